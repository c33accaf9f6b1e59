// ---- flash_decode.cuh: split-KV decoding over a paged (or contiguous) KV cache, mma.sync ----
// Needs, from the rendered template: struct DecodeParams, namespace cfg { HEAD_DIM, BLOCK_M, BLOCK_N,
// NUM_WARPS, NUM_STAGES, GQA_RATIO, PAGED, TMA, WHOLE_PAGES, IS_BF16, elem_t }, namespace mask { Bounds, bounds,
// visible } (attngen/cuda/mask.cuh.j2), namespace score { MODIFIED, modify, finish_row }
// (score_mod.cuh.j2), and hopper.cuh (mbarriers and tensor-map loads with TMA; the combine's early launch).
//
// One CTA: one (kv head and row tile, split, sequence). Its BLOCK_M rows are the query heads of the kv
// head times the new tokens (row r: token r / GQA_RATIO, head kv_head * GQA_RATIO + r % GQA_RATIO),
// so every cached K/V byte is read once per row tile. Every warp holds all the rows and takes its own
// BLOCK_N / NUM_WARPS keys of each loaded block: the warps' softmax states merge through shared
// memory at the end. With more than one split, each CTA writes fp32 partials and their LSE to the
// workspace and the combine kernel merges the splits through their LSEs.
//
// K/V blocks sit in shared memory as TMA's 128-byte swizzle lays them out: each row split into
// 64-column sub-tiles of 128 bytes, a row's 16-byte chunk c stored at chunk c ^ (row % 8), so the
// ldmatrix reads of 8 rows hit 8 different bank groups. They arrive by cp.async (16 bytes per thread
// and instruction; the cp.async path writes the swizzle itself) or, with TMA (sm_90), as tensor-map
// boxes completing on a per-stage mbarrier: a few instructions per block, and bytes in flight not
// bounded by the SM's load queues. p.box_rows picks per call: 0 for cp.async (a layout TMA cannot
// describe, pages whose size shares fewer than 8 rows with BLOCK_N), else the box's rows.

namespace fd {

using namespace cfg;

constexpr int THREADS = NUM_WARPS * 32;
#define NEG_INF (-__int_as_float(0x7f800000))
constexpr int MT = BLOCK_M / 16;              // m16 tiles of rows, held by every warp
constexpr int WARP_N = BLOCK_N / NUM_WARPS;   // keys of each loaded block one warp takes
constexpr int NT = WARP_N / 8;                // n8 tiles of S
constexpr int PK = WARP_N / 16;               // k16 steps of P.V
constexpr int DT = HEAD_DIM / 8;              // n8 tiles of O
constexpr int DK = HEAD_DIM / 16;             // k16 steps of Q.K^T
constexpr int ROW = HEAD_DIM + 8;             // padded Q row (elements): ldmatrix free of bank conflicts
constexpr int ROW_BYTES = ROW * 2;
constexpr int CHUNKS = HEAD_DIM / 8;          // 16-byte chunks per row
constexpr int SUBTILES = (HEAD_DIM + 63) / 64;  // 64-column (128-byte) sub-tiles of a K/V row; d96's last half-empty
constexpr int SUBTILE_BYTES = BLOCK_N * 128;
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int KV_TILE_BYTES = SUBTILES * SUBTILE_BYTES;
constexpr int RING_BYTES = 2 * NUM_STAGES * KV_TILE_BYTES;
constexpr int TILE_BYTES = Q_TILE_BYTES + RING_BYTES;
constexpr int MERGE_ROW = HEAD_DIM + 4;       // fp32 row of one warp's O in the merge
constexpr int MERGE_BYTES = NUM_WARPS * BLOCK_M * (MERGE_ROW + 2) * 4;
// TMA's swizzle follows address bits, so the ring starts at a 1024-byte boundary (1 KB of slack);
// the stages' mbarriers sit after both the tiles and the merge (never reused as data).
constexpr int ALIGN_SLACK = TMA ? 1024 : 0;
constexpr int BARS_OFFSET = TILE_BYTES > MERGE_BYTES ? TILE_BYTES : MERGE_BYTES;
constexpr int SMEM_BYTES = ALIGN_SLACK + BARS_OFFSET + (TMA ? (8 * NUM_STAGES + 15) / 16 * 16 : 0);  // family.py smem_bytes()
// cp.async: 16-byte chunks of K (and of V) per thread and block, and how many of them the compiler
// may overlap: their addresses are computed ahead of the copies, 4 registers each, while O is live
// (16 at d256 would spill).
constexpr int COPIES = (BLOCK_N * CHUNKS + THREADS - 1) / THREADS;
constexpr int COPY_UNROLL = COPIES < 8 ? COPIES : 8;
// Paged cp.async: a refill reads the page ids of the block this many refills later. Ids read at key
// iteration it may come back only after the copies issued before them (blocks up to it + NUM_STAGES
// - 2); they are used at iteration it + IDS_AHEAD, which has waited for block it + IDS_AHEAD: so at
// least NUM_STAGES - 2 ahead.
constexpr int IDS_AHEAD = NUM_STAGES > 3 ? NUM_STAGES - 2 : 1;
constexpr int MIN_BOX_ROWS = 8;               // family.py MIN_BOX_ROWS: at most BLOCK_N / 8 boxes per block
constexpr float LOG2E = 1.4426950408889634f;
// Q fragments stay in registers up to d128; at d256 they are re-read from shared memory per k16
// step, which leaves the registers to O (128 per thread for 16 rows).
constexpr bool Q_IN_REGS = HEAD_DIM <= 128;

static_assert(WARP_N % 16 == 0, "each warp takes whole k16 steps of keys");
static_assert(BLOCK_N / MIN_BOX_ROWS <= 32, "a paged block's boxes are one per lane of warp 0");
static_assert(BLOCK_M % 16 == 0 && HEAD_DIM % 16 == 0 && NUM_STAGES >= 2, "tile shapes");
static_assert(!WHOLE_PAGES || (PAGED && !TMA), "pages of whole blocks: a paged cp.async plan (family.py whole_pages)");

using Params = DecodeParams;  // generated from the family's argument list (family.py)

// A development timeline (bench/decode_cta_timeline.py defines ATTNGEN_TRACE): per split-kernel CTA,
// thread 0 stamps the SM clock at the points of DecodeEvent, the global timer at its entry and end (the
// SM clocks are not aligned across SMs), its SM and its key-block count, and the clock as each of its first
// TRACE_BLOCKS key blocks has landed. Each stamp waits for the value it is given (`after`), so a stamp
// after a load marks that load's return.
enum DecodeEvent { EV_ENTRY, EV_WAITED, EV_LENGTH, EV_IDS, EV_FIRST_BLOCK, EV_LAST_BLOCK, EV_MERGED, EV_STORED, EV_GT_ENTRY,
                   EV_GT_END, EV_SM, EV_BLOCKS, EV_ISSUED0, EV_ISSUED, TRACE_EVENTS };
#ifdef ATTNGEN_TRACE
constexpr int TRACE_CTAS = 4096, TRACE_BLOCKS = 64;
__device__ long long attngen_decode_trace[TRACE_CTAS][TRACE_EVENTS + TRACE_BLOCKS];
__device__ __forceinline__ void trace_store(int event, long long value) {
    const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x == 0 && cta < TRACE_CTAS && event < TRACE_EVENTS + TRACE_BLOCKS)
        attngen_decode_trace[cta][event] = value;
}
// The SM clock (EV_GT_ENTRY, EV_GT_END: the global timer) once `after` is ready.
__device__ __forceinline__ void trace(DecodeEvent event, int after = 0) {
    long long value;
    if (event == EV_GT_ENTRY || event == EV_GT_END)
        asm volatile("add.s32 %1, %1, 0;\n\tmov.u64 %0, %%globaltimer;\n" : "=l"(value), "+r"(after));
    else
        asm volatile("add.s32 %1, %1, 0;\n\tmov.u64 %0, %%clock64;\n" : "=l"(value), "+r"(after));
    trace_store(event, value);
}
__device__ __forceinline__ int smid() {
    int id;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
    return id;
}
__device__ __forceinline__ void trace_block(int it) { trace_store(TRACE_EVENTS + it, clock64()); }
#else
__device__ __forceinline__ void trace_store(int, long long) {}
__device__ __forceinline__ void trace_block(int) {}
__device__ __forceinline__ void trace(DecodeEvent, int = 0) {}
__device__ __forceinline__ int smid() { return 0; }
#endif

