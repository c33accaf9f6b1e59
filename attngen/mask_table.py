"""Block tables for masks that read runtime inputs, built on the GPU at the start of every call.

A mask such as `doc[b, q_idx] == doc[b, kv_idx] and causal` (packed documents) has no closed
form, and a kernel scanning its key blocks could read `doc` only at single positions: every
block would be "partial", nothing skipped, every element masked. So a forward plan whose mask
has no closed form runs small kernels of its module first, on the same argument struct and
stream (attngen/cuda/mask.cuh.j2):

  summaries  (when the mask reads int inputs by position) for each such input, the min and max
             of every GRANULE consecutive elements along its last dimension (the positions):
             rows x ceil(n / GRANULE) int pairs;
  table      for each query block (per batch and head where the mask reads b or h): the bounds
             the kernel's scan defines (first and last non-empty key block, the first run of full
             ones), one warp per query block classifying 32 key blocks at a time, with an input's
             range over a block read from the summaries (maskc classify with spans; the Python
             model is MaskProgram.classify with granule=GRANULE).

The attention kernel then reads 4 ints per tile. For a FlexAttention BlockMask (attngen/block_sparse.py)
and for masks that divide kv_idx (_lists_pay), a forward family also gets each tile's list of
non-empty key blocks (last first, each flagged full or not), and a tile whose span has holes gets
the entry {-1, count, 0, 0}: its kernel walks the list, so hidden blocks are never loaded; a tile
without holes keeps its bounds. All of it lives in the call's workspace (workspace_bytes); nothing
is built or copied on the host: the same inputs under CUDA graphs, any lengths, no recompilation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from attngen.codegen.abi import Abi, Param
from attngen.families.base import ForwardCall, KernelPlan, Launch

GRANULE = 16  # divides every block size of both families, so tile edges fall on granule edges
THREADS = 256
ALIGN = 256  # bytes: each array of the workspace starts at a multiple


@dataclass(frozen=True)
class MaskTable:
    """What a plan's table needs: the inputs it summarizes and the axes the mask depends on."""

    inputs: tuple  # attngen/runtime_inputs.py Declared: the mask's int inputs with at least one index
    by_batch: bool  # the mask reads b: a table per batch entry
    by_head: bool  # the mask reads h: a table per query head
    # The forward families' key-block width: each query block also gets its list of non-empty key
    # blocks of this width. None: bounds only (backward families).
    list_block_n: int | None = None

    @property
    def granule(self) -> int:
        return GRANULE

    @property
    def threads(self) -> int:
        return THREADS

    @property
    def max_span_granules(self) -> int:
        from attngen.maskc.interval import MAX_SPAN_GRANULES

        return MAX_SPAN_GRANULES


@functools.lru_cache(maxsize=1024)
def for_problem(problem, list_block_n: int | None = None) -> MaskTable | None:
    """The table a problem's kernels build: for every mask without a closed form (None for those
    with one), with key-block lists of width list_block_n when given. Without inputs to summarize
    only the table kernel runs; it still replaces each tile's scan of every key block by one thread
    with a warp's (measured: `kv_idx <= q_idx` at 16k ran 7% behind the built-in causal with the scan,
    and 0.4-7.5% behind with the table, before such bands got closed forms: attngen/maskc/bands.py)."""
    from attngen.families.base import problem_inputs
    from attngen.maskc.ir import Input, Var, walk
    from attngen.masks import get_mask

    lowering = get_mask(problem.mask)
    if lowering.closed is not None:
        return None
    declared = problem_inputs(problem)
    mask_reads = {node.name for node in walk(lowering.program.ir) if isinstance(node, Input)}
    summarized = tuple(d for d in declared if d.kind == "mask" and d.arity >= 1 and d.name in mask_reads)
    read = {node.name for node in walk(lowering.program.ir) if isinstance(node, Var)}
    lists = list_block_n if _lists_pay(lowering.program.ir, declared) else None
    return MaskTable(summarized, "b" in read, "h" in read, lists)


def _lists_pay(mask_ir, declared) -> bool:
    """Whether a forward kernel walks key-block lists for this mask: for a BlockMask's (holes are what
    it is for) and for masks that divide kv_idx (// or %: strided, dilated and other periodic
    patterns, whose spans have holes). Other masks keep the bounds alone: with lists built for the
    packed-documents mask, whose tiles all walk their span anyway, its kernel ran 12% slower in a
    same-run A/B (docs/perf-notes.md, "Key-block lists"); holes in their spans are loaded and masked."""
    from attngen.block_sparse import STATE
    from attngen.maskc.ir import INT_DIVISION, Op, Var, walk

    if any(d.name == STATE for d in declared):
        return True
    return any(isinstance(node, Op) and node.op in INT_DIVISION
               and any(isinstance(v, Var) and v.name == "kv_idx" for v in walk(node))
               for node in walk(mask_ir))


