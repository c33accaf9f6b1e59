"""The search's bookkeeping on CPU: the GPU pieces (build, launch, timing, reference check) are faked."""

from __future__ import annotations

import dataclasses
import datetime
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from attngen import families, targets
from attngen.build.nvcc import ResourceReport
from attngen.spec import AttentionSpec
from attngen.tune import lookup, ranking, search
from attngen.tune.db import TuningDB, spec_key
from attngen.tune.model import Shape, gpu_model
from attngen.tune.resources import prune
from attngen.tune.space import label

# 32 configs of fwd_sm80 (narrowed: stored only when asked).
SPEC = AttentionSpec(head_dim=64, mask="causal", family="fwd_sm80", config={"block_n": 64})
SHAPE = Shape(2, 1024, 1024, 8)
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"
# What targets.device_target says about the fake GPU.
TARGET = dataclasses.replace(targets.target("sm_90"), sms=132, device_name="Fake H100")
SM80_FAMILY = families.get_family("fwd_sm80")


pytestmark = pytest.mark.usefixtures("sm80_only")


def plan_label(plan) -> str:
    return label(plan.family, plan.config)


class FakeKernel:
    def __init__(self, gpu, plan):
        self.gpu, self.plan = gpu, plan

    def __call__(self, q, k, v):
        self.gpu.launched = self.plan


class FakeGPU:
    """Stands in for torch.cuda, the device's target, the builds, the kernels, the timer
    (attngen.bench.time_ms, so the search's own probe cutoff runs) and verification; records what
    ran. `ms(plan)` is a kernel's full time, `probe_ms(plan)` its probe's (default: the same);
    every timer call and every verification advances `clock` (when given: the search's
    time.monotonic) by its seconds. Candidates are named by their labels (fwd_sm80/m64n64w4s2)."""

    def __init__(self, monkeypatch, *, ms=lambda plan: 1.0 + plan.block_m / 1000, probe_ms=None, broken=(),
                 wrong=(), sticky=(), spills=lambda c: 0, clock=None, timer_s=0.0, verify_s=0.0):
        import torch

        self.ms, self.probe_ms, self.wrong, self.sticky = ms, probe_ms or ms, set(wrong), set(sticky)
        self.calls: list[tuple[str, str]] = []  # (label, "probe" or "full"), per timer call
        self.verified: list[str] = []
        self.built: list[str] = []
        self.clock, self.timer_s, self.verify_s = clock, timer_s, verify_s
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr("attngen.build.nvcc.find_nvcc", lambda: "nvcc")
        monkeypatch.setattr(targets, "device_target", lambda device: TARGET)
        monkeypatch.setattr(lookup, "compiler_version", lambda: "nvrtc-0.0")
        monkeypatch.setattr(ranking, "compile_reports",
                            lambda cands, jobs=None, on_done=None: fake_reports(cands, spills))
        monkeypatch.setattr(search, "process_pool", lambda jobs: ThreadPoolExecutor(2))

        def build(family, problem, target, config):
            assert target == TARGET  # built for the GPU at hand
            self.built.append(label(family, config))
            return "CompileError: boom" if label(family, config) in broken else None

        monkeypatch.setattr(search, "_nvrtc_binary", build)
        monkeypatch.setattr(search, "input_sets", lambda problem, shape: [(None, None, None)])
        monkeypatch.setattr("attngen.runtime.dispatch.kernel_for", self._kernel_for)
        monkeypatch.setattr("attngen.bench.time_ms", self._time_ms)
        monkeypatch.setattr(search, "verify", self._verify)
        if clock is not None:
            monkeypatch.setattr(search.time, "monotonic", clock)

    @property
    def timed(self) -> list[str]:
        """The configs launched, in order (every measurement starts with a probe)."""
        return [name for name, kind in self.calls if kind == "probe"]

    def _kernel_for(self, plan, device):
        assert device == 0 and plan.target == TARGET
        return FakeKernel(self, plan)

    def _advance(self, seconds: float) -> None:
        if seconds:
            self.clock.now += seconds

    def _time_ms(self, fn, input_sets, warmup=5, repeats=30):
        fn(*input_sets[0])
        plan = self.launched
        name = plan_label(plan)
        if name in self.sticky:
            raise RuntimeError(ILLEGAL_ADDRESS)
        probe = repeats == search.PROBE_REPEATS
        self.calls.append((name, "probe" if probe else "full"))
        self._advance(self.timer_s)
        return self.probe_ms(plan) if probe else self.ms(plan)

    def _verify(self, candidate):
        self.verified.append(candidate.label)
        self._advance(self.verify_s)
        return "failed verification (output): x" if candidate.label in self.wrong else None


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_reports(candidates, spills=lambda c: 0) -> list[ResourceReport | None]:
    return [ResourceReport(c.label, c.target.name, 128, 0, 0, spills(c), spills(c), c.plan.smem_bytes)
            if c.launchable else None for c in candidates]


