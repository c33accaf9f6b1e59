"""Every spec in specs/: generated/ holds exactly its current rendering, and nvcc compiles it
for sm_80 and sm_90a with no register spills (the ptxas resource report)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

import attngen
from attngen.cli import kernel_files
from attngen.nvcc import nvcc_available
from attngen.plan import SMEM_LIMIT
from attngen.spec import ARCHS

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
GENERATED = ROOT / "generated"
REGENERATE = "run `attngen generate --prune specs/*.yaml` and commit generated/"


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


# -- nvcc: all compiles run once, in parallel, the first time any test asks --------------------
# The runtime compiles a spec for whatever GPU it runs on (a spec that pins sm_90 keeps its
# tiles on an A100), so every spec is compiled for every arch.
TARGETS = [(p, arch) for p in SPECS for arch in ARCHS]


@lru_cache(maxsize=None)
def compile_all() -> dict:
    from attngen.cli import check_spec

    def run(target):
        path, arch = target
        try:
            return check_spec(attngen.load_spec(path), arch)
        except Exception as exc:  # reported by the test of that target
            return exc

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(TARGETS, pool.map(run, TARGETS)))


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("spec_path, arch", TARGETS, ids=[f"{spec_id(p)}-{a}" for p, a in TARGETS])
def test_compiles_without_spills(spec_path: Path, arch: str):
    report = compile_all()[(spec_path, arch)]
    if isinstance(report, Exception):
        pytest.fail(f"{spec_path.name} does not compile for {arch}: {report}")
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, (
        f"{report.name} on {arch} spills ({report.spill_store_bytes} B stores, {report.spill_load_bytes} B loads, "
        f"{report.registers} registers): lower the tile or keep Q in shared memory\n{report.log}"
    )
    assert report.smem_total_bytes <= SMEM_LIMIT[arch], (
        f"{report.name} needs {report.smem_total_bytes} B of shared memory; {arch} allows {SMEM_LIMIT[arch]} B"
    )
