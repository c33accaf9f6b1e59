"""The paged decode regime: random KV caches for attngen.decode, guarded with NaN, held to the
float64 reference (docs/decode.md has the contract).

A DecodeCase is a spec (a problem the decode family runs), each sequence's cache length, 1 to 16
new tokens per sequence, the number of splits (None: the kernel's choice) and the cache: paged
(any page size, pages in shuffled order, a prefix of pages shared with sequence 0, spare pages no
sequence lists) or contiguous. make_decode_inputs builds it from the case's seed, with NaN wherever
the kernels must neither read nor let a value into the result:
  - every slot of a page no sequence lists within its length (the spare pages),
  - the slots of a listed page past the longest length that uses it (a last page's tail),
  - a contiguous cache past each sequence's length;
and the page-table entries past each sequence's pages hold ids the kernels must never follow: -1,
ids past the cache, a spare page of NaN. A read of any of them shows as NaN or a wrong value.

check_decode_case runs a decode function (attngen.decode, or a stand-in in the CPU tests) and
holds every sequence's output and LSE to reference.decode_attention within attngen.tolerance's
per-dtype bounds (decode_failure), as the forward fuzz does. `attngen fuzz --decode` runs these
cases as a mode of the fuzzer (attngen/fuzz/decode_command.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from attngen import reference, tolerance
from attngen.dtypes import torch_dtype
from attngen.fuzz.case import MAX_SEED, FuzzCase, host_runtime_inputs
from attngen.fuzz.strategies import LOGIT_SCALES
from attngen.spec import AttentionSpec

MAX_SEQ_Q = 16  # new tokens per sequence (speculative decoding, chunked-prefill tails)
PAGE_SIZES = (16, 32, 64, 128, 256)  # the common ones; any other size in 1..256 is drawn too
# The first cases' caches, one per kernel a spec may run as: pages of 16 (the per-row plan), pages of
# 256 (a multiple of every decode block_n: the plan for pages of whole key blocks), contiguous.
FIRST_PAGE_SIZES = (16, 256, None)
MAX_PAGE_SIZE = 256
GARBAGE_IDS = 3  # past its pages, a table entry is -1, an id past the cache, or a spare (NaN) page


@dataclass(frozen=True)
class DecodeCase:
    spec: AttentionSpec
    lengths: tuple[int, ...]  # cache_seqlens, one per sequence
    seq_q: int
    heads_kv: int
    page_size: int | None  # None: a contiguous cache
    extra_pages: int = 0  # table entries past the longest sequence's pages (contiguous: extra tokens / 64)
    shared_pages: int = 0  # leading pages every other sequence shares with sequence 0 (paged)
    spare_pages: int = 1  # pages no sequence lists, all NaN (paged)
    num_splits: int | None = None
    logit_scale: float = 1.0  # q and k ~ N(0, logit_scale^2), as in the forward fuzz
    data_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.spec, AttentionSpec):
            raise ValueError(f"spec={self.spec!r} is invalid; allowed: an attngen.AttentionSpec")
        if not isinstance(self.lengths, tuple) or not self.lengths or not all(_int(n, 0) for n in self.lengths):
            raise ValueError(f"lengths={self.lengths!r} is invalid; allowed: a tuple of one integer >= 0 per sequence")
        checks = (("seq_q", 1, MAX_SEQ_Q, False, ""), ("heads_kv", 1, None, False, ""),
                  ("page_size", 1, MAX_PAGE_SIZE, True, "None (contiguous) or "), ("extra_pages", 0, None, False, ""),
                  ("shared_pages", 0, None, False, ""), ("spare_pages", 1, None, False, " (the NaN pages a wild "
                                                                                     "read lands in)"),
                  ("num_splits", 1, None, True, "None or "), ("data_seed", 0, MAX_SEED, False, ""))
        for name, low, high, optional, note in checks:
            value = getattr(self, name)
            if not (optional and value is None) and not _int(value, low, high):
                allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
                prefix, suffix = (note, "") if note.endswith("or ") else ("", note)
                raise ValueError(f"{name}={value!r} is invalid; allowed: {prefix}{allowed}{suffix}")
        scale = self.logit_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"logit_scale={scale!r} is invalid; allowed: a finite number > 0")

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.spec.gqa_ratio

    def pages_needed(self, b: int) -> int:
        return math.ceil(self.lengths[b] / self.page_size)

    def shared(self, b: int) -> int:
        """Leading pages sequence b shares with sequence 0 (paged)."""
        return 0 if b == 0 else min(self.shared_pages, self.pages_needed(0), self.pages_needed(b))

    @property
    def num_pages(self) -> int:
        """Pages in the paged cache: each sequence's own (its shared prefix is sequence 0's), then the spare ones."""
        return sum(self.pages_needed(b) - self.shared(b) for b in range(self.batch)) + self.spare_pages

    @property
    def capacity(self) -> int:
        """Tokens a sequence may hold: pages per sequence x page size, or the contiguous length."""
        if self.page_size is None:
            return max(max(self.lengths), 1) + 64 * self.extra_pages
        return (max(max(self.pages_needed(b) for b in range(self.batch)), 1) + self.extra_pages) * self.page_size

    def label(self) -> str:
        cache = "contiguous" if self.page_size is None else (
            f"pages of {self.page_size} (+{self.extra_pages} per sequence, {self.shared_pages} shared, "
            f"{self.spare_pages} spare)")
        return (f"decode lengths={list(self.lengths)} seq_q={self.seq_q} heads {self.heads_q}/{self.heads_kv} "
                f"{cache} splits={self.num_splits} logits~{self.logit_scale:g}^2 seed={self.data_seed}")


def _int(value, low: int, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value <= high)


@dataclass
class DecodeInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    page_table: torch.Tensor | None
    inputs: dict[str, torch.Tensor]

    def to(self, device) -> "DecodeInputs":
        move = (lambda t: None if t is None else t.to(device))
        return DecodeInputs(move(self.q), move(self.k_cache), move(self.v_cache), move(self.cache_seqlens),
                            move(self.page_table), {name: t.to(device) for name, t in self.inputs.items()})


def _page_table(case: DecodeCase, gen: torch.Generator) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(table, num_pages, filled): each page's slots in use (the longest length through it)."""
    needed = [case.pages_needed(b) for b in range(case.batch)]
    shared = [case.shared(b) for b in range(case.batch)]
    num_pages = case.num_pages
    owned = num_pages - case.spare_pages
    ids = torch.randperm(num_pages, generator=gen)
    spare = ids[owned:]
    per_sequence = case.capacity // case.page_size
    garbage = torch.stack([torch.full((per_sequence,), -1), torch.full((per_sequence,), num_pages),
                           spare[torch.randint(0, len(spare), (per_sequence,), generator=gen)]])
    table = torch.empty(case.batch, per_sequence, dtype=torch.int64)
    filled = torch.zeros(num_pages, dtype=torch.int64)
    next_id = 0
    for b, n in enumerate(needed):
        kinds = torch.randint(0, GARBAGE_IDS, (per_sequence,), generator=gen)
        table[b] = garbage[kinds, torch.arange(per_sequence)]
        table[b, :shared[b]] = table[0, :shared[b]]
        table[b, shared[b]:n] = ids[next_id:next_id + n - shared[b]]
        next_id += n - shared[b]
        slots = (case.lengths[b] - torch.arange(n) * case.page_size).clamp(max=case.page_size)
        filled.scatter_reduce_(0, table[b, :n], slots, "amax")
    return table.to(torch.int32), num_pages, filled


