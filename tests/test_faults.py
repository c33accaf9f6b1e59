"""Fault injection renders a distinct, clearly marked kernel and leaves correct kernels alone, in every
kernel family (a fault is a plan-level template flag: the fuzzer's own test needs every family to honour it)."""

import pytest

from attngen import families, targets
from attngen.faults import FAULTS
from attngen.fuzz.pool import PROBLEMS, pinned_spec


def _family_specs():
    """(family, spec pinned to it, a target it runs the spec on) for every registered family."""
    found = []
    for family in families.FAMILIES.values():
        for arch in targets.allowed_archs():
            target = targets.target(arch)
            problem = next((p for p in PROBLEMS if family.supports(p, target) is None), None)
            if problem is not None:
                found.append(pytest.param(family, pinned_spec(problem, family), target, id=family.name))
                break
        else:
            pytest.fail(f"family {family.name} supports no problem of the fuzz pool on any known target")
    return found


FAMILY_SPECS = _family_specs()


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("family, spec, target", FAMILY_SPECS)
def test_fault_kernel_has_its_own_symbol_and_macro(family, spec, target, fault):
    correct = families.plan_spec(spec, target)
    plan = families.plan_spec(spec, target, fault=fault)
    source = family.render(plan)
    assert plan.name == f"{correct.name}_fault_{fault}" and plan.fault == fault
    assert f"#define {FAULTS[fault]} 1" in source
    assert all(f"{kernel.symbol}(" in source and plan.name in kernel.symbol for kernel in plan.kernels)
    assert correct.name not in {kernel.symbol for kernel in plan.kernels}  # never served in place of the correct one


@pytest.mark.parametrize("family, spec, target", FAMILY_SPECS)
def test_correct_kernel_defines_no_fault(family, spec, target):
    source = family.render(families.plan_spec(spec, target))
    assert not any(f"#define {macro}" in source for macro in FAULTS.values())


@pytest.mark.parametrize("family, spec, target", FAMILY_SPECS)
def test_unknown_fault_is_rejected_with_the_allowed_names(family, spec, target):
    with pytest.raises(ValueError, match=r"fault='nope'.*drop_last_partial_kv_tile"):
        families.plan_spec(spec, target, fault="nope")
