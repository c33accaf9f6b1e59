"""The fuzzer's strategies and cases (CPU): valid, bounded, deterministic, and reaching every edge case."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from attngen import targets
from attngen.families import plan_spec
from attngen.fuzz.case import (GUARD_ROWS, LAYOUTS, PAD, FuzzCase, buffer_elements, host_inputs, input_digest,
                               make_inputs, make_outputs)
from attngen.fuzz import strategies
from attngen.fuzz.strategies import DEFAULT_LIMITS, LOGIT_SCALES, fuzz_cases
from attngen.masks import get_mask
from attngen.spec import AttentionSpec

# Small tiles, so lengths around several tile multiples fit in the short lengths drawn here.
SPECS = (
    AttentionSpec(head_dim=64, dtype="fp16", family="fwd_sm80",
                  config=dict(block_m=32, block_n=16, num_warps=2, num_stages=2)),
    AttentionSpec(head_dim=64, dtype="bf16", mask="causal", gqa_ratio=4, family="fwd_sm80",
                  config=dict(block_m=16, block_n=32, num_warps=1, num_stages=2)),
)
LIMITS = DEFAULT_LIMITS.up_to(200)
CASES = fuzz_cases(SPECS, LIMITS)
SEARCH = settings(max_examples=3000, database=None, suppress_health_check=list(HealthCheck))


@settings(max_examples=300, database=None, deadline=None)
@given(case=CASES)
def test_cases_are_valid_and_within_the_limits(case):
    assert case.spec in SPECS
    assert case.heads_q == case.heads_kv * case.spec.gqa_ratio
    assert 1 <= case.seq_q <= LIMITS.max_seq and 1 <= case.seq_k <= max(LIMITS.max_seq, LIMITS.max_long_seq_k)
    assert case.batch <= LIMITS.max_batch
    # Budgets hold unless even one batch and one kv head exceed them; the input budget counts the
    # poisoned buffers the case allocates (guards and padding included).
    if case.batch * case.heads_kv > 1:
        assert case.score_elements <= LIMITS.max_score_elements
        longest = max(case.q_shape, case.kv_shape, key=lambda shape: shape[1])
        assert buffer_elements(longest, case.layout) <= LIMITS.max_input_elements


def _tile(case):
    """The tiles the cases' lengths are drawn around: the plan's on the default target (fuzz_cases' default)."""
    return plan_spec(case.spec, targets.target(targets.DEFAULT_ARCH))


def _fully_masked_rows(case):
    q_idx = torch.arange(case.seq_q)[:, None]
    k_idx = torch.arange(case.seq_k)[None, :]
    visible = torch.as_tensor(get_mask(case.spec.mask).dense_visible(q_idx, k_idx, case.seq_q, case.seq_k))
    return not torch.broadcast_to(visible, (case.seq_q, case.seq_k)).any(dim=1).all()


# The list of inputs the fuzzer must generate deliberately; each is found within the search.
EDGE_CASES = {
    "seqlen 1": lambda c: c.seq_q == 1 and c.seq_k == 1,
    "single query against long keys": lambda c: c.seq_q == 1 and c.seq_k > LIMITS.max_seq,
    "Sk < Sq": lambda c: c.seq_k < c.seq_q,
    "query length one past a tile multiple": lambda c: c.seq_q > _tile(c).block_m and c.seq_q % _tile(c).block_m == 1,
    "key length one short of a tile multiple": lambda c: c.seq_k > _tile(c).block_n
    and c.seq_k % _tile(c).block_n == _tile(c).block_n - 1,
    "key length an exact tile multiple": lambda c: c.seq_k > _tile(c).block_n and c.seq_k % _tile(c).block_n == 0,
    "fully masked rows": _fully_masked_rows,
    "logits near +-1e4": lambda c: c.logit_scale**2 >= 1e4,
    "large head count, batch 1": lambda c: c.batch == 1 and c.heads_q >= LIMITS.max_heads_q_wide // 2,
    "transposed (BHSD) inputs": lambda c: c.layout == "transposed",
    "padded strided inputs": lambda c: c.layout == "padded",
    "explicit softmax_scale": lambda c: c.softmax_scale is not None,
    "GQA with several kv heads and batches": lambda c: c.spec.gqa_ratio > 1 and c.heads_kv > 1 and c.batch > 1,
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_strategy_generates_each_edge_case(name):
    find(CASES, EDGE_CASES[name], settings=SEARCH)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_largest_logit_scale_gives_scores_near_1e4(head_dim):
    # The scores the kernel sees (q.k * scale, scale = 1/sqrt(D)), from the data the case draws.
    case = FuzzCase(AttentionSpec(head_dim=head_dim, dtype="bf16"), batch=1, seq_q=64, seq_k=64, heads_kv=2,
                    logit_scale=max(LOGIT_SCALES), data_seed=5)
    q, k, _ = host_inputs(case)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * case.scale
    assert 5e3 <= scores.std() <= 2e4 and scores.abs().max() >= 1e4


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_tile_edges_follow_the_plan_on_the_runners_target(arch, monkeypatch):
    # d128's default tiles differ between these targets (m128n32 on 99 KB of shared memory, m128n64 on
    # 227 KB): the near-multiple lengths must be those of the plan the runner's target gets.
    spec = AttentionSpec(head_dim=128, dtype="bf16", family="fwd_sm80")
    target = targets.target(arch)
    plan = plan_spec(spec, target)
    assert plan_spec(spec, targets.target("sm_86")).block_n != plan_spec(spec, targets.target("sm_90")).block_n
    blocks = set()
    real = strategies.near_multiples
    monkeypatch.setattr(strategies, "near_multiples", lambda block, max_len: blocks.add(block) or real(block, max_len))

    @settings(max_examples=100, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=fuzz_cases([spec], LIMITS, target))
    def draw(case):
        pass

    draw()
    assert blocks == {plan.block_m, plan.block_n}


def test_fuzz_cases_needs_a_spec():
    with pytest.raises(ValueError, match=r"specs=\(\) is invalid; allowed: at least one"):
        fuzz_cases([])


# -- cases and their inputs ---------------------------------------------------------
CASE = FuzzCase(SPECS[1], batch=2, seq_q=5, seq_k=7, heads_kv=2, data_seed=11, logit_scale=4.0)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(batch=0), r"batch=0 is invalid; allowed: an integer >= 1"),
        (dict(seq_k=True), r"seq_k=True is invalid"),
        (dict(layout="bshd"), r"layout='bshd' is invalid; allowed: contiguous, transposed, padded"),
        (dict(logit_scale=float("inf")), r"logit_scale=inf is invalid; allowed: a finite float > 0"),
        (dict(softmax_scale=-1.0), r"softmax_scale=-1.0 is invalid"),
        (dict(data_seed=-1), r"data_seed=-1 is invalid; allowed: an integer in \[0, 2\*\*63 - 1\]"),
    ],
)
def test_case_fields_are_validated_by_name(change, match):
    fields = {**dict(spec=CASE.spec, batch=1, seq_q=1, seq_k=1, heads_kv=1), **change}
    with pytest.raises(ValueError, match=match):
        FuzzCase(**fields)


