"""The CLI commands that need no GPU: generate (and --prune), check (nvcc only), and bench's no-GPU error."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import attngen
from attngen.build.nvcc import nvcc_available, parse_ptxas
from attngen.cli import PACKAGE_ROOT, main
from attngen.families import get_family, plan_spec
from attngen.spec import AttentionSpec

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")


def write_spec(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# Small pinned tiles: quick to compile, and independent of the defaults (which the tuner changes).
CAUSAL = AttentionSpec(head_dim=128, mask="causal", dtype="bf16", family="fwd_sm80",
                       config=dict(block_m=64, block_n=32, num_warps=4, num_stages=2))
GQA = AttentionSpec(head_dim=64, dtype="fp16", gqa_ratio=4, arch="sm_80", family="fwd_sm80",
                    config=dict(block_m=64, block_n=64, num_warps=4, num_stages=2))


@pytest.fixture
def specs(tmp_path: Path) -> list[Path]:
    return [write_spec(tmp_path / f"{label}.yaml", yaml.safe_dump(spec.to_dict()))
            for label, spec in (("causal", CAUSAL), ("gqa", GQA))]


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def render(spec: AttentionSpec) -> str:
    plan = plan_spec(spec)
    return get_family(plan.family).render(plan)


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and attngen.__version__ in result.output


# -- generate ---------------------------------------------------------------------
def test_generate_writes_source_and_manifest(specs, tmp_path):
    out = tmp_path / "gen"
    result = invoke("generate", *specs, "-o", out)
    assert result.exit_code == 0, result.output
    name = CAUSAL.name
    assert name.endswith("_sm90a")  # no arch in the spec: the default target, spelled in the name
    assert sorted(snapshot(out)) == sorted(f"{s.name}.{ext}" for s in (CAUSAL, GQA) for ext in ("cu", "json"))
    source = (out / f"{name}.cu").read_text()
    assert source == render(CAUSAL)
    assert f"{name}(" in source  # the canonical name is the kernel symbol
    meta = json.loads((out / f"{name}.json").read_text())
    assert meta["generator"] == "attngen generate" and meta["attngen_version"] == attngen.__version__
    assert meta["name"] == name and meta["source"] == f"{name}.cu"
    assert meta["spec"] == {**CAUSAL.to_dict(), "arch": "sm_90a"}
    # The manifest's spec is a spec, and it names this kernel.
    assert AttentionSpec.from_dict(meta["spec"]).name == name
    plan = meta["plan"]
    assert plan["family"] == "fwd_sm80" and plan["target"] == "sm_90a" and plan["config"] == dict(CAUSAL.config)
    assert plan["threads"] == CAUSAL.config["num_warps"] * 32
    assert [k["symbol"] for k in plan["kernels"]] == [name]
    assert meta["templates"][0] == "attngen/families/fwd_sm80/fwd.cu.j2"
    for template in meta["templates"]:  # paths in the package, as installed
        assert (PACKAGE_ROOT.parent / template).is_file(), template
    assert meta["source_sha256"] == hashlib.sha256(source.encode()).hexdigest()
    assert str(out / f"{name}.cu") in result.output


def test_generate_to_an_out_that_cannot_be_a_directory_is_a_usage_error_naming_out(specs, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, why in [(afile / "sub", "Not a directory"), (Path("/dev/null"), "it exists and is not a directory"),
                     (Path("/proc/attngen-out"), "")]:  # (why there depends on the system)
        result = invoke("generate", "-o", out, specs[0])
        assert result.exit_code == 2 and "Invalid value for '-o' / '--out'" in result.output, result.output
        assert f"{out}: {why}" in result.output and "Traceback" not in result.output


def test_generate_is_deterministic(specs, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert invoke("generate", *specs, "-o", first).exit_code == 0
    assert invoke("generate", *reversed(specs), "-o", second).exit_code == 0
    assert snapshot(first) == snapshot(second)
    again = invoke("generate", *specs, "-o", first)
    assert again.exit_code == 0 and "unchanged" in again.output and "wrote" not in again.output
    assert snapshot(first) == snapshot(second)


def test_generate_specs_differing_only_in_arch(tmp_path):
    base = "head_dim: 64\nfamily: fwd_sm80\n"
    sm80 = write_spec(tmp_path / "sm80.yaml", base + "arch: sm_80\n")
    sm86 = write_spec(tmp_path / "sm86.yaml", base + "arch: sm_86\n")
    out = tmp_path / "gen"
    result = invoke("generate", sm80, sm86, "-o", out)
    assert result.exit_code == 0, result.output
    names = sorted(p.stem for p in out.glob("*.cu"))
    assert len(names) == 2 and names[0].endswith("_sm80") and names[1].endswith("_sm86"), names
    for name in names:
        meta = json.loads((out / f"{name}.json").read_text())
        assert meta["plan"]["target"] == "sm_" + name.rsplit("_sm", 1)[1]
    # sm_90 and sm_90a name one target: one kernel, no conflict.
    sm90 = write_spec(tmp_path / "sm90.yaml", base + "arch: sm_90\n")
    sm90a = write_spec(tmp_path / "sm90a.yaml", base + "arch: sm_90a\n")
    out = tmp_path / "gen90"
    assert invoke("generate", sm90, sm90a, "-o", out).exit_code == 0
    assert len(list(out.glob("*.cu"))) == 1


# -- generate --prune -----------------------------------------------------------------
UNRELATED = {
    "package.json": json.dumps({"name": "web", "version": "1.0.0", "scripts": {}}),
    "kernels.json": json.dumps({"name": "mine", "source": "mine.cu"}),
    "mine.cu": "// hand-written\n",
    "notes.txt": "kept\n",
    "broken.json": "{not json",
    "binary.json": "\xff\xfe",
    "list.json": "[1, 2]",
    # Says attngen made it, but is not named after the kernel it names: not a manifest attngen wrote.
    "renamed.json": json.dumps({"generator": "attngen generate", "name": "other", "source": "other.cu",
                                "source_sha256": "0" * 64}),
    "other.cu": "// not attngen's\n",
    # Names a source outside the directory.
    "escape.json": json.dumps({"generator": "attngen generate", "name": "escape", "source": "../outside.cu",
                               "source_sha256": "0" * 64}),
}


def test_generate_prune_removes_only_stale_attngen_kernels(specs, tmp_path):
    out = tmp_path / "gen"
    assert invoke("generate", *specs, "-o", out).exit_code == 0
    for fname, text in UNRELATED.items():
        (out / fname).write_text(text)
    (tmp_path / "outside.cu").write_text("// outside\n")
    result = invoke("generate", specs[0], "-o", out, "--prune")
    assert result.exit_code == 0, result.output
    names = set(snapshot(out))
    # The stale attngen kernel (GQA's) is gone: its source and its manifest.
    assert f"{GQA.name}.cu" not in names and f"{GQA.name}.json" not in names
    assert f"removed   {out / (GQA.name + '.cu')}" in result.output
    # Everything else is untouched.
    assert {f"{CAUSAL.name}.cu", f"{CAUSAL.name}.json"} | set(UNRELATED) == names
    for fname, text in UNRELATED.items():
        assert (out / fname).read_text() == text
    assert (tmp_path / "outside.cu").is_file()


def test_generate_prune_keeps_an_edited_source(specs, tmp_path):
    out = tmp_path / "gen"
    assert invoke("generate", *specs, "-o", out).exit_code == 0
    edited = out / f"{GQA.name}.cu"
    edited.write_text(edited.read_text() + "// my fix\n")
    result = invoke("generate", specs[0], "-o", out, "--prune")
    assert result.exit_code == 0, result.output
    assert edited.is_file() and (out / f"{GQA.name}.json").is_file()
    assert "edited since attngen generated it" in result.output


def test_generate_prune_removes_attngen_0_1_kernels(specs, tmp_path):
    """attngen 0.1 wrote manifests without a "generator" field: their kernels are still attngen's."""
    out = tmp_path / "gen"
    out.mkdir()
    old_source = "// Generated by attngen from spec fwd_causal_d128_gqa4_bf16_m128n64w4s2; do not edit.\n"
    old_name = "fwd_causal_d128_gqa4_bf16_m128n64w4s2"
    (out / f"{old_name}.cu").write_text(old_source)
    (out / f"{old_name}.json").write_text(json.dumps({
        "attngen_version": "0.1.0", "name": old_name, "plan": {"arch": "sm_90"}, "source": f"{old_name}.cu",
        "source_sha256": hashlib.sha256(old_source.encode()).hexdigest(), "spec": {"head_dim": 128},
        "templates": ["fwd.cu.j2"]}))
    # A JSON that merely has a version field is not one.
    (out / "tool.json").write_text(json.dumps({"attngen_version": "0.1.0", "name": "tool"}))
    result = invoke("generate", specs[0], "-o", out, "--prune")
    assert result.exit_code == 0, result.output
    assert set(snapshot(out)) == {f"{CAUSAL.name}.cu", f"{CAUSAL.name}.json", "tool.json"}


