"""The fwd_sm90 family's time model (its `estimate()`), for ranking configurations.

Per key block a CTA does 4 bm bn D tensor FLOPs on wgmma, bm bn exp2 on the MUFU and about
4 bm bn FP32 softmax operations; the consumer warpgroups' softmax hides under the GEMMs when
they overlap (OVERLAP within a warpgroup, PINGPONG across warpgroups), else adds to them.
A stage-deep ring hides the load latency of all but the first block. CTAs are dealt in launch
order (longest query blocks first) to SMs x resident CTAs, so wave tails and causal imbalance
show; the total is that makespan or the DRAM floor, plus the launch.
"""

from __future__ import annotations

from attngen.tune.model import Estimate, GpuModel, Shape, dram_seconds, key_blocks, makespan, occupancy

SOFTMAX_OPS_PER_SCORE = 4  # scale-and-subtract FMA, max, sum, pack
MASK_OPS_PER_SCORE = 3
UNHIDDEN = 0.15  # what the overlap leaves of the softmax beside the GEMMs
# A cluster of two CTAs measured 1% slower per clock than the same tile alone (H100, one producer
# thread and no exit barrier: docs/perf-notes.md "The clusters' lost 4%"); its saving in energy at the
# power cap (1.4-1.6% faster there at d128) is not in this clock-bound model.
CLUSTER_PER_BLOCK = 1.01


def estimate(plan, report, gpu: GpuModel, shape: Shape) -> Estimate:
    occ = occupancy(gpu, plan.threads, report.registers, report.smem_total_bytes)
    if occ.ctas < 1:
        raise ValueError(f"occupancy of {plan.name} is {occ.ctas} CTAs/SM: it cannot run (limited by {occ.limiter})")
    c = occ.ctas
    bm, bn, d = plan.block_m, plan.block_n, plan.head_dim
    mma = c * 4 * bm * bn * d / (gpu.tensor_flops_total / gpu.sms)
    per_block = {}
    for masked in (False, True):
        ops = (SOFTMAX_OPS_PER_SCORE + (MASK_OPS_PER_SCORE if masked else 0)) * bm * bn
        softmax = c * (bm * bn / (gpu.mufu_per_clk * gpu.clock_hz) + ops / (gpu.fp32_per_clk * gpu.clock_hz))
        hidden = plan.overlap or plan.pingpong
        per_block[masked] = max(mma, softmax) + UNHIDDEN * min(mma, softmax) if hidden else mma + softmax
        if plan.cluster:
            per_block[masked] *= CLUSTER_PER_BLOCK
    blocks = key_blocks(plan.mask, bm, bn, shape)
    one_head = [(n - partial) * per_block[False] + partial * per_block[True] + gpu.cta_fixed_s + gpu.mem_latency_s
                for n, partial in blocks]
    durations = one_head * (shape.heads_q * shape.batch)
    slots = gpu.sms * c
    compute_s = makespan(durations, slots) / c
    dram_s = dram_seconds(gpu, shape, d, plan.gqa_ratio)
    bound = ("mma" if mma >= per_block[False] - mma else "softmax") if compute_s >= dram_s else "dram"
    total = max(compute_s, dram_s) + gpu.launch_s
    return Estimate(total * 1e3, len(durations), slots, len(durations) / slots, bound)
