"""prefix_lm(plen[b]) with closed-form bounds (attngen/maskc/bands.py: an `or` of two upper ends, a length read at
the batch row) against the same mask through its block table and element predicate (spelt `plen[b] + h - h`, which
is no band: what every prefix took before), beside the built-in causal, on each forward family and head dim, timed
side by side in one process (attngen/bench.py time_beside): B=1, 16k tokens, bf16, 16 heads, a prefix of 4096.
Useful TFLOP/s count visible pairs only.

    PYTHONPATH=. python bench/prefix_probe.py [--out DIR]

Prints one JSON line per case and a table last; with --out, JSON there."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEQLEN = 16384
HEADS = 16
PREFIX = 4096
MASKS = {"closed": "prefix_lm(plen[b])", "table": "kv_idx < plen[b] + h - h or causal"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    import attngen
    from attngen import mask_table
    from attngen.bench import time_probe_case
    from attngen.spec import AttentionSpec

    plen = torch.tensor([PREFIX], dtype=torch.int32, device="cuda")
    causal_pairs = SEQLEN * (SEQLEN + 1) // 2
    # rows q < PREFIX see PREFIX keys instead of q + 1
    pairs = {"causal": causal_pairs, "prefix": causal_pairs + PREFIX * (PREFIX - 1) // 2}
    rows = []
    for family, head_dim in [("fwd_sm90", 64), ("fwd_sm90", 128), ("fwd_sm80", 64), ("fwd_sm80", 128)]:
        q, k, v = (torch.randn(1, SEQLEN, HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        specs = {"causal": AttentionSpec(head_dim=head_dim, dtype="bf16", mask="causal", family=family)}
        specs |= {name: AttentionSpec(head_dim=head_dim, dtype="bf16", mask=m, family=family) for name, m in MASKS.items()}

        def call(spec):
            reads = {"plen": plen} if "plen" in spec.mask else None
            return lambda: attngen.attention(q, k, v, spec, inputs=reads)

        if family == "fwd_sm80":  # causal's tile pinned: the A100's default (sm_90a keeps the smaller one at d128)
            tile = attngen.compile(specs["causal"]).plan.config
            pinned = {f: getattr(tile, f) for f in ("block_m", "block_n", "num_warps", "num_stages")}
            specs["closed_causal_tile"] = AttentionSpec(head_dim=head_dim, dtype="bf16", mask=MASKS["closed"],
                                                        family=family, config=pinned)
        fns = {name: call(spec) for name, spec in specs.items()}
        times = time_probe_case(fns, f"{family} d{head_dim}", settle=not rows)
        flops = {n: (pairs["causal"] if n == "causal" else pairs["prefix"]) * 4 * head_dim * HEADS for n in times}
        row = {"family": family, "head_dim": head_dim, "ms": times,
               "tflops": {n: flops[n] / ms / 1e9 for n, ms in times.items()},
               "configs": {n: attngen.compile(s).plan.config.label() for n, s in specs.items()},
               "tables": {n: mask_table.for_problem(s.problem) is not None for n, s in specs.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_properties(0).name
    print(f"\n{gpu}: 16k, prefix {PREFIX}, useful TFLOP/s")
    for r in rows:
        t = r["tflops"]
        print(f"{r['family']} d{r['head_dim']}: causal {t.get('causal', 0):6.1f}  closed {t.get('closed', 0):6.1f} "
              f"({r['configs']['closed']})  table {t.get('table', 0):6.1f} ({r['configs']['table']})  "
              f"closed/table {t.get('closed', 0) / max(t.get('table', 1e-9), 1e-9):.3f}"
              + (f"  closed on causal's tile {t['closed_causal_tile']:6.1f}" if "closed_causal_tile" in t else ""))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix-probe.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
