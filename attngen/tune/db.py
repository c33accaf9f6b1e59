"""The tuning database: SQLite (embedded, no server), safe under concurrent writers.

One row per (spec without its tile fields, GPU name, compile target, compiler version,
sequence-length bucket, batch x heads bucket) holds the winning tile and how it was
found. WAL journaling lets readers run beside a writer; a busy timeout makes concurrent
writers wait their turn instead of failing; upserts make a re-tune replace the old row,
unless the row there is newer (`updated`, compared as a time, not as text). Every entry is
checked before it is written, whether it comes from the tuner or from an export file.

The default file is <attngen cache dir>/tuning.sqlite3 (the compile cache's root,
attngen/compiler.py); $ATTNGEN_TUNING_DB or an explicit path overrides it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import re
import sqlite3
import threading
from contextlib import closing
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from attngen.errors import SpecError
from attngen.spec import TILE_FIELDS, AttentionSpec, TileConfig
from attngen.tune.model import Shape

ENV_VAR = "ATTNGEN_TUNING_DB"
DB_FILE = "tuning.sqlite3"
SCHEMA_VERSION = 1
EXPORT_FORMAT = "attngen-tuning"
BUSY_TIMEOUT_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tuned (
    spec TEXT NOT NULL,
    gpu TEXT NOT NULL,
    arch TEXT NOT NULL,
    compiler TEXT NOT NULL,
    seqlen_bucket INTEGER NOT NULL,
    batch_heads_bucket INTEGER NOT NULL,
    block_m INTEGER NOT NULL,
    block_n INTEGER NOT NULL,
    num_warps INTEGER NOT NULL,
    num_stages INTEGER NOT NULL,
    ms REAL NOT NULL,
    tflops REAL NOT NULL,
    shape TEXT NOT NULL,
    timed INTEGER NOT NULL,
    space INTEGER NOT NULL,
    attngen_version TEXT NOT NULL,
    updated TEXT NOT NULL,
    PRIMARY KEY (spec, gpu, arch, compiler, seqlen_bucket, batch_heads_bucket)
)
"""


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
    # Read on every attention() call: the environment is the cache key, the path math runs once.
    return _default_db_path(*(os.environ.get(v) for v in (ENV_VAR, "ATTNGEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME")))


@functools.lru_cache(maxsize=16)
def _default_db_path(explicit: str | None, *cache_env: str | None) -> Path:
    from attngen.compiler import cache_dir

    return Path(explicit or cache_dir() / DB_FILE)


