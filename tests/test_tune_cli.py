"""`attngen check --configs` and the parts of `attngen tune` that need no GPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from attngen.cli import main
from attngen.nvcc import ResourceReport, nvcc_available
from attngen.plan import make_plan
from attngen.spec import AttentionSpec, TileConfig
from attngen.tune.db import TuningDB, TuningEntry, TuningKey
from attngen.tune.model import Shape

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def spec_file(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


def gpu_absent() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


@needs_nvcc
def test_check_configs_compiles_and_ranks_a_narrow_space(tmp_path):
    # Two configs (4 or 8 warps): a real nvcc run, kept small for CI.
    spec = spec_file(tmp_path, head_dim=64, block_m=128, block_n=64, num_stages=2)
    result = invoke("check", "--configs", "--arch", "sm_90", "--seqlen", "2048", spec)
    assert result.exit_code == 0, result.output
    assert "m128n64w4s2" in result.output and "m128n64w8s2" in result.output
    assert "2 of 2 survive" in result.output and "b8h32s2048" in result.output
    rows = [line for line in result.output.splitlines() if "m128n64w" in line]
    assert all(" ok" in line for line in rows), rows


def test_check_configs_shows_pruning_reasons(tmp_path, monkeypatch):
    import attngen.nvcc
    import attngen.tune.ranking

    def fake_reports(candidates, arch, jobs=None, on_done=None):
        out = []
        for c in candidates:
            if not c.launchable:
                out.append(None)
                continue
            plan = make_plan(c.spec, arch)
            spills = 16 if c.spec.block_n == 128 else 0  # pretend the widest tiles spill
            out.append(ResourceReport(plan.name, arch, 168, 0, 0, spills, spills, plan.smem_bytes))
        return out

    monkeypatch.setattr(attngen.nvcc, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(attngen.nvcc, "nvcc_version", lambda: "0.0")
    monkeypatch.setattr(attngen.tune.ranking, "compile_reports", fake_reports)
    spec = spec_file(tmp_path, head_dim=128, mask="causal")
    result = invoke("check", "--configs", "--arch", "sm_90", "--batch-heads", "32", spec)
    assert result.exit_code == 0, result.output
    assert "spills 16/16 B" in result.output and "plan: tile config" in result.output
    assert "occupancy:" in result.output and "b1h32s4096" in result.output
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in result.output.splitlines() if "│" in line]
    cells = [c for c in cells if c[0]]  # not the continuation lines of a wrapped verdict
    assert [c[0] for c in cells[:3]] == ["1", "2", "3"] and cells[-1][0] == "-"  # survivors first, ranked
    predicted = [float(c[7]) for c in cells if c[0] != "-"]
    assert predicted == sorted(predicted)


def test_tune_without_gpu_exits_2(tmp_path):
    if not gpu_absent():
        pytest.skip("a GPU is present: tune would run")
    result = invoke("tune", spec_file(tmp_path, head_dim=64), "--seqlen", "1024", "--db", tmp_path / "t.db")
    assert result.exit_code == 2 and "GPU" in result.output
    assert not (tmp_path / "t.db").exists()


def test_tune_export_and_import_need_no_gpu(tmp_path):
    src = TuningDB(tmp_path / "src.sqlite3")
    key = TuningKey.for_shape(AttentionSpec(head_dim=64), Shape(4, 4096, 4096, 32), "NVIDIA H100", "sm_90", "nvrtc-13.0")
    src.put(TuningEntry(key, TileConfig(128, 128, 4, 2), 1.0, 300.0, "b4h32s4096", 30, 128, "0.1.0",
                        "2026-11-22T10:00:00+00:00"))
    export = tmp_path / "x.json"
    result = invoke("tune", "--db", src.path, "--export", export)
    assert result.exit_code == 0, result.output
    assert json.loads(export.read_text())["entries"][0]["block_m"] == 128
    result = invoke("tune", "--db", tmp_path / "dst.sqlite3", "--import", export)
    assert result.exit_code == 0, result.output
    assert "imported 1 entries" in result.output and "not written" not in result.output
    assert TuningDB(tmp_path / "dst.sqlite3").entries() == src.entries()
    src.put(dataclasses.replace(src.entries()[0], updated="2026-11-23T10:00:00+00:00"))
    result = invoke("tune", "--db", src.path, "--import", export)
    assert result.exit_code == 0, result.output
    assert "imported 1 entries" in result.output
    assert "(1 older than the entries already there: not written)" in result.output


@pytest.mark.parametrize("where, why", [
    ("missing/x.json", "directory {tmp}/missing does not exist"),
    ("file.txt/x.json", "{tmp}/file.txt is not a directory"),
])
def test_tune_export_path_is_checked_before_anything_runs(tmp_path, where, why):
    (tmp_path / "file.txt").write_text("")
    spec = spec_file(tmp_path, head_dim=64)
    result = invoke("tune", spec, "--db", tmp_path / "t.sqlite3", "--export", tmp_path / where)
    assert result.exit_code == 2, result.output  # a usage error, before the GPU check or any tuning
    assert "--export" in result.output and str(tmp_path / where) in result.output
    assert why.format(tmp=tmp_path) in result.output and "allowed: a file path in an existing" in result.output
    assert not (tmp_path / "t.sqlite3").exists()


def test_tune_refuses_a_narrowed_spec_without_store_narrowed_before_anything_runs(tmp_path):
    spec = spec_file(tmp_path, head_dim=64, block_n=64, num_stages=2)
    result = invoke("tune", spec, "--db", tmp_path / "t.sqlite3")
    assert result.exit_code == 1 and result.output.startswith(f"error: {spec}: pins block_n=64, num_stages=2")
    assert "--store-narrowed" in result.output and not (tmp_path / "t.sqlite3").exists()


@pytest.mark.parametrize("args, message", [
    ((), "give at least one SPEC"),
    (("--budget", "0"), "--budget"),
    (("--max-fraction", "1.5"), "--max-fraction"),
])
def test_tune_bad_arguments(tmp_path, args, message):
    result = invoke("tune", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_tune_batch_heads_must_fit_the_gqa_ratio(tmp_path):
    result = invoke("tune", spec_file(tmp_path, head_dim=64, gqa_ratio=4), "--batch-heads", "6")
    assert result.exit_code == 2
    assert "--batch-heads" in result.output and "gqa_ratio=4" in result.output


def test_tune_import_of_a_bad_file_is_a_clean_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    result = invoke("tune", "--db", tmp_path / "t.sqlite3", "--import", bad)
    assert result.exit_code == 1 and result.output.startswith("error: ") and str(bad) in result.output


def test_check_shape_options_need_configs(tmp_path):
    result = invoke("check", "--seqlen", "1024", spec_file(tmp_path, head_dim=64))
    assert result.exit_code == 2 and "only apply with --configs" in result.output
