"""The search on a GPU: time the ranked survivors, best-predicted first, within a budget.

Per shape, the search times at most `max_fraction` of the launchable space, in the model's
order, and stops early when its share of the budget is spent (the first candidate is
always timed, so every shape gets an answer). Kernels are built with NVRTC in worker
processes while earlier candidates are being timed. Timing is attngen.bench's: CUDA
events, warm-up, median of repeats, inputs rotated past L2; a candidate whose short
probe is already far behind the best is not timed further. A candidate that fails to
build, launch or match the reference times as infinity with the reason; the winner is
checked against the reference before it is stored.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from attngen.spec import AttentionSpec
from attngen.tune import lookup
from attngen.tune.db import TuningDB, TuningEntry, TuningKey, now_utc
from attngen.tune.model import GpuModel, Shape, gpu_model
from attngen.tune.ranking import Ranked, analyse, no_survivor_error, rank, survivors
from attngen.tune.resources import describe_error, process_pool
from attngen.tune.space import search_space, untiled

PROBE_REPEATS = 3
# A probe this much slower than the best so far cannot win: its probe time is its time.
PROBE_CUTOFF = 1.5
# An odd length exercises ragged query and key blocks; small enough for the float64 reference.
VERIFY_SEQLEN = 1000


class TuneError(ValueError):
    """The search cannot produce an answer (nothing survives pruning, everything failed)."""


@dataclass
class Timing:
    ranked: Ranked
    ms: float  # inf when it failed
    error: str | None = None
    probe_only: bool = False  # dropped after the probe: a clear loser

    @property
    def ok(self) -> bool:
        return math.isfinite(self.ms)


@dataclass
class ShapeResult:
    spec: AttentionSpec  # untiled: what the result is stored for
    shape: Shape
    gpu: GpuModel
    ranked: list[Ranked]  # the whole space, survivors first in predicted order
    timings: list[Timing]  # in the order timed
    limit: int  # most candidates the max fraction allows
    stopped_by: str  # "max fraction", "budget" or "survivors"
    seconds: float
    winner: Timing | None = None
    entry: TuningEntry | None = field(default=None, repr=False)

    @property
    def launchable(self) -> int:
        return sum(r.pruned.candidate.launchable for r in self.ranked)

    def tflops(self, ms: float) -> float:
        return self.shape.flops(self.spec.head_dim, self.spec.mask == "causal") / (ms * 1e-3) / 1e12


# -- building and timing one candidate ------------------------------------------------------
def _nvrtc_binary(spec: AttentionSpec, family: str, target: str) -> str | None:
    """Worker: compile `spec` with NVRTC into the on-disk cache; None, or why it failed."""
    from attngen import compiler
    from attngen.plan import make_plan
    from attngen.render import render_plan

    try:
        plan = make_plan(spec, family)
        compiler.cached_compile(plan.name, render_plan(plan), target, compiler.NVRTC_OPTIONS,
                                compiler.nvrtc_version(), compiler.nvrtc_compile)
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


def input_sets(spec: AttentionSpec, shape: Shape):
    from attngen.bench import _input_sets
    from attngen.runtime import _DTYPE_NAMES

    dtype = _DTYPE_NAMES[spec.dtype]
    if shape.heads_q % spec.gqa_ratio:
        raise ValueError(f"heads_q={shape.heads_q} is invalid for gqa_ratio={spec.gqa_ratio}; allowed: a multiple "
                         "of gqa_ratio")
    if shape.seqlen_q != shape.seqlen_k:
        raise ValueError(f"shape {shape.label()}: the search times square shapes only (seqlen_q == seqlen_k)")
    return _input_sets(shape.batch, shape.seqlen_q, shape.heads_q, spec.head_dim, dtype=dtype,
                       kv_heads=shape.heads_q // spec.gqa_ratio)


def verify(spec: AttentionSpec) -> str | None:
    """None when `spec`'s kernel matches the reference on a small odd-length problem, else why not."""
    import torch

    import attngen
    from attngen import reference, tolerance

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = reference.SPEC_DTYPES[spec.dtype]

    def rand(heads):
        return torch.randn(1, VERIFY_SEQLEN, heads, spec.head_dim, generator=gen, device="cuda").to(dtype)

    q, k, v = rand(2 * spec.gqa_ratio), rand(2), rand(2)
    out, lse = attngen.compile(spec)(q, k, v)
    ref, ref_lse = reference.attention_for_spec(q, k, v, spec, return_lse=True)
    bad = tolerance.check_output(out, ref, q, k, v, spec.dtype, spec.effective_scale) or \
        tolerance.check_lse(lse, ref_lse, q, k, spec.effective_scale)
    return None if bad is None else f"wrong output: {bad}"


def time_candidates(todo: list[Ranked], shape: Shape, target: str, deadline: float, jobs: int | None,
                     on_timed=None) -> tuple[list[Timing], bool]:
    """Timings of `todo` in order, and whether the deadline cut the list short."""
    import attngen

    sets = input_sets(todo[0].spec, shape)
    timings: list[Timing] = []
    out_of_time = False
    best = math.inf
    with process_pool(jobs) as pool:
        builds = [pool.submit(_nvrtc_binary, r.spec, r.pruned.candidate.plan.arch, target) for r in todo]
        for i, (r, build) in enumerate(zip(todo, builds)):
            if i > 0 and time.monotonic() > deadline:
                out_of_time = True
                break
            error = build.result()
            timing = Timing(r, math.inf, error)
            if error is None:
                try:
                    kernel = attngen.compile(r.spec)
                    timing.ms, timing.probe_only = measure(lambda q, k, v: kernel(q, k, v), sets, best)
                    best = min(best, timing.ms)
                except Exception as exc:  # noqa: BLE001 - a launch failure is recorded, never a crash
                    timing.error = describe_error(exc)
            timings.append(timing)
            if on_timed is not None:
                on_timed(timing, best)
        for build in builds:
            build.cancel()
    del sets
    return timings, out_of_time


