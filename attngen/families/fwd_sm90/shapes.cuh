// ---- shapes.cuh: fwd_sm90's sizes, from the plan (namespace cfg): threads, tiles, shared memory, registers ----
// The first of the kernel's headers; flash_fwd_sm90.cuh lists them in the order the template pastes them.

namespace fa90 {

using namespace cfg;
using Params = FwdSm90Params;

#define NEG_INF (-__int_as_float(0x7f800000))
constexpr int WG_THREADS = 128;
constexpr int THREADS = (CONSUMERS + 1) * WG_THREADS;
static_assert(BLOCK_M == 64 * CONSUMERS, "query rows per CTA: 64 per consumer warpgroup");
constexpr int CHUNKS = (HEAD_DIM + 63) / 64;     // 64-column (128-byte) chunks of a row: one TMA box each
constexpr int Q_CHUNK = BLOCK_M * 128;           // bytes of one column chunk of the Q tile
constexpr int KV_CHUNK = BLOCK_N * 128;
constexpr int Q_BYTES = CHUNKS * Q_CHUNK;
constexpr int KV_BYTES = CHUNKS * KV_CHUNK;      // one K or one V stage (TMA fills out-of-bounds with zeros)
constexpr int ALIGN = 1024;                      // a 128-byte swizzle atom: 8 rows of 128 bytes
constexpr int SMEM_BYTES = ALIGN + Q_BUFFERS * Q_BYTES + 2 * NUM_STAGES * KV_BYTES;  // family.py smem_bytes() must agree
constexpr int S_REGS = BLOCK_N / 2;              // fp32 scores per thread: the m64 x BLOCK_N accumulator
constexpr int O_REGS = HEAD_DIM / 2;
constexpr int DK = HEAD_DIM / 16;                // k16 steps of Q K^T
constexpr int PK = BLOCK_N / 16;                 // k16 steps of P V
constexpr int PINGPONG_BARRIER = 1;              // named barriers 1..CONSUMERS: whose turn to issue GEMMs
constexpr int STORE_BARRIER = 1 + CONSUMERS;     // named barriers after those: one per warpgroup's epilogue

static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256 && HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "wgmma shapes");
static_assert(Q_CHUNK % ALIGN == 0 && KV_CHUNK % ALIGN == 0, "every tile starts on a swizzle-atom boundary");
static_assert(CLUSTER == 1 || (CLUSTER == 2 && PAIRS && !VARLEN && CHUNKS % 2 == 0),
              "a cluster of two CTAs: pairs of tiles, the K/V chunks split evenly between them");

}  // namespace fa90