def predicted_order(spec=SPEC, shape=SHAPE) -> list[str]:
    """The survivors' labels in the model's order, given FakeGPU's resource reports."""
    gpu, space = gpu_model(TARGET), search.search_space(spec, TARGET)
    pruned = [prune(c, r, gpu) for c, r in zip(space, fake_reports(space))]
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
    [stored] = db.entries()
    assert (stored.family, stored.config) == ("fwd_sm80", best.candidate.config.to_dict()) and stored.timed == 8
    assert stored.searched == ("fwd_sm80",) and stored.space == 32
    # Stored for the spec without its config fields: the problem and the family it pins.
    assert stored.key.spec == spec_key(AttentionSpec(head_dim=64, mask="causal", family="fwd_sm80"))
    assert (stored.key.gpu, stored.key.target, stored.key.compiler) == ("Fake H100", "sm_90a", "nvrtc-0.0")
    assert stored.key.seqlen_bucket == 1024 and stored.key.batch_heads_bucket == 16


def test_every_family_that_supports_the_problem_is_searched_and_recorded(monkeypatch, db, other_family):
    monkeypatch.setattr(families, "FAMILIES", {"fwd_other": other_family, "fwd_sm80": SM80_FAMILY})
    # fwd_other's kernels are a little faster: the winner is one of them.
    gpu = FakeGPU(monkeypatch, ms=lambda plan: (0.9 if plan.family == "fwd_other" else 1.0) + plan.block_m / 1000)
    spec = AttentionSpec(head_dim=64, mask="causal")
    [result] = search.tune(spec, [SHAPE], max_fraction=1.0, db=db)  # no config field pinned: no flag needed
    assert result.searched == ("fwd_other", "fwd_sm80")
    assert {t.candidate.family for t in result.timings} == {"fwd_other", "fwd_sm80"}
    assert {name.split("/")[0] for name in gpu.timed} == {"fwd_other", "fwd_sm80"}
    [stored] = db.entries()
    assert stored.family == "fwd_other" and stored.searched == ("fwd_other", "fwd_sm80")
    assert stored.key.spec == spec.problem.key() and stored.space == result.launchable
    # The dispatcher's question gets this answer back.
    assert lookup.tuned_for_shape(spec, SHAPE, TARGET, "nvrtc-0.0", db) == ("fwd_other", stored.config)


def test_failures_time_as_infinity_and_a_wrong_winner_is_replaced(monkeypatch, db):
    FakeGPU(monkeypatch, ms=lambda plan: float(plan.block_m))
    result = tune(max_fraction=1.0, db=db)[0]
    ordered = sorted(result.timings, key=lambda t: t.ms)
    fastest, second = ordered[0].ranked.label, ordered[1].ranked.label
    gpu = FakeGPU(monkeypatch, ms=lambda plan: float(plan.block_m), broken={fastest}, wrong={second})
    result = tune(max_fraction=1.0, db=db)[0]
    by_label = {t.ranked.label: t for t in result.timings}
    assert math.isinf(by_label[fastest].ms) and "boom" in by_label[fastest].error
    assert math.isinf(by_label[second].ms) and by_label[second].error.startswith("failed verification")
    assert result.winner.ranked.label not in (fastest, second) and result.winner.ok
    assert db.entries()[0].config == result.winner.candidate.config.to_dict()
    assert fastest not in gpu.timed and len(set(gpu.timed)) == len(result.timings) - 1  # the broken build never ran


