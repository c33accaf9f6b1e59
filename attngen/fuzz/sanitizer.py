"""compute-sanitizer over a sample of cases: memcheck (out-of-bounds and misaligned accesses),
racecheck (shared-memory hazards) and synccheck (barriers used where not every thread arrives,
and the like).

Each (case, tool) pair runs in its own process,
  compute-sanitizer --tool T --kernel-name kns=<kernel> python -m attngen.cli fuzz --replay DIR [--fault F]
so a finding belongs to one kernel, a crash takes no other case with it, and only the kernel
under test is instrumented (the reference's kernels run uninstrumented). <kernel> is the name of
the plan the caller's runner makes for the case's spec on this GPU's target (fault included),
not the name a reproducer recorded elsewhere. torch's caching allocator is switched off
(PYTORCH_NO_CUDA_MEMORY_CACHING=1) so every tensor is its own allocation and memcheck sees an
access past its end.

`kns=` matches kernel symbols that contain <kernel>: every __global__ function of a plan has the
plan's name in its symbol (tests/test_fuzz_sanitizer.py checks each family), so all of a plan's
kernels are instrumented. A filter that matches no launched kernel instruments nothing and still
prints a clean summary, so the replay prints a `launched kernel <plan name>` line for every plan
it launched (LAUNCHED_LINE), and a run is clean only when: the tool printed its summary with no
errors or hazards, the replay launched the instrumented plan, and the replay itself passed (exit 0).

Each problem is a kernel finding (errors, hazards, a replay that still fails or crashes, a
timeout) or a harness error (the replay exited 2: it could not run; no summary: the sanitizer
did not finish; the kernel never launched: nothing was checked).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from attngen.build.nvcc import find_nvcc
from attngen.families import plan_spec
from attngen.fuzz.case import FuzzCase
from attngen.targets import Target

TOOLS = ("memcheck", "racecheck", "synccheck")
TIMEOUT_S = 900
# Instrumented kernels run 10-1000x slower: the sample prefers cases below this many scores.
SANITIZE_MAX_SCORES = 2**21

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?")
_RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_QUIET_LINES = re.compile(r"^=+\s*(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|$)")
LAUNCHED_LINE = "launched kernel {}"  # what a replay prints for each plan (by name) it launched
_LAUNCHED = re.compile(r"^launched kernel (\S+)$", re.MULTILINE)
HARNESS_EXIT = 2  # `attngen fuzz --replay` could not run: a usage or harness error, not a kernel finding
EXCERPT_LINES = 12


def sample_key(case: FuzzCase, target: Target) -> tuple:
    """Smaller is a better case to sanitize: cheap, with partial tiles (of the spec's plan on `target`)
    and non-trivial strides."""
    plan = plan_spec(case.spec, target)
    edges = ((case.seq_q % plan.block_m != 0) + (case.seq_k % plan.block_n != 0) + (case.seq_q != case.seq_k)
             + (case.layout != "contiguous") + (case.batch * case.heads_kv > 1))
    return (case.score_elements > SANITIZE_MAX_SCORES, -edges, case.score_elements)


def choose_samples(kernel_stats, count: int) -> list:
    """Up to `count` kernels that have a passing sample case, in name order (KernelStats from a search)."""
    return sorted((s for s in kernel_stats if s.sample is not None), key=lambda s: s.kernel)[:count]


def find_compute_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else beside nvcc (CUDA toolkits ship both in bin/); None if neither."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    nvcc = find_nvcc()
    candidate = Path(nvcc).parent / "compute-sanitizer" if nvcc else None
    return str(candidate) if candidate is not None and os.access(candidate, os.X_OK) else None


def sanitizer_command(sanitizer: str, tool: str, kernel: str, case_dir: Path, python: str = sys.executable,
                      fault: str | None = None) -> list[str]:
    """`fault`: replay with this fault instead of the reproducer's (`attngen fuzz --fault`)."""
    if tool not in TOOLS:
        raise ValueError(f"tool={tool!r} is invalid; allowed: {', '.join(TOOLS)}")
    return [sanitizer, "--tool", tool, "--kernel-name", f"kns={kernel}", "--report-api-errors", "no",
            python, "-m", "attngen.cli", "fuzz", "--replay", str(case_dir), *(("--fault", fault) if fault else ())]


@dataclass(frozen=True)
class SanitizerReport:
    summary_found: bool
    errors: int
    warnings: int
    excerpt: str  # the first lines of the findings
    launched: tuple[str, ...] = ()  # the kernel symbols the replay says it launched


def parse_report(text: str) -> SanitizerReport:
    """Read memcheck's and synccheck's `ERROR SUMMARY: N errors` and racecheck's `RACECHECK SUMMARY: N
    hazards displayed (E errors, W warnings)` out of the sanitizer's output, and the replay's LAUNCHED_LINEs."""
    errors = [int(m.group(1)) for m in _ERROR_SUMMARY.finditer(text)]
    races = [(int(m.group(2)), int(m.group(3))) for m in _RACECHECK_SUMMARY.finditer(text)]
    findings = [line for line in text.splitlines() if line.startswith("=") and not _QUIET_LINES.match(line)]
    return SanitizerReport(
        summary_found=bool(errors or races),
        errors=max(errors + [e for e, _ in races], default=0),
        warnings=max((w for _, w in races), default=0),
        excerpt="\n".join(findings[:EXCERPT_LINES]),
        launched=tuple(dict.fromkeys(_LAUNCHED.findall(text))),
    )


@dataclass(frozen=True)
class SanitizerResult:
    kernel: str
    tool: str
    case_dir: Path
    command: tuple[str, ...]
    returncode: int | None  # None: timed out
    report: SanitizerReport
    output_tail: str = ""

    @property
    def problems(self) -> list[tuple[str, str]]:
        """(kind, what) for each problem: kind "kernel" (a finding about the kernel) or "harness"
        (the run could not check the kernel). Empty when the run is clean."""
        if self.returncode is None:
            return [("kernel", "timed out")]
        problems = []
        if self.returncode == HARNESS_EXIT:
            problems.append(("harness", f"the replay could not run (exit status {HARNESS_EXIT}: a usage or harness "
                                        "error, not a kernel finding)"))
        if not self.report.summary_found:  # the sanitizer did not finish: nothing below is known
            return problems or [("harness", f"no {self.tool} summary in the output (exit status {self.returncode})")]
        if self.returncode != HARNESS_EXIT and self.kernel not in self.report.launched:
            launched = ", ".join(self.report.launched) or "no kernel"
            problems.append(("harness", f"{self.kernel} never launched, so nothing was instrumented (the replay "
                                        f"launched {launched})"))
        if self.report.errors:
            problems.append(("kernel", f"{self.report.errors} errors"))
        if self.report.warnings:
            problems.append(("kernel", f"{self.report.warnings} warnings"))
        if self.returncode not in (0, HARNESS_EXIT):
            problems.append(("kernel", f"the replay exited with status {self.returncode}"))
        return problems

    @property
    def finding(self) -> str:
        """What is wrong, or "" when the run is clean."""
        return ", ".join(what for _, what in self.problems)

    @property
    def clean(self) -> bool:
        return not self.problems

    @property
    def kernel_finding(self) -> bool:
        return any(kind == "kernel" for kind, _ in self.problems)


def sanitize(samples: list[tuple[str, Path]], *, tools=TOOLS, sanitizer: str | None = None, timeout: float = TIMEOUT_S,
             jobs: int = 1, on_result: Callable[[SanitizerResult], None] | None = None,
             fault: str | None = None) -> list[SanitizerResult]:
    """Run every tool over every (kernel, reproducer directory) sample, one process each, `jobs` at a time.
    `kernel` is the symbol the replay launches on this GPU; `fault` overrides the reproducers' faults."""
    sanitizer = sanitizer or find_compute_sanitizer()
    if sanitizer is None:
        raise FileNotFoundError("compute-sanitizer not found: put it on PATH, or nvcc with it beside it "
                                "(CUDA_HOME/bin)")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")

    def run_one(job) -> SanitizerResult:
        (kernel, case_dir), tool = job
        command = sanitizer_command(sanitizer, tool, kernel, case_dir, fault=fault)
        returncode, output = _run(command, env, timeout)
        return SanitizerResult(kernel, tool, case_dir, tuple(command), returncode, parse_report(output),
                               output_tail="\n".join(output.splitlines()[-EXCERPT_LINES:]))

    results = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(run_one, [(sample, tool) for sample in samples for tool in tools]):
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def _run(command: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    # A session of its own, so a timeout ends the sanitizer and the process it runs, and nothing else.
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
            return proc.returncode, output
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return None, output
