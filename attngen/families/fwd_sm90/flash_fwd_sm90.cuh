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
// through a NUM_STAGES-deep ring with TMA, completing on mbarriers; the ring runs on across tiles.
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
// Needs, from the rendered template: struct FwdSm90Params, namespace cfg { HEAD_DIM, BLOCK_M, BLOCK_N,
// CONSUMERS, NUM_STAGES, Q_BUFFERS, GQA_RATIO, OVERLAP, PINGPONG, PAIRS, DYNAMIC, VARLEN, CLUSTER,
// SET_MAX_REGS, PRODUCER_REGS, CONSUMER_REGS, IS_BF16 }, namespace mask { Bounds, bounds, visible } (attngen/cuda/mask.cuh.j2),
// namespace score { MODIFIED, modify, finish_row } (attngen/cuda/score_mod.cuh.j2),
// and wgmma_qk (m64 x BLOCK_N, SS) / wgmma_pv (m64 x HEAD_DIM, RS); with ATTNGEN_DROPOUT, namespace dropout
// (attngen/cuda/philox.cuh) and p.rng.

namespace fa90 {

using namespace cfg;
using Params = FwdSm90Params;

#define NEG_INF (-__int_as_float(0x7f800000))
constexpr int WG_THREADS = 128;
constexpr int THREADS = (CONSUMERS + 1) * WG_THREADS;
static_assert(BLOCK_M == 64 * CONSUMERS, "query rows per CTA: 64 per consumer warpgroup");
constexpr int CHUNKS = (HEAD_DIM + 63) / 64;     // 64-column (128-byte) chunks of a row: one TMA box each
constexpr int Q_CHUNK = BLOCK_M * 128;           // bytes of one column chunk of the Q tile
constexpr int KV_CHUNK = BLOCK_N * 128;
constexpr int Q_BYTES = CHUNKS * Q_CHUNK;
constexpr int KV_BYTES = CHUNKS * KV_CHUNK;      // one K or one V stage (TMA fills out-of-bounds with zeros)
constexpr int ALIGN = 1024;                      // a 128-byte swizzle atom: 8 rows of 128 bytes
constexpr int SMEM_BYTES = ALIGN + Q_BUFFERS * Q_BYTES + 2 * NUM_STAGES * KV_BYTES;  // family.py smem_bytes() must agree
constexpr int S_REGS = BLOCK_N / 2;              // fp32 scores per thread: the m64 x BLOCK_N accumulator
constexpr int O_REGS = HEAD_DIM / 2;
constexpr int DK = HEAD_DIM / 16;                // k16 steps of Q K^T
constexpr int PK = BLOCK_N / 16;                 // k16 steps of P V
constexpr int PINGPONG_BARRIER = 1;              // named barriers 1..CONSUMERS: whose turn to issue GEMMs
constexpr int STORE_BARRIER = 1 + CONSUMERS;     // named barriers after those: one per warpgroup's epilogue

static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256 && HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "wgmma shapes");
static_assert(Q_CHUNK % ALIGN == 0 && KV_CHUNK % ALIGN == 0, "every tile starts on a swizzle-atom boundary");
static_assert(CLUSTER == 1 || (CLUSTER == 2 && PAIRS && !VARLEN && CHUNKS % 2 == 0),
              "a cluster of two CTAs: pairs of tiles, the K/V chunks split evenly between them");


// Tile t of the order. grid and PAIRS: (batch, head) pairs one after another (the query heads of
// one kv head together). Within a pair, grid: the query blocks longest first (M-1, M-2, ...);
// PAIRS: zigzag (M-1, 0, M-2, 1, ...) over an even count, so tiles 2u and 2u+1 are a pair of the
// same head whose key blocks add up to about the same number for every u. An odd count gets a
// phantom block M (past Sq: nothing to load or store) paired with block 0. DYNAMIC: sections of
// p.section_heads (batch, head) pairs (a multiple of GQA_RATIO, so a kv head's query heads share
// one), and within a section block M-1 of every head, then block M-2, ...
// VARLEN (packed sequences): the list varlen_tiles.cuh built holds each tile's sequence and query
// block; row0/key0 place the sequence in the packed tensors, sq/sk are its rows and keys, and every
// position the kernel computes with is the sequence's own. Otherwise row0 = key0 = 0, sq = Sq, sk = Sk.
struct Tile {
    int m_block, head, batch;
    int row0, key0, sq, sk;
};

// The tile's sequence, read through these so a kernel without VARLEN keeps no registers for it.
__device__ __forceinline__ int seq_q(const Params& p, const Tile& tile) { return VARLEN ? tile.sq : p.Sq; }
__device__ __forceinline__ int seq_k(const Params& p, const Tile& tile) { return VARLEN ? tile.sk : p.Sk; }
__device__ __forceinline__ int first_row(const Tile& tile) { return VARLEN ? tile.row0 : 0; }
__device__ __forceinline__ int first_key(const Tile& tile) { return VARLEN ? tile.key0 : 0; }

