"""The bodies of `attngen check --configs` and `attngen tune` (attngen/cli.py holds the options)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from attngen.bench import HIDDEN, TOKENS  # the FlashAttention papers' benchmark setup
from attngen.errors import SpecError
from attngen.spec import AttentionSpec
from attngen.tune.model import Shape, gpu_model

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
    """Print the pruned and ranked (family, config) space of each spec for each target and shape (nvcc, no GPU).
    The target is --arch's, as for `attngen check`: a spec's own arch is for `attngen generate`."""
    import attngen
    from attngen import targets
    from attngen.build.nvcc import nvcc_version, require_nvcc
    from attngen.tune.ranking import analyse, rank, survivors
    from attngen.tune.report import print_ranked
    from attngen.tune.space import families_of, search_space

    require_nvcc()
    for path in spec_paths:
        spec = attngen.load_spec(path)
        for arch in dict.fromkeys(archs):
            target = targets.target(arch)
            gpu = gpu_model(target)
            try:
                space = search_space(spec, target)
            except SpecError as exc:  # name the file and the target once (the spec's own message may name the file)
                message = str(exc).removeprefix(f"{path}: ")
                raise SpecError(f"{path} ({target.name}): {message}", field=exc.field) from None
            pruned = analyse(space, gpu, jobs)
            for shape in shapes_for(spec, seqlens, batch_heads):
                ranked = rank(pruned, gpu, shape)
                print_ranked(ranked, shape, f"{path}: {target.name}, {shape.label()}, {gpu.name}, nvcc "
                                            f"{nvcc_version()}, families {', '.join(families_of(space))}: "
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


def check_export_path(path: Path) -> None:
    """Fail before any tuning when --export cannot be written."""
    if path.is_dir():
        why = "it is a directory"
    elif not path.parent.exists():
        why = f"directory {path.parent} does not exist"
    elif not path.parent.is_dir():
        why = f"{path.parent} is not a directory"
    elif not os.access(path.parent, os.W_OK):
        why = f"directory {path.parent} is not writable"
    else:
        return
    raise click.BadParameter(f"{path}: {why}; allowed: a file path in an existing, writable directory",
                             param_hint="--export")


def run_tune(spec_paths: tuple[Path, ...], seqlens: tuple[int, ...], batch_heads: tuple[int, ...], budget: float,
             max_fraction: float, db_path: Path | None, export: Path | None, import_: Path | None, top: int,
             jobs: int | None, store_narrowed: bool = False) -> None:
    import attngen
    from attngen.progress import Progress
    from attngen.tune.db import TuningDB
    from attngen.tune.report import print_result
    from attngen.tune.search import check_narrowed, check_no_dropout, check_search_args

    db = TuningDB(db_path)
    if not spec_paths and export is None and import_ is None:
        raise click.UsageError("give at least one SPEC to tune, or --export/--import")
    check_search_args(budget, max_fraction)
    if export is not None:
        check_export_path(export)
    specs = [attngen.load_spec(p) for p in spec_paths]
    shapes = [shapes_for(s, seqlens or DEFAULT_SEQLENS, batch_heads) for s in specs]  # errors before timing
    for spec in specs:
        check_narrowed(spec, store_narrowed)
        check_no_dropout(spec)
    if specs:
        require_gpu()  # before anything is written
    if import_ is not None:
        held, written = db.import_file(import_)
        kept = f" ({held - written} older than the entries already there: not written)" if held - written else ""
        click.echo(f"imported {held} entries from {import_} into {db.path}{kept}")
    if specs:
        from attngen.tune.search import tune

        # One deadline for the whole run: each spec gets its shapes' share of what is left when it
        # starts, so time one spec overruns (verification included) comes out of the later ones.
        deadline = time.monotonic() + budget
        left = sum(len(s) for s in shapes)
        stored = 0
        for spec, spec_shapes in zip(specs, shapes):
            now = time.monotonic()
            share = max(0.0, deadline - now) * len(spec_shapes) / left
            left -= len(spec_shapes)
            click.echo(f"tuning {spec.to_dict()} for {len(spec_shapes)} shapes, {share:.0f} s of the budget left, "
                       f"at most {max_fraction:.0%} of the space per shape", err=True)
            with Progress(stderr=True) as progress:
                results = tune(spec, spec_shapes, deadline=now + share, max_fraction=max_fraction, db=db, jobs=jobs,
                               progress=progress, store_narrowed=store_narrowed)
            for result in results:
                print_result(result, top)
                sys.stdout.flush()
            stored += len(results)  # tune() raises when an entry is not stored
        click.echo(f"stored {stored} tuned entries in {db.path}")
    if export is not None:
        click.echo(f"exported {db.export(export)} entries from {db.path} to {export}")
