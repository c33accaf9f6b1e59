"""Progress display and console setup for long-running commands (`attngen fuzz`, `attngen tune`).

Live rich progress bars when rich is installed and the output stream is a terminal; otherwise
(CI logs, pipes, a GPU host without rich) a plain line per task at most every `interval`
seconds, when a task finishes, and whenever an update asks for one. `console()` is the rich
Console for tables: outside a terminal it is wide and colourless, so logs keep whole rows.
"""

from __future__ import annotations

import sys
import time

PLAIN_INTERVAL_S = 10.0
LOG_WIDTH = 220  # columns of a console that is not a terminal: wide enough that kernel names are never cut


def rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _stream(stderr: bool):
    return sys.stderr if stderr else sys.stdout


def console(stderr: bool = False):
    """A rich Console on stdout (or stderr); outside a terminal LOG_WIDTH wide and without colour."""
    from rich.console import Console

    if _stream(stderr).isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=LOG_WIDTH, no_color=True)


class Progress:
    """Use as a context manager; `task(label, total)` adds a task to update.

    live: rich bars (default: when rich is installed and the stream is a terminal)."""

    def __init__(self, *, stderr: bool = False, live: bool | None = None, interval: float = PLAIN_INTERVAL_S):
        self.stderr = stderr
        self.live = (_stream(stderr).isatty() and rich_available()) if live is None else live
        self.interval = interval
        self._bars = None

    def __enter__(self) -> "Progress":
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bars = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                                      console=console(self.stderr))
            self._bars.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bars is not None:
            self._bars.stop()
            self._bars = None

    def task(self, label: str, total: int) -> "Task":
        if self._bars is not None:
            return Task(self, label, total, self._bars.add_task(label, total=total, note=""))
        return Task(self, label, total, None)


class Task:
    """One task's progress: `update(completed=...)` or `advance()`, each with an optional note."""

    def __init__(self, progress: Progress, label: str, total: int, bar_id):
        self._progress, self.label, self.total, self._bar_id = progress, label, total, bar_id
        self.completed = 0
        self._last_line = time.monotonic()
        self._printed: int | None = None  # `completed` when the last plain line was printed

    def advance(self, note: str = "", *, force: bool = False) -> None:
        self.update(self.completed + 1, note=note, force=force)

    def update(self, completed: int, *, note: str = "", force: bool = False) -> None:
        """`force`: print a plain line now (something the log must show, a first failure say)."""
        self.completed = completed
        bars = self._progress._bars
        if bars is not None:
            bars.update(self._bar_id, completed=completed, note=note)
            return
        now = time.monotonic()
        finished = completed >= self.total and self._printed != completed
        if force or finished or now - self._last_line >= self._progress.interval:
            self._last_line, self._printed = now, completed
            line = f"{self.label} [{completed:>{len(str(self.total))}}/{self.total}]"
            print(f"{line} {note}" if note else line, file=_stream(self._progress.stderr), flush=True)
