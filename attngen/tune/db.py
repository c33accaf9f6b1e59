"""The tuning database: SQLite (embedded, no server), safe under concurrent writers.

One row per (spec key, GPU name, compile target, compiler version, sequence-length bucket,
batch x heads bucket) holds the winning kernel family and its config, the families the search
covered (`searched`) and how the winner was found. The spec key is the spec's problem plus the
family it pins, if any (spec_key()): a spec that pins config fields reads no entry. WAL
journaling lets readers run beside a writer; a busy timeout makes concurrent writers wait their
turn instead of failing; upserts make a re-tune replace the old row, unless the row there is
newer (`updated`, compared as a time, not as text). Every entry is checked before it is
written, whether it comes from the tuner or from an export file.

Schema versions (SQLite's user_version): 2 is this one. A version-1 database (attngen 0.1:
one fixed tile, block_m..num_stages, under the arch "sm_90") is read as version 2, and migrated
in place on the first write: each row becomes family fwd_sm80 (the only kernel 0.1 had) with
its tile as the config, searched ["fwd_sm80"], its arch as the exact compile target (sm_90 ->
sm_90a); a row that cannot be migrated is dropped with a warning naming it. A database of a
newer version is refused, never misread. Export files carry the same version; a version-1
export is migrated the same way on import, except that a bad entry refuses the whole file.

The default file is <attngen cache dir>/tuning.sqlite3 (the compile cache's root,
attngen/build/compiler.py); $ATTNGEN_TUNING_DB or an explicit path overrides it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import sqlite3
import threading
import time
import warnings
from contextlib import closing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from attngen import targets
from attngen.families import get_family
from attngen.spec import AttentionSpec, ConfigMap
from attngen.tune.model import Shape

ENV_VAR = "ATTNGEN_TUNING_DB"
DB_FILE = "tuning.sqlite3"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
EXPORT_FORMAT = "attngen-tuning"
BUSY_TIMEOUT_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tuned (
    spec TEXT NOT NULL,
    gpu TEXT NOT NULL,
    target TEXT NOT NULL,
    compiler TEXT NOT NULL,
    seqlen_bucket INTEGER NOT NULL,
    batch_heads_bucket INTEGER NOT NULL,
    family TEXT NOT NULL,
    config TEXT NOT NULL,
    searched TEXT NOT NULL,
    ms REAL NOT NULL,
    tflops REAL NOT NULL,
    shape TEXT NOT NULL,
    timed INTEGER NOT NULL,
    space INTEGER NOT NULL,
    attngen_version TEXT NOT NULL,
    updated TEXT NOT NULL,
    PRIMARY KEY (spec, gpu, target, compiler, seqlen_bucket, batch_heads_bucket)
)
"""
# Version 1 (attngen 0.1): the same, with `arch` for `target` and the tile for family/config/searched.
V1_TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
V1_COLUMNS = ("spec", "gpu", "arch", "compiler", "seqlen_bucket", "batch_heads_bucket", *V1_TILE_FIELDS, "ms",
              "tflops", "shape", "timed", "space", "attngen_version", "updated")
V1_FAMILY = "fwd_sm80"  # the one kernel attngen 0.1 had, ported unchanged


class TuningDBError(ValueError):
    """The tuning database (or an export file) cannot be read or written; names the file."""


# Writes through any TuningDB in this process (attngen.tune.lookup reads it to know its memo is stale).
_generation = 0
_generation_lock = threading.Lock()


def write_generation() -> int:
    """A number that changes after every write to any tuning database by this process."""
    return _generation


def _bump_generation() -> None:
    global _generation
    with _generation_lock:
        _generation += 1


