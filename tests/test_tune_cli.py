"""`attngen check --configs` and the parts of `attngen tune` that need no GPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from attngen import families
from attngen.build.nvcc import ResourceReport, nvcc_available
from attngen.cli import main
from attngen.families.fwd_sm80.family import Sm80Forward
from attngen.spec import AttentionSpec
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


class OtherFamily(Sm80Forward):
    """A second family: fwd_sm80's kernel under another name, on sm_90 and newer only."""

    name = "fwd_other"

    def supports(self, problem, target):
        return None if target.cc >= 90 else f"needs sm_90 or newer, not {target.name}"


@needs_nvcc
def test_check_configs_compiles_and_ranks_a_narrow_space(tmp_path):
    # Two configs (4 or 8 warps): a real nvcc run, kept small for CI.
    spec = spec_file(tmp_path, head_dim=64, family="fwd_sm80", config={"block_m": 128, "block_n": 64, "num_stages": 2})
    result = invoke("check", "--configs", "--arch", "sm_90", "--seqlen", "2048", spec)
    assert result.exit_code == 0, result.output
    assert "m128n64w4s2" in result.output and "m128n64w8s2" in result.output
    assert "2 of 2 survive" in result.output and "b8h32s2048" in result.output
    assert f"{spec}: sm_90a," in result.output and "families fwd_sm80:" in result.output
    rows = [line for line in result.output.splitlines() if "m128n64w" in line]
    assert len(rows) == 2 and all(" ok" in line and "fwd_sm80" in line for line in rows), rows


def test_check_configs_shows_pruning_reasons_and_every_family(tmp_path, monkeypatch):
    import attngen.build.nvcc
    import attngen.tune.ranking

    def fake_reports(candidates, jobs=None, on_done=None):
        out = []
        for c in candidates:
            if not c.launchable:
                out.append(None)
                continue
            spills = 16 if c.config.block_n == 128 else 0  # pretend the widest tiles spill
            registers = 168 if c.family == "fwd_sm80" else 200
            out.append(ResourceReport(c.plan.name, c.target.name, registers, 0, 0, spills, spills, c.plan.smem_bytes))
        return out

    monkeypatch.setattr(families, "FAMILIES", {"fwd_other": OtherFamily(), "fwd_sm80": families.get_family("fwd_sm80")})
    monkeypatch.setattr(attngen.build.nvcc, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(attngen.build.nvcc, "nvcc_version", lambda: "0.0")
    monkeypatch.setattr(attngen.tune.ranking, "compile_reports", fake_reports)
    spec = spec_file(tmp_path, head_dim=128, mask="causal")
    result = invoke("check", "--configs", "--arch", "sm_90", "--arch", "sm_80", "--batch-heads", "32", spec)
    assert result.exit_code == 0, result.output
    assert "spills 16/16 B" in result.output and "plan: config m" in result.output
    assert "occupancy:" in result.output and "b1h32s4096" in result.output
    assert "families fwd_other, fwd_sm80:" in result.output and "families fwd_sm80:" in result.output
    tables = result.output.split(f"{spec}: ")[1:]
    assert [t.split(",")[0] for t in tables] == ["sm_90a", "sm_80"]
    for table, names in zip(tables, ({"fwd_other", "fwd_sm80"}, {"fwd_sm80"})):
        cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if "│" in line]
        cells = [c for c in cells if c[0]]  # not the continuation lines of a wrapped verdict
        assert [c[0] for c in cells[:3]] == ["1", "2", "3"] and cells[-1][0] == "-"  # survivors first, ranked
        assert {c[1] for c in cells} == names  # the family column
        predicted = [float(c[8]) for c in cells if c[0] != "-"]
        assert predicted == sorted(predicted)


def test_tune_without_gpu_exits_2(tmp_path):
    if not gpu_absent():
        pytest.skip("a GPU is present: tune would run")
    result = invoke("tune", spec_file(tmp_path, head_dim=64), "--seqlen", "1024", "--db", tmp_path / "t.db")
    assert result.exit_code == 2 and "GPU" in result.output
    assert not (tmp_path / "t.db").exists()


