// ---- flash_fwd_sm90.cuh: FlashAttention forward for Hopper (sm_90a) ----
// A CTA works through tiles (one query block of one (batch, query head) each), under one of
// three schedules (tile_of; docs/perf-notes.md: which wins where):
// - grid: one CTA per tile, each head's query blocks together (its K/V stay in L2) and longest
//   first (under a causal mask the last block sees the most keys); the hardware's block
//   scheduler hands out the next CTA as one finishes.
// - PAIRS: a persistent grid (one CTA per SM) dealt consecutive pairs of tiles round-robin, each
//   head's blocks zigzagging from both ends (longest, shortest, second longest, ...): under a
//   causal mask every pair holds about the same number of key blocks, so the static schedule
//   comes out balanced.
// - DYNAMIC: a persistent grid whose producer takes each next tile from a counter in global
//   memory (zeroed by the module's reset kernel before every launch), as the hardware scheduler
//   would. Tiles come in sections of heads whose K/V fit in L2 together, longest query blocks
//   first across a section's heads: balanced under any mask.
// Under every schedule the producer works out each tile (its place and key blocks) and hands it to
// the consumers through a shared-memory slot guarded by two mbarriers (TileSlot). Persistent grids
// load the next tiles' Q while the current one runs, and (CARRY) issue a tile's last P V together
// with the next tile's first S, its epilogue following once that P V is done. Warp specialisation:
// warpgroup 0 is the producer, one thread of which streams Q (Q_BUFFERS deep) and the K/V blocks
// through a NUM_STAGES-deep ring with TMA, completing on mbarriers; the ring runs on across tiles
// (LATE_CLAIM: a thread of its second warp claims the next tiles from the counter and loads their Q).
// Warpgroups 1..CONSUMERS each own 64 query rows: S = Q K^T on wgmma (both operands in shared
// memory), the online softmax in registers, O += P V on wgmma with P straight from registers.
// OVERLAP issues S of block j+1 together with the P V of block j, in one turn; PINGPONG makes the
// consumer warpgroups take turns issuing GEMMs, so one's softmax runs under the other's. A warpgroup
// whose rows all lie past the sequence's last skips the tile, keeping step (idle_tile). Key blocks
// the mask makes empty are never loaded; blocks it makes full are never masked per element.
// CLUSTER (2, PAIRS without a mask only): the two CTAs of a cluster run the two tiles of a pair
// side by side, on the same head and key blocks, and each loads half of every K/V block (every
// other 64-column chunk) into both CTAs' rings by TMA multicast: L2 serves each block once for
// two tiles. A stage is refilled once both CTAs' consumers have released it.
// The headers, in the order the template (fwd_sm90.cu.j2) pastes them: shapes.cuh (sizes from the plan),
// tiles.cuh (tile schedules, key blocks), trace.cuh (a development timeline), producer.cuh (TMA loads),
// gemm.cuh (wgmma), softmax.cuh (S to P), consumer.cuh (the consumer warpgroups), then this file: the
// kernel's body.
// The headers need, from the rendered template: struct FwdSm90Params, namespace cfg { HEAD_DIM, BLOCK_M, BLOCK_N,
// CONSUMERS, NUM_STAGES, Q_BUFFERS, GQA_RATIO, OVERLAP, PINGPONG, PAIRS, DYNAMIC, VARLEN, CLUSTER,
// SET_MAX_REGS, PRODUCER_REGS, CONSUMER_REGS, IS_BF16 }, namespace mask { Bounds, bounds, visible } (attngen/cuda/mask.cuh.j2),
// namespace score { MODIFIED, modify, finish_row } (attngen/cuda/score_mod.cuh.j2),
// and wgmma_qk (m64 x BLOCK_N, SS) / wgmma_pv (m64 x HEAD_DIM, RS); with ATTNGEN_DROPOUT, namespace dropout
// (attngen/cuda/philox.cuh) and p.rng.

namespace fa90 {

__device__ __forceinline__ void flash_fwd_sm90(const Params& p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ Pipeline pipe;
    // Swizzled tiles must start on 1024-byte boundaries: align the base (SMEM_BYTES has the slack).
    const u32 sQ = (smem_u32(smem_raw) + ALIGN - 1) & ~static_cast<u32>(ALIGN - 1);
    const u32 sK = sQ + Q_BUFFERS * Q_BYTES, sV = sK + NUM_STAGES * KV_BYTES;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int q = 0; q < Q_BUFFERS; ++q) {
            mbar_init(smem_u32(&pipe.q_full[q]), 1);
            mbar_init(smem_u32(&pipe.q_empty[q]), CONSUMERS);
        }
#pragma unroll
        for (int s = 0; s < NUM_STAGES; ++s) {
            mbar_init(smem_u32(&pipe.k_full[s]), 1);
            mbar_init(smem_u32(&pipe.v_full[s]), 1);
            mbar_init(smem_u32(&pipe.k_empty[s]), CONSUMERS * CLUSTER);
            mbar_init(smem_u32(&pipe.v_empty[s]), CONSUMERS * CLUSTER);
        }
        mbar_init(smem_u32(&pipe.tile_full), 1);
        mbar_init(smem_u32(&pipe.tile_empty), CONSUMERS * WG_THREADS);
        if constexpr (LATE_CLAIM) {
            mbar_init(smem_u32(&pipe.claim_asked), 1);
            mbar_init(smem_u32(&pipe.claim_done), 1);
        }
        mbar_init_fence();
    }
    // Under CLUSTER the other CTA's multicasts and releases reach these barriers: both inits first.
    if constexpr (CLUSTER > 1) cluster_sync();
    else __syncthreads();
    // Launched early behind the call's own kernel that zeroes the tile counter or builds the tile list
    // (family.py launches): the set-up above ran while that kernel did; nothing global is read or
    // written before it is done.
    pdl_wait();
    const int tiles = tile_count(p);
    const int wg = threadIdx.x / WG_THREADS;
    if (wg == 0) {
        if constexpr (SET_MAX_REGS) regs_dealloc<PRODUCER_REGS>();
        if (PRODUCER_WARP ? threadIdx.x < 32 : threadIdx.x == 0) produce(p, pipe, sQ, sK, sV, tiles);
        else if (LATE_CLAIM && threadIdx.x == 32) claim_tiles(p, pipe, sQ);
    } else {
        if constexpr (SET_MAX_REGS) regs_alloc<CONSUMER_REGS>();
        // The warpgroup through a shuffle: ptxas then holds it, and Q's wgmma descriptors made from it, in
        // uniform registers (from threadIdx alone, each wgmma moved them over from vector registers: 16 R2UR a
        // block at d128, 32 at d256). Not under CLUSTER, whose kernel measured 1.2% slower with it at ncu's
        // locked clock (docs/perf-notes.md "Every wgmma's Q descriptor in uniform registers").
        Consumer(p, pipe, sQ, sK, sV, CLUSTER > 1 ? wg - 1 : __shfl_sync(0xffffffffu, wg - 1, 0)).run(tiles);
    }
    // (CLUSTER: no barrier at exit; the producer's last waits keep this CTA until the other's releases.)
}

}  // namespace fa90
