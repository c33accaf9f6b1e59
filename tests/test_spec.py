"""AttentionSpec validation: every valid spec constructs, hashes, names and renders; every invalid one
raises a SpecError naming the field, the bad value and the allowed set, with every problem at once.
(Spec files: tests/test_specfile.py.)"""

from __future__ import annotations

import dataclasses

import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attngen import load_spec, targets
from attngen.dtypes import DTYPES
from attngen.errors import SpecError
from attngen.families import BACKWARD_FAMILIES, DECODE_FAMILIES, FAMILIES, get_family, plan_spec
from attngen.families.fwd_sm80.family import ROWS_PER_WARP
from attngen import masks
from attngen.spec import FLOAT32_MAX, FLOAT32_MIN_NORMAL, HEAD_DIMS, LEGACY_TILE_FIELDS, MAX_GQA_RATIO, AttentionSpec

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
PROBLEM_FIELDS = ("head_dim", "dtype", "gqa_ratio", "mask", "softmax_scale")
FIELDS = PROBLEM_FIELDS + ("family", "config", "arch")
ARCHS = tuple(targets.allowed_archs())
SM80 = get_family("fwd_sm80")
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def render(spec: AttentionSpec, target=None) -> str:
    plan = plan_spec(spec, target)
    return get_family(plan.family).render(plan)


def allowed_rejection(err: SpecError, *specs: AttentionSpec) -> bool:
    """What a plan may refuse of a spec whose config passes check_config: a config the target's shared
    memory cannot hold, fwd_sm90's three consumer warpgroups at a head dim whose O leaves them too few
    registers (family.py THREE_CONSUMERS_MAX_HEAD_DIM), or, where one of `specs` pins fwd_sm90's clusters,
    a problem they cannot run (a mask, a head dim of one chunk: family.py cluster_reason)."""
    clustered = any(spec.pinned.get("cluster") for spec in specs)
    return err.field == "config" and ("shared memory" in str(err)
                                      or "3 consumer warpgroups get 160 registers" in str(err)
                                      or clustered and "a cluster of two CTAs cannot run" in str(err))


# -- strategies ---------------------------------------------------------------
# width=32: the canonical name spells the scale's float32 bits, so distinct draws stay distinct.
scales = st.floats(min_value=FLOAT32_MIN_NORMAL, max_value=FLOAT32_MAX, width=32)


@st.composite
def configs(draw, family, complete: bool = False):
    """Config fields of `family`, each set or unset (all set when complete), that check_config accepts."""
    config = {f: draw(st.sampled_from(allowed)) for f, allowed in family.config_fields.items()}
    if not complete:
        keep = draw(st.lists(st.sampled_from(sorted(config)), unique=True))
        config = {f: v for f, v in config.items() if f in keep}
    assume(not family.check_config(config))
    return config


@st.composite
def spec_fields(draw, complete: bool = False):
    """Keyword arguments of a valid AttentionSpec; complete: family, every config field and arch set."""
    fields = {
        "head_dim": draw(st.sampled_from(HEAD_DIMS)),
        "dtype": draw(st.sampled_from(sorted(DTYPES))),
        "gqa_ratio": draw(st.integers(min_value=1, max_value=128)),
        "mask": draw(st.sampled_from(masks.EXAMPLES)),
        "softmax_scale": draw(st.none() | scales),
        "arch": draw(st.sampled_from(ARCHS) if complete else st.none() | st.sampled_from(ARCHS)),
        "family": draw(st.sampled_from(sorted(FAMILIES)) if complete
                       else st.none() | st.sampled_from(sorted(FAMILIES))),
    }
    if fields["family"] is not None:
        family = get_family(fields["family"])
        fields["config"] = draw(configs(family, complete=complete)) or None
        if fields["arch"] is not None:
            # A pinned family must support the problem on a pinned arch (else: test_family_must_support_arch).
            assume(family.supports(AttentionSpec(fields["head_dim"], fields["dtype"], fields["gqa_ratio"],
                                                 fields["mask"], fields["softmax_scale"]).problem,
                                   targets.target(fields["arch"])) is None)
    return {k: v for k, v in fields.items() if v is not None or draw(st.booleans())}


