"""From a call to a loaded kernel: family, config, plan, binary and module, resolved once and memoized.

A call is resolved per (spec, shape bucket, device): the spec's pinned family and config, the
tuned entry for the bucket on this GPU when `attngen tune` stored one (attngen/tune/lookup.py),
else the preferred family's defaults for the call's length bucket. The answer is memoized, and
reused while the tuning database is unchanged (lookup.stamp(): a write by this process or a
change of the file).
Kernels are planned and compiled for the GPU they run on (attngen/targets.py), whatever arch
the spec names for offline generation: arch-specific code never runs on another GPU.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from typing import Any

from attngen import families, targets
from attngen.build import compiler
from attngen.families.base import ForwardCall, Plan
from attngen.runtime import checks
from attngen.runtime.launch import LoadedModule
from attngen.runtime.prepared import Prepared
from attngen.runtime.tensors import TensorInfo, current_stream, describe, device_name, new_like
from attngen.spec import AttentionSpec


class Kernel:
    """A plan built and loaded on one device. Call it on tensors (torch or CuPy): it checks them
    against the kernel contract, launches on the caller's current stream and returns (out, lse)."""

    def __init__(self, plan: Plan, device: int):
        self.plan = plan
        self.family = families.get_family(plan.family)
        self.device = device
        self.source = self.family.render(plan)
        binary = compiler.build(plan, self.source)
        self.binary_path = binary.path
        self._module = LoadedModule(plan, binary.path, device)

    def __repr__(self) -> str:
        return f"Kernel({self.plan.name}, {device_name(self.device)})"

    def __call__(self, q, k, v, *, softmax_scale: float | None = None, out=None, lse=None, inputs=None, rng=None):
        """Run on q, k, v (and the runtime inputs the mask and score modifier read; with dropout, `rng`:
        an int64 tensor [seed, offset], attngen/dropout.py); `out`/`lse` may be given (tests poison
        them first). Returns (out, lse)."""
        qi, ki, vi = describe(q, "q"), describe(k, "k"), describe(v, "v")
        checks.check_inputs(self.plan.problem, qi, ki, vi)
        if qi.device != self.device:
            raise ValueError(f"q is on {qi.where} but this kernel is loaded on {device_name(self.device)}")
        out, lse, call = _outputs_and_call(self.plan, q, qi, ki, vi, out, lse, softmax_scale, inputs, rng)
        reason = self.family.accepts(self.plan, call)
        if reason is not None:
            raise ValueError(f"{self.plan.name} cannot run these tensors: {reason}")
        self.run(call, current_stream(q, self.device), q)
        return out, lse

    def workspace_bytes(self, call: ForwardCall) -> int:
        return self.family.workspace_bytes(self.plan, call)

    def run(self, call: ForwardCall, stream: int, ref) -> None:
        """Launch the call's kernels on `stream`, with a workspace of `ref`'s kind when they need one
        (freed once queued: the caching allocators reuse memory in stream order)."""
        if call.batch == 0 or call.seq_q == 0 or call.heads_q == 0:
            return
        size = self.workspace_bytes(call)
        workspace = new_like(ref, (size,), "uint8") if size else None
        if workspace is not None:
            call = dataclasses.replace(call, workspace=describe(workspace, "workspace").ptr)
        self._module.launch(self.family.launches(self.plan, call), stream)

    def bind(self, call: ForwardCall) -> tuple:
        """The call's launches, packed for the driver (Prepared keeps them per pointer set)."""
        return self._module.bind(self.family.launches(self.plan, call))

    def launch_bound(self, bound: tuple, stream: int) -> None:
        self._module.launch_bound(bound, stream)


def _outputs_and_call(plan: Plan, ref, qi: TensorInfo, ki, vi, out, lse, softmax_scale, inputs=None, rng=None):
    B, Sq, Hq, D = qi.shape
    if out is None:
        out = new_like(ref, (B, Sq, Hq, D))
    if lse is None:
        lse = new_like(ref, (B, Hq, Sq), "float32")
    call = checks.forward_call(plan.problem, qi, ki, vi, describe(out, "out"), describe(lse, "lse"), softmax_scale,
                               describe_inputs(inputs), describe_rng(rng))
    return out, lse, call


def describe_rng(rng) -> TensorInfo | None:
    """The TensorInfo of a call's dropout state [seed, offset] (None when not given)."""
    return None if rng is None else describe(rng, "rng")


