"""What the search shows people: the ranked table, the results table, rank correlation."""

from __future__ import annotations

import math

from attngen.families.base import Plan
from attngen.flops import tflops
from attngen.progress import console
from attngen.tune.model import Shape
from attngen.tune.ranking import Ranked

# Plan choices the tables show in columns of their own, or that restate the launch (not choices).
_SHOWN_ELSEWHERE = {"threads", "smem_bytes", "min_blocks_per_sm"}


def plan_choices(plan: Plan | None) -> str:
    """What the family derived beyond the config (plan.choices(): sub_n, q_in_regs, ...), compactly."""
    if plan is None:
        return "-"
    parts = []
    for name, value in plan.choices().items():
        if name in _SHOWN_ELSEWHERE or value is None:
            continue
        if isinstance(value, bool):
            parts.append(name if value else "")
        else:
            parts.append(f"{name}={value}")
    return " ".join(p for p in parts if p)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (ties get their mean rank); nan for fewer than 3 pairs."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs equal lengths, got {len(xs)} and {len(ys)}")
    if len(xs) < 3:
        return math.nan
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else math.nan


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


# -- tables ---------------------------------------------------------------------------------------
def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None or not math.isfinite(ms) else f"{ms:.3f}"


def _resources(r: Ranked) -> list[str]:
    report, occ = r.pruned.report, r.pruned.occupancy
    if report is None:
        return ["-"] * 4
    return [str(report.registers), f"{report.smem_total_bytes / 1024:.1f}",
            f"{report.spill_store_bytes}/{report.spill_load_bytes}",
            f"{occ.ctas} ({occ.warps}w, {occ.limiter})" if occ else "-"]


_LEFT = ("family", "config", "plan", "CTAs/SM", "bound", "verdict", "note")


def print_ranked(ranked: list[Ranked], shape: Shape, title: str) -> None:
    """`attngen check --configs`: every candidate, survivors in predicted order, then the pruned."""
    from rich.table import Table

    print(title)  # not the table's title: rich would wrap a long one
    table = Table()
    for col in ("#", "family", "config", "plan", "regs", "smem KB", "spill st/ld", "CTAs/SM", "pred ms",
                "pred TFLOP/s", "bound", "verdict"):
        table.add_column(col, justify="left" if col in _LEFT else "right", no_wrap=col != "verdict")
    for i, r in enumerate(ranked, 1):
        est, c = r.estimate, r.candidate
        flops = shape.flops(c.problem.head_dim, c.problem.causal)
        table.add_row(str(i) if r.pruned.survives else "-", c.family, c.config.label(), plan_choices(c.plan),
                      *_resources(r), _fmt_ms(r.predicted_ms if est else None),
                      f"{tflops(flops, est.ms):.0f}" if est else "-", est.bound if est else "-",
                      "ok" if r.pruned.survives else r.pruned.reason)
    console().print(table)


def print_result(result, top: int) -> None:
    """`attngen tune`: the top timed configs, the winner, coverage and predicted-vs-measured."""
    from rich.table import Table

    predicted_rank = {id(r): i for i, r in enumerate(result.ranked, 1)}
    timed = sorted(result.timings, key=lambda t: (t.ms, predicted_rank[id(t.ranked)]))
    print(f"{result.spec.to_dict()} on {result.shape.label()} ({result.gpu.name}, {result.target.name}; families "
          f"searched: {', '.join(result.searched)})")
    table = Table()
    for col in ("#", "family", "config", "plan", "regs", "smem KB", "spill st/ld", "CTAs/SM", "pred ms", "pred #",
                "ms", "TFLOP/s", "note"):
        table.add_column(col, justify="left" if col in _LEFT else "right", no_wrap=col != "note")
    for i, t in enumerate(timed[:top], 1):
        note = t.error or ("probe only" if t.probe_only else "")
        c = t.candidate
        table.add_row(str(i), c.family, c.config.label(), plan_choices(c.plan), *_resources(t.ranked),
                      _fmt_ms(t.ranked.predicted_ms), str(predicted_rank[id(t.ranked)]), _fmt_ms(t.ms),
                      f"{result.tflops(t.ms):.1f}" if t.ok else "-", note)
    console().print(table)
    for line in summary_lines(result):
        print(line)


def summary_lines(result) -> list[str]:
    ok = [t for t in result.timings if t.ok]
    rho = spearman([t.ranked.predicted_ms for t in ok], [t.ms for t in ok])
    win = result.winner
    return [
        f"winner: {win.ranked.label} {win.ms:.3f} ms, {result.tflops(win.ms):.1f} TFLOP/s "
        f"(predicted {win.ranked.predicted_ms:.3f} ms, model rank {result.ranked.index(win.ranked) + 1})",
        f"timed {len(result.timings)} of {result.launchable} launchable configs "
        f"({len(result.timings) / result.launchable:.0%}; stopped by {result.stopped_by}) in {result.seconds:.1f} s",
        f"predicted vs measured rank correlation (Spearman, {len(ok)} timed): {rho:.2f}",
    ]
