"""The front door: `attngen.attention`, a torch custom op with a fake implementation.

On torch tensors, `attention` calls the op `torch.ops.attngen.forward(q, k, v, spec_key,
softmax_scale, input_names, inputs)` (the last two: the runtime inputs, by name). Its fake
(meta) implementation gives the outputs' shapes and dtypes and checks the inputs, so
`torch.compile(fullgraph=True)` traces it without a graph break; the real one resolves the call
to a loaded kernel (attngen/runtime/dispatch.py, memoized per shape bucket) and launches it on
the current stream, which CUDA graphs capture. Eager calls on plain tensors
skip the dispatcher's op machinery and run the same implementation directly (EAGER_DIRECT),
which saves its per-call overhead. CuPy arrays take the runtime directly.

With dropout (docs/dropout.md), both ops take one more tensor, `rng`: the call's int64 [seed,
offset], drawn on the GPU from torch's generator (or made from an int seed), which the autograd
formula saves so the backward regenerates the forward's mask.

Gradients: the forward op has an autograd formula (register_autograd) that calls a second op,
`torch.ops.attngen.backward(dout, q, k, v, out, lse, dlse, spec_key, softmax_scale, input_names,
inputs)` -> (dq, dk, dv), run by a backward family (attngen/runtime/backward.py,
attngen/families/bwd_sm80/; docs/backward.md). A call that needs gradients always takes the op, so
autograd records it. Runtime inputs get gradients only where the sink alone reads them, computed
in torch from the sink's expression.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import sys

from attngen import masks, score_mods
from attngen.errors import type_article
from attngen.runtime.tensors import torch_stream
from attngen.spec import HEAD_DIMS, MAX_GQA_RATIO, AttentionSpec

OP = "attngen::forward"
SCHEMA = ("(Tensor q, Tensor k, Tensor v, str spec_key, float? softmax_scale, str[]? input_names=None, "
          "Tensor[]? inputs=None, Tensor? rng=None) -> (Tensor, Tensor)")
BACKWARD_OP = "attngen::backward"
BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, str spec_key, "
                   "float? softmax_scale, str[]? input_names=None, Tensor[]? inputs=None, Tensor? rng=None) -> "
                   "(Tensor, Tensor, Tensor, Tensor)")
# Eager calls on plain tensors, with autograd not needed, run the op's implementation directly.
EAGER_DIRECT = True
_SPEC_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


def attention(q, k, v, spec: AttentionSpec | None = None, *, mask: str | None = None, score_mod: str | None = None,
              sink: str | None = None, inputs: dict | None = None, softmax_scale: float | None = None,
              return_lse: bool = False, dropout_p: float = 0.0, dropout_seed=None, deterministic: bool | None = None,
              block_mask=None):
    """Attention forward, softmax(score_mod(scale * q k^T) + mask) v, in one fused kernel.

    Args:
        q: (batch, seq_q, heads_q, head_dim) torch CUDA tensor (or CuPy array), fp16 or bf16.
        k, v: (batch, seq_k, heads_kv, head_dim), the dtype and device of q. heads_q must be a
            multiple of heads_kv (grouped-query attention): query head h reads kv head
            h // (heads_q // heads_kv).
            Only the last dimension must be contiguous, and rows 16-byte aligned: a
            (batch, heads, seq, head_dim) tensor passed as `.transpose(1, 2)` needs no copy.
        spec: an AttentionSpec pinning everything (head dim, dtype, GQA ratio, mask, scale, and
            optionally the kernel family and its config). Without one, head dim, dtype and GQA
            ratio are taken from the tensors and the mask from `mask`.
        mask: "none" (default), "causal" (bottom-right aligned when seq_q != seq_k: query i
            sees keys j <= i + seq_k - seq_q), another built-in such as "sliding_window(256, 0)"
            or "chunked(512)", or an expression over b, h, q_idx, kv_idx, q_len, kv_len such as
            "kv_idx <= q_idx and q_idx - kv_idx < 4096" (docs/masks.md). Compiled into the kernel:
            key blocks it hides are skipped. With a spec, it must agree with the spec's mask.
        score_mod: None (default), or an expression over score (softmax_scale * q.k) and b, h,
            q_idx, kv_idx, q_len, kv_len giving the score the softmax sees, applied before the
            mask: "softcap(30.0)" (Gemma 2: 30 * tanh(score / 30)), "score - 0.25 * abs(q_idx -
            kv_idx)" (docs/masks.md). With a spec, it must agree with the spec's score_mod.
        softmax_scale: the scale of q k^T; default the spec's, else 1 / sqrt(head_dim).
        sink: None (default), or an expression over b, h, q_idx, q_len, kv_len (and runtime
            inputs) giving a logit per row that joins the softmax's denominator only: learned
            attention sinks as in gpt-oss, sink="sinks[h]" with inputs={"sinks": (heads_q,)
            float32}. A row that sees no key then has output 0 and LSE = its sink.
        inputs: the runtime inputs the mask and score modifier read, by name: int32 tensors for a
            mask (e.g. mask="doc[b, q_idx] == doc[b, kv_idx] and causal" with inputs={"doc": ids},
            ids of shape (batch, seq) for packed documents), float32 for a score modifier (e.g.
            score_mod="alibi" with inputs={"slope": slopes of shape (heads_q,)}), int32 for one a
            score modifier reads as int(name) (a mask's offsets, shared: docs/masks.md). Every index the
            expression computes over the call must lie inside the tensor: checked before launch.
        return_lse: also return the log-sum-exp of each row's scaled (and modified) scores.
        dropout_p: dropout of the attention probabilities (training), fused into the kernels: 0
            (default) or a float in (1/512, 511/512], realised as the nearest multiple of 1/256
            (docs/dropout.md). Kept probabilities are scaled by 1 / (1 - p); the row sums and the
            LSE are those of the undropped probabilities. With a spec, the spec's dropout_p applies,
            and a dropout_p > 0 here must equal it.
        dropout_seed: which elements are dropped: None (default) draws a fresh [seed, offset] on
            the GPU from torch's default CUDA generator (torch.manual_seed reproduces it; a CUDA
            graph draws a new one each replay); an int in [0, 2**64) fixes it (offset 0), the same
            seed giving the same mask; or an int64 tensor [seed, offset] of shape (2,) on q's
            device, read when the kernel runs. Ignored when dropout_p is 0. The element (b, h, i,
            j) is kept by a pure function of (seed, offset, b, h, i, j) (docs/dropout.md), whatever
            the kernel family or tile, so the backward regenerates the forward's mask exactly.
        deterministic: whether the gradients must be bitwise repeatable (the forward always is):
            the backward then adds dQ's parts in a fixed order (docs/backward.md, "Deterministic";
            it runs the bwd_sm80 family). None (default): the spec's `deterministic`, else torch's
            setting (torch.use_deterministic_algorithms). With a spec, True needs the spec's to be
            true, and torch's setting with a spec that is not raises (warns in warn_only mode), as
            torch does for an op without a deterministic implementation.
        block_mask: None (default), or a FlexAttention BlockMask (torch.nn.attention.flex_attention:
            create_block_mask, BlockMask.from_kv_blocks) of int32 tensors on q's device: a key is
            visible where its block is listed full, or listed partial and `mask` holds; unlisted
            blocks are hidden and never loaded (attngen/block_sparse.py, docs/masks.md "Block
            sparsity"). `mask` stands in for the BlockMask's mask_mod, a Python callable attngen
            cannot compile: a BlockMask built with one needs `mask` given (the same mask as an
            expression, or "none").

    Returns:
        out, like q (new, contiguous), in q's dtype; with return_lse, (out, lse) where lse is
        float32 (batch, heads_q, seq_q), natural log. A row that sees no key (causal with
        seq_k < seq_q) gives out 0 and lse -inf.

    The kernel is chosen per GPU and shape bucket: the spec's pinned family and config, the
    configuration `attngen tune` stored for this shape, else the best family's defaults; it is
    compiled on first use and cached on disk. Works under torch.compile(fullgraph=True) and in
    CUDA graph capture; runs on the current CUDA stream.

    Gradients flow to q, k and v (torch autograd, when grad is enabled and one of them requires
    grad) through the backward families (attngen/families/bwd_sm80/, docs/backward.md): dq, dk,
    dv from the output's and the LSE's gradients, the same mask, score modifier and sink, the
    spec's family pinned only when it is a backward family. A runtime input of the sink alone may
    require grad too (learned sinks): its gradient is computed in torch from the sink's
    expression. Inputs the mask or score modifier read cannot (ValueError). CuPy arrays have no
    autograd.

    Raises:
        ValueError (SpecError for spec fields): a bad argument, naming it, its value and what is
        allowed: wrong device, dtype, rank, head dim, head counts, a non-contiguous last
        dimension, misaligned rows, a spec that disagrees with the tensors, a runtime input that
        requires grad but is read by the mask or score modifier, a dropout_p the kernels cannot
        realise, a dropout_seed that is no int in [0, 2**64) or an int64 CUDA tensor of shape (2,).
    """
    check_call_args(return_lse=return_lse, deterministic=deterministic, inputs=inputs, softmax_scale=softmax_scale,
                    q=q, k=k, v=v)
    _check_seed(dropout_seed)
    if block_mask is not None:
        from attngen import block_sparse

        if spec is not None:  # the lowered mask would have to replace the spec's (not done yet)
            raise ValueError("block_mask with a spec is not supported; allowed: spec=None, with the spec's mask (the "
                             "element mask), score_mod and sink passed as arguments")
        mask, inputs = block_sparse.lowered_call(block_mask, mask, inputs, q, k, score_mod, sink)
    if type(q).__module__.startswith("torch"):
        import torch

        # A call that needs gradients takes the op, whose autograd formula records the graph.
        grad = _needs_grad(torch, q, k, v, inputs)
        if EAGER_DIRECT and not grad and type(q) is torch.Tensor and type(k) is torch.Tensor \
                and type(v) is torch.Tensor and not torch.compiler.is_compiling():
            out, lse = _eager(torch, q, k, v, spec, (mask, score_mod, sink), softmax_scale, inputs, dropout_p,
                              dropout_seed)
        else:
            key = _spec_key(q, k, spec, mask, score_mod, sink, dropout_p,
                            _deterministic(torch, deterministic, spec) if grad else False)
            names, tensors = _split_inputs(inputs)
            if grad:  # before the forward runs: the op's autograd formula checks only after it
                _check_grad_inputs(key, names, tensors)
                if q.is_cuda and not torch.compiler.is_compiling():
                    _check_backward_supported(key, q.get_device())
            rng = _rng(torch, q, spec.dropout_p if spec is not None else dropout_p, dropout_seed)
            op = _OP or register()
            out, lse = op(q, k, v, key, softmax_scale, names, tensors) if rng is None else \
                op(q, k, v, key, softmax_scale, names, tensors, rng)
    else:
        from attngen.runtime.dispatch import forward

        key = _spec_key(q, k, spec, mask, score_mod, sink, dropout_p)
        out, lse = forward(q, k, v, _spec_from_key(key), softmax_scale=softmax_scale, inputs=inputs,
                           rng=_cupy_rng(q, spec.dropout_p if spec is not None else dropout_p, dropout_seed))
    return (out, lse) if return_lse else out


def _array_kind(t) -> str | None:
    """"torch" for a torch tensor, "cupy" for a CuPy array, else None."""
    module = type(t).__module__
    for kind in ("torch", "cupy"):
        if (module == kind or module.startswith(kind + ".")) and hasattr(t, "shape"):
            return kind
    return None


def check_call_args(*, return_lse=False, deterministic=None, inputs=None, softmax_scale=None, **arrays) -> None:
    """ValueError naming a front door's argument of the wrong kind, before any of its attributes is
    read: every array a torch tensor or a CuPy array, all of one kind; inputs None or a dict of name
    -> tensor (or array) of that kind; return_lse a bool; deterministic None or a bool; softmax_scale
    None or a number (its range is checked against the spec later; torch's op schema would refuse
    another type with an error of its own)."""
    kinds = {}
    for name, t in arrays.items():
        kind = _array_kind(t)
        if kind is None:
            raise ValueError(f"{name} is {type_article(t)}; allowed: a torch CUDA tensor or a CuPy array")
        kinds[name] = kind
    names = list(kinds)
    other = next((n for n in names if kinds[n] != kinds[names[0]]), None)
    if other is not None:
        raise ValueError(f"{names[0]} is a {kinds[names[0]]} array and {other} a {kinds[other]} one; allowed: all "
                         "of one kind")
    if inputs is not None:
        if not isinstance(inputs, dict):
            raise ValueError(f"inputs is {type_article(inputs)}; allowed: None or a dict of name -> tensor")
        for name, t in inputs.items():
            if not isinstance(name, str):
                raise ValueError(f"inputs has the key {name!r}; allowed: names (str)")
            if _array_kind(t) is None:
                raise ValueError(f"inputs[{name!r}] is {type_article(t)}; allowed: a torch CUDA tensor or a CuPy array "
                                 "(a scalar input is a 0-dim tensor)")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse={return_lse!r} is invalid; allowed: True, False")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"deterministic={deterministic!r} is invalid; allowed: None, True, False")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise ValueError(f"softmax_scale={softmax_scale!r} is invalid; allowed: a float or None")


def _deterministic(torch, deterministic, spec) -> bool:
    """Whether the call's gradients must be deterministic (attention()'s `deterministic`)."""
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"deterministic={deterministic!r} is invalid; allowed: None, True, False")
    if deterministic is not None:
        return deterministic
    if spec is not None and isinstance(spec, AttentionSpec):
        if not spec.deterministic and torch.are_deterministic_algorithms_enabled():
            message = ("attngen.attention's backward with a spec whose deterministic is false adds dQ with "
                       "order-dependent fp32 atomics, and torch.use_deterministic_algorithms(True) is set; "
                       "allowed: a spec with deterministic=True (docs/backward.md, \"Deterministic\")")
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(message)
            import warnings

            warnings.warn(message, stacklevel=3)
        return spec.deterministic
    return torch.are_deterministic_algorithms_enabled()


def _check_seed(seed) -> None:
    """ValueError naming dropout_seed unless it is None, an int in [0, 2**64) or a tensor (checked at launch)."""
    if seed is None or (hasattr(seed, "dtype") and hasattr(seed, "shape")):
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"dropout_seed={seed!r} is invalid; allowed: None (drawn from torch's CUDA generator), an "
                         "int in [0, 2**64), or an int64 tensor [seed, offset] of shape (2,) on q's device")


def _rng(torch, q, p: float, seed):
    """The int64 tensor [seed, offset] the kernels read for dropout p (None without dropout): drawn
    on q's device from torch's default generator, made from an int seed (offset 0), or the caller's
    tensor. Kernel launches only: traceable, and capturable in a CUDA graph."""
    if not p:
        return None
    if seed is None:
        # 62 random bits each; the kernels use the seed's 64 bits and the offset's low 32.
        return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=q.device)
    if isinstance(seed, int):
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        rng[0] = seed - 2**64 if seed >= 2**63 else seed  # the same 64 bits, as int64
        return rng
    return seed


def _cupy_rng(q, p: float, seed):
    """_rng for CuPy arrays: an int seed or the caller's array (CuPy has no torch generator to draw from)."""
    if not p:
        return None
    if seed is None:
        raise ValueError(f"dropout_p={p} on CuPy arrays needs dropout_seed: an int in [0, 2**64) or an int64 array "
                         "[seed, offset] of shape (2,) on q's device")
    if isinstance(seed, int):
        import cupy

        with cupy.cuda.Device(q.device.id):
            return cupy.array([seed - 2**64 if seed >= 2**63 else seed, 0], dtype=cupy.int64)
    return seed


