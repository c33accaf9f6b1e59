"""Dense reference attention with exactly the kernel contract (DESIGN.md section 3).

Layout q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), any strides; query head h reads kv head
h // gqa_ratio; bottom-right causal alignment; LSE float32 natural log (B, Hq, Sq); a row
with no visible key gives output 0 and LSE -inf. Everything is computed densely in
float64 (or float32) so the kernels have an exact yardstick. The mask is the mask's
`dense_visible` predicate, kept in masks.py beside the CUDA lowering of the same mask.
Dropout keeps exactly the elements the kernels keep (dropout_mask: attngen/philox.py's mapping),
so a kernel with dropout compares with the reference as one without.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from attngen.dtypes import torch_dtype
from attngen.masks import get_mask
from attngen.score_mods import get_score_mod

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPUTE_DTYPES = (torch.float32, torch.float64)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: str = "none",
    softmax_scale: float | None = None,
    gqa_ratio: int | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
    score_mod: str | None = None,
    inputs: dict | None = None,
    sink: str | None = None,
    batch_offset: int = 0,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
):
    """softmax(score_mod(scale * q k^T) + mask) v; returns out, or (out, lse) when return_lse.
    `inputs`: the runtime inputs the expressions read, by name (docs/masks.md); `sink`: a logit
    per row that joins the softmax's denominator only (so a row's weights sum to less than 1);
    `batch_offset`: the batch index the expressions see for q[0] (decode_attention runs one
    sequence at a time); `dropout_p`, `dropout_seed`, `dropout_offset`: the kernels' dropout
    (dropout_mask), applied to the probabilities that multiply v; the LSE is of the undropped ones."""
    ratio = _check_inputs(q, k, v, gqa_ratio, compute_dtype)
    lowering = get_mask(mask)  # raises ValueError naming mask= and what is allowed
    modifier = None if score_mod is None else get_score_mod(score_mod)
    B, Sq, Hq, D = q.shape
    scale = _check_scale(softmax_scale, D)
    drop = _dropout_weights(dropout_p, dropout_seed, dropout_offset, q, k, ratio, batch_offset, compute_dtype)
    dense = _grouped(q, k, v, lowering, modifier, sink, scale, ratio, inputs, batch_offset, compute_dtype, drop)
    out, lse = dense.out, dense.lse

    out = out.reshape(B, Hq, Sq, D).permute(0, 2, 1, 3).to(q.dtype)
    if not return_lse:
        return out
    return out, lse.reshape(B, Hq, Sq).to(torch.float32)


def dropout_mask(dropout_p: float, seed: int, offset: int, batch: int, heads: int, seq_q: int, seq_k: int, *,
                 batch_offset: int = 0, device=None) -> torch.Tensor:
    """(batch, heads, seq_q, seq_k) bool: the elements the kernels keep with dropout_p, for a call
    whose rng tensor holds [seed, offset] (docs/dropout.md). All True for dropout_p 0."""
    from attngen import philox

    if not _check_dropout(dropout_p):
        return torch.ones((batch, heads, seq_q, seq_k), dtype=torch.bool, device=device)
    for name, value, top in (("dropout_seed", seed, 2**64), ("dropout_offset", offset, 2**63)):
        if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < top:
            raise ValueError(f"{name}={value!r} is invalid; allowed: an int in [-2**63, {top})")
    from attngen.dropout import threshold

    mask = philox.keep_mask(seed, offset, batch, heads, seq_q, seq_k, threshold(dropout_p), batch_offset)
    return torch.from_numpy(mask).to(device)


def _dropout_weights(dropout_p, seed, offset, q, k, ratio, batch_offset, compute_dtype):
    """The factor on each probability that multiplies v, grouped (B, Hkv, ratio, Sq, Sk): 0 where
    dropped, 1 / (1 - p) of the realised p where kept; None without dropout."""
    from attngen import dropout

    if not _check_dropout(dropout_p):
        return None
    B, Sq, Hq, _ = q.shape
    keep = dropout_mask(dropout_p, seed, offset, B, Hq, Sq, k.shape[1], batch_offset=batch_offset, device=q.device)
    weights = keep.to(compute_dtype) * dropout.keep_scale(dropout_p)
    return weights.reshape(B, Hq // ratio, ratio, Sq, k.shape[1])


def _grouped(q, k, v, lowering, modifier, sink, scale, ratio, inputs, batch_offset, compute_dtype, drop=None):
    """attention()'s dense computation with query heads grouped by the kv head they read: every
    intermediate in the layout (B, Hkv, ratio, Sq, Sk) (rows: (B, Hkv, ratio, Sq)). `drop`: the
    dropout weights (_dropout_weights), or None."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    # Group query heads by the kv head they read: (B, Hkv, ratio, Sq, D). No copy of k/v.
    qg = q.to(compute_dtype).permute(0, 2, 1, 3).reshape(B, Hkv, ratio, Sq, D)
    kg = k.to(compute_dtype).permute(0, 2, 1, 3)
    vg = v.to(compute_dtype).permute(0, 2, 1, 3)
    raw = torch.einsum("bgrqd,bgkd->bgrqk", qg, kg) * scale

    # The mask over (batch, kv head, query head in group, row, key): query head h = g * ratio + r.
    q_idx = torch.arange(Sq, device=q.device)[:, None]
    kv_idx = torch.arange(Sk, device=q.device)[None, :]
    b = torch.arange(batch_offset, batch_offset + B, device=q.device)[:, None, None, None, None]
    h = torch.arange(Hq, device=q.device).reshape(1, Hkv, ratio, 1, 1)
    scores = raw
    if modifier is not None:
        scores = modifier.dense(scores, q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs)
    visible = torch.as_tensor(lowering.dense_visible(q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs), device=q.device)
    visible = torch.broadcast_to(visible, scores.shape)
    scores = scores.masked_fill(~visible, -math.inf)

    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row with no visible key
    sinks = None
    if sink is not None:
        zero = torch.zeros((), dtype=scores.dtype, device=q.device)
        sinks = get_score_mod(sink).dense(zero, q_idx[:, 0], 0, Sq, Sk, b=b[..., 0], h=h[..., 0], inputs=inputs)
        sinks = torch.broadcast_to(sinks, lse.shape)
        lse = torch.logaddexp(lse, sinks)
    # Subtracting a -inf LSE would give NaN; with 0 instead every exp(-inf) is exactly 0.
    probs = torch.exp(scores - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs if drop is None else probs * drop, vg)
    return SimpleNamespace(qg=qg, kg=kg, vg=vg, raw=raw, scores=scores, visible=visible, lse=lse, sinks=sinks,
                           probs=probs, out=out, index=(q_idx, kv_idx, b, h), drop=drop)


