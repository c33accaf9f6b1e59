"""What the dispatcher asks the tuning database on every call: stamp() and tuned() (no GPU)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import sqlite3
import warnings

import pytest

from attngen import families, targets
from attngen.families.fwd_sm80.family import Sm80Forward
from attngen.spec import AttentionSpec
from attngen.tune import lookup
from attngen.tune.db import ENV_VAR, TuningDB, TuningEntry, TuningKey
from attngen.tune.model import Shape

GPU, NVRTC = "NVIDIA H100 80GB HBM3", "nvrtc-13.0"
# The targets of devices (what targets.device_target gives: the device's name and SM count).
H100 = dataclasses.replace(targets.target("sm_90"), sms=132, device_name=GPU)
A10 = dataclasses.replace(targets.target("sm_86"), sms=72, device_name="NVIDIA A10")
SPEC = AttentionSpec(head_dim=64, mask="causal")
SM80_FAMILY = families.get_family("fwd_sm80")


def cfg(block_m, block_n, num_warps, num_stages) -> dict:
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}


TUNED = cfg(64, 64, 4, 3)
OTHER = cfg(128, 64, 4, 2)


class OtherFamily(Sm80Forward):
    """A family added after a tune: fwd_sm80's kernel under another name, on sm_90 and newer only."""

    name = "fwd_other"

    def supports(self, problem, target):
        return None if target.cc >= 90 else f"needs sm_90 or newer, not {target.name}"


def store(db: TuningDB, spec=SPEC, shape=Shape(4, 2048, 2048, 32), config=TUNED, family="fwd_sm80",
          searched=("fwd_sm80",), target=H100, updated="2026-11-22T10:00:00+00:00") -> TuningEntry:
    entry = TuningEntry(TuningKey.for_shape(spec, shape, target.device_name, target.name, NVRTC), family, config,
                        searched, 1.0, 300.0, shape.label(), 30, 128, "0.2.0", updated)
    assert db.put(entry) == 1
    return entry


@pytest.fixture
def db(tmp_path, monkeypatch):
    """A fresh default database, fwd_sm80 the only family (tests add others), no GPU needed."""
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "tuning.sqlite3"))
    monkeypatch.setattr(lookup, "compiler_version", lambda: NVRTC)
    monkeypatch.setattr(lookup, "_warned", set())
    monkeypatch.setattr(families, "FAMILIES", {"fwd_sm80": SM80_FAMILY})
    lookup.clear_memo()
    yield TuningDB()
    lookup.clear_memo()


def call(spec, B=4, S=2048, H=32, Sk=None, target=H100):
    return lookup.tuned(spec, (B, S, H, spec.head_dim), (B, Sk or S, H, spec.head_dim), target)


def test_an_unpinned_spec_gets_the_tuned_family_and_config_of_its_bucket(db):
    store(db)
    assert call(SPEC) == ("fwd_sm80", TUNED)
    assert call(SPEC, S=1500) == ("fwd_sm80", TUNED)  # same seqlen bucket (2048)
    assert call(SPEC, B=2, H=64) == ("fwd_sm80", TUNED)  # same batch x heads
    assert call(SPEC, S=4096) is None  # another bucket: the defaults
    assert call(SPEC, B=8) is None
    assert call(SPEC.replace(mask="none")) is None
    assert call(SPEC.replace(arch="sm_80")) == ("fwd_sm80", TUNED)  # arch is for offline generation only


def test_entries_are_per_gpu_target_and_compiler(db, monkeypatch):
    store(db)
    assert call(SPEC, target=dataclasses.replace(H100, device_name="NVIDIA H200")) is None
    assert call(SPEC, target=A10) is None
    assert call(SPEC, target=targets.target("sm_90")) is None  # a table target is no GPU: nothing to look up
    monkeypatch.setattr(lookup, "compiler_version", lambda: "nvrtc-13.1")
    assert call(SPEC) is None


