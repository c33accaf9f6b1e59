"""What the performance models of every family share: GPU rates, shapes, occupancy, key blocks,
wave scheduling. Each family's own model lives in its folder (`estimate()` of the protocol);
no GPU is needed. The models only have to rank configurations well enough that the search
times the winners first; docs/perf-notes.md holds the peak numbers.

Occupancy (CTAs per SM) is the least of what registers (allocated per warp in units of 256),
shared memory (plus 1 KB the driver reserves per CTA), threads and the CTA slot limit allow.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from attngen.flops import forward_flops
from attngen.masks import MaskLowering
from attngen.targets import Target


@dataclass(frozen=True)
class GpuModel:
    """Per-SM limits and rates of one GPU. The rates are per SM unless named *_total."""

    name: str
    cc: int  # compute capability, 10 * major + minor
    sms: int
    clock_hz: float
    mma_flops_total: float  # mma.sync fp16/bf16 dense, whole GPU
    tensor_flops_total: float  # the fastest tensor-core path (wgmma on Hopper), whole GPU
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
H100 = GpuModel("H100 SXM (model)", 90, sms=132, clock_hz=1.755e9, mma_flops_total=2 / 3 * 744e12,
                tensor_flops_total=744e12, l2_bytes_total=6.0e12, dram_bytes_total=3.0e12, smem_per_sm=228 * 1024)
A100 = GpuModel("A100 SXM (model)", 80, sms=108, clock_hz=1.41e9, mma_flops_total=0.85 * 312e12,
                tensor_flops_total=0.85 * 312e12, l2_bytes_total=4.0e12, dram_bytes_total=1.9e12,
                smem_per_sm=164 * 1024)


def gpu_model(target: Target) -> GpuModel:
    """The model closest to a target (Hopper and newer: the H100's; else the A100's), with its
    shared memory per SM, and its name and SM count when it is a device."""
    model = H100 if target.cc >= 90 else A100
    model = dataclasses.replace(model, cc=target.cc, smem_per_sm=target.smem_per_sm)
    if target.sms is not None:
        model = model.with_device(target.device_name or model.name, target.sms)
    return model


@dataclass(frozen=True)
class Shape:
    """The problem a config is tuned for: q (batch, seqlen_q, heads_q, D), k/v (batch, seqlen_k, ...)."""

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
        """FLOPs as the FlashAttention papers count them (attngen/flops.py)."""
        return forward_flops(self.batch, self.heads_q, self.seqlen_q, self.seqlen_k, head_dim, causal)

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


@dataclass(frozen=True)
class Estimate:
    ms: float
    ctas: int  # grid size
    slots: int  # CTAs resident on the whole GPU at once
    waves: float  # ctas / slots
    bound: str  # the pipe that dominates: mma, smem, mufu, fp32, l2 (or dram)


# -- key blocks per query block, from the mask's own lowering -------------------------------
def key_blocks(mask: MaskLowering, block_m: int, block_n: int, shape: Shape) -> list[tuple[int, int]]:
    """(loaded key blocks, of which partially masked) for each query block, longest first, as the
    kernel classifies them (attngen/masks.py bounds(); batch 0, head 0 stand for all)."""
    bm, bn, Sq, Sk = block_m, block_n, shape.seqlen_q, shape.seqlen_k
    out = []
    for m_block in reversed(range(-(-Sq // bm))):
        m0, m1 = m_block * bm, min(m_block * bm + bm, Sq)
        lo, hi, full_lo, full_hi = mask.bounds(m0, m1, Sq, Sk, bn)
        begin = lo // bn
        end = -(-hi // bn) if hi > lo else begin
        # Blocks wholly inside [full_lo, full_hi) skip per-element masking; a ragged last
        # block is always masked (keys past Sk).
        full = max(0, min(end, min(full_hi, Sk) // bn) - max(begin, -(-full_lo // bn)))
        out.append((end - begin, end - begin - full))
    return out


def makespan(durations: list[float], slots: int) -> float:
    """Greedy list scheduling in launch order: each CTA takes the slot that frees first."""
    if len(set(durations)) == 1:  # uniform work: whole waves
        return math.ceil(len(durations) / slots) * durations[0]
    free = [0.0] * min(slots, len(durations))
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


def dram_seconds(gpu: GpuModel, shape: Shape, head_dim: int, gqa_ratio: int, itemsize: int = 2) -> float:
    """q, k, v read once and o written once, over the DRAM bandwidth: the memory floor."""
    hkv = max(1, shape.heads_q // gqa_ratio)
    elements = head_dim * shape.batch * (2 * shape.seqlen_q * shape.heads_q + 2 * shape.seqlen_k * hkv)
    return elements * itemsize / gpu.dram_bytes_total
