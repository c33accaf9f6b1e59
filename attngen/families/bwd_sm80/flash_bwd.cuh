// ---- flash_bwd.cuh: FlashAttention-2 backward, one (key block, kv head, batch) per CTA ----
// Needs, from the rendered template: struct BwdParams, namespace cfg { HEAD_DIM, BLOCK_M, BLOCK_N, SUB_M,
// NUM_WARPS, NUM_STAGES, GQA_RATIO, IS_BF16, elem_t }, namespace mask { Bounds, bounds, visible }
// (attngen/cuda/mask.cuh.j2), namespace score { MODIFIED, modify, modify_grad }
// (attngen/cuda/score_mod.cuh.j2) and bwd_rows::add_dq (attngen/cuda/bwd_rows.cuh); with ATTNGEN_DROPOUT,
// namespace dropout (attngen/cuda/philox.cuh) and p.rng. attngen/families/bwd_sm80/family.py says what each
// kernel does.

namespace fb {

using namespace cfg;

constexpr int THREADS = NUM_WARPS * 32;
#define NEG_INF (-__int_as_float(0x7f800000))
constexpr int WARP_N = BLOCK_N / NUM_WARPS;  // keys one warp owns: its rows of S^T, dP^T, dK, dV
constexpr int MT = WARP_N / 16;              // m16 tiles of keys per warp
constexpr int NT = SUB_M / 8;                // n8 tiles of S^T (query columns) per register step
constexpr int DT = HEAD_DIM / 8;             // n8 tiles of dK/dV per m16 tile
constexpr int DK = HEAD_DIM / 16;            // k16 steps of K.Q^T and V.dO^T
constexpr int PK = SUB_M / 16;               // k16 steps of P^T.dO and dS^T.Q
// One 16-byte pad per row: 8 consecutive rows fall in 8 distinct bank groups (ldmatrix, cp.async).
constexpr int ROW = HEAD_DIM + 8;
constexpr int ROW_BYTES = ROW * 2;
constexpr int CHUNKS = HEAD_DIM / 8;         // 16-byte chunks per row
constexpr int DS_ROW = BLOCK_M + 8;          // dS^T rows (keys) of BLOCK_M query columns, padded
constexpr int KV_TILE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int STAGE_BYTES = 2 * Q_TILE_BYTES + 2 * BLOCK_M * 4;  // Q, dO, then the rows' lse2 and delta
constexpr int DS_BYTES = BLOCK_N * DS_ROW * 2;
constexpr int SMEM_BYTES = 2 * KV_TILE_BYTES + NUM_STAGES * STAGE_BYTES + DS_BYTES;  // family.py smem_bytes()
// dQ of one query block: (BLOCK_M / 16 / DQ_MT) x (HEAD_DIM / DQ_N) items of DQ_MT m16 tiles of rows by
// DQ_N columns, shared by the warps (32 x 32 reads each K and dS element half as often as 16 x 32).
constexpr int DQ_N = 32;
constexpr int DQ_MT = BLOCK_M >= 32 ? 2 : 1;
constexpr int DQ_ITEMS = (BLOCK_M / 16 / DQ_MT) * (HEAD_DIM / DQ_N);

static_assert(WARP_N == 16 || WARP_N == 32, "a warp owns one or two m16 tiles of keys");
static_assert(SUB_M % 16 == 0 && BLOCK_M % SUB_M == 0 && HEAD_DIM % 16 == 0, "tiles are whole k16 steps");

using Params = BwdParams;

// Copy ROWS x HEAD_DIM elements from global row `row0` into a padded smem tile; rows at or past
// `row_end` are zero-filled (their source clamped to row0, which callers keep in range).
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const elem_t* base, i64 row_stride, int row0, int row_end) {
    constexpr int TOTAL = ROWS * CHUNKS;
#pragma unroll
    for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS;
        if (TOTAL % THREADS == 0 || c < TOTAL) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
            const bool in = row0 + r < row_end;
            cp_async_16(dst + r * ROW_BYTES + col * 2, base + (i64)(in ? row0 + r : row0) * row_stride + col, in);
        }
    }
}

