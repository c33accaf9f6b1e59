"""bwd_sm90: the FlashAttention backward on Hopper's warpgroup MMA (wgmma, sm_90a).

One CTA per (kv head, key block of 128, batch), two warpgroups of 64 keys each; K and V stay in
shared memory (128-byte swizzled, as wgmma reads them), dK and dV in registers. The CTA walks every
query block of every query head of its GQA group that the mask lets see its keys (empty blocks
skipped, full ones unmasked; mask tables for masks without a closed form), with the next block's
Q, dO, LSE and D loading (cp.async) while this one computes:

  S^T = K Q^T, dP^T = V dO^T      (both operands from shared memory)
  P^T = exp2(S^T log2(e) scale - LSE2), dS^T = P^T (dP^T - D) * d score_mod / d score * scale
  dV += P^T dO, dK += dS^T Q      (P^T and dS^T straight from the accumulator registers)
  dQ += dS K                      (dS^T through shared memory, read transposed; each warpgroup
                                   takes half the head dim), staged in shared memory and added to the
                                   fp32 accumulator by the bulk copy engine (cp.reduce.async.bulk)

Why it beats the mma.sync family (bwd_sm80): a wgmma's shared-memory operand is read once per
warpgroup rather than once per warp, so the backward's five GEMMs are no longer bound by shared
memory bandwidth (docs/perf-notes.md). The prep and dq kernels are the shared row kernels
(attngen/families/bwd_shared.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from attngen import mask_table
from attngen.codegen import render as codegen
from attngen.errors import SpecError
from attngen.families import bwd_shared
from attngen.families.base import BackwardCall, Config, KernelFamily, KernelPlan, Launch, problem_inputs
from attngen.families.bwd_shared import ARGUMENTS, BackwardPlan, Workspace, the_call
from attngen.faults import check_fault
from attngen.masks import get_mask, mask_problem
from attngen.runtime_inputs import with_inputs
from attngen.spec import Problem
from attngen.targets import Target

FOLDER = Path(__file__).resolve().parent
HEAD_DIMS = (64, 128)  # whole 64-column swizzle chunks; dQ splits the head dim over two warpgroups
BLOCK_MS = (64,)  # query rows per step: the N of S^T = K Q^T (wider would overflow the registers)
NUM_STAGES = (1, 2)
CONSUMERS = 2  # warpgroups, 64 keys each
BLOCK_N = 64 * CONSUMERS
THREADS = 128 * CONSUMERS
ALIGN = 1024  # a 128-byte swizzle atom: 8 rows of 128 bytes


@dataclass(frozen=True)
class Sm90BwdConfig(Config):
    block_m: int
    num_stages: int  # Q/dO pipeline depth

    @property
    def block_n(self) -> int:
        return BLOCK_N

    def label(self) -> str:
        return f"m{self.block_m}n{BLOCK_N}s{self.num_stages}"


@dataclass(frozen=True, kw_only=True)
class Sm90BwdPlan(BackwardPlan):
    num_stages: int
    threads: int
    smem_bytes: int

    def choices(self) -> dict[str, Any]:
        return {"threads": self.threads, "smem_bytes": self.smem_bytes}


def smem_bytes(config: Sm90BwdConfig, head_dim: int) -> int:
    """flash_bwd_sm90.cuh's SMEM_BYTES: alignment slack, K and V, the Q/dO ring, two dS^T buffers, each
    stage's LSE and D rows, two fp32 dQ buffers per warpgroup (half the head dim each)."""
    chunks = head_dim // 64
    kv = 2 * chunks * BLOCK_N * 128
    ring = config.num_stages * 2 * chunks * config.block_m * 128
    ds = 2 * BLOCK_N * config.block_m * 2
    rows = config.num_stages * 2 * config.block_m * 4
    dq = 2 * config.block_m * head_dim * 4
    return ALIGN + kv + ring + ds + rows + dq


class Sm90Backward(KernelFamily):
    name = "bwd_sm90"
    operation = "backward"
    description = "Hopper backward: wgmma, K/V and dK/dV resident per 128-key block, dQ by bulk reductions (sm_90a only)"
    folder = FOLDER
    config_fields = {"block_m": BLOCK_MS, "num_stages": NUM_STAGES}

    def supports(self, problem: Problem, target: Target) -> str | None:
        if target.cc != 90:
            return f"needs sm_90a (H100, H200): wgmma does not exist on {target.name}"
        if problem.head_dim not in HEAD_DIMS:
            return f"head_dim {problem.head_dim} is not one of {HEAD_DIMS}"
        if getattr(problem, "dropout_p", 0.0):
            return "dropout is not built into this family yet"
        if problem.deterministic:
            return "its dQ bulk reductions are unordered (deterministic: bwd_sm80 orders its dQ sums)"
        return mask_problem(problem)

    def configs(self, problem: Problem, target: Target, pinned: Mapping[str, Any] | None = None) -> list[Sm90BwdConfig]:
        pinned = dict(pinned or {})
        values = [(pinned[f],) if f in pinned else allowed for f, allowed in self.config_fields.items()]
        return [Sm90BwdConfig(*combo) for combo in itertools.product(*values)]

    def default_config(self, problem: Problem, target: Target, seqlen: int | None = None) -> Sm90BwdConfig:
        return Sm90BwdConfig(block_m=64, num_stages=2)

    def resolve_config(self, problem: Problem, target: Target, pinned: Mapping[str, Any],
                       seqlen: int | None = None) -> Sm90BwdConfig:
        default = self.default_config(problem, target, seqlen)
        return Sm90BwdConfig(**{f: pinned.get(f, getattr(default, f)) for f in self.config_fields})

    def plan(self, problem: Problem, target: Target, config: Sm90BwdConfig, *,
             fault: str | None = None) -> Sm90BwdPlan:
        check_fault(fault)
        reason = self.supports(problem, target)
        if reason is not None:
            raise SpecError(f"family {self.name} cannot run this problem on {target.name}: {reason}", field="family")
        smem = smem_bytes(config, problem.head_dim)
        if smem > target.smem_per_block:
            raise SpecError(f"config {config.label()} needs {smem} B of shared memory; {target.name} allows "
                            f"{target.smem_per_block} B: lower num_stages", field="config")
        name = self.plan_name(problem, target, config, fault)
        table = mask_table.for_problem(problem)
        abi = mask_table.with_table(with_inputs(ARGUMENTS, problem_inputs(problem), the_call), table, the_call,
                                    config.block_m)
        kernels = (KernelPlan(name, THREADS, smem, abi), *mask_table.kernels(name, table, abi),
                   *bwd_shared.row_kernels(name, abi))
        return Sm90BwdPlan(
            family=self.name, name=name, problem=problem, target=target, config=config, kernels=kernels,
            block_m=config.block_m, block_n=BLOCK_N, fault=fault, num_stages=config.num_stages, threads=THREADS,
            smem_bytes=smem, mask=get_mask(problem.mask))

    def render(self, plan: Sm90BwdPlan) -> str:
        return codegen.render(FOLDER, "bwd_sm90.cu.j2", plan=plan, abi=plan.kernels[0].abi,
                              ptx_type="bf16" if plan.dtype == "bf16" else "f16")

    def workspace_bytes(self, plan: Sm90BwdPlan, call: BackwardCall) -> int:
        return Workspace.of(plan, call).total

    def launches(self, plan: Sm90BwdPlan, call: BackwardCall) -> list[Launch]:
        return bwd_shared.launches(plan, call)

    def estimate(self, plan, report, gpu, shape):
        raise NotImplementedError("the tuner does not time backward kernels yet")


FAMILY = Sm90Backward()
