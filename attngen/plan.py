"""KernelPlan: everything the forward template needs, derived from a resolved spec.

The plan owns the decisions that are not spec fields: threads, shared-memory
footprint, whether Q stays in registers, the mask lowering and the occupancy
hint. It also rejects tile configurations the target cannot hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.errors import SpecError
from attngen.faults import check_fault, fault_macro
from attngen.masks import MaskLowering, get_mask
from attngen.spec import AttentionSpec

# Opt-in dynamic shared memory per block (CUDA programming guide, compute capability table).
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
# Registers a thread may hold before the compiler must spill (of 255) keep a margin for
# addresses, loop state and softmax temporaries.
REGISTER_BUDGET = 168


@dataclass(frozen=True)
class KernelPlan:
    spec: AttentionSpec
    name: str
    arch: str
    dtype: str
    head_dim: int
    gqa_ratio: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    q_in_regs: bool
    row_sums_in_smem: bool
    sub_n: int
    threads: int
    smem_bytes: int
    min_blocks_per_sm: int
    mask: MaskLowering
    fault: str | None = None  # attngen/faults.py; None for every kernel users run

    @property
    def fault_macro(self) -> str | None:
        return fault_macro(self.fault)

    @property
    def spec_summary(self) -> str:
        # The arch is the compile target, not part of the kernel: keep it out of the source.
        return ", ".join(f"{k}={v}" for k, v in self.spec.to_dict().items() if k != "arch")


def _fragment_registers(spec: AttentionSpec, sub_n: int, q_in_regs: bool) -> int:
    """32-bit registers per thread for the O, S, P (and Q) fragments of one warp's rows."""
    m_tiles = spec.block_m // spec.num_warps // 16
    per_tile = spec.head_dim // 2 + sub_n // 2 + sub_n // 4
    if q_in_regs:
        per_tile += spec.head_dim // 4
    return m_tiles * per_tile


def smem_bytes(spec: AttentionSpec, row_sums_in_smem: bool) -> int:
    """flash_fwd.cuh's SMEM_BYTES: padded Q and K/V stage tiles, then any fp32 row-sum partials."""
    row_bytes = (spec.head_dim + 8) * 2  # one 16-byte pad per row
    # Each query row has one fp32 partial in each of the 4 lanes of its quad.
    row_sum_bytes = spec.block_m * 4 * 4 if row_sums_in_smem else 0
    return row_bytes * (spec.block_m + 2 * spec.num_stages * spec.block_n) + row_sum_bytes


def make_plan(spec: AttentionSpec, arch: str | None = None, *, fault: str | None = None) -> KernelPlan:
    check_fault(fault)
    spec = spec.resolved(arch)
    # Two m16 tiles per warp at a large head dim leave registers for at most a 64-key S next
    # to O, and only with the row sums in shared memory: a larger loaded block is processed in
    # 64-key softmax steps (docs/perf-notes.md v4, v7).
    register_tight = spec.block_m // spec.num_warps == 32 and spec.head_dim >= 96
    sub_n = min(spec.block_n, 64) if register_tight else spec.block_n
    q_in_regs = _fragment_registers(spec, sub_n, q_in_regs=True) <= REGISTER_BUDGET
    smem = smem_bytes(spec, row_sums_in_smem=register_tight)
    limit = SMEM_LIMIT[spec.arch]
    if smem > limit:
        raise SpecError(
            f"{spec.source + ': ' if spec.source else ''}tile config {spec.tile.label()} needs {smem} B of shared "
            f"memory (block_m + 2*num_stages*block_n rows of {spec.head_dim + 8} elements"
            f"{', and 16 B of row sums per query row' if register_tight else ''}); {spec.arch} allows "
            f"{limit} B: lower num_stages, block_n or block_m",
            field="num_stages",
        )
    threads = spec.num_warps * 32
    return KernelPlan(
        spec=spec,
        name=spec.name if fault is None else f"{spec.name}_fault_{fault}",
        arch=spec.arch,
        dtype=spec.dtype,
        head_dim=spec.head_dim,
        gqa_ratio=spec.gqa_ratio,
        block_m=spec.block_m,
        block_n=spec.block_n,
        num_warps=spec.num_warps,
        num_stages=spec.num_stages,
        q_in_regs=q_in_regs,
        row_sums_in_smem=register_tight,
        sub_n=sub_n,
        threads=threads,
        smem_bytes=smem,
        min_blocks_per_sm=1,
        mask=get_mask(spec.mask),
        fault=fault,
    )
