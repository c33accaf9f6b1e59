"""How many clusters of two CTAs run at once on this GPU, at fwd_sm90's shared memory per CTA?

A persistent fwd_sm90 grid of one CTA per SM on clusters of two ran 1.8x slower than without clusters
(docs/perf-notes.md "Clusters of two CTAs"). If fewer clusters fit at once than half the SMs, the rest
of the grid waits for a first wave to finish. This launches CTAS CTAs of 384 threads (clusters of two,
the kernel's dynamic shared memory), each spinning SPIN_NS, and reports when each started and on which
SM: the CTAs that start before the first one ends are what ran at once. Also the driver's own answer
(cuOccupancyMaxActiveClusters).

    PYTHONPATH=. python bench/cluster_probe.py [--smem 231424] [--ctas 132]
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(384, 1) __cluster_dims__(2, 1, 1)
probe(unsigned long long* start, int* sm, long long spin_ns) {
    extern __shared__ unsigned char smem[];
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    if (threadIdx.x == 0) {
        int id;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
        start[blockIdx.x] = t0;
        sm[blockIdx.x] = id;
        smem[0] = 1;
    }
    unsigned long long t;
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smem", type=int, default=231424)
    parser.add_argument("--ctas", type=int, default=132)
    parser.add_argument("--spin-us", type=float, default=200.0)
    args = parser.parse_args()
    module = cp.RawModule(code=SOURCE, options=("-arch=sm_90a",), backend="nvrtc")
    kernel = module.get_function("probe")
    kernel.max_dynamic_shared_size_bytes = args.smem
    start = cp.zeros(args.ctas, dtype=cp.uint64)
    sm = cp.zeros(args.ctas, dtype=cp.int32)
    spin = int(args.spin_us * 1000)
    for _ in range(2):
        kernel((args.ctas,), (384,), (start, sm, np.int64(spin)), shared_mem=args.smem)
    cp.cuda.runtime.deviceSynchronize()
    t = cp.asnumpy(start).astype(np.int64)
    t -= t.min()
    waves = np.floor(t / spin).astype(int)
    print(f"smem {args.smem} B, {args.ctas} CTAs in clusters of 2: CTAs per start wave {np.bincount(waves).tolist()}")
    print(f"distinct SMs {len(set(cp.asnumpy(sm).tolist()))}")
    try:
        from cuda.bindings import driver

        attrs = driver.CUlaunchAttribute()
        attrs.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs.value.clusterDim.x, attrs.value.clusterDim.y, attrs.value.clusterDim.z = 2, 1, 1
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = args.ctas, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = 384, 1, 1
        config.sharedMemBytes = args.smem
        config.attrs = [attrs]
        config.numAttrs = 1
        function = driver.CUfunction(kernel.kernel.ptr)  # RawKernel.kernel: the loaded function
        err, n = driver.cuOccupancyMaxActiveClusters(function, config)
        print(f"cuOccupancyMaxActiveClusters: {err} {n}")
    except Exception as exc:  # the probe's timing answer stands on its own
        print(f"cuOccupancyMaxActiveClusters not run: {exc!r}")


if __name__ == "__main__":
    main()
