"""The decode front door: `attngen.decode` (new tokens against a KV cache) and `append_kv`.

On torch tensors `decode` runs the op `torch.ops.attngen.decode` (registered with the forward op,
attngen/api.py), whose fake implementation checks the inputs and gives the outputs' shapes, so it
traces under torch.compile(fullgraph=True); eager calls on plain tensors run its implementation
directly. The number of splits comes from the shapes (or the caller), the workspace is allocated
from the caller's allocator and nothing synchronises with the host: a decode step can be
captured in a CUDA graph. The kernels: attngen/families/decode_sm80/.
"""

from __future__ import annotations

from attngen.spec import AttentionSpec

OP = "attngen::decode"
SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? page_table, str spec_key, "
          "float? softmax_scale, int? num_splits, str[]? input_names=None, Tensor[]? inputs=None) -> (Tensor, Tensor)")


def decode(q, k_cache, v_cache, cache_seqlens, *, page_table=None, spec: AttentionSpec | None = None,
           mask: str | None = None, score_mod: str | None = None, sink: str | None = None, inputs: dict | None = None,
           softmax_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False):
    """Attention of a few new tokens per sequence over each sequence's KV cache (flash decoding).

    Args:
        q: (batch, seq_q, heads_q, head_dim), fp16 or bf16: the new tokens' queries (seq_q >= 1:
            one for plain decoding, more for speculative decoding or a chunked-prefill tail).
        k_cache, v_cache: paged, (num_pages, page_size, heads_kv, head_dim) with `page_table`, or
            contiguous, (batch, capacity, heads_kv, head_dim) without; q's dtype and device; any
            page size; last dim contiguous, rows 16-byte aligned.
        cache_seqlens: (batch,) int32 on q's device: the tokens cached for each sequence, the new
            tokens' keys included when they were appended first (as `append_kv` does).
        page_table: (batch, pages per sequence) int32: sequence b's token t lives in page
            page_table[b, t // page_size], slot t % page_size. Pages in any order, shared or not.
        spec, mask, score_mod, sink, inputs, softmax_scale: as attngen.attention, with q_len =
            seq_q and kv_len = cache_seqlens[b]: "causal" lets new token i see the cached tokens
            j <= i + kv_len - seq_q (bottom-right aligned).
        num_splits: how many parts each sequence's cache is cut into (run by separate CTAs and
            merged through their LSEs); None chooses from the shapes and the GPU.
        return_lse: also return the LSE, float32 (batch, heads_q, seq_q).

    A sequence whose cache_seqlens lies outside [0, capacity] (capacity = pages per sequence x
    page_size, or the contiguous length), or whose pages within its length include an id outside
    [0, num_pages), gets NaN outputs: the kernels check what they read, since checking on the host
    would synchronise. An empty cache gives out 0 and lse -inf (or the sink).
    """
    from attngen import api

    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens}
    api.check_call_args(return_lse=return_lse, inputs=inputs, softmax_scale=softmax_scale, **arrays,
                        **({} if page_table is None else {"page_table": page_table}))
    key = api._spec_key(q, k_cache, spec, mask, score_mod, sink, k_name="k_cache")
    if type(q).__module__.startswith("torch"):
        import torch

        if type(q) is torch.Tensor and not torch.compiler.is_compiling():
            out, lse = _decode_impl(q, k_cache, v_cache, cache_seqlens, page_table, key, softmax_scale, num_splits,
                                    *api._split_inputs(inputs))
        else:
            api.register()
            out, lse = torch.ops.attngen.decode(q, k_cache, v_cache, cache_seqlens, page_table, key, softmax_scale,
                                                num_splits, *api._split_inputs(inputs))
    else:
        from attngen.runtime.decode import decode as run

        out, lse = run(q, k_cache, v_cache, cache_seqlens, api._spec_from_key(key), page_table=page_table,
                       softmax_scale=softmax_scale, num_splits=num_splits, inputs=inputs)
    return (out, lse) if return_lse else out


def _decode_impl(q, k_cache, v_cache, cache_seqlens, page_table, spec_key, softmax_scale, num_splits,
                 input_names=None, inputs=None):
    import torch

    from attngen import api
    from attngen.runtime.decode import decode_torch

    return decode_torch(torch, q, k_cache, v_cache, cache_seqlens, page_table, api._spec_from_key(spec_key),
                        softmax_scale, num_splits, list(input_names or ()), list(inputs or ()))


