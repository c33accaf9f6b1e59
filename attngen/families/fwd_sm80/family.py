"""fwd_sm80: the FlashAttention-2-class forward on mma.sync tensor cores (sm_80 and newer).

One CTA computes one query block of one (batch, query head): Q stays in registers or shared
memory, K/V blocks stream through a cp.async ring of `num_stages` stages, S and P live in
registers with an online softmax, and key blocks the mask makes empty are never loaded
(flash_fwd.cuh). The config is the tile: query rows per CTA (block_m), keys per step (block_n),
warps (each owns 16 or 32 query rows) and pipeline stages.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from attngen import dropout, mask_table
from attngen.codegen import render as codegen
from attngen.codegen.abi import Abi, Param
from attngen.errors import SpecError
from attngen.families.base import (
    Config,
    ForwardCall,
    ForwardPlan,
    KernelFamily,
    KernelPlan,
    Launch,
    problem_inputs,
)
from attngen.families import varlen_tiles
from attngen.faults import check_fault
from attngen.masks import bounds_read_at_batch, causal_shaped, get_mask, is_band, mask_problem, row_interval
from attngen.runtime_inputs import with_inputs
from attngen.spec import HEAD_DIMS, Problem
from attngen.targets import Target

FOLDER = Path(__file__).resolve().parent
LOG2E = 1.4426950408889634
BLOCK_MS = (16, 32, 64, 128, 256)
BLOCK_NS = (16, 32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
NUM_STAGES = (1, 2, 3, 4)
# A warp owns 16 or 32 query rows: one or two m16 MMA tiles.
ROWS_PER_WARP = (16, 32)
# Registers a thread may hold before the compiler must spill (of 255) keep a margin for
# addresses, loop state and softmax temporaries.
REGISTER_BUDGET = 168
_LABEL = re.compile(r"m(\d+)n(\d+)w(\d+)s(\d+)")


@dataclass(frozen=True)
class Sm80Config(Config):
    block_m: int  # query rows per CTA
    block_n: int  # keys per main-loop step
    num_warps: int
    num_stages: int  # K/V pipeline depth

    @property
    def rows_per_warp(self) -> int:
        return self.block_m // self.num_warps

    def label(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"

    @classmethod
    def from_label(cls, label: str) -> "Sm80Config":
        match = _LABEL.fullmatch(label)
        if match is None:
            raise ValueError(f"{label!r} is not a fwd_sm80 config label such as m128n64w4s2")
        return cls(*(int(g) for g in match.groups()))


@dataclass(frozen=True, kw_only=True)
class Sm80Plan(ForwardPlan):
    LISTS_KEY_BLOCKS = True
    num_warps: int
    num_stages: int
    q_in_regs: bool  # Q fragments stay in registers (else re-read from shared memory per k16 step)
    row_sums_in_smem: bool  # per-thread partial row sums in shared memory: registers for a wider S
    sub_n: int  # keys per softmax step within a loaded block
    threads: int
    smem_bytes: int
    min_blocks_per_sm: int

    def choices(self) -> dict[str, Any]:
        return {"q_in_regs": self.q_in_regs, "row_sums_in_smem": self.row_sums_in_smem, "sub_n": self.sub_n,
                "threads": self.threads, "smem_bytes": self.smem_bytes, "min_blocks_per_sm": self.min_blocks_per_sm}


# The kernel's arguments, once: the struct, the signature and the host packer come from this list.
ARGUMENTS = Abi("FwdParams", [
    Param("q", "const cfg::elem_t*", "ptr", lambda c: c.q.ptr),
    Param("k", "const cfg::elem_t*", "ptr", lambda c: c.k.ptr),
    Param("v", "const cfg::elem_t*", "ptr", lambda c: c.v.ptr),
    Param("o", "cfg::elem_t*", "ptr", lambda c: c.out.ptr),
    Param("lse", "float*", "ptr", lambda c: c.lse.ptr, "(B, Hq, Sq), contiguous"),
    Param("Sq", "int", "i32", lambda c: c.seq_q),
    Param("Sk", "int", "i32", lambda c: c.seq_k),
    Param("Hq", "int", "i32", lambda c: c.heads_q),
    *(Param(f"{t}_s{dim}", "i64", "i64", (lambda i, t: lambda c: getattr(c, t).strides[i])(i, attr),
            f"{t} {what} stride, elements" if dim == "b" else "")
      for t, attr in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))
      for i, (dim, what) in enumerate((("b", "batch"), ("s", "seq"), ("h", "head")))),
    Param("scale_log2", "float", "f32", lambda c: c.softmax_scale * LOG2E,
          "softmax_scale * log2(e): exp2 replaces exp with the scale folded in"),
    Param("scale", "float", "f32", lambda c: c.softmax_scale, "softmax_scale: a score modifier sees scaled scores"),
])


@functools.lru_cache(maxsize=None)
def _varlen_arguments(block_m: int) -> tuple[Param, ...]:
    """Packed sequences (Problem.varlen): what the tile builder and the kernel read of the call's list
    (attngen/cuda/varlen_tiles.cuh), which fills the whole workspace (such masks have no block table)."""
    return (Param("num_seqs", "int", "i32", varlen_tiles.num_seqs, "varlen: sequences (cu_seqlens entries - 1)"),
            Param("m_blocks", "int", "i32", lambda c: varlen_tiles.capacity(block_m, c), "varlen: the list's capacity"),
            Param("tile_counter", "int*", "ptr", lambda c: c.workspace, "varlen: the segment table and tile list "
                  "(workspace)"))


def _the_call(call: ForwardCall) -> ForwardCall:
    """What this family packs is the ForwardCall itself (attngen/runtime_inputs.py with_inputs)."""
    return call


def _fragment_registers(config: Sm80Config, head_dim: int, sub_n: int, q_in_regs: bool) -> int:
    """32-bit registers per thread for the O, S, P (and Q) fragments of one warp's rows."""
    m_tiles = config.rows_per_warp // 16
    per_tile = head_dim // 2 + sub_n // 2 + sub_n // 4
    if q_in_regs:
        per_tile += head_dim // 4
    return m_tiles * per_tile


