// ---- flash_fwd.cuh: FlashAttention-2 forward for one (query block, query head, batch) per CTA ----
// Needs, from the rendered template: struct FwdParams, namespace cfg { HEAD_DIM, BLOCK_M, BLOCK_N, SUB_N, NUM_WARPS,
// NUM_STAGES, GQA_RATIO, Q_IN_REGS, ROW_SUMS_IN_SMEM, IS_BF16, elem_t }, namespace mask { Bounds,
// bounds, visible } (attngen/cuda/mask.cuh.j2; attngen/masks.py says what they mean) and namespace
// score { MODIFIED, modify, finish_row } (attngen/cuda/score_mod.cuh.j2); with ATTNGEN_DROPOUT, namespace
// dropout (attngen/cuda/philox.cuh) and p.rng.

namespace fa {

using namespace cfg;

constexpr int THREADS = NUM_WARPS * 32;
#define NEG_INF (-__int_as_float(0x7f800000))
constexpr int WARP_ROWS = BLOCK_M / NUM_WARPS;  // query rows one warp owns
constexpr int MT = WARP_ROWS / 16;               // m16 tiles per warp
// A loaded key block is processed SUB_N keys at a time: S for a whole 64-key block and two
// m16 tiles would not fit in registers next to O at large head dims.
constexpr int NT = SUB_N / 8;                    // n8 tiles of S per m16 tile
constexpr int DT = HEAD_DIM / 8;                 // n8 tiles of O per m16 tile
constexpr int DK = HEAD_DIM / 16;                // k16 steps of Q.K^T
constexpr int PK = SUB_N / 16;                   // k16 steps of P.V
// One 16-byte pad per row puts 8 consecutive rows in 8 distinct bank groups, so
// ldmatrix and cp.async on any head dim are free of bank conflicts.
constexpr int ROW = HEAD_DIM + 8;                // smem row stride, elements
constexpr int ROW_BYTES = ROW * 2;
constexpr int CHUNKS = HEAD_DIM / 8;             // 16-byte chunks per row
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int KV_TILE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int TILE_BYTES = Q_TILE_BYTES + 2 * NUM_STAGES * KV_TILE_BYTES;
constexpr int ROW_SUM_BYTES = ROW_SUMS_IN_SMEM ? THREADS * MT * 2 * 4 : 0;  // per-thread fp32 partials
constexpr int SMEM_BYTES = TILE_BYTES + ROW_SUM_BYTES;  // attngen/plan.py smem_bytes() must agree

static_assert(WARP_ROWS == 16 || WARP_ROWS == 32, "a warp owns one or two m16 tiles");
static_assert(SUB_N % 16 == 0 && BLOCK_N % SUB_N == 0 && HEAD_DIM % 16 == 0, "tiles are whole k16 steps");

using Params = FwdParams;  // generated from the family's argument list (attngen/families/fwd_sm80/family.py)

// Copy ROWS x HEAD_DIM elements starting at global row `row0` into a padded smem tile;
// rows at or past `row_end` are zero-filled (their source address is clamped to row0,
// which callers guarantee is in range).
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const elem_t* base, i64 row_stride, int row0, int row_end) {
    if constexpr (THREADS % CHUNKS == 0) {
        // Each thread keeps one column and walks rows: one pointer and one increment live
        // across the main loop instead of an address per chunk.
        constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
        const int r = threadIdx.x / CHUNKS, col = (threadIdx.x % CHUNKS) * 8;
        const elem_t* first = base + (i64)row0 * row_stride + col;
#pragma unroll
        for (int i = 0; i < (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++i) {
            const int rr = r + i * ROWS_PER_PASS;
            if (ROWS % ROWS_PER_PASS == 0 || rr < ROWS) {
                const bool in = row0 + rr < row_end;
                cp_async_16(dst + rr * ROW_BYTES + col * 2, in ? first + (i64)rr * row_stride : first, in);
            }
        }
    } else {
        constexpr int TOTAL = ROWS * CHUNKS;
#pragma unroll
        for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
            const int c = threadIdx.x + i * THREADS;
            if (TOTAL % THREADS == 0 || c < TOTAL) {
                const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
                const bool in = row0 + r < row_end;
                const elem_t* src = base + (i64)(in ? row0 + r : row0) * row_stride + col;
                cp_async_16(dst + r * ROW_BYTES + col * 2, src, in);
            }
        }
    }
}

