"""attention_varlen: FlashAttention's variable-length layout, sequences packed end to end.

    out = attngen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")

q is (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim): sequence i holds the
query rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 and the keys cu_seqlens_k[i] ..
cu_seqlens_k[i + 1] - 1 (int32 on q's device, nondecreasing from 0; empty sequences allowed).
Sequences never see each other.

It runs one of two ways (docs/masks.md, "Packed sequences"):
- Per-sequence tiles (Problem.varlen: the fwd_sm90 family on sm_90a, fwd_sm80 elsewhere): one attention()
  call over batch 1 with the spec's `varlen` set and cu_seqlens passed as the inputs `cu_seqlens_q`,
  `cu_seqlens_k`; the kernel tiles each sequence on its own (its tile list is built on the GPU,
  attngen/cuda/varlen_tiles.cuh) and evaluates the caller's mask, modifier and sink in
  the sequence's positions. Taken for calls without gradients or dropout (eagerly or under
  torch.compile, where the choice is made once at trace time), whose mask has closed-form bounds
  and whose expressions read inputs indexed by h alone (native_reason).
- The document mask, everywhere else: one call of attention() over batch 1, its mask the document
  mask conjoined with the caller's mask rewritten into each sequence's own coordinates: q_idx,
  kv_idx, q_len and kv_len of the mask (and of a score modifier or sink) become the row's and key's
  positions within their sequence and their sequence's lengths, read from per-token int32 (or
  float32, for modifiers) arrays that this module builds on the GPU from cu_seqlens (a few small
  kernels, no host synchronisation: CUDA-graph capturable). The mask table classifies each (query
  block, key block) from the arrays' per-call summaries (attngen/mask_table.py): blocks across two
  sequences' boundaries are masked per element, blocks of one sequence like the dense mask's, other
  sequences' blocks skipped. Runtime inputs the caller passes are indexed in packed positions (an
  index is never rewritten).
Either way "causal" is bottom-right aligned per sequence, as in FlashAttention's varlen kernels, and
every mask, window and modifier the language has works per sequence; `b` would be 0 throughout and
is refused.
"""

from __future__ import annotations

import functools

from attngen.maskc.ir import Input, Op, Type, Var, make, to_text, walk

# The per-token arrays, by what they replace: (mask's int32 name, modifier's float32 name, index).
# A mask reads a position as the packed index minus its sequence's start, both starts read at the
# row (the key's sequence is the row's wherever the document conjunct holds): kv_idx stays an exact
# variable, so the block table sees a key block past the row's sequence as beyond its diagonal
# (per-key positions would be unrelated to the key's sequence in the analysis: the block that
# straddles the sequence's end could not be proved empty, nor could the blocks before it be skipped).
_POSITION_INPUTS = {
    "q_idx": ("varlen_qstart", "varlen_qposf", "q_idx"),
    "kv_idx": ("varlen_kstart", "varlen_kposf", "kv_idx"),
    "q_len": ("varlen_qlen", "varlen_qlenf", "q_idx"),
    "kv_len": ("varlen_klen", "varlen_klenf", "q_idx"),  # the key count of the row's sequence
}
_STARTS = ("q_idx", "kv_idx")  # in a mask: the variable minus the start
_DOCUMENTS = "varlen_qdoc[q_idx] == varlen_kdoc[kv_idx]"
# A varlen problem's kernels (Problem.varlen) read the sequences' boundaries as these int32 inputs.
CU_SEQLENS = ("cu_seqlens_k", "cu_seqlens_q")
RESERVED = frozenset({"varlen_qdoc", "varlen_kdoc", *CU_SEQLENS,
                      *(n for names in _POSITION_INPUTS.values() for n in names[:2])})
FLOAT_EXACT = 2**24  # positions a float32 holds exactly: modifiers read positions as floats
# Whether attention_varlen runs kernels that tile per sequence where they can (False: always the
# document mask over batch 1; tests and benchmarks compare the two).
PER_SEQUENCE_TILES = True
# Which family tiles per sequence (None: the first that runs the spec on the GPU, fwd_sm90 on the H100;
# tests and benchmarks pin "fwd_sm80" to run its kernels there too). Read when a call is traced: under
# torch.compile, set it before compiling (torch._dynamo.reset() after changing it).
PER_SEQUENCE_FAMILY: str | None = None
_TILING_FAMILIES = ("fwd_sm90", "fwd_sm80")  # the forward families with per-sequence tiles


