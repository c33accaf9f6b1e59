// ---- producer.cuh: the pipeline's barriers and tile hand-over (Pipeline, TileSlot), and the producer
// warpgroup, which works out each tile, hands it to the consumers, and streams its Q and K/V blocks into
// shared memory with TMA ----

namespace fa90 {

// What the producer hands the consumers for each tile: its order position (past the last: no more
// work), place and key blocks. The producer works them out for its loads anyway, ahead of the
// consumers: they read them here at a tile boundary rather than repeat the arithmetic (and, under
// VARLEN, the tile list's global reads) between their GEMMs.
struct TileSlot {
    int t;
    Tile tile;
    Blocks blocks;
};

struct Pipeline {
    u64 q_full[Q_BUFFERS], q_empty[Q_BUFFERS];
    u64 k_full[NUM_STAGES], k_empty[NUM_STAGES], v_full[NUM_STAGES], v_empty[NUM_STAGES];
    // The next tile, handed from the producer to the consumers through `next` (TileSlot) once
    // tile_empty says every consumer thread has read the previous one. mbarriers, not named
    // barriers: their arrive releases the arriving thread's accesses, which racecheck follows (it
    // takes bar.arrive for no ordering and reported a named-barrier hand-over as a race).
    u64 tile_full, tile_empty;
    TileSlot next;
    // LATE_CLAIM: the producer asks the claim thread for its next tile (claim_asked) and reads the answer
    // from `claimed` once claim_done says it is there (claim_tiles).
    u64 claim_asked, claim_done;
    int claimed;
};

// gridDim.x read where it is used (asm volatile: not hoisted), so the producer's 24 registers do not
// hold it across the loop (ptxas spilled it there).
__device__ __forceinline__ int grid_size() {
    u32 n;
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
    return static_cast<int>(n);
}

// -- producer: one thread issues every load, tile after tile (DYNAMIC: its whole warp runs the loop,
// and lane 0 issues: warp-uniform values stay in uniform registers, where the producer's 24 or 32
// registers a thread cannot hold them all). CLUSTER keeps one thread, given 32 registers (family.py
// CLUSTER_REGISTERS): a whole warp cost 2-2.5% per clock there, as it does under PAIRS
// (docs/perf-notes.md "The clusters' lost 4%") ------------------------------------------------------
constexpr bool PRODUCER_WARP = DYNAMIC;
// DYNAMIC: the next tile is claimed CLAIM_LEAD blocks before a tile's last (produce) under LATE_CLAIM, as
// the tile's round begins otherwise. Late at d128 and up (varlen documents' end 6.2% -> 2.0% of the CTAs
// idle, causal + ALiBi -1.6 to -3.1%, document ids -0.8 to -1.7%); not at d64, whose causal 16k read +1.0
// to +3.7% with it and whose CTAs end level either way (docs/perf-notes.md "The next tile claimed late").
// The claim goes through claim_tiles' thread, off the producer's loads (varlen documents a further -1.5 to
// -3.0%, document ids -1.1 to -3.7%; docs/perf-notes.md "Who waits for the counter's answer").
constexpr bool LATE_CLAIM = DYNAMIC && HEAD_DIM >= 128;
constexpr int CLAIM_LEAD = 2;
constexpr int NO_TILE = 0x7fffffff;  // LATE_CLAIM: the claim thread's answer past the last tile

// Round j's Q (one thread) into buffer j % Q_BUFFERS, which the consumers free once that buffer's previous
// tile's output has been stored from it (q_empty).
__device__ __forceinline__ void load_q(const Params& p, Pipeline& pipe, u32 sQ, const Tile& tile, int j) {
    const int qb = j % Q_BUFFERS;
    const u32 q_full = smem_u32(&pipe.q_full[qb]);
    mbar_expect_tx(q_full, Q_BYTES);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
        tma_load(sQ + qb * Q_BYTES + c * Q_CHUNK, &p.tmap_q, q_full, c * 64, first_row(tile) + tile.m_block * BLOCK_M,
                 tile.head, tile.batch);
    trace(TRACE_PRODUCER, j, Q_ISSUED);
}
__device__ __forceinline__ u32 q_free(Pipeline& pipe, int j) { return smem_u32(&pipe.q_empty[j % Q_BUFFERS]); }
__device__ __forceinline__ u32 q_free_parity(int j) { return ((j / Q_BUFFERS) & 1) ^ 1; }

// LATE_CLAIM: one thread of the producer warpgroup's second warp claims the producer's next tiles from the
// counter and loads their Q. Under the kernel's load an atomic's answer takes about a K block's load time
// (2,000-3,000 clk): the producer warp, waiting for it in a register, held back its next K or V load wherever
// the wait sat (read after the claim's own loads: +3.6% a steady block on the varlen documents; a block
// later: +700 clk on each tile's K0), and testing for it there spilled the producer's 24 registers. The producer
// asks (claim_asked) and takes the answer at its round's end (claim_done, `claimed`); the next tile's Q is
// this thread's, loaded once its buffer frees (with one Q buffer, once this tile's output is stored: the
// producer, which loaded it at its next round's start there, spilled at d256 with the thread beside it).
// (The tile count is read again here: passed in, it was live into both branches. The producer is told the end
// as NO_TILE, so its loop holds no tile count either.)
__device__ __forceinline__ void claim_tiles(const Params& p, Pipeline& pipe, u32 sQ) {
    const int tiles = tile_count(p);
    if (tile_index(0, tiles) >= tiles) return;  // no first tile: the producer asks nothing
#pragma unroll 1
    for (int j = 0;; ++j) {
        mbar_wait(smem_u32(&pipe.claim_asked), j & 1);
        const int t = atomicAdd(p.tile_counter, 1) + grid_size();
        pipe.claimed = t < tiles ? t : NO_TILE;
        mbar_arrive(smem_u32(&pipe.claim_done));  // releases the store above to the producer's wait
        if (t >= tiles) return;  // the producer's last question
        mbar_wait(q_free(pipe, j + 1), q_free_parity(j + 1));  // with one Q buffer: once this tile's output is out
        load_q(p, pipe, sQ, tile_of(p, t), j + 1);
    }
}
__device__ __forceinline__ void produce(const Params& p, Pipeline& pipe, u32 sQ, u32 sK, u32 sV, int tiles) {
    const bool leader = threadIdx.x == 0;
    if (leader) {
        tma_prefetch(&p.tmap_q);
        tma_prefetch(&p.tmap_k);
        tma_prefetch(&p.tmap_v);
    }
    auto issue_q = [&](const Tile& tile, int j) {
        if (leader) load_q(p, pipe, sQ, tile, j);
    };
    // One K or V block into a stage: every chunk, or under CLUSTER this CTA's half of them into both
    // CTAs (each CTA's barrier expects the whole stage's bytes, half of them from the other CTA).
    // (The rank is read where it is used, as grid_size: not held in one of the producer's registers.)
    auto load_kv = [&](u32 dst, const TensorMap* map, u32 full, int key, int kv_head, int batch) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            if constexpr (CLUSTER > 1) {
                if (c % CLUSTER == static_cast<int>(cluster_rank())) tma_load_multicast(dst + c * KV_CHUNK, map, full, c * 64, key, kv_head, batch, 0x3);
            } else {
                tma_load(dst + c * KV_CHUNK, map, full, c * 64, key, kv_head, batch);
            }
        }
    };
    int g = 0;  // K/V blocks loaded so far: the ring's position runs on across tiles
    int t = tile_index(0, tiles);
    if (LATE_CLAIM && t >= tiles) t = NO_TILE;
    bool q_ahead = false;  // round j's Q was issued during round j - 1 (LATE_CLAIM: by claim_tiles, from round 1 on)
