"""The paged decode regime on the CPU (attngen/fuzz/paged.py): the caches it builds hold real values
exactly where a decode may read and NaN everywhere else, the page-table entries past each sequence's
pages lead nowhere valid, and the check passes the reference while catching decodes that read past a
length, follow an entry past a sequence's pages or drop a last partial page."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from attngen import reference, targets
from attngen.fuzz.paged import DecodeCase, DecodeLimits, check_decode_case, decode_cases, decode_specs, make_decode_inputs
from attngen.spec import AttentionSpec

SPECS = decode_specs(targets.target("sm_90a"))
SMALL = DecodeLimits(max_batch=3, max_length=700, cache_elements=1 << 16, max_splits=8)
CASE = DecodeCase(AttentionSpec(head_dim=64, gqa_ratio=2, mask="causal"), lengths=(37, 0, 64, 5), seq_q=3, heads_kv=2,
                  page_size=16, extra_pages=2, shared_pages=2, spare_pages=2, num_splits=3, data_seed=5)


def _reference_decode(q, k_cache, v_cache, cache_seqlens, *, page_table, spec, num_splits, inputs, return_lse,
                      lengths_of=lambda lens: lens):
    """attngen.decode's answer from the float64 reference, in q's dtype (a stand-in kernel; with
    `lengths_of` a broken one, whose wild page ids are clamped into the cache rather than crash)."""
    table = None if page_table is None else page_table.clamp(0, k_cache.shape[0] - 1)
    out, lse = reference.decode_attention(q, k_cache, v_cache, lengths_of(cache_seqlens), spec, page_table=table,
                                          inputs=inputs)
    return out.to(q.dtype), lse.float()


def test_the_pool_is_the_decode_family_problems_without_packed_sequences():
    assert len(SPECS) >= 20 and all(not s.varlen and s.family in (None, "decode_sm80") for s in SPECS)
    assert {"causal", "none"} <= {s.mask for s in SPECS} and any(s.sink for s in SPECS)
    assert any("block_mask_state" in s.mask for s in SPECS) and any(s.score_mod for s in SPECS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(decode_cases(SPECS, SMALL))
def test_caches_hold_values_where_a_decode_reads_and_nan_elsewhere(case):
    x = make_decode_inputs(case)
    assert x.q.shape == (case.batch, case.seq_q, case.heads_q, case.spec.head_dim)
    assert x.cache_seqlens.tolist() == list(case.lengths) and x.cache_seqlens.dtype == torch.int32
    read = torch.zeros(x.k_cache.shape[:2], dtype=torch.bool)  # (pages or batch, slots): what a decode may read
    for b, length in enumerate(case.lengths):
        if case.page_size is None:
            read[b, :length] = True
            continue
        n = math.ceil(length / case.page_size)
        pages = x.page_table[b, :n].long()
        assert ((pages >= 0) & (pages < x.k_cache.shape[0])).all()
        for i, page in enumerate(pages.tolist()):
            read[page, :min(length - i * case.page_size, case.page_size)] = True
        past = x.page_table[b, n:].long()
        valid = past[(past >= 0) & (past < x.k_cache.shape[0])]
        assert x.k_cache[valid].isnan().all(), "an entry past a sequence's pages leads to data"
    for cache in (x.k_cache, x.v_cache):
        assert cache[read].isfinite().all() and cache[~read].isnan().all()
    if case.page_size is not None:
        assert case.capacity == x.page_table.shape[1] * case.page_size
        for b in range(1, case.batch):  # shared prefixes are sequence 0's pages
            shared = min(case.shared_pages, case.pages_needed(0), case.pages_needed(b))
            assert torch.equal(x.page_table[b, :shared], x.page_table[0, :shared])
        assert case.batch * case.heads_kv * case.spec.head_dim * max(case.lengths) <= SMALL.cache_elements


@settings(max_examples=40, deadline=None, derandomize=True)
@given(decode_cases(SPECS, SMALL, paged=True, page_sizes=(64, 192)))
def test_a_focused_search_draws_only_its_kernels_page_sizes(case):
    """attngen/fuzz/decode_search.py focuses a failure's search on the page sizes its kernel takes."""
    assert case.page_size in (64, 192)


def test_inputs_are_a_function_of_the_case():
    a, b = make_decode_inputs(CASE), make_decode_inputs(CASE)
    assert all(torch.equal(t, u) for t, u in ((a.q, b.q), (a.page_table, b.page_table)))
    assert torch.equal(a.k_cache.nan_to_num(7.0), b.k_cache.nan_to_num(7.0))


def test_the_reference_passes():
    for case in (CASE, DecodeCase(CASE.spec, (0, 200, 1), seq_q=1, heads_kv=1, page_size=None, data_seed=2)):
        assert check_decode_case(case, _reference_decode, "cpu") is None


def test_a_read_past_each_length_is_caught():
    bad = check_decode_case(CASE, lambda *a, **kw: _reference_decode(*a, **kw, lengths_of=lambda lens: lens + 1),
                            "cpu")
    assert bad is not None and "NaN" in bad


def test_a_dropped_last_partial_page_is_caught():
    def drop(lens):  # every sequence loses the tail of its last partial page
        return lens - lens % CASE.page_size

    bad = check_decode_case(CASE, lambda *a, **kw: _reference_decode(*a, **kw, lengths_of=drop), "cpu")
    assert bad is not None and "sequence 0 (length 37)" in bad


def test_following_an_entry_past_the_pages_is_caught():
    def follow(q, k_cache, v_cache, lens, *, page_table, **kw):  # reads one page past each sequence's pages
        pages = -(-lens // CASE.page_size)
        longer = torch.minimum((pages + 1) * CASE.page_size, torch.tensor(page_table.shape[1] * CASE.page_size))
        return _reference_decode(q, k_cache, v_cache, lens, page_table=page_table, **kw,
                                 lengths_of=lambda _: longer.int())

    assert check_decode_case(CASE, follow, "cpu") is not None


@pytest.mark.parametrize("field, value, message", [
    ("lengths", (), "lengths=()"), ("lengths", (3, -1), "lengths=(3, -1)"), ("seq_q", 17, "seq_q=17"),
    ("page_size", 257, "page_size=257"), ("spare_pages", 0, "spare_pages=0"), ("num_splits", 0, "num_splits=0"),
    ("heads_kv", 1.5, "heads_kv=1.5"), ("seq_q", True, "seq_q=True"), ("lengths", [3], "lengths=[3]"),
    ("spec", "causal", "spec='causal'"),
])
def test_bad_cases_are_refused_by_name(field, value, message):
    import dataclasses

    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(CASE, **{field: value})


def test_the_decode_pool_also_fuzzes_the_tma_loads_on_sm90():
    """decode_specs: every decode-capable pool problem unpinned (the default, cp.async loads) and, on
    sm_90, every TMA_EVERY-th of them pinned to decode_sm80's TMA loads; none of those on sm_80."""
    from attngen import targets
    from attngen.fuzz.paged import TMA_EVERY, decode_specs

    hopper, ampere = decode_specs(targets.target("sm_90a")), decode_specs(targets.target("sm_80"))
    pinned = [spec for spec in hopper if spec.family]
    assert [spec for spec in hopper if not spec.family] == ampere
    assert len(pinned) == -(-len(ampere) // TMA_EVERY)
    assert all(spec.family == "decode_sm80" and dict(spec.config) == {"loads": "tma"} for spec in pinned)
    assert {spec.replace(family=None, config={}) for spec in pinned} <= set(ampere)