def declared_cu_seqlens() -> tuple:
    """The runtime inputs a varlen problem adds to its expressions' (attngen/runtime_inputs.py)."""
    from attngen.runtime_inputs import Declared

    return tuple(Declared(name, 1, "mask") for name in CU_SEQLENS)


def native_reason(problem) -> str | None:
    """Why kernels tiling per sequence cannot run a varlen problem (None when they can). Positions
    there are the sequence's own, so the mask needs a closed form of its bounds (the block table
    summarizes inputs over packed positions), and expressions may not read b (every sequence is one
    batch row) nor index a runtime input by a position (attention_varlen indexes them in packed
    positions: such calls run the document mask instead)."""
    from attngen.families.base import problem_programs
    from attngen.maskc.ir import Input, Var, walk
    from attngen.masks import get_mask

    if problem.dropout_p:
        return "dropout is not built into the per-sequence tiles yet"
    lowering = get_mask(problem.mask)
    if lowering.closed is None:
        return (f"mask {problem.mask!r} has no closed form of its block bounds; per-sequence tiles run none, causal, "
                "sliding_window, chunked and bands (attention_varlen runs other masks through the document mask)")
    if lowering.program.inputs:  # a band reading scalars (offsets): not tested per sequence, so the document mask
        return (f"mask {problem.mask!r} reads runtime inputs; per-sequence tiles run masks without them "
                "(attention_varlen runs it through the document mask)")
    texts = [("mask", problem.mask), ("score_mod", problem.score_mod), ("sink", problem.sink)]
    for (name, text), (_, program) in zip([t for t in texts if t[1] is not None], problem_programs(problem)):
        nodes = list(walk(program.ir))
        if any(isinstance(node, Var) and node.name == "b" for node in nodes):
            return f"{name}={text!r} reads b; packed sequences are one batch row"
        for node in nodes:
            if isinstance(node, Input) and node.name in CU_SEQLENS:
                return f"{name}={text!r} reads {node.name!r}, the name of the sequences' boundaries"
            positional = isinstance(node, Input) and any(isinstance(v, Var) and v.name != "h"
                                                         for index in node.index for v in walk(index))
            if positional:
                return (f"{name}={text!r} indexes input {node.name!r} by a position; per-sequence tiles read "
                        "inputs indexed by h alone")
    return None


def _rewritten(node, kind: str, int_positions: bool = False):
    """node with each index variable replaced by its per-sequence array read at the packed position;
    indices of runtime inputs are left as they are (packed positions). A modifier reads positions as
    floats, unless `int_positions` (it reads int32 inputs, int(name), whose integer arithmetic with a
    position must stay exact past float32's 2**24): then as the mask does, through int(...) reads."""
    if isinstance(node, Var):
        names = _POSITION_INPUTS.get(node.name)
        if names is None:
            return node
        if kind != "mask" and not int_positions:
            return Input(names[1], (Var(names[2], Type.INT),), Type.FLOAT)
        read = Input(names[0], (Var("q_idx", Type.INT),), Type.INT, as_int=kind != "mask")
        return make("sub", node, read) if node.name in _STARTS else read
    if isinstance(node, Op):
        if node.op == "to_float":  # an int position the modifier converted: now read as a float already
            arg = _rewritten(node.args[0], kind, int_positions)
            return arg if arg.type is Type.FLOAT else make("to_float", arg)
        return make(node.op, *(_rewritten(a, kind, int_positions) for a in node.args))
    return node


