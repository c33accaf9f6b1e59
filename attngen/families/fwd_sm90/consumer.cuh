// ---- consumer.cuh: a consumer warpgroup, 64 query rows of each tile: the GEMMs' turns (pingpong), the
// overlapped or serial loop over key blocks, the epilogue, and the state one tile hands the next ----

namespace fa90 {

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

// VARLEN: this warpgroup's staged output rows where its sequence ends among them (first: the first
// one's position in its sequence), copied to out 16 bytes at a time up to the sequence's last row; a
// TMA store would write the next sequence's rows too. The tile's rows lie in [0, Sq) (varlen_tiles.cuh keeps segments inside q).
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
        // VARLEN: a TMA store would write past the sequence's last row into the next one's, so only
        // row groups wholly inside the sequence take it; the sequence's last, ragged one is copied
        // by the warpgroup (which costs its threads the stores' issue: docs/perf-notes.md "The varlen
        // output through TMA"). The condition goes through a shuffle, which ptxas sees as warp-uniform:
        // behind a branch it could not prove uniform, the steady loop lost its uniform registers (48
        // R2UR against 16, 993 instructions a block against 928; steady blocks 4.7% slower).
        if (VARLEN && __shfl_sync(0xffffffffu, m0 + 64 > seq_q(p, done.tile), 0)) {
            store_rows(p, rows, done.tile, m0, tid);
            named_sync(STORE_BARRIER + wg, WG_THREADS);  // every row has left the Q buffer
        } else if (tid == 0) {
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c)
                tma_store(&p.tmap_o, rows + c * Q_CHUNK, c * 64, first_row(done.tile) + m0, done.tile.head,
                          done.tile.batch);
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
            tma_store_wait_read();  // (VARLEN's ragged row groups were copied before the hand-over)
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
        trace(wg, j, SOFTMAX0_DONE, fence_clock(s));
        if constexpr (CARRIED) {
            wgmma_wait<0>();
            fence_regs(o);
            trace(wg, j, PREVIOUS_PV);
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

}  // namespace fa90
