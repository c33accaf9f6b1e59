// ---- bwd_rows.cuh: the per-row kernels every backward family runs around its main kernel ----
// prep (D, the LSE in log2, the dQ accumulator zeroed) and convert_dq (the fp32 accumulator to dQ),
// and add_dq, which main kernels use to add an m16 x n8 accumulator tile to the accumulator.
// attngen/families/bwd_shared.py launches them. Also the learnable inputs' per-CTA gradient sums
// (init_input_grads, store_input_grads). Needs, from the rendered template: struct BwdParams,
// score::INPUT_GRADS (attngen/cuda/score_mod.cuh.j2)
// and namespace cfg { HEAD_DIM, BLOCK_M, IS_BF16, elem_t, VECTOR_RED, DQ_PARTS, DQ_SWIZZLED, PREP_THREADS,
// DQ_THREADS, DETERMINISTIC }. With DETERMINISTIC, wait_turn / pass_turn order the dQ additions.

namespace bwd_rows {

using namespace cfg;
using Params = BwdParams;
constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row

// Where the accumulator keeps dQ element (row, col) of one (batch, head), in floats from its first row.
// Row-major for DQ_PARTS = 1 without DQ_SWIZZLED. Otherwise (a family that adds whole blocks from
// shared memory with bulk reductions) each BLOCK_M-row block is DQ_PARTS column parts one after
// another, row-major within a part, and with DQ_SWIZZLED a row's 16-byte units are XOR-permuted by the
// row within 8 (in groups of 8 units), which keeps the family's shared-memory stores free of bank
// conflicts. The prep kernel zeroes whole rows, so any layout within a block is zeroed.
__device__ __forceinline__ i64 dq_offset(int row, int col) {
    constexpr int PART = HEAD_DIM / DQ_PARTS;
    const int r = row % BLOCK_M, part = col / PART, c = col % PART;
    const int unit = DQ_SWIZZLED ? ((c / 4) & ~7) | (((c / 4) ^ r) & 7) : c / 4;
    return (i64)(row - r) * HEAD_DIM + part * BLOCK_M * PART + r * PART + unit * 4 + c % 4;
}

// One element's bits (the low 16 of `bits`) as a float.
__device__ __forceinline__ float to_float(u32 bits) {
    if constexpr (IS_BF16) {
        return __uint_as_float(bits << 16);
    } else {
        float f;
        asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"((u16)bits));
        return f;
    }
}

// Adds one m16 x n8 accumulator tile (rows r0.., columns c0..) to the fp32 dQ rows of a block.
// Hopper reduces 16 bytes per instruction: lanes t and t^1 swap halves so that each holds four
// consecutive columns of one row (even t: row g, odd t: row g + 8), a quarter of the scalar adds.
__device__ __forceinline__ void add_dq(float* rows, int r0, int c0, const float (&acc)[4], int m0, int Sq) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if constexpr (VECTOR_RED) {
        const bool odd = t & 1;
        // Even t sends its row g + 8 pair and receives the partner's row g pair; odd t the reverse.
        const float send0 = odd ? acc[0] : acc[2], send1 = odd ? acc[1] : acc[3];
        const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1), got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
        const int r = r0 + g + (odd ? 8 : 0), c = c0 + 2 * (t & ~1);
        const float4 v = odd ? make_float4(got0, got1, acc[2], acc[3]) : make_float4(acc[0], acc[1], got0, got1);
        if (m0 + r < Sq) {
            float* dst = rows + (i64)r * HEAD_DIM + c;
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                         ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
        }
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + g + 8 * h;
            if (m0 + r < Sq) {
                float* dst = rows + (i64)r * HEAD_DIM + c0 + 2 * t;
                atomicAdd(dst, acc[2 * h]);
                atomicAdd(dst + 1, acc[2 * h + 1]);
            }
        }
    }
}

// -- deterministic dQ (attngen/families/bwd_shared.py): the key blocks that see a query block add
// their dQ parts to it in key order. A key block's rank is its place in that order; the counter of
// (batch, head, query block) holds how many parts were added.
__device__ __forceinline__ int* dq_turn(const Params& p, int batch, int head, int m0) {
    return p.dq_turns + ((i64)batch * p.Hq + head) * (p.Sq_pad / BLOCK_M) + m0 / BLOCK_M;
}

// Lane 0 of the calling warp waits until the key blocks ranked before this one added their parts;
// __syncwarp then orders the warp's adds after that acquire. A key block waits only for lower
// ones, which the grid (key blocks on y, in order) has already started: they never wait for it.
// A wait of seconds means that broke: trap (a launch error) rather than hang.
__device__ __forceinline__ void wait_turn(const int* turn, int rank) {
    if (threadIdx.x % 32 == 0) {
        for (int spins = 0;; ++spins) {
            int seen;
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(turn) : "memory");
            if (seen >= rank) break;
            if (spins == (1 << 24)) __trap();
            __nanosleep(64);
        }
    }
    __syncwarp();
}

// After a CTA barrier that every warp's adds for `turn` precede: thread 0 makes them visible at GPU
// scope (the fence is cumulative over what the barrier ordered before it), then counts the part.
__device__ __forceinline__ void pass_turn(int* turn) {
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(turn, 1);
    }
}

