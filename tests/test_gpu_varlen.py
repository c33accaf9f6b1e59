"""attngen.attention_varlen on a GPU (marker `gpu`): sequences packed end to end (attngen/varlen.py)
against the float64 reference of the same packed problem, which tests/test_varlen.py holds to each
sequence computed on its own; outputs and LSE within attngen/tolerance.py's bounds, gradients too;
empty sequences, sequences of one token, Sq != Sk per sequence, GQA, windows, ALiBi, sinks."""

from __future__ import annotations

import pytest

import attngen
from attngen import reference, tolerance, varlen

pytestmark = pytest.mark.gpu

CASES = [  # (lengths_q, lengths_k, Hq, Hkv, D, dtype, mask, score_mod, sink)
    ([300, 0, 1, 517, 64], [300, 9, 1, 517, 0], 8, 2, 128, "bf16", "causal", None, None),
    ([200, 333, 1], [250, 300, 40], 4, 4, 64, "fp16", "none", None, None),
    ([700, 129, 64], [700, 129, 64], 8, 1, 128, "bf16", "sliding_window(100, 0)", "alibi", None),
    ([257, 3, 400], [257, 30, 400], 8, 2, 64, "bf16", "causal", "softcap(20.0)", "sinks[h]"),
]


def _dtype(name):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def make(lengths_q, lengths_k, Hq, Hkv, D, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lengths_q), Hq, D, device="cuda", generator=g).to(_dtype(dtype))
    k = torch.randn(sum(lengths_k), Hkv, D, device="cuda", generator=g).to(_dtype(dtype))
    v = torch.randn(sum(lengths_k), Hkv, D, device="cuda", generator=g).to(_dtype(dtype))
    cu = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for lengths in (lengths_q, lengths_k)]
    inputs = {"slope": torch.linspace(0.01, 0.2, Hq, device="cuda"),
              "sinks": torch.linspace(-1.0, 2.0, Hq, device="cuda")}
    return q, k, v, cu[0], cu[1], inputs


def _their_inputs(inputs, score_mod, sink):
    return {n: t for n, t in inputs.items() if (n == "slope" and score_mod == "alibi") or (n == "sinks" and sink)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}-d{c[4]}-{c[6][:8]}-{c[7]}-{c[8]}")
def test_forward_and_gradients_match_the_reference(case):
    import torch

    lengths_q, lengths_k, Hq, Hkv, D, dtype, mask, score_mod, sink = case
    q, k, v, cu_q, cu_k, inputs = make(lengths_q, lengths_k, Hq, Hkv, D, dtype, seed=len(lengths_q) + D)
    theirs = _their_inputs(inputs, score_mod, sink) or None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attngen.attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), mask=mask,
                                        score_mod=score_mod, sink=sink, inputs=theirs, return_lse=True)
    assert out.shape == q.shape and lse.shape == (Hq, q.shape[0]) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()

    # The packed problem attention() ran, in float64 (tests/test_varlen.py: = each sequence alone).
    texts = varlen.lowered(mask, score_mod, sink)
    all_inputs = {**(theirs or {}), **varlen.varlen_inputs(*texts, q, k, cu_q, cu_k)}
    kw = dict(mask=texts[0], score_mod=texts[1], sink=texts[2], inputs=all_inputs)
    p = [t[None] for t in (q, k, v)]
    ref_out, ref_lse = reference.attention(*p, return_lse=True, **kw)
    scale = D**-0.5
    assert tolerance.check_output(out[None], ref_out, *p, dtype, scale) is None
    assert tolerance.check_lse(lse[None], ref_lse, p[0], p[1], scale) is None
    want, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, mask=mask, score_mod=score_mod, sink=sink,
                                         inputs=theirs)
    assert tolerance.check_output(out[None], want[None], *p, dtype, scale) is None  # the per-sequence view
    ref = reference.attention_grads(*p, dout[None], **kw)
    bad = tolerance.check_grads(tuple(g[None] for g in grads), ref, *p, out[None].detach(), dout[None], dtype, scale,
                                lse=lse[None].detach())
    assert bad is None, bad


def test_alibi_over_global_positions_reads_int_offsets_exactly():
    """ALiBi over a context-parallel shard's global positions (offsets past float32's 2**24, read as int(name)),
    per sequence: the forward (per-sequence tiles) and the gradients (the document mask, whose modifier then reads
    the positions as ints) against each sequence computed on its own."""
    import torch

    lengths = [300, 1, 200]
    q, k, v, cu_q, cu_k, inputs = make(lengths, lengths, 8, 2, 128, "bf16", seed=3)
    off = torch.tensor(50_000_001, dtype=torch.int32, device="cuda")
    theirs = {"slope": inputs["slope"], "q_offset": off, "kv_offset": off}
    score_mod = "score - slope[h] * abs(q_idx + int(q_offset) - kv_idx - int(kv_offset))"
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attngen.attention_varlen(*leaves, cu_q, cu_k, 300, 300, mask="causal", score_mod=score_mod, inputs=theirs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    want, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", score_mod=score_mod, inputs=theirs)
    p = [t[None] for t in (q, k, v)]
    scale = 128**-0.5
    assert tolerance.check_output(out[None].detach(), want[None], *p, "bf16", scale) is None
    texts = varlen.lowered("causal", score_mod, None)
    kw = dict(mask=texts[0], score_mod=texts[1], inputs={**theirs, **varlen.varlen_inputs(*texts, q, k, cu_q, cu_k)})
    ref = reference.attention_grads(*p, dout[None], **kw)
    _, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, 300, 300, mask="causal", score_mod=score_mod, inputs=theirs,
                                      return_lse=True)
    bad = tolerance.check_grads(tuple(g[None] for g in grads), ref, *p, out[None].detach(), dout[None], "bf16", scale,
                                lse=lse[None])
    assert bad is None, bad


def test_sixteen_documents_in_one_long_sequence():
    """The issue's packed-documents shape scaled down: 16 random lengths in 8192 tokens, causal."""
    import torch

    g = torch.Generator().manual_seed(5)
    cuts = sorted(torch.randperm(8191, generator=g)[:15].add(1).tolist())
    bounds = [0, *cuts, 8192]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    q, k, v, cu_q, cu_k, _ = make(lengths, lengths, 8, 8, 128, "bf16", seed=6)
    out, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", return_lse=True)
    want, want_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, mask="causal")
    p = [t[None] for t in (q, k, v)]
    assert tolerance.check_output(out[None], want[None], *p, "bf16", 128**-0.5) is None
    assert tolerance.check_lse(lse[None], want_lse[None], p[0], p[1], 128**-0.5) is None
