"""What every backward family shares: the kernel arguments, the workspace layout, the per-row
kernels around the main one, and the plan's derivative of the score modifier.

A backward call runs, after the mask's table kernels (attngen/mask_table.py):

  prep   per query row: D = rowsum(dO * O) - dLSE, the LSE moved to the log2 domain (+inf for a
         row that saw no key, so every P of it is 0), and the row's fp32 dQ accumulator zeroed;
  main   the family's own kernel: dK, dV, and dQ added to the fp32 accumulator;
  dq     the accumulator converted to dQ's dtype and layout.

With `deterministic` (bwd_sm80 only), each (batch, head, query block) has a counter in the
workspace (zeroed by prep): the key blocks that see the query block add their dQ parts one after
another in key order, each waiting until the counter says the previous ones are done
(bwd_rows.cuh wait_turn / pass_turn), so every dQ element is the same fp32 sum in the same order
on every run.

Runtime inputs of the score modifier that it reads at `[h]` alone (a learned per-head bias, ALiBi
slopes: `learnable_inputs`) get gradients: the main kernel sums dL/dmodified * d modifier / d input
over each CTA's elements of a head, in a fixed order, into one float per (input, batch, head, key
block) of the workspace, which the runtime sums over batches and key blocks (attngen/runtime/backward.py).

The row kernels live in attngen/cuda/bwd_rows.cuh; a family's template renders them beside its main
kernel from the same argument list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attngen import mask_table
from attngen.codegen.abi import Abi, Param
from attngen.families.base import BackwardCall, ForwardPlan, KernelPlan, Launch

LOG2E = 1.4426950408889634
PREP_THREADS = 256
DQ_THREADS = 256
ALIGN = 256  # bytes: each workspace array starts at a multiple
MAX_GRID_Y = 65535  # main kernels put key blocks on the grid's y


def learnable_inputs(problem) -> tuple[str, ...]:
    """The float runtime inputs the backward gives gradients of: read by the score modifier, every
    read at index [h] (one value per query head), and not read by the sink (whose inputs get theirs
    in torch, attngen/api.py sink_grads). Sorted by name."""
    return modifier_learnable_inputs(problem.score_mod, problem.sink)


def modifier_learnable_inputs(score_mod: str | None, sink: str | None) -> tuple[str, ...]:
    """learnable_inputs of a score modifier and a sink given as their texts."""
    from attngen.maskc.ir import Input, Type, Var, walk
    from attngen.score_mods import get_score_mod

    if score_mod is None:
        return ()
    reads: dict[str, bool] = {}
    for n in walk(get_score_mod(score_mod).program.ir):
        if isinstance(n, Input):  # an int32 read (int(name)) has no gradient
            at_h = n.type is Type.FLOAT and len(n.index) == 1 and isinstance(n.index[0], Var) and n.index[0].name == "h"
            reads[n.name] = reads.get(n.name, True) and at_h
    sink_reads = set() if sink is None else {n for n, _ in get_score_mod(sink).program.inputs}
    return tuple(sorted(name for name, at_h in reads.items() if at_h and name not in sink_reads))


@dataclass(frozen=True, kw_only=True)
class BackwardPlan(ForwardPlan):
    """A backward family's plan: the forward's fields and the score modifier's derivatives."""

    @property
    def input_grads(self) -> tuple:
        """(name, d score_mod / d inputs[name][h] lowered like a score modifier) per learnable input."""
        from attngen.runtime_inputs import input_ref
        from attngen.score_mods import ScoreModLowering

        lowered = []
        for name in learnable_inputs(self.problem):
            program = self.score_mod.program.input_derivative(name)
            lowered.append((name, ScoreModLowering(program.canonical, program.slug, program.cuda_expr(input_ref), "",
                                                   program)))
        return tuple(lowered)

    @property
    def score_mod_grad(self):
        """d score_mod / d score, lowered like a score modifier (None: no modifier)."""
        from attngen.runtime_inputs import input_ref
        from attngen.score_mods import ScoreModLowering

        if self.score_mod is None:
            return None
        program = self.score_mod.program.derivative()
        return ScoreModLowering(program.canonical, program.slug, program.cuda_expr(input_ref), "", program)


