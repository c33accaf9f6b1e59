"""One attngen.decode call at a decode bench shape, for Nsight Compute to profile (the last launches):
    ncu -k regex:decode -s 2 -c 1 python3 bench/decode_ncu_target.py --batch 8 --seqlen 8192 --layout p64-shuffled
Layouts as bench/decode_paged_probe.py (contiguous, p64-identity, p64-shuffled, p64-grouped, p256-shuffled)."""

from __future__ import annotations

import argparse

import torch

import attngen
from attngen.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q
from bench.decode_paged_probe import arrange


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--layout", default="p64-shuffled")
    parser.add_argument("--loads", default="cp_async", choices=("cp_async", "tma"))
    args = parser.parse_args()
    q = torch.randn(args.batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(args.batch, args.seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    lens = torch.full((args.batch,), args.seqlen, dtype=torch.int32, device="cuda")
    table = None
    if args.layout != "contiguous":
        k, v, table = arrange(k, v, args.layout, torch.Generator().manual_seed(0))
    spec = attngen.AttentionSpec(head_dim=HEAD_DIM, gqa_ratio=HEADS_Q // HEADS_KV, family="decode_sm80",
                                 config={"loads": args.loads})
    for _ in range(3):
        attngen.decode(q, k, v, lens, page_table=table, spec=spec)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
