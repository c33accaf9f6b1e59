"""Tensor adapters: what the runtime needs of a torch CUDA tensor or a CuPy array, read once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorInfo:
    name: str  # the argument's name, for errors
    kind: str  # "torch" or "cupy"
    ptr: int  # device address of the first element
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # element-type name: "bfloat16", "float16", "float32", ...
    device: int  # CUDA device index (-1: a tensor off the GPU, as a fake tensor at trace time may be)

    @property
    def where(self) -> str:
        """The device as errors name it."""
        return device_name(self.device)


def device_name(index: int) -> str:
    """A device index as errors name it: cuda:N, or cpu for -1 (torch's index of a CPU tensor)."""
    return "cpu" if index < 0 else f"cuda:{index}"


_TORCH_DTYPE_NAMES: dict = {}


def _torch_dtype_name(dtype) -> str:
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        name = _TORCH_DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def describe(x: Any, name: str) -> TensorInfo:
    """The TensorInfo of a torch CUDA tensor or a CuPy array; ValueError naming `name` otherwise."""
    module = type(x).__module__
    if module.startswith("torch"):
        if not x.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
        return TensorInfo(name, "torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                          _torch_dtype_name(x.dtype), x.get_device())
    if module.startswith("cupy"):
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError(f"{name} has strides {x.strides} bytes that are not multiples of its item size")
        return TensorInfo(name, "cupy", x.data.ptr, tuple(x.shape), tuple(s // item for s in x.strides),
                          x.dtype.name, x.device.id)
    raise ValueError(f"{name} must be a torch CUDA tensor or a CuPy array, got {type(x).__name__}")


def new_like(ref: Any, shape: tuple[int, ...], dtype_name: str | None = None):
    """A new contiguous array of `shape` on `ref`'s device, of `ref`'s kind (torch or CuPy)."""
    if is_torch(ref):
        import torch

        dtype = ref.dtype if dtype_name is None else getattr(torch, dtype_name)
        return torch.empty(shape, dtype=dtype, device=ref.device)
    import cupy

    with cupy.cuda.Device(ref.device.id):
        return cupy.empty(shape, dtype=ref.dtype if dtype_name is None else dtype_name)


def current_stream(ref: Any, device: int) -> int:
    """The raw cudaStream_t the caller's framework would run on now: torch's current stream for
    torch tensors (so attngen orders with the caller's work and CUDA graph capture), else CuPy's."""
    if is_torch(ref):
        import torch

        return torch_stream(torch, device)
    import cupy

    return cupy.cuda.get_current_stream().ptr


def torch_stream(torch, device: int) -> int:
    """torch's current raw cudaStream_t on `device`."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # 0.3 us; the public way takes ~3 us
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
