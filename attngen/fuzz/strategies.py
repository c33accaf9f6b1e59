"""Hypothesis strategies over spec x shape x data, shared by `attngen fuzz` and the GPU tests
(the specs come from attngen/fuzz/pool.py or the user).

A case's shape comes from one of several regimes, each aimed at a way kernels go wrong:
  general             each length small, within one of a multiple of block_m / block_n (the tiles of
                      the spec's plan on the runner's target), one of ODD_LENGTHS, or anything up
                      to `max_seq`
  single_query        Sq = 1 against up to `max_long_seq_k` keys (decode)
  keys_shorter        Sk < Sq: with causal masks, rows that see no key at all
  many_heads          one batch, up to `max_heads_q_wide` query heads
  mask_lengths        lengths at the integer constants of the mask (a window's width, a chunk's
                      size) and one tile past them, +-1: where a block changes from full to partial
                      to empty (only for masks with such constants)
Packed specs (attngen/fuzz/case.py is_packed) draw from their own regimes instead, one batch row:
  documents           up to `max_documents` sequences, each of equal query and key lengths or of
                      independent ones (more rows than keys: rows that see none under causal),
                      lengths small, near tile multiples or anything, empty sequences included;
                      sometimes rows and keys past the last sequence
  many_documents      up to `max_small_documents` sequences of 0 to 8 tokens each (many tiles)
Data: q and k scaled so scores reach about +-1e4; contiguous, transposed and padded layouts;
an explicit softmax_scale. Every length strategy starts with a plain integer range and every
regime can reach length 1, one batch and one head, so hypothesis shrinks a failure to small
values (a regime of tile-edge lengths only could not shrink Sk = 15 to 2), and towards the
contiguous layout, unit logits and seed 0.

Batch and heads are drawn after the lengths and kept within a budget (the float64 reference
holds a few B*Hq*Sq*Sk score matrices; each tensor sits in a NaN-guarded buffer), so a case's
memory is bounded.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from attngen import families, targets
from attngen.fuzz.case import LAYOUTS, MAX_SEED, FuzzCase, buffer_elements, is_packed
from attngen.spec import AttentionSpec
from attngen.targets import Target

ODD_LENGTHS = (1, 17, 127, 129, 1000, 4097)

# The first value of each is what hypothesis shrinks to. With q, k ~ N(0, s^2) and the default
# scale, scores spread by about s^2: 100 puts them near +-1e4.
LOGIT_SCALES = (1.0, 0.5, 4.0, 30.0, 100.0)
SOFTMAX_SCALES = (None, 0.5, 0.01)
SMALL_SEQ = 256


@dataclass(frozen=True)
class Limits:
    """How large cases get. The defaults suit an 80 GB GPU; CPU tests pass small ones."""

    max_seq: int = 4200  # covers 4097 and the tile multiples around 4096
    max_long_seq_k: int = 16384  # keys against a single query
    max_batch: int = 3
    max_heads_kv: int = 3
    max_heads_q_wide: int = 128  # the many_heads regime
    max_score_elements: int = 2**26  # B * Hq * Sq * Sk; float64: 512 MiB per score matrix
    # Per input or output tensor: its NaN-poisoned buffer (guards and padding included, attngen.fuzz.case),
    # which also bounds the B * S * H * D values drawn on the CPU.
    max_input_elements: int = 2**25
    max_documents: int = 40  # the documents regime
    max_small_documents: int = 300  # the many_documents regime (the reference runs one sequence at a time)

    def up_to(self, max_seq: int) -> "Limits":
        """These limits with a shorter longest length (a single query then sees up to 4x as many keys)."""
        if max_seq < 2:
            raise ValueError(f"max_seq={max_seq!r} is invalid; allowed: an integer >= 2")
        return dataclasses.replace(self, max_seq=max_seq, max_long_seq_k=min(self.max_long_seq_k, 4 * max_seq))


DEFAULT_LIMITS = Limits()

SMALL_DOCUMENT = 8  # the many_documents regime's longest sequence


def fuzz_cases(specs, limits: Limits = DEFAULT_LIMITS, target: Target | None = None) -> st.SearchStrategy[FuzzCase]:
    """Cases over `specs`; tile-edge lengths follow the tiles of each spec's plan for `target` (the
    runner's; default the default arch's). SpecError when a spec has no plan on the target."""
    specs = tuple(specs)
    if not specs:
        raise ValueError("specs=() is invalid; allowed: at least one AttentionSpec")
    target = target or targets.target(targets.DEFAULT_ARCH)
    for spec in specs:
        families.plan_spec(spec, target)  # a SpecError saying why now, not from inside hypothesis
    return _cases(specs, limits, target)


def first_cases(specs, limits: Limits = DEFAULT_LIMITS, target: Target | None = None) -> list[FuzzCase]:
    """One case per spec, run before hypothesis draws any, so every kernel of the pool runs however
    few cases a search has (drawn uniformly, a spec of a large pool can go unpicked for hundreds):
    two query and two key tiles, each second one partial, GQA over two kv heads, the padded layout."""
    target = target or targets.target(targets.DEFAULT_ARCH)
    cases = []
    for spec in specs:
        plan = families.plan_spec(spec, target)
        seq_q, seq_k = (min(block + 1, limits.max_seq) for block in (plan.block_m, plan.block_n))
        documents = ()
        if is_packed(spec):  # and beside it an empty sequence, one without keys, one of a single token
            documents = ((seq_q, seq_k), (0, 0), (3, 0), (1, 1))
            seq_q, seq_k = seq_q + 5, seq_k + 1  # and a row past the last sequence
        cases.append(FuzzCase(spec, batch=1, seq_q=seq_q, seq_k=seq_k, heads_kv=2, layout="padded",
                              documents=documents))
    return cases


@st.composite
def _cases(draw, specs, limits, target):
    spec = draw(st.sampled_from(specs))
    shape = draw(shapes(spec, limits, target))
    return FuzzCase(
        spec,
        **shape,
        layout=draw(st.sampled_from(LAYOUTS)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        softmax_scale=draw(st.sampled_from(SOFTMAX_SCALES)) if spec.softmax_scale is None else None,
        data_seed=draw(st.integers(0, MAX_SEED)),
    )


@functools.lru_cache(maxsize=None)  # drawn from once per case: build each spec's strategy once
def shapes(spec: AttentionSpec, limits: Limits, target: Target) -> st.SearchStrategy[dict]:
    """{batch, seq_q, seq_k, heads_kv} from one of the regimes (module docstring), for the tiles of
    the spec's plan on `target` (the kernel the runner compiles)."""
    plan = families.plan_spec(spec, target)
    if is_packed(spec):
        regimes = (_documents, _many_documents)
    else:
        regimes = (_general, _single_query, _keys_shorter, _many_heads)
        if mask_constants(spec, limits.max_seq):
            regimes += (_mask_lengths,)
    return st.one_of([regime(spec, plan, limits) for regime in regimes])


