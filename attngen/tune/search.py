"""The search on a GPU: time the ranked survivors, best-predicted first, until a deadline.

The space holds every (family, config) of every kernel family that can run the spec's problem on
this GPU (attngen/tune/space.py), ranked together by the families' time models. Per shape, the
search times at most `max_fraction` of the launchable space, in the model's order, and stops
early when its share of the time left to the deadline is spent (the first candidate is always
timed, so every shape gets an answer, past the deadline if need be). Kernels are built with
NVRTC in worker processes while earlier candidates are being timed, and run through the
dispatcher's own loaded kernels (attngen.runtime.dispatch.kernel_for). Timing is
attngen.bench's: CUDA events, warm-up, median of repeats, inputs rotated past L2; a candidate
whose short probe is already far behind the best is not timed further. A candidate that fails to
build or launch times as infinity with the reason. The winner is the fastest candidate that
passes the fuzz harness's check (verify()), timed in full (not just probed) before it is
stored, with the families the search covered. A sticky CUDA error (an illegal address, say)
ends the search with a TuneError: it leaves the process's CUDA context unusable.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from attngen import targets
from attngen.errors import is_sticky_cuda_error
from attngen.flops import tflops
from attngen.spec import AttentionSpec, Problem
from attngen.targets import Target
from attngen.tune import lookup
from attngen.tune.db import TuningDB, TuningEntry, TuningKey, now_utc
from attngen.tune.model import GpuModel, Shape, gpu_model
from attngen.tune.ranking import Ranked, analyse, no_survivor_error, rank, survivors
from attngen.tune.resources import describe_error, process_pool
from attngen.tune.space import Candidate, build_plan, families_of, search_space, unconfigured

PROBE_REPEATS = 3
# A probe this much slower than the best so far cannot win: its probe time is its time.
PROBE_CUTOFF = 1.5
DEFAULT_BUDGET_S = 300.0
# A length no tile divides exercises ragged query and key blocks; small enough for the float64 reference.
VERIFY_SEQLEN = 1000
VERIFY_KV_HEADS = 2


class TuneError(ValueError):
    """The search cannot produce or store an answer (nothing survives pruning, everything failed,
    a sticky CUDA error, a newer entry in the database, a narrowed spec)."""


def sticky_error(candidate: str, stage: str, error: str) -> TuneError:
    return TuneError(f"{candidate}: a sticky CUDA error while {stage}: {error}. It leaves this process's CUDA "
                     "context unusable (every later launch fails too), so the search stops here; entries stored "
                     "before it are kept. The process must restart to use the GPU again, and this config's kernel "
                     "has a bug: it will fail the same way")


@dataclass
class Timing:
    ranked: Ranked
    ms: float  # inf when it failed
    error: str | None = None
    probe_only: bool = False  # dropped after the probe: a clear loser

    @property
    def ok(self) -> bool:
        return math.isfinite(self.ms)

    @property
    def candidate(self) -> Candidate:
        return self.ranked.candidate


@dataclass
class ShapeResult:
    spec: AttentionSpec  # the problem and any pinned family: what the result is stored for
    shape: Shape
    gpu: GpuModel
    target: Target
    searched: tuple[str, ...]  # the families the space covered
    ranked: list[Ranked]  # the whole space, survivors first in predicted order
    timings: list[Timing]  # in the order timed
    limit: int  # most candidates the max fraction allows
    stopped_by: str  # "max fraction", "budget" or "survivors"
    seconds: float
    winner: Timing | None = None
    entry: TuningEntry | None = field(default=None, repr=False)

    @property
    def launchable(self) -> int:
        return sum(r.candidate.launchable for r in self.ranked)

    def tflops(self, ms: float) -> float:
        problem = self.spec.problem
        return tflops(self.shape.flops(problem.head_dim, problem.causal), ms)


# -- building and timing one candidate ------------------------------------------------------
def _nvrtc_binary(family: str, problem: Problem, target: Target, config) -> str | None:
    """Worker: build one candidate with NVRTC into the on-disk cache; None, or why it failed."""
    from attngen.build import compiler

    try:
        compiler.build(build_plan(family, problem, target, config))
        return None
    except Exception as exc:  # noqa: BLE001 - a failed build is a verdict, not a crash
        return describe_error(exc)


def measure(fn, input_sets, best_ms: float) -> tuple[float, bool]:
    """(median ms, probe only): a short probe first; a full timing only for a contender."""
    from attngen.bench import time_ms

    probe = time_ms(fn, input_sets, warmup=1, repeats=PROBE_REPEATS)
    if probe > PROBE_CUTOFF * best_ms:
        return probe, True
    return time_ms(fn, input_sets), False


def input_sets(problem: Problem, shape: Shape):
    """Rotating (q, k, v) sets of `shape` in the problem's dtype, on the current GPU."""
    from attngen.bench import input_sets
    from attngen.dtypes import get_dtype

    if shape.heads_q % problem.gqa_ratio:
        raise ValueError(f"heads_q={shape.heads_q} is invalid for gqa_ratio={problem.gqa_ratio}; allowed: a multiple "
                         "of gqa_ratio")
    if shape.seqlen_q != shape.seqlen_k:
        raise ValueError(f"shape {shape.label()}: the search times square shapes only (seqlen_q == seqlen_k)")
    return input_sets(shape.batch, shape.seqlen_q, shape.heads_q, problem.head_dim,
                       dtype=get_dtype(problem.dtype).torch_name, kv_heads=shape.heads_q // problem.gqa_ratio)


def verify(candidate: Candidate) -> str | None:
    """None when the candidate's kernel passes the fuzz harness's check on one case, else why not.
    The harness runs the fully configured spec (its family and config pinned) on the current GPU.
    The outputs start as NaN inside guarded buffers (a kernel that skips a write or writes outside
    its output fails), the layout is padded (strides that do not follow from the shape), and the
    length is one no tile divides."""
    from attngen.fuzz.case import FuzzCase
    from attngen.fuzz.check import run_case
    from attngen.fuzz.runners import KernelRunner

    case = FuzzCase(candidate.spec, batch=1, seq_q=VERIFY_SEQLEN, seq_k=VERIFY_SEQLEN, heads_kv=VERIFY_KV_HEADS,
                    layout="padded")
    try:
        result = run_case(case, KernelRunner())
    except Exception as exc:
        if is_sticky_cuda_error(f"{type(exc).__name__}: {exc}"):
            raise sticky_error(candidate.label, "verifying it", describe_error(exc)) from exc
        raise
    if result.ok:
        return None
    if result.kind == "device":
        raise sticky_error(candidate.label, "verifying it", result.detail)
    return f"failed verification ({result.kind}): {result.detail}"


def _time(timing: Timing, sets, best_ms: float, device: int) -> None:
    """Time `timing`'s kernel into it (a probe only when that is far behind `best_ms`); a failure is its error."""
    from attngen.runtime import dispatch

    try:
        kernel = dispatch.kernel_for(timing.candidate.plan, device)
        timing.ms, timing.probe_only = measure(lambda q, k, v: kernel(q, k, v), sets, best_ms)
    except Exception as exc:  # noqa: BLE001 - a launch failure is recorded, never a crash
        timing.ms, timing.error = math.inf, describe_error(exc)
        if is_sticky_cuda_error(f"{type(exc).__name__}: {exc}"):
            raise sticky_error(timing.ranked.label, "timing it", timing.error) from exc


def time_candidates(todo: list[Ranked], shape: Shape, device: int, deadline: float, jobs: int | None,
                    on_timed=None) -> tuple[list[Timing], bool]:
    """Timings of `todo` in order, and whether the deadline cut the list short."""
    sets = input_sets(todo[0].candidate.problem, shape)
    timings: list[Timing] = []
    out_of_time = False
    best = math.inf
    with process_pool(jobs) as pool:
        builds = [pool.submit(_nvrtc_binary, c.family, c.problem, c.target, c.config)
                  for c in (r.candidate for r in todo)]
        try:
            for i, (r, build) in enumerate(zip(todo, builds)):
                if i > 0 and time.monotonic() > deadline:
                    out_of_time = True
                    break
                timing = Timing(r, math.inf, build.result())
                if timing.error is None:
                    _time(timing, sets, best, device)
                    best = min(best, timing.ms)
                timings.append(timing)
                if on_timed is not None:
                    on_timed(timing, best)
        finally:
            for build in builds:  # the pool's exit waits for builds still queued
                build.cancel()
    del sets
    return timings, out_of_time


def verified_winner(timings: list[Timing], shape: Shape, device: int) -> Timing | None:
    """The fastest timing whose kernel passes verify(), timed in full; wrong ones become infinite.

    A probe-only time can come first: its probe was cut off by a faster candidate that then
    failed verification. It is timed again in full before it can win.
    """
    sets = None
    while True:
        ok = [t for t in timings if t.ok]
        if not ok:
            return None
        first = min(ok, key=lambda t: t.ms)
        if first.probe_only:
            sets = input_sets(first.candidate.problem, shape) if sets is None else sets
            _time(first, sets, math.inf, device)
            continue
        error = verify(first.candidate)
        if error is None:
            return first
        first.ms, first.error = math.inf, error


# -- the whole search ---------------------------------------------------------------------------
def check_search_args(budget_s: float | None, max_fraction: float) -> None:
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
                                 or not budget_s > 0):
        raise ValueError(f"budget={budget_s!r} is invalid; allowed: seconds > 0")
    if isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float)) or not 0 < max_fraction <= 1:
        raise ValueError(f"max_fraction={max_fraction!r} is invalid; allowed: a number in (0, 1]")