def attention_for_spec(
    q, k, v, spec, softmax_scale: float | None = None, return_lse: bool = False, compute_dtype=torch.float64,
    inputs: dict | None = None, dropout_seed: int = 0, dropout_offset: int = 0,
):
    """attention() with mask, score modifier, gqa_ratio, scale and dropout_p taken from an
    AttentionSpec (or its Problem); with dropout, the call's seed and offset. For a varlen problem
    (sequences packed into batch 1, their boundaries the inputs cu_seqlens_q / cu_seqlens_k),
    attention_varlen below, one sequence at a time.

    Inputs may be in the spec's dtype or upcast to float32/float64 (a more exact reference). An
    explicit softmax_scale is held to what a kernel call accepts (attngen/runtime/checks.py).
    """
    from attngen.runtime.checks import check_scale

    problem = getattr(spec, "problem", spec)
    _check_inputs(q, k, v, problem.gqa_ratio, compute_dtype)  # first, so q below is a 4-d tensor
    if q.shape[-1] != problem.head_dim:
        raise ValueError(f"q.shape[-1]={q.shape[-1]} does not match the spec; allowed: head_dim={problem.head_dim}")
    allowed = (torch_dtype(problem.dtype), torch.float32, torch.float64)
    if q.dtype not in allowed:
        raise ValueError(f"q.dtype={q.dtype} does not match spec dtype {problem.dtype!r}; allowed: {_names(allowed)}")
    if problem.varlen:
        return _varlen_for_spec(q, k, v, problem, check_scale(softmax_scale, problem), return_lse, compute_dtype,
                                inputs)
    return attention(
        q, k, v, mask=problem.mask, softmax_scale=check_scale(softmax_scale, problem), gqa_ratio=problem.gqa_ratio,
        return_lse=return_lse, compute_dtype=compute_dtype, score_mod=problem.score_mod, inputs=inputs,
        sink=problem.sink, dropout_p=problem.dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    )