def default_db_path() -> Path:
    """$ATTNGEN_TUNING_DB, else tuning.sqlite3 in the compile cache's directory. Read on every
    attention() call (lookup.stamp()): the environment is the cache key, the path math runs once,
    and the variables after the first one set are not read (each read costs most of a microsecond)."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return _default_db_path(explicit)
    return _default_db_path(None, *(os.environ.get(v) for v in ("ATTNGEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME")))


@functools.lru_cache(maxsize=16)
def _default_db_path(explicit: str | None, *cache_env: str | None) -> Path:
    from attngen.build.compiler import cache_dir

    return Path(explicit or cache_dir() / DB_FILE)


def bucket(n: int) -> int:
    """The power of two at or above n: shapes within a factor of two share a tuned entry."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bucket of {n!r} is undefined; allowed: an integer >= 1")
    return 1 << (n - 1).bit_length()


def spec_key(spec: AttentionSpec) -> str:
    """What a tuned entry is for, as canonical JSON: the spec's problem (problem.key()'s fields) plus
    the family it pins, if it pins one. Config fields and arch are not part of it."""
    data = json.loads(spec.problem.key())
    if spec.family is not None:
        data["family"] = spec.family
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class TuningKey:
    spec: str  # spec_key()
    gpu: str
    target: str  # exact compile target, e.g. sm_90a
    compiler: str  # e.g. nvrtc-13.0
    seqlen_bucket: int
    batch_heads_bucket: int

    @classmethod
    def for_shape(cls, spec: AttentionSpec, shape: Shape, gpu: str, target: str, compiler: str) -> "TuningKey":
        return cls(spec_key(spec), gpu, target, compiler, bucket(max(shape.seqlen_q, shape.seqlen_k)),
                   bucket(shape.batch * shape.heads_q))