def test_generate_without_prune_deletes_nothing(specs, tmp_path):
    out = tmp_path / "gen"
    assert invoke("generate", *specs, "-o", out).exit_code == 0
    assert invoke("generate", specs[0], "-o", out).exit_code == 0
    assert f"{GQA.name}.cu" in snapshot(out)


# -- bad input ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, field, value",
    [
        ("head_dim: 100\n", "head_dim", "100"),
        ('head_dim: "128"\n', "head_dim", "must be an integer"),
        ("head_dim: 64\ndtype: fp32\n", "dtype", "fp32"),
        ("head_dim: 64\nmask: diagonal\n", "mask", "diagonal"),
        ("head_dim: 64\narch: sm_75\n", "arch", "sm_75"),
        ("head_dim: 64\nfamily: fwd_sm70\n", "family", "fwd_sm70"),
        ("head_dim: 64\nblock_size: 64\n", "block_size", None),
        ("head_dim: 64\nblock_m: 64\n", "block_m", "family: fwd_sm80"),
        ("head_dim: 64\nmask: none\nmask: causal\n", "mask", "given twice"),
        ("dtype: bf16\n", "head_dim", None),
    ],
)
def test_bad_spec_names_file_and_field(tmp_path, text, field, value):
    bad = write_spec(tmp_path / "bad.yaml", text)
    result = invoke("generate", bad, "-o", tmp_path / "gen")
    assert result.exit_code == 1
    assert str(bad) in result.output and field in result.output
    if value is not None:
        assert value in result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output
    assert not (tmp_path / "gen").exists()