def _needs_grad(torch, q, k, v, inputs) -> bool:
    """Whether autograd must record this call: grad enabled and q, k, v or a runtime input requiring it."""
    if not torch.is_grad_enabled():
        return False
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return True
    # A plain loop: torch 2.11's dynamo could not trace bool() of the inputs dict (a graph break under
    # torch.compile of every call with runtime inputs: document ids, a BlockMask's state grid...).
    for t in _split_inputs(inputs)[1]:
        if getattr(t, "requires_grad", False):
            return True
    return False


def _check_grad_inputs(spec_key: str, input_names, inputs) -> None:
    """ValueError naming a runtime input that requires grad but has no gradient: those the sink alone
    reads get theirs in torch, those the score modifier reads at [h] alone from the backward kernels
    (attngen/families/bwd_shared.py learnable_inputs); a mask's inputs and other modifier inputs none."""
    wanted = [name for name, t in zip(input_names or (), inputs or ()) if t.requires_grad]
    if not wanted:
        return
    sink, learnable = _SINK_INPUTS(spec_key), _LEARNABLE(spec_key)
    for name in wanted:
        if name not in sink and name not in learnable:
            raise ValueError(f"inputs[{name!r}] requires grad, but gradients of runtime inputs are only supported "
                             f"for those the sink alone reads ({list(sink)}) and those the score modifier reads "
                             f"at [h] alone, one value per query head ({list(learnable)}); allowed: detach "
                             f"inputs[{name!r}] or call under torch.no_grad()")


