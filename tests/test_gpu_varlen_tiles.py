"""attention_varlen through kernels that tile per sequence (Problem.varlen: fwd_sm90 and fwd_sm80, each test
on both where the GPU runs them; marker `gpu`): outputs and LSE against the float64 reference computed one sequence at a time
(attngen/reference.py attention_varlen), within attngen/tolerance.py's bounds. Covers sequences
without rows or keys, of one token, Sq != Sk per sequence, GQA, every head dim, windows, chunked
attention, softcap, ALiBi and sinks, more sequences than the tile builder's block holds, rows
outside every sequence, malformed cu_seqlens, and a CUDA graph replayed with new boundaries."""

from __future__ import annotations

import pytest

import attngen
from attngen import reference, tolerance, varlen

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["fwd_sm90", "fwd_sm80"], autouse=True)
def tiling_family(request, monkeypatch):
    """Every test on each forward family that tiles per sequence, where this GPU runs it (fwd_sm90 needs
    sm_90a; fwd_sm80 runs on the H100 too, pinned: varlen.PER_SEQUENCE_FAMILY)."""
    import torch

    from attngen import families, targets
    from attngen.spec import AttentionSpec

    problem = AttentionSpec(head_dim=128, mask="causal", varlen=True).problem
    reason = families.get_family(request.param).supports(problem, targets.device_target(torch.cuda.current_device()))
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    monkeypatch.setattr(varlen, "PER_SEQUENCE_FAMILY", request.param)
    return request.param

CASES = [  # (lengths_q, lengths_k, Hq, Hkv, D, dtype, mask, score_mod, sink)
    ([300, 0, 1, 517, 64], [300, 9, 1, 517, 0], 8, 2, 128, "bf16", "causal", None, None),
    ([200, 333, 1], [250, 300, 40], 4, 4, 64, "fp16", "none", None, None),
    ([700, 129, 64], [700, 129, 64], 8, 1, 128, "bf16", "sliding_window(100, 0)", "alibi", None),
    ([257, 3, 400], [257, 30, 400], 8, 2, 64, "bf16", "causal", "softcap(20.0)", "sinks[h]"),
    ([1000, 77, 513], [1000, 77, 600], 4, 2, 256, "bf16", "causal", None, None),
    ([190, 450, 2], [190, 450, 2], 6, 3, 96, "fp16", "chunked(64) and causal", None, None),
    ([129, 128, 127, 1], [1, 128, 300, 1], 2, 1, 128, "fp16", "causal", None, None),
    # a band written out (attngen/maskc/bands.py): q_len and kv_len are each sequence's
    ([300, 1, 130], [300, 50, 200], 4, 2, 128, "bf16",
     "kv_idx <= q_idx + kv_len - q_len and kv_idx > q_idx + kv_len - q_len - 64 and kv_idx >= 5", None, None),
    # a prefix of each sequence's own first 40 keys (an `or` of bands: bands.Widest), rows of Sq != Sk
    ([300, 1, 130, 20], [300, 50, 200, 20], 4, 2, 64, "bf16", "prefix_lm(40)", None, None),
]


def _dtype(name):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def make(lengths_q, lengths_k, Hq, Hkv, D, dtype, seed=0, extra_q=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lengths_q) + extra_q, Hq, D, device="cuda", generator=g).to(_dtype(dtype))
    k = torch.randn(sum(lengths_k), Hkv, D, device="cuda", generator=g).to(_dtype(dtype))
    v = torch.randn(sum(lengths_k), Hkv, D, device="cuda", generator=g).to(_dtype(dtype))
    cu = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for lengths in (lengths_q, lengths_k)]
    inputs = {"slope": torch.linspace(0.01, 0.2, Hq, device="cuda"),
              "sinks": torch.linspace(-1.0, 2.0, Hq, device="cuda")}
    return q, k, v, cu[0], cu[1], inputs


def _their_inputs(inputs, score_mod, sink):
    return {n: t for n, t in inputs.items() if (n == "slope" and score_mod == "alibi") or (n == "sinks" and sink)}


