"""Band masks: conjunctions of comparisons that bound kv_idx by q_idx (or by nothing) plus lengths, scalar inputs
and constants.

A comparison whose two sides differ by an affine function of q_idx, kv_idx, q_len, kv_len and int inputs without an
index (scalars such as a context-parallel shard's `q_offset`), in which kv_idx has coefficient +-1 and q_idx either
0 or the opposite of kv_idx's, bounds the keys of row q on one side by a function of q that never decreases:
`q_idx >= kv_idx` (keys up to q), `q_idx - kv_idx < 4096` (keys after q - 4096), `kv_idx < 100`,
`kv_idx >= q_idx + kv_len - q_len` (keys from the aligned diagonal on); abs, min and max count where they split
into such exactly (`abs(q_idx - kv_idx) <= 128`, `kv_idx < min(q_idx + 1, 4096)`). A conjunction of such shows
every row one interval of keys, [max of its lower bounds, min of its upper bounds), and shows the rows [m0, m1)
together

    some row: [lo(m0), hi(m1 - 1))        every row: [lo(m1 - 1), hi(m0))

(both bounds never decrease in q), exactly. So a mask a user writes out as a band (causal or a sliding window
spelled as an expression) gets closed-form bounds and per-row interval masking like the built-ins
(attngen/masks.py), with no block table, no scan and no predicate per element; `kv_idx + kv_offset <= q_idx +
q_offset` too, its bounds reading the two scalars.

Two more shapes are bands, exactly:
- an int input read at b alone (a length per sequence, `plen[b]`) is a constant of the batch row, as a scalar is of
  the call: its bounds read it at the row's batch (never at h: a decode CTA holds several query heads);
- an `or` of bands with the same lower bounds: [lo, hi1) | [lo, hi2) is [lo, max(hi1, hi2)), and a max of bounds
  that never decrease never decreases (Widest). So `prefix_lm(plen[b])`, `kv_idx < plen[b] or causal`, is row q's
  [0, max(plen[b], q + 1 + kv_len - q_len)).

Anything else (a product of indices, `//`, `%`, an `or` whose sides start apart, `!=`, b or h as a value, an input
read at a position or at h) is not a band: None, and the mask keeps its table.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.maskc.ir import Const, Input, Node, Op, Type, Var, make

# Kept far from long long's range: the C++ evaluates slope * row + a * q_len + b * kv_len + sum(d * input) + c in
# 64 bits with rows, lengths and int32 inputs below 2^31 in size, so coefficients up to 2^16 and |c| <= 2^40 keep
# every term below 2^48.
MAX_LENGTH_COEFFICIENT = 2**16
MAX_CONSTANT = 2**40

_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_AFFINE_VARS = ("q_idx", "kv_idx", "q_len", "kv_len")
_INPUT = "in:"  # the key of a scalar input's coefficient in an affine form
AT_BATCH = "@b"  # an input name's suffix in a Bound: read at the batch row (`plen[b]`), not a scalar


def _read_value(values: dict | None, key: str, b: int) -> int:
    """An input's value in a bound: a scalar's, or (key name@b) the batch row b's element; 0 where not given."""
    if not values or key.removesuffix(AT_BATCH) not in values:
        return 0
    value = values[key.removesuffix(AT_BATCH)]
    return int(value[b] if key.endswith(AT_BATCH) else value)


def _read_code(key: str, input_ref) -> str:
    """The C++ that reads a bound's input: a scalar's, or its element at the bounds' `batch`."""
    return input_ref(key.removesuffix(AT_BATCH), ["batch"] if key.endswith(AT_BATCH) else [])


@dataclass(frozen=True)
class Bound:
    """slope * q + q_len_coef * q_len + kv_len_coef * kv_len + sum(coef * input) + constant, for row q (slope 0
    or 1); inputs: (name, coef) of int inputs, sorted by name: scalars, and name@b for one read at the batch row."""

    slope: int
    q_len_coef: int
    kv_len_coef: int
    constant: int
    inputs: tuple[tuple[str, int], ...] = ()

    def at(self, q: int, q_len: int, kv_len: int, values: dict | None = None, b: int = 0) -> int:
        """The bound at row q of batch row b; values: each input's value (a Python int or a tensor: 0-d for a
        scalar, indexed by b for name@b), 0 where not given."""
        read = sum(c * _read_value(values, name, b) for name, c in self.inputs)
        return self.slope * q + self.q_len_coef * q_len + self.kv_len_coef * kv_len + read + self.constant

    def cuda(self, row: str, input_ref) -> str:
        """64-bit C++ over the row expression `row`, the ints Sq, Sk, batch and the inputs as input_ref reads them."""
        terms = [(self.slope, f"(long long)({row})"), (self.q_len_coef, "(long long)Sq"),
                 (self.kv_len_coef, "(long long)Sk"),
                 *((c, f"(long long){_read_code(name, input_ref)}") for name, c in self.inputs)]
        code = ""
        for c, t in [*((c, t) for c, t in terms if c), (self.constant, "")]:
            if c == 0 and (code or t):
                continue
            sign = "-" if c < 0 else "+"
            piece = f"{abs(c)}LL" if not t else t if abs(c) == 1 else f"{abs(c)}LL * {t}"
            code = f"{code} {sign} {piece}" if code else (f"-{piece}" if c < 0 else piece)
        return f"({code})"


