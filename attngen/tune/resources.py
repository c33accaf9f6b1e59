"""Static pruning: compile candidates with nvcc (parallel processes) and read ptxas's report.

A candidate is dropped, with its reason, when its family rejects it on the target, it fails to
compile, it spills registers, one of its kernels needs more shared memory than the target
allows a block, or too few warps of its first kernel fit on an SM to keep every warp scheduler
busy (attngen/tune/model.py). Survivors go on to the time model. No GPU is needed.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from attngen.build import nvcc
from attngen.build.nvcc import ResourceReport
from attngen.tune.model import GpuModel, Occupancy, occupancy
from attngen.tune.space import Candidate, build_plan


@dataclass(frozen=True)
class Pruned:
    """A candidate with its resource report (None when it has none) and the verdict."""

    candidate: Candidate
    report: ResourceReport | None
    occupancy: Occupancy | None
    reason: str | None  # None: survives

    @property
    def survives(self) -> bool:
        return self.reason is None


def _nvcc_report(family: str, problem, target, config) -> ResourceReport | str:
    """Worker: ptxas report of one candidate, or the first line of why it failed (never raises)."""
    try:
        return nvcc.check_plan(build_plan(family, problem, target, config))
    except Exception as exc:  # noqa: BLE001 - a config that fails to build is a verdict, not a crash
        return describe_error(exc)


def describe_error(exc: BaseException) -> str:
    """One line for a table cell: the exception type and the first line of its message."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def process_pool(jobs: int | None) -> ProcessPoolExecutor:
    """Worker processes started fresh (spawn): safe in a parent that already holds a CUDA context."""
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs={jobs!r} is invalid; allowed: an integer >= 1, or None for one per CPU")
    return ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1,
                               mp_context=multiprocessing.get_context("spawn"))


# Reports already read in this process, per nvcc version: a candidate's report does not change while
# it runs. Only reports: a failure may be transient (a full disk, a killed nvcc), so it is retried.
_reports: dict[tuple[Candidate, str], ResourceReport] = {}


def compile_reports(candidates: list[Candidate], jobs: int | None = None,
                    on_done=None) -> list[ResourceReport | str | None]:
    """nvcc reports for the launchable candidates, in order (None for unlaunchable ones, the
    first line of the error for those that fail). `on_done()` is called as each compile
    finishes (progress bars)."""
    version = nvcc.nvcc_version()
    found: dict[Candidate, ResourceReport | str] = {
        c: _reports[c, version] for c in candidates if (c, version) in _reports}
    todo = list(dict.fromkeys(c for c in candidates if c.launchable and c not in found))
    for _ in range(sum(c.launchable for c in candidates) - len(todo)):
        if on_done is not None:
            on_done()
    if todo:
        with process_pool(min(jobs or os.cpu_count() or 1, len(todo))) as pool:
            futures = {c: pool.submit(_nvcc_report, c.family, c.problem, c.target, c.config) for c in todo}
            for c, future in futures.items():
                found[c] = future.result()
                if isinstance(found[c], ResourceReport):
                    _reports[c, version] = found[c]
                if on_done is not None:
                    on_done()
    return [found[c] if c.launchable else None for c in candidates]


def _first_clause(message: str) -> str:
    """The gist of a plan error for a table cell: no parenthesised detail, no advice."""
    return message.split(" (")[0].split("; ")[0]


def _kernel_reports(report: ResourceReport) -> list[ResourceReport]:
    return list(report.kernels.values()) if report.kernels else [report]


def prune(candidate: Candidate, report: ResourceReport | str | None, gpu: GpuModel) -> Pruned:
    """The verdict on one candidate given its ptxas report (or compile error)."""
    if not candidate.launchable:
        return Pruned(candidate, None, None, f"plan: {_first_clause(candidate.plan_error)}")
    if report is None or isinstance(report, str):
        return Pruned(candidate, None, None, f"compile: {report or 'no report'}")
    limit = candidate.target.smem_per_block
    first = candidate.plan.kernels[0]
    occ = occupancy(gpu, first.threads, report.registers, report.smem_total_bytes)
    too_big = [k for k in _kernel_reports(report) if k.smem_total_bytes > limit]
    if report.spill_bytes:  # summed over every function of the module by ptxas's report
        reason = f"spills {report.spill_store_bytes}/{report.spill_load_bytes} B"
    elif too_big:
        which = "" if len(candidate.plan.kernels) == 1 else f" ({too_big[0].name})"
        reason = f"smem {too_big[0].smem_total_bytes} B > {limit} B{which}"
    elif occ.warps < gpu.schedulers:
        # Fewer warps than schedulers leaves tensor cores idle whatever the config: it cannot win.
        reason = f"occupancy: {occ.warps} warps/SM < {gpu.schedulers} schedulers ({occ.limiter})"
    else:
        reason = None
    return Pruned(candidate, report, occ, reason)
