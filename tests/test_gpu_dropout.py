"""Fused dropout on a GPU (marker `gpu`): the kernels keep exactly the elements attngen/philox.py
maps (docs/dropout.md), whatever the family or tile, in the forward and in the backward; outputs,
LSEs and gradients match the reference with the same mask within attngen/tolerance.py's bounds; the
keep rate is the realised p's; seeds reproduce and differ; torch.compile(fullgraph=True) and CUDA
graph capture work with dropout; bad dropout arguments are clear errors.

The mask is read straight off the kernels: with q = 0 every visible probability is 1/Sk, so with v
one-hot (v[j] = e_(j - j0)) the output's column c is Z[i, j0 + c] / (1 - p) / Sk; with dout one-hot
(dout[i] = e_(i - i0)) the backward's dV column c is Z[i0 + c, j] / (1 - p) / Sk."""

from __future__ import annotations

import pytest

import attngen
from attngen import dropout, reference, tolerance
from attngen.spec import AttentionSpec

pytestmark = pytest.mark.gpu

DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}
DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx] and causal"
P = 0.1


def _torch():
    import torch

    return torch


def _on_sm90a() -> bool:
    from attngen import targets

    return targets.device_target(_torch().cuda.current_device()).name == "sm_90a"


def _forward_specs():
    """(family, config) pairs whose masks must agree: both families' defaults and tiles whose key blocks
    straddle the 32-key spans of the mapping (fwd_sm80 16-key steps, fwd_sm90 80-key blocks)."""
    specs = [("fwd_sm80", {}), ("fwd_sm80", {"block_m": 64, "block_n": 16, "num_warps": 4}),
             ("fwd_sm80", {"block_m": 64, "block_n": 64, "num_warps": 4})]
    if _on_sm90a():
        specs += [("fwd_sm90", {}), ("fwd_sm90", {"block_n": 80}), ("fwd_sm90", {"consumers": 1})]
    return specs


def _rng(seed, offset=0):
    torch = _torch()
    return torch.tensor([seed, offset], dtype=torch.int64, device="cuda")


def _tensors(B, Sq, Sk, Hq, Hkv, D, dtype="bf16", seed=0):
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]

    def rand(S, H):
        return torch.randn(B, S, H, D, generator=gen, device="cuda").to(dt)

    return rand(Sq, Hq), rand(Sk, Hkv), rand(Sk, Hkv), rand(Sq, Hq)


