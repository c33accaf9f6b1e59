"""The search space of one spec on one target: (kernel family, config) candidates.

Nothing here is a table: the space is what the kernel families say (attngen/families). Every
family that supports the spec's problem on the target contributes `family.configs(problem,
target, pinned)`; a spec that pins a family contributes that family only, and the config fields
it pins stay fixed, so a partly configured spec narrows the search. Each candidate carries its
plan, or the reason `family.plan()` rejects it on the target (too much shared memory, say):
those stay in the space, as unlaunchable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attngen import families
from attngen.errors import SpecError
from attngen.families.base import Config, Plan
from attngen.spec import AttentionSpec, Problem
from attngen.targets import Target


def label(family: str, config: Config) -> str:
    """How tables, errors and logs name a candidate: fwd_sm80/m128n64w4s2."""
    return f"{family}/{config.label()}"


@dataclass(frozen=True)
class Candidate:
    """One (family, config) of a spec on a target: its plan, or why the family rejects it there.

    Equality and hashing use (family, problem, target, config) only, which are all picklable:
    worker processes get those and plan again (a Plan holds its ABI's packing functions)."""

    family: str
    problem: Problem
    target: Target
    config: Config
    plan: Plan | None = field(default=None, compare=False, repr=False)
    plan_error: str | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return label(self.family, self.config)

    @property
    def launchable(self) -> bool:
        return self.plan is not None

    @property
    def spec(self) -> AttentionSpec:
        """The fully configured spec of this candidate (what the fuzz harness verifies)."""
        return spec_for(self.problem, self.family, self.config)


def spec_for(problem: Problem, family: str, config: Config) -> AttentionSpec:
    fields = {k: v for k, v in vars(problem).items() if v is not None}
    return AttentionSpec(**fields, family=family, config=config.to_dict())


def build_plan(family: str, problem: Problem, target: Target, config: Config) -> Plan:
    """The plan of one candidate (what worker processes call: SpecError when it cannot be built)."""
    return families.get_family(family).plan(problem, target, config)


def unconfigured(spec: AttentionSpec) -> AttentionSpec:
    """The spec without config fields and arch: its problem and pinned family, what a result is stored for."""
    return spec.replace(config=None, arch=None)


def search_space(spec: AttentionSpec, target: Target) -> list[Candidate]:
    """Every (family, config) the spec allows on `target`, families in order of preference, each
    family's configs in its own order. `target` is where the kernels will run (the GPU at hand, or
    `attngen check --configs --arch`); the spec's own `arch` is for offline generation only."""
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attngen.AttentionSpec, got {type(spec).__name__}")
    if not isinstance(target, Target):
        raise ValueError(f"target must be an attngen.targets.Target (attngen.targets.target('sm_90')), "
                         f"got {target!r}")
    problem = spec.problem
    if spec.family is not None:
        searched = [families.select(problem, target, spec.family)]  # SpecError saying why it cannot run here
    else:
        searched = families.supporting(problem, target)
        if not searched:
            families.select(problem, target)  # raises: no family can run it, with each family's reason
    space = []
    for family in searched:
        for config in family.configs(problem, target, spec.pinned if spec.family == family.name else None):
            try:
                space.append(Candidate(family.name, problem, target, config, family.plan(problem, target, config)))
            except SpecError as exc:
                space.append(Candidate(family.name, problem, target, config, None, str(exc)))
    if not space:
        raise SpecError(f"spec {spec.to_dict()} has no valid configuration: its pinned config fields contradict "
                        "each other", field="config")
    return space


def families_of(space: list[Candidate]) -> tuple[str, ...]:
    """The sorted names of the families a space covers (stored with each result as `searched`)."""
    return tuple(sorted({c.family for c in space}))
