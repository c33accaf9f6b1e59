"""The backward on a GPU (marker `gpu`): attngen.attention's gradients (torch autograd through the
backward op; every test once per backward family, attngen/families/bwd_sm90/ and bwd_sm80/) against float64 autograd of the reference
(reference.attention_grads), held to the bounds derived in attngen/tolerance.py ("Gradients"):
fp16 and bf16, head dims 64, 96, 128; masks none, causal, a sliding window and packed documents;
Sq != Sk both ways (bottom-right causal), odd lengths, GQA; score modifiers; a learned sink and its
gradient; a loss reading the LSE; rows that see no key; large logits; strided inputs;
torch.compile(fullgraph=True) and CUDA graph capture of forward and backward; dk/dv bitwise
deterministic; head_dim 256 refused; backward twice through a retained graph; one training-sized
causal shape checked per (batch, head)."""

from __future__ import annotations

import pytest

import attngen
from attngen import families, reference, tolerance

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=families.BACKWARD_REGISTERED)
def backward_family(request, monkeypatch):
    """Each test once per backward family, that family first in the order of preference: a problem it
    cannot run (bwd_sm90 on another GPU than sm_90, or at head_dim 96) falls to the next one."""
    from attngen.runtime import backward

    chosen = request.param
    monkeypatch.setattr(families, "BACKWARD_FAMILIES",
                        {chosen: families.BACKWARD_FAMILIES[chosen], **families.BACKWARD_FAMILIES})
    backward.forget()
    yield chosen
    backward.forget()

DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx] and causal"
DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}


def _dtype(name):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _tensors(B, Sq, Sk, Hq, Hkv, D, dtype="bf16", seed=0, logit_scale=1.0):
    """q, k, v, dout in the dtype on the GPU; q and k scaled by logit_scale (scores ~ logit_scale^2)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(S, H, scale=1.0):
        return (torch.randn(B, S, H, D, generator=gen, device="cuda") * scale).to(_dtype(dtype))

    return rand(Sq, Hq, logit_scale), rand(Sk, Hkv, logit_scale), rand(Sk, Hkv), rand(Sq, Hq)


def _doc_ids(B, S, seed=0):
    """Sorted document ids (B, S) int32: random lengths, one document of length 1 per sequence."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lengths = torch.randint(1, max(2, S // 3), (S,), generator=gen).tolist()
        lengths[1] = 1
        rows.append(torch.repeat_interleave(torch.arange(S), torch.tensor(lengths))[:S])
    return torch.stack(rows).to(device="cuda", dtype=torch.int32)


def run(q, k, v, dout, *, dlse=None, grad_inputs=(), **kw):
    """(out, lse, grads) of attngen.attention through autograd: grads (dq, dk, dv), plus
    {name: gradient} of the runtime inputs named in grad_inputs."""
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    inputs = dict(kw.pop("inputs", None) or {})
    for name in grad_inputs:
        inputs[name] = inputs[name].detach().requires_grad_()
    out, lse = attngen.attention(*leaves, inputs=inputs or None, return_lse=True, **kw)
    outputs, grad_outputs = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grad_outputs.append(dlse)
    grads = torch.autograd.grad(outputs, [*leaves, *(inputs[name] for name in grad_inputs)], grad_outputs)
    torch.cuda.synchronize()
    if grad_inputs:
        return out.detach(), lse.detach(), (*grads[:3], dict(zip(grad_inputs, grads[3:])))
    return out.detach(), lse.detach(), tuple(grads)


def check(q, k, v, dout, *, dlse=None, grad_inputs=(), label="", **kw):
    """run(), then every gradient against the float64 reference within tolerance.check_grads;
    returns (out, lse, grads, reference grads)."""
    out, lse, grads = run(q, k, v, dout, dlse=dlse, grad_inputs=grad_inputs, **kw)
    ref_kw = {"mask": kw.get("mask") or "none", "score_mod": kw.get("score_mod"), "sink": kw.get("sink"),
              "inputs": kw.get("inputs"), "softmax_scale": kw.get("softmax_scale")}
    ref = reference.attention_grads(q, k, v, dout, dlse=dlse, grad_inputs=grad_inputs, **ref_kw)
    scale = kw.get("softmax_scale") or q.shape[-1] ** -0.5
    bad = tolerance.check_grads(grads, ref, q, k, v, out, dout, DTYPE_NAMES[str(q.dtype)], scale, lse=lse,
                                dlse=dlse)
    shapes = f"q {tuple(q.shape)} k {tuple(k.shape)}"
    assert bad is None, f"{label} {kw} {shapes}: {bad}"
    return out, lse, grads, ref


