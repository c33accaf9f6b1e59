"""The search's bookkeeping on CPU: the GPU pieces (build, launch, timing, reference check) are faked."""

from __future__ import annotations

import dataclasses
import datetime
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from attngen.nvcc import ResourceReport
from attngen.spec import AttentionSpec
from attngen.tune import lookup, ranking, search
from attngen.tune.db import TuningDB
from attngen.tune.model import Shape, gpu_model
from attngen.tune.resources import prune

SPEC = AttentionSpec(head_dim=64, mask="causal", block_n=64)  # 32 configs (narrowed: stored only when asked)
SHAPE = Shape(2, 1024, 1024, 8)
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


class FakeKernel:
    def __init__(self, gpu, spec):
        self.gpu, self.spec = gpu, spec

    def __call__(self, q, k, v):
        self.gpu.launched = self.spec


class FakeGPU:
    """Stands in for torch.cuda, the builds, the kernels, the timer (attngen.bench.time_ms, so the
    search's own probe cutoff runs) and verification; records what ran. `ms(spec)` is a kernel's
    full time, `probe_ms(spec)` its probe's (default: the same); every timer call and every
    verification advances `clock` (when given: the search's time.monotonic) by its seconds."""

    def __init__(self, monkeypatch, *, ms=lambda spec: 1.0 + spec.block_m / 1000, probe_ms=None, broken=(), wrong=(),
                 sticky=(), spills=lambda spec: 0, clock=None, timer_s=0.0, verify_s=0.0):
        import torch

        self.ms, self.probe_ms, self.wrong, self.sticky = ms, probe_ms or ms, set(wrong), set(sticky)
        self.calls: list[tuple[str, str]] = []  # (config, "probe" or "full"), per timer call
        self.verified: list[str] = []
        self.clock, self.timer_s, self.verify_s = clock, timer_s, verify_s
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr("attngen.nvcc.find_nvcc", lambda: "nvcc")
        monkeypatch.setattr(search, "device_gpu_model", lambda device: gpu_model("sm_90"))
        monkeypatch.setattr(lookup, "device_identity", lambda device: ("Fake H100", "sm_90"))
        monkeypatch.setattr(lookup, "compiler_version", lambda: "nvrtc-0.0")
        monkeypatch.setattr(ranking, "compile_reports",
                            lambda cands, arch, jobs=None, on_done=None: fake_reports(cands, arch, spills))
        monkeypatch.setattr(search, "process_pool", lambda jobs: ThreadPoolExecutor(2))
        monkeypatch.setattr(search, "_nvrtc_binary",
                            lambda spec, family, target: "CompileError: boom" if spec.tile.label() in broken else None)
        monkeypatch.setattr(search, "input_sets", lambda spec, shape: [(None, None, None)])
        monkeypatch.setattr("attngen.compile", lambda spec: FakeKernel(self, spec))
        monkeypatch.setattr("attngen.bench.time_ms", self._time_ms)
        monkeypatch.setattr(search, "verify", self._verify)
        if clock is not None:
            monkeypatch.setattr(search.time, "monotonic", clock)

    @property
    def timed(self) -> list[str]:
        """The configs launched, in order (every measurement starts with a probe)."""
        return [label for label, kind in self.calls if kind == "probe"]

    def _advance(self, seconds: float) -> None:
        if seconds:
            self.clock.now += seconds

    def _time_ms(self, fn, input_sets, warmup=5, repeats=30):
        fn(*input_sets[0])
        spec, label = self.launched, self.launched.tile.label()
        if label in self.sticky:
            raise RuntimeError(ILLEGAL_ADDRESS)
        probe = repeats == search.PROBE_REPEATS
        self.calls.append((label, "probe" if probe else "full"))
        self._advance(self.timer_s)
        return self.probe_ms(spec) if probe else self.ms(spec)

    def _verify(self, spec):
        self.verified.append(spec.tile.label())
        self._advance(self.verify_s)
        return "failed verification (output): x" if spec.tile.label() in self.wrong else None


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_reports(candidates, arch, spills=lambda spec: 0) -> list[ResourceReport | None]:
    return [ResourceReport(c.label, arch, 128, 0, 0, spills(c.spec), spills(c.spec), c.plan.smem_bytes)
            if c.launchable else None for c in candidates]


