"""The `attngen` command line: generate (no GPU), check (nvcc, no GPU), bench and tune (GPU)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import click

import attngen
from attngen.cli_types import FiniteFloatRange
from attngen.errors import CompileError, SpecError
from attngen.spec import AttentionSpec
from attngen.targets import allowed_archs

DEFAULT_GENERATED = "generated"
DEFAULT_BENCH_OUT = "bench/results"
GENERATOR = "attngen generate"  # what a manifest says made it: --prune deletes only such files
DEFAULT_CHECK_ARCHS = ("sm_80", "sm_90a")


# -- generate -----------------------------------------------------------------
PACKAGE_ROOT = Path(attngen.__file__).resolve().parent  # manifests name templates relative to its parent


def manifest(plan, source: str) -> dict:
    """What generated/<name>.json records: the resolved spec, the plan, the templates, the source hash."""
    from attngen.families import get_family

    from attngen.spec import is_set

    spec = {**{k: v for k, v in vars(plan.problem).items() if is_set(k, v)}, "family": plan.family,
            "config": plan.config.to_dict(), "arch": plan.target.name}
    return {
        "generator": GENERATOR,
        "name": plan.name,
        "attngen_version": attngen.__version__,
        "spec": spec,
        "plan": {
            "family": plan.family,
            "target": plan.target.name,
            "config": plan.config.to_dict(),
            "block_m": plan.block_m,
            "block_n": plan.block_n,
            "kernels": [{"symbol": k.symbol, "threads": k.threads, "smem_bytes": k.smem_bytes,
                         "params_bytes": k.abi.size} for k in plan.kernels],
            **plan.choices(),
        },
        "templates": family_templates(get_family(plan.family)),
        "source": f"{plan.name}.cu",
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
    }


def family_templates(family) -> list[str]:
    """Every template of a family's folder and the headers each inlines, in the order they are named, as
    paths from the package's parent (attngen/families/fwd_sm80/fwd.cu.j2, attngen/cuda/ptx.cuh)."""
    from attngen.codegen.render import SHARED_HEADERS, template_files

    found: dict[str, None] = {}
    for template in sorted(p.name for p in family.folder.glob("*.cu.j2")):
        for name in template_files(family.folder, template):
            path = family.folder / name if (family.folder / name).is_file() else SHARED_HEADERS / name
            found[path.resolve().relative_to(PACKAGE_ROOT.parent).as_posix()] = None
    return list(found)


def kernel_files(spec: AttentionSpec) -> dict[str, str]:
    """The files `attngen generate` writes for one spec: {file name: text}. Deterministic."""
    from attngen.families import get_family, plan_spec

    plan = plan_spec(spec)
    source = get_family(plan.family).render(plan)
    meta = json.dumps(manifest(plan, source), indent=2, sort_keys=True) + "\n"
    return {f"{plan.name}.cu": source, f"{plan.name}.json": meta}


@dataclass(frozen=True)
class GeneratedKernel:
    """A kernel an earlier `attngen generate` wrote, found by its manifest."""

    manifest: Path
    source: Path
    edited: bool  # the source no longer holds what attngen wrote: --prune leaves both files alone


# attngen 0.1 manifests had no "generator" field; these keys identify them.
_MANIFEST_0_1_KEYS = {"attngen_version", "name", "plan", "source", "source_sha256", "spec", "templates"}


def generated_by_attngen(path: Path) -> GeneratedKernel | None:
    """The kernel whose manifest is `path`, or None when `path` is not an attngen manifest. A manifest
    is attngen's when it says `attngen generate` made it (attngen 0.1's: has exactly its keys), is
    named <name>.json and names <name>.cu as its source, in the same directory."""
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("generator") != GENERATOR and not (set(meta) == _MANIFEST_0_1_KEYS
                                                   and str(meta["attngen_version"]).startswith("0.1.")):
        return None
    name, sha = meta.get("name"), meta.get("source_sha256")
    if not isinstance(name, str) or path.name != f"{name}.json" or meta.get("source") != f"{name}.cu" \
            or not isinstance(sha, str):
        return None
    source = path.with_name(f"{name}.cu")
    try:
        edited = hashlib.sha256(source.read_bytes()).hexdigest() != sha
    except FileNotFoundError:
        edited = False
    except OSError:  # a directory, say: not what attngen wrote
        edited = True
    return GeneratedKernel(path, source, edited)


