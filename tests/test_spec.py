"""AttentionSpec validation: every valid spec constructs, names and renders; every invalid one
raises a SpecError naming the field, the bad value and the allowed set (and the file)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attngen import load_spec
from attngen.errors import SpecError
from attngen.masks import MASKS
from attngen.render import render
from attngen.spec import (
    ARCHS,
    BLOCK_MS,
    BLOCK_NS,
    DTYPES,
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    HEAD_DIMS,
    NUM_STAGES,
    NUM_WARPS,
    ROWS_PER_WARP,
    TILE_FIELDS,
    AttentionSpec,
)
from attngen.tile_defaults import default_tile

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
FIELDS = ("head_dim", "dtype", "gqa_ratio", "mask", "softmax_scale", "arch") + TILE_FIELDS
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ---------------------------------------------------------------
# width=32: the canonical name spells the scale's float32 bits, so distinct draws stay distinct.
scales = st.floats(min_value=FLOAT32_MIN_NORMAL, max_value=FLOAT32_MAX, width=32)


@st.composite
def tiles(draw, complete: bool = False):
    """Tile fields, each set or unset; block_m / num_warps in ROWS_PER_WARP when both are set."""
    warps = draw(st.sampled_from(NUM_WARPS))
    rows = draw(st.sampled_from(ROWS_PER_WARP))
    assume(warps * rows in BLOCK_MS)
    tile = {
        "block_m": warps * rows,
        "block_n": draw(st.sampled_from(BLOCK_NS)),
        "num_warps": warps,
        "num_stages": draw(st.sampled_from(NUM_STAGES)),
    }
    if complete:
        return tile
    keep = draw(st.lists(st.sampled_from(TILE_FIELDS), unique=True))
    if "block_m" in keep and "num_warps" not in keep:
        # Alone, block_m may be any allowed value: resolved() picks num_warps to match.
        tile["block_m"] = draw(st.sampled_from(BLOCK_MS))
    return {f: v for f, v in tile.items() if f in keep}


@st.composite
def spec_fields(draw, complete: bool = False):
    """Keyword arguments of a valid AttentionSpec; complete: every tile field and arch set."""
    fields = {
        "head_dim": draw(st.sampled_from(HEAD_DIMS)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "gqa_ratio": draw(st.integers(min_value=1, max_value=128)),
        "mask": draw(st.sampled_from(sorted(MASKS))),
        "softmax_scale": draw(st.none() | scales),
        "arch": draw(st.sampled_from(ARCHS) if complete else st.none() | st.sampled_from(ARCHS)),
    }
    fields.update(draw(tiles(complete=complete)))
    return {k: v for k, v in fields.items() if v is not None or draw(st.booleans())}


# -- valid specs ----------------------------------------------------------------
@FAST
@given(spec_fields())
def test_valid_spec_constructs_hashes_names_and_renders(fields):
    spec = AttentionSpec(**fields)
    twin = AttentionSpec(**fields)
    assert spec == twin and hash(spec) == hash(twin) and len({spec, twin}) == 1
    assert C_IDENTIFIER.fullmatch(spec.name), spec.name
    # The name is the name of the kernel the defaults resolve to.
    assert spec.name == spec.resolved().name
    try:
        source = render(spec)
    except SpecError as err:
        # The only spec a plan may reject is a tile config the shared memory cannot hold.
        assert err.field in TILE_FIELDS and "shared memory" in str(err)
        return
    assert f"{spec.name}(" in source


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tile_combo_renders_or_names_a_tile_field(arch):
    rendered = rejected = 0
    for warps in NUM_WARPS:
        for rows in ROWS_PER_WARP:
            if warps * rows not in BLOCK_MS:
                continue
            for block_n in BLOCK_NS:
                for stages in NUM_STAGES:
                    tile = dict(block_m=warps * rows, block_n=block_n, num_warps=warps, num_stages=stages)
                    try:
                        render(AttentionSpec(head_dim=256, arch=arch, **tile))
                        rendered += 1
                    except SpecError as err:
                        assert err.field in TILE_FIELDS and arch in str(err)
                        rejected += 1
    # Both outcomes occur at head dim 256: the check neither accepts nor rejects everything.
    assert rendered > 0 and rejected > 0


@FAST
@given(spec_fields(complete=True), st.sampled_from([f for f in FIELDS if f != "arch"]), st.data())
def test_name_differs_when_any_field_differs(fields, field, data):
    # arch is left out: see test_name_spells_arch.
    spec = AttentionSpec(**fields)
    other = _changed(spec, field, data)
    assume(other is not None)
    assert other.name != spec.name, (spec, other)


def _changed(spec, field, data):
    """spec with `field` set to another valid value, or None when the change is invalid."""
    choices = {
        "head_dim": st.sampled_from(HEAD_DIMS),
        "dtype": st.sampled_from(DTYPES),
        "gqa_ratio": st.integers(min_value=1, max_value=128),
        "mask": st.sampled_from(sorted(MASKS)),
        "softmax_scale": st.none() | scales,
        "arch": st.sampled_from(ARCHS),
        "block_m": st.sampled_from(BLOCK_MS),
        "block_n": st.sampled_from(BLOCK_NS),
        "num_warps": st.sampled_from(NUM_WARPS),
        "num_stages": st.sampled_from(NUM_STAGES),
    }
    value = data.draw(choices[field].filter(lambda v: v != getattr(spec, field)))
    try:
        return spec.replace(**{field: value})
    except SpecError as err:
        assert err.field == "block_m"  # only the block_m / num_warps pairing can break
        return None


def test_name_determines_source_across_archs():
    """arch is the compile target, not part of the kernel's identity: equal names render equal source."""
    spec = AttentionSpec(head_dim=128, block_m=128, block_n=64, num_warps=8, num_stages=2)
    sm80, sm90 = spec.replace(arch="sm_80"), spec.replace(arch="sm_90")
    assert sm80.name == sm90.name and render(sm80) == render(sm90)