def predicted_order(spec=SPEC, shape=SHAPE) -> list[str]:
    """The survivors' labels in the model's order, given FakeGPU's resource reports."""
    gpu, space = gpu_model("sm_90"), search.search_space(spec, "sm_90")
    pruned = [prune(c, r, gpu) for c, r in zip(space, fake_reports(space, "sm_90"))]
    return [r.label for r in ranking.survivors(ranking.rank(pruned, gpu, shape))]


def tune(shapes=(SHAPE,), spec=SPEC, **kwargs):
    return search.tune(spec, list(shapes), store_narrowed=True, **kwargs)


@pytest.fixture
def db(tmp_path):
    lookup.clear_memo()
    return TuningDB(tmp_path / "t.sqlite3")


def test_times_the_best_predicted_first_up_to_the_fraction_and_stores_the_winner(monkeypatch, db):
    gpu = FakeGPU(monkeypatch)
    result = tune(max_fraction=0.25, db=db)[0]
    survivors = ranking.survivors(result.ranked)
    assert len(result.timings) == result.limit == math.floor(0.25 * result.launchable) == 8
    assert gpu.timed == [r.label for r in survivors[:8]]
    assert result.stopped_by == "max fraction"
    best = min(result.timings, key=lambda t: t.ms)
    assert result.winner is best
    stored = db.entries()
    assert len(stored) == 1 and stored[0].tile == best.ranked.spec.tile and stored[0].timed == 8
    assert stored[0].key.gpu == "Fake H100" and stored[0].key.seqlen_bucket == 1024


def test_failures_time_as_infinity_and_a_wrong_winner_is_replaced(monkeypatch, db):
    FakeGPU(monkeypatch, ms=lambda spec: float(spec.block_m))
    result = tune(max_fraction=1.0, db=db)[0]
    ordered = sorted(result.timings, key=lambda t: t.ms)
    fastest, second = ordered[0].ranked.label, ordered[1].ranked.label
    gpu = FakeGPU(monkeypatch, ms=lambda spec: float(spec.block_m), broken={fastest}, wrong={second})
    result = tune(max_fraction=1.0, db=db)[0]
    by_label = {t.ranked.label: t for t in result.timings}
    assert math.isinf(by_label[fastest].ms) and "boom" in by_label[fastest].error
    assert math.isinf(by_label[second].ms) and by_label[second].error.startswith("failed verification")
    assert result.winner.ranked.label not in (fastest, second) and result.winner.ok
    assert db.entries()[0].tile == result.winner.ranked.spec.tile
    assert fastest not in gpu.timed and len(set(gpu.timed)) == len(result.timings) - 1  # the broken build never ran


def test_probe_cutoff_times_only_contenders_in_full(monkeypatch, db):
    first, *rest = predicted_order()[:8]
    gpu = FakeGPU(monkeypatch, ms=lambda spec: 1.0 if spec.tile.label() == first else 2.0,
                  probe_ms=lambda spec: 1.0 if spec.tile.label() in (first, rest[0]) else 1.6)
    result = tune(max_fraction=0.25, db=db)[0]
    assert gpu.calls[:2] == [(first, "probe"), (first, "full")]
    # A probe within PROBE_CUTOFF of the best goes on to a full timing; one beyond it stops there.
    assert (rest[0], "full") in gpu.calls and not any(kind == "full" for label, kind in gpu.calls if label in rest[1:])
    probed = {t.ranked.label: t.probe_only for t in result.timings}
    assert probed == {first: False, rest[0]: False, **dict.fromkeys(rest[1:], True)}
    assert result.winner.ranked.label == first and db.entries()[0].ms == 1.0


def test_a_fast_wrong_kernel_cannot_leave_a_probe_time_as_the_stored_winner(monkeypatch, db):
    # The wrong kernel's probe cuts every other one off after its probe; once it fails verification
    # the winner must still be a full measurement: b (probe 1.0) is timed in full (1.3), then c
    # (probe 1.1), whose full time (1.05) wins.
    wrong, b, c = predicted_order()[:3]
    full = {wrong: 0.5, b: 1.3, c: 1.05}
    probe = {wrong: 0.5, b: 1.0, c: 1.1}
    gpu = FakeGPU(monkeypatch, ms=lambda spec: full.get(spec.tile.label(), 3.0),
                  probe_ms=lambda spec: probe.get(spec.tile.label(), 3.0), wrong={wrong})
    result = tune(max_fraction=0.25, db=db)[0]
    assert result.winner.ranked.label == c and not result.winner.probe_only and result.winner.ms == 1.05
    assert (b, "full") in gpu.calls and (c, "full") in gpu.calls
    assert gpu.verified == [wrong, c]
    [entry] = db.entries()
    assert entry.tile == result.winner.ranked.spec.tile and entry.ms == 1.05