// The sequence's cache length, or -1 when it is outside [0, capacity]: the kernels then write NaN
// for its rows rather than read past the cache (a bad length must not pass silently).
__device__ __forceinline__ int cache_len(const Params& p, int batch) {
    const int n = p.seqlens[batch];
    return n >= 0 && n <= p.capacity ? n : -1;
}

// p.box_rows where the plan loads by TMA (its parameter struct has the tensor maps), else 0.
template <class P>
__device__ __forceinline__ int tma_box_rows(const P& p) {
    if constexpr (TMA) return p.box_rows;
    else return 0;
}

// The keys of the CTA's rows (r0: its first row), by the mask's bounds over their tokens.
template <class P>
__device__ __forceinline__ mask::Bounds cta_bounds(const P& p, int Sk, int batch, int kv_head, int r0) {
    const int t_first = r0 / GQA_RATIO, t_end = min(p.Sq, (r0 + BLOCK_M + GQA_RATIO - 1) / GQA_RATIO);
    return mask::bounds(t_first, t_end, p.Sq, Sk, batch, kv_head * GQA_RATIO, p);
}

// The key blocks [begin, begin + blocks) one split visits: the bounds cut into runs of blocks per
// split that differ by at most one block (a CTA's time is its longest split's).
struct Span {
    int begin, blocks;
};
template <class P>
__device__ __forceinline__ Span split_span(const P& p, const mask::Bounds& bounds, int split) {
    const int all_begin = bounds.kv_begin / BLOCK_N;
    const int all_end = bounds.kv_end > bounds.kv_begin ? (bounds.kv_end + BLOCK_N - 1) / BLOCK_N : all_begin;
    const int all_blocks = all_end - all_begin;
    // s * all_blocks / num_splits, as s * (all_blocks / n) + s * (all_blocks % n) / n: exact, in 32 bits
    // (s * (all_blocks % n) < n^2 <= MAX_SPLITS^2), where the 64-bit division was a ~70-instruction call
    // on the CTA's start.
    const int n = p.num_splits, per = all_blocks / n, extra = all_blocks % n;
    const int begin = split * per + split * extra / n, end = (split + 1) * per + (split + 1) * extra / n;
    return {all_begin + begin, end - begin};
}

// Paged TMA plans launched early (sm_90): the CTA may start while the kernel before it still runs (the
// previous decode step's combine, or any kernel that lets its dependents start, even only at its end).
// Before its wait, warp 0 reads the length and the ring's first page ids as hints, past L1 (the reads
// after the wait must not find a stale line there), for two uses:
//
// Blocks into L2 (prefetch_first_blocks): it asks L2 for the ring's first blocks
// (`cp.async.bulk.prefetch.tensor.L2`; TMA drops boxes outside the tensor, so a stale or bad id fetches
// nothing or a wasted box, never a fault), so that the loads after the wait find them there; L2 is where
// the GPU's writes meet, so a prefetched line the previous kernel writes afterwards is not stale.
//
// Guessed page-id places (PageGuess). The paged CTA's start had one round trip more than the contiguous
// cache's: the length, then the ring's first page ids, then the first boxes. The ids' places follow from
// the split's span, which follows from the length: taken from the hinted length, they let the ids be
// read right after the wait, beside the length, instead of after it. Only the places come from the hint;
// the ids are read after the wait, and they stand only where the length read there gives the same span
// (a length that moved by a token mostly does not). Every place below the capacity lies inside the
// sequence's page-table row, whatever the hint.
//
// Measured: docs/perf-notes.md "Guessed page ids" (and its correction of "Paged blocks into L2 before the
// wait", whose timings were of cp.async kernels). Not in cp.async plans (the default): there a hinted
// length adds its own round trip and ~300 instructions before the wait, paid in full by a CTA that starts
// only as the kernel before it ends: the trial gained back to back and lost behind an ordinary kernel.
// Nor for masks whose bounds read runtime inputs (not PURE).
struct PageGuess {
    Span span;               // the split's span by the hinted length; begin -1: no guess
    int index[NUM_STAGES];   // the entry of the sequence's page-table row this lane reads per block, or -1
};
__device__ __forceinline__ PageGuess no_guess() {
    PageGuess guess;
    guess.span = {-1, 0};
#pragma unroll
    for (int b = 0; b < NUM_STAGES; ++b) guess.index[b] = -1;
    return guess;
}
template <class P>
__device__ __forceinline__ PageGuess prefetch_first_blocks(const P& p, int batch, int kv_head, int r0, int split, int lane) {
    PageGuess guess = no_guess();
    if constexpr (TMA && PAGED && mask::PURE) {
        const int n = __ldcg(p.seqlens + batch);
        if (n < 0 || n > p.capacity) return guess;
        guess.span = split_span(p, cta_bounds(p, n, batch, kv_head, r0), split);
        const int rows = p.box_rows, first = guess.span.begin * BLOCK_N + lane * rows;  // lane j: a block's j-th box
        bool in[NUM_STAGES];
        int page[NUM_STAGES];
#pragma unroll
        for (int b = 0; b < NUM_STAGES; ++b) {  // every id requested before any is used
            const int key = first + b * BLOCK_N;
            const bool listed = b < guess.span.blocks && lane * rows < BLOCK_N && key < p.capacity;
            guess.index[b] = listed ? key / p.page_size : -1;
            in[b] = listed && key < n;
            page[b] = in[b] ? __ldcg(p.page_table + (i64)batch * p.pt_sb + guess.index[b]) : 0;
        }
#pragma unroll
        for (int b = 0; b < NUM_STAGES; ++b) {
            if (!in[b]) continue;
            const int slot = (first + b * BLOCK_N) % p.page_size;
#pragma unroll
            for (int sub = 0; sub < SUBTILES; ++sub) {
                tma_prefetch_l2(&p.tmap_k, sub * 64, slot, kv_head, page[b]);
                tma_prefetch_l2(&p.tmap_v, sub * 64, slot, kv_head, page[b]);
            }
        }
    } else {
        (void)p; (void)batch; (void)kv_head; (void)r0; (void)split; (void)lane;
    }
    return guess;
}