def span_ref(name: str, leading: list, lo: str, hi: str) -> str:
    """The C++ that reads input `name`'s range over positions [lo, hi] (mask.cuh.j2 span_<name>)."""
    return f"span_{name}(p, {', '.join([*leading, lo, hi])})"


def _granules(n: int) -> int:
    return -(-n // GRANULE)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def table_rows(table: MaskTable, call: ForwardCall) -> int:
    return (call.batch if table.by_batch else 1) * (call.heads_q if table.by_head else 1)


def list_ints(table: MaskTable, call: ForwardCall) -> int:
    """Ints of one query block's key-block list: up to one entry per key block (the count is in its
    table entry, {-1, count, 0, 0}, where the list is walked)."""
    return math.ceil(call.seq_k / table.list_block_n)


def layout(table: MaskTable, call: ForwardCall, block_m: int) -> tuple[dict[str, int], int, int]:
    """(input name -> byte offset of its summaries, offset of the table, total bytes) in the workspace;
    the key-block lists, when the table has them, follow the table (list_offset)."""
    offsets, offset = {}, 0
    for d in table.inputs:
        shape = call.input(d.name).shape
        offsets[d.name] = offset
        offset += _aligned(math.prod(shape[:-1]) * _granules(shape[-1]) * 8)
    lists = 0 if table.list_block_n is None else _aligned(_entries(table, call, block_m) * list_ints(table, call) * 4)
    return offsets, offset, list_offset(table, call, block_m, offset) + lists


def _entries(table: MaskTable, call: ForwardCall, block_m: int) -> int:
    """Table entries: one per query block of every row (batch x heads) the table is kept for."""
    return table_rows(table, call) * math.ceil(call.seq_q / block_m)


def list_offset(table: MaskTable, call: ForwardCall, block_m: int, table_offset: int | None = None) -> int:
    """Where the key-block lists start: after the table (at table_offset, layout's second value)."""
    if table_offset is None:
        table_offset = layout(table, call, block_m)[1]
    return table_offset + _aligned(_entries(table, call, block_m) * 16)


def workspace_bytes(table: MaskTable | None, call: ForwardCall, block_m: int) -> int:
    return 0 if table is None else layout(table, call, block_m)[2]


@functools.lru_cache(maxsize=256)
def with_table(abi: Abi, table: MaskTable | None, call_of: Callable, block_m: int) -> Abi:
    """`abi` with what the two kernels and the table read appended: each summarized input's sizes and
    summaries, the table and its number of rows (batch x heads it is kept for)."""
    if table is None:
        return abi

    def at(name: str | None):
        def address(a):
            call = call_of(a)
            offsets, table_offset, _ = layout(table, call, block_m)
            return call.workspace + (table_offset if name is None else offsets[name])
        return address

    params = list(abi.params)
    for d in table.inputs:
        params += [Param(f"in_{d.name}_n{i}", "i64", "i64", lambda a, n=d.name, i=i: call_of(a).input(n).shape[i])
                   for i in range(d.arity)]
        params.append(Param(f"sum_{d.name}", "int*", "ptr", at(d.name),
                            f"min and max of {d.name} per {GRANULE} positions (workspace)"))
    params.append(Param("mask_table", "int*", "ptr", at(None), "bounds per query block (workspace)"))
    if table.list_block_n is not None:
        params.append(Param("mask_list", "int*", "ptr",
                            lambda a: call_of(a).workspace + list_offset(table, call_of(a), block_m),
                            "non-empty key blocks per query block (workspace)"))
    params.append(Param("mask_rows", "int", "i32", lambda a: table_rows(table, call_of(a)),
                        "(batch x heads) entries the table is kept for"))
    return Abi(abi.struct_name, params)


def kernels(name: str, table: MaskTable | None, abi: Abi) -> tuple[KernelPlan, ...]:
    """The module's kernels that build the table (mask.cuh.j2), after the attention kernel."""
    if table is None:
        return ()
    return (KernelPlan(f"{name}_mask_summaries", THREADS, 0, abi), KernelPlan(f"{name}_mask_table", THREADS, 0, abi))


def launches(plan, call: ForwardCall, params: bytes) -> list[Launch]:
    """The launches that precede the attention kernel: [] without a table, the summaries' only when
    the mask reads inputs to summarize."""
    table = plan.mask_table
    if table is None:
        return []
    summaries, table_kernel = plan.kernels[1:3]
    warps = table_rows(table, call) * math.ceil(call.seq_q / plan.block_m)
    build = [Launch(table_kernel.symbol, (max(1, -(-warps * 32 // THREADS)), 1, 1), (THREADS, 1, 1), 0, params)]
    if not table.inputs:
        return build
    sms = plan.target.sms or 132  # a grid-stride loop: enough blocks to fill an H100 where the target is not a device
    items = max(math.prod(call.input(d.name).shape[:-1]) * _granules(call.input(d.name).shape[-1])
                for d in table.inputs)
    return [Launch(summaries.symbol, (max(1, min(-(-items // THREADS), 8 * sms)), 1, 1), (THREADS, 1, 1), 0, params),
            *build]