#ifdef ATTNGEN_VARLEN
// The workspace varlen_tiles.cuh fills (ints): [0] the schedule's counter, [1] tiles in the list,
// then the segment table (int4 {first row, rows, first key, keys}, num_seqs + 2), then the list
// (int2 {segment, query block}).
constexpr int VARLEN_HEADER = 4;
__device__ __forceinline__ int4* segments(const Params& p) {
    return reinterpret_cast<int4*>(p.tile_counter + VARLEN_HEADER);
}
__device__ __forceinline__ int2* tile_list(const Params& p) {
    return reinterpret_cast<int2*>(segments(p) + p.num_seqs + 2);
}
// Tile t: as the dynamic schedule's sections (tile_of), with the list's entries (the longest first)
// in place of query blocks: sections of p.section_heads query heads whose K/V stay in L2 together
// while their tiles run (family.py makes them long enough to end level), within a section entry
// after entry, the section's heads side by side.
__device__ __forceinline__ Tile varlen_tile(const Params& p, int t) {
    const int per_section = p.tile_counter[1] * p.section_heads;
    const int section = t / per_section, r = t - section * per_section;
    const int heads = min(p.section_heads, p.Hq - section * p.section_heads);  // the last may be short
    const int e = r / heads, head = section * p.section_heads + (r - e * heads);
    const int2 entry = tile_list(p)[e];
    const int4 seg = segments(p)[entry.x];
    return {entry.y, head, 0, seg.x, seg.z, seg.y, seg.w};
}
__device__ __forceinline__ int varlen_tiles(const Params& p) { return p.tile_counter[1] * p.Hq; }
#else
__device__ __forceinline__ Tile varlen_tile(const Params&, int) { return {}; }
__device__ __forceinline__ int varlen_tiles(const Params&) { return 0; }
#endif

// A development timeline (bench/tile_timeline.py defines ATTNGEN_TRACE): per CTA, consumer warpgroup
// and tile, the SM clock at TRACE_EVENTS points of the tile, its key-block count and the SM.
#ifdef ATTNGEN_TRACE
constexpr int TRACE_CTAS = 1024, TRACE_TILES = 32, TRACE_EVENTS = 16;
__device__ long long attngen_trace[TRACE_CTAS][3][TRACE_TILES][TRACE_EVENTS];  // warpgroups 0, 1; 2: the producer
// The clock once every score is computed (the stamp waits for them).
template <int N>
__device__ __forceinline__ long long fence_clock(const float (&s)[N]) {
    float x = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) x += s[i];
    long long c;
    asm volatile("add.f32 %1, %1, 0f00000000;\n\tmov.u64 %0, %%clock64;\n" : "=l"(c), "+f"(x));
    return c;
}
__device__ __forceinline__ int smid() {
    int id;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
    return id;
}
__device__ __forceinline__ void trace(int wg, int j, int event, long long value = -1) {
    if (threadIdx.x % WG_THREADS == 0 && blockIdx.x < TRACE_CTAS && wg < 3 && j < TRACE_TILES)
        attngen_trace[blockIdx.x][wg][j][event] = value < 0 ? clock64() : value;
}
#else
__device__ __forceinline__ void trace(int, int, int, long long = -1) {}
__device__ __forceinline__ int smid() { return 0; }
template <int N>
__device__ __forceinline__ long long fence_clock(const float (&)[N]) { return 0; }
#endif
enum TraceEvent { TILE_WAIT, TILE_READY, Q_READY, FIRST_SOFTMAX, LAST_PV, STORED, KEY_BLOCKS, SM, K0_READY, TURN0,
                  S0_READY, Q_ISSUED, K0_ISSUED, V0_ISSUED, S0_MASKED };
constexpr int TRACE_PRODUCER = 2;

__device__ __forceinline__ int blocks_per_head(const Params& p) {
    return PAIRS ? (p.m_blocks + 1) & ~1 : p.m_blocks;
}

__device__ __forceinline__ Tile tile_of(const Params& p, int t) {
    if constexpr (VARLEN) return varlen_tile(p, t);
    if constexpr (DYNAMIC) {
        const int per_section = p.section_heads * p.m_blocks;
        const int section = t / per_section, r = t - section * per_section;
        const int heads = min(p.section_heads, p.Hq * p.batch - section * p.section_heads);  // the last may be short
        const int bh = section * p.section_heads + r % heads;
        return {p.m_blocks - 1 - r / heads, bh % p.Hq, bh / p.Hq, 0, 0, p.Sq, p.Sk};
    }
    const int per_head = blocks_per_head(p);
    const int bh = t / per_head, r = t - bh * per_head;
    const int m_block = !PAIRS ? per_head - 1 - r : (r & 1) ? r / 2 : per_head - 1 - r / 2;
    return {m_block, bh % p.Hq, bh / p.Hq, 0, 0, p.Sq, p.Sk};
}

// The order position of this CTA's j-th tile under a static schedule (grid, PAIRS); the first one
// past the tiles ends its work. PAIRS with more tiles than CTAs: pair u = j / 2 of this CTA is pair
// blockIdx.x + u * gridDim.x. (DYNAMIC: only the first tile is blockIdx.x; the counter hands out
// the rest from gridDim.x on.)
__device__ __forceinline__ int tile_index(int j, int tiles) {
    // CLUSTER: round j of the cluster's two CTAs (consecutive ranks) is pair j * gridDim.x / 2 +
    // cluster, a tile each; tiles come an even count per head, so a pair never straddles heads.
    if (CLUSTER > 1) {
        const int t = j * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x);
        return t < tiles ? t : 0x7fffffff;
    }
    if (PAIRS && static_cast<int>(gridDim.x) < tiles)
        return 2 * ((j >> 1) * static_cast<int>(gridDim.x) + blockIdx.x) + (j & 1);
    return j == 0 ? static_cast<int>(blockIdx.x) : 0x7fffffff;
}

// The key blocks one CTA visits, from the last to the first so partially masked blocks come
// first; [full_lo, full_hi) is visible to every row of the CTA. Under mask::LISTED a tile whose span
// has holes walks its list from the block table instead (list set), each entry flagged full or not.
struct Blocks {
    int n_begin, n_end, full_lo, full_hi;
    const int* list;  // the listed walk: (n_block << 1) | full, last first; nullptr: the span
    __device__ __forceinline__ bool listed() const { return mask::LISTED && list != nullptr; }
    __device__ __forceinline__ int count() const { return n_end - n_begin; }
    __device__ __forceinline__ int key0(int it) const {
        return (listed() ? list[it] >> 1 : n_end - 1 - it) * BLOCK_N;
    }
    // Whether the table classified the block full (masked then only for keys past Sk).
    __device__ __forceinline__ bool full_block(int it) const {
        if (listed()) return list[it] & 1;
        const int n0 = key0(it);
        return n0 >= full_lo && n0 < full_hi;
    }
    __device__ __forceinline__ bool needs_mask(int it) const {
        const int n0 = key0(it);
        if (listed()) return !((list[it] & 1) && n0 + BLOCK_N <= full_hi);  // a ragged last block is masked
        return !(n0 >= full_lo && n0 + BLOCK_N <= full_hi);
    }
};

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
};

