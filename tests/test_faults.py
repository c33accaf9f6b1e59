"""Fault injection renders a distinct, clearly marked kernel and leaves correct kernels alone."""

import pytest

from attngen.faults import FAULTS
from attngen.plan import make_plan
from attngen.render import render_plan
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64, arch="sm_90")


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_kernel_has_its_own_symbol_and_macro(fault):
    plan = make_plan(SPEC, fault=fault)
    source = render_plan(plan)
    assert plan.name == f"{SPEC.name}_fault_{fault}"
    assert f"#define {FAULTS[fault]} 1" in source
    assert f"{plan.name}(" in source


def test_correct_kernel_defines_no_fault():
    source = render_plan(make_plan(SPEC))
    assert not any(f"#define {macro}" in source for macro in FAULTS.values())


def test_unknown_fault_is_rejected_with_the_allowed_names():
    with pytest.raises(ValueError, match=r"fault='nope'.*drop_last_partial_kv_tile"):
        make_plan(SPEC, fault="nope")
