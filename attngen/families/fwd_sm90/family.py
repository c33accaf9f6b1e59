"""fwd_sm90: the Hopper forward (sm_90a): wgmma, TMA, warp specialisation.

A CTA computes query blocks of one (batch, query head) each: a producer warpgroup streams Q and
the K/V blocks through a shared-memory ring with TMA, and `consumers` warpgroups of 64 query
rows each run S = Q K^T and O += P V on wgmma with the online softmax in registers
(KERNEL_HEADERS; flash_fwd_sm90.cuh says what each holds). The config: keys per block, consumer
warpgroups, ring stages, whether each warpgroup overlaps its softmax with its own GEMMs, whether
the warpgroups take turns issuing GEMMs (pingpong), and the tile schedule (one CTA per tile, or
one per SM dealt pairs of tiles or taking them from a counter the module's reset kernel zeroes
before each launch). Runs only on sm_90a (H100, H200): wgmma and setmaxnreg exist nowhere else,
and the runtime always plans for the GPU it runs on.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from attngen import dropout, mask_table
from attngen.masks import causal_shaped, row_interval
from attngen.codegen import render as codegen
from attngen.codegen.abi import Abi, Param
from attngen.dtypes import get_dtype
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
from attngen.families import tma, varlen_tiles
from attngen.faults import check_fault
from attngen.masks import get_mask, mask_problem
from attngen.runtime_inputs import with_inputs
from attngen.spec import Problem
from attngen.targets import Target

FOLDER = Path(__file__).resolve().parent
# The kernel's headers, in the order fwd_sm90.cu.j2 pastes them (one after another, nothing between).
KERNEL_HEADERS = ("shapes.cuh", "tiles.cuh", "trace.cuh", "producer.cuh", "gemm.cuh", "softmax.cuh", "consumer.cuh",
                  "flash_fwd_sm90.cuh")
LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 96, 128, 256)
BLOCK_NS = (64, 80, 96, 112, 128, 144, 160, 176, 192)
CONSUMERS = (1, 2, 3)
NUM_STAGES = (2, 3, 4)
# Registers per thread of the producer and of each consumer warpgroup (setmaxnreg): the 64K
# register file split so the consumers hold S, P and O. One consumer warpgroup keeps the default.
REGISTERS = {1: (None, None), 2: (24, 240), 3: (32, 160)}
# Clusters: the producer is one thread (producer.cuh PRODUCER_WARP), which needs 32 registers
# for the multicast's operands (24 spilled 8-32 bytes); the consumers still fit in 232 without spills.
CLUSTER_REGISTERS = {2: (32, 232)}
# What a consumer thread's accumulators take, O (head_dim / 2), S (block_n / 2) and P (block_n / 4), most in
# those 232 registers without spills (nvcc 13.0, d128: 176-key blocks take 196 and compile clean, 192-key
# blocks take 208 and spill 48 bytes). A default's cluster gives way to a pinned block size above it.
CLUSTER_ACCUMULATOR_REGISTERS = 200
# Dropout's draws and keep masks do not fit beside S, P and O in 160 registers: with dropout, at
# most 2 consumer warpgroups (240 registers each).
DROPOUT_CONSUMERS = 2
# O takes head_dim / 2 fp32 registers per thread: at head dim 256 that is 128 of the 160 three consumer
# warpgroups get, too few left for S, P and addresses (ptxas fails: nvcc 13.0, every block size). Three
# consumer warpgroups run head dims up to this.
THREE_CONSUMERS_MAX_HEAD_DIM = 128
DEFAULT_SMS = 132  # a persistent grid's size where the target is not a device (an H100 SXM)
# Tile schedules (tiles.cuh tile_of) and their label letters: one CTA per tile; one CTA per SM
# dealt pairs of tiles statically; one CTA per SM taking tiles from a counter.
SCHEDULES = {"grid": "", "pairs": "r", "dynamic": "d"}
# Bytes of K/V a dynamic schedule's section of heads may hold: half the H100's 50 MB L2, the rest
# left to the Q and O tiles streaming through.
L2_SECTION_BYTES = 25 << 20
# Q tiles in shared memory, as many as fit up to this: with two, the next tile's Q loads while the
# current tile runs; a third gives that load a tile of slack when the epilogue holds its tile's
# buffer into the next tile (consumer.cuh CARRY), which short tiles (documents) waited for.
Q_BUFFERS_MAX = 3
# The kernel's own static shared memory (the Pipeline's barriers and tile slot, as ptxas reports it),
# beside the dynamic tiles: a third Q buffer is planned only where both fit.
STATIC_SMEM_BYTES = 1024


def cluster_reason(config: "Sm90Config", problem: Problem, target: Target | None = None) -> str | None:
    """Why `config` cannot run `problem` on a cluster of two CTAs, or None. The two tiles of a pair share
    every key block only without a mask (a score modifier or sink changes no block), and each CTA loads
    every other 64-column chunk of a block, so the chunks must split evenly (head dims 96, 128, 256)."""
    if config.schedule != "pairs":
        return f"schedule={config.schedule}; allowed: schedule=pairs (the cluster runs a pair's two tiles)"
    if problem.varlen:
        return ("packed sequences (varlen) tile each sequence on its own, through the dynamic schedule; allowed: "
                "clusters for calls of one length (varlen=False)")
    if problem.mask != "none":
        return f"mask {problem.mask!r}: the two tiles of a pair must see the same key blocks; allowed: mask none"
    if -(-problem.head_dim // 64) % 2:
        return (f"head_dim {problem.head_dim} is one 64-column chunk, which two CTAs cannot split; allowed: "
                "head dims of 2 or 4 chunks (96, 128, 256)")
    if problem.dropout_p:
        return f"dropout_p={problem.dropout_p}: clusters are not validated with dropout on a GPU; allowed: dropout_p 0"
    if target is not None and target.sms is not None and target.sms < 2:
        return f"{target.name} has {target.sms} SM: a cluster of two CTAs of a whole SM each needs 2 or more"
    return None


_LABEL = re.compile(r"m(\d+)n(\d+)s(\d+)(o?)(p?)([rd]?)(c?)")


@dataclass(frozen=True)
class Sm90Config(Config):
    block_n: int  # keys per block
    consumers: int  # consumer warpgroups, 64 query rows each
    num_stages: int  # K/V ring depth
    overlap: bool  # the softmax of block j runs while S of block j+1 and P V of block j-1 run
    pingpong: bool  # consumer warpgroups take turns issuing GEMMs
    schedule: str  # grid | pairs | dynamic (SCHEDULES); persistent ones overlap a tile's epilogue with the next's loads
    # The two tiles of each pair on a cluster of two CTAs sharing every K/V load by TMA multicast (label
    # letter c): pairs without a mask, head dims of whole 128-column chunks (cluster_reason).
    cluster: bool = False

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    def label(self) -> str:
        return (f"m{self.block_m}n{self.block_n}s{self.num_stages}" + ("o" if self.overlap else "")
                + ("p" if self.pingpong else "") + SCHEDULES[self.schedule] + ("c" if self.cluster else ""))

    @classmethod
    def from_label(cls, label: str) -> "Sm90Config":
        match = _LABEL.fullmatch(label)
        if match is None or int(match.group(1)) % 64:
            raise ValueError(f"{label!r} is not a fwd_sm90 config label such as m128n128s2opr")
        schedule = {letter: name for name, letter in SCHEDULES.items()}[match.group(6)]
        return cls(int(match.group(2)), int(match.group(1)) // 64, int(match.group(3)), bool(match.group(4)),
                   bool(match.group(5)), schedule, bool(match.group(7)))


@dataclass(frozen=True, kw_only=True)
class Sm90Plan(ForwardPlan):
    LISTS_KEY_BLOCKS = True
    consumers: int
    num_stages: int
    q_buffers: int  # Q tiles in shared memory (Q_BUFFERS_MAX at most, as many as fit)
    overlap: bool
    pingpong: bool
    schedule: str
    cluster: bool  # pairs of tiles on clusters of two CTAs sharing K/V loads (Sm90Config.cluster)
    threads: int
    smem_bytes: int
    producer_regs: int | None
    consumer_regs: int | None

    def choices(self) -> dict[str, Any]:
        return {"threads": self.threads, "smem_bytes": self.smem_bytes, "q_buffers": self.q_buffers,
                "producer_regs": self.producer_regs, "consumer_regs": self.consumer_regs}

    @property
    def tile_order(self) -> bool:
        """Whether the dynamic schedule takes its query blocks in an order built per call from the mask's
        block table (tiles.cuh order_tiles): masks without a closed form, whose blocks' work follows no
        position."""
        return _ordered(self.schedule, self.mask_table, self.problem.varlen)


def _ordered(schedule: str, table, varlen: bool) -> bool:
    return schedule == "dynamic" and table is not None and not varlen


@dataclass(frozen=True)
class Sm90Args:
    """What one launch packs: the call, the query blocks per head, the tensor maps of q, k, v, out, and
    for a dynamic schedule its counter's address and section size."""

    call: ForwardCall
    m_blocks: int
    tmap_q: bytes
    tmap_k: bytes
    tmap_v: bytes
    tmap_o: bytes
    tile_counter: int = 0
    section_heads: int = 1
    num_seqs: int = 0  # varlen: the sequences packed in q, k, v
    tile_order: int = 0  # dynamic schedule with a block table: the query blocks' order (workspace)


