"""d/d(score) of a score modifier, symbolically, as IR of the same language; and d/d(input) for a
float runtime input it reads (a learned bias, ALiBi slopes).

The backward kernel needs the derivative of the modified score with respect to the raw score, and
for a runtime input that requires grad, with respect to that input's value at the element; both are
built here from the IR with the usual rules (product, quotient, chain) and then lowered like any
score modifier. Comparisons and integer parts are piecewise constant in score, so they
differentiate to zero, and where(c, a, b) differentiates to where(c, a', b').

A derivative is carried as (expression, exact rational scale): constant factors such as the c and
1/c of softcap multiply the scale exactly instead of appearing in the expression, so
d/dscore[c * tanh(score / c)] comes out as `1.0 - tanh(score / c) * tanh(score / c)` with no
`c * (1/c)` rounding. At points where a function is not differentiable (abs at 0, min/max at a tie)
the value follows torch's autograd convention: sign(0) = 0, and min(a, a) gives a'.
"""

from __future__ import annotations

from fractions import Fraction

from attngen.maskc.ir import Const, Input, Node, Op, Type, Var, const, make, walk

ONE = const(1.0)
ZERO = (None, Fraction(0))  # (expression, scale): the derivative is scale * expression; None is zero


def derivative(node: Node, wrt: str | None = None) -> Node:
    """d(node)/d(score) as a float node; with `wrt`, d(node)/d(inputs[wrt][...]) at the element: every
    read of that input is the variable (callers make sure all reads are at one index)."""
    return _materialize(_d(node, wrt))


def _is_variable(node: Node, wrt: str | None) -> bool:
    if wrt is None:
        return isinstance(node, Var) and node.name == "score"
    return isinstance(node, Input) and node.name == wrt and node.type is Type.FLOAT


def _depends(node: Node, wrt: str | None) -> bool:
    return any(_is_variable(n, wrt) for n in walk(node))


def _materialize(d) -> Node:
    expr, scale = d
    if expr is None or scale == 0:
        return const(0.0)
    if scale < 0:
        return make("neg", _materialize((expr, -scale)))
    # A scale outside the float32 range is applied in exact power-of-two steps first.
    big = Fraction(2) ** 100
    while scale > big:
        expr, scale = make("mul", const(float(big)), expr), scale / big
    while scale < 1 / big:
        expr, scale = make("mul", const(float(1 / big)), expr), scale * big
    return expr if scale == 1 else make("mul", const(float(scale)), expr)


def _times(e: Node, x: Node) -> Node:
    if e == ONE:
        return x
    if x == ONE:
        return e
    return make("mul", x, e)


def _divided(e: Node, y: Node) -> Node:
    return make("truediv", e, y)


def _sum(da, db, sign: int):
    """da + sign * db."""
    if da[0] is None:
        return db[0], sign * db[1]
    if db[0] is None:
        return da
    (ea, sa), (eb, sb) = da, (db[0], sign * db[1])
    if ea == eb:
        return (None, Fraction(0)) if sa + sb == 0 else (ea, sa + sb)
    if sb == sa:
        return make("add", ea, eb), sa
    if sb == -sa:
        return make("sub", ea, eb), sa
    return make("add", _materialize((ea, sa)), _materialize((eb, sb))), Fraction(1)


def _select(cond: Node, da, db):
    """d/dscore of where(cond, a, b)."""
    if da[0] is None and db[0] is None:
        return ZERO
    if da[0] is not None and db[0] is not None and da[1] == db[1]:
        return make("where", cond, da[0], db[0]), da[1]
    return make("where", cond, _materialize(da), _materialize(db)), Fraction(1)


def _d(node: Node, wrt: str | None = None):
    if node.type is not Type.FLOAT or not _depends(node, wrt):
        return ZERO
    if not isinstance(node, Op):
        return ONE, Fraction(1)  # the variable itself
    op, args = node.op, node.args
    if op in ("add", "sub"):
        return _sum(_d(args[0], wrt), _d(args[1], wrt), 1 if op == "add" else -1)
    if op == "neg":
        e, s = _d(args[0], wrt)
        return e, -s
    if op == "mul":
        return _sum(_product_part(args[0], args[1], wrt), _product_part(args[1], args[0], wrt), 1)
    if op == "truediv":
        a, b = args
        e, s = _d(a, wrt)
        part_a = ZERO
        if e is not None:
            part_a = (e, s / Fraction(b.value)) if isinstance(b, Const) and b.value != 0 else (_divided(e, b), s)
        e, s = _d(b, wrt)
        part_b = ZERO if e is None else (_divided(_times(e, a), make("mul", b, b)), -s)
        return _sum(part_a, part_b, 1)
    if op in ("min", "max"):
        first, rest = args[0], (args[1] if len(args) == 2 else make(op, *args[1:]))
        cond = make("le" if op == "min" else "ge", first, rest)
        return _select(cond, _d(first, wrt), _d(rest, wrt))
    if op == "where":
        return _select(args[0], _d(args[1], wrt), _d(args[2], wrt))
    inner, s = _d(args[0], wrt)
    if inner is None:
        return ZERO
    u = args[0]
    if op == "tanh":
        return _times(inner, make("sub", const(1.0), make("mul", node, node))), s
    if op == "exp":
        return _times(inner, node), s
    if op == "log":
        return _divided(inner, u), s
    if op == "sqrt":
        return _divided(inner, node), s / 2
    if op == "abs":
        sign = make("where", make("gt", u, const(0.0)), const(1.0),
                    make("where", make("lt", u, const(0.0)), const(-1.0), const(0.0)))
        return _times(inner, sign), s
    raise ValueError(f"no derivative rule for op {op!r}")


def _product_part(factor: Node, other: Node, wrt: str | None):
    """The term d(factor) * other of the product rule."""
    e, s = _d(factor, wrt)
    if e is None:
        return ZERO
    if isinstance(other, Const):
        return e, s * Fraction(other.value)
    return _times(e, other), s