def test_every_problem_of_a_file_is_printed(tmp_path):
    bad = write_spec(tmp_path / "bad.yaml", "head_dim: 100\ndtype: fp32\nmask: window\n")
    result = invoke("generate", bad, "-o", tmp_path / "gen")
    assert result.exit_code == 1 and "3 problems" in result.output
    for phrase in ("head_dim=100", "dtype='fp32'", "mask='window'"):
        assert phrase in result.output


def test_config_that_does_not_fit_the_target_names_file(tmp_path):
    spec = AttentionSpec(head_dim=256, arch="sm_80", family="fwd_sm80",
                         config=dict(block_m=256, block_n=128, num_warps=8, num_stages=4))
    bad = write_spec(tmp_path / "big.yaml", yaml.safe_dump(spec.to_dict()))
    result = invoke("generate", bad, "-o", tmp_path / "gen")
    assert result.exit_code == 1 and result.output.startswith(f"error: {bad}: ") and "shared memory" in result.output


def test_missing_binary_and_malformed_spec_files(tmp_path):
    missing = invoke("generate", tmp_path / "nope.yaml")
    assert missing.exit_code == 1 and "nope.yaml" in missing.output and "error: " in missing.output
    broken = write_spec(tmp_path / "broken.yaml", "head_dim: [64\n")
    result = invoke("generate", broken)
    assert result.exit_code == 1 and "broken.yaml" in result.output and "YAML" in result.output
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)))
    result = invoke("generate", binary)
    assert result.exit_code == 1 and "weights.bin" in result.output and "UTF-8" in result.output


