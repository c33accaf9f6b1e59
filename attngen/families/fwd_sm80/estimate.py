"""The fwd_sm80 family's time model (its `estimate()`): a roofline per key block, then waves.

One CTA walks its visible key blocks; per block it does, with bm x bn tiles and head dim D:
  tensor FLOPs   4 bm bn D                       (Q K^T and P V)
  smem bytes     warps * 4 bn D                  (every warp reads all of K and V by ldmatrix)
                 + 2 bm D bn/sub_n               (Q re-read per softmax step, unless in registers)
                 + 4 bn D                        (cp.async writes K and V)
  L2 bytes       4 bn D
  ex2 (MUFU)     bm bn
  FP32 ops       4 bm bn + bm D bn/sub_n         (softmax per score; O rescale per step)
  latency        a reduction chain per softmax step (a warp's own latency: other warps fill it)
  barriers       per block: while a CTA's warps wait there, only other CTAs can run
With c CTAs resident, one "round" (every resident CTA advances one block) takes, per pipe,
c * work / (the SM's rate). The pipes overlap partly: round = max + (1 - hide) * (sum - max)
with hide = 1 - 0.35 / w for w warps per scheduler: the more warps, the more of the other
pipes' time hides behind the busiest (calibrated on the perf-notes v7 sweep, where
m128n64w4s3 at 1 CTA/SM runs ~0.77x of m128n64w4s2 at 2). A block's barrier time shows
divided by the c CTAs that run meanwhile; its load latency is hidden by the
(num_stages - 1) blocks of prefetch, and what is left shows, shared by the c CTAs.
CTAs are dealt in launch order (the kernel runs the longest query blocks first) to the
SMs * c slots, each taking the next free one, so wave tails and causal imbalance show in
the makespan. The total is the makespan or the DRAM floor (q, k, v, o once), whichever is
larger, plus the launch.
"""

from __future__ import annotations

from attngen.tune.model import Estimate, GpuModel, Shape, dram_seconds, key_blocks, makespan, occupancy

UNHIDDEN_ONE_WARP = 0.35
MASK_OPS_PER_SCORE = 3  # index arithmetic, compare, select in a partially masked block
SOFTMAX_OPS_PER_SCORE = 4  # scale-and-subtract FMA, max, sum, pack


def _round_times(plan, gpu: GpuModel, ctas_per_sm: int, masked: bool) -> dict[str, float]:
    """Seconds each pipe of one SM needs while each of its resident CTAs does one key block."""
    bm, bn, D, c = plan.block_m, plan.block_n, plan.head_dim, ctas_per_sm
    steps = bn // plan.sub_n
    smem = plan.num_warps * 4 * bn * D + (0 if plan.q_in_regs else 2 * bm * D * steps) + 4 * bn * D
    fp32 = SOFTMAX_OPS_PER_SCORE * bm * bn + bm * D * steps + (MASK_OPS_PER_SCORE * bm * bn if masked else 0)
    return {
        "latency": steps * gpu.step_cycles / gpu.clock_hz,
        "mma": c * 4 * bm * bn * D / (gpu.mma_flops_total / gpu.sms),
        "smem": c * smem / (gpu.smem_bytes_per_clk * gpu.clock_hz),
        "mufu": c * bm * bn / (gpu.mufu_per_clk * gpu.clock_hz),
        "fp32": c * fp32 / (gpu.fp32_per_clk * gpu.clock_hz),
        "l2": c * 4 * bn * D / (gpu.l2_bytes_total / gpu.sms),
    }


def _round_seconds(times: dict[str, float], warps_per_scheduler: float) -> float:
    longest = max(times.values())
    hide = max(0.0, 1.0 - UNHIDDEN_ONE_WARP / warps_per_scheduler)
    return longest + (1.0 - hide) * (sum(times.values()) - longest)


def estimate(plan, report, gpu: GpuModel, shape: Shape) -> Estimate:
    """Predicted milliseconds of one forward call of `plan` on `shape`, given its ptxas report."""
    occ = occupancy(gpu, plan.threads, report.registers, report.smem_total_bytes)
    if occ.ctas < 1:
        raise ValueError(f"occupancy of {plan.name} is {occ.ctas} CTAs/SM: it cannot run (limited by {occ.limiter})")
    c = occ.ctas
    wps = occ.warps / gpu.schedulers
    per_block = {}
    for masked in (False, True):
        times = _round_times(plan, gpu, c, masked)
        rnd = _round_seconds(times, wps) + gpu.block_sync_cycles / gpu.clock_hz / c
        exposed = max(0.0, gpu.mem_latency_s - (plan.num_stages - 1) * rnd) / c
        per_block[masked] = (rnd + exposed, max(times, key=times.get))
    blocks = key_blocks(plan.mask, plan.block_m, plan.block_n, shape)
    one_head = [(n - partial) * per_block[False][0] + partial * per_block[True][0] + gpu.cta_fixed_s
                for n, partial in blocks]
    # Launch order: blockIdx.x (query blocks, longest first) fastest, then heads, then batch.
    durations = one_head * (shape.heads_q * shape.batch)
    slots = gpu.sms * c
    compute_s = makespan(durations, slots)
    dram_s = dram_seconds(gpu, shape, plan.head_dim, plan.gqa_ratio)
    bound = per_block[False][1] if compute_s >= dram_s else "dram"
    total = max(compute_s, dram_s) + gpu.launch_s
    return Estimate(total * 1e3, len(durations), slots, len(durations) / slots, bound)
