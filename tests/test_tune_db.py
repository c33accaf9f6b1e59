"""The tuning database: keys, buckets, round trips, export/import, concurrent writers (no GPU)."""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
from dataclasses import replace

import pytest

from attngen.spec import AttentionSpec, TileConfig
from attngen.tune.db import (ENV_VAR, TuningDB, TuningDBError, TuningEntry, TuningKey, bucket, default_db_path,
                             read_export, spec_key)
from attngen.tune.model import Shape

SPEC = AttentionSpec(head_dim=128, mask="causal", gqa_ratio=4)
SHAPE = Shape(batch=2, seqlen_q=3000, seqlen_k=3000, heads_q=32)


def make_entry(spec=SPEC, shape=SHAPE, tile=TileConfig(128, 64, 4, 2), updated="2026-11-22T10:00:00+00:00",
               gpu="NVIDIA H100 80GB HBM3", ms=1.5) -> TuningEntry:
    key = TuningKey.for_shape(spec, shape, gpu, "sm_90", "nvrtc-13.0")
    return TuningEntry(key, tile, ms=ms, tflops=300.0, shape=shape.label(), timed=30, space=110,
                       attngen_version="0.1.0", updated=updated)


def test_buckets_are_powers_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 1000, 1024, 1025, 16384)] == [1, 2, 4, 1024, 1024, 2048, 16384]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="bucket"):
            bucket(bad)


def test_key_drops_tile_fields_and_arch_and_buckets_the_shape():
    tiled = SPEC.replace(block_m=64, block_n=32, num_warps=4, num_stages=3, arch="sm_90")
    assert spec_key(tiled) == spec_key(SPEC)
    assert json.loads(spec_key(SPEC)) == {"dtype": "bf16", "gqa_ratio": 4, "head_dim": 128, "mask": "causal"}
    assert spec_key(SPEC.replace(mask="none")) != spec_key(SPEC)
    key = TuningKey.for_shape(SPEC, Shape(2, 3000, 5000, 32), "gpu", "sm_90", "nvrtc-13.0")
    assert (key.seqlen_bucket, key.batch_heads_bucket) == (8192, 64)  # max(Sq, Sk); batch * heads


def test_default_path_follows_env_and_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert default_db_path() == tmp_path / "cache" / "tuning.sqlite3"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "elsewhere.db"))
    assert default_db_path() == tmp_path / "elsewhere.db"
    assert TuningDB().path == tmp_path / "elsewhere.db"


def test_round_trip_and_missing_database(tmp_path):
    db = TuningDB(tmp_path / "sub" / "t.sqlite3")
    assert db.get(make_entry().key) is None and db.entries() == []
    assert not db.path.exists()  # reading never creates the file
    entry = make_entry()
    db.put(entry)
    assert db.get(entry.key) == entry
    assert db.entries() == [entry]
    other_gpu = make_entry(gpu="NVIDIA H200")
    assert db.get(other_gpu.key) is None
    with sqlite3.connect(db.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_newer_result_replaces_older_never_the_reverse(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    old = make_entry(tile=TileConfig(128, 32, 4, 2), updated="2026-11-22T10:00:00+00:00")
    new = make_entry(tile=TileConfig(128, 64, 4, 2), updated="2026-11-23T10:00:00+00:00")
    db.put(old)
    db.put(new)
    assert db.get(old.key).tile == new.tile
    db.put(old)
    assert db.get(old.key).tile == new.tile and len(db.entries()) == 1


def test_export_import_round_trip(tmp_path):
    src, dst = TuningDB(tmp_path / "a.sqlite3"), TuningDB(tmp_path / "b.sqlite3")
    entries = [make_entry(), make_entry(shape=Shape(1, 1024, 1024, 16), tile=TileConfig(64, 64, 4, 3))]
    src.put(*entries)
    assert src.export(tmp_path / "x.json") == 2
    assert dst.import_file(tmp_path / "x.json") == 2
    assert dst.entries() == src.entries()


@pytest.mark.parametrize("mutate, message", [
    (lambda doc: doc.update(format="other"), "not a tuning export"),
    (lambda doc: doc.update(entries={}), "'entries' must be a list"),
    (lambda doc: doc["entries"][0].pop("block_n"), "missing field 'block_n'"),
    (lambda doc: doc["entries"][0].update(block_m="big"), "block_m='big'"),
    (lambda doc: doc["entries"][0].update(block_m=48), "block_m=48 is invalid"),
    (lambda doc: doc["entries"][0].update(num_warps=8, block_m=64), "block_m"),
    (lambda doc: doc["entries"][0].update(spec='{"head_dim": 100}'), "head_dim=100"),
    (lambda doc: doc["entries"][0].update(spec='{"head_dim":64,"block_m":64}'), "not a canonical"),
])
def test_bad_import_names_file_entry_and_field(tmp_path, mutate, message):
    db = TuningDB(tmp_path / "t.sqlite3")
    db.put(make_entry())
    path = tmp_path / "x.json"
    db.export(path)
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(TuningDBError, match=message) as info:
        TuningDB(tmp_path / "other.sqlite3").import_file(path)
    assert str(path) in str(info.value)
    assert not (tmp_path / "other.sqlite3").exists()  # all or nothing


def test_unreadable_files(tmp_path):
    with pytest.raises(TuningDBError, match="cannot read"):
        read_export(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TuningDBError, match="invalid JSON"):
        read_export(tmp_path / "bad.json")
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"this is not a database" * 100)
    with pytest.raises(TuningDBError, match="corrupt.sqlite3"):
        TuningDB(corrupt).get(make_entry().key)
    with pytest.raises(TuningDBError, match="corrupt.sqlite3"):
        TuningDB(corrupt).put(make_entry())


def test_newer_schema_is_refused(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    db.put(make_entry())
    with sqlite3.connect(db.path) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(TuningDBError, match="schema version 99"):
        db.entries()


def _writer(path: str, worker: int, n: int) -> None:
    db = TuningDB(path)
    for i in range(n):
        # Distinct keys per worker, plus one key every worker fights over.
        shape = Shape(batch=1, seqlen_q=2 ** (i % 14 + 1), seqlen_k=2 ** (i % 14 + 1), heads_q=2 ** (worker + 1))
        db.put(make_entry(shape=shape, updated=f"2026-11-22T10:00:{i:02d}+00:00"))
        db.put(make_entry(tile=TileConfig(64, 32, 4, 1 + worker % 4), updated=f"2026-11-22T10:00:{i:02d}+00:00"))


def test_concurrent_writers(tmp_path):
    path = str(tmp_path / "t.sqlite3")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 14)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 4
    entries = TuningDB(path).entries()
    assert len(entries) == 4 * 14 + 1  # every distinct key once, the shared key once
    shared = TuningDB(path).get(make_entry().key)
    assert shared.tile.block_m == 64 and shared.updated.endswith(":13+00:00")


def test_entry_row_round_trip():
    entry = make_entry()
    assert TuningEntry.from_row(entry.row()) == entry
    assert replace(entry, ms=2.0) != entry
