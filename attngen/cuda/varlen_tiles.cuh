// ---- varlen_tiles.cuh: the tiles of a packed-sequence (varlen) call, built on the GPU ----
// Sequences packed end to end (attngen/varlen.py) are tiled per sequence: a tile's query rows and
// keys never cross a sequence's boundary, so its mask is the sequence's own (per-sequence
// positions) and no element is masked for belonging to another sequence. One CTA of THREADS builds,
// before the forward kernel runs (no host synchronisation); each plan holds a builder of each width in
// BUILD_WIDTHS and a call launches the narrowest that holds its sequences (attngen/families/varlen_tiles.py
// build_threads): the build is a chain of block-wide scans and barriers over a few values, each link
// longer the wider the CTA, and a width fixed at compile time keeps its loops unrolled (docs/perf-notes.md
// "The tile builder as wide as its sequences"):
// - the segment table: segment 0 the rows before the first sequence, 1 + s sequence s, and
//   num_seqs + 1 the rows after the last; each {first row, rows, first key, keys}. Sequence s
//   covers [max(cu_q[0..s]), max(cu_q[0..s+1])) clipped to [0, Sq) (and likewise its keys): for
//   nondecreasing cu_seqlens the sequence itself, for any other values disjoint ranges inside the
//   tensors. Rows outside every sequence see no key (output 0; LSE -inf, or the sink's logit).
// - the tile list: {segment, query block} per entry, sorted by the key blocks it visits (the
//   family's work_of), longest first (a counting sort over WORK_BUCKETS; ties in any order).
//   Slots past the entries, up to the list's capacity, hold {0, -1}: no tile.
// Shared by the forward families that tile per sequence (fwd_sm90 runs the entries once per query
// head in sections of heads; fwd_sm80 one CTA per entry and head). Workspace (p.tile_counter,
// ints): [0] a schedule's counter (zeroed), [1] entries in the list, then the segment table (int4,
// num_seqs + 2), then the list (int2, at most p.m_blocks entries): attngen/families/varlen_tiles.py.
// Needs Params members in_cu_seqlens_q/k (+ _s0), num_seqs, m_blocks (the list's capacity), Sq, Sk,
// tile_counter, and cfg::BLOCK_M.

namespace varlen {

constexpr int WORK_BUCKETS = 1024;  // key-block counts sorted apart; longer tiles share the last bucket
constexpr int NO_END = -2147483647 - 1;  // the identity of the ends' max-scan (NVRTC has no <climits>)

// A block-wide inclusive scan of v under op (whose identity is `none`); `total` gets the last thread's value.
template <int THREADS, class Op>
__device__ __forceinline__ int block_scan(int v, Op op, int none, int* warp_totals, int& total) {
    constexpr int warps = THREADS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        const int other = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v = op(other, v);
    }
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? warp_totals[lane] : none;
#pragma unroll
        for (int d = 1; d < warps; d *= 2) {  // lanes past the warps are never read
            const int other = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w = op(other, w);
        }
        warp_totals[lane] = w;
    }
    __syncthreads();
    if (warp > 0) v = op(warp_totals[warp - 1], v);
    total = warp_totals[warps - 1];
    __syncthreads();  // warp_totals is reused by the next scan
    return v;
}

__device__ __forceinline__ int query_blocks(int rows) { return (rows + cfg::BLOCK_M - 1) / cfg::BLOCK_M; }

// The list slot of a tile visiting `work` key blocks: the most work first.
__device__ __forceinline__ int bucket_of(int work) { return WORK_BUCKETS - 1 - min(work, WORK_BUCKETS - 1); }

// Where the workspace holds the segment table and the list (above).
constexpr int HEADER = 4;
template <class P>
__device__ __forceinline__ int4* segments(const P& p) {
    return reinterpret_cast<int4*>(p.tile_counter + HEADER);
}
template <class P>
__device__ __forceinline__ int2* tile_list(const P& p) {
    return reinterpret_cast<int2*>(segments(p) + p.num_seqs + 2);
}

