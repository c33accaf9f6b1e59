"""The decode runtime: a call of new tokens against a KV cache, checked against the contract
(docs/decode.md), resolved to a decode family's kernel and launched on the caller's stream.

What can be checked without reading device memory is checked here, before any launch: shapes,
dtypes, devices, strides, alignment, the runtime inputs' index ranges (over the cache's capacity).
The values of `cache_seqlens` and of the page table live on the device and reading them would
synchronise (and break CUDA graph capture), so the kernels check them as they read them: a
sequence whose length lies outside [0, capacity], or whose pages include an id outside
[0, num_pages) among those its length covers, gets NaN in every output and LSE element. Never a
read outside the cache, never a silent wrong answer.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

from attngen import families, targets
from attngen.families.base import (
    MAX_SPLITS,
    DecodeCall,
    problem_inputs,
    problem_programs,
)
from attngen.runtime import checks
from attngen.runtime.dispatch import describe_inputs, kernel_for
from attngen.runtime.tensors import TensorInfo, current_stream, describe, new_like
from attngen.spec import AttentionSpec

MAX_GRID_YZ = 65535


def check_decode_inputs(problem, q: TensorInfo, k: TensorInfo, v: TensorInfo, seqlens: TensorInfo,
                        page_table: TensorInfo | None) -> None:
    """ValueError naming the argument, its value and what is allowed, for anything the kernels
    cannot take (the values of seqlens and page_table are the kernels' to check: module docstring)."""
    from attngen.dtypes import get_dtype

    want = get_dtype(problem.dtype).torch_name
    layout = "(num_pages, page_size, heads_kv, head_dim)" if page_table else "(batch, capacity, heads_kv, head_dim)"
    for t, dims in ((q, "(batch, seq_q, heads_q, head_dim)"), (k, layout), (v, layout)):
        if len(t.shape) != 4:
            raise ValueError(f"{t.name} must have 4 dims {dims}, got shape {t.shape}")
        if t.dtype != want:
            raise ValueError(f"{t.name} has dtype {t.dtype}, but the spec's dtype is {problem.dtype} ({want})")
        if t.shape[3] != problem.head_dim:
            raise ValueError(f"{t.name} has head_dim {t.shape[3]} (shape {t.shape}), but the spec's head_dim is "
                             f"{problem.head_dim}")
        if t.strides[3] != 1:
            raise ValueError(f"{t.name} must be contiguous in its last dim, got strides {t.strides}")
        if t.ptr % 16 or any(s % 8 for s in t.strides[:3]):
            raise ValueError(f"{t.name} rows must be 16-byte aligned (data pointer and strides multiples of 8 "
                             f"elements), got strides {t.strides}; pass .contiguous()")
        if t.device != q.device:
            raise ValueError(f"{t.name} is on {t.where} but q is on {q.where}")
    if k.shape != v.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {k.shape} and {v.shape}")
    B, Sq, Hq, _ = q.shape
    Hkv = k.shape[2]
    if Hkv == 0 or Hq != problem.gqa_ratio * Hkv:
        raise ValueError(f"q has {Hq} heads and the cache has {Hkv}; the spec's gqa_ratio={problem.gqa_ratio} needs "
                         f"heads_q == gqa_ratio * heads_kv")
    if B < 1 or Sq < 1:
        raise ValueError(f"q has shape {q.shape}; allowed: batch >= 1 and seq_q >= 1 new tokens")
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(f"k_cache has shape {k.shape}; allowed: at least one {'page' if page_table else 'sequence'} "
                         f"of at least one token")
    index_tensors = [(seqlens, 1, "(batch,)")]
    if page_table is not None:
        index_tensors.append((page_table, 2, "(batch, pages per sequence)"))
    for t, rank, dims in index_tensors:
        if t.dtype != "int32":
            raise ValueError(f"{t.name} has dtype {t.dtype}; allowed: int32")
        if len(t.shape) != rank or t.shape[0] != B:
            raise ValueError(f"{t.name} has shape {t.shape}; allowed: {dims} with batch {B} (q's)")
        if t.strides[-1] != 1 and t.shape[-1] > 1:
            raise ValueError(f"{t.name} must be contiguous in its last dim, got strides {t.strides}")
        if t.device != q.device:
            raise ValueError(f"{t.name} is on {t.where} but q is on {q.where}")
    if page_table is not None and page_table.shape[1] < 1:
        raise ValueError(f"page_table has shape {page_table.shape}; allowed: at least one page per sequence")
    if page_table is None and k.shape[0] != B:
        raise ValueError(f"the contiguous cache k_cache has batch {k.shape[0]} but q has batch {B}; pass "
                         "page_table= for a paged cache of shape (num_pages, page_size, heads_kv, head_dim)")
    capacity = page_table.shape[1] * k.shape[1] if page_table is not None else k.shape[1]
    if capacity >= 2**31 or k.shape[0] >= 2**31:
        raise ValueError(f"the cache holds {capacity} tokens per sequence; allowed: fewer than 2**31")
    if B > MAX_GRID_YZ:
        raise ValueError(f"batch {B} exceeds the supported maximum {MAX_GRID_YZ}")
    if B * Sq * Hq >= 2**31:  # the combine kernel: one CTA per output row, its indices in 32 bits
        raise ValueError(f"q has shape {q.shape}: {B * Sq * Hq} output rows (batch x seq_q x heads_q); allowed: "
                         "fewer than 2**31")


def decode_call(problem, q, k, v, seqlens, page_table, out, lse, softmax_scale, num_splits, inputs) -> DecodeCall:
    """A checked DecodeCall (inputs checked with check_decode_inputs first); num_splits resolved."""
    from attngen.runtime_inputs import check

    checks.check_output(out, q, q.shape, q.dtype)
    B, Sq, Hq, _ = q.shape
    checks.check_output(lse, q, (B, Hq, Sq), "float32")
    inputs = dict(inputs or {})
    declared = problem_inputs(problem)
    call = DecodeCall(q, k, v, seqlens, page_table, out, lse, checks.check_scale(softmax_scale, problem),
                      num_splits, inputs=tuple(sorted(inputs.items())))
    if declared or inputs:
        # Positions range over the cache's capacity: every length the kernel may see.
        check([program for _, program in problem_programs(problem)], declared, inputs, B, Hq, Sq, call.capacity,
              q.device)
    return call


def check_num_splits(num_splits) -> None:
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits={num_splits!r} is invalid; allowed: None (chosen from the shapes) or an "
                         f"integer in [1, {MAX_SPLITS}]")


