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


EXPRESSIONS = [  # (mask, score_mod, sink): the heaviest per-score work the default tiles must hold
    ("kv_idx%5 != 2 or causal", "softcap( 30 )", None),
    ("doc[b, q_idx] == doc[b, kv_idx] and causal", "alibi", None),
    ("sliding_window(127, 0)", None, "sinks[h]"),
]


@pytest.mark.parametrize("family", ["fwd_sm80", "fwd_sm90"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mask, score_mod, sink", EXPRESSIONS, ids=["softcap", "documents_alibi", "window_sink"])
def test_default_configs_compile_without_spills_with_expressions(family, head_dim, mask, score_mod, sink):
    from attngen.build import nvcc

    if nvcc.find_nvcc() is None:
        pytest.skip("nvcc not found")
    spec = AttentionSpec(head_dim=head_dim, dtype="fp16", mask=mask, score_mod=score_mod, sink=sink, family=family)
    plan = families.plan_spec(spec, targets.target("sm_90a" if family == "fwd_sm90" else "sm_80"))
    source = families.get_family(family).render(plan)
    assert "score::modify" in source and "softcap( 30 )" not in source  # printed from the IR, never pasted
    report = nvcc.check_plan(plan)
    assert report.spill_bytes == 0, report


def test_sinks_join_the_denominator_only():
    gen = torch.Generator().manual_seed(2)
    B, Sq, Sk, H = 2, 20, 12, 4
    q = torch.randn(B, Sq, H, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, Sk, H, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    spec = AttentionSpec(head_dim=64, mask="causal", sink="sinks[h]")
    out, lse = reference.attention_for_spec(q, k, v, spec, return_lse=True, inputs={"sinks": sinks})
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8
    visible = torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq)  # rows 0..7 see no key
    scores = scores.masked_fill(~visible, -math.inf)
    extended = torch.cat([scores, sinks.double()[None, :, None, None].expand(B, H, Sq, 1)], -1)
    weights = extended.softmax(-1)[..., :-1]
    assert torch.allclose(out, torch.einsum("bhqk,bkhd->bqhd", weights, v), atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(extended, -1).float())
    assert torch.equal(out[:, :8], torch.zeros_like(out[:, :8]))  # no key: output 0, LSE the sink
    assert torch.allclose(lse[:, :, :8], sinks[None, :, None].expand(B, H, 8))


@pytest.mark.parametrize("value, piece", [("score + 1.0", "['score']"), ("kv_idx * 1.0", "['kv_idx']"),
                                          (2, "a string")])
def test_bad_sinks_are_refused_naming_sink(value, piece):
    with pytest.raises(SpecError, match="sink=") as caught:
        AttentionSpec(head_dim=64, sink=value)
    assert piece in str(caught.value)


@pytest.mark.parametrize("family", ["fwd_sm80", "fwd_sm90"])
def test_kernels_with_a_sink_render_and_compile(family):
    from attngen.build import nvcc

    spec = AttentionSpec(head_dim=128, mask="causal", sink="sinks[h]", family=family)
    assert "sink" in spec.name and spec.key().endswith('"sink":"sinks[h]"}')
    plan = families.plan_spec(spec, targets.target("sm_90a" if family == "fwd_sm90" else "sm_80"))
    assert [p.name for p in plan.kernels[0].abi.params][-2:] == ["in_sinks", "in_sinks_s0"]
    source = families.get_family(family).render(plan)
    assert "HAS_SINK = true" in source and "p.in_sinks[" in source
    if nvcc.find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert nvcc.check_plan(plan).spill_bytes == 0
