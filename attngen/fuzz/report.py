"""What `attngen fuzz` prints: progress while it runs, summary tables after.

rich draws a live progress bar when it is installed and stdout is a terminal; otherwise (CI
logs, a GPU host without rich) a plain line every PLAIN_INTERVAL_S seconds. Tables use rich
when installed, aligned plain text otherwise.
"""

from __future__ import annotations

import sys
import time

from attngen.fuzz.check import CaseResult, has_backward
from attngen.fuzz.search import SearchOutcome

PLAIN_INTERVAL_S = 10.0


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


class Progress:
    """Use as a context manager; `update` is search()'s on_case callback."""

    def __init__(self, examples: int, live: bool | None = None):
        self.examples = examples
        self.live = (sys.stdout.isatty() and _rich_available()) if live is None else live
        self._bar = self._task = None
        self._start = self._last_line = time.monotonic()

    def __enter__(self) -> "Progress":
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("fuzz"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[status]}"))
            self._bar.start()
            self._task = self._bar.add_task("fuzz", total=self.examples, status="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def status(self, outcome: SearchOutcome, shrinking: bool) -> str:
        if shrinking:
            return f"failure found; shrinking it (step {outcome.shrink_steps})"
        rate = outcome.cases / max(time.monotonic() - self._start, 1e-9)
        return f"{sum(s.failures for s in outcome.kernels.values())} failures, {rate:.1f} cases/s"

    def update(self, result: CaseResult, outcome: SearchOutcome, shrinking: bool) -> None:
        status = self.status(outcome, shrinking)
        if self._bar is not None:
            self._bar.update(self._task, completed=outcome.cases, status=status)
            return
        now = time.monotonic()
        first_failure = not result.ok and not shrinking
        if first_failure or now - self._last_line >= PLAIN_INTERVAL_S:
            self._last_line = now
            print(f"[{outcome.cases:>{len(str(self.examples))}}/{self.examples}] {status}", flush=True)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    if _rich_available():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        # Not a terminal (CI logs, pipes): wide enough that kernel names are never cut.
        console = Console() if sys.stdout.isatty() else Console(width=200, no_color=True)
        console.print(table)
        return
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(title)
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(w) if i == 0 else str(cell).rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


def print_summary(outcome: SearchOutcome) -> None:
    rows = [[s.kernel, str(s.cases), str(s.failures), str(s.longest_seq_q), str(s.longest_seq_k),
             f"{1000 * s.seconds / s.cases:.1f}"] for s in sorted(outcome.kernels.values(), key=lambda s: s.kernel)]
    print_table("attngen fuzz: cases per kernel", ["kernel", "cases", "failures", "longest Sq", "longest Sk", "ms/case"],
                rows)
    failures = sum(s.failures for s in outcome.kernels.values())
    print(f"{outcome.cases} cases in {outcome.seconds:.1f} s ({outcome.throughput:.1f} cases/s), {failures} failures, "
          f"seed {outcome.seed}; stopped: {outcome.stopped}")
    if not any(has_backward(s.spec) for s in outcome.kernels.values()):
        print("gradients: not checked, no spec has a backward pass yet")
