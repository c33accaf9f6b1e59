"""`attngen fuzz` end to end on the CPU: the reference (or a broken copy) stands in for the kernels."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from attngen.cli import main
from attngen.fuzz import command
from attngen.fuzz.reproducer import CASE_FILE
from attngen.fuzz.runners import ReferenceRunner
from attngen.fuzz.strategies import DEFAULT_LIMITS
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="fp16", block_m=32, block_n=16, num_warps=2, num_stages=2)
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
        return chosen["runner"]()

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
    assert "attngen fuzz: 1 specs, up to 12 cases, seed 3" in result.output
    assert SPEC.name in result.output and "12 cases in" in result.output and "0 failures" in result.output
    assert "gradients: not checked, no spec has a backward pass yet" in result.output
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
    assert broken.exit_code == 1 and broken.output.startswith(f"FAIL {path}: {SPEC.name} B=1 Sq=1 Sk=2")
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
    from attngen.fuzz.strategies import BUILTIN_SPECS

    result = fuzz("--examples", 3, "--seed", 0, "--max-seq-len", 8, "--random-specs", "--random-spec-count", 4)
    assert result.exit_code == 0, result.output
    assert f"attngen fuzz: {len(BUILTIN_SPECS) + 4} specs" in result.output


FAKE_SANITIZER = """#!/usr/bin/env bash
if [ "$2" = memcheck ]; then echo "========= ERROR SUMMARY: ${FAKE_ERRORS:-0} errors"; fi
if [ "$2" = racecheck ]; then echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"; fi
"""


@pytest.mark.parametrize("errors, exit_code", [(0, 0), (3, 1)])
def test_sanitize_replays_one_case_per_kernel(runners, spec_file, tmp_path, monkeypatch, errors, exit_code):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ERRORS", str(errors))
    result = fuzz(spec_file, "--examples", 10, "--seed", 2, *SMALL, "--out", tmp_path / "out", "--sanitize")
    assert result.exit_code == exit_code, result.output
    assert "note: --sanitize-sample 20, but only 1 kernels" in result.output
    (sample,) = (tmp_path / "out" / "sanitize").iterdir()
    assert sample.name.startswith(SPEC.name)
    assert f"sanitizer: {2 if errors == 0 else 1}/2 runs clean over 1 kernels" in result.output
    if errors:
        assert "memcheck finding for" in result.output and "rerun with:" in result.output


@pytest.mark.parametrize(
    "args, match",
    [
        (("--examples", 0), r"Invalid value for '--examples': 0 is not in the range x>=1"),
        (("--time-budget", 0), r"Invalid value for '--time-budget': 0.0 is not in the range x>0"),
        (("--max-seq-len", 1), r"Invalid value for '--max-seq-len': 1 is not in the range x>=2"),
        (("--fault", "nope"), r"Invalid value for '--fault': 'nope' is not 'drop_last_partial_kv_tile'"),
        (("--replay", "x", "spec.yaml"), r"--replay runs reproducers: it takes no SPEC arguments"),
    ],
)
def test_bad_arguments_are_named(args, match):
    result = fuzz(*args)
    assert result.exit_code == 2 and re.search(match, result.output), result.output


def test_missing_spec_and_reproducer_files_are_errors(runners, tmp_path):
    result = fuzz(tmp_path / "nope.yaml")
    assert result.exit_code == 1 and "nope.yaml: cannot read spec file" in result.output
    result = fuzz("--replay", tmp_path)
    assert result.exit_code == 1 and f"--replay {tmp_path}: no case.json there" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_tool_says_so():
    result = fuzz("--examples", 1)
    assert result.exit_code == 2 and "CUDA GPU" in result.output


def test_help_states_the_default_length_limit():
    assert f"[default: {DEFAULT_LIMITS.max_seq}]" in fuzz("--help").output