def make_decode_inputs(case: DecodeCase) -> DecodeInputs:
    """The case's tensors on the CPU (module docstring): a pure function of the case."""
    gen = torch.Generator().manual_seed(case.data_seed)
    dtype, D, Hkv = torch_dtype(case.spec.dtype), case.spec.head_dim, case.heads_kv
    q = (torch.randn(case.batch, case.seq_q, case.heads_q, D, generator=gen) * case.logit_scale).to(dtype)
    if case.page_size is None:
        table = None
        shape = (case.batch, case.capacity, Hkv, D)
        unused = torch.arange(case.capacity)[None, :] >= torch.tensor(case.lengths)[:, None]  # (batch, capacity)
    else:
        table, num_pages, filled = _page_table(case, gen)
        shape = (num_pages, case.page_size, Hkv, D)
        unused = torch.arange(case.page_size)[None, :] >= filled[:, None]  # (pages, slots)
    k = torch.randn(shape, generator=gen) * case.logit_scale
    v = torch.randn(shape, generator=gen)
    k[unused], v[unused] = float("nan"), float("nan")
    # Runtime inputs (sinks, slopes, offsets ...) as the forward fuzz draws them, over the capacity.
    proxy = FuzzCase(case.spec, batch=case.batch, seq_q=case.seq_q, seq_k=case.capacity, heads_kv=Hkv,
                     data_seed=case.data_seed)
    return DecodeInputs(q, k.to(dtype), v.to(dtype), torch.tensor(case.lengths, dtype=torch.int32), table,
                        host_runtime_inputs(proxy))