def prune(out_dir: Path, keep: set[str]) -> None:
    """Delete the kernels in `out_dir` that attngen generated (by their manifests) and that are not in
    `keep`; every other file is left alone, and so is a generated source someone edited."""
    for manifest_path in sorted(out_dir.glob("*.json")):
        found = generated_by_attngen(manifest_path)
        if found is None or found.manifest.name in keep:
            continue
        if found.edited:
            click.echo(f"kept      {found.source}: edited since attngen generated it (delete it and "
                       f"{found.manifest.name} by hand)")
            continue
        for stale in (found.source, found.manifest):
            if stale.is_file():
                stale.unlink()
                click.echo(f"removed   {stale}")


# -- check ----------------------------------------------------------------------
def check_spec(spec: AttentionSpec, arch: str, *, keep_cubin: Path | None = None):
    """nvcc-compile a spec for one target, as the runtime would on such a GPU: the plan is
    plan_spec(spec, target(arch)). The ptxas report; `keep_cubin`: copy the cubin there (for its SASS)."""
    from attngen import targets
    from attngen.build.nvcc import check_plan
    from attngen.families import plan_spec

    return check_plan(plan_spec(spec, targets.target(arch)), keep_cubin=keep_cubin)


# -- commands ---------------------------------------------------------------------
class _CleanErrors(click.Group):
    """Input and compile errors end the command with `error: ...` and exit 1, no traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (SpecError, CompileError, ValueError, OSError) as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


SPEC_ARG = click.argument("specs", metavar="SPEC...", nargs=-1, required=True, type=click.Path(path_type=Path))


@click.group(cls=_CleanErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(attngen.__version__, prog_name="attngen")
def main() -> None:
    """attngen: FlashAttention kernels compiled from declarative specs."""


@main.command()
@SPEC_ARG
@click.option("-o", "--out", "out_dir", default=DEFAULT_GENERATED, show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Directory for the .cu and .json files.")
@click.option("--prune", "prune_stale", is_flag=True,
              help="Delete kernels an earlier `attngen generate` wrote to DIR (by their manifests) that no given "
                   "spec produces now; other files, and generated sources edited since, are never touched.")
def generate(specs: tuple[Path, ...], out_dir: Path, prune_stale: bool) -> None:
    """Render each SPEC file to DIR/<name>.cu plus a DIR/<name>.json manifest (no GPU needed)."""
    from attngen.codegen.render import write_if_different

    files: dict[str, str] = {}
    origin: dict[str, Path] = {}
    for path in specs:
        for fname, text in kernel_files(attngen.load_spec(path)).items():
            if files.get(fname, text) != text:
                raise SpecError(f"{origin[fname]} and {path} both produce {fname}, with different content",
                                field=None)
            files[fname], origin[fname] = text, path
    try:  # a usage error naming --out, not an OSError's errno text
        if out_dir.exists() and not out_dir.is_dir():
            raise NotADirectoryError(20, "it exists and is not a directory")
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"{out_dir}: {exc.strerror}; allowed: a directory that exists or can be created",
                                 param_hint="'-o' / '--out'") from None
    for fname, text in sorted(files.items()):
        target = out_dir / fname
        try:
            wrote = write_if_different(target, text)
        except OSError as exc:
            raise click.BadParameter(f"cannot write {target}: {exc.strerror}", param_hint="'-o' / '--out'") from None
        click.echo(f"{'wrote    ' if wrote else 'unchanged'} {target}")
    if prune_stale and out_dir.is_dir():
        prune(out_dir, set(files))


@main.command()
@SPEC_ARG
@click.option("--arch", "archs", multiple=True, type=click.Choice(allowed_archs()),
              help=f"Target to compile for; repeat for several [default: {', '.join(DEFAULT_CHECK_ARCHS)}, each SPEC "
                   "on those of them it runs on].")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Parallel nvcc runs [default: CPUs].")
@click.option("--configs", is_flag=True,
              help="Show every (kernel family, config) of each SPEC on each --arch: resources, occupancy, predicted "
                   "time, pruning verdict.")
@click.option("--seqlen", "seqlens", multiple=True, type=click.IntRange(min=1),
              help="With --configs: sequence length to predict for; repeat for several [default: 4096].")
@click.option("--batch-heads", "batch_heads", multiple=True, type=click.IntRange(min=1),
              help="With --configs: batch x query heads [default: 16k tokens, hidden 2048].")
def check(specs: tuple[Path, ...], archs: tuple[str, ...], jobs: int | None, configs: bool,
          seqlens: tuple[int, ...], batch_heads: tuple[int, ...]) -> None:
    """Compile each SPEC with nvcc and show the ptxas resource report; fails on spills or errors.
    With --configs: every (kernel family, config) of each SPEC, pruned and ranked as `attngen tune` would."""
    named = bool(archs)  # a target asked for by name must run every SPEC; the defaults skip where one cannot
    archs = archs or DEFAULT_CHECK_ARCHS
    if configs:
        from attngen.tune.commands import check_configs

        return check_configs(specs, archs, seqlens or (4096,), batch_heads, jobs)
    if seqlens or batch_heads:
        raise click.UsageError("--seqlen and --batch-heads only apply with --configs")
    from rich.console import Console
    from rich.table import Table

    from attngen import targets
    from attngen.build.nvcc import nvcc_version, require_nvcc

    require_nvcc()
    loaded = [attngen.load_spec(path) for path in specs]
    jobs_list, skipped = [], []
    for path, spec in zip(specs, loaded):
        for arch in dict.fromkeys(archs):
            reason = None if named else _cannot_run(spec, targets.target(arch))
            if reason is None:
                jobs_list.append((path, spec, arch))
            else:
                skipped.append(f"{path} does not run on {arch} ({reason}): skipped; name --arch {arch} to check it")

    def run(job):
        _, spec, arch = job
        try:
            return check_spec(spec, arch)
        except (SpecError, CompileError, ValueError) as exc:
            return exc

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        results = list(pool.map(run, jobs_list))

    table = Table(title=f"ptxas resource usage (nvcc {nvcc_version()})")
    for col in ("spec", "arch", "registers", "static smem", "dynamic smem", "stack", "spill st/ld", "status"):
        table.add_column(col, justify="left" if col in ("spec", "arch", "status") else "right", no_wrap=True)
    failures: list[str] = []
    for (path, spec, arch), res in zip(jobs_list, results):
        if isinstance(res, Exception):
            failures.append(f"{path} ({arch}): {str(res).removeprefix(f'{path}: ')}")
            table.add_row(str(path), arch, *["-"] * 5, "[red]error[/red]")
            continue
        problems = {}
        limit = targets.target(arch).smem_per_block
        if res.spill_bytes:
            problems["spills"] = f"{res.spill_store_bytes} B spill stores, {res.spill_load_bytes} B spill loads"
        if res.smem_total_bytes > limit:
            problems["smem"] = f"{res.smem_total_bytes} B shared memory > {limit} B"
        failures += [f"{res.name} ({arch}): {msg}" for msg in problems.values()]
        table.add_row(res.name, arch, str(res.registers), str(res.smem_static_bytes), str(res.smem_dynamic_bytes),
                      str(res.stack_frame_bytes), f"{res.spill_store_bytes}/{res.spill_load_bytes}",
                      f"[red]{', '.join(problems)}[/red]" if problems else "[green]ok[/green]")
    # Not a terminal (CI logs, pipes): wide enough that kernel names are never cut.
    console = Console() if sys.stdout.isatty() else Console(width=200, no_color=True)
    console.print(table)
    for note in skipped:
        click.echo(f"note: {note}")
    for failure in failures:
        click.echo(f"error: {failure}", err=True)
    if failures:
        raise SystemExit(1)


def _cannot_run(spec, target) -> str | None:
    """Why no kernel family runs `spec` on `target` (its pinned family, else any that supports it), or None."""
    from attngen import families

    if spec.family is not None:
        return families.get_family(spec.family).supports(spec.problem, target)
    if families.supporting(spec.problem, target):
        return None
    reasons = [f"{family.name}: {family.supports(spec.problem, target)}" for family in families.FAMILIES.values()
               if family.operation == "forward"]
    return f"no forward family runs {spec.problem.label()} there; {'; '.join(reasons)}"


@main.command()
@click.argument("specs", metavar="[SPEC]...", nargs=-1, type=click.Path(path_type=Path))
@click.option("--seqlen", "seqlens", multiple=True, type=click.IntRange(min=1),
              help="Sequence length to tune for; repeat for several [default: 1024 ... 16384].")
@click.option("--batch-heads", "batch_heads", multiple=True, type=click.IntRange(min=1),
              help="Batch x query heads to tune for; repeat for several [default: 16k tokens, hidden 2048].")
@click.option("--budget", type=FiniteFloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds for the whole run: building, timing and verifying. At least one config per shape is "
                   "always timed, so a small budget can run over.")
@click.option("--max-fraction", type=FiniteFloatRange(min=0, max=1, min_open=True), default=0.3, show_default=True,
              help="Most of the space to time per shape.")
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Tuning database [default: $ATTNGEN_TUNING_DB, else tuning.sqlite3 in the cache dir].")
@click.option("--export", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Afterwards, write every entry of the database to this JSON file (an error when there is no "
                   "database).")
@click.option("--import", "import_", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="First, merge a file written by --export into the database (an attngen 0.1 file is migrated).")
@click.option("--store-narrowed", is_flag=True,
              help="Store the winner of a SPEC that pins config fields (a narrowed search) for every call that pins "
                   "only its family.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows in the results table.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Parallel compiles [default: CPUs].")
def tune(specs: tuple[Path, ...], seqlens: tuple[int, ...], batch_heads: tuple[int, ...], budget: float,
         max_fraction: float, db_path: Path | None, export: Path | None, import_: Path | None, store_narrowed: bool,
         top: int, jobs: int | None) -> None:
    """Find the fastest kernel family and config of each SPEC on this GPU (every family that can run it, unless
    the SPEC pins one) and store them in the tuning database."""
    from attngen.tune.commands import run_tune

    run_tune(specs, seqlens, batch_heads, budget, max_fraction, db_path, export, import_, top, jobs, store_narrowed)


@main.command()
@click.option("--out", "out_dir", default=DEFAULT_BENCH_OUT, show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Directory for the JSON and PNG results.")
@click.option("--quick", is_flag=True, help="A short run: fewer shapes and repetitions.")
@click.option("--masks", is_flag=True, help="The mask compiler's cases instead (attngen/bench_masks.py): an "
              "expression vs the built-in causal, a 4096-key window and packed documents vs FlexAttention.")
@click.option("--decode", is_flag=True, help="Decoding over a KV cache instead (attngen/bench_decode.py): one "
              "token per sequence against SDPA flash and cuDNN, contiguous and paged, and a CUDA-graph step.")
@click.option("--backward", is_flag=True, help="Training attention instead (attngen/bench_backward.py): forward + "
              "backward against SDPA flash and cuDNN, and the peak memory of forward + backward.")
def bench(out_dir: Path, quick: bool, masks: bool, decode: bool, backward: bool) -> None:
    """Benchmark the kernels against torch SDPA and FlexAttention (needs a CUDA GPU)."""
    modes = [flag for flag, on in (("--masks", masks), ("--decode", decode), ("--backward", backward)) if on]
    if len(modes) > 1:
        raise click.UsageError(f"{' and '.join(modes)} are separate benchmarks; give one per run")
    if quick and modes:
        raise click.UsageError(f"--quick shortens the forward benchmark only; {modes[0]} has no short form")
    try:
        # All imported up front, so a missing one fails now rather than after minutes of timing.
        import cupy  # noqa: F401
        import matplotlib  # noqa: F401
        import torch

        from attngen.bench import run_bench
    except ImportError as exc:
        click.echo(f"error: attngen bench needs a CUDA GPU with torch, CuPy (pip install 'attngen[cuda13]', or [cuda12]) and "
                   f"matplotlib; import failed: {exc}", err=True)
        raise SystemExit(2) from None
    if not torch.cuda.is_available():
        click.echo("error: attngen bench needs a CUDA GPU; torch.cuda.is_available() is False", err=True)
        raise SystemExit(2)
    if backward:
        from attngen.bench_backward import run_backward_bench

        run_backward_bench(out_dir)
        click.echo(f"backward benchmark written to {out_dir}")
        return
    if decode:
        from attngen.bench_decode import run_decode_bench

        run_decode_bench(out_dir)
        click.echo(f"decode benchmark written to {out_dir}")
        return
    if masks:
        from attngen.bench_masks import run_mask_bench

        run_mask_bench(out_dir)
        click.echo(f"mask benchmark written to {out_dir}")
        return
    results = run_bench(out_dir, quick=quick)
    click.echo(f"{len(results)} results written to {out_dir}")


# `attngen fuzz` (GPU): its own package, attngen/fuzz/.
from attngen.fuzz.command import fuzz  # noqa: E402

main.add_command(fuzz)

if __name__ == "__main__":
    main()