// Pass 0 counts each bucket's tiles, pass 1 places them. Chunks of THREADS sequences: a
// scan of their query blocks gives each sequence its first tile, and the chunk's tiles are spread
// over the THREADS (a thread finds its tile's sequence by binary search), so one long sequence and
// many short ones cost alike.
// work_of(segment, query block): the key blocks that tile visits, by the family's own bounds.
template <int THREADS, class P, class WorkOf>
__device__ void build(const P& p, WorkOf work_of) {
    static_assert(THREADS % 32 == 0 && THREADS <= WORK_BUCKETS && WORK_BUCKETS % THREADS == 0, "whole warps, whole rounds of buckets");
    constexpr bool NARROW = THREADS < WORK_BUCKETS;  // pass 1 scans the buckets in rounds: from the longest tile's on
    __shared__ int count[WORK_BUCKETS];
    __shared__ int first_tile[THREADS + 1];
    __shared__ int warp_totals[32];
    __shared__ int carry[2];  // the ranges' ends so far: rows, keys
    __shared__ int most_work;  // NARROW: the most key blocks a tile visits
    // The current chunk's segments and the two gaps' (the global table is read back only across chunks):
    // each read back from global memory was a dependent round trip of the build, which the forward
    // kernel waits for (docs/perf-notes.md "The tile builder's round trips").
    __shared__ int4 chunk_seg[THREADS];
    __shared__ int4 gaps[2];
    const int tid = threadIdx.x;
    const int n = p.num_seqs;
    int my_most_work = 0;  // NARROW: the most key blocks this thread's tiles visit (pass 0)
    int4* seg = segments(p);
    int2* list = tile_list(p);
    auto add = [](int a, int b) { return a + b; };  // identity 0
    auto maximum = [](int a, int b) { return max(a, b); };  // identity NO_END
    auto q_end_of = [&](int s) { return s < n ? p.in_cu_seqlens_q[(long long)(s + 1) * p.in_cu_seqlens_q_s0] : 0; };
    auto k_end_of = [&](int s) { return s < n ? p.in_cu_seqlens_k[(long long)(s + 1) * p.in_cu_seqlens_k_s0] : 0; };
    // The first chunk's ends are requested together with the first start: one round trip for both.
    const int first_q_end = q_end_of(tid), first_k_end = k_end_of(tid);
    for (int i = tid; i < WORK_BUCKETS; i += THREADS) count[i] = 0;
    if (tid == 0) {
        most_work = 0;
        carry[0] = min(max(p.in_cu_seqlens_q[0], 0), p.Sq);
        carry[1] = min(max(p.in_cu_seqlens_k[0], 0), p.Sk);
        gaps[0] = make_int4(0, carry[0], 0, 0);  // rows before the first sequence: no key
        seg[0] = gaps[0];
    }
    __syncthreads();
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) {  // count[] becomes each bucket's next free slot, the most work first
            int total = 0;
            if constexpr (NARROW) {
                // Only the buckets from the longest tile's on hold tiles: scanned THREADS at a time (one
                // round for the documents' short tiles; the buckets' order is the list's).
#pragma unroll 1
                for (int b0 = bucket_of(most_work); b0 < WORK_BUCKETS; b0 += THREADS) {
                    const int b = b0 + tid, c = b < WORK_BUCKETS ? count[b] : 0;
                    int round_total;
                    const int slot = total + block_scan<THREADS>(c, add, 0, warp_totals, round_total) - c;
                    if (b < WORK_BUCKETS) count[b] = slot;
                    total += round_total;
                }
            } else {
                const int c = count[tid];
                count[tid] = block_scan<THREADS>(c, add, 0, warp_totals, total) - c;
            }
            if (tid == 0) p.tile_counter[1] = min(total, p.m_blocks);
            // The slots past the entries read as none (query block -1): a CTA reading its slot
            // needs no count first (fwd_sm80), and no slot is left uninitialised.
            for (int i = total + tid; i < p.m_blocks; i += THREADS) list[i] = make_int2(0, -1);
            __syncthreads();
        }
        // Chunk c of sequences: thread tid holds sequence s = c + tid.
