"""The tuning database: keys, buckets, round trips, export/import, concurrent writers (no GPU)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
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


def test_put_says_whether_it_wrote_and_compares_times_not_text(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    assert db.put(make_entry(updated="2026-11-23T10:00:00+00:00")) == 1
    assert db.put(make_entry(tile=TileConfig(64, 64, 4, 3), updated="2026-11-22T10:00:00+00:00")) == 0
    assert db.get(make_entry().key).tile == TileConfig(128, 64, 4, 2)
    # 2026-11-23T09:00:00-02:00 is 11:00 UTC: newer, though it sorts first as text.
    assert db.put(make_entry(tile=TileConfig(64, 64, 4, 3), updated="2026-11-23T09:00:00-02:00")) == 1
    stored = db.get(make_entry().key)
    assert stored.tile == TileConfig(64, 64, 4, 3) and stored.updated == "2026-11-23T11:00:00+00:00"


def test_a_stored_time_that_is_not_one_never_freezes_the_row(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    db.put(make_entry())
    with sqlite3.connect(db.path) as conn:  # as an unchecked import could leave it
        conn.execute("UPDATE tuned SET updated = 'zzz'")
    assert db.put(make_entry(tile=TileConfig(64, 64, 4, 3))) == 1
    assert db.get(make_entry().key).tile == TileConfig(64, 64, 4, 3)


@pytest.mark.parametrize("field, value, allowed", [
    ("ms", math.nan, "a finite number > 0"), ("ms", 0.0, "a finite number > 0"),
    ("tflops", math.inf, "a finite number > 0"), ("updated", "2026-11-22T10:00:00", "UTC offset"),
])
def test_put_checks_every_entry_and_writes_none_of_a_bad_batch(tmp_path, field, value, allowed):
    db = TuningDB(tmp_path / "t.sqlite3")
    good, bad = make_entry(shape=Shape(1, 1024, 1024, 16)), replace(make_entry(), **{field: value})
    message = rf"entry 1: {field}={re.escape(repr(value))} is invalid; allowed: .*{allowed}"
    with pytest.raises(TuningDBError, match=message):
        db.put(good, bad)
    assert db.entries() == []


def test_export_import_round_trip(tmp_path):
    src, dst = TuningDB(tmp_path / "a.sqlite3"), TuningDB(tmp_path / "b.sqlite3")
    entries = [make_entry(), make_entry(shape=Shape(1, 1024, 1024, 16), tile=TileConfig(64, 64, 4, 3))]
    src.put(*entries)
    assert src.export(tmp_path / "x.json") == 2
    assert dst.import_file(tmp_path / "x.json") == (2, 2)
    assert dst.entries() == src.entries()
    assert dst.import_file(tmp_path / "x.json") == (2, 2)  # the same time: the file's entry wins
    dst.put(make_entry(updated="2026-11-24T10:00:00+00:00"))
    assert dst.import_file(tmp_path / "x.json") == (2, 1)  # never over a newer row


def test_import_normalizes_times_to_utc(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    db.put(make_entry())
    path = tmp_path / "x.json"
    db.export(path)
    doc = json.loads(path.read_text())
    doc["entries"][0]["updated"] = "2026-11-22T12:30:00.250+02:00"
    path.write_text(json.dumps(doc))
    other = TuningDB(tmp_path / "other.sqlite3")
    other.import_file(path)
    assert other.entries()[0].updated == "2026-11-22T10:30:00.250000+00:00"


def test_export_is_atomic_and_names_the_file(tmp_path, monkeypatch):
    db = TuningDB(tmp_path / "t.sqlite3")
    db.put(make_entry())
    path = tmp_path / "x.json"
    path.write_text("the previous export\n")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(TuningDBError, match=f"{re.escape(str(path))}: cannot write the tuning export"):
        db.export(path)
    assert path.read_text() == "the previous export\n" and sorted(tmp_path.iterdir()) == [db.path, path]
    with pytest.raises(TuningDBError, match="missing"):
        db.export(tmp_path / "missing" / "x.json")


@pytest.mark.parametrize("mutate, message", [
    (lambda doc: doc.update(format="other"), "not a tuning export"),
    (lambda doc: doc.update(entries={}), "'entries' must be a list"),
    (lambda doc: doc["entries"][0].pop("block_n"), "missing field 'block_n'"),
    (lambda doc: doc["entries"][0].update(block_m="big"), "block_m='big'"),
    (lambda doc: doc["entries"][0].update(block_m=48), "block_m=48 is invalid"),
    (lambda doc: doc["entries"][0].update(num_warps=8, block_m=64), "block_m"),
    (lambda doc: doc["entries"][0].update(spec='{"head_dim": 100}'), "head_dim=100"),
    (lambda doc: doc["entries"][0].update(spec='{"head_dim":64,"block_m":64}'), "a canonical untiled spec key"),
    (lambda doc: doc["entries"][0].update(spec="{"), r"spec='\{' is invalid"),
    (lambda doc: doc["entries"][0].update(updated="zzz"), "updated='zzz' is invalid; allowed: an ISO 8601 date"),
    (lambda doc: doc["entries"][0].update(updated="2026-11-22T10:00:00"), "updated=.* with a UTC offset"),
    (lambda doc: doc["entries"][0].update(seqlen_bucket=1000),
     "seqlen_bucket=1000 is invalid; allowed: a power of two"),
    (lambda doc: doc["entries"][0].update(batch_heads_bucket=-4), "batch_heads_bucket=-4 is invalid"),
    (lambda doc: doc["entries"][0].update(ms=-1.0), "ms=-1.0 is invalid; allowed: a finite number > 0"),
    (lambda doc: doc["entries"][0].update(ms=math.nan), "ms=nan is invalid; allowed: a finite number > 0"),
    (lambda doc: doc["entries"][0].update(tflops=math.inf), "tflops=inf is invalid"),
    (lambda doc: doc["entries"][0].update(timed=0), "timed=0 is invalid; allowed: an integer from 1 to space=110"),
    (lambda doc: doc["entries"][0].update(timed=111), "timed=111 is invalid"),
    (lambda doc: doc["entries"][0].update(space=0), "space=0 is invalid"),
    (lambda doc: doc["entries"][0].update(arch="sm90"), "arch='sm90' is invalid; allowed: a compile target"),
    (lambda doc: doc["entries"][0].update(arch="gfx90a"), "arch='gfx90a' is invalid"),
    (lambda doc: doc["entries"][0].update(gpu=""), "gpu='' is invalid; allowed: a non-empty string"),
    (lambda doc: doc["entries"][0].update(compiler=" "), "compiler=' ' is invalid"),
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
    whole_file = message in ("not a tuning export", "'entries' must be a list")
    assert str(info.value).startswith(f"{path}: " if whole_file else f"{path}: entry 0: ")
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