__device__ __forceinline__ Blocks kv_blocks(const Params& p, const Tile& tile) {
    // A phantom block past the last row has no key blocks; under CLUSTER its CTA still loads its half
    // of the pair's blocks, those of the head's last block. Its consumers idle through them under
    // OVERLAP (idle_tile); serial_tile computes them on Q's zero-filled rows, never stored.
    const int m0 = CLUSTER > 1 ? min(tile.m_block, p.m_blocks - 1) * BLOCK_M : tile.m_block * BLOCK_M;
    const int m1 = min(m0 + BLOCK_M, seq_q(p, tile));
    if (m0 >= seq_q(p, tile)) return {0, 0, 0, 0, nullptr};
    const mask::Bounds mb = mask::bounds(m0, m1, seq_q(p, tile), seq_k(p, tile), tile.batch, tile.head, p);
    if (mask::LISTED && mb.kv_begin < 0)  // {-1, count, 0, 0}: holes in the span, walk the list
        return {0, mb.kv_end, 0, seq_k(p, tile), mask::key_blocks(m0, p.Sq, p.Sk, tile.batch, tile.head, p)};
    Blocks b;
    b.n_begin = mb.kv_begin / BLOCK_N;
#ifdef ATTNGEN_FAULT_DROP_LAST_PARTIAL_KV_TILE
    b.n_end = mb.kv_end > mb.kv_begin ? mb.kv_end / BLOCK_N : b.n_begin;  // injected fault: floor drops a partial block
#else
    b.n_end = mb.kv_end > mb.kv_begin ? (mb.kv_end + BLOCK_N - 1) / BLOCK_N : b.n_begin;
#endif
    b.full_lo = mb.full_begin;
    b.full_hi = min(mb.full_end, seq_k(p, tile));  // a ragged last block is always masked
    return b;
}

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
__device__ __forceinline__ void produce(const Params& p, Pipeline& pipe, u32 sQ, u32 sK, u32 sV, int tiles) {
    const bool leader = threadIdx.x == 0;
    if (leader) {
        tma_prefetch(&p.tmap_q);
        tma_prefetch(&p.tmap_k);
        tma_prefetch(&p.tmap_v);
    }
    // Round j's Q into buffer j % Q_BUFFERS, which the consumers free once that buffer's previous
    // tile's output has been stored from it.
    auto load_q = [&](const Tile& tile, int j) {
        if (!leader) return;
        const int qb = j % Q_BUFFERS;
        const u32 q_full = smem_u32(&pipe.q_full[qb]);
        mbar_expect_tx(q_full, Q_BYTES);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
            tma_load(sQ + qb * Q_BYTES + c * Q_CHUNK, &p.tmap_q, q_full, c * 64, first_row(tile) + tile.m_block * BLOCK_M,
                     tile.head, tile.batch);
        trace(TRACE_PRODUCER, j, Q_ISSUED);
    };
    auto q_free = [&](int j) { return smem_u32(&pipe.q_empty[j % Q_BUFFERS]); };
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
    auto q_free_parity = [](int j) { return ((j / Q_BUFFERS) & 1) ^ 1; };
    int g = 0;  // K/V blocks loaded so far: the ring's position runs on across tiles
    int t = tile_index(0, tiles);
    bool q_ahead = false;  // round j's Q was issued during round j - 1
#pragma unroll 1
    for (int j = 0;; ++j) {
        if (t >= tiles) {  // the end, once the consumers have read the last tile
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
        int next;
        if constexpr (DYNAMIC) {
            int fetched = 0;
            if (leader) fetched = atomicAdd(p.tile_counter, 1);  // its latency hides under this tile's loads
            next = __shfl_sync(0xffffffffu, fetched, 0) + grid_size();  // read here: not held in a register
        } else {
            next = tile_index(j + 1, tiles);
        }
        if (!q_ahead) {
            mbar_wait(q_free(j), q_free_parity(j));
            load_q(tile, j);
        }
        // The next tile's Q goes out a tile ahead, as soon as its buffer is free: tested (never waited
        // on) after each block's loads, so a short tile's successor does not wait for its Q behind
        // this tile's last K/V (docs/perf-notes.md "The next tile's Q a tile ahead"). With one Q
        // buffer the next Q waits for this tile's output, at the next round.
        bool next_q = false;
        auto try_next_q = [&]() {
            if (Q_BUFFERS < 2 || next_q || next >= tiles) return;
            bool free = leader && mbar_test(q_free(j + 1), q_free_parity(j + 1));
            if constexpr (PRODUCER_WARP) free = __shfl_sync(0xffffffffu, free, 0);  // the warp agrees
            if (!free) return;
            load_q(tile_of(p, next), j + 1);  // worked out again at the next round (no Tile kept: stack)
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
            }
            try_next_q();
        }
        try_next_q();  // a tile without key blocks
        q_ahead = next_q;
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

// -- consumer pieces ---------------------------------------------------------------------------------
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

// Accumulator element i of this thread: row +8 when bit 1 of i is set, column 8 (i / 4) + 2 (lane % 4) + (i % 2).
__device__ __forceinline__ void apply_mask(float (&s)[S_REGS], int row0, int n0, bool full_block, const Params& p,
                                           const Tile& tile, int lane) {
    const int k0 = n0 + 2 * (lane % 4), sq = seq_q(p, tile), sk = seq_k(p, tile);
    if constexpr (mask::ROW_INTERVAL) {
        // Each of this thread's two rows sees keys [lo, hi), taken relative to k0 so that every
        // element compares its compile-time column offset: two compares and a select, no branch.
        int lo[2], hi[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int2 keys = mask::row_keys(row0 + 8 * h, sq, sk, tile.batch, tile.head, p);
            lo[h] = keys.x - k0;
            hi[h] = keys.y - k0;  // <= Sk - k0: keys past Sk are masked too
        }
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const int h = (i >> 1) & 1, c = 8 * (i >> 2) + (i & 1);
            s[i] = c >= lo[h] && c < hi[h] ? s[i] : NEG_INF;
        }
        (void)full_block;
    } else {
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const int q = row0 + 8 * ((i >> 1) & 1), k = k0 + 8 * (i >> 2) + (i & 1);
            // Rows past Sq are never stored; an input is read only in bounds.
            if (!mask::shown_in_bounds(q, k, sq, sk, tile.batch, tile.head, full_block, p)) s[i] = NEG_INF;
        }
    }
}