@FAST
@given(spec_fields())
def test_resolved_fills_tile_defaults(fields):
    spec = AttentionSpec(**fields)
    resolved = spec.resolved()
    assert resolved.tile_is_set and resolved.arch == (spec.arch or "sm_90")
    assert resolved.resolved() == resolved
    default = default_tile(spec.head_dim, resolved.arch)
    for f in TILE_FIELDS:
        given_value = getattr(spec, f)
        if given_value is not None:
            assert getattr(resolved, f) == given_value
        elif f in ("block_n", "num_stages") or (spec.block_m is None and spec.num_warps is None):
            assert getattr(resolved, f) == getattr(default, f)
    for f in ("head_dim", "dtype", "gqa_ratio", "mask", "softmax_scale"):
        assert getattr(resolved, f) == getattr(spec, f)


def test_resolved_arch_argument_fills_only_an_unset_arch():
    assert AttentionSpec(head_dim=64).resolved("sm_80").arch == "sm_80"
    assert AttentionSpec(head_dim=64, arch="sm_90").resolved("sm_80").arch == "sm_90"
    bare = AttentionSpec(head_dim=64).resolved()
    assert bare.tile.label() == default_tile(64, "sm_90").label()


@FAST
@given(spec_fields())
def test_round_trip_to_dict_from_dict(fields):
    spec = AttentionSpec(**fields)
    data = spec.to_dict()
    assert None not in data.values()
    assert AttentionSpec.from_dict(data) == spec
    assert AttentionSpec.from_dict(yaml.safe_load(yaml.safe_dump(data))) == spec


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


BAD_VALUES = {
    "head_dim": _not_in(HEAD_DIMS, optional=False),
    "dtype": _not_in(DTYPES, optional=False),
    "gqa_ratio": st.integers(max_value=0) | st.integers(min_value=1025) | st.sampled_from([1.0, 2.5, "2", True, None, math.nan]),
    "mask": _not_in(tuple(MASKS), optional=False),
    "softmax_scale": st.sampled_from([0, 0.0, -0.5, math.nan, math.inf, -math.inf, 1e-50, 1e300, True, "0.1", [1.0]]),
    "arch": _not_in(ARCHS, optional=True),
    "block_m": _not_in(BLOCK_MS, optional=True),
    "block_n": _not_in(BLOCK_NS, optional=True),
    "num_warps": _not_in(NUM_WARPS, optional=True),
    "num_stages": _not_in(NUM_STAGES, optional=True),
}


