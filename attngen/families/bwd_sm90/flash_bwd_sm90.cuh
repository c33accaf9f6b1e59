// ---- flash_bwd_sm90.cuh: FlashAttention backward on Hopper wgmma, one (kv head, key block, batch) per CTA ----
// Two warpgroups, 64 keys each. K and V stay in shared memory, dK and dV in registers; the CTA walks the
// query blocks of its GQA group that the mask lets see its keys, the next block's Q, dO, LSE and D loading
// with cp.async while this one computes (attngen/families/bwd_sm90/family.py has the math). dQ of a block
// needs both warpgroups' dS^T, so it runs during the next block, beside its S and dP GEMMs and softmax
// gradient: one CTA-wide barrier per block, and the tensor cores have work while the exp runs.
// Tiles are stored as wgmma reads them: 64-column chunks of 128-byte rows, 16-byte units XOR-swizzled by
// the row within each 8 (the 128-byte swizzle), every chunk 1024-byte aligned.
// Needs, from the rendered template: struct BwdParams, namespace cfg { HEAD_DIM, BLOCK_M, BLOCK_N,
// NUM_STAGES, GQA_RATIO, IS_BF16, elem_t }, namespace mask { Bounds, bounds, visible } (attngen/cuda/mask.cuh.j2),
// namespace score { MODIFIED, modify, modify_grad } (attngen/cuda/score_mod.cuh.j2), the Hopper wrappers (attngen/cuda/hopper.cuh) and wgmma_scores,
// wgmma_dkv, wgmma_dq (wgmma_bwd.cuh.j2).

namespace fb90 {

using namespace cfg;
using Params = BwdParams;

constexpr int WG_THREADS = 128;
constexpr int CONSUMERS = BLOCK_N / 64;
constexpr int THREADS = CONSUMERS * WG_THREADS;
constexpr int UNITS = HEAD_DIM / 8;              // 16-byte units per row
constexpr int CHUNKS = HEAD_DIM / 64;            // 64-column (128-byte) chunks per row
constexpr int KV_CHUNK = BLOCK_N * 128;          // bytes of one chunk of the K or V tile
constexpr int KV_BYTES = CHUNKS * KV_CHUNK;
constexpr int Q_CHUNK = BLOCK_M * 128;
constexpr int Q_BYTES = CHUNKS * Q_CHUNK;        // one Q or dO tile
// dS^T: one 128-byte row of BLOCK_M queries per key; two buffers, a block's read by its dQ during the next.
constexpr int DS_BYTES = BLOCK_N * BLOCK_M * 2;
constexpr int ROWS_BYTES = 2 * BLOCK_M * 4;      // a stage's lse2 then delta
constexpr int S_REGS = BLOCK_M / 2;              // S^T or dP^T (64 keys x BLOCK_M queries) per thread
constexpr int KV_REGS = HEAD_DIM / 2;            // dK or dV (64 keys x HEAD_DIM) per thread
constexpr int DQ_N = HEAD_DIM / CONSUMERS;       // dQ columns per warpgroup
constexpr int DQ_REGS = DQ_N / 2;
// A warpgroup's dQ part of one block in fp32, laid out as in the workspace (bwd_rows.cuh dq_offset): 16-byte
// units XOR-permuted by the row within 8, so a warp's 16-byte stores spread over the banks, and one bulk
// reduction adds the part. Two buffers per warpgroup: one is written while the other's reduction reads it.
constexpr int DQ_PART_BYTES = BLOCK_M * DQ_N * 4;
constexpr int ALIGN = 1024;                      // a 128-byte swizzle atom: 8 rows of 128 bytes
constexpr int SMEM_BYTES = ALIGN + 2 * KV_BYTES + NUM_STAGES * 2 * Q_BYTES + 2 * DS_BYTES + NUM_STAGES * ROWS_BYTES +
                           CONSUMERS * 2 * DQ_PART_BYTES;
constexpr int DK = HEAD_DIM / 16;                // k16 steps of K Q^T and V dO^T
constexpr int PK = BLOCK_M / 16;                 // k16 steps of P^T dO and dS^T Q
constexpr int NK = BLOCK_N / 16;                 // k16 steps of dS K
// The last block's dQ GEMM issues behind this block's S and dP, to run under the softmax gradient, where
// the registers allow it (head_dim 64); at 128 it issues once S and dP are packed (else 200+ bytes spill).
constexpr bool DQ_EARLY = 2 * KV_REGS + 2 * S_REGS + DQ_REGS <= 160;
constexpr int DQ_BARRIER = 1;                    // named barriers 1, 2: a warpgroup's dQ part is in shared memory

static_assert(BLOCK_M == 64, "a dS^T row (BLOCK_M queries) is one 128-byte swizzle row");
static_assert(HEAD_DIM % 64 == 0 && DQ_N % 32 == 0, "whole swizzle chunks; dQ parts are whole groups of 8 units");
static_assert(DQ_N == HEAD_DIM / DQ_PARTS, "bwd_rows.cuh's dQ layout and this kernel's agree");
static_assert(KV_CHUNK % ALIGN == 0 && Q_CHUNK % ALIGN == 0 && DS_BYTES % ALIGN == 0, "chunks start on atoms");
// The learnable inputs' warp sums (bwd_rows.cuh) are static shared memory beside SMEM_BYTES: within sm_90's 227 KB.
static_assert(SMEM_BYTES + 4 * bwd_rows::IG_REGS * (THREADS / 32) <= 232448, "shared memory past sm_90's 227 KB");

// Byte offset of 16-byte unit `unit` of row r in a swizzled tile of `rows` rows.
__device__ __forceinline__ u32 swizzled(int rows, int r, int unit) {
    return (unit / 8) * rows * 128 + r * 128 + (((unit % 8) ^ (r % 8)) * 16);
}

// Copy ROWS x HEAD_DIM elements from global row `row0` into a swizzled tile; rows at or past
// `row_end` are zero-filled (their source clamped to row0, which callers keep in range).
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const elem_t* base, i64 row_stride, int row0, int row_end) {
    constexpr int TOTAL = ROWS * UNITS;
    static_assert(TOTAL % THREADS == 0, "every thread copies the same number of units");
#pragma unroll
    for (int i = 0; i < TOTAL / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS, r = c / UNITS, u = c % UNITS;
        const bool in = row0 + r < row_end;
        cp_async_16(dst + swizzled(ROWS, r, u), base + (i64)(in ? row0 + r : row0) * row_stride + u * 8, in);
    }
}

