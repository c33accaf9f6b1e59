"""The `attngen fuzz` command: search, report, write the reproducer; replay; sanitize. With
--decode, the same over attngen.decode's paged decode regime (attngen/fuzz/decode_command.py says
what differs: a Regime).

Exit status (EXIT_STATUS, also in --help and the README):
  0    every case passed and every sanitizer run was clean
  1    a kernel failure: a case failed, a replay still fails, or compute-sanitizer found something
  2    a usage or harness error: bad arguments, spec files or reproducer paths, no GPU or a missing
       package, the harness itself failing on a case (out of memory, say), or a sanitizer run
       that could not check its kernel
  130  interrupted (after printing what ran)
A run that finds a kernel failure exits 1 even if something else also went wrong.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

import click

from attngen.cli_types import FiniteFloatRange
from attngen.errors import SpecError
from attngen.faults import FAULTS

DEFAULT_OUT = "fuzz-out"
DEFAULT_EXAMPLES = 100
DEFAULT_RANDOM_SPECS = 16
DEFAULT_SANITIZE_SAMPLE = 20
DEFAULT_SANITIZE_JOBS = 4
DEFAULT_DECODE_MAX_LENGTH = 131072  # attngen/fuzz/paged.py DecodeLimits.max_length, not imported for --help
EXIT_STATUS = ("Exit status: 0 all passed (and sanitizer runs clean); 1 a kernel failure found (a failing case, a "
               "replay that still fails, a sanitizer finding); 2 a usage or harness error (bad arguments or paths, "
               "no GPU, the harness failing on a case, a sanitizer run that checked nothing); 130 interrupted.")


def make_runner(fault: str | None):
    """The thing under test: the compiled kernels on this GPU. CPU tests replace this function."""
    from attngen.fuzz.runners import KernelRunner

    return KernelRunner(fault)


def make_decode_runner():
    """The thing under test with --decode: attngen.decode on this GPU. CPU tests replace this function."""
    from attngen.fuzz.decode_runners import DecodeKernelRunner

    return DecodeKernelRunner()


def _fail_to_start(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    raise SystemExit(2)


def _status(*statuses: int) -> int:
    """The run's exit status from its parts': a kernel failure (1) outranks a harness error (2)."""
    return 1 if 1 in statuses else max(statuses, default=0)


@click.command(epilog=EXIT_STATUS)
@click.argument("specs", metavar="[SPEC]...", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--random-specs", is_flag=True,
              help="Also fuzz random specs (random problems, each pinned to a random kernel family that supports "
                   "it on this GPU, mostly with a random config that fits), drawn from the seed.")
@click.option("--random-spec-count", type=click.IntRange(min=1), default=DEFAULT_RANDOM_SPECS, show_default=True,
              help="How many random specs --random-specs adds.")
@click.option("--family", "only_families", multiple=True, metavar="NAME",
              help="Only the built-in pool's specs (and --random-specs') that run as this kernel family, e.g. "
                   "fwd_sm90; with --decode, a decode family. Repeatable. Not with SPEC files.")
@click.option("--examples", type=click.IntRange(min=1), default=DEFAULT_EXAMPLES, show_default=True,
              help="Cases to run (shrink steps not counted).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Makes the run repeatable (cases and data). [default: random, printed]")
@click.option("--time-budget", type=FiniteFloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop drawing new cases this long after the start (kernels built ahead included); a failure "
                   "found in time is still shrunk.")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None, metavar="N",
              help="Longest query/key length to draw (a single query sees up to 4N keys) [default: 4200]; with "
                   f"--decode, the longest cache [default: {DEFAULT_DECODE_MAX_LENGTH}]. Lower it when the harness "
                   "runs out of memory.")
@click.option("--decode", is_flag=True,
              help="Fuzz attngen.decode instead: new tokens against paged (shuffled, shared, NaN spare pages) and "
                   "contiguous KV caches (attngen/fuzz/paged.py), over the SPEC files or the pool's problems a "
                   "decode family runs. Not with --random-specs or --fault.")
@click.option("--out", "out_dir", default=DEFAULT_OUT, show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Where reproducers go: OUT/failures/ and, with --sanitize, OUT/sanitize/.")
@click.option("--replay", "replays", multiple=True, type=click.Path(path_type=Path), metavar="PATH",
              help="Re-run a reproducer directory (with spec.yaml and case.json) instead of fuzzing; exits 1 if it "
                   "still fails. Repeatable.")
@click.option("--sanitize", is_flag=True,
              help="Afterwards, replay one passing case per kernel under compute-sanitizer memcheck, racecheck and synccheck "
                   "(with --replay: the reproducers).")
@click.option("--sanitize-sample", type=click.IntRange(min=1), default=DEFAULT_SANITIZE_SAMPLE, show_default=True,
              help="How many kernels --sanitize covers.")
@click.option("--sanitize-jobs", type=click.IntRange(min=1), default=DEFAULT_SANITIZE_JOBS, show_default=True,
              help="Sanitizer processes to run at once.")
@click.option("--fault", type=click.Choice(sorted(FAULTS)), default=None,
              help="Run deliberately broken kernels (attngen/faults.py), to check that the fuzzer catches them "
                   "(with --replay: instead of the reproducers' recorded faults, also under --sanitize).")
def fuzz(specs, random_specs, random_spec_count, only_families, examples, seed, time_budget, max_seq_len, decode,
         out_dir, replays, sanitize, sanitize_sample, sanitize_jobs, fault) -> None:
    """Fuzz the kernels of each SPEC (default: the built-in pool) against the reference.

    The built-in pool asks each kernel family what it can run on this GPU: every family that
    supports a problem gets a spec pinned to it, with its default config and a few others.

    Hypothesis draws spec x shape x data, including seqlen 1, a single query against long keys,
    Sk < Sq, lengths around tile multiples, fully masked rows, logits near +-1e4, many heads and
    strided inputs. Outputs are NaN-poisoned before every launch. A failure is shrunk to a minimal
    case and written as a reproducer; the command that replays it is printed.

    With --decode: new tokens against KV caches (1-4 sequences, lengths 0 to 128k, 1-16 new tokens,
    pages of 1-256 tokens or a contiguous cache, forced or chosen splits), NaN wherever a decode
    must not read; each sequence's output and LSE held to the reference.
    """
    try:
        import hypothesis  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        _fail_to_start(f"attngen fuzz needs torch and hypothesis (pip install hypothesis); import failed: {exc}")
    if decode:
        _refuse_forward_options(random_specs, fault, replays)
    sanitizing = Sanitizing(sanitize_sample, sanitize_jobs) if sanitize else None
    if sanitizing is not None:
        from attngen.fuzz.sanitizer import find_compute_sanitizer

        if find_compute_sanitizer() is None:  # now, not after the fuzz run
            _fail_to_start("--sanitize needs compute-sanitizer: put it on PATH, or nvcc with it beside it "
                           "(CUDA_HOME/bin)")
    if replays:
        if specs or random_specs or only_families:
            raise click.UsageError("--replay runs reproducers: it takes no SPEC arguments, no --random-specs and no "
                                   "--family")
        raise SystemExit(_replay_all(replays, fault, sanitizing))
    if specs and only_families:
        raise click.UsageError("--family chooses among the built-in pool's specs; SPEC files run as the families "
                               "they pin or the dispatcher picks: drop one of them")
    _check_family_names(only_families, "decode" if decode else "forward")
    runner = _decode_runner() if decode else _runner(fault)
    seed = secrets.randbelow(2**32) if seed is None else seed
    try:
        if decode:
            from attngen.fuzz.decode_command import decode_pool

            pool = decode_pool(specs, runner.target, only_families)
        else:
            pool = _spec_pool(specs, random_specs, random_spec_count, seed, runner.target, only_families)
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint="SPEC") from None
    if not pool:  # --family named families none of whose specs run here
        _refuse_families(only_families, decode, runner.target)
    regime, limits = _regime(decode, max_seq_len)
    raise SystemExit(_fuzz(pool, runner, regime, examples=examples, seed=seed, limits=limits,
                           time_budget=time_budget, out_dir=out_dir, fault=fault, sanitizing=sanitizing))


def _refuse_forward_options(random_specs: bool, fault: str | None, replays) -> None:
    """--decode with an option of the forward fuzz only: a usage error naming both."""
    if random_specs:
        raise click.UsageError("--decode fuzzes the SPEC files or the pool's decode problems; --random-specs draws "
                               "forward problems and kernel configs: drop one of them")
    if fault is not None:
        raise click.UsageError("--fault breaks forward kernels (attngen/faults.py); --decode runs attngen.decode, "
                               "which has no faults: drop one of them")
    if replays:
        raise click.UsageError("--replay reads whether a reproducer is a forward or a decode case from its case.json: "
                               "it takes no --decode")


@dataclass(frozen=True)
class Regime:
    """What the forward fuzz and --decode do differently; the rest of a run (progress, the failure, its
    reproducer, the sanitizer, the exit status) is shared."""

    name: str  # the command, as the first line and the table's title say it
    search: Callable  # search.search's signature
    print_summary: Callable  # (outcome) -> None
    families: Callable  # (pool, target) -> "fwd_sm80: 12, ...": which families run the pool
    longest: Callable  # (limits) -> the longest length drawn, which --max-seq-len sets
    more_kernels: str  # how a run reaches more kernels, for the sanitizer's sample
    compile_ahead: Callable  # (pool, runner, examples) -> a line saying what was built before the first case, or None


def _regime(decode: bool, max_seq_len: int | None) -> tuple[Regime, object]:
    """The regime and its limits (the help's defaults, or --max-seq-len)."""
    if decode:
        from attngen.fuzz.decode_command import decode_limits, decode_regime

        return decode_regime(), decode_limits(max_seq_len)
    from attngen.fuzz.report import print_summary
    from attngen.fuzz.search import search

    return Regime("attngen fuzz", search, print_summary, _families, lambda limits: limits.max_seq,
                  "specs or --random-specs", compile_ahead_line), _limits(max_seq_len)


def compile_ahead_line(pool, runner, examples: int) -> str | None:
    """The pool's kernels built in parallel before the first case (attngen/fuzz/compile_ahead.py), where the run
    has a case for each spec at least; a runner without kernels (the CPU tests' reference) builds none."""
    built = runner.compile_ahead(pool) if examples >= len(pool) else None
    return None if built is None else built.line()


@dataclass(frozen=True)
class Sanitizing:
    sample: int  # kernels
    jobs: int  # processes at once


def _runner(fault):
    try:
        return make_runner(fault)
    except RuntimeError as exc:
        _fail_to_start(str(exc))


def _decode_runner():
    try:
        return make_decode_runner()
    except RuntimeError as exc:
        _fail_to_start(str(exc))


def _limits(max_seq_len: int | None):
    from attngen.fuzz.strategies import DEFAULT_LIMITS

    return DEFAULT_LIMITS if max_seq_len is None else DEFAULT_LIMITS.up_to(max_seq_len)


def _refuse_families(only_families, decode: bool, target) -> NoReturn:
    """A usage error: none of the built-in pool's specs runs as the --family names on this target."""
    from attngen.fuzz.pool import builtin_specs

    if decode:
        from attngen.fuzz.decode_command import decode_family, decode_pool

        here = {decode_family(spec, target) for spec in decode_pool((), target)}
    else:
        here = {_forward_family(spec, target) for spec in builtin_specs(target)}
    names, them = ", ".join(map(repr, only_families)), "it" if len(only_families) == 1 else "them"
    raise click.BadParameter(f"{names}: no spec of the built-in pool runs as {them} on {target.name}; families that "
                             f"run here: {', '.join(sorted(here)) or 'none'}", param_hint="--family")


def _forward_family(spec, target) -> str:
    """The family that runs `spec` on `target`."""
    from attngen.families import plan_spec

    return plan_spec(spec, target).family


def _check_family_names(names, operation: str) -> None:
    """--family names: each a registered family of the operation the run fuzzes."""
    from attngen import families

    allowed = families.registry(operation)
    for name in names:
        if name not in allowed:
            raise click.BadParameter(f"{name!r} is not a {operation} kernel family; allowed: {', '.join(allowed)}",
                                     param_hint="--family")


def _spec_pool(paths, random_specs: bool, random_spec_count: int, seed: int, target, only_families=()) -> tuple:
    """The given spec files' specs, else the built-in pool, for the runner's target; plus random specs;
    with only_families, the built-in and random specs pinned to those families only."""
    from attngen import families
    from attngen.families import plan_spec
    from attngen.fuzz.pool import builtin_specs, of_families, random_spec_pool
    from attngen.specfile import load_spec

    given = [load_spec(path) for path in paths]
    for spec in given:
        if spec.dropout_p:
            raise SpecError(f"{spec.source}: dropout_p={spec.dropout_p}: the fuzzer compares kernels with the "
                            "reference without dropout; allowed: dropout_p 0 (tests/test_gpu_dropout.py tests dropout)",
                            field="dropout_p")
        # A family that cannot run here, a config this GPU cannot hold, or a family of another
        # operation (a decode or backward spec) is an error naming the file, not a failing case.
        try:
            plan_spec(spec, target, operation="forward")
        except SpecError as exc:
            hint = " (fuzz it with --decode)" if spec.family and families.get_family(spec.family).operation == "decode" \
                else ""
            raise SpecError(f"{exc}{hint}", field=exc.field) from None
    pool = given or of_families(builtin_specs(target), only_families, lambda spec: _forward_family(spec, target))
    if random_specs:
        try:
            pool += random_spec_pool(seed, random_spec_count, target, only_families or None)
        except ValueError as exc:  # no family (of those named) plans the random problems on this target
            raise click.BadParameter(str(exc), param_hint="--family" if only_families else "--random-specs") from None
    return tuple(dict.fromkeys(pool))


def _families(pool, target) -> str:
    """How many of the pool's specs run as each family on the target: "fwd_sm80: 12"."""
    from collections import Counter

    counts = Counter(_forward_family(spec, target) for spec in pool)
    return ", ".join(f"{family}: {n}" for family, n in counts.items())


def _fuzz(pool, runner, regime: Regime, *, examples, seed, limits, time_budget, out_dir: Path, fault,
          sanitizing) -> int:
    from attngen.fuzz.report import Progress

    budget = f", time budget {time_budget:g} s" if time_budget else ""
    click.echo(f"{regime.name}: {len(pool)} specs, up to {examples} cases, seed {seed}{budget}"
               f"{f', fault {fault}' if fault else ''}\n  target {runner.target.name}, families "
               f"{regime.families(pool, runner.target)}")
    start = time.monotonic()
    line = regime.compile_ahead(pool, runner, examples)
    if line:
        click.echo(line)
    if time_budget:  # the budget counts from the start: kernels built ahead take their time from it
        time_budget = max(time_budget - (time.monotonic() - start), 1e-3)
    with _hypothesis_files_under(out_dir), Progress(examples) as progress:
        outcome = regime.search(pool, runner, examples=examples, seed=seed, time_budget=time_budget, limits=limits,
                                on_case=progress.update)
    regime.print_summary(outcome)
    status = 0
    if outcome.failure is not None:
        _report_failure(outcome, out_dir / "failures", runner.machine, fault)
        status = 1
    if outcome.harness_error is not None:
        _report_harness_error(outcome.harness_error, regime.longest(limits))
        return _status(status, 2)
    if outcome.stopped == "interrupted":
        return 130
    if sanitizing is not None:
        from attngen.fuzz.reproducer import reproducer_dir, write_reproducer
        from attngen.fuzz.sanitizer import choose_samples

        chosen = choose_samples(outcome.kernels.values(), sanitizing.sample)
        if len(chosen) < sanitizing.sample:
            click.echo(f"note: --sanitize-sample {sanitizing.sample}, but only {len(chosen)} kernels have a passing "
                       f"case in this run (add {regime.more_kernels})")
        samples = [(s.kernel, write_reproducer(reproducer_dir(out_dir / "sanitize", s.sample, s.kernel), s.sample,
                                               kernel=s.kernel, machine=runner.machine, fault=fault)) for s in chosen]
        status = _status(status, _sanitize(samples, sanitizing.jobs, fault))
    return status


@contextlib.contextmanager
def _hypothesis_files_under(out_dir: Path):
    """Hypothesis keeps caches (not an example database: search() uses none) in ./.hypothesis by
    default; the tool keeps them under --out instead, unless HYPOTHESIS_STORAGE_DIRECTORY says where."""
    from hypothesis.configuration import set_hypothesis_home_dir

    if "HYPOTHESIS_STORAGE_DIRECTORY" in os.environ:
        yield
        return
    set_hypothesis_home_dir(out_dir / ".hypothesis")
    try:
        yield
    finally:
        set_hypothesis_home_dir(None)


def _report_failure(outcome, failures_dir: Path, machine, fault) -> None:
    from attngen.fuzz.check import FAILURE_KINDS
    from attngen.fuzz.reproducer import replay_command, reproducer_dir, write_reproducer

    failure = outcome.failure
    path = write_reproducer(reproducer_dir(failures_dir, failure.case, failure.kernel), failure.case,
                            kernel=failure.kernel, machine=machine, fault=fault, failure=failure)
    if outcome.shrunk:
        how = f"shrunk in {outcome.shrink_steps} steps from: {outcome.first_failure.case.label()}"
    elif outcome.harness_error is not None:
        how = "not shrunk: the harness failed while shrinking it (below)"
    elif outcome.flaky:
        how = "not shrunk: it passed when run again (a race, or a read of uninitialised memory?)"
    else:
        how = "not shrunk: the GPU context is unusable after this error; the replay runs in a fresh process"
    click.echo(f"\nFAILED ({failure.kind}: {FAILURE_KINDS[failure.kind]})\n"
               f"  kernel: {failure.kernel}\n  case:   {failure.case.label()}\n  {how}\n"
               f"  detail: {failure.detail}\n  reproducer: {path}\n"
               f"replay it with:\n  {replay_command(path)}")


def _report_harness_error(result, longest: int) -> None:
    from attngen.fuzz.check import HARNESS_MEANING

    click.echo(f"\nerror: {HARNESS_MEANING}; the run stopped there.\n  kernel: {result.kernel}\n"
               f"  case:   {result.case.label()}\n  detail: {result.detail}\n"
               f"If it ran out of memory, lower --max-seq-len (this run: {longest}).", err=True)


def _replay_all(paths, fault, sanitizing: Sanitizing | None) -> int:
    from attngen.fuzz.reproducer import load_reproducer, replay
    from attngen.fuzz.sanitizer import LAUNCHED_LINE

    loaded = []
    for path in paths:
        try:
            loaded.append(load_reproducer(path))
        except ValueError as exc:  # SpecError included: a damaged spec.yaml
            raise click.BadParameter(str(exc), param_hint="'--replay'") from None
    decode = [repro.path for repro in loaded if repro.kind == "decode"]
    if fault is not None and decode:
        raise click.UsageError(f"--fault breaks forward kernels (attngen/faults.py), and {decode[0]} is a decode "
                               "reproducer (attngen.decode has no faults): replay it without --fault")
    runners: dict = {}  # by kind and fault
    kernels = []  # the symbol each reproducer's case runs as here: what the sanitizer instruments
    status = 0
    for repro in loaded:
        use_fault = fault if fault is not None else repro.fault
        key = (repro.kind, use_fault)
        if key not in runners:
            runners[key] = _decode_runner() if repro.kind == "decode" else _runner(use_fault)
        runner = runners[key]
        launched = getattr(runner, "launched", [])
        before = len(launched)
        result, warnings = replay(repro, runner)
        kernels.append(result.kernel)
        for warning in warnings:
            click.echo(f"warning: {repro.path}: {warning}", err=True)
        verdict = "PASS" if result.ok else "ERROR" if result.harness_error else "FAIL"
        click.echo(f"{verdict} {repro.path}: {result.describe()}")
        for symbol in dict.fromkeys(launched[before:]):
            click.echo(LAUNCHED_LINE.format(symbol))
        status = _status(status, 0 if result.ok else 2 if result.harness_error else 1)
    if sanitizing is not None:
        samples = [(kernel, repro.path) for kernel, repro in zip(kernels, loaded)]
        status = _status(status, _sanitize(samples, sanitizing.jobs, fault))
    return status


def _sanitize(samples, jobs: int, fault) -> int:
    from attngen.fuzz.report import print_table
    from attngen.fuzz.sanitizer import TOOLS, sanitize

    click.echo(f"compute-sanitizer: {len(samples)} kernels x {', '.join(TOOLS)}, one process each, {jobs} at a time")
    results = sanitize(samples, jobs=jobs, fault=fault,
                       on_result=lambda r: click.echo(f"  {r.tool:<9} {r.kernel}: {r.finding or 'clean'}"))
    by_kernel: dict[str, dict[str, str]] = {}
    for r in results:
        by_kernel.setdefault(r.kernel, {})[r.tool] = r.finding or "clean"
    print_table("compute-sanitizer", ["kernel", *TOOLS],
                [[kernel, *(cells.get(tool, "-") for tool in TOOLS)] for kernel, cells in by_kernel.items()])
    dirty = [r for r in results if not r.clean]
    for r in dirty:
        what = "finding" if r.kernel_finding else "harness error (the kernel was not checked)"
        click.echo(f"\n{r.tool} {what} for {r.kernel} ({r.finding}); rerun with:\n  {shlex.join(r.command)}\n"
                   f"{r.report.excerpt or r.output_tail}")
    click.echo(f"sanitizer: {len(results) - len(dirty)}/{len(results)} runs clean over {len(by_kernel)} kernels")
    return _status(*(1 if r.kernel_finding else 2 for r in dirty))