// Scores as the softmax takes them: modified (a score modifier sees softmax_scale * q.k and
// leaves scores the softmax scales by log2(e)), then masked where the block needs it.
__device__ __forceinline__ void prepare_scores(float (&s)[S_REGS], int row0, const Blocks& b, int it, const Params& p,
                                               const Tile& tile, int lane) {
    if constexpr (score::MODIFIED) {
        const int k0 = b.key0(it) + 2 * (lane % 4), sq = seq_q(p, tile), sk = seq_k(p, tile);
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const int q = row0 + 8 * ((i >> 1) & 1), k = k0 + 8 * (i >> 2) + (i & 1);
            if (q < sq && k < sk)  // in bounds for the modifier's runtime inputs
                s[i] = score::modify(s[i] * p.scale, q, k, sq, sk, tile.batch, tile.head, p);
        }
    }
    if (b.needs_mask(it)) apply_mask(s, row0, b.key0(it), b.full_block(it), p, tile, lane);
}

// What takes a score to the log2 domain: softmax_scale * log2(e), or log2(e) once modified.
__device__ __forceinline__ float score_log2(const Params& p) {
    return score::MODIFIED ? 1.4426950408889634f : p.scale_log2;
}

// Under SPECULATE, a row's reference (row_max) moves only when a block's max passes it by more than
// RESCALE_SLACK (log2 units); until then the block's exps are taken against the old reference and may
// reach 2^RESCALE_SLACK = 256 (far inside fp16 and bf16), and O is not rescaled. Row sums, O and
// the LSE all stay relative to the one reference, so the result is the same up to rounding.
constexpr float RESCALE_SLACK = 8.f;

// Whether the overlapped loop takes a block's exps before its max (speculative_softmax): with PINGPONG,
// where the softmax lies between a warpgroup's turns (+3-7%; d256 without pingpong measured 4% slower).
// Not under a score modifier: a positional bias (ALiBi's, say) can raise the max by more than
// RESCALE_SLACK at every block, and each such block would take its exps twice; those kernels find the
// max first (softmax_step). docs/perf-notes.md "Exponentials against the reference already held".
constexpr bool SPECULATE = PINGPONG && !score::MODIFIED;

// The largest of this thread's scores of row h (unscaled; quad_max makes it the row's).
__device__ __forceinline__ float thread_max(const float (&s)[S_REGS], int h) {
    float mx = NEG_INF;
#pragma unroll
    for (int c = 0; c < S_REGS / 4; ++c) mx = fmaxf(mx, fmaxf(s[4 * c + 2 * h], s[4 * c + 2 * h + 1]));
    return mx;
}

// Online softmax in the log2 domain, in place: S becomes exp2(scaled S - reference), the reference
// being the running max; alpha rescales what was accumulated under the old reference. A row whose
// reference is still -inf uses 0 instead, so exp2 gives 0 rather than NaN. (A tile's first block, and
// every block unless SPECULATE; the overlapped loop's other blocks then: speculative_softmax.)
__device__ __forceinline__ void softmax_step(float (&s)[S_REGS], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], float scale_log2) {
    float ref[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float mx = fmaxf(row_max[h], quad_max(thread_max(s, h)) * scale_log2);  // scale > 0: scaled scores' max
        ref[h] = mx == NEG_INF ? 0.f : mx;
        alpha[h] = fast_exp2(row_max[h] - ref[h]);
        row_max[h] = mx;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        s[i] = fast_exp2(fmaf(s[i], scale_log2, -ref[(i >> 1) & 1]));
        sum[(i >> 1) & 1] += s[i];  // per-thread partials in fp32; reduced across the quad at the end
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * alpha[h] + sum[h];
}

__device__ __forceinline__ void rescale(float (&o)[O_REGS], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[(i >> 1) & 1];
}

// P's operand registers (the accumulator layout of two n8 column groups is the A-operand layout of
// one k16 step) as exp2(scaled S - reference), and the rows' per-thread sums of the unrounded exps.
__device__ __forceinline__ void exponentiate(u32 (&pf)[PK][4], float (&sum)[2], const float (&s)[S_REGS],
                                             const float (&ref)[2], float scale_log2) {
#pragma unroll
    for (int kk = 0; kk < PK; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = 8 * kk + 2 * j, h = j & 1;  // s[i] and s[i + 1]: one row, adjacent columns
            const float lo = fast_exp2(fmaf(s[i], scale_log2, -ref[h]));
            const float hi = fast_exp2(fmaf(s[i + 1], scale_log2, -ref[h]));
            sum[h] += lo;
            sum[h] += hi;
            pf[kk][j] = pack2<IS_BF16>(lo, hi);
        }
    }
}

