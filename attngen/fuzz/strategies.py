"""Hypothesis strategies over spec x shape x data, shared by `attngen fuzz` and the GPU tests.

A case's shape comes from one of several regimes, each aimed at a way kernels go wrong:
  general             each length small, within one of a multiple of the spec's block_m / block_n,
                      one of ODD_LENGTHS, or anything up to `max_seq`
  single_query        Sq = 1 against up to `max_long_seq_k` keys (decode)
  keys_shorter        Sk < Sq: with causal masks, rows that see no key at all
  many_heads          one batch, up to `max_heads_q_wide` query heads
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
import random
from dataclasses import dataclass

from hypothesis import strategies as st

from attngen.errors import SpecError
from attngen.fuzz.case import LAYOUTS, MAX_SEED, FuzzCase, buffer_elements
from attngen.masks import MASKS
from attngen.plan import make_plan
from attngen.spec import BLOCK_MS, BLOCK_NS, DTYPES, HEAD_DIMS, NUM_STAGES, NUM_WARPS, ROWS_PER_WARP, AttentionSpec

ODD_LENGTHS = (1, 17, 127, 129, 1000, 4097)

# The built-in pool: every head dim, dtype, mask and a few GQA ratios, the kernels of the spec
# files in specs/ (arch unset: the GPU's), and non-default tiles (two m-tiles per warp, Q re-read
# from shared memory, 1 and 3 stages). A fixed pool bounds the number of compiles (seconds each).
BUILTIN_SPECS = (
    AttentionSpec(head_dim=64, dtype="fp16"),
    AttentionSpec(head_dim=64, dtype="bf16", mask="causal", gqa_ratio=2),
    AttentionSpec(head_dim=128, dtype="bf16", mask="causal", gqa_ratio=4),
    AttentionSpec(head_dim=128, dtype="fp16"),
    AttentionSpec(head_dim=96, dtype="bf16", mask="causal"),
    AttentionSpec(head_dim=256, dtype="bf16", mask="causal"),
    AttentionSpec(head_dim=256, dtype="fp16", gqa_ratio=2),
    AttentionSpec(head_dim=128, dtype="bf16", mask="causal", block_m=128, block_n=64, num_warps=4, num_stages=2),
    AttentionSpec(head_dim=64, dtype="bf16", mask="causal", block_m=64, block_n=32, num_warps=4, num_stages=1),
    AttentionSpec(head_dim=64, dtype="fp16", block_m=32, block_n=128, num_warps=2, num_stages=3),
    AttentionSpec(head_dim=96, dtype="bf16"),
)

# The first value of each is what hypothesis shrinks to. With q, k ~ N(0, s^2) and the default
# scale, scores spread by about s^2: 100 puts them near +-1e4.
LOGIT_SCALES = (1.0, 0.5, 4.0, 30.0, 100.0)
SOFTMAX_SCALES = (None, 0.5, 0.01)
RANDOM_GQA_RATIOS = (1, 2, 3, 4, 8)
RANDOM_SOFTMAX_SCALES = (0.03125, 0.1, 0.5)
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

    def up_to(self, max_seq: int) -> "Limits":
        """These limits with a shorter longest length (a single query then sees up to 4x as many keys)."""
        if max_seq < 2:
            raise ValueError(f"max_seq={max_seq!r} is invalid; allowed: an integer >= 2")
        return dataclasses.replace(self, max_seq=max_seq, max_long_seq_k=min(self.max_long_seq_k, 4 * max_seq))


DEFAULT_LIMITS = Limits()

# Masks that need more than two lengths add regimes here. A document mask would register one that
# draws document lengths (empty and length-1 documents included) and adds them to FuzzCase and
# make_inputs; "none" and "causal" need nothing beyond the regimes above.
MASK_REGIMES: dict[str, tuple] = {}


def fuzz_cases(specs, limits: Limits = DEFAULT_LIMITS, arch: str = "sm_90") -> st.SearchStrategy[FuzzCase]:
    """Cases over `specs`; tile-edge lengths follow each spec's tile as resolved for `arch`."""
    specs = tuple(specs)
    if not specs:
        raise ValueError("specs=() is invalid; allowed: at least one AttentionSpec")
    return _cases(specs, limits, arch)


