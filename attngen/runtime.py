"""Launch compiled kernels on torch tensors or CuPy arrays.

`compile(spec)` renders, compiles (cached) and loads the kernel for the current GPU;
`attention(q, k, v, spec)` validates the inputs against the spec and the kernel
contract (DESIGN.md section 3), launches on the current stream and returns new outputs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from attngen import compiler
from attngen.plan import KernelPlan, make_plan
from attngen.render import render_plan
from attngen.spec import FLOAT32_MAX, FLOAT32_MIN_NORMAL, AttentionSpec

LOG2E = 1.4426950408889634
_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16"}
MAX_GRID_YZ = 65535


def arch_family(target: str) -> str:
    """The spec arch a compile target runs as: sm_86 -> "sm_80", sm_90a or sm_100 -> "sm_90"."""
    return "sm_90" if int(target.removeprefix("sm_").rstrip("a")) >= 90 else "sm_80"


def _device_arch(device_index: int) -> tuple[str, str]:
    """(spec arch family, exact compile target) of a CUDA device, e.g. ("sm_90", "sm_90")."""
    import cupy

    cc = int(cupy.cuda.Device(device_index).compute_capability)
    if cc < 80:
        raise ValueError(f"device cuda:{device_index} has compute capability {cc // 10}.{cc % 10}; "
                         "attngen kernels need sm_80 or newer (Ampere, Ada, Hopper)")
    target = f"sm_{cc}"
    return arch_family(target), target


class Kernel:
    """A loaded forward kernel for one resolved spec on one compile target."""

    def __init__(self, plan: KernelPlan, target: str):
        import cupy

        self.plan = plan
        self.spec = plan.spec
        self.target = target
        self.source = render_plan(plan)
        binary = compiler.cached_compile(plan.name, self.source, target, compiler.NVRTC_OPTIONS,
                                         compiler.nvrtc_version(), compiler.nvrtc_compile)
        self.binary_path = binary.path
        self._module = cupy.RawModule(path=str(binary.path))
        self._function = self._module.get_function(plan.name)
        self._function.max_dynamic_shared_size_bytes = plan.smem_bytes

    def __repr__(self) -> str:
        return f"Kernel({self.plan.name}, target={self.target})"

    def __call__(self, q, k, v, *, softmax_scale: float | None = None, out=None, lse=None):
        """Run on validated inputs; `out`/`lse` may be given (tests poison them first)."""
        import cupy

        qi, ki, vi = (_describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        _check_inputs(self.spec, qi, ki, vi)
        B, Sq, Hq, D = qi.shape
        Sk = ki.shape[1]
        if out is None:
            out = _new_like(q, (B, Sq, Hq, D), None)
        if lse is None:
            lse = _new_like(q, (B, Hq, Sq), "float32")
        oi, li = _describe(out, "out"), _describe(lse, "lse")
        _check_output(oi, qi, (B, Sq, Hq, D), qi.dtype, "out")
        _check_output(li, qi, (B, Hq, Sq), "float32", "lse")
        if li.strides != (Hq * Sq, Sq, 1):
            raise ValueError(f"lse must be contiguous with shape {(B, Hq, Sq)}, got strides {li.strides}")
        if B == 0 or Sq == 0 or Hq == 0:
            return out, lse
        scale = self.spec.effective_scale if softmax_scale is None else _check_scale(softmax_scale, self.spec)
        grid = (math.ceil(Sq / self.plan.block_m), Hq, B)
        args = (
            np.uint64(qi.ptr), np.uint64(ki.ptr), np.uint64(vi.ptr), np.uint64(oi.ptr), np.uint64(li.ptr),
            np.int32(Sq), np.int32(Sk), np.int32(Hq),
            *(np.int64(s) for s in (qi.strides[0], qi.strides[1], qi.strides[2])),
            *(np.int64(s) for s in (ki.strides[0], ki.strides[1], ki.strides[2])),
            *(np.int64(s) for s in (vi.strides[0], vi.strides[1], vi.strides[2])),
            *(np.int64(s) for s in (oi.strides[0], oi.strides[1], oi.strides[2])),
            np.float32(scale * LOG2E),
        )
        with cupy.cuda.Device(qi.device), _stream_for(q):
            self._function(grid, (self.plan.threads, 1, 1), args, shared_mem=self.plan.smem_bytes)
        return out, lse


_kernels: dict[tuple[AttentionSpec, str, str | None], Kernel] = {}
_kernels_lock = threading.Lock()


def compile(spec: AttentionSpec, device: int | None = None, *, fault: str | None = None) -> Kernel:
    """Render, compile (disk-cached) and load `spec` for a GPU (default: the current one).
    `fault` names a deliberate bug from attngen/faults.py, for testing the fuzzer."""
    import cupy

    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    device = cupy.cuda.runtime.getDevice() if device is None else device
    family, target = _device_arch(device)
    plan = make_plan(spec, family, fault=fault)
    key = (plan.spec, target, fault)
    with _kernels_lock:
        kernel = _kernels.get(key)
        if kernel is None:
            with cupy.cuda.Device(device):
                kernel = _kernels[key] = Kernel(plan, target)
    return kernel


def attention(q, k, v, spec: AttentionSpec, *, softmax_scale: float | None = None, return_lse: bool = False):
    """FlashAttention forward: q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) -> o like q (and LSE (B, Hq, Sq)).
    A spec with no tile field set runs the tile `attngen tune` found for this shape's bucket, if any."""
    from attngen.tune.lookup import tuned_spec

    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    qi = _describe(q, "q")
    _reject_autograd(q, k, v)
    spec = tuned_spec(spec, qi.shape, getattr(k, "shape", ()), qi.device)
    out, lse = compile(spec, qi.device)(q, k, v, softmax_scale=softmax_scale)
    return (out, lse) if return_lse else out


