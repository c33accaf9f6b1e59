"""The expression IR: frozen nodes, their types, constant folding and the canonical text.

Four node kinds: `Const` (a typed literal), `Var` (one of the fixed variables), `Input` (a named
runtime input read at integer indices) and `Op` (an operator from the fixed set `OPS`). Every
node carries its type: int, float or bool. Nodes are built only through `make`, which checks
types, inserts the implicit int -> float promotions (`to_float`), folds constants with Python
semantics and applies a few exact simplifications (`x + 0` for ints, `x * 1`, `True and x`, ...).
So two spellings that differ only in whitespace or redundant parentheses give equal nodes, and
`to_text` prints them to the same canonical text.

Only simplifications that are exact for every value are applied: `x + 0.0` is left alone (it
turns -0.0 into 0.0), `x * 0` is folded for ints only (NaN * 0 is NaN), and nothing is
reassociated (float addition is not associative).
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass

# Integer constants stay well inside long long, so the C++ literals and bounds never overflow.
INT_LIMIT = 2**62
# Float constants are float32 on the GPU; a folded constant outside this range is left unfolded.
FLOAT32_MAX = 3.4028234663852886e38

INDEX_VARS = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
SCORE = "score"


class Type(enum.Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"


class IRError(ValueError):
    """A node could not be built (a type error, a bad divisor); the parser adds where it happened."""


@dataclass(frozen=True)
class Const:
    # The type is a field so that Const(1, INT), Const(1.0, FLOAT) and Const(True, BOOL) differ
    # (1 == 1.0 == True in Python, which would otherwise merge them in sets and memo tables).
    value: bool | int | float
    type: Type


@dataclass(frozen=True)
class Var:
    name: str
    type: Type


@dataclass(frozen=True)
class Input:
    name: str
    index: tuple  # of int nodes; () for a scalar input
    type: Type
    # Read as int(name) in a score modifier: an int32 tensor (a mask's, e.g. a shard's q_offset), where a
    # score modifier's inputs are float32 otherwise. Printed back as int(...) so its text re-parses alike.
    as_int: bool = False


@dataclass(frozen=True)
class Op:
    op: str
    args: tuple
    type: Type


Node = Const | Var | Input | Op

ARITH = ("add", "sub", "mul")
INT_DIVISION = ("floordiv", "mod")
FLOAT_FUNCTIONS = ("tanh", "exp", "log", "sqrt")
MINMAX = ("min", "max")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC = ("and", "or")
OPS = (*ARITH, "truediv", *INT_DIVISION, "neg", "abs", *MINMAX, "where", *FLOAT_FUNCTIONS,
       *COMPARISONS, *LOGIC, "not", "to_float")

SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
           "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}

# Python semantics of every op on scalars: used for folding (and by tests as the definition).
SCALAR_SEMANTICS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "neg": operator.neg, "abs": abs,
    "min": lambda *v: min(v), "max": lambda *v: max(v), "where": lambda c, a, b: a if c else b,
    "tanh": math.tanh, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
    "ne": operator.ne, "and": lambda *v: all(v), "or": lambda *v: any(v), "not": operator.not_,
    "to_float": float,
}


def const(value) -> Const:
    """A literal node; bool is checked before int because bool is a subclass of int."""
    if isinstance(value, bool):
        return Const(value, Type.BOOL)
    if isinstance(value, int):
        if abs(value) >= INT_LIMIT:
            raise IRError(f"integer constant {value} is out of range (|value| < 2**62)")
        return Const(value, Type.INT)
    if isinstance(value, float):
        return Const(value, Type.FLOAT)
    raise TypeError(f"not a literal: {value!r}")


def var(name: str) -> Var:
    if name == SCORE:
        return Var(name, Type.FLOAT)
    if name in INDEX_VARS:
        return Var(name, Type.INT)
    raise ValueError(f"unknown variable {name!r}")


def is_const(node: Node, value=None) -> bool:
    """Whether node is a literal (equal to value and of value's type, when value is given)."""
    if not isinstance(node, Const):
        return False
    return value is None or (node.value == value and node.type == const(value).type)


def walk(node: Node):
    """Every node of a tree, parents before children."""
    yield node
    children = node.index if isinstance(node, Input) else node.args if isinstance(node, Op) else ()
    for child in children:
        yield from walk(child)


def depends_on(node: Node, name: str) -> bool:
    return any(isinstance(n, Var) and n.name == name for n in walk(node))


def has_input(node: Node) -> bool:
    return any(isinstance(n, Input) for n in walk(node))


# -- building nodes --------------------------------------------------------------------------------


def to_float(node: Node) -> Node:
    """The implicit promotion of an int operand where a float is needed."""
    if node.type is Type.FLOAT:
        return node
    return make("to_float", node)


def _require(node: Node, types: tuple, what: str) -> None:
    if node.type not in types:
        names = " or ".join(t.value for t in types)
        raise IRError(f"{what} needs {names} operands; got {node.type.value}")


def _unify_numeric(args: tuple, what: str) -> tuple:
    """Numeric operands, all promoted to float when any is float."""
    for a in args:
        _require(a, (Type.INT, Type.FLOAT), what)
    if any(a.type is Type.FLOAT for a in args):
        return tuple(to_float(a) for a in args)
    return args


def _check_types(op: str, args: tuple) -> tuple[tuple, Type]:
    """The operands after promotion, and the result type; IRError on a type error."""
    if op in ARITH:
        args = _unify_numeric(args, f"'{SYMBOLS[op]}'")
        return args, args[0].type
    if op == "truediv":
        args = _unify_numeric(args, "'/'")
        return tuple(to_float(a) for a in args), Type.FLOAT
    if op in INT_DIVISION:
        for a in args:
            _require(a, (Type.INT,), f"'{SYMBOLS[op]}'")
        divisor = args[1]
        if not isinstance(divisor, Const):
            raise IRError(f"the divisor of '{SYMBOLS[op]}' must be a positive integer constant")
        if divisor.value <= 0:
            raise IRError(f"the divisor of '{SYMBOLS[op]}' must be a positive integer constant; got {divisor.value}")
        return args, Type.INT
    if op in ("neg", "abs"):
        args = _unify_numeric(args, "unary minus" if op == "neg" else "abs()")
        return args, args[0].type
    if op in MINMAX:
        if len(args) < 2:
            raise IRError(f"{op}() needs at least 2 arguments")
        args = _unify_numeric(args, f"{op}()")
        return args, args[0].type
    if op in FLOAT_FUNCTIONS:
        args = _unify_numeric(args, f"{op}()")
        return (to_float(args[0]),), Type.FLOAT
    if op in COMPARISONS:
        if op in ("eq", "ne") and all(a.type is Type.BOOL for a in args):
            return args, Type.BOOL
        return _unify_numeric(args, f"'{SYMBOLS[op]}'"), Type.BOOL
    if op in LOGIC or op == "not":
        for a in args:
            _require(a, (Type.BOOL,), f"'{op}'")
        return args, Type.BOOL
    if op == "where":
        cond, a, b = args
        _require(cond, (Type.BOOL,), "the condition of where()")
        if a.type is Type.BOOL or b.type is Type.BOOL:
            if a.type is not b.type:
                types = f"{a.type.value} and {b.type.value}"
                raise IRError(f"where() branches must both be bool or both numbers; got {types}")
            return args, Type.BOOL
        a, b = _unify_numeric((a, b), "where()")
        return (cond, a, b), a.type
    if op == "to_float":
        _require(args[0], (Type.INT,), "to_float")
        return args, Type.FLOAT
    raise ValueError(f"unknown op {op!r}")


def make(op: str, *args: Node) -> Node:
    """The node for op(args): type-checked, promoted, folded and simplified."""
    args, result_type = _check_types(op, tuple(args))
    if op in LOGIC or op in MINMAX:
        # Associative: nested same-op nodes flatten, so `a and (b and c)` == `a and b and c`.
        args = tuple(x for a in args for x in (a.args if isinstance(a, Op) and a.op == op else (a,)))
        if op in LOGIC:  # idempotent: `causal and sliding_window(w, 0)` repeats causal's comparison
            args = tuple(dict.fromkeys(args))
    return _simplify(Op(op, args, result_type))


def _fold(node: Op) -> Node | None:
    """The constant for an op whose operands are all constants, or None where the result is not a
    finite in-range constant (e.g. log(-1.0), 1e38 * 10.0): those stay ops and run at run time."""
    if not all(isinstance(a, Const) for a in node.args):
        return None
    try:
        value = SCALAR_SEMANTICS[node.op](*(a.value for a in node.args))
    except (ArithmeticError, ValueError):
        return None
    if node.type is Type.FLOAT:
        value = float(value)
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            return None
    elif node.type is Type.INT and abs(value) >= INT_LIMIT:
        raise IRError(f"integer constant {value} is out of range (|value| < 2**62)")
    elif node.type is Type.BOOL:
        value = bool(value)
    return const(value)


def _is_positive_zero(node: Node) -> bool:
    return isinstance(node, Const) and node.type is Type.FLOAT and node.value == 0.0 \
        and math.copysign(1.0, node.value) > 0


def _simplify(node: Op) -> Node:
    folded = _fold(node)
    if folded is not None:
        return folded
    op, args = node.op, node.args
    one = const(1) if node.type is Type.INT else const(1.0)
    if op == "add" and node.type is Type.INT:
        kept = [a for a in args if not is_const(a, 0)]
        if len(kept) == 1:
            return kept[0]
    if op == "sub" and (is_const(args[1], 0) or _is_positive_zero(args[1])):
        return args[0]  # x - 0.0 is x even for x = -0.0
    if op == "mul":
        for i, a in enumerate(args):
            if is_const(a, one.value):
                return args[1 - i]
            if node.type is Type.INT and is_const(a, 0):
                return const(0)
    if op == "truediv" and is_const(args[1], 1.0):
        return args[0]
    if op == "floordiv" and args[1].value == 1:
        return args[0]
    if op == "mod" and args[1].value == 1:
        return const(0)
    if op in ("neg", "not") and isinstance(args[0], Op) and args[0].op == op:
        return args[0].args[0]
    if op == "abs" and isinstance(args[0], Op) and args[0].op == "abs":
        return args[0]
    if op in LOGIC:
        identity, absorbing = (True, False) if op == "and" else (False, True)
        if any(is_const(a, absorbing) for a in args):
            return const(absorbing)
        kept = tuple(a for a in args if not is_const(a, identity))
        if not kept:
            return const(identity)
        if len(kept) == 1:
            return kept[0]
        if len(kept) != len(args):
            return Op(op, kept, Type.BOOL)
    if op == "where":
        cond, a, b = args
        if isinstance(cond, Const):
            return a if cond.value else b
        if a == b:
            return a
    return node


# -- canonical text ------------------------------------------------------------------------------

# Python's precedence levels (higher binds tighter), for printing with minimal parentheses.
_PREC_OR, _PREC_AND, _PREC_NOT, _PREC_CMP, _PREC_ADD, _PREC_MUL, _PREC_UNARY, _PREC_ATOM = 1, 2, 3, 4, 6, 7, 8, 9
_BINARY_PREC = {"add": _PREC_ADD, "sub": _PREC_ADD, "mul": _PREC_MUL, "truediv": _PREC_MUL,
                "floordiv": _PREC_MUL, "mod": _PREC_MUL}


def _printed(node: Node) -> tuple[str, int]:
    """Python text for node and the precedence of its outermost operator."""
    if isinstance(node, Const):
        text = repr(node.value)
        negative = node.type is not Type.BOOL and text.startswith("-")
        return text, _PREC_UNARY if negative else _PREC_ATOM
    if isinstance(node, Var):
        return node.name, _PREC_ATOM
    if isinstance(node, Input):
        text = node.name if not node.index else f"{node.name}[{', '.join(to_text(i) for i in node.index)}]"
        return (f"int({text})" if node.as_int else text), _PREC_ATOM
    op, args = node.op, node.args
    if op == "to_float":  # implicit in the language: re-parsing inserts it again
        return _printed(args[0])
    if op in _BINARY_PREC:
        prec = _BINARY_PREC[op]
        left = _wrapped(args[0], lambda p: p < prec)
        right = _wrapped(args[1], lambda p: p <= prec)
        return f"{left} {SYMBOLS[op]} {right}", prec
    if op in COMPARISONS:
        # Comparisons chain in Python, so a comparison operand of a comparison needs parentheses.
        left, right = (_wrapped(a, lambda p: p <= _PREC_CMP) for a in args)
        return f"{left} {SYMBOLS[op]} {right}", _PREC_CMP
    if op in LOGIC:
        prec = _PREC_AND if op == "and" else _PREC_OR
        return f" {op} ".join(_wrapped(a, lambda p: p <= prec) for a in args), prec
    if op == "not":
        return f"not {_wrapped(args[0], lambda p: p < _PREC_NOT)}", _PREC_NOT
    if op == "neg":
        return f"-{_wrapped(args[0], lambda p: p < _PREC_UNARY)}", _PREC_UNARY
    return f"{op}({', '.join(to_text(a) for a in args)})", _PREC_ATOM


def _wrapped(node: Node, needs_parens) -> str:
    text, prec = _printed(node)
    return f"({text})" if needs_parens(prec) else text


def to_text(node: Node) -> str:
    """The canonical text: Python syntax, minimal parentheses, single spaces around operators."""
    return _printed(node)[0]
