"""Clock, power and time per call of fwd_sm90 and cuDNN under sustained load, in alternating segments.

The H100 runs long attention kernels at a clock well below its boost (docs/perf-notes.md "Timing side
by side"): if the cap is power, the kernel that spends more energy per call is clocked lower, and a
gain at a fixed clock (ncu's) shrinks at the clock the GPU settles on. This runs each call in a loop
for SECONDS, the two in turn, while nvidia-smi samples the SM clock, the board power, the temperature
and the clock's throttle reasons, and prints per segment: ms per call, mean clock, mean power, energy
per call (power x time) and the reasons seen.

    PYTHONPATH=.:bench python bench/power_probe.py [--seconds 4] [--rounds 2] [CASE ...]   (sm90_ab_probe DENSE)
"""
from __future__ import annotations

import argparse
import collections
import datetime
import subprocess
import time

import torch

import sm90_ab_probe as ab

QUERY = "timestamp,power.draw,clocks.sm,temperature.gpu,clocks_event_reasons.active"


def sustained(fn, sets, seconds: float) -> tuple[float, float, float]:
    """Runs fn over the input sets for `seconds`; returns (start, end, ms per call) in wall time."""
    torch.cuda.synchronize()
    start = time.time()
    calls = 0
    while time.time() - start < seconds:
        for args in sets:
            fn(*args)
            calls += 1
        torch.cuda.synchronize()
    end = time.time()
    return start, end, (end - start) * 1e3 / calls


def parse(lines):
    rows = []
    for line in lines:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except ValueError:
            continue
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("cases", nargs="*", default=["d128-none-16k"])
    args = parser.parse_args()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    segments = []
    with torch.no_grad():
        for name in args.cases:
            run, sets, flops, _ = ab.dense_case(name)
            d, mask, batch, seqlen, heads, kv_heads, _ = ab.DENSE[name]
            calls = {"attngen": run, "cudnn": ab.cudnn_call(mask, heads, kv_heads)}
            for fn in calls.values():  # compile and warm up
                for args_ in sets:
                    fn(*args_)
            for r in range(args.rounds):
                for who, fn in (calls.items() if r % 2 == 0 else reversed(calls.items())):
                    segments.append((name, who, flops, *sustained(fn, sets, args.seconds)))
    time.sleep(0.3)
    smi.terminate()
    rows = parse(smi.stdout.read().splitlines())
    for name, who, flops, start, end, ms in segments:
        inside = [r for r in rows if start + 0.5 <= r[0] <= end]  # the first half second settles
        if not inside:
            print(f"{name:16s} {who:8s} {ms:.3f} ms (no samples)")
            continue
        power = sum(r[1] for r in inside) / len(inside)
        clock = sum(r[2] for r in inside) / len(inside)
        temp = max(r[3] for r in inside)
        reasons = collections.Counter(r[4] for r in inside).most_common(2)
        print(f"{name:16s} {who:8s} {ms:.3f} ms {flops / ms / 1e9:4.0f} TFLOP/s  clock {clock:5.0f} MHz  "
              f"power {power:5.1f} W  {power * ms:6.1f} mJ/call  {temp:.0f} C  reasons {reasons}", flush=True)


if __name__ == "__main__":
    main()