def decode_plan(spec: AttentionSpec, target, paged: bool, page_size: int | None = None):
    """The decode plan of a spec: its pinned decode family and config, else the first decode family
    that supports the problem, with its defaults (a pinned forward family's config is the forward's);
    for a paged cache whose page size is given, the plan for that page size (pages of whole blocks or not)."""
    pinned = spec.family if spec.family in families.DECODE_FAMILIES else None
    family = families.select(spec.problem, target, pinned, "decode")
    config = family.resolve_config(spec.problem, target, spec.pinned if pinned else {})
    return family.plan(spec.problem, target, config, paged=paged, page_size=page_size if paged else None)


@functools.lru_cache(maxsize=None)
def _target(device: int):
    return targets.device_target(device)


_plans: dict[tuple, object] = {}
_lock = threading.Lock()


def _kernel(spec: AttentionSpec, device: int, page_size: int | None):
    """The kernel for a paged cache of `page_size` tokens a page, or (None) a contiguous one."""
    key = (spec, device, page_size)
    plan = _plans.get(key)
    if plan is None:
        with _lock:
            plan = _plans.get(key) or _plans.setdefault(
                key, decode_plan(spec, _target(device), page_size is not None, page_size))
    return kernel_for(plan, device)


class PreparedDecode:
    """A checked decode call layout (as attngen/runtime/prepared.py for the forward): later calls with
    the same shapes, strides, dtypes and devices skip the checks and the planning, and their launches
    are packed once per set of pointers (a decode loop reuses its cache, so only q, out and lse move)."""

    def __init__(self, kernel, call: DecodeCall):
        self.kernel = kernel
        self.template = call
        self.workspace_bytes = kernel.workspace_bytes(call)
        self._bound: dict[tuple, tuple] = {}

    def run_torch(self, torch, q, k, v, seqlens, page_table, inputs: tuple, stream: int):
        t = self.template
        out = torch.empty(t.out.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(t.lse.shape, dtype=torch.float32, device=q.device)
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=q.device) \
            if self.workspace_bytes else None
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), seqlens.data_ptr(),
                0 if page_table is None else page_table.data_ptr(), out.data_ptr(), lse.data_ptr(),
                0 if workspace is None else workspace.data_ptr(), *(x.data_ptr() for x in inputs))
        bound = self._bound.get(ptrs)
        if bound is None:
            if len(self._bound) >= 64:
                self._bound.clear()

            def at(info, ptr):
                return None if info is None else dataclasses.replace(info, ptr=ptr)

            call = dataclasses.replace(
                t, q=at(t.q, ptrs[0]), k=at(t.k, ptrs[1]), v=at(t.v, ptrs[2]), seqlens=at(t.seqlens, ptrs[3]),
                page_table=at(t.page_table, ptrs[4]), out=at(t.out, ptrs[5]), lse=at(t.lse, ptrs[6]),
                workspace=ptrs[7], inputs=tuple((name, at(info, ptr)) for (name, info), ptr in zip(t.inputs, ptrs[8:])))
            bound = self._bound[ptrs] = self.kernel.bind(call)
        self.kernel.launch_bound(bound, stream)
        return out, lse


