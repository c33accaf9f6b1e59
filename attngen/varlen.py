"""attention_varlen: FlashAttention's variable-length layout, sequences packed end to end.

    out = attngen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")

q is (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim): sequence i holds the
query rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 and the keys cu_seqlens_k[i] ..
cu_seqlens_k[i + 1] - 1 (int32 on q's device, nondecreasing from 0; empty sequences allowed).
Sequences never see each other.

It is one call of attention() over batch 1 of total_q x total_k, its mask the document mask
conjoined with the caller's mask rewritten into each sequence's own coordinates: q_idx, kv_idx,
q_len and kv_len of the mask (and of a score modifier or sink) become the row's and key's
positions within their sequence and their sequence's lengths, read from per-token int32 (or
float32, for modifiers) arrays that this module builds on the GPU from cu_seqlens (a few small
kernels, no host synchronisation: CUDA-graph capturable). So "causal" is bottom-right aligned per
sequence, as in FlashAttention's varlen kernels, and every mask, window and modifier the
language has works per sequence. The mask table classifies each (query block, key block) from
the arrays' per-call summaries (attngen/mask_table.py): blocks across two sequences' boundaries
are masked per element, blocks of one sequence like the dense mask's, other sequences' blocks
skipped. Runtime inputs the caller passes are indexed in packed positions (an index is never
rewritten); `b` would be 0 throughout and is refused.
"""

from __future__ import annotations

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
RESERVED = frozenset({"varlen_qdoc", "varlen_kdoc", *(n for names in _POSITION_INPUTS.values() for n in names[:2])})
FLOAT_EXACT = 2**24  # positions a float32 holds exactly: modifiers read positions as floats


def _rewritten(node, kind: str):
    """node with each index variable replaced by its per-sequence array read at the packed position;
    indices of runtime inputs are left as they are (packed positions)."""
    if isinstance(node, Var):
        names = _POSITION_INPUTS.get(node.name)
        if names is None:
            return node
        if kind != "mask":
            return Input(names[1], (Var(names[2], Type.INT),), Type.FLOAT)
        read = Input(names[0], (Var("q_idx", Type.INT),), Type.INT)
        return make("sub", node, read) if node.name in _STARTS else read
    if isinstance(node, Op):
        if node.op == "to_float":  # an int position the modifier converted: now read as a float already
            arg = _rewritten(node.args[0], kind)
            return arg if arg.type is Type.FLOAT else make("to_float", arg)
        return make(node.op, *(_rewritten(a, kind) for a in node.args))
    return node


def lowered(mask: str, score_mod: str | None, sink: str | None) -> tuple[str, str | None, str | None]:
    """The (mask, score_mod, sink) texts attention() runs for a varlen call: the document mask and
    the caller's expressions in per-sequence coordinates."""
    from attngen.masks import get_mask
    from attngen.score_mods import get_score_mod

    programs = [("mask", get_mask(mask).program, "mask")]
    for name, text in (("score_mod", score_mod), ("sink", sink)):
        if text is not None:
            programs.append((name, get_score_mod(text).program, "score_mod"))
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
            out[name] = to_text(_rewritten(program.ir, kind))
        except ValueError as exc:  # an integer operation (//, %) on a position a modifier reads as a float
            raise ValueError(f"{name}={program.canonical!r}: {exc}; a score modifier or sink of attention_varlen "
                             "reads positions as floats: allowed: + - * / abs min max where and comparisons on "
                             "q_idx, kv_idx, q_len, kv_len") from None
    mask_text = _DOCUMENTS if out["mask"] == "True" else f"{_DOCUMENTS} and ({out['mask']})"
    return mask_text, out.get("score_mod"), out.get("sink")


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
    """(sequence, position in it) of each of `total` packed tokens, int32; tokens past cu[-1] get
    sequence -1 (they see nothing, and nothing sees them)."""
    tokens = torch.arange(total, device=cu.device, dtype=torch.int32)
    sequences = cu.numel() - 1
    seq = torch.searchsorted(cu[1:].contiguous(), tokens, right=True)
    inside = seq < sequences
    seq_c = seq.clamp(max=max(sequences - 1, 0))
    position = tokens - cu[seq_c]
    return torch.where(inside, seq_c, -1).to(torch.int32), position.to(torch.int32), seq_c


def varlen_inputs(mask: str, score_mod: str | None, sink: str | None, q, k, cu_seqlens_q, cu_seqlens_k) -> dict:
    """The per-token arrays the lowered expressions read, built on the device of the cu_seqlens."""
    import torch

    from attngen.masks import get_mask
    from attngen.score_mods import get_score_mod

    wanted = {name for name, _ in get_mask(mask).program.inputs}
    for text in (score_mod, sink):
        if text is not None:
            wanted |= {name for name, _ in get_score_mod(text).program.inputs}
    qdoc, qpos, qseq = _per_token(torch, cu_seqlens_q, q.shape[0])
    kdoc, kpos, _ = _per_token(torch, cu_seqlens_k, k.shape[0])
    kdoc = torch.where(kdoc < 0, -2, kdoc)  # past the end on both sides: still apart
    lengths_q, lengths_k = cu_seqlens_q[1:] - cu_seqlens_q[:-1], cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if lengths_q.numel() == 0:  # no sequence: every token is past the end (its doc says so)
        qlen = klen = qstart = kstart = torch.zeros_like(qpos)
    else:
        qlen, klen = lengths_q[qseq], lengths_k[qseq]
        qstart, kstart = cu_seqlens_q[qseq], cu_seqlens_k[qseq]
    arrays = {"varlen_qdoc": qdoc, "varlen_kdoc": kdoc, "varlen_qstart": qstart, "varlen_kstart": kstart,
              "varlen_qlen": qlen, "varlen_klen": klen, "varlen_qposf": qpos.float(), "varlen_kposf": kpos.float(),
              "varlen_qlenf": qlen.float(), "varlen_klenf": klen.float()}
    return {name: arrays[name] for name in sorted(wanted & RESERVED)}  # int32 for the mask, float32 for modifiers


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
    0 and -inf. cu_seqlens are not read on the host (no synchronisation): values that are not
    nondecreasing from 0 to the totals give the attention of the sequences they describe, and rows
    past cu_seqlens_q[-1] see no key."""
    from attngen.api import attention

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
    texts = lowered(mask, score_mod, sink)
    reads_positions = any(text is not None and "posf[" in text for text in texts[1:])
    if reads_positions and max(q.shape[0], k.shape[0]) >= FLOAT_EXACT:
        raise ValueError(f"q has {q.shape[0]} and k {k.shape[0]} tokens, and the score modifier or sink reads "
                         f"positions (as float32); allowed: fewer than {FLOAT_EXACT} tokens")
    ours = varlen_inputs(*texts, q, k, cu_seqlens_q, cu_seqlens_k)
    clash = sorted(set(inputs or {}) & RESERVED)
    if clash:
        raise ValueError(f"inputs has {clash[0]!r}; attention_varlen reserves the names {sorted(RESERVED)}")
    result = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask=texts[0], score_mod=texts[1],
                       sink=texts[2], inputs={**(inputs or {}), **ours}, softmax_scale=softmax_scale,
                       return_lse=return_lse, dropout_p=dropout_p, dropout_seed=dropout_seed,
                       deterministic=deterministic)
    if return_lse:
        out, lse = result
        return out[0], lse[0]
    return result[0]
