"""`attngen fuzz --decode` end to end on the CPU: the reference (attngen/fuzz/decode_runners.py) or a
broken copy of it stands in for attngen.decode, through command.make_decode_runner."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from attngen.cli import main
from attngen.fuzz import command
from attngen.fuzz.decode_runners import ReferenceDecodeRunner
from attngen.fuzz.paged import DecodeLimits, decode_specs
from attngen.fuzz.reproducer import CASE_FILE
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="fp16", gqa_ratio=2, mask="causal")
# Pages of 16 (the per-row plan), of 256 (whole key blocks) and a contiguous cache: three kernels.
PAGED, WHOLE_PAGES, CONTIGUOUS = (ReferenceDecodeRunner().kernel_name(SPEC, size) for size in (16, 256, None))
SMALL = ("--max-seq-len", "200")


def _clamped(page_table, k_cache):
    """Page ids a broken stand-in may follow past a sequence's pages, kept inside the cache (so the
    read lands in a NaN page instead of raising)."""
    return None if page_table is None else page_table.clamp(0, k_cache.shape[0] - 1)


class ReadsOnePastEachLength(ReferenceDecodeRunner):
    def __call__(self, q, k_cache, v_cache, cache_seqlens, *, page_table, **kw):
        return super().__call__(q, k_cache, v_cache, cache_seqlens + 1, page_table=_clamped(page_table, k_cache), **kw)


class DropsLastPartialPage(ReferenceDecodeRunner):
    """Every sequence of a paged cache loses the tokens of its last page when that page is partial."""

    def __call__(self, q, k_cache, v_cache, cache_seqlens, *, page_table, **kw):
        if page_table is not None:
            cache_seqlens = cache_seqlens - cache_seqlens % k_cache.shape[1]
        return super().__call__(q, k_cache, v_cache, cache_seqlens, page_table=page_table, **kw)


class ReadsPastLengthsOnWholePages(ReferenceDecodeRunner):
    """Broken only where the plan for pages of whole key blocks runs (page sizes a multiple of 64)."""

    def __call__(self, q, k_cache, v_cache, cache_seqlens, *, page_table, **kw):
        if page_table is not None and k_cache.shape[1] % 64 == 0:
            cache_seqlens = cache_seqlens + 1
            page_table = _clamped(page_table, k_cache)
        return super().__call__(q, k_cache, v_cache, cache_seqlens, page_table=page_table, **kw)


class Recording(ReferenceDecodeRunner):
    """The reference, recording what each call got: shapes, lengths, splits and a checksum of q."""

    calls: list = []
    sleep = 0.0

    def __call__(self, q, k_cache, v_cache, cache_seqlens, *, page_table, num_splits, **kw):
        time.sleep(self.sleep)
        Recording.calls.append((tuple(q.shape), tuple(k_cache.shape), cache_seqlens.tolist(), num_splits,
                                float(q.float().sum())))
        return super().__call__(q, k_cache, v_cache, cache_seqlens, page_table=page_table, num_splits=num_splits, **kw)


@pytest.fixture
def decode_runner(monkeypatch):
    """Which class make_decode_runner instantiates (chosen["runner"]), and how often it was asked."""
    chosen = {"runner": ReferenceDecodeRunner, "made": 0}

    def make_decode_runner():
        chosen["made"] += 1
        return chosen["runner"]()

    monkeypatch.setattr(command, "make_decode_runner", make_decode_runner)
    monkeypatch.setattr(command, "make_runner", lambda fault: pytest.fail("the forward runner was made"))
    Recording.calls = []
    return chosen


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "decode.yaml"
    path.write_text(yaml.safe_dump(SPEC.to_dict()))
    return path


def fuzz(*args):
    return CliRunner().invoke(main, ["fuzz", *map(str, args)])


def _reproducer(output: str) -> Path:
    return Path(re.search(r"replay it with:\n  attngen fuzz --replay (\S+)", output).group(1))


def test_a_correct_decode_passes_every_kernel_of_the_pool_and_exits_0(decode_runner, tmp_path):
    specs = decode_specs(ReferenceDecodeRunner.target)
    result = fuzz("--decode", "--examples", 3 * len(specs), "--seed", 3, *SMALL, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    # The first cases run every kernel once: each problem over pages of 16 (the per-row plan), of 256 (pages
    # of whole key blocks, except in TMA plans, which take every page size) and a contiguous cache.
    runner = ReferenceDecodeRunner()
    names = {runner.kernel_name(spec, size) for spec in specs for size in (16, 256, None)}
    tma = sum(spec.pinned.get("loads") == "tma" for spec in specs)
    assert tma and len(names) == 3 * len(specs) - tma
    assert result.output.startswith(
        f"attngen fuzz --decode: {len(specs)} specs, up to {3 * len(specs)} cases, seed 3\n  target sm_90a, "
        f"families decode_sm80: {len(specs)} ({len(names)} kernels: paged and contiguous)\n")
    assert "attngen fuzz --decode: cases per kernel" in result.output and "longest cache" in result.output
    assert all(name in result.output for name in names)
    assert f"{3 * len(specs)} cases in" in result.output and "0 failures" in result.output
    assert "decode: every sequence's output and LSE checked against the float64 reference" in result.output
    assert not (tmp_path / "failures").exists()


def test_family_names_the_decode_family_of_the_pool(decode_runner, tmp_path):
    specs = decode_specs(ReferenceDecodeRunner.target)
    result = fuzz("--decode", "--family", "decode_sm80", "--examples", 2, "--seed", 3, *SMALL, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"attngen fuzz --decode: {len(specs)} specs, up to 2 cases, seed 3\n  target "
                                    f"sm_90a, families decode_sm80: {len(specs)} (")


def test_a_failure_on_pages_of_whole_blocks_is_found_named_and_shrunk(decode_runner, spec_file, tmp_path):
    """A decode broken only on pages of whole key blocks: found, named by that kernel, shrunk to a case on
    pages that kernel takes (its search draws only those: tests/test_fuzz_paged.py)."""
    decode_runner["runner"] = ReadsPastLengthsOnWholePages
    result = fuzz("--decode", spec_file, "--examples", 50, "--seed", 2, *SMALL, "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert f"kernel: {WHOLE_PAGES}" in result.output and "shrunk in" in result.output
    record = json.loads((_reproducer(result.output) / CASE_FILE).read_text())
    assert record["case"]["page_size"] % 64 == 0 and record["failure"]["kind"] == "output"


def test_a_read_past_each_length_is_shrunk_written_and_replayable(decode_runner, spec_file, tmp_path):
    decode_runner["runner"] = ReadsOnePastEachLength
    result = fuzz("--decode", spec_file, "--examples", 50, "--seed", 1, *SMALL, "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "FAILED (output" in result.output and "the output has NaN/Inf" in result.output
    # The first (paged) case failed; its kernel alone was searched and the failure shrunk to one empty sequence.
    assert re.search(r"case:   decode lengths=\[0\] seq_q=1 heads 2/1 pages of \d+ .* splits=None", result.output)
    assert f"kernel: {PAGED}" in result.output and "shrunk in" in result.output
    path = _reproducer(result.output)
    assert path.parent == tmp_path / "out" / "failures" and path.name.startswith(PAGED)
    record = json.loads((path / CASE_FILE).read_text())
    assert record["kind"] == "decode" and record["case"]["lengths"] == [0] and record["failure"]["kind"] == "output"

    still_broken = fuzz("--replay", path)
    assert still_broken.exit_code == 1 and still_broken.output.startswith(f"FAIL {path}: {PAGED} decode lengths=[0]")
    decode_runner["runner"] = ReferenceDecodeRunner
    fixed = fuzz("--replay", path)
    assert fixed.exit_code == 0 and fixed.output.startswith(f"PASS {path}: {PAGED}")


def test_a_dropped_last_partial_page_is_found_on_a_paged_cache_and_replayable(decode_runner, spec_file, tmp_path):
    decode_runner["runner"] = DropsLastPartialPage
    result = fuzz("--decode", spec_file, "--examples", 50, "--seed", 2, *SMALL, "--out", tmp_path)
    assert result.exit_code == 1, result.output
    (path,) = (tmp_path / "failures").iterdir()
    case = json.loads((path / CASE_FILE).read_text())["case"]
    assert case["page_size"] is not None and any(n % case["page_size"] for n in case["lengths"])
    assert case["lengths"] == [1] and case["seq_q"] == 1  # shrunk: one sequence of one token, one new token
    assert fuzz("--replay", path).exit_code == 1
    decode_runner["runner"] = ReferenceDecodeRunner
    assert fuzz("--replay", path).exit_code == 0


def test_the_seed_fixes_the_cases_and_a_run_without_one_prints_its_own(decode_runner, spec_file, tmp_path):
    decode_runner["runner"] = Recording

    def calls(*seed):
        Recording.calls = []
        result = fuzz("--decode", spec_file, "--examples", 15, *seed, *SMALL, "--out", tmp_path)
        assert result.exit_code == 0, result.output
        return Recording.calls, result.output

    first, _ = calls("--seed", 5)
    assert len(first) == 15 and calls("--seed", 5)[0] == first and calls("--seed", 6)[0] != first
    unseeded, output = calls()
    seed = re.search(r"up to 15 cases, seed (\d+)\n", output).group(1)
    assert calls("--seed", seed)[0] == unseeded


def test_max_seq_len_is_the_longest_cache(decode_runner, spec_file, tmp_path):
    decode_runner["runner"] = Recording
    result = fuzz("--decode", spec_file, "--examples", 60, "--seed", 0, "--max-seq-len", 40, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    lengths = [n for call in Recording.calls for n in call[2]]
    assert max(lengths) == 40 and min(lengths) == 0  # drawn up to the limit, and no further


def test_the_time_budget_stops_the_run(decode_runner, spec_file, tmp_path):
    decode_runner["runner"] = type("Slow", (Recording,), {"sleep": 0.05})
    start = time.monotonic()
    result = fuzz("--decode", spec_file, "--examples", 10_000, "--seed", 0, "--time-budget", 0.5, *SMALL,
                  "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "time budget 0.5 s" in result.output and "stopped: time budget" in result.output
    assert 1 <= len(Recording.calls) < 15 and time.monotonic() - start < 5


def test_a_sticky_gpu_error_is_reported_unshrunk(decode_runner, spec_file, tmp_path):
    class IllegalAddress(ReferenceDecodeRunner):
        def __call__(self, *args, **kw):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    decode_runner["runner"] = IllegalAddress
    result = fuzz("--decode", spec_file, "--examples", 20, "--seed", 0, *SMALL, "--out", tmp_path)
    assert result.exit_code == 1 and "FAILED (device" in result.output
    assert "not shrunk: the GPU context is unusable" in result.output
    assert len(list((tmp_path / "failures").iterdir())) == 1


def test_a_harness_error_stops_the_run_with_advice_and_exit_2(decode_runner, spec_file, tmp_path, monkeypatch):
    from attngen import reference

    decode_attention = reference.decode_attention

    def out_of_memory_above(q, k_cache, v_cache, cache_seqlens, spec, *, compute_dtype=torch.float64, **kw):
        if compute_dtype == torch.float64 and int(cache_seqlens.max()) > 30:
            raise RuntimeError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return decode_attention(q, k_cache, v_cache, cache_seqlens, spec, compute_dtype=compute_dtype, **kw)

    monkeypatch.setattr(reference, "decode_attention", out_of_memory_above)
    result = fuzz("--decode", spec_file, "--examples", 50, "--seed", 0, *SMALL, "--out", tmp_path)
    assert result.exit_code == 2, result.output
    assert "error: the harness itself failed" in result.output and "CUDA out of memory" in result.output
    assert "lower --max-seq-len (this run: 200)" in result.output and "stopped: harness error" in result.output
    assert "FAILED" not in result.output and not (tmp_path / "failures").exists()


class Launches(ReferenceDecodeRunner):
    """The reference, reporting the decode plan it "launches" (as DecodeKernelRunner does)."""

    def __init__(self):
        self.launched = []

    def __call__(self, q, k_cache, v_cache, cache_seqlens, *, page_table, spec, **kw):
        self.launched.append(self.kernel_name(spec, None if page_table is None else k_cache.shape[1]))
        return super().__call__(q, k_cache, v_cache, cache_seqlens, page_table=page_table, spec=spec, **kw)


def test_sanitize_replays_one_decode_case_per_kernel(decode_runner, spec_file, tmp_path, fake_sanitizer):
    result = fuzz("--decode", spec_file, "--examples", 30, "--seed", 4, *SMALL, "--out", tmp_path, "--sanitize")
    assert result.exit_code == 0, result.output
    samples = sorted((tmp_path / "sanitize").iterdir())
    assert [p.name.split("-")[0] for p in samples] == sorted([CONTIGUOUS, PAGED, WHOLE_PAGES])
    # The paged samples have a partial last page and several splits (so the combine kernel runs too).
    for sample in samples[1:]:
        paged = json.loads((sample / CASE_FILE).read_text())["case"]
        assert any(n % paged["page_size"] for n in paged["lengths"]) and paged["num_splits"] > 1
    calls = fake_sanitizer.calls.read_text().splitlines()
    assert len(calls) == 9 and {c.split("kns=")[1].split()[0] for c in calls} == {PAGED, WHOLE_PAGES, CONTIGUOUS}
    assert "sanitizer: 9/9 runs clean over 3 kernels" in result.output

    # What each sanitizer process runs: the replay, which names the decode plans it launched.
    decode_runner["runner"] = Launches
    replayed = fuzz("--replay", samples[1])
    assert replayed.exit_code == 0 and f"launched kernel {PAGED}" in replayed.output


@pytest.mark.parametrize("args, message", [
    (("--random-specs",), "--decode fuzzes the SPEC files or the pool's decode problems; --random-specs draws "
                          "forward problems"),
    (("--fault", "drop_last_partial_kv_tile"), "--fault breaks forward kernels (attngen/faults.py); --decode runs "
                                               "attngen.decode, which has no faults"),
    (("--replay", "somewhere"), "--replay reads whether a reproducer is a forward or a decode case from its "
                                "case.json: it takes no --decode"),
])
def test_forward_only_options_are_usage_errors_naming_both(decode_runner, args, message):
    result = fuzz("--decode", *args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert decode_runner["made"] == 0


def test_a_decode_reproducer_replayed_with_a_fault_is_a_usage_error(decode_runner, spec_file, tmp_path):
    decode_runner["runner"] = DropsLastPartialPage
    path = _reproducer(fuzz("--decode", spec_file, "--examples", 50, "--seed", 2, *SMALL, "--out", tmp_path).output)
    result = fuzz("--replay", path, "--fault", "drop_last_partial_kv_tile")
    assert result.exit_code == 2 and f"{path} is a decode reproducer" in " ".join(result.output.split())


@pytest.mark.parametrize("fields, message", [
    (dict(varlen=True), "packed sequences (varlen, or attention_varlen's document arrays) are the forward's"),
    (dict(dropout_p=0.1), "no decode kernel family can run"),
])
def test_a_spec_no_decode_family_runs_is_a_usage_error_naming_the_file(decode_runner, tmp_path, fields, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(SPEC.replace(**fields).to_dict()))
    result = fuzz("--decode", path, "--examples", 3)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"Invalid value for SPEC: {path}: " in text and message in text, result.output


def test_help_names_the_decode_mode_and_its_length_default():
    text = " ".join(fuzz("--help").output.split())
    assert "--decode Fuzz attngen.decode instead" in text and "Not with --random-specs or --fault." in text
    assert f"with --decode, the longest cache [default: {DecodeLimits().max_length}]" in text
    assert command.DEFAULT_DECODE_MAX_LENGTH == DecodeLimits().max_length


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_decode_mode_says_so():
    result = fuzz("--decode", "--examples", 1)
    assert result.exit_code == 2 and "CUDA GPU" in result.output

