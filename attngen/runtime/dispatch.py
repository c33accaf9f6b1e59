"""From a call to a loaded kernel: family, config, plan, binary and module, resolved once and memoized.

A call is resolved per (spec, shape bucket, device): the spec's pinned family and config, the
tuned entry for the bucket on this GPU when `attngen tune` stored one (attngen/tune/lookup.py),
else the preferred family's defaults. The answer is memoized, and reused while the tuning
database is unchanged (lookup.stamp(): a write by this process or a change of the file).
Kernels are planned and compiled for the GPU they run on (attngen/targets.py), whatever arch
the spec names for offline generation: arch-specific code never runs on another GPU.
"""

from __future__ import annotations

import threading
from typing import Any

from attngen import families, targets
from attngen.build import compiler
from attngen.families.base import ForwardCall, Plan
from attngen.runtime import checks
from attngen.runtime.launch import LoadedModule
from attngen.runtime.tensors import TensorInfo, current_stream, describe, new_like
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
        return f"Kernel({self.plan.name}, cuda:{self.device})"

    def __call__(self, q, k, v, *, softmax_scale: float | None = None, out=None, lse=None):
        """Run on q, k, v; `out`/`lse` may be given (tests poison them first). Returns (out, lse)."""
        qi, ki, vi = describe(q, "q"), describe(k, "k"), describe(v, "v")
        checks.check_inputs(self.plan.problem, qi, ki, vi)
        if qi.device != self.device:
            raise ValueError(f"q is on cuda:{qi.device} but this kernel is loaded on cuda:{self.device}")
        out, lse, call = _outputs_and_call(self.plan, q, qi, ki, vi, out, lse, softmax_scale)
        reason = self.family.accepts(self.plan, call)
        if reason is not None:
            raise ValueError(f"{self.plan.name} cannot run these tensors: {reason}")
        self.run(call, current_stream(q, self.device))
        return out, lse

    def run(self, call: ForwardCall, stream: int) -> None:
        if call.batch == 0 or call.seq_q == 0 or call.heads_q == 0:
            return
        self._module.launch(self.family.launches(self.plan, call), stream)


def _outputs_and_call(plan: Plan, ref, qi: TensorInfo, ki, vi, out, lse, softmax_scale):
    B, Sq, Hq, D = qi.shape
    if out is None:
        out = new_like(ref, (B, Sq, Hq, D))
    if lse is None:
        lse = new_like(ref, (B, Hq, Sq), "float32")
    call = checks.forward_call(plan.problem, qi, ki, vi, describe(out, "out"), describe(lse, "lse"), softmax_scale)
    return out, lse, call


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


def compile(spec: AttentionSpec, device: int | None = None, *, fault: str | None = None) -> Kernel:  # noqa: A001
    """Plan, build (disk-cached) and load `spec` for a GPU (default: the current one), without
    consulting the tuning database. `fault` names a deliberate bug from attngen/faults.py, for
    testing the fuzzer."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    device = current_device() if device is None else device
    return kernel_for(families.plan_spec(spec, targets.device_target(device), fault=fault), device)


# -- the front door's resolution: tuned entries, memoized per shape bucket ------------------------
_resolved: dict[tuple, tuple[Any, Kernel]] = {}


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def resolve(spec: AttentionSpec, q: TensorInfo, k: TensorInfo) -> Kernel:
    """The kernel a call runs: memoized per (spec, shape bucket, device) while the tuning database
    is unchanged."""
    from attngen.tune import lookup

    device = q.device
    if spec.fully_configured:
        key = (spec, device)
        stamp = None
    else:
        key = (spec, _bucket(max(q.shape[1], k.shape[1])), _bucket(q.shape[0] * q.shape[2]), device)
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
    if plan is None:
        plan = families.plan_spec(spec, target)
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
        plan = family.plan(spec.problem, target, family.default_config(spec.problem, target))
        if family.accepts(plan, call) is None:
            return kernel_for(plan, kernel.device)
    raise ValueError(f"no kernel family can run these tensors ({kernel.plan.family}: {reason})")


# Calls whose inputs have the layout of an earlier checked call skip the checks and the resolution:
# (spec, scale, each input's shape, strides, dtype and device) -> (tuning stamp, kernel, scale).
_checked: dict[tuple, tuple[Any, Kernel, float]] = {}
MAX_CHECKED = 4096


def forward(q, k, v, spec: AttentionSpec, *, softmax_scale: float | None = None, out=None, lse=None):
    """The forward pass on torch CUDA tensors or CuPy arrays: (out, lse), launched on the caller's
    current stream. Checks every input against the kernel contract first."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    qi, ki, vi = describe(q, "q"), describe(k, "k"), describe(v, "v")
    layout = None
    if out is None and lse is None and not (qi.ptr % 16 or ki.ptr % 16 or vi.ptr % 16):
        from attngen.tune import lookup

        layout = (spec, softmax_scale, targets.device_target(qi.device), qi.shape, qi.strides, qi.dtype, qi.device,
                  ki.shape, ki.strides, ki.dtype, ki.device, vi.shape, vi.strides, vi.dtype, vi.device)
        hit = _checked.get(layout)
        if hit is not None and (spec.fully_configured or hit[0] == lookup.recent_stamp()):
            _, kernel, scale = hit
            B, Sq, Hq, D = qi.shape
            out, lse = new_like(q, (B, Sq, Hq, D)), new_like(q, (B, Hq, Sq), "float32")
            call = ForwardCall(qi, ki, vi, describe(out, "out"), describe(lse, "lse"), scale)
            kernel.run(call, current_stream(q, qi.device))
            return out, lse
    checks.check_inputs(spec.problem, qi, ki, vi)
    kernel = resolve(spec, qi, ki)
    out, lse, call = _outputs_and_call(kernel.plan, q, qi, ki, vi, out, lse, softmax_scale)
    reason = kernel.family.accepts(kernel.plan, call)
    if reason is not None:
        kernel = _fallback(spec, kernel, call, reason)
    if layout is not None:
        from attngen.tune import lookup

        if len(_checked) >= MAX_CHECKED:
            _checked.clear()
        _checked[layout] = (None if spec.fully_configured else lookup.recent_stamp(), kernel, call.softmax_scale)
    kernel.run(call, current_stream(q, qi.device))
    return out, lse