def test_a_sticky_cuda_error_stops_the_search_and_says_to_restart(monkeypatch, db):
    first, second = predicted_order()[:2]
    gpu = FakeGPU(monkeypatch, sticky={second})
    with pytest.raises(search.TuneError, match=rf"{second}: a sticky CUDA error while timing it: .*illegal memory "
                                               r"access.*must restart"):
        tune(max_fraction=1.0, db=db)
    assert gpu.timed == [first] and gpu.verified == [] and db.entries() == []


def test_budget_stops_the_search_but_one_config_is_always_timed(monkeypatch, db):
    clock = Clock()
    gpu = FakeGPU(monkeypatch, clock=clock, timer_s=10)  # every timing takes 10 s
    result = tune([SHAPE, Shape(2, 4096, 4096, 8)], deadline=5, max_fraction=1.0, db=db)
    assert [len(r.timings) for r in result] == [1, 1] and len(gpu.timed) == 2
    assert {r.stopped_by for r in result} == {"budget"} and len(db.entries()) == 2


def test_verification_counts_against_the_deadline(monkeypatch, db):
    clock = Clock()
    FakeGPU(monkeypatch, clock=clock, timer_s=1, verify_s=100)
    first, second = tune([SHAPE, Shape(2, 4096, 4096, 8)], deadline=40, max_fraction=1.0, db=db)
    assert first.stopped_by == "budget" and first.seconds >= 100  # its verification is part of its time
    assert len(second.timings) == 1  # the first shape's verification used up the rest


def test_pruned_to_nothing_is_an_error_that_says_why(monkeypatch, db):
    FakeGPU(monkeypatch, spills=lambda spec: 8)
    with pytest.raises(search.TuneError, match=r"every one of the \d+ tile configurations.*by spills"):
        tune(db=db)
    assert db.entries() == []


def test_everything_failing_is_an_error(monkeypatch, db):
    labels = {c.label for c in search.search_space(SPEC, "sm_90")}
    FakeGPU(monkeypatch, broken=labels)
    with pytest.raises(search.TuneError, match="failed: .*boom"):
        tune(max_fraction=0.1, db=db)


def test_a_narrowed_search_is_stored_only_when_asked(monkeypatch, db):
    gpu = FakeGPU(monkeypatch)
    with pytest.raises(search.TuneError, match=r"pins block_n=64, so only part of the tile space.*--store-narrowed"):
        search.tune(SPEC, [SHAPE], max_fraction=0.1, db=db)
    assert gpu.calls == [] and db.entries() == []
    untiled = search.untiled(SPEC)
    [result] = search.tune(untiled, [SHAPE], max_fraction=0.1, db=db)  # the whole space needs no flag
    assert db.entries()[0].tile == result.winner.ranked.spec.tile and result.launchable > 32


def test_a_result_the_database_does_not_take_is_an_error(monkeypatch, db):
    FakeGPU(monkeypatch)
    [result] = tune(max_fraction=0.1, db=db)
    newer = dataclasses.replace(result.entry, updated="2999-01-01T00:00:00+00:00", ms=9.0)
    assert db.put(newer) == 1
    with pytest.raises(search.TuneError, match=r"was not stored: the database holds a newer entry .*updated "
                                               r"2999-01-01T00:00:00\+00:00") as info:
        tune(max_fraction=0.1, db=db)
    assert f"updated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}" in str(info.value)
    assert db.entries() == [newer]


