"""The element types kernels take, and everything other modules need to know about them.

One table: the spec's name for a type, the torch and CuPy element-type names, the size, the
unit roundoff (attngen/tolerance.py derives its bounds from it) and the TMA data-type code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # the spec's spelling: "bf16"
    torch_name: str  # torch.<torch_name>, and the element-type name tensor adapters report
    itemsize: int
    unit_roundoff: float  # 2^-(mantissa bits + 1)
    tensor_map_code: int  # CUtensorMapDataType: CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6, BFLOAT16 = 9


DTYPES: dict[str, DType] = {
    "fp16": DType("fp16", "float16", 2, 2.0**-11, 6),
    "bf16": DType("bf16", "bfloat16", 2, 2.0**-8, 9),
}


def get_dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype={name!r} is invalid; allowed: {', '.join(DTYPES)}") from None


def torch_dtype(name: str):
    """The torch.dtype of a spec dtype name ("bf16" -> torch.bfloat16)."""
    import torch

    return getattr(torch, get_dtype(name).torch_name)


def spec_dtype_of(element_type: str) -> str | None:
    """The spec's name for a tensor element-type name ("bfloat16" -> "bf16"), None if unsupported."""
    for dtype in DTYPES.values():
        if dtype.torch_name == element_type:
            return dtype.name
    return None