@dataclass(frozen=True)
class TuningEntry:
    key: TuningKey
    family: str  # the winner's kernel family
    config: Mapping[str, Any]  # every config field of `family` (stored as a hashable ConfigMap)
    searched: tuple[str, ...]  # the families the search covered, sorted
    ms: float
    tflops: float
    shape: str  # the shape that was timed, e.g. b4h16s4096
    timed: int  # configurations timed
    space: int  # configurations in the space
    attngen_version: str
    updated: str  # ISO 8601, UTC

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", ConfigMap(self.config))
        object.__setattr__(self, "searched", tuple(self.searched))

    def label(self) -> str:
        """The winner as tables name candidates (fwd_sm80/m128n64w4s2); its fields when its family cannot
        label them (a family or config this attngen does not know)."""
        from attngen.tune.space import label

        try:
            family = get_family(self.family)
            problem = AttentionSpec.from_key(self.key.spec).problem
            return label(family.name, family.resolve_config(problem, targets.target(self.key.target), self.config))
        except (ValueError, TypeError):
            return f"{self.family}/" + ",".join(f"{k}={v}" for k, v in self.config.items())

    def record(self) -> dict:
        """The entry as an export file holds it: config a mapping, searched a list."""
        rest = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("key", "config", "searched")}
        return {**{f.name: getattr(self.key, f.name) for f in fields(TuningKey)}, **rest,
                "config": dict(self.config), "searched": list(self.searched)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "TuningEntry":
        key = TuningKey(**{f.name: record[f.name] for f in fields(TuningKey)})
        return cls(key, **{f.name: record[f.name] for f in fields(cls) if f.name != "key"})


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def normalized_time(value: str) -> str | None:
    """An ISO 8601 date and time with a UTC offset, as UTC ISO text (e.g. 2026-11-22T10:00:00+00:00);
    None when `value` is not one (no offset, not a date, not a string)."""
    try:
        parsed = _dt.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return None
    if parsed.utcoffset() is None:
        return None
    return parsed.astimezone(_dt.timezone.utc).isoformat()


_KEY_COLUMNS = [f.name for f in fields(TuningKey)]
_COLUMNS = _KEY_COLUMNS + ["family", "config", "searched", "ms", "tflops", "shape", "timed", "space",
                           "attngen_version", "updated"]
# A newer result replaces an older one; importing an older file never overwrites a fresher tune.
# Times compare as times (julianday), not as text; a stored time that is not one (written behind
# the checks) never blocks a write.
_UPSERT = (
    f"INSERT INTO tuned ({', '.join(_COLUMNS)}) VALUES ({', '.join(':' + c for c in _COLUMNS)}) "
    f"ON CONFLICT ({', '.join(_KEY_COLUMNS)}) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[len(_KEY_COLUMNS):])
    + " WHERE julianday(tuned.updated) IS NULL OR julianday(excluded.updated) >= julianday(tuned.updated)"
)


def _canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _db_row(record: dict) -> dict:
    return {**record, "config": _canonical_json(record["config"]), "searched": _canonical_json(record["searched"])}


def _enter_wal_mode(conn: sqlite3.Connection) -> None:
    """Switch the file to write-ahead logging. The switch needs an exclusive lock, and SQLite answers
    "database is locked" at once, without its busy handler, while another new writer holds a lock:
    so retry here, for as long as the busy timeout allows."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay_s = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay_s > deadline:
                raise
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.05)


def _version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


# Version-1 rows already reported as dropped, per database, so a reader warns once per process.
_warned_drops: set[tuple[str, str]] = set()


def _warn_dropped(path: Path, messages: list[str]) -> None:
    for message in messages:
        if (str(path), message) not in _warned_drops:
            _warned_drops.add((str(path), message))
            warnings.warn(f"attngen: {message}; this version-1 row cannot be migrated to schema version "
                          f"{SCHEMA_VERSION}, so it is dropped (tune its shape again)", stacklevel=4)


class TuningDB:
    """The database at `path` (default: default_db_path()). Every call opens its own connection,
    so one object may be shared by threads; the file and its directory are made on first write,
    and a version-1 database is migrated then."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_db_path()

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r})"

    def _newer(self, version: int) -> TuningDBError:
        return TuningDBError(f"tuning database {self.path} has schema version {version}, written by a newer attngen; "
                             f"this attngen reads versions {' and '.join(map(str, READABLE_VERSIONS))}: upgrade "
                             "attngen, or pass another --db (ATTNGEN_TUNING_DB)")

    def _connect(self, create: bool) -> sqlite3.Connection:
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = None
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            version = _version(conn)
            if version > SCHEMA_VERSION:
                raise self._newer(version)
            if create and version < SCHEMA_VERSION:
                self._upgrade(conn)
            return conn
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, sqlite3.Error):
                raise TuningDBError(f"tuning database {self.path} is unusable: {exc}") from exc
            raise

    def _upgrade(self, conn: sqlite3.Connection) -> None:
        """Create the table, or migrate a version-1 one, in one transaction: of concurrent writers one
        upgrades, the others wait for it and then find version 2."""
        _enter_wal_mode(conn)  # readers never block the writer; not inside a transaction
        dropped: list[str] = []
        conn.isolation_level = None  # explicit BEGIN IMMEDIATE: take the write lock before reading the version
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = _version(conn)
                if version > SCHEMA_VERSION:
                    raise self._newer(version)
                if version == 1:
                    dropped = self._migrate_v1(conn)
                elif version == 0:
                    conn.execute(_SCHEMA)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        finally:
            conn.isolation_level = ""  # back to implicit transactions (put() commits with `with conn`)
        _warn_dropped(self.path, dropped)

    def _migrate_v1(self, conn: sqlite3.Connection) -> list[str]:
        rows = [dict(r) for r in conn.execute("SELECT * FROM tuned")]
        records, dropped = migrate_v1_rows(rows, f"tuning database {self.path}")
        conn.execute("ALTER TABLE tuned RENAME TO tuned_v1")
        conn.execute(_SCHEMA)
        for record in records:  # two rows may become one key (sm_90 and sm_90a): the newer one wins
            conn.execute(_UPSERT, _db_row(record))
        conn.execute("DROP TABLE tuned_v1")
        return dropped

    def _entries(self, key: TuningKey | None = None) -> list[TuningEntry]:
        if not self.path.is_file():
            return []
        try:
            with closing(self._connect(create=False)) as conn:
                version = _version(conn)
                if version == 0:
                    return []  # created but never written
                if version == 1:
                    found = self._read_v1(conn)
                    return [e for e in found if key is None or e.key == key]
                if key is None:
                    rows = conn.execute(f"SELECT * FROM tuned ORDER BY {', '.join(_KEY_COLUMNS)}")
                else:
                    where = " AND ".join(f"{c} = ?" for c in _KEY_COLUMNS)
                    rows = conn.execute(f"SELECT * FROM tuned WHERE {where}",
                                        tuple(getattr(key, c) for c in _KEY_COLUMNS))
                return [self._from_row(dict(r)) for r in rows]
        except sqlite3.Error as exc:
            raise TuningDBError(f"tuning database {self.path} is unreadable: {exc}") from exc

    def _from_row(self, row: dict) -> TuningEntry:
        try:
            decoded = {**row, "config": json.loads(row["config"]), "searched": json.loads(row["searched"])}
            return TuningEntry.from_record(decoded)
        except (TypeError, ValueError) as exc:
            where = ", ".join(f"{c}={row.get(c)!r}" for c in _KEY_COLUMNS)
            raise TuningDBError(f"tuning database {self.path}: the row ({where}) is unreadable: {exc}") from exc

    def _read_v1(self, conn: sqlite3.Connection) -> list[TuningEntry]:
        """A version-1 database read as version 2 (as the migration would write it), sorted by key."""
        rows = [dict(r) for r in conn.execute("SELECT * FROM tuned")]
        records, dropped = migrate_v1_rows(rows, f"tuning database {self.path}")
        _warn_dropped(self.path, dropped)
        newest: dict[TuningKey, TuningEntry] = {}
        for entry in map(TuningEntry.from_record, records):
            held = newest.get(entry.key)
            if held is None or _dt.datetime.fromisoformat(entry.updated) >= _dt.datetime.fromisoformat(held.updated):
                newest[entry.key] = entry
        return [newest[k] for k in sorted(newest, key=lambda k: tuple(getattr(k, c) for c in _KEY_COLUMNS))]

    def put(self, *entries: TuningEntry) -> int:
        """Insert or replace entries, all in one transaction; returns how many were written. An entry
        whose key holds a newer row (by `updated`) is not written. Each entry is checked first."""
        rows = [_db_row(_checked_record(e.record(), f"tuning database {self.path}: entry {i}"))
                for i, e in enumerate(entries)]
        written = 0
        try:
            with closing(self._connect(create=True)) as conn, conn:
                for row in rows:
                    written += conn.execute(_UPSERT, row).rowcount
        except sqlite3.Error as exc:
            raise TuningDBError(f"tuning database {self.path}: write failed: {exc}") from exc
        finally:
            _bump_generation()
        return written

    def get(self, key: TuningKey) -> TuningEntry | None:
        found = self._entries(key)
        return found[0] if found else None

    def entries(self) -> list[TuningEntry]:
        return self._entries()

    # -- moving results between machines ---------------------------------------------------
    def export(self, path: str | Path) -> int:
        """Write every entry to a JSON file (a temporary file, then renamed: never half written); returns how many."""
        path = Path(path)
        if not self.path.is_file():
            raise TuningDBError(f"tuning database {self.path} does not exist, so there is nothing to export to "
                                f"{path}; run `attngen tune SPEC` first, or pass --db (ATTNGEN_TUNING_DB) naming an "
                                "existing database")
        entries = self.entries()
        doc = {"format": EXPORT_FORMAT, "version": SCHEMA_VERSION, "entries": [e.record() for e in entries]}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TuningDBError(f"{path}: cannot write the tuning export ({exc.strerror})") from exc
        return len(entries)

    def import_file(self, path: str | Path) -> tuple[int, int]:
        """Merge a file written by export() (all or nothing): (entries in the file, entries written;
        the others are older than the rows already here)."""
        entries = read_export(path)
        return len(entries), self.put(*entries) if entries else 0