def test_softmax_scale_only_when_the_spec_sets_none():
    with pytest.raises(ValueError, match="when the spec sets no softmax_scale"):
        FuzzCase(SPECS[0].replace(softmax_scale=0.25), 1, 1, 1, 1, softmax_scale=0.5)


def test_inputs_are_a_function_of_the_seed_and_independent_of_layout():
    reference = host_inputs(CASE)
    assert all(torch.equal(a, b) for a, b in zip(reference, host_inputs(CASE)))
    assert not torch.equal(reference[0], host_inputs(replace(CASE, data_seed=12))[0])
    for layout in LAYOUTS:
        case = replace(CASE, layout=layout)
        placed = make_inputs(case, "cpu")
        for p, values in zip(placed, reference):
            assert torch.equal(p.view, values)
            assert p.view.dtype == torch.bfloat16 and p.view.stride(-1) == 1
        assert input_digest(case) == input_digest(CASE)
    assert reference[0].float().std() > 3 * reference[2].float().std()  # logit_scale applies to q and k only


def test_layouts_have_the_strides_they_promise():
    B, S, H, D = CASE.q_shape
    views = {layout: make_outputs(replace(CASE, layout=layout), "cpu")[0].view for layout in LAYOUTS}
    assert views["contiguous"].is_contiguous()
    assert views["transposed"].stride() == (H * S * D, D, S * D, 1)
    assert views["padded"].stride() == ((S + GUARD_ROWS) * H * (D + PAD), H * (D + PAD), D + PAD, 1)
    for view in views.values():
        assert all(s % 8 == 0 for s in view.stride()[:3]), "rows must stay 16-byte aligned"


