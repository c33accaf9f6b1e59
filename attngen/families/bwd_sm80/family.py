"""bwd_sm80: the FlashAttention-2-class backward on mma.sync tensor cores (sm_80 and newer).

A call runs three kernels of one module (after the mask's table kernels, for a mask without a
closed form, attngen/mask_table.py):

  prep     per query row: D = rowsum(dO * O) - dLSE, the LSE moved to the log2 domain (+inf for a
           row that saw no key, so every P of it is 0), and the row's fp32 dQ accumulator zeroed;
  main     one CTA per (key block, kv head, batch): K and V stay in shared memory, dK and dV in
           registers (each warp owns 16 or 32 keys), and the CTA walks every query block of every
           query head of its GQA group that the mask lets see the block (empty blocks skipped,
           full ones unmasked), recomputing S and P from Q and the LSE: dV += P^T dO,
           dS = P * (dP - D) * d score_mod / d score * scale, dK += dS^T Q, and dQ += dS K added
           to the fp32 accumulator with atomics (the only order-dependent sums of the call;
           with `deterministic`, added in key order behind a counter per query block instead:
           bwd_shared.py);
  dq       the accumulator converted to dQ's dtype and layout.

Each key's dK and dV are summed over its whole GQA group inside one CTA: no repeated K/V, no
atomics, deterministic. The config is the tile: keys per CTA (block_n), query rows per step
(block_m), warps (each owns block_n / num_warps keys) and Q/dO pipeline stages.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from attngen import dropout, mask_table
from attngen.codegen import render as codegen
from attngen.errors import SpecError
from attngen.families import bwd_shared
from attngen.families.base import (
    BackwardCall,
    Config,
    KernelFamily,
    KernelPlan,
    Launch,
    problem_inputs,
)
from attngen.families.bwd_shared import (
    ARGUMENTS,
    BackwardPlan,
    Workspace,
    the_call,
)
from attngen.faults import check_fault
from attngen.masks import get_mask, mask_problem
from attngen.runtime_inputs import with_inputs
from attngen.spec import Problem
from attngen.targets import Target

FOLDER = Path(__file__).resolve().parent
HEAD_DIMS = (64, 96, 128)  # d256 would need dK and dV split across warps: 256 registers each here
BLOCK_MS = (16, 32, 64, 128)
BLOCK_NS = (16, 32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
NUM_STAGES = (1, 2)
KEYS_PER_WARP = (16, 32)  # one or two m16 tiles of dK/dV rows
# fp32 dK and dV of a warp's keys, per thread, at most: the rest of 255 holds S, dP and addresses.
ACCUMULATOR_BUDGET = 128
# Registers per thread for dK/dV and one register step's S^T, dP^T, P^T and dS^T: the other ~40 of
# 255 hold addresses, loop state and the B fragments.
REGISTER_BUDGET = 215
_LABEL = re.compile(r"m(\d+)n(\d+)w(\d+)s(\d+)")


@dataclass(frozen=True)
class BwdConfig(Config):
    block_m: int  # query rows per step (one Q/dO block)
    block_n: int  # keys per CTA
    num_warps: int
    num_stages: int  # Q/dO pipeline depth

    @property
    def keys_per_warp(self) -> int:
        return self.block_n // self.num_warps

    def label(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"

    @classmethod
    def from_label(cls, label: str) -> "BwdConfig":
        match = _LABEL.fullmatch(label)
        if match is None:
            raise ValueError(f"{label!r} is not a bwd_sm80 config label such as m64n128w8s2")
        return cls(*(int(g) for g in match.groups()))


# Preferred tiles per head dim, first that fits the target's shared memory wins.
DEFAULTS = {
    64: ("m64n128w4s2", "m64n64w2s2", "m32n64w2s1"),
    96: ("m64n128w8s2", "m64n64w4s2", "m32n64w4s1"),
    128: ("m64n128w8s2", "m64n64w4s2", "m32n64w4s1"),
}


@dataclass(frozen=True, kw_only=True)
class BwdPlan(BackwardPlan):
    num_warps: int
    num_stages: int
    sub_m: int  # query columns of S^T per register step within a loaded block
    threads: int
    smem_bytes: int

    def choices(self) -> dict[str, Any]:
        return {"sub_m": self.sub_m, "threads": self.threads, "smem_bytes": self.smem_bytes}


def _row_bytes(head_dim: int) -> int:
    return (head_dim + 8) * 2  # one 16-byte pad per row: ldmatrix free of bank conflicts


def smem_bytes(config: BwdConfig, head_dim: int) -> int:
    """flash_bwd.cuh's SMEM_BYTES: K and V tiles, the Q/dO ring with each stage's LSE and D, dS^T."""
    kv = 2 * config.block_n * _row_bytes(head_dim)
    ring = config.num_stages * (2 * config.block_m * _row_bytes(head_dim) + 2 * config.block_m * 4)
    ds = config.block_n * (config.block_m + 8) * 2
    return kv + ring + ds


def _accumulator_registers(config: BwdConfig, head_dim: int) -> int:
    return 2 * config.keys_per_warp * head_dim // 32


def _sub_m(config: BwdConfig, head_dim: int, dropout: bool = False) -> int:
    """Query columns per register step: the widest whose S^T and dP^T (fp32) and P^T and dS^T
    (packed) fit beside dK and dV: 3 * keys * sub_m / 32 registers per thread, plus with dropout
    two keep words per n8 tile of queries (sub_m / 4), of what REGISTER_BUDGET leaves (at least one
    k16 step)."""
    room = REGISTER_BUDGET - _accumulator_registers(config, head_dim)
    fits = [m for m in BLOCK_MS if config.block_m % m == 0
            and 3 * config.keys_per_warp * m // 32 + (m // 4 if dropout else 0) <= room]
    return max(fits, default=16)


class Sm80Backward(KernelFamily):
    name = "bwd_sm80"
    operation = "backward"
    description = "FlashAttention-2-class backward: mma.sync, K/V and dK/dV resident per key block, dQ by atomics (sm_80+)"
    folder = FOLDER
    config_fields = {"block_m": BLOCK_MS, "block_n": BLOCK_NS, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}

    def supports(self, problem: Problem, target: Target) -> str | None:
        if target.cc < 80:
            return f"needs sm_80 or newer, not {target.name}"
        if problem.head_dim not in HEAD_DIMS:
            return f"head_dim {problem.head_dim} is not one of {HEAD_DIMS} (the backward of d256 is not built yet)"
        return mask_problem(problem)

    def check_config(self, config: Mapping[str, Any]) -> list[str]:
        problems = super().check_config(config)
        block_n, num_warps = config.get("block_n"), config.get("num_warps")
        if not problems and block_n is not None and num_warps is not None \
                and block_n / num_warps not in KEYS_PER_WARP:
            problems.append(f"config.block_n={block_n} is invalid with num_warps={num_warps}; allowed: block_n / "
                            f"num_warps in {{16, 32}} (each warp owns one or two m16 tiles of keys)")
        return problems

    def configs(self, problem: Problem, target: Target, pinned: Mapping[str, Any] | None = None) -> list[BwdConfig]:
        pinned = dict(pinned or {})
        values = [(pinned[f],) if f in pinned else allowed for f, allowed in self.config_fields.items()]
        return [BwdConfig(*combo) for combo in itertools.product(*values)
                if combo[1] / combo[2] in KEYS_PER_WARP
                and _accumulator_registers(BwdConfig(*combo), problem.head_dim) <= ACCUMULATOR_BUDGET]

    def default_config(self, problem: Problem, target: Target, seqlen: int | None = None) -> BwdConfig:
        choices = [BwdConfig.from_label(label) for label in DEFAULTS.get(problem.head_dim, DEFAULTS[128])]
        for config in choices:
            if smem_bytes(config, problem.head_dim) <= target.smem_per_block:
                return config
        return choices[-1]  # plan() then says why it does not fit

    def resolve_config(self, problem: Problem, target: Target, pinned: Mapping[str, Any],
                       seqlen: int | None = None) -> BwdConfig:
        default = self.default_config(problem, target, seqlen)
        tile = {f: pinned.get(f, getattr(default, f)) for f in self.config_fields}
        keys = default.keys_per_warp
        if "block_n" not in pinned and "num_warps" in pinned:
            tile["block_n"] = tile["num_warps"] * keys if tile["num_warps"] * keys in BLOCK_NS else tile["num_warps"] * 16
        elif "num_warps" not in pinned and "block_n" in pinned:
            fits = [r for r in (keys, 16, 32) if tile["block_n"] // r in NUM_WARPS and tile["block_n"] % r == 0]
            tile["num_warps"] = tile["block_n"] // fits[0] if fits else default.num_warps
        return BwdConfig(**tile)

    def plan(self, problem: Problem, target: Target, config: BwdConfig, *, fault: str | None = None) -> BwdPlan:
        check_fault(fault)
        reason = self.supports(problem, target)
        if reason is not None:
            raise SpecError(f"family {self.name} cannot run this problem on {target.name}: {reason}", field="family")
        if config.keys_per_warp not in KEYS_PER_WARP or config.block_n % config.num_warps:
            raise SpecError(f"config {config.label()}: block_n / num_warps must be 16 or 32", field="config")
        if _accumulator_registers(config, problem.head_dim) > ACCUMULATOR_BUDGET:
            raise SpecError(f"config {config.label()}: {config.keys_per_warp} keys per warp at head_dim "
                            f"{problem.head_dim} need {_accumulator_registers(config, problem.head_dim)} registers "
                            f"of dK/dV per thread; allowed: at most {ACCUMULATOR_BUDGET} (16 keys per warp at "
                            "head_dim > 64)", field="config")
        smem = smem_bytes(config, problem.head_dim)
        if smem > target.smem_per_block:
            raise SpecError(
                f"config {config.label()} needs {smem} B of shared memory (K and V: 2*block_n rows, the Q/dO ring: "
                f"2*num_stages*block_m rows of {problem.head_dim + 8} elements, dS^T: block_n x (block_m + 8)); "
                f"{target.name} allows {target.smem_per_block} B: lower num_stages, block_m or block_n",
                field="config")
        name = self.plan_name(problem, target, config, fault)
        threads = config.num_warps * 32
        table = mask_table.for_problem(problem)
        abi = mask_table.with_table(with_inputs(ARGUMENTS, problem_inputs(problem), the_call), table, the_call,
                                    config.block_m)
        if problem.dropout_p:
            abi = dropout.with_rng(abi, the_call)
        kernels = (KernelPlan(name, threads, smem, abi), *mask_table.kernels(name, table, abi),
                   *bwd_shared.row_kernels(name, abi))
        return BwdPlan(
            family=self.name, name=name, problem=problem, target=target, config=config, kernels=kernels,
            block_m=config.block_m, block_n=config.block_n, fault=fault, num_warps=config.num_warps,
            num_stages=config.num_stages, sub_m=_sub_m(config, problem.head_dim, problem.dropout_p > 0), threads=threads, smem_bytes=smem,
            mask=get_mask(problem.mask))

    def render(self, plan: BwdPlan) -> str:
        return codegen.render(FOLDER, "bwd.cu.j2", plan=plan, abi=plan.kernels[0].abi)

    def workspace_bytes(self, plan: BwdPlan, call: BackwardCall) -> int:
        return Workspace.of(plan, call).total

    def launches(self, plan: BwdPlan, call: BackwardCall) -> list[Launch]:
        return bwd_shared.launches(plan, call)

    def estimate(self, plan, report, gpu, shape):
        raise NotImplementedError("the tuner does not time backward kernels yet")


FAMILY = Sm80Backward()
