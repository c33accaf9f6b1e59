"""The tuning database: keys, buckets, round trips, export/import, concurrent writers, schema
versions and the migration of attngen 0.1 (version 1) databases and exports (no GPU)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import sqlite3
import warnings
from dataclasses import replace

import pytest

from attngen.spec import AttentionSpec
from attngen.tune.db import (ENV_VAR, SCHEMA_VERSION, TuningDB, TuningDBError, TuningEntry, TuningKey, bucket,
                             default_db_path, read_export, spec_key)
from attngen.tune.model import Shape

SPEC = AttentionSpec(head_dim=128, mask="causal", gqa_ratio=4)
SHAPE = Shape(batch=2, seqlen_q=3000, seqlen_k=3000, heads_q=32)
GPU = "NVIDIA H100 80GB HBM3"


def cfg(block_m=128, block_n=64, num_warps=4, num_stages=2) -> dict:
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}


def make_entry(spec=SPEC, shape=SHAPE, config=None, updated="2026-11-22T10:00:00+00:00", gpu=GPU, ms=1.5,
               target="sm_90a", family="fwd_sm80", searched=("fwd_sm80",)) -> TuningEntry:
    key = TuningKey.for_shape(spec, shape, gpu, target, "nvrtc-13.0")
    return TuningEntry(key, family, config or cfg(), searched, ms=ms, tflops=300.0, shape=shape.label(), timed=30,
                       space=110, attngen_version="0.2.0", updated=updated)


def test_buckets_are_powers_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 1000, 1024, 1025, 16384)] == [1, 2, 4, 1024, 1024, 2048, 16384]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="bucket"):
            bucket(bad)


def test_key_is_the_problem_plus_a_pinned_family_and_buckets_the_shape():
    assert spec_key(SPEC) == SPEC.problem.key()
    assert json.loads(spec_key(SPEC)) == {"dtype": "bf16", "gqa_ratio": 4, "head_dim": 128, "mask": "causal"}
    assert spec_key(SPEC.replace(arch="sm_80")) == spec_key(SPEC)  # the target is a key field of its own
    pinned = SPEC.replace(family="fwd_sm80")
    assert json.loads(spec_key(pinned)) == {**json.loads(spec_key(SPEC)), "family": "fwd_sm80"}
    # Config fields are not part of the key: a partly configured spec stores under its family's key.
    assert spec_key(pinned.replace(config={"block_n": 64}, arch="sm_90")) == spec_key(pinned)
    assert spec_key(SPEC.replace(mask="none")) != spec_key(SPEC)
    assert spec_key(SPEC.replace(softmax_scale=0.125)) != spec_key(SPEC)
    key = TuningKey.for_shape(SPEC, Shape(2, 3000, 5000, 32), "gpu", "sm_90a", "nvrtc-13.0")
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
    assert db.get(make_entry(gpu="NVIDIA H200").key) is None
    assert db.get(make_entry(spec=SPEC.replace(family="fwd_sm80")).key) is None  # the pinned family's own key
    with sqlite3.connect(db.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        row = conn.execute("SELECT family, config, searched, target FROM tuned").fetchone()
    assert row == ("fwd_sm80", json.dumps(cfg(), sort_keys=True, separators=(",", ":")), '["fwd_sm80"]', "sm_90a")


def test_newer_result_replaces_older_never_the_reverse(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    old = make_entry(config=cfg(block_n=32), updated="2026-11-22T10:00:00+00:00")
    new = make_entry(config=cfg(block_n=64), updated="2026-11-23T10:00:00+00:00")
    db.put(old)
    db.put(new)
    assert db.get(old.key).config == new.config
    db.put(old)
    assert db.get(old.key).config == new.config and len(db.entries()) == 1


def test_put_says_whether_it_wrote_and_compares_times_not_text(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    assert db.put(make_entry(updated="2026-11-23T10:00:00+00:00")) == 1
    assert db.put(make_entry(config=cfg(64, 64, 4, 3), updated="2026-11-22T10:00:00+00:00")) == 0
    assert db.get(make_entry().key).config == cfg()
    # 2026-11-23T09:00:00-02:00 is 11:00 UTC: newer, though it sorts first as text.
    assert db.put(make_entry(config=cfg(64, 64, 4, 3), updated="2026-11-23T09:00:00-02:00")) == 1
    stored = db.get(make_entry().key)
    assert stored.config == cfg(64, 64, 4, 3) and stored.updated == "2026-11-23T11:00:00+00:00"


def test_a_stored_time_that_is_not_one_never_freezes_the_row(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    db.put(make_entry())
    with sqlite3.connect(db.path) as conn:  # as a hand edit could leave it
        conn.execute("UPDATE tuned SET updated = 'zzz'")
    assert db.put(make_entry(config=cfg(64, 64, 4, 3))) == 1
    assert db.get(make_entry().key).config == cfg(64, 64, 4, 3)


@pytest.mark.parametrize("field, value, allowed", [
    ("ms", math.nan, "a finite number > 0"), ("ms", 0.0, "a finite number > 0"),
    ("tflops", math.inf, "a finite number > 0"), ("updated", "2026-11-22T10:00:00", "UTC offset"),
    ("family", "fwd_sm99", ".*fwd_sm80"), ("searched", ("fwd_zz", "fwd_sm80"), "the sorted, distinct names"),
])
def test_put_checks_every_entry_and_writes_none_of_a_bad_batch(tmp_path, field, value, allowed):
    db = TuningDB(tmp_path / "t.sqlite3")
    good, bad = make_entry(shape=Shape(1, 1024, 1024, 16)), replace(make_entry(), **{field: value})
    shown = re.escape(repr(list(value) if isinstance(value, tuple) else value))
    with pytest.raises(TuningDBError, match=rf"entry 1: {field}={shown} is invalid; allowed: .*{allowed}"):
        db.put(good, bad)
    assert db.entries() == []


def test_put_checks_the_config_against_the_family(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    with pytest.raises(TuningDBError, match=r"entry 0: config.block_m=48 is invalid; allowed: \{16, 32"):
        db.put(make_entry(config=cfg(block_m=48)))
    with pytest.raises(TuningDBError, match=r"entry 0: config=.* missing: num_stages"):
        db.put(make_entry(config={k: v for k, v in cfg().items() if k != "num_stages"}))
    assert not db.path.exists()


def test_export_import_round_trip(tmp_path):
    src, dst = TuningDB(tmp_path / "a.sqlite3"), TuningDB(tmp_path / "b.sqlite3")
    entries = [make_entry(), make_entry(shape=Shape(1, 1024, 1024, 16), config=cfg(64, 64, 4, 3)),
               make_entry(spec=SPEC.replace(family="fwd_sm80"), target="sm_86", gpu="NVIDIA A10")]
    src.put(*entries)
    assert src.export(tmp_path / "x.json") == 3
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["version"] == 2 and doc["entries"][0]["config"] == entries[0].config
    assert doc["entries"][0]["searched"] == ["fwd_sm80"] and doc["entries"][0]["family"] == "fwd_sm80"
    assert dst.import_file(tmp_path / "x.json") == (3, 3)
    assert dst.entries() == src.entries() and sorted(map(repr, dst.entries())) == sorted(map(repr, entries))
    assert dst.import_file(tmp_path / "x.json") == (3, 3)  # the same time: the file's entry wins
    dst.put(make_entry(updated="2026-11-24T10:00:00+00:00"))
    assert dst.import_file(tmp_path / "x.json") == (3, 2)  # never over a newer row


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


def test_export_without_a_database_is_an_error_that_says_so(tmp_path):
    db = TuningDB(tmp_path / "never-written.sqlite3")
    with pytest.raises(TuningDBError, match=rf"tuning database {re.escape(str(db.path))} does not exist, so there "
                                            r"is nothing to export to .*x\.json; run `attngen tune SPEC` first"):
        db.export(tmp_path / "x.json")
    assert sorted(tmp_path.iterdir()) == []  # neither the export nor the database was made


@pytest.mark.parametrize("mutate, message", [
    (lambda doc: doc.update(format="other"), "not a tuning export"),
    (lambda doc: doc.update(version=0), "not a tuning export; expected .* version 1 or 2, got .*version=0"),
    (lambda doc: doc.update(entries={}), "'entries' must be a list"),
    (lambda doc: doc["entries"][0].pop("config"), "missing field 'config'"),
    (lambda doc: doc["entries"][0].pop("searched"), "missing field 'searched'"),
    (lambda doc: doc["entries"][0].update(config="m128n64w4s2"),
     "config='m128n64w4s2' is invalid; allowed: a mapping of the family's config fields"),
    (lambda doc: doc["entries"][0]["config"].update(block_m="big"), "config.block_m='big' is invalid"),
    (lambda doc: doc["entries"][0]["config"].update(block_m=48), r"config.block_m=48 is invalid; allowed: \{16"),
    (lambda doc: doc["entries"][0]["config"].update(num_warps=8, block_m=64),
     "config.block_m=64 is invalid with num_warps=8"),
    (lambda doc: doc["entries"][0]["config"].pop("num_stages"),
     "config=.* is invalid; allowed: every config field of family fwd_sm80 .*missing: num_stages"),
    (lambda doc: doc["entries"][0]["config"].update(sub_n=32), "config field 'sub_n' is not one of family fwd_sm80's"),
    (lambda doc: doc["entries"][0].update(family="fwd_sm99"), "family='fwd_sm99' is invalid; allowed: .*fwd_sm80"),
    (lambda doc: doc["entries"][0].update(searched="fwd_sm80"),
     "searched='fwd_sm80' is invalid; allowed: a list of family names"),
    (lambda doc: doc["entries"][0].update(searched=[]), r"searched=\[\] is invalid; allowed: the sorted, distinct"),
    (lambda doc: doc["entries"][0].update(searched=["fwd_sm80", "fwd_sm80"]), "searched=.* is invalid"),
    (lambda doc: doc["entries"][0].update(searched=["fwd_zz", "fwd_sm80"]), "searched=.* is invalid"),
    (lambda doc: doc["entries"][0].update(searched=["fwd_other"]), "searched=.* is invalid.*'fwd_sm80' among them"),
    (lambda doc: doc["entries"][0].update(spec=spec_key(SPEC.replace(family="fwd_sm80")),
                                          searched=["fwd_other", "fwd_sm80"]),
     r"searched=.* is invalid.*\['fwd_sm80'\] for a spec key that pins it"),
    (lambda doc: doc["entries"][0].update(spec='{"head_dim": 100}'), "head_dim=100"),
    (lambda doc: doc["entries"][0].update(spec='{"head_dim": 64}'), "a canonical spec key"),
    (lambda doc: doc["entries"][0].update(spec='{"config":{"block_m":64},"family":"fwd_sm80","head_dim":64}'),
     "a canonical spec key"),
    (lambda doc: doc["entries"][0].update(spec='{"arch":"sm_90a","dtype":"bf16","gqa_ratio":1,"head_dim":64,'
                                               '"mask":"none"}'), "a canonical spec key"),
    (lambda doc: doc["entries"][0].update(spec='{"block_m":64,"head_dim":64}'), "write `family: fwd_sm80`"),
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
    # sm_90 names an architecture, not the exact target (sm_90a) a kernel was built for: never guessed.
    (lambda doc: doc["entries"][0].update(target="sm_90"),
     "target='sm_90' is invalid; allowed: an exact compile target: one of sm_80, .*sm_90a"),
    (lambda doc: doc["entries"][0].update(target="sm90"), "target='sm90' is invalid"),
    (lambda doc: doc["entries"][0].update(target="gfx90a"), "target='gfx90a' is invalid"),
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
    whole_file = message.startswith(("not a tuning export", "'entries' must be a list"))
    assert str(info.value).startswith(f"{path}: " if whole_file else f"{path}: entry 0: ")
    assert not (tmp_path / "other.sqlite3").exists()  # all or nothing


def test_an_export_of_a_newer_version_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "attngen-tuning", "version": 3, "entries": []}))
    with pytest.raises(TuningDBError, match=rf"{re.escape(str(path))}: a tuning export of version 3, written by a "
                                            "newer attngen; this attngen reads versions 1 and 2"):
        read_export(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(TuningDBError, match="cannot read"):
        read_export(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TuningDBError, match="invalid JSON"):
        read_export(tmp_path / "bad.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TuningDBError, match="binary.json: not a tuning export"):
        read_export(tmp_path / "binary.json")
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"this is not a database" * 100)
    with pytest.raises(TuningDBError, match="corrupt.sqlite3"):
        TuningDB(corrupt).get(make_entry().key)
    with pytest.raises(TuningDBError, match="corrupt.sqlite3"):
        TuningDB(corrupt).put(make_entry())


def test_newer_schema_is_refused_for_reading_and_writing(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite3")
    db.put(make_entry())
    with sqlite3.connect(db.path) as conn:
        conn.execute("PRAGMA user_version = 99")
    before = db.path.read_bytes()
    message = rf"tuning database {re.escape(str(db.path))} has schema version 99, written by a newer attngen; " \
              "this attngen reads versions 1 and 2: upgrade attngen"
    for action in (db.entries, lambda: db.get(make_entry().key), lambda: db.put(make_entry(ms=2.0)),
                   lambda: db.export(tmp_path / "x.json")):
        with pytest.raises(TuningDBError, match=message):
            action()
    assert db.path.read_bytes() == before and not (tmp_path / "x.json").exists()


# -- version 1 (attngen 0.1) ----------------------------------------------------------------------
V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS tuned (
    spec TEXT NOT NULL, gpu TEXT NOT NULL, arch TEXT NOT NULL, compiler TEXT NOT NULL,
    seqlen_bucket INTEGER NOT NULL, batch_heads_bucket INTEGER NOT NULL,
    block_m INTEGER NOT NULL, block_n INTEGER NOT NULL, num_warps INTEGER NOT NULL, num_stages INTEGER NOT NULL,
    ms REAL NOT NULL, tflops REAL NOT NULL, shape TEXT NOT NULL, timed INTEGER NOT NULL, space INTEGER NOT NULL,
    attngen_version TEXT NOT NULL, updated TEXT NOT NULL,
    PRIMARY KEY (spec, gpu, arch, compiler, seqlen_bucket, batch_heads_bucket)
)
"""
V1_SPEC = '{"dtype":"bf16","gqa_ratio":4,"head_dim":128,"mask":"causal"}'  # attngen 0.1's untiled spec key