def _varlen_for_spec(q, k, v, problem, softmax_scale, return_lse, compute_dtype, inputs):
    from attngen.varlen import CU_SEQLENS

    missing = [name for name in CU_SEQLENS if name not in (inputs or {})]
    if missing or q.shape[0] != 1:
        raise ValueError(f"a varlen problem packs its sequences into batch 1 (q.shape[0]={q.shape[0]}) with their "
                         f"boundaries in inputs {list(CU_SEQLENS)} (missing: {missing or 'none'}); allowed: both")
    if problem.dropout_p:
        raise ValueError(f"dropout_p={problem.dropout_p}: the varlen reference has no dropout; allowed: 0")
    theirs = {name: t for name, t in inputs.items() if name not in CU_SEQLENS}
    out, lse = attention_varlen(q[0], k[0], v[0], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], mask=problem.mask,
                                score_mod=problem.score_mod, sink=problem.sink, inputs=theirs or None,
                                softmax_scale=softmax_scale, compute_dtype=compute_dtype)
    return (out[None], lse[None]) if return_lse else out[None]


def attention_grads(
    q, k, v, dout, *, mask: str = "none", softmax_scale: float | None = None, gqa_ratio: int | None = None,
    score_mod: str | None = None, inputs: dict | None = None, sink: str | None = None, dlse=None,
    grad_inputs: tuple = (), batch_offset: int = 0, dropout_p: float = 0.0, dropout_seed: int = 0,
    dropout_offset: int = 0,
):
    """The float64 gradients of attention() for the loss sum(out * dout) + sum(lse * dlse):
    (dq, dk, dv, parts), dq like q and dk, dv like k, all float64.

    The gradients are torch autograd through attention() itself, computed in float64 (the
    yardstick); `grad_inputs` names runtime inputs (a sink's, say) whose gradients are wanted too:
    parts["dinputs"][name], float64. `parts` holds the dense float64 pieces the kernels compute
    and attngen/tolerance.py bounds their errors with, grouped by kv head: (B, Hkv, ratio, Sq, Sk)
    for "S" (scale * q.k), "Z" (modified and masked, -inf where hidden), "visible" (bool), "P",
    "dP" (dout . v), "g1" and "g2" (the modifier's first and second derivatives in the score, by
    autograd; None without a modifier), "g1_err" (a bound on the kernels' fp32 evaluation error of
    g1's expression at the exact score: maskc/dense.py evaluation_error) and "dS" = P * (dP - D) * g1 * scale; (B, Hkv, ratio, Sq)
    for "lse" (float64, sink included), "D" (rowsum(dout * out) - dlse), "sinks" and "psink"
    (exp(sink - lse); None without a sink); "out" (B, Hkv, ratio, Sq, D); "jacobian"[name]: d
    sinks / d inputs[name], (B, Hkv, ratio, Sq, *shape); and "scale", "ratio". The dense pieces
    agree with the autograd gradients (tests/test_tolerance_grads.py): dv = P^T dout, dk = dS^T q,
    dq = dS k summed over each GQA group. With dropout (`dropout_p`, `dropout_seed`,
    `dropout_offset` as attention's), "W" holds the weights on P (0 dropped, 1 / (1 - p) kept;
    None without), "keep_scale" that 1 / (1 - p) (1.0 without), "dP" is W * (dout . v) and
    dv = (P W)^T dout; P, lse and dS are as above."""
    from attngen import dropout

    f64 = torch.float64
    ratio = _check_inputs(q, k, v, gqa_ratio, f64)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"dout has shape {tuple(getattr(dout, 'shape', ()))}; allowed: q's shape {tuple(q.shape)}")
    if dlse is not None and tuple(dlse.shape) != (B, Hq, Sq):
        raise ValueError(f"dlse has shape {tuple(dlse.shape)}; allowed: (batch, heads_q, seq_q) = {(B, Hq, Sq)}")
    inputs = dict(inputs or {})
    for name in grad_inputs:
        if name not in inputs or not torch.is_floating_point(torch.as_tensor(inputs[name])):
            raise ValueError(f"grad_inputs names {name!r}; allowed: a float tensor of inputs ({sorted(inputs)})")
    lowering = get_mask(mask)
    modifier = None if score_mod is None else get_score_mod(score_mod)
    scale = _check_scale(softmax_scale, D)

    q64, k64, v64 = (t.detach().to(f64).requires_grad_() for t in (q, k, v))
    leaves = {name: inputs[name].detach().to(f64).requires_grad_() for name in grad_inputs}
    inputs64 = {**inputs, **leaves}
    dout64 = dout.detach().to(device=q.device, dtype=f64)
    dlse64 = None if dlse is None else dlse.detach().to(device=q.device, dtype=f64)
    with torch.enable_grad():
        out, lse = attention(q64, k64, v64, mask=mask, softmax_scale=scale, gqa_ratio=ratio, return_lse=True,
                             compute_dtype=f64, score_mod=score_mod, inputs=inputs64, sink=sink,
                             batch_offset=batch_offset, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             dropout_offset=dropout_offset)
        loss = (out * dout64).sum()
        if dlse64 is not None:  # a row with lse -inf depends on nothing: gradient 0, not NaN
            loss = loss + (torch.where(lse == -math.inf, 0.0, lse.to(f64)) * dlse64).sum()
        wrt = [q64, k64, v64, *leaves.values()]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads)]

    with torch.no_grad():
        plain = {name: t.detach() if isinstance(t, torch.Tensor) else t for name, t in inputs64.items()}
        drop = _dropout_weights(dropout_p, dropout_seed, dropout_offset, q, k, ratio, batch_offset, f64)
        dense = _grouped(q64.detach(), k64.detach(), v64.detach(), lowering, modifier, sink, scale, ratio, plain,
                         batch_offset, f64, drop)
        P, og, vg = dense.probs, dense.out, dense.vg
        dog = dout64.permute(0, 2, 1, 3).reshape(B, Hkv, ratio, Sq, D)
        dP = torch.einsum("bgrqd,bgkd->bgrqk", dog, vg)
        if drop is not None:
            dP = dP * drop
        delta = (dog * og).sum(-1)
        if dlse64 is not None:
            delta = delta - dlse64.reshape(B, Hkv, ratio, Sq)
        g1 = g2 = g1_err = None
        if modifier is not None:
            g1, g2 = _modifier_derivatives(modifier, dense, Sq, Sk, plain)
            q_idx, kv_idx, b, h = dense.index
            g1_err = torch.broadcast_to(modifier.program.derivative().dense_error(
                dense.raw.detach(), q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=plain), g1.shape)
        dS = P * (dP - delta[..., None]) * (1.0 if g1 is None else g1) * scale
        psink = None
        if dense.sinks is not None:
            psink = torch.where(dense.lse == -math.inf, 0.0, torch.exp(dense.sinks - dense.lse))
    jacobian, dmod = {}, {}
    for name, leaf in leaves.items():
        if _read_at_h_by_modifier(name, score_mod, sink):
            dmod[name] = _modifier_input_derivative(modifier, name, dense, Sq, Sk, plain, P.shape)
        else:
            jacobian[name] = _sink_jacobian(sink, leaf.detach(), name, plain, dense, Sq, Sk)
    parts = {
        "scale": scale, "ratio": ratio, "S": dense.raw, "Z": dense.scores, "visible": dense.visible, "P": P,
        "dP": dP, "g1": g1, "g2": g2, "g1_err": g1_err, "dS": dS, "lse": dense.lse, "D": delta, "sinks": dense.sinks,
        "psink": psink, "out": og, "jacobian": jacobian, "dmod": dmod, "dinputs": dict(zip(leaves, grads[3:])),
        "W": drop,
        "keep_scale": dropout.keep_scale(dropout_p),
    }
    return grads[0], grads[1], grads[2], parts


