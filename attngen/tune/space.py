"""The search space of one spec: every tile configuration the templates accept.

Nothing here is a hand-written table: the space is the product of the tile fields'
allowed values (attngen/spec.py), filtered by the spec's own rules (rows per warp) and
by the plan (shared memory on the target arch). Tile fields the spec pins stay fixed,
so a partly tiled spec narrows the search. The plan's own choices (softmax step width
`sub_n`, Q in registers) come along with each candidate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from attngen.errors import SpecError
from attngen.plan import KernelPlan, make_plan
from attngen.spec import BLOCK_MS, BLOCK_NS, NUM_STAGES, NUM_WARPS, TILE_FIELDS, AttentionSpec

TILE_VALUES = {"block_m": BLOCK_MS, "block_n": BLOCK_NS, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}


@dataclass(frozen=True)
class Candidate:
    """One tile configuration of a spec: its plan, or why the plan rejects it."""

    spec: AttentionSpec  # tile fields and arch set
    plan: KernelPlan | None
    plan_error: str | None = None

    @property
    def label(self) -> str:
        return self.spec.tile.label()

    @property
    def launchable(self) -> bool:
        return self.plan is not None


def untiled(spec: AttentionSpec) -> AttentionSpec:
    """The spec with every tile field unset: what the tuning database is keyed by."""
    return spec.replace(**dict.fromkeys(TILE_FIELDS))


def search_space(spec: AttentionSpec, arch: str) -> list[Candidate]:
    """Every tile of `spec` for `arch` that the spec accepts, in a fixed order; the plan
    rejects some (recorded with its reason): they stay in the space, as unlaunchable."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    arch = spec.arch or arch
    choices = [(getattr(spec, f),) if getattr(spec, f) is not None else TILE_VALUES[f] for f in TILE_FIELDS]
    space = []
    for values in itertools.product(*choices):
        try:
            tiled = spec.replace(arch=arch, **dict(zip(TILE_FIELDS, values)))
        except SpecError:
            continue  # the template's own rules (rows per warp) exclude this combination
        try:
            space.append(Candidate(tiled, make_plan(tiled, arch)))
        except SpecError as exc:
            space.append(Candidate(tiled, None, str(exc)))
    if not space:
        raise SpecError(f"spec {spec.to_dict()} has no valid tile configuration: its pinned tile fields "
                        "contradict each other", field="block_m")
    return space
