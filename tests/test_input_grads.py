"""Gradients of a score modifier's runtime inputs read at [h] alone (a learned per-head bias or ALiBi
slopes) without a GPU: the symbolic derivative with respect to an input, the kernels' rendering of it,
and the derived bound of tolerance.grad_bounds, which holds the exact gradient and refuses wrong ones."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attngen import reference, targets, tolerance  # noqa: E402
from attngen.families import BACKWARD_FAMILIES  # noqa: E402
from attngen.maskc.program import compile_score_mod  # noqa: E402
from attngen.spec import AttentionSpec  # noqa: E402

SLOPE_MOD = "score - slope[h] * abs(q_idx - kv_idx)"


@pytest.mark.parametrize("text, name, want", [
    (SLOPE_MOD, "slope", "-abs(q_idx - kv_idx)"),
    ("score + bias[h] * 2.0", "bias", "2.0"),
    ("tanh(score * w[h])", "w", "(1.0 - tanh(score * w[h]) * tanh(score * w[h])) * score"),
])
def test_the_derivative_with_respect_to_an_input(text, name, want):
    assert compile_score_mod(text).input_derivative(name).canonical == want


@pytest.mark.parametrize("family", ["bwd_sm80", "bwd_sm90"])
def test_the_backward_kernels_render_the_input_derivative(family):
    spec = AttentionSpec(head_dim=64, mask="causal", score_mod=SLOPE_MOD)
    target = targets.target("sm_90a")
    f = BACKWARD_FAMILIES[family]
    source = f.render(f.plan(spec.problem, target, f.default_config(spec.problem, target)))
    assert "constexpr int INPUT_GRADS = 1;" in source and "g[0] = " in source and "// slope" in source
    plain = AttentionSpec(head_dim=64, mask="causal", score_mod="softcap(30.0)")
    assert "constexpr int INPUT_GRADS = 0;" in f.render(f.plan(plain.problem, target, f.default_config(plain.problem,
                                                                                                      target)))


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, S, H, D = 1, 40, 4, 64
    q, dout = (torch.randn(B, S, H, D, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, S, 2, D, generator=gen).bfloat16() for _ in range(2))
    slope = torch.linspace(0.01, 0.2, H)
    kw = dict(mask="causal", score_mod=SLOPE_MOD, inputs={"slope": slope}, gqa_ratio=2)
    ref = reference.attention_grads(q, k, v, dout, grad_inputs=("slope",), **kw)
    out = reference.attention(q.double(), k.double(), v.double(), **kw).to(q.dtype)
    return q, k, v, dout, out, ref


def test_the_bound_holds_the_exact_gradient_and_refuses_wrong_ones():
    q, k, v, dout, out, ref = _case()
    dq, dk, dv, parts = ref
    exact = parts["dinputs"]["slope"].float()
    grads = lambda g: (dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), {"slope": g})  # noqa: E731
    assert tolerance.check_grads(grads(exact), ref, q, k, v, out, dout, "bf16", 64 ** -0.5) is None
    for wrong in (exact * 1.05, exact.roll(1), exact * (torch.arange(4) != 1)):  # scaled, heads swapped, one lost
        assert tolerance.check_grads(grads(wrong), ref, q, k, v, out, dout, "bf16", 64 ** -0.5) is not None