def test_a_spec_that_pins_a_family_reads_that_family_s_entry(db):
    pinned = SPEC.replace(family="fwd_sm80")
    assert call(pinned) is None
    store(db)  # the unpinned entry is not the pinned spec's
    assert call(pinned) is None and call(SPEC) == ("fwd_sm80", TUNED)
    store(db, spec=pinned, config=OTHER)
    assert call(pinned) == ("fwd_sm80", OTHER) and call(SPEC) == ("fwd_sm80", TUNED)


def test_an_explicit_config_always_wins(db, monkeypatch):
    store(db, spec=SPEC.replace(family="fwd_sm80"))
    monkeypatch.setattr(TuningDB, "get", lambda self, key: pytest.fail("looked up despite a config field"))
    for field, value in OTHER.items():
        assert call(SPEC.replace(family="fwd_sm80", config={field: value})) is None


def test_missing_database_means_defaults_and_creates_nothing(db):
    assert call(SPEC) is None
    assert not db.path.exists()


def test_lookups_are_memoized_per_bucket(db, monkeypatch):
    store(db)
    reads = []
    real_get = TuningDB.get
    monkeypatch.setattr(TuningDB, "get", lambda self, key: reads.append(key) or real_get(self, key))
    for _ in range(5):
        assert call(SPEC) == ("fwd_sm80", TUNED)
    call(SPEC, S=4096)
    call(SPEC, S=4000)
    assert len(reads) == 2
    lookup.clear_memo()
    call(SPEC)
    assert len(reads) == 3


def test_corrupt_database_warns_once_and_uses_defaults(db):
    db.path.write_bytes(b"garbage" * 1000)
    with pytest.warns(UserWarning, match="ignoring the tuning database") as record:
        assert call(SPEC) is None
        assert call(SPEC, S=4096) is None
    assert len(record) == 1 and str(db.path) in str(record[0].message)


def test_a_database_of_a_newer_schema_is_never_misread(db):
    store(db)
    with sqlite3.connect(db.path) as conn:
        conn.execute("PRAGMA user_version = 3")
    with pytest.warns(UserWarning, match="schema version 3, written by a newer attngen"):
        assert call(SPEC) is None


@pytest.mark.parametrize("edit, message", [
    # A config the family's own rules reject (m128 with one warp: 128 rows per warp).
    ("UPDATE tuned SET config = '{\"block_m\":128,\"block_n\":64,\"num_stages\":2,\"num_warps\":1}'",
     "block_m=128 is invalid with num_warps=1"),
    ("UPDATE tuned SET family = 'fwd_gone'", "family='fwd_gone' is invalid"),
    ("UPDATE tuned SET config = '{\"block_m\":64}'", "its config lacks block_n, num_warps, num_stages"),
])
def test_an_entry_today_s_families_reject_is_ignored_with_one_warning(db, edit, message):
    # Written behind the database's checks, as an older attngen or a hand edit could leave it.
    store(db)
    with sqlite3.connect(db.path) as conn:
        conn.execute(edit)
    with pytest.warns(UserWarning, match=message) as record:
        assert call(SPEC) is None
        assert call(SPEC.replace(mask="none")) is None  # nothing stored there: no second warning
    assert len(record) == 1


def test_an_entry_today_s_plan_rejects_is_ignored_with_a_warning(db):
    # d256 with m256n128s4 passes the family's rules but needs ~580 KB of shared memory.
    spec = AttentionSpec(head_dim=256)
    store(db, spec=spec, config=cfg(256, 128, 8, 4))  # the database checks the config, not the plan: GPUs differ
    with pytest.warns(UserWarning, match="shared memory"):
        assert call(spec, H=32) is None


