"""Interval analysis of a mask over a rectangle of (query, key) positions: empty, full or partial.

The invariant is soundness: "empty" only if no (q, k) in the rectangle is visible, "full" only if
every one is. "partial" is always a correct answer (the kernel then masks per element), so any
loss of precision costs speed, never correctness.

Integers are evaluated as inclusive ranges [lo, hi] (Python ints, so no overflow here); a range
can also be unknown (None: an input read at an index that is not exact over the rectangle).
Booleans are three-valued, as the pair (can be true, can be false). b, h, q_len and kv_len are
exact; q_idx ranges over [q_lo, q_hi] and kv_idx over [kv_lo, kv_hi].

Plain interval arithmetic forgets that two occurrences of q_idx are the same number, so
`kv_idx <= q_idx + d` would be fine but `2 * q_idx >= q_idx + kv_idx` would not. Sums are therefore
evaluated as linear forms: `linearize` writes an integer expression as
`cq * q_idx + ck * kv_idx + const + sum(coef * opaque)`, where the coefficients are compile-time
integers and each opaque part (an abs(), a //, a product of two variables, an input, b, h, ...)
is evaluated as a range of its own. A comparison `A op B` is evaluated as `A - B op 0` on the
linear form of A - B, whose extremes over a rectangle are at its corners. That makes causal,
sliding_window, chunked and prefix_lm exact on every rectangle. The CUDA emitter (cuda.py) follows the same
steps, so the kernel classifies exactly as this module does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attngen.maskc.ir import Const, Input, Node, Op, Type, Var

EMPTY, PARTIAL, FULL = "empty", "partial", "full"


@dataclass(frozen=True)
class Range:
    lo: int
    hi: int


@dataclass(frozen=True)
class Tri:
    """A three-valued boolean: which values the expression can take over the rectangle."""

    can_true: bool
    can_false: bool


UNKNOWN_BOOL = Tri(True, True)


@dataclass(frozen=True)
class Linear:
    """cq * q_idx + ck * kv_idx + const + sum(coef * term) with integer coefficients."""

    q: int = 0
    kv: int = 0
    const: int = 0
    terms: tuple = ()  # ((node, coef), ...) in first-seen order, no zero coefficients, no repeats

    def plus(self, other: Linear, scale: int = 1) -> Linear:
        coefs = dict(self.terms)
        for node, coef in other.terms:
            coefs[node] = coefs.get(node, 0) + scale * coef
        return Linear(self.q + scale * other.q, self.kv + scale * other.kv, self.const + scale * other.const,
                      tuple((n, c) for n, c in coefs.items() if c != 0))

    def scaled(self, scale: int) -> Linear:
        return Linear().plus(self, scale)


def is_linear_op(node: Node) -> bool:
    """Whether linearize looks inside node (rather than keeping it as one opaque term)."""
    if isinstance(node, Var):
        return node.name in ("q_idx", "kv_idx")
    if isinstance(node, Const):
        return node.type is Type.INT
    if isinstance(node, Op) and node.type is Type.INT:
        if node.op in ("add", "sub", "neg"):
            return True
        return node.op == "mul" and any(isinstance(a, Const) for a in node.args)
    return False


def linearize(node: Node) -> Linear:
    if not is_linear_op(node):
        return Linear(terms=((node, 1),))
    if isinstance(node, Var):
        return Linear(q=1) if node.name == "q_idx" else Linear(kv=1)
    if isinstance(node, Const):
        return Linear(const=node.value)
    if node.op == "add":
        return linearize(node.args[0]).plus(linearize(node.args[1]))
    if node.op == "sub":
        return linearize(node.args[0]).plus(linearize(node.args[1]), -1)
    if node.op == "neg":
        return linearize(node.args[0]).scaled(-1)
    factor, other = (node.args[0], node.args[1]) if isinstance(node.args[0], Const) else (node.args[1], node.args[0])
    return linearize(other).scaled(factor.value)


def comparison_form(node: Op) -> Linear:
    """The linear form of A - B for an integer comparison `A op B`."""
    return linearize(node.args[0]).plus(linearize(node.args[1]), -1)


def compare_to_zero(op: str, lo: int, hi: int) -> Tri:
    """What `x op 0` can be for x anywhere in [lo, hi]."""
    if op == "lt":
        return Tri(lo < 0, hi >= 0)
    if op == "le":
        return Tri(lo <= 0, hi > 0)
    if op == "gt":
        return Tri(hi > 0, lo <= 0)
    if op == "ge":
        return Tri(hi >= 0, lo < 0)
    can_equal, can_differ = lo <= 0 <= hi, not (lo == 0 and hi == 0)
    return Tri(can_equal, can_differ) if op == "eq" else Tri(can_differ, can_equal)


@dataclass
class Box:
    """The rectangle and the exact scalars of one classification."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int
    scalars: dict  # b, h, q_len, kv_len
    inputs: dict | None = None
    memo: dict = field(default_factory=dict)
    # With a granule, an input read whose last index spans a range takes the min and max of the
    # input over the granules that range touches (the per-call summaries of attngen/mask_table.py).
    granule: int | None = None


