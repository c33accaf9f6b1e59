#!/usr/bin/env python3
"""Sweep decode_sm80 configs (block_n, warps, stages) and split counts on the bench's decode shapes
(attngen/bench_decode.py), paged cache, GPU time from CUDA graphs. Prints one JSON line per result
and writes them to $OUT/decode-sweep.json: the evidence behind the family's default config and
choose_splits (docs/perf-notes.md, Decode)."""

import itertools
import json
import os
from pathlib import Path

import torch

import attngen
from attngen.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, SHAPES, _graph_ms, _paged
from attngen.errors import SpecError

results = []
gen = torch.Generator().manual_seed(0)
for batch, seqlen in (*SHAPES, (1, 4096)):
    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kp, vp, table = _paged(k, torch.randn_like(k), gen)
    del k
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
        if block_n // warps < 16:
            continue
        config = {"block_m": 16, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        try:
            spec = attngen.AttentionSpec(head_dim=HEAD_DIM, gqa_ratio=HEADS_Q // HEADS_KV, family="decode_sm80",
                                         config=config)
            splits = (None,) if batch * seqlen > 4096 else (None, 4, 8, 16, 32)
            for s in splits:
                ms = _graph_ms(lambda s=s: attngen.decode(q, kp, vp, lens, page_table=table, spec=spec, num_splits=s))
                row = {"batch": batch, "seqlen": seqlen, **config, "splits": s, "ms": ms,
                       "tbps": 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2 / ms / 1e9}
                results.append(row)
                print(json.dumps(row), flush=True)
        except SpecError as exc:
            print(json.dumps({"config": config, "skipped": str(exc)[:80]}), flush=True)
out = Path(os.environ.get("OUT", "."))
(out / "decode-sweep.json").write_text(json.dumps(results, indent=0))
best = {}
for r in results:
    key = (r["batch"], r["seqlen"])
    if key not in best or r["ms"] < best[key]["ms"]:
        best[key] = r
for key, r in best.items():
    print("best", key, {k: r[k] for k in ("block_n", "num_warps", "num_stages", "splits", "tbps")})