# -- dtypes, head dims, masks --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_dtypes_and_head_dims_match_the_reference(dtype, head_dim):
    q, k, v, dout = _tensors(2, 300, 300, 8, 2, head_dim, dtype, seed=head_dim)
    check(q, k, v, dout, mask="causal")


@pytest.mark.parametrize("dtype, head_dim", [("bf16", 128), ("fp16", 64)])
@pytest.mark.parametrize("mask", ["none", "causal", "sliding_window(64, 0)", DOC_MASK,
                                  "q_idx - kv_idx < 100 and kv_idx <= q_idx",  # a band written out
                                  "prefix_lm(plen[b])"])  # a prefix per batch row: closed-form bounds read at b
def test_masks_match_the_reference(dtype, head_dim, mask):
    import torch

    B, S = 2, 300
    q, k, v, dout = _tensors(B, S, S, 8, 2, head_dim, dtype, seed=7)
    inputs = {"doc": _doc_ids(B, S, seed=3)} if mask == DOC_MASK else None
    if "plen" in mask:
        inputs = {"plen": torch.tensor([150, 0], dtype=torch.int32, device="cuda")}
    check(q, k, v, dout, mask=mask, inputs=inputs)


# -- lengths, GQA -------------------------------------------------------------------------------------
LENGTHS = [(1, 1), (1, 300), (17, 17), (17, 300), (127, 127), (127, 300), (300, 127), (300, 17), (300, 300),
           (512, 511)]


@pytest.mark.parametrize("Sq, Sk", LENGTHS)
def test_odd_and_unequal_lengths_bottom_right_causal(Sq, Sk):
    q, k, v, dout = _tensors(2, Sq, Sk, 8, 2, 64, "bf16", seed=Sq * 1000 + Sk)
    check(q, k, v, dout, mask="causal")


@pytest.mark.parametrize("Sq, Sk", [(1, 300), (127, 300), (300, 17)])
def test_unequal_lengths_without_a_mask(Sq, Sk):
    q, k, v, dout = _tensors(1, Sq, Sk, 8, 2, 64, "fp16", seed=Sq + Sk)
    check(q, k, v, dout, mask="none")


@pytest.mark.parametrize("heads_kv", [8, 4, 2])
def test_gqa_ratios(heads_kv):
    q, k, v, dout = _tensors(2, 257, 300, 8, heads_kv, 128, "bf16", seed=heads_kv)
    check(q, k, v, dout, mask="causal")


def test_an_explicit_softmax_scale():
    q, k, v, dout = _tensors(2, 200, 200, 8, 2, 128, "bf16", seed=5)
    check(q, k, v, dout, mask="causal", softmax_scale=0.3)


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("head_dim, mask", [(64, "causal"), (128, DOC_MASK)])
def test_bwd_sm90_pinned_stages(backward_family, num_stages, head_dim, mask):
    """bwd_sm90 pinned by a spec with each of its Q/dO pipeline depths (the default is 2)."""
    import torch

    if backward_family != "bwd_sm90":
        pytest.skip("pins bwd_sm90 itself: once is enough")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("bwd_sm90 runs on sm_90 only")
    B, S = 2, 300
    q, k, v, dout = _tensors(B, S, S, 8, 2, head_dim, "bf16", seed=31 + num_stages)
    spec = attngen.AttentionSpec(head_dim=head_dim, dtype="bf16", gqa_ratio=4, mask=mask, family="bwd_sm90",
                                 config={"block_m": 64, "num_stages": num_stages}, arch="sm_90a")
    inputs = {"doc": _doc_ids(B, S, seed=5)} if mask == DOC_MASK else None
    check(q, k, v, dout, spec=spec, mask=mask, inputs=inputs)


# -- score modifiers, sinks, the LSE ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("score_mod, logit_scale", [("softcap(30.0)", 3.0),
                                                    ("score - 0.05 * abs(q_idx - kv_idx)", 1.0)])