# -- valid specs ----------------------------------------------------------------
@FAST
@given(spec_fields())
def test_valid_spec_constructs_hashes_names_and_renders(fields):
    spec = AttentionSpec(**fields)
    twin = AttentionSpec(**fields)
    assert spec == twin and hash(spec) == hash(twin) and len({spec, twin}) == 1 and spec.key() == twin.key()
    try:
        plan = plan_spec(spec)
    except SpecError as err:
        assert allowed_rejection(err, spec), str(err)
        return
    assert C_IDENTIFIER.fullmatch(spec.name), spec.name
    # The name is the name of the kernel the spec's plan (its pins, the family's defaults) makes.
    assert spec.name == plan.name
    assert spec.name.endswith("_" + targets.target(spec.arch or targets.DEFAULT_ARCH).label)
    source = get_family(plan.family).render(plan)
    for kernel in plan.kernels:
        assert f"{kernel.symbol}(" in source


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90a"])
def test_every_config_renders_or_names_the_config(arch):
    target = targets.target(arch)
    problem = AttentionSpec(head_dim=256).problem
    rendered = rejected = 0
    for config in SM80.configs(problem, target):
        try:
            SM80.render(SM80.plan(problem, target, config))
            rendered += 1
        except SpecError as err:
            assert err.field == "config" and config.label() in str(err) and target.name in str(err), str(err)
            rejected += 1
    # Both outcomes occur at head dim 256: the check neither accepts nor rejects everything.
    assert rendered > 0 and rejected > 0


@FAST
@given(spec_fields(complete=True), st.sampled_from(PROBLEM_FIELDS + ("config", "arch")), st.data())
def test_name_differs_when_any_field_differs(fields, field, data):
    spec = AttentionSpec(**fields)
    other = _changed(spec, field, data)
    assume(other is not None)
    try:
        names = spec.name, other.name
    except SpecError as err:  # a config that does not fit one of the two targets
        assert allowed_rejection(err, spec, other), str(err)
        return
    assert names[0] != names[1], (spec, other)


def _changed(spec, field, data):
    """spec with `field` set to another valid value, or None when the change is invalid."""
    if field == "config":
        family = get_family(spec.family)
        name = data.draw(st.sampled_from(sorted(family.config_fields)))
        value = data.draw(st.sampled_from(family.config_fields[name]).filter(lambda v: v != spec.config[name]))
        change = {"config": {**spec.config, name: value}}
    else:
        choices = {
            "head_dim": st.sampled_from(HEAD_DIMS),
            "dtype": st.sampled_from(sorted(DTYPES)),
            "gqa_ratio": st.integers(min_value=1, max_value=128),
            # Another mask, not another spelling of the same one.
            "mask": st.sampled_from(masks.EXAMPLES).filter(lambda m: masks.canonical(m) != spec.mask),
            "softmax_scale": st.none() | scales,
            # A different compile target: sm_90 and sm_90a are one target (the spec stores sm_90a).
            "arch": st.sampled_from(ARCHS).filter(lambda a: targets.target(a).name != spec.arch),
        }
        change = {field: data.draw(choices[field].filter(lambda v: v != getattr(spec, field)))}
    try:
        return spec.replace(**change)
    except SpecError as err:
        # Only the block_m / num_warps pairing, or a family that cannot run on the new arch, can break.
        assert err.field in ("config", "family"), str(err)
        return None


def test_arch_is_part_of_the_name_and_names_one_target():
    # A tile that fits the 99 KB of sm_86 too.
    spec = AttentionSpec(head_dim=128, family="fwd_sm80", config=dict(block_m=64, block_n=64, num_warps=4,
                                                                       num_stages=2))
    sm80, sm86, sm90, sm90a = (spec.replace(arch=a) for a in ("sm_80", "sm_86", "sm_90", "sm_90a"))
    assert sm80.name.endswith("_sm80") and sm86.name.endswith("_sm86") and sm90.name.endswith("_sm90a")
    assert len({sm80.name, sm86.name, sm90.name}) == 3
    # sm_90 and sm_90a are the same compile target: the same spec, name and source.
    assert sm90 == sm90a and sm90.arch == "sm_90a" and sm90.name == sm90a.name and render(sm90) == render(sm90a)
    # The unset arch names the default target.
    assert spec.name == sm90.name