#pragma unroll 1
    for (int j = 0;; ++j) {
        if (LATE_CLAIM ? t == NO_TILE : t >= tiles) {  // the end, once the consumers have read the last tile
            mbar_wait(smem_u32(&pipe.tile_empty), (j & 1) ^ 1);
            if (leader) {
                pipe.next.t = t;
                mbar_arrive(smem_u32(&pipe.tile_full));
            }
            break;
        }
        const Tile tile = tile_of(p, t);
        const Blocks b = kv_blocks(p, tile);
        mbar_wait(smem_u32(&pipe.tile_empty), (j & 1) ^ 1);  // the consumers have read the previous tile
        if (leader) {
            pipe.next = {t, tile, b};
            mbar_arrive(smem_u32(&pipe.tile_full));
        }
        // LATE_CLAIM: the next tile is asked for as block claim_at's stage frees, CLAIM_LEAD blocks before
        // this tile's last (about CLAIM_LEAD + NUM_STAGES blocks before its consumers end it), and the
        // answer taken at the round's end (claim_tiles, which loads its Q). Claimed as a tile began, a CTA
        // held its next tile a whole tile ahead: one that began a long tile as the last section started had
        // taken the next long one already.
        // Otherwise (DYNAMIC) claimed here, as the round begins; the static schedules claim nothing (tile_index).
        const int claim_at = LATE_CLAIM ? max(0, b.count() - CLAIM_LEAD) : 0;
        int fetched = 0, next = 0;
        auto claim_next = [&]() {
            if constexpr (LATE_CLAIM) {
                if (leader) mbar_arrive(smem_u32(&pipe.claim_asked));
            } else if constexpr (DYNAMIC) {
                if (leader) fetched = atomicAdd(p.tile_counter, 1);
            }
        };
        auto resolve_next = [&]() {
            if constexpr (LATE_CLAIM) {
                mbar_wait(smem_u32(&pipe.claim_done), j & 1);
                next = pipe.claimed;
                __syncwarp();  // every lane has read it before lane 0 can ask again (the slot's next answer)
            } else if constexpr (DYNAMIC) {
                next = __shfl_sync(0xffffffffu, fetched, 0) + grid_size();  // %nctaid here: no register
            } else {
                next = tile_index(j + 1, tiles);
            }
        };
        if constexpr (!LATE_CLAIM) claim_next();
        if (LATE_CLAIM ? j == 0 : !q_ahead) {
            mbar_wait(q_free(pipe, j), q_free_parity(j));
            issue_q(tile, j);
        }
        // The next tile's Q goes out a tile ahead, as soon as its buffer is free: tested (never waited
        // on) after each block's loads once the next tile is known, so a short tile's successor does not
        // wait for its Q behind this tile's last K/V (docs/perf-notes.md "The next tile's Q a tile ahead";
        // under LATE_CLAIM claim_tiles loads it). With one Q buffer the next Q waits for this tile's
        // output, at the next round.
        bool next_q = false;
        auto try_next_q = [&]() {
            if (Q_BUFFERS < 2 || LATE_CLAIM || next_q || next >= tiles) return;
            bool free = leader && mbar_test(q_free(pipe, j + 1), q_free_parity(j + 1));
            if constexpr (PRODUCER_WARP) free = __shfl_sync(0xffffffffu, free, 0);  // the warp agrees
            if (!free) return;
            issue_q(tile_of(p, next), j + 1);  // worked out again at the next round (no Tile kept: stack)
            next_q = true;
        };
        const int kv_head = tile.head / GQA_RATIO;  // query head h reads kv head h // ratio
#pragma unroll 1
        for (int it = 0; it < b.count(); ++it, ++g) {
            const int stage = g % NUM_STAGES;
            const u32 phase = (g / NUM_STAGES) & 1;
            const int n0 = b.key0(it);
            // Wait until every consumer has released this stage's previous block.
            mbar_wait(smem_u32(&pipe.k_empty[stage]), phase ^ 1);
            if (leader && it == 0) trace(TRACE_PRODUCER, j, K0_STAGE_FREE);
            if (LATE_CLAIM && it == claim_at) claim_next();
            if (leader) {
                const u32 k_full = smem_u32(&pipe.k_full[stage]);
                mbar_expect_tx(k_full, KV_BYTES);
                load_kv(sK + stage * KV_BYTES, &p.tmap_k, k_full, first_key(tile) + n0, kv_head, tile.batch);
                if (it == 0) trace(TRACE_PRODUCER, j, K0_ISSUED);
            }
            mbar_wait(smem_u32(&pipe.v_empty[stage]), phase ^ 1);
            if (leader) {
                const u32 v_full = smem_u32(&pipe.v_full[stage]);
                mbar_expect_tx(v_full, KV_BYTES);
                load_kv(sV + stage * KV_BYTES, &p.tmap_v, v_full, first_key(tile) + n0, kv_head, tile.batch);
                if (it == 0) trace(TRACE_PRODUCER, j, V0_ISSUED);
                if (it == b.count() - 1) trace(TRACE_PRODUCER, j, LAST_V_ISSUED);
            }
            if (!LATE_CLAIM && it == claim_at) resolve_next();
            try_next_q();
        }
        if constexpr (LATE_CLAIM) {
            if (b.count() == 0) claim_next();  // a tile without key blocks
            resolve_next();
        } else {
            if (b.count() == 0) resolve_next();
            try_next_q();
            q_ahead = next_q;
        }
        t = next;
    }
    // CLUSTER: the other CTA's consumers release this CTA's stages until they finish, so this CTA (its
    // barriers) must outlive their last arrivals. Wait here for the release of every stage's last block,
    // by both CTAs, rather than with a cluster barrier at exit, where the idle warps waited out the
    // whole kernel (2% per clock). The multicasts into this CTA completed before its consumers used them.
    if constexpr (CLUSTER > 1) {
#pragma unroll 1
        for (int k = 0; k < NUM_STAGES; ++k, ++g) {
            mbar_wait(smem_u32(&pipe.k_empty[g % NUM_STAGES]), ((g / NUM_STAGES) & 1) ^ 1);
            mbar_wait(smem_u32(&pipe.v_empty[g % NUM_STAGES]), ((g / NUM_STAGES) & 1) ^ 1);
        }
    }
}

}  // namespace fa90