#ifdef ATTNGEN_DROPOUT
// Which elements of a register step dropout keeps (attngen/cuda/philox.cuh), in S^T's layout: this
// thread's queries q0 + 8 nt + 2t + e (q0 a multiple of 16, OFF n8 tiles into its 32-query span) and
// the warp's keys kb + 16 mt + 8 h + g (kb a multiple of 16). keep[nt][e] holds the keep bytes of
// word (query >> 3) & 3 of the group of query 2t + e; byte n is key tile n of the key span, shifted
// down so that byte 2 mt + h (WARP_N 32) or h (WARP_N 16) is this thread's key of tile (mt, h).
template <int OFF>
__device__ __forceinline__ void step_keep(u32 (&keep)[NT][2], const dropout::Rng& r, int batch, int head, int q0, int kb) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int shift = WARP_N == 32 ? 0 : 8 * ((kb >> 3) & 3);  // 32 keys per warp start a span
#pragma unroll
    for (int span = 0; span < (NT + OFF + 3) / 4; ++span) {
        const int i = q0 - 8 * OFF + 32 * span + 2 * t;
        const uint4 lo = dropout::group_draws(r, batch, head, i, kb + g), hi = dropout::group_draws(r, batch, head, i + 1, kb + g);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if ((nt + OFF) / 4 != span) continue;
            keep[nt][0] = dropout::keep_bytes(dropout::word(lo, (nt + OFF) % 4)) >> shift;
            keep[nt][1] = dropout::keep_bytes(dropout::word(hi, (nt + OFF) % 4)) >> shift;
        }
    }
}
#endif

// One query block of one query head, as the CTA walks them: (head in the group, block) flattened.
struct Item {
    int head, m0;
    bool full;  // every (query, key) of the block and this CTA's keys is visible: no per-element mask
    int rank;   // this key block's place among those the query block sees, in key order (DETERMINISTIC)
};