def test_an_entry_that_predates_a_family_is_ignored_until_tuned_again(db, monkeypatch):
    store(db)  # searched: fwd_sm80 only
    store(db, spec=SPEC.replace(family="fwd_sm80"), config=OTHER)
    store(db, target=A10)
    monkeypatch.setattr(families, "FAMILIES", {"fwd_other": OtherFamily(), "fwd_sm80": SM80_FAMILY})
    with pytest.warns(UserWarning) as record:
        assert call(SPEC) is None  # fwd_other can run it on the H100 now, and was never timed against it
        store(db, shape=Shape(4, 4096, 4096, 32))
        assert call(SPEC, S=4096) is None  # a second such entry: warned once per database
    assert len(record) == 1
    message = str(record[0].message)
    assert str(db.path) in message and "covered fwd_sm80 but not fwd_other" in message
    assert "run `attngen tune`" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call(SPEC.replace(family="fwd_sm80")) == ("fwd_sm80", OTHER)  # a pinned family's entry still holds
        assert call(SPEC, target=A10) == ("fwd_sm80", TUNED)  # fwd_other cannot run on the A10: nothing is missing
        # A search that covered both families: its winner stands, whichever family it is.
        store(db, config=OTHER, searched=("fwd_other", "fwd_sm80"), updated="2026-11-23T10:00:00+00:00")
        assert call(SPEC) == ("fwd_sm80", OTHER)
        store(db, family="fwd_other", searched=("fwd_other", "fwd_sm80"), updated="2026-11-24T10:00:00+00:00")
        assert call(SPEC) == ("fwd_other", TUNED)