// Rows with no visible key (or a CTA with no key block at all): output 0, LSE -inf.
__device__ __forceinline__ void write_empty_rows(const Params& p, elem_t* o_base, float* lse_base, int m0, int Sq,
                                                 int Sk, int batch, int head) {
    for (int c = threadIdx.x; c < BLOCK_M * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        if (m0 + r < Sq) {
            *reinterpret_cast<uint4*>(o_base + (i64)(m0 + r) * p.o_ss + col) = make_uint4(0, 0, 0, 0);
        }
    }
    for (int r = threadIdx.x; r < BLOCK_M; r += THREADS) {
        float lse;  // -inf, or the sink's logit
        score::finish_row(NEG_INF, 0.f, m0 + r, Sq, Sk, batch, head, p, lse);
        if (m0 + r < Sq) lse_base[m0 + r] = lse;
    }
}

// The key blocks a query block visits, [begin, end) in blocks of BLOCK_N, from the mask's bounds (also
// each tile's work in a packed-sequence call's list: varlen_tiles.cuh).
__device__ __forceinline__ int2 key_block_span(const mask::Bounds& bounds) {
    const int begin = bounds.kv_begin / BLOCK_N;
#ifdef ATTNGEN_FAULT_DROP_LAST_PARTIAL_KV_TILE
    const int end = bounds.kv_end > bounds.kv_begin ? bounds.kv_end / BLOCK_N : begin;  // injected fault: floor drops a partial block
#else
    const int end = bounds.kv_end > bounds.kv_begin ? (bounds.kv_end + BLOCK_N - 1) / BLOCK_N : begin;
#endif
    return make_int2(begin, end);
}

// Which query block of which sequence a CTA computes, and where that sequence lies in the tensors.
struct Tile {
    int m_block, batch, Sq, Sk;
    i64 row0, key0;  // the sequence's first query row and first key (VARLEN; else 0)
};
// Longest (last) query blocks first: under a causal mask they carry the most key blocks. VARLEN
// (packed sequences): entry blockIdx.x of the call's tile list (attngen/cuda/varlen_tiles.cuh, the
// longest first), or none (m_block -1) past its end: the builder fills the slots up to the list's
// capacity (the grid), so one read answers both.
__device__ __forceinline__ Tile tile_of(const Params& p) {
#ifdef ATTNGEN_VARLEN
    const int2 entry = varlen::tile_list(p)[blockIdx.x];
    if (entry.y < 0) return {-1, 0, 0, 0, 0, 0};
    const int4 seg = varlen::segments(p)[entry.x];
    return {entry.y, 0, seg.y, seg.w, seg.x, seg.z};
#else
    return {(int)(gridDim.x - 1 - blockIdx.x), (int)blockIdx.z, p.Sq, p.Sk, 0, 0};
#endif
}