# Packed sequences (Problem.varlen): the sequence count for the tile builder, and out's pointer and
# strides for the kernel's own stores of a sequence's last, ragged row group (a TMA store would cross into
# the next sequence's rows; whole row groups take the TMA store).
VARLEN_ARGUMENTS = (
    Param("num_seqs", "int", "i32", lambda a: a.num_seqs, "varlen: sequences (cu_seqlens entries - 1)"),
    Param("o", "u16*", "ptr", lambda a: a.call.out.ptr, "varlen: out (1, total_q, Hq, D)"),
    Param("o_s1", "i64", "i64", lambda a: a.call.out.strides[1], "varlen: out's row stride (elements)"),
    Param("o_s2", "i64", "i64", lambda a: a.call.out.strides[2], "varlen: out's head stride (elements)"),
)
# A dynamic schedule over a mask's block table: each table row's query blocks ranked by the key blocks
# they visit (the longest first), built by the reset kernel, a CTA per row and ORDER_THREADS query blocks.
ORDER_ARGUMENTS = (
    Param("tile_order", "int*", "ptr", lambda a: a.tile_order, "dynamic schedule: query blocks per table row, "
          "the most key blocks first (workspace)"),
)
ORDER_THREADS = 256  # tiles.cuh ORDER_THREADS
# The forward kernel as a programmatic dependent launch behind the call's own set-up kernel (launches);
# a module switch so a probe can time the ordinary launch beside it (bench/sm90_ab_probe.py --ordinary).
EARLY_AFTER_SETUP = True


