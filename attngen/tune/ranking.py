"""Static analysis of a spec's space: prune with ptxas's report, then rank by the time model.

This is everything the search knows before it touches a GPU, and exactly what
`attngen check --configs` prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.spec import AttentionSpec
from attngen.tune.model import Estimate, GpuModel, Shape, estimate
from attngen.tune.resources import Pruned, compile_reports, prune
from attngen.tune.space import Candidate


@dataclass(frozen=True)
class Ranked:
    """A candidate with its verdict and, where it has a resource report, the model's estimate."""

    pruned: Pruned
    estimate: Estimate | None

    @property
    def label(self) -> str:
        return self.pruned.candidate.label

    @property
    def spec(self) -> AttentionSpec:
        return self.pruned.candidate.spec

    @property
    def predicted_ms(self) -> float:
        return self.estimate.ms if self.estimate is not None else float("inf")


def analyse(space: list[Candidate], gpu: GpuModel, jobs: int | None = None, on_compiled=None) -> list[Pruned]:
    """A space (attngen.tune.space.search_space) compiled with nvcc and pruned; shape-independent."""
    reports = compile_reports(space, gpu.arch, jobs, on_done=on_compiled)
    return [prune(c, r, gpu) for c, r in zip(space, reports)]


def rank(pruned: list[Pruned], gpu: GpuModel, shape: Shape) -> list[Ranked]:
    """Survivors fastest-predicted first, then the pruned ones (estimated where they compiled)."""
    ranked = []
    for p in pruned:
        est = None
        if p.report is not None and p.occupancy is not None and p.occupancy.ctas >= 1:
            est = estimate(p.candidate.plan, p.occupancy, gpu, shape)
        ranked.append(Ranked(p, est))
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
    return (f"every one of the {len(ranked)} tile configurations of {spec.to_dict()} was pruned ({detail}); "
            f"e.g. {example}")