def test_tune_export_and_import_need_no_gpu(tmp_path):
    src = TuningDB(tmp_path / "src.sqlite3")
    key = TuningKey.for_shape(AttentionSpec(head_dim=64), Shape(4, 4096, 4096, 32), "NVIDIA H100", "sm_90a",
                              "nvrtc-13.0")
    config = {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 2}
    src.put(TuningEntry(key, "fwd_sm80", config, ("fwd_sm80",), 1.0, 300.0, "b4h32s4096", 30, 128, "0.2.0",
                        "2026-11-22T10:00:00+00:00"))
    export = tmp_path / "x.json"
    result = invoke("tune", "--db", src.path, "--export", export)
    assert result.exit_code == 0, result.output
    [exported] = json.loads(export.read_text())["entries"]
    assert exported["config"] == config and exported["family"] == "fwd_sm80"
    result = invoke("tune", "--db", tmp_path / "dst.sqlite3", "--import", export)
    assert result.exit_code == 0, result.output
    assert "imported 1 entries" in result.output and "not written" not in result.output
    assert TuningDB(tmp_path / "dst.sqlite3").entries() == src.entries()
    src.put(dataclasses.replace(src.entries()[0], updated="2026-11-23T10:00:00+00:00"))
    result = invoke("tune", "--db", src.path, "--import", export)
    assert result.exit_code == 0, result.output
    assert "imported 1 entries" in result.output
    assert "(1 older than the entries already there: not written)" in result.output


def test_tune_export_without_a_database_fails_and_says_so(tmp_path):
    db, export = tmp_path / "none.sqlite3", tmp_path / "x.json"
    result = invoke("tune", "--db", db, "--export", export)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: tuning database {db} does not exist, so there is nothing to export")
    assert "exported" not in result.output and not export.exists() and not db.exists()


def test_tune_import_of_a_version_1_export_migrates_it(tmp_path):
    export = tmp_path / "v1.json"
    row = {"spec": '{"dtype":"bf16","gqa_ratio":1,"head_dim":64,"mask":"none"}', "gpu": "NVIDIA A10", "arch": "sm_86",
           "compiler": "nvrtc-13.0", "seqlen_bucket": 4096, "batch_heads_bucket": 128, "block_m": 128,
           "block_n": 64, "num_warps": 4, "num_stages": 2, "ms": 1.0, "tflops": 300.0, "shape": "b4h32s4096",
           "timed": 30, "space": 128, "attngen_version": "0.1.0", "updated": "2026-11-22T10:00:00+00:00"}
    export.write_text(json.dumps({"format": "attngen-tuning", "version": 1, "entries": [row]}))
    result = invoke("tune", "--db", tmp_path / "t.sqlite3", "--import", export)
    assert result.exit_code == 0, result.output
    [entry] = TuningDB(tmp_path / "t.sqlite3").entries()
    assert (entry.family, entry.searched, entry.key.target) == ("fwd_sm80", ("fwd_sm80",), "sm_86")
    assert entry.label() == "fwd_sm80/m128n64w4s2"


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
    spec = spec_file(tmp_path, head_dim=64, family="fwd_sm80", config={"block_n": 64, "num_stages": 2})
    result = invoke("tune", spec, "--db", tmp_path / "t.sqlite3")
    assert result.exit_code == 1 and result.output.startswith(f"error: {spec}: pins block_n=64, num_stages=2")
    assert "--store-narrowed" in result.output and not (tmp_path / "t.sqlite3").exists()


@pytest.mark.parametrize("args, message", [
    ((), "give at least one SPEC"),
    (("--budget", "0"), "--budget"),
    (("--max-fraction", "1.5"), "--max-fraction"),
    (("--budget", "nan"), "Invalid value for '--budget': 'nan' is not a finite number"),  # nan passed FloatRange
    (("--budget", "inf"), "Invalid value for '--budget': 'inf' is not a finite number"),
    (("--max-fraction", "nan"), "Invalid value for '--max-fraction': 'nan' is not a finite number"),
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


@needs_nvcc
@pytest.mark.parametrize("configs", [(), ("--configs",)])
def test_check_of_a_spec_its_target_cannot_run_names_the_file_and_the_target_once(tmp_path, configs):
    spec = spec_file(tmp_path, head_dim=64, family="fwd_sm90")
    result = invoke("check", *configs, "--arch", "sm_80", spec)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"error: {spec} (sm_80): family='fwd_sm90' cannot run" in " ".join(result.output.split())
    error = " ".join(result.output[result.output.index("error: "):].split())
    assert error.count(str(spec)) == 1  # not "path (sm_80): path: ..."
