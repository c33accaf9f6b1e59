"""Tensor maps (TMA descriptors) for BSHD tensors, encoded on the host with cuda-python; the sm_90
families' loads (fwd_sm90's q, k, v, out; decode_sm80's K/V cache on sm_90) take them.

A (B, S, H, D) tensor with any 16-byte-aligned strides is described as a 4-d tiled map
(D, S, H, B), innermost first, with a box of 64 columns (128 bytes, the 128-byte swizzle's
span) by `rows` sequence positions of one head of one batch. Reads past S or D come back as
zeros; stores past them are dropped. Encoding costs microseconds, so maps are memoized by
everything they depend on: a training loop that reuses its buffers encodes each once.
"""

from __future__ import annotations

import ctypes
import functools

from attngen.errors import MissingDependency

BOX_COLUMNS = 64
MAX_DIM = 2**32
MAX_STRIDE_BYTES = 2**40


def describable(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> str | None:
    """None when TMA can describe this (B, S, H, D) tensor, else why not."""
    if any(n > MAX_DIM for n in shape):
        return f"a dimension of shape {shape} exceeds 2^32"
    if any(s * itemsize >= MAX_STRIDE_BYTES or s * itemsize % 16 for s in strides[:3]):
        return f"strides {strides} are not multiples of 16 bytes below 2^40"
    return None


@functools.lru_cache(maxsize=1024)
def encode(dtype_code: int, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
           rows: int) -> bytes:
    """The 128 bytes of a CUtensorMap over a (B, S, H, D) tensor: box (64 columns x `rows` rows)."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise MissingDependency('the sm_90 kernels encode TMA descriptors with cuda-python: pip install '
                                f'"attngen[cuda13]" (or [cuda12]) ({exc})') from None
    B, S, H, D = shape
    dims = [driver.cuuint64_t(n) for n in (D, S, H, B)]
    stride_bytes = [driver.cuuint64_t(s * itemsize) for s in (strides[1], strides[2], strides[0])]
    box = [driver.cuuint32_t(n) for n in (BOX_COLUMNS, rows, 1, 1)]
    ones = [driver.cuuint32_t(1)] * 4
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(dtype_code), 4, ptr, dims, stride_bytes, box, ones,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused a tensor of shape {shape}, strides {strides} "
                         f"(elements) at {ptr:#x}: {err}")
    return ctypes.string_at(tensor_map.getPtr(), 128)
