"""The `attngen` command line: generate (no GPU), check (nvcc, no GPU), bench and tune (GPU)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

import attngen
from attngen.errors import CompileError, SpecError
from attngen.plan import SMEM_LIMIT, KernelPlan, make_plan
from attngen.spec import ARCHS, TILE_FIELDS, AttentionSpec

DEFAULT_GENERATED = "generated"
DEFAULT_BENCH_OUT = "bench/results"


# -- generate -----------------------------------------------------------------
def template_files() -> list[str]:
    """The forward template and every header it inlines, in the order it names them."""
    import jinja2
    from jinja2 import nodes

    from attngen.render import FORWARD_TEMPLATE, templates_dir

    tree = jinja2.Environment().parse((templates_dir() / FORWARD_TEMPLATE).read_text())
    headers = [
        call.args[0].value
        for call in tree.find_all(nodes.Call)
        if isinstance(call.node, nodes.Name) and call.node.name == "include_header" and call.args
        and isinstance(call.args[0], nodes.Const)
    ]
    return [FORWARD_TEMPLATE, *headers]


def manifest(plan: KernelPlan, source: str) -> dict:
    """What generated/<name>.json records: the resolved spec, the plan, the templates, the source hash."""
    return {
        "name": plan.name,
        "attngen_version": attngen.__version__,
        "spec": plan.spec.to_dict(),
        "plan": {
            "arch": plan.arch,
            "threads": plan.threads,
            "smem_bytes": plan.smem_bytes,
            "q_in_regs": plan.q_in_regs,
            "row_sums_in_smem": plan.row_sums_in_smem,
            "sub_n": plan.sub_n,
            "min_blocks_per_sm": plan.min_blocks_per_sm,
            "mask": plan.mask.name,
            "tile": {f: getattr(plan, f) for f in TILE_FIELDS},
        },
        "templates": template_files(),
        "source": f"{plan.name}.cu",
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
    }


def kernel_files(spec: AttentionSpec) -> dict[str, str]:
    """The files `attngen generate` writes for one spec: {file name: text}. Deterministic."""
    from attngen.render import render_plan

    plan = make_plan(spec)
    source = render_plan(plan)
    meta = json.dumps(manifest(plan, source), indent=2, sort_keys=True) + "\n"
    return {f"{plan.name}.cu": source, f"{plan.name}.json": meta}


# -- check ----------------------------------------------------------------------
def check_spec(spec: AttentionSpec, arch: str):
    """nvcc-compile a spec for one target arch, as the runtime would on such a GPU: the plan is
    make_plan(spec, arch) (a spec that pins its arch keeps its own tiles). The ptxas report."""
    from attngen.nvcc import check_plan

    return check_plan(make_plan(spec, arch), arch)


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
@click.option("--prune", is_flag=True, help="Delete .cu/.json files in the directory that no given spec produces.")
def generate(specs: tuple[Path, ...], out_dir: Path, prune: bool) -> None:
    """Render each SPEC file to DIR/<name>.cu plus a DIR/<name>.json manifest (no GPU needed)."""
    from attngen.render import write_if_different

    files: dict[str, str] = {}
    origin: dict[str, Path] = {}
    for path in specs:
        for fname, text in kernel_files(attngen.load_spec(path)).items():
            if files.get(fname, text) != text:
                raise SpecError(f"{origin[fname]} and {path} both produce {fname}, with different content "
                                "(canonical names do not spell arch)", field=None)
            files[fname], origin[fname] = text, path
    for fname, text in sorted(files.items()):
        target = out_dir / fname
        click.echo(f"{'wrote    ' if write_if_different(target, text) else 'unchanged'} {target}")
    if prune and out_dir.is_dir():
        for stale in sorted(out_dir.iterdir()):
            if stale.suffix in (".cu", ".json") and stale.name not in files:
                stale.unlink()
                click.echo(f"removed   {stale}")


@main.command()
@SPEC_ARG
@click.option("--arch", "archs", multiple=True, type=click.Choice(ARCHS), default=ARCHS, show_default=True,
              help="Target to compile for; repeat for several.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Parallel nvcc runs [default: CPUs].")
@click.option("--configs", is_flag=True,
              help="Show every tile config of each SPEC: resources, occupancy, predicted time, pruning verdict.")
@click.option("--seqlen", "seqlens", multiple=True, type=click.IntRange(min=1),
              help="With --configs: sequence length to predict for; repeat for several [default: 4096].")
@click.option("--batch-heads", "batch_heads", multiple=True, type=click.IntRange(min=1),
              help="With --configs: batch x query heads [default: 16k tokens, hidden 2048].")
def check(specs: tuple[Path, ...], archs: tuple[str, ...], jobs: int | None, configs: bool,
          seqlens: tuple[int, ...], batch_heads: tuple[int, ...]) -> None:
    """Compile each SPEC with nvcc and show the ptxas resource report; fails on spills or errors.
    With --configs: every tile config of each SPEC, pruned and ranked as `attngen tune` would."""
    if configs:
        from attngen.tune.commands import check_configs

        return check_configs(specs, archs, seqlens or (4096,), batch_heads, jobs)
    if seqlens or batch_heads:
        raise click.UsageError("--seqlen and --batch-heads only apply with --configs")
    from rich.console import Console
    from rich.table import Table

    from attngen.nvcc import find_nvcc, nvcc_version

    if find_nvcc() is None:
        raise CompileError("nvcc not found: put it on PATH or set CUDA_HOME to the CUDA toolkit")
    loaded = [attngen.load_spec(path) for path in specs]
    jobs_list = [(path, spec, arch) for path, spec in zip(specs, loaded) for arch in dict.fromkeys(archs)]

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
            failures.append(f"{path} ({arch}): {res}")
            table.add_row(spec.resolved(arch).name, arch, *["-"] * 5, "[red]error[/red]")
            continue
        problems = {}
        if res.spill_bytes:
            problems["spills"] = f"{res.spill_store_bytes} B spill stores, {res.spill_load_bytes} B spill loads"
        if res.smem_total_bytes > SMEM_LIMIT[arch]:
            problems["smem"] = f"{res.smem_total_bytes} B shared memory > {SMEM_LIMIT[arch]} B"
        failures += [f"{res.name} ({arch}): {msg}" for msg in problems.values()]
        table.add_row(res.name, arch, str(res.registers), str(res.smem_static_bytes), str(res.smem_dynamic_bytes),
                      str(res.stack_frame_bytes), f"{res.spill_store_bytes}/{res.spill_load_bytes}",
                      f"[red]{', '.join(problems)}[/red]" if problems else "[green]ok[/green]")
    # Not a terminal (CI logs, pipes): wide enough that kernel names are never cut.
    console = Console() if sys.stdout.isatty() else Console(width=200, no_color=True)
    console.print(table)
    for failure in failures:
        click.echo(f"error: {failure}", err=True)
    if failures:
        raise SystemExit(1)


@main.command()
@click.argument("specs", metavar="[SPEC]...", nargs=-1, type=click.Path(path_type=Path))
@click.option("--seqlen", "seqlens", multiple=True, type=click.IntRange(min=1),
              help="Sequence length to tune for; repeat for several [default: 1024 ... 16384].")
@click.option("--batch-heads", "batch_heads", multiple=True, type=click.IntRange(min=1),
              help="Batch x query heads to tune for; repeat for several [default: 16k tokens, hidden 2048].")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds for the whole run: building, timing and verifying. At least one config per shape is "
                   "always timed, so a small budget can run over.")
@click.option("--max-fraction", type=click.FloatRange(min=0, max=1, min_open=True), default=0.3, show_default=True,
              help="Most of the space to time per shape.")
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Tuning database [default: $ATTNGEN_TUNING_DB, else tuning.sqlite3 in the cache dir].")
@click.option("--export", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Afterwards, write every entry of the database to this JSON file.")
@click.option("--import", "import_", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="First, merge a file written by --export into the database.")
@click.option("--store-narrowed", is_flag=True,
              help="Store the winner of a SPEC that pins tile fields (a narrowed search) for every untiled call.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows in the results table.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Parallel compiles [default: CPUs].")
def tune(specs: tuple[Path, ...], seqlens: tuple[int, ...], batch_heads: tuple[int, ...], budget: float,
         max_fraction: float, db_path: Path | None, export: Path | None, import_: Path | None, store_narrowed: bool,
         top: int, jobs: int | None) -> None:
    """Find the fastest tile config of each SPEC on this GPU and store it in the tuning database."""
    from attngen.tune.commands import run_tune

    run_tune(specs, seqlens, batch_heads, budget, max_fraction, db_path, export, import_, top, jobs, store_narrowed)


@main.command()
@click.option("--out", "out_dir", default=DEFAULT_BENCH_OUT, show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Directory for the JSON and PNG results.")
@click.option("--quick", is_flag=True, help="A short run: fewer shapes and repetitions.")
def bench(out_dir: Path, quick: bool) -> None:
    """Benchmark the kernels against torch SDPA and FlexAttention (needs a CUDA GPU)."""
    try:
        # All imported up front, so a missing one fails now rather than after minutes of timing.
        import cupy  # noqa: F401
        import matplotlib  # noqa: F401
        import torch

        from attngen.bench import run_bench
    except ImportError as exc:
        click.echo(f"error: attngen bench needs a CUDA GPU with torch, CuPy (e.g. pip install cupy-cuda12x) and "
                   f"matplotlib; import failed: {exc}", err=True)
        raise SystemExit(2) from None
    if not torch.cuda.is_available():
        click.echo("error: attngen bench needs a CUDA GPU; torch.cuda.is_available() is False", err=True)
        raise SystemExit(2)
    results = run_bench(out_dir, quick=quick)
    click.echo(f"{len(results)} results written to {out_dir}")


# `attngen fuzz` (GPU): its own package, attngen/fuzz/.
from attngen.fuzz.command import fuzz  # noqa: E402

main.add_command(fuzz)

if __name__ == "__main__":
    main()
