"""Where the host time of one tiny attngen call goes: cProfile over many calls of the front door
and of a compiled kernel, top functions by own time. Run on a GPU machine:
    PYTHONPATH=. python3 bench/overhead_profile.py [--calls N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import attngen
from attngen.spec import AttentionSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kernel = attngen.compile(AttentionSpec(head_dim=64, mask="causal"))
    cases = {"attention": lambda: attngen.attention(q, k, v, mask="causal"), "kernel": lambda: kernel(q, k, v)}
    with torch.no_grad():
        for name, fn in cases.items():
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
            print(f"{name}: {(time.perf_counter() - start) / args.calls * 1e6:.1f} us per call unprofiled")
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                fn()
            profile.disable()
            torch.cuda.synchronize()
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