def test_generate_needs_no_torch(specs, tmp_path):
    code = (
        "import sys; from attngen.cli import main\n"
        f"rc = main(['generate', {str(specs[0])!r}, '-o', {str(tmp_path / 'gen')!r}], standalone_mode=False)\n"
        "heavy = sorted(m for m in ('torch', 'cupy', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)
    assert (tmp_path / "gen" / f"{CAUSAL.name}.cu").is_file()


@pytest.mark.parametrize("args, message", [
    (("--masks", "--decode"), "--masks and --decode are separate benchmarks; give one per run"),
    (("--decode", "--backward", "--masks"), "--masks and --decode and --backward are separate benchmarks"),
    (("--quick", "--masks"), "--quick shortens the forward benchmark only; --masks has no short form"),
])
def test_bench_modes_that_do_not_combine_are_usage_errors(args, message):
    """One benchmark per run: given several, the first used to run and the rest were dropped silently."""
    result = invoke("bench", *args)
    assert result.exit_code == 2 and message in result.output, result.output


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


# -- check --------------------------------------------------------------------------
@needs_nvcc
def test_check_reports_zero_spills(specs):
    result = invoke("check", specs[0], specs[1])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "fwd_" in line]
    assert len(lines) == 4, result.output  # two specs x (sm_80, sm_90a)
    for line in lines:
        assert "0/0" in line and "ok" in line, line
    assert sum(" sm_80 " in line for line in lines) == 2 and sum(" sm_90a " in line for line in lines) == 2


@needs_nvcc
def test_check_reports_compile_errors_cleanly(specs, monkeypatch):
    monkeypatch.setattr(get_family("fwd_sm80"), "render", lambda plan: "this is not CUDA;\n")
    result = invoke("check", "--arch", "sm_80", specs[0])
    assert result.exit_code == 1
    assert "error: " in result.output and "nvcc failed" in result.output and "Traceback" not in result.output


def test_check_skips_the_default_targets_a_spec_cannot_run_on_and_refuses_a_named_one(monkeypatch):
    """`attngen check specs/*.yaml` (the README's example) holds specs some default target cannot run
    (the Hopper backward runs on sm_90a only): those pairs are skipped with a note naming the reason, not
    errors; a target named with --arch must run every spec."""
    import attngen.build.nvcc
    import attngen.cli

    checked = []

    def fake_check(spec, arch, **kwargs):  # plans as check_spec does (a spec no family runs raises), never compiles
        from attngen import families, targets

        families.plan_spec(spec, targets.target(arch))
        checked.append(arch)
        log = (f"ptxas info    : Compiling entry function '{spec.name}' for '{arch}'\n"
               f"ptxas info    : Function properties for {spec.name}\n"
               "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
               "ptxas info    : Used 168 registers, 1024 bytes smem, 360 bytes cmem[0]\n")
        return parse_ptxas(log, spec.name, arch)

    monkeypatch.setattr(attngen.build.nvcc, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(attngen.build.nvcc, "nvcc_version", lambda: "0.0")
    monkeypatch.setattr(attngen.cli, "check_spec", fake_check)
    path = Path(__file__).resolve().parents[1] / "specs" / "bwd_hopper_llama3_causal_gqa4_d128_bf16.yaml"
    result = invoke("check", path)
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and checked == ["sm_90a"], result.output
    assert f"note: {path} does not run on sm_80 (needs sm_90a" in text and "name --arch sm_80" in text
    result = invoke("check", "--arch", "sm_80", path)
    assert result.exit_code == 1 and "error: " in result.output and "Traceback" not in result.output


def test_check_without_nvcc_says_how_to_get_it(specs, monkeypatch):
    import attngen.build.nvcc

    monkeypatch.setattr(attngen.build.nvcc, "find_nvcc", lambda: None)
    result = invoke("check", specs[0])
    assert result.exit_code == 1 and result.output.startswith("error: nvcc not found") and "CUDA_HOME" in result.output


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
    import attngen.build.nvcc
    import attngen.cli

    def spilling(spec, arch, **kwargs):
        name = spec.name
        return parse_ptxas(PTXAS_SPILLING.replace("'kern'", f"'{name}'").replace("for kern", f"for {name}"),
                           name, arch)

    monkeypatch.setattr(attngen.build.nvcc, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(attngen.build.nvcc, "nvcc_version", lambda: "0.0")
    monkeypatch.setattr(attngen.cli, "check_spec", spilling)
    result = invoke("check", "--arch", "sm_90", specs[0])
    assert result.exit_code == 1, result.output
    assert "spills" in result.output and "240 B spill stores, 236 B spill loads" in result.output