@dataclass(frozen=True)
class Widest:
    """The largest of its options' upper bounds, each option the smallest of its bounds: the upper end of an `or`
    of bands that start alike. Never decreasing in q, as each of them is."""

    options: tuple[tuple[Bound | Widest, ...], ...]

    @property
    def inputs(self) -> tuple[tuple[str, int], ...]:
        return tuple(i for option in self.options for bound in option for i in bound.inputs)

    def at(self, q: int, q_len: int, kv_len: int, values: dict | None = None, b: int = 0) -> int:
        return max(min(x.at(q, q_len, kv_len, values, b) for x in option) for option in self.options)

    def cuda(self, row: str, input_ref) -> str:
        return fold("maskc_max", [fold("maskc_min", [x.cuda(row, input_ref) for x in option])
                                  for option in self.options])


def fold(pick: str, exprs: list[str]) -> str:
    """C++ pick(pick(e0, e1), e2)... over one or more expressions (one: itself)."""
    code = exprs[0]
    for e in exprs[1:]:
        code = f"{pick}({code}, {e})"
    return code


@dataclass(frozen=True)
class Band:
    """Row q sees the keys k with lower_i(q) <= k < upper_j(q) for every i, j (and 0 <= k < kv_len)."""

    lower: tuple[Bound, ...]
    upper: tuple[Bound | Widest, ...]


def band(ir: Node) -> Band | None:
    """The band a mask's IR is, or None when it is not one (module docstring)."""
    found = _band(ir)
    return None if found is None or not found.lower and not found.upper else found


def _band(ir: Node) -> Band | None:
    """band() without its last check: a side of an `or` may bound nothing (every key from its lower bounds on)."""
    if isinstance(ir, Op) and ir.op == "or":
        sides = [_band(arg) for arg in ir.args]
        if any(side is None for side in sides) or len({frozenset(side.lower) for side in sides}) != 1:
            return None  # sides that start apart may leave a hole between them
        if any(not side.upper for side in sides):
            return Band(sides[0].lower, ())  # one side reaches the row's end
        return Band(sides[0].lower, (Widest(tuple(side.upper for side in sides)),))
    terms = ir.args if isinstance(ir, Op) and ir.op == "and" else (ir,)
    lower: list[Bound] = []
    upper: list[Bound | Widest] = []
    for term in terms:
        if isinstance(term, Op) and term.op == "or":
            inner = _band(term)
            if inner is None:
                return None
            lower += inner.lower
            upper += inner.upper
            continue
        atoms = _atoms(term)
        if atoms is None:
            return None
        for atom in atoms:
            sides = _comparison(atom)
            if sides is None:
                return None
            lower += sides[0]
            upper += sides[1]
    return Band(tuple(dict.fromkeys(lower)), tuple(dict.fromkeys(upper)))


def _atoms(node: Node) -> list[Op] | None:
    """A conjunct as comparisons whose sides hold no abs, min or max at the top, or None: `not` moves into
    the comparison, and `abs(e) < r` is `e < r and -e < r`, `e < min(a, b)` is `e < a and e < b`,
    `max(a, b) < e` is `a < e and b < e` (likewise for <=, >, >=), exactly, for integers."""
    negate = False
    while isinstance(node, Op) and node.op == "not":
        node, negate = node.args[0], not negate
    if not (isinstance(node, Op) and node.op in _NEGATED and all(a.type is Type.INT for a in node.args)):
        return None
    op = _NEGATED[node.op] if negate else node.op
    if op in ("eq", "ne"):
        return [make(op, *node.args)]
    small, big = node.args if op in ("lt", "le") else node.args[::-1]
    less = "lt" if op in ("lt", "gt") else "le"
    if isinstance(small, Op) and small.op == "abs":
        parts = [make(less, small.args[0], big), make(less, make("neg", small.args[0]), big)]
    elif isinstance(small, Op) and small.op == "max":
        parts = [make(less, x, big) for x in small.args]
    elif isinstance(big, Op) and big.op == "min":
        parts = [make(less, small, y) for y in big.args]
    else:
        return [make(less, small, big)]
    out = []
    for part in parts:
        if isinstance(part, Const):  # folded: True adds nothing; False would hide every key (not a band)
            if part.value:
                continue
            return None
        atoms = _atoms(part)
        if atoms is None:
            return None
        out += atoms
    return out