def check_narrowed(spec: AttentionSpec, store_narrowed: bool) -> None:
    """A spec that pins config fields searches part of its family's space, yet its winner would be
    stored under the key that every call pinning only that family reads: only when asked to."""
    if spec.config and not store_narrowed:
        spelled = ", ".join(f"{k}={v}" for k, v in spec.config.items())
        raise TuneError(f"{spec.source or spec.to_dict()}: pins {spelled}, so only part of family {spec.family}'s "
                        f"configs would be searched, yet the winner would be stored for every call that pins family "
                        f"{spec.family} and no config field; allowed: a spec with no config field set (the whole "
                        "space), or --store-narrowed (store_narrowed=True) to store the narrowed winner anyway")


def check_no_dropout(spec: AttentionSpec) -> None:
    """The search verifies winners against the reference without dropout: a spec with dropout is refused."""
    if spec.dropout_p:
        raise TuneError(f"{spec.source or spec.to_dict()}: dropout_p={spec.dropout_p}: the tuner verifies its winner "
                        "against the reference without dropout; allowed: dropout_p 0 (calls with dropout run the "
                        "family's defaults)")


def tune(spec: AttentionSpec, shapes: list[Shape], *, deadline: float | None = None, max_fraction: float = 0.3,
         db: TuningDB | None = None, jobs: int | None = None, progress=None,
         store_narrowed: bool = False) -> list[ShapeResult]:
    """Search the (family, config) space of `spec` for each shape on the current GPU and store each winner.

    Every family that can run the spec's problem on this GPU is searched, unless the spec pins one.
    `deadline` (a time.monotonic() value; default: DEFAULT_BUDGET_S from now) bounds the whole
    call, building, timing and verification included: each shape gets an even share of the time
    left when it starts, so an overrun comes out of the shapes after it. The first config of
    every shape is timed even past the deadline. `max_fraction` bounds how much of the space one
    shape may time. A spec that pins config fields narrows the space; its winner is stored (under
    the key of the spec without them) only with `store_narrowed`. Results go to `db` (default: the
    default database); a result the database does not take (it holds a newer entry) is a TuneError.
    `progress`, if given, is an attngen.progress.Progress.
    """
    import torch

    from attngen.build import nvcc

    check_search_args(None, max_fraction)
    deadline = time.monotonic() + DEFAULT_BUDGET_S if deadline is None else deadline
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or math.isnan(deadline):
        raise ValueError(f"deadline={deadline!r} is invalid; allowed: a time.monotonic() value in seconds")
    if not shapes:
        raise ValueError("shapes is empty; allowed: at least one Shape")
    check_narrowed(spec, store_narrowed)
    check_no_dropout(spec)
    if not torch.cuda.is_available():
        raise TuneError("attngen tune needs a CUDA GPU; torch.cuda.is_available() is False")
    if nvcc.find_nvcc() is None:
        raise TuneError(f"attngen tune needs nvcc for the resource report: {nvcc.NVCC_MISSING}")
    db = db or TuningDB()
    device = torch.cuda.current_device()
    target = targets.device_target(device)
    gpu = gpu_model(target)

    space = search_space(spec, target)
    task = progress.task("resource report (nvcc)", sum(c.launchable for c in space)) if progress else None
    pruned = analyse(space, gpu, jobs, on_compiled=task.advance if task else None)
    stored_for, searched = unconfigured(spec), families_of(space)
    results = []
    for i, shape in enumerate(shapes):
        now = time.monotonic()
        share = now + max(0.0, deadline - now) / (len(shapes) - i)  # an even share of what is left
        result = _search_shape(stored_for, searched, shape, pruned, gpu, target, device, share, max_fraction, jobs,
                               progress)
        result.entry = _entry(result)
        _store(db, result.entry)
        results.append(result)
    return results


