"""Reproducers (CPU): what they record, that they load back to the same case, and how replay reports."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

import attngen
from attngen import targets
from attngen.families import plan_spec
from attngen.fuzz.case import GUARD_ROWS, FuzzCase, input_digest, is_packed
from attngen.fuzz.check import run_case
from attngen.fuzz.reproducer import CASE_FILE, SPEC_FILE, load_reproducer, replay, reproducer_dir, write_reproducer
from attngen.fuzz.runners import Machine, ReferenceRunner
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="fp16", mask="causal", gqa_ratio=3, family="fwd_sm80",
                     config=dict(block_m=32, block_n=16, num_warps=2, num_stages=2))
CASE = FuzzCase(SPEC, batch=2, seq_q=19, seq_k=7, heads_kv=2, layout="padded", logit_scale=30.0,
                softmax_scale=0.5, data_seed=12345)
A10 = Machine("sm_86", "NVIDIA A10", "nvrtc-12.4")


class WrongOnLongKeys(ReferenceRunner):
    """Zeroes the output whenever there are more than 5 keys (on an A10: its kernels are planned for sm_86)."""

    target = targets.target("sm_86")
    machine = A10

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
        if k.shape[1] > 5:
            out.zero_()


@pytest.fixture
def written(tmp_path):
    failure = run_case(CASE, WrongOnLongKeys())
    assert failure.kind == "output"
    path = write_reproducer(reproducer_dir(tmp_path, CASE, failure.kernel), CASE, kernel=failure.kernel,
                            machine=A10, failure=failure)
    return path, failure


def test_reproducer_records_the_case_and_loads_back_to_it(written):
    path, failure = written
    kernel = plan_spec(SPEC, targets.target("sm_86")).name
    assert failure.kernel == kernel and kernel.endswith("_sm86")
    assert path.name.startswith(f"{kernel}-") and sorted(p.name for p in path.iterdir()) == [CASE_FILE, SPEC_FILE]
    # spec.yaml pins the family and config, and loads back to the same spec.
    assert attngen.load_spec(path / SPEC_FILE) == SPEC
    assert yaml.safe_load((path / SPEC_FILE).read_text()) == SPEC.to_dict()
    assert SPEC.to_dict()["family"] == "fwd_sm80" and SPEC.to_dict()["config"]["block_m"] == 32
    record = json.loads((path / CASE_FILE).read_text())
    assert record["shape"]["q"] == [2, 19, 6, 64] and record["shape"]["k"] == [2, 7, 2, 64]
    assert record["layout"]["name"] == "padded"
    assert record["layout"]["strides"]["q"] == [(19 + GUARD_ROWS) * 6 * 72, 6 * 72, 72, 1]
    assert record["dtype"] == "fp16" and record["softmax_scale"] == 0.5 and record["effective_scale"] == 0.5
    assert record["data"] == {"seed": 12345, "logit_scale": 30.0, "sha256": input_digest(CASE)}
    assert record["kernel"] == kernel and record["fault"] is None
    assert record["machine"] == {"target": "sm_86", "gpu": "NVIDIA A10", "nvrtc": "nvrtc-12.4"}
    assert record["attngen_version"] == attngen.__version__
    assert record["failure"] == {"kind": failure.kind, "detail": failure.detail}
    assert record["replay"] == f"attngen fuzz --replay {path}"
    repro = load_reproducer(path)
    assert repro.case == CASE and repro.kernel == kernel and repro.path == path and repro.machine == A10
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


class OnAnH100(ReferenceRunner):
    machine = Machine("sm_90a", "NVIDIA H100 80GB HBM3", "nvrtc-12.8")


def test_replay_warns_about_another_target_gpu_nvrtc_or_attngen_but_runs(written):
    path, failure = written
    _edit_record(path, lambda record: record.update(attngen_version="0.0.1"))
    result, warnings = replay(load_reproducer(path), OnAnH100())
    h100_kernel = plan_spec(SPEC, OnAnH100.target).name
    assert result.ok and warnings == [
        f"recorded for kernel {failure.kernel}; this GPU runs {h100_kernel} (another target, default family or "
        "config, or fault?)",
        "recorded with compile target sm_86; this replay has sm_90a: it may not reproduce",
        "recorded with GPU NVIDIA A10; this replay has NVIDIA H100 80GB HBM3: it may not reproduce",
        "recorded with NVRTC nvrtc-12.4; this replay has nvrtc-12.8: it may not reproduce",
        f"recorded with attngen 0.0.1; this is attngen {attngen.__version__}: the kernel source may differ",
    ]
    # sm_86 and sm_80 run the same family, but they are two compile targets: that is worth a warning too.
    a100 = targets.target("sm_80")
    _, warnings = replay(load_reproducer(path), type("OnAnA100", (ReferenceRunner,), {
        "target": a100, "machine": Machine("sm_80", "NVIDIA A10", "nvrtc-12.4")})())
    assert [w for w in warnings if "attngen" not in w] == [
        f"recorded for kernel {failure.kernel}; this GPU runs {plan_spec(SPEC, a100).name} (another target, default "
        "family or config, or fault?)",
        "recorded with compile target sm_86; this replay has sm_80: it may not reproduce"]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda r: r["shape"].pop("seq_k"), r"case.json: missing field 'seq_k'"),
        (lambda r: r["shape"].update(batch=0), r"case.json: batch=0 is invalid; allowed: an integer >= 1"),
        (lambda r: r["layout"].update(name="nhwc"), r"case.json: layout='nhwc' is invalid"),
        (lambda r: r.update(dtype="bf16"), r"case.json: dtype='bf16' disagrees with spec.yaml .*; allowed: 'fp16'"),
        (lambda r: r["shape"].update(heads_q=4), r"case.json: shape.heads_q=4 disagrees with spec.yaml .*; allowed: 6"),
        (lambda r: r.update(format=2), r"case.json: format=2 is not supported; allowed: 4 \(rerun the fuzz"),
        (lambda r: r.pop("machine"), r"case.json: missing field 'machine'"),
        # Derived fields someone edited: each would describe another case than the one replayed.
        (lambda r: r["layout"]["strides"].update(q=[1, 2, 3, 4]),
         r"case.json: layout.strides.q=\[1, 2, 3, 4\] disagrees with spec.yaml and the case's other fields \(was the "
         rf"file edited\?\); allowed: \[{(19 + GUARD_ROWS) * 6 * 72}, 432, 72, 1\]"),
        (lambda r: r.update(effective_scale=0.125), r"case.json: effective_scale=0.125 disagrees .*; allowed: 0.5"),
        (lambda r: r["shape"].update(q=[2, 19, 6, 128]), r"case.json: shape.q=\[2, 19, 6, 128\] disagrees"),
        (lambda r: r["shape"].update(k=[2, 8, 2, 64]), r"case.json: shape.k=\[2, 8, 2, 64\] disagrees"),
    ],
)
def test_a_damaged_case_file_is_an_error_naming_file_and_field(written, change, match):
    path, _ = written
    _edit_record(path, change)
    with pytest.raises(ValueError, match=match):
        load_reproducer(path)


def test_missing_or_unreadable_reproducers_are_errors_naming_the_path(tmp_path):
    expected = "expected a directory `attngen fuzz` wrote, with spec.yaml and case.json in it"
    with pytest.raises(ValueError, match=rf"{tmp_path}: no case.json there; {expected}"):
        load_reproducer(tmp_path)
    (tmp_path / CASE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=rf"{tmp_path}: no spec.yaml there; {expected}"):
        load_reproducer(tmp_path)
    (tmp_path / SPEC_FILE).write_text("head_dim: 64\n")
    with pytest.raises(ValueError, match="case.json: not valid JSON"):
        load_reproducer(tmp_path)


def test_an_older_reproducer_is_refused_by_its_format_before_its_spec_is_read(written):
    # Format 2 wrote tile fields into spec.yaml, which specs no longer take: the format says what to do.
    path, _ = written
    _edit_record(path, lambda record: record.update(format=2))
    (path / SPEC_FILE).write_text("head_dim: 64\ndtype: fp16\nblock_m: 32\nblock_n: 16\n")
    with pytest.raises(ValueError, match=r"case.json: format=2 is not supported; allowed: 4 \(rerun the fuzz"):
        load_reproducer(path)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_pool_and_random_spec_round_trips_through_a_reproducer(tmp_path, arch):
    from attngen.fuzz.pool import builtin_specs, random_spec_pool

    target = targets.target(arch)
    for i, spec in enumerate(builtin_specs(target) + random_spec_pool(1, 16, target)):
        documents = ((2, 1), (0, 3), (1, 0)) if is_packed(spec) else ()
        case = FuzzCase(spec, batch=1, seq_q=3, seq_k=4, heads_kv=1, data_seed=i, documents=documents)
        kernel = plan_spec(spec, target).name
        path = write_reproducer(reproducer_dir(tmp_path, case, kernel), case, kernel=kernel,
                                machine=Machine(target.name))
        repro = load_reproducer(path)
        assert repro.case == case and repro.case.spec.to_dict() == spec.to_dict() and repro.kernel == kernel