@FAST
@given(spec_fields())
def test_plan_keeps_pins_and_fills_family_defaults(fields):
    spec = AttentionSpec(**fields)
    target = targets.target(spec.arch or targets.DEFAULT_ARCH)
    try:
        plan = plan_spec(spec)
    except SpecError as err:
        assert allowed_rejection(err, spec), str(err)
        return
    assert plan.target == target and plan.problem == spec.problem
    family = get_family(plan.family)
    if spec.family is not None:
        assert plan.family == spec.family
    else:
        assert plan.family == next(f.name for f in FAMILIES.values() if f.supports(spec.problem, target) is None)
    config = plan.config.to_dict()
    assert {f: config[f] for f in spec.pinned} == spec.pinned
    default = family.default_config(spec.problem, target).to_dict()
    if not spec.pinned:
        assert config == default
    elif plan.family == "fwd_sm80":
        for f in ("block_n", "num_stages"):  # independent of the others: the default when not pinned
            if f not in spec.pinned:
                assert config[f] == default[f]
        assert config["block_m"] // config["num_warps"] in ROWS_PER_WARP


def test_plan_target_argument_overrides_the_spec_arch():
    # The runtime plans for the GPU it runs on, whatever arch the spec names for offline builds.
    assert plan_spec(AttentionSpec(head_dim=64)).target.name == targets.DEFAULT_ARCH + "a"
    assert plan_spec(AttentionSpec(head_dim=64, arch="sm_90"), targets.target("sm_80")).target.name == "sm_80"
    bare = plan_spec(AttentionSpec(head_dim=64))
    assert bare.config == get_family(bare.family).default_config(bare.problem, targets.target("sm_90"))
    pinned = plan_spec(AttentionSpec(head_dim=64, family="fwd_sm80"), targets.target("sm_86"))
    assert pinned.family == "fwd_sm80" and pinned.config == SM80.default_config(pinned.problem, targets.target("sm_86"))


@FAST
@given(spec_fields())
def test_round_trip_to_dict_from_dict_and_key(fields):
    spec = AttentionSpec(**fields)
    data = spec.to_dict()
    assert None not in data.values() and "source" not in data
    assert AttentionSpec.from_dict(data) == spec
    assert AttentionSpec.from_dict(yaml.safe_load(yaml.safe_dump(data))) == spec
    assert AttentionSpec.from_key(spec.key()) == spec


def test_from_key_refuses_what_is_not_a_key():
    with pytest.raises(ValueError, match="not a spec's canonical JSON"):
        AttentionSpec.from_key("{head_dim: 64")


def test_pinned_and_fully_configured():
    full = dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    assert AttentionSpec(head_dim=64).pinned == {} and not AttentionSpec(head_dim=64).fully_configured
    partial = AttentionSpec(head_dim=64, family="fwd_sm80", config={"block_n": 32})
    assert partial.pinned == {"block_n": 32} and not partial.fully_configured
    assert AttentionSpec(head_dim=64, family="fwd_sm80", config=full).fully_configured
    # An empty config is no config: the same spec as none.
    assert AttentionSpec(head_dim=64, family="fwd_sm80", config={}) == AttentionSpec(head_dim=64, family="fwd_sm80")


# -- invalid values -------------------------------------------------------------
def _not_in(allowed, optional):
    """Values of every YAML-ish type that are not in `allowed` (None is fine for optional fields)."""
    bad = st.one_of(
        st.integers(min_value=-(2**40), max_value=2**40),
        st.text(max_size=8),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
    )
    if not optional:
        bad = bad | st.none()
    # True == 1 and 64.0 == 64: only an exact type and value match is allowed.
    return bad.filter(lambda v: not any(type(v) is type(a) and v == a for a in allowed))


def _compiles_as_mask(value) -> bool:
    try:
        masks.get_mask(value)
    except (ValueError, TypeError):
        return False
    return True


BAD_VALUES = {
    "head_dim": _not_in(HEAD_DIMS, optional=False),
    "dtype": _not_in(tuple(DTYPES), optional=False),
    "gqa_ratio": st.integers(max_value=0) | st.integers(min_value=MAX_GQA_RATIO + 1)
    | st.sampled_from([1.0, 2.5, "2", True, None, math.nan]),
    "mask": _not_in((), optional=False).filter(lambda v: not _compiles_as_mask(v)),
    "softmax_scale": st.sampled_from([0, 0.0, -0.5, math.nan, math.inf, -math.inf, 1e-50, 1e300, True, "0.1", [1.0]]),
    "arch": _not_in(ARCHS, optional=True),
    "family": _not_in(tuple(FAMILIES) + tuple(DECODE_FAMILIES) + tuple(BACKWARD_FAMILIES), optional=True),  # every operation's
}
# Which set a message must name as allowed (an element of it, at least).
ALLOWED_EXAMPLE = {"head_dim": "128", "dtype": "bf16", "gqa_ratio": str(MAX_GQA_RATIO), "mask": "causal",
                   "softmax_scale": "1/sqrt(head_dim)", "arch": "sm_90a", "family": "fwd_sm80",
                   "deterministic": "true, false"}


