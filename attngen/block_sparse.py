"""Block-sparse attention from a FlexAttention BlockMask, lowered to the mask language.

    bm = torch.nn.attention.flex_attention.create_block_mask(mask_mod, B, H, Sq, Sk)   # or from_kv_blocks
    out = attngen.attention(q, k, v, block_mask=bm, mask="causal")

A BlockMask lists, for each query block of Q_BLOCK rows (per batch entry and query head, either
possibly broadcast), the key blocks of KV_BLOCK keys that are partially visible (kv_num_blocks,
kv_indices) and those that are fully visible (full_kv_num_blocks, full_kv_indices). As in
FlexAttention, a key is visible to a row when its block is listed full, or listed partial and the
element mask holds there (`mask`: an expression of docs/masks.md, standing in for the BlockMask's
Python mask_mod, which attngen cannot compile); unlisted blocks are hidden.

The lists become one int32 runtime input, the block state (0 hidden, 1 partial, 2 full) of every
(query block, key block), built on the GPU by a scatter (no host synchronisation: CUDA-graph
capturable; eager calls with the same unchanged lists reuse it), and the call's mask becomes

    block_mask_state[b, h, q_idx // Q_BLOCK, kv_idx // KV_BLOCK] == 2
        or (block_mask_state[b, h, q_idx // Q_BLOCK, kv_idx // KV_BLOCK] == 1 and (mask))

(a broadcast batch or head axis reads index 0). So every family runs it, forward and backward, and
the block table (attngen/mask_table.py) reads the state exactly wherever a kernel tile lies inside
one BlockMask block: hidden blocks are never loaded (the forward kernels walk each tile's list of
non-empty key blocks) and full ones never masked per element; a partial one then has state 1, so
the forward kernels apply the element mask alone there (partial_element), without reading the state.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict

from attngen.maskc.ir import Input, walk

STATE = "block_mask_state"
RESERVED = frozenset({STATE})
ATTRIBUTES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "BLOCK_SIZE")


def lowered(mask: str, q_block: int, kv_block: int, by_batch: bool, by_head: bool) -> str:
    """The mask text attention() runs for a BlockMask with these block sizes and axes, and the
    element mask `mask` on its partial blocks. A function of constants: torch.compile runs it once at
    trace time (mark_constant_at_trace_time), as it cannot trace the parser."""
    from attngen.maskc.ir import to_text
    from attngen.masks import get_mask

    program = get_mask(mask).program
    clash = sorted({n.name for n in walk(program.ir) if isinstance(n, Input)} & RESERVED)
    if clash:
        raise ValueError(f"mask reads the input {clash[0]!r}; block_mask reserves the name {STATE!r}")
    state = f"{STATE}[{'b' if by_batch else 0}, {'h' if by_head else 0}, q_idx // {q_block}, kv_idx // {kv_block}]"
    element = to_text(program.ir)
    if element == "True":
        return f"{state} != 0"
    return f"{state} == 2 or ({state} == 1 and ({element}))"


def mark_constant_at_trace_time(torch) -> None:
    """Called by attngen.api.register(), outside any trace (marking inside one is a graph break)."""
    torch.compiler.assume_constant_result(lowered)


_LOWERED = re.compile(rf"{STATE}\[(0|b), (0|h), q_idx // (\d+), kv_idx // (\d+)\] (?:!= 0$|== 2 or {STATE}"
                      rf"\[\1, \2, q_idx // \3, kv_idx // \4\] == 1 and (.+)$)")


def partial_element(mask_text: str, block_m: int, block_n: int) -> str | None:
    """For a mask lowered from a BlockMask (canonical text) whose blocks tiles of block_m x block_n
    lie inside: its element mask, which is all a partial tile applies (its state is 1: the table
    reads the state exactly there, so state 0 is empty and state 2 full). None otherwise."""
    from attngen.masks import get_mask

    found = _LOWERED.match(mask_text)
    if found is None:
        return None
    by_batch, by_head, q_block, kv_block, element = found.groups()
    q_block, kv_block = int(q_block), int(kv_block)
    if q_block % block_m or kv_block % block_n:
        return None
    element = element or "True"
    try:  # the match must be the lowering itself, not a look-alike written by hand
        same = get_mask(lowered(element, q_block, kv_block, by_batch == "b", by_head == "h")).text == mask_text
    except ValueError:
        return None
    return element if same else None


def _is_noop(mask_mod) -> bool:
    return mask_mod is None or getattr(mask_mod, "__name__", None) == "noop_mask"


def _block_sizes(block_mask) -> tuple[int, int]:
    sizes = block_mask.BLOCK_SIZE
    sizes = (sizes, sizes) if isinstance(sizes, int) else tuple(sizes) if isinstance(sizes, (tuple, list)) else ()
    if len(sizes) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ValueError(f"block_mask.BLOCK_SIZE={block_mask.BLOCK_SIZE!r} is invalid; allowed: an int >= 1 or a "
                         "pair (Q_BLOCK, KV_BLOCK) of them")
    return sizes


def _check_lists(torch, block_mask, q, prefix: str, shape3) -> None:
    """ValueError unless block_mask.<prefix>_num_blocks and <prefix>_indices are int32 on q's device,
    (B', H', query blocks) and (B', H', query blocks, n) with B', H' as in shape3."""
    num, idx = getattr(block_mask, f"{prefix}_num_blocks"), getattr(block_mask, f"{prefix}_indices")
    for name, t, rank in ((f"{prefix}_num_blocks", num, 3), (f"{prefix}_indices", idx, 4)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"block_mask.{name} is a {type(t).__name__}; allowed: a torch int32 tensor")
        if t.dtype != torch.int32 or t.dim() != rank:
            raise ValueError(f"block_mask.{name} has dtype {str(t.dtype).removeprefix('torch.')} and shape "
                             f"{tuple(t.shape)}; allowed: int32 with {rank} dims")
        if t.device != q.device:
            raise ValueError(f"block_mask.{name} is on {t.device}, q on {q.device}; allowed: q's device")
    if shape3 is not None and (tuple(num.shape) != tuple(shape3) or tuple(idx.shape[:3]) != tuple(shape3)):
        raise ValueError(f"block_mask.{prefix}_num_blocks has shape {tuple(num.shape)} and {prefix}_indices "
                         f"{tuple(idx.shape)}; allowed: the shape of kv_num_blocks, {tuple(shape3)}, and "
                         f"(*{tuple(shape3)}, n)")
    if tuple(idx.shape[:3]) != tuple(num.shape):
        raise ValueError(f"block_mask.{prefix}_indices has shape {tuple(idx.shape)} and {prefix}_num_blocks "
                         f"{tuple(num.shape)}; allowed: indices of shape (*num_blocks.shape, n)")


def check(block_mask, mask: str | None, q, k) -> tuple[int, int, bool, bool]:
    """(Q_BLOCK, KV_BLOCK, by_batch, by_head) of a BlockMask for the call q (B, Sq, Hq, D), k (B, Sk,
    Hkv, D); ValueError naming what does not fit."""
    import torch

    missing = [a for a in ATTRIBUTES if not hasattr(block_mask, a)]
    if missing:
        raise ValueError(f"block_mask is a {type(block_mask).__name__} without {', '.join(missing)}; allowed: a "
                         "FlexAttention BlockMask (torch.nn.attention.flex_attention) or an object with its "
                         f"attributes {', '.join(ATTRIBUTES)}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"block_mask needs torch tensors; {name} is a {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; allowed with block_mask: 4 dims (batch, seq, heads, "
                             "head_dim)")
    if mask is None and not _is_noop(getattr(block_mask, "mask_mod", None)):
        name = getattr(block_mask.mask_mod, "__name__", repr(block_mask.mask_mod))
        raise ValueError(f"block_mask carries mask_mod {name!r}, a Python callable attngen cannot compile; allowed: "
                         "pass the same mask as an expression, mask=\"...\" (docs/masks.md), which partial blocks "
                         "then apply, or mask=\"none\" to show partial blocks whole")
    q_block, kv_block = _block_sizes(block_mask)
    batch, seq_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    seq_k = k.shape[1]
    _check_lists(torch, block_mask, q, "kv", None)
    num = block_mask.kv_num_blocks
    b_m, h_m, q_blocks = num.shape
    if b_m not in (1, batch) or h_m not in (1, heads_q):
        raise ValueError(f"block_mask.kv_num_blocks has shape {tuple(num.shape)} for batch {batch} and {heads_q} query "
                         f"heads; allowed: (1 or {batch}, 1 or {heads_q}, query blocks)")
    if q_blocks < math.ceil(seq_q / q_block):
        raise ValueError(f"block_mask has {q_blocks} query blocks of {q_block} rows; allowed: at least "
                         f"ceil(seq_q / {q_block}) = {math.ceil(seq_q / q_block)} for seq_q={seq_q} (a BlockMask "
                         "made for a shorter sequence)")
    lengths = getattr(block_mask, "seq_lengths", None)
    if lengths is not None and (lengths[0] < seq_q or lengths[1] < seq_k):
        raise ValueError(f"block_mask.seq_lengths={tuple(lengths)} is shorter than the call's (seq_q, seq_k) = "
                         f"({seq_q}, {seq_k}); allowed: a BlockMask made for at least these lengths")
    full = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    if (full[0] is None) != (full[1] is None):
        raise ValueError("block_mask has one of full_kv_num_blocks and full_kv_indices; allowed: both or neither")
    if full[0] is not None:
        _check_lists(torch, block_mask, q, "full_kv", num.shape)
    return q_block, kv_block, b_m > 1, h_m > 1


def state_grid(block_mask, seq_q: int, seq_k: int, q_block: int, kv_block: int):
    """int32 (B', H', ceil(seq_q / Q_BLOCK), ceil(seq_k / KV_BLOCK)): 2 where a block is listed full, 1
    where it is listed partial (and not full), 0 elsewhere. Counts are clamped to the lists' length;
    indices outside the key blocks are dropped (their keys do not exist: FlexAttention masks them)."""
    import torch

    q_blocks, kv_blocks = math.ceil(seq_q / q_block), math.ceil(seq_k / kv_block)
    num = block_mask.kv_num_blocks[..., :q_blocks]
    grid = torch.zeros((*num.shape, kv_blocks + 1), dtype=torch.int32, device=num.device)  # + a column for drops

    def put(counts, indices, value: int) -> None:
        counts, indices = counts[..., :q_blocks], indices[..., :q_blocks, :]
        listed = torch.arange(indices.shape[-1], device=indices.device) < counts.unsqueeze(-1)
        inside = listed & (indices >= 0) & (indices < kv_blocks)
        grid.scatter_(-1, torch.where(inside, indices, kv_blocks).long(), value)

    put(block_mask.kv_num_blocks, block_mask.kv_indices, 1)
    if block_mask.full_kv_num_blocks is not None:
        put(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2)  # listed both ways: full
    return grid[..., :kv_blocks]


# Grids of recent BlockMasks (a model calls attention with one BlockMask in every layer): keyed by
# the lists' addresses and version counters (an in-place change bumps the version, so a changed list
# misses), each entry keeping its lists alive so their addresses cannot be reused by others.
_GRIDS: OrderedDict = OrderedDict()
GRID_CACHE_SIZE = 8


def _cached_grid(block_mask, seq_q: int, seq_k: int, q_block: int, kv_block: int):
    """state_grid(), reused across eager calls with the same unchanged lists; built afresh under
    torch.compile and in CUDA-graph capture (a replay then rebuilds it from the lists' contents)."""
    import torch

    lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
             block_mask.full_kv_indices)
    if torch.compiler.is_compiling() or (lists[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return state_grid(block_mask, seq_q, seq_k, q_block, kv_block)
    key = (seq_q, seq_k, q_block, kv_block, *((None,) if t is None else
                                             (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype, t.device)
                                             for t in lists))
    hit = _GRIDS.get(key)
    if hit is not None:
        _GRIDS.move_to_end(key)
        return hit[1]
    grid = state_grid(block_mask, seq_q, seq_k, q_block, kv_block)
    _GRIDS[key] = (lists, grid)
    while len(_GRIDS) > GRID_CACHE_SIZE:
        _GRIDS.popitem(last=False)
    return grid


def lowered_call(block_mask, mask: str | None, inputs: dict | None, q, k, score_mod: str | None = None,
                 sink: str | None = None) -> tuple[str, dict]:
    """The (mask text, inputs) attention() runs for a call with a BlockMask (and the call's score modifier
    and sink, which may not read the state grid's name either: it is bound to the BlockMask's grid)."""
    if mask is not None and not isinstance(mask, str):
        raise ValueError(f"mask={mask!r} is invalid; allowed: a mask expression (docs/masks.md)")
    q_block, kv_block, by_batch, by_head = check(block_mask, mask, q, k)
    clash = sorted(set(inputs or {}) & RESERVED)
    if clash:
        raise ValueError(f"inputs has {clash[0]!r}; block_mask reserves the name {STATE!r}")
    from attngen import maskc

    for name, text in (("score_mod", score_mod), ("sink", sink)):
        try:
            reads = {n for n, _ in maskc.compile_score_mod(text).inputs} if isinstance(text, str) else set()
        except maskc.ExprError:
            continue  # refused later, with the argument's own message
        if STATE in reads:
            raise ValueError(f"{name}={text!r} reads the input {STATE!r}; block_mask reserves the name {STATE!r}")
    text = lowered(mask or "none", q_block, kv_block, by_batch, by_head)
    grid = _cached_grid(block_mask, q.shape[1], k.shape[1], q_block, kv_block)
    return text, {**(inputs or {}), STATE: grid}
