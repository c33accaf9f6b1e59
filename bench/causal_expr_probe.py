"""`mask: "q_idx >= kv_idx"` against the built-in causal on each forward family and head dim (issue 10's bar:
within 3%), with the tile the expression took before it was given causal's (masks.band_shaped), all timed side by
side in one process (attngen/bench.py time_beside): B=1, 16k tokens, bf16, 16 heads (8 at d256).

    PYTHONPATH=. python bench/causal_expr_probe.py [--out DIR]

Per (family, head dim): causal, the expression on its default config, and the expression pinned to the
expressions' tile (fwd_sm80: tile_defaults.yaml `expressions`; fwd_sm90: the expressions' tile on causal's
schedule). fwd_sm80 d128 also times sliding_window(4095, 0) on both tiles. Prints a table last; with --out, JSON
there."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEQLEN = 16384
EXPR = "q_idx >= kv_idx"
WINDOW = "sliding_window(4095, 0)"


def old_config(family: str, head_dim: int, mask: str):
    """The config `mask` took before bands were given the built-ins' tiles."""
    from attngen import targets
    from attngen.families import get_family
    from attngen.families.fwd_sm80.family import _preferences as sm80_preferences
    from attngen.families.fwd_sm90.family import _preferences as sm90_preferences
    from attngen.spec import AttentionSpec

    target = targets.target("sm_90a")
    if family == "fwd_sm80":
        return sm80_preferences()[head_dim, True][0]
    causal = get_family(family).default_config(AttentionSpec(head_dim=head_dim, mask="causal").problem, target, SEQLEN)
    expressions = sm90_preferences()[head_dim, "expressions"][0]
    return dataclasses.replace(expressions, schedule=causal.schedule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    import attngen
    from attngen.bench import time_probe_case
    from attngen.families import get_family
    from attngen.spec import AttentionSpec

    cases = [("fwd_sm80", d) for d in (64, 96, 128, 256)] + [("fwd_sm90", d) for d in (64, 128, 256)]
    rows = []
    for family, head_dim in cases:
        heads = 8 if head_dim == 256 else 16
        q, k, v = (torch.randn(1, SEQLEN, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fields = get_family(family).config_fields

        def call(mask, config=None):
            pinned = None if config is None else {f: getattr(config, f) for f in fields}
            spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask=mask, family=family, config=pinned)
            return lambda: attngen.attention(q, k, v, spec)

        fns = {"causal": call("causal"), "expr": call(EXPR), "expr_old_tile": call(EXPR, old_config(family, head_dim, EXPR))}
        if family == "fwd_sm80" and head_dim == 128:
            fns |= {"window": call(WINDOW), "window_old_tile": call(WINDOW, old_config(family, head_dim, WINDOW))}
        times = time_probe_case(fns, f"{family} d{head_dim}", settle=not rows)
        row = {"family": family, "head_dim": head_dim, "heads": heads, "seqlen": SEQLEN,
               "old_tile": old_config(family, head_dim, EXPR).label(), "ms": times,
               "expr_vs_causal": times.get("expr", float("nan")) / times["causal"],
               "old_tile_vs_causal": times.get("expr_old_tile", float("nan")) / times["causal"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "torch": torch.__version__}
    print(f"\n{meta['gpu']}: `{EXPR}` / causal (16k, bf16)")
    print(f"{'family':9} {'d':>4} {'causal ms':>10} {'expr':>7} {'old tile':>18}")
    for r in rows:
        print(f"{r['family']:9} {r['head_dim']:>4} {r['ms']['causal']:>10.3f} {r['expr_vs_causal']:>7.3f} "
              f"{r['old_tile_vs_causal']:>7.3f} {r['old_tile']:>10}")
        if "window" in r["ms"]:
            print(f"{'':9} {'':>4} window 4096: {r['ms']['window']:.3f} ms, old tile {r['ms']['window_old_tile']:.3f} ms")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "causal-expr-probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