def _check_backward_supported(spec_key: str, device: int) -> None:
    """SpecError now, before the forward runs, when no backward family can run this problem on this GPU
    (head_dim 256, say), rather than inside loss.backward()."""
    from attngen.runtime.backward import device_plan

    device_plan(_spec_from_key(spec_key), device)


def _sink_inputs(spec_key: str) -> tuple[str, ...]:
    """Names of the runtime inputs the spec's sink reads and neither its mask nor its score modifier."""
    problem = _spec_from_key(spec_key).problem
    if problem.sink is None:
        return ()
    others = {name for name, _ in masks.get_mask(problem.mask).program.inputs}
    if problem.score_mod is not None:
        others |= {name for name, _ in score_mods.get_score_mod(problem.score_mod).program.inputs}
    return tuple(sorted({name for name, _ in score_mods.get_score_mod(problem.sink).program.inputs} - others))


_SINK_INPUTS = _sink_inputs  # register() makes it a constant of torch.compile's traces


def _learnable_inputs(spec_key: str) -> tuple[str, ...]:
    """Names of the runtime inputs whose gradients the backward kernels give (bwd_shared.learnable_inputs)."""
    from attngen.families.bwd_shared import learnable_inputs

    return learnable_inputs(_spec_from_key(spec_key).problem)


