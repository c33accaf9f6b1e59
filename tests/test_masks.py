"""Mask lowering (attngen/masks.py) on the CPU: the bounds a kernel derives from a mask's
classification are sound against the dense predicate (keys outside [kv_begin, kv_end) are hidden
from every row, keys inside [full_begin, full_end) visible to all), the closed forms of none and
causal equal the generic scan, specs canonicalise masks, and every kind of mask renders and
compiles for both families."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen import families, masks, targets
from attngen.errors import SpecError
from attngen.spec import AttentionSpec


def _dense(mask: masks.MaskLowering, Sq: int, Sk: int, b: int = 0, h: int = 0) -> torch.Tensor:
    q_idx, kv_idx = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    return torch.broadcast_to(torch.as_tensor(mask.dense_visible(q_idx, kv_idx, Sq, Sk, b=b, h=h)), (Sq, Sk))


CONJUNCTIONS = ("chunked(7) and causal", "sliding_window(5, 3) and chunked(6)", "causal and sliding_window(0, 2)",
                "chunked(4) and sliding_window(2, 9) and causal")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(masks.EXAMPLES + CONJUNCTIONS + ("sliding_window(5, 3)", "h == 1 or kv_idx < q_idx")),
       st.integers(1, 70), st.integers(1, 70), st.sampled_from((8, 16, 32)), st.integers(1, 40), st.data())
def test_bounds_are_sound_against_the_dense_mask(text, Sq, Sk, block_n, block_m, data):
    mask = masks.get_mask(text)
    b, h = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    dense = _dense(mask, Sq, Sk, b, h)
    m0 = data.draw(st.integers(0, Sq - 1))
    m1 = min(Sq, m0 + block_m)
    kv_begin, kv_end, full_begin, full_end = mask.bounds(m0, m1, Sq, Sk, block_n, b=b, h=h)
    rows = dense[m0:m1]
    hidden = torch.ones(Sk, dtype=torch.bool)
    hidden[kv_begin:kv_end] = False
    assert not rows[:, hidden].any(), f"{text}: a visible key outside [{kv_begin}, {kv_end}) for rows [{m0}, {m1})"
    assert rows[:, full_begin:min(full_end, Sk)].all(), f"{text}: a hidden key in the full range [{full_begin}, {full_end})"
    if mask.closed is None:  # the scan works in whole blocks; closed forms give exact keys
        assert kv_begin % block_n == 0 and full_begin % block_n == 0


CLOSED_FORM_MASKS = (st.sampled_from(("none", "causal"))
                     | st.builds("sliding_window({}, {})".format, st.integers(0, 300), st.integers(0, 300))
                     | st.builds("chunked({})".format, st.integers(1, 300)))


@settings(max_examples=400, deadline=None)
@given(CLOSED_FORM_MASKS, st.integers(1, 300), st.integers(1, 300), st.sampled_from((16, 64, 128)),
       st.integers(1, 128), st.data())
def test_closed_forms_agree_with_the_generic_scan_where_it_matters(text, Sq, Sk, block_n, block_m, data):
    """The kernel only uses the bounds at block granularity: the same blocks loaded, the same ones unmasked."""
    mask = masks.get_mask(text)
    assert mask.closed is not None
    m0 = data.draw(st.integers(0, Sq - 1))
    m1 = min(Sq, m0 + block_m)
    closed = mask.closed_bounds(m0, m1, Sq, Sk)
    scanned = masks.scan_bounds(lambda n0, n1: mask.program.classify(m0, m1 - 1, n0, n1 - 1, Sq, Sk), Sk, block_n)

    def blocks(bounds):
        lo, hi, full_lo, full_hi = bounds
        loaded = {n for n in range(0, Sk, block_n) if hi > lo and lo // block_n * block_n <= n < hi}
        unmasked = {n for n in loaded if n >= full_lo and n + block_n <= min(full_hi, Sk)}
        return loaded, unmasked

    assert blocks(closed) == blocks(scanned)


CLOSED_FORMS_AND_CONJUNCTIONS = CLOSED_FORM_MASKS | st.sampled_from(CONJUNCTIONS) | st.builds(
    "{} and {}".format, CLOSED_FORM_MASKS, CLOSED_FORM_MASKS)


@settings(max_examples=400, deadline=None)
@given(CLOSED_FORMS_AND_CONJUNCTIONS, st.integers(1, 300), st.integers(1, 300))
def test_closed_forms_of_one_row_are_exactly_its_visible_keys(text, Sq, Sk):
    """mask.cuh.j2 ROW_INTERVAL: a kernel masks an element of row q by [kv_begin, kv_end) of
    bounds(q, q + 1) alone, so every row's visible keys must be exactly that interval."""
    assert_rows_are_their_intervals(text, Sq, Sk)