def _scaled_range(r: Range, coef: int) -> Range:
    return Range(coef * r.lo, coef * r.hi) if coef >= 0 else Range(coef * r.hi, coef * r.lo)


def linear_range(form: Linear, box: Box) -> Range | None:
    parts = [Range(form.const, form.const), _scaled_range(Range(box.q_lo, box.q_hi), form.q),
             _scaled_range(Range(box.kv_lo, box.kv_hi), form.kv)]
    for node, coef in form.terms:
        r = int_range(node, box)
        if r is None:
            return None
        parts.append(_scaled_range(r, coef))
    return Range(sum(p.lo for p in parts), sum(p.hi for p in parts))


def int_range(node: Node, box: Box) -> Range | None:
    """The range of an int node over the box, or None when unknown."""
    if node not in box.memo:
        box.memo[node] = _int_range(node, box)
    return box.memo[node]


def _int_range(node: Node, box: Box) -> Range | None:
    if is_linear_op(node):
        return linear_range(linearize(node), box)
    if isinstance(node, Var):
        value = box.scalars[node.name]
        return Range(value, value)
    if isinstance(node, Input):
        return _input_range(node, box)
    op, args = node.op, node.args
    if op == "where":
        return _where_range(node, box)
    ranges = [int_range(a, box) for a in args]
    if any(r is None for r in ranges):
        return None
    if op == "mul":
        a, b = ranges
        products = (a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi)
        return Range(min(products), max(products))
    if op == "floordiv":
        d = args[1].value
        return Range(ranges[0].lo // d, ranges[0].hi // d)
    if op == "mod":
        d, r = args[1].value, ranges[0]
        # Within one period the remainder is monotone; across a period boundary it can be anything.
        if r.lo // d == r.hi // d:
            return Range(r.lo % d, r.hi % d)
        return Range(0, d - 1)
    if op == "abs":
        r = ranges[0]
        if r.lo >= 0:
            return r
        if r.hi <= 0:
            return Range(-r.hi, -r.lo)
        return Range(0, max(-r.lo, r.hi))
    if op == "min":
        return Range(min(r.lo for r in ranges), min(r.hi for r in ranges))
    if op == "max":
        return Range(max(r.lo for r in ranges), max(r.hi for r in ranges))
    raise ValueError(f"no interval rule for int op {op!r}")


def _input_range(node: Input, box: Box) -> Range | None:
    """An input's value where every index is exact (and in range of the tensor given), else unknown;
    with box.granule, the last index may span a range (granule_span)."""
    if box.inputs is None or node.name not in box.inputs:
        return None
    index = []
    for d, i in enumerate(node.index):
        r = int_range(i, box)
        if r is not None and r.lo != r.hi and box.granule is not None and d == len(node.index) - 1:
            return granule_span(box.inputs[node.name], index, r.lo, r.hi, box.granule)
        if r is None or r.lo != r.hi:
            return None
        index.append(r.lo)
    number = _read(box.inputs[node.name], index)
    return None if number is None else Range(number, number)


# A range over more granules than this is left unknown: reading it would cost more than the
# block's work (an index such as q_idx * 64); the kernels' span helpers stop at the same count.
MAX_SPAN_GRANULES = 64


def granule_span(value, prefix: list, lo: int, hi: int, granule: int) -> Range | None:
    """The min and max of value[prefix][j] over the granules of `granule` elements that [lo, hi]
    touches (a superset of [lo, hi], so sound); None where [lo, hi] leaves the tensor or touches
    more than MAX_SPAN_GRANULES granules."""
    if hi // granule - lo // granule >= MAX_SPAN_GRANULES:
        return None
    numbers = []
    for j in range(lo // granule * granule, (hi // granule + 1) * granule):
        number = _read(value, [*prefix, j])
        if number is None and j <= hi:
            return None
        if number is not None:
            numbers.append(number)
    return Range(min(numbers), max(numbers))


def _read(value, index: list) -> int | None:
    """value[i][j]... as an int (tensor, array or nested lists); None where an index is out of range."""
    try:
        for i in index:
            if not 0 <= i < len(value):
                return None
            value = value[i]
        return int(value)
    except (TypeError, ValueError, RuntimeError):  # wrong number of indices: leave it unknown
        return None


def _where_range(node: Op, box: Box) -> Range | None:
    cond = tri(node.args[0], box)
    a = int_range(node.args[1], box) if cond.can_true else None
    b = int_range(node.args[2], box) if cond.can_false else None
    if (cond.can_true and a is None) or (cond.can_false and b is None):
        return None
    if not cond.can_false:
        return a
    if not cond.can_true:
        return b
    return Range(min(a.lo, b.lo), max(a.hi, b.hi))


def tri(node: Node, box: Box) -> Tri:
    """What a bool node can be over the box."""
    if isinstance(node, Const):
        return Tri(node.value, not node.value)
    op, args = node.op, node.args
    if op in ("lt", "le", "gt", "ge", "eq", "ne") and args[0].type is Type.INT:
        r = linear_range(comparison_form(node), box)
        return UNKNOWN_BOOL if r is None else compare_to_zero(op, r.lo, r.hi)
    parts = [tri(a, box) for a in args]
    if op in ("eq", "ne"):  # of two bools
        a, b = parts
        equal = Tri((a.can_true and b.can_true) or (a.can_false and b.can_false),
                    (a.can_true and b.can_false) or (a.can_false and b.can_true))
        return equal if op == "eq" else Tri(equal.can_false, equal.can_true)
    if op == "and":
        return Tri(all(p.can_true for p in parts), any(p.can_false for p in parts))
    if op == "or":
        return Tri(any(p.can_true for p in parts), all(p.can_false for p in parts))
    if op == "not":
        return Tri(parts[0].can_false, parts[0].can_true)
    if op == "where":
        c, a, b = parts
        return Tri((c.can_true and a.can_true) or (c.can_false and b.can_true),
                   (c.can_true and a.can_false) or (c.can_false and b.can_false))
    raise ValueError(f"no interval rule for bool op {op!r}")


def classify(node: Node, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int, q_len: int, kv_len: int,
             b: int = 0, h: int = 0, inputs: dict | None = None, granule: int | None = None) -> str:
    """EMPTY, FULL or PARTIAL for the mask node over the inclusive rectangle (granule: Box.granule)."""
    bounds = [int(x) for x in (q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, b, h)]
    q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, b, h = bounds
    if q_lo > q_hi or kv_lo > kv_hi:
        raise ValueError(f"empty rectangle: q [{q_lo}, {q_hi}], kv [{kv_lo}, {kv_hi}] (bounds are inclusive)")
    box = Box(q_lo, q_hi, kv_lo, kv_hi, {"b": b, "h": h, "q_len": q_len, "kv_len": kv_len}, inputs, granule=granule)
    result = tri(node, box)
    if not result.can_true:
        return EMPTY
    if not result.can_false:
        return FULL
    return PARTIAL