// The overlapped loop's softmax of every block after a tile's first, straight into P's operand: the
// exponentials are taken against the reference the earlier blocks left, not after this block's max
// (a chain of maxes and two shuffles that held back the first exp by 50-100 instructions). The max is
// found beside them; a row whose max passes its reference by more than RESCALE_SLACK moves it, and its
// warp takes the exponentials again from S, which is left as it was, and rescales O. So the result
// never depends on the guess: an exponential that overflowed is taken again. Rare once a row's first
// blocks have set its reference (docs/perf-notes.md "Exponentials
// against the reference already held"). O's P V must be complete (pf and O are written).
__device__ __forceinline__ void speculative_softmax(u32 (&pf)[PK][4], float (&o)[O_REGS], const float (&s)[S_REGS],
                                                   float (&row_max)[2], float (&row_sum)[2], float scale_log2) {
    float ref[2], mx[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        ref[h] = row_max[h] == NEG_INF ? 0.f : row_max[h];
        mx[h] = thread_max(s, h);
    }
    exponentiate(pf, sum, s, ref, scale_log2);
    bool move[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = quad_max(mx[h]) * scale_log2;  // scale > 0: the max of scaled scores
        move[h] = mx[h] > row_max[h] + RESCALE_SLACK;  // from -inf: any finite max moves it
    }
    if (__any_sync(0xffffffffu, move[0] || move[1])) {
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float next = move[h] ? mx[h] : row_max[h];
            ref[h] = next == NEG_INF ? 0.f : next;
            alpha[h] = move[h] ? fast_exp2(row_max[h] - ref[h]) : 1.f;
            row_max[h] = next;
            row_sum[h] *= alpha[h];
            sum[h] = 0.f;
        }
        exponentiate(pf, sum, s, ref, scale_log2);
        rescale(o, alpha);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] += sum[h];
}

// As exponentiate lays P out: two n8 column groups of the accumulator are one k16 step's A operand.
__device__ __forceinline__ void to_operand(u32 (&pf)[PK][4], const float (&s)[S_REGS]) {
#pragma unroll
    for (int kk = 0; kk < PK; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) pf[kk][j] = pack2<IS_BF16>(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
    }
}

#ifdef ATTNGEN_DROPOUT
// Dropout of a warp's P operand (16 rows from row_base, the key block from n0), after the row sums:
// the LSE is of the undropped P (attngen/cuda/philox.cuh).
__device__ __forceinline__ void drop(u32 (&pf)[PK][4], const dropout::Rng& rng, const Tile& tile, int row_base, int n0) {
    dropout::drop_p<1, BLOCK_N / 8, BLOCK_N % 32 == 0>(reinterpret_cast<u32 (&)[1][PK][4]>(pf), rng, tile.batch, tile.head,
                                                       row_base, n0);
}
#endif

// Pingpong: a warpgroup issues its GEMMs only after the previous one has issued its own. Every turn
// ends with a hand-over, the last warpgroup's last one to the first, which takes it at exit
// (Consumer::run): no named barrier is left half-arrived, whatever the tile count.
struct Turns {
    int wg;
    __device__ __forceinline__ void begin() const {
        if constexpr (PINGPONG) named_sync(PINGPONG_BARRIER + wg, 2 * WG_THREADS);
    }
    __device__ __forceinline__ void end() const {
        if constexpr (PINGPONG) named_arrive(PINGPONG_BARRIER + (wg + 1) % CONSUMERS, 2 * WG_THREADS);
    }
    // A turn with nothing to issue, taken so every warpgroup's turn count stays the same.
    __device__ __forceinline__ void pass() const {
        begin();
        end();
    }
};

// VARLEN: this warpgroup's staged output rows (first: the first one's position in its sequence)
// copied to out 16 bytes at a time, up to the sequence's last row; a TMA store would write the next
// sequence's rows too. The tile's rows lie in [0, Sq) (varlen_tiles.cuh keeps segments inside q).
__device__ __forceinline__ void store_rows(const Params& p, u32 q_rows, const Tile& tile, int first, int tid) {
#ifdef ATTNGEN_VARLEN
    constexpr int UNITS = HEAD_DIM / 8;  // 16-byte units of a row; unit c sits in column chunk c / 8
    const int rows = min(64, seq_q(p, tile) - first);
#pragma unroll 1
    for (int u = tid; u < rows * UNITS; u += WG_THREADS) {
        const int r = u / UNITS, c = u % UNITS;
        const u32 addr = q_rows + (c / 8) * Q_CHUNK + r * 128 + (((c % 8) ^ (r % 8)) * 16);
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
        const i64 row = first_row(tile) + first + r;
        *reinterpret_cast<uint4*>(p.o + row * p.o_s1 + (i64)tile.head * p.o_s2 + c * 8) = v;
    }
#else
    (void)p; (void)q_rows; (void)tile; (void)first; (void)tid;
#endif
}

// CARRY: a tile's last P V is issued together with the next tile's first S, whose softmax runs
// under it; the tile's epilogue follows once that P V is done, and its Q buffer goes back to the
// producer a block later. The next tile's Q must load while this tile's output is staged in its own
// Q buffer: it needs a second one (d256 has room for one only). Under pingpong the epilogue still
// holds up both warpgroups' turns (docs/perf-notes.md "Across tile boundaries").
constexpr bool CARRY = OVERLAP && Q_BUFFERS >= 2;

// A tile whose scores are all in, waiting for its last P V (under CARRY, issued with the next tile's
// first S) and its epilogue.
struct Finished {
    Tile tile;
    int qb;        // its Q buffer, where the output is staged
    int last;      // ring position of its last V block
    int j;         // its round (the timeline's index)
    float inv[2];  // what normalises this thread's two rows (0 for a row without a visible key)
};

