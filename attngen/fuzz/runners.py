"""The thing under test: a callable that fills `out` and `lse` for one case.

A runner has a `device` (where the harness puts tensors), an `arch` (the spec arch family
its kernels resolve tiles for), a `machine` (what a reproducer records about where it ran),
`kernel_name(spec)` and is called as `runner(spec, q, k, v, out=..., lse=..., softmax_scale=...)`.
`KernelRunner` is the real one; `ReferenceRunner` runs the reference through the same harness,
so the whole find -> shrink -> reproduce -> replay path can be exercised without a GPU; tests
wrap either to build deliberately broken runners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from attngen import reference
from attngen.plan import make_plan
from attngen.spec import AttentionSpec


@dataclass(frozen=True)
class Machine:
    """Where a runner's kernels run: recorded in reproducers and compared when they are replayed."""

    arch: str  # the spec arch family its kernels resolve tiles for: "sm_80" or "sm_90"
    target: str | None = None  # the exact compile target, e.g. "sm_86"; None when nothing is compiled
    gpu: str | None = None  # the device's name
    nvrtc: str | None = None  # the compiler, as the compile cache keys it ("nvrtc-12.4")


class Runner(Protocol):
    device: str
    arch: str
    machine: Machine

    def kernel_name(self, spec: AttentionSpec) -> str: ...

    def __call__(self, spec: AttentionSpec, q, k, v, *, out, lse, softmax_scale: float | None) -> None: ...


class KernelRunner:
    """The compiled kernel on the current CUDA device; `fault` (attngen/faults.py) breaks it on purpose.

    `launched` lists the kernel symbols launched so far, in order: a replay under compute-sanitizer
    prints them, so the parent can tell the instrumented kernel really ran."""

    def __init__(self, fault: str | None = None):
        from attngen.compiler import nvrtc_version
        from attngen.faults import check_fault
        from attngen.runtime import _device_arch

        if not torch.cuda.is_available():
            raise RuntimeError("attngen fuzz runs kernels on a CUDA GPU, and torch.cuda.is_available() is False")
        try:
            import cupy  # noqa: F401 - checked now, not as a crash in every case
        except ImportError as exc:
            raise RuntimeError(f"attngen fuzz needs CuPy to launch kernels (e.g. pip install cupy-cuda12x): {exc}") from None
        # One device for everything: the harness's tensors, the arch the plans resolve for, the compile.
        self.device_index = torch.cuda.current_device()
        self.device = f"cuda:{self.device_index}"
        family, target = _device_arch(self.device_index)
        self.arch = family
        self.machine = Machine(family, target, torch.cuda.get_device_name(self.device_index), nvrtc_version())
        self.fault = check_fault(fault)
        self.launched: list[str] = []

    def kernel_name(self, spec: AttentionSpec) -> str:
        return make_plan(spec, self.arch, fault=self.fault).name

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None) -> None:
        from attngen.runtime import compile as compile_kernel

        kernel = compile_kernel(spec, self.device_index, fault=self.fault)
        kernel(q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
        self.launched.append(kernel.plan.name)
        torch.cuda.synchronize(self.device_index)  # an asynchronous launch error surfaces here, in this case


class ReferenceRunner:
    """The float32 reference as the thing under test: correct by construction, runs on the CPU."""

    device = "cpu"
    arch = "sm_90"
    machine = Machine(arch)

    def kernel_name(self, spec: AttentionSpec) -> str:
        return make_plan(spec, self.arch).name

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None) -> None:
        o, l = reference.attention_for_spec(q, k, v, spec, softmax_scale=softmax_scale, return_lse=True,
                                            compute_dtype=torch.float32)
        out.copy_(o)
        lse.copy_(l)
