"""decode_sm80: split-KV flash decoding on mma.sync tensor cores (sm_80 and newer).

A decode step has a few new query tokens per sequence and reads the whole KV cache: it is bound by
memory bandwidth, so the kernel's job is to read every cached byte once, with enough bytes in
flight. One CTA takes one (split, kv head, row tile, sequence): its rows are the kv head's query
heads times the new tokens (GQA packing), its keys one split's share of the cached blocks, which
stream through a ring whose stages are all filled at the start, by cp.async or (config.loads "tma",
sm_90) by tensor-map boxes; every warp holds all the rows and takes its own keys of each block
(flash_decode.cuh). With more than one split a combine
kernel merges the splits' partials through their LSEs. The number of splits is chosen per call
from the shapes alone (`choose_splits`: no host synchronisation, so a call can be captured in a
CUDA graph), or given by the caller.

The cache is paged, `(num_pages, page_size, heads_kv, head_dim)` with a page table `(batch,
pages_per_sequence)` int32, or contiguous, `(batch, capacity, heads_kv, head_dim)`; each sequence's
length comes from `cache_seqlens` (batch,) int32 on the device. The masks and score modifiers are
the forward's (attngen/masks.py, attngen/score_mods.py) with q_len = the new tokens and kv_len =
the sequence's cache length, so causal is bottom-right aligned. A mask with a closed form skips
the blocks it hides; any other is applied per element to every block.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from attngen.codegen import render as codegen
from attngen.codegen.abi import Abi, Param
from attngen.dtypes import get_dtype
from attngen.errors import SpecError
from attngen.families.base import (
    MAX_SPLITS,
    Config,
    DecodeCall,
    ForwardPlan,
    KernelFamily,
    KernelPlan,
    Launch,
    problem_inputs,
)
from attngen.families import tma
from attngen.faults import check_fault
from attngen.masks import get_mask, mask_problem
from attngen.runtime_inputs import with_inputs
from attngen.spec import HEAD_DIMS, Problem
from attngen.targets import Target

FOLDER = Path(__file__).resolve().parent
LOG2E = 1.4426950408889634
BLOCK_MS = (16, 32, 64)
BLOCK_NS = (32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
NUM_STAGES = (2, 3, 4)
# Rows x head dim a thread's fragments hold at most (Q and O of every row in every warp): 16 rows
# at d256 is 128 + 64 registers for O and Q, the most that leaves room for S and addresses.
MAX_ROWS_TIMES_DIM = 16 * 256
MIN_WARP_KEYS = 16  # a warp takes whole k16 steps of each block
COMBINE_THREADS = 128  # one output row per combine CTA, its 4 warps sharing the splits (COMBINE_WARPS)
MIN_BLOCKS_PER_SPLIT = 2  # shorter splits cost more in partials and combine than they gain
# A CTA's fixed cost (prologue latency, the warps' merge, its partials), in key blocks' time.
CTA_FIXED_BLOCKS = 1
# How cached rows reach shared memory: cp.async (16 bytes per thread and instruction, sm_80+) or
# tensor-map boxes on the TMA (sm_90+), completing on a per-stage mbarrier. Label letter "t".
LOADS = ("cp_async", "tma")
MIN_BOX_ROWS = 8  # flash_decode.cuh: a paged block's boxes are one per lane of a warp; fewer rows -> cp.async
_LABEL = re.compile(r"m(\d+)n(\d+)w(\d+)s(\d+)(t?)")


@dataclass(frozen=True)
class DecodeConfig(Config):
    block_m: int  # rows (query heads x new tokens) per CTA
    block_n: int  # keys per loaded block
    num_warps: int  # each takes block_n / num_warps keys of every block
    num_stages: int  # K/V pipeline depth
    loads: str = "cp_async"  # LOADS

    def label(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                + ("t" if self.loads == "tma" else ""))

    @classmethod
    def from_label(cls, label: str) -> "DecodeConfig":
        match = _LABEL.fullmatch(label)
        if match is None:
            raise ValueError(f"{label!r} is not a decode_sm80 config label such as m16n64w4s3 or m16n64w4s3t")
        return cls(*(int(g) for g in match.groups()[:4]), "tma" if match.group(5) else "cp_async")


@dataclass(frozen=True, kw_only=True)
class DecodePlan(ForwardPlan):
    num_warps: int
    num_stages: int
    paged: bool  # a paged cache (page table) or a contiguous one
    tma: bool  # K/V by tensor-map boxes where the call's layout allows (config.loads == "tma")
    whole_pages: bool  # paged cp.async, pages whose size is a multiple of block_n (whole_pages())
    threads: int
    smem_bytes: int
    combine_threads: int = COMBINE_THREADS

    @property
    def mask_table(self) -> None:
        """No block table: a mask without a closed form is applied per element to every block."""
        return None

    def choices(self) -> dict[str, Any]:
        return {"paged": self.paged, "tma": self.tma, "whole_pages": self.whole_pages, "threads": self.threads,
                "smem_bytes": self.smem_bytes}


def _the_call(call: "DecodeCall | TmaDecodeArgs") -> "DecodeCall | TmaDecodeArgs":
    return call


@dataclass(frozen=True)
class TmaDecodeArgs:
    """What a TMA plan's launch packs: the call (its fields read through), the K and V caches' tensor
    maps and the rows of their boxes (0: this call's layout takes the cp.async path)."""

    call: DecodeCall
    tmap_k: bytes
    tmap_v: bytes
    box_rows: int

    def __getattr__(self, name: str):
        return getattr(self.call, name)

    def input(self, name: str):
        return self.call.input(name)


# The kernels' arguments, once (both kernels take the same struct).
ARGUMENTS = Abi("DecodeParams", [
    Param("q", "const cfg::elem_t*", "ptr", lambda c: c.q.ptr, "(B, Sq, Hq, D) new tokens' queries"),
    Param("k", "const cfg::elem_t*", "ptr", lambda c: c.k.ptr, "the cache: (pages, page_size, Hkv, D) or (B, capacity, Hkv, D)"),
    Param("v", "const cfg::elem_t*", "ptr", lambda c: c.v.ptr),
    Param("o", "cfg::elem_t*", "ptr", lambda c: c.out.ptr),
    Param("lse", "float*", "ptr", lambda c: c.lse.ptr, "(B, Hq, Sq), contiguous"),
    Param("o_part", "float*", "ptr", lambda c: c.workspace, "workspace: (splits, B, Sq, Hq, D) fp32 partials"),
    Param("lse_part", "float*", "ptr", lambda c: c.workspace + 4 * c.partial_rows * c.head_dim if c.workspace else 0,
          "workspace: (splits, B, Sq, Hq) partial LSEs, log2 domain"),
    Param("seqlens", "const int*", "ptr", lambda c: c.seqlens.ptr, "(B,) cache length of each sequence"),
    Param("page_table", "const int*", "ptr", lambda c: c.page_table.ptr if c.page_table else 0,
          "(B, pages per sequence); unused for a contiguous cache"),
    Param("Sq", "int", "i32", lambda c: c.seq_q),
    Param("Hq", "int", "i32", lambda c: c.heads_q),
    Param("batch", "int", "i32", lambda c: c.batch),
    Param("num_splits", "int", "i32", lambda c: c.num_splits),
    Param("capacity", "int", "i32", lambda c: c.capacity, "tokens a sequence's cache holds at most"),
    Param("page_size", "int", "i32", lambda c: c.page_size),
    Param("num_pages", "int", "i32", lambda c: c.num_pages, "valid page ids are [0, num_pages)"),
    Param("pt_sb", "i64", "i64", lambda c: c.page_table.strides[0] if c.page_table else 0),
    *(Param(f"{t}_s{dim}", "i64", "i64", (lambda i, a: lambda c: getattr(c, a).strides[i])(i, attr),
            f"{t} {what} stride, elements" if i == 0 else "")
      for t, attr, first in (("q", "q", "b"), ("k", "k", "p"), ("v", "v", "p"), ("o", "out", "b"))
      for i, (dim, what) in enumerate(((first, "page (or batch)" if first == "p" else "batch"), ("s", "seq"),
                                       ("h", "head")))),
    Param("scale_log2", "float", "f32", lambda c: c.softmax_scale * LOG2E, "softmax_scale * log2(e)"),
    Param("scale", "float", "f32", lambda c: c.softmax_scale, "softmax_scale: a score modifier sees scaled scores"),
])


# TMA plans add the tensor maps and their box rows (TensorMap: attngen/cuda/hopper.cuh).
TMA_ARGUMENTS = Abi("DecodeParams", [
    *ARGUMENTS.params,
    Param("tmap_k", "TensorMap", "tensor_map", lambda a: a.tmap_k, "K cache, box: 64 columns x box_rows rows"),
    Param("tmap_v", "TensorMap", "tensor_map", lambda a: a.tmap_v),
    Param("box_rows", "int", "i32", lambda a: a.box_rows, "rows per box; 0: cp.async for this call"),
])


def smem_bytes(config: DecodeConfig, head_dim: int) -> int:
    """flash_decode.cuh's SMEM_BYTES: the Q tile (padded rows) and the K/V ring (rows of 128-byte
    sub-tiles), or the warps' merge if larger; with TMA, 1 KB of alignment slack and the mbarriers."""
    tiles = config.block_m * (head_dim + 8) * 2 + 2 * config.num_stages * config.block_n * 128 * -(-head_dim // 64)
    merge = config.num_warps * config.block_m * (head_dim + 4 + 2) * 4
    if config.loads == "tma":
        return 1024 + max(tiles, merge) + -(-8 * config.num_stages // 16) * 16
    return max(tiles, merge)


def box_rows(plan: "DecodePlan", call: DecodeCall) -> int:
    """Rows of a TMA box for this call's cache, or 0 where TMA cannot take it (flash_decode.cuh
    then copies with cp.async): a box must stay inside one page and describe 16-byte-aligned data."""
    itemsize = get_dtype(plan.dtype).itemsize
    for t in (call.k, call.v):
        if t.ptr % 16 or tma.describable(t.shape, t.strides, itemsize) is not None:
            return 0
    rows = math.gcd(plan.block_n, call.page_size) if plan.paged else plan.block_n
    return rows if rows >= MIN_BOX_ROWS else 0


def whole_pages(config: DecodeConfig, page_size: int | None) -> bool:
    """Whether a paged call takes the plan for pages of whole blocks: cp.async loads (a TMA plan keeps one
    kernel for every page size: boxes, or its own cp.async path where a call's layout cannot be boxed) and
    a page size that is a multiple of block_n, so a block never straddles two pages. Those plans find each
    block's rows as the contiguous cache does and read the page table 32 ids at a time (flash_decode.cuh
    WHOLE_PAGES); every other page size takes the per-row plan."""
    return page_size is not None and config.loads == "cp_async" and page_size % config.block_n == 0


def choose_splits(batch: int, kv_heads: int, row_tiles: int, capacity: int, block_n: int, sms: int,
                  ctas_per_sm: int) -> int:
    """Splits per sequence from the shapes alone (the lengths are on the device): the count whose
    CTAs finish first in a model of waves over the GPU's CTA slots, each CTA taking its split's
    blocks of a full cache (splits differ by at most one block) plus CTA_FIXED_BLOCKS; the fewest
    splits among equals, each keeping at least MIN_BLOCKS_PER_SPLIT blocks."""
    base = batch * kv_heads * row_tiles
    slots = max(1, sms * ctas_per_sm)
    blocks = math.ceil(capacity / block_n)
    most = max(1, min(MAX_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT))

    def cost(splits: int) -> int:
        return math.ceil(base * splits / slots) * (math.ceil(blocks / splits) + CTA_FIXED_BLOCKS)

    return min(range(1, most + 1), key=lambda splits: (cost(splits), splits))


class Sm80Decode(KernelFamily):
    name = "decode_sm80"
    operation = "decode"
    description = "Split-KV flash decoding over a paged or contiguous KV cache: mma.sync, GQA packing (sm_80+)"
    folder = FOLDER
    config_fields = {"block_m": BLOCK_MS, "block_n": BLOCK_NS, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES,
                     "loads": LOADS}

    def supports(self, problem: Problem, target: Target) -> str | None:
        if target.cc < 80:
            return f"needs sm_80 or newer, not {target.name}"
        if problem.head_dim not in HEAD_DIMS:
            return f"head_dim {problem.head_dim} is not one of {HEAD_DIMS}"
        if problem.dropout_p:
            return f"dropout_p={problem.dropout_p} is for training; decoding is inference: allowed dropout_p=0"
        return mask_problem(problem)

    def check_config(self, config: Mapping[str, Any]) -> list[str]:
        problems = super().check_config(config)
        block_n, num_warps = config.get("block_n"), config.get("num_warps")
        if not problems and block_n is not None and num_warps is not None and block_n // num_warps < MIN_WARP_KEYS:
            problems.append(f"config.block_n={block_n} is invalid with num_warps={num_warps}; allowed: block_n / "
                            f"num_warps >= {MIN_WARP_KEYS} (each warp takes whole k16 steps of keys)")
        return problems

    def configs(self, problem: Problem, target: Target, pinned: Mapping[str, Any] | None = None) -> list[DecodeConfig]:
        pinned = dict(pinned or {})
        values = [(pinned[f],) if f in pinned else allowed for f, allowed in self.config_fields.items()]
        return [DecodeConfig(*combo) for combo in itertools.product(*values)
                if combo[1] // combo[2] >= MIN_WARP_KEYS and combo[0] * problem.head_dim <= MAX_ROWS_TIMES_DIM
                and (combo[4] != "tma" or target.cc >= 90)]

    def default_config(self, problem: Problem, target: Target, seqlen: int | None = None) -> DecodeConfig:
        for stages in (3, 2):
            config = DecodeConfig(16, 64, 4, stages)
            if smem_bytes(config, problem.head_dim) <= target.smem_per_block // 2:  # two CTAs per SM
                return config
        return DecodeConfig(16, 32, 2, 2)

    def resolve_config(self, problem: Problem, target: Target, pinned: Mapping[str, Any],
                       seqlen: int | None = None) -> DecodeConfig:
        default = self.default_config(problem, target, seqlen)
        return DecodeConfig(**{f: pinned.get(f, getattr(default, f)) for f in self.config_fields})

    def plan(self, problem: Problem, target: Target, config: DecodeConfig, *, fault: str | None = None,
             paged: bool = True, page_size: int | None = None) -> DecodePlan:
        """The plan for a paged (`page_size`: the call's, None: any) or contiguous cache."""
        check_fault(fault)
        if fault is not None:
            raise SpecError(f"family {self.name} has no injected faults (fault={fault!r})", field="fault")
        reason = self.supports(problem, target)
        if reason is not None:
            raise SpecError(f"family {self.name} cannot run this problem on {target.name}: {reason}", field="family")
        problems = self.check_config(config.to_dict())
        if config.loads == "tma" and target.cc < 90:
            problems.append(f"config.loads='tma' needs sm_90 or newer (tensor-map loads), not {target.name}; "
                            f"allowed there: 'cp_async'")
        if config.block_m * problem.head_dim > MAX_ROWS_TIMES_DIM:
            problems.append(f"config {config.label()}: block_m={config.block_m} rows at head_dim {problem.head_dim} "
                            f"do not fit in registers; allowed: block_m * head_dim <= {MAX_ROWS_TIMES_DIM}")
        if problems:
            raise SpecError("; ".join(problems), field="config")
        smem = smem_bytes(config, problem.head_dim)
        if smem > target.smem_per_block:
            raise SpecError(f"config {config.label()} needs {smem} B of shared memory; {target.name} allows "
                            f"{target.smem_per_block} B: lower num_stages or block_n", field="config")
        whole = paged and whole_pages(config, page_size)
        cache = ("paged_whole" if whole else "paged") if paged else "contiguous"
        name = f"{self.plan_name(problem, target, config)}_{cache}"
        threads = config.num_warps * 32
        abi = with_inputs(TMA_ARGUMENTS if config.loads == "tma" else ARGUMENTS, problem_inputs(problem), _the_call)
        return DecodePlan(
            family=self.name, name=name, problem=problem, target=target, config=config,
            kernels=(KernelPlan(name, threads, smem, abi), KernelPlan(f"{name}_combine", COMBINE_THREADS, 0, abi)),
            block_m=config.block_m, block_n=config.block_n, num_warps=config.num_warps,
            num_stages=config.num_stages, paged=paged, tma=config.loads == "tma", whole_pages=whole, threads=threads,
            smem_bytes=smem, mask=get_mask(problem.mask))

    def render(self, plan: DecodePlan) -> str:
        return codegen.render(FOLDER, "decode.cu.j2", plan=plan, abi=plan.kernels[0].abi)

    def num_splits(self, plan: DecodePlan, call: DecodeCall, target: Target) -> int:
        """choose_splits for this call on `target`: CTA slots per SM from the kernel's shared memory
        and threads (registers allow two CTAs of the default configs)."""
        per_sm = min(target.smem_per_sm // (plan.smem_bytes + 1024), 2048 // plan.threads, 32)
        return choose_splits(call.batch, call.heads_kv, self.row_tiles(plan, call), call.capacity, plan.block_n,
                             target.sms or 132, max(1, per_sm))

    def row_tiles(self, plan: DecodePlan, call: DecodeCall) -> int:
        return math.ceil(call.seq_q * plan.gqa_ratio / plan.block_m)

    def workspace_bytes(self, plan: DecodePlan, call: DecodeCall) -> int:
        return 0 if call.num_splits == 1 else 4 * call.partial_rows * (plan.head_dim + 1)

    def launches(self, plan: DecodePlan, call: DecodeCall) -> list[Launch]:
        params = plan.kernels[0].abi.pack(self._tma_args(plan, call) if plan.tma else call)
        grid = (call.heads_kv * self.row_tiles(plan, call), call.num_splits, call.batch)
        # sm_90: both kernels are launched early (programmatic dependent launches): each one's launch and
        # start-up overlap the end of the kernel before it in the stream (for the split kernel, the previous
        # step's combine or split kernel, which let it start after their key loops), and each waits for
        # that kernel's writes in-kernel before touching memory (flash_decode.cuh pdl_wait).
        early = plan.target.cc >= 90
        launches = [Launch(plan.name, grid, (plan.threads, 1, 1), plan.smem_bytes, params, early=early)]
        if call.num_splits > 1:
            rows = call.batch * call.seq_q * call.heads_q
            launches.append(Launch(f"{plan.name}_combine", (rows, 1, 1), (COMBINE_THREADS, 1, 1), 0, params,
                                   early=early))
        return launches

    def _tma_args(self, plan: DecodePlan, call: DecodeCall) -> TmaDecodeArgs:
        rows = box_rows(plan, call)
        if not rows:
            return TmaDecodeArgs(call, bytes(128), bytes(128), 0)
        dtype = get_dtype(plan.dtype)
        return TmaDecodeArgs(call, *(tma.encode(dtype.tensor_map_code, t.ptr, t.shape, t.strides, dtype.itemsize, rows)
                                     for t in (call.k, call.v)), rows)

    def estimate(self, plan, report, gpu, shape):
        """Bandwidth-bound: K and V of every cached token read once, then the launches."""
        from attngen.tune.model import Estimate

        bytes_read = 2 * shape.batch * shape.seqlen_k * (shape.heads_q // plan.gqa_ratio) * plan.head_dim * 2
        return Estimate(1e3 * (bytes_read / gpu.dram_bytes_total + 2 * gpu.launch_s), 0, 0, 0.0, "dram")


FAMILY = Sm80Decode()