_LEARNABLE = _learnable_inputs  # as _SINK_INPUTS


def _split_inputs(inputs) -> tuple[list, list]:
    """Names and tensors of the runtime inputs, sorted by name (the op's str[] and Tensor[])."""
    from attngen.runtime_inputs import as_mapping

    inputs = as_mapping(inputs)
    names = sorted(inputs)
    return names, [inputs[name] for name in names]


def _eager(torch, q, k, v, spec, texts, softmax_scale, inputs=None, dropout_p=0.0, dropout_seed=None):
    """The op's implementation for plain tensors, called directly. A layout seen before (same
    arguments, shapes, strides, dtypes, devices; pointers 16-byte aligned) runs its Prepared call
    (attngen/runtime/prepared.py) without repeating the checks: the launch overhead of a tiny call."""
    from attngen.runtime import dispatch

    key = None
    names, tensors = _split_inputs(inputs)
    if all(text is None or type(text) is str for text in texts) \
            and (softmax_scale is None or type(softmax_scale) in (float, int)) and type(dropout_p) in (float, int) \
            and (spec is None or type(spec) is AttentionSpec) and all(type(t) is torch.Tensor for t in tensors) \
            and (dropout_seed is None or type(dropout_seed) is int):
        key = (spec, texts, softmax_scale, dropout_p, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(),
               k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device,
               tuple((name, t.shape, t.stride(), t.dtype, t.device) for name, t in zip(names, tensors)))
        prepared = dispatch.eager_prepared.get(key)
        if prepared is not None and not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16) \
                and prepared.current():
            rng = _rng(torch, q, prepared.kernel.plan.problem.dropout_p, dropout_seed)
            return prepared.run_torch(torch, q, k, v, torch_stream(torch, prepared.device), tensors, rng)
    spec = _spec_from_key(_spec_key(q, k, spec, *texts, dropout_p))
    rng = _rng(torch, q, spec.dropout_p, dropout_seed)
    prepared = dispatch.prepare(q, k, v, spec, softmax_scale, inputs, rng)
    if key is not None:
        dispatch.remember(dispatch.eager_prepared, key, prepared)
    return prepared.run_torch(torch, q, k, v, torch_stream(torch, prepared.device), tensors, rng)


