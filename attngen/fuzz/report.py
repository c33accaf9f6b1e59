"""What `attngen fuzz` prints: progress while it runs, summary tables after.

Progress is attngen.progress's: a live rich bar in a terminal; otherwise (CI logs, a GPU host
without rich) a plain line every PLAIN_INTERVAL_S seconds and at the first failure. Tables use
rich when installed, aligned plain text otherwise.
"""

from __future__ import annotations

import time

from attngen import progress
from attngen.fuzz.check import CaseResult
from attngen.fuzz.search import SearchOutcome


class Progress:
    """Use as a context manager; `update` is search()'s on_case callback."""

    def __init__(self, examples: int, live: bool | None = None):
        self.examples = examples
        self._display = progress.Progress(live=live)
        self._task = None
        self._start = time.monotonic()

    def __enter__(self) -> "Progress":
        self._display.__enter__()
        self._task = self._display.task("fuzz", self.examples)
        return self

    def __exit__(self, *exc) -> None:
        self._display.__exit__(*exc)

    def status(self, outcome: SearchOutcome, shrinking: bool) -> str:
        if shrinking:
            return f"failure found; shrinking it (step {outcome.shrink_steps})"
        rate = outcome.cases / max(time.monotonic() - self._start, 1e-9)
        return f"{sum(s.failures for s in outcome.kernels.values())} failures, {rate:.1f} cases/s"

    def update(self, result: CaseResult, outcome: SearchOutcome, shrinking: bool) -> None:
        first_failure = not result.ok and not shrinking
        self._task.update(outcome.cases, note=self.status(outcome, shrinking), force=first_failure)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    if progress.rich_available():
        from rich.table import Table

        table = Table(title=title)
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        progress.console().print(table)
        return
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(title)
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(w) if i == 0 else str(cell).rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


GRADIENTS_NOTE = "gradients: dq, dk, dv checked in every case a backward family runs (attngen/fuzz/check.py)"
DECODE_NOTE = ("decode: every sequence's output and LSE checked against the float64 reference, NaN wherever a "
               "decode must not read (attngen/fuzz/paged.py)")


def print_summary(outcome: SearchOutcome, *, title: str = "attngen fuzz",
                  lengths: tuple[str, str] = ("longest Sq", "longest Sk"), note: str = GRADIENTS_NOTE) -> None:
    """The per-kernel table and a line of totals; `lengths` names KernelStats' two length columns."""
    rows = [[s.kernel, str(s.cases), str(s.failures), str(s.longest_seq_q), str(s.longest_seq_k),
             f"{1000 * s.seconds / s.cases:.1f}"] for s in sorted(outcome.kernels.values(), key=lambda s: s.kernel)]
    print_table(f"{title}: cases per kernel", ["kernel", "cases", "failures", *lengths, "ms/case"], rows)
    failures = sum(s.failures for s in outcome.kernels.values())
    print(f"{outcome.cases} cases in {outcome.seconds:.1f} s ({outcome.throughput:.1f} cases/s), {failures} failures, "
          f"seed {outcome.seed}; stopped: {outcome.stopped}")
    print(note)


def print_decode_summary(outcome: SearchOutcome) -> None:
    print_summary(outcome, title="attngen fuzz --decode", lengths=("most new tokens", "longest cache"),
                  note=DECODE_NOTE)
