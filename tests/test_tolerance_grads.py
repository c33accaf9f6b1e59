"""The gradient bounds (attngen/tolerance.py, "Gradients") hold for a CPU model of the backward's
arithmetic and reject real errors; reference.attention_grads' dense pieces agree with its autograd.

The model does what attngen/families/bwd_sm80 does (its docstring): the forward in fp32 with P
rounded to the dtype before P.V and O rounded to the dtype, its LSE in fp32; the backward
recomputing P from fp32 scores and that LSE (flushed to 0 below 2^-126, as ex2.approx.ftz does), dV = P^T dO with P rounded to the dtype,
D = rowsum(dO * O) - dLSE from the rounded O, dS = P (dP - D) g1 scale rounded to the dtype, dK =
dS^T Q and dQ = dS K, every product summed in fp32, the results rounded to the dtype; a sink's
gradient -exp(sink - LSE) D summed in fp32; with dropout, the dropped elements of the rounded P zeroed
for P.V and dV, which are scaled by 1 / (1 - p) in fp32, and dP zeroed and scaled likewise. Each
deliberate mistake below is one a kernel could
make (a missing factor, a dropped term, a mask off by one, a GQA group not summed); the bounds
must catch every one of them on problems where it matters, and pass the model everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from attngen import dropout, reference, tolerance
from attngen.masks import get_mask
from attngen.score_mods import get_score_mod

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx] and causal"


def _doc_ids(B, S, seed):
    """Sorted document ids per sequence (a few documents of random lengths, one of length 1)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        cuts = sorted(torch.randperm(S - 1, generator=g)[:3].add(1).tolist() + [1])
        rows.append(torch.bucketize(torch.arange(S), torch.tensor(cuts), right=True) * 3)
    return torch.stack(rows).to(torch.int32)


