"""The backward runtime: attention()'s gradients dq, dk, dv from the forward's q, k, v, output and
LSE and the gradients of its outputs, checked against the contract (docs/backward.md), resolved
to a backward family's kernel (attngen/families/bwd_sm80/) and launched on the caller's stream.

Everything is checked before any launch, as for the forward (attngen/runtime/checks.py): q, k, v
by the forward's own checks, out and dout like q, the LSE and its gradient float32 (batch,
heads_q, seq_q) contiguous, the gradients' buffers like q and k, and the runtime inputs' index
ranges. An empty call (no batch or no query rows) launches nothing: dq, dk and dv are zeros.
"""

from __future__ import annotations

import dataclasses
import math
import threading

from attngen import families, targets
from attngen.families.base import BackwardCall, problem_inputs, problem_programs
from attngen.families.bwd_shared import Workspace, learnable_inputs
from attngen.runtime import checks
from attngen.runtime.dispatch import describe_inputs, describe_rng, kernel_for
from attngen.runtime.tensors import TensorInfo, current_stream, describe, new_like
from attngen.spec import AttentionSpec

MAX_BOUND = 64  # pointer sets packed per layout before the memo starts over
MAX_PREPARED = 4096


def _check_like(t: TensorInfo, ref: TensorInfo) -> None:
    """`t` has `ref`'s shape, dtype and device, its last dim contiguous and rows 16-byte aligned."""
    if t.shape != ref.shape:
        raise ValueError(f"{t.name} has shape {t.shape}; allowed: {ref.name}'s shape {ref.shape}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{t.name} has dtype {t.dtype}; allowed: {ref.name}'s dtype {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{t.name} is on {t.where}; allowed: {ref.name}'s device {ref.where}")
    if t.strides[-1] != 1:
        raise ValueError(f"{t.name} has strides {t.strides}; allowed: contiguous in its last dim (stride 1)")
    # The kernels move 16-byte chunks of every row, as they do of q's.
    # A dim of size 1 never moves the address, whatever its stride (torch's contiguous() keeps any).
    if t.ptr % 16 or any(s % 8 and n > 1 for n, s in zip(t.shape[:-1], t.strides[:-1])):
        raise ValueError(f"{t.name} has strides {t.strides} and data pointer {t.ptr:#x}; allowed: rows 16-byte "
                         "aligned (pointer a multiple of 16 bytes, strides multiples of 8 elements): pass "
                         ".contiguous()")


def _check_rows(t: TensorInfo, q: TensorInfo) -> None:
    """`t` is float32 (batch, heads_q, seq_q), contiguous, on q's device: the LSE's layout."""
    B, Sq, Hq, _ = q.shape
    shape = (B, Hq, Sq)
    if t.shape != shape:
        raise ValueError(f"{t.name} has shape {t.shape}; allowed: (batch, heads_q, seq_q) = {shape}")
    if t.dtype != "float32":
        raise ValueError(f"{t.name} has dtype {t.dtype}; allowed: float32")
    if t.device != q.device:
        raise ValueError(f"{t.name} is on {t.where}; allowed: q's device {q.where}")
    # The kernels index it as contiguous; a dim of size 1 never moves, whatever its stride says.
    contiguous = (Hq * Sq, Sq, 1)
    if any(n > 1 and s != want for n, s, want in zip(t.shape, t.strides, contiguous)):
        raise ValueError(f"{t.name} has strides {t.strides}; allowed: contiguous, {contiguous}: pass .contiguous()")


def check_backward_inputs(problem, q: TensorInfo, k: TensorInfo, v: TensorInfo, out: TensorInfo, lse: TensorInfo,
                          dout: TensorInfo, dlse: TensorInfo | None) -> None:
    """ValueError naming the argument, its value and what is allowed, for anything the backward
    kernels cannot take: q, k, v as the forward checks them, out and dout like q, lse and dlse
    float32 (batch, heads_q, seq_q) contiguous."""
    checks.check_inputs(problem, q, k, v)
    _check_like(out, q)
    _check_like(dout, q)
    _check_rows(lse, q)
    if dlse is not None:
        _check_rows(dlse, q)


def backward_call(problem, q: TensorInfo, k: TensorInfo, v: TensorInfo, out: TensorInfo, lse: TensorInfo,
                  dout: TensorInfo, dlse: TensorInfo | None, dq: TensorInfo, dk: TensorInfo, dv: TensorInfo,
                  softmax_scale, inputs: dict | None = None, rng: TensorInfo | None = None) -> BackwardCall:
    """A checked BackwardCall (inputs checked with check_backward_inputs first): the gradients'
    buffers dq like q and dk, dv like k, the scale resolved, the runtime inputs checked over the call,
    with dropout the forward's [seed, offset] tensor `rng` (attngen/dropout.py)."""
    from attngen.dropout import check_rng
    from attngen.runtime_inputs import check

    _check_like(dq, q)
    _check_like(dk, k)
    _check_like(dv, k)
    B, Sq, Hq, _ = q.shape
    inputs = dict(inputs or {})
    declared = problem_inputs(problem)
    if declared or inputs:
        programs = [program for _, program in problem_programs(problem)]
        check(programs, declared, inputs, B, Hq, Sq, k.shape[1], q.device)
    check_rng(rng, q, problem.dropout_p)
    return BackwardCall(q, k, v, out, lse, dout, dlse, dq, dk, dv, checks.check_scale(softmax_scale, problem),
                        inputs=tuple(sorted(inputs.items())), rng=rng)


