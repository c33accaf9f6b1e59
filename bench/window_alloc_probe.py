"""Does the sliding-window kernel's time depend on where its tensors lie? The masks bench's window
4096 case swung 0.743 -> 0.813 ms between processes on the same code (docs/perf-notes.md, issue 10's
window bar) while the built-in causal stayed within 0.3%. One process: q, k, v (the bench's shape)
allocated again behind a padding of random size, several times; per allocation the window's and the
causal's times and the tensors' addresses. One JSON line per allocation.

    PYTHONPATH=. python bench/window_alloc_probe.py [--trials 8]
"""
import argparse
import json

import torch

import attngen
from attngen.bench_masks import HEAD_DIM, HEADS, SEQLEN, WINDOW, _time_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    fraction = sum(min(i + 1, WINDOW) for i in range(SEQLEN)) / (SEQLEN * (SEQLEN + 1) // 2)
    gen = torch.Generator().manual_seed(0)
    keep = []
    with torch.no_grad():
        for trial in range(args.trials):
            pad_mb = int(torch.randint(1, 512, (1,), generator=gen))
            keep.append(torch.empty(pad_mb << 20, dtype=torch.uint8, device="cuda"))
            q, k, v = (torch.randn(1, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            keep.append((q, k, v))
            window = _time_ms(lambda: attngen.attention(q, k, v, mask=f"sliding_window({WINDOW - 1}, 0)"))
            causal = _time_ms(lambda: attngen.attention(q, k, v, mask="causal"))
            window_again = _time_ms(lambda: attngen.attention(q, k, v, mask=f"sliding_window({WINDOW - 1}, 0)"))
            print(json.dumps({"trial": trial, "pad_mb": pad_mb, "q": hex(q.data_ptr()), "k": hex(k.data_ptr()),
                              "v": hex(v.data_ptr()), "window_ms": round(window, 4),
                              "window_again_ms": round(window_again, 4), "causal_ms": round(causal, 4),
                              "vs_fraction_of_causal": round(min(window, window_again) / (fraction * causal), 4)}),
                  flush=True)


if __name__ == "__main__":
    main()