def test_probe_cutoff_times_only_contenders_in_full(monkeypatch, db):
    first, *rest = predicted_order()[:8]
    gpu = FakeGPU(monkeypatch, ms=lambda plan: 1.0 if plan_label(plan) == first else 2.0,
                  probe_ms=lambda plan: 1.0 if plan_label(plan) in (first, rest[0]) else 1.6)
    result = tune(max_fraction=0.25, db=db)[0]
    assert gpu.calls[:2] == [(first, "probe"), (first, "full")]
    # A probe within PROBE_CUTOFF of the best goes on to a full timing; one beyond it stops there.
    assert (rest[0], "full") in gpu.calls and not any(kind == "full" for name, kind in gpu.calls if name in rest[1:])
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
    gpu = FakeGPU(monkeypatch, ms=lambda plan: full.get(plan_label(plan), 3.0),
                  probe_ms=lambda plan: probe.get(plan_label(plan), 3.0), wrong={wrong})
    result = tune(max_fraction=0.25, db=db)[0]
    assert result.winner.ranked.label == c and not result.winner.probe_only and result.winner.ms == 1.05
    assert (b, "full") in gpu.calls and (c, "full") in gpu.calls
    assert gpu.verified == [wrong, c]
    [entry] = db.entries()
    assert entry.label() == c and entry.ms == 1.05


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
    FakeGPU(monkeypatch, spills=lambda c: 8)
    with pytest.raises(search.TuneError, match=r"every one of the \d+ configurations.*by spills"):
        tune(db=db)
    assert db.entries() == []


def test_everything_failing_is_an_error(monkeypatch, db):
    labels = {c.label for c in search.search_space(SPEC, TARGET)}
    FakeGPU(monkeypatch, broken=labels)
    with pytest.raises(search.TuneError, match="failed: .*boom"):
        tune(max_fraction=0.1, db=db)


def test_a_narrowed_search_is_stored_only_when_asked(monkeypatch, db):
    gpu = FakeGPU(monkeypatch)
    with pytest.raises(search.TuneError, match=r"pins block_n=64, so only part of family fwd_sm80's configs.*"
                                               r"--store-narrowed"):
        search.tune(SPEC, [SHAPE], max_fraction=0.1, db=db)
    assert gpu.calls == [] and gpu.built == [] and db.entries() == []
    family_only = search.unconfigured(SPEC)
    [result] = search.tune(family_only, [SHAPE], max_fraction=0.1, db=db)  # the family's whole space needs no flag
    assert db.entries()[0].config == result.winner.candidate.config.to_dict() and result.launchable > 32


def test_a_result_the_database_does_not_take_is_an_error(monkeypatch, db):
    FakeGPU(monkeypatch)
    [result] = tune(max_fraction=0.1, db=db)
    newer = dataclasses.replace(result.entry, updated="2999-01-01T00:00:00+00:00", ms=9.0)
    assert db.put(newer) == 1
    with pytest.raises(search.TuneError, match=r"was not stored: the database holds a newer entry for its key "
                                               r"\(fwd_sm80/m.*, updated 2999-01-01T00:00:00\+00:00") as info:
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

    candidate = search.search_space(AttentionSpec(head_dim=64, mask="causal"), TARGET)[0]
    seen = []

    class Correct(runners.ReferenceRunner):
        def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
            seen.append((spec, tuple(q.shape), out.is_contiguous(), bool(torch.isnan(out).all())))
            super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)

    class NeverWrites(runners.ReferenceRunner):
        def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
            pass

    class IllegalAddress(runners.ReferenceRunner):
        def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
            raise RuntimeError(ILLEGAL_ADDRESS)

    monkeypatch.setattr(runners, "KernelRunner", Correct)
    assert search.verify(candidate) is None
    # The candidate's family and config pinned; one query head per kv head (gqa_ratio 1), a length no
    # tile divides, strided views, outputs all NaN.
    assert seen == [(candidate.spec, (1, search.VERIFY_SEQLEN, search.VERIFY_KV_HEADS, 64), False, True)]
    assert seen[0][0].family == "fwd_sm80" and seen[0][0].config == candidate.config.to_dict()
    monkeypatch.setattr(runners, "KernelRunner", NeverWrites)
    assert search.verify(candidate).startswith("failed verification (output)")
    monkeypatch.setattr(runners, "KernelRunner", IllegalAddress)
    with pytest.raises(search.TuneError, match=rf"{candidate.label}: a sticky CUDA error while verifying.*restart"):
        search.verify(candidate)


def test_input_sets_need_a_matching_head_count():
    with pytest.raises(ValueError, match="heads_q=6 is invalid for gqa_ratio=4"):
        search.input_sets(SPEC.replace(gqa_ratio=4).problem, Shape(1, 128, 128, 6))


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
    assert result.output.count("winner: fwd_sm80/m") == 2 and result.output.count("Spearman") == 2
    assert "timed 9 of 32 launchable configs (28%; stopped by max fraction)" in result.output
    assert "b1h16s1024" in result.output and "stored 2 tuned entries" in result.output
    assert "families searched: fwd_sm80" in result.output and "sm_90a" in result.output
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
