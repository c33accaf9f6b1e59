"""Does `attngen bench`'s fixed order of implementations move its ratios?

`attngen bench` (attngen/bench.py time_beside) times its five implementations in turn, in the same
order every round, so each always starts at the clock its predecessor's power draw left behind; the
H100 runs these kernels at its 700 W cap, where the clock follows power within tens of milliseconds
(docs/perf-notes.md "Power, not only clocks"). This times the bench's own implementations for a few
cells both ways, in one process: the bench's order every round, and the order reversed on every
other round; rounds of the two methods alternate. One line per cell and method: attngen's ms and its
ratio to cuDNN's.

    PYTHONPATH=. python bench/order_probe.py [--methods 3] [d128-none-8k d128-none-16k ...]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from attngen.bench import HIDDEN, REPEATS, ROUNDS, TOKENS, WARMUP, _implementations, input_sets, time_ms

CELLS = {  # name -> (head_dim, causal, seqlen)
    "d128-none-8k": (128, False, 8192),
    "d128-none-16k": (128, False, 16384),
    "d128-causal-8k": (128, True, 8192),
    "d64-causal-2k": (64, True, 2048),
}


def timed_rounds(impls: dict, sets, alternate: bool) -> dict[str, float]:
    """time_beside's method (ROUNDS runs of REPEATS // ROUNDS timings each, the median of the runs'
    medians), with the order reversed on odd rounds when `alternate`."""
    runs: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    for r in range(ROUNDS):
        for name in (names[::-1] if alternate and r % 2 else names):
            runs[name].append(time_ms(impls[name], sets, warmup=0, repeats=REPEATS // ROUNDS))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", type=int, default=3, help="rounds of the two methods, alternating")
    parser.add_argument("cells", nargs="*", default=list(CELLS))
    args = parser.parse_args()
    with torch.no_grad():
        for cell in args.cells:
            d, causal, seqlen = CELLS[cell]
            batch, heads = TOKENS // seqlen, HIDDEN // d
            sets = input_sets(batch, seqlen, heads, d)
            impls, _, _ = _implementations(d, causal, seqlen)
            for fn in impls.values():  # compile and warm up
                time_ms(fn, sets, warmup=WARMUP, repeats=1)
            ratios: dict[str, list[float]] = {"fixed": [], "alternating": []}
            for m in range(args.methods):
                for method in ("fixed", "alternating") if m % 2 == 0 else ("alternating", "fixed"):
                    ms = timed_rounds(impls, sets, method == "alternating")
                    ratios[method].append(ms["sdpa_cudnn"] / ms["attngen"])
                    print(f"{cell:16s} {method:12s} attngen {ms['attngen']:.3f} ms  cuDNN {ms['sdpa_cudnn']:.3f} ms  "
                          f"ratio {ratios[method][-1]:.3f}", flush=True)
            print(f"{cell:16s} median ratio: fixed {statistics.median(ratios['fixed']):.3f}  "
                  f"alternating {statistics.median(ratios['alternating']):.3f}", flush=True)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
