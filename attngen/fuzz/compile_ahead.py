"""The fuzz pool's kernels (forward and backward; with --decode, the decode plans) compiled before its
first case, in parallel processes, into the on-disk cache (attngen/build/compiler.py): the cases then
load them instead of compiling them one at a time as hypothesis first draws each spec. On an H100 a
cold pool of 38 fwd_sm90 specs took ~175 s of a 545 s run to its 35th case, each spec's first case
building its forward and backward kernels one after the other, before its cases ran at 10-16 a
second (bench/results/fuzz-5921-seed141-*.log); NVRTC builds one of them in about a second, and one
process per CPU builds the pool's 63 at once.

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


def forward_plans(spec: AttentionSpec, target: Target, fault: str | None) -> dict:
    """The plans a forward case of `spec` runs on `target`: the forward's and, where a backward family
    runs the spec, the backward's (runners.py: KernelRunner and backward_plan_name)."""
    from attngen.errors import SpecError
    from attngen.families import plan_spec
    from attngen.runtime.backward import backward_plan

    found = {"forward": plan_spec(spec, target, fault=fault)}
    try:
        found["backward"] = backward_plan(spec, target)
    except SpecError:
        pass
    return found


def decode_plans(spec: AttentionSpec, target: Target, fault: str | None = None) -> dict:
    """The plans a decode case of `spec` may run, by page size: one per kind of cache (paged.py
    FIRST_PAGE_SIZES: pages of rows, pages of whole key blocks, contiguous); each holds its combine."""
    from attngen.fuzz.paged import FIRST_PAGE_SIZES
    from attngen.runtime.decode import decode_plan

    return {size: decode_plan(spec, target, size is not None, size) for size in FIRST_PAGE_SIZES}


PLANS = {"forward": forward_plans, "decode": decode_plans}  # by regime


def _build(regime: str, spec: AttentionSpec, target: Target, fault: str | None, key) -> bool:
    """Worker: one plan built into the on-disk cache (planned again here: plans do not pickle); whether
    it built (never raises)."""
    from attngen.build import compiler

    try:
        compiler.build(PLANS[regime](spec, target, fault)[key])
        return True
    except Exception:  # noqa: BLE001 - the case that runs it reports the failure
        return False


def compile_ahead(pool, target: Target, fault: str | None = None, jobs: int | None = None,
                  regime: str = "forward") -> CompiledAhead:
    """Build every plan the pool's cases run in `regime`, `jobs` processes at once (default: one per CPU)."""
    from attngen.tune.resources import process_pool

    start = time.monotonic()
    todo: dict[str, tuple] = {}  # plan name -> how a worker plans it again
    for spec in pool:
        for key, plan in PLANS[regime](spec, target, fault).items():
            todo.setdefault(plan.name, (regime, spec, target, fault, key))
    if not todo:
        return CompiledAhead(0, 0, 0.0, 0)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    try:
        with process_pool(jobs) as workers:
            built = list(workers.map(_build, *zip(*todo.values())))
    except (BrokenProcessPool, OSError):  # no worker processes here: each case builds its kernels, as before
        built = [False] * len(todo)
    return CompiledAhead(len(todo), built.count(False), time.monotonic() - start, jobs)
