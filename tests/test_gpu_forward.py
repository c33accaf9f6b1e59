"""Forward kernel against the float64 reference on a GPU (marker `gpu`).

Outputs are NaN-poisoned before every launch so an unwritten element fails; bounds
come from attngen.tolerance (one per dtype, derived from the numerics).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings

import attngen
from attngen import reference, tolerance
from attngen.fuzz.case import make_inputs as make_case_inputs
from attngen.fuzz.strategies import BUILTIN_SPECS, ODD_LENGTHS, fuzz_cases
from attngen.spec import AttentionSpec

pytestmark = pytest.mark.gpu

TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}

# A fixed pool of specs keeps the number of distinct compiles (seconds each) bounded; it and the
# case strategy are the fuzzer's (attngen/fuzz/strategies.py), shared rather than copied.
SPEC_POOL = BUILTIN_SPECS


def make_inputs(spec, B, Sq, Sk, Hkv, *, transposed=False, logit_scale=1.0, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, TORCH_DTYPE[spec.dtype])
    Hq = Hkv * spec.gqa_ratio

    def rand(S, H, scale=1.0):
        shape = (B, H, S, spec.head_dim) if transposed else (B, S, H, spec.head_dim)
        x = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dtype)
        return x.transpose(1, 2) if transposed else x  # BHSD storage seen as BSHD: non-trivial strides

    return rand(Sq, Hq, logit_scale), rand(Sk, Hkv, logit_scale), rand(Sk, Hkv)


def run_and_check(spec, q, k, v, softmax_scale=None):
    import torch

    kernel = attngen.compile(spec)
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format).contiguous()
    lse = torch.full((B, Hq, Sq), float("nan"), device="cuda", dtype=torch.float32)
    kernel(q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
    torch.cuda.synchronize()
    scale = spec.effective_scale if softmax_scale is None else softmax_scale
    ref, ref_lse = reference.attention_for_spec(q, k, v, spec, softmax_scale=scale, return_lse=True)
    bad = tolerance.check_output(out, ref, q, k, v, spec.dtype, scale) or tolerance.check_lse(lse, ref_lse, q, k, scale)
    assert bad is None, f"{spec.name} B={B} Sq={Sq} Sk={Sk} Hq={Hq}: {bad}"


@pytest.mark.parametrize("spec", SPEC_POOL[:7], ids=lambda s: s.name)
@pytest.mark.parametrize("Sq,Sk", [(n, n) for n in ODD_LENGTHS] + [(1, 4097), (129, 17), (1000, 127), (17, 1000)])
def test_odd_lengths(spec, Sq, Sk):
    q, k, v = make_inputs(spec, B=1, Sq=Sq, Sk=Sk, Hkv=2, seed=Sq * 7919 + Sk)
    run_and_check(spec, q, k, v)


@pytest.mark.parametrize("spec", SPEC_POOL, ids=lambda s: s.name)
def test_strided_bhsd_inputs(spec):
    q, k, v = make_inputs(spec, B=2, Sq=300, Sk=257, Hkv=2, transposed=True, seed=3)
    assert not q.is_contiguous()
    run_and_check(spec, q, k, v)


def test_fully_masked_rows_give_zero_and_neg_inf():
    import torch

    spec = AttentionSpec(head_dim=64, dtype="bf16", mask="causal")
    q, k, v = make_inputs(spec, B=1, Sq=300, Sk=40, Hkv=3, seed=5)
    out, lse = attngen.attention(q, k, v, spec, return_lse=True)
    hidden = 300 - 40  # bottom-right alignment: rows below Sq - Sk see no key
    assert torch.all(out[:, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, hidden:]).all()
    run_and_check(spec, q, k, v)


def test_large_logits_and_custom_scale():
    spec = AttentionSpec(head_dim=128, dtype="bf16", mask="causal")
    q, k, v = make_inputs(spec, B=1, Sq=513, Sk=513, Hkv=2, logit_scale=30.0, seed=11)
    run_and_check(spec, q, k, v)  # scores up to ~1e4
    run_and_check(spec, q, k, v, softmax_scale=0.5)


def test_runs_on_current_stream_and_returns_new_tensor():
    import torch

    spec = SPEC_POOL[0]
    q, k, v = make_inputs(spec, B=2, Sq=256, Sk=256, Hkv=4, seed=2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = attngen.attention(q, k, v, spec)
    stream.synchronize()
    assert out.data_ptr() != q.data_ptr() and out.shape == q.shape and out.dtype == q.dtype
    ref = reference.attention_for_spec(q, k, v, spec)
    assert tolerance.check_output(out, ref, q, k, v, spec.dtype, spec.effective_scale) is None


def test_cupy_arrays():
    import cupy
    import torch

    spec = AttentionSpec(head_dim=64, dtype="fp16", mask="causal")
    q, k, v = make_inputs(spec, B=1, Sq=200, Sk=333, Hkv=2, seed=9)
    out = attngen.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), spec)
    assert isinstance(out, cupy.ndarray)
    ref = reference.attention_for_spec(q, k, v, spec)
    assert tolerance.check_output(torch.as_tensor(out, device="cuda"), ref, q, k, v, spec.dtype,
                                  spec.effective_scale) is None


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, v: (q.float(), k, v), "dtype"),
        (lambda q, k, v: (q[..., :32].contiguous(), k, v), "head_dim"),
        (lambda q, k, v: (q, k[:, :, :1], v[:, :, :1]), "gqa_ratio"),
        (lambda q, k, v: (q, k, v[:, :-1]), "same shape"),
        (lambda q, k, v: (q.cpu(), k, v), "CUDA"),
        (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "contiguous in its last dim"),
        (lambda q, k, v: (q[0], k, v), "4 dims"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, match):
    spec = AttentionSpec(head_dim=64, dtype="bf16", gqa_ratio=2)
    q, k, v = make_inputs(spec, B=1, Sq=64, Sk=64, Hkv=2)
    with pytest.raises(ValueError, match=match):
        attngen.attention(*change(q, k, v), spec)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=fuzz_cases(SPEC_POOL))
def test_hypothesis_against_reference(case):
    q, k, v = (p.view for p in make_case_inputs(case, "cuda"))
    run_and_check(case.spec, q, k, v, softmax_scale=case.softmax_scale)
