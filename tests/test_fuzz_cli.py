"""`attngen fuzz` end to end on the CPU: the reference (or a broken copy) stands in for the kernels."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from attngen import targets
from attngen.cli import main
from attngen.fuzz import command, pool
from attngen.fuzz.reproducer import CASE_FILE
from attngen.fuzz.runners import ReferenceRunner
from attngen.families import plan_spec
from attngen.fuzz.strategies import DEFAULT_LIMITS
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="fp16", family="fwd_sm80",
                     config=dict(block_m=32, block_n=16, num_warps=2, num_stages=2))
KERNEL = ReferenceRunner().kernel_name(SPEC)  # its name for the reference's target (sm_90a)
SMALL = ("--max-seq-len", "48")


class DropsLastKey(ReferenceRunner):
    """Attention over all keys but the last (the spec has no mask, so nothing else moves)."""

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        if k.shape[1] > 1:
            k, v = k[:, :-1], v[:, :-1]
        super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)


@pytest.fixture
def runners(monkeypatch):
    """Which runner make_runner returns (by name), and the faults it was asked for."""
    chosen = {"runner": ReferenceRunner, "faults": []}

    def make_runner(fault):
        chosen["faults"].append(fault)
        runner = chosen["runner"]()
        runner.fault = fault
        return runner

    monkeypatch.setattr(command, "make_runner", make_runner)
    return chosen


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "mha.yaml"
    path.write_text(yaml.safe_dump(SPEC.to_dict()))
    return path


def fuzz(*args):
    return CliRunner().invoke(main, ["fuzz", *map(str, args)])


def test_passing_run_prints_a_summary_and_exits_0(runners, spec_file, tmp_path):
    result = fuzz(spec_file, "--examples", 12, "--seed", 3, *SMALL, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "attngen fuzz: 1 specs, up to 12 cases, seed 3\n  target sm_90a, families fwd_sm80: 1\n" in result.output
    assert KERNEL in result.output and "12 cases in" in result.output and "0 failures" in result.output
    assert "gradients: dq, dk, dv checked in every case a backward family runs" in result.output
    assert not (tmp_path / "out" / "failures").exists()


def test_failure_is_shrunk_written_and_replayable(runners, spec_file, tmp_path):
    runners["runner"] = DropsLastKey
    result = fuzz(spec_file, "--examples", 50, "--seed", 1, *SMALL, "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "FAILED (output" in result.output and "case:   B=1 Sq=1 Sk=2 Hq=1 Hkv=1 contiguous" in result.output
    replay_line = re.search(r"replay it with:\n  (attngen fuzz --replay (\S+))", result.output)
    path = Path(replay_line.group(2))
    assert path.parent == tmp_path / "out" / "failures" and json.loads((path / CASE_FILE).read_text())["failure"]

    broken = fuzz("--replay", path)
    assert broken.exit_code == 1 and broken.output.startswith(f"FAIL {path}: {KERNEL} B=1 Sq=1 Sk=2")
    runners["runner"] = ReferenceRunner
    fixed = fuzz("--replay", path)
    assert fixed.exit_code == 0 and fixed.output.startswith(f"PASS {path}")


def test_fault_reaches_the_runner_and_the_reproducer(runners, spec_file, tmp_path):
    runners["runner"] = DropsLastKey
    result = fuzz(spec_file, "--examples", 20, "--seed", 1, *SMALL, "--out", tmp_path, "--fault",
                  "drop_last_partial_kv_tile")
    assert result.exit_code == 1 and "fault drop_last_partial_kv_tile" in result.output
    (path,) = (tmp_path / "failures").iterdir()
    assert json.loads((path / CASE_FILE).read_text())["fault"] == "drop_last_partial_kv_tile"
    fuzz("--replay", path)  # replays with the recorded fault
    assert runners["faults"] == ["drop_last_partial_kv_tile"] * 2


def test_builtin_and_random_specs(runners):
    from attngen.fuzz.pool import builtin_specs

    builtin = builtin_specs(ReferenceRunner.target)
    result = fuzz("--examples", 3, "--seed", 0, "--max-seq-len", 8)
    assert result.exit_code == 0, result.output
    assert f"attngen fuzz: {len(builtin)} specs" in result.output
    # The pool is asked of the families: each that runs on the target is listed with its specs.
    counts = Counter(spec.family for spec in builtin)
    assert f"target sm_90a, families {', '.join(f'{f}: {n}' for f, n in counts.items())}\n" in result.output
    result = fuzz("--examples", 3, "--seed", 0, "--max-seq-len", 8, "--random-specs", "--random-spec-count", 4)
    assert result.exit_code == 0, result.output
    assert f"attngen fuzz: {len(builtin) + 4} specs" in result.output


def test_family_keeps_only_the_pools_specs_of_that_family(runners):
    from attngen.fuzz.pool import builtin_specs

    ours = [spec for spec in builtin_specs(ReferenceRunner.target) if spec.family == "fwd_sm80"]
    assert 0 < len(ours) < len(builtin_specs(ReferenceRunner.target))
    result = fuzz("--family", "fwd_sm80", "--examples", 3, "--seed", 0, "--max-seq-len", 8)
    assert result.exit_code == 0, result.output
    assert f"attngen fuzz: {len(ours)} specs" in result.output
    assert "target sm_90a, families fwd_sm80: " in result.output and "fwd_sm90" not in result.output
    result = fuzz("--family", "fwd_sm80", "--examples", 3, "--seed", 0, "--max-seq-len", 8, "--random-specs",
                  "--random-spec-count", 4)
    assert result.exit_code == 0, result.output
    assert f"attngen fuzz: {len(ours) + 4} specs, up to 3 cases, seed 0\n  target sm_90a, families fwd_sm80: " \
           f"{len(ours) + 4}\n" in result.output


def test_random_specs_of_named_families_only():
    from attngen.fuzz.pool import random_spec_pool

    target = ReferenceRunner.target
    assert {spec.family for spec in random_spec_pool(3, 12, target)} == {"fwd_sm80", "fwd_sm90"}
    assert {spec.family for spec in random_spec_pool(3, 12, target, ["fwd_sm90"])} == {"fwd_sm90"}


@pytest.mark.parametrize(
    "args, match",
    [
        (("--family", "fwd_sm81"), r"Invalid value for --family: 'fwd_sm81' is not a forward kernel family; allowed: "
                                   r"fwd_sm90, fwd_sm80"),
        (("--family", "fwd_sm80", "--decode"), r"'fwd_sm80' is not a decode kernel family; allowed: decode_sm80"),
        (("--family", "fwd_sm80", "spec.yaml"), r"--family chooses among the built-in pool's specs; SPEC files run"),
        (("--family", "fwd_sm80", "--replay", "x"), r"--replay runs reproducers: it takes no SPEC arguments, no "
                                                    r"--random-specs and no --family"),
    ],
)
def test_bad_family_arguments_are_named(runners, args, match):
    result = fuzz(*args)
    assert result.exit_code == 2 and re.search(match, " ".join(result.output.split())), result.output


def test_a_family_that_runs_nothing_here_is_a_usage_error(runners, monkeypatch):
    class OnAnA100(ReferenceRunner):
        target = targets.target("sm_80")

    runners["runner"] = OnAnA100
    result = fuzz("--family", "fwd_sm90", "--examples", 3)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert ("Invalid value for --family: 'fwd_sm90': no spec of the built-in pool runs as it on sm_80; families "
            "that run here: fwd_sm80") in text
    # Random specs cannot supply one either: a usage error naming --family, not a kernel failure.
    monkeypatch.setattr(pool, "RANDOM_TRIES", 50)
    result = fuzz("--family", "fwd_sm90", "--random-specs", "--examples", 3)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert ("Invalid value for --family: no kernel family of 'fwd_sm90' plans a random problem on sm_80 in 50 "
            "draws") in text


def test_a_spec_file_pinning_a_family_this_gpu_cannot_run_is_a_usage_error(runners, tmp_path, sm90a_only_family):
    class OnAnA100(ReferenceRunner):
        target = targets.target("sm_80")

    runners["runner"] = OnAnA100
    path = tmp_path / "hopper.yaml"
    path.write_text(yaml.safe_dump(SPEC.replace(family=sm90a_only_family.name).to_dict()))
    result = fuzz(path, "--examples", 3)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"Invalid value for SPEC: {path}: family='{sm90a_only_family.name}' cannot run" in text
    assert "on sm_80: needs sm_90a" in text


@pytest.mark.parametrize("errors, exit_code", [(0, 0), (3, 1)])
def test_sanitize_replays_one_case_per_kernel(runners, spec_file, tmp_path, monkeypatch, fake_sanitizer, errors,
                                              exit_code):
    monkeypatch.setenv("FAKE_ERRORS", str(errors))
    result = fuzz(spec_file, "--examples", 10, "--seed", 2, *SMALL, "--out", tmp_path / "out", "--sanitize")
    assert result.exit_code == exit_code, result.output
    assert "note: --sanitize-sample 20, but only 1 kernels" in result.output
    (sample,) = (tmp_path / "out" / "sanitize").iterdir()
    assert sample.name.startswith(KERNEL)
    assert f"sanitizer: {3 if errors == 0 else 1}/3 runs clean over 1 kernels" in result.output  # memcheck and synccheck see the errors
    if errors:
        assert "memcheck finding for" in result.output and "rerun with:" in result.output


@pytest.mark.parametrize(
    "args, match",
    [
        (("--examples", 0), r"Invalid value for '--examples': 0 is not in the range x>=1"),
        (("--time-budget", 0), r"Invalid value for '--time-budget': 0.0 is not in the range x>0"),
        (("--time-budget", "nan"), r"Invalid value for '--time-budget': 'nan' is not a finite number"),
        (("--max-seq-len", 1), r"Invalid value for '--max-seq-len': 1 is not in the range x>=2"),
        (("--fault", "nope"), r"Invalid value for '--fault': 'nope' is not 'drop_last_partial_kv_tile'"),
        (("--replay", "x", "spec.yaml"), r"--replay runs reproducers: it takes no SPEC arguments"),
    ],
)
def test_bad_arguments_are_named(args, match):
    result = fuzz(*args)
    assert result.exit_code == 2 and re.search(match, result.output), result.output


@pytest.mark.parametrize("name, phrase", [("decode_llama3_8b_paged_gqa4_d128_bf16.yaml", "is a decode family, but this "
                                           "call runs a forward family (fwd_sm90, fwd_sm80) (fuzz it with --decode)"),
                                          ("bwd_hopper_llama3_causal_gqa4_d128_bf16.yaml", "is a backward family")])
def test_a_spec_of_another_operation_is_a_usage_error_not_failing_cases(runners, name, phrase):
    """The forward fuzz given a decode or backward spec file refuses it by name (exit 2), where it used
    to compile it for every case, count each as a kernel failure and exit 1."""
    path = Path(__file__).resolve().parents[1] / "specs" / name
    result = fuzz(path, "--examples", "3")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"Invalid value for SPEC: {path}: family=" in text and phrase in text, text


def test_missing_spec_and_reproducer_files_are_usage_errors(runners, tmp_path):
    result = fuzz(tmp_path / "nope.yaml")
    assert result.exit_code == 2 and "Invalid value for SPEC:" in result.output
    assert "nope.yaml: cannot read spec file" in result.output
    result = fuzz("--replay", tmp_path)
    assert result.exit_code == 2, result.output
    assert (f"Invalid value for '--replay': {tmp_path}: no case.json there; expected a directory `attngen fuzz` wrote, "
            "with spec.yaml and case.json in it") in " ".join(result.output.split())
    assert runners["faults"] == [None]  # the replay made no runner: nothing ran


def test_a_bad_replay_path_under_sanitize_is_a_usage_error_not_a_kernel_finding(runners, tmp_path, fake_sanitizer):
    result = fuzz("--replay", tmp_path / "missing", "--sanitize")
    assert result.exit_code == 2 and "no case.json there" in result.output
    assert not fake_sanitizer.calls.exists()  # no sanitizer run to misreport


def _reproducer(runners, spec_file, tmp_path) -> Path:
    """A reproducer of a failing case (DropsLastKey), through the CLI."""
    runners["runner"] = DropsLastKey
    result = fuzz(spec_file, "--examples", 50, "--seed", 1, *SMALL, "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    (path,) = (tmp_path / "out" / "failures").iterdir()
    return path


class NamesTheFault(ReferenceRunner):
    """The reference, with kernel names that spell the runner's fault (like KernelRunner's), which
    reports each kernel it "launches"."""

    def __init__(self):
        self.fault, self.launched = None, []

    def kernel_name(self, spec):
        return plan_spec(spec, self.target, fault=self.fault).name

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
        self.launched.append(self.kernel_name(spec))


FAULT = "drop_last_partial_kv_tile"


def test_replay_sanitize_instruments_the_kernel_this_gpu_runs_and_passes_the_fault_on(runners, spec_file, tmp_path,
                                                                                      fake_sanitizer):
    path = _reproducer(runners, spec_file, tmp_path)
    record = json.loads((path / CASE_FILE).read_text())
    record["kernel"] = "fwd_compiled_on_another_gpu"
    (path / CASE_FILE).write_text(json.dumps(record))
    runners["runner"] = NamesTheFault
    result = fuzz("--replay", path, "--sanitize", "--fault", FAULT)
    faulty = plan_spec(SPEC, ReferenceRunner.target, fault=FAULT).name
    assert result.exit_code == 0, result.output
    assert "recorded for kernel fwd_compiled_on_another_gpu; this GPU runs " + faulty in result.output
    assert f"launched kernel {faulty}" in result.output  # what a replay under the sanitizer prints
    calls = fake_sanitizer.calls.read_text().splitlines()
    assert len(calls) == 3 and all(f"kns={faulty} " in c and c.endswith(f"--replay {path} --fault {FAULT}")
                                   for c in calls)


def test_sanitize_that_instruments_nothing_is_not_clean(runners, spec_file, tmp_path, fake_sanitizer, monkeypatch):
    path = _reproducer(runners, spec_file, tmp_path)
    runners["runner"] = ReferenceRunner
    monkeypatch.setenv("FAKE_LAUNCHED", "fwd_some_other_kernel")
    result = fuzz("--replay", path, "--sanitize")
    assert result.exit_code == 2, result.output  # a harness error: nothing was checked
    assert f"{KERNEL} never launched, so nothing was instrumented (the replay launched fwd_some_other_kernel)" \
        in result.output
    assert "memcheck harness error (the kernel was not checked)" in result.output
    assert "sanitizer: 0/3 runs clean over 1 kernels" in result.output


def test_sanitize_runs_whose_replay_cannot_run_are_harness_errors(runners, spec_file, tmp_path, fake_sanitizer,
                                                                  monkeypatch):
    path = _reproducer(runners, spec_file, tmp_path)
    runners["runner"] = ReferenceRunner
    monkeypatch.setenv("FAKE_EXIT", "2")
    result = fuzz("--replay", path, "--sanitize")
    assert result.exit_code == 2 and "the replay could not run (exit status 2" in result.output
    monkeypatch.setenv("FAKE_EXIT", "1")  # the replay still fails under the sanitizer: a kernel finding
    assert fuzz("--replay", path, "--sanitize").exit_code == 1


def test_sanitize_without_compute_sanitizer_fails_before_fuzzing(runners, spec_file, monkeypatch):
    monkeypatch.setattr("attngen.fuzz.sanitizer.find_compute_sanitizer", lambda: None)
    result = fuzz(spec_file, "--examples", 5, "--sanitize")
    assert result.exit_code == 2 and "--sanitize needs compute-sanitizer" in result.output
    assert runners["faults"] == []


def _float64_reference_out_of_memory_above(monkeypatch, seq_k):
    from attngen import reference

    attention_for_spec = reference.attention_for_spec

    def reference_oom(q, k, v, spec, *args, compute_dtype=torch.float64, **kwargs):
        if compute_dtype == torch.float64 and k.shape[1] > seq_k:
            raise RuntimeError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return attention_for_spec(q, k, v, spec, *args, compute_dtype=compute_dtype, **kwargs)

    monkeypatch.setattr(reference, "attention_for_spec", reference_oom)


def test_a_harness_error_stops_the_run_with_advice_and_exit_2(runners, spec_file, tmp_path, monkeypatch):
    _float64_reference_out_of_memory_above(monkeypatch, 30)
    result = fuzz(spec_file, "--examples", 200, "--seed", 1, *SMALL, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "error: the harness itself failed" in result.output and "CUDA out of memory" in result.output
    assert "stopped: harness error" in result.output and "If it ran out of memory, lower --max-seq-len (this run: 48)" \
        in result.output
    assert "FAILED" not in result.output and not (tmp_path / "out" / "failures").exists()


def test_a_replay_whose_harness_fails_exits_2(runners, spec_file, tmp_path, monkeypatch):
    path = _reproducer(runners, spec_file, tmp_path)
    _float64_reference_out_of_memory_above(monkeypatch, 0)
    result = fuzz("--replay", path)
    assert result.exit_code == 2 and result.output.startswith(f"ERROR {path}: ") and "harness error" in result.output


def test_help_states_the_exit_statuses():
    text = " ".join(fuzz("--help").output.split())
    assert "Exit status: 0 all passed" in text and "1 a kernel failure found" in text
    assert "2 a usage or harness error" in text and "130 interrupted" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_tool_says_so():
    result = fuzz("--examples", 1)
    assert result.exit_code == 2 and "CUDA GPU" in result.output


def test_help_states_the_default_length_limit():
    assert f"[default: {DEFAULT_LIMITS.max_seq}]" in fuzz("--help").output
