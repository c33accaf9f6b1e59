"""Reproducers (CPU): what they record, that they load back to the same case, and how replay reports."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import attngen
from attngen.fuzz.case import FuzzCase, input_digest
from attngen.fuzz.check import run_case
from attngen.fuzz.reproducer import CASE_FILE, SPEC_FILE, load_reproducer, replay, reproducer_dir, write_reproducer
from attngen.fuzz.runners import ReferenceRunner
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="fp16", mask="causal", gqa_ratio=3, block_m=32, block_n=16, num_warps=2,
                     num_stages=2)
CASE = FuzzCase(SPEC, batch=2, seq_q=19, seq_k=7, heads_kv=2, layout="padded", logit_scale=30.0,
                softmax_scale=0.5, data_seed=12345)


class WrongOnLongKeys(ReferenceRunner):
    """Zeroes the output whenever there are more than 5 keys."""

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
        if k.shape[1] > 5:
            out.zero_()


@pytest.fixture
def written(tmp_path):
    failure = run_case(CASE, WrongOnLongKeys())
    assert failure.kind == "output"
    path = write_reproducer(reproducer_dir(tmp_path, CASE, failure.kernel), CASE, kernel=failure.kernel,
                            arch="sm_90", failure=failure)
    return path, failure


def test_reproducer_records_the_case_and_loads_back_to_it(written):
    path, failure = written
    assert path.name.startswith(f"{SPEC.name}-") and sorted(p.name for p in path.iterdir()) == [CASE_FILE, SPEC_FILE]
    assert attngen.load_spec(path / SPEC_FILE) == SPEC
    record = json.loads((path / CASE_FILE).read_text())
    assert record["shape"]["q"] == [2, 19, 6, 64] and record["shape"]["k"] == [2, 7, 2, 64]
    assert record["layout"]["name"] == "padded" and record["layout"]["strides"]["q"] == [20 * 6 * 72, 6 * 72, 72, 1]
    assert record["dtype"] == "fp16" and record["softmax_scale"] == 0.5 and record["effective_scale"] == 0.5
    assert record["data"] == {"seed": 12345, "logit_scale": 30.0, "sha256": input_digest(CASE)}
    assert record["kernel"] == SPEC.name and record["fault"] is None and record["arch"] == "sm_90"
    assert record["failure"] == {"kind": failure.kind, "detail": failure.detail}
    assert record["replay"] == f"attngen fuzz --replay {path}"
    repro = load_reproducer(path)
    assert repro.case == CASE and repro.kernel == SPEC.name and repro.path == path
    assert load_reproducer(path / CASE_FILE).case == CASE


def test_the_directory_name_is_a_function_of_the_case(tmp_path):
    assert reproducer_dir(tmp_path, CASE, "k") == reproducer_dir(tmp_path, replace(CASE), "k")
    assert reproducer_dir(tmp_path, CASE, "k") != reproducer_dir(tmp_path, replace(CASE, data_seed=1), "k")


def test_replay_fails_while_the_bug_is_there_and_passes_once_it_is_gone(written):
    path, failure = written
    result, warnings = replay(load_reproducer(path), WrongOnLongKeys())
    assert (result.kind, result.detail, warnings) == (failure.kind, failure.detail, [])
    assert replay(load_reproducer(path), ReferenceRunner())[0].ok


def _edit_record(path, change):
    record = json.loads((path / CASE_FILE).read_text())
    change(record)
    (path / CASE_FILE).write_text(json.dumps(record))


def test_replay_warns_when_data_or_kernel_differ_from_the_recording(written):
    path, _ = written

    def change(record):
        record["data"]["sha256"] = "0" * 64
        record["kernel"] = "fwd_other"

    _edit_record(path, change)
    _, warnings = replay(load_reproducer(path), ReferenceRunner())
    assert any("inputs regenerated from seed 12345 differ" in w for w in warnings)
    assert any("recorded for kernel fwd_other" in w for w in warnings)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda r: r["shape"].pop("seq_k"), r"case.json: missing field 'seq_k'"),
        (lambda r: r["shape"].update(batch=0), r"case.json: batch=0 is invalid; allowed: an integer >= 1"),
        (lambda r: r["layout"].update(name="nhwc"), r"case.json: layout='nhwc' is invalid"),
        (lambda r: r.update(dtype="bf16"), r"case.json: dtype='bf16' disagrees with spec.yaml; allowed: 'fp16'"),
        (lambda r: r["shape"].update(heads_q=4), r"case.json: shape.heads_q=4 disagrees with spec.yaml; allowed: 6"),
        (lambda r: r.update(format=99), r"case.json: format=99 is not supported; allowed: 1"),
    ],
)
def test_a_damaged_case_file_is_an_error_naming_file_and_field(written, change, match):
    path, _ = written
    _edit_record(path, change)
    with pytest.raises(ValueError, match=match):
        load_reproducer(path)


def test_missing_or_unreadable_reproducers_are_errors_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match=rf"--replay {tmp_path}: no case.json there"):
        load_reproducer(tmp_path)
    (tmp_path / CASE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="case.json: not valid JSON"):
        load_reproducer(tmp_path)