ARGUMENTS = Abi("FwdSm90Params", [
    Param("tmap_q", "TensorMap", "tensor_map", lambda a: a.tmap_q, "box: 64 columns x block_m rows"),
    Param("tmap_k", "TensorMap", "tensor_map", lambda a: a.tmap_k, "box: 64 columns x block_n rows"),
    Param("tmap_v", "TensorMap", "tensor_map", lambda a: a.tmap_v, "box: 64 columns x block_n rows"),
    Param("tmap_o", "TensorMap", "tensor_map", lambda a: a.tmap_o, "box: 64 columns x 64 rows (one warpgroup)"),
    Param("lse", "float*", "ptr", lambda a: a.call.lse.ptr, "(B, Hq, Sq), contiguous"),
    Param("Sq", "int", "i32", lambda a: a.call.seq_q),
    Param("Sk", "int", "i32", lambda a: a.call.seq_k),
    Param("Hq", "int", "i32", lambda a: a.call.heads_q),
    Param("batch", "int", "i32", lambda a: a.call.batch),
    Param("m_blocks", "int", "i32", lambda a: a.m_blocks, "query blocks per (batch, head)"),
    Param("scale_log2", "float", "f32", lambda a: a.call.softmax_scale * LOG2E,
          "softmax_scale * log2(e): exp2 replaces exp with the scale folded in"),
    Param("scale", "float", "f32", lambda a: a.call.softmax_scale, "softmax_scale: a score modifier sees scaled scores"),
    Param("tile_counter", "int*", "ptr", lambda a: a.tile_counter, "dynamic schedule: the next tile (workspace)"),
    Param("section_heads", "int", "i32", lambda a: a.section_heads,
          "dynamic schedule: (batch, head) pairs whose K/V share L2, a multiple of the GQA ratio"),
])


