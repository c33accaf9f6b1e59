"""Which tile `attngen.attention` runs for an untiled spec: the tuned one of the call's bucket (no GPU)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import warnings

import pytest

from attngen.spec import AttentionSpec, TileConfig
from attngen.tune import lookup
from attngen.tune.db import ENV_VAR, TuningDB, TuningEntry, TuningKey
from attngen.tune.model import Shape

GPU, ARCH, NVRTC = "NVIDIA H100 80GB HBM3", "sm_90", "nvrtc-13.0"
SPEC = AttentionSpec(head_dim=64, mask="causal")
TUNED = TileConfig(64, 64, 4, 3)
OTHER = TileConfig(128, 64, 4, 2)


def store(db: TuningDB, spec=SPEC, shape=Shape(4, 2048, 2048, 32), tile=TUNED) -> TuningEntry:
    entry = TuningEntry(TuningKey.for_shape(spec, shape, GPU, ARCH, NVRTC), tile, 1.0, 300.0, shape.label(), 30, 128,
                        "0.1.0", "2026-11-22T10:00:00+00:00")
    db.put(entry)
    return entry


@pytest.fixture
def db(tmp_path, monkeypatch):
    """A fresh default database on a fake CUDA device 0 (no GPU needed)."""
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "tuning.sqlite3"))
    monkeypatch.setattr(lookup, "device_identity", lambda device: (GPU, ARCH))
    monkeypatch.setattr(lookup, "compiler_version", lambda: NVRTC)
    monkeypatch.setattr(lookup, "_warned", set())
    lookup.clear_memo()
    yield TuningDB()
    lookup.clear_memo()


def call(spec, B=4, S=2048, H=32, Sk=None):
    return lookup.tuned_spec(spec, (B, S, H, spec.head_dim), (B, Sk or S, H, spec.head_dim), 0)


def test_untiled_spec_gets_the_tuned_tile_of_its_bucket(db):
    store(db)
    got = call(SPEC)
    assert got.tile == TUNED and got.replace(**dict.fromkeys(("block_m", "block_n", "num_warps", "num_stages"))) == SPEC
    assert call(SPEC, S=1500).tile == TUNED  # same seqlen bucket (2048)
    assert call(SPEC, B=2, H=64).tile == TUNED  # same batch x heads
    assert call(SPEC, S=4096) is SPEC  # another bucket: the defaults
    assert call(SPEC, B=8) is SPEC
    assert call(SPEC.replace(mask="none")) == SPEC.replace(mask="none")


def test_explicit_tile_always_wins(db, monkeypatch):
    store(db)
    monkeypatch.setattr(lookup, "device_identity", lambda device: pytest.fail("looked up despite a tile field"))
    for field, value in (("block_m", 128), ("block_n", 32), ("num_warps", 8), ("num_stages", 1)):
        spec = SPEC.replace(**{field: value})
        assert call(spec) is spec


def test_missing_database_means_defaults_and_creates_nothing(db):
    assert call(SPEC) is SPEC
    assert not db.path.exists()


def test_lookups_are_memoized_per_bucket(db, monkeypatch):
    store(db)
    reads = []
    real_get = TuningDB.get
    monkeypatch.setattr(TuningDB, "get", lambda self, key: reads.append(key) or real_get(self, key))
    for _ in range(5):
        assert call(SPEC).tile == TUNED
    call(SPEC, S=4096)
    call(SPEC, S=4000)
    assert len(reads) == 2
    lookup.clear_memo()
    call(SPEC)
    assert len(reads) == 3


def test_corrupt_database_warns_once_and_uses_defaults(db):
    db.path.write_bytes(b"garbage" * 1000)
    with pytest.warns(UserWarning, match="ignoring the tuning database") as record:
        assert call(SPEC) is SPEC
        assert call(SPEC, S=4096) is SPEC
    assert len(record) == 1 and str(db.path) in str(record[0].message)


def test_entry_the_spec_rejects_is_ignored_with_a_warning(db):
    # A tile the spec's own rules reject (m128 with one warp: 128 rows per warp), written behind
    # the database's checks, as an older attngen or a hand edit could leave it.
    import sqlite3

    store(db)
    with sqlite3.connect(db.path) as conn:
        conn.execute("UPDATE tuned SET num_warps = 1, block_m = 128")
    with pytest.warns(UserWarning, match="block_m=128"):
        assert call(SPEC) is SPEC


def test_malformed_or_empty_inputs_skip_the_lookup(db):
    store(db)
    assert lookup.tuned_spec(SPEC, (4, 2048, 32), (4, 2048, 32, 64), 0) is SPEC
    assert lookup.tuned_spec(SPEC, (0, 2048, 32, 64), (0, 2048, 32, 64), 0) is SPEC
    assert lookup.tuned_spec(SPEC, (4, 2048, 32, 64), (4, 0, 32, 64), 0) is SPEC


def test_no_warning_for_a_healthy_database(db):
    store(db)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(SPEC)


def test_entry_today_s_plan_rejects_is_ignored_with_a_warning(db):
    # d256 with m256n128s4 passes the spec's rules but needs ~580 KB of shared memory.
    spec = AttentionSpec(head_dim=256)
    store(db, spec=spec, tile=TileConfig(256, 128, 8, 4))
    with pytest.warns(UserWarning, match="shared memory"):
        assert call(spec, H=32) is spec


def test_a_write_in_this_process_is_seen_at_once(db):
    entry = store(db)
    assert call(SPEC).tile == TUNED
    TuningDB(db.path).put(dataclasses.replace(entry, tile=OTHER, updated="2026-11-23T10:00:00+00:00"))
    assert call(SPEC).tile == OTHER  # no clear_memo(): the write itself makes the answer stale


def test_an_import_in_this_process_is_seen_at_once(db, tmp_path):
    store(db)
    assert call(SPEC).tile == TUNED
    other = TuningDB(tmp_path / "other.sqlite3")
    store(other, tile=OTHER)  # as old as the entry it replaces: an import wins a tie
    other.export(tmp_path / "x.json")
    db.import_file(tmp_path / "x.json")
    assert call(SPEC).tile == OTHER


def test_an_answer_read_before_a_write_is_not_memoized_after_it(db, monkeypatch):
    store(db)
    real_get = TuningDB.get

    def get_then_tune_writes(self, key):
        found = real_get(self, key)  # the reader has its (old) answer ...
        monkeypatch.setattr(TuningDB, "get", real_get)
        # ... when a tune in another thread writes and clears the memo, before the reader stores it.
        TuningDB(db.path).put(dataclasses.replace(found, tile=OTHER, updated="2026-11-23T10:00:00+00:00"))
        lookup.clear_memo()
        return found

    monkeypatch.setattr(TuningDB, "get", get_then_tune_writes)
    assert call(SPEC).tile == TUNED  # what it read
    assert call(SPEC).tile == OTHER  # not the old answer, memoized after the clear


def _put_other_tile(path: str) -> None:
    entry = TuningEntry(TuningKey.for_shape(SPEC, Shape(4, 2048, 2048, 32), GPU, ARCH, NVRTC), OTHER, 1.0, 300.0,
                        "b4h32s2048", 30, 128, "0.1.0", "2026-11-23T10:00:00+00:00")
    assert TuningDB(path).put(entry) == 1


def test_a_write_by_another_process_is_seen(db):
    store(db)
    assert call(SPEC).tile == TUNED
    proc = mp.get_context("spawn").Process(target=_put_other_tile, args=(str(db.path),))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 0
    assert call(SPEC).tile == OTHER
