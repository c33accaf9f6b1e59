"""One attngen forward at a benchmark shape, for Nsight Compute to profile (the last launch):
    ncu -k regex:fwd_sm90 -s 1 -c 1 python3 bench/ncu_target.py --seqlen 16384 --head-dim 128 --causal
Shapes follow attngen/bench.py: batch x seqlen = 16k tokens, hidden 2048."""

from __future__ import annotations

import argparse

import torch

import attngen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer key/value heads")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    batch, heads = max(1, 16384 // args.seqlen), 2048 // args.head_dim
    q = torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, args.seqlen, args.kv_heads or heads, args.head_dim, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    for _ in range(2):
        attngen.attention(q, k, v, mask="causal" if args.causal else None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
