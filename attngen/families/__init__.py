"""Kernel families, in order of preference: the dispatcher runs the first that supports a problem
on the GPU at hand (a spec may pin one by name).

Adding a family: a folder beside fwd_sm80/ whose __init__.py exposes FAMILY (a KernelFamily,
attngen/families/base.py), and its name in REGISTERED (forward), DECODE_REGISTERED (decode) or
BACKWARD_REGISTERED (the forward's gradients).
Nothing else names families.
"""

from __future__ import annotations

import importlib

from attngen.errors import SpecError
from attngen.families.base import KernelFamily, Plan

REGISTERED = ("fwd_sm90", "fwd_sm80")
# Families of the decode front door (attngen.decode): a call of new tokens against a KV cache.
DECODE_REGISTERED = ("decode_sm80",)
# Families of attention()'s backward: q, k, v gradients from the forward's output and LSE.
BACKWARD_REGISTERED = ("bwd_sm90", "bwd_sm80")

FAMILIES: dict[str, KernelFamily] = {
    name: importlib.import_module(f"attngen.families.{name}").FAMILY for name in REGISTERED
}
DECODE_FAMILIES: dict[str, KernelFamily] = {
    name: importlib.import_module(f"attngen.families.{name}").FAMILY for name in DECODE_REGISTERED
}
BACKWARD_FAMILIES: dict[str, KernelFamily] = {
    name: importlib.import_module(f"attngen.families.{name}").FAMILY for name in BACKWARD_REGISTERED
}
OPERATIONS = ("forward", "decode", "backward")


def _registries() -> dict[str, dict[str, KernelFamily]]:
    # Looked up at each call: tests replace a module-level registry.
    return {"forward": FAMILIES, "decode": DECODE_FAMILIES, "backward": BACKWARD_FAMILIES}


def get_family(name: str) -> KernelFamily:
    """A forward, decode or backward family by name."""
    for families in _registries().values():
        try:
            if name in families:
                return families[name]
        except TypeError:
            break
    raise ValueError(f"family={name!r} is invalid; allowed: {', '.join(n for f in _registries().values() for n in f)}")


def registry(operation: str) -> dict[str, KernelFamily]:
    """The families of one front door: "forward" (attention()), "decode" (attngen.decode()) or
    "backward" (attention()'s gradients)."""
    if operation not in OPERATIONS:
        raise ValueError(f"operation={operation!r} is invalid; allowed: {', '.join(OPERATIONS)}")
    return _registries()[operation]


def supporting(problem, target, operation: str = "forward") -> list[KernelFamily]:
    """The families of `operation` that can run `problem` on `target`, in order of preference."""
    return [f for f in registry(operation).values() if f.supports(problem, target) is None]


def select(problem, target, family: str | None = None, operation: str = "forward") -> KernelFamily:
    """The pinned family (SpecError saying why when it cannot run here or serves another operation),
    else the first family of `operation` that can."""
    if family is not None:
        chosen = get_family(family)
        if chosen.operation != operation:
            raise SpecError(f"family={family!r} is a {chosen.operation} family, but this call runs a {operation} "
                            f"family ({', '.join(registry(operation))})", field="family")
        reason = chosen.supports(problem, target)
        if reason is not None:
            raise SpecError(f"family={family!r} cannot run {problem.label()} on {target.name}: {reason}",
                            field="family")
        return chosen
    found = supporting(problem, target, operation)
    if not found:
        reasons = "; ".join(f"{f.name}: {f.supports(problem, target)}" for f in registry(operation).values())
        kind = "" if operation == "forward" else f"{operation} "
        raise SpecError(f"no {kind}kernel family can run {problem.label()} on {target.name} ({reasons})",
                        field="family")
    return found[0]


def plan_spec(spec, target=None, *, fault: str | None = None, operation: str | None = None,
              seqlen: int | None = None) -> Plan:
    """The plan a spec makes for `target` (default: the spec's arch, else sm_90): its pinned family or
    the preferred one, its pinned config fields and the family's defaults for the rest. No tuning
    lookup (attngen/runtime/dispatch.py adds that). `operation`: the one the caller runs ("forward"
    for attention()); None takes a pinned family's own (`attngen generate` of a decode spec).
    `seqlen`: where the caller knows it, the call's longest sequence rounded up to a power of two (the
    front door's length bucket), which an unpinned default may depend on."""
    from attngen import targets

    if target is None:
        target = targets.target(spec.arch or targets.DEFAULT_ARCH)
    try:
        if operation is None:
            operation = get_family(spec.family).operation if spec.family else "forward"
        family = select(spec.problem, target, spec.family, operation)
        config = family.resolve_config(spec.problem, target, spec.pinned if spec.family == family.name else {}, seqlen)
        return family.plan(spec.problem, target, config, fault=fault)
    except SpecError as exc:
        if spec.source and not str(exc).startswith(spec.source):
            raise SpecError(f"{spec.source}: {exc}", field=exc.field, problems=exc.problems) from None
        raise