__device__ __forceinline__ void flash_fwd(const Params& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    const u32 sKV = sQ + Q_TILE_BYTES;  // stage s: K at sKV + 2s*KV, V at sKV + (2s+1)*KV

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment row group and column pair
    const Tile tile = tile_of(p);
#ifdef ATTNGEN_VARLEN
    if (tile.m_block < 0) return;  // past the list's end
#endif
    const int m_block = tile.m_block, batch = tile.batch, head = blockIdx.y;
    const int kv_head = head / GQA_RATIO;  // query head h reads kv head h // ratio
    // Positions are the sequence's own: its rows and keys, from row0 and key0 in the tensors.
    const int Sq = tile.Sq, Sk = tile.Sk;
    const int m0 = m_block * BLOCK_M, m1 = min(m0 + BLOCK_M, Sq);
    // What takes a score to the log2 domain: softmax_scale * log2(e), or log2(e) once modified.
    const float score_log2 = score::MODIFIED ? 1.4426950408889634f : p.scale_log2;

#ifdef ATTNGEN_DROPOUT
    const dropout::Rng rng = dropout::load(p.rng);
#endif
    const elem_t* q_base = p.q + batch * p.q_sb + head * p.q_sh + tile.row0 * p.q_ss;
    const elem_t* k_base = p.k + batch * p.k_sb + kv_head * p.k_sh + tile.key0 * p.k_ss;
    const elem_t* v_base = p.v + batch * p.v_sb + kv_head * p.v_sh + tile.key0 * p.v_ss;

    // Block classification from the mask: [n_begin, n_end) may hold visible keys; a block
    // inside [full_lo, full_hi) is visible to every row here and skips per-element masking.
    // Under mask::LISTED a tile whose span has holes walks the table's list of its non-empty key
    // blocks instead: (n_block << 1) | full, last first (listed; nullptr: the span).
    const mask::Bounds bounds = mask::bounds(m0, m1, Sq, Sk, batch, head, p);
    const int* listed = mask::LISTED && bounds.kv_begin < 0 ? mask::key_blocks(m0, Sq, Sk, batch, head, p) : nullptr;
    const int full_lo = bounds.full_begin, full_hi = bounds.full_end;
    const int2 span = key_block_span(bounds);
    const int n_begin = span.x, n_end = span.y;
    const int n_blocks = listed != nullptr ? bounds.kv_end : n_end - n_begin;  // {-1, count, 0, 0}: the list's count
    // Output pointers are formed where they are used, to keep them out of the main loop's registers.
    auto o_rows = [&]() { return p.o + batch * p.o_sb + head * p.o_sh + tile.row0 * p.o_ss; };
    auto lse_row = [&]() { return p.lse + ((i64)batch * p.Hq + head) * p.Sq + tile.row0; };
    if (n_blocks <= 0) {
        write_empty_rows(p, o_rows(), lse_row(), m0, Sq, Sk, batch, head);
        return;
    }
    // Key blocks are visited from the last to the first, so masked blocks come first.
    auto block_of = [&](int it) { return listed != nullptr ? listed[it] >> 1 : n_end - 1 - it; };
    // Whether keys [n0, n0 + SUB_N) of block `it` are visible to every row here.
    auto all_visible = [&](int it, int n0) {
        if (listed != nullptr) return (listed[it] & 1) && n0 + SUB_N <= Sk;  // a ragged last block is masked
        return n0 >= full_lo && n0 + SUB_N <= full_hi;
    };
    auto load_kv = [&](int it) {
        const int stage = it % NUM_STAGES, n0 = block_of(it) * BLOCK_N;
        load_tile<BLOCK_N>(sKV + (2 * stage) * KV_TILE_BYTES, k_base, p.k_ss, n0, Sk);
        cp_async_commit();
        load_tile<BLOCK_N>(sKV + (2 * stage + 1) * KV_TILE_BYTES, v_base, p.v_ss, n0, Sk);
        cp_async_commit();
    };

    // Prologue: Q, then the first NUM_STAGES-1 key/value blocks (empty groups keep counts uniform).
    load_tile<BLOCK_M>(sQ, q_base, p.q_ss, m0, Sq);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < NUM_STAGES - 1; ++s) {
        if (s < n_blocks) load_kv(s);
        else { cp_async_commit(); cp_async_commit(); }
    }

    // Per-lane ldmatrix offsets (bytes within a tile). A operand (Q): matrices ordered
    // (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
    const u32 q_lane = ((warp * WARP_ROWS + (lane % 8) + 8 * ((lane / 8) % 2)) * ROW + 8 * (lane / 16)) * 2;
    // B operand of Q.K^T (K rows are keys): (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, ...).
    const u32 k_lane = (((lane % 8) + 8 * (lane / 16)) * ROW + 8 * ((lane / 8) % 2)) * 2;
    // B operand of P.V, transposed (V rows are keys = k): (k 0-7, d 0-7), (k 8-15, d 0-7), (k 0-7, d 8-15), ...
    const u32 v_lane = (((lane % 8) + 8 * ((lane / 8) % 2)) * ROW + 8 * (lane / 16)) * 2;

    u32 q_frag[MT][Q_IN_REGS ? DK : 1][4];
    float o_acc[MT][DT][4];
    float row_max[MT][2];
    // Per-thread partial row sums: touched once per block, so where registers are tight they
    // live in shared memory and their registers are the margin a 64-key S tile needs next to O.
    float row_sum_regs[ROW_SUMS_IN_SMEM ? 1 : MT][2];
    float* row_sum_smem = reinterpret_cast<float*>(smem + TILE_BYTES) + threadIdx.x;
    auto row_sum = [&](int mt, int h) -> float& {
        if constexpr (ROW_SUMS_IN_SMEM) return row_sum_smem[(mt * 2 + h) * THREADS];
        else return row_sum_regs[mt][h];
    };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o_acc[mt][dt][i] = 0.f;
        row_max[mt][0] = row_max[mt][1] = NEG_INF;
        row_sum(mt, 0) = row_sum(mt, 1) = 0.f;
    }

    cp_async_wait<2 * (NUM_STAGES - 1)>();
    __syncthreads();
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < DK; ++kk)
                ldmatrix_x4(q_frag[mt][kk], sQ + q_lane + (mt * 16 * ROW + kk * 16) * 2);
    }

