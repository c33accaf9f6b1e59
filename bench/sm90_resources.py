"""Registers, spills and SASS size of fwd_sm90 kernels, compiled offline with nvcc for sm_90a (no GPU).

  python bench/sm90_resources.py [--sass-dir DIR]

One line per kernel: the default config of each head dim and mask kind, a few pinned configs the tuner
searches, and the feature combinations that press on registers (dropout, softcap + sink, varlen, a
document mask). A change to fwd_sm90's kernel headers is checked here before it reaches a GPU.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attngen
from attngen import targets
from attngen.build.nvcc import check_plan, sass
from attngen.families import plan_spec

CASES = [
    *(dict(head_dim=d, mask=m) for d in (64, 96, 128, 256) for m in ("none", "causal")),
    dict(head_dim=128, mask="causal", gqa_ratio=4),
    dict(head_dim=128, mask="sliding_window(4095, 0)"),
    dict(head_dim=128, mask="causal", varlen=True),
    dict(head_dim=256, mask="causal", varlen=True),
    dict(head_dim=128, mask="causal", score_mod="softcap(50)", sink="sink"),
    dict(head_dim=256, mask="sliding_window(4095, 0)", score_mod="softcap(50)"),
    dict(head_dim=128, mask="causal", dropout_p=0.1),
    dict(head_dim=64, mask="causal", dropout_p=0.1),
    dict(head_dim=128, mask="doc[b, q_idx] == doc[b, kv_idx] and causal"),
    dict(head_dim=128, mask="none", config={"block_n": 192}),
    dict(head_dim=128, mask="causal", config={"schedule": "dynamic"}),
    dict(head_dim=128, mask="causal", config={"overlap": False}),
    dict(head_dim=64, mask="none", config={"consumers": 3, "schedule": "pairs"}),
    *(dict(head_dim=d, mask="none", config={"cluster": True, "schedule": "pairs"}) for d in (96, 128, 256)),
    dict(head_dim=128, mask="none", score_mod="softcap(50)", sink="sink",
         config={"cluster": True, "schedule": "pairs"}),
    dict(head_dim=128, mask="none", config={"cluster": True, "overlap": False}),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass-dir", type=Path, help="write each kernel's SASS here")
    args = parser.parse_args()
    target = targets.target("sm_90a")

    def build(case):
        spec = attngen.AttentionSpec(family="fwd_sm90", **case)
        plan = plan_spec(spec, target)
        cubin = args.sass_dir / f"{plan.name}.cubin" if args.sass_dir else None
        if cubin:
            args.sass_dir.mkdir(parents=True, exist_ok=True)
        report = check_plan(plan, keep_cubin=cubin)
        text = sass(cubin) if cubin else ""
        if cubin:
            cubin.with_suffix(".sass").write_text(text)
        return plan.name, report, text

    failures = 0
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, report, text in pool.map(build, CASES):
            kernel = report.kernels.get(name, report) if report.kernels else report
            spills = report.spill_bytes
            # ptxas's performance warnings: setmaxnreg ignored (C7508...), wgmma serialised (C7514)
            warned = [w for w in ("C7508", "C7510", "C7514", "C7515") if w in report.log]
            failures += spills > 0 or bool(warned)
            extra = f" sass {text.count(chr(10))} lines, HGMMA {text.count('HGMMA')}" if text else ""
            print(f"{name:70s} regs {report.registers:3d} stack {report.stack_frame_bytes:4d} "
                  f"spill {spills:4d}{extra}{' WARN ' + ','.join(warned) if warned else ''}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