def _modifier_derivatives(modifier, dense, Sq: int, Sk: int, inputs):
    """d Z / d S and d^2 Z / d S^2 of an elementwise score modifier, by float64 autograd, dense."""
    q_idx, kv_idx, b, h = dense.index
    with torch.enable_grad():
        s = dense.raw.detach().requires_grad_()
        z = torch.broadcast_to(modifier.dense(s, q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs), s.shape)
        (g1,) = torch.autograd.grad(z.sum(), s, create_graph=True, allow_unused=True)
        if g1 is None:  # a modifier that ignores the score
            return torch.zeros_like(s), torch.zeros_like(s)
        g2 = None
        if g1.requires_grad:
            (g2,) = torch.autograd.grad(g1.sum(), s, allow_unused=True)
    g1 = torch.broadcast_to(g1.detach(), s.shape)
    return g1, torch.zeros_like(s) if g2 is None else g2.detach()


def _read_at_h_by_modifier(name: str, score_mod, sink) -> bool:
    """Whether inputs[name] is one the backward kernels differentiate (bwd_shared.learnable_inputs)."""
    from attngen.families.bwd_shared import modifier_learnable_inputs

    return name in modifier_learnable_inputs(score_mod, sink)


def _modifier_input_derivative(modifier, name, dense, Sq: int, Sk: int, inputs, shape):
    """d Z / d inputs[name][h] per element, (B, Hkv, ratio, Sq, Sk) float64: the symbolic derivative
    (attngen/maskc/diff.py) evaluated densely; for the error bounds only (the reference's gradient of
    the input itself comes from autograd)."""
    q_idx, kv_idx, b, h = dense.index
    program = modifier.program.input_derivative(name)  # a ScoreModProgram: its own dense evaluation
    return torch.broadcast_to(program.dense(dense.raw, q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs), shape)