def problem(dtype, *, B=2, Sq=33, Sk=40, Hq=4, Hkv=2, D=64, mask="causal", score_mod=None, sink=False, dlse=False,
            logit_scale=1.0, seed=0, dropout_p=0.0, softmax_scale=None):
    """A small random problem: q, k, v, dout in the dtype and the call's keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Sq, Hq, D, generator=g) * logit_scale).to(DTYPES[dtype])
    k = (torch.randn(B, Sk, Hkv, D, generator=g) * logit_scale).to(DTYPES[dtype])
    v = torch.randn(B, Sk, Hkv, D, generator=g).to(DTYPES[dtype])
    dout = torch.randn(B, Sq, Hq, D, generator=g).to(DTYPES[dtype])
    inputs = {}
    if "doc[" in mask:
        inputs["doc"] = _doc_ids(B, max(Sq, Sk), seed)
    if sink:
        inputs["sinks"] = torch.randn(Hq, generator=g) * 2
    kw = dict(mask=mask, score_mod=score_mod, sink="sinks[h]" if sink else None, inputs=inputs or None,
              softmax_scale=softmax_scale or D**-0.5)
    if dropout_p:
        kw.update(dropout_p=dropout_p, dropout_seed=1000 + seed)
    return q, k, v, dout, (torch.randn(B, Hq, Sq, generator=g) if dlse else None), kw


def _group(t, ratio):
    B, S, H, D = t.shape
    return t.float().permute(0, 2, 1, 3).reshape(B, H // ratio, ratio, S, D)


def model(q, k, v, dout, dlse, kw, wrong=None):
    """(out, lse, (dq, dk, dv, {input: grad})) in the kernels' precisions; `wrong` names a mistake."""
    dt = q.dtype
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    ratio = Hq // Hkv
    scale = kw["softmax_scale"]
    inputs = kw["inputs"] or {}
    qg, dog = _group(q, ratio), _group(dout, ratio)
    kg, vg = k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3)
    q_idx, kv_idx = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    b = torch.arange(B)[:, None, None, None, None]
    h = torch.arange(Hq).reshape(1, Hkv, ratio, 1, 1)

    S = torch.einsum("bgrqd,bgkd->bgrqk", qg, kg) * scale  # fp32 sums of exact products
    Z = S
    g1 = torch.ones(())
    if kw["score_mod"] is not None:
        program = get_score_mod(kw["score_mod"]).program
        Z = program.dense(S, q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs)
        g1 = program.derivative().dense(S, q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs)  # what the kernel emits
    visible = torch.broadcast_to(get_mask(kw["mask"]).dense_visible(q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs),
                                 S.shape)
    Z_all = Z
    Z = Z.masked_fill(~visible, -math.inf)
    sinks = None
    if kw["sink"] is not None:
        sinks = torch.broadcast_to(inputs["sinks"].float().reshape(1, Hkv, ratio, 1), (B, Hkv, ratio, Sq))

    # dropout: the kept elements of the rounded P, the result scaled by 1 / (1 - p) in fp32
    keep, keep_scale = torch.ones(()), torch.ones(())
    if kw.get("dropout_p"):
        keep = reference.dropout_mask(kw["dropout_p"], kw["dropout_seed"], 0, B, Hq, Sq, Sk).reshape(S.shape).float()
        keep_scale = torch.tensor(dropout.keep_scale(kw["dropout_p"]), dtype=torch.float32)

    # forward: online softmax's result, P rounded to the dtype before P.V, O rounded
    m = Z.amax(-1)
    if sinks is not None:
        m = torch.maximum(m, sinks)
    m0 = torch.where(m == -math.inf, 0.0, m)
    p = torch.exp(Z - m0[..., None])
    l = p.sum(-1) + (0.0 if sinks is None else torch.exp(sinks - m0))
    o = torch.einsum("bgrqk,bgkd->bgrqd", p.to(dt).float() * keep, vg) / torch.where(l > 0, l, 1.0)[..., None]
    o = o * keep_scale
    out = o.to(dt)
    lse = torch.where(l > 0, m0 + torch.log(l), -math.inf)

    # backward
    lse0 = torch.where(lse == -math.inf, math.inf, lse)  # the kernel's +inf: every P of the row is 0
    if wrong == "lse_off_by_2^-5":
        lse0 = lse0 + 2.0**-5  # every P 3% small: 8 bf16 roundings, 64 fp16 ones
    P = torch.exp(Z - lse0[..., None])
    P = P.masked_fill(P < 2.0**-126, 0.0)  # ex2.approx.ftz: results below fp32's normal range are 0
    if wrong == "mask_off_by_one":
        shifted = torch.broadcast_to(get_mask(kw["mask"]).dense_visible(q_idx + 1, kv_idx, Sq, Sk, b=b, h=h,
                                                                        inputs=inputs), S.shape)
        P = torch.exp(Z_all.masked_fill(~(visible | shifted), -math.inf) - lse0[..., None])
    outg = out.float()
    dP = torch.einsum("bgrqd,bgkd->bgrqk", dog, vg)
    if wrong == "dropout_other_mask":  # the backward regenerating another call's mask
        keep = reference.dropout_mask(kw["dropout_p"], kw["dropout_seed"], 1, B, Hq, Sq, Sk).reshape(S.shape).float()
    if wrong != "dropout_dp_unmasked":
        dP = dP * keep_scale * keep
    delta = (dog * outg).sum(-1)
    if dlse is not None and wrong != "no_dlse":
        delta = delta - dlse.float().reshape(B, Hkv, ratio, Sq)
    if wrong == "no_D":
        delta = torch.zeros_like(delta)
    if wrong == "no_modifier_grad":
        g1 = torch.ones(())
    dS32 = P * (dP - delta[..., None]) * g1 * (1.0 if wrong == "no_scale" else scale)
    dS = dS32.to(dt).float()
    if wrong == "ds_in_e4m3":  # dS with 3 mantissa bits: 2^4 times the dtype's rounding error, or more
        dS = dS32.to(torch.float8_e4m3fn).float() if dS32.abs().max() < 448 else dS32.to(dt).float()
    P_dt = P.to(dt).float()
    dS_k = dS
    if wrong == "dk_unmasked":
        dS_k = (torch.exp(Z_all - lse0[..., None]) * (dP - delta[..., None]) * g1 * scale).to(dt).float()
    rows = slice(None) if wrong != "no_gqa_sum" else slice(0, 1)
    dv = torch.einsum("bgrqk,bgrqd->bgkd", (P_dt * keep)[:, :, rows], dog[:, :, rows])
    if wrong != "dropout_dv_unscaled":
        dv = dv * keep_scale
    dk = torch.einsum("bgrqk,bgrqd->bgkd", dS_k[:, :, rows], qg[:, :, rows])
    dS_q = dS
    if wrong == "dq_drops_a_block":
        dS_q = dS.clone()
        dS_q[..., -16:] = 0
    dq = torch.einsum("bgrqk,bgkd->bgrqd", dS_q, kg)
    dq = dq.reshape(B, Hq, Sq, D).permute(0, 2, 1, 3).to(dt)
    dk, dv = (t.permute(0, 2, 1, 3).to(dt) for t in (dk, dv))
    dinputs = {}
    if sinks is not None:
        w = torch.where(lse == -math.inf, 0.0, torch.exp(sinks - lse))
        dinputs["sinks"] = (-w * delta).sum((0, 3)).reshape(Hq)
    out = out.reshape(B, Hq, Sq, D).permute(0, 2, 1, 3)
    return out, lse.reshape(B, Hq, Sq), (dq, dk, dv, dinputs)


