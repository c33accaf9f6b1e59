"""Time several configs of one kernel family against SDPA flash in one process.

A development tool for choosing a family's defaults (e.g. attngen/families/fwd_sm80/tile_defaults.yaml);
`attngen tune` is the way to pick configs for a workload. Usage:
  python bench/tile_sweep.py --head-dim 128 --seqlen 2048 --seqlen 8192 --config m128n64w8s2 --config m128n64w4s2
(--family fwd_sm80 by default; a config is named by its family's label, as `attngen check --configs` prints it).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen import families, targets
from attngen.bench import HIDDEN, TOKENS, input_sets, time_ms
from attngen.flops import forward_flops, tflops
from attngen.spec import AttentionSpec
from attngen.tune.space import spec_for


def find_config(family, problem, target, label: str):
    """The family's config whose label is `label` (SystemExit listing a few when there is none)."""
    configs = family.configs(problem, target)
    for config in configs:
        if config.label() == label:
            return config
    examples = ", ".join(c.label() for c in configs[:4])
    raise SystemExit(f"--config {label!r} is not a config of family {family.name}; allowed: its labels, "
                     f"e.g. {examples}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, action="append", required=True)
    ap.add_argument("--seqlen", type=int, action="append", required=True)
    ap.add_argument("--family", default=next(iter(families.FAMILIES)), choices=list(families.FAMILIES))
    ap.add_argument("--config", action="append", required=True, help="a config label, e.g. m128n64w4s2")
    ap.add_argument("--mask", action="append", default=None)
    args = ap.parse_args()
    family = families.get_family(args.family)
    target = targets.device_target(torch.cuda.current_device())
    for d in args.head_dim:
        for mask in args.mask or ["none", "causal"]:
            problem = AttentionSpec(head_dim=d, dtype="bf16", mask=mask).problem
            configs = [find_config(family, problem, target, label) for label in args.config]  # all, before timing
            for s in args.seqlen:
                b, h = TOKENS // s, HIDDEN // d
                sets = input_sets(b, s, h, d)
                flops = forward_flops(b, h, s, s, d, mask == "causal")

                def fa2(q, k, v):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                              v.transpose(1, 2), is_causal=mask == "causal")

                ref = tflops(flops, time_ms(fa2, sets))
                cells = []
                for config in configs:
                    try:
                        kernel = attngen.compile(spec_for(problem, family.name, config))
                        tf = tflops(flops, time_ms(lambda q, k, v: kernel(q, k, v), sets))
                        cells.append(f"{config.label()} {tf:6.1f} ({tf / ref:.2f}x)")
                    except Exception as exc:  # a config that fails is reported, not fatal
                        cells.append(f"{config.label()} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                print(f"d{d} {mask:6s} s{s:5d} FA2 {ref:6.1f} | " + " | ".join(cells), flush=True)
                del sets
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