_prepared: dict[tuple, PreparedDecode] = {}


def decode_torch(torch, q, k_cache, v_cache, cache_seqlens, page_table, spec: AttentionSpec, softmax_scale,
                 num_splits, names: list, tensors: list):
    """decode() for plain torch tensors, through a PreparedDecode per layout (16-byte aligned pointers)."""
    from attngen.runtime.tensors import torch_stream

    key = (spec, softmax_scale, num_splits, q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
           k_cache.dtype, k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
           cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
           None if page_table is None else (page_table.shape, page_table.stride(), page_table.dtype, page_table.device),
           tuple((name, t.shape, t.stride(), t.dtype, t.device) for name, t in zip(names, tensors)))
    prepared = _prepared.get(key)
    if prepared is None or q.data_ptr() % 16 or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        inputs = dict(zip(names, tensors)) or None
        kernel, call = _checked(q, k_cache, v_cache, cache_seqlens, page_table, spec, softmax_scale, num_splits,
                                inputs)
        prepared = PreparedDecode(kernel, call)
        if len(_prepared) >= 4096:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared.run_torch(torch, q, k_cache, v_cache, cache_seqlens, page_table, tensors,
                              torch_stream(torch, q.get_device()))


def _checked(q, k_cache, v_cache, cache_seqlens, page_table, spec, softmax_scale, num_splits, inputs, out=None,
             lse=None):
    """The kernel and the checked call (num_splits resolved) of a decode call."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    check_num_splits(num_splits)
    qi, ki, vi = describe(q, "q"), describe(k_cache, "k_cache"), describe(v_cache, "v_cache")
    si = describe(cache_seqlens, "cache_seqlens")
    pi = None if page_table is None else describe(page_table, "page_table")
    check_decode_inputs(spec.problem, qi, ki, vi, si, pi)
    kernel = _kernel(spec, qi.device, None if pi is None else ki.shape[1])
    B, Sq, Hq, D = qi.shape
    oi = describe(out, "out") if out is not None else \
        TensorInfo("out", qi.kind, 0, (B, Sq, Hq, D), (Sq * Hq * D, Hq * D, D, 1), qi.dtype, qi.device)
    li = describe(lse, "lse") if lse is not None else \
        TensorInfo("lse", qi.kind, 0, (B, Hq, Sq), (Hq * Sq, Sq, 1), "float32", qi.device)
    call = decode_call(spec.problem, qi, ki, vi, si, pi, oi, li, softmax_scale, num_splits or 1,
                       describe_inputs(inputs))
    if num_splits is None:
        splits = kernel.family.num_splits(kernel.plan, call, _target(qi.device))
        call = dataclasses.replace(call, num_splits=splits)
    return kernel, call


def decode(q, k_cache, v_cache, cache_seqlens, spec: AttentionSpec, *, page_table=None, softmax_scale=None,
           num_splits=None, inputs=None, out=None, lse=None):
    """(out, lse) of the new tokens' attention over each sequence's cache (attngen.decode documents
    the arguments), on torch CUDA tensors or CuPy arrays, on the caller's current stream. Every
    check, every call (decode_torch skips them for a layout seen before)."""
    qi = describe(q, "q")
    B, Sq, Hq, D = qi.shape if len(qi.shape) == 4 else (0, 0, 0, 0)
    out = new_like(q, (B, Sq, Hq, D)) if out is None else out
    lse = new_like(q, (B, Hq, Sq), "float32") if lse is None else lse
    kernel, call = _checked(q, k_cache, v_cache, cache_seqlens, page_table, spec, softmax_scale, num_splits, inputs,
                            out, lse)
    kernel.run(call, current_stream(q, qi.device), q)
    return out, lse