// Adds `bytes` of fp32 from shared memory to global memory element by element (the bulk copy engine;
// 16-byte aligned, a multiple of 16 bytes), completing in this thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* dst, u32 src, int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
// Wait until at most N of this thread's bulk groups still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

template <int R>
__device__ __forceinline__ void fence_operands(u32 (&r)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// dQ = dS K of a finished block for this warpgroup's DQ_N columns (k_cols: its columns of K): dS^T read
// transposed (MN-major A), K MN-major.
__device__ __forceinline__ void issue_dq(float (&dq)[DQ_REGS], u32 ds, u32 k_cols) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < NK; ++kk)
        wgmma_dq(dq, smem_desc(ds + kk * 2048, DS_BYTES, 1024), smem_desc(k_cols + kk * 2048, KV_CHUNK, 1024), kk > 0);
    wgmma_commit();
}

// A warpgroup's dQ part to shared memory, 16 bytes per store: lanes t and t^1 swap halves so that each
// holds four consecutive columns of one row (even t: row g, odd t: row g + 8); then one thread adds it to
// the fp32 accumulator (padded to whole blocks) with one bulk reduction, while the warpgroup goes on.
// `block`: the accumulator's first float of the finished block; sDQ: the part's buffer.
__device__ __forceinline__ void add_dq(const float (&dq)[DQ_REGS], float* block, u32 sDQ, int wg) {
    const int tid = threadIdx.x % WG_THREADS, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < DQ_REGS / 4; ++j) {
        const bool odd = t & 1;
        const float send0 = odd ? dq[4 * j] : dq[4 * j + 2], send1 = odd ? dq[4 * j + 1] : dq[4 * j + 3];
        const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1), got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
        const int r = warp * 16 + g + (odd ? 8 : 0), c = 8 * j + 4 * (t >> 1);
        const float4 v = odd ? make_float4(got0, got1, dq[4 * j + 2], dq[4 * j + 3])
                             : make_float4(dq[4 * j], dq[4 * j + 1], got0, got1);
        const u32 at = sDQ + static_cast<u32>(bwd_rows::dq_offset(r, wg * DQ_N + c) * 4) - wg * DQ_PART_BYTES;
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                     : "memory");
    }
    fence_async_smem();  // the bulk copy engine reads through the async proxy
    named_sync(DQ_BARRIER + wg, WG_THREADS);
    if (tid == 0) {
        bulk_reduce_add(block + wg * (DQ_PART_BYTES / 4), sDQ, DQ_PART_BYTES);
        tma_store_commit();
        bulk_wait_read<1>();  // the other buffer is free once the block-before-last's reduction read it
    }
}

