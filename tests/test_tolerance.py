"""The per-dtype bounds hold for a CPU model of the kernel's arithmetic, and reject real errors.

The model does what the kernel does: fp32 scores (from exact products of fp16/bf16 inputs),
fp32 softmax, P rounded to the dtype before P.V in fp32, the output rounded to the dtype.
"""

import pytest
import torch

from attngen import reference, tolerance
from attngen.spec import AttentionSpec

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def kernel_model(q, k, v, scale):
    """(out, lse) computed in the kernel's precisions; q, k, v are (B, S, H, D)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype).float(), v.float()) / l.transpose(1, 2).squeeze(-1)[..., None]
    return o.to(q.dtype), (m + l.log()).squeeze(-1)


def inputs(dtype, logit_scale, head_dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 64, 2, head_dim, generator=g) for _ in range(3))
    # scores of about logit_scale^2 after the default scale
    return (q * logit_scale).to(dtype), (k * logit_scale).to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("logit_scale", [1.0, 30.0, 100.0])
def test_kernel_arithmetic_is_within_the_bounds(dtype, logit_scale):
    spec = AttentionSpec(head_dim=128, dtype=dtype)
    q, k, v = inputs(DTYPES[dtype], logit_scale)
    scale = spec.effective_scale
    out, lse = kernel_model(q, k, v, scale)
    ref, ref_lse = reference.attention_for_spec(q, k, v, spec, return_lse=True)
    assert tolerance.check_output(out, ref, q, k, v, dtype, scale) is None
    assert tolerance.check_lse(lse, ref_lse, q, k, scale) is None


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_unit_roundoff_is_half_the_machine_epsilon(dtype):
    # The bounds stand on attngen.dtypes' table: it must agree with torch's own.
    assert tolerance.UNIT_ROUNDOFF[dtype] == torch.finfo(DTYPES[dtype]).eps / 2


def test_score_term_is_negligible_at_unit_logits_and_dominant_near_1e4():
    q, k, v = inputs(torch.float16, 1.0)
    unit = tolerance.score_error(q, k, 128**-0.5).max().item()
    q, k, v = inputs(torch.float16, 100.0)
    large = tolerance.score_error(q, k, 128**-0.5).min().item()
    assert unit < 0.1 * tolerance.UNIT_ROUNDOFF["fp16"] < large


def test_score_error_follows_gqa_and_is_per_row():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 4, 64, generator=g), torch.randn(2, 7, 2, 64, generator=g)
    ds = tolerance.score_error(q, k, 0.125)
    assert ds.shape == (2, 5, 4)
    # query head 3 reads kv head 1; row (1, 2)
    expected = tolerance.U32 * 0.125 * (q[1, 2, 3].double().abs() @ k[1, :, 1].double().abs().T).max()
    assert torch.isclose(ds[1, 2, 3], expected)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_an_error_beyond_the_bound_is_reported_with_its_index(dtype):
    spec = AttentionSpec(head_dim=128, dtype=dtype)
    q, k, v = inputs(DTYPES[dtype], 1.0)
    ref = reference.attention_for_spec(q, k, v, spec)
    bound = tolerance.output_bound(ref, q, k, v, dtype, spec.effective_scale)
    out = ref.double().clone()
    out[0, 5, 1, 7] += 3 * bound[0, 5, 1, 7]
    bad = tolerance.check_output(out, ref, q, k, v, dtype, spec.effective_scale)
    assert bad is not None and bad.index == (0, 5, 1, 7)