def test_score_modifiers(dtype, score_mod, logit_scale):
    """softcap bends scores of ~10-100 (q, k scaled by 3): its derivative matters."""
    q, k, v, dout = _tensors(2, 300, 300, 8, 2, 128 if dtype == "bf16" else 64, dtype, seed=11,
                             logit_scale=logit_scale)
    check(q, k, v, dout, mask="causal", score_mod=score_mod)


@pytest.mark.parametrize("Sq, Sk, with_lse", [(300, 300, False), (300, 200, True)])
def test_a_learned_sink_and_its_gradient(Sq, Sk, with_lse):
    """sinks[h] requiring grad: dq, dk, dv and d sinks; with Sk < Sq the first rows see no key
    (their output is 0, their LSE the sink)."""
    import torch

    q, k, v, dout = _tensors(2, Sq, Sk, 8, 2, 64, "bf16", seed=13)
    sinks = torch.linspace(-2.0, 3.0, 8, device="cuda")
    dlse = torch.randn(2, 8, Sq, device="cuda") if with_lse else None
    _, _, grads, ref = check(q, k, v, dout, mask="causal", sink="sinks[h]", inputs={"sinks": sinks}, dlse=dlse,
                             grad_inputs=("sinks",))
    assert grads[3]["sinks"].dtype == torch.float32 and grads[3]["sinks"].shape == (8,)
    assert ref[3]["dinputs"]["sinks"].abs().min() > 0  # every head's sink has a gradient to check


SLOPE_MOD = "score - slope[h] * abs(q_idx - kv_idx)"  # ALiBi with learned slopes: read at [h] alone


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["causal", DOC_MASK])
def test_a_learned_per_head_slope_gets_its_gradient(head_dim, mask):
    """A score modifier's input read at [h] alone, requiring grad: its gradient from the kernels' per-CTA
    sums (attngen/families/bwd_shared.py), against float64 autograd, within the derived bound; with
    GQA, packed documents and bitwise the same on a second run."""
    import torch

    B, S = 2, 300
    q, k, v, dout = _tensors(B, S, S, 8, 2, head_dim, "bf16", seed=21)
    inputs = {"slope": torch.linspace(0.01, 0.2, 8, device="cuda")}
    if mask == DOC_MASK:
        inputs["doc"] = _doc_ids(B, S, seed=4)
    _, _, grads, ref = check(q, k, v, dout, mask=mask, score_mod=SLOPE_MOD, inputs=inputs, grad_inputs=("slope",))
    assert grads[3]["slope"].shape == (8,) and grads[3]["slope"].dtype == torch.float32
    assert ref[3]["dinputs"]["slope"].abs().min() > 0  # every head's slope has a gradient to check
    again = run(q, k, v, dout, mask=mask, score_mod=SLOPE_MOD, inputs=inputs, grad_inputs=("slope",))[2]
    assert torch.equal(again[3]["slope"], grads[3]["slope"])  # a fixed-order reduction: deterministic


def test_a_shards_learned_slopes_over_shared_int_offsets_get_their_gradients():
    """ALiBi on a context-parallel shard: the score modifier reads the mask's int32 offsets as int(q_offset) (no
    gradient: int32) and learned slopes at [h] (a gradient), against float64 autograd."""
    import torch

    q, k, v, dout = _tensors(1, 200, 500, 8, 2, 128, "bf16", seed=23)
    inputs = {"slope": torch.linspace(0.01, 0.2, 8, device="cuda"),
              "q_offset": torch.tensor(300, dtype=torch.int32, device="cuda"),
              "kv_offset": torch.tensor(0, dtype=torch.int32, device="cuda")}
    check(q, k, v, dout, mask="kv_idx + kv_offset <= q_idx + q_offset", inputs=inputs, grad_inputs=("slope",),
          score_mod="score - slope[h] * abs(q_idx + int(q_offset) - kv_idx - int(kv_offset))")