def check_decode_case(case: DecodeCase, decode, device) -> str | None:
    """None when `decode` (attngen.decode's signature) gets every sequence right, else what is wrong."""
    host = make_decode_inputs(case)
    x = host.to(device)
    out, lse = decode(x.q, x.k_cache, x.v_cache, x.cache_seqlens, page_table=x.page_table, spec=case.spec,
                      num_splits=case.num_splits, inputs=x.inputs or None, return_lse=True)
    bad = decode_failure(case, host, out.cpu(), lse.cpu())
    return None if bad is None else bad[1]


def decode_failure(case: DecodeCase, host: DecodeInputs, out, lse) -> tuple[str, str] | None:
    """(kind, what is wrong) of a decode's out and lse (on the CPU) for the case's inputs `host`: kind
    "output" or "lse" (attngen/fuzz/check.py FAILURE_KINDS); None when every sequence is right."""
    q = host.q
    if tuple(out.shape) != tuple(q.shape) or tuple(lse.shape) != (case.batch, case.heads_q, case.seq_q):
        return "output", (f"out {tuple(out.shape)} and lse {tuple(lse.shape)}; allowed: {tuple(q.shape)} and "
                          f"{(case.batch, case.heads_q, case.seq_q)}")
    ref, ref_lse = reference.decode_attention(q, host.k_cache, host.v_cache, host.cache_seqlens, case.spec,
                                              page_table=host.page_table, inputs=host.inputs or None)
    scale = case.spec.effective_scale
    for b, length in enumerate(case.lengths):
        where = f"sequence {b} (length {length})"
        if not out[b].isfinite().all():
            return "output", f"{where}: the output has NaN/Inf"
        if lse[b].isnan().any():
            return "lse", f"{where}: the LSE has NaN"
        k, v = (reference.gather_cache(t, host.page_table, b, length) for t in (host.k_cache, host.v_cache))
        bad = tolerance.check_output(out[b:b + 1], ref[b:b + 1], q[b:b + 1], k, v, case.spec.dtype, scale)
        if bad is not None:
            return "output", f"{where}: {bad}"
        bad = tolerance.check_lse(lse[b:b + 1], ref_lse[b:b + 1], q[b:b + 1], k, scale)
        if bad is not None:
            return "lse", f"{where}: {bad}"
    return None


def decode_input_digest(case: DecodeCase) -> str:
    """sha256 of the case's input bytes (NaN guards included): a replay checks it regenerated the same data."""
    x = make_decode_inputs(case)
    digest = hashlib.sha256()
    for t in (x.q, x.k_cache, x.v_cache, x.cache_seqlens, *(() if x.page_table is None else (x.page_table,)),
              *x.inputs.values()):
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


TMA_EVERY = 3  # on sm_90+, every third problem also runs pinned to decode_sm80's TMA loads


