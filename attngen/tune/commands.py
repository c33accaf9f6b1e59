"""The bodies of `attngen check --configs` and `attngen tune` (attngen/cli.py holds the options)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attngen.spec import AttentionSpec
from attngen.tune.model import Shape, gpu_model

# FlashAttention papers' benchmark setup: batch * seqlen = 16k tokens, hidden 2048 (attngen/bench.py).
TOKENS = 16384
HIDDEN = 2048
DEFAULT_SEQLENS = (1024, 2048, 4096, 8192, 16384)


def shapes_for(spec: AttentionSpec, seqlens: tuple[int, ...], batch_heads: tuple[int, ...]) -> list[Shape]:
    """One shape per (seqlen, batch x heads); without batch x heads, the papers' setup."""
    for s in seqlens:
        if s < 1:
            raise click.BadParameter(f"{s} is invalid; allowed: an integer >= 1", param_hint="--seqlen")
    shapes = []
    for s in seqlens:
        if not batch_heads:
            heads = max(spec.gqa_ratio, HIDDEN // spec.head_dim // spec.gqa_ratio * spec.gqa_ratio)
            shapes.append(Shape(batch=max(1, TOKENS // s), seqlen_q=s, seqlen_k=s, heads_q=heads))
        for bh in batch_heads:
            if bh < 1 or bh % spec.gqa_ratio:
                raise click.BadParameter(f"{bh} is invalid for gqa_ratio={spec.gqa_ratio}; allowed: a positive "
                                         "multiple of gqa_ratio", param_hint="--batch-heads")
            shapes.append(Shape(batch=1, seqlen_q=s, seqlen_k=s, heads_q=bh))  # the grid sees only B*H
    return shapes


def check_configs(spec_paths: tuple[Path, ...], archs: tuple[str, ...], seqlens: tuple[int, ...],
                  batch_heads: tuple[int, ...], jobs: int | None) -> None:
    """Print the pruned and ranked space of each spec for each arch and shape (nvcc, no GPU)."""
    import attngen
    from attngen.errors import CompileError
    from attngen.nvcc import find_nvcc, nvcc_version
    from attngen.tune.ranking import analyse, rank, survivors
    from attngen.tune.report import print_ranked
    from attngen.tune.space import search_space

    if find_nvcc() is None:
        raise CompileError("nvcc not found: put it on PATH or set CUDA_HOME to the CUDA toolkit")
    for path in spec_paths:
        spec = attngen.load_spec(path)
        for arch in dict.fromkeys(archs):
            gpu = gpu_model(arch)
            pruned = analyse(search_space(spec, arch), gpu, jobs)
            for shape in shapes_for(spec, seqlens, batch_heads):
                ranked = rank(pruned, gpu, shape)
                print_ranked(ranked, shape, f"{path}: {arch}, {shape.label()}, {gpu.name}, nvcc {nvcc_version()}: "
                                            f"{len(survivors(ranked))} of {len(ranked)} survive")


def require_gpu() -> None:
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError as exc:
        click.echo(f"error: attngen tune needs a CUDA GPU with torch and CuPy; import failed: {exc}", err=True)
        raise SystemExit(2) from None
    if not torch.cuda.is_available():
        click.echo("error: attngen tune needs a CUDA GPU; torch.cuda.is_available() is False", err=True)
        raise SystemExit(2)


def run_tune(spec_paths: tuple[Path, ...], seqlens: tuple[int, ...], batch_heads: tuple[int, ...], budget: float,
             max_fraction: float, db_path: Path | None, export: Path | None, import_: Path | None, top: int,
             jobs: int | None) -> None:
    import attngen
    from attngen.tune.db import TuningDB
    from attngen.tune.report import Progress, print_result
    from attngen.tune.search import check_search_args

    db = TuningDB(db_path)
    if not spec_paths and export is None and import_ is None:
        raise click.UsageError("give at least one SPEC to tune, or --export/--import")
    check_search_args(budget, max_fraction)
    specs = [attngen.load_spec(p) for p in spec_paths]
    shapes = {id(s): shapes_for(s, seqlens or DEFAULT_SEQLENS, batch_heads) for s in specs}  # errors before timing
    if specs:
        require_gpu()  # before anything is written
    if import_ is not None:
        click.echo(f"imported {db.import_file(import_)} entries from {import_} into {db.path}")
    if specs:
        from attngen.tune.search import tune

        total_shapes = sum(len(v) for v in shapes.values())
        for spec in specs:
            share = budget * len(shapes[id(spec)]) / total_shapes
            click.echo(f"tuning {spec.to_dict()} for {len(shapes[id(spec)])} shapes, budget {share:.0f} s, "
                       f"at most {max_fraction:.0%} of the space per shape", err=True)
            with Progress() as progress:
                results = tune(spec, shapes[id(spec)], budget_s=share, max_fraction=max_fraction, db=db, jobs=jobs,
                               progress=progress)
            for result in results:
                print_result(result, top)
                sys.stdout.flush()
        click.echo(f"stored {sum(len(v) for v in shapes.values())} tuned entries in {db.path}")
    if export is not None:
        click.echo(f"exported {db.export(export)} entries from {db.path} to {export}")
