"""Self-consistency of the dense reference (CPU): it is the yardstick every kernel is held to."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attngen.reference import attention, attention_for_spec
from attngen.spec import AttentionSpec

# float64 vs float64 with a different summation order: only rounding differs.
TIGHT = dict(rtol=1e-10, atol=1e-12)


def _qkv(B=2, Sq=5, Sk=7, Hq=4, Hkv=2, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Sk, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _loop_attention(q, k, v, scale, causal):
    """Row-by-row attention in numpy: an independent statement of the contract."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    ratio = Hq // Hkv
    out = np.zeros((B, Sq, Hq, D))
    lse = np.full((B, Hq, Sq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            kh = h // ratio
            for i in range(Sq):
                # Bottom-right: the last query row lines up with the last key.
                keys = [j for j in range(Sk) if not causal or (Sq - 1 - i) <= (Sk - 1 - j)]
                if not keys:
                    continue
                s = np.array([scale * float(q[b, i, h] @ k[b, j, kh]) for j in keys])
                m = s.max()
                w = np.exp(s - m)
                out[b, i, h] = sum(wj * v[b, j, kh] for wj, j in zip(w, keys)) / w.sum()
                lse[b, h, i] = m + math.log(w.sum())
    return torch.from_numpy(out), torch.from_numpy(lse)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_gqa_equals_repeated_kv_heads(ratio, mask):
    q, k, v = _qkv(Hq=2 * ratio, Hkv=2, Sq=6, Sk=6)
    out, lse = attention(q, k, v, mask=mask, return_lse=True)
    k_rep, v_rep = k.repeat_interleave(ratio, dim=2), v.repeat_interleave(ratio, dim=2)
    out_mha, lse_mha = attention(q, k_rep, v_rep, mask=mask, gqa_ratio=1, return_lse=True)
    torch.testing.assert_close(out, out_mha, **TIGHT)
    torch.testing.assert_close(lse, lse_mha, **TIGHT)
    torch.testing.assert_close(attention(q, k, v, mask=mask, gqa_ratio=ratio), out, rtol=0, atol=0)


@pytest.mark.parametrize("Sq,Sk", [(5, 5), (3, 8), (1, 9), (8, 3), (9, 1), (6, 6)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_matches_row_by_row_loops(Sq, Sk, mask):
    q, k, v = _qkv(Sq=Sq, Sk=Sk, Hq=4, Hkv=2)
    scale = 0.37
    out, lse = attention(q, k, v, mask=mask, softmax_scale=scale, return_lse=True)
    want_out, want_lse = _loop_attention(q, k, v, scale, causal=(mask == "causal"))
    torch.testing.assert_close(out, want_out, **TIGHT)
    # LSE is float32 by contract.
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compute_dtype", [torch.float64, torch.float32])
def test_fully_masked_rows_give_zero_and_minus_inf(dtype, compute_dtype):
    # Causal with Sq=6 > Sk=2: rows 0..3 see no key (i + Sk - Sq < 0).
    q, k, v = _qkv(Sq=6, Sk=2, dtype=dtype)
    out, lse = attention(q, k, v, mask="causal", return_lse=True, compute_dtype=compute_dtype)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, :4] == 0).all()
    assert (lse[:, :, :4] == -math.inf).all()
    assert out[:, 4:].abs().sum() > 0 and torch.isfinite(lse[:, :, 4:]).all()


def test_no_keys_at_all():
    q, k, v = _qkv(Sq=3, Sk=0)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == (2, 4, 3) and (lse == -math.inf).all()


def test_lse_is_logsumexp_of_scaled_scores():
    q, k, v = _qkv(Hq=2, Hkv=2, Sq=4, Sk=9)
    D = q.shape[-1]
    out, lse = attention(q, k, v, return_lse=True)
    # Scores via a different contraction: (B, H, Sq, Sk) from BHSD matmul, default scale 1/sqrt(D).
    scores = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / math.sqrt(D)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float(), rtol=1e-6, atol=1e-6)
    # The output is exp(scores - lse) @ v: the LSE the backward pass will consume.
    probs = torch.exp(scores - lse.double()[..., None])
    torch.testing.assert_close(out, (probs @ v.transpose(1, 2)).transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _qkv(D=16)
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, softmax_scale=0.25), rtol=0, atol=0)
    assert not torch.allclose(attention(q, k, v), attention(q, k, v, softmax_scale=0.5))


def test_large_logits_stay_finite_and_convex():
    q, k, v = _qkv()
    out = attention(q * 1e3, k * 1e3, v, mask="causal")
    assert torch.isfinite(out).all()
    # Each output is a convex combination of value rows, so it lies within their range.
    assert (out <= v.amax(dim=(1, 2), keepdim=True) + 1e-12).all()
    assert (out >= v.amin(dim=(1, 2), keepdim=True) - 1e-12).all()


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_strided_bhsd_inputs_match_contiguous(mask):
    q, k, v = _qkv(Sq=5, Sk=7)
    # (B, H, S, D) storage viewed as BSHD: the zero-copy path the kernels must accept too.
    q_t, k_t, v_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q_t.is_contiguous()
    want, want_lse = attention(q, k, v, mask=mask, return_lse=True)
    got, got_lse = attention(q_t, k_t, v_t, mask=mask, return_lse=True)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(got_lse, want_lse, **TIGHT)
    # Any strides at all, even a non-contiguous last dim (the reference is not the kernel).
    q_s = torch.stack([q, torch.full_like(q, math.nan)], dim=-1).flatten(-2)[..., ::2]
    torch.testing.assert_close(attention(q_s, k, v, mask=mask), want, **TIGHT)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_float32_close_to_float64(mask):
    q, k, v = _qkv(Sq=9, Sk=9, D=32)
    want, want_lse = attention(q, k, v, mask=mask, return_lse=True)
    got, got_lse = attention(q, k, v, mask=mask, return_lse=True, compute_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-6)
    # float32 inputs come back as float32.
    out32 = attention(q.float(), k.float(), v.float(), mask=mask)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_in_input_dtype_lse_float32(dtype):
    q, k, v = _qkv(dtype=dtype)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 5)
    # Computed from the same rounded inputs, so it is the float64 answer rounded once.
    want = attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out, want.to(dtype), rtol=0, atol=0)