__device__ __forceinline__ void flash_bwd(const Params& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sK = smem_u32(smem), sV = sK + KV_TILE_BYTES;
    const u32 sStages = sV + KV_TILE_BYTES;
    const u32 sDS = sStages + NUM_STAGES * STAGE_BYTES;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment row group and column pair
    // Heads vary fastest, then key blocks: under a causal mask the first key blocks are seen by the
    // most query blocks, so every head's longest CTAs start first (the tail of the grid is short),
    // while CTAs running together read the Q and dO of the same few batches from L2.
    const int kv_head = blockIdx.x, n_block = blockIdx.y, batch = blockIdx.z;
    const int Sq = p.Sq, Sk = p.Sk;
    const int n0 = n_block * BLOCK_N, n1 = min(n0 + BLOCK_N, Sk);
#ifdef ATTNGEN_DROPOUT
    const dropout::Rng rng = dropout::load(p.rng);
#endif
    const int m_blocks = (Sq + BLOCK_M - 1) / BLOCK_M;
    const int items = GQA_RATIO * m_blocks;

    const elem_t* k_base = p.k + batch * p.k_sb + kv_head * p.k_sh;
    const elem_t* v_base = p.v + batch * p.v_sb + kv_head * p.v_sh;
    load_tile<BLOCK_N>(sK, k_base, p.k_ss, n0, Sk);
    load_tile<BLOCK_N>(sV, v_base, p.v_ss, n0, Sk);
    cp_async_commit();

    // The mask's classification of (query block, this key block): query blocks none of whose rows
    // sees a key here are never loaded.
    auto item_at = [&](int it, bool& visible_here) {
        Item item;
        item.head = kv_head * GQA_RATIO + it / m_blocks;
        // DETERMINISTIC walks each head's query blocks last to first: every key block of a wave then
        // reaches a query block at the same step, key block n - 1's turn just before n's. (First to
        // last, key block n of a causal mask starts at the diagonal, which n - 1 reaches later: the
        // waits would add up along the wave.)
        item.m0 = (DETERMINISTIC ? m_blocks - 1 - it % m_blocks : it % m_blocks) * BLOCK_M;
        const mask::Bounds b = mask::bounds(item.m0, min(item.m0 + BLOCK_M, Sq), Sq, Sk, batch, item.head, p);
        visible_here = b.kv_begin < b.kv_end && b.kv_begin < n1 && b.kv_end > n0;
        item.full = n0 >= b.full_begin && n0 + BLOCK_N <= b.full_end;
        // The key blocks a query block sees are those meeting [kv_begin, kv_end): consecutive.
        item.rank = n_block - b.kv_begin / BLOCK_N;
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
        const u32 sQ = sStages + stage * STAGE_BYTES, sO = sQ + Q_TILE_BYTES, sRows = sO + Q_TILE_BYTES;
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

    // Per-lane ldmatrix offsets (bytes). A operand, rows = keys (K or V): matrices (rows 0-7, k 0-7),
    // (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
    const u32 a_lane = ((warp * WARP_N + (lane % 8) + 8 * ((lane / 8) % 2)) * ROW + 8 * (lane / 16)) * 2;
    // B operand of K.Q^T and V.dO^T (rows = queries, k = head dim): (rows 0-7, k 0-7), (rows 0-7, k 8-15), ...
    const u32 b_lane = (((lane % 8) + 8 * (lane / 16)) * ROW + 8 * ((lane / 8) % 2)) * 2;
    // B operand transposed (rows = the k dimension): (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), ...
    const u32 bt_lane = (((lane % 8) + 8 * ((lane / 8) % 2)) * ROW + 8 * (lane / 16)) * 2;
    // A operand of dS.K read transposed from dS^T (rows = keys): matrix i holds keys 8*(i/2).., queries 8*(i%2)..
    const u32 ds_lane = (((lane % 8) + 8 * (lane / 16)) * DS_ROW + 8 * ((lane / 8) % 2)) * 2;

    float dk_acc[MT][DT][4], dv_acc[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) dk_acc[mt][dt][i] = dv_acc[mt][dt][i] = 0.f;

    // Learnable inputs' gradient sums (attngen/families/bwd_shared.py): per thread for the current head.
    float ig[bwd_rows::IG_REGS] = {};
    int ig_head = -1;
    bwd_rows::init_input_grads<GQA_RATIO>(p, kv_head, batch);

    int cur = next_visible(0);
    if (cur < items) load_item(cur, 0);
    int stage = 0;
    int* added_turn = nullptr;  // DETERMINISTIC: the counter of the query block whose dQ parts were just added
#pragma unroll 1
    while (cur < items) {
        bool unused;
        const Item item = item_at(cur, unused);
        if constexpr (bwd_rows::IG > 0) {
            if (ig_head >= 0 && item.head != ig_head) bwd_rows::store_input_grads<NUM_WARPS>(ig, p, batch, ig_head);
            ig_head = item.head;
        }
        const int next = next_visible(cur + 1);
        cp_async_wait<0>();
        __syncthreads();  // this block's Q/dO landed; every warp is done with the previous block
        if constexpr (DETERMINISTIC) {
            if (added_turn != nullptr) bwd_rows::pass_turn(added_turn);  // every warp's adds precede the barrier
        }
        if constexpr (NUM_STAGES == 2) {
            if (next < items) load_item(next, stage ^ 1);  // overlaps this block's compute
        }
        const u32 sQ = sStages + stage * STAGE_BYTES, sO = sQ + Q_TILE_BYTES;
        const float* rows = reinterpret_cast<const float*>(smem + (sO + Q_TILE_BYTES - sK));
        const float* lse2_rows = rows;
        const float* delta_rows = rows + BLOCK_M;

#pragma unroll 1
        for (int sub = 0; sub < BLOCK_M / SUB_M; ++sub) {
            const int c0 = sub * SUB_M;  // first query column of this step within the block
            // S^T = K Q^T and dP^T = V dO^T for this warp's keys.
            float s_acc[MT][NT][4], dp_acc[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) s_acc[mt][nt][i] = dp_acc[mt][nt][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk) {
                u32 ak[MT][4], av[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    ldmatrix_x4(ak[mt], sK + a_lane + (mt * 16 * ROW + kk * 16) * 2);
                    ldmatrix_x4(av[mt], sV + a_lane + (mt * 16 * ROW + kk * 16) * 2);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    u32 bq[4], bo[4];
                    ldmatrix_x4(bq, sQ + b_lane + ((c0 + np * 16) * ROW + kk * 16) * 2);
                    ldmatrix_x4(bo, sO + b_lane + ((c0 + np * 16) * ROW + kk * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<IS_BF16>(s_acc[mt][2 * np], ak[mt], bq[0], bq[1]);
                        mma_16816<IS_BF16>(s_acc[mt][2 * np + 1], ak[mt], bq[2], bq[3]);
                        mma_16816<IS_BF16>(dp_acc[mt][2 * np], av[mt], bo[0], bo[1]);
                        mma_16816<IS_BF16>(dp_acc[mt][2 * np + 1], av[mt], bo[2], bo[3]);
                    }
                }
            }

#ifdef ATTNGEN_DROPOUT
            u32 keep[NT][2];
            if constexpr (BLOCK_M % 32 == 0 && SUB_M % 32 == 0) {
                step_keep<0>(keep, rng, batch, item.head, item.m0 + c0, n0 + warp * WARP_N);
            } else {
                if ((item.m0 + c0) & 16) step_keep<2>(keep, rng, batch, item.head, item.m0 + c0, n0 + warp * WARP_N);
                else step_keep<0>(keep, rng, batch, item.head, item.m0 + c0, n0 + warp * WARP_N);
            }
#endif
            // P^T = exp(score - lse) and dS^T = P^T (dP^T - delta) * d score_mod / d score * scale, both
            // rounded and packed as A operands (two n8 accumulator tiles make one k16 step).
            u32 p_frag[MT][PK][4], ds_frag[MT][PK][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int k_row = n0 + warp * WARP_N + mt * 16 + g;  // this lane's keys: k_row, k_row + 8
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int col = c0 + nt * 8 + 2 * t;  // this lane's queries within the block: col, col + 1
                    float pv[4], dsv[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int q = item.m0 + col + (i % 2), k = k_row + 8 * (i / 2);
                        const float lse2 = lse2_rows[col + (i % 2)], delta = delta_rows[col + (i % 2)];
                        // Positions outside the tensors: never handed to the modifier or the mask,
                        // whose runtime inputs are only checked over them.
                        const bool in = q < Sq && k < Sk;
                        float x = s_acc[mt][nt][i], grad = 1.f;
                        if constexpr (score::MODIFIED) {
                            if (in) {
                                const float scaled = x * p.scale;
                                grad = score::modify_grad(scaled, q, k, Sq, Sk, batch, item.head, p);
                                x = score::modify(scaled, q, k, Sq, Sk, batch, item.head, p) * 1.4426950408889634f;
                            }
                        } else {
                            x *= p.scale_log2;
                        }
                        const bool shown = item.full ? in
                                          : mask::PURE ? in && mask::visible(q, k, Sq, Sk, batch, item.head, p)
                                                       : mask::visible_in_bounds(in, q, k, Sq, Sk, batch, item.head, p);
                        const float pr = shown ? fast_exp2(x - lse2) : 0.f;
#ifdef ATTNGEN_DROPOUT
                        // dV's P and dP carry the mask Z (dV is scaled by 1 / (1 - p) at the end, dP here);
                        // D is of the dropped O, so dS = P (dP Z / (1 - p) - D) as without dropout.
                        const bool kept = (keep[nt][i % 2] >> (8 * ((WARP_N == 32 ? 2 * mt : 0) + i / 2))) & 1u;
                        const float dp = kept ? dp_acc[mt][nt][i] * dropout::SCALE : 0.f;
                        pv[i] = kept ? pr : 0.f;
#else
                        const float dp = dp_acc[mt][nt][i];
                        pv[i] = pr;
#endif
                        dsv[i] = shown ? pr * (dp - delta) * grad * p.scale : 0.f;
                        if constexpr (bwd_rows::IG > 0) {  // dL/d modified score times d modified / d input
                            if (shown) {
                                float dm[bwd_rows::IG_REGS];
                                score::modify_input_grads(s_acc[mt][nt][i] * p.scale, q, k, Sq, Sk, batch, item.head,
                                                          p, dm);
#pragma unroll
                                for (int n = 0; n < bwd_rows::IG; ++n) ig[n] += pr * (dp - delta) * dm[n];
                            }
                        }
                    }
                    const int kk = nt / 2, half = nt % 2;
                    p_frag[mt][kk][2 * half] = pack2<IS_BF16>(pv[0], pv[1]);
                    p_frag[mt][kk][2 * half + 1] = pack2<IS_BF16>(pv[2], pv[3]);
                    ds_frag[mt][kk][2 * half] = pack2<IS_BF16>(dsv[0], dsv[1]);
                    ds_frag[mt][kk][2 * half + 1] = pack2<IS_BF16>(dsv[2], dsv[3]);
                }
            }

            // dS^T to shared memory for dQ = dS K, which needs every warp's keys.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = warp * WARP_N + mt * 16 + g;
#pragma unroll
                for (int kk = 0; kk < PK; ++kk)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int col = c0 + kk * 16 + half * 8 + 2 * t;
                        *reinterpret_cast<u32*>(smem + (sDS - sK) + (r * DS_ROW + col) * 2) = ds_frag[mt][kk][2 * half];
                        *reinterpret_cast<u32*>(smem + (sDS - sK) + ((r + 8) * DS_ROW + col) * 2) =
                            ds_frag[mt][kk][2 * half + 1];
                    }
            }

            // dV += P^T dO and dK += dS^T Q: A from registers, B transposed from the stage.
#pragma unroll
            for (int kk = 0; kk < PK; ++kk) {
#pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp) {
                    u32 bo[4], bq[4];
                    ldmatrix_x4_trans(bo, sO + bt_lane + ((c0 + kk * 16) * ROW + dp * 16) * 2);
                    ldmatrix_x4_trans(bq, sQ + bt_lane + ((c0 + kk * 16) * ROW + dp * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<IS_BF16>(dv_acc[mt][2 * dp], p_frag[mt][kk], bo[0], bo[1]);
                        mma_16816<IS_BF16>(dv_acc[mt][2 * dp + 1], p_frag[mt][kk], bo[2], bo[3]);
                        mma_16816<IS_BF16>(dk_acc[mt][2 * dp], ds_frag[mt][kk], bq[0], bq[1]);
                        mma_16816<IS_BF16>(dk_acc[mt][2 * dp + 1], ds_frag[mt][kk], bq[2], bq[3]);
                    }
                }
            }
        }

        __syncthreads();  // dS^T of every warp's keys is in shared memory
        // dQ += dS K for the block's rows, added to the fp32 accumulator: items of DQ_MT m16 tiles of
        // rows by DQ_N columns, each B fragment of K used for every m16 tile.
        float* dq_rows = p.dq_acc + (((i64)batch * p.Hq + item.head) * p.Sq_pad + item.m0) * HEAD_DIM;
        if constexpr (DETERMINISTIC) added_turn = bwd_rows::dq_turn(p, batch, item.head, item.m0);
        bool my_turn = !DETERMINISTIC;
#pragma unroll 1
        for (int w = warp; w < DQ_ITEMS; w += NUM_WARPS) {
            const int mq = w / (HEAD_DIM / DQ_N) * DQ_MT, d0 = (w % (HEAD_DIM / DQ_N)) * DQ_N;
            float acc[DQ_MT][DQ_N / 8][4];
#pragma unroll
            for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < DQ_N / 8; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                u32 a[DQ_MT][4];
#pragma unroll
                for (int mt = 0; mt < DQ_MT; ++mt)
                    ldmatrix_x4_trans(a[mt], sDS + ds_lane + (kk * 16 * DS_ROW + (mq + mt) * 16) * 2);
#pragma unroll
                for (int dp = 0; dp < DQ_N / 16; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, sK + bt_lane + (kk * 16 * ROW + d0 + dp * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < DQ_MT; ++mt) {
                        mma_16816<IS_BF16>(acc[mt][2 * dp], a[mt], b[0], b[1]);
                        mma_16816<IS_BF16>(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            if (!my_turn) {  // each warp before its first add, after its GEMM: a late turn costs less
                bwd_rows::wait_turn(added_turn, item.rank);
                my_turn = true;
            }
#pragma unroll
            for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < DQ_N / 8; ++nt)
                    bwd_rows::add_dq(dq_rows, (mq + mt) * 16, d0 + nt * 8, acc[mt][nt], item.m0, Sq);
        }

        if constexpr (NUM_STAGES == 1) {
            if (next < items) {
                __syncthreads();  // every warp is done with the stage and dS^T
                load_item(next, 0);
            }
        } else {
            stage ^= 1;
        }
        cur = next;
    }
    if constexpr (bwd_rows::IG > 0) {
        if (ig_head >= 0) bwd_rows::store_input_grads<NUM_WARPS>(ig, p, batch, ig_head);
    }

    // Epilogue: dK and dV through this warp's own K and V rows in shared memory, so global stores
    // are full 16-byte rows. Keys no query sees get zeros.
    cp_async_wait<0>();
    __syncthreads();  // every warp is done reading K for dQ
    if constexpr (DETERMINISTIC) {
        if (added_turn != nullptr) bwd_rows::pass_turn(added_turn);
    }
#ifdef ATTNGEN_DROPOUT
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) dv_acc[mt][dt][i] *= dropout::SCALE;  // the kept P's 1 / (1 - p)
#endif
    elem_t* dk_base = p.dk + batch * p.dk_sb + kv_head * p.dk_sh;
    elem_t* dv_base = p.dv + batch * p.dv_sb + kv_head * p.dv_sh;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp * WARP_N + mt * 16 + g + 8 * h;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int off = r * ROW_BYTES + (dt * 8 + 2 * t) * 2;
                *reinterpret_cast<u32*>(smem + off) = pack2<IS_BF16>(dk_acc[mt][dt][2 * h], dk_acc[mt][dt][2 * h + 1]);
                *reinterpret_cast<u32*>(smem + KV_TILE_BYTES + off) =
                    pack2<IS_BF16>(dv_acc[mt][dt][2 * h], dv_acc[mt][dt][2 * h + 1]);
            }
        }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < WARP_N * CHUNKS / 32; ++i) {
        const int c = lane + i * 32;
        const int r = warp * WARP_N + c / CHUNKS, col = (c % CHUNKS) * 8;
        if (n0 + r < Sk) {
            *reinterpret_cast<uint4*>(dk_base + (i64)(n0 + r) * p.dk_ss + col) =
                *reinterpret_cast<const uint4*>(smem + r * ROW_BYTES + col * 2);
            *reinterpret_cast<uint4*>(dv_base + (i64)(n0 + r) * p.dv_ss + col) =
                *reinterpret_cast<const uint4*>(smem + KV_TILE_BYTES + r * ROW_BYTES + col * 2);
        }
    }
}

}  // namespace fb
