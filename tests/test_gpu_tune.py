"""`attngen tune` on a GPU (marker `gpu`): a tiny search into a temporary database, then
`attngen.attention` with an untiled spec runs the tuned kernel; an explicit tile still wins;
verification catches a deliberately broken kernel."""

from __future__ import annotations

import math
import time

import pytest
import yaml
from click.testing import CliRunner

import attngen
from attngen.cli import main
from attngen import reference, runtime, tolerance
from attngen.spec import AttentionSpec
from attngen.tile_defaults import default_tile
from attngen.tune.db import ENV_VAR, TuningDB
from attngen.tune.model import Shape

pytestmark = pytest.mark.gpu

SPEC = AttentionSpec(head_dim=64, dtype="bf16", mask="causal")
# Pinned fields narrow the space to 8 configs, none of them the default tile (block_n=128); its
# winner is stored for the untiled spec only because the tests ask for it (store_narrowed).
NARROW = SPEC.replace(block_n=64, num_stages=2)
SHAPE = Shape(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=8)


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
    """The resolved specs of the kernels compiled while fn() runs (the runtime's kernel memo)."""
    runtime._kernels.clear()
    fn()
    return [key[0] for key in runtime._kernels]


def test_search_times_the_space_and_stores_a_verified_winner(tuned):
    import torch

    assert len(tuned.timings) == 8 and tuned.stopped_by in ("survivors", "max fraction")
    assert tuned.winner.ok and tuned.winner.ms == min(t.ms for t in tuned.timings)
    entry = tuned.entry
    assert entry.tile == tuned.winner.ranked.spec.tile and entry.tile.block_n == 64
    assert entry.key.gpu == torch.cuda.get_device_name() and entry.key.seqlen_bucket == 1024
    assert TuningDB().get(entry.key) == entry
    assert math.isfinite(tuned.tflops(tuned.winner.ms))


def test_attention_runs_the_tuned_kernel_for_an_untiled_spec(tuned):
    q, k, v = inputs(1000)  # same buckets as the tuned shape: seqlen 1024, batch x heads 16
    out = []
    ran = kernels_run(lambda: out.append(attngen.attention(q, k, v, SPEC)))
    assert [s.tile for s in ran] == [tuned.entry.tile]
    assert tuned.entry.tile != default_tile(64, "sm_90")
    assert tolerance.check_output(out[0], reference.attention_for_spec(q, k, v, SPEC), q, k, v, "bf16",
                                  SPEC.effective_scale) is None


def test_explicit_tile_and_other_buckets_do_not_use_it(tuned):
    explicit = SPEC.replace(block_m=64, block_n=32, num_warps=4, num_stages=1)
    q, k, v = inputs(1000)
    assert [s.tile for s in kernels_run(lambda: attngen.attention(q, k, v, explicit))] == [explicit.tile]
    q, k, v = inputs(3000)  # seqlen bucket 4096: nothing tuned there
    ran = kernels_run(lambda: attngen.attention(q, k, v, SPEC))
    assert [s.tile for s in ran] == [SPEC.resolved(ran[0].arch).tile]


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
    assert "winner: m" in result.output and "Spearman" in result.output and "timed 4 of 8" in result.output
    assert len(TuningDB(db).entries()) == 1 and export.is_file()


def test_verify_passes_a_correct_kernel_and_catches_a_broken_one(monkeypatch):
    from attngen.fuzz import runners
    from attngen.tune.search import verify

    tiled = NARROW.replace(block_m=128, num_warps=4)
    assert verify(tiled) is None
    # The fault skips the last key block when it is partial: the verification length leaves one.
    real = runners.KernelRunner
    monkeypatch.setattr(runners, "KernelRunner", lambda: real(fault="drop_last_partial_kv_tile"))
    assert verify(tiled).startswith("failed verification (output)")
