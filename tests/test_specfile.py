"""Spec files (attngen/specfile.py): read strictly, every problem in a file reported at once, each
naming the file, the field, the bad value and what is allowed; hostile input refused quickly."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_spec import BAD_VALUES, assert_names, spec_fields

from attngen import load_spec, specfile
from attngen.errors import SpecError
from attngen.families import FAMILIES, plan_spec
from attngen.spec import FLOAT32_MAX, FLOAT32_MIN_NORMAL, AttentionSpec
from attngen.targets import allowed_archs, target

FILE_CASES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def write(tmp_path: Path, data, name="spec.yaml") -> Path:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def problem_fields(err: SpecError) -> list:
    return sorted((f for f, _ in err.problems), key=str)


# -- numbers ------------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("1E-3", 1e-3), ("5e-1", 0.5), (".5", 0.5), ("0.125", 0.125),
                                         ("1.0e+3", 1000.0), ("2e2", 200.0), ("+3e-2", 0.03)])
def test_scientific_notation_is_a_float(tmp_path, text, value):
    spec = load_spec(write(tmp_path, f"head_dim: 64\nsoftmax_scale: {text}\n"))
    assert spec.softmax_scale == value and isinstance(spec.softmax_scale, float)


@FILE_CASES
@given(st.floats(min_value=FLOAT32_MIN_NORMAL, max_value=FLOAT32_MAX))
def test_every_float_as_python_writes_it_reads_back(tmp_path, scale):
    # repr() writes 1e-05, 1.5e+20, 0.001: YAML 1.2 floats all, whatever YAML 1.1 says.
    spec = load_spec(write(tmp_path, f"head_dim: 64\nsoftmax_scale: {scale!r}\n"))
    assert spec.softmax_scale == scale


def test_integers_stay_integers_and_quoted_numbers_stay_text(tmp_path):
    assert load_spec(write(tmp_path, "head_dim: 128\ngqa_ratio: 4\n")).gqa_ratio == 4
    path = write(tmp_path, 'head_dim: "128"\n')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_names(info.value, "head_dim", "128", source=str(path))
    assert "must be an integer" in str(info.value)
    with pytest.raises(SpecError, match="must be an integer"):
        load_spec(write(tmp_path, "head_dim: 1e2\n"))  # a float, even a whole one


@pytest.mark.parametrize("text, field, value", [("gqa_ratio: 010", "gqa_ratio", 10), ("gqa_ratio: 0o10", "gqa_ratio", 8),
                                                ("gqa_ratio: 0x4", "gqa_ratio", 4), ("varlen: true", "varlen", True),
                                                ("varlen: False", "varlen", False)])
def test_integers_and_booleans_read_as_yaml_1_2(tmp_path, text, field, value):
    """YAML 1.2's core schema: 010 is ten (YAML 1.1, PyYAML's default, read it as octal eight: a gqa8
    kernel for a spec that says 10), 0o10 is eight, true/false are the booleans."""
    spec = load_spec(write(tmp_path, f"head_dim: 64\n{text}\n"))
    assert getattr(spec, field) == value and type(getattr(spec, field)) is type(value)


@pytest.mark.parametrize("text, field, shown", [("gqa_ratio: 1:04", "gqa_ratio", "1:04"), ("head_dim: 1_28", "head_dim", "1_28"),
                                                ("softmax_scale: 1_0.5", "softmax_scale", "1_0.5"),
                                                ("varlen: yes", "varlen", "yes"), ("varlen: on", "varlen", "on")])
def test_yaml_1_1_only_numbers_and_booleans_are_text_and_refused(tmp_path, text, field, shown):
    """Base 60 (1:04 was 64), underscores (1_28 was 128) and yes/on (were true) are text in YAML 1.2,
    which the field then refuses by name: never a value the file did not mean."""
    path = write(tmp_path, f"head_dim: 64\n{text}\n" if field != "head_dim" else f"{text}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert field in problem_fields(info.value) and shown in str(info.value)


# -- duplicate keys -----------------------------------------------------------------
def test_duplicate_key_is_refused_naming_it(tmp_path):
    path = write(tmp_path, "head_dim: 64\nmask: causal\nmask: none\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    assert err.field == "mask" and str(path) in str(err) and "'mask'" in str(err) and "line 3" in str(err)


def test_every_duplicate_and_every_bad_value_at_once(tmp_path):
    path = write(tmp_path, "head_dim: 64\nhead_dim: 100\ndtype: fp32\nmask: causal\nmask: window\nwindw: 3\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    # Duplicates first, then the values (the last one given of each), then unknown fields.
    assert problem_fields(err) == ["dtype", "head_dim", "head_dim", "mask", "mask", "windw"], err.problems
    message = str(err)
    assert message.startswith(f"{path}: 6 problems:")
    for phrase in ("'head_dim' is given twice", "'mask' is given twice", "head_dim=100", "dtype='fp32'",
                   "mask='window'", "'windw'"):
        assert phrase in message, message


def test_duplicate_inside_config_is_attributed_to_config(tmp_path):
    path = write(tmp_path, "head_dim: 64\nfamily: fwd_sm80\nconfig:\n  block_n: 32\n  block_n: 64\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.field == "config" and "config.block_n is given twice" in str(info.value)


def test_duplicate_through_a_merge_key_is_refused(tmp_path):
    with pytest.raises(SpecError, match="'mask' is given twice"):
        load_spec(write(tmp_path, "head_dim: 64\n<<: {mask: causal}\nmask: none\n"))


# -- bounded, hostile and broken files ---------------------------------------------------
def test_dev_zero_is_refused_quickly():
    # In a subprocess with a deadline: an unbounded read would never return.
    code = ("import attngen\ntry:\n    attngen.load_spec('/dev/zero')\nexcept attngen.SpecError as e:\n"
            "    print(e)\nelse:\n    raise SystemExit('loaded')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "/dev/zero" in out.stdout and "larger than" in out.stdout


def test_large_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(specfile, "MAX_BYTES", 64)
    path = write(tmp_path, "head_dim: 64\n" + "# padding\n" * 10)
    with pytest.raises(SpecError, match="larger than 64 bytes") as info:
        load_spec(path)
    assert str(path) in str(info.value)
    load_spec(write(tmp_path, "head_dim: 64\n", "small.yaml"))  # at the limit's side that is fine


@pytest.mark.parametrize("data, phrase", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not a UTF-8 text file"),
    (bytes(range(256)), "not a UTF-8 text file"),
    (b"head_dim: 64\n\x00\x01\x02", "not a text file"),
    (b"\x7fELF\x02\x01\x01\x00", "not a text file"),
])
def test_binary_file_names_the_file(tmp_path, data, phrase):
    path = write(tmp_path, data, "model.bin")
    with pytest.raises(SpecError, match=phrase) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: ")


@FILE_CASES
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_load_or_raise_a_spec_error_naming_the_file(tmp_path, data):
    path = write(tmp_path, data)
    try:
        spec = load_spec(path)
    except SpecError as err:
        assert str(err).startswith(f"{path}: "), str(err)
        assert err.problems and all(isinstance(m, str) for _, m in err.problems)
    else:
        assert isinstance(spec, AttentionSpec)


def test_anchors_and_aliases_are_refused(tmp_path):
    # Nine lines of aliases would expand to 10^9 elements (an alias bomb).
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
    ) + "head_dim: *i\n"
    path = write(tmp_path, bomb)
    with pytest.raises(SpecError, match="anchor &a is not allowed") as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_deep_nesting_is_refused(tmp_path):
    path = write(tmp_path, "head_dim: " + "[" * 100_000)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_long_value_is_shown_cut_short(tmp_path):
    path = write(tmp_path, "head_dim: " + "x" * 100_000 + "\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert len(str(info.value)) < 500 and "xxx" in str(info.value) and "allowed" in str(info.value)


@pytest.mark.parametrize(
    "text, phrase",
    [("", "head_dim"), ("- 1\n- 2\n", "mapping"), ("head_dim: [1\n", "YAML"), ("mask: causal\n", "head_dim"),
     ("head_dim: 64\n---\nhead_dim: 128\n", "YAML")],
)
def test_malformed_file_names_file(tmp_path, text, phrase):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and phrase in str(info.value)


def test_yaml_error_points_into_the_file(tmp_path):
    path = write(tmp_path, "head_dim: 64\nmask: [causal\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert f'in "{path}", line 2' in str(info.value)


def test_missing_file_and_directory_name_the_path(tmp_path):
    with pytest.raises(SpecError, match="nope.yaml"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="cannot read") as info:
        load_spec(tmp_path)
    assert str(tmp_path) in str(info.value)


# -- fields ---------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["head_dims", "blockm", "window", "source", "Mask"])
def test_file_unknown_key_names_file_and_key(tmp_path, key):
    path = write(tmp_path, {"head_dim": 128, key: 1})
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.field == key
    assert str(path) in str(info.value) and repr(key) in str(info.value) and "allowed" in str(info.value)


def test_file_mixed_type_keys_are_a_spec_error(tmp_path):
    path = write(tmp_path, "head_dim: 128\n1: 2\nfoo: 3\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and problem_fields(info.value) == [1, "foo"]


@FILE_CASES
@given(st.sampled_from(sorted(BAD_VALUES)), st.data())
def test_file_bad_value_names_file_field_and_value(tmp_path, field, data):
    value = data.draw(BAD_VALUES[field], label=field)
    path = write(tmp_path, {"head_dim": 128, field: value})
    # The value as the file states it, read by YAML 1.2 rules as load_spec does: a string such as '0E0'
    # that PyYAML writes unquoted is a float there.
    loader = specfile._StrictLoader(path.read_text(), str(path))
    try:
        loaded = loader.get_single_data()[field]
    finally:
        loader.dispose()
    if isinstance(loaded, float) and math.isnan(loaded):
        loaded = value  # nan != nan: its repr is what the message must show
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_names(info.value, field, loaded, source=str(path))


@pytest.mark.parametrize("config, phrase", [
    ("{block_m: 100}", "config.block_m=100 is invalid"),
    ('{block_n: "64"}', "config.block_n='64' is invalid"),
    ("{warps: 4}", "'warps'"),
    ("{block_m: 64, num_warps: 1}", "block_m=64 is invalid with num_warps=1"),
])
def test_bad_config_in_a_file_names_file_field_and_allowed(tmp_path, config, phrase):
    path = write(tmp_path, f"head_dim: 128\nfamily: fwd_sm80\nconfig: {config}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert info.value.field == "config" and message.startswith(f"{path}: ") and phrase in message, message
    assert "allowed" in message


def test_legacy_tile_fields_in_a_file(tmp_path):
    path = write(tmp_path, "head_dim: 128\nblock_m: 64\nnum_warps: 4\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "`family: fwd_sm80`" in message
    assert "`config: {block_m: 64, num_warps: 4}`" in message
    # Written as the message says, the file loads with the same tile.
    fixed = write(tmp_path, "head_dim: 128\nfamily: fwd_sm80\nconfig: {block_m: 64, num_warps: 4}\n", "fixed.yaml")
    assert load_spec(fixed).pinned == {"block_m": 64, "num_warps": 4}


def test_smem_error_names_file_and_config(tmp_path):
    config = {"block_m": 256, "block_n": 128, "num_warps": 8, "num_stages": 4}
    path = write(tmp_path, {"head_dim": 256, "arch": "sm_80", "family": "fwd_sm80", "config": config})
    spec = load_spec(path)  # a valid spec: whether it fits is the family's plan's call, for its target
    with pytest.raises(SpecError) as info:
        plan_spec(spec)
    assert info.value.field == "config" and str(info.value).startswith(f"{path}: ") and "sm_80" in str(info.value)


def test_family_that_cannot_run_on_the_arch_names_both(tmp_path):
    problem = AttentionSpec(head_dim=128).problem
    pairs = [(f, a) for f in FAMILIES.values() for a in allowed_archs() if f.supports(problem, target(a))]
    if not pairs:
        pytest.skip("every registered family runs on every arch")
    family, arch = pairs[0]
    path = write(tmp_path, {"head_dim": 128, "arch": arch, "family": family.name})
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert info.value.field == "family" and message.startswith(f"{path}: ") and family.name in message
    assert target(arch).name in message


@FILE_CASES
@given(spec_fields())
def test_file_round_trip(tmp_path, fields):
    spec = AttentionSpec(**fields)
    loaded = load_spec(write(tmp_path, spec.to_dict()))
    assert loaded == spec and hash(loaded) == hash(spec) and loaded.source is not None


def test_arch_only_difference_gives_different_names(tmp_path):
    a = load_spec(write(tmp_path, "head_dim: 64\narch: sm_80\n", "a.yaml"))
    b = load_spec(write(tmp_path, "head_dim: 64\narch: sm_89\n", "b.yaml"))
    assert a != b and a.name != b.name and a.name.endswith("_sm80") and b.name.endswith("_sm89")


@pytest.mark.parametrize("path", [None, 5, b"spec.yaml", ["spec.yaml"]])
def test_a_path_that_is_no_path_is_named(path):
    """load_spec(None) and the like gave pathlib's TypeError, naming nothing."""
    with pytest.raises(SpecError, match="path is .*; allowed: a spec file's path"):
        load_spec(path)