// A template so that the TMA branches (`if constexpr (TMA)`), which name the tensor maps, are
// dropped unchecked from a cp.async plan, whose parameter struct has none.
template <class P>
__device__ __forceinline__ void flash_decode(const P& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    // The ring first (stage s: K at sKV + 2s*KV, V at sKV + (2s+1)*KV), then the Q tile.
    const u32 sKV = ALIGN_SLACK ? (smem_u32(smem) + ALIGN_SLACK - 1) / ALIGN_SLACK * ALIGN_SLACK : smem_u32(smem);
    const u32 sQ = sKV + RING_BYTES;
    const u32 bars = sKV + BARS_OFFSET;  // TMA: one mbarrier per stage, a phase per block it holds
    const bool tma = tma_box_rows(p) > 0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // Heads vary fastest in launch order, so CTAs running together read the same tokens of every kv
    // head (measured neutral on the H100 against splits fastest; x also lifts the 65535 limit).
    const int split = blockIdx.y, batch = blockIdx.z;
    const int Sq = p.Sq, rows = Sq * GQA_RATIO;
    const int row_tiles = (rows + BLOCK_M - 1) / BLOCK_M;
    const int kv_head = blockIdx.x / row_tiles, r0 = (blockIdx.x % row_tiles) * BLOCK_M;
    trace(EV_ENTRY);
    trace(EV_GT_ENTRY);
    PageGuess guess = no_guess();
    if (tma && warp == 0) guess = prefetch_first_blocks(p, batch, kv_head, r0, split, lane);
    // Launched early (sm_90: family.py launches): the CTA was scheduled while the kernel before it in the
    // stream finished; every read of an input and every write waits for that kernel's writes here.
    pdl_wait();
    trace(EV_WAITED);
    const int len = cache_len(p, batch);
    trace(EV_LENGTH, len);
    int guessed_ids[NUM_STAGES];  // paged TMA, warp 0: the guessed entries' ids, read beside the length
#pragma unroll
    for (int b = 0; b < NUM_STAGES; ++b)
        guessed_ids[b] = PAGED && guess.index[b] >= 0 ? p.page_table[(i64)batch * p.pt_sb + guess.index[b]] : -1;
    // A bad length, or a plan for pages of whole blocks given another page size (runtime/decode.py never
    // does that: it picks the plan by the call's page size), reads nothing: Sk -1, which every row fails
    // and the merge turns into NaN (in Sk's sign, not a flag of its own: a flag live across the loop was
    // spilled at d96). `bad`: bad page ids met.
    const int Sk = len < 0 || (WHOLE_PAGES && p.page_size % BLOCK_N != 0) ? -1 : len;
    bool bad = false;
    const float score_log2 = score::MODIFIED ? LOG2E : p.scale_log2;

    const mask::Bounds bounds = cta_bounds(p, max(Sk, 0), batch, kv_head, r0);
    const Span span = split_span(p, bounds, split);
    const int n_begin = span.begin, n_blocks = span.blocks;
    // Paged TMA: the guessed page ids stand where the length gives the hint's span: the same table entries
    // then (a box past the length is dropped by tma_page either way).
    const bool guessed = PAGED && guess.span.begin == n_begin && guess.span.blocks == n_blocks;

    const elem_t* k_head = p.k + kv_head * p.k_sh;
    const elem_t* v_head = p.v + kv_head * p.v_sh;
    // A cached row's offsets in K and V, or false when it is past the cache or its page id is bad (a
    // bad page id is never read: the sequence's rows become NaN).
    auto row_offsets = [&](int n, i64& k_off, i64& v_off) {
        k_off = v_off = 0;
        if (n >= Sk) return false;
        if constexpr (PAGED) {
            // The page table row holds capacity / page_size entries, and n < Sk <= capacity.
            const int page = p.page_table[(i64)batch * p.pt_sb + n / p.page_size];
            const int slot = n % p.page_size;
            if ((unsigned)page >= (unsigned)p.num_pages) {
                bad = true;
                return false;
            }
            k_off = (i64)page * p.k_sp + (i64)slot * p.k_ss;
            v_off = (i64)page * p.v_sp + (i64)slot * p.v_ss;
        } else {
            k_off = (i64)batch * p.k_sp + (i64)n * p.k_ss;
            v_off = (i64)batch * p.v_sp + (i64)n * p.v_ss;
        }
        return true;
    };
    // Paged: the page ids a block touches (at most 32, so pages of more than about BLOCK_N / 30 rows;
    // tiny pages take row_offsets' per-row lookup) sit in the lanes of every warp, lane j holding the
    // block's j-th page, and each row takes its id by a shuffle. A refill first reads the ids of the
    // block IDS_AHEAD refills later, then issues its copies: a load issued behind a thread's copies
    // seems to come back only after them (ids read after the copies: 64 x 16384 6% slower on the H200).
    const bool lane_pages = PAGED && !WHOLE_PAGES && (BLOCK_N - 1) / p.page_size + 2 <= 32 && p.page_size + BLOCK_N <= (1 << 22);
    // A row's page within its block, (slot + 0.5) * (1 / page_size) rounded down, every step rounded
    // to nearest in fp32: exact while slot < page_size + BLOCK_N <= 2^22 (checked exhaustively up to
    // page size 4096, sampled beyond), and no integer division per row.
    const float inv_page_size = __frcp_rn((float)p.page_size);
    auto block_pages = [&](int it) {  // this lane's page id of block `it`, or -1 (none, or unlisted)
        const int n0 = (n_begin + it) * BLOCK_N, first = n0 / p.page_size;
        const int last = (min(n0 + BLOCK_N, Sk) - 1) / p.page_size;  // the last page with a listed row
        if (!lane_pages || it >= n_blocks || n0 >= Sk || first + lane > last) return -1;
        return p.page_table[(i64)batch * p.pt_sb + first + lane];
    };
    // cp.async: every thread copies 16-byte chunks of block `it` into their swizzled places, a row's
    // offsets from `offsets(n0, r, real, k_off, v_off)` (false: the row is zero-filled). Every thread
    // runs every chunk (`real`: the chunk exists), so `offsets` may shuffle. Each way of finding a row
    // is its own straight-line loop: runtime branches per chunk kept ptxas from overlapping the chunks'
    // address arithmetic (paged decode ran at 0.6x the contiguous cache's speed with them).
    auto copy_block = [&](int it, auto offsets) {
        const int stage = it % NUM_STAGES, n0 = (n_begin + it) * BLOCK_N;
        const u32 dk = sKV + 2 * stage * KV_TILE_BYTES, dv = dk + KV_TILE_BYTES;
#pragma unroll(COPY_UNROLL)
        for (int i = 0; i < COPIES; ++i) {
            const int c = threadIdx.x + i * THREADS;
            const int r = c / CHUNKS, chunk = c % CHUNKS;
            const bool real = (BLOCK_N * CHUNKS) % THREADS == 0 || c < BLOCK_N * CHUNKS;
            i64 k_off, v_off;
            const bool in = offsets(n0, r, real, k_off, v_off);
            if (real) {
                const u32 at = (chunk / 8) * SUBTILE_BYTES + r * 128 + ((chunk % 8) ^ (r % 8)) * 16;
                // Rows past the cache come back as zeros: never NaN into the tensor cores.
                cp_async_16(dk + at, k_head + k_off + chunk * 8, in);
                cp_async_16(dv + at, v_head + v_off + chunk * 8, in);
            }
        }
        cp_async_commit();
    };
    // `ids`: block_pages(it) (unused without lane_pages).
    auto load_kv = [&](int it, int ids) {
        if (lane_pages) {
            const int at_page = (n_begin + it) * BLOCK_N % p.page_size;  // the block's first row's slot
            copy_block(it, [&](int n0, int r, bool real, i64& k_off, i64& v_off) {
                const int j = __float2int_rd(__fmul_rn(__fadd_rn((float)(at_page + r), 0.5f), inv_page_size));
                const int slot = at_page + r - j * p.page_size;
                const int page = __shfl_sync(0xffffffffu, ids, j);
                const bool listed = real && n0 + r < Sk, valid = (unsigned)page < (unsigned)p.num_pages;
                bad |= listed && !valid;  // a bad page id is never followed: the sequence's rows become NaN
                const i64 at = valid ? page : 0;
                k_off = at * p.k_sp + (i64)slot * p.k_ss;
                v_off = at * p.v_sp + (i64)slot * p.v_ss;
                return listed && valid;
            });
        } else {
            copy_block(it, [&](int n0, int r, bool real, i64& k_off, i64& v_off) {
                k_off = v_off = 0;
                return real && row_offsets(n0 + r, k_off, v_off);
            });
        }
    };
    // Pages of whole blocks (WHOLE_PAGES: the page size a multiple of BLOCK_N, family.py whole_pages): a
    // block lies in one page, so its rows' offsets are the contiguous cache's from its first row, with no
    // per-row page arithmetic or shuffle; and the ids come 32 pages at a time: lane j of every warp holds
    // page w0 + j's id (`window`), the next 32 (`next_window`) read when the window last moved, 32 pages
    // before their use. One page-table load per 32 pages instead of one per block: with both, pages of 64
    // ran as fast as the contiguous cache's code on the same memory (docs/perf-notes.md "Pages of whole blocks").
    // The cursor (page, slot) is the next block to load; the loads go in block order.
    const int last_page = Sk > 0 ? (Sk - 1) / p.page_size : -1;  // the last page with a listed row
    auto window_ids = [&](int w) {  // lane j: the id of the sequence's page w + j, or -1 past the listed ones
        return WHOLE_PAGES && w + lane <= last_page ? p.page_table[(i64)batch * p.pt_sb + w + lane] : -1;
    };
    int cursor_page = 0, cursor_slot = 0, w0 = 0, window = -1, next_window = -1;
    auto load_whole_page_block = [&](int it) {
        if (cursor_page - w0 == 32) {  // the cursor moves at most one page a block
            w0 += 32;
            window = next_window;
            next_window = window_ids(w0 + 32);  // before the copies (see lane_pages)
        }
        const int page = __shfl_sync(0xffffffffu, window, cursor_page - w0);
        const bool valid = (unsigned)page < (unsigned)p.num_pages;
        bad |= !valid;  // a bad page id is never followed: the sequence's rows become NaN
        const i64 at = valid ? page : 0;
        const i64 k_block = at * p.k_sp + (i64)cursor_slot * p.k_ss, v_block = at * p.v_sp + (i64)cursor_slot * p.v_ss;
        copy_block(it, [&](int n0, int r, bool real, i64& k_off, i64& v_off) {
            k_off = k_block + (i64)r * p.k_ss;
            v_off = v_block + (i64)r * p.v_ss;
            return real && valid && n0 + r < Sk;
        });
        cursor_slot += BLOCK_N;
        if (cursor_slot == p.page_size) {
            cursor_slot = 0;
            ++cursor_page;
        }
    };
    // TMA, issued by warp 0. Contiguous: one box of BLOCK_N rows per sub-tile of K and of V. Paged:
    // lane j takes the block's j-th run of p.box_rows rows (inside one page, since box_rows divides
    // the page size and BLOCK_N); `page` is its page id, read one block ahead so the table's latency
    // stays off the issue path; a run wholly past the length is not issued (its id may be garbage).
    // Rows past the length inside an issued box land too: the block's wait zeroes V there.
    // Both walk the blocks in order (tma_page from block 0 one ahead of load_kv_tma), each with a cursor on
    // this lane's box: its page (index into the sequence's page-table row) and slot, stepped a block at a
    // time rather than divided out per block (page sizes are any 1..256): the two divisions were ~50 of
    // warp 0's refill instructions, which the other warps then waited for at the loop's barrier.
    struct PageCursor {
        int page, slot;
    };
    const int page_size = PAGED ? p.page_size : 1, step_pages = BLOCK_N / page_size, step_slots = BLOCK_N % page_size;
    const int box0 = n_begin * BLOCK_N + lane * tma_box_rows(p);  // this lane's first key
    PageCursor id_at{box0 / page_size, box0 % page_size}, load_at = id_at;
    auto advance = [&](PageCursor& c) {
        c.page += step_pages;
        c.slot += step_slots;
        if (c.slot >= page_size) {
            c.slot -= page_size;
            ++c.page;
        }
    };
    auto tma_page = [&](int it, bool use_guess = false, int guessed_id = -1) {  // use_guess: the id already read
        const int rows = tma_box_rows(p), n = (n_begin + it) * BLOCK_N + lane * rows;
        const PageCursor at = id_at;  // block `it`'s
        advance(id_at);
        if (!PAGED || it >= n_blocks || lane * rows >= BLOCK_N || n >= Sk) return -1;
        return use_guess ? guessed_id : p.page_table[(i64)batch * p.pt_sb + at.page];
    };
    auto load_kv_tma = [&](int it, int page) {
        if constexpr (TMA) {  // a cp.async plan's parameters have no tensor maps
            const int stage = it % NUM_STAGES, n0 = (n_begin + it) * BLOCK_N;
            const u32 dk = sKV + 2 * stage * KV_TILE_BYTES, dv = dk + KV_TILE_BYTES, bar = bars + 8 * stage;
            if constexpr (PAGED) {
                const int rows = p.box_rows, n = n0 + lane * rows, slot = load_at.slot;  // block `it`'s
                advance(load_at);
                const bool listed = lane * rows < BLOCK_N && n < Sk;
                const bool in = listed && (unsigned)page < (unsigned)p.num_pages;
                bad |= listed && !in;  // a bad page id is never followed: the sequence's rows become NaN
                const int boxes = __popc(__ballot_sync(0xffffffffu, in));
                if (lane == 0) mbar_expect_tx(bar, boxes * rows * 128 * SUBTILES * 2);
                __syncwarp();  // the bytes are announced before any box can complete
                if (in) {
#pragma unroll
                    for (int sub = 0; sub < SUBTILES; ++sub) {
                        tma_load(dk + sub * SUBTILE_BYTES + lane * rows * 128, &p.tmap_k, bar, sub * 64, slot, kv_head, page);
                        tma_load(dv + sub * SUBTILE_BYTES + lane * rows * 128, &p.tmap_v, bar, sub * 64, slot, kv_head, page);
                    }
                }
            } else {
                if (lane != 0) return;
                mbar_expect_tx(bar, KV_TILE_BYTES * 2);  // rows past the capacity count too (zero-filled)
#pragma unroll
                for (int sub = 0; sub < SUBTILES; ++sub) {
                    tma_load(dk + sub * SUBTILE_BYTES, &p.tmap_k, bar, sub * 64, n0, kv_head, batch);
                    tma_load(dv + sub * SUBTILE_BYTES, &p.tmap_v, bar, sub * 64, n0, kv_head, batch);
                }
            }
        }
    };

    // TMA: warp 0 initialises the stages' mbarriers and requests the first NUM_STAGES blocks (their
    // page ids all in flight before the first is used), then reads the next block's page ids.
    int next_page = -1;  // TMA, paged: this lane's page id for the next block to issue
    auto start_tma_ring = [&]() {
        if constexpr (TMA) {
            if (warp != 0) return;
            if (lane == 0) {
#pragma unroll
                for (int s = 0; s < NUM_STAGES; ++s) mbar_init(bars + 8 * s, 1);  // lane 0's expect_tx arrives
                mbar_init_fence();
            }
            __syncwarp();
            int pages[NUM_STAGES];
#pragma unroll
            for (int s = 0; s < NUM_STAGES; ++s) pages[s] = tma_page(s, guessed, guessed_ids[s]);
#pragma unroll
            for (int s = 0; s < NUM_STAGES; ++s)
                if (s < n_blocks) load_kv_tma(s, pages[s]);
            next_page = tma_page(NUM_STAGES);
        }
    };
    // TMA brought whole boxes: once block `it` has landed, V rows past the length (whatever the page
    // holds there, or an older block's rows where no box was issued) become zeros, as cp.async's are
    // (0 x NaN is NaN in P.V).
    auto wait_tma_block = [&](int it, int stage) {
        if constexpr (TMA) {
            mbar_wait(bars + 8 * stage, (it / NUM_STAGES) & 1);
            const int n0 = (n_begin + it) * BLOCK_N;
            if (n0 + BLOCK_N > Sk) {
                const u32 dv = sKV + (2 * stage + 1) * KV_TILE_BYTES;
                for (int c = threadIdx.x; c < BLOCK_N * 8 * SUBTILES; c += THREADS) {
                    const int r = c / (8 * SUBTILES), sub = c % (8 * SUBTILES) / 8, chunk = c % 8;
                    if (n0 + r >= Sk) st_shared_zero16(dv + sub * SUBTILE_BYTES + r * 128 + chunk * 16);
                }
                fence_async_smem();  // ordered before any later box into this stage
            }
        }
    };

    // Q: rows past Sq * GQA_RATIO are zeros (never stored).
    for (int c = threadIdx.x; c < BLOCK_M * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8, row = r0 + r;
        const bool in = row < rows;
        const int token = in ? row / GQA_RATIO : 0, head = kv_head * GQA_RATIO + (in ? row % GQA_RATIO : 0);
        cp_async_16(sQ + r * ROW_BYTES + col * 2, p.q + batch * p.q_sb + token * p.q_ss + head * p.q_sh + col, in);
    }
    cp_async_commit();
    // Every stage of the ring is filled at once (a split of up to NUM_STAGES blocks requests all of
    // them before the first lands); a stage is refilled once every warp has read its block. (Reading
    // the ring's page ids before Q's copies measured no faster.)
    int ahead_ids[IDS_AHEAD];  // cp.async, lane_pages: block_pages of the next IDS_AHEAD blocks to load
    if (tma) {
        start_tma_ring();
        trace(EV_IDS);
    } else if constexpr (WHOLE_PAGES) {
        // Unrolled (unlike the per-row plan's start where a thread copies 8+ chunks): the three blocks take
        // ~900 SASS instructions at d128 here, against the per-row start's ~6,400 when it was unrolled.
        const int key0 = n_begin * BLOCK_N;
        cursor_page = w0 = key0 / p.page_size;
        cursor_slot = key0 - cursor_page * p.page_size;
        window = window_ids(w0);
        next_window = window_ids(w0 + 32);
        trace(EV_IDS, window);
#pragma unroll
        for (int s = 0; s < NUM_STAGES; ++s) {
            if (s < n_blocks) load_whole_page_block(s);
            else cp_async_commit();  // empty groups keep the wait counts uniform
            if (s == 0) trace(EV_ISSUED0);
        }
        trace(EV_ISSUED);
    } else {
        int ids[NUM_STAGES];
#pragma unroll
        for (int s = 0; s < NUM_STAGES; ++s) ids[s] = block_pages(s);
        trace(EV_IDS, ids[0]);
#pragma unroll
        for (int a = 0; a < IDS_AHEAD; ++a) ahead_ids[a] = block_pages(NUM_STAGES + a);
        auto start_block = [&](int s, int block_ids) {
            if (s < n_blocks) load_kv(s, block_ids);
            else cp_async_commit();  // empty groups keep the wait counts uniform
            if (s == 0) trace(EV_ISSUED0);
        };
        if constexpr (PAGED && COPIES >= 8) {
            // Not unrolled: each load_kv holds both ways of finding a row, 8 chunks each, and three copies of
            // it made the d128 paged kernel's start ~6,400 instructions long. Every CTA fetched them cold while
            // its first copies filled the memory system: its warps waited on instruction fetches (ncu: the
            // start's top stall, "no instruction"), took ~8 us to issue the ring (2 us contiguous) and the
            // first block landed ~10 us after the page ids. (Fewer chunks, d64 and d96: a shorter start, and
            // the loop's registers made ptxas spill under d64's 128-register cap, so it stays unrolled there.)
#pragma unroll 1
            for (int s = 0; s < NUM_STAGES; ++s) {
                int block_ids = ids[0];  // ids[s] without indexing the array at run time (registers)
#pragma unroll
                for (int k = 1; k < NUM_STAGES; ++k) block_ids = s == k ? ids[k] : block_ids;
                start_block(s, block_ids);
            }
        } else {
#pragma unroll
            for (int s = 0; s < NUM_STAGES; ++s) start_block(s, ids[s]);
        }
        trace(EV_ISSUED);
    }

    // This thread's rows: (m tile, half) -> token and query head; rows past the problem are padding.
    int row_token[MT][2], row_head[MT][2];
    bool row_real[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + mt * 16 + g + 8 * h;
            row_real[mt][h] = row < rows;
            row_token[mt][h] = row_real[mt][h] ? row / GQA_RATIO : 0;
            row_head[mt][h] = kv_head * GQA_RATIO + (row_real[mt][h] ? row % GQA_RATIO : 0);
        }

    const u32 q_lane = (((lane % 8) + 8 * ((lane / 8) % 2)) * ROW + 8 * (lane / 16)) * 2;
    // K and V (swizzled): this lane's row of its 8x8 matrix, and the bits its chunk is XOR-ed with (the
    // row's low 3 bits with the lane's chunk offset folded in: every other term is a multiple of 8 rows
    // and an even chunk, so chunk ^ row % 8 = even part ^ these bits).
    const u32 k_lane = ((lane % 8) + 8 * (lane / 16)) * 128;
    const u32 k_xor = ((lane / 8) % 2) ^ (lane % 8);
    const u32 v_lane = ((lane % 8) + 8 * ((lane / 8) % 2)) * 128;
    const u32 v_xor = (lane / 16) ^ (lane % 8);

    u32 q_frag[MT][Q_IN_REGS ? DK : 1][4];
    float o_acc[MT][DT][4];
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o_acc[mt][dt][i] = 0.f;
        row_max[mt][0] = row_max[mt][1] = NEG_INF;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    if (tma) cp_async_wait<0>();  // Q landed
    else cp_async_wait<NUM_STAGES>();  // Q landed (the groups after it are the ring's blocks)
    __syncthreads();  // Q, and with TMA the mbarriers' initialisation, visible to every thread
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < DK; ++kk) ldmatrix_x4(q_frag[mt][kk], sQ + q_lane + (mt * 16 * ROW + kk * 16) * 2);
    }

