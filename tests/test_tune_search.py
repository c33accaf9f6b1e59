"""The search's bookkeeping on CPU: the GPU pieces (build, launch, timing, reference check) are faked."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from attngen.nvcc import ResourceReport
from attngen.spec import AttentionSpec
from attngen.tune import lookup, ranking, search
from attngen.tune.db import TuningDB
from attngen.tune.model import Shape, gpu_model

SPEC = AttentionSpec(head_dim=64, mask="causal", block_n=64)  # 32 configs
SHAPE = Shape(2, 1024, 1024, 8)


class FakeGPU:
    """Stands in for torch.cuda, the builds, the kernels and the timer; records what ran."""

    def __init__(self, monkeypatch, *, ms=lambda spec: 1.0 + spec.block_m / 1000, broken=(), wrong=(),
                 spills=lambda spec: 0, clock=None):
        import torch

        self.timed, self.ms, self.wrong = [], ms, set(wrong)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr("attngen.nvcc.find_nvcc", lambda: "nvcc")
        monkeypatch.setattr(search, "device_gpu_model", lambda device: gpu_model("sm_90"))
        monkeypatch.setattr(lookup, "device_identity", lambda device: ("Fake H100", "sm_90"))
        monkeypatch.setattr(lookup, "compiler_version", lambda: "nvrtc-0.0")
        monkeypatch.setattr(ranking, "compile_reports", lambda cands, arch, jobs=None, on_done=None: [
            ResourceReport(c.label, arch, 128, 0, 0, spills(c.spec), spills(c.spec), c.plan.smem_bytes)
            if c.launchable else None for c in cands])
        monkeypatch.setattr(search, "process_pool", lambda jobs: ThreadPoolExecutor(2))
        monkeypatch.setattr(search, "_nvrtc_binary",
                            lambda spec, family, target: "CompileError: boom" if spec.tile.label() in broken else None)
        monkeypatch.setattr(search, "input_sets", lambda spec, shape: None)
        monkeypatch.setattr("attngen.compile", lambda spec: spec)  # the "kernel" is its spec
        monkeypatch.setattr(search, "measure", self._measure)
        monkeypatch.setattr(search, "verify",
                            lambda spec: "wrong output: x" if spec.tile.label() in self.wrong else None)
        if clock is not None:
            monkeypatch.setattr(search.time, "monotonic", clock)

    def _measure(self, fn, sets, best):
        spec = fn.__closure__[0].cell_contents  # the lambda's kernel
        self.timed.append(spec.tile.label())
        return self.ms(spec), False


@pytest.fixture
def db(tmp_path):
    lookup.clear_memo()
    return TuningDB(tmp_path / "t.sqlite3")


def test_times_the_best_predicted_first_up_to_the_fraction_and_stores_the_winner(monkeypatch, db):
    gpu = FakeGPU(monkeypatch)
    result = search.tune(SPEC, [SHAPE], max_fraction=0.25, db=db)[0]
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
    result = search.tune(SPEC, [SHAPE], max_fraction=1.0, db=db)[0]
    ordered = sorted(result.timings, key=lambda t: t.ms)
    fastest, second = ordered[0].ranked.label, ordered[1].ranked.label
    gpu = FakeGPU(monkeypatch, ms=lambda spec: float(spec.block_m), broken={fastest}, wrong={second})
    result = search.tune(SPEC, [SHAPE], max_fraction=1.0, db=db)[0]
    by_label = {t.ranked.label: t for t in result.timings}
    assert math.isinf(by_label[fastest].ms) and "boom" in by_label[fastest].error
    assert math.isinf(by_label[second].ms) and by_label[second].error.startswith("wrong output")
    assert result.winner.ranked.label not in (fastest, second) and result.winner.ok
    assert db.entries()[0].tile == result.winner.ranked.spec.tile
    assert len(gpu.timed) == len(result.timings) - 1  # the broken build was never launched


def test_budget_stops_the_search_but_one_config_is_always_timed(monkeypatch, db):
    ticks = iter(range(0, 10_000, 10))  # every clock read advances 10 s
    gpu = FakeGPU(monkeypatch, clock=lambda: next(ticks))
    result = search.tune(SPEC, [SHAPE, Shape(2, 4096, 4096, 8)], budget_s=5, max_fraction=1.0, db=db)
    assert [len(r.timings) for r in result] == [1, 1] and len(gpu.timed) == 2
    assert {r.stopped_by for r in result} == {"budget"} and len(db.entries()) == 2


def test_pruned_to_nothing_is_an_error_that_says_why(monkeypatch, db):
    FakeGPU(monkeypatch, spills=lambda spec: 8)
    with pytest.raises(search.TuneError, match=r"every one of the \d+ tile configurations.*by spills"):
        search.tune(SPEC, [SHAPE], db=db)
    assert db.entries() == []


def test_everything_failing_is_an_error(monkeypatch, db):
    labels = {c.label for c in search.search_space(SPEC, "sm_90")}
    FakeGPU(monkeypatch, broken=labels)
    with pytest.raises(search.TuneError, match="failed: .*boom"):
        search.tune(SPEC, [SHAPE], max_fraction=0.1, db=db)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget_s": 0}, "budget=0"), ({"budget_s": True}, "budget=True"),
    ({"max_fraction": 0}, "max_fraction=0"), ({"max_fraction": 1.5}, "max_fraction=1.5"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        search.tune(SPEC, [SHAPE], **kwargs)


def test_no_shapes_is_an_error():
    with pytest.raises(ValueError, match="shapes is empty"):
        search.tune(SPEC, [])


def test_input_sets_need_a_matching_head_count():
    with pytest.raises(ValueError, match="heads_q=6 is invalid for gqa_ratio=4"):
        search.input_sets(SPEC.replace(gqa_ratio=4), Shape(1, 128, 128, 6))


def test_cli_tune_prints_progress_table_and_summary(monkeypatch, tmp_path):
    import yaml
    from click.testing import CliRunner

    from attngen.cli import main
    from attngen.tune import commands

    FakeGPU(monkeypatch)
    monkeypatch.setattr(commands, "require_gpu", lambda: None)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC.to_dict()))
    db = tmp_path / "t.sqlite3"
    result = CliRunner().invoke(main, ["tune", str(spec), "--seqlen", "1024", "--seqlen", "4096", "--batch-heads",
                                       "16", "--top", "3", "--db", str(db), "--export", str(tmp_path / "x.json")])
    assert result.exit_code == 0, result.output
    assert result.output.count("winner: m") == 2 and result.output.count("Spearman") == 2
    assert "timed 9 of 32 launchable configs (28%; stopped by max fraction)" in result.output
    assert "b1h16s1024" in result.output and "stored 2 tuned entries" in result.output
    assert "exported 2 entries" in result.output and len(TuningDB(db).entries()) == 2