def _spec_key(q, k, spec, mask, score_mod=None, sink=None, dropout_p=0.0, deterministic=False, k_name="k") -> str:
    """The canonical key of the spec a call runs: pure Python over tensor metadata, so torch.compile
    traces it into constants. `deterministic`: the gradients' (attention()'s, resolved); `k_name`:
    what the caller calls k in its messages (decode: k_cache)."""
    from attngen import dropout

    reason = dropout.problem(dropout_p)
    if reason is not None:
        raise ValueError(reason)
    if spec is not None:
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"spec must be an attngen.AttentionSpec or None, got {type(spec).__name__}")
        if deterministic and not spec.deterministic:
            raise ValueError("deterministic=True conflicts with the spec's deterministic=False; allowed: None or "
                             "False, or a spec with deterministic=True")
        if dropout_p and dropout_p != spec.dropout_p:
            raise ValueError(f"dropout_p={dropout_p!r} conflicts with the spec's dropout_p={spec.dropout_p!r}; "
                             "allowed: 0 (the spec's applies) or the spec's value")
        if mask is not None and _known_texts("mask", mask)[0] != spec.mask:
            raise ValueError(f"mask={mask!r} conflicts with the spec's mask={spec.mask!r}; allowed: None or the "
                             "spec's mask")
        for name, text in (("score_mod", score_mod), ("sink", sink)):
            if text is not None and _known_texts(name, text)[0] != getattr(spec, name):
                raise ValueError(f"{name}={text!r} conflicts with the spec's {name}={getattr(spec, name)!r}; "
                                 f"allowed: None or the spec's {name}")
        return spec.key()
    mask_json = _known_texts("mask", "none" if mask is None else mask)[1]  # ValueError naming mask=, what is allowed
    # The score modifier's field, when it changes scores (its JSON includes the leading comma).
    score_json = "" if score_mod is None else _known_texts("score_mod", score_mod)[1]
    sink_json = "" if sink is None else _known_texts("sink", sink)[1]
    for name, t in (("q", q), (k_name, k)):
        if len(t.shape) != 4:
            dims = "(batch, seq, heads, head_dim)" if name in ("q", "k") else \
                "(num_pages, page_size, heads_kv, head_dim) or (batch, capacity, heads_kv, head_dim)"
            raise ValueError(f"{name} must have 4 dims {dims}, got shape {tuple(t.shape)}")
    head_dim = q.shape[3]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q has head_dim {head_dim} (shape {tuple(q.shape)}); allowed: {HEAD_DIMS}")
    dtype = _SPEC_DTYPES.get(str(q.dtype).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"q has dtype {str(q.dtype).removeprefix('torch.')}; allowed: float16, bfloat16")
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_kv < 1 or heads_q % heads_kv or not 1 <= heads_q // heads_kv <= MAX_GQA_RATIO:
        raise ValueError(f"q has {heads_q} heads and {k_name} has {heads_kv}; allowed: heads_kv >= 1 and heads_q a multiple "
                         f"of it, 1 to {MAX_GQA_RATIO} times")
    # AttentionSpec.key()'s canonical JSON, spelled out (fields sorted, no spaces; deterministic and
    # dropout_p sort first). repr is json.dumps's spelling of a finite float, and dynamo traces it
    # (not the json encoder).
    deterministic_json = '"deterministic":true,' if deterministic else ""
    dropout_json = f'"dropout_p":{float(dropout_p)!r},' if dropout_p else ""
    return (f'{{{deterministic_json}{dropout_json}"dtype":"{dtype}","gqa_ratio":{heads_q // heads_kv},"head_dim":{head_dim},'
            f'"mask":{mask_json}{score_json}{sink_json}}}')


def _known_texts(kind: str, text) -> tuple[str | None, str]:
    """(canonical text, its spec-key JSON) of a mask or score modifier (kind "mask" or
    "score_mod"). Parsing an expression is nothing for torch.compile to trace: texts seen before
    (and none, causal) come from a dict that dynamo reads as constants; others go through
    _TEXTS, which register() marks to run once at trace time (the dict grows only eagerly)."""
    # isinstance, not type() is: dynamo failed on type() of a str a marked function returned (block_sparse).
    texts = _TEXT_CACHE.get((kind, text)) if isinstance(text, str) else None
    if texts is None:
        texts = _TEXTS(kind, text)
        torch = sys.modules.get("torch")
        if len(_TEXT_CACHE) < MAX_CACHED_TEXTS and not (torch is not None and torch.compiler.is_compiling()):
            _TEXT_CACHE[kind, text] = texts
    return texts


