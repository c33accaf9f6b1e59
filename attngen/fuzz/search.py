"""The search: hypothesis draws cases, `run_case` runs each; a failure is shrunk to a minimal case.
`run_search` is the part every regime shares (attngen/fuzz/decode_search.py runs paged decode cases).

One hypothesis run, seeded with --seed and with no example database, so a run is a function of
its seed. Its first cases are explicit ones, one per spec (strategies.first_cases), so every kernel
of the pool runs even in a short search; the rest are drawn. The first case drawn after the time budget is spent ends the run, so a run ends
within about one case of its budget; a failure found in time is always shrunk.

A sticky CUDA error (an illegal address, say) makes every later CUDA call in the process fail,
so shrinking it would "minimise" to whatever case came next: the search stops trying cases and
reports the case that raised it, unshrunk. Its reproducer replays in a fresh process.

An error in the harness itself (check.HARNESS: out of memory in the reference, say), or any
other exception the search did not expect, is not a kernel failure: the search stops at once,
unshrunk, with `harness_error` set and stopped == "harness error".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky

from attngen.fuzz.case import FuzzCase
from attngen.fuzz.check import FAILURE_KINDS, HARNESS, CaseResult, run_case
from attngen.fuzz.runners import Runner
from attngen.fuzz.sanitizer import sample_key
from attngen.fuzz.strategies import DEFAULT_LIMITS, Limits, first_cases, fuzz_cases
from attngen.spec import AttentionSpec
from attngen.targets import Target


class CaseFailed(Exception):
    def __init__(self, result: CaseResult):
        super().__init__(result.describe())
        self.result = result


class _BudgetSpent(BaseException):
    """Ends a hypothesis run from inside: like KeyboardInterrupt, hypothesis lets it through unshrunk."""


class _HarnessFailed(BaseException):
    """Ends a hypothesis run from inside, unshrunk: the harness, not the kernel, failed on this case."""

    def __init__(self, result: CaseResult):
        super().__init__(result.describe())
        self.result = result


# One exception type per failure kind: hypothesis keeps a failure's kind while it shrinks it
# (it tells failures apart by exception type), so a wrong value never shrinks into a crash.
_FAILURE_TYPES = {kind: type(f"{kind.title()}Failure", (CaseFailed,), {}) for kind in FAILURE_KINDS}


@dataclass
class KernelStats:
    kernel: str
    spec: AttentionSpec
    cases: int = 0
    failures: int = 0
    seconds: float = 0.0
    longest_seq_q: int = 0
    longest_seq_k: int = 0
    sample: FuzzCase | None = None  # the passing case a sanitizer run replays for this kernel


@dataclass
class SearchOutcome:
    seed: int
    examples: int
    cases: int = 0  # cases drawn and run, shrink steps not included
    shrink_steps: int = 0
    seconds: float = 0.0
    stopped: str = ""  # "examples", "time budget", "failure", "exhausted", "interrupted" or "harness error"
    failure: CaseResult | None = None  # the minimal failing case (or the first, when not shrunk)
    first_failure: CaseResult | None = None
    device_error: CaseResult | None = None  # the case after which the GPU context was unusable
    harness_error: CaseResult | None = None  # the case on which the harness itself failed (kind HARNESS)
    shrunk: bool = False
    flaky: bool = False  # the failure did not happen again when hypothesis replayed it
    kernels: dict[str, KernelStats] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.cases / self.seconds if self.seconds > 0 else 0.0

    def record(self, result: CaseResult, target: Target) -> None:
        stats = self.kernels.setdefault(result.kernel, KernelStats(result.kernel, result.case.spec))
        stats.cases += 1
        stats.failures += not result.ok
        stats.seconds += result.seconds
        seq_q, seq_k = self.lengths(result.case)
        stats.longest_seq_q = max(stats.longest_seq_q, seq_q)
        stats.longest_seq_k = max(stats.longest_seq_k, seq_k)
        key = self.sample_key
        if result.ok and (stats.sample is None or key(result.case, target) < key(stats.sample, target)):
            stats.sample = result.case

    # What a regime's outcome (attngen/fuzz/decode_search.py) records differently.
    @staticmethod
    def lengths(case: FuzzCase) -> tuple[int, int]:
        """The case's (queries, keys) for the longest-length columns."""
        return case.seq_q, case.seq_k

    @staticmethod
    def sample_key(case: FuzzCase, target: Target) -> tuple:
        return sample_key(case, target)


OnCase = Callable[[CaseResult, SearchOutcome, bool], None]


def search(specs, runner: Runner, *, examples: int, seed: int, time_budget: float | None = None,
           limits: Limits = DEFAULT_LIMITS, on_case: OnCase | None = None) -> SearchOutcome:
    """Run up to `examples` cases over `specs`; stop early at the time budget, the first failure (shrunk)
    or the first harness error (not shrunk)."""
    check_search_arguments(examples, time_budget)
    return run_search(fuzz_cases(specs, limits, runner.target), first_cases(specs, limits, runner.target)[:examples],
                      lambda case: fuzz_cases([case.spec], limits, runner.target), runner,
                      SearchOutcome(seed=seed, examples=examples), time_budget, on_case)


def check_search_arguments(examples: int, time_budget: float | None) -> None:
    if examples < 1:
        raise ValueError(f"examples={examples!r} is invalid; allowed: an integer >= 1")
    if time_budget is not None and not time_budget > 0:
        raise ValueError(f"time_budget={time_budget!r} is invalid; allowed: seconds > 0, or None for no limit")


