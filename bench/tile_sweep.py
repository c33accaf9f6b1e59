"""Time several tile configurations of one spec family against SDPA flash in one process.

A development tool for choosing defaults (attngen/tile_defaults.yaml) until `attngen tune`
exists. Usage: python bench/tile_sweep.py --head-dim 128 --seqlen 2048 --seqlen 8192 \
                 --tile m128n64w8s2 --tile m128n64w4s2
"""

from __future__ import annotations

import argparse
import re

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen.bench import HIDDEN, TOKENS, _input_sets, fwd_flops, time_ms
from attngen.spec import AttentionSpec


def parse_tile(text: str) -> dict:
    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", text)
    if not m:
        raise SystemExit(f"--tile {text!r}: expected the form m128n64w4s2")
    return dict(zip(("block_m", "block_n", "num_warps", "num_stages"), map(int, m.groups())))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, action="append", required=True)
    ap.add_argument("--seqlen", type=int, action="append", required=True)
    ap.add_argument("--tile", action="append", required=True)
    ap.add_argument("--mask", action="append", default=None)
    args = ap.parse_args()
    for d in args.head_dim:
        for mask in args.mask or ["none", "causal"]:
            for s in args.seqlen:
                b, h = TOKENS // s, HIDDEN // d
                sets = _input_sets(b, s, h, d)
                flops = fwd_flops(b, h, s, d, mask == "causal")

                def fa2(q, k, v):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                              v.transpose(1, 2), is_causal=mask == "causal")

                ref = flops / time_ms(fa2, sets) / 1e9
                cells = []
                for tile in args.tile:
                    try:
                        spec = AttentionSpec(head_dim=d, dtype="bf16", mask=mask, **parse_tile(tile))
                        kernel = attngen.compile(spec)
                        tf = flops / time_ms(lambda q, k, v: kernel(q, k, v), sets) / 1e9
                        cells.append(f"{tile} {tf:6.1f} ({tf / ref:.2f}x)")
                    except Exception as exc:  # a config that fails is reported, not fatal
                        cells.append(f"{tile} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                print(f"d{d} {mask:6s} s{s:5d} FA2 {ref:6.1f} | " + " | ".join(cells), flush=True)
                del sets
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