#pragma unroll 1
    for (int it = 0; it < n_blocks; ++it) {
        const int stage = it % NUM_STAGES;
        if (tma) {
            wait_tma_block(it, stage);
        } else {
            // Groups: Q, the ring's first NUM_STAGES blocks, then one per iteration from the second on,
            // so block `it` is group it + 1 and the groups after it number NUM_STAGES - 1, then - 2.
            if (it == 0) cp_async_wait<NUM_STAGES - 1>();
            else cp_async_wait<NUM_STAGES - 2>();
        }
        __syncthreads();  // block `it` landed for every thread; block it - 1's stage has been read
        if (it == 0) trace(EV_FIRST_BLOCK);
        if (it == n_blocks - 1) trace(EV_LAST_BLOCK);
        trace_block(it);
        if (it > 0) {
            if (tma) {
                if (warp == 0 && it - 1 + NUM_STAGES < n_blocks) {
                    load_kv_tma(it - 1 + NUM_STAGES, next_page);
                    next_page = tma_page(it + NUM_STAGES);
                }
            } else if (it - 1 + NUM_STAGES < n_blocks) {
                if constexpr (WHOLE_PAGES) {
                    load_whole_page_block(it - 1 + NUM_STAGES);
                } else {
                    const int ids = ahead_ids[0];
#pragma unroll
                    for (int a = 0; a + 1 < IDS_AHEAD; ++a) ahead_ids[a] = ahead_ids[a + 1];
                    ahead_ids[IDS_AHEAD - 1] = block_pages(it - 1 + NUM_STAGES + IDS_AHEAD);  // before the copies
                    load_kv(it - 1 + NUM_STAGES, ids);
                }
            } else {
                cp_async_commit();  // empty groups keep the wait counts uniform
            }
        }

        const u32 sK = sKV + 2 * stage * KV_TILE_BYTES + warp * WARP_N * 128, sV = sK + KV_TILE_BYTES;
        float s_acc[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s_acc[mt][nt][i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
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
                ldmatrix_x4(b, sK + (kk / 4) * SUBTILE_BYTES + np * 16 * 128 + k_lane + (((kk % 4) * 2) ^ k_xor) * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<IS_BF16>(s_acc[mt][2 * np], a[mt], b[0], b[1]);
                    mma_16816<IS_BF16>(s_acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }

        const int kw0 = (n_begin + it) * BLOCK_N + warp * WARP_N;  // this warp's first key
        if constexpr (score::MODIFIED) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int h = i / 2, k = kw0 + nt * 8 + 2 * t + (i % 2);
                        if (!score::READS_INPUTS || (row_real[mt][h] && k < Sk))  // in bounds for its inputs
                            s_acc[mt][nt][i] = score::modify(s_acc[mt][nt][i] * p.scale, row_token[mt][h], k, Sq, Sk,
                                                             batch, row_head[mt][h], p);
                    }
        }
        if (!(kw0 >= bounds.full_begin && kw0 + WARP_N <= bounds.full_end)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int h = i / 2, k = kw0 + nt * 8 + 2 * t + (i % 2);
                        if (!(k < Sk && row_real[mt][h] &&
                              mask::visible(row_token[mt][h], k, Sq, Sk, batch, row_head[mt][h], p)))
                            s_acc[mt][nt][i] = NEG_INF;
                    }
        }

        // Online softmax in the log2 domain (as flash_fwd.cuh): P stays in registers for P.V.
        u32 p_frag[MT][PK][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float ref[2], alpha[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = s_acc[mt][0][2 * h];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s_acc[mt][nt][2 * h], s_acc[mt][nt][2 * h + 1]));
                mx = fmaxf(row_max[mt][h], quad_max(mx) * score_log2);
                ref[h] = mx == NEG_INF ? 0.f : mx;
                alpha[h] = fast_exp2(row_max[mt][h] - ref[h]);
                row_max[mt][h] = mx;
                row_sum[mt][h] *= alpha[h];
            }
