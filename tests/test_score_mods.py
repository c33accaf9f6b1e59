"""Score modifiers (attngen/score_mods.py) on the CPU: specs store them canonically and name them,
bad ones are refused naming score_mod=, the reference applies them before the mask, and every
family's default config compiles without spills with a modifier (and a compiled mask) at every
head dim; the user's spelling never reaches the CUDA source."""

from __future__ import annotations

import math

import pytest
import torch

from attngen import families, reference, score_mods, targets
from attngen.errors import SpecError
from attngen.spec import HEAD_DIMS, AttentionSpec


def test_specs_store_modifiers_canonically_and_name_them():
    spec = AttentionSpec(head_dim=64, mask="causal", score_mod="softcap(30)")
    assert spec.score_mod == AttentionSpec(head_dim=64, mask="causal", score_mod=" softcap( 30.0 )").score_mod
    assert spec.score_mod == "softcap(30.0)" and "softcap_30" in spec.name
    assert '"score_mod":"softcap(30.0)"' in spec.key() and AttentionSpec.from_key(spec.key()) == spec
    # A modifier that leaves scores as they are is no modifier: the same spec, the same kernel.
    assert AttentionSpec(head_dim=64, score_mod="score") == AttentionSpec(head_dim=64)
    expr = AttentionSpec(head_dim=64, score_mod="score - 0.5 * abs(q_idx - kv_idx)")
    assert expr.name.isidentifier() and score_mods.get_score_mod(expr.score_mod).slug in expr.name
    assert "score_mod" not in AttentionSpec(head_dim=64).key()  # old tuning databases keep their keys


@pytest.mark.parametrize("value, piece", [("score > 0", "float"), ("q_idx", "float"), (3, "a string"),
                                          ("score.real", "attribute")])
def test_bad_modifiers_are_refused_naming_score_mod(value, piece):
    with pytest.raises(SpecError, match="score_mod") as caught:
        AttentionSpec(head_dim=64, score_mod=value)
    assert piece in str(caught.value)


def test_the_reference_applies_the_modifier_to_scaled_scores_before_the_mask():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 33, 4, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 40, 2, 64, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(2, 40, 2, 64, generator=gen, dtype=torch.float64)
    spec = AttentionSpec(head_dim=64, gqa_ratio=2, mask="causal", score_mod="softcap(5.0)", softmax_scale=0.3)
    out, lse = reference.attention_for_spec(q, k, v, spec, return_lse=True)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = 5.0 * torch.tanh(torch.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3 / 5.0)
    visible = torch.arange(40)[None, :] <= torch.arange(33)[:, None] + 7
    scores = scores.masked_fill(~visible, -math.inf)
    assert torch.allclose(out, torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv), atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(scores, -1).float(), atol=1e-6)


@pytest.mark.parametrize("family", ["fwd_sm80", "fwd_sm90"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_default_configs_compile_without_spills_with_a_modifier(family, head_dim):
    from attngen.build import nvcc

    if nvcc.find_nvcc() is None:
        pytest.skip("nvcc not found")
    text = "softcap( 30 )"
    spec = AttentionSpec(head_dim=head_dim, dtype="fp16", mask="kv_idx%5 != 2 or causal", score_mod=text,
                         family=family)
    plan = families.plan_spec(spec, targets.target("sm_90a" if family == "fwd_sm90" else "sm_80"))
    source = families.get_family(family).render(plan)
    assert "score::modify" in source and text not in source
    report = nvcc.check_plan(plan)
    assert report.spill_bytes == 0, report