def read_export(path: str | Path) -> list[TuningEntry]:
    """The entries of an export file, each checked (a bad one names the file, the entry and the field);
    a version-1 file's entries are migrated as a version-1 database's rows are."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise TuningDBError(f"{path}: cannot read tuning export ({exc.strerror})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuningDBError(f"{path}: not a tuning export (invalid JSON: {exc})") from exc
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT or version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION
        if isinstance(doc, dict) and doc.get("format") == EXPORT_FORMAT and newer:
            raise TuningDBError(f"{path}: a tuning export of version {version}, written by a newer attngen; this "
                                f"attngen reads versions {' and '.join(map(str, READABLE_VERSIONS))}: upgrade attngen")
        raise TuningDBError(f"{path}: not a tuning export; expected format={EXPORT_FORMAT!r} and version "
                            f"{' or '.join(map(str, READABLE_VERSIONS))}, got "
                            f"format={doc.get('format') if isinstance(doc, dict) else None!r}, version={version!r}")
    rows = doc.get("entries")
    if not isinstance(rows, list):
        raise TuningDBError(f"{path}: 'entries' must be a list")
    if version == 1:
        return [TuningEntry.from_record(migrate_v1_record(row, f"{path}: entry {i} (version 1)"))
                for i, row in enumerate(rows)]
    return [TuningEntry.from_record(_checked_entry(row, f"{path}: entry {i}")) for i, row in enumerate(rows)]


# -- checking entries ---------------------------------------------------------------------------------
_TYPES = {"seqlen_bucket": int, "batch_heads_bucket": int, "timed": int, "space": int, "ms": float, "tflops": float,
          "config": dict, "searched": list}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", dict: "a mapping of the family's config fields",
               list: "a list of family names"}
_TIME_EXAMPLE = "2026-11-22T10:00:00+00:00"


def _checked_entry(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise TuningDBError(f"{where}: must be a mapping, got {type(row).__name__}")
    missing = [c for c in _COLUMNS if c not in row]
    if missing:
        raise TuningDBError(f"{where}: missing field {missing[0]!r}; required: {', '.join(_COLUMNS)}")
    return _checked_record(row, where)


def _checked_spec_key(text: str, where: str) -> AttentionSpec:
    try:
        spec = AttentionSpec.from_key(text)
    except ValueError as exc:  # SpecError too
        raise TuningDBError(f"{where}: spec={text!r} is invalid: {exc}") from exc
    if spec.config is not None or spec.arch is not None or spec_key(spec) != text:
        raise TuningDBError(f"{where}: spec={text!r} is invalid; allowed: a canonical spec key, the problem and at "
                            "most a pinned family (attngen.tune.db.spec_key)")
    return spec


def _checked_record(row: Mapping[str, Any], where: str) -> dict:
    """Every field of `row` checked (the error names `where`, the field, the value and what is allowed);
    the record as stored: ms and tflops as floats, `updated` as UTC ISO text, config's keys sorted."""

    def check(name: str, ok: bool, allowed: str) -> None:
        if not ok:
            raise TuningDBError(f"{where}: {name}={row[name]!r} is invalid; allowed: {allowed}")

    for name in _COLUMNS:
        want = _TYPES.get(name, str)
        value = row[name]
        check(name, not isinstance(value, bool) and isinstance(value, (int, float) if want is float else want),
              _TYPE_NAMES[want])
    for name in ("seqlen_bucket", "batch_heads_bucket"):
        check(name, row[name] >= 1 and bucket(row[name]) == row[name], "a power of two >= 1 (a shape bucket)")
    for name in ("ms", "tflops"):
        check(name, math.isfinite(row[name]) and row[name] > 0, "a finite number > 0")
    check("space", row["space"] >= 1, "an integer >= 1")
    check("timed", 1 <= row["timed"] <= row["space"], f"an integer from 1 to space={row['space']}")
    try:
        exact = targets.target(row["target"]).name == row["target"]
    except ValueError:
        exact = False
    check("target", exact, f"an exact compile target: one of {', '.join(_exact_targets())}")
    for name in ("gpu", "compiler", "shape", "attngen_version"):
        check(name, bool(row[name].strip()), "a non-empty string")
    updated = normalized_time(row["updated"])
    check("updated", updated is not None, f"an ISO 8601 date and time with a UTC offset, e.g. {_TIME_EXAMPLE}")
    spec = _checked_spec_key(row["spec"], where)
    try:
        family = get_family(row["family"])
    except ValueError as exc:
        raise TuningDBError(f"{where}: {exc}") from None
    check("family", spec.family in (None, family.name), f"{spec.family!r}, the family its spec key pins")
    config = family.with_added_fields(row["config"])
    problems = family.check_config(config)
    if problems:
        raise TuningDBError(f"{where}: {problems[0]}")
    missing = [f for f in family.config_fields if f not in config]
    check("config", not missing, f"every config field of family {family.name} ({', '.join(family.config_fields)}); "
                                 f"missing: {', '.join(missing)}")
    searched = row["searched"]
    check("searched", all(isinstance(s, str) and s for s in searched) and searched == sorted(set(searched))
          and family.name in searched and (spec.family is None or searched == [spec.family]),
          f"the sorted, distinct names of the families the search covered, {family.name!r} among them"
          + (f": [{spec.family!r}] for a spec key that pins it" if spec.family else ""))
    return {**{c: row[c] for c in _COLUMNS}, "ms": float(row["ms"]), "tflops": float(row["tflops"]),
            "updated": updated, "config": dict(sorted(config.items())), "searched": list(searched)}