def test_a_model_with_learned_per_head_slopes_trains():
    """Fit per-head slopes to a teacher's: 60 Adam steps on the output's squared error, gradients from
    the kernels only; the loss falls a hundredfold and every slope moves to the teacher's."""
    import torch

    q, k, v, _ = _tensors(2, 256, 256, 4, 4, 64, "bf16", seed=5)
    teacher = torch.tensor([0.02, 0.1, 0.3, 0.6], device="cuda")
    with torch.no_grad():
        target = attngen.attention(q, k, v, mask="causal", score_mod=SLOPE_MOD, inputs={"slope": teacher}).float()
    slope = torch.full((4,), 0.25, device="cuda", requires_grad=True)
    opt = torch.optim.Adam([slope], lr=0.02)
    losses = []
    for _ in range(60):
        out = attngen.attention(q, k, v, mask="causal", score_mod=SLOPE_MOD, inputs={"slope": slope})
        loss = ((out.float() - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 100, losses
    assert (slope.detach() - teacher).abs().max() < 0.05, slope


def test_a_loss_reading_the_lse():
    """loss = sum(out * w) + sum(lse * w2), through .backward(): the LSE's gradient enters D."""
    import torch

    q, k, v, w = _tensors(2, 300, 300, 8, 2, 128, "bf16", seed=17)
    w2 = torch.randn(2, 8, 300, device="cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attngen.attention(*leaves, mask="causal", return_lse=True)
    loss = (out.float() * w.float()).sum() + (lse * w2).sum()
    loss.backward()
    torch.cuda.synchronize()
    ref = reference.attention_grads(q, k, v, w, mask="causal", dlse=w2)
    grads = tuple(t.grad for t in leaves)
    bad = tolerance.check_grads(grads, ref, q, k, v, out.detach(), w, "bf16", 128**-0.5, lse=lse.detach(), dlse=w2)
    assert bad is None, bad
    # without the LSE's term the gradients differ: the test sees it
    plain = reference.attention_grads(q, k, v, w, mask="causal")
    assert tolerance.check_grads(grads, plain, q, k, v, out.detach(), w, "bf16", 128**-0.5) is not None


@pytest.mark.parametrize("with_lse", [False, True])
def test_rows_that_see_no_key_have_zero_finite_gradients(with_lse):
    """Causal with Sq = 300 > Sk = 100: rows 0..199 see no key (LSE -inf); their dq is exactly 0,
    everything finite, also when the loss reads their (-inf) LSE."""
    import torch

    q, k, v, dout = _tensors(2, 300, 100, 8, 2, 128, "fp16", seed=19)
    dlse = torch.randn(2, 8, 300, device="cuda") if with_lse else None
    _, lse, grads, _ = check(q, k, v, dout, mask="causal", dlse=dlse)
    assert torch.isneginf(lse[:, :, :200]).all()
    assert torch.equal(grads[0][:, :200], torch.zeros_like(grads[0][:, :200]))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("logit_scale", [3.0, 10.0, 30.0, 100.0])
def test_large_logits(dtype, logit_scale):
    """q and k scaled so scores reach ~1e1, 1e2, 1e3, 1e4 of either sign (fp32 holds them; P is
    one-hot at the largest): finite gradients within the bounds, whose exponent error grows with |S|."""
    q, k, v, dout = _tensors(2, 256, 256, 8, 2, 128, dtype, seed=int(logit_scale), logit_scale=logit_scale)
    check(q, k, v, dout, mask="causal")


def test_strided_inputs():
    """q, k, v and dout from (B, H, S, D) tensors passed as .transpose(1, 2): no copies needed."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(23)

    def rand(H, S):
        return torch.randn(2, H, S, 128, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)

    q, k, v, dout = rand(8, 300), rand(2, 280), rand(2, 280), rand(8, 300)
    assert not q.is_contiguous() and not dout.is_contiguous()
    check(q, k, v, dout, mask="causal")


# -- torch.compile, CUDA graphs, determinism ----------------------------------------------------
def test_fullgraph_compile_of_the_forward_and_its_backward():
    """A compiled (fullgraph) forward with its loss, differentiated: AOTAutograd traces the backward
    op (its fake implementation) into the backward graph; dk, dv equal eager's bit for bit, dq
    (atomics) within the bound."""
    import torch

    q, k, v, w = _tensors(2, 300, 300, 8, 2, 128, "bf16", seed=29)

    def loss_of(q, k, v, w):
        out, lse = attngen.attention(q, k, v, mask="causal", return_lse=True)
        return (out.float() * w.float()).sum(), out, lse

    compiled = torch.compile(loss_of, fullgraph=True)
    results = []
    for fn in (loss_of, compiled):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        loss, out, lse = fn(*leaves, w)
        results.append((out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)))
    torch.cuda.synchronize()
    (out_e, lse_e, eager), (out_c, lse_c, comp) = results
    assert torch.equal(out_e, out_c) and torch.equal(lse_e, lse_c)
    assert torch.equal(eager[1], comp[1]) and torch.equal(eager[2], comp[2])
    ref = reference.attention_grads(q, k, v, w, mask="causal")
    for grads, out, lse in ((eager, out_e, lse_e), (comp, out_c, lse_c)):
        bad = tolerance.check_grads(grads, ref, q, k, v, out, w, "bf16", 128**-0.5, lse=lse)
        assert bad is None, bad


def test_fullgraph_compile_of_a_function_calling_autograd_grad():
    """torch.compile(fullgraph=True) of forward + torch.autograd.grad in one function matches eager
    (dk, dv bit for bit; dq within the bound). Dynamo traces autograd.grad only with
    torch._dynamo.config.trace_autograd_ops (newer torch)."""
    import torch

    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip(f"torch {torch.__version__} cannot trace torch.autograd.grad (no trace_autograd_ops)")
    q, k, v, dout = _tensors(2, 300, 300, 8, 2, 64, "bf16", seed=31)

    def step(q, k, v, dout):
        out = attngen.attention(q, k, v, mask="causal")
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = step(*leaves, dout)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(step, fullgraph=True)(*leaves, dout)
    torch.cuda.synchronize()
    assert torch.equal(eager[0], compiled[0])
    assert torch.equal(eager[2], compiled[2]) and torch.equal(eager[3], compiled[3])
    ref = reference.attention_grads(q, k, v, dout, mask="causal")
    for result in (eager, compiled):
        bad = tolerance.check_grads(result[1:], ref, q, k, v, result[0].detach(), dout, "bf16", 64**-0.5)
        assert bad is None, bad


def test_cuda_graph_capture_of_forward_and_backward_replays_correctly():
    import torch

    q, k, v, dout = _tensors(2, 300, 300, 8, 2, 128, "bf16", seed=37)
    static = [t.clone().requires_grad_() for t in (q, k, v)]
    static_dout = dout.clone()

    def step():
        out = attngen.attention(*static, mask="causal")
        return (out, *torch.autograd.grad(out, static, static_dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, resolve and warm up outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (41, 43):
        fresh = _tensors(2, 300, 300, 8, 2, 128, "bf16", seed=seed)
        with torch.no_grad():
            for dst, src in zip((*static, static_dout), fresh):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        out, lse, grads = run(*fresh, mask="causal")
        assert torch.equal(captured[0], out)
        assert torch.equal(captured[2], grads[1]) and torch.equal(captured[3], grads[2])
        ref = reference.attention_grads(*fresh, mask="causal")
        bad = tolerance.check_grads(tuple(t.detach() for t in captured[1:]), ref, *fresh[:3], out, fresh[3], "bf16",
                                    128**-0.5, lse=lse)
        assert bad is None, f"replay with seed {seed}: {bad}"


def test_dk_dv_are_bitwise_deterministic():
    """dK and dV are summed inside one CTA per key block (no atomics): two runs agree bit for bit;
    dQ's atomics may order differently, so it is held to the bound instead."""
    import torch

    q, k, v, dout = _tensors(2, 512, 512, 8, 2, 128, "bf16", seed=47)
    out1, lse1, grads1, ref = check(q, k, v, dout, mask="causal")
    out2, lse2, grads2 = run(q, k, v, dout, mask="causal")
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert torch.equal(grads1[1], grads2[1]) and torch.equal(grads1[2], grads2[2])
    assert tolerance.check_grads(grads2, ref, q, k, v, out2, dout, "bf16", 128**-0.5, lse=lse2) is None


DETERMINISTIC_CASES = [  # (B, Sq, Sk, Hq, Hkv, D, mask): many key blocks adding to each query block
    (2, 1500, 1500, 8, 2, 128, "causal"),
    (1, 700, 1900, 4, 4, 64, "none"),
    (2, 1100, 1100, 8, 1, 64, DOC_MASK),
    (1, 129, 2000, 8, 2, 128, "causal"),
]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=lambda c: f"{c[1]}x{c[2]}-d{c[5]}-{c[6][:6]}")
def test_deterministic_gradients_are_bitwise_repeatable(backward_family, case):
    """deterministic=True: dQ's parts added in key order (bwd_shared.py), so three runs agree bit for
    bit in dq as well as dk and dv, within the bounds; torch.use_deterministic_algorithms(True)
    selects the same kernel (the same bits)."""
    import torch

    if backward_family != families.BACKWARD_REGISTERED[0]:
        pytest.skip("deterministic runs bwd_sm80 whichever family is preferred: once is enough")
    B, Sq, Sk, Hq, Hkv, D, mask = case
    q, k, v, dout = _tensors(B, Sq, Sk, Hq, Hkv, D, "bf16", seed=Sq + Sk)
    inputs = {"doc": _doc_ids(B, Sq, seed=9)} if mask == DOC_MASK else None
    _, _, first, _ = check(q, k, v, dout, mask=mask, inputs=inputs, deterministic=True)
    for _ in range(2):
        again = run(q, k, v, dout, mask=mask, inputs=inputs, deterministic=True)[2]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    torch.use_deterministic_algorithms(True)
    try:
        by_flag = run(q, k, v, dout, mask=mask, inputs=inputs)[2]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, by_flag))