def assert_rows_are_their_intervals(text: str, Sq: int, Sk: int, inputs: dict | None = None, b: int = 0) -> torch.Tensor:
    """Every row's visible keys are exactly [kv_begin, kv_end) of the closed form over that row (with the inputs'
    values `inputs`: ints for scalars, lists for inputs read at b) in batch row b; returns the dense mask."""
    mask = masks.get_mask(text)
    assert mask.closed is not None, text
    tensors = {name: torch.tensor(v) for name, v in (inputs or {}).items()}
    dense = torch.broadcast_to(torch.as_tensor(mask.dense_visible(torch.arange(Sq)[:, None], torch.arange(Sk)[None, :],
                                                                  Sq, Sk, b=b, inputs=tensors)), (Sq, Sk))
    keys = torch.arange(Sk)
    for q in range(Sq):
        kv_begin, kv_end, _, _ = mask.closed_bounds(q, q + 1, Sq, Sk, inputs, b)
        interval = (keys >= kv_begin) & (keys < kv_end)
        assert torch.equal(dense[q], interval), f"{text}: row {q} of ({Sq}, {Sk}) is not [{kv_begin}, {kv_end})"
    return dense


def test_only_closed_forms_mask_by_row_intervals():
    """The template's ROW_INTERVAL flag follows the closed form: a mask without one keeps its predicate."""
    target = targets.target("sm_90a")
    family = families.get_family("fwd_sm90")
    for text, expected in (("causal", "true"), ("sliding_window(64, 0) and causal", "true"),
                           ("none", "true"), ("kv_idx % 3 != 1 or q_idx == kv_idx", "false")):
        problem = AttentionSpec(head_dim=64, mask=text).problem
        source = family.render(family.plan(problem, target, family.default_config(problem, target)))
        assert f"constexpr bool ROW_INTERVAL = {expected};" in source, text


def test_conjunctions_of_built_ins_are_stored_sorted_with_closed_forms():
    a, b = masks.get_mask("chunked(8192) and causal"), masks.get_mask("causal  and chunked( 8192 )")
    assert a.text == b.text == "causal and chunked(8192)" and a.slug == b.slug and a.closed is not None
    assert masks.get_mask("causal and causal").text == "causal"
    assert masks.get_mask("chunked(64) and kv_idx > 3").closed is None  # not built-ins alone: scanned


def test_specs_store_the_canonical_mask_and_name_it_by_slug():
    spec = AttentionSpec(head_dim=64, mask="sliding_window( 128,0 )")
    assert spec.mask == AttentionSpec(head_dim=64, mask="sliding_window(128, 0)").mask
    assert AttentionSpec(head_dim=64, mask="causal").mask == "causal"
    expr = AttentionSpec(head_dim=64, mask="kv_idx <= q_idx and q_idx - kv_idx < 4096")
    assert expr.name.isidentifier() and masks.get_mask(expr.mask).slug in expr.name


@pytest.mark.parametrize("text, piece", [("q_idx.real", "real"), ("foo(q_idx)", "foo"), ("q_idx // kv_idx == 0", "//"),
                                         ("score > 0", "score"), ("1 + 2", "")])
def test_bad_masks_are_refused_naming_the_mask_and_what_is_allowed(text, piece):
    with pytest.raises(SpecError, match="mask") as caught:
        AttentionSpec(head_dim=64, mask=text)
    assert "allowed" in str(caught.value) and piece in str(caught.value)


@pytest.mark.parametrize("family", ["fwd_sm80", "fwd_sm90"])
@pytest.mark.parametrize("text", ["sliding_window( 128,0 )", "kv_idx%3 != 1 or (q_idx == kv_idx and h == 0)"])
def test_compiled_masks_render_and_compile_for_every_family(family, text):
    from attngen.build import nvcc

    if nvcc.find_nvcc() is None:
        pytest.skip("nvcc not found")
    spec = AttentionSpec(head_dim=128, mask=text, family=family)
    plan = families.plan_spec(spec, targets.target("sm_90a" if family == "fwd_sm90" else "sm_80"))
    source = families.get_family(family).render(plan)
    # Lowered from the IR, never pasted: the user's spelling appears nowhere (comments print the IR).
    # A single window has closed-form bounds; anything else scans with the emitted classifier.
    assert ("classify(" in source) == (masks.get_mask(spec.mask).closed is None) and text not in source
    report = nvcc.check_plan(plan)
    assert report.spill_bytes == 0, report


