"""How long a kernel launched early waits after the kernel before it ends, against flags: the decode combine's
tail ("The graph step and the combine's tail" in docs/perf-notes.md: ~2.8 us from the split kernel's end to the
combine's) split into its parts on a stand-in of the two kernels, no attngen kernel involved.

The producer stands in for the split kernel (1 x 32768: 8 kv heads x 32 splits = 256 CTAs of 128 threads, each
spinning `--spin` cycles, with a per-CTA skew, then writing a 128-float partial for each of its 4 rows), the
consumer for the combine (32 CTAs, one per row: reads its head's 32 partials, writes 128 floats). Ways for the
consumer to learn that its partials are there:
  ordinary    an ordinary launch: it starts once the producer grid has finished
  grid        launched early (programmatic), griddepcontrol.wait: the grid's completion and memory flush
  flag        launched early; each producer CTA, after a barrier, counts itself in on its head's counter
              (thread 0: red.release.gpu, which ptxas makes MEMBAR.GPU + RED, as __threadfence + an
              atomicAdd whose value is unused), the consumer's thread 0 polls it (ld.acquire.gpu), and the
              consumer waits for the producer grid only at its end (so the next pair's producer does)
Each pair is captured in a CUDA graph of `--pairs` pairs back to back (the counters' targets grow with the
pair; they are zeroed before each replay); GPU time per pair, median of replays.

    PYTHONPATH=. python bench/pdl_release_probe.py [--spin 20000] [--pairs 40]"""
from __future__ import annotations

import argparse
import ctypes
import statistics

import cupy
import torch
from cuda.bindings import driver

HEADS, SPLITS, ROWS_PER_HEAD, D = 8, 32, 4, 128
SOURCE = r"""
struct Params {
    float* part;            // [split][row][D]
    unsigned* counter;      // [head]
    float* out;             // [row][D]
    unsigned target;        // the head's count once this pair's producer is done
    int mode;               // 0: ordinary / grid (griddepcontrol.wait), 1: flag
    long long spin;
};
constexpr int HEADS = %(HEADS)d, SPLITS = %(SPLITS)d, ROWS_PER_HEAD = %(ROWS_PER_HEAD)d, D = %(D)d;

extern "C" __global__ void __launch_bounds__(128) producer(const Params p) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous pair's consumer read the partials
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int head = blockIdx.x %% HEADS, split = blockIdx.x / HEADS;
    const long long t0 = clock64(), spin = p.spin + (blockIdx.x * 37 %% 64) * (p.spin / 256);
    while (clock64() - t0 < spin) {}
    for (int i = threadIdx.x; i < ROWS_PER_HEAD * D; i += blockDim.x) {
        const int row = head * ROWS_PER_HEAD + i / D;
        p.part[((size_t)split * HEADS * ROWS_PER_HEAD + row) * D + i %% D] = (float)(split + 1);
    }
    if (p.mode == 0) return;
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%%0], 1;" :: "l"(p.counter + head) : "memory");
}

extern "C" __global__ void __launch_bounds__(128) consumer(const Params p) {
    const int row = blockIdx.x, head = row / ROWS_PER_HEAD;
    if (p.mode == 0) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        if (threadIdx.x == 0) {
            unsigned seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %%0, [%%1];" : "=r"(seen) : "l"(p.counter + head) : "memory");
            } while (seen < p.target);
        }
        __syncthreads();
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    float acc = 0.f;
    for (int s = 0; s < SPLITS; ++s) acc += __ldcg(p.part + ((size_t)s * HEADS * ROWS_PER_HEAD + row) * D + threadIdx.x);
    p.out[row * D + threadIdx.x] = acc;
    // Flags: the grid ends only with the producer's (its last CTAs may still be exiting), so the next pair's
    // producer, which waits for this grid, also waits for that one.
    if (p.mode != 0) asm volatile("griddepcontrol.wait;" ::: "memory");
}
""" % dict(HEADS=HEADS, SPLITS=SPLITS, ROWS_PER_HEAD=ROWS_PER_HEAD, D=D)


class Params(ctypes.Structure):
    _fields_ = [("part", ctypes.c_uint64), ("counter", ctypes.c_uint64), ("out", ctypes.c_uint64),
                ("target", ctypes.c_uint32), ("mode", ctypes.c_int32), ("spin", ctypes.c_int64)]


def launch(function, grid: int, params: Params, stream: int, early: bool, keep: list) -> None:
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    keep += [params, argv]
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 128, 1, 1
    config.sharedMemBytes = 0
    config.hStream = driver.CUstream(stream)
    if early:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attr]
        config.numAttrs = 1
    (err,) = driver.cuLaunchKernelEx(config, driver.CUfunction(function), ctypes.addressof(argv), 0)
    assert err == driver.CUresult.CUDA_SUCCESS, err


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spin", type=int, default=20000, help="producer cycles per CTA (plus up to 25%% skew)")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    producer, consumer = (module.get_function(n).kernel.ptr for n in ("producer", "consumer"))
    part = torch.zeros(SPLITS * HEADS * ROWS_PER_HEAD * D, device="cuda")
    out = torch.zeros(HEADS * ROWS_PER_HEAD * D, device="cuda")
    counter = torch.zeros(HEADS, dtype=torch.int32, device="cuda")
    print(torch.cuda.get_device_name(0), f"spin {args.spin} cycles, {args.pairs} pairs a graph", flush=True)
    for name, mode, early in (("ordinary", 0, False), ("grid", 0, True), ("flag", 1, True)):
        keep: list = []
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for i in range(args.pairs):
                p = Params(part.data_ptr(), counter.data_ptr(), out.data_ptr(), SPLITS * (i + 1), mode, args.spin)
                launch(producer, HEADS * SPLITS, p, stream.cuda_stream, early=True, keep=keep)
                launch(consumer, HEADS * ROWS_PER_HEAD, p, stream.cuda_stream, early=early, keep=keep)
        times = []
        for _ in range(args.replays):
            counter.zero_()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.pairs)
        assert torch.allclose(out, torch.full_like(out, SPLITS * (SPLITS + 1) / 2)), name
        print(f"{name:9} {statistics.median(times):7.2f} us per pair (min {min(times):.2f})", flush=True)


if __name__ == "__main__":
    main()