def lowered(mask: str, score_mod: str | None, sink: str | None) -> tuple[str, str | None, str | None]:
    """The (mask, score_mod, sink) texts attention() runs for a varlen call: the document mask and
    the caller's expressions in per-sequence coordinates."""
    from attngen.masks import get_mask
    from attngen.score_mods import get_score_mod

    from attngen.score_mods import canonical_sink

    programs = [("mask", get_mask(mask).program, "mask")]
    if score_mod is not None:
        programs.append(("score_mod", get_score_mod(score_mod).program, "score_mod"))
    if sink is not None:  # checked as a sink first: its errors name sink= and a sink's rules
        programs.append(("sink", get_score_mod(canonical_sink(sink)).program, "score_mod"))
    out = {}
    for name, program, kind in programs:
        clash = sorted({n.name for n in walk(program.ir) if isinstance(n, Input)} & RESERVED)
        if clash:
            raise ValueError(f"{name} reads the input {clash[0]!r}; attention_varlen reserves the names "
                             f"{sorted(RESERVED)}")
        if any(isinstance(n, Var) and n.name == "b" for n in walk(program.ir)):
            raise ValueError(f"{name}={program.canonical!r} reads b; attention_varlen packs every sequence into one, "
                             "so b would be 0 throughout: allowed: h, q_idx, kv_idx, q_len, kv_len (per sequence) "
                             "and runtime inputs indexed by them")
        try:
            int_positions = any(isinstance(n, Input) and n.as_int for n in walk(program.ir))
            out[name] = to_text(_rewritten(program.ir, kind, int_positions))
        except ValueError as exc:  # an integer operation (//, %) on a position a modifier reads as a float
            raise ValueError(f"{name}={program.canonical!r}: {exc}; a score modifier or sink of attention_varlen "
                             "reads positions as floats: allowed: + - * / abs min max where and comparisons on "
                             "q_idx, kv_idx, q_len, kv_len") from None
    mask_text = _DOCUMENTS if out["mask"] == "True" else f"{_DOCUMENTS} and ({out['mask']})"
    return mask_text, out.get("score_mod"), out.get("sink")


@functools.lru_cache(maxsize=64)
def _per_sequence_spec(key: str, device: int, family: str | None = None):
    """The varlen spec of a call's spec key when a family tiling per sequence runs it on `device` (fwd_sm90
    on sm_90a, fwd_sm80 elsewhere; `family` pins one), else None."""
    from attngen import families, targets
    from attngen.spec import AttentionSpec

    spec = AttentionSpec.from_key(key).replace(varlen=True)
    supporting = families.supporting(spec.problem, targets.device_target(device))
    if family is not None:
        return spec.replace(family=family) if any(f.name == family for f in supporting) else None
    return spec if supporting else None


def _per_sequence_key(key: str, device: int) -> str:
    """The key of _per_sequence_spec, or "" for none. attngen.api.register() marks it with
    torch.compiler.assume_constant_result, so torch.compile runs it once at trace time (it parses a
    spec key and asks the GPU which families run it: nothing to trace) and keeps the string as a
    constant (a spec object cannot be one, and dynamo traces through an lru_cache wrapper rather
    than honour the mark on it: hence a plain function of strings)."""
    family = PER_SEQUENCE_FAMILY
    if family is not None and family not in _TILING_FAMILIES:
        raise ValueError(f"attngen.varlen.PER_SEQUENCE_FAMILY={family!r} is invalid; allowed: None or one of "
                         f"{list(_TILING_FAMILIES)}")
    spec = _per_sequence_spec(key, device, family)
    return "" if spec is None else spec.key()


def mark_constant_at_trace_time(torch) -> None:
    """Called by attngen.api.register(), outside any trace (marking inside one is a graph break): what
    parses expressions or asks the GPU runs once when torch.compile traces attention_varlen."""
    for fn in (_per_sequence_key, _lowered_texts, _read_inputs):
        torch.compiler.assume_constant_result(fn)


def _check_cu(name: str, cu, other_name: str, other) -> None:
    import torch

    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor (int32, on q's device), got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} has dtype {str(cu.dtype).removeprefix('torch.')} and shape {tuple(cu.shape)}; "
                         "allowed: int32 of shape (sequences + 1,)")
    if isinstance(other, torch.Tensor) and other.shape != cu.shape:
        raise ValueError(f"{name} has shape {tuple(cu.shape)} but {other_name} has {tuple(other.shape)}; allowed: "
                         "the same number of sequences")