def _comparison(node: Op) -> tuple[list[Bound], list[Bound]] | None:
    """The lower and upper bounds one comparison puts on kv_idx, or None."""
    op = node.op
    left, right = (_affine(a) for a in node.args)
    if left is None or right is None or op == "ne" or not (_small(left) and _small(right)):
        return None
    diff = {v: left.get(v, 0) - right.get(v, 0) for v in {*_AFFINE_VARS, "1", *left, *right}}  # diff op 0
    if not any(c for v, c in diff.items() if v != "1"):  # a constant: true bounds nothing, false hides every key
        holds = {"lt": diff["1"] < 0, "le": diff["1"] <= 0, "gt": diff["1"] > 0, "ge": diff["1"] >= 0,
                 "eq": diff["1"] == 0, "ne": diff["1"] != 0}[op]
        return ([], []) if holds else ([], [Bound(0, 0, 0, 0)])
    if diff["kv_idx"] not in (1, -1):
        return None
    if diff["kv_idx"] == -1:
        diff, op = {v: -c for v, c in diff.items()}, _FLIPPED[op]
    # kv_idx + rest op 0, i.e. kv_idx op x(q) = -rest: q_idx's coefficient in x must be 0 or 1.
    inputs = tuple(sorted((v[len(_INPUT):], -c) for v, c in diff.items() if v.startswith(_INPUT) and c))
    x = Bound(-diff["q_idx"], -diff["q_len"], -diff["kv_len"], -diff["1"], inputs)
    coefficients = [x.q_len_coef, x.kv_len_coef, *(c for _, c in inputs)]
    if x.slope not in (0, 1) or max(map(abs, coefficients)) > MAX_LENGTH_COEFFICIENT \
            or abs(x.constant) > MAX_CONSTANT - 1:
        return None
    plus_one = Bound(x.slope, x.q_len_coef, x.kv_len_coef, x.constant + 1, inputs)
    return {"lt": ([], [x]), "le": ([], [plus_one]), "gt": ([plus_one], []), "ge": ([x], []),
            "eq": ([x], [plus_one])}[op]


def _small(form: dict[str, int]) -> bool:
    """Whether each side stays far from long long's range on its own, as the element predicate evaluates it (a side
    that wraps around there would make the predicate and the band disagree; docs/masks.md: integers are exact)."""
    return all(abs(c) <= (MAX_CONSTANT - 1 if v == "1" else MAX_LENGTH_COEFFICIENT) for v, c in form.items())


def _affine(node: Node) -> dict[str, int] | None:
    """An int node as {variable, "in:<input>" or "1": coefficient}, or None when it is not affine in q_idx,
    kv_idx, q_len, kv_len, scalar int inputs and int inputs read at b alone (`plen[b]`: "in:plen@b"). b and h as
    values are left out (a band's shape may change from one batch row to the next only through an input read
    there), and so is anything read at h: decode's CTAs hold several query heads."""
    if isinstance(node, Const) and node.type is Type.INT:
        return {"1": node.value}
    if isinstance(node, Input):
        if node.type is not Type.INT:
            return None
        if not node.index:
            return {_INPUT + node.name: 1}
        at_batch = len(node.index) == 1 and isinstance(node.index[0], Var) and node.index[0].name == "b"
        return {_INPUT + node.name + AT_BATCH: 1} if at_batch else None
    if isinstance(node, Var):
        return {node.name: 1} if node.name in _AFFINE_VARS else None
    if not isinstance(node, Op) or node.type is not Type.INT:
        return None
    args = [_affine(a) for a in node.args]
    if any(a is None for a in args):
        return None
    if node.op == "neg":
        return {v: -c for v, c in args[0].items()}
    if node.op in ("add", "sub"):
        sign = -1 if node.op == "sub" else 1
        out = dict(args[0])
        for a in args[1:]:
            for v, c in a.items():
                out[v] = out.get(v, 0) + sign * c
        return out
    if node.op == "mul":
        scale, other = (args[0], args[1]) if set(args[0]) <= {"1"} else (args[1], args[0])
        if not set(scale) <= {"1"}:
            return None  # a product of two variables
        k = scale.get("1", 0)
        return {v: k * c for v, c in other.items()}
    return None