def reference_grads(q, k, v, dout, dlse, kw):
    grad_inputs = ("sinks",) if kw["sink"] else ()
    return reference.attention_grads(q, k, v, dout, dlse=dlse, grad_inputs=grad_inputs, **kw)


def check_model(dtype, wrong=None, **shape):
    q, k, v, dout, dlse, kw = problem(dtype, **shape)
    out, lse, grads = model(q, k, v, dout, dlse, kw, wrong)
    ref = reference_grads(q, k, v, dout, dlse, kw)
    return tolerance.check_grads(grads, ref, q, k, v, out, dout, dtype, kw["softmax_scale"], lse=lse, dlse=dlse)


# -- the reference's pieces ------------------------------------------------------------------------
@pytest.mark.parametrize("score_mod", [None, "softcap(3.0)", "where(h == 1, score * 0.5, score) + 0.01 * kv_idx"])
def test_dense_pieces_agree_with_autograd(score_mod):
    q, k, v, dout, dlse, kw = problem("bf16", mask="causal", score_mod=score_mod, sink=True, dlse=True, Sq=17, Sk=9)
    dq, dk, dv, parts = reference_grads(q, k, v, dout, dlse, kw)
    ratio = parts["ratio"]
    qg, dog = _group(q, ratio).double(), _group(dout, ratio).double()
    kg = k.double().permute(0, 2, 1, 3)
    tight = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.einsum("bgrqk,bgrqd->bgkd", parts["P"], dog), dv.permute(0, 2, 1, 3), **tight)
    torch.testing.assert_close(torch.einsum("bgrqk,bgrqd->bgkd", parts["dS"], qg), dk.permute(0, 2, 1, 3), **tight)
    dq_parts = torch.einsum("bgrqk,bgkd->bgrqd", parts["dS"], kg).reshape(dq.shape[0], -1, *dq.shape[1:2], dq.shape[3])
    torch.testing.assert_close(dq_parts.permute(0, 2, 1, 3), dq, **tight)
    row_grad = -(parts["psink"] * parts["D"])
    torch.testing.assert_close(torch.einsum("bgrq,bgrqx->x", row_grad, parts["jacobian"]["sinks"]),
                               parts["dinputs"]["sinks"], **tight)
    assert parts["visible"].shape == parts["P"].shape and not parts["P"][~parts["visible"]].any()