def _decode_fake(q, k_cache, v_cache, cache_seqlens, page_table, spec_key, softmax_scale, num_splits,
                 input_names=None, inputs=None):
    """Shapes and dtypes of the outputs, after the checks that need no data."""
    import torch

    from attngen import api, targets
    from attngen.runtime import decode as runtime
    from attngen.runtime.tensors import TensorInfo

    def info(name, t):
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        return TensorInfo(name, "torch", 0, tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                          t.get_device())

    spec = api._spec_from_key(spec_key)
    # The decode family's own refusals (dropout, packed sequences...), as the eager call gives them; the
    # spec's arch (default sm_90) stands in for the device, which a trace does not ask.
    runtime.decode_plan(spec, targets.target(spec.arch or targets.DEFAULT_ARCH), page_table is not None)
    runtime.check_num_splits(num_splits)
    qi, ki, vi = info("q", q), info("k_cache", k_cache), info("v_cache", v_cache)
    si = info("cache_seqlens", cache_seqlens)
    pi = None if page_table is None else info("page_table", page_table)
    runtime.check_decode_inputs(spec.problem, qi, ki, vi, si, pi)
    B, Sq, Hq, D = q.shape
    out = TensorInfo("out", "torch", 0, (B, Sq, Hq, D), (Sq * Hq * D, Hq * D, D, 1), qi.dtype, qi.device)
    lse = TensorInfo("lse", "torch", 0, (B, Hq, Sq), (Hq * Sq, Sq, 1), "float32", qi.device)
    given = {name: info(f"inputs[{name!r}]", t) for name, t in zip(input_names or (), inputs or ())}
    runtime.decode_call(spec.problem, qi, ki, vi, si, pi, out, lse, softmax_scale, num_splits or 1, given)
    return q.new_empty((B, Sq, Hq, D)), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def register_op(torch):
    """Define torch.ops.attngen.decode (attngen/api.py register() calls this once)."""
    @torch.library.custom_op(OP, mutates_args=(), schema=SCHEMA)
    def decode_op(q, k_cache, v_cache, cache_seqlens, page_table, spec_key, softmax_scale, num_splits,
                  input_names=None, inputs=None):
        return _decode_impl(q, k_cache, v_cache, cache_seqlens, page_table, spec_key, softmax_scale, num_splits,
                            input_names, inputs)

    decode_op.register_fake(_decode_fake)


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, *, page_table=None, check: bool = True) -> None:
    """Write new tokens' keys and values (batch, n, heads_kv, head_dim) into the cache at positions
    cache_seqlens[b] ... cache_seqlens[b] + n - 1 of each sequence (paged through `page_table`, or
    contiguous); cache_seqlens itself is left for the caller to advance (`cache_seqlens += n`).
    torch tensors only. `check` (default) first verifies on the host that every position fits the
    sequence's capacity and every page id touched is valid, which synchronises: pass check=False
    inside a CUDA graph capture once the lengths are known to fit (a write that does not fit is then
    refused by the indexing kernel, a device-side assert, never redirected onto another token)."""
    import torch

    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new),
                    ("cache_seqlens", cache_seqlens), ("page_table", page_table)):
        if not isinstance(t, torch.Tensor) and not (name == "page_table" and t is None):
            raise ValueError(f"{name} is a {type(t).__name__}; allowed: a torch.Tensor")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}: allowed: the same "
                         "4-dim shape, (num_pages, page_size, heads_kv, head_dim) or (batch, capacity, heads_kv, "
                         "head_dim)")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1:
        raise ValueError(f"cache_seqlens is {cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}; allowed: "
                         "int32 (batch,)")
    if page_table is not None and (page_table.dtype != torch.int32 or page_table.dim() != 2
                                   or page_table.shape[0] != cache_seqlens.shape[0] or page_table.shape[1] == 0):
        raise ValueError(f"page_table is {page_table.dtype} of shape {tuple(page_table.shape)}; allowed: int32 "
                         f"(batch={cache_seqlens.shape[0]}, pages per sequence >= 1)")
    for name, t, want in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
        if t.dim() != 4 or t.shape[0] != cache_seqlens.shape[0] or t.shape[2:] != want.shape[2:]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; allowed: (batch={cache_seqlens.shape[0]}, n, "
                             f"{want.shape[2]}, {want.shape[3]}) for this cache")
        if t.dtype != want.dtype or t.device != want.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; allowed: the cache's {want.dtype} on {want.device}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"k_new has shape {tuple(k_new.shape)} and v_new {tuple(v_new.shape)}; allowed: the same "
                         "shape (one key and one value per new token)")
    if page_table is None and k_cache.shape[0] != cache_seqlens.shape[0]:
        raise ValueError(f"k_cache has {k_cache.shape[0]} sequences (shape {tuple(k_cache.shape)}) and cache_seqlens "
                         f"{cache_seqlens.shape[0]}; allowed: one cache row per sequence (a contiguous cache is "
                         "(batch, capacity, heads_kv, head_dim))")
    if k_cache.shape[1] == 0:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}; allowed: a page size (or capacity) of at least 1")
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table)):
        if t is not None and t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}; allowed: the cache's device, {k_cache.device}")
    if not isinstance(check, bool):
        raise ValueError(f"check={check!r} is invalid; allowed: True, False")
    if check and k_cache.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("append_kv(check=True) reads the lengths on the host, which a CUDA graph capture cannot; "
                         "allowed there: check=False (a write that does not fit is still refused on the device)")
    n = k_new.shape[1]
    positions = cache_seqlens.long()[:, None] + torch.arange(n, device=k_new.device)  # (batch, n)
    # A write that does not fit (a position outside the sequence's capacity, a page id outside the
    # cache) gets an index past the cache's end, never a wrapped or clamped one: with check=False the
    # indexing kernel refuses it (a device-side assert on the GPU, an IndexError on the CPU) instead of
    # overwriting another token, perhaps of another sequence through a shared page.
    if page_table is None:
        capacity = k_cache.shape[1]
        fits = (positions >= 0) & (positions < capacity)
        rows = torch.arange(k_new.shape[0], device=k_new.device)[:, None].expand_as(positions)
        index = (rows, torch.where(fits, positions, capacity))
    else:
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        capacity = page_table.shape[1] * page_size
        fits = (positions >= 0) & (positions < capacity)
        pages = torch.gather(page_table.long(), 1, torch.where(fits, positions // page_size, 0))
        fits &= (pages >= 0) & (pages < num_pages)
        index = (torch.where(fits, pages, num_pages), positions % page_size)
    if check:
        bad = ~fits
        if bool(bad.any()):
            b = int(bad.any(dim=1).nonzero()[0, 0])
            raise ValueError(f"append_kv: sequence {b} has cache_seqlens {int(cache_seqlens[b])} and {n} new tokens, "
                             f"past its capacity {capacity} or onto a page id outside [0, {k_cache.shape[0]})")
    k_cache[index] = k_new
    v_cache[index] = v_new