def bucket(n: int) -> int:
    """The power of two at or above n: shapes within a factor of two share a tuned tile."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bucket of {n!r} is undefined; allowed: an integer >= 1")
    return 1 << (n - 1).bit_length()


def spec_key(spec: AttentionSpec) -> str:
    """The spec without its tile fields and arch, as canonical JSON: what a tuned tile is for."""
    return json.dumps({k: v for k, v in spec.to_dict().items() if k not in TILE_FIELDS and k != "arch"},
                      sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class TuningKey:
    spec: str  # spec_key()
    gpu: str
    arch: str  # compile target, e.g. sm_90
    compiler: str  # e.g. nvrtc-13.0
    seqlen_bucket: int
    batch_heads_bucket: int

    @classmethod
    def for_shape(cls, spec: AttentionSpec, shape: Shape, gpu: str, arch: str, compiler: str) -> "TuningKey":
        return cls(spec_key(spec), gpu, arch, compiler, bucket(max(shape.seqlen_q, shape.seqlen_k)),
                   bucket(shape.batch * shape.heads_q))


@dataclass(frozen=True)
class TuningEntry:
    key: TuningKey
    tile: TileConfig
    ms: float
    tflops: float
    shape: str  # the shape that was timed, e.g. b4h16s4096
    timed: int  # configurations timed
    space: int  # configurations in the space
    attngen_version: str
    updated: str  # ISO 8601, UTC

    def row(self) -> dict:
        return {**asdict(self.key), **asdict(self.tile), **{f.name: getattr(self, f.name) for f in fields(self)
                                                           if f.name not in ("key", "tile")}}

    @classmethod
    def from_row(cls, row: dict) -> "TuningEntry":
        key = TuningKey(**{f.name: row[f.name] for f in fields(TuningKey)})
        tile = TileConfig(**{f: row[f] for f in TILE_FIELDS})
        rest = {f.name: row[f.name] for f in fields(cls) if f.name not in ("key", "tile")}
        return cls(key, tile, **rest)


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


_COLUMNS = [f.name for f in fields(TuningKey)] + list(TILE_FIELDS) + [
    f.name for f in fields(TuningEntry) if f.name not in ("key", "tile")]
# A newer result replaces an older one; importing an older file never overwrites a fresher tune.
# Times compare as times (julianday), not as text; a stored time that is not one (written before
# entries were checked) never blocks a write.
_UPSERT = (
    f"INSERT INTO tuned ({', '.join(_COLUMNS)}) VALUES ({', '.join(':' + c for c in _COLUMNS)}) "
    f"ON CONFLICT ({', '.join(f.name for f in fields(TuningKey))}) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[len(fields(TuningKey)):])
    + " WHERE julianday(tuned.updated) IS NULL OR julianday(excluded.updated) >= julianday(tuned.updated)"
)


class TuningDB:
    """The database at `path` (default: default_db_path()). Every call opens its own connection,
    so one object may be shared by threads; the file and its directory are made on first write."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_db_path()

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r})"

    def _connect(self, create: bool) -> sqlite3.Connection:
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                conn.close()
                raise TuningDBError(f"tuning database {self.path} has schema version {version}; this attngen "
                                    f"reads up to {SCHEMA_VERSION}: upgrade attngen or pass another --db")
            if create and version < SCHEMA_VERSION:
                conn.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
                with conn:
                    conn.execute(_SCHEMA)
                    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return conn
        except sqlite3.Error as exc:
            raise TuningDBError(f"tuning database {self.path} is unusable: {exc}") from exc

    def _read(self, sql: str, params: tuple = ()) -> list[TuningEntry]:
        if not self.path.is_file():
            return []
        try:
            with closing(self._connect(create=False)) as conn:
                if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                    return []  # created but never written
                return [TuningEntry.from_row(dict(r)) for r in conn.execute(sql, params)]
        except sqlite3.Error as exc:
            raise TuningDBError(f"tuning database {self.path} is unreadable: {exc}") from exc

    def put(self, *entries: TuningEntry) -> int:
        """Insert or replace entries, all in one transaction; returns how many were written. An entry
        whose key holds a newer row (by `updated`) is not written. Each entry is checked first."""
        rows = [_checked_row(e.row(), f"tuning database {self.path}: entry {i}") for i, e in enumerate(entries)]
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
        where = " AND ".join(f"{f.name} = ?" for f in fields(TuningKey))
        found = self._read(f"SELECT * FROM tuned WHERE {where}", tuple(asdict(key).values()))
        return found[0] if found else None

    def entries(self) -> list[TuningEntry]:
        return self._read("SELECT * FROM tuned ORDER BY spec, gpu, arch, compiler, seqlen_bucket, batch_heads_bucket")

    # -- moving results between machines ---------------------------------------------------
    def export(self, path: str | Path) -> int:
        """Write every entry to a JSON file (a temporary file, then renamed: never half written); returns how many."""
        path = Path(path)
        entries = self.entries()
        doc = {"format": EXPORT_FORMAT, "version": SCHEMA_VERSION, "entries": [e.row() for e in entries]}
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
    """The entries of an export file, each checked (bad ones name the file and the entry)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise TuningDBError(f"{path}: cannot read tuning export ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise TuningDBError(f"{path}: not a tuning export (invalid JSON: {exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT or doc.get("version") != SCHEMA_VERSION:
        raise TuningDBError(f"{path}: not a tuning export; expected format={EXPORT_FORMAT!r} and "
                            f"version={SCHEMA_VERSION}, got format={doc.get('format') if isinstance(doc, dict) else None!r}")
    rows = doc.get("entries")
    if not isinstance(rows, list):
        raise TuningDBError(f"{path}: 'entries' must be a list")
    return [_checked_entry(row, f"{path}: entry {i}") for i, row in enumerate(rows)]


_TYPES = {"seqlen_bucket": int, "batch_heads_bucket": int, "timed": int, "space": int, "ms": float, "tflops": float,
          **dict.fromkeys(TILE_FIELDS, int)}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}
ARCH_PATTERN = re.compile(r"sm_\d+a?")
_TIME_EXAMPLE = "2026-11-22T10:00:00+00:00"


def _checked_entry(row, where: str) -> TuningEntry:
    if not isinstance(row, dict):
        raise TuningDBError(f"{where}: must be a mapping, got {type(row).__name__}")
    missing = [c for c in _COLUMNS if c not in row]
    if missing:
        raise TuningDBError(f"{where}: missing field {missing[0]!r}; required: {', '.join(_COLUMNS)}")
    return TuningEntry.from_row(_checked_row(row, where))


def _checked_row(row: dict, where: str) -> dict:
    """Every column of `row` checked (the error names `where`, the field, the value and what is allowed);
    the row as stored: ms and tflops as floats, `updated` as UTC ISO text."""

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
    check("arch", ARCH_PATTERN.fullmatch(row["arch"]) is not None, "a compile target such as sm_80, sm_90 or sm_90a")
    for name in ("gpu", "compiler", "shape", "attngen_version"):
        check(name, bool(row[name].strip()), "a non-empty string")
    updated = normalized_time(row["updated"])
    check("updated", updated is not None, f"an ISO 8601 date and time with a UTC offset, e.g. {_TIME_EXAMPLE}")
    try:
        spec = AttentionSpec.from_dict(json.loads(row["spec"]))
    except (json.JSONDecodeError, SpecError) as exc:
        raise TuningDBError(f"{where}: spec={row['spec']!r} is invalid: {exc}") from exc
    try:
        spec.replace(**{f: row[f] for f in TILE_FIELDS})  # the tile must be one the spec accepts
    except SpecError as exc:
        raise TuningDBError(f"{where}: {exc}") from exc
    check("spec", spec_key(spec) == row["spec"], "a canonical untiled spec key (attngen.tune.db.spec_key)")
    return {**{c: row[c] for c in _COLUMNS}, "ms": float(row["ms"]), "tflops": float(row["tflops"]),
            "updated": updated}