#pragma unroll
            for (int kk = 0; kk < PK; ++kk) {
                float e[2][4];
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        e[half][i] = fast_exp2(fmaf(s_acc[mt][2 * kk + half][i], score_log2, -ref[i / 2]));
                        row_sum[mt][i / 2] += e[half][i];
                    }
                p_frag[mt][kk][0] = pack2<IS_BF16>(e[0][0], e[0][1]);
                p_frag[mt][kk][1] = pack2<IS_BF16>(e[0][2], e[0][3]);
                p_frag[mt][kk][2] = pack2<IS_BF16>(e[1][0], e[1][1]);
                p_frag[mt][kk][3] = pack2<IS_BF16>(e[1][2], e[1][3]);
            }
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o_acc[mt][dt][0] *= alpha[0];
                o_acc[mt][dt][1] *= alpha[0];
                o_acc[mt][dt][2] *= alpha[1];
                o_acc[mt][dt][3] *= alpha[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < PK; ++kk)
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, sV + (dp / 4) * SUBTILE_BYTES + kk * 16 * 128 + v_lane + (((dp % 4) * 2) ^ v_xor) * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<IS_BF16>(o_acc[mt][2 * dp], p_frag[mt][kk], b[0], b[1]);
                    mma_16816<IS_BF16>(o_acc[mt][2 * dp + 1], p_frag[mt][kk], b[2], b[3]);
                }
            }
    }

    // The next kernel (the combine, or with one split the next step's split kernel; each launched early)
    // may start once every CTA is here: its launch and start-up then run under this grid's merges and
    // stores, without taking SM slots from the key loop.
    pdl_launch_dependents();
    // Merge the warps: each writes its rows' (max, sum) and unnormalised O to shared memory (the
    // ring, now idle), then every thread finishes 4 columns of one row at a time.
    cp_async_wait<0>();
    __syncthreads();
    float* merge_o = reinterpret_cast<float*>(smem);                          // [warp][row][MERGE_ROW]
    float* merge_ml = merge_o + NUM_WARPS * BLOCK_M * MERGE_ROW;                // [warp][row][2]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + g + 8 * h;
            const float sum = quad_sum(row_sum[mt][h]);
            if (t == 0) {
                merge_ml[(warp * BLOCK_M + r) * 2] = row_max[mt][h];
                merge_ml[(warp * BLOCK_M + r) * 2 + 1] = sum;
            }
            float* o_row = merge_o + (warp * BLOCK_M + r) * MERGE_ROW;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(o_row + dt * 8 + 2 * t) = make_float2(o_acc[mt][dt][2 * h], o_acc[mt][dt][2 * h + 1]);
        }
    const bool any_bad = __syncthreads_or(bad || Sk < 0);
    trace(EV_MERGED, any_bad);
    const float nan = __int_as_float(0x7fc00000);
    for (int c = threadIdx.x; c < BLOCK_M * (HEAD_DIM / 4); c += THREADS) {
        const int r = c / (HEAD_DIM / 4), col = (c % (HEAD_DIM / 4)) * 4, row = r0 + r;
        if (row >= rows) continue;
        const int token = row / GQA_RATIO, head = kv_head * GQA_RATIO + row % GQA_RATIO;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, merge_ml[(w * BLOCK_M + r) * 2]);
        const float ref = mx == NEG_INF ? 0.f : mx;
        float sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float scale = exp2f(merge_ml[(w * BLOCK_M + r) * 2] - ref);  // 0 for a warp that saw no key
            sum += merge_ml[(w * BLOCK_M + r) * 2 + 1] * scale;
            const float4 o = *reinterpret_cast<const float4*>(merge_o + (w * BLOCK_M + r) * MERGE_ROW + col);
            acc[0] += o.x * scale; acc[1] += o.y * scale; acc[2] += o.z * scale; acc[3] += o.w * scale;
        }
        if (p.num_splits == 1) {
            float lse;
            float inv = score::finish_row(mx, sum, token, Sq, max(Sk, 0), batch, head, p, lse);
            if (any_bad) inv = lse = nan;
            elem_t* o = p.o + batch * p.o_sb + token * p.o_ss + head * p.o_sh + col;
            *reinterpret_cast<uint2*>(o) = make_uint2(pack2<IS_BF16>(acc[0] * inv, acc[1] * inv),
                                                      pack2<IS_BF16>(acc[2] * inv, acc[3] * inv));
            if (col == 0) p.lse[((i64)batch * p.Hq + head) * Sq + token] = lse;
        } else {
            // Partials: O normalised by its own sum, and its LSE (log2 domain); combine() merges them.
            const i64 part = (((i64)split * gridDim.z + batch) * Sq + token) * p.Hq + head;
            const float inv = any_bad ? nan : (sum > 0.f ? 1.f / sum : 0.f);
            *reinterpret_cast<float4*>(p.o_part + part * HEAD_DIM + col) =
                make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
            if (col == 0) p.lse_part[part] = any_bad ? nan : (sum > 0.f ? mx + log2f(sum) : NEG_INF);
        }
    }
    trace(EV_STORED);
    trace(EV_GT_END);
    trace_store(EV_SM, smid());
    trace_store(EV_BLOCKS, n_blocks);
}

