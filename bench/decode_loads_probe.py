"""Decode K/V loads on the H100: cp.async against TMA tensor-map boxes (config.loads), same process.

For each of the decode bench's shapes (GQA 32/8, d128, bf16, one new token), contiguous and paged
(page 64, shuffled), the GPU time of attngen.decode from CUDA graphs for a set of configs, beside
cuDNN's; then the graph step at 1 x 4096 per config. Prints one JSON line per measurement; the
first argument, if given, is a file the lines are also written to.

    PYTHONPATH=. python bench/decode_loads_probe.py [$OUT/decode-loads.jsonl]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, SHAPES, _copy_bandwidth, _graph_ms, _paged
from attngen.families.decode_sm80.family import DecodeConfig
from bench.decode_paged_probe import json_lines

LABELS = ("m16n64w4s3", "m16n64w4s3t", "m16n64w4s2t", "m16n64w4s4t", "m16n128w4s2t", "m16n128w8s3t",
          "m16n32w2s4t")
emit = json_lines(open(sys.argv[1], "w") if len(sys.argv) > 1 else None)


def spec_of(label: str) -> attngen.AttentionSpec:
    config = DecodeConfig.from_label(label)
    return attngen.AttentionSpec(head_dim=HEAD_DIM, gqa_ratio=HEADS_Q // HEADS_KV, family="decode_sm80",
                                 config=config.to_dict())


copy = _copy_bandwidth()
emit(gpu=torch.cuda.get_device_name(0), copy_tbps=copy)
for batch, seqlen in SHAPES:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    kp, vp, table = _paged(k, v, gen)
    nbytes = 2 * k.numel() * 2
    tb = lambda ms: nbytes / (ms * 1e-3) / 1e12  # noqa: E731
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    emit(shape=f"{batch}x{seqlen}", impl="cudnn", tbps=tb(_graph_ms(cudnn)))
    ref = attngen.decode(q, k, v, lens)
    for label in LABELS:
        spec = spec_of(label)
        for layout, args in (("contiguous", (q, k, v, lens)), ("paged", (q, kp, vp, lens))):
            table_arg = table if layout == "paged" else None
            try:
                out = attngen.decode(*args, page_table=table_arg, spec=spec)
                err = (out.float() - ref.float()).abs().max().item()
                ms = _graph_ms(lambda: attngen.decode(*args, page_table=table_arg, spec=spec))
                emit(shape=f"{batch}x{seqlen}", impl=label, layout=layout, tbps=tb(ms), vs_copy=tb(ms) / copy,
                     max_diff_vs_default=err)
            except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported
                emit(shape=f"{batch}x{seqlen}", impl=label, layout=layout, error=f"{type(exc).__name__}: {exc}"[:300])
    emit(shape=f"{batch}x{seqlen}", impl="cudnn", tbps=tb(_graph_ms(cudnn)), note="again, after")
    del q, k, v, kp, vp, table
    torch.cuda.empty_cache()

# The graph step at 1 x 4096 (paged 64), caches rotated past L2, per config.
batch, seqlen = 1, 4096
l2 = torch.cuda.get_device_properties(0).L2_cache_size
nbytes = 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2
count = max(2, -(-3 * l2 // nbytes))
gen = torch.Generator().manual_seed(1)
steps = []
for _ in range(count):
    k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kp, vp, table = _paged(k, torch.randn_like(k), gen)
    steps.append((torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16), kp, vp,
                  torch.full((batch,), seqlen, dtype=torch.int32, device="cuda"), table))
floor_ms = nbytes / (copy * 1e12) * 1e3
for label in LABELS:
    spec = spec_of(label)
    it = iter(range(10**9))

    def step():
        q, kp, vp, lens, table = steps[next(it) % count]
        return attngen.decode(q, kp, vp, lens, page_table=table, spec=spec)

    ms = _graph_ms(step, calls=4 * count)
    emit(shape="graph 1x4096 paged", impl=label, us=ms * 1e3, vs_floor=ms / floor_ms)