def _make_v1_db(path) -> None:
    """A database as attngen 0.1 wrote it (version 1): one H100 row (arch sm_90) and one A10 row."""
    columns = ("spec, gpu, arch, compiler, seqlen_bucket, batch_heads_bucket, block_m, block_n, num_warps, "
               "num_stages, ms, tflops, shape, timed, space, attngen_version, updated")
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE tuned ({columns}, PRIMARY KEY (spec, gpu, arch, compiler, seqlen_bucket, "
                     "batch_heads_bucket))")
        conn.execute("PRAGMA user_version = 1")
        for gpu, arch in ((GPU, "sm_90"), ("NVIDIA A10", "sm_86")):
            conn.execute(f"INSERT INTO tuned ({columns}) VALUES (?, ?, ?, ?, 2048, 128, 64, 64, 4, 3, 1.0, 300.0, "
                         "'b4h32s2048', 30, 128, '0.1.0', '2026-11-22T10:00:00+00:00')",
                         ('{"dtype":"bf16","gqa_ratio":1,"head_dim":64,"mask":"causal"}', gpu, arch, NVRTC))
    conn.close()


def test_a_version_1_database_is_read_through_the_migration(db, monkeypatch):
    _make_v1_db(db.path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call(SPEC) == ("fwd_sm80", TUNED)  # sm_90 in 0.1 is the sm_90a target
        assert call(SPEC, target=A10) == ("fwd_sm80", TUNED)
    # Version-1 entries covered fwd_sm80 alone: a newer family for the GPU makes them stale.
    monkeypatch.setattr(families, "FAMILIES", {"fwd_other": OtherFamily(), "fwd_sm80": SM80_FAMILY})
    lookup.clear_memo()  # the registry is fixed for a process's life; the memo rightly assumes so
    with pytest.warns(UserWarning, match="covered fwd_sm80 but not fwd_other"):
        assert call(SPEC) is None
    assert call(SPEC, target=A10) == ("fwd_sm80", TUNED)


def test_malformed_or_empty_inputs_skip_the_lookup(db):
    store(db)
    assert lookup.tuned(SPEC, (4, 2048, 32), (4, 2048, 32, 64), H100) is None
    assert lookup.tuned(SPEC, (0, 2048, 32, 64), (0, 2048, 32, 64), H100) is None
    assert lookup.tuned(SPEC, (4, 2048, 32, 64), (4, 0, 32, 64), H100) is None


def test_no_warning_for_a_healthy_database(db):
    store(db)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(SPEC)


def test_a_write_in_this_process_is_seen_at_once(db):
    entry = store(db)
    assert call(SPEC) == ("fwd_sm80", TUNED)
    TuningDB(db.path).put(dataclasses.replace(entry, config=OTHER, updated="2026-11-23T10:00:00+00:00"))
    assert call(SPEC) == ("fwd_sm80", OTHER)  # no clear_memo(): the write itself makes the answer stale


def test_an_import_in_this_process_is_seen_at_once(db, tmp_path):
    store(db)
    assert call(SPEC) == ("fwd_sm80", TUNED)
    other = TuningDB(tmp_path / "other.sqlite3")
    store(other, config=OTHER)  # as old as the entry it replaces: an import wins a tie
    other.export(tmp_path / "x.json")
    db.import_file(tmp_path / "x.json")
    assert call(SPEC) == ("fwd_sm80", OTHER)


def test_an_answer_read_before_a_write_is_not_memoized_after_it(db, monkeypatch):
    store(db)
    real_get = TuningDB.get

    def get_then_tune_writes(self, key):
        found = real_get(self, key)  # the reader has its (old) answer ...
        monkeypatch.setattr(TuningDB, "get", real_get)
        # ... when a tune in another thread writes and clears the memo, before the reader stores it.
        TuningDB(db.path).put(dataclasses.replace(found, config=OTHER, updated="2026-11-23T10:00:00+00:00"))
        lookup.clear_memo()
        return found

    monkeypatch.setattr(TuningDB, "get", get_then_tune_writes)
    assert call(SPEC) == ("fwd_sm80", TUNED)  # what it read
    assert call(SPEC) == ("fwd_sm80", OTHER)  # not the old answer, memoized after the clear


def _put_other_config(path: str) -> None:
    entry = TuningEntry(TuningKey.for_shape(SPEC, Shape(4, 2048, 2048, 32), GPU, "sm_90a", NVRTC), "fwd_sm80", OTHER,
                        ("fwd_sm80",), 1.0, 300.0, "b4h32s2048", 30, 128, "0.2.0", "2026-11-23T10:00:00+00:00")
    assert TuningDB(path).put(entry) == 1


def test_a_write_by_another_process_is_seen(db):
    store(db)
    assert call(SPEC) == ("fwd_sm80", TUNED)
    before = lookup.stamp()
    proc = mp.get_context("spawn").Process(target=_put_other_config, args=(str(db.path),))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 0
    assert lookup.stamp() != before  # the file changed, though this process wrote nothing
    assert call(SPEC) == ("fwd_sm80", OTHER)


def test_the_stamp_follows_writes_the_file_and_the_environment(db, tmp_path, monkeypatch):
    empty = lookup.stamp()
    assert lookup.stamp() == empty and empty[1:] == (None, None)  # no database: no file state
    store(db)
    written = lookup.stamp()
    assert written != empty and written[1] is not None
    assert lookup.stamp() == written  # nothing changed: the dispatcher's memo stays valid
    TuningDB(tmp_path / "elsewhere.sqlite3").put(dataclasses.replace(
        TuningDB(db.path).entries()[0], updated="2026-11-23T10:00:00+00:00"))
    assert lookup.stamp() != written  # any write by this process, to any database
    now = lookup.stamp()
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "elsewhere.sqlite3"))
    assert lookup.stamp() != now  # the path is read from the environment on every call
    hash(lookup.stamp())


def test_an_entry_tuned_before_a_config_field_was_added_keeps_its_kernel(db, monkeypatch):
    """fwd_sm90's `cluster` came after databases held fwd_sm90 entries: an entry without it still answers,
    as the kernel it timed (no clusters), instead of being ignored as another family's config."""
    import json

    from attngen.families.fwd_sm90.family import FAMILY as sm90

    monkeypatch.setattr(families, "FAMILIES", {"fwd_sm90": sm90, "fwd_sm80": SM80_FAMILY})
    spec = AttentionSpec(head_dim=128)
    old = {"block_n": 128, "consumers": 2, "num_stages": 2, "overlap": True, "pingpong": True, "schedule": "pairs"}
    store(db, spec=spec, config=old, family="fwd_sm90", searched=("fwd_sm80", "fwd_sm90"))
    with sqlite3.connect(db.path) as conn:  # as a database written before the field existed holds it
        conn.execute("UPDATE tuned SET config = ?", (json.dumps(old, sort_keys=True, separators=(",", ":")),))
    lookup.clear_memo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignoring entry" warning
        family, config = call(spec)
    assert family == "fwd_sm90" and config == {**old, "cluster": False}