def test_modifier_derivatives_are_the_analytic_ones():
    q, k, v, dout, dlse, kw = problem("fp16", mask="none", score_mod="softcap(3.0)", logit_scale=2.0)
    *_, parts = reference_grads(q, k, v, dout, dlse, kw)
    t = torch.tanh(parts["S"] / 3.0)
    torch.testing.assert_close(parts["g1"], 1 - t * t, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(parts["g2"], -2 / 3.0 * t * (1 - t * t), rtol=1e-12, atol=1e-14)


def test_reference_gradients_match_finite_differences():
    """The yardstick itself: float64 autograd through attention() against central differences."""
    q, k, v, dout, dlse, kw = problem("bf16", B=1, Sq=5, Sk=7, Hq=2, Hkv=1, D=8, mask="causal",
                                      score_mod="softcap(3.0)", sink=True, dlse=True)
    dq, dk, dv, parts = reference_grads(q, k, v, dout, dlse, kw)

    def loss(q_, k_, v_, sinks):  # attention()'s computation, its LSE kept in float64
        dense = reference._grouped(q_, k_, v_, get_mask(kw["mask"]), get_score_mod(kw["score_mod"]), kw["sink"],
                                   kw["softmax_scale"], 2, {"sinks": sinks}, 0, torch.float64)
        out = dense.out.reshape(1, 2, 5, 8).permute(0, 2, 1, 3)
        return (out * dout.double()).sum() + (dense.lse.reshape(1, 2, 5) * dlse.double()).sum()

    x = [q.double(), k.double(), v.double(), kw["inputs"]["sinks"].double()]
    for which, grad in enumerate((dq, dk, dv, parts["dinputs"]["sinks"])):
        for flat in (0, x[which].numel() // 2, x[which].numel() - 1):
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x[which].shape))
            hi, lo = [t.clone() for t in x], [t.clone() for t in x]
            hi[which][idx] += 1e-6
            lo[which][idx] -= 1e-6
            fd = (loss(*hi) - loss(*lo)).item() / 2e-6
            assert abs(fd - grad[idx].item()) <= 1e-6 * (1 + abs(fd)), (which, idx, fd, grad[idx].item())


# -- the bounds pass exact results and catch anything beyond them ---------------------------------------
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_reference_itself_passes_and_a_perturbation_just_beyond_the_bound_fails(dtype):
    q, k, v, dout, dlse, kw = problem(dtype, mask="causal", Sq=40, Sk=24, sink=True, dlse=True)
    ref = reference_grads(q, k, v, dout, dlse, kw)
    out = reference.attention(q, k, v, **kw)
    scale = kw["softmax_scale"]
    exact = (*ref[:3], ref[3]["dinputs"])
    assert tolerance.check_grads(exact, ref, q, k, v, out, dout, dtype, scale, dlse=dlse) is None
    bounds = tolerance.grad_bounds(ref, q, k, v, out, dout, dtype, scale, dlse=dlse)
    for which, name in enumerate(("dq", "dk", "dv")):
        idx = (1, 30, 3, 5) if name == "dq" else (0, 7, 1, 60)
        for factor, fails in ((-0.999, False), (1.001, True)):
            grads = [g.clone() for g in exact[:3]] + [exact[3]]
            grads[which] = grads[which] + 0.999 * bounds[name]  # everywhere at once: still within
            grads[which][idx] = exact[which][idx] + factor * bounds[name][idx]
            bad = tolerance.check_grads(grads, ref, q, k, v, out, dout, dtype, scale, dlse=dlse)
            assert (bad is not None) == fails, (name, factor, bad)
            if fails:
                assert bad.what == name and bad.index == idx
    sink_bound = bounds["inputs"]["sinks"]
    grads = (*exact[:3], {"sinks": exact[3]["sinks"] + 1.01 * sink_bound * torch.tensor([0, 0, 1, 0])})
    bad = tolerance.check_grads(grads, ref, q, k, v, out, dout, dtype, scale, dlse=dlse)
    assert bad is not None and bad.what == "d inputs['sinks']" and bad.index == (2,)