@st.composite
def _cases(draw, specs, limits, arch):
    spec = draw(st.sampled_from(specs))
    shape = draw(shapes(spec, limits, arch))
    return FuzzCase(
        spec,
        **shape,
        layout=draw(st.sampled_from(LAYOUTS)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        softmax_scale=draw(st.sampled_from(SOFTMAX_SCALES)) if spec.softmax_scale is None else None,
        data_seed=draw(st.integers(0, MAX_SEED)),
    )


@functools.lru_cache(maxsize=None)  # drawn from once per case: build each spec's strategy once
def shapes(spec: AttentionSpec, limits: Limits = DEFAULT_LIMITS, arch: str = "sm_90") -> st.SearchStrategy[dict]:
    """{batch, seq_q, seq_k, heads_kv} from one of the regimes (module docstring)."""
    tile = spec.resolved(arch).tile
    regimes = (_general, _single_query, _keys_shorter, _many_heads, *MASK_REGIMES.get(spec.mask, ()))
    return st.one_of([regime(spec, tile, limits) for regime in regimes])


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
def _general(draw, spec, tile, limits):
    seq_q, seq_k = draw(lengths(limits.max_seq, tile.block_m)), draw(lengths(limits.max_seq, tile.block_n))
    return _with_batch_and_heads(draw, spec, limits, seq_q, seq_k)


@st.composite
def _single_query(draw, spec, tile, limits):
    seq_k = draw(st.one_of(st.integers(1, limits.max_long_seq_k), near_multiples(tile.block_n, limits.max_long_seq_k)))
    return _with_batch_and_heads(draw, spec, limits, 1, seq_k)


@st.composite
def _keys_shorter(draw, spec, tile, limits):
    seq_q = draw(st.integers(1, limits.max_seq))
    seq_k = draw(st.integers(1, max(1, seq_q - 1)))
    return _with_batch_and_heads(draw, spec, limits, seq_q, seq_k)


@st.composite
def _many_heads(draw, spec, tile, limits):
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


# -- random specs ---------------------------------------------------------------------
def random_spec(rng: random.Random, arch: str) -> AttentionSpec:
    """A spec with random fields (and, three times in four, a random tile) that the plan accepts on arch."""
    while True:
        fields = dict(head_dim=rng.choice(HEAD_DIMS), dtype=rng.choice(DTYPES),
                      gqa_ratio=rng.choice(RANDOM_GQA_RATIOS), mask=rng.choice(sorted(MASKS)))
        if rng.random() < 0.25:
            fields["softmax_scale"] = rng.choice(RANDOM_SOFTMAX_SCALES)
        if rng.random() < 0.75:
            num_warps = rng.choice(NUM_WARPS)
            fields.update(block_m=num_warps * rng.choice(ROWS_PER_WARP), num_warps=num_warps,
                          block_n=rng.choice(BLOCK_NS), num_stages=rng.choice(NUM_STAGES))
            if fields["block_m"] not in BLOCK_MS:
                continue
        spec = AttentionSpec(**fields)
        try:
            make_plan(spec, arch)  # the target must hold the tile (shared memory)
        except SpecError:
            continue
        return spec


def random_spec_pool(seed: int, count: int, arch: str) -> tuple[AttentionSpec, ...]:
    """`count` distinct random specs, the same for the same seed. A pool (not a spec per case) keeps
    the number of compiles bounded; hypothesis still shrinks towards the pool's first spec."""
    rng = random.Random(f"attngen-random-specs-{seed}")
    pool: dict[AttentionSpec, None] = {}
    for _ in range(100 * count):
        if len(pool) == count:
            break
        pool[random_spec(rng, arch)] = None
    return tuple(pool)
