"""The runtime side of tuning: which tile `attngen.attention` runs for an untiled spec.

A spec that leaves all four tile fields unset gets the tuned tile of the call's shape
bucket on this GPU, when the tuning database has one; any explicit tile field means no
lookup. Answers are memoized per (spec, bucket, GPU, database file), so the database is
read once per shape bucket, not per call. An answer is used only while the database is as
it was when the answer was read: no write by this process since (db.write_generation()),
and the database file and its WAL file have the same (mtime, size) (writes by other
processes: `attngen tune` in another shell). A missing database means the defaults; an
unreadable one means the defaults and one warning: tuning can never break a call.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import warnings

from attngen.errors import SpecError
from attngen.plan import make_plan
from attngen.spec import TILE_FIELDS, AttentionSpec, TileConfig
from attngen.tune.db import TuningDB, TuningDBError, TuningKey, bucket, write_generation
from attngen.tune.model import Shape

# (spec, buckets, GPU, target, compiler, database path) -> (the database's stamp when read, the answer)
_memo: dict[tuple, tuple[tuple, TileConfig | None]] = {}
_lock = threading.Lock()
_warned: set[str] = set()


@functools.lru_cache(maxsize=None)
def device_identity(device: int) -> tuple[str, str]:
    """(GPU name, compile target) of a CUDA device, e.g. ("NVIDIA H100 80GB HBM3", "sm_90")."""
    import cupy

    from attngen.runtime import _device_arch

    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return (name.decode() if isinstance(name, bytes) else str(name)), _device_arch(device)[1]


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    from attngen.compiler import nvrtc_version

    return nvrtc_version()


def clear_memo() -> None:
    """Forget every answer (tests; writes through TuningDB need no call: they make answers stale)."""
    with _lock:
        _memo.clear()


def _file_state(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def tuned_tile(spec: AttentionSpec, shape: Shape, gpu: str, arch: str, compiler: str,
               db: TuningDB | None = None) -> TileConfig | None:
    """The tuned tile for `spec` on `shape`'s bucket, or None (no entry, or an unusable database)."""
    db = db or TuningDB()
    path = str(db.path)
    # Cheap to build on every call, unlike the canonical spec key.
    memo_key = (spec, bucket(max(shape.seqlen_q, shape.seqlen_k)), bucket(shape.batch * shape.heads_q), gpu, arch,
                compiler, path)
    # Before the read, so a write after it makes a mismatch. No database file: no WAL worth a stat.
    main = _file_state(path)
    files = (main, main and _file_state(path + "-wal"))
    with _lock:
        stamp = (write_generation(), *files)
        memoized = _memo.get(memo_key)
        if memoized is not None and memoized[0] == stamp:
            return memoized[1]
    tile = None
    try:
        entry = db.get(TuningKey.for_shape(spec, shape, gpu, arch, compiler))
        if entry is not None:
            from attngen.runtime import arch_family

            # A tile this spec and today's plan accept (a newer attngen may plan differently), else SpecError.
            make_plan(spec.replace(**dataclasses.asdict(entry.tile)), arch_family(arch))
            tile = entry.tile
    except (TuningDBError, SpecError) as exc:
        with _lock:
            first = path not in _warned
            _warned.add(path)
        if first:
            warnings.warn(f"attngen: ignoring the tuning database: {exc}; using the default tiles", stacklevel=4)
    with _lock:
        if write_generation() == stamp[0]:  # else this process wrote meanwhile: the answer may be stale
            _memo[memo_key] = (stamp, tile)
    return tile


def tuned_spec(spec: AttentionSpec, q_shape, k_shape, device: int) -> AttentionSpec:
    """`spec` with the tuned tile of this call's shape when it sets no tile field; else `spec`."""
    if any(getattr(spec, f) is not None for f in TILE_FIELDS):
        return spec  # an explicit tile always wins
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if len(q_shape) != 4 or len(k_shape) != 4 or min(q_shape[:3] + k_shape[1:2]) < 1:
        return spec  # malformed or empty input: the kernel's own checks report it
    shape = Shape(batch=q_shape[0], seqlen_q=q_shape[1], seqlen_k=k_shape[1], heads_q=q_shape[2])
    gpu, arch = device_identity(device)
    tile = tuned_tile(spec, shape, gpu, arch, compiler_version())
    return spec if tile is None else _with_tile(spec, spec.source, tile)


@functools.lru_cache(maxsize=1024)
def _with_tile(spec: AttentionSpec, source: str | None, tile: TileConfig) -> AttentionSpec:
    # Revalidating a spec costs ~10 us and attention() asks for the same few on every call.
    # `source` is in the key because specs compare equal whatever file they came from.
    return spec.replace(**dataclasses.asdict(tile))