def test_nonfinite_gradients_and_stray_values_in_empty_rows_and_keys_fail():
    q, k, v, dout, dlse, kw = problem("bf16", mask="causal", Sq=40, Sk=24)  # rows 0..15 see no key
    ref = reference_grads(q, k, v, dout, dlse, kw)
    out = reference.attention(q, k, v, **kw)
    scale = kw["softmax_scale"]
    assert (ref[0][:, :16] == 0).all()
    for which, idx, value, what in ((0, (0, 20, 1, 3), float("nan"), "dq has NaN/Inf"),
                                    (2, (1, 3, 0, 0), float("inf"), "dv has NaN/Inf"),
                                    (0, (0, 15, 2, 0), 1e-30, "dq of a row that sees no key is not 0")):
        grads = [g.clone() for g in ref[:3]]
        grads[which][idx] = value
        bad = tolerance.check_grads(grads, ref, q, k, v, out, dout, "bf16", scale)
        assert bad is not None and bad.what == what and bad.index == idx, bad
    # a key no row sees: sliding window hides the keys of the window's far side
    q, k, v, dout, dlse, kw = problem("bf16", mask="sliding_window(4, 0)", Sq=8, Sk=40)
    ref = reference_grads(q, k, v, dout, dlse, kw)
    out = reference.attention(q, k, v, **kw)
    grads = [g.clone() for g in ref[:3]]
    grads[1][0, 2, 1, 0] = 1e-30
    bad = tolerance.check_grads(grads, ref, q, k, v, out, dout, "bf16", kw["softmax_scale"])
    assert bad is not None and bad.what == "dk of a key no row sees is not 0"


def test_a_forward_output_beyond_its_bound_is_reported_first():
    q, k, v, dout, dlse, kw = problem("fp16", mask="none")
    ref = reference_grads(q, k, v, dout, dlse, kw)
    out = reference.attention(q, k, v, **kw).clone()
    out[0, 3, 1, 2] += 0.1
    bad = tolerance.check_grads(ref[:3], ref, q, k, v, out, dout, "fp16", kw["softmax_scale"])
    assert bad is not None and bad.what.startswith("the forward output the backward read")


