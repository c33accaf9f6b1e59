// ---- philox.cuh: dropout's random bits, Philox4x32-10 (Random123), and which elements are kept ----
// Rendered only into kernels with dropout (cfg::DROPOUT_THRESHOLD; the kernel argument p.rng). The mapping is part of the contract (docs/dropout.md; attngen/philox.py computes
// the same bits on the host for the reference): element (batch b, query head h, query i, key j) is
// byte (j >> 3) & 3 of word (i >> 3) & 3 of Philox4x32-10 with
//   key     (seed mod 2^32, seed >> 32)
//   counter ((j >> 5) * 8 + (j & 7), (i >> 5) * 8 + (i & 7), b * 65536 + h, offset mod 2^32)
// and is kept when that byte is below DROPOUT_THRESHOLD. One call thus gives the 16 draws of a group
// {i' = i mod 8} x {j' = j mod 8} of a 32-row by 32-key span: rows g, g+8, g+16, g+24 of an
// accumulator layout by keys g or 2t (+1) in steps of 8, the shape both the forward's S and the
// backward's S^T give a thread.

namespace dropout {

constexpr u32 THRESHOLD = cfg::DROPOUT_THRESHOLD;
constexpr float SCALE = 256.f / THRESHOLD;  // what kept probabilities are scaled by: 1 / (1 - p) of the realised p

// The call's key and offset (p.rng = [seed, offset], int64).
struct Rng {
    u32 key0, key1, offset;
};

__device__ __forceinline__ Rng load(const i64* rng) {
    const unsigned long long seed = static_cast<unsigned long long>(rng[0]);
    return {static_cast<u32>(seed), static_cast<u32>(seed >> 32), static_cast<u32>(rng[1])};
}

// Philox4x32-10: ten rounds of two 32 x 32 -> 64-bit products (one IMAD.WIDE each) and XORs, the
// key bumped by the Weyl constants before every round but the first.
__device__ __forceinline__ uint4 philox(uint4 c, u32 k0, u32 k1) {
    // Opaque copies of the key: the compiler would otherwise hoist the nine bumped keys of both
    // words out of the kernel's loops, 18 registers held for one add each.
    asm volatile("mov.b32 %0, %0;" : "+r"(k0));
    asm volatile("mov.b32 %0, %0;" : "+r"(k1));
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned long long p0 = static_cast<unsigned long long>(0xD2511F53u) * c.x;
        const unsigned long long p1 = static_cast<unsigned long long>(0xCD9E8D57u) * c.z;
        c = make_uint4(static_cast<u32>(p1 >> 32) ^ c.y ^ k0, static_cast<u32>(p1),
                       static_cast<u32>(p0 >> 32) ^ c.w ^ k1, static_cast<u32>(p0));
    }
    return c;
}

// The 16 draws of the group holding element (i, j) of (batch, head): the draw of element (i', j') of
// the group is byte (j' >> 3) & 3 of word (i' >> 3) & 3.
__device__ __forceinline__ uint4 group_draws(const Rng& r, int batch, int head, int i, int j) {
    return philox(make_uint4(static_cast<u32>((j >> 5) * 8 + (j & 7)), static_cast<u32>((i >> 5) * 8 + (i & 7)),
                             (static_cast<u32>(batch) << 16) | static_cast<u32>(head), r.offset),
                  r.key0, r.key1);
}

__device__ __forceinline__ u32 word(const uint4& x, int w) {
    return w == 0 ? x.x : w == 1 ? x.y : w == 2 ? x.z : x.w;
}

// 0xff in each byte of a word of draws that is kept (below THRESHOLD), 0 elsewhere.
__device__ __forceinline__ u32 keep_bytes(u32 draws) {
    return __vcmpltu4(draws, THRESHOLD * 0x01010101u);
}

// The AND mask of a packed pair of 16-bit elements: the low one kept per byte n of lo, the high one
// per byte n of hi (a dropped element becomes +0).
__device__ __forceinline__ u32 pair_mask(u32 lo, u32 hi, int n) {
    return __byte_perm(lo, hi, n * 0x1111u + 0x4400u);
}

// Drops the elements of a P operand packed as the A fragments of k16 steps (pf[kk][2 * half + h]:
// row h's keys 16 kk + 8 half + 2t and + 1), NT n8 tiles starting OFF tiles into a 32-key span,
// those of span `span` (0, 1, ...): lo and hi hold the keep bytes of rows h = 0 (x) and 1 (y) in the
// groups of keys 2t and 2t + 1.
template <int NT, int OFF>
__device__ __forceinline__ void drop_span(u32 (&pf)[NT / 2][4], uint2 lo, uint2 hi, int span) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        if ((nt + OFF) / 4 != span) continue;
        pf[nt / 2][2 * (nt % 2)] &= pair_mask(lo.x, hi.x, (nt + OFF) % 4);
        pf[nt / 2][2 * (nt % 2) + 1] &= pair_mask(lo.y, hi.y, (nt + OFF) % 4);
    }
}

// The keep bytes of words w and w + 1 of a group's draws (rows g and g + 8 of an m16 tile).
__device__ __forceinline__ uint2 rows_keep(const uint4& x, int w) {
    return make_uint2(keep_bytes(word(x, w)), keep_bytes(word(x, w + 1)));
}

// The forward's dropout of a warp's P: MT tiles of 16 rows from row_base (a multiple of 16, of 32
// when MT is 2: the tiles then share their groups), NT n8 tiles of keys from key n0 (a multiple of
// 8, OFF tiles into its 32-key span). Per span, the two groups the thread's keys 2t and 2t + 1 fall
// in, then every packed pair.
template <int MT, int NT, int OFF>
__device__ __forceinline__ void drop_rows(u32 (&pf)[MT][NT / 2][4], const Rng& r, int batch, int head, int row_base,
                                          int n0) {
    static_assert(MT == 1 || MT == 2, "one or two m16 tiles of rows");
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int span = 0; span < (NT + OFF + 3) / 4; ++span) {
        const int j = n0 - 8 * OFF + 32 * span + 2 * t;
        const uint4 lo = group_draws(r, batch, head, row_base + g, j), hi = group_draws(r, batch, head, row_base + g, j + 1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {  // rows row_base + 16 mt + g (+ 8): words w and w + 1 of the groups
            const int w = MT == 2 ? 2 * mt : (row_base >> 3) & 3;
            drop_span<NT, OFF>(pf[mt], rows_keep(lo, w), rows_keep(hi, w), span);
        }
    }
}

// drop_rows for keys from n0, a multiple of 16: ALIGNED when every n0 of the kernel is a multiple of
// 32 (one instantiation), else the span offset is chosen at run time.
template <int MT, int NT, bool ALIGNED>
__device__ __forceinline__ void drop_p(u32 (&pf)[MT][NT / 2][4], const Rng& r, int batch, int head, int row_base,
                                       int n0) {
    if constexpr (ALIGNED) {
        drop_rows<MT, NT, 0>(pf, r, batch, head, row_base, n0);
    } else {
        if (n0 & 16) drop_rows<MT, NT, 2>(pf, r, batch, head, row_base, n0);
        else drop_rows<MT, NT, 0>(pf, r, batch, head, row_base, n0);
    }
}

}  // namespace dropout
