"""attngen.progress (CPU): the plain-text progress used without rich or a terminal, and the rich path."""

from __future__ import annotations

import pytest

from attngen import progress


def test_plain_lines_at_the_interval_when_forced_and_when_a_task_finishes(capsys, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with progress.Progress(live=False, interval=10.0) as display:
        task = display.task("tune", 12)
        task.advance("a")
        task.update(5, note="quiet")
        assert capsys.readouterr().out == ""  # within the interval
        task.update(6, note="a failure", force=True)
        assert capsys.readouterr().out == "tune [ 6/12] a failure\n"
        clock[0] += 10.0
        task.update(7)
        assert capsys.readouterr().out == "tune [ 7/12]\n"
        task.update(12, note="done")
        task.update(12, note="done")  # the finished line once
        assert capsys.readouterr().out == "tune [12/12] done\n"


def test_plain_lines_go_to_stderr_when_asked(capsys):
    with progress.Progress(stderr=True, live=False) as display:
        display.task("configs", 1).advance()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "configs [1/1]\n"


def test_without_a_terminal_progress_is_plain(capsys):
    # pytest captures stdout: not a terminal, so no live bars even where rich is installed.
    assert progress.Progress().live is False


def test_rich_progress_and_log_console():
    pytest.importorskip("rich")
    console = progress.console()
    assert console.width == progress.LOG_WIDTH and console.no_color  # not a terminal
    with progress.Progress(live=True) as display:
        task = display.task("fuzz", 3)
        task.advance("1 failures")
        bars = display._bars
        (rich_task,) = bars.tasks
        assert (rich_task.description, rich_task.completed, rich_task.fields["note"]) == ("fuzz", 1, "1 failures")
    assert display._bars is None
