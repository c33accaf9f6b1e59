"""The specs the fuzzer runs, asked of the kernel families (CPU): the built-in pool per target, random
specs, the guard rows every family's tiles need, and a family that needs sm_90a never planned for
another target (a test double registered only inside the tests that ask for `sm90a_only_family`)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attngen
from attngen import families, targets
from attngen.dtypes import DTYPES
from attngen.errors import SpecError
from attngen.fuzz.case import GUARD_ROWS
from attngen.fuzz.pool import (EXTRA_CONFIGS, PROBLEMS, SHORT_CALL, builtin_specs, pinned_spec, random_spec,
                               random_spec_pool, short_default, variety)
from attngen import masks
from attngen.spec import HEAD_DIMS, AttentionSpec, Problem

# Every architecture the target table knows (the arch-specific variant where there is one).
TARGETS = [targets.target(arch) for arch in targets.allowed_archs() if arch.endswith("a") or
           f"{arch}a" not in targets.allowed_archs()]
SPEC_FILES = sorted(Path(__file__).parent.parent.glob("specs/*.yaml"))


def _plans(pool, target):
    return [families.plan_spec(spec, target) for spec in pool]


def _spelt_out_band(text: str) -> bool:
    """A mask whose closed form comes from attngen/maskc/bands.py rather than from its built-ins."""
    from attngen.maskc.parse import parse

    mask = masks.get_mask(text)
    return mask.closed is not None and masks.closed_form(mask.text, parse(mask.text, "mask").builtin) is None


def test_the_problems_vary_every_problem_field():
    assert {p.head_dim for p in PROBLEMS} == set(HEAD_DIMS)
    assert {p.dtype for p in PROBLEMS} == set(DTYPES)
    assert {"none", "causal"} < {p.mask for p in PROBLEMS}
    assert sum(masks.get_mask(p.mask).closed is None for p in PROBLEMS) >= 3  # masks classified by a scan
    assert {1, 2, 4} <= {p.gqa_ratio for p in PROBLEMS}
    assert any(p.softmax_scale is not None for p in PROBLEMS)
    # The regimes beyond two lengths (attngen/fuzz/strategies.py, case.py): packed sequences both ways,
    # offsets as scalar inputs, FlexAttention block states.
    assert sum(p.varlen for p in PROBLEMS) >= 3
    assert sum(p.mask.startswith("varlen_qdoc[q_idx] == varlen_kdoc[kv_idx]") for p in PROBLEMS) >= 2
    assert sum("kv_offset" in p.mask for p in PROBLEMS) >= 2
    assert sum(_spelt_out_band(p.mask) for p in PROBLEMS) >= 3  # closed forms from maskc/bands.py, offsets included
    assert sum(p.mask.startswith("block_mask_state[") for p in PROBLEMS) >= 2
    assert PROBLEMS[0].mask == "none"  # what hypothesis shrinks towards: the simplest kernel
    assert len(set(PROBLEMS)) == len(PROBLEMS)


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_the_builtin_pool_pins_every_supporting_family_with_its_default_and_a_few_other_configs(target):
    pool = builtin_specs(target)
    assert pool == builtin_specs(target)  # a function of the target
    plans = _plans(pool, target)  # each one plans on the target
    assert len({plan.name for plan in plans}) == len(pool), "two specs of the pool make the same kernel"
    assert all(spec.family is not None for spec in pool)
    for family in families.FAMILIES.values():
        supported = [p for p in PROBLEMS if family.supports(p, target) is None]
        own = [(spec, plan) for spec, plan in zip(pool, plans) if spec.family == family.name]
        # Each supported problem's default (none dropped: the defaults fit every known target) ...
        assert [spec for spec, _ in own if spec.config is None] == [pinned_spec(p, family) for p in supported]
        # ... its default for short calls where that is another (fwd_sm90's rows for at most 1k tokens) ...
        pinned = [(spec, plan) for spec, plan in own if spec.config is not None]
        short = [spec for p in supported if (spec := short_default(p, family, target)) is not None]
        assert [spec for spec, _ in pinned[:len(short)]] == short
        assert all(family.resolve_config(s.problem, target, {}, SHORT_CALL) == _plans([s], target)[0].config
                   for s in short)
        if family.name == "fwd_sm90" and target.cc == 90:  # d64 causal and d128 none, without GQA
            assert {(s.head_dim, s.mask, s.gqa_ratio) for s in short} >= {(64, "causal", 1), (128, "none", 1)}
        # ... and EXTRA_CONFIGS other configs of it, all its fields pinned, none its default.
        extras = pinned[len(short):]
        assert len(extras) == (EXTRA_CONFIGS if supported else 0), [spec for spec, _ in extras]
        for spec, plan in extras:
            assert spec.fully_configured and plan.config != family.resolve_config(spec.problem, target, {})
        assert len(own) <= 2 * len(PROBLEMS) + EXTRA_CONFIGS  # bounded: every kernel is compiled


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_each_familys_pool_varies_every_config_field_and_derived_choice(target):
    pool = builtin_specs(target)
    for family in families.FAMILIES.values():
        plans = [plan for spec, plan in zip(pool, _plans(pool, target)) if spec.family == family.name]
        if not plans:
            continue
        seen = set().union(*(variety(plan) for plan in plans))
        for field, allowed in family.config_fields.items():
            assert len({value for name, value in seen if name == field}) >= min(2, len(allowed)), field
        # Every on/off choice the family makes for some config of these problems is made both ways.
        possible = set()
        for problem in {plan.problem for plan in plans}:
            for config in family.configs(problem, target):
                try:
                    possible |= variety(family.plan(problem, target, config))
                except SpecError:
                    pass
        both_ways = {name for name, value in possible if isinstance(value, bool) and (name, not value) in possible}
        for name in both_ways:
            assert {(name, True), (name, False)} <= seen, f"{family.name} never plans {name} both ways"


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_the_builtin_pool_has_the_kernels_of_the_spec_files(target):
    assert SPEC_FILES
    names = {plan.name for plan in _plans(builtin_specs(target), target)}
    for path in SPEC_FILES:
        spec = attngen.load_spec(path)
        if spec.family in families.DECODE_FAMILIES or spec.family in families.BACKWARD_FAMILIES:
            continue  # the fuzzer runs forward calls; decode and backward specs have their GPU tests
        if spec.varlen and not families.supporting(spec.problem, target):
            continue  # packed sequences run where a family tiles per sequence (fwd_sm90, fwd_sm80)
        assert families.plan_spec(spec, target).name in names, f"{path} is not in the pool"


def test_guard_rows_cover_the_largest_tile_of_every_family():
    # A kernel reading a whole tile past the end of a tensor must land in the guards, whatever the
    # family and config: every plan any family makes, on every known target, for every head dim.
    largest = 0
    for family, target in itertools.product(families.FAMILIES.values(), TARGETS):
        for head_dim, dtype, mask in itertools.product(HEAD_DIMS, DTYPES, ("none", "causal")):
            problem = Problem(head_dim, dtype, mask=mask)
            if family.supports(problem, target) is not None:
                continue
            for config in family.configs(problem, target):
                try:
                    plan = family.plan(problem, target, config)
                except SpecError:
                    continue
                largest = max(largest, plan.block_m, plan.block_n)
    assert 0 < largest <= GUARD_ROWS


@settings(max_examples=200, database=None, deadline=None)
@given(seed=st.integers(0, 2**32), target=st.sampled_from(TARGETS))
def test_random_specs_pin_a_supporting_family_and_plan_on_their_target(seed, target):
    spec = random_spec(random.Random(seed), target)
    assert spec.family is not None and families.get_family(spec.family).supports(spec.problem, target) is None
    families.plan_spec(spec, target)


def test_random_spec_pool_is_a_function_of_the_seed():
    target = targets.target("sm_90")
    pool = random_spec_pool(7, 16, target)
    assert len(pool) == len(set(pool)) == 16
    assert pool == random_spec_pool(7, 16, target)
    assert pool != random_spec_pool(8, 16, target)
    assert any(spec.fully_configured for spec in pool) and any(spec.config is None for spec in pool)
    assert any(spec.mask == "causal" for spec in pool) and any(spec.softmax_scale for spec in pool)


def test_random_specs_carry_random_expression_trees_to_the_kernels(monkeypatch):
    """--random-specs draws masks and score modifiers from the whole expression grammar too
    (attngen/fuzz/expressions.py, without runtime inputs), so random trees reach the GPU kernels
    and not only the compiler's CPU tests; every one compiles and the reference evaluates it."""
    import torch

    from attngen import reference
    from attngen.fuzz.expressions import MaskExprs
    from attngen.fuzz.pool import random_mask, random_score_mod
    from attngen.maskc import compile_mask, compile_score_mod

    rng = random.Random(5)
    masks = [random_mask(rng) for _ in range(2000)]
    trees = [m for m in masks if any(f in m for f in ("where(", "min(", "max(", "abs(", "not "))]
    assert len(trees) >= 10
    mods = [random_score_mod(rng) for _ in range(100)]
    tree_mods = [m for m in mods if m.startswith("score + 0.5 * tanh(")]
    assert len(tree_mods) >= 10
    assert all(not compile_mask(m).inputs for m in trees) and all(not compile_score_mod(m).inputs for m in tree_mods)
    drawn = []  # trees are one non-trivial draw in nine: 1/18 of all draws
    original = MaskExprs.mask
    monkeypatch.setattr(MaskExprs, "mask", lambda self: drawn.append(1) or original(self))
    for _ in range(4000):
        random_mask(rng)
    assert 0.035 < len(drawn) / 4000 < 0.08
    pool = random_spec_pool(3, 200, targets.target("sm_90"))
    with_trees = [s for s in pool if any(f in s.mask for f in ("where(", "min(", "max(", "abs("))
                  or (s.score_mod or "").startswith("score + 0.5 * tanh(")]
    assert with_trees
    gen = torch.Generator().manual_seed(0)
    def plain(s):  # no cu_seqlens or other runtime inputs to make up here
        return not s.varlen and not s.sink and not compile_mask(s.mask).inputs \
            and not (s.score_mod and compile_score_mod(s.score_mod).inputs)
    checked = [s for s in with_trees if plain(s)][:8]
    assert checked
    for spec in checked:
        hq = spec.gqa_ratio
        q = torch.randn(1, 19, hq, spec.head_dim, generator=gen)
        k, v = (torch.randn(1, 23, 1, spec.head_dim, generator=gen) for _ in range(2))
        out = reference.attention_for_spec(q, k, v, spec, softmax_scale=spec.effective_scale)
        assert out.shape == q.shape and not out.isnan().any()


