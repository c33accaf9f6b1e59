"""The fuzz pool's kernels compiled before its first case, in parallel processes, into the on-disk
cache (attngen/build/compiler.py): the cases then load them instead of compiling them one at a time
as hypothesis first draws each spec. On an H100 a cold pool of 38 fwd_sm90 specs took ~175 s of a
545 s run to its 35th case, each spec's first case building its forward and backward kernels one
after the other, before its cases ran at 10-16 a second (bench/results/fuzz-5921-seed141-*.log);
NVRTC builds one of them in about a second, and one process per CPU builds the pool's 63 at once.

A kernel that fails to build here is not reported here: its case compiles it again and reports the
failure as a kernel failure, with its reproducer, as it always did.
"""

from __future__ import annotations

import os
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from attngen.spec import AttentionSpec
from attngen.targets import Target


@dataclass(frozen=True)
class CompiledAhead:
    kernels: int  # distinct plans built or found in the cache
    failed: int  # of those, how many did not build (their cases will say why)
    seconds: float
    jobs: int

    def line(self) -> str:
        failed = f", {self.failed} failed (their cases report it)" if self.failed else ""
        return (f"  compiled {self.kernels} kernels ahead in {self.seconds:.1f} s ({self.jobs} processes)"
                f"{failed}")


def plans(spec: AttentionSpec, target: Target, fault: str | None) -> dict:
    """The plans a case of `spec` runs on `target`, by operation: the forward's and, where a backward
    family runs the spec, the backward's (runners.py: KernelRunner and backward_plan_name)."""
    from attngen.errors import SpecError
    from attngen.families import plan_spec
    from attngen.runtime.backward import backward_plan

    found = {"forward": plan_spec(spec, target, fault=fault)}
    try:
        found["backward"] = backward_plan(spec, target)
    except SpecError:
        pass
    return found


def _build(spec: AttentionSpec, target: Target, fault: str | None, operation: str) -> bool:
    """Worker: one plan built into the on-disk cache (planned again here: plans do not pickle); whether
    it built (never raises)."""
    from attngen.build import compiler

    try:
        compiler.build(plans(spec, target, fault)[operation])
        return True
    except Exception:  # noqa: BLE001 - the case that runs it reports the failure
        return False


def compile_ahead(pool, target: Target, fault: str | None, jobs: int | None = None) -> CompiledAhead:
    """Build every plan the pool's cases run, `jobs` processes at once (default: one per CPU)."""
    from attngen.tune.resources import process_pool

    start = time.monotonic()
    todo: dict[str, tuple] = {}  # plan name -> how a worker plans it again
    for spec in pool:
        for operation, plan in plans(spec, target, fault).items():
            todo.setdefault(plan.name, (spec, target, fault, operation))
    if not todo:
        return CompiledAhead(0, 0, 0.0, 0)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    try:
        with process_pool(jobs) as workers:
            built = list(workers.map(_build, *zip(*todo.values())))
    except (BrokenProcessPool, OSError):  # no worker processes here: each case builds its kernels, as before
        built = [False] * len(todo)
    return CompiledAhead(len(todo), built.count(False), time.monotonic() - start, jobs)