def v1_row(**changes) -> dict:
    row = {"spec": V1_SPEC, "gpu": GPU, "arch": "sm_90", "compiler": "nvrtc-13.0", "seqlen_bucket": 4096,
           "batch_heads_bucket": 64, "block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2, "ms": 1.5,
           "tflops": 300.0, "shape": "b2h32s3000", "timed": 30, "space": 110, "attngen_version": "0.1.0",
           "updated": "2026-11-22T10:00:00+00:00"}
    return {**row, **changes}


def make_v1_db(path, rows) -> None:
    """A database exactly as attngen 0.1 wrote it: its schema, WAL, user_version 1."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(V1_SCHEMA)
        conn.execute("PRAGMA user_version = 1")
        for row in rows:
            conn.execute(f"INSERT INTO tuned ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                         tuple(row.values()))
    conn.close()


V1_ROWS = [
    v1_row(),  # H100: becomes the sm_90a entry
    v1_row(gpu="NVIDIA A10", arch="sm_86", block_m=64, num_stages=3, seqlen_bucket=1024),
    # The same key after migration (sm_90 and sm_90a are one target): the newer row wins.
    v1_row(arch="sm_90a", block_n=32, updated="2026-11-21T10:00:00+00:00"),
    v1_row(arch="sm_70", seqlen_bucket=2048),  # no such target: dropped
    v1_row(block_m=48, seqlen_bucket=8192),  # a tile the family rejects: dropped
    v1_row(spec='{"head_dim":100}', seqlen_bucket=16384),  # not a spec: dropped
]


def expected_v1_entries() -> list[TuningEntry]:
    h100 = TuningEntry(TuningKey(V1_SPEC, GPU, "sm_90a", "nvrtc-13.0", 4096, 64), "fwd_sm80", cfg(), ["fwd_sm80"],
                       1.5, 300.0, "b2h32s3000", 30, 110, "0.1.0", "2026-11-22T10:00:00+00:00")
    a10 = replace(h100, key=replace(h100.key, gpu="NVIDIA A10", target="sm_86", seqlen_bucket=1024),
                  config=cfg(64, 64, 4, 3))
    return [a10, h100]


def test_a_version_1_database_is_read_as_version_2_without_changing_it(tmp_path):
    path = tmp_path / "v1.sqlite3"
    make_v1_db(path, V1_ROWS)
    before = path.read_bytes()
    db = TuningDB(path)
    with pytest.warns(UserWarning) as record:
        assert db.entries() == expected_v1_entries()
    dropped = [str(w.message) for w in record]
    assert len(dropped) == 3  # one warning per row that cannot be migrated, each naming it
    assert any("arch='sm_70'" in m and "seqlen_bucket=2048" in m for m in dropped)
    assert any("config.block_m=48 is invalid" in m and "seqlen_bucket=8192" in m for m in dropped)
    assert any("head_dim=100" in m and "seqlen_bucket=16384" in m for m in dropped)
    assert all(m.startswith(f"attngen: tuning database {path}: version-1 row (spec=") and "dropped" in m
               for m in dropped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not per read
        assert db.get(expected_v1_entries()[1].key) == expected_v1_entries()[1]
        assert db.get(make_entry(target="sm_90").key) is None
    assert path.read_bytes() == before
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 1


def test_a_version_1_database_is_migrated_on_the_first_write(tmp_path):
    path = tmp_path / "v1.sqlite3"
    make_v1_db(path, V1_ROWS)
    db = TuningDB(path)
    new = make_entry(shape=Shape(1, 16384, 16384, 16))
    with pytest.warns(UserWarning, match="version-1 row"):
        assert db.put(new) == 1
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        columns = [r[1] for r in conn.execute("PRAGMA table_info(tuned)")]
    assert tables == {"tuned"} and "family" in columns and "block_m" not in columns and "target" in columns
    assert db.entries() == sorted(expected_v1_entries() + [new], key=lambda e: (e.key.gpu, e.key.seqlen_bucket))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # migrated once: nothing left to warn about
        TuningDB(path).put(make_entry(ms=1.0, updated="2026-11-25T10:00:00+00:00"))
    assert TuningDB(path).get(make_entry().key).ms == 1.0


def _v1_migrating_writer(path: str, worker: int) -> None:
    warnings.simplefilter("ignore")
    db = TuningDB(path)
    for i in range(5):
        shape = Shape(batch=1, seqlen_q=2 ** (i + 1), seqlen_k=2 ** (i + 1), heads_q=2 ** (worker + 1))
        db.put(make_entry(shape=shape))


def test_concurrent_writers_migrate_a_version_1_database_once(tmp_path):
    path = tmp_path / "v1.sqlite3"
    make_v1_db(path, V1_ROWS)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_v1_migrating_writer, args=(str(path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 3
    entries = TuningDB(path).entries()
    assert len(entries) == 2 + 3 * 5 and all(e in entries for e in expected_v1_entries())


def test_a_version_1_export_is_migrated_on_import(tmp_path):
    path = tmp_path / "v1.json"
    rows = [v1_row(), v1_row(gpu="NVIDIA A10", arch="sm_86", block_m=64, num_stages=3, seqlen_bucket=1024)]
    path.write_text(json.dumps({"format": "attngen-tuning", "version": 1, "entries": rows}))
    db = TuningDB(tmp_path / "t.sqlite3")
    assert db.import_file(path) == (2, 2)
    assert db.entries() == expected_v1_entries()


@pytest.mark.parametrize("change, message", [
    ({"block_m": 48}, "config.block_m=48 is invalid"),
    ({"arch": "sm_70"}, "arch='sm_70' is invalid; allowed: sm_80"),
    ({"spec": '{"head_dim":100}'}, "spec=.* is invalid: head_dim=100"),
    ({"spec": '{"block_m":64,"head_dim":64}'}, "write `family: fwd_sm80`"),
    ({"ms": -1.0}, "ms=-1.0 is invalid"),
])
def test_a_bad_version_1_export_entry_refuses_the_file(tmp_path, change, message):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": "attngen-tuning", "version": 1, "entries": [v1_row(), v1_row(**change)]}))
    with pytest.raises(TuningDBError, match=message) as info:
        TuningDB(tmp_path / "t.sqlite3").import_file(path)
    assert str(info.value).startswith(f"{path}: entry 1 (version 1): ")
    assert not (tmp_path / "t.sqlite3").exists()


def test_a_version_1_export_entry_missing_a_tile_field_is_refused(tmp_path):
    path = tmp_path / "v1.json"
    row = v1_row()
    del row["block_n"]
    path.write_text(json.dumps({"format": "attngen-tuning", "version": 1, "entries": [row]}))
    with pytest.raises(TuningDBError, match=r"entry 0 \(version 1\): missing field 'block_n'"):
        read_export(path)


# -- concurrency ---------------------------------------------------------------------------------------
def _writer(path: str, worker: int, n: int) -> None:
    db = TuningDB(path)
    for i in range(n):
        # Distinct keys per worker, plus one key every worker fights over.
        shape = Shape(batch=1, seqlen_q=2 ** (i % 14 + 1), seqlen_k=2 ** (i % 14 + 1), heads_q=2 ** (worker + 1))
        db.put(make_entry(shape=shape, updated=f"2026-11-22T10:00:{i:02d}+00:00"))
        db.put(make_entry(config=cfg(64, 32, 4, 1 + worker % 4), updated=f"2026-11-22T10:00:{i:02d}+00:00"))


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
    assert shared.config["block_m"] == 64 and shared.updated.endswith(":13+00:00")


def _racing_creator(paths: list[str], start) -> None:
    failures = []
    for path in paths:
        start.wait(timeout=60)
        try:
            TuningDB(path).put(make_entry())
        except TuningDBError as exc:  # keep meeting the others at the barrier; fail at the end
            failures.append(str(exc))
    if failures:
        raise SystemExit("\n".join(failures))


def test_new_writers_racing_to_create_the_database(tmp_path):
    # Eight writers open each missing file at once, so they race for the switch to WAL mode, which
    # SQLite refuses at once (no busy handler) while another holds a lock. Before the retry, about
    # one file in four lost a writer to "database is locked".
    paths = [str(tmp_path / f"t{trial}.sqlite3") for trial in range(12)]
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(8)
    procs = [ctx.Process(target=_racing_creator, args=(paths, start)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 8
    assert all(TuningDB(path).entries() == [make_entry()] for path in paths)


def test_entry_record_round_trip_and_label():
    entry = make_entry()
    assert TuningEntry.from_record(entry.record()) == entry
    assert replace(entry, ms=2.0) != entry
    assert entry.label() == "fwd_sm80/m128n64w4s2"
    assert replace(entry, family="fwd_gone").label() == "fwd_gone/block_m=128,block_n=64,num_stages=2,num_warps=4"