@pytest.mark.parametrize("kwargs, message", [
    ({"deadline": math.nan}, "deadline=nan"), ({"deadline": True}, "deadline=True"),
    ({"max_fraction": 0}, "max_fraction=0"), ({"max_fraction": 1.5}, "max_fraction=1.5"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tune(**kwargs)


def test_no_shapes_is_an_error():
    with pytest.raises(ValueError, match="shapes is empty"):
        tune([])


def test_verify_runs_the_fuzz_harness_on_a_padded_ragged_case(monkeypatch):
    import torch

    from attngen.fuzz import runners

    spec = search.search_space(AttentionSpec(head_dim=64, mask="causal"), "sm_90")[0].spec
    seen = []

    class Correct(runners.ReferenceRunner):
        def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
            seen.append((tuple(q.shape), out.is_contiguous(), bool(torch.isnan(out).all())))
            super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)

    class NeverWrites(runners.ReferenceRunner):
        def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
            pass

    class IllegalAddress(runners.ReferenceRunner):
        def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
            raise RuntimeError(ILLEGAL_ADDRESS)

    monkeypatch.setattr(runners, "KernelRunner", Correct)
    assert search.verify(spec) is None
    # One query head per kv head (gqa_ratio 1), a length no tile divides, strided views, outputs all NaN.
    assert seen == [((1, search.VERIFY_SEQLEN, search.VERIFY_KV_HEADS, 64), False, True)]
    monkeypatch.setattr(runners, "KernelRunner", NeverWrites)
    assert search.verify(spec).startswith("failed verification (output)")
    monkeypatch.setattr(runners, "KernelRunner", IllegalAddress)
    with pytest.raises(search.TuneError, match=rf"{spec.tile.label()}: a sticky CUDA error while verifying.*restart"):
        search.verify(spec)


def test_input_sets_need_a_matching_head_count():
    with pytest.raises(ValueError, match="heads_q=6 is invalid for gqa_ratio=4"):
        search.input_sets(SPEC.replace(gqa_ratio=4), Shape(1, 128, 128, 6))


def cli_tune(monkeypatch, tmp_path, specs, *args):
    import yaml
    from click.testing import CliRunner

    from attngen.cli import main
    from attngen.tune import commands

    monkeypatch.setattr(commands, "require_gpu", lambda: None)
    paths = []
    for i, spec in enumerate(specs):
        paths.append(tmp_path / f"spec{i}.yaml")
        paths[-1].write_text(yaml.safe_dump(spec.to_dict()))
    return CliRunner().invoke(main, ["tune", *map(str, paths), *map(str, args)])


def test_cli_tune_prints_progress_table_and_summary(monkeypatch, tmp_path):
    FakeGPU(monkeypatch)
    db = tmp_path / "t.sqlite3"
    result = cli_tune(monkeypatch, tmp_path, [SPEC], "--seqlen", "1024", "--seqlen", "4096", "--batch-heads", "16",
                      "--top", "3", "--db", db, "--export", tmp_path / "x.json", "--store-narrowed")
    assert result.exit_code == 0, result.output
    assert result.output.count("winner: m") == 2 and result.output.count("Spearman") == 2
    assert "timed 9 of 32 launchable configs (28%; stopped by max fraction)" in result.output
    assert "b1h16s1024" in result.output and "stored 2 tuned entries" in result.output
    assert "exported 2 entries" in result.output and len(TuningDB(db).entries()) == 2


def test_cli_budget_is_one_deadline_for_every_spec(monkeypatch, tmp_path):
    # 60 s for two specs of one shape each: the first spec's share is 30 s, and its verification
    # takes 50 s more, so nothing is left for the second spec: it times its first config only.
    clock = Clock()
    FakeGPU(monkeypatch, clock=clock, timer_s=1, verify_s=50)
    result = cli_tune(monkeypatch, tmp_path, [SPEC, SPEC.replace(mask="none")], "--seqlen", "1024", "--batch-heads",
                      "16", "--budget", "60", "--max-fraction", "1", "--db", tmp_path / "t.sqlite3",
                      "--store-narrowed")
    assert result.exit_code == 0, result.output
    coverage = [line for line in result.output.splitlines() if line.startswith("timed ")]
    assert len(coverage) == 2 and "stopped by budget" in coverage[0]
    assert coverage[1].startswith("timed 1 of ") and "stopped by budget" in coverage[1]


def test_cli_tune_fails_loudly_when_its_result_is_not_stored(monkeypatch, tmp_path):
    FakeGPU(monkeypatch)
    db = TuningDB(tmp_path / "t.sqlite3")
    [result] = tune(max_fraction=0.1, db=db)
    db.put(dataclasses.replace(result.entry, updated="2999-01-01T00:00:00+00:00"))
    result = cli_tune(monkeypatch, tmp_path, [SPEC], "--seqlen", "1024", "--batch-heads", "16", "--max-fraction",
                      "0.1", "--db", db.path, "--store-narrowed")
    assert result.exit_code == 1 and "was not stored" in result.output and "2999-01-01T00:00:00+00:00" in result.output
    assert "stored 1 tuned entries" not in result.output