def backward_plan(spec: AttentionSpec, target):
    """The backward plan of a spec: its pinned backward family and config, else the first backward
    family that supports the problem, with its defaults (a pinned forward family's config is the
    forward's, not the backward's)."""
    pinned = spec.family if spec.family in families.BACKWARD_FAMILIES else None
    family = families.select(spec.problem, target, pinned, "backward")
    config = family.resolve_config(spec.problem, target, spec.pinned if pinned else {})
    return family.plan(spec.problem, target, config)


_plans: dict[tuple, object] = {}
_lock = threading.Lock()


def device_plan(spec: AttentionSpec, device: int):
    """backward_plan for the GPU `device`, memoized (attention() asks before every forward that
    needs gradients: a problem no backward family runs fails then, not in loss.backward())."""
    key = (spec, device)
    plan = _plans.get(key)
    if plan is None:
        with _lock:
            plan = _plans.get(key) or _plans.setdefault(key, backward_plan(spec, targets.device_target(device)))
    return plan


def _kernel(spec: AttentionSpec, device: int):
    return kernel_for(device_plan(spec, device), device)


def contiguous_info(name: str, shape: tuple, dtype: str, ref: TensorInfo) -> TensorInfo:
    """The TensorInfo of a contiguous array new_like makes (pointer filled in per call)."""
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(name, ref.kind, 0, tuple(shape), strides, dtype, ref.device)


def _is_empty(call: BackwardCall) -> bool:
    return call.batch == 0 or call.seq_q == 0 or call.heads_q == 0


def _zero(x) -> None:
    """Fill a torch tensor or CuPy array with zeros, on its framework's current stream."""
    if type(x).__module__.startswith("torch"):
        x.zero_()
    else:
        x.fill(0)