// One query block of one query head, as the CTA walks them: (head in the group, block) flattened.
struct Item {
    int head, m0;
    bool full;  // every (query, key) of the block and this CTA's keys is visible: no per-element mask
};

// P^T = exp(score - lse) and dS^T = P^T (dP^T - delta) * d score_mod / d score * scale, packed pair by
// pair as A operands (two n8 accumulator column groups make one k16 step). MASKED: the block is partly
// visible, so every element asks the mask; otherwise only the tensors' bounds (compiled apart: the
// per-element mask in the common path costs a third of the backward's time).
// Accumulator element i: key +8 when bit 1 of i is set, query column 8 (i / 4) + 2 t + (i % 2).
// With learnable inputs (bwd_rows::IG > 0), ig gathers dL/d modified score * d modified / d input.
template <bool MASKED>
__device__ __forceinline__ void to_operands(u32 (&pf)[PK][4], u32 (&dsf)[PK][4], const float (&s)[S_REGS],
                                            const float (&dp)[S_REGS], const float* lse2_rows,
                                            const float* delta_rows, const Item& item, int key_lo, int batch,
                                            const Params& p, float (&ig)[bwd_rows::IG_REGS]) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int kk = 0; kk < PK; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float pv[2], dsv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 8 * kk + 2 * j + e;
                const int col = 8 * (i >> 2) + 2 * t + e;
                const int q = item.m0 + col, k = key_lo + 8 * (j & 1);
                // Positions outside the tensors: never handed to the modifier or the mask, whose
                // runtime inputs are only checked over them. A fully visible block has every key in
                // range, and its rows past Sq have lse2 = +inf and dO = 0: P = dS = 0 there untested.
                const bool in = MASKED || score::MODIFIED ? q < p.Sq && k < p.Sk : true;
                float x = s[i], grad = 1.f;
                if constexpr (score::MODIFIED) {
                    if (in) {
                        const float scaled = x * p.scale;
                        grad = score::modify_grad(scaled, q, k, p.Sq, p.Sk, batch, item.head, p);
                        x = score::modify(scaled, q, k, p.Sq, p.Sk, batch, item.head, p) * 1.4426950408889634f;
                    }
                } else {
                    x *= p.scale_log2;
                }
                const bool shown = !MASKED ? in
                                  : mask::PURE ? in && mask::visible(q, k, p.Sq, p.Sk, batch, item.head, p)
                                               : mask::visible_in_bounds(in, q, k, p.Sq, p.Sk, batch, item.head, p);
                pv[e] = shown ? fast_exp2(x - lse2_rows[col]) : 0.f;
                dsv[e] = shown ? pv[e] * (dp[i] - delta_rows[col]) * grad * p.scale : 0.f;
                if constexpr (bwd_rows::IG > 0) {
                    if (shown) {
                        float dm[bwd_rows::IG_REGS];
                        score::modify_input_grads(s[i] * p.scale, q, k, p.Sq, p.Sk, batch, item.head, p, dm);
#pragma unroll
                        for (int n = 0; n < bwd_rows::IG; ++n) ig[n] += pv[e] * (dp[i] - delta_rows[col]) * dm[n];
                    }
                }
            }
            pf[kk][j] = pack2<IS_BF16>(pv[0], pv[1]);
            dsf[kk][j] = pack2<IS_BF16>(dsv[0], dsv[1]);
        }
}