// One consumer warpgroup: 64 rows of each of its CTA's tiles, tile after tile, and the state one
// tile hands the next (the pending last P V, the output still in a Q buffer).
struct Consumer {
    const Params& p;
    Pipeline& pipe;
    u32 sQ, sK, sV;
    int wg, tid, warp, lane;
    Turns turns;
    float o[O_REGS], s[S_REGS], row_max[2], row_sum[2], alpha[2];
    u32 pf[PK][4];
#ifdef ATTNGEN_DROPOUT
    dropout::Rng rng;
#endif
    int g;            // ring position of the current tile's first K/V block
    Finished done;    // the last finished tile
    bool pending;     // whether done's last P V and epilogue are still to come
    int stored;       // Q buffers (bits) holding output the TMA store may still be reading

    __device__ __forceinline__ Consumer(const Params& p_, Pipeline& pipe_, u32 sQ_, u32 sK_, u32 sV_, int wg_)
        : p(p_), pipe(pipe_), sQ(sQ_), sK(sK_), sV(sV_), wg(wg_), tid(threadIdx.x % WG_THREADS),
          warp(tid / 32), lane(tid % 32), turns{wg_}, g(0), pending(false), stored(0) {
#ifdef ATTNGEN_DROPOUT
        rng = dropout::load(p.rng);
#endif
    }

    __device__ __forceinline__ u32 q_rows(int qb) const { return sQ + qb * Q_BYTES + wg * 64 * 128; }
    __device__ __forceinline__ u32 k_at(int pos) const { return sK + (pos % NUM_STAGES) * KV_BYTES; }
    __device__ __forceinline__ u32 v_at(int pos) const { return sV + (pos % NUM_STAGES) * KV_BYTES; }
    __device__ __forceinline__ void wait_k(int pos) {
        mbar_wait(smem_u32(&pipe.k_full[pos % NUM_STAGES]), (pos / NUM_STAGES) & 1);
    }
    __device__ __forceinline__ void wait_v(int pos) {
        mbar_wait(smem_u32(&pipe.v_full[pos % NUM_STAGES]), (pos / NUM_STAGES) & 1);
    }
    // One thread per warpgroup releases a stage: the wgmma that read it has completed for all four warps.
    // CLUSTER: to both CTAs' producers, each of which refills half of it in both.
    __device__ __forceinline__ void release(u32 empty) {
        if (tid != 0) return;
        if constexpr (CLUSTER > 1) {
#pragma unroll
            for (u32 cta = 0; cta < CLUSTER; ++cta) mbar_arrive_cluster(empty, cta);
        } else {
            mbar_arrive(empty);
        }
    }
    __device__ __forceinline__ void release_k(int pos) { release(smem_u32(&pipe.k_empty[pos % NUM_STAGES])); }
    __device__ __forceinline__ void release_v(int pos) { release(smem_u32(&pipe.v_empty[pos % NUM_STAGES])); }
    // This thread's rows of a tile: row0 and row0 + 8.
    __device__ __forceinline__ int thread_row0(const Tile& tile) const {
        return tile.m_block * BLOCK_M + wg * 64 + warp * 16 + lane / 4;
    }

    __device__ __forceinline__ void start_rows() {
        row_max[0] = row_max[1] = NEG_INF;
        row_sum[0] = row_sum[1] = 0.f;
    }
    __device__ __forceinline__ void zero_o() {
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    }

    // Block `it` of the tile, once its S is in: modifier, mask, online softmax (alpha: the rescale O needs).
    __device__ __forceinline__ void softmax_block(const Blocks& b, int it, const Tile& tile, int row0) {
        prepare_scores(s, row0, b, it, p, tile, lane);
        softmax_step(s, row_max, row_sum, alpha, score_log2(p));
    }
    // S of the block becomes the P operand of its P V (dropout applied after the row sums).
    __device__ __forceinline__ void make_p(const Blocks& b, int it, const Tile& tile, int row0) {
        to_operand(pf, s);
        drop_p(b, it, tile, row0);
    }
    __device__ __forceinline__ void drop_p(const Blocks& b, int it, const Tile& tile, int row0) {
#ifdef ATTNGEN_DROPOUT
        drop(pf, rng, tile, row0 - lane / 4, b.key0(it));
#else
        (void)b; (void)it; (void)tile; (void)row0;
#endif
    }