def smem_bytes(config: Sm80Config, head_dim: int, row_sums_in_smem: bool) -> int:
    """flash_fwd.cuh's SMEM_BYTES: padded Q and K/V stage tiles, then any fp32 row-sum partials."""
    row_bytes = (head_dim + 8) * 2  # one 16-byte pad per row
    # Each query row has one fp32 partial in each of the 4 lanes of its quad.
    row_sum_bytes = config.block_m * 4 * 4 if row_sums_in_smem else 0
    return row_bytes * (config.block_m + 2 * config.num_stages * config.block_n) + row_sum_bytes


@functools.lru_cache(maxsize=None)
def _preferences() -> dict[tuple[int, bool], list[Sm80Config]]:
    """(head dim, has expressions beyond none/causal) -> configs in order of preference, from tile_defaults.yaml."""
    table = yaml.safe_load((FOLDER / "tile_defaults.yaml").read_text())
    modified = table.pop("expressions", {})
    plain = {(int(d), False): [Sm80Config.from_label(label) for label in labels] for d, labels in table.items()}
    return {**plain, **{(d, True): plain[d, False] for d, _ in plain},
            **{(int(d), True): [Sm80Config.from_label(label) for label in labels] for d, labels in modified.items()}}


class Sm80Forward(KernelFamily):
    name = "fwd_sm80"
    description = "FlashAttention-2-class forward: mma.sync, cp.async ring, one CTA per query block (sm_80+)"
    folder = FOLDER
    config_fields = {"block_m": BLOCK_MS, "block_n": BLOCK_NS, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}

    def supports(self, problem: Problem, target: Target) -> str | None:
        if target.cc < 80:
            return f"needs sm_80 or newer, not {target.name}"
        if problem.head_dim not in HEAD_DIMS:
            return f"head_dim {problem.head_dim} is not one of {HEAD_DIMS}"
        return mask_problem(problem, per_sequence_tiles=True)

    def check_config(self, config: Mapping[str, Any]) -> list[str]:
        problems = super().check_config(config)
        block_m, num_warps = config.get("block_m"), config.get("num_warps")
        if not problems and block_m is not None and num_warps is not None and block_m / num_warps not in ROWS_PER_WARP:
            problems.append(f"config.block_m={block_m} is invalid with num_warps={num_warps}; allowed: block_m / "
                            f"num_warps in {{16, 32}} (each warp owns one or two m16 tiles)")
        return problems

    def configs(self, problem: Problem, target: Target, pinned: Mapping[str, Any] | None = None) -> list[Sm80Config]:
        pinned = dict(pinned or {})
        values = [(pinned[f],) if f in pinned else allowed for f, allowed in self.config_fields.items()]
        return [Sm80Config(*combo) for combo in itertools.product(*values)
                if combo[0] / combo[2] in ROWS_PER_WARP]

    def default_config(self, problem: Problem, target: Target, seqlen: int | None = None) -> Sm80Config:
        # A mask with a closed form (a window, chunks, a band such as `q_idx >= kv_idx`, a prefix such as
        # prefix_lm(plen[b])) is masked as causal is: causal's tile, not the smaller one that keeps other
        # expressions' per-element work from spilling. What spills there (tests/test_mask_bands.py): chunks, which
        # divide per row, beside a packed sequence's tile (32-148 bytes) or dropout's keep masks (8-16), a prefix's
        # two ends beside a packed sequence's tile (24), and beside the keep masks a window's second bound (40 at
        # d64) or a band's scalar inputs (8): those keep the smaller tile. So does a prefix read per batch row at
        # d128 for sm_90a, where causal's tile already takes 255 registers (28 bytes spilled; 0 for sm_80).
        mask = problem.mask
        plain = row_interval(mask) and problem.score_mod is None and problem.sink is None
        if problem.head_dim == 128 and target.cc >= 90:
            plain = plain and not bounds_read_at_batch(mask)
        if problem.dropout_p:
            plain = plain and (mask in ("none", "causal") or is_band(mask) and causal_shaped(mask)
                               and not get_mask(mask).program.inputs)
        elif problem.varlen:
            plain = plain and is_band(mask)
        choices = _preferences()[problem.head_dim, not plain]
        for config in choices:
            if self._smem(config, problem.head_dim) <= target.smem_per_block:
                return config
        return choices[-1]  # plan() then says why it does not fit

    def resolve_config(self, problem: Problem, target: Target, pinned: Mapping[str, Any],
                       seqlen: int | None = None) -> Sm80Config:
        default = self.default_config(problem, target, seqlen)
        tile = {f: pinned.get(f, getattr(default, f)) for f in self.config_fields}
        # Only one of block_m / num_warps given: keep the default rows per warp for the other.
        rows = default.rows_per_warp
        if "block_m" not in pinned and "num_warps" in pinned:
            tile["block_m"] = tile["num_warps"] * rows if tile["num_warps"] * rows in BLOCK_MS else tile["num_warps"] * 16
        elif "num_warps" not in pinned and "block_m" in pinned:
            fits = [r for r in (rows, 16, 32) if tile["block_m"] // r in NUM_WARPS and tile["block_m"] % r == 0]
            tile["num_warps"] = tile["block_m"] // fits[0] if fits else default.num_warps
        return Sm80Config(**tile)

    @staticmethod
    def _register_tight(config: Sm80Config, head_dim: int) -> bool:
        # Two m16 tiles per warp at a large head dim leave registers for at most a 64-key S next
        # to O, and only with the row sums in shared memory (docs/perf-notes.md v4, v7).
        return config.rows_per_warp == 32 and head_dim >= 96

    def _smem(self, config: Sm80Config, head_dim: int) -> int:
        return smem_bytes(config, head_dim, row_sums_in_smem=self._register_tight(config, head_dim))

    def plan(self, problem: Problem, target: Target, config: Sm80Config, *, fault: str | None = None) -> Sm80Plan:
        check_fault(fault)
        reason = self.supports(problem, target)
        if reason is not None:
            raise SpecError(f"family {self.name} cannot run this problem on {target.name}: {reason}", field="family")
        if config.rows_per_warp not in ROWS_PER_WARP or config.block_m % config.num_warps:
            raise SpecError(f"config {config.label()}: block_m / num_warps must be 16 or 32", field="config")
        register_tight = self._register_tight(config, problem.head_dim)
        # Dropout's keep masks of two m16 tiles are live beside the packed P: 64-key steps at most.
        narrow = register_tight or (problem.dropout_p > 0 and config.rows_per_warp == 32)
        sub_n = min(config.block_n, 64) if narrow else config.block_n
        q_in_regs = _fragment_registers(config, problem.head_dim, sub_n, q_in_regs=True) <= REGISTER_BUDGET
        smem = smem_bytes(config, problem.head_dim, row_sums_in_smem=register_tight)
        if smem > target.smem_per_block:
            raise SpecError(
                f"config {config.label()} needs {smem} B of shared memory (block_m + 2*num_stages*block_n rows of "
                f"{problem.head_dim + 8} elements{', and 16 B of row sums per query row' if register_tight else ''}); "
                f"{target.name} allows {target.smem_per_block} B: lower num_stages, block_n or block_m",
                field="config")
        name = self.plan_name(problem, target, config, fault)
        threads = config.num_warps * 32
        table = mask_table.for_problem(problem, config.block_n)  # with key-block lists
        abi = mask_table.with_table(with_inputs(ARGUMENTS, problem_inputs(problem), _the_call), table, _the_call,
                                    config.block_m)
        if problem.dropout_p:
            abi = dropout.with_rng(abi, _the_call)
        builder = ()
        if problem.varlen:  # (mask_problem: a closed form without inputs, so no block table beside the list)
            abi = Abi(abi.struct_name, [*abi.params, *_varlen_arguments(config.block_m)])
            builder = varlen_tiles.builder_kernels(name, abi)
        return Sm80Plan(
            family=self.name, name=name, problem=problem, target=target, config=config,
            kernels=(KernelPlan(name, threads, smem, abi), *mask_table.kernels(name, table, abi), *builder),
            block_m=config.block_m, block_n=config.block_n,
            fault=fault, num_warps=config.num_warps, num_stages=config.num_stages, q_in_regs=q_in_regs,
            row_sums_in_smem=register_tight, sub_n=sub_n, threads=threads, smem_bytes=smem, min_blocks_per_sm=1,
            mask=get_mask(problem.mask))

    def render(self, plan: Sm80Plan) -> str:
        return codegen.render(FOLDER, "fwd.cu.j2", plan=plan, abi=plan.kernels[0].abi)

    def workspace_bytes(self, plan: Sm80Plan, call: ForwardCall) -> int:
        if plan.problem.varlen:
            return varlen_tiles.workspace_bytes(plan.block_m, call)
        return mask_table.workspace_bytes(plan.mask_table, call, plan.block_m)

    def launches(self, plan: Sm80Plan, call: ForwardCall) -> list[Launch]:
        params = plan.kernels[0].abi.pack(call)
        if plan.problem.varlen:  # the list first, then a CTA per entry (its capacity) and query head
            grid = (varlen_tiles.capacity(plan.block_m, call), call.heads_q, 1)
            return [varlen_tiles.builder_launch(plan.name, call, params),
                    Launch(plan.name, grid, (plan.threads, 1, 1), plan.smem_bytes, params)]
        grid = (math.ceil(call.seq_q / plan.block_m), call.heads_q, call.batch)
        return [*mask_table.launches(plan, call, params),
                Launch(plan.name, grid, (plan.threads, 1, 1), plan.smem_bytes, params)]

    def estimate(self, plan, report, gpu, shape):
        from attngen.families.fwd_sm80.estimate import estimate

        return estimate(plan, report, gpu, shape)


FAMILY = Sm80Forward()
