"""The sanitizer driver (CPU): reading compute-sanitizer's reports, the commands it runs, the sample it
picks, and the whole subprocess path against a stand-in compute-sanitizer script."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from attngen import targets
from attngen.fuzz import sanitizer
from attngen.fuzz.case import FuzzCase
from attngen.fuzz.sanitizer import (LAUNCHED_LINE, SanitizerReport, SanitizerResult, choose_samples, parse_report,
                                    sample_key, sanitize, sanitizer_command)
from attngen.spec import AttentionSpec

MEMCHECK_CLEAN = """========= COMPUTE-SANITIZER
PASS /tmp/x: fwd_none_d64 ok
launched kernel fwd_none_d64
========= ERROR SUMMARY: 0 errors
"""
MEMCHECK_ERRORS = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 16 bytes
=========     at fwd_none_d64_gqa1_fp16_m128n128w4s2+0x1a30
=========     by thread (0,0,0) in block (3,0,0)
=========     Address 0x7f00 is out of bounds
=========
========= ERROR SUMMARY: 2 errors
"""
RACECHECK_CLEAN = """========= COMPUTE-SANITIZER
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
RACECHECK_HAZARDS = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at fwd_x+0x10 and Read access at fwd_x+0x40 [128 hazards]
=========
========= Warning: Race reported between Read access at fwd_x+0x80 and Write access at fwd_x+0x90 [4 hazards]
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


@pytest.mark.parametrize(
    "text, errors, warnings, excerpt",
    [
        (MEMCHECK_CLEAN, 0, 0, ""),
        (MEMCHECK_ERRORS, 2, 0, "Invalid __global__ write of size 16 bytes"),
        (RACECHECK_CLEAN, 0, 0, ""),
        (RACECHECK_HAZARDS, 1, 1, "Race reported between Write access"),
    ],
)
def test_reports_are_read(text, errors, warnings, excerpt):
    report = parse_report(text)
    assert (report.summary_found, report.errors, report.warnings) == (True, errors, warnings)
    assert excerpt in report.excerpt and "SUMMARY" not in report.excerpt and "COMPUTE-SANITIZER" not in report.excerpt
    assert report.launched == (("fwd_none_d64",) if text is MEMCHECK_CLEAN else ())


def test_launched_kernels_are_read_from_the_replays_own_lines():
    text = "\n".join([LAUNCHED_LINE.format("fwd_a"), "  launched kernel fwd_indented", LAUNCHED_LINE.format("fwd_b"),
                      LAUNCHED_LINE.format("fwd_a"), "========= ERROR SUMMARY: 0 errors"])
    assert parse_report(text).launched == ("fwd_a", "fwd_b")


def test_missing_summary_is_not_clean():
    report = parse_report("Traceback (most recent call last):\nImportError: no torch\n")
    assert not report.summary_found
    result = SanitizerResult("k", "memcheck", Path("d"), (), 1, report)
    assert not result.clean and result.finding == "no memcheck summary in the output (exit status 1)"
    assert not result.kernel_finding  # the sanitizer did not finish: a harness error


@pytest.mark.parametrize(
    "returncode, report, finding, kernel_finding",
    [
        (0, SanitizerReport(True, 0, 0, "", ("k",)), "", False),
        (0, SanitizerReport(True, 3, 1, "", ("k",)), "3 errors, 1 warnings", True),
        (1, SanitizerReport(True, 0, 0, "", ("k",)), "the replay exited with status 1", True),
        (None, SanitizerReport(False, 0, 0, ""), "timed out", True),
        # A filter that matched nothing: a clean summary, but nothing was checked.
        (0, SanitizerReport(True, 0, 0, "", ("k_other",)),
         "k never launched, so nothing was instrumented (the replay launched k_other)", False),
        (0, SanitizerReport(True, 0, 0, ""), "k never launched, so nothing was instrumented (the replay launched no "
                                             "kernel)", False),
        # The replay could not run (a bad path, no GPU): a harness error, not a kernel finding.
        (2, SanitizerReport(True, 0, 0, ""), "the replay could not run (exit status 2: a usage or harness error, not a "
                                             "kernel finding)", False),
    ],
)
def test_a_run_is_clean_only_with_a_summary_no_findings_the_kernel_launched_and_a_passing_replay(
        returncode, report, finding, kernel_finding):
    result = SanitizerResult("k", "racecheck", Path("d"), (), returncode, report)
    assert result.finding == finding and result.clean == (finding == "")
    assert result.kernel_finding == kernel_finding


def test_command_instruments_only_the_kernel_and_replays_the_case():
    command = sanitizer_command("/cuda/bin/compute-sanitizer", "racecheck", "fwd_none_d64", Path("out/s/x"), "py")
    assert command == ["/cuda/bin/compute-sanitizer", "--tool", "racecheck", "--kernel-name", "kns=fwd_none_d64",
                       "--report-api-errors", "no", "py", "-m", "attngen.cli", "fuzz", "--replay", "out/s/x"]
    with pytest.raises(ValueError, match="tool='initcheck' is invalid; allowed: memcheck, racecheck, synccheck"):
        sanitizer_command("cs", "initcheck", "k", Path("d"))
    # An outer --fault reaches the replay (it would otherwise run the reproducer's recorded fault).
    command = sanitizer_command("cs", "memcheck", "fwd_x_fault_f", Path("d"), "py", fault="f")
    assert command[-4:] == ["--replay", "d", "--fault", "f"] and "kns=fwd_x_fault_f" in command


SPEC = AttentionSpec(head_dim=64, dtype="fp16", family="fwd_sm80",
                     config=dict(block_m=32, block_n=16, num_warps=2, num_stages=2))


def test_sample_prefers_cheap_cases_with_partial_tiles():
    exact = FuzzCase(SPEC, batch=1, seq_q=64, seq_k=64, heads_kv=1)
    partial = FuzzCase(SPEC, batch=2, seq_q=65, seq_k=33, heads_kv=2, layout="transposed")
    huge = FuzzCase(SPEC, batch=3, seq_q=4097, seq_k=4097, heads_kv=3, layout="padded")
    hopper = targets.target("sm_90")
    assert sorted([exact, huge, partial], key=lambda c: sample_key(c, hopper)) == [partial, exact, huge]


def test_sample_tile_edges_are_those_of_the_plan_on_the_target():
    # d128's default key tile is 64 on sm_90 and 32 on sm_86: Sk = 96 is a partial tile on sm_90 only.
    spec = AttentionSpec(head_dim=128, dtype="bf16", family="fwd_sm80")
    case = FuzzCase(spec, batch=1, seq_q=128, seq_k=96, heads_kv=1)
    assert sample_key(case, targets.target("sm_90"))[1] == sample_key(case, targets.target("sm_86"))[1] - 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_of_a_plan_has_the_plans_name_in_its_symbol(arch):
    # The sanitizer instruments kns=<plan name> (a substring of the symbol): it must reach every kernel.
    from attngen.families import plan_spec
    from attngen.fuzz.pool import builtin_specs

    target = targets.target(arch)
    for spec in builtin_specs(target):
        plan = plan_spec(spec, target)
        assert plan.kernels and all(plan.name in kernel.symbol for kernel in plan.kernels), plan.name


def test_choose_samples_takes_kernels_with_a_passing_case_in_name_order():
    stats = [SimpleNamespace(kernel=name, sample=sample) for name, sample in (("b", 1), ("a", 2), ("c", None), ("d", 3))]
    assert [s.kernel for s in choose_samples(stats, 2)] == ["a", "b"]
    assert [s.kernel for s in choose_samples(stats, 10)] == ["a", "b", "d"]


def test_compute_sanitizer_is_found_on_path(fake_sanitizer):
    assert sanitizer.find_compute_sanitizer() == str(fake_sanitizer.path)


def test_sanitize_runs_every_tool_per_sample_in_its_own_process(fake_sanitizer, tmp_path):
    seen = []
    results = sanitize([("fwd_a", tmp_path / "a"), ("fwd_b", tmp_path / "b")], on_result=seen.append)
    assert [(r.kernel, r.tool) for r in results] == [(k, tool) for k in ("fwd_a", "fwd_b")
                                                     for tool in ("memcheck", "racecheck", "synccheck")]
    assert seen == results and all(r.clean for r in results)
    assert f"--kernel-name kns=fwd_b --report-api-errors no {sys.executable} -m attngen.cli fuzz --replay" in \
        results[-1].output_tail
    assert "caching off: 1" in results[0].output_tail


def test_sanitize_reports_errors_failing_replays_and_timeouts(fake_sanitizer, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_ERRORS", "4")
    monkeypatch.setenv("FAKE_EXIT", "1")
    memcheck, racecheck, synccheck = sanitize([("fwd_a", tmp_path)])
    assert memcheck.finding == synccheck.finding == "4 errors, the replay exited with status 1"
    assert racecheck.finding == "the replay exited with status 1"
    monkeypatch.setenv("FAKE_EXIT", "2")
    memcheck, racecheck, _ = sanitize([("fwd_a", tmp_path)])
    assert memcheck.kernel_finding and "4 errors" in memcheck.finding  # what the sanitizer saw still counts
    assert racecheck.finding.startswith("the replay could not run (exit status 2") and not racecheck.kernel_finding
    monkeypatch.delenv("FAKE_ERRORS")
    monkeypatch.setenv("FAKE_EXIT", "0")
    monkeypatch.setenv("FAKE_LAUNCHED", "fwd_sm80_tile")  # the replay ran another kernel than the one instrumented
    (other,) = sanitize([("fwd_a", tmp_path)], tools=("memcheck",))
    assert other.finding == "fwd_a never launched, so nothing was instrumented (the replay launched fwd_sm80_tile)"
    monkeypatch.setenv("FAKE_SLEEP", "5")
    (slow,) = sanitize([("fwd_a", tmp_path)], tools=("memcheck",), timeout=0.5)
    assert slow.returncode is None and slow.finding == "timed out"


def test_sanitize_without_compute_sanitizer_says_where_it_looked(monkeypatch):
    monkeypatch.setattr(sanitizer, "find_compute_sanitizer", lambda: None)
    with pytest.raises(FileNotFoundError, match="compute-sanitizer not found: put it on PATH"):
        sanitize([("k", Path("d"))])