# -- the kernel's arithmetic passes ------------------------------------------------------------------
CASES = [
    dict(mask="none"),
    dict(mask="causal", Sq=33, Sk=40, Hkv=1),
    dict(mask="causal", Sq=47, Sk=20, Hkv=4),  # bottom-right causal: 27 rows see no key
    dict(mask="causal", Sq=1, Sk=37),
    dict(mask="sliding_window(8, 0)", Sq=40, Sk=40, D=96),
    dict(mask=DOC_MASK, Sq=48, Sk=48, Hkv=1),
    dict(mask="causal", score_mod="softcap(3.0)", logit_scale=2.0),
    dict(mask="none", score_mod="softcap(30.0)", logit_scale=8.0, D=128),
    dict(mask="causal", score_mod="score - 0.05 * abs(q_idx - kv_idx)", Sq=40, Sk=33),
    dict(mask="causal", sink=True, dlse=True, Sq=45, Sk=30),
    dict(mask="none", dlse=True, Hkv=1),
    dict(mask="causal", logit_scale=10.0),  # scores ~1e2
    dict(mask="none", logit_scale=100.0, Sq=20, Sk=20),  # scores ~1e4: one key per row
    dict(mask="causal", logit_scale=100.0, sink=True, dlse=True, Sq=24, Sk=24, Hkv=1),
    dict(mask="causal", dropout_p=0.1),
    dict(mask="none", dropout_p=0.5, Sq=40, Sk=70, D=128),
    dict(mask=DOC_MASK, Sq=48, Sk=48, Hkv=1, dropout_p=0.25, sink=True, dlse=True),
    dict(mask="causal", score_mod="softcap(3.0)", logit_scale=2.0, dropout_p=0.9),
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_arithmetic_is_within_the_bounds(dtype, case, seed):
    assert check_model(dtype, seed=seed, **case) is None


@pytest.mark.parametrize("seed", [2, 8, 13])
def test_probabilities_flushed_to_zero_are_within_the_bounds(seed):
    """One query row per head seeing keys whose P falls below 2^-126 (scores spread ~100): ex2.approx.ftz
    returns 0 there, and the dK of such a key is then off by P |dP - D| scale |q| ~ 1e-37, beyond
    the dtype's rounding terms alone (`attngen fuzz` found this on the H100: the bound's phi)."""
    q, k, v, dout, dlse, kw = problem("bf16", mask="causal", logit_scale=4.0, Sq=1, Sk=40, Hkv=2, seed=seed,
                                      softmax_scale=0.5)
    out, lse, grads = model(q, k, v, dout, dlse, kw)
    assert (grads[1] == 0).any()
    ref = reference_grads(q, k, v, dout, dlse, kw)
    assert tolerance.check_grads(grads, ref, q, k, v, out, dout, "bf16", 0.5, lse=lse, dlse=dlse) is None


@pytest.mark.parametrize("shape", [dict(B=2, Sq=1, Sk=2, Hq=1, Hkv=1, softmax_scale=0.01), dict(Sq=20, Sk=20)])
@pytest.mark.parametrize("seed", [3, 9])
def test_a_saturated_softcap_derivative_is_within_the_bounds(shape, seed):
    """softcap's g1 = 1 - tanh^2 cancels near saturation (scores ~ 900 x scale): its fp32 value is off
    by ~1e-7 absolute where g1 is far smaller, beyond 4 eps32 |g1| (`attngen fuzz` found it on the
    H100); the bound's evaluation error of g1 (maskc/dense.py) covers it."""
    q, k, v, dout, dlse, kw = problem("bf16", mask="causal", score_mod="softcap(20.0)", logit_scale=30.0, seed=seed,
                                      **shape)
    out, lse, grads = model(q, k, v, dout, dlse, kw)
    ref = reference_grads(q, k, v, dout, dlse, kw)
    assert tolerance.check_grads(grads, ref, q, k, v, out, dout, "bf16", kw["softmax_scale"], lse=lse,
                                 dlse=dlse) is None


@pytest.mark.parametrize("text", ["softcap(20.0)", "score * tanh(score) + exp(score / 8.0)",
                                  "where(score > 1.0, sqrt(abs(score) + 1.0), score / 3.0 - 1.0)",
                                  "log(abs(score) + 2.0) * 0.5 - score"])
def test_the_fp32_evaluation_error_bound_holds_for_derivatives(text):
    """evaluation_error's bound against torch's fp32 evaluation of each derivative, on scores from
    1e-4 to 1e3 of both signs (torch's tanh, exp and log are within the kernels' error model)."""
    program = get_score_mod(text).program.derivative()
    mag = torch.logspace(-4, 3, 4001, dtype=torch.float64)
    score = torch.cat([mag, -mag]).reshape(1, -1).float().double()  # exact fp32 scores: their own error is apart
    exact = program.dense(score, 0, torch.arange(score.shape[1]), 1, score.shape[1]).double()
    fp32 = program.dense(score.float(), 0, torch.arange(score.shape[1]), 1, score.shape[1]).double()
    bound = program.dense_error(score, 0, torch.arange(score.shape[1]), 1, score.shape[1])
    ok = torch.isfinite(exact) & torch.isfinite(fp32)  # past fp32's range it overflows: not a rounding error
    assert ((fp32 - exact).abs()[ok] <= 2 * bound[ok] + 1e-300).all()
    assert (bound[ok] < 1e-3 * (exact.abs()[ok] + 1)).all()  # and not vacuous


# -- and mistakes do not ------------------------------------------------------------------------------
# Each mistake on a problem where it changes the result (a GQA sum needs ratio > 1, dLSE a loss
# reading the LSE, a modifier's gradient a modifier that bends the scores).
MISTAKES = [
    ("no_scale", dict(mask="causal")),
    ("no_D", dict(mask="causal")),
    ("no_D", dict(mask="none", logit_scale=100.0, Sq=20, Sk=20)),
    ("no_dlse", dict(mask="causal", dlse=True, sink=True)),
    ("dk_unmasked", dict(mask="causal")),
    ("dk_unmasked", dict(mask=DOC_MASK, Sq=48, Sk=48)),
    ("mask_off_by_one", dict(mask="causal", Sq=40, Sk=40)),
    ("mask_off_by_one", dict(mask="sliding_window(8, 0)", Sq=40, Sk=40)),
    ("no_gqa_sum", dict(mask="causal", Hkv=1)),
    ("no_modifier_grad", dict(mask="causal", score_mod="softcap(3.0)", logit_scale=2.0)),
    ("dq_drops_a_block", dict(mask="none", Sq=20, Sk=40)),
    ("lse_off_by_2^-5", dict(mask="causal")),
    ("ds_in_e4m3", dict(mask="none", D=128)),
    ("dropout_dp_unmasked", dict(mask="causal", dropout_p=0.1)),
    ("dropout_dv_unscaled", dict(mask="causal", dropout_p=0.1)),
    ("dropout_other_mask", dict(mask="none", dropout_p=0.1)),
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("wrong, case", MISTAKES, ids=[f"{w}-{i}" for i, (w, _) in enumerate(MISTAKES)])
def test_a_wrong_gradient_fails(dtype, wrong, case):
    assert check_model(dtype, **case) is None  # the same problem, computed right, passes
    bad = check_model(dtype, wrong=wrong, **case)
    assert bad is not None, f"{wrong} passed the {dtype} bounds"


def test_the_bounds_are_not_vacuous():
    """The model's worst error uses a fair share of each bound: a bound a thousand times the error
    could not tell a half-precision kernel from a wrong one. Where a gradient does not cancel the
    worst-case sums of magnitudes are within a small factor of the rounding errors that occur."""
    for dtype in DTYPES:
        q, k, v, dout, dlse, kw = problem(dtype, mask="causal", Sq=64, Sk=64)
        out, lse, grads = model(q, k, v, dout, dlse, kw)
        ref = reference_grads(q, k, v, dout, dlse, kw)
        bounds = tolerance.grad_bounds(ref, q, k, v, out, dout, dtype, kw["softmax_scale"], lse=lse)
        for which, name in enumerate(("dq", "dk", "dv")):
            used = ((grads[which].double() - ref[which]).abs() / bounds[name].clamp_min(1e-300)).max().item()
            assert 0.05 < used < 1.0, (dtype, name, used)


def test_the_lse_error_is_the_actual_one_when_given_else_the_forward_estimate():
    """Given the forward's LSE the exponent error uses |L' - L| (an LSE further off widens the
    bound, and fails the forward's LSE check first); without it, the forward's estimate, which
    covers the model's fp32 LSE."""
    q, k, v, dout, dlse, kw = problem("fp16", mask="causal")
    out, lse, grads = model(q, k, v, dout, dlse, kw)
    ref = reference_grads(q, k, v, dout, dlse, kw)
    scale = kw["softmax_scale"]
    assert tolerance.check_grads(grads, ref, q, k, v, out, dout, "fp16", scale) is None
    off = lse + 0.01 * (lse > -math.inf)
    exact = tolerance.grad_bounds(ref, q, k, v, out, dout, "fp16", scale, lse=lse)
    wider = tolerance.grad_bounds(ref, q, k, v, out, dout, "fp16", scale, lse=off)
    seen = exact["key_seen"][..., None].expand_as(exact["dv"])
    assert (wider["dv"][seen] > exact["dv"][seen]).all() and torch.equal(wider["dv"][~seen], exact["dv"][~seen])
    bad = tolerance.check_grads(grads, ref, q, k, v, out, dout, "fp16", scale, lse=off)
    assert bad is not None and bad.what.startswith("the forward LSE the backward read")