@dataclass(frozen=True)
class Workspace:
    """Where a call's scratch arrays lie: byte offsets after any mask table (attngen/mask_table.py)."""

    dq_acc: int  # (B, Hq, Sq_pad, D) fp32
    lse2: int  # (B, Hq, Sq_pad) fp32
    delta: int  # (B, Hq, Sq_pad) fp32
    sq_pad: int  # Sq rounded up to block_m: the main kernel reads whole query blocks
    total: int
    igrad: int = 0  # (learnable inputs, B, Hq, key blocks) fp32: per-CTA sums of the inputs' gradients
    key_blocks: int = 0
    dq_turns: int = 0  # (B, Hq, Sq_pad / block_m) int32 with `deterministic`: dQ parts added so far

    @classmethod
    def of(cls, plan: ForwardPlan, call: BackwardCall) -> "Workspace":
        table = mask_table.workspace_bytes(plan.mask_table, call, plan.block_m)
        sq_pad = -(-call.seq_q // plan.block_m) * plan.block_m
        rows = call.batch * call.heads_q * sq_pad
        dq_acc = _aligned(table)
        lse2 = dq_acc + _aligned(rows * call.q.shape[3] * 4)
        delta = lse2 + _aligned(rows * 4)
        igrad = delta + _aligned(rows * 4)
        key_blocks = -(-call.seq_k // plan.block_n)
        sums = len(learnable_inputs(plan.problem)) * call.batch * call.heads_q * key_blocks
        dq_turns = igrad + _aligned(sums * 4)
        turns = call.batch * call.heads_q * (sq_pad // plan.block_m) if plan.problem.deterministic else 0
        return cls(dq_acc, lse2, delta, sq_pad, dq_turns + _aligned(turns * 4), igrad, key_blocks, dq_turns)


@dataclass(frozen=True)
class Packing:
    """What the ABI packs: the call and its workspace layout."""

    call: BackwardCall
    workspace: Workspace


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def the_call(a: Packing) -> BackwardCall:
    return a.call


ARGUMENTS = Abi("BwdParams", [
    Param("q", "const cfg::elem_t*", "ptr", lambda a: a.call.q.ptr),
    Param("k", "const cfg::elem_t*", "ptr", lambda a: a.call.k.ptr),
    Param("v", "const cfg::elem_t*", "ptr", lambda a: a.call.v.ptr),
    Param("o", "const cfg::elem_t*", "ptr", lambda a: a.call.out.ptr),
    Param("dout", "const cfg::elem_t*", "ptr", lambda a: a.call.dout.ptr),
    Param("lse", "const float*", "ptr", lambda a: a.call.lse.ptr, "(B, Hq, Sq), contiguous: the forward's"),
    Param("dlse", "const float*", "ptr", lambda a: 0 if a.call.dlse is None else a.call.dlse.ptr,
          "(B, Hq, Sq) contiguous, or null: d loss / d lse"),
    Param("dq", "cfg::elem_t*", "ptr", lambda a: a.call.dq.ptr),
    Param("dk", "cfg::elem_t*", "ptr", lambda a: a.call.dk.ptr),
    Param("dv", "cfg::elem_t*", "ptr", lambda a: a.call.dv.ptr),
    Param("dq_acc", "float*", "ptr", lambda a: a.call.workspace + a.workspace.dq_acc,
          "(B, Hq, Sq_pad, D) fp32 dQ accumulator (workspace)"),
    Param("lse2", "float*", "ptr", lambda a: a.call.workspace + a.workspace.lse2,
          "(B, Hq, Sq_pad) LSE * log2(e), +inf for rows with no visible key (workspace)"),
    Param("delta", "float*", "ptr", lambda a: a.call.workspace + a.workspace.delta,
          "(B, Hq, Sq_pad) rowsum(dO * O) - dLSE (workspace)"),
    Param("igrad", "float*", "ptr", lambda a: a.call.workspace + a.workspace.igrad,
          "(learnable inputs, B, Hq, key blocks) per-CTA sums of their gradients (workspace)"),
    Param("dq_turns", "int*", "ptr", lambda a: a.call.workspace + a.workspace.dq_turns,
          "(B, Hq, Sq_pad / BLOCK_M) dQ parts added so far, with deterministic (workspace)"),
    Param("Sq", "int", "i32", lambda a: a.call.seq_q),
    Param("Sk", "int", "i32", lambda a: a.call.seq_k),
    Param("Hq", "int", "i32", lambda a: a.call.heads_q),
    Param("Sq_pad", "int", "i32", lambda a: a.workspace.sq_pad, "Sq rounded up to block_m"),
    *(Param(f"{t}_s{dim}", "i64", "i64", (lambda i, t: lambda a: getattr(a.call, t).strides[i])(i, t),
            f"{t} {what} stride, elements" if dim == "b" else "")
      for t in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")
      for i, (dim, what) in enumerate((("b", "batch"), ("s", "seq"), ("h", "head")))),
    Param("scale_log2", "float", "f32", lambda a: a.call.softmax_scale * LOG2E, "softmax_scale * log2(e)"),
    Param("scale", "float", "f32", lambda a: a.call.softmax_scale, "softmax_scale: a score modifier sees scaled scores"),
])


def row_kernels(name: str, abi: Abi) -> tuple[KernelPlan, KernelPlan]:
    """The prep and dq kernels of a plan named `name` (its last two kernels, in that order)."""
    return KernelPlan(f"{name}_prep", PREP_THREADS, 0, abi), KernelPlan(f"{name}_dq", DQ_THREADS, 0, abi)


def check_key_blocks(plan: ForwardPlan, call: BackwardCall) -> int:
    """The main grid's key blocks; a clear error past what the grid's y dimension holds."""
    key_blocks = math.ceil(call.seq_k / plan.block_n)
    if key_blocks > MAX_GRID_Y:
        raise ValueError(f"k has sequence length {call.seq_k}; allowed: at most {MAX_GRID_Y * plan.block_n} keys "
                         f"for {plan.name} ({MAX_GRID_Y} key blocks of {plan.block_n})")
    return key_blocks


def launches(plan: ForwardPlan, call: BackwardCall) -> list[Launch]:
    """Every launch of a call in order: mask tables, prep, the family's main kernel on the grid
    (kv heads, key blocks, batch) with the plan's threads and shared memory, dq."""
    key_blocks = check_key_blocks(plan, call)
    workspace = Workspace.of(plan, call)
    params = plan.kernels[0].abi.pack(Packing(call, workspace))
    prep, dq = plan.kernels[-2:]
    rows_per_prep = PREP_THREADS // 32  # one warp per row
    rows_per_dq = DQ_THREADS // (plan.head_dim // 8)
    return [*mask_table.launches(plan, call, params),
            Launch(prep.symbol, (math.ceil(workspace.sq_pad / rows_per_prep), call.heads_q, call.batch),
                   (PREP_THREADS, 1, 1), 0, params),
            Launch(plan.name, (call.heads_kv, key_blocks, call.batch), (plan.threads, 1, 1), plan.smem_bytes, params),
            Launch(dq.symbol, (math.ceil(call.seq_q / rows_per_dq), call.heads_q, call.batch),
                   (DQ_THREADS, 1, 1), 0, params)]
