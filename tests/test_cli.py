"""The CLI commands that need no GPU: generate, check (nvcc only), and bench's no-GPU error."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from attngen.cli import main
from attngen.nvcc import nvcc_available, parse_ptxas
from attngen.render import render
from attngen.spec import AttentionSpec

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")


def write_spec(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# Small pinned tiles: quick to compile, and independent of the tile defaults (which the tuner changes).
CAUSAL = AttentionSpec(head_dim=128, mask="causal", dtype="bf16", block_m=64, block_n=32, num_warps=4, num_stages=2)
GQA = AttentionSpec(head_dim=64, dtype="fp16", gqa_ratio=4, arch="sm_80", block_m=64, block_n=64, num_warps=4,
                    num_stages=2)


@pytest.fixture
def specs(tmp_path: Path) -> list[Path]:
    return [write_spec(tmp_path / f"{label}.yaml", yaml.safe_dump(spec.to_dict()))
            for label, spec in (("causal", CAUSAL), ("gqa", GQA))]


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_generate_writes_source_and_manifest(specs, tmp_path):
    out = tmp_path / "gen"
    result = invoke("generate", *specs, "-o", out)
    assert result.exit_code == 0, result.output
    name = CAUSAL.name
    assert sorted(snapshot(out)) == sorted(f"{s.name}.{ext}" for s in (CAUSAL, GQA) for ext in ("cu", "json"))
    source = (out / f"{name}.cu").read_text()
    assert source == render(CAUSAL)
    assert f"{name}(" in source  # the canonical name is the kernel symbol
    meta = json.loads((out / f"{name}.json").read_text())
    assert meta["name"] == name and meta["source"] == f"{name}.cu"
    assert meta["spec"] == CAUSAL.resolved().to_dict()
    assert meta["plan"]["threads"] == meta["spec"]["num_warps"] * 32
    assert meta["plan"]["arch"] in ("sm_80", "sm_90") and meta["templates"][0] == "fwd.cu.j2"
    assert meta["source_sha256"] == hashlib.sha256(source.encode()).hexdigest()
    assert str(out / f"{name}.cu") in result.output


def test_generate_is_deterministic(specs, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert invoke("generate", *specs, "-o", first).exit_code == 0
    assert invoke("generate", *reversed(specs), "-o", second).exit_code == 0
    assert snapshot(first) == snapshot(second)
    again = invoke("generate", *specs, "-o", first)
    assert again.exit_code == 0 and "unchanged" in again.output and "wrote" not in again.output
    assert snapshot(first) == snapshot(second)


def test_generate_prune_removes_stale_files(specs, tmp_path):
    out = tmp_path / "gen"
    assert invoke("generate", *specs, "-o", out).exit_code == 0
    (out / "fwd_old_kernel.cu").write_text("// stale\n")
    (out / "notes.txt").write_text("kept\n")
    result = invoke("generate", specs[0], "-o", out, "--prune")
    assert result.exit_code == 0, result.output
    names = set(snapshot(out))
    assert "fwd_old_kernel.cu" not in names and "notes.txt" in names
    assert not any(GQA.name in n for n in names) and f"{CAUSAL.name}.cu" in names


@pytest.mark.parametrize(
    "text, field, value",
    [
        ("head_dim: 100\n", "head_dim", "100"),
        ("head_dim: 64\ndtype: fp32\n", "dtype", "fp32"),
        ("head_dim: 64\nmask: diagonal\n", "mask", "diagonal"),
        ("head_dim: 64\nblock_size: 64\n", "block_size", None),
        ("dtype: bf16\n", "head_dim", None),
    ],
)
def test_bad_spec_names_file_and_field(tmp_path, text, field, value):
    bad = write_spec(tmp_path / "bad.yaml", text)
    result = invoke("generate", bad, "-o", tmp_path / "gen")
    assert result.exit_code != 0
    assert str(bad) in result.output and field in result.output
    if value is not None:
        assert value in result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output
    assert not (tmp_path / "gen").exists()


def test_missing_and_malformed_spec_files(tmp_path):
    missing = invoke("generate", tmp_path / "nope.yaml")
    assert missing.exit_code != 0 and "nope.yaml" in missing.output and "error: " in missing.output
    broken = write_spec(tmp_path / "broken.yaml", "head_dim: [64\n")
    result = invoke("generate", broken)
    assert result.exit_code != 0 and "broken.yaml" in result.output and "YAML" in result.output


def test_generate_needs_no_torch(specs, tmp_path):
    code = (
        "import sys; from attngen.cli import main\n"
        f"rc = main(['generate', {str(specs[0])!r}, '-o', {str(tmp_path / 'gen')!r}], standalone_mode=False)\n"
        "heavy = sorted(m for m in ('torch', 'cupy', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_bench_without_gpu_exits_2(tmp_path):
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: bench would run")
    except ImportError:
        pass
    result = invoke("bench", "--out", tmp_path / "bench", "--quick")
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "GPU" in result.output
    assert not (tmp_path / "bench").exists()


@needs_nvcc
def test_check_reports_zero_spills(specs):
    result = invoke("check", specs[0], specs[1])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "fwd_" in line]
    assert len(lines) == 4, result.output  # two specs x (sm_80, sm_90)
    for line in lines:
        assert "0/0" in line and "ok" in line, line
    assert sum("sm_80" in line for line in lines) == 2


@needs_nvcc
def test_check_reports_compile_errors_cleanly(specs, monkeypatch):
    import attngen.render

    monkeypatch.setattr(attngen.render, "render_plan", lambda plan: "this is not CUDA;\n")
    result = invoke("check", "--arch", "sm_80", specs[0])
    assert result.exit_code != 0
    assert "error: " in result.output and "nvcc failed" in result.output and "Traceback" not in result.output


PTXAS_SPILLING = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'kern' for 'sm_80'
ptxas info    : Function properties for kern
    240 bytes stack frame, 236 bytes spill stores, 232 bytes spill loads
ptxas info    : Used 24 registers, used 1 barriers, 240 bytes cumulative stack size, 1024 bytes smem, 360 bytes cmem[0]
"""


def test_parse_ptxas_counts_spills_of_every_function():
    report = parse_ptxas(PTXAS_SPILLING, "kern", "sm_80", smem_dynamic_bytes=4096)
    assert (report.registers, report.smem_static_bytes, report.stack_frame_bytes) == (24, 1024, 240)
    assert (report.spill_store_bytes, report.spill_load_bytes) == (240, 236)
    assert report.smem_total_bytes == 1024 + 4096


def test_parse_ptxas_without_the_kernel_is_an_error():
    from attngen.errors import CompileError

    with pytest.raises(CompileError, match="other"):
        parse_ptxas(PTXAS_SPILLING, "other", "sm_80")


def test_check_fails_on_spills(specs, monkeypatch):
    import attngen.cli
    import attngen.nvcc

    def spilling(spec, arch):
        return parse_ptxas(PTXAS_SPILLING.replace("'kern'", f"'{spec.name}'").replace("for kern", f"for {spec.name}"),
                           spec.name, arch)

    monkeypatch.setattr(attngen.nvcc, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(attngen.nvcc, "nvcc_version", lambda: "0.0")
    monkeypatch.setattr(attngen.cli, "check_spec", spilling)
    result = invoke("check", "--arch", "sm_90", specs[0])
    assert result.exit_code == 1, result.output
    assert "spills" in result.output and "240 B spill stores, 236 B spill loads" in result.output
