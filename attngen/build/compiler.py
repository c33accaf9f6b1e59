"""Compile rendered kernels with NVRTC (through CuPy) and cache the binaries on disk.

Cache entries are keyed by a hash of the rendered source (headers are inlined, so a
template edit always changes it), the compiler options, the target arch and the
NVRTC version. Writes go to a temporary file that is renamed into place, under a
per-entry file lock, so concurrent processes never see a partial binary; the OS
drops the lock of a killed process, so a crash cannot wedge the others.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from attngen.errors import CompileError

NVRTC_OPTIONS = ("-std=c++17", "--device-as-default-execution-space")
LOCK_TIMEOUT_S = 600


def cache_dir() -> Path:
    env = os.environ.get("ATTNGEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attngen"


def cache_key(source: str, options: tuple[str, ...], arch: str, compiler_version: str) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(options), arch, compiler_version):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


@dataclass(frozen=True)
class CachedBinary:
    path: Path
    key: str
    compiled_now: bool


def cached_compile(name: str, source: str, arch: str, options: tuple[str, ...], compiler_version: str,
                   compile_fn) -> CachedBinary:
    """Return the cached binary for (source, options, arch, compiler), compiling it once.

    `compile_fn(source, name, options, arch) -> bytes` does the compiling; it is a
    parameter so the cache protocol can be tested without a GPU.
    """
    key = cache_key(source, options, arch, compiler_version)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}-{arch}-{key[:24]}.cubin"
    if path.is_file():
        return CachedBinary(path, key, compiled_now=False)
    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
        if path.is_file():  # another process finished it while we waited
            return CachedBinary(path, key, compiled_now=False)
        binary = compile_fn(source, name, options, arch)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(binary)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return CachedBinary(path, key, compiled_now=True)


# -- NVRTC through CuPy -------------------------------------------------------

@functools.lru_cache(maxsize=None)
def nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return f"nvrtc-{major}.{minor}"


def nvrtc_compile(source: str, name: str, options: tuple[str, ...], arch: str) -> bytes:
    """Compile to a cubin for the exact target `arch` (e.g. "sm_90a") with NVRTC; CompileError carries the log."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options) + [f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            kept = Path(tempfile.gettempdir()) / f"attngen-failed-{name}.cu"
            kept.write_text(source)
            raise CompileError(f"NVRTC failed to compile {name} for {arch}: {exc}", log, str(kept)) from None
        return whole_elf(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def whole_elf(cubin: bytes) -> bytes:
    """`cubin` with the last byte CuPy's getCUBIN drops (it strips a "trailing NULL" as from a C
    string) put back, so the file is the ELF its header describes and cuobjdump reads it (the driver
    loads either). The header gives the length: the section and program header tables end the file,
    and the dropped byte is the top byte of a 64-bit field of the last entry (an alignment or an
    entry size), 0. Anything else is returned as it came."""
    if len(cubin) < 64 or cubin[:5] != b"\x7fELF\x02":  # ELF64 only
        return cubin
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" if size == len(cubin) + 1 else cubin


def build(plan, source: str | None = None) -> CachedBinary:
    """The cached NVRTC binary of a family's plan, for the plan's exact target (rendering it unless given)."""
    from attngen.families import get_family

    source = get_family(plan.family).render(plan) if source is None else source
    return cached_compile(plan.name, source, plan.target.name, NVRTC_OPTIONS, nvrtc_version(), nvrtc_compile)
