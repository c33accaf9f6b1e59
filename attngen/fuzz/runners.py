"""The thing under test: a callable that fills `out` and `lse` for one case.

A runner has a `device` (where the harness puts tensors), a `target` (the attngen.targets.Target
its kernels are planned and compiled for), a `machine` (what a reproducer records about where it
ran), `kernel_name(spec)` (the name of the plan it runs for a spec) and is called as
`runner(spec, q, k, v, out=..., lse=..., softmax_scale=...)`; `backward_name(spec)` (the backward
plan's name, None where no backward family runs the spec) and `backward(spec, q, k, v, out, lse,
dout, dq=..., dk=..., dv=..., softmax_scale=...)` run the gradients, which run_case checks too;
`compile_ahead(pool)` builds every kernel the pool's cases run before the first one
(attngen/fuzz/compile_ahead.py; None where nothing is compiled). `KernelRunner` is the real one;
`ReferenceRunner` runs the reference through the same harness, so the whole find -> shrink ->
reproduce -> replay path can be exercised without a GPU; tests wrap either to build deliberately
broken runners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from attngen import reference, targets
from attngen.families import plan_spec
from attngen.spec import AttentionSpec
from attngen.targets import Target


@dataclass(frozen=True)
class Machine:
    """Where a runner's kernels run: recorded in reproducers and compared when they are replayed."""

    target: str | None = None  # the exact compile target, e.g. "sm_90a"
    gpu: str | None = None  # the device's name; None when nothing runs on a GPU
    nvrtc: str | None = None  # the compiler, as the compile cache keys it ("nvrtc-12.4")


class Runner(Protocol):
    device: str
    target: Target
    machine: Machine

    def kernel_name(self, spec: AttentionSpec) -> str: ...

    def __call__(self, spec: AttentionSpec, q, k, v, *, out, lse, softmax_scale: float | None,
                 inputs: dict | None = None) -> None: ...

    def backward_name(self, spec: AttentionSpec) -> str | None: ...

    def backward(self, spec: AttentionSpec, q, k, v, out, lse, dout, *, dq, dk, dv, softmax_scale: float | None,
                 inputs: dict | None = None) -> None: ...

    def compile_ahead(self, pool): ...


def backward_plan_name(spec: AttentionSpec, target: Target) -> str | None:
    """The backward plan a spec gets on `target` (runtime/backward.py backward_plan), None when no
    backward family runs it."""
    from attngen.errors import SpecError
    from attngen.runtime.backward import backward_plan

    try:
        return backward_plan(spec, target).name
    except SpecError:
        return None


def cuda_device() -> tuple[int, Target, Machine]:
    """(index, target, machine) of the current CUDA device: one device for everything, the harness's
    tensors, the target the plans are made for, the compile. RuntimeError saying why there is none."""
    from attngen.build import compiler
    from attngen.errors import MissingDependency, require_cupy

    if not torch.cuda.is_available():
        raise RuntimeError("attngen fuzz runs kernels on a CUDA GPU, and torch.cuda.is_available() is False")
    try:
        require_cupy()  # checked now, not as a crash in every case
    except MissingDependency as exc:
        raise RuntimeError(str(exc)) from None
    index = torch.cuda.current_device()
    try:
        target = targets.device_target(index)
    except ValueError as exc:  # a GPU older than any family supports
        raise RuntimeError(str(exc)) from None
    return index, target, Machine(target.name, torch.cuda.get_device_name(index), compiler.nvrtc_version())


class KernelRunner:
    """The compiled kernel on the current CUDA device; `fault` (attngen/faults.py) breaks it on purpose.

    `launched` lists the plans launched so far, by name, in order: a replay under compute-sanitizer
    prints them, so the parent can tell the instrumented kernel really ran."""

    def __init__(self, fault: str | None = None):
        from attngen.faults import check_fault

        self.device_index, self.target, self.machine = cuda_device()
        self.device = f"cuda:{self.device_index}"
        self.fault = check_fault(fault)
        self.launched: list[str] = []

    def kernel_name(self, spec: AttentionSpec) -> str:
        return plan_spec(spec, self.target, fault=self.fault).name

    def compile_ahead(self, pool):
        """Every kernel the pool's cases run, built into the on-disk cache at once (a process per CPU)."""
        from attngen.fuzz.compile_ahead import compile_ahead

        return compile_ahead(pool, self.target, self.fault)

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None, inputs=None) -> None:
        from attngen.runtime import dispatch

        kernel = dispatch.compile(spec, self.device_index, fault=self.fault)
        kernel(q, k, v, out=out, lse=lse, softmax_scale=softmax_scale, inputs=inputs)
        self.launched.append(kernel.plan.name)
        torch.cuda.synchronize(self.device_index)  # an asynchronous launch error surfaces here, in this case

    def backward_name(self, spec):
        return backward_plan_name(spec, self.target)

    def backward(self, spec, q, k, v, out, lse, dout, *, dq, dk, dv, softmax_scale=None, inputs=None) -> None:
        from attngen.runtime.backward import backward

        backward(dout, q, k, v, out, lse, spec, softmax_scale=softmax_scale, inputs=inputs, dq=dq, dk=dk, dv=dv)
        self.launched.append(self.backward_name(spec))
        torch.cuda.synchronize(self.device_index)


class ReferenceRunner:
    """The float32 reference as the thing under test: correct by construction, runs on the CPU. It
    names kernels by the plans the default target (sm_90a) gets."""

    device = "cpu"
    target = targets.target(targets.DEFAULT_ARCH)
    machine = Machine(target.name)

    def kernel_name(self, spec: AttentionSpec) -> str:
        return plan_spec(spec, self.target).name

    def compile_ahead(self, pool) -> None:
        return None  # no kernels

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None, inputs=None) -> None:
        o, l = reference.attention_for_spec(q, k, v, spec, softmax_scale=softmax_scale, return_lse=True,
                                            compute_dtype=torch.float32, inputs=inputs)
        out.copy_(o)
        lse.copy_(l)

    def backward_name(self, spec):
        return backward_plan_name(spec, self.target)

    def backward(self, spec, q, k, v, out, lse, dout, *, dq, dk, dv, softmax_scale=None, inputs=None) -> None:
        scale = spec.effective_scale if softmax_scale is None else softmax_scale
        grads = reference.attention_grads(q, k, v, dout, mask=spec.mask, score_mod=spec.score_mod, sink=spec.sink,
                                          inputs=inputs, gqa_ratio=spec.gqa_ratio, softmax_scale=scale)
        for buffer, grad in zip((dq, dk, dv), grads[:3]):
            buffer.copy_(grad)