// One CTA per (sequence, token, query head): the splits' partials weighted by their LSEs. Every
// warp reads all the LSEs (each lane a strided share) for the maximum and takes its own splits'
// partials (up to COMBINE_UNROLL per lane in flight), the first of them requested with the LSEs;
// the warps' sums merge through shared memory.
constexpr int COMBINE_WARPS = 4;  // family.py COMBINE_THREADS / 32
constexpr int COMBINE_UNROLL = 8;

__device__ __forceinline__ void combine(const Params& p) {
    constexpr int PER_LANE = HEAD_DIM / 32;  // contiguous columns of each lane
    const unsigned full = 0xffffffffu;
    __shared__ float merge_acc[COMBINE_WARPS][HEAD_DIM];
    __shared__ float merge_sum[COMBINE_WARPS];
    pdl_wait();  // launched early (sm_90): the split kernel's partials are complete and visible from here
    pdl_launch_dependents();  // the next kernel (the next decode step's split kernel) may be scheduled now
    // The row's indices in 32 bits (rows = batch x Sq x Hq fits, as the grid's x does): in 64 bits they
    // were a ~70-instruction division call between the wait and the first read.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 row = blockIdx.x, rows = (i64)p.batch * p.Sq * p.Hq;
    const unsigned row_in_batch = blockIdx.x % (unsigned)(p.Hq * p.Sq);
    const int head = (int)(row_in_batch % (unsigned)p.Hq), token = (int)(row_in_batch / (unsigned)p.Hq);
    const int batch = (int)(blockIdx.x / (unsigned)(p.Hq * p.Sq));
    const int len = cache_len(p, batch);  // requested with the partials (a sink's finish_row reads it)
    const int splits = p.num_splits;
    const float* o_row = p.o_part + row * HEAD_DIM + lane * PER_LANE;

    // This warp's splits: warp, warp + COMBINE_WARPS, ..., up to 32 per round (lane u holds the LSE of
    // the round's split u), their partials read COMBINE_UNROLL at a time. The first round's LSEs and
    // first partials are requested together with the LSEs for the maximum: no load waits on another,
    // so a call of up to 32 * COMBINE_WARPS splits costs one L2 round trip before its arithmetic.
    auto round_splits = [&](int j0) { return min(32, (splits - j0 + COMBINE_WARPS - 1) / COMBINE_WARPS); };
    auto lane_lse = [&](int j0) {  // -inf past the last split: its weight is 0
        const int s = j0 + lane * COMBINE_WARPS;
        return s < splits ? __ldcg(p.lse_part + s * rows + row) : NEG_INF;
    };
    auto load_partials = [&](int j0, int u0, int n, float (&part)[COMBINE_UNROLL][PER_LANE]) {
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u) {
            const i64 s_u = j0 + (i64)(u0 + u) * COMBINE_WARPS;
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) part[u][k] = u0 + u < n ? __ldcg(o_row + s_u * rows * HEAD_DIM + k) : 0.f;
        }
    };
    int n = round_splits(warp);
    float l_lane = lane_lse(warp), part[COMBINE_UNROLL][PER_LANE];
    load_partials(warp, 0, n, part);

    float mx = NEG_INF;
    bool nan_seen = false;
    for (int s = lane; s < splits; s += 32) {
        const float l = __ldcg(p.lse_part + s * rows + row);
        nan_seen |= l != l;
        mx = fmaxf(mx, l);
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) mx = fmaxf(mx, __shfl_xor_sync(full, mx, d));
    nan_seen = __any_sync(full, nan_seen);
    const float ref = mx == NEG_INF ? 0.f : mx;

    float sum = 0.f, acc[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) acc[k] = 0.f;
