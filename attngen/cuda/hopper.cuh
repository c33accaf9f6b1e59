// ---- hopper.cuh: thin wrappers over the Hopper instructions the sm_90a kernels use ----
// Tensor Memory Accelerator loads and stores completing on mbarriers, warpgroup MMA (wgmma)
// fences, register reallocation and named barriers. docs/hopper-facts.md has the encodings.
typedef unsigned long long u64;

// CUtensorMap: 128 opaque bytes the host encodes (cuTensorMapEncodeTiled); it travels inside the
// __grid_constant__ parameter struct, and the instructions take its generic address.
struct alignas(64) TensorMap { u64 opaque[16]; };

// -- mbarrier: a phase completes when its arrivals and expected transaction bytes are all in --
__device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}
// Make the initialised barriers visible to the async proxy (TMA) before anyone uses them.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` the TMA will deliver in this phase.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so
// waiting for parity 1 returns at once: producers start on the "previous" phase of empty slots.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// Whether the phase of parity `parity` has completed, without waiting.
__device__ __forceinline__ bool mbar_test(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

// -- TMA: 4-d tiles (head_dim, seq, head, batch) between global memory and shared memory --
__device__ __forceinline__ void tma_prefetch(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
// A box of `map` at these coordinates into L2 only: a hint (no barrier, no shared memory; a box out of
// the tensor's bounds is not fetched), so that a later tma_load of it finds the bytes in L2.
__device__ __forceinline__ void tma_prefetch_l2(const TensorMap* map, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n"
                 ::"l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// The same tile into shared memory at `dst` of every CTA in `cta_mask` of the cluster, each copy
// completing bytes on the mbarrier at `bar`'s offset in that CTA: one L2 read for all of them.
__device__ __forceinline__ void tma_load_multicast(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3,
                                                   u16 cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
        ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(cta_mask)
        : "memory");
}
// Rows past the tensor's end are not written: the map's bounds clip the store.
__device__ __forceinline__ void tma_store(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(reinterpret_cast<u64>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Shared memory may be reused (or the CTA may exit) only once the stores have read it.
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Ordinary shared-memory stores become visible to the async proxy (TMA, wgmma) after this.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// -- clusters: CTAs of one cluster run at once on one GPC and reach each other's shared memory --
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// One arrival on the mbarrier at `bar`'s offset in CTA `cta` of the cluster, with the instruction's
// default release at CTA scope, as CUTLASS's cluster pipelines arrive: an explicit .release.cluster
// made fwd_sm90's clusters 1.8x slower (docs/perf-notes.md "Clusters of two CTAs").
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(cta) : "memory");
}
// Every thread of every CTA of the cluster: accesses before it (barrier inits, remote arrivals)
// happen before any thread of the cluster goes past it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// -- programmatic dependent launch: a kernel launched `early` (attngen/runtime/launch.py) starts
// while the one before it finishes, and waits here for that one's writes. No-ops before sm_90 and
// for a kernel launched the ordinary way. --
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the next kernel (if launched early) be scheduled once every CTA of this one has said so.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// -- wgmma: warpgroup matrix multiply-accumulate, asynchronous --
// Order register writes (O rescale, P) before the wgmma that reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keep the compiler from moving reads of an accumulator above the wait that completes it.
template <int R>
__device__ __forceinline__ void fence_regs(float (&r)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start, leading and stride byte offsets >> 4.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 leading_bytes, u32 stride_bytes) {
    return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(leading_bytes >> 4) << 16) |
           (static_cast<u64>(stride_bytes >> 4) << 32) | (1ull << 62);
}

// -- warpgroup roles --
template <int REGS>
__device__ __forceinline__ void regs_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void regs_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