def run_search(strategy, firsts: list, focus: Callable, runner, outcome: SearchOutcome, time_budget: float | None,
               on_case: OnCase | None, check: Callable | None = None,
               kernel_of: Callable | None = None) -> SearchOutcome:
    """The search of any regime: `firsts` (explicit cases), then cases drawn from `strategy`, each run by
    `check(case, runner)` -> CaseResult (default run_case); `focus(case)` draws cases of the case's
    kernel, for a failing first case. `kernel_of(runner, case)` names a case's kernel when `check`
    itself raised."""
    start = time.monotonic()

    def budget_spent() -> bool:
        return time_budget is not None and time.monotonic() - start >= time_budget

    harness = (check or run_case, kernel_of or _kernel_name)
    try:
        _run(strategy, firsts, outcome.examples - len(firsts), runner, outcome, budget_spent, on_case, harness)
        if outcome.failure is not None and outcome.failure.case in firsts and outcome.device_error is None:
            # A first case failed, and hypothesis does not shrink explicit cases: search its kernel
            # alone, where a failure is drawn again and shrunk (or the first case stands).
            _refocus(focus(outcome.failure.case), runner, outcome, budget_spent, on_case, harness)
    except KeyboardInterrupt:
        outcome.stopped = "interrupted"
    except _BudgetSpent:
        outcome.stopped = "time budget"
    except _HarnessFailed as exc:
        outcome.harness_error, outcome.stopped = exc.result, "harness error"
    outcome.seconds = time.monotonic() - start
    if not outcome.stopped:
        # Fewer cases than asked only when hypothesis has tried every case the strategy can draw.
        outcome.stopped = ("failure" if outcome.failure else "examples" if outcome.cases >= outcome.examples
                           else "exhausted")
    return outcome


FOCUSED_EXAMPLES = 200  # drawn cases a search of one failing spec may take to fail again


def _refocus(strategy, runner, outcome: SearchOutcome, budget_spent, on_case, harness) -> None:
    first = outcome.failure
    outcome.failure = outcome.first_failure = None
    try:
        _run(strategy, [], FOCUSED_EXAMPLES, runner, outcome, budget_spent, on_case, harness)
    finally:  # also when the budget, a harness error or an interrupt ends the focused search
        if outcome.device_error is None and (outcome.failure is None or outcome.failure.kind != first.kind):
            outcome.failure, outcome.shrunk, outcome.flaky = first, False, False
        outcome.first_failure = first


def _run(strategy, firsts: list, drawn: int, runner, outcome: SearchOutcome, budget_spent: Callable[[], bool],
         on_case: OnCase | None, harness: tuple[Callable, Callable]) -> None:
    check, kernel_of = harness

    def one_case(case) -> None:
        if outcome.device_error is not None:
            raise _FAILURE_TYPES["device"](outcome.device_error)  # the GPU is unusable: run nothing more
        shrinking = outcome.first_failure is not None
        if not shrinking:
            if budget_spent():
                raise _BudgetSpent
            outcome.cases += 1
        try:
            result = check(case, runner)
        except Exception as exc:  # noqa: BLE001 - check classifies what it expects; this is a harness bug
            raise _HarnessFailed(CaseResult(case, kernel_of(runner, case), 0.0, HARNESS,
                                            f"{type(exc).__name__}: {exc}")) from exc
        if result.harness_error:
            raise _HarnessFailed(result)
        if shrinking:
            outcome.shrink_steps += 1
        else:
            outcome.record(result, runner.target)
        if on_case is not None:
            on_case(result, outcome, shrinking)
        if not result.ok:
            outcome.first_failure = outcome.first_failure or result
            if result.kind == "device":
                outcome.device_error = result
            outcome.failure = result  # the latest failing case; hypothesis' final replay is the minimal one
            raise _FAILURE_TYPES[result.kind](result)

    case_test = given(strategy)(one_case)
    for case in reversed(firsts):  # decorators apply bottom-up: hypothesis runs them in list order
        case_test = example(case)(case_test)
    test = hypothesis_seed(outcome.seed)(settings(
        max_examples=max(drawn, 1),
        database=None,  # a run is a function of its seed, not of earlier runs
        deadline=None,  # cases differ in size by orders of magnitude
        suppress_health_check=[HealthCheck.too_slow],
        phases=[Phase.explicit, *([Phase.generate] if drawn else []), Phase.shrink],
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
    )(case_test))
    try:
        test()
    except CaseFailed as exc:
        # Shrunk unless it is one of the explicit first cases, which hypothesis runs as they are.
        outcome.failure, outcome.shrunk = exc.result, exc.result.case not in firsts
    except Flaky:
        # The minimal case passed when hypothesis ran it again: report the last failing case seen.
        outcome.flaky = True
    if outcome.device_error is not None:
        # Even while shrinking another failure: nothing after it ran, and it is the worse bug.
        outcome.failure, outcome.shrunk, outcome.flaky = outcome.device_error, False, False


def _kernel_name(runner, case: FuzzCase) -> str:
    """The runner's name for the case's kernel, or the spec's key when naming it is what failed."""
    try:
        return runner.kernel_name(case.spec)
    except Exception:  # noqa: BLE001 - reporting a harness error must not raise another
        return f"spec {case.spec.key()}"