__device__ __forceinline__ void flash_bwd_sm90(const Params& p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // Swizzled tiles start on 1024-byte boundaries: align the base (SMEM_BYTES has the slack).
    const u32 base = smem_u32(smem_raw);
    const u32 sK = (base + ALIGN - 1) & ~static_cast<u32>(ALIGN - 1);
    const u32 sV = sK + KV_BYTES, sQ0 = sV + KV_BYTES;  // stage s: Q at sQ0 + 2 s Q_BYTES, dO after it
    const u32 sDS0 = sQ0 + NUM_STAGES * 2 * Q_BYTES, sRows0 = sDS0 + 2 * DS_BYTES;
    const u32 sDQ0 = sRows0 + NUM_STAGES * ROWS_BYTES;
    unsigned char* smem = smem_raw + (sK - base);  // generic address of sK

    // At head dim 64 the warpgroup goes through a shuffle: ptxas then holds it, and the descriptors made from
    // it, in uniform registers (from threadIdx alone, each wgmma moves them over from vector registers; 35 ->
    // 12 R2UR in the loop, 4-8% faster at 8k). At 128, where the kernel sits at 255 registers, the same change
    // measured 2-3% slower (docs/perf-notes.md "Every wgmma's Q descriptor in uniform registers").
    const int wg = HEAD_DIM == 64 ? __shfl_sync(0xffffffffu, threadIdx.x / WG_THREADS, 0) : threadIdx.x / WG_THREADS;
    const int warp = (threadIdx.x % WG_THREADS) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // Heads vary fastest, then key blocks: under a causal mask the first key blocks are seen by the
    // most query blocks, so every head's longest CTAs start first.
    const int kv_head = blockIdx.x, n_block = blockIdx.y, batch = blockIdx.z;
    const int Sq = p.Sq, Sk = p.Sk;
    const int n0 = n_block * BLOCK_N, n1 = min(n0 + BLOCK_N, Sk);
    const int m_blocks = (Sq + BLOCK_M - 1) / BLOCK_M;
    const int items = GQA_RATIO * m_blocks;

    // dS^T buffer 1 is "the block before the first": zeros, so every block issues the same GEMMs.
    for (int c = threadIdx.x; c < DS_BYTES / 16; c += THREADS)
        *reinterpret_cast<uint4*>(smem + (sDS0 + DS_BYTES - sK) + c * 16) = make_uint4(0, 0, 0, 0);
    load_tile<BLOCK_N>(sK, p.k + batch * p.k_sb + kv_head * p.k_sh, p.k_ss, n0, Sk);
    load_tile<BLOCK_N>(sV, p.v + batch * p.v_sb + kv_head * p.v_sh, p.v_ss, n0, Sk);
    cp_async_commit();

    // The mask's classification of (query block, this key block): query blocks none of whose rows
    // sees a key here are never loaded.
    auto item_at = [&](int it, bool& visible_here) {
        Item item;
        item.head = kv_head * GQA_RATIO + it / m_blocks;
        item.m0 = (it % m_blocks) * BLOCK_M;
        const mask::Bounds b = mask::bounds(item.m0, min(item.m0 + BLOCK_M, Sq), Sq, Sk, batch, item.head, p);
        visible_here = b.kv_begin < b.kv_end && b.kv_begin < n1 && b.kv_end > n0;
        item.full = n0 >= b.full_begin && n0 + BLOCK_N <= b.full_end;
        return item;
    };
    auto next_visible = [&](int it) {
        bool visible_here = false;
        for (; it < items; ++it) {
            item_at(it, visible_here);
            if (visible_here) break;
        }
        return it;
    };
    auto load_item = [&](int it, int stage) {
        bool unused;
        const Item item = item_at(it, unused);
        const u32 sQ = sQ0 + stage * 2 * Q_BYTES, sO = sQ + Q_BYTES, sRows = sRows0 + stage * ROWS_BYTES;
        load_tile<BLOCK_M>(sQ, p.q + batch * p.q_sb + item.head * p.q_sh, p.q_ss, item.m0, Sq);
        load_tile<BLOCK_M>(sO, p.dout + batch * p.dout_sb + item.head * p.dout_sh, p.dout_ss, item.m0, Sq);
        // lse2 and delta of the block's rows: the workspace is padded to whole blocks.
        const i64 row0 = ((i64)batch * p.Hq + item.head) * p.Sq_pad + item.m0;
        for (int c = threadIdx.x; c < 2 * BLOCK_M / 4; c += THREADS) {
            const float* src = (c < BLOCK_M / 4 ? p.lse2 : p.delta) + row0 + (c % (BLOCK_M / 4)) * 4;
            cp_async_16(sRows + c * 16, src, true);
        }
        cp_async_commit();
    };

    float dk[KV_REGS], dv[KV_REGS];
#pragma unroll
    for (int i = 0; i < KV_REGS; ++i) dk[i] = dv[i] = 0.f;

    const u32 k_rows = sK + wg * 64 * 128, v_rows = sV + wg * 64 * 128;  // this warpgroup's keys in each chunk
    // dQ's B operand: this warpgroup's DQ_N columns of K, MN-major. At head_dim 64 warpgroup 1's start
    // is 64 bytes into a 128-byte row: fine, as the descriptor's base offset is that of the swizzle
    // pattern ((pattern start >> 7) & 7 = 0: chunks are 1024-byte aligned), not of the matrix, the same
    // mechanism as the K-major k16 steps; the head_dim-64 GPU tests check all of dQ's columns.
    const u32 k_cols = sK + (wg * DQ_N / 64) * KV_CHUNK + (wg * DQ_N % 64) * 2;
    const int key_lo = n0 + wg * 64 + warp * 16 + g;  // this thread's keys: key_lo and key_lo + 8

    const int tid = threadIdx.x % WG_THREADS;
    auto dq_block = [&](const Item& done) {
        return p.dq_acc + (((i64)batch * p.Hq + done.head) * p.Sq_pad + done.m0) * HEAD_DIM;
    };

    // Learnable inputs' gradient sums (attngen/families/bwd_shared.py): per thread for the current head.
    float ig[bwd_rows::IG_REGS] = {};
    int ig_head = -1;
    bwd_rows::init_input_grads<GQA_RATIO>(p, kv_head, batch);

    int cur = next_visible(0);
    if (cur < items) load_item(cur, 0);
    int stage = 0, n_done = 0;  // blocks finished; block n's dS^T is in buffer n % 2
    Item prev{};                // the last finished block, whose dQ is still to come
#pragma unroll 1
    while (cur < items) {
        bool unused;
        const Item item = item_at(cur, unused);
        if constexpr (bwd_rows::IG > 0) {
            if (ig_head >= 0 && item.head != ig_head) bwd_rows::store_input_grads<THREADS / 32>(ig, p, batch, ig_head);
            ig_head = item.head;
        }
        const int next = next_visible(cur + 1);
        cp_async_wait<0>();
        fence_async_smem();  // cp.async wrote through the generic proxy; wgmma reads through the async one
        __syncthreads();     // this block's tiles and the last block's dS^T are in; the other stage is free
        if constexpr (NUM_STAGES == 2) {
            if (next < items) load_item(next, stage ^ 1);  // overlaps this block's compute
        }
        const u32 sQ = sQ0 + stage * 2 * Q_BYTES, sO = sQ + Q_BYTES;
        const float* lse2_rows = reinterpret_cast<const float*>(smem + (sRows0 + stage * ROWS_BYTES - sK));
        const float* delta_rows = lse2_rows + BLOCK_M;
        const bool dq_due = n_done > 0;  // the first block's dQ GEMM reads a zero dS^T and is dropped

        // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys: K-major operands, 32 bytes per k16
        // step; then (DQ_EARLY) the last block's dQ behind them.
        float s[S_REGS], dp[S_REGS], dq[DQ_REGS];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const u32 at = (kk / 4) * KV_CHUNK + (kk % 4) * 32, bt = (kk / 4) * Q_CHUNK + (kk % 4) * 32;
            wgmma_scores(s, smem_desc(k_rows + at, 16, 1024), smem_desc(sQ + bt, 16, 1024), kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const u32 at = (kk / 4) * KV_CHUNK + (kk % 4) * 32, bt = (kk / 4) * Q_CHUNK + (kk % 4) * 32;
            wgmma_scores(dp, smem_desc(v_rows + at, 16, 1024), smem_desc(sO + bt, 16, 1024), kk > 0);
        }
        wgmma_commit();
        if constexpr (DQ_EARLY) {
            issue_dq(dq, sDS0 + ((n_done - 1) & 1) * DS_BYTES, k_cols);
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        fence_regs(s);
        fence_regs(dp);

        u32 pf[PK][4], dsf[PK][4];
        if (item.full) {
            to_operands<false>(pf, dsf, s, dp, lse2_rows, delta_rows, item, key_lo, batch, p, ig);
        } else {
            to_operands<true>(pf, dsf, s, dp, lse2_rows, delta_rows, item, key_lo, batch, p, ig);
        }

        if constexpr (!DQ_EARLY) issue_dq(dq, sDS0 + ((n_done - 1) & 1) * DS_BYTES, k_cols);

        // dS^T to shared memory for this block's dQ, which needs both warpgroups' keys.
        const u32 sDS = sDS0 + (n_done & 1) * DS_BYTES;
#pragma unroll
        for (int kk = 0; kk < PK; ++kk)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = wg * 64 + warp * 16 + g + 8 * (j & 1), col = 16 * kk + 8 * (j >> 1) + 2 * t;
                const u32 addr = sDS + r * 128 + (((col / 8) ^ (r % 8)) * 16) + (col % 8) * 2;
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(dsf[kk][j]) : "memory");
            }

        // dV += P^T dO and dK += dS^T Q: A from registers, B MN-major (16 query rows are 2048 bytes).
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PK; ++kk) wgmma_dkv(dv, pf[kk], smem_desc(sO + kk * 2048, Q_CHUNK, 1024));
#pragma unroll
        for (int kk = 0; kk < PK; ++kk) wgmma_dkv(dk, dsf[kk], smem_desc(sQ + kk * 2048, Q_CHUNK, 1024));
        wgmma_commit();
        wgmma_wait<1>();  // the last block's dQ; dV and dK may still run
        fence_regs(dq);
        if (dq_due) {
            add_dq(dq, dq_block(prev), sDQ0 + (wg * 2 + ((n_done - 1) & 1)) * DQ_PART_BYTES, wg);
        }
        wgmma_wait<0>();  // the stage is read: the next block may load into it
        fence_regs(dk);
        fence_regs(dv);
        fence_operands(pf);
        fence_operands(dsf);
        fence_async_smem();  // this block's dS^T, read by both warpgroups' wgmma after the next barrier

        if constexpr (NUM_STAGES == 1) {
            if (next < items) {
                __syncthreads();  // every warpgroup is done with the stage
                load_item(next, 0);
            }
        } else {
            stage ^= 1;
        }
        prev = item;
        ++n_done;
        cur = next;
    }
    if constexpr (bwd_rows::IG > 0) {
        if (ig_head >= 0) bwd_rows::store_input_grads<THREADS / 32>(ig, p, batch, ig_head);
    }
    if (n_done > 0) {  // the last block's dQ
        __syncthreads();  // both warpgroups' dS^T are in
        float dq[DQ_REGS];
        issue_dq(dq, sDS0 + ((n_done - 1) & 1) * DS_BYTES, k_cols);
        wgmma_wait<0>();
        fence_regs(dq);
        add_dq(dq, dq_block(prev), sDQ0 + (wg * 2 + ((n_done - 1) & 1)) * DQ_PART_BYTES, wg);
    }

    // Epilogue: dK and dV staged in the K and V tiles (swizzled) so global stores are 16-byte units.
    // Keys no query sees get zeros.
    cp_async_wait<0>();
    if (tid == 0) bulk_wait_all();  // this warpgroup's dQ reductions are done with shared memory
    __syncthreads();  // every warpgroup is done reading K for dQ (and K/V landed, when no block was visible)
