"""How fast this GPU's memory can be read, for the decode bars: a kernel that only streams bytes in
(16-byte loads past L1, several in flight per thread, a grid-stride loop, one word written per thread),
swept over CTAs per SM, threads and loads in flight, at the decode bench's K+V sizes. The best rate
per size is the read ceiling a decode kernel of that size could reach (it reads nothing else of note).
Sizes under ROTATE_BYTES rotate over enough copies of the data that consecutive launches never find
their bytes in L2 (50 MB on the H100), as the decode bench's graph step does.

    PYTHONPATH=. python bench/read_roofline.py [--sizes-mb 134,268,537,4295] [--reps 20]

One JSON line per (size, variant) and one per size with the best (TB/s = bytes / kernel time, CUDA
events around a CUDA graph of `reps` launches)."""
from __future__ import annotations

import argparse
import json
import math

ROTATE_BYTES = 256 * 10**6  # smaller sizes read one of ceil(ROTATE_BYTES / size) copies per launch

SOURCE = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ data, long long n, unsigned* __restrict__ sink) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x * UNROLL;
    for (long long i = (long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x; i < n; i += stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long j = i + (long long)u * blockDim.x;
            if (j < n) asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                    : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(data + j));
            else v[u] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    sink[(long long)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""


def positive_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"--{name}={text!r} is invalid; allowed: comma-separated positive integers")
    return values


def main() -> None:
    import cupy as cp

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", default="134,268,537,4295", help="MB read per call (the decode bench's K+V)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    sizes = positive_ints(args.sizes_mb, "sizes-mb")
    if args.reps < 1:
        raise SystemExit(f"--reps={args.reps} is invalid; allowed: a positive integer")
    device = cp.cuda.Device()
    sms = device.attributes["MultiProcessorCount"]
    kernels = {u: cp.RawKernel(f"#define UNROLL {u}\n" + SOURCE, "read_all") for u in (2, 4, 8)}
    print(json.dumps({"gpu": cp.cuda.runtime.getDeviceProperties(device.id)["name"].decode(), "sms": sms}))
    for mb in sizes:
        n = mb * 10**6 // 16
        copies = max(1, math.ceil(ROTATE_BYTES / (n * 16)))
        buffers = [cp.ones(n * 4, dtype=cp.uint32) for _ in range(copies)]
        best = None
        for unroll, kernel in kernels.items():
            for threads in (256, 512, 1024):
                for per_sm in (1, 2, 4, 8):
                    if threads * per_sm > 2048:
                        continue
                    grid = sms * per_sm
                    sink = cp.empty(grid * threads, dtype=cp.uint32)
                    def launch(i: int) -> None:
                        kernel((grid,), (threads,), (buffers[i % copies], cp.int64(n), sink))

                    launch(0)
                    stream = cp.cuda.Stream(non_blocking=True)
                    with stream:
                        stream.begin_capture()
                        for i in range(args.reps):
                            launch(i)
                        graph = stream.end_capture()
                    graph.launch(stream)
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    times = []
                    for _ in range(3):
                        start.record(stream)
                        graph.launch(stream)
                        end.record(stream)
                        end.synchronize()
                        times.append(cp.cuda.get_elapsed_time(start, end) / args.reps)
                    ms = min(times)
                    row = {"mb": mb, "copies": copies, "unroll": unroll, "threads": threads, "ctas_per_sm": per_sm,
                           "tbps": round(n * 16 / ms / 1e9, 4)}
                    print(json.dumps(row), flush=True)
                    if best is None or row["tbps"] > best["tbps"]:
                        best = row
        print(json.dumps({"best": best}), flush=True)
        del buffers


if __name__ == "__main__":
    main()
