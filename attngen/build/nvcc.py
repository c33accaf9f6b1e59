"""Offline compiles with the machine's nvcc: no GPU needed.

The run-time path compiles with NVRTC (attngen/build/compiler.py); this module is for
checks that run anywhere nvcc is installed (CI, `attngen check`): it builds a
cubin with `ptxas -v` and reads back the resource report (registers, shared
memory, stack, spills), so a template change that makes a kernel spill fails
before it ever reaches a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from attngen.errors import CompileError

NVCC_FLAGS = ("-cubin", "-std=c++17", "-Xptxas", "-v")
TIMEOUT_S = 600


@dataclass(frozen=True)
class ResourceReport:
    """What ptxas reports for one kernel. Spills are summed over every function in the module."""

    name: str
    arch: str
    registers: int
    smem_static_bytes: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    # Dynamic shared memory is not known to ptxas: it is the plan's smem_bytes, passed in.
    smem_dynamic_bytes: int = 0
    log: str = field(default="", compare=False, repr=False)
    # Every kernel of the module by symbol (this one included), when it has more than one.
    kernels: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    @property
    def smem_total_bytes(self) -> int:
        return self.smem_static_bytes + self.smem_dynamic_bytes


def find_nvcc() -> str | None:
    """nvcc on PATH, else $CUDA_HOME/bin/nvcc (then $CUDA_PATH, /usr/local/cuda); None if none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidate = Path(root) / "bin" / "nvcc"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def nvcc_available() -> bool:
    return find_nvcc() is not None


NVCC_MISSING = "nvcc not found: put it on PATH or set CUDA_HOME to the CUDA toolkit"


def require_nvcc() -> str:
    """The nvcc path, or CompileError saying how to provide one."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CompileError(NVCC_MISSING)
    return nvcc


def gencode(target: str) -> str:
    """nvcc's flag for exactly `target` (sm_90a: the -gencode form, which never runs a plain sm_90 pass)."""
    arch = target.removeprefix("sm_")
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    """The toolkit version nvcc reports, e.g. '13.0.88'."""
    nvcc = require_nvcc()
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"\bV(\d+(?:\.\d+)+)", out) or re.search(r"release (\d+\.\d+)", out)
    if match is None:
        raise CompileError(f"cannot read the version from `{nvcc} --version`", log=out)
    return match.group(1)


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str, name: str, arch: str, smem_dynamic_bytes: int = 0) -> ResourceReport:
    """Read the `ptxas -v` report of entry function `name` out of an nvcc log."""
    entries: dict[str, dict[str, int]] = {}
    frames: dict[str, tuple[int, int, int]] = {}
    current = props_of = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
            entries.setdefault(current, {})
        elif m := _PROPS.search(line):
            props_of = m.group(1)
        elif (m := _FRAME.search(line)) and props_of is not None:
            frames[props_of] = tuple(int(x) for x in m.groups())
            props_of = None
        elif (m := _USED.search(line)) and current is not None:
            entries[current]["registers"] = int(m.group(1))
            smem = _SMEM.search(line)
            entries[current]["smem"] = int(smem.group(1)) if smem else 0
    if name not in entries or "registers" not in entries[name]:
        raise CompileError(
            f"ptxas reported no resource usage for kernel {name!r} on {arch} "
            f"(entries seen: {sorted(entries) or 'none'})",
            log=log,
        )
    stack = frames.get(name, (0, 0, 0))[0]
    return ResourceReport(
        name=name,
        arch=arch,
        registers=entries[name]["registers"],
        smem_static_bytes=entries[name]["smem"],
        stack_frame_bytes=stack,
        spill_store_bytes=sum(f[1] for f in frames.values()),
        spill_load_bytes=sum(f[2] for f in frames.values()),
        smem_dynamic_bytes=smem_dynamic_bytes,
        log=log,
    )


def compile_with_nvcc(source: str, arch: str, name: str, smem_dynamic_bytes: int = 0, *,
                      kernels: dict[str, int] | None = None, keep_cubin: Path | None = None) -> ResourceReport:
    """Compile `source` to a cubin for target `arch` (e.g. sm_90a) and return the ptxas report for
    kernel `name` (`kernels`: {symbol: dynamic smem} of every kernel, all reported in `.kernels`).

    On failure raises CompileError with the compiler log and the path of the source,
    which is kept (the temporary directory is removed only on success). `keep_cubin`: copy the
    cubin there (for reading its SASS).
    """
    nvcc = require_nvcc()
    workdir = Path(tempfile.mkdtemp(prefix=f"attngen-nvcc-{name}-{arch}-"))
    src = workdir / f"{name}.cu"
    src.write_text(source)
    cmd = [nvcc, *NVCC_FLAGS, gencode(arch), str(src), "-o", str(workdir / f"{name}.cubin")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise CompileError(f"nvcc timed out after {TIMEOUT_S} s compiling {name} for {arch}", log, str(src)) from None
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CompileError(
            f"nvcc failed (exit {proc.returncode}) compiling {name} for {arch}: {' '.join(cmd)}", log, str(src)
        )
    try:
        report = parse_ptxas(log, name, arch, smem_dynamic_bytes)
        others = {k: parse_ptxas(log, k, arch, smem) for k, smem in (kernels or {}).items() if k != name}
    except CompileError as exc:
        raise CompileError(str(exc).split("\n", 1)[0], log, str(src)) from None
    if keep_cubin is not None:
        shutil.copyfile(workdir / f"{name}.cubin", keep_cubin)
    shutil.rmtree(workdir, ignore_errors=True)
    return dataclasses.replace(report, kernels={name: report, **others}) if others else report


def check_plan(plan, *, keep_cubin: Path | None = None) -> ResourceReport:
    """Render a family's plan and compile it with nvcc for the plan's target: the report of its first
    kernel (the others under `.kernels`), carrying each kernel's dynamic shared memory."""
    from attngen.families import get_family

    source = get_family(plan.family).render(plan)
    first = plan.kernels[0]
    return compile_with_nvcc(source, plan.target.name, first.symbol, first.smem_bytes,
                             kernels={k.symbol: k.smem_bytes for k in plan.kernels}, keep_cubin=keep_cubin)


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, else beside nvcc; None if neither (pip: nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = find_nvcc()
    beside = Path(nvcc).resolve().with_name("cuobjdump") if nvcc else None
    return str(beside) if beside is not None and beside.is_file() else None


def sass(cubin: Path) -> str:
    """The disassembly of a cubin (cuobjdump -sass)."""
    tool = find_cuobjdump()
    if tool is None:
        raise CompileError("cuobjdump not found: put it on PATH (it comes with the CUDA toolkit, or pip install "
                           "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm and add their bin directory)")
    proc = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CompileError(f"cuobjdump -sass {cubin} failed (exit {proc.returncode})", proc.stdout + proc.stderr)
    return proc.stdout
