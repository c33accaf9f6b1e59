"""A static performance model: occupancy from the resource report, time from a roofline.

No GPU is needed. The model only has to rank tile configurations well enough that the
search times the winners first; docs/perf-notes.md holds the peak numbers.

Occupancy (CTAs per SM) is the least of what registers (allocated per warp in units of
256), shared memory (plus 1 KB the driver reserves per CTA), threads and the CTA slot
limit allow.

Time. One CTA walks its visible key blocks; per block it does, with bm x bn tiles and
head dim D:
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

import dataclasses
import heapq
import math
import re
from dataclasses import dataclass

from attngen.plan import KernelPlan


@dataclass(frozen=True)
class GpuModel:
    """Per-SM limits and rates of one GPU. The rates are per SM unless named *_total."""

    name: str
    arch: str
    sms: int
    clock_hz: float
    mma_flops_total: float  # mma.sync fp16/bf16 dense, whole GPU
    l2_bytes_total: float  # L2 -> SM bandwidth, whole GPU
    dram_bytes_total: float
    smem_per_sm: int  # bytes CTAs can use together
    regs_per_sm: int = 65536
    reg_alloc_unit: int = 256  # registers are allocated per warp in these units
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    smem_reserved_per_cta: int = 1024
    schedulers: int = 4
    smem_bytes_per_clk: int = 128
    mufu_per_clk: int = 16  # ex2 per clock per SM
    fp32_per_clk: int = 128
    mem_latency_s: float = 1.0e-6  # a K/V block load, issue to landed
    block_sync_cycles: int = 600  # two barriers and the cp.async wait, per loaded block
    step_cycles: int = 200  # the max/exp/sum dependency chain of one softmax step
    cta_fixed_s: float = 2.0e-6  # Q load, first K/V block, epilogue
    launch_s: float = 4.0e-6

    def with_device(self, name: str, sms: int) -> "GpuModel":
        """This model with the name and SM count of the actual device."""
        return dataclasses.replace(self, name=name, sms=sms)


# H100 SXM: 744 TFLOP/s is the measured wgmma bf16 peak and 3.0 TB/s the measured DRAM
# copy (docs/perf-notes.md). mma.sync kernels such as FA2 reach about half of 744 in
# total; the mma.sync pipe alone peaks near two thirds of it (public microbenchmarks),
# the rest is what the model's other pipes and overlap losses take. L2 bandwidth and
# clock: public microbenchmarks. A100 SXM: datasheet numbers (mma.sync is its native
# tensor path), not yet measured here.
GPUS = {
    "sm_90": GpuModel("H100 SXM (model)", "sm_90", sms=132, clock_hz=1.755e9, mma_flops_total=2 / 3 * 744e12,
                      l2_bytes_total=6.0e12, dram_bytes_total=3.0e12, smem_per_sm=228 * 1024),
    "sm_80": GpuModel("A100 SXM (model)", "sm_80", sms=108, clock_hz=1.41e9, mma_flops_total=0.85 * 312e12,
                      l2_bytes_total=4.0e12, dram_bytes_total=1.9e12, smem_per_sm=164 * 1024),
}


def gpu_model(arch: str) -> GpuModel:
    try:
        return GPUS[arch]
    except KeyError:
        raise ValueError(f"arch={arch!r} has no performance model; allowed: {sorted(GPUS)}") from None


@dataclass(frozen=True)
class Shape:
    """The problem a tile is tuned for: q (batch, seqlen_q, heads_q, D), k/v (batch, seqlen_k, ...)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int

    def __post_init__(self) -> None:
        for name in ("batch", "seqlen_q", "seqlen_k", "heads_q"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 1")

    def flops(self, head_dim: int, causal: bool) -> float:
        """FLOPs as the FlashAttention papers count them (DESIGN.md section 7)."""
        flops = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * head_dim
        return flops / 2 if causal else flops

    def label(self) -> str:
        seq = f"s{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"sq{self.seqlen_q}sk{self.seqlen_k}"
        return f"b{self.batch}h{self.heads_q}{seq}"


@dataclass(frozen=True)
class Occupancy:
    ctas: int  # per SM
    warps: int  # per SM
    limiter: str  # what bounds it: registers, smem, threads or ctas


def occupancy(gpu: GpuModel, threads: int, registers: int, smem_bytes: int) -> Occupancy:
    warps_per_cta = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // gpu.reg_alloc_unit) * gpu.reg_alloc_unit
    # The register file is split among the schedulers; a warp's registers live in one part.
    warps_by_regs = gpu.schedulers * ((gpu.regs_per_sm // gpu.schedulers) // max(regs_per_warp, 1))
    limits = {
        "registers": warps_by_regs // warps_per_cta,
        "smem": gpu.smem_per_sm // (smem_bytes + gpu.smem_reserved_per_cta),
        "threads": gpu.max_threads_per_sm // threads,
        "ctas": gpu.max_ctas_per_sm,
    }
    limiter = min(limits, key=limits.get)
    return Occupancy(limits[limiter], limits[limiter] * warps_per_cta, limiter)


# -- key blocks per query block, from the mask's own lowering -------------------------------
_MASK_EXPR = re.compile(r"^[\s0-9A-Za-z_+\-*/(),]*$")
_MASK_NAMES = {"min", "max", "m0", "m1", "Sq", "Sk"}


def _mask_bound(expr: str):
    """A Python function of (m0, m1, Sq, Sk) for one of the mask's CUDA bound expressions
    (attngen/masks.py); our own strings, checked against a whitelist before use."""
    names = set(re.findall(r"[A-Za-z_]\w*", expr))
    if not _MASK_EXPR.match(expr) or not names <= _MASK_NAMES:
        raise ValueError(f"mask bound {expr!r} uses more than {sorted(_MASK_NAMES)}: extend the model")
    code = compile(expr.replace("/", "//"), "<mask bound>", "eval")
    return lambda m0, m1, Sq, Sk: eval(code, {"__builtins__": {}, "min": min, "max": max},  # noqa: S307
                                       {"m0": m0, "m1": m1, "Sq": Sq, "Sk": Sk})


def key_blocks(plan: KernelPlan, shape: Shape) -> list[tuple[int, int]]:
    """(loaded key blocks, of which partially masked) for each query block, in launch order."""
    bm, bn, Sq, Sk = plan.block_m, plan.block_n, shape.seqlen_q, shape.seqlen_k
    lo_f, hi_f = _mask_bound(plan.mask.kv_begin), _mask_bound(plan.mask.kv_end)
    full_lo_f, full_hi_f = _mask_bound(plan.mask.full_begin), _mask_bound(plan.mask.full_end)
    out = []
    for m_block in reversed(range(-(-Sq // bm))):
        m0, m1 = m_block * bm, min(m_block * bm + bm, Sq)
        lo, hi = lo_f(m0, m1, Sq, Sk), hi_f(m0, m1, Sq, Sk)
        begin = lo // bn
        end = -(-hi // bn) if hi > lo else begin
        full_lo, full_hi = full_lo_f(m0, m1, Sq, Sk), full_hi_f(m0, m1, Sq, Sk)
        # Blocks wholly inside [full_lo, full_hi) skip per-element masking; a ragged last
        # block is always masked (keys past Sk).
        full = max(0, min(end, min(full_hi, Sk) // bn) - max(begin, -(-full_lo // bn)))
        out.append((end - begin, end - begin - full))
    return out


# -- time ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    ms: float
    ctas: int  # grid size
    slots: int  # CTAs resident on the whole GPU at once
    waves: float  # ctas / slots
    bound: str  # the pipe that dominates a round: mma, smem, mufu, fp32, l2 (or dram)


UNHIDDEN_ONE_WARP = 0.35
MASK_OPS_PER_SCORE = 3  # index arithmetic, compare, select in a partially masked block
SOFTMAX_OPS_PER_SCORE = 4  # scale-and-subtract FMA, max, sum, pack


def _round_times(plan: KernelPlan, gpu: GpuModel, ctas_per_sm: int, masked: bool) -> dict[str, float]:
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


def _makespan(durations: list[float], slots: int) -> float:
    """Greedy list scheduling in launch order: each CTA takes the slot that frees first."""
    if len(set(durations)) == 1:  # uniform work: whole waves
        return math.ceil(len(durations) / slots) * durations[0]
    free = [0.0] * min(slots, len(durations))
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


def estimate(plan: KernelPlan, occ: Occupancy, gpu: GpuModel, shape: Shape) -> Estimate:
    """Predicted milliseconds of one forward call of `plan` on `shape` at occupancy `occ`."""
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
    blocks = key_blocks(plan, shape)
    one_head = [(n - partial) * per_block[False][0] + partial * per_block[True][0] + gpu.cta_fixed_s
                for n, partial in blocks]
    # Launch order: blockIdx.x (query blocks, longest first) fastest, then heads, then batch.
    durations = one_head * (shape.heads_q * shape.batch)
    slots = gpu.sms * c
    compute_s = _makespan(durations, slots)
    hkv = max(1, shape.heads_q // plan.gqa_ratio)
    dram_bytes = 2 * plan.head_dim * shape.batch * (2 * shape.seqlen_q * shape.heads_q + 2 * shape.seqlen_k * hkv)
    dram_s = dram_bytes / gpu.dram_bytes_total
    bound = per_block[False][1] if compute_s >= dram_s else "dram"
    total = max(compute_s, dram_s) + gpu.launch_s
    return Estimate(total * 1e3, len(durations), slots, len(durations) / slots, bound)