// Per query row (one warp each): delta = rowsum(dO * O) - dLSE, lse2 = LSE * log2(e) (+inf for a
// row that saw no key: every P of it is then exp2(-inf) = 0), and the row's dQ accumulator zeroed.
// Rows from Sq to Sq_pad get delta 0 and lse2 +inf, so the main kernel reads whole blocks.
__device__ __forceinline__ void prep(const Params& p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * (PREP_THREADS / 32) + warp, head = blockIdx.y, batch = blockIdx.z;
    if (row >= p.Sq_pad) return;
    const i64 flat = ((i64)batch * p.Hq + head) * p.Sq_pad + row;
    if constexpr (DETERMINISTIC) {
        if (lane == 0 && row % BLOCK_M == 0) *dq_turn(p, batch, head, row) = 0;
    }
    float4* dq = reinterpret_cast<float4*>(p.dq_acc + flat * HEAD_DIM);
    for (int c = lane; c < HEAD_DIM / 4; c += 32) dq[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    float dot = 0.f, lse = (-__int_as_float(0x7f800000)), dlse = 0.f;
    if (row < p.Sq) {
        const elem_t* o = p.o + batch * p.out_sb + (i64)row * p.out_ss + head * p.out_sh;
        const elem_t* d = p.dout + batch * p.dout_sb + (i64)row * p.dout_ss + head * p.dout_sh;
        for (int c = lane; c < HEAD_DIM / 2; c += 32) {
            const u32 ov = reinterpret_cast<const u32*>(o)[c], dv = reinterpret_cast<const u32*>(d)[c];
            dot += to_float(ov & 0xffffu) * to_float(dv & 0xffffu) + to_float(ov >> 16) * to_float(dv >> 16);
        }
        const i64 lse_at = ((i64)batch * p.Hq + head) * p.Sq + row;
        lse = p.lse[lse_at];
        if (p.dlse != nullptr) dlse = p.dlse[lse_at];
    }
#pragma unroll
    for (int s = 16; s > 0; s /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, s);
    if (lane == 0) {
        p.delta[flat] = row < p.Sq ? dot - dlse : 0.f;
        p.lse2[flat] = lse == (-__int_as_float(0x7f800000)) ? __int_as_float(0x7f800000) : lse * 1.4426950408889634f;
    }
}

// dQ from the fp32 accumulator, in dQ's dtype and layout: 8 elements (one 16-byte store) per thread.
__device__ __forceinline__ void convert_dq(const Params& p) {
    constexpr int ROWS = DQ_THREADS / CHUNKS;
    const int r = threadIdx.x / CHUNKS, col = (threadIdx.x % CHUNKS) * 8;
    const int row = blockIdx.x * ROWS + r, head = blockIdx.y, batch = blockIdx.z;
    if (r >= ROWS || row >= p.Sq) return;
    const float* acc = p.dq_acc + ((i64)batch * p.Hq + head) * p.Sq_pad * HEAD_DIM;
    const float4 a = *reinterpret_cast<const float4*>(acc + dq_offset(row, col));
    const float4 b = *reinterpret_cast<const float4*>(acc + dq_offset(row, col + 4));
    uint4 out;
    out.x = pack2<IS_BF16>(a.x, a.y);
    out.y = pack2<IS_BF16>(a.z, a.w);
    out.z = pack2<IS_BF16>(b.x, b.y);
    out.w = pack2<IS_BF16>(b.z, b.w);
    *reinterpret_cast<uint4*>(p.dq + batch * p.dq_sb + (i64)row * p.dq_ss + head * p.dq_sh + col) = out;
}

// -- learnable inputs (attngen/families/bwd_shared.py): one float per (input, batch, head, key block) --
constexpr int IG = score::INPUT_GRADS;
constexpr int IG_REGS = IG > 0 ? IG : 1;

__device__ __forceinline__ float* input_grad_slot(const Params& p, int n, int batch, int head) {
    // The main kernels' grid: y key blocks, z batches.
    return p.igrad + (((i64)n * gridDim.z + batch) * p.Hq + head) * gridDim.y + blockIdx.y;
}

// Zeros for every head of the CTA's GQA group (a head none of whose blocks the CTA sees keeps them);
// thread 0 alone writes the slots, so its later stores land after these.
template <int GROUP>
__device__ __forceinline__ void init_input_grads(const Params& p, int kv_head, int batch) {
    if constexpr (IG > 0) {
        if (threadIdx.x == 0)
#pragma unroll 1
            for (int n = 0; n < IG; ++n)
                for (int g = 0; g < GROUP; ++g) *input_grad_slot(p, n, batch, kv_head * GROUP + g) = 0.f;
    }
}

// The CTA's sums for one head: each thread's, then each warp's (shuffles), then thread 0 adds the
// warps' in warp order and stores them: a fixed order, so the gradient is deterministic. Every
// thread of the CTA calls it (it synchronises the CTA); acc is zeroed for the next head.
template <int WARPS>
__device__ __forceinline__ void store_input_grads(float (&acc)[IG_REGS], const Params& p, int batch, int head) {
    if constexpr (IG > 0) {
        __shared__ float warp_sums[IG][WARPS];
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
        for (int n = 0; n < IG; ++n) {
            float v = acc[n];
#pragma unroll
            for (int s = 16; s > 0; s /= 2) v += __shfl_xor_sync(0xffffffffu, v, s);
            if (lane == 0) warp_sums[n][warp] = v;
            acc[n] = 0.f;
        }
        __syncthreads();
        if (threadIdx.x == 0)
#pragma unroll 1
            for (int n = 0; n < IG; ++n) {
                float sum = 0.f;
                for (int w = 0; w < WARPS; ++w) sum += warp_sums[n][w];
                *input_grad_slot(p, n, batch, head) = sum;
            }
        __syncthreads();  // warp_sums is free for the next head
    }
}

}  // namespace bwd_rows