#pragma unroll 1
    for (int it = 0; it < n_blocks; ++it) {
        const int stage = it % NUM_STAGES;
        const u32 sK = sKV + (2 * stage) * KV_TILE_BYTES, sV = sK + KV_TILE_BYTES;
        // Wait for K of this block; the barrier also retires the stage read last iteration,
        // which the next prefetch overwrites.
        if constexpr (NUM_STAGES == 1) {
            __syncthreads();
            load_kv(it);
            cp_async_wait<1>();
        } else {
            cp_async_wait<2 * NUM_STAGES - 3>();
        }
        __syncthreads();
        if constexpr (NUM_STAGES > 1) {
            if (it + NUM_STAGES - 1 < n_blocks) load_kv(it + NUM_STAGES - 1);
            else { cp_async_commit(); cp_async_commit(); }
        }

#pragma unroll
        for (int sub = 0; sub < BLOCK_N / SUB_N; ++sub) {
            // S = Q K^T on the tensor cores.
            float s_acc[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) s_acc[mt][nt][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk) {
                // A operand: resident in registers, or re-read from smem to save registers.
                u32 a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (Q_IN_REGS) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[mt][kk][i];
                    } else {
                        ldmatrix_x4(a[mt], sQ + q_lane + (mt * 16 * ROW + kk * 16) * 2);
                    }
                }
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    u32 b[4];
                    ldmatrix_x4(b, sK + k_lane + ((sub * SUB_N + np * 16) * ROW + kk * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<IS_BF16>(s_acc[mt][2 * np], a[mt], b[0], b[1]);
                        mma_16816<IS_BF16>(s_acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }

            const int n0 = block_of(it) * BLOCK_N + sub * SUB_N;
            // A score modifier sees every scaled score and leaves it in the log2 domain: the
            // softmax below then scales by log2(e) instead of softmax_scale * log2(e).
            if constexpr (score::MODIFIED) {
                const int q0 = m0 + warp * WARP_ROWS + g, k0 = n0 + 2 * t;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int q = q0 + mt * 16 + 8 * (i / 2), k = k0 + nt * 8 + (i % 2);
                            s_acc[mt][nt][i] = score::modify_in_bounds(s_acc[mt][nt][i] * p.scale, q, k, Sq, Sk, batch,
                                                                       head, p);
                        }
            }
            // Per-element mask only on blocks the classification could not prove fully visible.
            if (!all_visible(it, n0)) {
                // Whether the table classified the block full (masked then only for keys past Sk).
                const bool full_block = listed != nullptr ? (listed[it] & 1) != 0 : n0 >= full_lo && n0 < full_hi;
                const int q0 = m0 + warp * WARP_ROWS + g, k0 = n0 + 2 * t;  // this lane's first element
                if constexpr (mask::ROW_INTERVAL) {
                    // Each of this lane's rows sees keys [lo, hi) (relative to k0): every element
                    // compares its compile-time column offset, with no branch (mask.cuh.j2).
                    int lo[MT][2], hi[MT][2];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int2 keys = mask::row_keys(q0 + mt * 16 + 8 * h, Sq, Sk, batch, head, p);
                            lo[mt][h] = keys.x - k0;
                            hi[mt][h] = keys.y - k0;  // <= Sk - k0: keys past Sk are masked too
                        }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const int c = nt * 8 + (i % 2);
                                const bool shown = c >= lo[mt][i / 2] && c < hi[mt][i / 2];
                                s_acc[mt][nt][i] = shown ? s_acc[mt][nt][i] : NEG_INF;
                            }
                    (void)full_block;
                } else if constexpr (mask::PURE) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const int q = q0 + mt * 16 + 8 * (i / 2), k = k0 + nt * 8 + (i % 2);
                                if (!mask::shown_in_bounds(q, k, Sq, Sk, batch, head, full_block, p))
                                    s_acc[mt][nt][i] = NEG_INF;
                            }
                } else {  // reading inputs: as bits, a few groups' reads in flight at once (mask.cuh.j2 shown_bits)
                    unsigned long long shown[(MT * NT + 15) / 16];  // group mt * NT + nt
                    mask::shown_bits<MT * NT>(shown, [&](int w, int c) {
                        const int g = 16 * w + c;
                        return mask::shown_four(q0 + g / NT * 16, k0 + g % NT * 8, Sq, Sk, batch, head, full_block, p);
                    });
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                            for (int i = 0; i < 4; ++i)
                                s_acc[mt][nt][i] = mask::bit(shown, 4 * (mt * NT + nt) + i) ? s_acc[mt][nt][i] : NEG_INF;
                }
            }

            // Online softmax in the log2 domain; a row whose max is still -inf uses 0 as its
            // reference so exp2 gives 0 rather than NaN. Each pair of n8 tiles is exponentiated
            // and packed at once, so S registers turn into P registers as they go.
            u32 p_frag[MT][PK][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float ref[2], alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // scale > 0, so the max of scaled scores is the scaled max.
                    float mx = s_acc[mt][0][2 * h];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s_acc[mt][nt][2 * h], s_acc[mt][nt][2 * h + 1]));
                    mx = fmaxf(row_max[mt][h], quad_max(mx) * score_log2);
                    ref[h] = mx == NEG_INF ? 0.f : mx;
                    alpha[h] = fast_exp2(row_max[mt][h] - ref[h]);
                    row_max[mt][h] = mx;
                }
