"""fwd_sm80's tiles for masks without a closed form: each mask on the none/causal tile and on the `expressions` tile
(tile_defaults.yaml), beside the family's built-in causal, timed side by side in one process (attngen/bench.py
time_beside): B=1, 16k tokens, bf16, 16 heads, d128 (or --head-dim). Then the masks bench's 16 documents (causal
within each) as packed sequences on fwd_sm80's per-sequence tiles and as document ids. Useful TFLOP/s count
visible pairs only.

    PYTHONPATH=. python bench/sm80_tile_probe.py [--head-dim 128] [--out DIR]

Prints one JSON line per mask and a table last; with --out, JSON there."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEQLEN = 16384
HEADS = 16
MASKS = ("doc[b, q_idx] == doc[b, kv_idx] and causal", "chunked(8192)", "prefix_lm(plen[b])",
         "kv_idx % 5 != 2 or causal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    import attngen
    from attngen.bench import settle_clock, time_beside
    from attngen.bench_masks import _document_ids
    from attngen.families.fwd_sm80.family import _preferences
    from attngen.masks import get_mask
    from attngen.spec import AttentionSpec

    d = args.head_dim
    q, k, v = (torch.randn(1, SEQLEN, HEADS, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ids, _ = _document_ids()
    inputs = {"doc": ids.cuda(), "plen": torch.tensor([SEQLEN // 4], dtype=torch.int32, device="cuda")}
    tiles = {"plain": _preferences()[d, False][0], "expressions": _preferences()[d, True][0]}

    def call(mask, tile):
        config = {f: getattr(tile, f) for f in ("block_m", "block_n", "num_warps", "num_stages")}
        spec = AttentionSpec(head_dim=d, dtype="bf16", mask=mask, family="fwd_sm80", config=config)
        reads = {n: inputs[n] for n in inputs if n in mask}
        return lambda: attngen.attention(q, k, v, spec, inputs=reads or None)

    causal = call("causal", tiles["plain"])
    rows = []
    with torch.no_grad():
        settle_clock(causal)
        for mask in MASKS:
            rq = torch.arange(SEQLEN, device="cuda")
            lowering = get_mask(mask)
            pairs = sum(int(lowering.dense_visible(rq[i:i + 512, None], rq[None, :], SEQLEN, SEQLEN,
                                                   inputs={n: t for n, t in inputs.items()}).sum())
                        for i in range(0, SEQLEN, 512))
            times, errors = time_beside({"causal": causal, **{name: call(mask, t) for name, t in tiles.items()}}, [()])
            for name, exc in errors.items():
                print(f"{mask} {name}: {type(exc).__name__}: {exc}", flush=True)
            causal_pairs = SEQLEN * (SEQLEN + 1) // 2
            useful = {name: pairs * 4 * d * HEADS / ms / 1e9 for name, ms in times.items() if name != "causal"}
            row = {"mask": mask, "head_dim": d, "pairs": pairs, "ms": times,
                   "tiles": {n: t.label() for n, t in tiles.items()}, "tflops": useful,
                   "causal_tflops": causal_pairs * 4 * d * HEADS / times["causal"] / 1e9}
            rows.append(row)
            print(json.dumps(row), flush=True)
        # The documents as packed sequences (attention_varlen, per-sequence tiles on fwd_sm80) against the ids.
        from attngen import varlen

        _, lengths = _document_ids()
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
        packed = [x[0] for x in (q, k, v)]

        def packed_call():
            return varlen.attention_varlen(*packed, cu, cu, mask="causal")

        varlen.PER_SEQUENCE_FAMILY = "fwd_sm80"
        try:
            key = varlen._per_sequence(*packed, "causal", None, None, None, 0.0)
            assert key and '"family":"fwd_sm80"' in key, key
            ids_mask = "doc[b, q_idx] == doc[b, kv_idx] and causal"
            ids_spec = AttentionSpec(head_dim=d, dtype="bf16", mask=ids_mask, family="fwd_sm80")
            times, _ = time_beside({"causal": causal, "varlen": packed_call,
                                    "ids": lambda: attngen.attention(q, k, v, ids_spec, inputs={"doc": inputs["doc"]})},
                                   [()])
        finally:
            varlen.PER_SEQUENCE_FAMILY = None
        doc_pairs = int(sum(n * (n + 1) // 2 for n in lengths.tolist()))
        causal_tflops = SEQLEN * (SEQLEN + 1) // 2 * 4 * d * HEADS / times["causal"] / 1e9
        documents = {"ms": times, "tflops": {n: doc_pairs * 4 * d * HEADS / times[n] / 1e9 for n in ("varlen", "ids")},
                     "causal_tflops": causal_tflops}
        print(json.dumps({"documents": documents}), flush=True)
    gpu = torch.cuda.get_device_properties(0).name
    print(f"\n{gpu}: fwd_sm80 d{d}, 16k, useful TFLOP/s (causal {rows[0]['causal_tflops']:.0f})")
    for r in rows:
        print(f"{r['mask']:48} " + "  ".join(f"{n} {r['tiles'][n]} {r['tflops'].get(n, float('nan')):6.1f}"
                                              for n in ("plain", "expressions")))
    t = documents["tflops"]
    print(f"16 documents, causal within each: varlen (per-sequence tiles) {t['varlen']:.1f}, "
          f"ids {t['ids']:.1f} ({t['varlen'] / documents['causal_tflops']:.3f}x / {t['ids'] / documents['causal_tflops']:.3f}x "
          f"the dense causal)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"sm80-tile-probe-d{d}.json").write_text(json.dumps({"gpu": gpu, "rows": rows,
                                                                         "documents": documents}, indent=1))


if __name__ == "__main__":
    main()