# -- tensor adapters ----------------------------------------------------------

@dataclass(frozen=True)
class _Info:
    name: str
    kind: str  # "torch" or "cupy"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # numpy-style name
    device: int


def _describe(x: Any, name: str) -> _Info:
    mod = type(x).__module__
    if mod.startswith("torch"):
        if not x.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
        return _Info(name, "torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                     str(x.dtype).removeprefix("torch."), x.device.index)
    if mod.startswith("cupy"):
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError(f"{name} has strides {x.strides} bytes that are not multiples of its item size")
        return _Info(name, "cupy", x.data.ptr, tuple(x.shape), tuple(s // item for s in x.strides),
                     x.dtype.name, x.device.id)
    raise ValueError(f"{name} must be a torch CUDA tensor or a CuPy array, got {type(x).__name__}")


def _new_like(ref, shape, dtype_name):
    if type(ref).__module__.startswith("torch"):
        import torch

        dtype = ref.dtype if dtype_name is None else getattr(torch, dtype_name)
        return torch.empty(shape, dtype=dtype, device=ref.device)
    import cupy

    return cupy.empty(shape, dtype=ref.dtype if dtype_name is None else dtype_name)


def _stream_for(x):
    import cupy

    if type(x).__module__.startswith("torch"):
        import torch

        stream = torch.cuda.current_stream(x.device)
        if hasattr(stream, "__cuda_stream__"):
            return cupy.cuda.Stream.from_external(stream)
        return cupy.cuda.ExternalStream(stream.cuda_stream)
    return cupy.cuda.get_current_stream()


def _reject_autograd(*tensors) -> None:
    for name, x in zip("qkv", tensors):
        if getattr(x, "requires_grad", False):
            import torch

            if torch.is_grad_enabled():
                raise ValueError(f"{name} requires grad, but attngen has no backward kernel yet; "
                                 "call under torch.no_grad() or detach the inputs")


def _check_scale(scale, spec: AttentionSpec) -> float:
    # The kernel takes the scale as float32: the same range the spec accepts, so it never rounds to 0 or inf.
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or not FLOAT32_MIN_NORMAL <= scale <= FLOAT32_MAX):
        raise ValueError(f"softmax_scale={scale!r} is invalid; allowed: a float in "
                         f"[{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}] or None")
    if spec.softmax_scale is not None and scale != spec.softmax_scale:
        raise ValueError(f"softmax_scale={scale!r} conflicts with the spec's softmax_scale={spec.softmax_scale!r}; "
                         "allowed: None or the spec's value")
    return float(scale)


def _check_inputs(spec: AttentionSpec, q: _Info, k: _Info, v: _Info) -> None:
    want = _DTYPE_NAMES[spec.dtype]
    for t in (q, k, v):
        if len(t.shape) != 4:
            raise ValueError(f"{t.name} must have 4 dims (batch, seq, heads, head_dim), got shape {t.shape}")
        if t.dtype != want:
            raise ValueError(f"{t.name} has dtype {t.dtype}, but the spec's dtype is {spec.dtype} ({want})")
        if t.shape[3] != spec.head_dim:
            raise ValueError(f"{t.name} has head_dim {t.shape[3]} (shape {t.shape}), but the spec's head_dim "
                             f"is {spec.head_dim}")
        if t.strides[3] != 1:
            raise ValueError(f"{t.name} must be contiguous in its last dim, got strides {t.strides}")
        # cp.async moves 16-byte chunks: every row must start 16-byte aligned.
        if t.ptr % 16 or any(s % 8 for s in t.strides[:3]):
            raise ValueError(f"{t.name} rows must be 16-byte aligned (data pointer and batch/seq/head strides "
                             f"multiples of 8 elements), got strides {t.strides}; pass .contiguous()")
        if t.device != q.device:
            raise ValueError(f"{t.name} is on cuda:{t.device} but q is on cuda:{q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    B, Sq, Hq, _ = q.shape
    Hkv, Sk = k.shape[2], k.shape[1]
    if Hkv == 0 or Hq != spec.gqa_ratio * Hkv:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}; the spec's gqa_ratio={spec.gqa_ratio} needs "
                         f"Hq == gqa_ratio * Hkv")
    if Sk < 1:
        raise ValueError(f"k/v have sequence length {Sk}; allowed: >= 1")
    for what, n, limit in (("q seq len", Sq, 2**31 - 1), ("k seq len", Sk, 2**31 - 1),
                           ("q heads", Hq, MAX_GRID_YZ), ("batch", B, MAX_GRID_YZ)):
        if n > limit:
            raise ValueError(f"{what} {n} exceeds the supported maximum {limit}")


def _check_output(t: _Info, q: _Info, shape, dtype: str, name: str) -> None:
    if t.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {t.shape}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on cuda:{t.device} but q is on cuda:{q.device}")
    if name == "out" and (t.strides[-1] != 1 or t.ptr % 16 or any(s % 8 for s in t.strides[:-1])):
        raise ValueError(f"out must be 16-byte aligned and contiguous in its last dim, got strides {t.strides}")