def test_smooth_score_trees_have_no_kink_in_a_float():
    """The fuzzer's random score modifiers (ScoreExprs smooth=True) take abs, min and max of integer
    subtrees only: a kink in a float subtree (one holding the score) makes the kernel's derivative
    jump where the exact score sits within its rounding of it, past the gradient tolerances."""
    from attngen.fuzz.expressions import ScoreExprs
    from attngen.maskc import compile_score_mod
    from attngen.maskc.ir import Op, Type, walk

    rng = random.Random(2)
    kinks = {"abs", "min", "max"}
    smooth = [compile_score_mod(ScoreExprs(rng, inputs=False, smooth=True).score_mod()) for _ in range(500)]
    rough = [compile_score_mod(ScoreExprs(rng, inputs=False).score_mod()) for _ in range(500)]

    def float_kinks(program):
        return [n for n in walk(program.ir) if isinstance(n, Op) and n.op in kinks and n.type is Type.FLOAT]
    assert not any(float_kinks(p) for p in smooth)
    assert any(float_kinks(p) for p in rough)  # the check can see one


def test_random_specs_give_up_with_a_clear_error_where_no_family_runs(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", {})
    with pytest.raises(ValueError, match=r"no kernel family plans a random problem on sm_90a"):
        random_spec(random.Random(0), targets.target("sm_90"))


# -- families are planned only where they run ---------------------------------------------
def test_no_family_is_planned_for_a_target_it_does_not_support(sm90a_only_family):
    # Every registered family (the sm_90a-only test double too, so this always refuses something).
    refused = set()
    for family, target, problem in itertools.product(families.FAMILIES.values(), TARGETS, PROBLEMS):
        if family.supports(problem, target) is not None:
            refused.add(family.name)
            with pytest.raises(SpecError, match=rf"family='{family.name}' cannot run .* on {target.name}"):
                families.plan_spec(pinned_spec(problem, family), target)
    assert sm90a_only_family.name in refused


def test_a_family_that_needs_sm90a_is_never_planned_for_another_target(sm90a_only_family):
    pinned = AttentionSpec(head_dim=128, mask="causal", family=sm90a_only_family.name)
    for arch in ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120"):
        with pytest.raises(SpecError, match=rf"family='{sm90a_only_family.name}' cannot run .* on {arch}.*: needs "
                                            r"sm_90a") as caught:
            families.plan_spec(pinned, targets.target(arch))
        assert caught.value.field == "family"
    assert families.plan_spec(pinned, targets.target("sm_90")).name.endswith("_sm90a")
    # Unpinned, the dispatcher takes it where it runs (it is preferred) and another family elsewhere.
    unpinned = AttentionSpec(head_dim=128, mask="causal")
    assert families.plan_spec(unpinned, targets.target("sm_90")).family == sm90a_only_family.name
    assert families.plan_spec(unpinned, targets.target("sm_80")).family == "fwd_sm80"
    # A spec naming it with an arch it cannot run on is refused when it is made.
    with pytest.raises(SpecError, match=rf"family='{sm90a_only_family.name}' cannot run this spec on arch=sm_80"):
        AttentionSpec(head_dim=128, family=sm90a_only_family.name, arch="sm_80")


def _running_on(target) -> set[str]:
    """The registered families that run some problem of the pool on `target`."""
    return {f.name for f in families.FAMILIES.values() if any(f.supports(p, target) is None for p in PROBLEMS)}


def test_the_pool_asks_each_family_what_it_can_run(sm90a_only_family):
    hopper, ampere = targets.target("sm_90"), targets.target("sm_80")
    on_hopper = builtin_specs(hopper)
    assert sm90a_only_family.name in _running_on(hopper) and sm90a_only_family.name not in _running_on(ampere)
    assert {spec.family for spec in on_hopper} == _running_on(hopper)
    supported = [p for p in PROBLEMS if sm90a_only_family.supports(p, hopper) is None]  # varlen too: it tiles per sequence
    assert len(supported) == len(PROBLEMS)
    assert len([spec for spec in on_hopper if spec.family == sm90a_only_family.name]) == len(supported) + EXTRA_CONFIGS
    assert {spec.family for spec in builtin_specs(ampere)} == _running_on(ampere) == {"fwd_sm80"}
    assert sm90a_only_family.name in {spec.family for spec in random_spec_pool(3, 16, hopper)}
    assert {spec.family for spec in random_spec_pool(3, 16, ampere)} == {"fwd_sm80"}
