// ---- softmax.cuh: from S to P in a consumer's registers: score modifier, mask, and the online softmax in
// the log2 domain (the first block's exact max, then exponentials against the reference already held) ----

namespace fa90 {

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
    } else if constexpr (mask::PURE) {
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const int q = row0 + 8 * ((i >> 1) & 1), k = k0 + 8 * (i >> 2) + (i & 1);
            if (!mask::shown_in_bounds(q, k, sq, sk, tile.batch, tile.head, full_block, p)) s[i] = NEG_INF;
        }
    } else if constexpr (mask::KEYED) {
        // Inputs read per key (mask.cuh.j2 KEYED): the two rows' values, and each key's once a quad column.
        // Lane 4 a + r reads keys n0 + 8 (16 u + 2 a + t / 2) + 2 r + t % 2 into slot 4 u + t (t < 4), so
        // a thread's key 8 c + 2 (lane % 4) + j sits in lane 4 ((c % 16) / 2) + lane % 4, slot 4 (c / 16) +
        // 2 (c % 2) + j, the same slot for every lane: one round of loads, one shuffle per key and read.
        constexpr int GROUPS = S_REGS / 4, ROUNDS = (GROUPS + 15) / 16;
        int rv[2][mask::ROW_SLOTS], held[4 * ROUNDS][mask::KEY_SLOTS];
#pragma unroll
        for (int h = 0; h < 2; ++h)
            mask::row_values(min(row0 + 8 * h, sq - 1), sq, sk, tile.batch, tile.head, p, rv[h]);
#pragma unroll
        for (int t = 0; t < 4 * ROUNDS; ++t) {
            const int key = n0 + 8 * (16 * (t / 4) + 2 * (lane / 4) + (t % 4) / 2) + 2 * (lane % 4) + t % 2;
            mask::key_values(min(key, sk - 1), sq, sk, tile.batch, tile.head, p, held[t]);
        }
        unsigned long long shown[ROUNDS];
        mask::shown_bits<GROUPS>(shown, [&](int w, int c) {  // group 16 w + c: a loop over c, four at a time
            unsigned four = 0;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                int kv[mask::KEY_SLOTS];
#pragma unroll
                for (int r = 0; r < mask::KEY_READS; ++r)  // the slot by a select: c is not known here
                    kv[r] = __shfl_sync(0xffffffffu, (c & 1) ? held[4 * w + 2 + j][r] : held[4 * w + j][r],
                                        4 * (c / 2) + lane % 4);
                const int k = k0 + 8 * (16 * w + c) + j;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int q = row0 + 8 * h;
                    four |= unsigned((k < sk) & (q < sq) &
                                     mask::visible_from(q, k, sq, sk, tile.batch, tile.head, p, rv[h], kv)) << (2 * h + j);
                }
            }
            return four;
        });
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) s[i] = mask::bit(shown, i) ? s[i] : NEG_INF;
    } else {  // reading inputs: as bits, a few groups' reads in flight at once (mask.cuh.j2 shown_bits)
        constexpr int GROUPS = S_REGS / 4;  // element i: group i / 4, row +8 when bit 1 of i is set, key + i % 2
        unsigned long long shown[(GROUPS + 15) / 16];
        mask::shown_bits<GROUPS>(shown, [&](int w, int c) {
            return mask::shown_four(row0, k0 + 8 * (16 * w + c), sq, sk, tile.batch, tile.head, full_block, p);
        });
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) s[i] = mask::bit(shown, i) ? s[i] : NEG_INF;
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
            s[i] = score::modify_in_bounds(s[i] * p.scale, q, k, sq, sk, tile.batch, tile.head, p);
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

}  // namespace fa90