    // The tile's row statistics are final: write its LSE, keep what normalises O for the epilogue.
    __device__ __forceinline__ void finish(const Tile& tile, int qb, int last, int j) {
        const int row0 = thread_row0(tile);
        done.tile = tile;
        done.qb = qb;
        done.last = last;
        done.j = j;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int q = row0 + 8 * h;
            float lse;  // a row with no visible key: output 0, LSE -inf (or the sink)
            done.inv[h] = score::finish_row(row_max[h], quad_sum(row_sum[h]), q, seq_q(p, tile), seq_k(p, tile),
                                            tile.batch, tile.head, p, lse);
#ifdef ATTNGEN_DROPOUT
            done.inv[h] *= dropout::SCALE;  // kept probabilities are scaled by 1 / (1 - p)
#endif
            if (lane % 4 == 0 && q < seq_q(p, tile))
                p.lse[((i64)tile.batch * p.Hq + tile.head) * p.Sq + first_row(tile) + q] = lse;
        }
    }

    // Epilogue of `done`, its last P V complete: normalise O, stage it in this warpgroup's rows of the
    // tile's Q buffer (their wgmmas are long done) in the TMA's swizzled layout, and store it (TMA
    // drops rows past Sq). The buffer goes back to the producer in release_q, once the store read it.
    __device__ __forceinline__ void store_output() {
        const u32 rows = q_rows(done.qb);
#pragma unroll
        for (int i = 0; i < O_REGS / 2; ++i) {
            const int h = i & 1, r = warp * 16 + lane / 4 + 8 * h, col = 8 * (i >> 1) + 2 * (lane % 4);
            const u32 unit = ((col % 64) / 8) ^ (r % 8);  // the 128-byte swizzle: 16-byte unit XOR row within 8
            const u32 addr = rows + (col / 64) * Q_CHUNK + r * 128 + unit * 16 + (col % 8) * 2;
            const u32 packed = pack2<IS_BF16>(o[2 * i] * done.inv[h], o[2 * i + 1] * done.inv[h]);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
        }
        fence_async_smem();
        named_sync(STORE_BARRIER + wg, WG_THREADS);
        const int m0 = done.tile.m_block * BLOCK_M + wg * 64;
        if constexpr (VARLEN) {
            store_rows(p, rows, done.tile, m0, tid);
            named_sync(STORE_BARRIER + wg, WG_THREADS);  // every row has left the Q buffer
        } else if (tid == 0) {
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c)
                tma_store(&p.tmap_o, rows + c * Q_CHUNK, c * 64, m0, done.tile.head, done.tile.batch);
            tma_store_commit();
        }
        stored |= 1 << done.qb;
        pending = false;
        trace(wg, done.j, STORED);
    }
    // Q buffers whose output the TMA store has read go back to the producer (for a later tile's Q).
    __device__ __forceinline__ void release_q() {
        if (stored == 0) return;
        if (tid == 0) {
            if constexpr (!VARLEN) tma_store_wait_read();
#pragma unroll
            for (int qb = 0; qb < Q_BUFFERS; ++qb)
                if (stored & (1 << qb)) mbar_arrive(smem_u32(&pipe.q_empty[qb]));
        }
        stored = 0;
    }
    // The pending tile's last P V on its own (no next tile to issue it with), then its epilogue. The turn
    // is taken even with nothing pending: every warpgroup calls flush at the same tiles, and their turn
    // counts must stay equal (a warpgroup idle on a tile leaves nothing pending where the others do).
    __device__ __forceinline__ void flush() {
        if (!pending) {
            turns.pass();
            return;
        }
        wait_v(done.last);
        turns.begin();
        issue_pv(o, pf, v_at(done.last));
        turns.end();
        wgmma_wait<0>();
        fence_regs(o);
        release_v(done.last);
        store_output();
    }

    // A tile without key blocks (its rows see no key, or a phantom block past Sq): output 0, LSE -inf.
    __device__ __forceinline__ void empty_tile(const Tile& tile, int qb, int j) {
        flush();
        zero_o();
        start_rows();
        finish(tile, qb, 0, j);
        store_output();
        release_q();
    }

    // A tile none of whose rows are this warpgroup's (its 64 rows lie past the sequence's last: the last
    // query block of a length that is not a multiple of BLOCK_M). No GEMMs of its own, no softmax, no
    // output: its GEMMs would take the tensor pipe from the warpgroups with rows (docs/perf-notes.md "Idle
    // warpgroups"). It keeps step with them: as many turns as overlapped_tile takes (the first one issuing
    // the pending tile's last P V, as first_block would with the tile's first S; without CARRY one more,
    // for the last P V flushed at the tile's end), and each K/V stage released once filled, so its
    // arrival counts toward that block's phase.
    __device__ __forceinline__ void idle_tile(const Blocks& b, int qb) {
        const int n = b.count();
        wait_k(g);
        flush();  // the first turn: the pending tile's last P V and its epilogue, or a pass where none is pending
        release_k(g);
#pragma unroll 1
        for (int it = 1; it < n; ++it) {
            wait_k(g + it);
            turns.pass();
            release_k(g + it);
            wait_v(g + it - 1);
            release_v(g + it - 1);
        }
        wait_v(g + n - 1);
        release_v(g + n - 1);
        if constexpr (!CARRY) turns.pass();  // the turn of the last P V, which overlapped_tile flushes at once
        stored |= 1 << qb;  // nothing staged: the buffer goes back once earlier stores have read theirs
        release_q();
    }

    // The tile's first block: S, and with CARRIED the pending tile's last P V in the same turn, whose
    // epilogue then runs once it completes. Two straight-line versions (run picks one): ptxas
    // serialises every wgmma of a kernel where a path it cannot rule out touches an accumulator
    // while its wgmma runs.
    template <bool CARRIED>
    __device__ __forceinline__ void first_block(const Tile& tile, const Blocks& b, u32 q, int row0, int j) {
        wait_k(g);
        trace(wg, j, K0_READY);
        turns.begin();
        trace(wg, j, TURN0);
        issue_qk(s, q, k_at(g));
        if constexpr (CARRIED) {
            wait_v(done.last);
            issue_pv(o, pf, v_at(done.last));
        }
        turns.end();
        wgmma_wait<CARRIED ? 1 : 0>();  // S is done; the pending tile's P V may still run
        fence_regs(s);
        trace(wg, j, S0_READY);
        release_k(g);
#ifdef ATTNGEN_TRACE_NO_FIRST_MASK
        if (false)
#endif
        prepare_scores(s, row0, b, 0, p, tile, lane);
        trace(wg, j, S0_MASKED, fence_clock(s));
        softmax_step(s, row_max, row_sum, alpha, score_log2(p));
        if constexpr (CARRIED) {
            wgmma_wait<0>();
            fence_regs(o);
            release_v(done.last);
            store_output();
        }
        zero_o();
        make_p(b, 0, tile, row0);
        trace(wg, j, FIRST_SOFTMAX);
    }

    // OVERLAP: each step issues S of block it and P V of block it-1 together, then the softmax of block
    // it. Under SPECULATE it waits for that P V first, since it writes P straight into the operand
    // registers (and may rescale O); otherwise the source has the wait after the softmax, and ptxas
    // moves it above (to interleave the packing of P and O's rescale with the exponentials). Either way
    // the softmax runs under the other warpgroups' GEMMs (PINGPONG), not its own P V: a softmax under
    // its own P V measured slower (docs/perf-notes.md "The softmax under its own P V"). The tile's first
    // S goes with the previous tile's last P V (CARRY).
    __device__ __forceinline__ void overlapped_tile(const Tile& tile, const Blocks& b, int qb, int j) {
        const int n = b.count(), row0 = thread_row0(tile);
        const u32 q = q_rows(qb);
        start_rows();
        if (CARRY && pending) first_block<CARRY>(tile, b, q, row0, j);
        else first_block<false>(tile, b, q, row0, j);
        if (n == 1) release_q();  // (else under the next block's GEMMs, below)
#pragma unroll 1
        for (int it = 1; it < n; ++it) {
            wait_k(g + it);
            turns.begin();
            issue_qk(s, q, k_at(g + it));
            wait_v(g + it - 1);
            issue_pv(o, pf, v_at(g + it - 1));
            turns.end();
            if (it == 1) release_q();  // under the GEMMs: the stored output has long been read
            wgmma_wait<1>();  // S(it) is done; P V may still run
            fence_regs(s);
            release_k(g + it);
            if constexpr (SPECULATE) {
                prepare_scores(s, row0, b, it, p, tile, lane);
                wgmma_wait<0>();  // P V is done: O and P may change
                fence_regs(o);
                release_v(g + it - 1);
                speculative_softmax(pf, o, s, row_max, row_sum, score_log2(p));
                drop_p(b, it, tile, row0);
            } else {
                softmax_block(b, it, tile, row0);
                wgmma_wait<0>();  // P V is done: O and P may change
                fence_regs(o);
                release_v(g + it - 1);
                rescale(o, alpha);
                make_p(b, it, tile, row0);
            }
        }
        trace(wg, j, LAST_PV);
        finish(tile, qb, g + n - 1, j);
        pending = true;
        if constexpr (!CARRY) {
            flush();
            release_q();  // the next tile's Q loads into this one's buffer
        }
    }

    // Without OVERLAP: S, softmax and P V of one block after the other.
    __device__ __forceinline__ void serial_tile(const Tile& tile, const Blocks& b, int qb, int j) {
        const int n = b.count(), row0 = thread_row0(tile);
        const u32 q = q_rows(qb);
        start_rows();
        zero_o();
#pragma unroll 1
        for (int it = 0; it < n; ++it) {
            wait_k(g + it);
            turns.begin();
            issue_qk(s, q, k_at(g + it));
            turns.end();
            wgmma_wait<0>();
            fence_regs(s);
            release_k(g + it);
            softmax_block(b, it, tile, row0);
            rescale(o, alpha);
            make_p(b, it, tile, row0);
            if (it < n - 1) {
                wait_v(g + it);
                turns.begin();
                issue_pv(o, pf, v_at(g + it));
                turns.end();
                wgmma_wait<0>();
                fence_regs(o);
                release_v(g + it);
            }
        }
        trace(wg, j, LAST_PV);
        finish(tile, qb, g + n - 1, j);
        pending = true;
        flush();
        release_q();
    }

    __device__ __forceinline__ void run(int tiles) {
        if constexpr (PINGPONG) {
            if (wg == CONSUMERS - 1) named_arrive(PINGPONG_BARRIER, 2 * WG_THREADS);  // the first warpgroup goes first
        }
#pragma unroll 1
        for (int j = 0;; ++j) {
            const int qb = j % Q_BUFFERS;
            trace(wg, j, TILE_WAIT);
            mbar_wait(smem_u32(&pipe.tile_full), j & 1);
            const TileSlot next = pipe.next;
            if (next.t >= tiles) break;  // the producer waits for no read of the end
            mbar_arrive(smem_u32(&pipe.tile_empty));  // every thread: each releases its own read
            const Tile& tile = next.tile;
            const Blocks& b = next.blocks;
            trace(wg, j, TILE_READY);
            mbar_wait(smem_u32(&pipe.q_full[qb]), (j / Q_BUFFERS) & 1);
            trace(wg, j, Q_READY);
            if (b.count() == 0) empty_tile(tile, qb, j);
            else if constexpr (OVERLAP) {
                // Through a shuffle: a condition ptxas sees as warp-uniform. Behind a branch it could not prove
                // uniform, the tiles' loop lost its uniform registers (75 more instructions a block).
                if (__shfl_sync(0xffffffffu, tile.m_block * BLOCK_M + wg * 64 >= seq_q(p, tile), 0)) idle_tile(b, qb);
                else overlapped_tile(tile, b, qb, j);
            }
            else serial_tile(tile, b, qb, j);
            trace(wg, j, KEY_BLOCKS, b.count());
            trace(wg, j, SM, smid());
            g += b.count();
        }
        flush();
        release_q();  // also: no store still reads shared memory when the CTA exits
        if constexpr (PINGPONG) {
            if (wg == 0) named_sync(PINGPONG_BARRIER, 2 * WG_THREADS);  // the last hand-over
        }
    }
};

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
        mbar_init_fence();
    }
    // Under CLUSTER the other CTA's multicasts and releases reach these barriers: both inits first.
    if constexpr (CLUSTER > 1) cluster_sync();
    else __syncthreads();
    // Launched early behind the call's own kernel that zeroes the tile counter or builds the tile list
    // (family.py launches): the set-up above ran while that kernel did; nothing global is read or
    // written before it is done.
    pdl_wait();
    const int tiles = VARLEN ? varlen_tiles(p) : blocks_per_head(p) * p.Hq * p.batch;
    const int wg = threadIdx.x / WG_THREADS;
    if (wg == 0) {
        if constexpr (SET_MAX_REGS) regs_dealloc<PRODUCER_REGS>();
        if (PRODUCER_WARP ? threadIdx.x < 32 : threadIdx.x == 0) produce(p, pipe, sQ, sK, sV, tiles);
    } else {
        if constexpr (SET_MAX_REGS) regs_alloc<CONSUMER_REGS>();
        Consumer(p, pipe, sQ, sK, sV, wg - 1).run(tiles);
    }
    // (CLUSTER: no barrier at exit; the producer's last waits keep this CTA until the other's releases.)
}

}  // namespace fa90