def _texts(kind: str, text) -> tuple[str | None, str]:
    # ValueError naming mask= / score_mod= and what is allowed.
    if kind == "mask":
        canonical = masks.canonical(text)
        return canonical, json.dumps(canonical)
    canonical = score_mods.canonical(text) if kind == "score_mod" else score_mods.canonical_sink(text)
    return canonical, "" if canonical is None else f',"{kind}":{json.dumps(canonical)}'


_TEXT_CACHE: dict[tuple[str, str], tuple] = {("mask", "none"): ("none", '"none"'),
                                             ("mask", "causal"): ("causal", '"causal"')}
MAX_CACHED_TEXTS = 1024
_TEXTS = _texts


@functools.lru_cache(maxsize=4096)
def _spec_from_key(key: str) -> AttentionSpec:
    return AttentionSpec.from_key(key)


def _forward_impl(q, k, v, spec_key: str, softmax_scale: float | None, input_names=None, inputs=None, rng=None):
    from attngen.runtime.dispatch import forward

    return forward(q, k, v, _spec_from_key(spec_key), softmax_scale=softmax_scale,
                   inputs=dict(zip(input_names or (), inputs or ())) or None, rng=rng)


def _forward_fake(q, k, v, spec_key: str, softmax_scale: float | None, input_names=None, inputs=None, rng=None):
    """Shapes and dtypes of the outputs, after the checks that need no data."""
    from attngen.runtime import checks
    from attngen.runtime.tensors import TensorInfo

    spec = _spec_from_key(spec_key)
    infos = [TensorInfo(name, "torch", 0, tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                        t.get_device()) for name, t in (("q", q), ("k", k), ("v", v))]
    for t, info in zip((q, k, v), infos):
        if not t.is_cuda:
            raise ValueError(f"{info.name} must be a CUDA tensor, got device {t.device}")
    checks.check_inputs(spec.problem, *infos)
    checks.check_scale(softmax_scale, spec.problem)
    B, Sq, Hq, D = q.shape
    given = {name: TensorInfo(f"inputs[{name!r}]", "torch", 0, tuple(t.shape), tuple(t.stride()),
                              str(t.dtype).removeprefix("torch."), t.get_device())
             for name, t in zip(input_names or (), inputs or ())}
    out_info = TensorInfo("out", "torch", 0, (B, Sq, Hq, D), (Sq * Hq * D, Hq * D, D, 1), infos[0].dtype, infos[0].device)
    lse_info = TensorInfo("lse", "torch", 0, (B, Hq, Sq), (Hq * Sq, Sq, 1), "float32", infos[0].device)
    rng_info = None if rng is None else _meta_info("rng", rng)
    checks.forward_call(spec.problem, *infos, out_info, lse_info, softmax_scale, given, rng_info)  # inputs, rng too
    return q.new_empty((B, Sq, Hq, D)), q.new_empty((B, Hq, Sq), dtype=_torch().float32)


def _meta_info(name: str, t):
    """The TensorInfo the checks read of a (possibly fake) torch tensor: no data pointer (0)."""
    from attngen.runtime.tensors import TensorInfo

    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    return TensorInfo(name, "torch", 0, tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                      t.get_device())


def _backward_impl(dout, q, k, v, out, lse, dlse, spec_key: str, softmax_scale: float | None, input_names=None,
                   inputs=None, rng=None):
    from attngen.runtime.backward import backward_torch

    return backward_torch(_torch(), dout, q, k, v, out, lse, dlse, _spec_from_key(spec_key), softmax_scale,
                          list(input_names or ()), list(inputs or ()), rng)


