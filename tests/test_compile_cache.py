"""The on-disk binary cache: keyed by everything that changes the binary, safe under concurrency."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

from attngen.build import compiler
from attngen.codegen import render as codegen
from attngen.families import get_family, plan_spec
from attngen.families.fwd_sm80 import family as fwd_sm80
from attngen.spec import AttentionSpec

OPTS = ("-std=c++17",)


def slow_fake_compile(log_path: str, delay: float):
    def compile_fn(source, name, options, arch):
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        return f"BINARY[{name}|{arch}|{len(source)}]".encode()

    return compile_fn


def _worker(cache_dir, log_path, delay, queue):
    os.environ["ATTNGEN_CACHE_DIR"] = cache_dir
    got = compiler.cached_compile("k", "src", "sm_90", OPTS, "v1", slow_fake_compile(log_path, delay))
    queue.put((str(got.path), got.path.read_bytes()))


def test_key_covers_source_options_arch_and_compiler():
    base = compiler.cache_key("src", OPTS, "sm_90a", "nvrtc-13.0")
    assert compiler.cache_key("src ", OPTS, "sm_90a", "nvrtc-13.0") != base
    assert compiler.cache_key("src", OPTS + ("-G",), "sm_90a", "nvrtc-13.0") != base
    assert compiler.cache_key("src", OPTS, "sm_80", "nvrtc-13.0") != base
    # The exact target: sm_90a code (wgmma, setmaxnreg) is not sm_90 code.
    assert compiler.cache_key("src", OPTS, "sm_90", "nvrtc-13.0") != base
    assert compiler.cache_key("src", OPTS, "sm_90a", "nvrtc-13.1") != base


def render(spec: AttentionSpec) -> str:
    plan = plan_spec(spec)
    return get_family(plan.family).render(plan)


@pytest.fixture
def point_templates(monkeypatch):
    """point_templates(module, attribute, folder): render from an edited copy. Rendering environments are
    cached per family folder, so the cache is cleared on every change and after the test (monkeypatch
    then restores the real folders): the copies never leak into other tests."""

    def point(module, attribute, folder):
        monkeypatch.setattr(module, attribute, folder)
        codegen.environment.cache_clear()

    yield point
    codegen.environment.cache_clear()


SPEC = AttentionSpec(head_dim=64, family="fwd_sm80")


def test_shared_header_edit_changes_source_hash(point_templates, tmp_path):
    """Headers are inlined, so an edit to any shared header reaches the source, and so the cache key."""
    before = render(SPEC)
    copy = tmp_path / "cuda"
    shutil.copytree(codegen.SHARED_HEADERS, copy)
    (copy / "ptx.cuh").write_text((copy / "ptx.cuh").read_text() + "\n// edited\n")
    point_templates(codegen, "SHARED_HEADERS", copy)
    after = render(SPEC)
    assert "// edited" in after and before != after


def test_family_template_edit_changes_source_hash(point_templates, tmp_path):
    before = render(SPEC)
    copy = tmp_path / "fwd_sm80"
    shutil.copytree(fwd_sm80.FOLDER, copy)
    (copy / "flash_fwd.cuh").write_text((copy / "flash_fwd.cuh").read_text() + "\n// edited family header\n")
    point_templates(fwd_sm80, "FOLDER", copy)
    after = render(SPEC)
    assert "// edited family header" in after and before != after


def test_compiles_once_then_hits(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    log = tmp_path / "log"
    first = compiler.cached_compile("k", "src", "sm_90", OPTS, "v1", slow_fake_compile(str(log), 0))
    second = compiler.cached_compile("k", "src", "sm_90", OPTS, "v1", slow_fake_compile(str(log), 0))
    assert first.compiled_now and not second.compiled_now and first.path == second.path
    assert log.read_text().count("\n") == 1
    third = compiler.cached_compile("k", "src2", "sm_90", OPTS, "v1", slow_fake_compile(str(log), 0))
    assert third.path != first.path and third.compiled_now


def test_concurrent_processes_compile_once(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    log = tmp_path / "log"
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), str(log), 1.0, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert len({r[0] for r in results}) == 1
    assert all(r[1] == b"BINARY[k|sm_90|3]" for r in results)
    assert log.read_text().count("\n") == 1, "exactly one process compiled"
    assert not list(Path(tmp_path).glob("*.tmp")), "no temporary files left behind"


def test_killed_compiler_does_not_wedge_or_corrupt(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    log = tmp_path / "log"
    victim = ctx.Process(target=_worker, args=(str(tmp_path), str(log), 30.0, queue))
    victim.start()
    deadline = time.time() + 30
    while not log.exists() and time.time() < deadline:  # the victim holds the lock and is compiling
        time.sleep(0.05)
    assert log.exists()
    victim.kill()
    victim.join()
    survivor = ctx.Process(target=_worker, args=(str(tmp_path), str(log), 0.0, queue))
    survivor.start()
    path, data = queue.get(timeout=30)
    survivor.join(timeout=30)
    assert data == b"BINARY[k|sm_90|3]"
    assert log.read_text().count("\n") == 2


def test_compile_error_propagates_and_caches_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))

    def failing(source, name, options, arch):
        raise compiler.CompileError("boom", "log text")

    with pytest.raises(compiler.CompileError, match="boom"):
        compiler.cached_compile("k", "src", "sm_90", OPTS, "v1", failing)
    assert not list(tmp_path.glob("*.cubin"))


def _elf_header(phoff: int, phnum: int, shoff: int, shnum: int) -> bytes:
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", header, 0x20, phoff, shoff)
    struct.pack_into("<HHHH", header, 0x36, 56, phnum, 64, shnum)
    return bytes(header)


def test_whole_elf_puts_back_the_byte_cupy_drops_and_nothing_else():
    header = _elf_header(phoff=200, phnum=2, shoff=64, shnum=2)  # program headers end the file at 312
    whole = header + bytes(312 - len(header))
    assert compiler.whole_elf(whole[:-1]) == whole
    assert compiler.whole_elf(whole) == whole
    assert compiler.whole_elf(whole[:-2]) == whole[:-2]  # not the one-byte loss: left as it came
    assert compiler.whole_elf(b"not an ELF file") == b"not an ELF file"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvrtc_cubins_are_whole_elf_files_cuobjdump_reads(arch, tmp_path):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from attngen.build import nvcc

    source = 'extern "C" __global__ void attngen_probe(float* x) { x[threadIdx.x] *= 2.0f; }'
    cubin = compiler.nvrtc_compile(source, "probe", compiler.NVRTC_OPTIONS, arch)
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    assert len(cubin) == max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    cuobjdump = nvcc.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not found")
    (tmp_path / "probe.cubin").write_bytes(cubin)
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "probe.cubin")], capture_output=True, text=True)
    assert sass.returncode == 0 and "Function : attngen_probe" in sass.stdout, sass.stderr