def check(out, lse, q, k, v, cu_q, cu_k, dtype, **kw):
    want, want_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    p = [t[None] for t in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    bad = tolerance.check_output(out[None], want[None], *p, dtype, scale)
    assert bad is None, bad
    bad = tolerance.check_lse(lse[None], want_lse[None], p[0], p[1], scale)
    assert bad is None, bad


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}-d{c[4]}-{c[6][:10]}-{c[7]}-{c[8]}")
def test_per_sequence_tiles_match_the_reference(case, tiling_family):
    import torch

    from attngen.spec import AttentionSpec

    lengths_q, lengths_k, Hq, Hkv, D, dtype, mask, score_mod, sink = case
    q, k, v, cu_q, cu_k, inputs = make(lengths_q, lengths_k, Hq, Hkv, D, dtype, seed=len(lengths_q) + D)
    theirs = _their_inputs(inputs, score_mod, sink) or None
    key = varlen._per_sequence(q, k, v, mask, score_mod, sink, theirs, 0.0)
    assert key and AttentionSpec.from_key(key).family == tiling_family  # not the document mask
    with torch.no_grad():
        out, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, mask=mask, score_mod=score_mod, sink=sink,
                                            inputs=theirs, return_lse=True)
    assert out.shape == q.shape and lse.shape == (Hq, q.shape[0])
    check(out, lse, q, k, v, cu_q, cu_k, dtype, mask=mask, score_mod=score_mod, sink=sink, inputs=theirs)


def test_more_sequences_than_the_builder_has_threads():
    """2100 sequences of 0..6 tokens: the tile builder's scans run over three chunks."""
    import torch

    g = torch.Generator().manual_seed(3)
    lengths_q = torch.randint(0, 7, (2100,), generator=g).tolist()
    lengths_k = [n + int(torch.randint(0, 5, (1,), generator=g)) for n in lengths_q]
    q, k, v, cu_q, cu_k, _ = make(lengths_q, lengths_k, 4, 2, 64, "bf16", seed=11)
    with torch.no_grad():
        out, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", return_lse=True)
    check(out, lse, q, k, v, cu_q, cu_k, "bf16", mask="causal")


@pytest.mark.parametrize("sequences", [1, 16, 256, 257, 600, 1024])
def test_the_builder_as_wide_as_its_sequences(sequences):
    """The narrowest builder that holds the sequences runs (256 threads, or 1,024: attngen/families/
    varlen_tiles.py build_threads): counts at each width's edges, one sequence of 16 tiles and the rest of
    0 to 8 rows (the tolerance's bound is dense over the packed tokens: few of them)."""
    import torch

    g = torch.Generator().manual_seed(sequences)
    lengths_q = [2000] + torch.randint(0, 9, (sequences - 1,), generator=g).tolist()
    lengths_k = [n + int(torch.randint(0, 9, (1,), generator=g)) for n in lengths_q]
    q, k, v, cu_q, cu_k, _ = make(lengths_q, lengths_k, 4, 2, 64, "bf16", seed=sequences)
    with torch.no_grad():
        out, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", return_lse=True)
    check(out, lse, q, k, v, cu_q, cu_k, "bf16", mask="causal")


def test_one_long_sequence_and_rows_outside_every_sequence():
    """Rows before cu_seqlens_q[0] and past cu_seqlens_q[-1] see no key: 0 and -inf, written (the
    outputs start as NaN through a poisoned allocator is not possible here, so they are compared)."""
    import torch

    q, k, v, cu_q, cu_k, _ = make([3000, 1500], [3000, 1500], 4, 4, 128, "bf16", seed=4, extra_q=300)
    cu_q = torch.tensor([100, 3100, 4600], dtype=torch.int32, device="cuda")  # rows 0..99 and 4600.. outside
    with torch.no_grad():
        out, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", return_lse=True)
    assert torch.all(out[:100] == 0) and torch.all(out[4600:] == 0)
    assert torch.all(lse[:, :100] == -torch.inf) and torch.all(lse[:, 4600:] == -torch.inf)
    check(out, lse, q, k, v, cu_q, cu_k, "bf16", mask="causal")


