"""Decode reproducers (CPU): case.json of kind "decode" records every DecodeCase field, loads back to
the same case, refuses edits, and replays; forward reproducers of format 4 without a kind still load
as forward ones. Also the decode search's choice of the case a sanitizer replays."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attngen.fuzz.case import FuzzCase
from attngen.fuzz.decode_check import run_decode_case
from attngen.fuzz.decode_reproducer import CASE_FIELDS, decode_case_record
from attngen.fuzz.decode_runners import ReferenceDecodeRunner
from attngen.fuzz.decode_search import decode_sample_key
from attngen.fuzz.paged import DecodeCase, make_decode_inputs
from attngen.fuzz.reproducer import CASE_FILE, load_reproducer, replay, reproducer_dir, write_reproducer
from attngen.fuzz.runners import Machine, ReferenceRunner
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="bf16", gqa_ratio=2, mask="sliding_window(40, 0)")
CASE = DecodeCase(SPEC, lengths=(37, 0, 5), seq_q=3, heads_kv=2, page_size=16, extra_pages=1, shared_pages=1,
                  spare_pages=2, num_splits=3, logit_scale=4.0, data_seed=77)
H100 = Machine("sm_90a", "NVIDIA H100 80GB HBM3", "nvrtc-12.8")


class ZeroesTheOutput(ReferenceDecodeRunner):
    def __call__(self, *args, **kw):
        out, lse = super().__call__(*args, **kw)
        return out.zero_(), lse


@pytest.fixture
def written(tmp_path):
    failure = run_decode_case(CASE, ZeroesTheOutput())
    assert failure.kind == "output"
    path = write_reproducer(reproducer_dir(tmp_path, CASE, failure.kernel), CASE, kernel=failure.kernel, machine=H100,
                            failure=failure)
    return path, failure


def _edit(path, change):
    record = json.loads((path / CASE_FILE).read_text())
    change(record)
    (path / CASE_FILE).write_text(json.dumps(record))


def test_a_decode_reproducer_records_every_field_and_loads_back_to_the_case(written):
    path, failure = written
    assert path.name.startswith(f"{failure.kernel}-") and failure.kernel.endswith("_paged")
    record = json.loads((path / CASE_FILE).read_text())
    assert record["kind"] == "decode" and record["format"] == 1 and record["kernel"] == failure.kernel
    assert set(CASE_FIELDS) == {f.name for f in dataclasses.fields(DecodeCase)} - {"spec"}
    assert record["case"] == {**{name: getattr(CASE, name) for name in CASE_FIELDS}, "lengths": [37, 0, 5]}
    # 3 pages of sequence 0, none of the empty one, the third's only page is sequence 0's first, 2 spare.
    assert record["derived"]["k_cache"] == [5, 16, 2, 64] and record["derived"]["page_table"] == [3, 4]
    assert record["failure"] == {"kind": "output", "detail": failure.detail}
    repro = load_reproducer(path)
    assert (repro.kind, repro.case, repro.kernel, repro.machine) == ("decode", CASE, failure.kernel, H100)


@pytest.mark.parametrize("case", [CASE, dataclasses.replace(CASE, page_size=None, shared_pages=0)])
def test_the_derived_shapes_are_those_of_the_inputs(case):
    x = make_decode_inputs(case)
    derived = decode_case_record(case)["derived"]
    assert derived["q"] == list(x.q.shape) and derived["k_cache"] == list(x.k_cache.shape)
    assert derived["page_table"] == (None if x.page_table is None else list(x.page_table.shape))


def test_replay_fails_while_the_bug_is_there_and_passes_once_it_is_gone(written):
    path, failure = written
    result, warnings = replay(load_reproducer(path), ZeroesTheOutput())
    assert (result.kind, result.detail) == (failure.kind, failure.detail)
    assert warnings == ["recorded with GPU NVIDIA H100 80GB HBM3; this replay has None: it may not reproduce",
                        "recorded with NVRTC nvrtc-12.8; this replay has None: it may not reproduce"]
    assert replay(load_reproducer(path), ReferenceDecodeRunner())[0].ok


def test_replay_warns_when_the_data_or_kernel_differ(written):
    path, _ = written

    def change(record):
        record["data"]["sha256"] = "0" * 64
        record["kernel"] = "decode_elsewhere"

    _edit(path, change)
    _, warnings = replay(load_reproducer(path), ReferenceDecodeRunner())
    assert any("inputs regenerated from seed 77 differ" in w for w in warnings)
    assert any("recorded for kernel decode_elsewhere" in w for w in warnings)


@pytest.mark.parametrize("change, match", [
    (lambda r: r["case"].pop("spare_pages"), r"case.json: missing field 'case.spare_pages'"),
    (lambda r: r["case"].update(pages=3), r"case.json: case.pages is not a decode case field; allowed: lengths, "),
    (lambda r: r["case"].update(lengths=[37, -1, 5]), r"case.json: lengths=\(37, -1, 5\) is invalid"),
    (lambda r: r["case"].update(logit_scale="big"), r"case.json: logit_scale='big' is invalid"),
    (lambda r: r["case"].update(data_seed=-1), r"case.json: data_seed=-1 is invalid"),
    (lambda r: r["derived"].update(k_cache=[5, 16, 2, 128]),
     r"case.json: derived.k_cache=\[5, 16, 2, 128\] disagrees with spec.yaml .*allowed: \[5, 16, 2, 64\]"),
    (lambda r: r["derived"].update(dtype="fp16"), r"case.json: derived.dtype='fp16' disagrees .*allowed: 'bf16'"),
    (lambda r: r.update(format=2), r"case.json: format=2 is not supported for a decode case; allowed: 1"),
    (lambda r: r.update(kind="backward"), r"case.json: kind='backward' is invalid; allowed: 'forward', 'decode'"),
])
def test_a_damaged_decode_case_file_is_an_error_naming_file_and_field(written, change, match):
    path, _ = written
    _edit(path, change)
    with pytest.raises(ValueError, match=match):
        load_reproducer(path)


def test_a_forward_reproducer_without_a_kind_still_loads_and_replays(tmp_path):
    # Format 4 files were written before decode reproducers existed: they have no "kind".
    spec = AttentionSpec(head_dim=64, dtype="fp16", family="fwd_sm80")
    case = FuzzCase(spec, batch=1, seq_q=5, seq_k=9, heads_kv=1, data_seed=3)
    runner = ReferenceRunner()
    path = write_reproducer(reproducer_dir(tmp_path, case, "k"), case, kernel=runner.kernel_name(spec),
                            machine=runner.machine)
    assert json.loads((path / CASE_FILE).read_text())["kind"] == "forward"
    _edit(path, lambda record: record.pop("kind"))
    repro = load_reproducer(path)
    assert repro.kind == "forward" and repro.case == case
    result, warnings = replay(repro, runner)
    assert result.ok and warnings == []


def test_the_sanitizer_sample_prefers_small_cases_with_a_partial_page_and_splits():
    edges = DecodeCase(SPEC, (37, 5), seq_q=2, heads_kv=1, page_size=16, num_splits=2)
    plain = DecodeCase(SPEC, (32,), seq_q=1, heads_kv=1, page_size=16, num_splits=1)
    huge = dataclasses.replace(edges, lengths=(100_000, 5), heads_kv=2)
    assert sorted([huge, plain, edges], key=decode_sample_key) == [edges, plain, huge]
