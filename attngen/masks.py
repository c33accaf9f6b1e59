"""Mask lowering: a mask's text -> what every forward family's template needs (attngen/cuda/mask.cuh.j2).

A mask is an expression of attngen's mask language (docs/masks.md, compiled by attngen/maskc):
a built-in such as `causal`, `sliding_window(256, 0)` or `chunked(512)`, an expression over
`b, h, q_idx, kv_idx, q_len, kv_len` such as `q_idx - kv_idx < 4096 and kv_idx <= q_idx`, or a
combination with and/or/not. Its lowering holds:

  visible          the element predicate, C++ over q_idx, kv_idx, q_len, kv_len, b, h; evaluated
                   only in key blocks that need it
  classify         C++ interval arithmetic: is a (query rows x keys) rectangle empty (0), partly
                   visible (1) or full (2)? An input is read exactly where its index is exact,
                   else over the block's range from per-call summaries (span_<name>). The block
                   table kernel runs it for a mask without a closed form, once per (query block,
                   key block) each call, so empty blocks are never loaded and full ones never
                   masked per element (attngen/mask_table.py)
  closed           for `none`, `causal`, `sliding_window(l, r)`, `chunked(n)` and their conjunctions,
                   and for bands written out as expressions (`q_idx >= kv_idx`, prefixes such as
                   `prefix_lm(plen[b])`: attngen/maskc/bands.py):
                   the same bounds in closed form over the query rows [m0, m1) (no scan); tests hold
                   them to the generic scan and to the dense mask
  dense_visible    the same predicate for the reference, on broadcastable torch tensors

The kernel and the reference read one compiled expression, so they cannot drift apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from attngen.errors import show
from attngen.maskc.bands import fold as _fold

# The built-ins, for messages (docs/masks.md defines each in the language itself).
BUILTINS = ("none", "causal", "sliding_window(left, right)", "chunked(size)", "prefix_lm(n)")
ALLOWED = "a mask expression (docs/masks.md), e.g. " + ", ".join(BUILTINS)
# Masks of every kind, for tests and examples.
EXAMPLES = ("none", "causal", "sliding_window(128, 0)", "chunked(64)", "prefix_lm(16)",
            "causal and sliding_window(100, 0)", "kv_idx % 3 != 1 or q_idx == kv_idx")


@dataclass(frozen=True)
class ClosedForm:
    """Bounds over the query rows [m0, m1) in closed form: C++ for the kernel, Python for the model."""

    cuda: tuple[str, str, str, str]  # kv_begin, kv_end, full_begin, full_end over (m0, m1, Sq, Sk) and p's inputs
    python: Callable[..., tuple[int, int, int, int]]  # (m0, m1, Sq, Sk), and inputs=, b= where reads_inputs
    # A band reading inputs (a scalar q_offset, a length per batch row plen[b]): python takes their values as
    # inputs= and the batch row as b=.
    reads_inputs: bool = False


# Bottom-right aligned causal (FlashAttention's convention): query q sees keys k <= q + (Sk - Sq).
CLOSED_FORMS = {
    "none": ClosedForm(("0", "Sk", "0", "Sk"), lambda m0, m1, Sq, Sk: (0, Sk, 0, Sk)),
    "causal": ClosedForm(
        ("0", "min(Sk, max(0, m1 + (Sk - Sq)))", "0", "min(Sk, max(0, m0 + 1 + (Sk - Sq)))"),
        lambda m0, m1, Sq, Sk: (0, min(Sk, max(0, m1 + Sk - Sq)), 0, min(Sk, max(0, m0 + 1 + Sk - Sq)))),
}
# Parameters past this are windows or chunks longer than any sequence: no closed form needed.
MAX_CLOSED_PARAM = 2**30


def _clamp(x: int, Sk: int) -> int:
    return min(Sk, max(0, x))


def _clamped(expr: str) -> str:
    """C++ of a 64-bit bound clamped to [0, Sk], as an int (what _clamp is in Python)."""
    return f"(int)maskc_max(0LL, maskc_min((long long)Sk, {expr}))"


def _window(left: int, right: int) -> ClosedForm:
    """sliding_window(left, right): row q sees keys [q + d - left, q + d + right], d = Sk - Sq. Every
    row of [m0, m1) sees [m1 - 1 + d - left, m0 + d + right]; some row sees [m0 + d - left, m1 - 1 + d + right]."""
    c = _clamped  # 64-bit inside, clamped to [0, Sk]
    d = "((long long)Sk - Sq)"
    cuda = (c(f"(long long)m0 + {d} - {left}LL"), c(f"(long long)m1 + {d} + {right}LL"),
            c(f"(long long)m1 - 1 + {d} - {left}LL"), c(f"(long long)m0 + 1 + {d} + {right}LL"))
    return ClosedForm(cuda, lambda m0, m1, Sq, Sk: (
        _clamp(m0 + Sk - Sq - left, Sk), _clamp(m1 + Sk - Sq + right, Sk),
        _clamp(m1 - 1 + Sk - Sq - left, Sk), _clamp(m0 + 1 + Sk - Sq + right, Sk)))


def _chunked(size: int) -> ClosedForm:
    """chunked(size): row q sees the keys of its chunk (q + d) // size. Rows [m0, m1) see chunks c0..c1;
    when c0 == c1 every row sees the whole chunk, else no key is visible to all. The chunk indices are
    divided in 32 bits (a 64-bit division held fwd_sm80's d128 tile past its registers: 72 bytes spilled):
    a row past Sq (the last tile's padding, never stored) counts as row Sq, so (row - Sq) + Sk lies in
    [-Sq, Sk] and never overflows; the products stay 64-bit."""
    c = _clamped
    c0, c1 = (f"(long long)maskc_floordiv32(min({row}, Sq) - Sq + Sk, {size})" for row in ("m0", "m1 - 1"))
    cuda = (c(f"{c0} * {size}LL"), c(f"({c1} + 1) * {size}LL"), c(f"{c0} * {size}LL"),
            c(f"({c0} == {c1} ? {c0} + 1 : {c0}) * {size}LL"))

    def python(m0, m1, Sq, Sk):
        lo, hi = (m0 + Sk - Sq) // size, (m1 - 1 + Sk - Sq) // size
        return (_clamp(lo * size, Sk), _clamp((hi + 1) * size, Sk), _clamp(lo * size, Sk),
                _clamp((lo + 1 if lo == hi else lo) * size, Sk))
    return ClosedForm(cuda, python)


def closed_form(canonical: str, builtin: tuple | None) -> ClosedForm | None:
    """The closed form of a mask that is one built-in with one, or a conjunction of such
    (stored as "A and B", maskc.stored_text), else None (the kernel scans)."""
    if canonical in CLOSED_FORMS:
        return CLOSED_FORMS[canonical]
    if builtin is None:
        from attngen.maskc.parse import parse
        from attngen.maskc.program import builtin_conjunction

        terms = builtin_conjunction(canonical)
        if terms is None:
            return None
        forms = [closed_form(term, parse(term, "mask").builtin) for term in terms]
        return None if any(f is None for f in forms) else _conjunction(forms)
    if any(abs(v) > MAX_CLOSED_PARAM for v in builtin[1]):
        return None
    name, values = builtin
    if name == "sliding_window":
        return _window(*values)
    if name == "chunked":
        return _chunked(*values)
    return None


def band_form(program, input_ref) -> ClosedForm | None:
    """The closed form of a mask that is a band (attngen/maskc/bands.py), else None: row q sees
    [lo(q), hi(q)), lo the max of the lower bounds, hi the min of the upper ones, both never
    decreasing in q; so rows [m0, m1) see [lo(m0), hi(m1 - 1)) together and [lo(m1 - 1), hi(m0)) each.
    Inputs are read through input_ref in C++ (one read at b at the bounds' `batch`), and from inputs= at b= in
    Python (0 where not given: the tile model's stand-in)."""
    from attngen.maskc.bands import band

    found = band(program.ir)
    if found is None:
        return None

    def cuda_side(bounds, pick: str, empty: str, row: str) -> str:
        return _clamped(_fold(pick, [b.cuda(row, input_ref) for b in bounds] or [empty]))

    def lo(row: str) -> str:
        return cuda_side(found.lower, "maskc_max", "0LL", row)

    def hi(row: str) -> str:
        return cuda_side(found.upper, "maskc_min", "(long long)Sk", row)

    def python(m0, m1, Sq, Sk, inputs=None, b=0):
        def lo_at(q):
            return _clamp(max((x.at(q, Sq, Sk, inputs, b) for x in found.lower), default=0), Sk)

        def hi_at(q):
            return _clamp(min((x.at(q, Sq, Sk, inputs, b) for x in found.upper), default=Sk), Sk)
        return lo_at(m0), hi_at(m1 - 1), lo_at(m1 - 1), hi_at(m0)
    reads = any(x.inputs for x in (*found.lower, *found.upper))
    return ClosedForm((lo("m0"), hi("m1 - 1"), lo("m1 - 1"), hi("m0")), python, reads)


def _conjunction(forms: list[ClosedForm]) -> ClosedForm:
    """A and B: the keys some row may see lie in both spans (sound); the keys every row sees are
    those every row sees in both (exact)."""
    cuda = tuple(_fold("max" if i % 2 == 0 else "min", [f.cuda[i] for f in forms]) for i in range(4))

    def python(m0, m1, Sq, Sk):
        bounds = [f.python(m0, m1, Sq, Sk) for f in forms]
        return (max(b[0] for b in bounds), min(b[1] for b in bounds), max(b[2] for b in bounds),
                min(b[3] for b in bounds))
    return ClosedForm(cuda, python)


@dataclass(frozen=True)
class MaskLowering:
    text: str  # the canonical expression: what a spec stores
    slug: str  # for kernel names: the built-in and its parameters, or expr_<hash>
    visible: str
    classify: str  # reads input ranges through span_<name> (attngen/mask_table.py)
    preamble: str
    closed: ClosedForm | None  # bounds in closed form (no scan): built-ins and bands
    program: Any  # the compiled attngen.maskc program
    # The input reads a kernel may take out of the per-element predicate (maskc.cuda.hoisted_reads): C++
    # reading each row's (no kv_idx in its indices) and each key's (kv_idx, no q_idx), and the predicate
    # over their values rv[i] and kv[i] (mask.cuh.j2 visible_from).
    row_reads: tuple[str, ...] = ()
    key_reads: tuple[str, ...] = ()
    visible_from: str = ""

    def dense_visible(self, q_idx, kv_idx, Sq: int, Sk: int, b=0, h=0, inputs=None):
        """The predicate on broadcastable torch integer tensors (the reference's mask); `inputs`:
        the runtime inputs it reads, by name."""
        return self.program.dense(q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs)


    def closed_bounds(self, m0: int, m1: int, Sq: int, Sk: int,
                      inputs: dict | None = None, b: int = 0) -> tuple[int, int, int, int]:
        if self.closed.reads_inputs:
            return self.closed.python(m0, m1, Sq, Sk, inputs=inputs, b=b)
        return self.closed.python(m0, m1, Sq, Sk)

    def bounds(self, m0: int, m1: int, Sq: int, Sk: int, block_n: int, b: int = 0,
               h: int = 0, inputs: dict | None = None, granule: int | None = None) -> tuple[int, int, int, int]:
        """(kv_begin, kv_end, full_begin, full_end) for query rows [m0, m1), as the kernel computes them
        (with the call's runtime inputs and the block table's granule: as its table holds them)."""
        if self.closed is not None:
            return self.closed_bounds(m0, m1, Sq, Sk, inputs, b)
        return scan_bounds(lambda n0, n1: self.program.classify(m0, m1 - 1, n0, n1 - 1, Sq, Sk, b=b, h=h,
                                                                inputs=inputs, granule=granule), Sk, block_n)

    def key_blocks(self, m0: int, m1: int, Sq: int, Sk: int, block_n: int, b: int = 0, h: int = 0,
                   inputs: dict | None = None, granule: int | None = None) -> list[tuple[int, bool]]:
        """The key-block list a forward kernel walks for rows [m0, m1) of a mask with a block table
        (mask.cuh.j2 build_table): (n_block, full) of every non-empty block, the last first."""
        blocks = []
        for n_block in reversed(range(-(-Sk // block_n))):
            n0 = n_block * block_n
            c = self.program.classify(m0, m1 - 1, n0, min(n0 + block_n, Sk) - 1, Sq, Sk, b=b, h=h, inputs=inputs,
                                      granule=granule)
            if c != "empty":
                blocks.append((n_block, c == "full"))
        return blocks


_CLASS = {"empty": 0, "partial": 1, "full": 2}


def scan_bounds(classify: Callable[[int, int], str], Sk: int, block_n: int) -> tuple[int, int, int, int]:
    """The bounds a block table entry holds (mask.cuh.j2 build_table, which classifies 32 blocks per
    step): one pass over the key blocks [n0, n1); the first and last not empty, and the first run
    of full ones."""
    kv_begin = kv_end = full_begin = full_end = 0
    seen = in_run = run_over = False
    for n0 in range(0, Sk, block_n):
        n1 = min(n0 + block_n, Sk)
        c = _CLASS[classify(n0, n1)]
        if c != 0:
            if not seen:
                kv_begin = n0
            seen, kv_end = True, n1
        if c == 2 and not run_over:
            if not in_run:
                full_begin = n0
            in_run, full_end = True, n1
        elif in_run:
            in_run, run_over = False, True
    return kv_begin, kv_end, full_begin, full_end


def get_mask(text: str) -> MaskLowering:
    """The lowering of a mask's text; ValueError naming mask= and what is allowed otherwise."""
    if not isinstance(text, str):  # before the cache: an unhashable value is a user mistake too
        raise ValueError(f"mask={show(text)} is invalid; allowed: {ALLOWED}")
    return _lower(text)


@functools.lru_cache(maxsize=1024)
def _lower(text: str) -> MaskLowering:
    from attngen import maskc
    from attngen.mask_table import span_ref
    from attngen.maskc.cuda import hoisted_reads, point_code, read_code
    from attngen.maskc.parse import parse
    from attngen.runtime_inputs import input_ref

    try:
        canonical = maskc.stored_text(text, "mask")
        program = maskc.compile_mask(canonical)  # every spelling lowers from the stored text: one kernel
    except maskc.ExprError as exc:
        raise ValueError(f"mask={show(text)} is invalid: {exc}; allowed: {ALLOWED}") from None
    closed = closed_form(canonical, parse(canonical, "mask").builtin) or band_form(program, input_ref)
    # Runtime inputs are read from the kernel's argument struct p (attngen/runtime_inputs.py).
    rows, keys = hoisted_reads(program.ir)
    values = {n: f"rv[{i}]" for i, n in enumerate(rows)} | {n: f"kv[{i}]" for i, n in enumerate(keys)}
    return MaskLowering(canonical, program.slug, program.cuda_visible(input_ref),
                        program.cuda_classify(input_ref, span_ref), maskc.cuda_preamble(), closed, program,
                        tuple(read_code(n, input_ref) for n in rows), tuple(read_code(n, input_ref) for n in keys),
                        point_code(program.ir, input_ref, values))


# The square problems causal_shaped() looks at (up to a million positions: a literal in a mask, such as
# a window's width, changes its shape only past that many), and the 128-row blocks it checks in each.
SHAPE_MODEL_LENGTHS = (2048, 16384, 131072, 1 << 20)
SHAPE_MODEL_BLOCK = 128


@functools.lru_cache(maxsize=256)
def causal_shaped(text: str) -> bool:
    """Whether a mask that reads no runtime input provably has causal's block structure on square
    problems: for each checked query block, every key before it visible (full), every key after it
    hidden (empty) and its diagonal block partial, as the classifier's interval arithmetic shows it
    (e.g. `q_idx >= kv_idx`). Such a mask's tiles have causal's lengths, so a family may schedule
    them as causal's; the choice affects speed only (docs/perf-notes.md "Per-tile cost"). A mask that
    reads inputs counts when it is causal shifted by them: a band with one upper bound, q plus lengths,
    scalars and a constant, and no lower bound (a context-parallel shard's `kv_idx + kv_offset <= q_idx +
    q_offset`), whose tiles' lengths grow with the row as the built-in causal's do when Sq != Sk (not one read
    per batch row: its tiles' lengths would differ from one row to the next)."""
    from attngen.maskc.bands import AT_BATCH, Bound, band
    from attngen.maskc.ir import Var, walk

    mask = get_mask(text)
    if mask.text in ("causal", "none"):
        return mask.text == "causal"
    if mask.program.inputs:
        shifted = band(mask.program.ir)
        return shifted is not None and not shifted.lower and len(shifted.upper) == 1 \
            and isinstance(shifted.upper[0], Bound) and shifted.upper[0].slope == 1 \
            and not any(name.endswith(AT_BATCH) for name, _ in shifted.upper[0].inputs)
    if any(isinstance(node, Var) and node.name in ("b", "h") for node in walk(mask.program.ir)):
        return False  # its shape may change from one batch or head to the next
    block = SHAPE_MODEL_BLOCK
    for n in SHAPE_MODEL_LENGTHS:
        last = n - block
        for m0 in sorted({0, block, n // 2, last - block, last}):
            m1 = m0 + block
            classify = functools.partial(mask.program.classify, m0, m1 - 1, q_len=n, kv_len=n)
            if classify(m0, m1 - 1) != "partial" or (m0 > 0 and classify(0, m0 - 1) != "full") \
                    or (m1 < n and classify(m1, n - 1) != "empty"):
                return False
    return True


def is_band(text: str) -> bool:
    """Whether a mask is none, causal or a band (attngen/maskc/bands.py) whose bounds are affine in the row: no
    chunk's division, and no `or`'s max of two ends (a prefix's: 24 bytes spilled beside fwd_sm80's packed
    sequences at d128)."""
    from attngen.maskc.bands import Bound, band

    mask = get_mask(text)
    found = band(mask.program.ir)
    return mask.text in ("none", "causal") or found is not None and all(isinstance(x, Bound) for x in found.upper)


def bounds_read_at_batch(text: str) -> bool:
    """Whether a mask's closed-form bounds read an input at the batch row (a prefix per sequence, `plen[b]`)."""
    from attngen.maskc.bands import AT_BATCH, band

    found = band(get_mask(text).program.ir)
    return found is not None and any(name.endswith(AT_BATCH) for x in (*found.lower, *found.upper)
                                     for name, _ in x.inputs)


def row_interval(text: str) -> bool:
    """Whether a mask has a closed form (the built-ins none, causal, sliding windows, chunks and their
    conjunctions, and bands, attngen/maskc/bands.py: `q_idx >= kv_idx`, a context-parallel shard's
    `kv_idx + kv_offset <= q_idx + q_offset`, a prefix per batch row `prefix_lm(plen[b])`). The kernels mask
    such rows as they mask the built-in causal's, by the row's two bounds (ROW_INTERVAL), with no predicate
    and no input read per element, so a family may give it the tile it gives none and causal: no more
    registers live, but for what a family holds beside them (fwd_sm80 default_config names the cases that
    spilled; they are compiled in tests/test_mask_bands.py). Masks that read inputs at a position or at h
    are not."""
    return get_mask(text).closed is not None


def mask_problem(problem, per_sequence_tiles: bool = False) -> str | None:
    """Why a problem's mask cannot be lowered (None when it can): for a family's supports(). A varlen
    problem (packed sequences) needs a family whose tiles follow the sequences (per_sequence_tiles)."""
    if getattr(problem, "varlen", False):
        from attngen.varlen import native_reason

        if not per_sequence_tiles:
            return "packed sequences (varlen) run on a family that tiles per sequence (fwd_sm90, fwd_sm80)"
        reason = native_reason(problem)
        if reason is not None:
            return reason
    try:
        get_mask(problem.mask)
    except ValueError as exc:
        return str(exc)
    return None


def canonical(text: str) -> str:
    """The canonical text of a mask (what AttentionSpec stores); ValueError as get_mask."""
    return get_mask(text).text