def _backward_fake(dout, q, k, v, out, lse, dlse, spec_key: str, softmax_scale: float | None, input_names=None,
                   inputs=None, rng=None):
    """Shapes and dtypes of dq (q's), dk and dv (k's) and the learnable inputs' per-head gradients
    ((learnable inputs, Hq) float32), after the checks that need no data."""
    from attngen.runtime import backward as runtime

    spec = _spec_from_key(spec_key)
    qi, ki, vi, oi, li, di = (_meta_info(name, t) for name, t in
                              (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", dout)))
    dli = None if dlse is None else _meta_info("dlse", dlse)
    runtime.check_backward_inputs(spec.problem, qi, ki, vi, oi, li, di, dli)
    grads = [runtime.contiguous_info(name, ref.shape, ref.dtype, ref)
             for name, ref in (("dq", qi), ("dk", ki), ("dv", ki))]
    given = {name: _meta_info(f"inputs[{name!r}]", t) for name, t in zip(input_names or (), inputs or ())}
    rng_info = None if rng is None else _meta_info("rng", rng)
    runtime.backward_call(spec.problem, qi, ki, vi, oi, li, di, dli, *grads, softmax_scale, given, rng_info)
    from attngen.families.bwd_shared import learnable_inputs

    head_sums = q.new_empty((len(learnable_inputs(spec.problem)), q.shape[2]), dtype=_torch().float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape), head_sums


def _setup_context(ctx, inputs, output) -> None:
    """Saves what the backward reads: q, k, v, the outputs, the runtime inputs, dropout's [seed, offset]
    and the call's arguments."""
    q, k, v, spec_key, softmax_scale, input_names, tensors, *rest = inputs
    rng = rest[0] if rest else None
    _check_grad_inputs(spec_key, input_names, tensors)  # callers of the op itself, too
    out, lse = output
    ctx.set_materialize_grads(False)  # an output the loss ignores gets None, not a tensor of zeros
    ctx.save_for_backward(q, k, v, out, lse, *(tensors or ()), *(() if rng is None else (rng,)))
    ctx.has_rng = rng is not None
    ctx.spec_key, ctx.softmax_scale = spec_key, softmax_scale
    ctx.input_names = list(input_names or ())
    ctx.has_inputs = tensors is not None  # the gradient of `inputs` mirrors its structure


def _backward(ctx, grad_out, grad_lse):
    """The forward op's autograd formula: dq, dk, dv by torch.ops.attngen.backward, the sink's inputs'
    gradients in torch; None for the arguments that are not tensors."""
    torch = _torch()
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    rng = tensors.pop() if ctx.has_rng else None  # the forward's [seed, offset]: the same mask
    # One entry per argument the call passed (the dispatcher drops trailing defaults): q, k, v,
    # spec_key, softmax_scale, then input_names and inputs (a list of bools) and rng when passed.
    needs = ctx.needs_input_grad
    dq = dk = dv = input_grads = head_sums = None
    if grad_out is not None or grad_lse is not None:
        dout = torch.zeros_like(out) if grad_out is None else _rows_aligned(grad_out)
        dlse = None if grad_lse is None else grad_lse.contiguous()
        learnable = _LEARNABLE(ctx.spec_key)
        kernels_wanted = any(needs[:3]) or (ctx.has_inputs and any(
            need and name in learnable for name, need in zip(ctx.input_names, needs[6])))
        if kernels_wanted:
            dq, dk, dv, head_sums = torch.ops.attngen.backward(
                dout, q, k, v, out, lse, dlse, ctx.spec_key, ctx.softmax_scale, ctx.input_names,
                tensors if ctx.has_inputs else None, *(() if rng is None else (rng,)))
            if not any(needs[:3]):
                dq = dk = dv = None
        input_grads = _input_grads(torch, ctx, needs, tensors, out, lse, dout, dlse, k.shape[1], head_sums)
    elif ctx.has_inputs:
        input_grads = [None] * len(tensors)
    # torch (2.11) checks the formula's output against the inputs' structure: an empty input_names
    # list needs [], a non-empty one None.
    names_grad = [] if not ctx.input_names else None
    return (dq, dk, dv, None, None, names_grad, input_grads, None)[:len(needs)]


def _input_grads(torch, ctx, needs, tensors, out, lse, dout, dlse, seq_k, head_sums):
    """The gradients of the `inputs` list (None for those not wanted), or None when none was passed: the
    sink's inputs' in torch, the learnable inputs' from the kernels' per-head sums."""
    if not ctx.has_inputs:
        return None
    wanted = [name for name, need in zip(ctx.input_names, needs[6]) if need]
    if not wanted:
        return [None] * len(tensors)
    learnable = _LEARNABLE(ctx.spec_key)
    by_name = dict(zip(ctx.input_names, tensors))
    grads = {}
    from_sink = [name for name in wanted if name not in learnable]
    if from_sink:
        sink = _spec_from_key(ctx.spec_key).problem.sink
        grads = sink_grads(torch, sink, out, lse, dout, dlse, seq_k, by_name, from_sink)
    for i, name in enumerate(learnable):
        if name in wanted:  # read at [h] alone: entries past the query heads get no gradient
            t = by_name[name]
            heads = head_sums.shape[1]
            grad = head_sums[i].to(t.dtype)
            grads[name] = grad if t.shape[0] == heads else \
                torch.cat([grad, torch.zeros(t.shape[0] - heads, dtype=t.dtype, device=t.device)])
    return [grads.get(name) for name in ctx.input_names]


def _rows_aligned(t):
    """`t`, or a contiguous copy where the kernels could not read its rows (the expanded gradient of
    a sum has stride 0; a view may start mid-chunk). Strides and offsets only: traceable."""
    # A dim of size 1 never moves the address, whatever its stride (the kernels' checks agree).
    if t.stride(-1) == 1 and all(s % 8 == 0 or n == 1 for n, s in zip(t.shape[:-1], t.stride()[:-1])) \
            and t.storage_offset() % 8 == 0:
        return t
    return t.contiguous()


def sink_grads(torch, sink: str, out, lse, dout, dlse, seq_k: int, inputs: dict, wanted: list) -> dict:
    """d loss / d input for the runtime inputs `wanted` (those only the sink reads), by name.

    A row's sink logit s joins only the softmax's denominator, so with D = rowsum(dout * out) - dlse
    (the backward kernels' D), d loss / d s = -exp(s - lse) * D: 0 in a row with lse = -inf (its
    sink is -inf too). The logits are the sink's expression evaluated densely, as the reference
    does, with autograd on, and the row gradients flow back through it to the inputs."""
    from attngen.score_mods import get_score_mod

    B, Sq, Hq, _ = out.shape
    dtype = torch.promote_types(lse.dtype, torch.float32)
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2)  # (B, Hq, Sq), like lse
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    device = lse.device
    with torch.enable_grad():
        leaves = {name: t.detach().requires_grad_(name in wanted) for name, t in inputs.items()}
        zero = torch.zeros((), dtype=dtype, device=device)
        b = torch.arange(B, device=device)[:, None, None]
        h = torch.arange(Hq, device=device)[None, :, None]
        q_idx = torch.arange(Sq, device=device)
        logits = get_score_mod(sink).dense(zero, q_idx, 0, Sq, seq_k, b=b, h=h, inputs=leaves)
        logits = torch.broadcast_to(logits, lse.shape)
        # Subtracting a -inf LSE gives NaN; such a row's sink has weight 0.
        weight = torch.where(lse == -float("inf"), 0.0, torch.exp(logits.detach() - lse.to(dtype)))
        grads = torch.autograd.grad(logits, [leaves[name] for name in wanted], grad_outputs=-weight * delta,
                                    allow_unused=True)
    return {name: torch.zeros_like(inputs[name]) if g is None else g.to(inputs[name].dtype)
            for name, g in zip(wanted, grads)}


def _torch():
    import torch

    return torch


_OP = None


def register():
    """Register torch.ops.attngen.forward (with its autograd formula) and attngen.backward, once;
    returns the forward op. Done when torch is imported, before or after attngen (importing attngen
    needs no torch)."""
    global _OP, _TEXTS, _SINK_INPUTS, _LEARNABLE
    if _OP is not None:
        return _OP
    torch = _torch()
    _TEXTS = torch.compiler.assume_constant_result(_texts)
    _SINK_INPUTS = torch.compiler.assume_constant_result(_sink_inputs)
    _LEARNABLE = torch.compiler.assume_constant_result(_learnable_inputs)
    from attngen import block_sparse, varlen

    varlen.mark_constant_at_trace_time(torch)
    block_sparse.mark_constant_at_trace_time(torch)

    @torch.library.custom_op(OP, mutates_args=(), schema=SCHEMA)
    def forward(q, k, v, spec_key, softmax_scale, input_names=None, inputs=None, rng=None):
        # rng only with dropout: the call is then exactly the one before dropout existed.
        return _forward_impl(q, k, v, spec_key, softmax_scale, input_names, inputs, *(() if rng is None else (rng,)))

    forward.register_fake(_forward_fake)

    @torch.library.custom_op(BACKWARD_OP, mutates_args=(), schema=BACKWARD_SCHEMA)
    def backward(dout, q, k, v, out, lse, dlse, spec_key, softmax_scale, input_names=None, inputs=None, rng=None):
        return _backward_impl(dout, q, k, v, out, lse, dlse, spec_key, softmax_scale, input_names, inputs,
                              *(() if rng is None else (rng,)))

    backward.register_fake(_backward_fake)
    forward.register_autograd(_backward, setup_context=_setup_context)
    from attngen.decoding import register_op

    register_op(torch)
    _OP = torch.ops.attngen.forward
    return _OP


class _RegisterWhenTorchLoads(importlib.abc.MetaPathFinder):
    """Registers the op as soon as `import torch` finishes, when attngen was imported first (as
    sorted imports do). Registering later, on the first call, would happen inside dynamo's trace
    when that call is compiled: custom_op is not traceable, so fullgraph=True would fail.
    It stays on sys.meta_path until torch has actually run (a `find_spec("torch")` probe, as
    libraries make to see whether torch is installed, uses nothing up), and leaves torch's own
    loader untouched: the spec it returns carries a proxy of it."""

    registers_attngen_op = True  # recognised across reloads of this module

    def __init__(self):
        self._looking = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._looking:
            return None
        self._looking = True  # the lookup below asks every finder, this one included
        try:
            spec = importlib.util.find_spec(name)
        except Exception:  # noqa: BLE001 - let the import itself fail as it would without attngen
            return None
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, self)
        return spec


class _RegisteringLoader:
    """torch's loader, which registers the op once torch's module has run."""

    def __init__(self, inner, finder: _RegisterWhenTorchLoads):
        self._inner = inner
        self._finder = finder

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        try:
            register()
        except Exception:  # noqa: BLE001, S110 - an unusable torch must not break `import torch`;
            pass  # the first call registers again and raises there, naming the problem

    def __getattr__(self, name):  # get_resource_reader, get_source, is_package, ...
        return getattr(self._inner, name)


if "torch" in sys.modules:
    register()
elif not any(getattr(finder, "registers_attngen_op", False) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenTorchLoads())