#pragma unroll
    for (int j = 0; j < KV_REGS / 2; ++j) {
        const int r = wg * 64 + warp * 16 + g + 8 * (j & 1), col = 8 * (j >> 1) + 2 * t;
        const u32 off = swizzled(BLOCK_N, r, col / 8) + (col % 8) * 2;
        *reinterpret_cast<u32*>(smem + off) = pack2<IS_BF16>(dk[2 * j], dk[2 * j + 1]);
        *reinterpret_cast<u32*>(smem + KV_BYTES + off) = pack2<IS_BF16>(dv[2 * j], dv[2 * j + 1]);
    }
    __syncthreads();
    elem_t* dk_base = p.dk + batch * p.dk_sb + kv_head * p.dk_sh;
    elem_t* dv_base = p.dv + batch * p.dv_sb + kv_head * p.dv_sh;
#pragma unroll
    for (int i = 0; i < BLOCK_N * UNITS / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS, r = c / UNITS, u = c % UNITS;
        if (n0 + r < Sk) {
            const u32 off = swizzled(BLOCK_N, r, u);
            *reinterpret_cast<uint4*>(dk_base + (i64)(n0 + r) * p.dk_ss + u * 8) =
                *reinterpret_cast<const uint4*>(smem + off);
            *reinterpret_cast<uint4*>(dv_base + (i64)(n0 + r) * p.dv_ss + u * 8) =
                *reinterpret_cast<const uint4*>(smem + KV_BYTES + off);
        }
    }
}

}  // namespace fb90
