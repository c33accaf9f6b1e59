// ---- gemm.cuh: a consumer warpgroup's two GEMMs on wgmma, S = Q K^T and O += P V ----

namespace fa90 {

// Descriptors of a tile's k16 steps: the tile's own plus the step's byte offset in the 14-bit start
// address field (shared memory ends below 2^18 bytes, so the field never carries): one add per
// step, the tile's descriptor made once.
__device__ __forceinline__ u64 desc_at(u64 tile_desc, u32 offset) { return tile_desc + (offset >> 4); }

// S = Q K^T for this warpgroup's 64 rows: K-major operands, 32 bytes per k16 step within a chunk.
__device__ __forceinline__ void issue_qk(float (&s)[S_REGS], u32 q_rows, u32 k_tile) {
    const u64 a = smem_desc(q_rows, 16, 1024), b = smem_desc(k_tile, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DK; ++kk)  // the first step overwrites S
        wgmma_qk(s, desc_at(a, (kk / 4) * Q_CHUNK + (kk % 4) * 32), desc_at(b, (kk / 4) * KV_CHUNK + (kk % 4) * 32),
                 kk > 0);
    wgmma_commit();
}

// O += P V: V is the MN-major B operand; 16 keys are 2048 bytes, the head-dim chunks KV_CHUNK apart.
__device__ __forceinline__ void issue_pv(float (&o)[O_REGS], const u32 (&pf)[PK][4], u32 v_tile) {
    const u64 b = smem_desc(v_tile, KV_CHUNK, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < PK; ++kk) wgmma_pv(o, pf[kk], desc_at(b, kk * 2048));
    wgmma_commit();
}

}  // namespace fa90
