"""The fuzzer's regimes beyond two lengths (CPU): packed documents (varlen specs and the document
mask attention_varlen lowers to), position offsets, FlexAttention block states and lengths at a
mask's constants. Cases are valid and reach their edge cases, inputs are drawn by what they are,
the reference passes its own harness, and runners broken in each regime's way are caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings

from attngen import block_sparse, targets, varlen
from attngen.families import plan_spec
from attngen.fuzz.case import FuzzCase, host_runtime_inputs, input_digest, input_shapes, is_packed
from attngen.fuzz.check import run_case
from attngen.fuzz.pool import PROBLEMS
from attngen.fuzz.runners import ReferenceRunner
from attngen.fuzz.search import search
from attngen.fuzz.strategies import DEFAULT_LIMITS, first_cases, fuzz_cases, mask_constants
from attngen.spec import AttentionSpec

TARGET = targets.target(targets.DEFAULT_ARCH)  # the ReferenceRunner's: fwd_sm90 runs varlen specs there
LIMITS = dataclasses.replace(DEFAULT_LIMITS.up_to(300), max_score_elements=2**20, max_input_elements=2**21,
                             max_small_documents=60)
VARLEN = AttentionSpec(head_dim=64, dtype="bf16", gqa_ratio=2, mask="causal", varlen=True)
DOCUMENT_MASK = AttentionSpec(head_dim=64, dtype="fp16", **dict(zip(("mask", "score_mod"),
                                                                    varlen.lowered("causal", "alibi", None)[:2])))
OFFSETS = AttentionSpec(head_dim=64, dtype="bf16", mask="kv_idx + kv_offset <= q_idx + q_offset")
BLOCKS = AttentionSpec(head_dim=64, dtype="bf16", mask=block_sparse.lowered("causal", 64, 64, True, False))
WINDOW = AttentionSpec(head_dim=64, dtype="bf16", mask="sliding_window(100, 0)")
# Found, not shrunk: shrinking a case of many documents to the smallest that still has them is slow.
SEARCH = settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate])


def _draw_each(spec, check, examples=150):
    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=fuzz_cases([spec], LIMITS, TARGET))
    def draw(case):
        check(case)

    draw()


# -- packed documents ---------------------------------------------------------------
@pytest.mark.parametrize("spec", [VARLEN, DOCUMENT_MASK], ids=["varlen", "document-mask"])
def test_packed_cases_are_one_batch_row_of_documents_within_the_limits(spec):
    assert is_packed(spec)

    def check(case):
        assert case.batch == 1 and case.documents
        cu_q, cu_k = case.cu_seqlens
        assert cu_q[-1] <= case.seq_q <= LIMITS.max_seq + _tile(spec).block_m + 1
        assert cu_k[-1] <= case.seq_k <= LIMITS.max_seq + _tile(spec).block_m + 1
        assert len(case.documents) <= max(LIMITS.max_documents, LIMITS.max_small_documents)

    _draw_each(spec, check)


def _tile(spec):
    return plan_spec(spec, TARGET)


PACKED_EDGES = {
    "an empty document": lambda c: (0, 0) in c.documents,
    "rows of a document without keys": lambda c: any(q > 0 and k == 0 for q, k in c.documents),
    "keys of a document without rows": lambda c: any(q == 0 and k > 0 for q, k in c.documents),
    "a document of one token": lambda c: (1, 1) in c.documents,
    "more rows than keys in a document": lambda c: any(q > k > 0 for q, k in c.documents),
    "a document longer than a tile": lambda c: any(q > _tile(c.spec).block_m for q, _ in c.documents),
    "a document ending one past a tile multiple": lambda c: any(
        q > _tile(c.spec).block_m and q % _tile(c.spec).block_m == 1 for q, _ in c.documents),
    "rows and keys past the last document": lambda c: c.seq_q > c.cu_seqlens[0][-1] and c.seq_k > c.cu_seqlens[1][-1],
    "many documents": lambda c: len(c.documents) >= 50,
    "several kv heads": lambda c: c.heads_kv > 1,
}


@pytest.mark.parametrize("name", sorted(PACKED_EDGES))
def test_the_documents_regimes_reach_each_edge_case(name):
    find(fuzz_cases([VARLEN], LIMITS, TARGET), PACKED_EDGES[name], settings=SEARCH)


def test_packed_inputs_are_the_documents_boundaries_and_attention_varlens_own_arrays():
    documents = ((5, 3), (0, 0), (2, 0), (1, 1))
    case = FuzzCase(VARLEN, batch=1, seq_q=10, seq_k=6, heads_kv=1, documents=documents)
    assert case.cu_seqlens == ([0, 5, 5, 7, 8], [0, 3, 3, 3, 4])
    drawn = host_runtime_inputs(case)
    assert drawn.keys() == {"cu_seqlens_q", "cu_seqlens_k"}
    assert drawn["cu_seqlens_q"].tolist() == [0, 5, 5, 7, 8] and drawn["cu_seqlens_q"].dtype == torch.int32
    assert drawn["cu_seqlens_k"].tolist() == [0, 3, 3, 3, 4]
    lowered = FuzzCase(DOCUMENT_MASK, batch=1, seq_q=10, seq_k=6, heads_kv=1, documents=documents)
    arrays = host_runtime_inputs(lowered)
    want = varlen.varlen_inputs(DOCUMENT_MASK.mask, DOCUMENT_MASK.score_mod, None, torch.empty(10), torch.empty(6),
                                *(torch.tensor(cu, dtype=torch.int32) for cu in case.cu_seqlens))
    assert set(want) < set(arrays) and all(torch.equal(arrays[name], want[name]) for name in want)
    assert input_shapes(lowered)["varlen_qdoc"] == (10,) and input_shapes(lowered)["varlen_kdoc"] == (6,)
    assert arrays["varlen_qdoc"].tolist() == [0] * 5 + [2, 2, 3, -1, -1]  # rows past the end: no document
    # The documents are part of the data: another split of the same tokens is another input.
    other = dataclasses.replace(case, documents=((4, 3), (0, 0), (3, 0), (1, 1)))
    assert input_digest(other) != input_digest(case)


@pytest.mark.parametrize("change, match", [
    (dict(documents=()), r"documents=\(\) is invalid; allowed: a non-empty tuple of \(query rows, keys\)"),
    (dict(documents=((1, -1),)), r"documents=\(\(1, -1\),\) is invalid"),
    (dict(documents=((1, 2, 3),)), r"documents=\(\(1, 2, 3\),\) is invalid"),
    (dict(batch=2), r"batch=2 is invalid for packed documents; allowed: 1"),
    (dict(seq_q=2), r"seq_q=2 is invalid: the documents pack 3; allowed: at least that"),
    (dict(seq_k=1), r"seq_k=1 is invalid: the documents pack 2; allowed: at least that"),
])
def test_packed_case_fields_are_validated_by_name(change, match):
    fields = {**dict(spec=VARLEN, batch=1, seq_q=4, seq_k=4, heads_kv=1, documents=((3, 2),)), **change}
    with pytest.raises(ValueError, match=match):
        FuzzCase(**fields)


def test_documents_are_refused_for_a_spec_that_reads_no_boundaries():
    with pytest.raises(ValueError, match=r"documents=\(\(1, 1\),\) is invalid for a spec whose kernels read no "
                                         r"sequence boundaries; allowed: \(\)"):
        FuzzCase(OFFSETS, batch=1, seq_q=1, seq_k=1, heads_kv=1, documents=((1, 1),))


def test_first_cases_of_a_packed_spec_hold_its_edge_documents():
    (case,) = first_cases([VARLEN], LIMITS, TARGET)
    plan = _tile(VARLEN)
    assert case.documents == ((plan.block_m + 1, plan.block_n + 1), (0, 0), (3, 0), (1, 1))
    assert case.seq_q > case.cu_seqlens[0][-1]


# -- runtime inputs by what they are --------------------------------------------------
def _many(spec, seeds=range(60), **shape):
    fields = {**dict(batch=2, seq_q=200, seq_k=150, heads_kv=2), **shape}
    return [host_runtime_inputs(FuzzCase(spec, data_seed=seed, **fields)) for seed in seeds]


def test_offsets_are_zero_or_shift_rows_out_of_sight_and_back():
    values = [(int(d["q_offset"]), int(d["kv_offset"])) for d in _many(OFFSETS)]
    assert all(-200 <= v <= 400 for pair in values for v in pair)
    assert any(0 in pair for pair in values) and any(min(pair) < 0 for pair in values)
    assert any(q - k > 150 for q, k in values) and any(k - q > 200 for q, k in values)  # all visible, none visible


def test_block_states_hold_hidden_partial_and_full_blocks_in_varying_proportions():
    states = [d[block_sparse.STATE] for d in _many(BLOCKS)]
    assert all(s.shape == (2, 1, 4, 3) and s.dtype == torch.int32 for s in states)
    assert set(torch.cat([s.flatten() for s in states]).tolist()) == {0, 1, 2}
    assert len({int((s == 0).sum()) for s in states}) > 3


def test_document_ids_run_from_one_document_to_many_short_ones():
    spec = AttentionSpec(head_dim=64, mask="doc[b, q_idx] == doc[b, kv_idx]")
    ids = [d["doc"] for d in _many(spec, seq_q=400, seq_k=400)]
    assert all((t.diff(dim=-1) >= 0).all() for t in ids)
    counts = [int(t[0, -1]) - int(t[0, 0]) for t in ids]
    assert min(counts) <= 2 and max(counts) >= 100
    assert any((t.diff(dim=-1) == 2).any() for t in ids)  # an id skipped: an empty document


def test_lengths_are_drawn_at_the_masks_constants():
    assert mask_constants(WINDOW, 300) == (100,)
    assert mask_constants(AttentionSpec(head_dim=64, mask="chunked(8192) and causal"), 4200) == ()
    plan = _tile(WINDOW)
    near = {99, 100, 101, 99 + plan.block_m, 100 + plan.block_m, 101 + plan.block_m}
    find(fuzz_cases([WINDOW], LIMITS, TARGET), lambda c: c.seq_q in near and c.seq_k in near, settings=SEARCH)


# -- the reference passes, broken runners are caught -----------------------------------
REGIME_SPECS = (VARLEN, DOCUMENT_MASK, OFFSETS, BLOCKS, WINDOW)


def test_the_reference_passes_every_regime():
    outcome = search(REGIME_SPECS, ReferenceRunner(), examples=150, seed=1, limits=LIMITS)
    assert outcome.failure is None, outcome.failure.describe()
    assert outcome.harness_error is None, outcome.harness_error.describe()


def test_the_pools_packed_problems_plan_with_their_documents():
    packed = [p for p in PROBLEMS if is_packed(AttentionSpec(**dataclasses.asdict(p)))]
    assert len(packed) >= 5
    for problem in packed:
        for case in first_cases([AttentionSpec(**dataclasses.asdict(problem))], LIMITS, TARGET):
            assert run_case(case, ReferenceRunner()).ok


class _Broken(ReferenceRunner):
    """The reference with its inputs (or spec) changed the way a broken kernel would read them."""

    def change(self, spec, inputs):
        return spec, inputs

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None, inputs=None):
        spec, inputs = self.change(spec, dict(inputs or {}))
        super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale, inputs=inputs)


class SequencesSeeEachOther(_Broken):
    def change(self, spec, inputs):  # the mask over the whole packed row, ignoring the boundaries
        return spec.replace(varlen=False), {n: t for n, t in inputs.items() if n not in varlen.CU_SEQLENS}


class OneDocument(_Broken):
    def change(self, spec, inputs):
        return spec, {**inputs, "varlen_kdoc": torch.zeros_like(inputs["varlen_kdoc"]).clamp_(min=0),
                      "varlen_qdoc": torch.zeros_like(inputs["varlen_qdoc"])}


class OffsetsIgnored(_Broken):
    def change(self, spec, inputs):
        return spec, {**inputs, "kv_offset": torch.zeros_like(inputs["kv_offset"])}


class PartialBlocksAsFull(_Broken):
    def change(self, spec, inputs):
        state = inputs[block_sparse.STATE]
        return spec, {**inputs, block_sparse.STATE: torch.where(state == 1, 2, state).to(state.dtype)}


@pytest.mark.parametrize("spec, runner", [(VARLEN, SequencesSeeEachOther), (DOCUMENT_MASK, OneDocument),
                                          (OFFSETS, OffsetsIgnored), (BLOCKS, PartialBlocksAsFull)],
                         ids=["varlen", "document-mask", "offsets", "block-states"])
def test_a_runner_broken_in_the_regimes_way_is_caught_and_shrunk(spec, runner):
    outcome = search([spec], runner(), examples=300, seed=0, limits=LIMITS)
    assert outcome.failure is not None, f"{runner.__name__} passed {outcome.cases} cases"
    assert outcome.failure.kind in ("output", "lse") and outcome.shrunk
    assert not run_case(outcome.failure.case, runner()).ok and run_case(outcome.failure.case, ReferenceRunner()).ok
    if spec is VARLEN:  # the smallest: one row outside every sequence (there are none) shown a key
        case = outcome.failure.case
        assert (case.documents, case.seq_q, case.seq_k) == (((0, 0),), 1, 1), case.label()