def _per_token(torch, cu, total: int):
    """Per packed token, int32: its sequence (-1 outside every one: before cu[0] or from cu[-1] on;
    it sees nothing and nothing sees it), its position and the first token and length of its
    sequence, or of its run of tokens outside every sequence (those before cu[0], or those from
    cu[-1] on: a sequence without keys, as the kernels tiling per sequence treat them)."""
    tokens = torch.arange(total, device=cu.device, dtype=torch.int32)
    sequences = cu.numel() - 1
    seq = torch.searchsorted(cu[1:].contiguous(), tokens, right=True)
    before, after = tokens < cu[0], seq >= sequences
    seq_c = seq.clamp(max=max(sequences - 1, 0))
    if sequences:
        start, length = cu[seq_c], cu[seq_c + 1] - cu[seq_c]
    else:
        start = length = torch.zeros_like(tokens)
    tail = cu[-1].clamp(min=0)
    start = torch.where(before, 0, torch.where(after, tail, start))
    length = torch.where(before, cu[0], torch.where(after, total - tail, length))
    doc = torch.where(before | after, -1, seq_c)
    return doc.to(torch.int32), (tokens - start).to(torch.int32), start.to(torch.int32), length.to(torch.int32)


def _read_inputs(mask: str, score_mod: str | None, sink: str | None) -> tuple[str, ...]:
    """The runtime inputs the expressions read (a constant at trace time: mark_constant_at_trace_time)."""
    from attngen.masks import get_mask
    from attngen.score_mods import get_score_mod

    wanted = {name for name, _ in get_mask(mask).program.inputs}
    for text in (score_mod, sink):
        if text is not None:
            wanted |= {name for name, _ in get_score_mod(text).program.inputs}
    return tuple(sorted(wanted))


def _lowered_texts(mask: str, score_mod: str | None, sink: str | None) -> tuple[str, str | None, str | None]:
    """lowered(), as a constant at trace time (mark_constant_at_trace_time)."""
    return lowered(mask, score_mod, sink)


def varlen_inputs(mask: str, score_mod: str | None, sink: str | None, q, k, cu_seqlens_q, cu_seqlens_k) -> dict:
    """The per-token arrays the lowered expressions read, built on the device of the cu_seqlens."""
    import torch

    wanted = set(_read_inputs(mask, score_mod, sink))
    qdoc, qpos, qstart, qlen = _per_token(torch, cu_seqlens_q, q.shape[0])
    kdoc, kpos, _, _ = _per_token(torch, cu_seqlens_k, k.shape[0])
    kdoc = torch.where(kdoc < 0, -2, kdoc)  # outside every sequence on both sides: still apart
    # The row's sequence's keys (none for a row outside every sequence).
    inside = qdoc >= 0
    seq = qdoc.clamp(min=0).long()
    kstart = torch.where(inside, cu_seqlens_k[seq], 0).to(torch.int32)
    klen = torch.where(inside, cu_seqlens_k[(seq + 1).clamp(max=cu_seqlens_k.numel() - 1)] - cu_seqlens_k[seq],
                       0).to(torch.int32)
    arrays = {"varlen_qdoc": qdoc, "varlen_kdoc": kdoc, "varlen_qstart": qstart, "varlen_kstart": kstart,
              "varlen_qlen": qlen, "varlen_klen": klen, "varlen_qposf": qpos.float(), "varlen_kposf": kpos.float(),
              "varlen_qlenf": qlen.float(), "varlen_klenf": klen.float()}
    return {name: arrays[name] for name in sorted(wanted & RESERVED)}  # int32 for the mask, float32 for modifiers


