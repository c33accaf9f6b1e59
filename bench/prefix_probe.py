"""prefix_lm(plen[b]) with closed-form bounds (attngen/maskc/bands.py: an `or` of two upper ends, a length read at
the batch row) against the same mask through its block table and element predicate (spelt `plen[b] + h - h`, which
is no band: what every prefix took before), beside the built-in causal, on each forward family and head dim, timed
side by side in one process (attngen/bench.py time_beside): B=1, 16k tokens, bf16, 16 heads, a prefix of 4096.
Useful TFLOP/s count visible pairs only.

    PYTHONPATH=. python bench/prefix_probe.py [--out DIR]
    python bench/prefix_probe.py --plot RESULTS.json     (the PNG beside it; needs matplotlib only)

Prints one JSON line per case and a table last; with --out, JSON (and, with matplotlib, a PNG) there."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEQLEN = 16384
HEADS = 16
PREFIX = 4096
MASKS = {"closed": "prefix_lm(plen[b])", "table": "kv_idx < plen[b] + h - h or causal"}
WINDOW = "sliding_window(4095, 0)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="draw a results JSON as a PNG beside it, and stop")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return

    import torch

    import attngen
    from attngen import mask_table
    from attngen.bench import time_probe_case
    from attngen.spec import AttentionSpec

    plen = torch.tensor([PREFIX], dtype=torch.int32, device="cuda")
    causal_pairs = SEQLEN * (SEQLEN + 1) // 2
    # rows q < PREFIX see PREFIX keys instead of q + 1
    pairs = {"causal": causal_pairs, "prefix": causal_pairs + PREFIX * (PREFIX - 1) // 2}
    rows = []
    for family, head_dim in [("fwd_sm90", 64), ("fwd_sm90", 128), ("fwd_sm80", 64), ("fwd_sm80", 128)]:
        q, k, v = (torch.randn(1, SEQLEN, HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        specs = {"causal": AttentionSpec(head_dim=head_dim, dtype="bf16", mask="causal", family=family)}
        specs |= {name: AttentionSpec(head_dim=head_dim, dtype="bf16", mask=m, family=family) for name, m in MASKS.items()}

        def call(spec):
            reads = {"plen": plen} if "plen" in spec.mask else None
            return lambda: attngen.attention(q, k, v, spec, inputs=reads)

        if family == "fwd_sm80":  # causal's tile pinned: the A100's default (sm_90a keeps the smaller one at d128)
            tile = attngen.compile(specs["causal"]).plan.config
            pinned = {f: getattr(tile, f) for f in ("block_m", "block_n", "num_warps", "num_stages")}
            specs["closed_causal_tile"] = AttentionSpec(head_dim=head_dim, dtype="bf16", mask=MASKS["closed"],
                                                        family=family, config=pinned)
        if family == "fwd_sm90":  # the expressions' tile pinned: what closed forms other than causal's took before
            from attngen.families.fwd_sm90.family import _preferences

            tile = _preferences()[head_dim, "expressions"][0]
            specs["closed_expressions_tile"] = AttentionSpec(
                head_dim=head_dim, dtype="bf16", mask=MASKS["closed"], family=family,
                config={f: getattr(tile, f) for f in attngen.families.get_family(family).config_fields})
        fns = {name: call(spec) for name, spec in specs.items()}
        times = time_probe_case(fns, f"{family} d{head_dim}", settle=not rows)
        flops = {n: (pairs["causal"] if n == "causal" else pairs["prefix"]) * 4 * head_dim * HEADS for n in times}
        row = {"family": family, "head_dim": head_dim, "ms": times,
               "tflops": {n: flops[n] / ms / 1e9 for n, ms in times.items()},
               "configs": {n: attngen.compile(s).plan.config.label() for n, s in specs.items()},
               "tables": {n: mask_table.for_problem(s.problem) is not None for n, s in specs.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # A window on fwd_sm90 at d64 too: its default (causal's config on the counter) against the expressions' tile.
    from attngen.families.fwd_sm90.family import _preferences

    q, k, v = (torch.randn(1, SEQLEN, HEADS, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tile = _preferences()[64, "expressions"][0]
    window = {"default": AttentionSpec(head_dim=64, dtype="bf16", mask=WINDOW, family="fwd_sm90"),
              "expressions_tile": AttentionSpec(head_dim=64, dtype="bf16", mask=WINDOW, family="fwd_sm90", config={
                  f: getattr(tile, f) for f in attngen.families.get_family("fwd_sm90").config_fields})}
    times = time_probe_case({n: (lambda s=s: attngen.attention(q, k, v, s)) for n, s in window.items()}, "window", False)
    windows = {"mask": WINDOW, "head_dim": 64, "ms": times,
               "configs": {n: attngen.compile(s).plan.config.label() for n, s in window.items()}}
    print(json.dumps({"window": windows}), flush=True)
    gpu = torch.cuda.get_device_properties(0).name
    print(f"\nfwd_sm90 d64 {WINDOW}: default {windows['configs']['default']} {times.get('default', 0):.3f} ms, "
          f"expressions' tile {times.get('expressions_tile', 0):.3f} ms")
    print(f"\n{gpu}: 16k, prefix {PREFIX}, useful TFLOP/s")
    for r in rows:
        t = r["tflops"]
        print(f"{r['family']} d{r['head_dim']}: causal {t.get('causal', 0):6.1f}  closed {t.get('closed', 0):6.1f} "
              f"({r['configs']['closed']})  table {t.get('table', 0):6.1f} ({r['configs']['table']})  "
              f"closed/table {t.get('closed', 0) / max(t.get('table', 1e-9), 1e-9):.3f}"
              + (f"  closed on causal's tile {t['closed_causal_tile']:6.1f}" if "closed_causal_tile" in t else "")
              + (f"  closed on the expressions' tile {t['closed_expressions_tile']:6.1f}"
                 if "closed_expressions_tile" in t else ""))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix-probe.json").write_text(json.dumps({"gpu": gpu, "rows": rows, "window": windows}, indent=1))
        try:
            plot({"gpu": gpu, "rows": rows}, args.out / "prefix-probe.png")
        except ImportError:
            pass


def plot(results: dict, path: Path) -> None:
    """Useful TFLOP/s of each case, grouped by family and head dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["causal", "closed", "closed_causal_tile", "closed_expressions_tile", "table"]
    labels = {"causal": "causal", "closed": "prefix, closed form (default)", "closed_causal_tile":
              "prefix, closed form on causal's tile", "closed_expressions_tile": "prefix, closed form on the expressions' tile",
              "table": "prefix, block table + predicate (before)"}
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.16
    for i, name in enumerate(names):
        xs = [j + (i - 2) * width for j, r in enumerate(rows) if name in r["tflops"]]
        ys = [r["tflops"][name] for r in rows if name in r["tflops"]]
        ax.bar(xs, ys, width, label=labels[name])
    ax.set_xticks(range(len(rows)), [f"{r['family']} d{r['head_dim']}" for r in rows])
    ax.set_ylabel("useful TFLOP/s")
    ax.set_title(f"prefix_lm(plen[b]), 16k tokens, prefix {PREFIX}, bf16 ({results['gpu']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