def _the_call(args: Sm90Args) -> ForwardCall:
    """The ForwardCall inside what this family packs (attngen/runtime_inputs.py with_inputs)."""
    return args.call


def smem_bytes(config: Sm90Config, head_dim: int, q_buffers: int = 1) -> int:
    """shapes.cuh's SMEM_BYTES: 1 KB of alignment slack, the Q tiles and the K and V rings,
    every row padded to whole 64-column chunks."""
    chunks = -(-head_dim // 64)
    return 1024 + chunks * 128 * (q_buffers * config.block_m + 2 * config.num_stages * config.block_n)


# The sections (tiles.cuh section_of) of a dynamic schedule whose tiles follow no pattern (packed
# sequences, a mask's block table) hold at least this many waves of tiles, so the longest tile of a section
# (a packed document's longest query block, or one straddling two documents given as ids: ~2.4x a block's
# time, all its blocks partial) ends while the section's other tiles keep the SMs busy. Varlen: a section
# of one head ran 9% longer (docs/perf-notes.md "Per-sequence tiles"); document ids at 16k in sections of
# 5 heads rather than L2's 3: -4% ("A short last section"). Other dynamic schedules keep L2's sections:
# the floor measured -2% to +3% there (d64 causal 16k +3%).
SECTION_WAVES = 4


def waved_section_heads(call: ForwardCall, gqa_ratio: int, itemsize: int, tiles_per_head: int, sms: int,
                        pairs: int) -> int:
    """(batch, query head) pairs per section of a dynamic schedule: as many as L2 holds the K/V of
    (section_heads), or more, up to all `pairs`, until a section holds SECTION_WAVES waves of tiles."""
    waves = math.ceil(SECTION_WAVES * sms / max(tiles_per_head * gqa_ratio, 1)) * gqa_ratio
    return min(max(section_heads(call, gqa_ratio, itemsize), waves), pairs)


def launch_section_heads(plan: Sm90Plan, call: ForwardCall, m_blocks: int, sms: int) -> int:
    """A call's sections: waved for packed sequences and over a block table, L2's otherwise."""
    itemsize = get_dtype(plan.dtype).itemsize
    if plan.problem.varlen:
        return waved_section_heads(call, plan.gqa_ratio, itemsize, m_blocks, sms, call.heads_q)
    if plan.tile_order:
        return waved_section_heads(call, plan.gqa_ratio, itemsize, m_blocks, sms, call.heads_q * call.batch)
    return section_heads(call, plan.gqa_ratio, itemsize)


def varlen_capacity(plan: Sm90Plan, call: ForwardCall) -> int:
    """The most tiles (query blocks) a varlen call's list can hold (attngen/families/varlen_tiles.py)."""
    return varlen_tiles.capacity(plan.block_m, call)


def _counter_offset(plan: Sm90Plan, call: ForwardCall) -> int:
    """Where a dynamic schedule's tile counter sits in the workspace: after the mask's block table."""
    size = mask_table.workspace_bytes(plan.mask_table, call, plan.block_m)
    return -(-size // mask_table.ALIGN) * mask_table.ALIGN


def tile_order_offset(plan: Sm90Plan, call: ForwardCall) -> int:
    """Where the query blocks' order (Sm90Plan.tile_order) sits in the workspace: after the counter."""
    return _counter_offset(plan, call) + mask_table.ALIGN


def _order_bytes(plan: Sm90Plan, call: ForwardCall) -> int:
    if not plan.tile_order:
        return 0
    return 4 * mask_table.table_rows(plan.mask_table, call) * math.ceil(call.seq_q / plan.block_m)


def section_heads(call: ForwardCall, gqa_ratio: int, itemsize: int) -> int:
    """(batch, query head) pairs in one section of a dynamic schedule: as many kv heads' K and V as
    L2_SECTION_BYTES holds (at least one), times the query heads that read each."""
    kv_bytes = 2 * call.seq_k * call.k.shape[3] * itemsize
    return max(1, L2_SECTION_BYTES // max(kv_bytes, 1)) * gqa_ratio


# Calls whose longest sequence is at most this many tokens take tile_defaults.yaml's <kind>_short row
# where there is one (the front door knows the length; a spec's own default is the long one).
SHORT_SEQLEN = 1024


@functools.lru_cache(maxsize=None)
def _preferences() -> dict[tuple[int, str], list[Sm90Config]]:
    """(head dim, none | causal | expressions, or one of those + "_gqa") -> configs in order of preference,
    from tile_defaults.yaml."""
    table = yaml.safe_load((FOLDER / "tile_defaults.yaml").read_text())
    return {(int(d), mask): [Sm90Config.from_label(label) for label in labels]
            for d, per_mask in table.items() for mask, labels in per_mask.items()}


class Sm90Forward(KernelFamily):
    name = "fwd_sm90"
    description = "Hopper forward: wgmma, TMA ring, producer/consumer warpgroups (sm_90a only)"
    folder = FOLDER
    config_fields = {"block_n": BLOCK_NS, "consumers": CONSUMERS, "num_stages": NUM_STAGES,
                     "overlap": (True, False), "pingpong": (True, False), "schedule": tuple(SCHEDULES),
                     "cluster": (False, True)}
    config_field_defaults = {"cluster": False}  # added 2026-11-27: entries tuned before ran without clusters

    def supports(self, problem: Problem, target: Target) -> str | None:
        if target.cc != 90:
            return f"needs sm_90a (H100, H200): wgmma and setmaxnreg do not exist on {target.name}"
        if problem.head_dim not in HEAD_DIMS:
            return f"head_dim {problem.head_dim} is not one of {HEAD_DIMS}"
        return mask_problem(problem, per_sequence_tiles=True)

    def check_config(self, config: Mapping[str, Any]) -> list[str]:
        problems = super().check_config(config)
        if not problems and config.get("pingpong") and config.get("consumers") == 1:
            problems.append("config.pingpong=True is invalid with consumers=1; allowed: pingpong with 2 or 3 "
                            "consumer warpgroups")
        if not problems and config.get("cluster") and config.get("schedule", "pairs") != "pairs":
            problems.append(f"config.cluster=True is invalid with schedule={config['schedule']!r}; allowed: "
                            "cluster with schedule='pairs' (the cluster runs a pair's two tiles)")
        return problems

    def configs(self, problem: Problem, target: Target, pinned: Mapping[str, Any] | None = None) -> list[Sm90Config]:
        pinned = dict(pinned or {})
        values = [(pinned[f],) if f in pinned else allowed for f, allowed in self.config_fields.items()]
        configs = [Sm90Config(*combo) for combo in itertools.product(*values) if not (combo[4] and combo[1] == 1)
                   and not (problem.dropout_p and combo[1] > DROPOUT_CONSUMERS)
                   and not (combo[1] == 3 and problem.head_dim > THREE_CONSUMERS_MAX_HEAD_DIM)]
        # Clusters run the pairs schedule (check_config); pinned, a cluster the problem cannot take stays in
        # the space, where plan() says why.
        return [c for c in configs if not (c.cluster and (c.schedule != "pairs" or "cluster" not in pinned
                                                          and cluster_reason(c, problem, target)))]

    def default_config(self, problem: Problem, target: Target, seqlen: int | None = None) -> Sm90Config:
        plain = problem.mask in ("none", "causal") and problem.score_mod is None and problem.sink is None
        kind = "varlen" if problem.varlen else problem.mask if plain else "expressions"
        table = _preferences()
        if problem.gqa_ratio > 1 and (problem.head_dim, f"{kind}_gqa") in table:
            kind = f"{kind}_gqa"
        elif problem.gqa_ratio == 1 and seqlen is not None and seqlen <= SHORT_SEQLEN \
                and (problem.head_dim, f"{kind}_short") in table:
            kind = f"{kind}_short"
        choices = table[problem.head_dim, kind]
        config = next((c for c in choices if smem_bytes(c, problem.head_dim) <= target.smem_per_block
                       and not (problem.dropout_p and c.consumers > DROPOUT_CONSUMERS)
                       and not (c.cluster and cluster_reason(c, problem, target))), choices[-1])
        if kind != "expressions" or problem.score_mod is not None or problem.sink is not None:
            return config
        shaped, closed = causal_shaped(problem.mask), row_interval(problem.mask)
        if shaped or closed:
            causal = self.default_config(dataclasses.replace(problem, mask="causal"), target, seqlen)
            if shaped and closed:
                # A closed form of causal's shape (`q_idx >= kv_idx`) is masked as causal is: causal's whole config.
                return causal
            if shaped:
                # Tiles of causal's lengths: causal's schedule, which beats the counter there (docs/perf-notes.md,
                # "Per-tile cost"); the expression's tile and stages, which hold its per-element work.
                return dataclasses.replace(config, schedule=causal.schedule)
            if causal.schedule == "dynamic":
                # Any other closed form (a window, a prefix per batch row) is masked as causal is too, and its
                # tiles' lengths follow no pattern pairs balance: causal's config where that runs on the counter
                # already (d64's three consumer warpgroups, m192: 1.22x the expressions' tile for
                # prefix_lm(plen[b]) and 1.17x for a 4096 window on the H100, docs/perf-notes.md "Prefixes get
                # closed forms"), else the expressions' tile as it is.
                return causal
        return config

    def resolve_config(self, problem: Problem, target: Target, pinned: Mapping[str, Any],
                       seqlen: int | None = None) -> Sm90Config:
        # A partly pinned config is filled in from the length-free default, so that whether it plans (fits
        # the shared memory, say) never depends on the call's length; only an unpinned one takes short rows.
        default = self.default_config(problem, target, None if pinned else seqlen)
        config = {f: pinned.get(f, getattr(default, f)) for f in self.config_fields}
        if config["consumers"] == 1 and "pingpong" not in pinned:
            config["pingpong"] = False  # nothing to take turns with
        if problem.varlen and "schedule" not in pinned:
            config["schedule"] = "dynamic"  # the tile list is read through the dynamic schedule's counter
        if config["cluster"] and "cluster" not in pinned and config["schedule"] != "pairs":
            config["cluster"] = False  # a default's cluster gives way to a pinned schedule other than pairs
        accumulators = problem.head_dim // 2 + config["block_n"] // 2 + config["block_n"] // 4
        if config["cluster"] and "cluster" not in pinned and accumulators > CLUSTER_ACCUMULATOR_REGISTERS:
            config["cluster"] = False  # nor to a pinned block size whose S and P would spill beside O there
        if config["cluster"] and "schedule" not in pinned:
            config["schedule"] = "pairs"  # the cluster runs a pair's two tiles
        return Sm90Config(**config)

    def plan(self, problem: Problem, target: Target, config: Sm90Config, *, fault: str | None = None) -> Sm90Plan:
        check_fault(fault)
        reason = self.supports(problem, target)
        if reason is not None:
            raise SpecError(f"family {self.name} cannot run this problem on {target.name}: {reason}", field="family")
        if config.pingpong and config.consumers == 1:
            raise SpecError(f"config {config.label()}: pingpong needs 2 or 3 consumer warpgroups", field="config")
        if problem.dropout_p and config.consumers > DROPOUT_CONSUMERS:
            raise SpecError(f"config {config.label()}: {config.consumers} consumer warpgroups leave 160 registers per "
                            f"thread, too few for dropout's keep masks beside S, P and O; allowed with dropout_p > 0: "
                            f"consumers <= {DROPOUT_CONSUMERS}", field="config")
        if config.consumers == 3 and problem.head_dim > THREE_CONSUMERS_MAX_HEAD_DIM:
            raise SpecError(f"config {config.label()}: 3 consumer warpgroups get 160 registers per thread, and O alone "
                            f"takes head_dim / 2 = {problem.head_dim // 2} of them at head_dim {problem.head_dim}; "
                            f"allowed at head_dim > {THREE_CONSUMERS_MAX_HEAD_DIM}: consumers <= 2", field="config")
        if config.cluster and (reason := cluster_reason(config, problem, target)) is not None:
            raise SpecError(f"config {config.label()}: a cluster of two CTAs cannot run this problem: {reason}",
                            field="config")
        if problem.varlen and config.schedule != "dynamic":
            raise SpecError(f"config {config.label()}: packed sequences (varlen) take their tiles from a list through "
                            f"the dynamic schedule; allowed: schedule=dynamic", field="config")
        q_buffers = next((n for n in range(Q_BUFFERS_MAX, 1, -1)
                          if smem_bytes(config, problem.head_dim, n) + STATIC_SMEM_BYTES <= target.smem_per_block), 1)
        smem = smem_bytes(config, problem.head_dim, q_buffers)
        if smem > target.smem_per_block:
            raise SpecError(
                f"config {config.label()} needs {smem} B of shared memory (the {config.block_m}-row Q tile and "
                f"{config.num_stages} stages of {config.block_n}-row K and V tiles, rows padded to 64 columns); "
                f"{target.name} allows {target.smem_per_block} B: lower num_stages or block_n", field="config")
        name = self.plan_name(problem, target, config, fault)
        threads = 128 * (config.consumers + 1)
        producer_regs, consumer_regs = (CLUSTER_REGISTERS.get(config.consumers, REGISTERS[config.consumers])
                                        if config.cluster else REGISTERS[config.consumers])
        table = mask_table.for_problem(problem, config.block_n)  # with key-block lists
        abi = mask_table.with_table(with_inputs(ARGUMENTS, problem_inputs(problem), _the_call), table, _the_call,
                                    config.block_m)
        if problem.dropout_p:
            abi = dropout.with_rng(abi, _the_call)
        # Launched before the kernel: the varlen tile builder, or the dynamic schedule's counter reset.
        ordered = _ordered(config.schedule, table, problem.varlen)
        if problem.varlen:
            abi = Abi(abi.struct_name, [*abi.params, *VARLEN_ARGUMENTS])
            first = varlen_tiles.builder_kernels(name, abi)
        elif ordered:
            abi = Abi(abi.struct_name, [*abi.params, *ORDER_ARGUMENTS])
            first = (KernelPlan(f"{name}_reset", ORDER_THREADS, 0, abi),)
        else:
            first = (KernelPlan(f"{name}_reset", 32, 0, abi),) if config.schedule == "dynamic" else ()
        return Sm90Plan(
            family=self.name, name=name, problem=problem, target=target, config=config,
            kernels=(KernelPlan(name, threads, smem, abi), *mask_table.kernels(name, table, abi), *first),
            block_m=config.block_m, block_n=config.block_n,
            fault=fault, consumers=config.consumers, num_stages=config.num_stages, q_buffers=q_buffers,
            overlap=config.overlap, pingpong=config.pingpong, schedule=config.schedule, cluster=config.cluster,
            threads=threads, smem_bytes=smem, producer_regs=producer_regs,
            consumer_regs=consumer_regs,
            mask=get_mask(problem.mask))

    def render(self, plan: Sm90Plan) -> str:
        return codegen.render(FOLDER, "fwd_sm90.cu.j2", plan=plan, abi=plan.kernels[0].abi, qk_n=plan.block_n,
                              pv_n=plan.head_dim, ptx_type="bf16" if plan.dtype == "bf16" else "f16")

    def accepts(self, plan: Sm90Plan, call: ForwardCall) -> str | None:
        itemsize = get_dtype(plan.dtype).itemsize
        for t in (call.q, call.k, call.v, call.out):
            reason = tma.describable(t.shape, t.strides, itemsize)
            if reason is not None:
                return f"TMA cannot describe {t.name}: {reason}"
        return None

    def workspace_bytes(self, plan: Sm90Plan, call: ForwardCall) -> int:
        if plan.problem.varlen:
            return _counter_offset(plan, call) + varlen_tiles.workspace_bytes(plan.block_m, call)
        return _counter_offset(plan, call) + (mask_table.ALIGN if plan.schedule == "dynamic" else 0) \
            + _order_bytes(plan, call)

    def launches(self, plan: Sm90Plan, call: ForwardCall) -> list[Launch]:
        dtype = get_dtype(plan.dtype)

        def tensor_map(t, rows):
            return tma.encode(dtype.tensor_map_code, t.ptr, t.shape, t.strides, dtype.itemsize, rows)

        varlen = plan.problem.varlen
        # varlen: m_blocks is the tile list's capacity (varlen_tiles.cuh)
        m_blocks = varlen_capacity(plan, call) if varlen else math.ceil(call.seq_q / plan.block_m)
        dynamic = plan.schedule == "dynamic"
        sms = plan.target.sms or DEFAULT_SMS
        heads = launch_section_heads(plan, call, m_blocks, sms)
        args = Sm90Args(call, m_blocks, tensor_map(call.q, plan.block_m), tensor_map(call.k, plan.block_n),
                        tensor_map(call.v, plan.block_n), tensor_map(call.out, 64),
                        call.workspace + _counter_offset(plan, call) if dynamic else 0, heads,
                        varlen_tiles.num_seqs(call) if varlen else 0,
                        call.workspace + tile_order_offset(plan, call) if plan.tile_order else 0)
        tiles = m_blocks * call.heads_q * call.batch
        # Behind the call's own kernel that builds the tile list or zeroes the counter, the forward kernel is
        # launched early (a programmatic dependent launch, which that kernel allows at its start): its
        # launch and set-up overlap that kernel, and it waits for its writes (flash_fwd_sm90.cuh pdl_wait).
        if varlen:
            params = plan.kernels[0].abi.pack(args)
            return [varlen_tiles.builder_launch(plan.name, call, params),
                    Launch(plan.name, (min(tiles, sms), 1, 1), (plan.threads, 1, 1), plan.smem_bytes, params,
                           early=EARLY_AFTER_SETUP)]
        if plan.schedule == "pairs":  # pairs of tiles (an even count per head) dealt out to one CTA per SM at most
            tiles = (m_blocks + 1) // 2 * 2 * call.heads_q * call.batch
            grid = (tiles if tiles <= sms else min(tiles // 2, sms), 1, 1)  # tiles.cuh tile_index
            if plan.cluster:  # one tile per CTA and round, a pair per cluster: an even grid
                grid = (min(tiles, sms - sms % 2), 1, 1)
        else:
            grid = (min(tiles, sms) if dynamic else tiles, 1, 1)
        params = plan.kernels[0].abi.pack(args)
        # The counter's reset; with a block table also the query blocks' order, a CTA per table row and
        # ORDER_THREADS query blocks.
        order_grid = (mask_table.table_rows(plan.mask_table, call), -(-m_blocks // ORDER_THREADS), 1) \
            if plan.tile_order else (1, 1, 1)
        reset = [Launch(plan.kernels[-1].symbol, order_grid, (plan.kernels[-1].threads, 1, 1), 0, params)] \
            if dynamic else []
        return [*mask_table.launches(plan, call, params), *reset,
                Launch(plan.name, grid, (plan.threads, 1, 1), plan.smem_bytes, params,
                       early=dynamic and EARLY_AFTER_SETUP)]

    def estimate(self, plan, report, gpu, shape):
        from attngen.families.fwd_sm90.estimate import estimate

        return estimate(plan, report, gpu, shape)


FAMILY = Sm90Forward()