def test_malformed_cu_seqlens_read_safely():
    """Boundaries that decrease or pass the totals: each sequence starts where the previous one
    ended (the running maximum, clipped to the tensors), as varlen_tiles.cuh documents."""
    import torch

    q, k, v, _, _, _ = make([600], [500], 4, 2, 64, "fp16", seed=9)
    cu_q = torch.tensor([0, 400, 100, 900], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([-5, 300, 200, 10_000], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        out, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", return_lse=True)
    torch.cuda.synchronize()
    clipped_q = torch.tensor([0, 400, 400, 600], dtype=torch.int32, device="cuda")
    clipped_k = torch.tensor([0, 300, 300, 500], dtype=torch.int32, device="cuda")
    check(out, lse, q, k, v, clipped_q, clipped_k, "fp16", mask="causal")


def test_cuda_graph_replays_with_new_boundaries():
    """The tile list is built on the GPU each launch: a captured call follows cu_seqlens' new values."""
    import torch

    q, k, v, cu_q, cu_k, _ = make([500, 300, 224], [500, 300, 224], 4, 4, 128, "bf16", seed=5)
    with torch.no_grad():
        attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal")  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", return_lse=True)
    for bounds in ([0, 500, 800, 1024], [0, 10, 1000, 1024], [0, 1024, 1024, 1024]):
        cu_q.copy_(torch.tensor(bounds, dtype=torch.int32))
        cu_k.copy_(cu_q)
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, q, k, v, cu_q, cu_k, "bf16", mask="causal")


def test_the_document_mask_path_agrees():
    """The two ways attention_varlen runs (per-sequence tiles, the document mask over batch 1) on the
    same call: both within tolerance of the reference."""
    import torch

    q, k, v, cu_q, cu_k, _ = make([700, 1, 900], [700, 5, 900], 8, 2, 128, "bf16", seed=8)
    outs = []
    with torch.no_grad():
        for tiles in (True, False):
            varlen.PER_SEQUENCE_TILES = tiles
            try:
                outs.append(attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", return_lse=True))
            finally:
                varlen.PER_SEQUENCE_TILES = True
    for out, lse in outs:
        check(out, lse, q, k, v, cu_q, cu_k, "bf16", mask="causal")


def test_torch_compile_fullgraph_runs_both_paths(tiling_family):
    """torch.compile(fullgraph=True) over attention_varlen: without gradients the per-sequence tiles
    (chosen at trace time: the graph's op is the varlen spec's), with them the document mask, whose
    per-token arrays are built inside the graph; both within tolerance, and the deterministic
    backward's gradients bitwise equal to the eager call's (the same kernels on the same inputs)."""
    import torch

    q, k, v, cu_q, cu_k, inputs = make([300, 1, 517], [300, 9, 517], 8, 2, 128, "bf16", seed=9)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k, v, cu_q, cu_k, sinks):
        return attngen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal", sink="sinks[h]",
                                        inputs={"sinks": sinks}, return_lse=True, deterministic=True)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    with torch.no_grad():
        out, lse = compiled(q, k, v, cu_q, cu_k, inputs["sinks"])
    keys = [str(n.args[3]) for n in graphs[-1].graph.nodes if n.op == "call_function" and "attngen" in str(n.target)]
    assert len(keys) == 1 and '"varlen":true' in keys[0] and f'"family":"{tiling_family}"' in keys[0]
    check(out, lse, q, k, v, cu_q, cu_k, "bf16", mask="causal", sink="sinks[h]", inputs={"sinks": inputs["sinks"]})

    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = compiled(qg, kg, vg, cu_q, cu_k, inputs["sinks"])
    check(out.detach(), lse.detach(), q, k, v, cu_q, cu_k, "bf16", mask="causal", sink="sinks[h]",
          inputs={"sinks": inputs["sinks"]})
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    qe, ke, ve = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    eager_out, _ = layer(qe, ke, ve, cu_q, cu_k, inputs["sinks"])
    eager = torch.autograd.grad(eager_out, (qe, ke, ve), dout)
    for got, want in zip(grads, eager):
        assert torch.equal(got, want)
    torch._dynamo.reset()
