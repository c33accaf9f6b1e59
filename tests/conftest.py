"""Shared test configuration: GPU tests (marker `gpu`) skip where no CUDA GPU with CuPy is present."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
