"""The front door on a GPU (marker `gpu`): torch.compile(fullgraph=True) traces the op with no graph
break and matches eager exactly; CUDA graph capture and replay; the op path and the direct eager
path give identical results."""

from __future__ import annotations

import pytest

import attngen
from attngen import api, reference, tolerance

pytestmark = pytest.mark.gpu


def _inputs(seed=0, B=2, S=300, Hq=8, Hkv=2, D=128):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(H):
        return torch.randn(B, S, H, D, generator=gen, device="cuda").to(torch.bfloat16)

    return rand(Hq), rand(Hkv), rand(Hkv)


def test_fullgraph_compile_matches_eager_exactly_with_no_graph_break():
    import torch

    q, k, v = _inputs()

    def layer(q, k, v):
        out, lse = attngen.attention(q, k, v, mask="causal", return_lse=True)
        return out.float() * 2 + 1, lse

    eager = layer(q, k, v)
    explanation = torch._dynamo.explain(layer)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)(q, k, v)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    ref = reference.attention(q, k, v, mask="causal")
    assert tolerance.check_output(eager[0].sub(1).div(2).to(q.dtype), ref, q, k, v, "bf16", 128**-0.5) is None


def test_cuda_graph_capture_and_replay():
    import torch

    q, k, v = _inputs(seed=1)
    static_q, static_k, static_v = q.clone(), k.clone(), v.clone()
    attngen.attention(static_q, static_k, static_v, mask="causal")  # compile and resolve before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attngen.attention(static_q, static_k, static_v, mask="causal")
    for seed in (2, 3):
        fresh = _inputs(seed=seed)
        for dst, src in zip((static_q, static_k, static_v), fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attngen.attention(*fresh, mask="causal"))


def test_the_op_and_the_direct_eager_path_agree(monkeypatch):
    import torch

    q, k, v = _inputs(seed=4)
    direct = attngen.attention(q, k, v, return_lse=True)
    monkeypatch.setattr(api, "EAGER_DIRECT", False)
    through_op = attngen.attention(q, k, v, return_lse=True)
    assert torch.equal(direct[0], through_op[0]) and torch.equal(direct[1], through_op[1])
    assert torch.equal(torch.ops.attngen.forward(q, k, v, attngen.AttentionSpec(head_dim=128, gqa_ratio=4).key(),
                                                 None)[0], direct[0])


def test_a_layout_seen_before_runs_new_data_and_still_refuses_bad_pointers():
    """The second call of a layout skips the checks (attngen/runtime/prepared.py): new data at new
    addresses must give new, right answers, and a misaligned view must still be refused."""
    import torch

    from attngen.runtime import dispatch

    dispatch.forget()
    results = []
    for seed in (5, 6, 7):  # the same layout three times, at different addresses
        q, k, v = _inputs(seed=seed, S=200)
        out = attngen.attention(q, k, v, mask="causal")
        ref = reference.attention(q, k, v, mask="causal")
        assert tolerance.check_output(out, ref, q, k, v, "bf16", 128**-0.5) is None
        results.append((q.data_ptr(), out))
    assert len({ptr for ptr, _ in results}) > 1 and len(dispatch.eager_prepared) == 1
    # Same shape and strides, but the data starts 8 bytes into the buffer: not 16-byte aligned.
    q, k, v = _inputs(seed=8, S=200)
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    shifted = flat[4:4 + q.numel()].view(q.shape)
    shifted.copy_(q)
    with pytest.raises(ValueError, match="q rows must be 16-byte aligned"):
        attngen.attention(shifted, k, v, mask="causal")
    # The op path's memo (keyed by the spec) gives what the eager one gives.
    assert torch.equal(dispatch.forward(q, k, v, attngen.AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal"))[0],
                       attngen.attention(q, k, v, mask="causal"))
