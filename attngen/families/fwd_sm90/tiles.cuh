// ---- tiles.cuh: which tile a CTA works on next (the schedules flash_fwd_sm90.cuh describes), and the key blocks
// a tile visits (from the mask's bounds: empty blocks never visited, full ones never masked per element) ----

namespace fa90 {

// Tile t of the order. grid and PAIRS: (batch, head) pairs one after another (the query heads of
// one kv head together). Within a pair, grid: the query blocks longest first (M-1, M-2, ...);
// PAIRS: zigzag (M-1, 0, M-2, 1, ...) over an even count, so tiles 2u and 2u+1 are a pair of the
// same head whose key blocks add up to about the same number for every u. An odd count gets a
// phantom block M (past Sq: nothing to load or store) paired with block 0. DYNAMIC: sections of
// p.section_heads (batch, head) pairs (a multiple of GQA_RATIO, so a kv head's query heads share
// one; section_of), and within a section block M-1 of every head, then block M-2, ... (a mask with a
// block table: its blocks ranked by the key blocks they visit, ranked_block).
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

// Sections of the dynamic schedules (tile_of, varlen_tile): tile t's section of `size` (batch, head)
// pairs out of `pairs`, its first pair and pair count, and t's place r within it. Fewer than size / 2
// pairs left over join the last whole section: a short last section's longest tiles start as the others'
// run out, leaving the SMs without one idle (16 heads in sections of 3 left one: causal + ALiBi at 16k
// ran 4.5% longer; docs/perf-notes.md "A short last section"). Longer ones keep a section of
// their own, which L2 holds with the rest (the sections' point).
struct Section {
    int first, heads, r;
};
__device__ __forceinline__ Section section_of(int t, int per_section, int size, int pairs) {
    const int whole = pairs / size, left = pairs - whole * size;
    const int sections = whole == 0 || 2 * left >= size ? whole + (left > 0) : whole;
    const int section = min(t / per_section, sections - 1);
    const int first = section * size;
    return {first, section == sections - 1 ? pairs - first : size, t - section * per_section};
}

#ifdef ATTNGEN_TILE_ORDER
// The query block of rank `rank` in its (batch, head)'s order: the block table's rows ranked by the key
// blocks they visit, the most first (order_tiles, before the kernel). A mask with a table has no shape
// the order by position fits (document ids: a late query block of a short document visits few keys).
__device__ __forceinline__ int ranked_block(const Params& p, int batch, int head, int rank) {
    return p.tile_order[mask::table_row(batch, head, p) * p.m_blocks + rank];
}
#else
// The last query block first: under a causal mask or a band, the one that visits the most key blocks.
__device__ __forceinline__ int ranked_block(const Params& p, int, int, int rank) { return p.m_blocks - 1 - rank; }
#endif

#ifdef ATTNGEN_VARLEN
// Tile t of the list attngen/cuda/varlen_tiles.cuh built: as the dynamic schedule's sections (tile_of),
// with the list's entries (the longest first) in place of query blocks: sections of p.section_heads
// query heads whose K/V stay in L2 together while their tiles run (family.py makes them long enough to
// end level), within a section entry after entry, the section's heads side by side.
__device__ __forceinline__ Tile varlen_tile(const Params& p, int t) {
    const Section s = section_of(t, p.tile_counter[1] * p.section_heads, p.section_heads, p.Hq);
    const int e = s.r / s.heads, head = s.first + (s.r - e * s.heads);
    const int2 entry = varlen::tile_list(p)[e];
    const int4 seg = varlen::segments(p)[entry.x];
    return {entry.y, head, 0, seg.x, seg.z, seg.y, seg.w};
}
__device__ __forceinline__ int varlen_tiles(const Params& p) { return p.tile_counter[1] * p.Hq; }
#else
__device__ __forceinline__ Tile varlen_tile(const Params&, int) { return {}; }
__device__ __forceinline__ int varlen_tiles(const Params&) { return 0; }
#endif

__device__ __forceinline__ int blocks_per_head(const Params& p) {
    return PAIRS ? (p.m_blocks + 1) & ~1 : p.m_blocks;
}

// The call's tiles: every query block of every (batch, head), or under VARLEN the tile list's entries.
__device__ __forceinline__ int tile_count(const Params& p) {
    return VARLEN ? varlen_tiles(p) : blocks_per_head(p) * p.Hq * p.batch;
}

__device__ __forceinline__ Tile tile_of(const Params& p, int t) {
    if constexpr (VARLEN) return varlen_tile(p, t);
    if constexpr (DYNAMIC) {
        const Section s = section_of(t, p.section_heads * p.m_blocks, p.section_heads, p.Hq * p.batch);
        const int bh = s.first + s.r % s.heads, batch = bh / p.Hq, head = bh % p.Hq;
        return {ranked_block(p, batch, head, s.r / s.heads), head, batch, 0, 0, p.Sq, p.Sk};
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

__device__ __forceinline__ Blocks kv_blocks(const Params& p, const Tile& tile) {
    // A phantom block past the last row has no key blocks; under CLUSTER its CTA still loads its half
    // of the pair's blocks, those of the head's last block. Its consumers idle through them under
    // OVERLAP (consumer.cuh idle_tile); serial_tile computes them on Q's zero-filled rows, never stored.
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
    if constexpr (mask::LISTED) b.list = nullptr;  // the span, not the list (listed() reads it only there)
    return b;
}

#ifdef ATTNGEN_TILE_ORDER
constexpr int ORDER_THREADS = 256;  // family.py ORDER_THREADS
// Before the kernel (its reset kernel, a CTA per block-table row and ORDER_THREADS query blocks): the row's
// query blocks ranked by the key blocks they visit, the most first, ties the later block first (the order
// without a table). Each block's key, count * M + block, is unique; its rank counts the larger keys, each
// thread one block against all M, keys staged in shared memory a chunk at a time: deterministic, no sort's
// passes, M compares of 5 instructions a thread over M / ORDER_THREADS CTAs (one CTA of 1,024 threads a
// row ranking M / 1,024 blocks each took ~4 us at 16k tokens and ~2 ms at 1M: docs/perf-notes.md).
__device__ void order_tiles(const Params& p) {
    __shared__ long long keys[ORDER_THREADS];
    const int row = blockIdx.x, batch = mask::table_batch(row, p), head = mask::table_head(row, p);
    auto key = [&](int m) {
        if (m >= p.m_blocks) return -1LL;
        return (long long)kv_blocks(p, Tile{m, head, batch, 0, 0, p.Sq, p.Sk}).count() * p.m_blocks + m;
    };
    const int m = blockIdx.y * ORDER_THREADS + threadIdx.x;
    const long long mine = key(m);
    int rank = 0;
#pragma unroll 1
    for (int j0 = 0; j0 < p.m_blocks; j0 += ORDER_THREADS) {
        __syncthreads();  // the previous chunk's compares are done
        keys[threadIdx.x] = key(j0 + threadIdx.x);
        __syncthreads();
        const int n = min(ORDER_THREADS, p.m_blocks - j0);
#pragma unroll 8
        for (int i = 0; i < n; ++i) rank += keys[i] > mine;
    }
    if (m < p.m_blocks) p.tile_order[(long long)row * p.m_blocks + rank] = m;
}
#endif

}  // namespace fa90
