"""`attngen tune` on a GPU (marker `gpu`): tiny searches into temporary databases, then
`attngen.attention` runs the tuned kernel for a spec that leaves the config open; an explicit
config still wins; an unpinned spec's search covers every family that can run it on this GPU;
verification catches a deliberately broken kernel."""

from __future__ import annotations

import math
import time

import pytest
import yaml
from click.testing import CliRunner

import attngen
from attngen import families, reference, targets, tolerance
from attngen.cli import main
from attngen.runtime import dispatch
from attngen.spec import AttentionSpec
from attngen.tune.db import ENV_VAR, TuningDB
from attngen.tune.model import Shape

pytestmark = pytest.mark.gpu

SPEC = AttentionSpec(head_dim=64, dtype="bf16", mask="causal")
FAMILY_SPEC = SPEC.replace(family="fwd_sm80")
# Pinned config fields narrow fwd_sm80's space to 8 configs, none of them its default (block_n=128);
# the winner is stored for the family-pinned spec only because the tests ask for it (store_narrowed).
NARROW = FAMILY_SPEC.replace(config={"block_n": 64, "num_stages": 2})
SHAPE = Shape(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=8)


def device_target():
    import torch

    return targets.device_target(torch.cuda.current_device())


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    from attngen.tune.search import tune

    path = tmp_path_factory.mktemp("tune") / "tuning.sqlite3"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(path))
        result = tune(NARROW, [SHAPE], deadline=time.monotonic() + 120, max_fraction=1.0, db=TuningDB(path),
                      store_narrowed=True)[0]
        yield result


def inputs(S, B=2, H=8):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(S)
    return [torch.randn(B, S, H, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]


def kernels_run(fn) -> list:
    """The plans of the kernels resolved while fn() runs (the dispatcher's memos, emptied first)."""
    dispatch._kernels.clear()
    dispatch.forget()
    fn()
    return [kernel.plan for kernel in dispatch._kernels.values()]


def test_search_times_the_space_and_stores_a_verified_winner(tuned):
    import torch

    assert len(tuned.timings) == 8 and tuned.stopped_by in ("survivors", "max fraction")
    assert tuned.winner.ok and tuned.winner.ms == min(t.ms for t in tuned.timings)
    entry = tuned.entry
    assert (entry.family, entry.searched) == ("fwd_sm80", ("fwd_sm80",))
    assert entry.config == tuned.winner.candidate.config.to_dict() and entry.config["block_n"] == 64
    assert entry.key.gpu == torch.cuda.get_device_name() and entry.key.target == device_target().name
    assert entry.key.seqlen_bucket == 1024
    assert TuningDB().get(entry.key) == entry
    assert math.isfinite(tuned.tflops(tuned.winner.ms))


def test_attention_runs_the_tuned_kernel_for_a_spec_that_pins_only_the_family(tuned):
    q, k, v = inputs(1000)  # same buckets as the tuned shape: seqlen 1024, batch x heads 16
    out = []
    ran = kernels_run(lambda: out.append(attngen.attention(q, k, v, FAMILY_SPEC)))
    assert [(p.family, p.config.to_dict()) for p in ran] == [("fwd_sm80", dict(tuned.entry.config))]
    default = families.get_family("fwd_sm80").default_config(SPEC.problem, device_target())
    assert dict(tuned.entry.config) != default.to_dict()
    assert tolerance.check_output(out[0], reference.attention_for_spec(q, k, v, SPEC), q, k, v, "bf16",
                                  SPEC.effective_scale) is None


def test_explicit_config_other_buckets_and_unpinned_specs_do_not_use_it(tuned):
    explicit = FAMILY_SPEC.replace(config={"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 1})
    q, k, v = inputs(1000)
    assert [p.config.to_dict() for p in kernels_run(lambda: attngen.attention(q, k, v, explicit))] == \
        [dict(explicit.config)]
    # The unpinned spec reads the unpinned entry (none here): the preferred family's defaults for the
    # length bucket (fwd_sm90 has its own for calls of at most 1k tokens).
    assert [p.name for p in kernels_run(lambda: attngen.attention(q, k, v, SPEC))] == \
        [families.plan_spec(SPEC, device_target(), seqlen=1024).name]
    q, k, v = inputs(3000)  # seqlen bucket 4096: nothing tuned there
    assert [p.name for p in kernels_run(lambda: attngen.attention(q, k, v, FAMILY_SPEC))] == \
        [families.plan_spec(FAMILY_SPEC, device_target(), seqlen=4096).name]


def test_an_unpinned_search_covers_every_family_and_attention_runs_its_winner(tmp_path, monkeypatch):
    from attngen.tune.search import tune

    path = tmp_path / "tuning.sqlite3"
    monkeypatch.setenv(ENV_VAR, str(path))
    shape = Shape(batch=1, seqlen_q=512, seqlen_k=512, heads_q=8)
    [result] = tune(SPEC, [shape], deadline=time.monotonic() + 240, max_fraction=0.03, db=TuningDB(path))
    supporting = tuple(sorted(f.name for f in families.supporting(SPEC.problem, device_target())))
    assert result.searched == supporting == result.entry.searched
    assert {r.candidate.family for r in result.ranked} == set(supporting)
    q, k, v = inputs(500, B=1)
    ran = kernels_run(lambda: attngen.attention(q, k, v, SPEC))
    assert [(p.family, p.config.to_dict()) for p in ran] == [(result.entry.family, dict(result.entry.config))]


def test_cli_tune_prints_the_table_winner_and_correlation(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(NARROW.to_dict()))
    db, export = tmp_path / "t.sqlite3", tmp_path / "export.json"
    args = ["tune", str(spec), "--seqlen", "1024", "--batch-heads", "16", "--budget", "60", "--max-fraction", "0.5",
            "--db", str(db), "--export", str(export), "--top", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "--store-narrowed" in result.output and not db.exists()
    result = CliRunner().invoke(main, args + ["--store-narrowed"])
    assert result.exit_code == 0, result.output
    assert "winner: fwd_sm80/m" in result.output and "Spearman" in result.output and "timed 4 of 8" in result.output
    assert len(TuningDB(db).entries()) == 1 and export.is_file()


def test_verify_passes_a_correct_kernel_and_catches_a_broken_one(monkeypatch):
    from attngen.fuzz import runners
    from attngen.tune.search import verify
    from attngen.tune.space import search_space

    [candidate] = search_space(NARROW.replace(config={**NARROW.config, "block_m": 128, "num_warps": 4}),
                               device_target())
    assert verify(candidate) is None
    # The fault skips the last key block when it is partial: the verification length leaves one.
    real = runners.KernelRunner
    monkeypatch.setattr(runners, "KernelRunner", lambda: real(fault="drop_last_partial_kv_tile"))
    assert verify(candidate).startswith("failed verification (output)")
