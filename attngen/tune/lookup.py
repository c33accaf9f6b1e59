"""The runtime side of tuning: which (family, config) a call runs when its spec leaves the config open.

attngen/runtime/dispatch.py asks two questions:

  stamp()  -> a value that changes whenever a tuning result this process can see may have changed:
              a write through any TuningDB in this process (db.write_generation()), or a change of
              the default database file or its WAL file ((mtime, size): `attngen tune` in another
              shell). The dispatcher reuses a resolved kernel while the stamp is unchanged.
  tuned(spec, q_shape, k_shape, target) -> (family name, config) stored for the call's shape
              bucket on this GPU, or None: then the dispatcher uses the defaults.

Rules. A spec that pins any config field gets None: an explicit config always wins. A spec that
pins a family reads the entry stored for that family. An unpinned spec reads the unpinned entry,
and uses it only if the families its search covered (`searched`) include every family that
supports the problem on this GPU now: an entry older than a family (a Hopper family added since,
say) would hide it, so it is ignored, with one warning per database saying to run `attngen tune`
again. An entry whose family no longer exists, or whose config today's family rejects or cannot
plan on the GPU, is ignored with one warning. A missing database means None; an unreadable one
means None and one warning: tuning can never break a call.

Answers are memoized per (spec, buckets, GPU, target, compiler, database path) with the stamp
read before the lookup, so the database is read once per shape bucket while it is unchanged.
"""

from __future__ import annotations

import functools
import os
import time
import threading
import warnings

from attngen import families
from attngen.errors import SpecError
from attngen.spec import AttentionSpec
from attngen.targets import Target
from attngen.tune.db import ENV_VAR, TuningDB, TuningDBError, TuningKey, bucket, default_db_path, write_generation
from attngen.tune.model import Shape

# (spec, buckets, GPU, target, compiler, database path) -> (the stamp when read, the answer)
_memo: dict[tuple, tuple[tuple, tuple[str, dict] | None]] = {}
_lock = threading.Lock()
# (database path, kind of problem) already warned about: one warning each per process.
_warned: set[tuple[str, str]] = set()


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    """The compiler kernels are built with at run time, as tuning keys name it (e.g. nvrtc-13.0)."""
    from attngen.build.compiler import nvrtc_version

    return nvrtc_version()


def clear_memo() -> None:
    """Forget every answer (tests; writes through TuningDB need no call: they change the stamp)."""
    with _lock:
        _memo.clear()


def _file_state(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _stamp_of(path: str) -> tuple:
    # No database file: no WAL worth a stat.
    main = _file_state(path)
    return write_generation(), main, main and _file_state(path + "-wal")


def stamp() -> tuple:
    """Changes whenever a tuning result visible to this process may have changed (a few microseconds)."""
    return _stamp_of(str(default_db_path()))


# The runtime's per-call check: this process's writes and a change of $ATTNGEN_TUNING_DB show at once,
# other processes' writes (the database files' state) within RECHECK_S.
RECHECK_S = 0.25
_recent: tuple[float, str | None, tuple] = (float("-inf"), None, ())


def recent_stamp() -> tuple:
    """stamp() for the hot path: the files are stat'ed at most every RECHECK_S seconds (0.3 us otherwise)."""
    global _recent
    explicit = os.environ.get(ENV_VAR)
    checked, path_env, files = _recent
    now = time.monotonic()
    if now - checked >= RECHECK_S or path_env != explicit:
        path = str(default_db_path())
        main = _file_state(path)
        files = (path, main, main and _file_state(path + "-wal"))
        _recent = (now, explicit, files)
    return write_generation(), files


def _warn_once(path: str, kind: str, message: str) -> None:
    with _lock:
        first = (path, kind) not in _warned
        _warned.add((path, kind))
    if first:
        warnings.warn(f"attngen: {message}", stacklevel=4)


def tuned(spec: AttentionSpec, q_shape, k_shape, target: Target) -> tuple[str, dict] | None:
    """The (family name, config) the default tuning database holds for this call on `target`'s GPU, or None."""
    if spec.config:
        return None  # an explicit config always wins
    if target.device_name is None:
        return None  # entries are per GPU: a target read from the table is no GPU
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if len(q_shape) != 4 or len(k_shape) != 4 or min(q_shape[:3] + k_shape[1:2]) < 1:
        return None  # malformed or empty input: the kernel's own checks report it
    shape = Shape(batch=q_shape[0], seqlen_q=q_shape[1], seqlen_k=k_shape[1], heads_q=q_shape[2])
    return tuned_for_shape(spec, shape, target, compiler_version())


def tuned_for_shape(spec: AttentionSpec, shape: Shape, target: Target, compiler: str,
                    db: TuningDB | None = None) -> tuple[str, dict] | None:
    """tuned() for a Shape, an explicit compiler and database (default: the default database)."""
    if spec.config:
        return None
    db = db or TuningDB()
    path = str(db.path)
    memo_key = (spec, bucket(max(shape.seqlen_q, shape.seqlen_k)), bucket(shape.batch * shape.heads_q),
                target.device_name, target.name, compiler, path)
    current = _stamp_of(path)  # before the read, so a write after it makes a mismatch
    with _lock:
        memoized = _memo.get(memo_key)
        if memoized is not None and memoized[0] == current:
            return memoized[1]
    answer = None
    try:
        entry = db.get(TuningKey.for_shape(spec, shape, target.device_name, target.name, compiler))
        if entry is not None:
            answer = _usable(spec, entry, target, path)
    except TuningDBError as exc:
        _warn_once(path, "unreadable", f"ignoring the tuning database: {exc}; using the default configs")
    with _lock:
        if write_generation() == current[0]:  # else this process wrote meanwhile: the answer may be stale
            _memo[memo_key] = (current, answer)
    return answer


def _usable(spec: AttentionSpec, entry, target: Target, path: str) -> tuple[str, dict] | None:
    """The entry's (family, config) when today's families can run it on `target`, else None (warned)."""
    problem = spec.problem
    where = f"the tuning database {path} entry for {entry.key.spec} on {entry.shape} ({entry.family} " \
            f"{dict(entry.config)})"
    if spec.family is None:
        missing = sorted({f.name for f in families.supporting(problem, target)} - set(entry.searched))
        if missing:
            _warn_once(path, "coverage", f"ignoring {where}: its search covered {', '.join(entry.searched)} but not "
                                         f"{', '.join(missing)}, which can run it on this GPU now; run "
                                         "`attngen tune` for the spec again (such entries are ignored until then)")
            return None
    try:
        family = families.get_family(entry.family)
        if spec.family not in (None, family.name):  # the key pins the family: only a hand edit gets here
            raise SpecError(f"it names family {family.name}, but the spec pins {spec.family}")
        reason = family.supports(problem, target)
        if reason is not None:
            raise SpecError(f"family {family.name} cannot run it on {target.name}: {reason}")
        stored = family.with_added_fields(entry.config)
        problems = family.check_config(stored)
        missing = [f for f in family.config_fields if f not in stored]
        if problems or missing:  # an older or newer family's config: not what this one would time
            raise SpecError(problems[0] if problems else f"its config lacks {', '.join(missing)}")
        config = family.resolve_config(problem, target, stored)
        family.plan(problem, target, config)  # a config today's family cannot build here is no answer
    except (ValueError, SpecError) as exc:
        _warn_once(path, "invalid", f"ignoring {where}: {exc}; using the default configs")
        return None
    return family.name, config.to_dict()