def assert_names(err: SpecError, field: str, value, source: str | None = None):
    message = str(err)
    assert err.field == field, message
    assert repr(value) in message and "allowed" in message and ALLOWED_EXAMPLE[field] in message, message
    if source is not None:
        assert message.startswith(f"{source}: "), message


@FAST
@given(st.sampled_from(sorted(BAD_VALUES)), st.data())
def test_invalid_value_names_field_value_and_allowed(field, data):
    value = data.draw(BAD_VALUES[field], label=field)
    with pytest.raises(SpecError) as info:
        AttentionSpec(**{"head_dim": 128, field: value})
    assert_names(info.value, field, value)


@pytest.mark.parametrize("field, value", [("head_dim", "128"), ("head_dim", 128.0), ("gqa_ratio", "4"),
                                          ("gqa_ratio", 4.0)])
def test_wrong_type_says_must_be_an_integer(field, value):
    with pytest.raises(SpecError, match="must be an integer") as info:
        AttentionSpec(**{"head_dim": 64, field: value})
    assert_names(info.value, field, value)


@pytest.mark.parametrize("value", ["true", 1, None])
def test_deterministic_must_be_a_bool(value):
    with pytest.raises(SpecError, match="must be true or false.*allowed: true, false") as info:
        AttentionSpec(head_dim=64, deterministic=value)
    assert_names(info.value, "deterministic", value)


def test_deterministic_is_in_the_key_only_when_true():
    assert "deterministic" not in AttentionSpec(head_dim=64).key()
    spec = AttentionSpec(head_dim=64, deterministic=True)
    assert AttentionSpec.from_key(spec.key()) == spec and spec.problem.deterministic


def test_scale_of_the_wrong_type_says_must_be_a_number():
    with pytest.raises(SpecError, match="must be a number") as info:
        AttentionSpec(head_dim=64, softmax_scale="1e-3")
    assert_names(info.value, "softmax_scale", "1e-3")


@FAST
@given(st.sampled_from(sorted(SM80.config_fields)), st.data())
def test_invalid_config_value_names_field_value_and_allowed(name, data):
    allowed = SM80.config_fields[name]
    value = data.draw(_not_in(allowed, optional=False), label=name)
    with pytest.raises(SpecError) as info:
        AttentionSpec(head_dim=128, family="fwd_sm80", config={name: value})
    message = str(info.value)
    assert info.value.field == "config" and f"config.{name}={value!r}" in message, message
    assert "allowed" in message and str(allowed[-1]) in message, message


@pytest.mark.parametrize("config, phrase", [
    ({"block_size": 64}, "block_size"),
    ([64, 32], "mapping"),
    ("m128n64w4s2", "mapping"),
])
def test_invalid_config_shapes(config, phrase):
    with pytest.raises(SpecError, match=phrase) as info:
        AttentionSpec(head_dim=64, family="fwd_sm80", config=config)
    assert info.value.field == "config" and "allowed" in str(info.value)


def test_config_without_family_says_to_set_one():
    with pytest.raises(SpecError) as info:
        AttentionSpec(head_dim=64, config={"block_m": 64})
    assert info.value.field == "config" and "family" in str(info.value) and "fwd_sm80" in str(info.value)


@pytest.mark.parametrize("block_m, num_warps", [(64, 1), (16, 4), (256, 2), (128, 1), (32, 8)])
def test_block_m_num_warps_mismatch(block_m, num_warps):
    with pytest.raises(SpecError) as info:
        AttentionSpec(head_dim=64, family="fwd_sm80", config=dict(block_m=block_m, num_warps=num_warps))
    message = str(info.value)
    assert info.value.field == "config" and f"block_m={block_m}" in message and f"num_warps={num_warps}" in message
    assert "allowed" in message and str(ROWS_PER_WARP[0]) in message


def test_family_must_support_arch():
    # Every registered family that some arch cannot run names that arch and why.
    for family in FAMILIES.values():
        for arch in ARCHS:
            problem = AttentionSpec(head_dim=128).problem
            reason = family.supports(problem, targets.target(arch))
            if reason is None:
                continue
            with pytest.raises(SpecError) as info:
                AttentionSpec(head_dim=128, family=family.name, arch=arch)
            assert info.value.field == "family" and reason in str(info.value)