def test_head_dim_256_backward_is_refused_naming_head_dim():
    import torch

    q, k, v, dout = _tensors(1, 64, 64, 2, 2, 256, "bf16", seed=53)
    with torch.no_grad():
        attngen.attention(q, k, v, mask="causal")  # the forward runs d256
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with pytest.raises(ValueError, match="head_dim 256"):  # before the forward runs, not in backward()
        attngen.attention(*leaves, mask="causal")


def test_backward_twice_through_a_retained_graph():
    """Two backward passes of one graph: each within the bound, dk and dv identical; .backward()
    twice accumulates: k.grad and v.grad exactly twice one pass's (x + x is exact)."""
    import torch

    q, k, v, dout = _tensors(2, 300, 300, 8, 2, 64, "bf16", seed=59)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attngen.attention(*leaves, mask="causal", return_lse=True)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    second = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    ref = reference.attention_grads(q, k, v, dout, mask="causal")
    for grads in (first, second):
        bad = tolerance.check_grads(grads, ref, q, k, v, out.detach(), dout, "bf16", 64**-0.5, lse=lse.detach())
        assert bad is None, bad
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    out.backward(dout, retain_graph=True)
    out.backward(dout)
    torch.cuda.synchronize()
    assert torch.equal(leaves[1].grad, 2 * first[1]) and torch.equal(leaves[2].grad, 2 * first[2])
    bounds = tolerance.grad_bounds(ref, q, k, v, out.detach(), dout, "bf16", 64**-0.5, lse=lse.detach())
    # q.grad = dq1 + dq2 rounded once more: within twice the bound plus that rounding
    err = (leaves[0].grad.double() - 2 * ref[0]).abs()
    allowed = 2 * bounds["dq"] + tolerance.UNIT_ROUNDOFF["bf16"] * leaves[0].grad.double().abs()
    assert (err <= allowed).all()


# -- one training-sized shape ------------------------------------------------------------------------
def test_a_training_sized_causal_shape():
    """B=2, S=2048, H=16, D=128, causal, bf16: the float64 reference and the bounds per (batch,
    head), as each is an independent attention problem (the bounds' sums run over the same keys
    and rows as the whole call's)."""
    import torch

    B, S, H, D = 2, 2048, 16, 128
    q, k, v, dout = _tensors(B, S, S, H, H, D, "bf16", seed=61)
    out, lse, grads = run(q, k, v, dout, mask="causal")
    for b in range(B):
        for h in range(H):
            def part(t, b=b, h=h):
                return t[b:b + 1, :, h:h + 1]

            ref = reference.attention_grads(part(q), part(k), part(v), part(dout), mask="causal")
            bad = tolerance.check_grads(tuple(part(g) for g in grads), ref, part(q), part(k), part(v), part(out),
                                        part(dout), "bf16", D**-0.5, lse=lse[b:b + 1, h:h + 1])
            assert bad is None, f"batch {b} head {h}: {bad}"
            del ref
    torch.cuda.empty_cache()