def _doc_ids(B, S):
    torch = _torch()
    return (torch.arange(S, device="cuda")[None, :].expand(B, S) // 37).to(torch.int32).contiguous()


def forward_mask(spec, B, Sq, Sk, Hq, Hkv, D, rng):
    """(B, Hq, Sq, Sk) bool: which elements the forward kernel of `spec` kept, and the kept values'
    relative error from (1 - p)^-1 / Sk (the scale)."""
    torch = _torch()
    q = torch.zeros(B, Sq, Hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, Sk, Hkv, D, device="cuda").to(torch.bfloat16)
    keep = torch.zeros(B, Hq, Sq, Sk, dtype=torch.bool, device="cuda")
    want = dropout.keep_scale(spec.dropout_p) / Sk
    worst = 0.0
    for j0 in range(0, Sk, D):
        width = min(D, Sk - j0)
        v = torch.zeros(B, Sk, Hkv, D, dtype=torch.bfloat16, device="cuda")
        v[:, j0:j0 + width, :, :width] = torch.eye(width, dtype=torch.bfloat16, device="cuda")[None, :, None, :]
        out = attngen.attention(q, k, v, spec, dropout_seed=rng).float()  # (B, Sq, Hq, D)
        cols = out[..., :width].permute(0, 2, 1, 3)
        keep[..., j0:j0 + width] = cols > want / 2
        kept = cols[cols > want / 2]
        if kept.numel():
            worst = max(worst, ((kept - want).abs() / want).max().item())
    return keep, worst


def reference_mask(p, rng, B, Hq, Sq, Sk):
    seed, offset = (int(x) for x in rng.tolist())
    return reference.dropout_mask(p, seed, offset, B, Hq, Sq, Sk, device="cuda")


# -- the mask: exactly the mapping's, in every family and tile ------------------------------------------
def test_every_forward_family_and_tile_keeps_exactly_the_mapped_elements():
    B, Sq, Sk, Hq, Hkv, D = 2, 200, 300, 4, 2, 128
    rng = _rng(0x0123456789ABCDEF - 2**63, 2**32 + 77)
    want = reference_mask(P, rng, B, Hq, Sq, Sk)
    for family, config in _forward_specs():
        spec = AttentionSpec(head_dim=D, gqa_ratio=2, dropout_p=P, family=family, config=config or None)
        keep, worst = forward_mask(spec, B, Sq, Sk, Hq, Hkv, D, rng)
        mismatches = (keep != want).sum().item()
        assert mismatches == 0, f"{family} {config}: {mismatches} elements differ from the mapping"
        assert worst <= 2 * 2.0**-8, f"{family} {config}: kept values off the 1/(1-p) scale by {worst}"


@pytest.mark.parametrize("config", [{}, {"block_m": 16, "block_n": 32, "num_warps": 2}],
                         ids=["default", "m16n32w2"])
def test_the_backward_regenerates_the_forwards_mask(config):
    """dV with q = 0 and dout one-hot reads Z^T off the bwd_sm80 kernel (its S^T layout)."""
    torch = _torch()
    from attngen.runtime.backward import backward

    B, Sq, Sk, H, D = 2, 150, 260, 2, 64
    rng = _rng(977, 3)
    spec = AttentionSpec(head_dim=D, dropout_p=P)
    bwd_spec = spec.replace(family="bwd_sm80", config=config or None)
    q = torch.zeros(B, Sq, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, Sk, H, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    out, lse = attngen.attention(q, k, v, spec, dropout_seed=rng, return_lse=True)
    keep = torch.zeros(B, H, Sq, Sk, dtype=torch.bool, device="cuda")
    for i0 in range(0, Sq, D):
        width = min(D, Sq - i0)
        dout = torch.zeros_like(q)
        dout[:, i0:i0 + width, :, :width] = torch.eye(width, dtype=torch.bfloat16, device="cuda")[None, :, None, :]
        _, _, dv = backward(dout, q, k, v, out, lse, bwd_spec, rng=rng)
        keep[:, :, i0:i0 + width, :] = (dv.float()[..., :width] > 0.5 * dropout.keep_scale(P) / Sk).permute(0, 2, 3, 1)
    want = reference_mask(P, rng, B, H, Sq, Sk)
    assert (keep != want).sum().item() == 0


def test_the_keep_rate_is_the_realised_ps():
    B, Sq, Sk, H, D = 1, 1024, 128, 8, 128
    rng = _rng(31337)
    for p in (0.1, 0.5):
        keep, _ = forward_mask(AttentionSpec(head_dim=D, dropout_p=p), B, Sq, Sk, H, H, D, rng)
        rate, n = 1 - dropout.realised(p), keep.numel()
        sigma = (rate * (1 - rate) / n) ** 0.5
        assert abs(keep.float().mean().item() - rate) < 5 * sigma, (p, keep.float().mean().item(), rate)


# -- against the reference ----------------------------------------------------------------------------------
FORWARD_CASES = [
    dict(dtype="bf16", D=128, Hq=8, Hkv=2, Sq=300, Sk=300, mask="causal"),
    dict(dtype="fp16", D=64, Hq=4, Hkv=4, Sq=129, Sk=333, mask="none"),
    dict(dtype="bf16", D=64, Hq=4, Hkv=1, Sq=256, Sk=256, mask=DOC_MASK),
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=[f"{c['dtype']}-d{c['D']}-{c['mask'][:6]}" for c in FORWARD_CASES])
def test_forward_output_and_lse_match_the_reference_with_the_same_mask(case):
    B = 2
    q, k, v, _ = _tensors(B, case["Sq"], case["Sk"], case["Hq"], case["Hkv"], case["D"], case["dtype"], seed=case["D"])
    inputs = {"doc": _doc_ids(B, max(case["Sq"], case["Sk"]))} if case["mask"] == DOC_MASK else None
    for family in ("fwd_sm90", "fwd_sm80") if _on_sm90a() else ("fwd_sm80",):
        spec = AttentionSpec(head_dim=case["D"], dtype=case["dtype"], gqa_ratio=case["Hq"] // case["Hkv"],
                             mask=case["mask"], dropout_p=0.2, family=family)
        out, lse = attngen.attention(q, k, v, spec, inputs=inputs, dropout_seed=12345, return_lse=True)
        ref_out, ref_lse = reference.attention_for_spec(q, k, v, spec, return_lse=True, inputs=inputs,
                                                        dropout_seed=12345)
        scale = case["D"] ** -0.5
        bad = tolerance.check_output(out, ref_out, q, k, v, case["dtype"], scale, dropout.keep_scale(0.2)) \
            or tolerance.check_lse(lse, ref_lse, q, k, scale)
        assert bad is None, f"{family} {case}: {bad}"


def run_grads(q, k, v, dout, **kw):
    torch = _torch()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attngen.attention(*leaves, return_lse=True, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse.detach(), grads


GRAD_CASES = [
    dict(dtype="bf16", D=128, Hq=8, Hkv=2, Sq=300, Sk=300, mask="causal", p=0.1),
    dict(dtype="fp16", D=64, Hq=4, Hkv=4, Sq=77, Sk=301, mask="none", p=0.5),
    dict(dtype="bf16", D=96, Hq=4, Hkv=2, Sq=300, Sk=127, mask="causal", p=0.25),
    dict(dtype="bf16", D=64, Hq=4, Hkv=1, Sq=256, Sk=256, mask=DOC_MASK, p=0.1),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[f"{c['dtype']}-d{c['D']}-{c['mask'][:6]}" for c in GRAD_CASES])
def test_gradients_match_the_reference_with_the_same_mask(case):
    B = 2
    q, k, v, dout = _tensors(B, case["Sq"], case["Sk"], case["Hq"], case["Hkv"], case["D"], case["dtype"], seed=7)
    inputs = {"doc": _doc_ids(B, max(case["Sq"], case["Sk"]))} if case["mask"] == DOC_MASK else None
    out, lse, grads = run_grads(q, k, v, dout, mask=case["mask"], inputs=inputs, dropout_p=case["p"], dropout_seed=4242)
    ref = reference.attention_grads(q, k, v, dout, mask=case["mask"], inputs=inputs, dropout_p=case["p"],
                                    dropout_seed=4242)
    bad = tolerance.check_grads(grads, ref, q, k, v, out, dout, case["dtype"], case["D"] ** -0.5, lse=lse)
    assert bad is None, f"{case}: {bad}"


def test_a_sink_and_a_loss_reading_the_lse_with_dropout():
    torch = _torch()
    q, k, v, dout = _tensors(2, 200, 200, 8, 2, 64, "bf16", seed=11)
    sinks = torch.randn(8, device="cuda")
    dlse = torch.randn(2, 8, 200, device="cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attngen.attention(*leaves, mask="causal", sink="sinks[h]", inputs={"sinks": sinks}, dropout_p=0.3,
                                 dropout_seed=5, return_lse=True)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    ref = reference.attention_grads(q, k, v, dout, mask="causal", sink="sinks[h]", inputs={"sinks": sinks},
                                    dlse=dlse, dropout_p=0.3, dropout_seed=5)
    bad = tolerance.check_grads(grads, ref, q, k, v, out.detach(), dout, "bf16", 64**-0.5, lse=lse.detach(),
                                dlse=dlse)
    assert bad is None, bad


# -- seeds -----------------------------------------------------------------------------------------------------
def test_seeds_reproduce_and_differ():
    torch = _torch()
    q, k, v, _ = _tensors(2, 256, 256, 4, 4, 64, "bf16", seed=3)
    same = [attngen.attention(q, k, v, mask="causal", dropout_p=P, dropout_seed=17) for _ in range(2)]
    assert torch.equal(same[0], same[1])
    assert torch.equal(same[0], attngen.attention(q, k, v, mask="causal", dropout_p=P, dropout_seed=_rng(17)))
    assert not torch.equal(same[0], attngen.attention(q, k, v, mask="causal", dropout_p=P, dropout_seed=18))
    assert not torch.equal(same[0], attngen.attention(q, k, v, mask="causal", dropout_p=P, dropout_seed=_rng(17, 1)))
    drawn = []
    for _ in range(2):
        torch.manual_seed(1234)
        drawn.append([attngen.attention(q, k, v, mask="causal", dropout_p=P) for _ in range(2)])
    assert torch.equal(drawn[0][0], drawn[1][0]) and torch.equal(drawn[0][1], drawn[1][1])
    assert not torch.equal(drawn[0][0], drawn[0][1])  # each call draws a fresh seed
    # dropout_p 0: no dropout, whatever the seed
    assert torch.equal(attngen.attention(q, k, v, mask="causal", dropout_seed=17), attngen.attention(q, k, v, mask="causal"))


# -- torch.compile and CUDA graphs ---------------------------------------------------------------------------------
def test_fullgraph_compile_with_dropout_matches_eager():
    """With an int seed the compiled forward and backward run the same kernels on the same [seed, 0]:
    out, dk, dv bit for bit (dq's atomics within the bound). With a drawn seed, torch.manual_seed
    reproduces the compiled function's results."""
    torch = _torch()
    q, k, v, w = _tensors(2, 300, 300, 8, 2, 128, "bf16", seed=29)

    def loss_of(q, k, v, w, seed):
        out = attngen.attention(q, k, v, mask="causal", dropout_p=P, dropout_seed=seed)
        return (out.float() * w.float()).sum(), out

    compiled = torch.compile(loss_of, fullgraph=True)
    results = []
    for fn in (loss_of, compiled):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        loss, out = fn(*leaves, w, 99)
        results.append((out.detach(), torch.autograd.grad(loss, leaves)))
    (out_e, eager), (out_c, comp) = results
    assert torch.equal(out_e, out_c) and torch.equal(eager[1], comp[1]) and torch.equal(eager[2], comp[2])
    ref = reference.attention_grads(q, k, v, w, mask="causal", dropout_p=P, dropout_seed=99)
    bad = tolerance.check_grads(comp, ref, q, k, v, out_c, w, "bf16", 128**-0.5)
    assert bad is None, bad
    drawn = []
    for _ in range(2):
        torch.manual_seed(5)
        drawn.append(compiled(q, k, v, w, None)[1])
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], out_c)


def test_cuda_graph_replays_draw_fresh_masks_and_read_a_given_rng():
    torch = _torch()
    q, k, v, dout = _tensors(2, 300, 300, 8, 2, 128, "bf16", seed=37)
    static = [t.clone().requires_grad_() for t in (q, k, v)]
    state = _rng(1, 0)

    def step(seed):
        out = attngen.attention(*static, mask="causal", dropout_p=P, dropout_seed=seed)
        return (out, *torch.autograd.grad(out, static, dout))

    captured = {}
    for name, seed in (("drawn", None), ("given", state)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for _ in range(2):
                step(seed)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step(seed)
        captured[name] = (graph, outputs)
    graph, outputs = captured["drawn"]
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(outputs[0].clone())
    assert not torch.equal(replays[0], replays[1])  # a fresh [seed, offset] each replay
    graph, outputs = captured["given"]
    for seed, offset in ((41, 0), (43, 9)):
        state.copy_(_rng(seed, offset))
        graph.replay()
        torch.cuda.synchronize()
        out, lse, grads = run_grads(q, k, v, dout, mask="causal", dropout_p=P, dropout_seed=_rng(seed, offset))
        assert torch.equal(outputs[0], out)
        assert torch.equal(outputs[2], grads[1]) and torch.equal(outputs[3], grads[2])
        ref = reference.attention_grads(q, k, v, dout, mask="causal", dropout_p=P, dropout_seed=seed,
                                        dropout_offset=offset)
        bad = tolerance.check_grads(tuple(t.detach() for t in outputs[1:]), ref, q, k, v, out, dout, "bf16",
                                    128**-0.5, lse=lse)
        assert bad is None, f"replay with [{seed}, {offset}]: {bad}"


# -- errors -----------------------------------------------------------------------------------------------------------
def test_bad_dropout_arguments_are_named():
    torch = _torch()
    q, k, v, _ = _tensors(1, 64, 64, 2, 2, 64, "bf16")
    for seed, match in [
        (torch.tensor([1, 2], dtype=torch.int64), "rng must be a CUDA tensor, got device cpu"),
        (torch.tensor([1, 2], dtype=torch.int32, device="cuda"), r"rng has dtype int32 and shape \(2,\)"),
        (torch.tensor([1, 2, 3], dtype=torch.int64, device="cuda"), r"rng has dtype int64 and shape \(3,\)"),
        (torch.arange(4, dtype=torch.int64, device="cuda")[::2], r"rng has strides \(2,\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            attngen.attention(q, k, v, dropout_p=P, dropout_seed=seed)
    with pytest.raises(ValueError, match=r"dropout_p=1.0 is invalid; allowed: 0 \(no dropout\)"):
        attngen.attention(q, k, v, dropout_p=1.0)
    spec = AttentionSpec(head_dim=64, dropout_p=0.3)
    with pytest.raises(ValueError, match=r"dropout_p=0.1 conflicts with the spec's dropout_p=0.3"):
        attngen.attention(q, k, v, spec, dropout_p=0.1)
    with pytest.raises(ValueError, match="no decode kernel family can run .*dropout_p=0.3 is for training"):
        attngen.decode(q[:, :1], k, v, torch.full((1,), 64, dtype=torch.int32, device="cuda"), spec=spec)