def describe_inputs(inputs) -> dict[str, TensorInfo]:
    """name -> TensorInfo of a call's runtime inputs; ValueError for anything but a mapping of names to tensors."""
    from attngen.runtime_inputs import as_mapping

    return {name: describe(t, f"inputs[{name!r}]") for name, t in as_mapping(inputs).items()}


_kernels: dict[tuple[str, int], Kernel] = {}
_lock = threading.Lock()


def kernel_for(plan: Plan, device: int) -> Kernel:
    """The loaded kernel of `plan` on `device`, built (disk-cached) and loaded once per process."""
    key = (plan.name, device)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _kernels[key] = Kernel(plan, device)
    return kernel


def current_device() -> int:
    from attngen.errors import require_cupy

    return require_cupy().cuda.runtime.getDevice()


def compile(spec: AttentionSpec, device: int | None = None, *, fault: str | None = None,  # noqa: A001
            seqlen: int | None = None) -> Kernel:
    """Plan, build (disk-cached) and load `spec` for a GPU (default: the current one), without
    consulting the tuning database. `seqlen`: the longest sequence (max of Sq and Sk) of the calls it
    is for, so the defaults are those the front door takes for such calls (fwd_sm90 has its own for
    at most 1k tokens); None: the length-free defaults. `fault` names a deliberate bug from
    attngen/faults.py, for testing the fuzzer."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise ValueError(f"device={device!r} is invalid; allowed: None (the current GPU) or a GPU index >= 0")
    if seqlen is not None:
        if isinstance(seqlen, bool) or not hasattr(type(seqlen), "__index__") or operator.index(seqlen) < 1:
            raise ValueError(f"seqlen={seqlen!r} is invalid; allowed: None (length-free defaults) or an int >= 1")
        seqlen = operator.index(seqlen)  # numpy's ints too
    device = current_device() if device is None else device
    plan = families.plan_spec(spec, targets.device_target(device), fault=fault, operation="forward",
                              seqlen=None if seqlen is None else _bucket(seqlen))
    return kernel_for(plan, device)


# -- the front door's resolution: tuned entries, memoized per shape bucket ------------------------
_resolved: dict[tuple, tuple[Any, Kernel]] = {}


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def forward_part(spec: AttentionSpec) -> AttentionSpec:
    """The spec the forward runs: one pinning a backward family (and its config) pins the backward
    alone (attngen/runtime/backward.py backward_plan), so the forward picks its own family; and
    `deterministic` asks only the backward for something (forward kernels are deterministic), so
    the forward runs the very kernel it runs without it."""
    if spec.family is not None and spec.family in families.BACKWARD_FAMILIES:
        spec = dataclasses.replace(spec, family=None, config=None)
    if spec.deterministic:
        spec = dataclasses.replace(spec, deterministic=False)
    return spec


def resolve(spec: AttentionSpec, q: TensorInfo, k: TensorInfo) -> Kernel:
    """The kernel a call runs: memoized per (spec, shape bucket, device) while the tuning database
    is unchanged."""
    from attngen.tune import lookup

    spec = forward_part(spec)
    device = q.device
    seqlen = _bucket(max(q.shape[1], k.shape[1]))
    if spec.fully_configured:
        key = (spec, device)
        stamp = None
    else:
        key = (spec, seqlen, _bucket(q.shape[0] * q.shape[2]), device)
        stamp = lookup.recent_stamp()
    hit = _resolved.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    target = targets.device_target(device)
    plan = None
    if stamp is not None:
        tuned = lookup.tuned(spec, q.shape, k.shape, target)
        if tuned is not None:
            family_name, config = tuned
            family = families.get_family(family_name)
            plan = family.plan(spec.problem, target, family.resolve_config(spec.problem, target, config))
    if plan is None:  # the defaults for this length bucket (fwd_sm90 has tiles for short sequences)
        plan = families.plan_spec(spec, target, operation="forward", seqlen=seqlen)
    kernel = kernel_for(plan, device)
    _resolved[key] = (stamp, kernel)
    return kernel


def _fallback(spec: AttentionSpec, kernel: Kernel, call: ForwardCall, reason: str) -> Kernel:
    """Another family for a call the chosen one cannot describe (a layout TMA cannot express, say)."""
    if spec.family is not None:
        raise ValueError(f"family {spec.family} cannot run these tensors: {reason}")
    target = targets.device_target(kernel.device)
    for family in families.supporting(spec.problem, target):
        if family.name == kernel.plan.family:
            continue
        plan = family.plan(spec.problem, target,
                           family.default_config(spec.problem, target, _bucket(max(call.seq_q, call.seq_k))))
        if family.accepts(plan, call) is None:
            return kernel_for(plan, kernel.device)
    raise ValueError(f"no kernel family can run these tensors ({kernel.plan.family}: {reason})")


# Calls whose inputs have the layout of an earlier checked call skip the checks and the resolution
# (attngen/runtime/prepared.py): (spec, scale, target, each input's shape, strides, dtype, device) -> Prepared.
_prepared: dict[tuple, Prepared] = {}
# The front door's eager memo (attngen/api.py), keyed by its own arguments and the torch layout.
eager_prepared: dict[tuple, Prepared] = {}
MAX_PREPARED = 4096


def remember(memo: dict, key: tuple, prepared: Prepared) -> Prepared:
    if len(memo) >= MAX_PREPARED:
        memo.clear()
    memo[key] = prepared
    return prepared


def forget() -> None:
    """Drop every memoized resolution (tests observe what a fresh process would resolve)."""
    from attngen.runtime import backward

    _resolved.clear()
    _prepared.clear()
    eager_prepared.clear()
    backward.forget()


def prepare(q, k, v, spec: AttentionSpec, softmax_scale: float | None = None, inputs=None, rng=None) -> Prepared:
    """Check a call's inputs against the kernel contract and resolve its kernel: a Prepared that runs
    every call of the same layout (inputs 16-byte aligned)."""
    from attngen.tune import lookup

    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    qi, ki, vi = describe(q, "q"), describe(k, "k"), describe(v, "v")
    checks.check_inputs(spec.problem, qi, ki, vi)
    stamp = None if spec.fully_configured else lookup.recent_stamp()
    kernel = resolve(spec, qi, ki)
    B, Sq, Hq, D = qi.shape
    # The outputs' layout, as new_like makes them; the pointers are filled in per call.
    out = TensorInfo("out", qi.kind, 0, (B, Sq, Hq, D), (Sq * Hq * D, Hq * D, D, 1), qi.dtype, qi.device)
    lse = TensorInfo("lse", qi.kind, 0, (B, Hq, Sq), (Hq * Sq, Sq, 1), "float32", qi.device)
    call = checks.forward_call(kernel.plan.problem, qi, ki, vi, out, lse, softmax_scale, describe_inputs(inputs),
                               describe_rng(rng))
    reason = kernel.family.accepts(kernel.plan, call)
    if reason is not None:
        kernel = _fallback(spec, kernel, call, reason)
    return Prepared(kernel, call, stamp)


def forward(q, k, v, spec: AttentionSpec, *, softmax_scale: float | None = None, out=None, lse=None, inputs=None,
            rng=None):
    """The forward pass on torch CUDA tensors or CuPy arrays: (out, lse), launched on the caller's
    current stream. Checks every input against the kernel contract first (once per layout). With
    dropout (the spec's dropout_p > 0), `rng` is the int64 tensor [seed, offset] (attngen/dropout.py)."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    qi, ki, vi = describe(q, "q"), describe(k, "k"), describe(v, "v")
    if out is not None or lse is not None:  # outputs given (tests poison them first): every check, every time
        checks.check_inputs(spec.problem, qi, ki, vi)
        kernel = resolve(spec, qi, ki)
        out, lse, call = _outputs_and_call(kernel.plan, q, qi, ki, vi, out, lse, softmax_scale, inputs, rng)
        reason = kernel.family.accepts(kernel.plan, call)
        if reason is not None:
            kernel = _fallback(spec, kernel, call, reason)
        kernel.run(call, current_stream(q, qi.device), q)
        return out, lse
    given = describe_inputs(inputs)
    ri = describe_rng(rng)
    layout = (spec, softmax_scale, qi.shape, qi.strides, qi.dtype, qi.device, ki.shape, ki.strides, ki.dtype,
              ki.device, vi.shape, vi.strides, vi.dtype, vi.device,
              tuple((name, t.shape, t.strides, t.dtype, t.device) for name, t in sorted(given.items())),
              None if ri is None else (ri.shape, ri.strides, ri.dtype, ri.device))
    prepared = _prepared.get(layout)
    if prepared is None or not prepared.current() or qi.ptr % 16 or ki.ptr % 16 or vi.ptr % 16 \
            or (ri is not None and ri.ptr % 8):
        prepared = remember(_prepared, layout, prepare(q, k, v, spec, softmax_scale, inputs, rng))
    return prepared.run(q, k, v, inputs, rng)