def _assert_names(err: SpecError, field: str, value, source: str | None = None):
    message = str(err)
    assert err.field == field, message
    assert repr(value) in message and "allowed" in message, message
    if source is not None:
        assert source in message, message


@FAST
@given(st.sampled_from(FIELDS), st.data())
def test_invalid_value_names_field_value_and_allowed(field, data):
    value = data.draw(BAD_VALUES[field], label=field)
    with pytest.raises(SpecError) as info:
        AttentionSpec(**{"head_dim": 128, field: value})
    _assert_names(info.value, field, value)


@pytest.mark.parametrize("block_m, num_warps", [(64, 1), (16, 4), (256, 2), (128, 1), (32, 8)])
def test_block_m_num_warps_mismatch(block_m, num_warps):
    with pytest.raises(SpecError) as info:
        AttentionSpec(head_dim=64, block_m=block_m, num_warps=num_warps)
    _assert_names(info.value, "block_m", block_m)
    assert str(ROWS_PER_WARP[0]) in str(info.value)


@FAST
@given(st.text(min_size=1, max_size=12) | st.integers())
def test_from_dict_unknown_key_names_it(key):
    assume(key not in FIELDS)
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"head_dim": 64, key: 1, "zzz_other": 2}, source="my.yaml")
    message = str(info.value)
    assert info.value.field in (key, "zzz_other") and repr(info.value.field) in message
    assert "my.yaml" in message and "allowed" in message


def test_from_dict_rejects_source_and_missing_head_dim():
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"head_dim": 64, "source": "x"})
    assert info.value.field == "source"
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"mask": "causal"})
    assert info.value.field == "head_dim" and "allowed" in str(info.value)


# -- spec files -------------------------------------------------------------------
def _write(tmp_path: Path, data, name="spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("key", ["head_dims", "blockm", "window", "source", "Mask"])
def test_file_unknown_key_names_file_and_key(tmp_path, key):
    path = _write(tmp_path, {"head_dim": 128, key: 1})
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.field == key
    assert str(path) in str(info.value) and repr(key) in str(info.value)


def test_file_mixed_type_keys_are_a_spec_error(tmp_path):
    path = _write(tmp_path, "head_dim: 128\n1: 2\nfoo: 3\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FIELDS), st.data())
def test_file_bad_value_names_file_field_and_value(tmp_path, field, data):
    value = data.draw(BAD_VALUES[field], label=field)
    path = _write(tmp_path, {"head_dim": 128, field: value})
    loaded = yaml.safe_load(path.read_text())[field]  # the value as the file states it
    with pytest.raises(SpecError) as info:
        load_spec(path)
    _assert_names(info.value, field, loaded, source=str(path))


@pytest.mark.parametrize(
    "text, phrase",
    [("", "head_dim"), ("- 1\n- 2\n", "mapping"), ("head_dim: [1\n", "YAML"), ("mask: causal\n", "head_dim")],
)
def test_malformed_file_names_file(tmp_path, text, phrase):
    path = _write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and phrase in str(info.value)


def test_missing_file_names_file(tmp_path):
    with pytest.raises(SpecError, match="nope.yaml"):
        load_spec(tmp_path / "nope.yaml")


def test_smem_error_names_file_and_tile_field(tmp_path):
    tile = {"block_m": 256, "block_n": 128, "num_warps": 8, "num_stages": 4}
    path = _write(tmp_path, {"head_dim": 256, "arch": "sm_80", **tile})
    with pytest.raises(SpecError) as info:
        render(load_spec(path))
    assert info.value.field in TILE_FIELDS and str(path) in str(info.value)


def test_file_round_trip_ignores_source(tmp_path):
    spec = AttentionSpec(head_dim=96, dtype="fp16", gqa_ratio=8, mask="causal", softmax_scale=0.5, block_n=32)
    loaded = load_spec(_write(tmp_path, spec.to_dict()))
    assert loaded == spec and hash(loaded) == hash(spec) and loaded.source is not None


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
    assert spec.arch == "sm_90"
    assert not any(getattr(spec, f) is not None for f in TILE_FIELDS), "tile fields are left to the defaults"
    assert spec.name in render(spec)