#pragma unroll
                for (int kk = 0; kk < PK; ++kk) {
                    float e[2][4];
#pragma unroll
                    for (int half = 0; half < 2; ++half)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            e[half][i] = fast_exp2(fmaf(s_acc[mt][2 * kk + half][i], score_log2, -ref[i / 2]));
                            sum[i / 2] += e[half][i];  // fp32 sums keep the LSE at fp32 accuracy
                        }
                    // The S accumulator layout of two n8 tiles is the A operand layout of one k16
                    // step, so P feeds P.V straight from registers.
                    p_frag[mt][kk][0] = pack2<IS_BF16>(e[0][0], e[0][1]);
                    p_frag[mt][kk][1] = pack2<IS_BF16>(e[0][2], e[0][3]);
                    p_frag[mt][kk][2] = pack2<IS_BF16>(e[1][0], e[1][1]);
                    p_frag[mt][kk][3] = pack2<IS_BF16>(e[1][2], e[1][3]);
                }
                row_sum(mt, 0) = row_sum(mt, 0) * alpha[0] + sum[0];  // per-thread partials; reduced at the end
                row_sum(mt, 1) = row_sum(mt, 1) * alpha[1] + sum[1];
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    o_acc[mt][dt][0] *= alpha[0];
                    o_acc[mt][dt][1] *= alpha[0];
                    o_acc[mt][dt][2] *= alpha[1];
                    o_acc[mt][dt][3] *= alpha[1];
                }
            }

#ifdef ATTNGEN_DROPOUT
            // Dropout after the row sums (the LSE is of the undropped P): dropped elements of P become 0.
            dropout::drop_p<MT, NT, BLOCK_N % 32 == 0 && SUB_N % 32 == 0>(p_frag, rng, batch, head, m0 + warp * WARP_ROWS,
                                                                          n0);
#endif
            // O += P V once V has landed (waited for once per loaded block).
            if (sub == 0) {
                cp_async_wait<2 * (NUM_STAGES - 1)>();
                __syncthreads();
            }
#pragma unroll
            for (int kk = 0; kk < PK; ++kk) {
#pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, sV + v_lane + ((sub * SUB_N + kk * 16) * ROW + dp * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<IS_BF16>(o_acc[mt][2 * dp], p_frag[mt][kk], b[0], b[1]);
                        mma_16816<IS_BF16>(o_acc[mt][2 * dp + 1], p_frag[mt][kk], b[2], b[3]);
                    }
                }
            }
        }
    }

    // Epilogue: normalise once, write LSE, stage O through this warp's own Q rows in smem
    // so global stores are full 16-byte vectors.
    cp_async_wait<0>();
    elem_t* o_base = o_rows();
    float* lse_base = lse_row();
    unsigned char* warp_rows = smem + warp * WARP_ROWS * ROW_BYTES;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + g + 8 * h;
            const int q = m0 + warp * WARP_ROWS + r;
            float lse;  // a row with no visible key: output 0, LSE -inf (or the sink)
            float inv = score::finish_row(row_max[mt][h], quad_sum(row_sum(mt, h)), q, Sq, Sk, batch, head, p, lse);
#ifdef ATTNGEN_DROPOUT
            inv *= dropout::SCALE;  // kept probabilities are scaled by 1 / (1 - p)
#endif
            if (t == 0 && q < Sq) lse_base[q] = lse;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                *reinterpret_cast<u32*>(warp_rows + r * ROW_BYTES + (dt * 8 + 2 * t) * 2) =
                    pack2<IS_BF16>(o_acc[mt][dt][2 * h] * inv, o_acc[mt][dt][2 * h + 1] * inv);
            }
        }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < WARP_ROWS * CHUNKS / 32; ++i) {
        const int c = lane + i * 32;
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        const int q = m0 + warp * WARP_ROWS + r;
        if (q < Sq)
            *reinterpret_cast<uint4*>(o_base + (i64)q * p.o_ss + col) =
                *reinterpret_cast<const uint4*>(warp_rows + r * ROW_BYTES + col * 2);
    }
}

}  // namespace fa
