"""Every spec in specs/: generated/ holds exactly its current rendering, and nvcc compiles it for
sm_80 and sm_90a with no register spills (the ptxas resource report), on tensor cores (its SASS)."""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

import attngen
from attngen import targets
from attngen.build.nvcc import find_cuobjdump, nvcc_available
from attngen.cli import DEFAULT_CHECK_ARCHS, generated_by_attngen, kernel_files
from attngen.families import get_family, plan_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
GENERATED = ROOT / "generated"
REGENERATE = "run `attngen generate --prune specs/*.yaml` and commit generated/"
needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")


def spec_id(path: Path) -> str:
    return path.stem


def test_specs_dir_is_not_empty():
    assert SPECS, f"no spec files in {ROOT / 'specs'}: the checks below would test nothing"


@pytest.mark.parametrize("spec_path", SPECS, ids=spec_id)
def test_generated_is_up_to_date(spec_path: Path):
    for fname, text in kernel_files(attngen.load_spec(spec_path)).items():
        committed = GENERATED / fname
        assert committed.is_file(), f"generated/{fname} is missing for {spec_path.name}: {REGENERATE}"
        assert committed.read_text() == text, f"generated/{fname} differs from {spec_path.name}'s rendering: {REGENERATE}"


def test_generated_has_no_stale_files():
    expected = {f for p in SPECS for f in kernel_files(attngen.load_spec(p))}
    present = {p.name for p in GENERATED.glob("*") if p.suffix in (".cu", ".json")}
    stale = sorted(present - expected)
    assert not stale, f"generated/ holds files no spec in specs/ produces: {stale}: {REGENERATE}"


def test_every_committed_manifest_is_one_prune_recognises():
    # Otherwise `attngen generate --prune` could never remove these files once their spec goes.
    for manifest in GENERATED.glob("*.json"):
        found = generated_by_attngen(manifest)
        assert found is not None and not found.edited, manifest.name
        assert found.source.is_file()


# -- nvcc: all compiles run once, in parallel, the first time any test asks --------------------
# The runtime plans a spec for whatever GPU it runs on (a spec that names sm_90 runs on an A100
# too), so every spec is compiled for every target `attngen check` checks by default that its
# pinned family (if any) runs on: a spec pinning the Hopper backward runs on sm_90a alone, and so does
# one no other family supports (packed sequences tile per sequence on fwd_sm90 alone).
def runs_on(spec_path: Path, arch: str) -> bool:
    from attngen.families import supporting

    spec = attngen.load_spec(spec_path)
    if spec.family is None:
        return bool(supporting(spec.problem, targets.target(arch)))
    return get_family(spec.family).supports(spec.problem, targets.target(arch)) is None


TARGETS = [(p, arch) for p in SPECS for arch in DEFAULT_CHECK_ARCHS if runs_on(p, arch)]


@lru_cache(maxsize=None)
def cubin_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="attngen-test-cubins-"))


@lru_cache(maxsize=None)
def compile_all() -> dict:
    from attngen.cli import check_spec

    def run(target):
        path, arch = target
        try:
            return check_spec(attngen.load_spec(path), arch, keep_cubin=cubin_path(path, arch))
        except Exception as exc:  # reported by the test of that target
            return exc

    cubin_dir()  # made once, before the threads: two first calls of an lru_cache at once would make two
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(TARGETS, pool.map(run, TARGETS)))


def cubin_path(spec_path: Path, arch: str) -> Path:
    return cubin_dir() / f"{spec_path.stem}-{arch}.cubin"


def report_of(spec_path: Path, arch: str):
    report = compile_all()[(spec_path, arch)]
    if isinstance(report, Exception):
        pytest.fail(f"{spec_path.name} does not compile for {arch}: {report}")
    return report


@needs_nvcc
@pytest.mark.parametrize("spec_path, arch", TARGETS, ids=[f"{spec_id(p)}-{a}" for p, a in TARGETS])
def test_compiles_without_spills(spec_path: Path, arch: str):
    report = report_of(spec_path, arch)
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, (
        f"{report.name} on {arch} spills ({report.spill_store_bytes} B stores, {report.spill_load_bytes} B loads, "
        f"{report.registers} registers): lower the tile or keep Q in shared memory\n{report.log}"
    )
    limit = targets.target(arch).smem_per_block
    assert report.smem_total_bytes <= limit, (
        f"{report.name} needs {report.smem_total_bytes} B of shared memory; {arch} allows {limit} B"
    )


def cuobjdump_found() -> bool:
    return find_cuobjdump() is not None


# The tensor-core instruction each family's kernels must be made of (their SASS, read with cuobjdump).
TENSOR_CORE_SASS = {"fwd_sm80": "HMMA", "fwd_sm90": "HGMMA", "decode_sm80": "HMMA", "bwd_sm80": "HMMA",
                    "bwd_sm90": "HGMMA"}


@needs_nvcc
@pytest.mark.skipif(not cuobjdump_found(), reason="cuobjdump not found (on PATH or beside nvcc): .ci/run installs it "
                                                  "from the nvidia-cuda-cuobjdump wheel")
@pytest.mark.parametrize("spec_path, arch", TARGETS, ids=[f"{spec_id(p)}-{a}" for p, a in TARGETS])
def test_sass_runs_on_tensor_cores(spec_path: Path, arch: str):
    from attngen.build.nvcc import sass

    report_of(spec_path, arch)
    family = plan_spec(attngen.load_spec(spec_path), targets.target(arch)).family
    if family not in TENSOR_CORE_SASS:
        pytest.fail(f"add family {family}'s tensor-core SASS instruction to TENSOR_CORE_SASS")
    text = sass(cubin_path(spec_path, arch))
    assert TENSOR_CORE_SASS[family] in text, f"{spec_path.name} on {arch} ({family}): no {TENSOR_CORE_SASS[family]}"


def teardown_module():
    if cubin_dir.cache_info().currsize:
        shutil.rmtree(cubin_dir(), ignore_errors=True)