def _checked(dout, q, k, v, out, lse, spec, softmax_scale, inputs, dlse, dq, dk, dv, rng=None):
    """The kernel (None for an empty call) and the checked call; dq, dk, dv described as given, or
    as new_like would make them when None."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    qi, ki, vi = describe(q, "q"), describe(k, "k"), describe(v, "v")
    oi, li, di = describe(out, "out"), describe(lse, "lse"), describe(dout, "dout")
    dli = None if dlse is None else describe(dlse, "dlse")
    check_backward_inputs(spec.problem, qi, ki, vi, oi, li, di, dli)
    grads = [describe(t, name) if t is not None else contiguous_info(name, ref.shape, ref.dtype, ref)
             for t, name, ref in ((dq, "dq", qi), (dk, "dk", ki), (dv, "dv", ki))]
    call = backward_call(spec.problem, qi, ki, vi, oi, li, di, dli, *grads, softmax_scale, describe_inputs(inputs),
                         describe_rng(rng))
    return (None if _is_empty(call) else _kernel(spec, qi.device)), call


def backward(dout, q, k, v, out, lse, spec: AttentionSpec, *, softmax_scale=None, inputs=None, dlse=None, dq=None,
             dk=None, dv=None, rng=None):
    """(dq, dk, dv) of a forward call (its q, k, v, out, lse) from the gradients of its outputs (dout,
    and dlse when the loss reads the LSE), on torch CUDA tensors or CuPy arrays, launched on the
    caller's current stream. dq, dk, dv may be given (tests poison them first); new otherwise. With
    dropout, `rng` is the forward call's [seed, offset] tensor, holding the same values.
    Every check, every call (backward_torch skips them for a layout seen before)."""
    kernel, call = _checked(dout, q, k, v, out, lse, spec, softmax_scale, inputs, dlse, dq, dk, dv, rng)
    dq = new_like(q, call.dq.shape) if dq is None else dq
    dk = new_like(q, call.dk.shape) if dk is None else dk
    dv = new_like(q, call.dv.shape) if dv is None else dv
    if kernel is None:  # nothing to launch: no query row reaches any key
        for x in (dq, dk, dv):
            _zero(x)
        return dq, dk, dv
    call = dataclasses.replace(call, dq=describe(dq, "dq"), dk=describe(dk, "dk"), dv=describe(dv, "dv"))
    kernel.run(call, current_stream(q, call.q.device), q)
    return dq, dk, dv


class PreparedBackward:
    """A checked backward call layout (as PreparedDecode for decode): later calls with the same
    shapes, strides, dtypes and devices skip the checks and the planning, and their launches are
    packed once per set of pointers (a training loop's caching allocator hands out the same ones)."""

    FIELDS = ("dout", "q", "k", "v", "out", "lse", "dlse", "dq", "dk", "dv")

    def __init__(self, kernel, call: BackwardCall, learnable: int = 0):
        self.kernel = kernel  # None: an empty call, nothing to launch
        self.template = call
        self.workspace_bytes = 0 if kernel is None else kernel.workspace_bytes(call)
        self._bound: dict[tuple, tuple] = {}
        # The learnable inputs' per-CTA gradient sums (attngen/families/bwd_shared.py): where in the workspace.
        self.learnable = learnable
        self.sums = None if kernel is None or not learnable else Workspace.of(kernel.plan, call)

    def head_sums(self, torch, workspace, device):
        """(learnable inputs, Hq) float32: each input's gradient per query head, the kernels' per-CTA sums
        added over batches and key blocks (a fixed-order reduction: deterministic)."""
        t = self.template
        if self.sums is None:
            return torch.zeros((self.learnable, t.heads_q), dtype=torch.float32, device=device)
        n, ws = self.learnable, self.sums
        count = n * t.batch * t.heads_q * ws.key_blocks
        sums = workspace[ws.igrad:ws.igrad + 4 * count].view(torch.float32).view(n, t.batch, t.heads_q, ws.key_blocks)
        return sums.sum(dim=(1, 3))

    def run_torch(self, torch, dout, q, k, v, out, lse, dlse, inputs: tuple, stream: int, rng=None):
        t = self.template
        if self.kernel is None:
            return (torch.zeros(t.dq.shape, dtype=q.dtype, device=q.device),
                    torch.zeros(t.dk.shape, dtype=k.dtype, device=q.device),
                    torch.zeros(t.dv.shape, dtype=k.dtype, device=q.device), self.head_sums(torch, None, q.device))
        dq = torch.empty(t.dq.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(t.dk.shape, dtype=k.dtype, device=q.device)
        dv = torch.empty(t.dv.shape, dtype=k.dtype, device=q.device)
        # Freed once queued: the caching allocator hands it out again in stream order.
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=q.device) \
            if self.workspace_bytes else None
        tensors = (dout, q, k, v, out, lse, dlse, dq, dk, dv)
        ptrs = (*(0 if x is None else x.data_ptr() for x in tensors), 0 if workspace is None else workspace.data_ptr(),
                *(x.data_ptr() for x in inputs), *(() if rng is None else (rng.data_ptr(),)))
        bound = self._bound.get(ptrs)
        if bound is None:
            if len(self._bound) >= MAX_BOUND:
                self._bound.clear()
            bound = self._bound[ptrs] = self.kernel.bind(self._at(ptrs))
        self.kernel.launch_bound(bound, stream)
        return dq, dk, dv, self.head_sums(torch, workspace, q.device)

    def _at(self, ptrs: tuple) -> BackwardCall:
        """The template call at these addresses (FIELDS, the workspace, then the runtime inputs by name,
        then with dropout the rng tensor)."""
        t = self.template

        def at(info, ptr):
            return None if info is None else dataclasses.replace(info, ptr=ptr)

        n = len(self.FIELDS)
        moved = {name: at(getattr(t, name), ptr) for name, ptr in zip(self.FIELDS, ptrs)}
        inputs = tuple((name, at(info, ptr)) for (name, info), ptr in zip(t.inputs, ptrs[n + 1:]))
        rng = None if t.rng is None else at(t.rng, ptrs[n + 1 + len(t.inputs)])
        return dataclasses.replace(t, **moved, workspace=ptrs[n], inputs=inputs, rng=rng)


_prepared: dict[tuple, PreparedBackward] = {}


def _torch_layout(t) -> tuple:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def backward_torch(torch, dout, q, k, v, out, lse, dlse, spec: AttentionSpec, softmax_scale, names: list,
                   tensors: list, rng=None):
    """backward() for plain torch tensors, through a PreparedBackward per layout (16-byte aligned
    pointers: those are all the skipped checks depend on besides the layout): (dq, dk, dv, head sums),
    the last (learnable inputs, Hq) float32, the gradient of each learnable input per query head."""
    from attngen.runtime.tensors import torch_stream

    key = (spec, softmax_scale, *(_torch_layout(t) for t in (dout, q, k, v, out, lse, dlse, rng)),
           tuple((name, *_torch_layout(t)) for name, t in zip(names, tensors)))
    prepared = _prepared.get(key)
    if prepared is None or any(t.data_ptr() % 16 for t in (dout, q, k, v, out)) \
            or (rng is not None and rng.data_ptr() % 8):
        kernel, call = _checked(dout, q, k, v, out, lse, spec, softmax_scale, dict(zip(names, tensors)) or None,
                                dlse, None, None, None, rng)
        prepared = PreparedBackward(kernel, call, len(learnable_inputs(spec.problem)))
        if len(_prepared) >= MAX_PREPARED:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared.run_torch(torch, dout, q, k, v, out, lse, dlse, tuple(tensors), torch_stream(torch, q.get_device()),
                              rng)


def forget() -> None:
    """Drop every memoized plan and layout (tests observe what a fresh process would resolve)."""
    _plans.clear()
    _prepared.clear()