def _sink_jacobian(sink, x, name, inputs, dense, Sq: int, Sk: int):
    """d sinks / d inputs[name]: (B, Hkv, ratio, Sq, *x.shape), float64 (forward-mode, one pass
    per element of the input)."""
    q_idx, _, b, h = dense.index
    program = get_score_mod(sink)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    shape = dense.lse.shape

    def sinks(value):
        logits = program.dense(zero, q_idx[:, 0], 0, Sq, Sk, b=b[..., 0], h=h[..., 0], inputs={**inputs, name: value})
        return torch.broadcast_to(logits, shape)

    return torch.autograd.functional.jacobian(sinks, x, vectorize=True, strategy="forward-mode")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, mask: str = "none", score_mod: str | None = None,
                     sink: str | None = None, inputs: dict | None = None, softmax_scale: float | None = None,
                     compute_dtype: torch.dtype = torch.float64):
    """attngen.attention_varlen one sequence at a time: attention() of each sequence's rows and keys as
    a batch of 1, the mask, modifier and sink in that sequence's own positions; (out (total_q,
    heads_q, head_dim), lse (heads_q, total_q)). Runtime inputs must not depend on the position
    (per-head ones such as slope[h] or sinks[h]). Rows of a sequence without keys, and rows outside
    every sequence (before cu_seqlens_q[0], from cu_seqlens_q[-1] on: a run of rows without keys),
    give 0 and -inf (the sink's logit, with a sink)."""
    total_q, Hq, D = q.shape
    out = torch.zeros(total_q, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.full((Hq, total_q), -math.inf, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    # Each sequence, then the rows outside every one (before cu_seqlens_q[0], from cu_seqlens_q[-1] on)
    # as sequences without keys.
    head, tail = min(max(cq[0], 0), total_q), min(max(cq[-1], 0), total_q)
    segments = [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)] + [(0, head, 0, 0),
                                                                                     (tail, total_q, 0, 0)]
    for q0, q1, k0, k1 in segments:
        if q1 <= q0:
            continue
        if k1 == k0:  # no key: one stand-in key that nothing sees, so the sink (if any) sets the LSE
            keys = keys_v = k.new_zeros((1, *k.shape[1:]))
            seq_mask = "kv_idx < 0"
        else:
            keys, keys_v, seq_mask = k[k0:k1], v[k0:k1], mask
        o, l_ = attention(q[None, q0:q1], keys[None], keys_v[None], mask=seq_mask, score_mod=score_mod, sink=sink,
                          inputs=inputs, softmax_scale=softmax_scale, return_lse=True, compute_dtype=compute_dtype)
        out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
    return out, lse


def gather_cache(cache: torch.Tensor, page_table: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    """(1, length, Hkv, D): the first `length` cached tokens of sequence `batch`, from a paged cache
    (num_pages, page_size, Hkv, D) through its page table row, or from a contiguous one."""
    if page_table is None:
        return cache[batch:batch + 1, :length]
    page_size = cache.shape[1]
    pages = page_table[batch, :math.ceil(length / page_size)].long()
    return cache[pages].reshape(1, -1, *cache.shape[2:])[:, :length]


def decode_attention(q, k_cache, v_cache, cache_seqlens, spec, *, page_table=None, softmax_scale=None,
                     inputs=None, compute_dtype=torch.float64):
    """(out, lse) of attngen.decode: each sequence's new tokens q[b] (seq_q of them) attend to the
    first cache_seqlens[b] tokens of its cache with the spec's mask, modifier and sink, q_len =
    seq_q and kv_len = cache_seqlens[b] (so causal is bottom-right aligned). A sequence with an
    empty cache gives out 0 and lse -inf (or its sink)."""
    problem = getattr(spec, "problem", spec)
    B, Sq, Hq, D = q.shape
    outs, lses = [], []
    for b in range(B):
        length = int(cache_seqlens[b])
        k = gather_cache(k_cache, page_table, b, length)
        v = gather_cache(v_cache, page_table, b, length)
        out, lse = attention(q[b:b + 1], k, v, mask=problem.mask, softmax_scale=softmax_scale or problem.scale,
                             gqa_ratio=problem.gqa_ratio, return_lse=True, compute_dtype=compute_dtype,
                             score_mod=problem.score_mod, inputs=inputs, sink=problem.sink, batch_offset=b)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# -- validation ---------------------------------------------------------------
def _names(dtypes) -> str:
    return "{" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + "}"


def _check_inputs(q, k, v, gqa_ratio, compute_dtype) -> int:
    """Validate shapes, dtypes and devices; return the GQA ratio."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} is a {type(t).__name__}; allowed: a torch.Tensor")
        if t.ndim != 4:
            raise ValueError(f"{name}.ndim={t.ndim} (shape {tuple(t.shape)}) is invalid; allowed: 4 (B, S, H, D)")
        if t.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} is invalid; allowed: {_names(INPUT_DTYPES)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={t.dtype} differs from q.dtype; allowed: {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}.device={t.device} differs from q.device; allowed: {q.device}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k.shape[0]={k.shape[0]} (batch) differs from q.shape[0]; allowed: {q.shape[0]}")
    if q.shape[-1] < 1:
        raise ValueError(f"q.shape[-1]={q.shape[-1]} (head dim) is invalid; allowed: >= 1")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k.shape[-1]={k.shape[-1]} (head dim) differs from q.shape[-1]; allowed: {q.shape[-1]}")
    if v.shape != k.shape:
        raise ValueError(f"v.shape={tuple(v.shape)} differs from k.shape; allowed: {tuple(k.shape)}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype} is invalid; allowed: {_names(COMPUTE_DTYPES)}")
    return _check_ratio(q.shape[2], k.shape[2], gqa_ratio)


def _check_ratio(hq: int, hkv: int, gqa_ratio) -> int:
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q.shape[2]={hq} (query heads) is not a multiple of k.shape[2]={hkv} (kv heads); "
            "allowed: Hq = gqa_ratio * Hkv with Hkv >= 1"
        )
    if gqa_ratio is None:
        return hq // hkv
    if isinstance(gqa_ratio, bool) or not isinstance(gqa_ratio, int) or gqa_ratio * hkv != hq:
        raise ValueError(
            f"gqa_ratio={gqa_ratio!r} does not match q heads {hq} / k heads {hkv}; allowed: {hq // hkv} or None"
        )
    return gqa_ratio


def _check_dropout(dropout_p) -> float:
    """dropout_p, when the kernels can realise it (attngen/dropout.py); ValueError naming it otherwise."""
    from attngen import dropout

    reason = dropout.problem(dropout_p)
    if reason is not None:
        raise ValueError(reason)
    return dropout_p


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    ok = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if not ok or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale={softmax_scale!r} is invalid; allowed: a finite float, or None for 1/sqrt(D)")
    return float(softmax_scale)