def test_outputs_start_poisoned_and_writes_outside_are_found():
    for layout in LAYOUTS:
        out, lse = make_outputs(replace(CASE, layout=layout), "cpu")
        assert torch.isnan(out.view).all() and torch.isnan(lse.view).all()
        assert lse.view.is_contiguous() and lse.view.shape == CASE.lse_shape
        out.view.zero_()
        lse.view.zero_()
        assert out.written_outside() is None and lse.written_outside() is None
        out.buffer[-1] = 0  # the last element of the buffer lies outside every view
        assert "after the tensor's last element" in out.written_outside()
        out.buffer[-1], out.buffer[0] = float("nan"), 0
        assert "before the tensor's first element" in out.written_outside()
    assert PAD % 8 == 0


def _offsets(view, b, rows, h, cols):
    """Buffer offsets of view[b, rows, h, cols] as a kernel computes them from the strides, rows and
    columns taken past the tensor's ends (b, h: int or a range)."""
    sB, sS, sH, sD = view.stride()
    idx = [torch.as_tensor(list(x) if isinstance(x, range) else [x]) for x in (b, rows, h, cols)]
    b_, r_, h_, c_ = torch.meshgrid(*idx, indexing="ij")
    return (view.storage_offset() + b_ * sB + r_ * sS + h_ * sH + c_ * sD).flatten()


def _all_nan_in_buffer(p, offsets):
    inside = (offsets >= 0) & (offsets < p.buffer.numel())
    return bool(inside.all()) and bool(torch.isnan(p.buffer[offsets]).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_whole_tile_read_past_the_ends_lands_in_nan(layout):
    case = replace(CASE, layout=layout, batch=3, heads_kv=2)
    B, S, H, D = case.kv_shape
    after, before = range(S, S + GUARD_ROWS), range(-GUARD_ROWS, 0)
    for p in make_inputs(case, "cpu")[1:]:  # k and v, each (B, S, H, D)
        # Every layout: GUARD_ROWS rows past the end of the last sequence in storage order, and before the first.
        last = (B - 1, H - 1) if layout == "transposed" else (B - 1, range(H))
        first = (0, 0) if layout == "transposed" else (0, range(H))
        assert _all_nan_in_buffer(p, _offsets(p.view, last[0], after, last[1], range(D)))
        assert _all_nan_in_buffer(p, _offsets(p.view, first[0], before, first[1], range(D)))
        if layout == "padded":  # and past the end and start of every sequence, and past every row's D
            assert _all_nan_in_buffer(p, _offsets(p.view, range(B), after, range(H), range(D)))
            assert _all_nan_in_buffer(p, _offsets(p.view, range(B), before, range(H), range(D)))
            assert _all_nan_in_buffer(p, _offsets(p.view, range(B), range(S), range(H), range(D, D + PAD)))
    lse = make_outputs(case, "cpu")[1]  # (B, H, S), one element per row
    first, last = lse.view.storage_offset(), lse.view.storage_offset() + lse.view.numel() - 1
    assert _all_nan_in_buffer(lse, torch.arange(first - GUARD_ROWS, first))
    assert _all_nan_in_buffer(lse, torch.arange(last + 1, last + 1 + GUARD_ROWS))


def test_guards_keep_rows_aligned():
    from attngen.spec import HEAD_DIMS

    # tests/test_fuzz_pool.py checks GUARD_ROWS against every family's tiles.
    assert all(d % 8 == 0 for d in HEAD_DIMS) and PAD % 8 == 0  # 16-byte aligned rows and guards


def test_limits_up_to_a_shorter_length():
    limits = DEFAULT_LIMITS.up_to(100)
    assert (limits.max_seq, limits.max_long_seq_k, limits.max_batch) == (100, 400, DEFAULT_LIMITS.max_batch)
    assert DEFAULT_LIMITS.up_to(10**6).max_long_seq_k == DEFAULT_LIMITS.max_long_seq_k
    with pytest.raises(ValueError, match=r"max_seq=1 is invalid; allowed: an integer >= 2"):
        DEFAULT_LIMITS.up_to(1)
