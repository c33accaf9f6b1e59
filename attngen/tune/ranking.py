"""Static analysis of a spec's space: prune with ptxas's report, then rank by each family's time model.

This is everything the search knows before it touches a GPU, and exactly what
`attngen check --configs` prints. Candidates of every family are ranked together by their
family's `estimate()` (predicted milliseconds on the shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.families import get_family
from attngen.spec import AttentionSpec
from attngen.tune.model import Estimate, GpuModel, Shape
from attngen.tune.resources import Pruned, compile_reports, prune
from attngen.tune.space import Candidate


@dataclass(frozen=True)
class Ranked:
    """A candidate with its verdict and, where it has a resource report, its family's estimate."""

    pruned: Pruned
    estimate: Estimate | None

    @property
    def candidate(self) -> Candidate:
        return self.pruned.candidate

    @property
    def label(self) -> str:
        return self.pruned.candidate.label

    @property
    def predicted_ms(self) -> float:
        return self.estimate.ms if self.estimate is not None else float("inf")


def analyse(space: list[Candidate], gpu: GpuModel, jobs: int | None = None, on_compiled=None) -> list[Pruned]:
    """A space (attngen.tune.space.search_space) compiled with nvcc and pruned; shape-independent."""
    reports = compile_reports(space, jobs, on_done=on_compiled)
    return [prune(c, r, gpu) for c, r in zip(space, reports)]


def estimate(pruned: Pruned, gpu: GpuModel, shape: Shape) -> Estimate | None:
    """The family's prediction for a candidate that compiled and fits on an SM, else None."""
    if pruned.report is None or pruned.occupancy is None or pruned.occupancy.ctas < 1:
        return None
    c = pruned.candidate
    return get_family(c.family).estimate(c.plan, pruned.report, gpu, shape)


def rank(pruned: list[Pruned], gpu: GpuModel, shape: Shape) -> list[Ranked]:
    """Survivors fastest-predicted first, then the pruned ones (estimated where they compiled)."""
    ranked = [Ranked(p, estimate(p, gpu, shape)) for p in pruned]
    return sorted(ranked, key=lambda r: (not r.pruned.survives, r.predicted_ms, r.label))


def survivors(ranked: list[Ranked]) -> list[Ranked]:
    return [r for r in ranked if r.pruned.survives]


def no_survivor_error(spec: AttentionSpec, ranked: list[Ranked]) -> str:
    """Why a pruned-to-nothing space is empty: the count of each reason."""
    counts: dict[str, int] = {}
    for r in ranked:
        kind = r.pruned.reason.split(":")[0].split(" ")[0]
        counts[kind] = counts.get(kind, 0) + 1
    detail = ", ".join(f"{n} by {kind}" for kind, n in sorted(counts.items()))
    example = "; ".join(f"{r.label}: {r.pruned.reason}" for r in ranked[:3])
    return (f"every one of the {len(ranked)} configurations of {spec.to_dict()} was pruned ({detail}); "
            f"e.g. {example}")
