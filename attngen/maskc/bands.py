"""Band masks: conjunctions of comparisons that bound kv_idx by q_idx (or by nothing) plus lengths and constants.

A comparison whose two sides differ by an affine function of q_idx, kv_idx, q_len and kv_len, in which kv_idx has
coefficient +-1 and q_idx either 0 or the opposite of kv_idx's, bounds the keys of row q on one side by a function
of q that never decreases: `q_idx >= kv_idx` (keys up to q), `q_idx - kv_idx < 4096` (keys after q - 4096),
`kv_idx < 100`, `kv_idx >= q_idx + kv_len - q_len` (keys from the aligned diagonal on). A conjunction of such shows every row one interval of
keys, [max of its lower bounds, min of its upper bounds), and shows the rows [m0, m1) together

    some row: [lo(m0), hi(m1 - 1))        every row: [lo(m1 - 1), hi(m0))

(both bounds never decrease in q), exactly. So a mask a user writes out as a band (causal or a sliding window
spelled as an expression) gets closed-form bounds and per-row interval masking like the built-ins
(attngen/masks.py), with no block table, no scan and no predicate per element. Anything else (a product of
indices, `//`, `%`, `or`, `!=`, b or h, a runtime input) is not a band: None, and the mask keeps its table.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.maskc.ir import Const, Node, Op, Type, Var

# Kept far from long long's range: the C++ evaluates slope * row + a * q_len + b * kv_len + c in 64 bits with
# rows and lengths below 2^31, so |a|, |b| <= 2^16 and |c| <= 2^40 keep every term below 2^48.
MAX_LENGTH_COEFFICIENT = 2**16
MAX_CONSTANT = 2**40

_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_AFFINE_VARS = ("q_idx", "kv_idx", "q_len", "kv_len")


@dataclass(frozen=True)
class Bound:
    """slope * q + q_len_coef * q_len + kv_len_coef * kv_len + constant, for row q (slope 0 or 1)."""

    slope: int
    q_len_coef: int
    kv_len_coef: int
    constant: int

    def at(self, q: int, q_len: int, kv_len: int) -> int:
        return self.slope * q + self.q_len_coef * q_len + self.kv_len_coef * kv_len + self.constant

    def cuda(self, row: str) -> str:
        """64-bit C++ over the row expression `row` and the ints Sq, Sk."""
        terms = [(self.slope, f"(long long)({row})"), (self.q_len_coef, "(long long)Sq"),
                 (self.kv_len_coef, "(long long)Sk")]
        code = " + ".join(t if c == 1 else f"{c}LL * {t}" for c, t in terms if c != 0)
        if self.constant or not code:
            code = f"{code} + {self.constant}LL" if code else f"{self.constant}LL"
        return f"({code})"


@dataclass(frozen=True)
class Band:
    """Row q sees the keys k with lower_i(q) <= k < upper_j(q) for every i, j (and 0 <= k < kv_len)."""

    lower: tuple[Bound, ...]
    upper: tuple[Bound, ...]


def band(ir: Node) -> Band | None:
    """The band a mask's IR is, or None when it is not one (module docstring)."""
    terms = ir.args if isinstance(ir, Op) and ir.op == "and" else (ir,)
    lower: list[Bound] = []
    upper: list[Bound] = []
    for term in terms:
        sides = _comparison(term)
        if sides is None:
            return None
        lo, hi = sides
        lower += lo
        upper += hi
    if not lower and not upper:
        return None
    return Band(tuple(dict.fromkeys(lower)), tuple(dict.fromkeys(upper)))


def _comparison(node: Node) -> tuple[list[Bound], list[Bound]] | None:
    """The lower and upper bounds one comparison (or `not` of one) puts on kv_idx, or None."""
    negate = False
    while isinstance(node, Op) and node.op == "not":
        node, negate = node.args[0], not negate
    if not (isinstance(node, Op) and node.op in _NEGATED and all(a.type is Type.INT for a in node.args)):
        return None
    op = _NEGATED[node.op] if negate else node.op
    left, right = (_affine(a) for a in node.args)
    if left is None or right is None or op == "ne":
        return None
    diff = {v: left.get(v, 0) - right.get(v, 0) for v in (*_AFFINE_VARS, "1")}  # diff op 0
    if diff["kv_idx"] not in (1, -1):
        return None
    if diff["kv_idx"] == -1:
        diff, op = {v: -c for v, c in diff.items()}, _FLIPPED[op]
    # kv_idx + rest op 0, i.e. kv_idx op x(q) = -rest: q_idx's coefficient in x must be 0 or 1.
    x = Bound(-diff["q_idx"], -diff["q_len"], -diff["kv_len"], -diff["1"])
    if x.slope not in (0, 1) or max(abs(x.q_len_coef), abs(x.kv_len_coef)) > MAX_LENGTH_COEFFICIENT \
            or abs(x.constant) > MAX_CONSTANT - 1:
        return None
    plus_one = Bound(x.slope, x.q_len_coef, x.kv_len_coef, x.constant + 1)
    return {"lt": ([], [x]), "le": ([], [plus_one]), "gt": ([plus_one], []), "ge": ([x], []),
            "eq": ([x], [plus_one])}[op]


def _affine(node: Node) -> dict[str, int] | None:
    """An int node as {variable or "1": coefficient}, or None when it is not affine in q_idx, kv_idx,
    q_len, kv_len (b and h are left out: a band's shape may not change from one batch or head to the next)."""
    if isinstance(node, Const) and node.type is Type.INT:
        return {"1": node.value}
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
