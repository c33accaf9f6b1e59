"""The thing under test: a callable that fills `out` and `lse` for one case.

A runner has a `device` (where the harness puts tensors), an `arch` (the spec arch family
its kernels resolve tiles for), `kernel_name(spec)` and is called as
`runner(spec, q, k, v, out=..., lse=..., softmax_scale=...)`. `KernelRunner` is the real
one; `ReferenceRunner` runs the reference through the same harness, so the whole
find -> shrink -> reproduce -> replay path can be exercised without a GPU; tests wrap either
to build deliberately broken runners.
"""

from __future__ import annotations

from typing import Protocol

import torch

from attngen import reference
from attngen.plan import make_plan
from attngen.spec import AttentionSpec


class Runner(Protocol):
    device: str
    arch: str

    def kernel_name(self, spec: AttentionSpec) -> str: ...

    def __call__(self, spec: AttentionSpec, q, k, v, *, out, lse, softmax_scale: float | None) -> None: ...


class KernelRunner:
    """The compiled kernel on the current CUDA device; `fault` (attngen/faults.py) breaks it on purpose."""

    device = "cuda"

    def __init__(self, fault: str | None = None):
        from attngen.faults import check_fault

        if not torch.cuda.is_available():
            raise RuntimeError("attngen fuzz runs kernels on a CUDA GPU, and torch.cuda.is_available() is False")
        try:
            import cupy  # noqa: F401 - checked now, not as a crash in every case
        except ImportError as exc:
            raise RuntimeError(f"attngen fuzz needs CuPy to launch kernels (e.g. pip install cupy-cuda12x): {exc}") from None
        major, _ = torch.cuda.get_device_capability()
        self.arch = "sm_90" if major >= 9 else "sm_80"
        self.fault = check_fault(fault)

    def kernel_name(self, spec: AttentionSpec) -> str:
        return make_plan(spec, self.arch, fault=self.fault).name

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None) -> None:
        from attngen.runtime import compile as compile_kernel

        compile_kernel(spec, fault=self.fault)(q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
        torch.cuda.synchronize()  # an asynchronous launch error surfaces here, in this case


class ReferenceRunner:
    """The float32 reference as the thing under test: correct by construction, runs on the CPU."""

    device = "cpu"
    arch = "sm_90"

    def kernel_name(self, spec: AttentionSpec) -> str:
        return make_plan(spec, self.arch).name

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None) -> None:
        o, l = reference.attention_for_spec(q, k, v, spec, softmax_scale=softmax_scale, return_lse=True,
                                            compute_dtype=torch.float32)
        out.copy_(o)
        lse.copy_(l)
