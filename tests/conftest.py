"""Shared test configuration: GPU tests (marker `gpu`) skip where no CUDA GPU with CuPy is present, and
run once per kernel family the GPU runs (`gpu_family`, `gpu_spec`, `gpu_default_spec`); a stand-in
compute-sanitizer; a kernel family that needs sm_90a, registered only for the tests that ask for it."""

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


@functools.lru_cache(maxsize=None)
def gpu_target():
    """The target the GPU tests are parametrized for: this GPU's, or the default arch's where there is no
    GPU (they are collected there, and skipped)."""
    from attngen import targets

    if gpu_unavailable_reason() is None:
        import torch

        return targets.device_target(torch.cuda.current_device())
    return targets.target(targets.DEFAULT_ARCH)


def pytest_generate_tests(metafunc):
    """GPU tests run for every kernel family the GPU runs: a test taking `gpu_family` runs once per family
    that runs a problem of the fuzzer's built-in pool here, `gpu_spec` once per spec of that pool, and
    `gpu_default_spec` once per spec of it with the family's default config (attngen/fuzz/pool.py)."""
    wanted = {"gpu_family", "gpu_spec", "gpu_default_spec"} & set(metafunc.fixturenames)
    if not wanted:
        return
    from attngen import families
    from attngen.fuzz.pool import builtin_specs

    from attngen.families.base import problem_inputs

    target = gpu_target()
    # Specs whose expressions read runtime inputs need them drawn per case: the fuzzer does that
    # (attngen/fuzz/case.py), and tests/test_gpu_masks.py tests them directly.
    pool = [spec for spec in builtin_specs(target) if not problem_inputs(spec.problem)]
    if "gpu_family" in wanted:
        metafunc.parametrize("gpu_family", list(dict.fromkeys(spec.family for spec in pool)))
    for name, specs in (("gpu_spec", pool), ("gpu_default_spec", [s for s in pool if s.config is None])):
        if name in wanted:
            metafunc.parametrize(name, specs, ids=[families.plan_spec(s, target).name for s in specs])


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
if [ "$2" = memcheck ] || [ "$2" = synccheck ]; then echo "========= ERROR SUMMARY: ${FAKE_ERRORS:-0} errors"; fi
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


@pytest.fixture
def sm90a_only_family(monkeypatch):
    """A kernel family that needs sm_90a (as a wgmma/TMA family does), registered first in preference
    for this test only: fwd_sm80's kernel under another name, claiming to need sm_90a."""
    from attngen import families
    from attngen.families.fwd_sm80.family import Sm80Forward

    class Sm90aOnly(Sm80Forward):
        name = "fwd_test_sm90a"
        description = "test double: needs sm_90a"

        def supports(self, problem, target):
            if target.name != "sm_90a":
                return f"needs sm_90a (wgmma, setmaxnreg), not {target.name}"
            return super().supports(problem, target)

    family = Sm90aOnly()
    monkeypatch.setattr(families, "FAMILIES", {family.name: family, **families.FAMILIES})
    return family



@pytest.fixture
def other_family():
    """A second family for tuner tests: fwd_sm80's kernel under another name, on sm_90 and newer only."""
    from attngen.families.fwd_sm80.family import Sm80Forward

    class OtherFamily(Sm80Forward):
        name = "fwd_other"

        def supports(self, problem, target):
            return None if target.cc >= 90 else f"needs sm_90 or newer, not {target.name}"

    return OtherFamily()


@pytest.fixture
def sm80_only(monkeypatch):
    """The registry holds fwd_sm80 alone (tuner tests count its configs) unless a test says otherwise."""
    from attngen import families

    monkeypatch.setattr(families, "FAMILIES", {"fwd_sm80": families.get_family("fwd_sm80")})
