"""Compile targets: names, limits, and arch-specific code that never runs elsewhere."""

from __future__ import annotations

import pytest

from attngen import targets
from attngen.errors import SpecError
from attngen.families import FAMILIES, plan_spec, select
from attngen.spec import AttentionSpec


@pytest.mark.parametrize("arch, name, limit", [("sm_80", "sm_80", 163 * 1024), ("sm_86", "sm_86", 99 * 1024),
                                               ("sm_89", "sm_89", 99 * 1024), ("sm_90", "sm_90a", 227 * 1024),
                                               ("sm_90a", "sm_90a", 227 * 1024), ("sm_100", "sm_100a", 227 * 1024),
                                               ("sm_120", "sm_120a", 99 * 1024)])
def test_exact_compile_target_and_limits(arch, name, limit):
    target = targets.target(arch)
    assert target.name == name and target.smem_per_block == limit
    assert target.label == name.replace("_", "")


@pytest.mark.parametrize("arch", ["sm_75", "sm_86a", "sm90", "90", None, 90, "sm_999"])
def test_unknown_arch_names_the_value_and_the_allowed_set(arch):
    with pytest.raises(ValueError, match=rf"arch={arch!r} is invalid; allowed: sm_80, sm_86"):
        targets.target(arch)


def test_device_limits_override_the_table_and_old_gpus_are_refused():
    t = targets.for_compute_capability(9, 0, smem_per_block=1000, sms=7, device_name="X")
    assert (t.name, t.smem_per_block, t.sms) == ("sm_90a", 1000, 7)
    with pytest.raises(ValueError, match=r"compute capability 7\.5.*8\.0 or newer"):
        targets.for_compute_capability(7, 5)
    newer = targets.for_compute_capability(13, 0)  # not in the table: the smallest known limits
    assert newer.name == "sm_130" and newer.smem_per_block == targets.UNKNOWN_LIMITS[0]


@pytest.mark.parametrize("arch", targets.allowed_archs())
def test_every_plan_is_for_exactly_the_target_asked(arch):
    target = targets.target(arch)
    for mask in ("none", "causal"):
        spec = AttentionSpec(head_dim=128, mask=mask)
        plan = plan_spec(spec, target)
        assert plan.target == target and plan.name.endswith("_" + target.label)
        # sm_90a-only families never run elsewhere; the preferred one that can, does.
        assert FAMILIES[plan.family].supports(spec.problem, target) is None


def test_arch_specific_family_is_refused_on_another_target():
    spec = AttentionSpec(head_dim=128, family="fwd_sm90")
    for arch in ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120"):
        with pytest.raises(SpecError, match="family='fwd_sm90' cannot run .* on sm_"):
            plan_spec(spec, targets.target(arch))
    assert plan_spec(spec, targets.target("sm_90")).family == "fwd_sm90"


def test_newer_gpu_runs_the_newest_compatible_family():
    problem = AttentionSpec(head_dim=64).problem
    assert select(problem, targets.target("sm_90")).name == "fwd_sm90"
    assert select(problem, targets.target("sm_100")).name == "fwd_sm80"  # no wgmma on Blackwell
    assert select(problem, targets.target("sm_86")).name == "fwd_sm80"


def test_default_configs_fit_every_target():
    for arch in targets.allowed_archs():
        target = targets.target(arch)
        for d in (64, 96, 128, 256):
            for mask in ("none", "causal"):
                plan = plan_spec(AttentionSpec(head_dim=d, mask=mask), target)
                assert plan.kernels[0].smem_bytes <= target.smem_per_block, (arch, plan.name)
