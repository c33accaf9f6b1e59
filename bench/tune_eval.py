"""Does the tuner find the best tile? Issue 3's acceptance check, in one GPU run (<= 8 min on an H100).

For three held-out shapes it (a) times every launchable (family, config) of the unpruned space
(every kernel family that can run the spec on this GPU),
(b) runs the tuner's pruned and ranked search (`attngen.tune.search.tune`, its budget and
max fraction), then (c) times the overall best and the tuned config head to head. Per
shape it reports both configs and times, their ratio (the bar: tuned <= 1.03x best), the
fraction of the space the tuner timed (bar: <= 30%) and the Spearman rank correlation of
predicted vs measured times. Everything, with every config's resources, prediction and
time, goes to OUT/tune_eval.json (and the tuned entries to OUT/tuning-export.json).

Usage (repo root, GPU machine): python bench/tune_eval.py --out DIR [--set heldout|extra] [--budget 90] [--jobs 16]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from attngen.spec import AttentionSpec
from attngen.tune.model import Shape

# Held out: the model's constants come from docs/perf-notes.md, not from these shapes.
# Batch x heads follow the FlashAttention papers' setup (16k tokens, hidden 2048).
CASE_SETS = {
    "heldout": [
        ("d64 causal s2048", AttentionSpec(head_dim=64, dtype="bf16", mask="causal"), Shape(8, 2048, 2048, 32)),
        ("d128 none s4096", AttentionSpec(head_dim=128, dtype="bf16", mask="none"), Shape(4, 4096, 4096, 16)),
        ("d128 causal s8192", AttentionSpec(head_dim=128, dtype="bf16", mask="causal"), Shape(2, 8192, 8192, 16)),
    ],
    # Shapes and specs no perf-notes measurement has touched: GQA, fp16, short and long rows.
    "extra": [
        ("d64 none s1024 fp16", AttentionSpec(head_dim=64, dtype="fp16", mask="none"), Shape(16, 1024, 1024, 32)),
        ("d128 causal gqa4 s2048", AttentionSpec(head_dim=128, dtype="bf16", mask="causal", gqa_ratio=4),
         Shape(8, 2048, 2048, 32)),
        ("d128 none s16384", AttentionSpec(head_dim=128, dtype="bf16", mask="none"), Shape(1, 16384, 16384, 16)),
    ],
}
RATIO_BAR = 1.03
FRACTION_BAR = 0.30
HEAD_TO_HEAD_ROUNDS = 3


def config_rows(ranked, timings) -> list[dict]:
    from attngen.tune.report import plan_choices

    measured = {id(t.ranked): t for t in timings}
    rows = []
    for i, r in enumerate(ranked, 1):
        p, t = r.pruned, measured.get(id(r))
        rows.append({
            "family": r.candidate.family, "config": r.candidate.config.label(), "plan": plan_choices(r.candidate.plan),
            "model_rank": i if p.survives else None,
            "verdict": p.reason or "ok",
            "registers": p.report.registers if p.report else None,
            "smem_bytes": p.report.smem_total_bytes if p.report else None,
            "spill_bytes": p.report.spill_bytes if p.report else None,
            "ctas_per_sm": p.occupancy.ctas if p.occupancy else None,
            "predicted_ms": r.estimate.ms if r.estimate else None,
            "measured_ms": t.ms if t and t.ok else None,
            "probe_only": t.probe_only if t else None,
            "error": t.error if t else None,
        })
    return rows


def head_to_head(a, b, shape, device) -> tuple[float, float]:
    """Median ms of two candidates timed alternately (drift hits both alike)."""
    from attngen.bench import time_ms
    from attngen.runtime.dispatch import kernel_for
    from attngen.tune.search import input_sets

    sets = input_sets(a.problem, shape)
    kernels = [kernel_for(a.plan, device), kernel_for(b.plan, device)]
    times = [[], []]
    for _ in range(HEAD_TO_HEAD_ROUNDS):
        for i, kernel in enumerate(kernels):
            times[i].append(time_ms(lambda q, k, v, kernel=kernel: kernel(q, k, v), sets))
    return statistics.median(times[0]), statistics.median(times[1])


def evaluate(name, spec, shape, args, db) -> dict:
    import torch

    from attngen import targets
    from attngen.tune.model import gpu_model
    from attngen.tune.ranking import analyse, rank
    from attngen.tune.report import spearman
    from attngen.tune.search import time_candidates, tune, verified_winner
    from attngen.tune.space import search_space

    device = torch.cuda.current_device()
    target = targets.device_target(device)
    gpu = gpu_model(target)
    t0 = time.monotonic()
    ranked = rank(analyse(search_space(spec, target), gpu, args.jobs), gpu, shape)
    # (a) every launchable candidate, in the space's own order (not the model's), pruned ones too.
    order = sorted((r for r in ranked if r.candidate.launchable), key=lambda r: r.label)
    full, _ = time_candidates(order, shape, device, math.inf, args.jobs)
    t_full = time.monotonic() - t0
    best = verified_winner(full, shape, device)  # a fast wrong kernel is no yardstick
    if best is None:
        raise SystemExit(f"{name}: every config failed; first errors: {[t.error for t in full[:3]]}")
    ok = [t for t in full if t.ok]
    # (b) the tuner, as `attngen tune` runs it.
    t1 = time.monotonic()
    result = tune(spec, [shape], deadline=t1 + args.budget, max_fraction=args.max_fraction, db=db, jobs=args.jobs)[0]
    t_tune = time.monotonic() - t1
    tuned = result.winner
    # (c) the two winners head to head.
    best_ms, tuned_ms = head_to_head(best.candidate, tuned.candidate, shape, device)
    ratio = tuned_ms / best_ms
    fraction = len(result.timings) / result.launchable
    tuned_ok = [t for t in result.timings if t.ok]
    survivors_ok = [t for t in ok if t.ranked.pruned.survives and t.ranked.estimate is not None]
    best_rank = ranked.index(best.ranked) + 1
    return {
        "case": name, "spec": spec.to_dict(), "shape": shape.label(), "gpu": gpu.name, "target": target.name,
        "searched": list(result.searched),
        "space": len(ranked), "launchable": result.launchable, "survivors": sum(r.pruned.survives for r in ranked),
        "best": {"config": best.ranked.label, "ms": best.ms, "tflops": result.tflops(best.ms),
                 "head_to_head_ms": best_ms, "model_rank": best_rank, "verdict": best.ranked.pruned.reason or "ok"},
        "tuned": {"config": tuned.ranked.label, "ms": tuned.ms, "tflops": result.tflops(tuned.ms),
                  "head_to_head_ms": tuned_ms},
        "ratio": ratio, "fraction_timed": fraction, "timed": len(result.timings), "stopped_by": result.stopped_by,
        "spearman_tuner": spearman([t.ranked.predicted_ms for t in tuned_ok], [t.ms for t in tuned_ok]),
        "spearman_all_survivors": spearman([t.ranked.predicted_ms for t in survivors_ok],
                                           [t.ms for t in survivors_ok]),
        "pass": ratio <= RATIO_BAR and fraction <= FRACTION_BAR,
        "seconds": {"full_space": t_full, "tuner": t_tune},
        "configs": config_rows(ranked, full),
    }


def run_case(index: int, args) -> dict:
    """One case in this process; its result is also written to OUT/case<index>.json."""
    from attngen.tune.db import TuningDB

    name, spec, shape = CASE_SETS[args.set][index]
    result = evaluate(name, spec, shape, args, TuningDB(args.out / "tuning.sqlite3"))
    (args.out / f"case{index}.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for tune_eval.json")
    ap.add_argument("--budget", type=float, default=90.0, help="the tuner's budget per shape, seconds")
    ap.add_argument("--max-fraction", type=float, default=FRACTION_BAR)
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPUs)")
    ap.add_argument("--case", type=int, default=None, help="run only this case, in this process")
    ap.add_argument("--set", choices=sorted(CASE_SETS), default="heldout", help="which shapes (default: heldout)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.case is not None:
        run_case(args.case, args)
        return
    # One process per case: a config that corrupts the CUDA context (an illegal address) costs
    # only its own case, and the log names it.
    start = time.monotonic()
    results = []
    for index, (name, _, _) in enumerate(CASE_SETS[args.set]):
        cmd = [sys.executable, __file__, "--case", str(index), "--set", args.set, "--out", str(args.out),
               "--budget", str(args.budget),
               "--max-fraction", str(args.max_fraction)] + (["--jobs", str(args.jobs)] if args.jobs else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (args.out / f"case{index}.log").write_text(proc.stdout + proc.stderr)
        path = args.out / f"case{index}.json"
        if proc.returncode != 0 or not path.is_file():
            print(f"{name}: FAILED (exit {proc.returncode}); last lines of {args.out}/case{index}.log:\n"
                  + "\n".join((proc.stdout + proc.stderr).splitlines()[-8:]), flush=True)
            continue
        r = json.loads(path.read_text())
        results.append(r)
        print(f"{name}: best {r['best']['config']} {r['best']['tflops']:.0f} TFLOP/s, tuned {r['tuned']['config']} "
              f"{r['tuned']['tflops']:.0f}, ratio {r['ratio']:.3f}, timed {r['fraction_timed']:.0%}, "
              f"rho {r['spearman_tuner']:.2f}/{r['spearman_all_survivors']:.2f} "
              f"({r['seconds']['full_space']:.0f}+{r['seconds']['tuner']:.0f} s)", flush=True)
    (args.out / "tune_eval.json").write_text(json.dumps({"results": results}, indent=1))
    from attngen.tune.db import TuningDB

    if results:  # no case stored anything: no database to export
        TuningDB(args.out / "tuning.sqlite3").export(args.out / "tuning-export.json")
    print_summary(results)
    print(f"total {time.monotonic() - start:.0f} s")


def print_summary(results: list[dict]) -> None:
    print(f"\n{'case':20s} {'best':22s} {'ms':>7s} {'tuned':22s} {'ms':>7s} {'ratio':>6s} {'timed':>6s} "
          f"{'rho':>5s} {'rho*':>5s} {'rank':>4s} pass")
    for r in results:
        print(f"{r['case']:20s} {r['best']['config']:22s} {r['best']['head_to_head_ms']:7.3f} "
              f"{r['tuned']['config']:22s} {r['tuned']['head_to_head_ms']:7.3f} {r['ratio']:6.3f} "
              f"{r['fraction_timed']:6.0%} {r['spearman_tuner']:5.2f} {r['spearman_all_survivors']:5.2f} "
              f"{r['best']['model_rank'] or '-':>4} {'yes' if r['pass'] else 'NO'}")
    print("ratio: tuned/best timed head to head; rho: Spearman predicted vs measured over the tuner's timed "
          "configs; rho*: over all survivors; rank: the best config's place in the model's order")


if __name__ == "__main__":
    main()