def mask_constants(spec: AttentionSpec, max_seq: int) -> tuple[int, ...]:
    """The integer constants >= 2 of the spec's mask up to max_seq: a window's width, a chunk's size."""
    from attngen.maskc.ir import Const, Type, walk
    from attngen.masks import get_mask

    return tuple(sorted({n.value for n in walk(get_mask(spec.mask).program.ir)
                         if isinstance(n, Const) and n.type is Type.INT and 2 <= n.value <= max_seq}))


def lengths(max_len: int, block: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(1, min(SMALL_SEQ, max_len)),
        near_multiples(block, max_len),
        st.sampled_from([n for n in ODD_LENGTHS if n <= max_len]),
        st.integers(1, max_len),
    )


def near_multiples(block: int, max_len: int) -> st.SearchStrategy[int]:
    """c * block - 1, c * block and c * block + 1 up to max_len, from 1 (= 0 * block + 1) upwards."""
    return st.sampled_from(sorted(n for c in range(max_len // block + 2) for n in (c * block - 1, c * block, c * block + 1)
                                  if 1 <= n <= max_len))


@st.composite
def _general(draw, spec, plan, limits):
    seq_q, seq_k = draw(lengths(limits.max_seq, plan.block_m)), draw(lengths(limits.max_seq, plan.block_n))
    return _with_batch_and_heads(draw, spec, limits, seq_q, seq_k)


@st.composite
def _single_query(draw, spec, plan, limits):
    seq_k = draw(st.one_of(st.integers(1, limits.max_long_seq_k), near_multiples(plan.block_n, limits.max_long_seq_k)))
    return _with_batch_and_heads(draw, spec, limits, 1, seq_k)


@st.composite
def _keys_shorter(draw, spec, plan, limits):
    seq_q = draw(st.integers(1, limits.max_seq))
    seq_k = draw(st.integers(1, max(1, seq_q - 1)))
    return _with_batch_and_heads(draw, spec, limits, seq_q, seq_k)


@st.composite
def _many_heads(draw, spec, plan, limits):
    short = min(SMALL_SEQ, limits.max_seq)
    seq_q, seq_k = draw(st.integers(1, short)), draw(st.integers(1, short))
    most = max(1, limits.max_heads_q_wide // spec.gqa_ratio)
    fits = _pairs_that_fit(spec, limits, seq_q, seq_k)
    heads_kv = draw(st.integers(1, max(1, min(most, fits))))
    return dict(batch=1, seq_q=seq_q, seq_k=seq_k, heads_kv=heads_kv)


def _pairs_that_fit(spec, limits, seq_q, seq_k) -> int:
    """How many (batch, kv head) pairs keep a case within the limits' element budgets (at least 1)."""
    scores = spec.gqa_ratio * seq_q * seq_k
    # One pair's buffer in the largest layout; more pairs share the guards, so this is an upper bound.
    inputs = buffer_elements((1, max(seq_q, seq_k), spec.gqa_ratio, spec.head_dim), "padded")
    return max(1, min(limits.max_score_elements // scores, limits.max_input_elements // inputs))


def _with_batch_and_heads(draw, spec, limits, seq_q, seq_k) -> dict:
    fits = _pairs_that_fit(spec, limits, seq_q, seq_k)
    batch = draw(st.integers(1, max(1, min(limits.max_batch, fits))))
    heads_kv = draw(st.integers(1, max(1, min(limits.max_heads_kv, fits // batch))))
    return dict(batch=batch, seq_q=seq_q, seq_k=seq_k, heads_kv=heads_kv)


@st.composite
def _mask_lengths(draw, spec, plan, limits):
    near = sorted({n for c in mask_constants(spec, limits.max_seq) for base in (c, c + plan.block_m, c + plan.block_n)
                   for n in (base - 1, base, base + 1) if 1 <= n <= limits.max_seq})
    seq_q = draw(st.one_of(st.sampled_from(near), lengths(limits.max_seq, plan.block_m)))
    seq_k = draw(st.one_of(st.sampled_from(near), lengths(limits.max_seq, plan.block_n)))
    return _with_batch_and_heads(draw, spec, limits, seq_q, seq_k)


def _document_lengths(max_len: int, block: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 3), st.integers(0, min(SMALL_SEQ, max_len)), near_multiples(block, max_len),
                     st.integers(0, max_len))


@st.composite
def _documents(draw, spec, plan, limits):
    rows, keys = _document_lengths(limits.max_seq, plan.block_m), _document_lengths(limits.max_seq, plan.block_n)
    pair = st.one_of(rows.map(lambda n: (n, n)), st.tuples(rows, keys))
    count = draw(st.one_of(st.integers(1, 4), st.integers(1, limits.max_documents)))
    return _packed(draw, spec, plan, limits, draw(st.lists(pair, min_size=count, max_size=count)))


@st.composite
def _many_documents(draw, spec, plan, limits):
    small = st.integers(0, SMALL_DOCUMENT)
    pair = st.one_of(small.map(lambda n: (n, n)), st.tuples(small, small))
    count = draw(st.integers(1, limits.max_small_documents))  # a list's own size would stay small
    return _packed(draw, spec, plan, limits, draw(st.lists(pair, min_size=count, max_size=count)))


def _packed(draw, spec, plan, limits, documents) -> dict:
    """The shape of a packed case: the documents that fit in max_seq rows and keys (at least the
    first), one batch row, sometimes rows and keys past the last document."""
    kept, rows, keys = [], 0, 0
    for q, k in documents:
        if kept and (rows + q > limits.max_seq or keys + k > limits.max_seq):
            break
        kept.append((min(q, limits.max_seq), min(k, limits.max_seq)))
        rows, keys = rows + kept[-1][0], keys + kept[-1][1]
    past = st.one_of(st.just(0), st.integers(1, plan.block_m + 1))
    seq_q, seq_k = max(1, rows + draw(past)), max(1, keys + draw(past))
    fits = _pairs_that_fit(spec, limits, seq_q, seq_k)
    heads_kv = draw(st.integers(1, max(1, min(limits.max_heads_kv, fits))))
    return dict(batch=1, seq_q=seq_q, seq_k=seq_k, heads_kv=heads_kv, documents=tuple(kept))