def verified_winner(timings: list[Timing]) -> Timing | None:
    """The fastest timing whose kernel matches the reference; wrong ones become infinite."""
    for timing in sorted((t for t in timings if t.ok), key=lambda t: t.ms):
        error = verify(timing.ranked.spec)
        if error is None:
            return timing
        timing.ms, timing.error = math.inf, error
    return None


# -- the whole search ---------------------------------------------------------------------------
def check_search_args(budget_s: float, max_fraction: float) -> None:
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
        raise ValueError(f"budget={budget_s!r} is invalid; allowed: seconds > 0")
    if isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float)) or not 0 < max_fraction <= 1:
        raise ValueError(f"max_fraction={max_fraction!r} is invalid; allowed: a number in (0, 1]")


def device_gpu_model(device: int) -> GpuModel:
    """The arch's model with this device's name and SM count."""
    import torch

    from attngen.runtime import _device_arch

    props = torch.cuda.get_device_properties(device)
    return gpu_model(_device_arch(device)[0]).with_device(lookup.device_identity(device)[0],
                                                          props.multi_processor_count)


def tune(spec: AttentionSpec, shapes: list[Shape], *, budget_s: float = 300.0, max_fraction: float = 0.3,
         db: TuningDB | None = None, jobs: int | None = None, progress=None) -> list[ShapeResult]:
    """Search the tile space of `spec` for each shape on the current GPU and store each winner.

    `budget_s` bounds the whole call (building included), shared evenly by the shapes still
    to do; `max_fraction` bounds how much of the space one shape may time. Tile fields the
    spec pins narrow the space. Results go to `db` (default: the default database).
    `progress`, if given, is an attngen.tune.report.Progress.
    """
    import torch

    from attngen.nvcc import find_nvcc

    check_search_args(budget_s, max_fraction)
    if not shapes:
        raise ValueError("shapes is empty; allowed: at least one Shape")
    if not torch.cuda.is_available():
        raise TuneError("attngen tune needs a CUDA GPU; torch.cuda.is_available() is False")
    if find_nvcc() is None:
        raise TuneError("attngen tune needs nvcc (PATH or $CUDA_HOME/bin) for the resource report")
    db = db or TuningDB()
    start = time.monotonic()
    device = torch.cuda.current_device()
    gpu = device_gpu_model(device)
    gpu_name, target = lookup.device_identity(device)

    space = search_space(spec, gpu.arch)
    task = progress.task("resource report (nvcc)", sum(c.launchable for c in space)) if progress else None
    pruned = analyse(space, gpu, jobs, on_compiled=task.advance if task else None)
    results = []
    for i, shape in enumerate(shapes):
        now = time.monotonic()
        deadline = now + (budget_s - (now - start)) / (len(shapes) - i)  # an even share of what is left
        result = _search_shape(spec, shape, pruned, gpu, target, deadline, max_fraction, jobs, progress)
        result.entry = _entry(result, gpu_name, target)
        db.put(result.entry)
        lookup.clear_memo()
        results.append(result)
    return results


def _search_shape(spec: AttentionSpec, shape: Shape, pruned, gpu: GpuModel, target: str, deadline: float,
                  max_fraction: float, jobs: int | None, progress) -> ShapeResult:
    start = time.monotonic()
    ranked = rank(pruned, gpu, shape)
    alive = survivors(ranked)
    if not alive:
        raise TuneError(no_survivor_error(spec, ranked))
    limit = max(1, math.floor(max_fraction * sum(r.pruned.candidate.launchable for r in ranked)))
    todo = alive[:limit]
    task = progress.task(f"timing {shape.label()}", len(todo)) if progress else None
    flops = shape.flops(spec.head_dim, spec.mask == "causal")

    def on_timed(timing, best):
        if task is not None:
            task.advance(f"best {flops / best / 1e9:.0f} TFLOP/s" if math.isfinite(best) else "")

    timings, out_of_time = time_candidates(todo, shape, target, deadline, jobs, on_timed)
    stopped_by = "budget" if out_of_time else "survivors" if len(alive) <= limit else "max fraction"
    result = ShapeResult(untiled(spec), shape, gpu, ranked, timings, limit, stopped_by, time.monotonic() - start)
    result.winner = verified_winner(timings)
    if result.winner is None:
        reasons = "; ".join(f"{t.ranked.label}: {t.error}" for t in timings[:3])
        raise TuneError(f"every timed configuration of {spec.to_dict()} on {shape.label()} failed: {reasons}")
    return result


def _entry(result: ShapeResult, gpu_name: str, target: str) -> TuningEntry:
    import attngen

    win = result.winner
    key = TuningKey.for_shape(result.spec, result.shape, gpu_name, target, lookup.compiler_version())
    return TuningEntry(key, win.ranked.spec.tile, win.ms, result.tflops(win.ms), result.shape.label(),
                       timed=len(result.timings), space=result.launchable, attngen_version=attngen.__version__,
                       updated=now_utc())