def _store(db: TuningDB, entry: TuningEntry) -> None:
    if db.put(entry):
        return
    there = db.get(entry.key)
    held = f"{there.label()}, updated {there.updated}" if there is not None else "updated later than this one"
    raise TuneError(f"{db.path}: this run's winner for {entry.shape} ({entry.label()}, "
                    f"{entry.ms:.4g} ms, updated {entry.updated}) was not stored: the database holds a newer entry for "
                    f"its key ({held}), and an older result never replaces a newer one. The newer entry came from "
                    "another tune run, or from an --import of a machine whose clock is ahead")


def _search_shape(spec: AttentionSpec, searched: tuple[str, ...], shape: Shape, pruned, gpu: GpuModel,
                  target: Target, device: int, deadline: float, max_fraction: float, jobs: int | None,
                  progress) -> ShapeResult:
    start = time.monotonic()
    ranked = rank(pruned, gpu, shape)
    alive = survivors(ranked)
    if not alive:
        raise TuneError(no_survivor_error(spec, ranked))
    limit = max(1, math.floor(max_fraction * sum(r.candidate.launchable for r in ranked)))
    todo = alive[:limit]
    task = progress.task(f"timing {shape.label()}", len(todo)) if progress else None
    flops = shape.flops(spec.head_dim, spec.problem.causal)

    def on_timed(timing, best):
        if task is not None:
            task.advance(f"best {tflops(flops, best):.0f} TFLOP/s" if math.isfinite(best) else "")

    timings, out_of_time = time_candidates(todo, shape, device, deadline, jobs, on_timed)
    winner = verified_winner(timings, shape, device)
    if winner is None:
        reasons = "; ".join(f"{t.ranked.label}: {t.error}" for t in timings[:3])
        raise TuneError(f"every timed configuration of {spec.to_dict()} on {shape.label()} failed: {reasons}")
    stopped_by = "budget" if out_of_time else "survivors" if len(alive) <= limit else "max fraction"
    return ShapeResult(spec, shape, gpu, target, searched, ranked, timings, limit, stopped_by,
                       time.monotonic() - start, winner)


def _entry(result: ShapeResult) -> TuningEntry:
    import attngen

    win = result.winner.candidate
    key = TuningKey.for_shape(result.spec, result.shape, result.target.device_name, result.target.name,
                              lookup.compiler_version())
    return TuningEntry(key, win.family, win.config.to_dict(), result.searched, result.winner.ms,
                       result.tflops(result.winner.ms), result.shape.label(), timed=len(result.timings),
                       space=result.launchable, attngen_version=attngen.__version__, updated=now_utc())