@pytest.mark.parametrize("text, shaped", [
    ("causal", True), ("q_idx >= kv_idx", True), ("not (kv_idx > q_idx)", True), ("kv_idx < q_idx", True),
    ("q_idx >= kv_idx and q_idx - kv_idx < 10000000", True), ("prefix_lm(16)", True),
    ("none", False), ("sliding_window(100, 0)", False), ("kv_idx <= q_idx + 1", False),
    ("q_idx >= kv_idx and q_idx - kv_idx < 4096", False),  # a window at 16k: shorter tiles
    ("h == 1 or kv_idx <= q_idx", False),  # another shape on head 1
    ("kv_idx % 3 != 1 or q_idx == kv_idx", False), ("doc[q_idx] == doc[kv_idx] and kv_idx <= q_idx", False),
])
def test_causal_shaped_masks_are_those_with_causal_tiles(text, shaped):
    assert masks.causal_shaped(masks.canonical(text)) is shaped


def test_a_causal_shaped_expression_takes_causal_schedule_on_fwd_sm90():
    """A band of causal's shape (`q_idx >= kv_idx`, prefix_lm(16): masked as causal is) takes causal's whole config;
    any other causal-shaped mask (a `%` in an `or`: a predicate per element) keeps the expression defaults' tile
    and stages (register budget), with causal's schedule."""
    target = targets.target("sm_90a")
    family = families.get_family("fwd_sm90")
    for head_dim, gqa in ((64, 1), (128, 1), (128, 4), (256, 1)):
        def config(mask):
            problem = AttentionSpec(head_dim=head_dim, gqa_ratio=gqa, mask=mask).problem
            return family.default_config(problem, target)
        band, prefix, shaped, window, causal = (
            config(m) for m in ("q_idx >= kv_idx", "prefix_lm(16)", "kv_idx <= q_idx or kv_idx < 16 and kv_idx % 2 == 0",
                                "sliding_window(100, 0)", "causal"))
        assert masks.causal_shaped(masks.canonical("kv_idx <= q_idx or kv_idx < 16 and kv_idx % 2 == 0"))
        assert band == prefix == causal
        assert shaped.schedule == causal.schedule
        expressions = config("kv_idx % 3 != 1")  # no closed form, not causal-shaped
        assert dataclasses.replace(shaped, schedule=expressions.schedule) == expressions
        # a window has a closed form: causal's config where that is on the counter (d64), else the expressions'
        assert window == (causal if causal.schedule == "dynamic" else expressions)


def test_masks_that_read_inputs_read_them_without_a_branch_per_element(tmp_path):
    """A partial block of the document-ids mask reads doc at its rows and keys: once per row and key, in
    one round, keys passed between lanes (mask.cuh.j2 KEYED), so fwd_sm90's kernel has fewer loads than
    a thread has scores in a block (29 against 64). Behind a branch per element each load waited for
    the one before (395 of them; the documents ran 1.9x slower on the H200: docs/perf-notes.md "Masks
    that read inputs, without a branch")."""
    from attngen.build import nvcc

    if not nvcc.nvcc_available() or nvcc.find_cuobjdump() is None:
        pytest.skip("nvcc and cuobjdump are needed")
    spec = AttentionSpec(head_dim=128, mask="doc[b, q_idx] == doc[b, kv_idx] and causal", family="fwd_sm90")
    plan = families.plan_spec(spec, targets.target("sm_90a"))
    cubin = tmp_path / "k.cubin"
    report = nvcc.check_plan(plan, keep_cubin=cubin)
    assert report.spill_bytes == 0, report.log
    sass = [f for f in nvcc.sass(cubin).split("Function : ") if f.startswith(plan.kernels[0].symbol + "\n")][0]
    scores = plan.block_n // 2  # a consumer thread's share of a 64-row warpgroup's block
    assert sass.count("LDG") < scores, f"{plan.name}: {sass.count('LDG')} global loads for {scores} scores a thread"