@FAST
@given(st.lists(st.sampled_from(sorted(BAD_VALUES)), min_size=2, unique=True), st.data())
def test_every_problem_is_reported_at_once(fields, data):
    values = {f: data.draw(BAD_VALUES[f], label=f) for f in fields}
    with pytest.raises(SpecError) as info:
        AttentionSpec(**{"head_dim": 128, **values})
    err = info.value
    assert sorted(f for f, _ in err.problems) == sorted(fields), err.problems
    assert err.field == err.problems[0][0] and f"{len(fields)} problems" in str(err)
    for field, message in err.problems:
        assert message in str(err) and repr(values[field]) in message


# -- from_dict: unknown and legacy fields ---------------------------------------
@FAST
@given(st.text(min_size=1, max_size=12) | st.integers())
def test_from_dict_unknown_key_names_it(key):
    # Every field the spec has (hypothesis draws string constants from the code, so 'score_mod' comes up).
    assume(key not in {f.name for f in dataclasses.fields(AttentionSpec)} - {"source"} and key not in LEGACY_TILE_FIELDS)
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"head_dim": 64, key: 1, "zzz_other": 2}, source="my.yaml")
    message = str(info.value)
    assert {f for f, _ in info.value.problems} == {key, "zzz_other"}
    assert repr(key) in message and message.startswith("my.yaml: ") and "allowed" in message


def test_from_dict_rejects_source_and_missing_head_dim():
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"head_dim": 64, "source": "x"})
    assert info.value.field == "source"
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"mask": "causal"})
    assert info.value.field == "head_dim" and "allowed" in str(info.value)
    with pytest.raises(SpecError, match="mapping"):
        AttentionSpec.from_dict([("head_dim", 64)])


@FAST
@given(st.lists(st.sampled_from(LEGACY_TILE_FIELDS), min_size=1, unique=True))
def test_legacy_tile_fields_give_the_migration(legacy):
    tile = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    data = {"head_dim": 64, **{f: tile[f] for f in legacy}}
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict(data, source="old.yaml")
    err = info.value
    assert len(err.problems) == 1 and err.field in legacy  # one message for all of them
    message = str(err)
    assert message.startswith("old.yaml: ") and "`family: fwd_sm80`" in message
    # What the message says to write is a spec with the same tile pinned.
    config = yaml.safe_load(re.search(r"`config: (\{.*?\})`", message).group(1))
    migrated = AttentionSpec.from_dict({"head_dim": 64, "family": "fwd_sm80", "config": config})
    assert migrated.pinned == {f: tile[f] for f in legacy}


def test_legacy_fields_are_reported_with_the_other_problems():
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"head_dim": 100, "block_m": 64, "mask": "diagonal", "windw": 3})
    assert sorted(f for f, _ in info.value.problems) == ["block_m", "head_dim", "mask", "windw"]


# -- the committed spec files -------------------------------------------------------
SPEC_FILES = sorted(SPECS_DIR.glob("*.yaml"))


def test_spec_files_exist():
    names = {p.name for p in SPEC_FILES}
    assert {
        "llama3_8b_causal_gqa4_d128_bf16.yaml",
        "mha_d64_fp16.yaml",
        "d256_causal_bf16.yaml",
        "mha_d96_bf16.yaml",
    } <= names


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.name for p in SPEC_FILES])
def test_spec_file_loads_and_renders(path):
    assert path.read_text().startswith("# "), "each spec file opens with a comment saying what it is for"
    spec = load_spec(path)
    # arch pinned so the committed generated/ source does not depend on the machine.
    assert spec.arch is not None
    assert spec.config is None, "config fields are left to the family's defaults (and the tuner)"
    assert f"{spec.name}(" in render(spec)


@pytest.mark.parametrize("field, text", [("mask", "q_idx < " + "1 + " * 3000 + "("),
                                         ("score_mod", "score + " * 2000 + "("), ("sink", "sinks[h] + " * 1500 + "(")])
def test_a_huge_expression_is_shown_cut_short_in_its_error(field, text):
    """A 10k-character expression (a generated mask, say) used to be echoed whole in the error: one
    line of 10-13 KB. It is elided like any long value in a message."""
    with pytest.raises(SpecError) as info:
        AttentionSpec(head_dim=64, **{field: text})
    message = str(info.value)
    assert f"{field}='" in message and "..." in message and len(message) < 1500, len(message)
