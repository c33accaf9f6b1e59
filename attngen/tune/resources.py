"""Static pruning: compile candidates with nvcc (parallel processes) and read ptxas's report.

A candidate is dropped, with its reason, when the plan rejects it, it fails to compile,
it spills registers, its shared memory exceeds the arch's limit, or too few warps fit on
an SM to keep every warp scheduler busy (attngen/tune/model.py). Survivors go on to the
time model. No GPU is needed.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from attngen import nvcc
from attngen.nvcc import ResourceReport, check_plan
from attngen.plan import SMEM_LIMIT, make_plan
from attngen.spec import AttentionSpec
from attngen.tune.model import GpuModel, Occupancy, occupancy
from attngen.tune.space import Candidate


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


def _nvcc_report(spec: AttentionSpec, arch: str) -> ResourceReport | str:
    """Worker: ptxas report of one candidate, or the first line of why it failed (never raises)."""
    try:
        return check_plan(make_plan(spec, arch), arch)
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


# Reports already read in this process, per nvcc version: a spec's report does not change while
# it runs. Only reports: a failure may be transient (a full disk, a killed nvcc), so it is retried.
_reports: dict[tuple[AttentionSpec, str, str], ResourceReport] = {}


def compile_reports(candidates: list[Candidate], arch: str, jobs: int | None = None,
                    on_done=None) -> list[ResourceReport | str | None]:
    """nvcc reports for the launchable candidates, in order (None for unlaunchable ones, the
    first line of the error for those that fail). `on_done()` is called as each compile
    finishes (progress bars)."""
    version = nvcc.nvcc_version()
    found: dict[AttentionSpec, ResourceReport | str] = {
        c.spec: _reports[c.spec, arch, version] for c in candidates if (c.spec, arch, version) in _reports}
    todo = [c.spec for c in candidates if c.launchable and c.spec not in found]
    for _ in range(sum(c.launchable for c in candidates) - len(todo)):
        if on_done is not None:
            on_done()
    if todo:
        with process_pool(min(jobs or os.cpu_count() or 1, len(todo))) as pool:
            futures = {spec: pool.submit(_nvcc_report, spec, arch) for spec in todo}
            for spec, future in futures.items():
                found[spec] = future.result()
                if isinstance(found[spec], ResourceReport):
                    _reports[spec, arch, version] = found[spec]
                if on_done is not None:
                    on_done()
    return [found[c.spec] if c.launchable else None for c in candidates]


def _first_clause(message: str, source: str | None) -> str:
    """The gist of a plan error for a table cell: no file name, no parenthesised detail."""
    if source and message.startswith(f"{source}: "):
        message = message[len(source) + 2:]
    return message.split(" (")[0].split("; ")[0]


def prune(candidate: Candidate, report: ResourceReport | str | None, gpu: GpuModel) -> Pruned:
    """The verdict on one candidate given its ptxas report (or compile error)."""
    if not candidate.launchable:
        return Pruned(candidate, None, None, f"plan: {_first_clause(candidate.plan_error, candidate.spec.source)}")
    if report is None or isinstance(report, str):
        return Pruned(candidate, None, None, f"compile: {report or 'no report'}")
    occ = occupancy(gpu, candidate.plan.threads, report.registers, report.smem_total_bytes)
    if report.spill_bytes:
        reason = f"spills {report.spill_store_bytes}/{report.spill_load_bytes} B"
    elif report.smem_total_bytes > SMEM_LIMIT[candidate.plan.arch]:
        reason = f"smem {report.smem_total_bytes} B > {SMEM_LIMIT[candidate.plan.arch]} B"
    elif occ.warps < gpu.schedulers:
        # Fewer warps than schedulers leaves tensor cores idle whatever the tile: it cannot win.
        reason = f"occupancy: {occ.warps} warps/SM < {gpu.schedulers} schedulers ({occ.limiter})"
    else:
        reason = None
    return Pruned(candidate, report, occ, reason)
