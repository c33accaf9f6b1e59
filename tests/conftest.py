"""Shared test configuration: GPU tests (marker `gpu`) skip where no CUDA GPU with CuPy is present."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

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


FAKE_SANITIZER = """#!/usr/bin/env bash
# Stands in for compute-sanitizer: logs its arguments to sanitizer-calls.log, echoes them, prints the
# replay's launched-kernel line (the kernel its filter names, or FAKE_LAUNCHED) and the tool's
# summary, and exits like the replay would (FAKE_EXIT).
echo "$*" >> "$(dirname "$0")/sanitizer-calls.log"
echo "args: $*"
echo "caching off: $PYTORCH_NO_CUDA_MEMORY_CACHING"
echo "launched kernel ${FAKE_LAUNCHED:-${4#kns=}}"
sleep "${FAKE_SLEEP:-0}"
if [ "$2" = memcheck ]; then echo "========= ERROR SUMMARY: ${FAKE_ERRORS:-0} errors"; fi
if [ "$2" = racecheck ]; then echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"; fi
exit "${FAKE_EXIT:-0}"
"""


@pytest.fixture
def fake_sanitizer(tmp_path, monkeypatch):
    """A stand-in compute-sanitizer first on PATH: .path is the script, .calls the log of its command lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = bin_dir / "compute-sanitizer"
    path.write_text(FAKE_SANITIZER)
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return SimpleNamespace(path=path, calls=bin_dir / "sanitizer-calls.log")