def _per_sequence(q, k, v, mask, score_mod, sink, inputs, dropout_p) -> str:
    """The key of the varlen spec to run this call with kernels that tile per sequence
    (Problem.varlen), or "" for the document mask over batch 1: without gradients or dropout, for a mask with
    closed-form bounds and inputs indexed by h alone (native_reason)."""
    import torch

    from attngen.api import _needs_grad, _spec_key

    if not PER_SEQUENCE_TILES or dropout_p or type(q) is not torch.Tensor or not q.is_cuda \
            or _needs_grad(torch, q, k, v, inputs):
        return ""
    key = _spec_key(q.unsqueeze(0), k.unsqueeze(0), None, mask, score_mod, sink)
    return _per_sequence_key(key, q.get_device())


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, *, mask: str = "none", score_mod: str | None = None,
                     sink: str | None = None, inputs: dict | None = None, softmax_scale: float | None = None,
                     return_lse: bool = False, dropout_p: float = 0.0, dropout_seed=None,
                     deterministic: bool | None = None):
    """Attention over sequences packed end to end (module docstring): q (total_q, heads_q, head_dim),
    k, v (total_k, heads_kv, head_dim), cu_seqlens_q and cu_seqlens_k int32 (sequences + 1,).
    mask, score_mod and sink apply within each sequence, in its own positions (mask="causal" is
    bottom-right aligned per sequence). max_seqlen_q / max_seqlen_k are accepted for FlashAttention's
    signature and not needed. The other arguments are attention()'s; gradients flow to q, k, v
    (and learnable inputs) as there.

    Returns out (total_q, heads_q, head_dim); with return_lse, (out, lse) with lse float32
    (heads_q, total_q), as FlashAttention's varlen functions. A row whose sequence has no key gives
    0 and -inf (with a sink, its logit). cu_seqlens are not read on the host (no synchronisation):
    values that are not nondecreasing from 0 to the totals give the attention of the sequences they
    describe, and rows before cu_seqlens_q[0] or from cu_seqlens_q[-1] on are a sequence without keys."""
    from attngen.api import attention, check_call_args

    check_call_args(return_lse=return_lse, deterministic=deterministic, inputs=inputs, softmax_scale=softmax_scale,
                    q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(getattr(t, "shape", ())) != 3:
            raise ValueError(f"{name} must have 3 dims (total_tokens, heads, head_dim) for attention_varlen, got "
                             f"shape {tuple(getattr(t, 'shape', ()))}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} and v {tuple(v.shape)}; allowed: the same shape")
    _check_cu("cu_seqlens_q", cu_seqlens_q, "cu_seqlens_k", cu_seqlens_k)
    _check_cu("cu_seqlens_k", cu_seqlens_k, "cu_seqlens_q", cu_seqlens_q)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}; allowed: q's device")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}={value!r} is invalid; allowed: None or an int >= 0")
    if not isinstance(mask, str):
        raise ValueError(f"mask={mask!r} is invalid; allowed: a mask expression (docs/masks.md)")
    clash = sorted(set(inputs or {}) & RESERVED)
    if clash:
        raise ValueError(f"inputs has {clash[0]!r}; attention_varlen reserves the names {sorted(RESERVED)}")
    key = _per_sequence(q, k, v, mask, score_mod, sink, inputs, dropout_p)
    if key:  # kernels tiling per sequence: the caller's expressions as they are
        import torch

        from attngen import api

        q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        with_cu = {**(inputs or {}), "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
        if torch.compiler.is_compiling():  # the op by its key (no gradients here: nothing else to record)
            names, tensors = api._split_inputs(with_cu)
            out, lse = (api._OP or api.register())(q4, k4, v4, key, softmax_scale, names, tensors)
        else:
            out, lse = attention(q4, k4, v4, api._spec_from_key(key), inputs=with_cu, softmax_scale=softmax_scale,
                                 return_lse=True)
        return (out.squeeze(0), lse.squeeze(0)) if return_lse else out.squeeze(0)
    # Copies of the texts, free of the trace-time constant's source (dynamo cannot guard on its items).
    texts = tuple(None if text is None else str(text) for text in _lowered_texts(mask, score_mod, sink))
    reads_positions = any(text is not None and "posf[" in text for text in texts[1:])
    if reads_positions and max(q.shape[0], k.shape[0]) >= FLOAT_EXACT:
        raise ValueError(f"q has {q.shape[0]} and k {k.shape[0]} tokens, and the score modifier or sink reads "
                         f"positions (as float32); allowed: fewer than {FLOAT_EXACT} tokens")
    ours = varlen_inputs(*texts, q, k, cu_seqlens_q, cu_seqlens_k)
    result = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask=texts[0], score_mod=texts[1],
                       sink=texts[2], inputs={**(inputs or {}), **ours}, softmax_scale=softmax_scale,
                       return_lse=return_lse, dropout_p=dropout_p, dropout_seed=dropout_seed,
                       deterministic=deterministic)
    if return_lse:
        out, lse = result
        return out.squeeze(0), lse.squeeze(0)
    return result.squeeze(0)