def decode_specs(target) -> list[AttentionSpec]:
    """The built-in pool's problems (attngen/fuzz/pool.py) a decode family runs on `target`, unpinned
    (attngen.decode picks the family; packed sequences are the forward's); on sm_90 and newer, every
    TMA_EVERY-th of them also pinned to decode_sm80 with `loads: tma` (the default loads by cp.async)."""
    from attngen import families
    from attngen.fuzz.case import is_packed
    from attngen.fuzz.pool import PROBLEMS

    specs = [AttentionSpec(**dataclasses.asdict(problem)) for problem in PROBLEMS if not problem.varlen]
    specs = [spec for spec in specs if not is_packed(spec) and any(
        family.supports(spec.problem, target) is None for family in families.DECODE_FAMILIES.values())]
    decode = families.DECODE_FAMILIES["decode_sm80"]
    tma = [spec.replace(family="decode_sm80", config={"loads": "tma"}) for spec in specs[::TMA_EVERY]
           if target.cc >= 90 and decode.supports(spec.problem, target) is None]
    return specs + tma


@dataclass(frozen=True)
class DecodeLimits:
    """How large cases get; the defaults suit an 80 GB GPU and a float64 reference on the CPU."""

    max_batch: int = 4
    max_heads_kv: int = 2
    max_length: int = 131072  # tokens cached in one sequence
    cache_elements: int = 1 << 23  # sum of lengths x heads_kv x head_dim (one cache's values)
    max_splits: int = 40


def first_decode_cases(specs, limits: DecodeLimits = DecodeLimits()) -> list[DecodeCase]:
    """Three cases per spec, run before hypothesis draws any, so every kernel runs however few cases a
    search has (pages of 16, pages of whole key blocks and a contiguous cache are three kernels): two
    sequences over two kv heads and two new tokens; paged, a last partial page, a shared page and two
    splits; pages of 256 (a multiple of every decode block_n); contiguous, an empty sequence."""
    cases = []
    for spec in specs:
        short = (min(37, limits.max_length), min(20, limits.max_length))
        cases.append(DecodeCase(spec, short, seq_q=2, heads_kv=2, page_size=16, extra_pages=1, shared_pages=1,
                                num_splits=2))
        cases.append(DecodeCase(spec, (min(300, limits.max_length), short[0]), seq_q=2, heads_kv=2, page_size=256,
                                extra_pages=1, shared_pages=1, num_splits=2))
        cases.append(DecodeCase(spec, (min(70, limits.max_length), 0), seq_q=2, heads_kv=2, page_size=None,
                                extra_pages=1))
    return cases


@st.composite
def decode_cases(draw, specs: list[AttentionSpec], limits: DecodeLimits = DecodeLimits(),
                 paged: bool | None = None, page_sizes: tuple[int, ...] | None = None) -> DecodeCase:
    """Cases over `specs`: paged caches, contiguous ones or (None) both; paged ones of `page_sizes` only
    when given (the page sizes one kernel takes). Every draw starts with a small range (hypothesis
    shrinks to short caches, one sequence, one token, a contiguous cache and the kernel's own split
    count)."""
    spec = draw(st.sampled_from(specs))
    batch = draw(st.integers(1, limits.max_batch))
    heads_kv = draw(st.integers(1, limits.max_heads_kv))
    sizes = st.sampled_from(page_sizes) if page_sizes else st.one_of(st.sampled_from(PAGE_SIZES),
                                                                      st.integers(1, MAX_PAGE_SIZE))
    page_size = draw(st.none() if paged is False else sizes if paged else st.one_of(st.none(), sizes))
    longest = min(limits.max_length, limits.cache_elements // (batch * heads_kv * spec.head_dim))
    unit = page_size or 64
    length = st.one_of(
        st.integers(0, min(300, longest)),
        st.integers(0, longest // unit).flatmap(lambda n: st.sampled_from([n * unit - 1, n * unit, n * unit + 1])),
        st.integers(0, longest),
    ).map(lambda n: max(0, min(n, longest)))
    lengths = tuple(draw(st.lists(length, min_size=batch, max_size=batch)))
    has_pages = page_size is not None
    return DecodeCase(
        spec, lengths, seq_q=draw(st.integers(1, MAX_SEQ_Q)), heads_kv=heads_kv, page_size=page_size,
        extra_pages=draw(st.integers(0, 2)), shared_pages=draw(st.integers(0, 3)) if has_pages and batch > 1 else 0,
        spare_pages=draw(st.integers(1, 3)) if has_pages else 1,
        num_splits=draw(st.one_of(st.none(), st.integers(1, limits.max_splits))),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)), data_seed=draw(st.integers(0, 2**31 - 1)))