@functools.lru_cache(maxsize=None)
def _exact_targets() -> tuple[str, ...]:
    return tuple(dict.fromkeys(targets.target(a).name for a in targets.allowed_archs()))


# -- version 1 ------------------------------------------------------------------------------------------
def _v1_row_name(row) -> str:
    if not isinstance(row, dict):
        return repr(row)
    return "(" + ", ".join(f"{c}={row.get(c)!r}" for c in ("spec", "gpu", "arch", "compiler", "seqlen_bucket",
                                                          "batch_heads_bucket")) + ")"


def migrate_v1_record(row, where: str) -> dict:
    """A version-1 row or export entry as a checked version-2 record; TuningDBError naming `where` and the
    field when it cannot be one."""
    if not isinstance(row, dict):
        raise TuningDBError(f"{where}: must be a mapping, got {type(row).__name__}")
    missing = [c for c in V1_COLUMNS if c not in row]
    if missing:
        raise TuningDBError(f"{where}: missing field {missing[0]!r}; required (version 1): {', '.join(V1_COLUMNS)}")
    try:
        target = targets.target(row["arch"])
    except ValueError:
        raise TuningDBError(f"{where}: arch={row['arch']!r} is invalid; allowed: "
                            f"{', '.join(targets.allowed_archs())}") from None
    try:
        spec = AttentionSpec.from_dict(json.loads(row["spec"]))
    except (TypeError, ValueError) as exc:  # JSONDecodeError and SpecError are ValueErrors
        raise TuningDBError(f"{where}: spec={row['spec']!r} is invalid: {exc}") from exc
    if spec.family is not None or spec.config is not None or spec.arch is not None:
        raise TuningDBError(f"{where}: spec={row['spec']!r} is invalid; allowed: a version-1 spec key (the problem "
                            "fields only)")
    record = {
        **{c: row[c] for c in V1_COLUMNS if c not in V1_TILE_FIELDS and c not in ("spec", "arch")},
        "spec": spec_key(spec), "target": target.name, "family": V1_FAMILY,
        "config": {f: row[f] for f in V1_TILE_FIELDS}, "searched": [V1_FAMILY],
    }
    return _checked_record(record, where)


def migrate_v1_rows(rows: list[dict], where: str) -> tuple[list[dict], list[str]]:
    """(the version-2 records of the rows that migrate, why each other row does not)."""
    records, dropped = [], []
    for row in rows:
        try:
            records.append(migrate_v1_record(row, f"{where}: version-1 row {_v1_row_name(row)}"))
        except TuningDBError as exc:
            dropped.append(str(exc))
    return records, dropped