def test_attention_for_spec_uses_spec_fields():
    spec = AttentionSpec(head_dim=64, dtype="bf16", gqa_ratio=2, mask="causal", softmax_scale=0.2)
    q, k, v = _qkv(Hq=4, Hkv=2, Sq=5, Sk=8, D=64)
    got, got_lse = attention_for_spec(q, k, v, spec, return_lse=True)
    want, want_lse = attention(q, k, v, mask="causal", gqa_ratio=2, softmax_scale=0.2, return_lse=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    # Unset scale in the spec means 1/sqrt(head_dim).
    plain = AttentionSpec(head_dim=64, gqa_ratio=2)
    torch.testing.assert_close(attention_for_spec(q, k, v, plain), attention(q, k, v, softmax_scale=0.125))


def test_attention_for_spec_takes_the_spec_or_its_problem():
    spec = AttentionSpec(head_dim=64, gqa_ratio=2, mask="causal", softmax_scale=0.2, family="fwd_sm80")
    q, k, v = _qkv(Hq=4, Hkv=2, Sq=5, Sk=8, D=64)
    got, got_lse = attention_for_spec(q, k, v, spec.problem, return_lse=True)
    want, want_lse = attention_for_spec(q, k, v, spec, return_lse=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [0.0, -0.1, 1e-50, math.inf, math.nan, True, "0.1"])
def test_attention_for_spec_holds_an_explicit_scale_to_what_kernels_accept(scale):
    q, k, v = _qkv(Hq=4, Hkv=2, D=64)
    with pytest.raises(ValueError, match="allowed") as info:
        attention_for_spec(q, k, v, AttentionSpec(head_dim=64, gqa_ratio=2), softmax_scale=scale)
    assert "softmax_scale" in str(info.value)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda q, k, v, s: attention_for_spec(q, k, v, AttentionSpec(head_dim=128, gqa_ratio=2)), "q.shape[-1]"),
        (lambda q, k, v, s: attention_for_spec(q, k, v, AttentionSpec(head_dim=64, gqa_ratio=4)), "gqa_ratio"),
        (lambda q, k, v, s: attention_for_spec(q.half(), k.half(), v.half(), s), "q.dtype"),
        (lambda q, k, v, s: attention_for_spec(q, k, v, s, softmax_scale=0.3), "softmax_scale"),
    ],
)
def test_attention_for_spec_rejects_mismatch(call, argument):
    spec = AttentionSpec(head_dim=64, dtype="bf16", gqa_ratio=2, softmax_scale=0.2)
    q, k, v = _qkv(Hq=4, Hkv=2, D=64)
    with pytest.raises(ValueError, match="allowed") as info:
        call(q, k, v, spec)
    assert argument in str(info.value)


def _bad_calls():
    """(description, call on good q, k, v, argument the error must name)."""
    return [
        ("q not a tensor", lambda q, k, v: attention(q.tolist(), k, v), "q"),
        ("q 3-d", lambda q, k, v: attention(q[0], k, v), "q.ndim"),
        ("v 5-d", lambda q, k, v: attention(q, k, v[None]), "v.ndim"),
        ("int q", lambda q, k, v: attention(q.long(), k, v), "q.dtype"),
        ("k dtype differs", lambda q, k, v: attention(q, k.float(), v), "k.dtype"),
        ("batch differs", lambda q, k, v: attention(q, k[:1], v[:1]), "k.shape[0]"),
        ("head dim differs", lambda q, k, v: attention(q, k[..., :4], v[..., :4]), "k.shape[-1]"),
        ("v seq differs", lambda q, k, v: attention(q, k, v[:, :3]), "v.shape"),
        ("Hq % Hkv", lambda q, k, v: attention(q[:, :, :3], k, v), "q.shape[2]"),
        ("ratio wrong", lambda q, k, v: attention(q, k, v, gqa_ratio=4), "gqa_ratio"),
        ("ratio float", lambda q, k, v: attention(q, k, v, gqa_ratio=2.0), "gqa_ratio"),
        ("unknown mask", lambda q, k, v: attention(q, k, v, mask="sliding"), "mask"),
        ("nan scale", lambda q, k, v: attention(q, k, v, softmax_scale=math.nan), "softmax_scale"),
        ("str scale", lambda q, k, v: attention(q, k, v, softmax_scale="0.1"), "softmax_scale"),
        ("fp16 compute", lambda q, k, v: attention(q, k, v, compute_dtype=torch.float16), "compute_dtype"),
    ]


@pytest.mark.parametrize("what, call, argument", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_raise_value_error_naming_argument(what, call, argument):
    q, k, v = _qkv(Hq=4, Hkv=2)
    with pytest.raises(ValueError, match="allowed") as info:
        call(q, k, v)
    assert argument in str(info.value), str(info.value)
