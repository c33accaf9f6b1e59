// ---- trace.cuh: a development timeline of the tiles' phases (bench/tile_timeline.py); empty otherwise ----

namespace fa90 {

// A development timeline (bench/tile_timeline.py defines ATTNGEN_TRACE): per CTA, consumer warpgroup
// and tile, the SM clock at TRACE_EVENTS points of the tile, its key-block count and the SM.
#ifdef ATTNGEN_TRACE
constexpr int TRACE_CTAS = 1024, TRACE_TILES = 32, TRACE_EVENTS = 19;
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
// One thread a warpgroup stamps. The producer's events (slot 2 from warpgroup 0's threads) come from whichever
// one thread issues the load: its leader, or under LATE_CLAIM the claim thread (thread 32) for the Q loads.
__device__ __forceinline__ void trace(int wg, int j, int event, long long value = -1) {
    const bool producer = wg == 2 && threadIdx.x < WG_THREADS;
    if ((producer || threadIdx.x % WG_THREADS == 0) && blockIdx.x < TRACE_CTAS && wg < 3 && j < TRACE_TILES)
        attngen_trace[blockIdx.x][wg][j][event] = value < 0 ? clock64() : value;
}
#else
__device__ __forceinline__ void trace(int, int, int, long long = -1) {}
__device__ __forceinline__ int smid() { return 0; }
template <int N>
__device__ __forceinline__ long long fence_clock(const float (&)[N]) { return 0; }
#endif
// The producer's (slot 2): Q, the first K and V issued, the first K's stage free, the last V issued (a stamp at
// the round's start too spilled the traced producer's 24 registers: 24 bytes against 8).
enum TraceEvent { TILE_WAIT, TILE_READY, Q_READY, FIRST_SOFTMAX, LAST_PV, STORED, KEY_BLOCKS, SM, K0_READY, TURN0,
                  S0_READY, Q_ISSUED, K0_ISSUED, V0_ISSUED, S0_MASKED, SOFTMAX0_DONE, PREVIOUS_PV, K0_STAGE_FREE,
                  LAST_V_ISSUED };
constexpr int TRACE_PRODUCER = 2;

}  // namespace fa90