#pragma unroll 1
    for (int j0 = warp; j0 < splits; j0 += 32 * COMBINE_WARPS) {
        if (j0 != warp) {
            n = round_splits(j0);
            l_lane = lane_lse(j0);
        }
        const float w_lane = exp2f(l_lane - ref);  // 0 for a split that saw no key (its partial is zeros)
        sum += w_lane;
#pragma unroll 1
        for (int u0 = 0; u0 < n; u0 += COMBINE_UNROLL) {
            if (j0 != warp || u0 != 0) load_partials(j0, u0, n, part);
#pragma unroll
            for (int u = 0; u < COMBINE_UNROLL; ++u) {
                const float w = __shfl_sync(full, w_lane, (u0 + u) % 32);
#pragma unroll
                for (int k = 0; k < PER_LANE; ++k) acc[k] += w * part[u][k];
            }
        }
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(full, sum, d);
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) merge_acc[warp][lane * PER_LANE + k] = acc[k];
    if (lane == 0) merge_sum[warp] = sum;
    __syncthreads();
    if (warp != 0) return;
    sum = 0.f;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) sum += merge_sum[w];
    float lse;
    float inv = score::finish_row(mx, sum, token, p.Sq, len < 0 ? 0 : len, batch, head, p, lse);
    if (nan_seen) inv = lse = __int_as_float(0x7fc00000);
    elem_t* out = p.o + batch * p.o_sb + token * p.o_ss + head * p.o_sh + lane * PER_LANE;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < COMBINE_WARPS; ++w) v += merge_acc[w][lane * PER_LANE + k];
        out[k] = (elem_t)(pack2<IS_BF16>(v * inv, 0.f) & 0xffffu);
    }
    if (lane == 0) p.lse[((i64)batch * p.Hq + head) * p.Sq + token] = lse;
}

}  // namespace fd
