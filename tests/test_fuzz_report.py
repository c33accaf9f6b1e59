"""What `attngen fuzz` prints (CPU): the plain-text fallbacks used without rich or without a terminal."""

from __future__ import annotations

from attngen import progress
from attngen.fuzz import report
from attngen.fuzz.case import FuzzCase
from attngen.fuzz.check import CaseResult
from attngen.fuzz.search import KernelStats, SearchOutcome
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64)
CASE = FuzzCase(SPEC, batch=1, seq_q=3, seq_k=5, heads_kv=1)


def _outcome() -> SearchOutcome:
    outcome = SearchOutcome(seed=9, examples=40, cases=12, seconds=3.0, stopped="examples")
    outcome.kernels["fwd_a"] = KernelStats("fwd_a", SPEC, cases=12, failures=0, seconds=0.6, longest_seq_q=300,
                                           longest_seq_k=4097)
    return outcome


def test_plain_summary_without_rich(monkeypatch, capsys):
    monkeypatch.setattr(progress, "rich_available", lambda: False)
    report.print_summary(_outcome())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "attngen fuzz: cases per kernel"
    assert lines[1].split() == ["kernel", "cases", "failures", "longest", "Sq", "longest", "Sk", "ms/case"]
    assert lines[2].split() == ["fwd_a", "12", "0", "300", "4097", "50.0"]
    assert lines[3] == "12 cases in 3.0 s (4.0 cases/s), 0 failures, seed 9; stopped: examples"
    assert lines[4] == "gradients: dq, dk, dv checked in every case a backward family runs (attngen/fuzz/check.py)"


def test_plain_progress_reports_the_first_failure_at_once(capsys):
    outcome = _outcome()
    with report.Progress(40, live=False) as progress:
        progress.update(CaseResult(CASE, "fwd_a", 0.1), outcome, shrinking=False)
        assert capsys.readouterr().out == ""  # passing cases print at most every PLAIN_INTERVAL_S
        outcome.kernels["fwd_a"].failures = 1
        progress.update(CaseResult(CASE, "fwd_a", 0.1, "output", "bad"), outcome, shrinking=False)
    assert capsys.readouterr().out.startswith("fuzz [12/40] 1 failures, ")
    assert progress.status(outcome, shrinking=True) == "failure found; shrinking it (step 0)"
