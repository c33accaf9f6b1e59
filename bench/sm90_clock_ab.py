"""Versions of fwd_sm90's kernel compared at one locked clock: run under Nsight Compute, which holds
the SM clock at its base value while it times each kernel, so the GPU's fall in clock under sustained load
(the ~10% swings of same-process A/B at boost clocks, docs/perf-notes.md) drops out of the comparison: the
same kernel timed three times spreads by ~1%.

    python bench/sm90_versions.py my-variant-dir/ > .ab/v1.cuh   # a version of the kernel (bench/sm90_versions.py)
    ncu --csv --print-units base --metrics gpu__time_duration.sum -k 'regex:sm90a$|sdpa|cudnn' \\
        python3 bench/sm90_clock_ab.py --variant v1=.ab/v1.cuh [--reps 3] [CASE ...] > ncu.csv
    python3 bench/sm90_clock_ab.py --report ncu.csv

Builds: "base" (the working tree's kernel) and each --variant, with cuDNN beside them (dense masks);
cases are bench/sm90_ab_probe.py's DENSE, a case written CASE@LABEL runs the config LABEL (such as
d64-causal-2k-dyn@m192n128s2opr) to compare configs. The run prints one manifest line per call ("#call CASE BUILD
warm|timed") in launch order; --report pairs them with ncu's rows and prints each case's median kernel
time per build and its ratio to cuDNN's."""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sm90_versions as versions  # noqa: E402 (after the path)


def run(args) -> None:
    import torch

    import sm90_ab_probe as ab

    builds = [("base", None)] + [(name, versions.load(source)) for name, source in args.variant]
    with torch.no_grad():
        for name in args.cases or list(ab.DENSE):
            shape, _, config = name.partition("@")  # CASE@LABEL: that config in place of the case's
            d, mask, batch, seqlen, heads, kv_heads, label = ab.DENSE[shape]
            label = config or label
            (q, k, v), *_ = ab.input_sets(batch, seqlen, heads, d, kv_heads=kv_heads)
            peer = ab.cudnn_call(mask, heads, kv_heads)
            calls = [("cudnn", lambda: peer(q, k, v))] if mask in ("none", "causal") else []
            for build, version in builds:
                calls.append((build, lambda version=version: (versions.use(version),
                                                              ab.runner(d, mask, heads, kv_heads, label)(q, k, v))))
            for build, call in calls:  # warm-ups: compiles, plans (ncu times them too: marked, then dropped)
                call()
                torch.cuda.synchronize()
                print(f"#call {name} {build} warm", flush=True)
            for _ in range(args.reps):
                for build, call in calls:
                    call()
                    torch.cuda.synchronize()
                    print(f"#call {name} {build} timed", flush=True)
        versions.use(None)


def report(path: Path) -> None:
    """Pairs the manifest lines with ncu's launches in order: each call launches exactly one kernel that
    ncu's filter matches (attngen's main kernel, or cuDNN's attention kernel)."""
    lines = path.read_text().splitlines()
    calls = [line.split()[1:4] for line in lines if line.startswith("#call ")]
    rows = list(csv.DictReader(io.StringIO("\n".join(line for line in lines if line.startswith('"')))))
    duration: dict[int, float] = {}
    names: dict[int, str] = {}
    for r in rows:
        if r["Metric Name"] == "gpu__time_duration.sum":
            duration[int(r["ID"])] = float(r["Metric Value"].replace(",", ""))  # ns (--print-units base)
            names[int(r["ID"])] = r["Kernel Name"]
    launches = [duration[i] for i in sorted(duration)]
    if len(launches) != len(calls):
        for i, call in enumerate(calls):
            print(" ".join(call), names.get(sorted(names)[i]) if i < len(names) else "-")
        sys.exit(f"{len(calls)} calls but {len(launches)} profiled launches: the filter matched more or fewer kernels")
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (case, build, kind), ns in zip(calls, launches):
        if kind == "timed":
            times[case, build].append(ns / 1e6)
    for case in dict.fromkeys(c for c, _, _ in calls):
        ref = statistics.median(times[case, "cudnn"]) if (case, "cudnn") in times else None
        cells = []
        for build in dict.fromkeys(b for c, b, _ in calls if c == case):
            ts = times.get((case, build))
            if ts:
                ratio = f" {ref / statistics.median(ts):.3f}x" if ref and build != "cudnn" else ""
                cells.append(f"{build} {statistics.median(ts):.4f}ms{ratio} (spread {100 * (max(ts) - min(ts)) / min(ts):.1f}%)")
        print(f"{case:24s} " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", action="append", default=[], type=versions.named, metavar="NAME=VERSION",
                        help="a version of the kernel to time beside the tree's: git:REV, a directory of its "
                             "headers or a file (bench/sm90_versions.py)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--report", type=Path, help="pair a finished run's output and ncu CSV")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    if args.report:
        return report(args.report)
    import sm90_ab_probe as ab

    for case in args.cases:
        shape, _, label = case.partition("@")
        if shape not in ab.DENSE:
            parser.error(f"case {case!r}: {shape!r} is not a case of bench/sm90_ab_probe.py DENSE; "
                         f"allowed: {', '.join(ab.DENSE)} (optionally @LABEL)")
        if label:
            try:
                ab.sm90.Sm90Config.from_label(label)
            except ValueError as exc:
                parser.error(f"case {case!r}: {exc}")
    run(args)


if __name__ == "__main__":
    main()