#pragma unroll 1
        for (int c = 0; c < n; c += THREADS) {
            const int s = c + tid;
            int4 mine = make_int4(0, 0, 0, 0);
            if (pass == 0) {
                const int q_end = c == 0 ? first_q_end : q_end_of(s);
                const int k_end = c == 0 ? first_k_end : k_end_of(s);
                int total;
                const int q1 = min(max(block_scan<THREADS>(q_end, maximum, NO_END, warp_totals, total), carry[0]), p.Sq);
                const int k1 = min(max(block_scan<THREADS>(k_end, maximum, NO_END, warp_totals, total), carry[1]), p.Sk);
                // Each sequence starts where the one before ends (first_tile is borrowed to pass the ends).
                first_tile[tid] = q1;
                __syncthreads();
                const int prev_q = tid == 0 ? carry[0] : first_tile[tid - 1];
                __syncthreads();
                first_tile[tid] = k1;
                __syncthreads();
                const int prev_k = tid == 0 ? carry[1] : first_tile[tid - 1];
                mine = make_int4(prev_q, q1 - prev_q, prev_k, k1 - prev_k);
                if (s < n) seg[1 + s] = mine;
                __syncthreads();
                if (tid == min(THREADS, n - c) - 1) {
                    carry[0] = q1;
                    carry[1] = k1;
                }
            } else if (n <= THREADS) {
                mine = chunk_seg[tid];  // one chunk: still there from pass 0
            } else if (s < n) {
                mine = seg[1 + s];
            }
            chunk_seg[tid] = mine;  // read by the tile loop below, after the scan's barriers
            int chunk_tiles;
            const int blocks = s < n ? query_blocks(mine.y) : 0;
            first_tile[tid + 1] = block_scan<THREADS>(blocks, add, 0, warp_totals, chunk_tiles);
            if (tid == 0) first_tile[0] = 0;
            __syncthreads();
#pragma unroll 1
            for (int e = tid; e < chunk_tiles; e += THREADS) {
                int lo = 0, hi = THREADS;  // the last sequence whose first tile is <= e
                while (hi - lo > 1) {
                    const int mid = (lo + hi) / 2;
                    if (first_tile[mid] <= e) lo = mid; else hi = mid;
                }
                const int m_block = e - first_tile[lo];
                const int work = work_of(chunk_seg[lo], m_block);
                const int bucket = bucket_of(work);
                if (pass == 0) {
                    atomicAdd(&count[bucket], 1);
                    if constexpr (NARROW) my_most_work = max(my_most_work, work);
                } else {
                    const int slot = atomicAdd(&count[bucket], 1);
                    if (slot < p.m_blocks) list[slot] = make_int2(1 + c + lo, m_block);
                }
            }
            __syncthreads();
        }
        if (NARROW && pass == 0) {  // one shared atomic a warp: every thread's on one address serialised (~1 us)
            const int warp_most = __reduce_max_sync(0xffffffffu, my_most_work);
            if (tid % 32 == 0) atomicMax(&most_work, warp_most);
        }
        // The rows before the first sequence and after the last: no key, the least work.
        if (tid == 0 && pass == 0) {
            gaps[1] = make_int4(carry[0], p.Sq - carry[0], carry[1], 0);
            seg[n + 1] = gaps[1];
        }
        __syncthreads();
        for (int g = 0; g < 2; ++g) {
            const int which = g == 0 ? 0 : n + 1;
            const int4 gap = gaps[g];
            for (int m = tid; m < query_blocks(gap.y); m += THREADS) {
                const int slot = atomicAdd(&count[bucket_of(0)], 1);
                if (pass == 1 && slot < p.m_blocks) list[slot] = make_int2(which, m);
            }
        }
        __syncthreads();
    }
    if (tid == 0) p.tile_counter[0] = 0;  // the dynamic schedule's counter
}

}  // namespace varlen
