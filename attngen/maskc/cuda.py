"""IR -> CUDA C++: the element predicate, the score modifier and the block classifier.

All C++ is printed from the IR, never from user text: identifiers come from the fixed variable
names, the helper names below and input names (checked against a pattern and a reserved list by
the parser, and routed through the caller's `input_ref`); literals are re-printed here. Integer
code has Python's floor division and modulo (the `maskc_*` helpers; divisors are positive
constants by construction); float code is `float` only (`tanhf`, `2.5f`, no double). Every helper
is `__host__ __device__`, so the same code runs in kernels and in CPU tests.

Integer width. The point code (`point_code`: the element predicate and score modifiers) picks a
width per IR node: 32-bit `int` where `static_range` proves that the node's value and every
operand fit in int32 over the variables' documented ranges (`VAR_RANGES`, the kernel contract),
else `long long`. 64-bit `/` and `%` are emulated on the GPU (tens of instructions and registers
per element), so `kv_idx % 3` as int matters in the inner loop. An int node computes with the
`maskc_*32` helpers on int operands; an operand of the other width is converted explicitly
(`((long long)(x))` up, `((int)(x))` down, the latter only where the operand's range fits), so
no implicit conversion can overflow before a promotion. Comparisons compare as int where both
sides fit, else as long long. The variables arrive as long long (they are read as `((int)q_idx)`
where an int is wanted); inputs are unknown, so long long; input indices are passed to
`input_ref` as long long, as before. The results are those of the all-long-long code for every
point in the documented ranges: int is chosen only where no value leaves int32.

`classify_code` prints the interval analysis of interval.py step by step: one temporary per IR
node (lo/hi of an int range, can-be-true/can-be-false of a bool, and an "ok" flag for ranges that
depend on an input that may be unknown), with the same linear forms, so the kernel and the Python
classify give the same answer for the same inputs.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

from attngen.maskc.interval import comparison_form, is_linear_op, linearize
from attngen.maskc.ir import Const, Input, Node, Op, Type, Var, walk

InputRef = Callable[[str, list], str]
# (input name, C++ of its exact leading indices, C++ of the last index's lo and hi) -> C++ of a
# maskc_span: the input's range over those positions (attngen/mask_table.py reads summaries).
SpanRef = Callable[[str, list, str, str], str]

PREAMBLE = r"""#ifndef ATTNGEN_MASKC_PREAMBLE
#define ATTNGEN_MASKC_PREAMBLE
// An input's values over a range of positions (ok false: unknown).
struct maskc_span {
    long long lo, hi;
    bool ok;
};
// Python's floor division and modulo for a positive divisor d (C++ truncates toward zero).
__host__ __device__ __forceinline__ long long maskc_floordiv(long long a, long long d) {
    long long q = a / d;
    return (a % d < 0) ? q - 1 : q;
}
__host__ __device__ __forceinline__ long long maskc_mod(long long a, long long d) {
    long long r = a % d;
    return r < 0 ? r + d : r;
}
// and, or, where with every operand evaluated: no branch between an element's input reads, which then
// issue together with the other elements' (a short-circuit per element serialised them: each read's
// round trip before the next element's, docs/perf-notes.md "Masks that read inputs, without a branch").
// The kernels evaluate a predicate only at positions whose every read is in range (attngen/runtime_inputs.py
// checks each index over the whole call, whichever branch reads it).
__host__ __device__ __forceinline__ bool maskc_and(bool a, bool b) { return a & b; }
__host__ __device__ __forceinline__ bool maskc_or(bool a, bool b) { return a | b; }
template <class T>
__host__ __device__ __forceinline__ T maskc_where(bool c, T a, T b) { return c ? a : b; }
__host__ __device__ __forceinline__ long long maskc_min(long long a, long long b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ long long maskc_max(long long a, long long b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ long long maskc_abs(long long a) { return a < 0 ? -a : a; }
// The same on int, where the emitter proved every value fits in int32 (d > 0, |a| < 2^31).
__host__ __device__ __forceinline__ int maskc_floordiv32(int a, int d) {
    int q = a / d;
    return (a % d < 0) ? q - 1 : q;
}
__host__ __device__ __forceinline__ int maskc_mod32(int a, int d) {
    int r = a % d;
    return r < 0 ? r + d : r;
}
__host__ __device__ __forceinline__ int maskc_min32(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int maskc_max32(int a, int b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int maskc_abs32(int a) { return a < 0 ? -a : a; }
// tanh on the GPU in a few registers (the library tanhf's polynomial and branches spill the
// attention kernels' registers), to a few ulp relative: an odd Taylor polynomial below 0.35, where
// 1 - 2 / (e^(2x) + 1) loses digits to cancellation (1e-4 relative at x = 1e-3: a softcapped
// score's LSE off by far more than fp32 rounding), that formula above it; +-inf give +-1. e^(2|x|) is
// 2^(|x| * 2 log2(e)) (the same product as __expf's 2|x| * log2(e): doubling is exact) through the flushing
// ex2, which __expf is not: its argument is >= 0 here, so nothing to flush, and 3 fewer instructions.
__host__ __device__ __forceinline__ float maskc_tanhf(float x) {
#ifdef __CUDA_ARCH__
    const float ax = fabsf(x), x2 = x * x;
    const float series = fmaf(x * x2, fmaf(x2, fmaf(x2, fmaf(x2, fmaf(x2, -1382.0f / 155925.0f,
        62.0f / 2835.0f), -17.0f / 315.0f), 2.0f / 15.0f), -1.0f / 3.0f), x);
    float e2x;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e2x) : "f"(ax * 2.88539008177792681f));
    const float saturating = copysignf(1.0f - __fdividef(2.0f, e2x + 1.0f), x);
    return ax < 0.35f ? series : saturating;
#else
    return tanhf(x);
#endif
}
#endif
"""


def cuda_preamble() -> str:
    """The helpers every emitted expression may call; include-guarded, so it can be pasted twice."""
    return PREAMBLE


def default_input_ref(name: str, index: list) -> str:
    return name + "".join(f"[{i}]" for i in index)


def int_literal(value: int) -> str:
    if abs(value) >= 2**63 - 1:
        raise ValueError(f"integer {value} does not fit in long long")
    return f"{value}LL" if value >= 0 else f"({value}LL)"


def float_literal(value: float) -> str:
    """The float32 value of a constant, printed so that C++ reads back exactly that float."""
    try:
        rounded = _float32(value)
    except OverflowError:
        raise ValueError(f"constant {value!r} does not fit in float32") from None
    if not math.isfinite(rounded):
        raise ValueError(f"constant {value!r} is not a finite float32")
    text = f"{rounded:.9g}"  # 9 significant digits round-trip any float32
    if not any(c in text for c in ".en"):
        text += ".0"
    return f"{text}f" if not text.startswith("-") else f"({text}f)"


def _float32_reciprocal(divisor: Node) -> float | None:
    """1 / c correctly rounded to float32 for a constant divisor c whose reciprocal is a normal float32, else
    None. x * (1 / c) is then two roundings, the error the fp32 model allows a division (dense.py
    evaluation_error: 2 U32 relative), where `x / c` compiles to the IEEE division: a check and a called slow
    path per element, ~7 instructions and a branch each (softcap's `score / c` was a fifth of its loop)."""
    node = divisor.args[0] if isinstance(divisor, Op) and divisor.op == "to_float" else divisor
    if not isinstance(node, Const) or node.type is Type.BOOL:
        return None
    try:
        c = _float32(node.value)  # the literal as the kernel holds it (float_literal prints this value)
        # In double, then rounded to float32: the correctly rounded float32 quotient (53 >= 2 * 24 + 2 bits).
        r = _float32(1.0 / c) if c != 0 and math.isfinite(c) else math.inf
    except OverflowError:
        return None
    return r if math.isfinite(r) and abs(r) >= 2.0**-126 else None


def _float32(value: float) -> float:
    """The float32 nearest `value` (OverflowError beyond float32's range; no numpy here: `attngen generate`
    imports neither numpy nor torch)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


# -- static ranges and integer widths -----------------------------------------------------------------

# The kernel contract: the values the variables can take (docs/masks.md). Inputs are unknown.
VAR_RANGES = {
    "q_idx": (0, 2**31 - 2), "kv_idx": (0, 2**31 - 2),
    "q_len": (1, 2**31 - 1), "kv_len": (1, 2**31 - 1),
    "b": (0, 65534), "h": (0, 65534),
}
# Values an int node may take: symmetric, so -x and abs(x) of such a value fit too, and no literal
# is INT_MIN (which C++ cannot spell as a literal).
INT32_MIN, INT32_MAX = -(2**31 - 1), 2**31 - 1
INT, LONG = "int", "long long"


def static_range(node: Node, memo: dict | None = None, var_ranges: dict | None = None) -> tuple[int, int] | None:
    """Sound bounds (lo, hi) of an int node over every point of `var_ranges` (default VAR_RANGES,
    the kernel contract; a call's own ranges give tighter ones) and every input value, by plain
    interval arithmetic on Python ints; None where unbounded (an input, or anything whose bound
    depends on one). A memo belongs to one var_ranges."""
    memo = {} if memo is None else memo
    if node not in memo:
        memo[node] = _static_range(node, memo, VAR_RANGES if var_ranges is None else var_ranges)
    return memo[node]


def _static_range(node: Node, memo: dict, var_ranges: dict) -> tuple[int, int] | None:
    if node.type is not Type.INT:
        return None
    if isinstance(node, Const):
        return node.value, node.value
    if isinstance(node, Var):
        return var_ranges[node.name]
    if isinstance(node, Input):
        return None
    op, args = node.op, node.args
    if op == "mod":  # whatever the dividend: the divisor d is a positive constant
        d, r = args[1].value, static_range(args[0], memo, var_ranges)
        if r is not None and r[0] // d == r[1] // d:  # within one period the remainder is monotone
            return r[0] % d, r[1] % d
        return 0, d - 1
    ranges = [static_range(a, memo, var_ranges) for a in (args[1:] if op == "where" else args)]
    if any(r is None for r in ranges):
        return None
    if op == "add":
        (alo, ahi), (blo, bhi) = ranges
        return alo + blo, ahi + bhi
    if op == "sub":
        (alo, ahi), (blo, bhi) = ranges
        return alo - bhi, ahi - blo
    if op == "neg":
        lo, hi = ranges[0]
        return -hi, -lo
    if op == "mul":
        (alo, ahi), (blo, bhi) = ranges
        products = (alo * blo, alo * bhi, ahi * blo, ahi * bhi)
        return min(products), max(products)
    if op == "floordiv":
        (lo, hi), d = ranges[0], args[1].value
        return lo // d, hi // d
    if op == "abs":
        lo, hi = ranges[0]
        if lo >= 0:
            return lo, hi
        return (-hi, -lo) if hi <= 0 else (0, max(-lo, hi))
    if op == "where":  # either branch, whatever the condition
        return min(r[0] for r in ranges), max(r[1] for r in ranges)
    if op in ("min", "max"):
        pick = min if op == "min" else max
        return pick(r[0] for r in ranges), pick(r[1] for r in ranges)
    raise ValueError(f"no static range rule for int op {op!r}")


def fits_int32(r: tuple[int, int] | None) -> bool:
    return r is not None and INT32_MIN <= r[0] and r[1] <= INT32_MAX


def int_literal32(value: int) -> str:
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"integer {value} does not fit in int")
    return str(value) if value >= 0 else f"({value})"


# -- point evaluation: visible() and score modifiers -------------------------------------------------

_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!="}
_FLOAT_CALLS = {"tanh": "maskc_tanhf", "exp": "expf", "log": "logf", "sqrt": "sqrtf", "abs": "fabsf", "min": "fminf",
                "max": "fmaxf"}
_INT_CALLS = {"abs": "maskc_abs", "min": "maskc_min", "max": "maskc_max", "floordiv": "maskc_floordiv",
              "mod": "maskc_mod"}
_INT32_CALLS = {op: f"{name}32" for op, name in _INT_CALLS.items()}


def point_code(node: Node, input_ref: InputRef | None = None, read_values: dict | None = None) -> str:
    """A C++ expression for node at one point, over long long q_idx, kv_idx, q_len, kv_len, b, h
    (and float score): bool, float, or long long for an int node (computed as int inside where
    that is exact). read_values: C++ names holding some of its input reads (Input node -> name), read
    beforehand (hoisted_reads)."""
    emitter = _PointEmitter(input_ref or default_input_ref, read_values or {})
    if node.type is Type.INT:
        return emitter.int_code(node, LONG)
    return emitter.code(node)


class _PointEmitter:
    def __init__(self, input_ref: InputRef, read_values: dict):
        self.ref = input_ref
        self.read_values = read_values
        self.ranges: dict = {}

    def fits(self, node: Node) -> bool:
        return fits_int32(static_range(node, self.ranges))

    def width(self, node: Node) -> str:
        """The width an int node computes in: int where its value and its int operands all fit
        (for // and %, the divisor is one of them). Inputs are long long; a variable or a literal
        is printed in whichever width its user wants, so here it is int where it fits."""
        if isinstance(node, Input):
            return LONG
        operands = node.args[1:] if isinstance(node, Op) and node.op == "where" else \
            node.args if isinstance(node, Op) else ()
        return INT if self.fits(node) and all(self.fits(a) for a in operands) else LONG

    def int_code(self, node: Node, want: str) -> str:
        """An int node as a C++ expression of type `want` (INT only where the node's range fits)."""
        if want == INT and not self.fits(node):
            raise AssertionError(f"int wanted for a node that may not fit in int32: {node}")
        if isinstance(node, Const):
            return int_literal32(node.value) if want == INT else int_literal(node.value)
        if isinstance(node, Var):
            return f"((int){node.name})" if want == INT else node.name
        width = self.width(node)
        code = self._compute(node, width)
        if width == want:
            return code
        return f"((long long)({code}))" if want == LONG else f"((int)({code}))"

    def code(self, node: Node) -> str:
        """A bool or float node; an int node in its own width."""
        if node.type is Type.INT:
            return self.int_code(node, self.width(node))
        if isinstance(node, Const):
            return ("true" if node.value else "false") if node.type is Type.BOOL else float_literal(node.value)
        if isinstance(node, Var):
            return node.name
        if isinstance(node, Input):
            return self._input(node)
        op, args = node.op, node.args
        if op in _INFIX and args[0].type is Type.INT:  # an int comparison: as int where both sides fit
            width = INT if all(self.fits(a) for a in args) else LONG
            return f"({self.int_code(args[0], width)} {_INFIX[op]} {self.int_code(args[1], width)})"
        code = [self.code(a) for a in args]
        reciprocal = _float32_reciprocal(args[1]) if op == "truediv" else None
        if reciprocal is not None:  # x / c as x * (1 / c): no IEEE division (a slow path and a call per element)
            return f"({code[0]} * {float_literal(reciprocal)})"
        if op in _INFIX:
            return f"({code[0]} {_INFIX[op]} {code[1]})"
        if op in ("and", "or"):
            if _reads_input(node):  # every operand evaluated (PREAMBLE); without reads, C++'s own
                return _nested("maskc_and" if op == "and" else "maskc_or", code)
            return "(" + (" && " if op == "and" else " || ").join(code) + ")"
        if op == "not":
            return f"(!{code[0]})"
        if op == "neg":
            return f"(-{code[0]})"
        if op == "where":
            if _reads_input(node):
                return f"maskc_where<{'bool' if node.type is Type.BOOL else 'float'}>({code[0]}, {code[1]}, {code[2]})"
            return f"({code[0]} ? {code[1]} : {code[2]})"
        if op == "to_float":
            return f"((float)({code[0]}))"
        return _call(_FLOAT_CALLS[op], code)

    def _compute(self, node: Node, width: str) -> str:
        """An int Op or Input, computed in width, its int operands converted to width."""
        if isinstance(node, Input):
            return self._input(node)
        op, args = node.op, node.args
        if op == "where":
            arms = self.code(args[0]), self.int_code(args[1], width), self.int_code(args[2], width)
            return f"maskc_where<{width}>({', '.join(arms)})" if _reads_input(node) else f"({arms[0]} ? {arms[1]} : {arms[2]})"
        code = [self.int_code(a, width) for a in args]
        if op in _INFIX:
            return f"({code[0]} {_INFIX[op]} {code[1]})"
        if op == "neg":
            return f"(-{code[0]})"
        return _call((_INT32_CALLS if width == INT else _INT_CALLS)[op], code)

    def _input(self, node: Input) -> str:
        if node in self.read_values:
            return _input_read(node, None, lambda *_: self.read_values[node])
        # Indices reach input_ref as long long, whatever width they were computed in.
        return _input_read(node, [self.int_code(i, LONG) for i in node.index], self.ref)


def read_code(node: Input, input_ref: InputRef | None = None) -> str:
    """The C++ that reads one input element (its own type, not widened), over the point variables."""
    emitter = _PointEmitter(input_ref or default_input_ref, {})
    return (input_ref or default_input_ref)(node.name, [emitter.int_code(i, LONG) for i in node.index])


def hoisted_reads(node: Node) -> tuple[tuple[Input, ...], tuple[Input, ...]]:
    """The distinct input reads of a predicate a kernel can take out of its per-element evaluation: those
    whose indices do not depend on kv_idx (one per row: a row's document id, a batch's prefix length) and
    those that depend on kv_idx but not q_idx (one per key). Reads indexed by both stay in the predicate."""
    reads = list(dict.fromkeys(n for n in walk(node) if isinstance(n, Input)))
    uses = {n: {v.name for v in walk(n) if isinstance(v, Var)} for n in reads}
    rows = tuple(n for n in reads if "kv_idx" not in uses[n])
    keys = tuple(n for n in reads if "kv_idx" in uses[n] and "q_idx" not in uses[n])
    return rows, keys


def _reads_input(node: Node) -> bool:
    return any(isinstance(n, Input) for n in walk(node))


def _call(helper: str, code: list) -> str:
    """helper(a) for one argument; min/max of more than two: nested two-argument calls."""
    if len(code) == 1:
        return f"{helper}({code[0]})"
    return _nested(helper, code)


def _input_read(node: Input, index_code: list, ref: InputRef) -> str:
    cast = "long long" if node.type is Type.INT else "float"
    return f"(({cast})({ref(node.name, index_code)}))"


# -- block classification ----------------------------------------------------------------------------


def classify_code(node: Node, input_ref: InputRef | None = None, span_ref: SpanRef | None = None) -> str:
    """The body of `int classify(long long q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, b, h)`:
    returns 0 (empty), 1 (partial) or 2 (full). With span_ref, an input whose leading indices are
    exact is read through it over its last index's range (interval.classify with a granule)."""
    emitter = _ClassifyEmitter(input_ref or default_input_ref, span_ref)
    can_true, can_false = emitter.tri(node)
    emitter.lines += [f"if (!({can_true})) return 0;", f"if (!({can_false})) return 2;", "return 1;"]
    return "\n".join(emitter.lines)


class _ClassifyEmitter:
    """Prints interval.int_range / interval.tri as straight-line code, one temporary per node."""

    def __init__(self, input_ref: InputRef, span_ref: SpanRef | None = None):
        self.input_ref = input_ref
        self.span_ref = span_ref
        self.lines: list[str] = []
        self.ranges: dict = {}  # node -> (lo, hi, ok) C++ names or literals
        self.tris: dict = {}  # node -> (can_true, can_false)
        self.static: dict = {}  # node -> static_range memo

    def _temp(self, ctype: str, code: str) -> str:
        name = f"maskc_t{len(self.lines)}"
        self.lines.append(f"const {ctype} {name} = {code};")
        return name

    # ints: (lo, hi, ok); ok is the literal "true" for nodes that cannot be unknown

    def range(self, node: Node) -> tuple[str, str, str]:
        if node not in self.ranges:
            self.ranges[node] = self._range(node)
        return self.ranges[node]

    def _range(self, node: Node) -> tuple[str, str, str]:
        if isinstance(node, Const):
            return int_literal(node.value), int_literal(node.value), "true"
        if is_linear_op(node):
            return self._linear(linearize(node))
        if isinstance(node, Var):
            return node.name, node.name, "true"
        if isinstance(node, Input):
            return self._input(node)
        op, args = node.op, node.args
        if op == "where":
            return self._where(node)
        # The divisor of // and % is a constant: only the dividend has a range.
        ranges = [self.range(a) for a in (args[:1] if op in ("floordiv", "mod") else args)]
        ok = _all_of([r[2] for r in ranges])
        if op == "mul":
            (alo, ahi, _), (blo, bhi, _) = ranges
            products = [f"{x} * {y}" for x in (alo, ahi) for y in (blo, bhi)]
            lo = self._temp("long long", _nested("maskc_min", products))
            hi = self._temp("long long", _nested("maskc_max", products))
            return lo, hi, ok
        if op in ("floordiv", "mod"):
            div, mod = self._division(args[0], args[1].value)
            lo, hi, _ = ranges[0]
            if op == "floordiv":
                return self._temp("long long", div(lo)), self._temp("long long", div(hi)), ok
            same = self._temp("bool", f"{div(lo)} == {div(hi)}")
            return (self._temp("long long", f"{same} ? {mod(lo)} : 0LL"),
                    self._temp("long long", f"{same} ? {mod(hi)} : {int_literal(args[1].value - 1)}"), ok)
        if op == "abs":
            lo, hi, _ = ranges[0]
            return (self._temp("long long", f"{lo} >= 0 ? {lo} : ({hi} <= 0 ? -{hi} : 0LL)"),
                    self._temp("long long", f"{lo} >= 0 ? {hi} : ({hi} <= 0 ? -{lo} : maskc_max(-{lo}, {hi}))"), ok)
        if op in ("min", "max"):
            helper = f"maskc_{op}"
            return (self._temp("long long", _nested(helper, [r[0] for r in ranges])),
                    self._temp("long long", _nested(helper, [r[1] for r in ranges])), ok)
        raise ValueError(f"no interval rule for int op {op!r}")

    def _division(self, dividend: Node, d: int) -> tuple[Callable[[str], str], Callable[[str], str]]:
        """floor division and modulo by d of one end of dividend's range, as long long code: on int
        where the dividend's static range fits (the ends of its range over a rectangle of the
        contract lie inside that range, as every rule here is monotone in its operands' ranges), so
        the key-block scan does no 64-bit division for `kv_idx % 3`."""
        if fits_int32(static_range(dividend, self.static)) and fits_int32((d, d)):
            return (lambda x: f"((long long)maskc_floordiv32((int)({x}), {d}))",
                    lambda x: f"((long long)maskc_mod32((int)({x}), {d}))")
        return (lambda x: f"maskc_floordiv({x}, {int_literal(d)})", lambda x: f"maskc_mod({x}, {int_literal(d)})")

    def _linear(self, form) -> tuple[str, str, str]:
        lo_terms, hi_terms, oks = [], [], []
        terms = [(("q_lo", "q_hi", "true"), form.q), (("kv_lo", "kv_hi", "true"), form.kv)]
        terms += [(self.range(n), coef) for n, coef in form.terms]
        for (lo, hi, ok), coef in terms:
            if coef != 0:
                low, high = (lo, hi) if coef > 0 else (hi, lo)  # a negative coefficient swaps the ends
                lo_terms.append((coef, low))
                hi_terms.append((coef, high))
                oks.append(ok)
        if form.const == 0 and len(lo_terms) == 1 and lo_terms[0][0] == 1:
            return lo_terms[0][1], hi_terms[0][1], oks[0]  # a lone variable or node: no new temporary
        return (self._temp("long long", _linear_sum(form.const, lo_terms)),
                self._temp("long long", _linear_sum(form.const, hi_terms)), _all_of(oks))

    def _input(self, node: Input) -> tuple[str, str, str]:
        # Read only where every index is exact and known; the ternary keeps the read from happening
        # otherwise (the index would not be one point's index).
        ranges = [self.range(i) for i in node.index]
        if self.span_ref is not None and ranges:
            *leading, (lo, hi, last_ok) = ranges
            known = _all_of([f"({ok} && {a} == {b})" if ok != "true" else f"{a} == {b}" for a, b, ok in leading]
                            + [last_ok])
            span = self._temp("maskc_span", f"({known}) ? {self.span_ref(node.name, [a for a, _, _ in leading], lo, hi)}"
                                            " : maskc_span{0LL, 0LL, false}")
            return f"{span}.lo", f"{span}.hi", f"{span}.ok"
        exact = _all_of([f"({ok} && {lo} == {hi})" if ok != "true" else f"{lo} == {hi}" for lo, hi, ok in ranges])
        read = _input_read(node, [lo for lo, _, _ in ranges], self.input_ref)
        ok = self._temp("bool", exact)
        value = self._temp("long long", f"{ok} ? {read} : 0LL")
        return value, value, ok

    def _where(self, node: Op) -> tuple[str, str, str]:
        can_true, can_false = self.tri(node.args[0])
        alo, ahi, aok = self.range(node.args[1])
        blo, bhi, bok = self.range(node.args[2])
        lo = self._temp("long long", f"{can_true} ? ({can_false} ? maskc_min({alo}, {blo}) : {alo}) : {blo}")
        hi = self._temp("long long", f"{can_true} ? ({can_false} ? maskc_max({ahi}, {bhi}) : {ahi}) : {bhi}")
        if aok == "true" and bok == "true":
            return lo, hi, "true"
        return lo, hi, self._temp("bool", f"(!{can_true} || {aok}) && (!{can_false} || {bok})")

    # bools: (can_true, can_false)

    def tri(self, node: Node) -> tuple[str, str]:
        if node not in self.tris:
            self.tris[node] = self._tri(node)
        return self.tris[node]

    def _tri(self, node: Node) -> tuple[str, str]:
        if isinstance(node, Const):
            return ("true", "false") if node.value else ("false", "true")
        op, args = node.op, node.args
        if op in ("lt", "le", "gt", "ge", "eq", "ne") and args[0].type is Type.INT:
            lo, hi, ok = self._linear(comparison_form(node))
            can_true, can_false = _compare_to_zero(op, lo, hi)
            if ok != "true":
                can_true, can_false = f"!{ok} || ({can_true})", f"!{ok} || ({can_false})"  # unknown: both
            return self._temp("bool", can_true), self._temp("bool", can_false)
        parts = [self.tri(a) for a in args]
        if op == "not":
            return parts[0][1], parts[0][0]
        if op in ("eq", "ne"):
            (at, af), (bt, bf) = parts
            equal = (f"({at} && {bt}) || ({af} && {bf})", f"({at} && {bf}) || ({af} && {bt})")
            can_true, can_false = equal if op == "eq" else equal[::-1]
        elif op == "and":
            can_true = " && ".join(p[0] for p in parts)
            can_false = " || ".join(p[1] for p in parts)
        elif op == "or":
            can_true = " || ".join(p[0] for p in parts)
            can_false = " && ".join(p[1] for p in parts)
        elif op == "where":
            (ct, cf), (at, af), (bt, bf) = parts
            can_true, can_false = f"({ct} && {at}) || ({cf} && {bt})", f"({ct} && {af}) || ({cf} && {bf})"
        else:
            raise ValueError(f"no interval rule for bool op {op!r}")
        return self._temp("bool", can_true), self._temp("bool", can_false)


def _compare_to_zero(op: str, lo: str, hi: str) -> tuple[str, str]:
    """interval.compare_to_zero, printed."""
    if op == "lt":
        return f"{lo} < 0", f"{hi} >= 0"
    if op == "le":
        return f"{lo} <= 0", f"{hi} > 0"
    if op == "gt":
        return f"{hi} > 0", f"{lo} <= 0"
    if op == "ge":
        return f"{hi} >= 0", f"{lo} < 0"
    can_equal, can_differ = f"{lo} <= 0 && {hi} >= 0", f"!({lo} == 0 && {hi} == 0)"
    return (can_equal, can_differ) if op == "eq" else (can_differ, can_equal)


def _linear_sum(constant: int, terms: list) -> str:
    """const + sum(coef * name), printed plainly: `kv_lo - q_hi + 2LL * h - 3LL`."""
    text = ""
    for coef, name in terms:
        sign = "-" if coef < 0 else "+"
        product = name if abs(coef) == 1 else f"{int_literal(abs(coef))} * {name}"
        text += f" {sign} {product}"
    if constant:
        text += f" {'-' if constant < 0 else '+'} {int_literal(abs(constant))}"
    text = text.strip()
    if not text:
        return "0LL"
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


def _nested(helper: str, args: list) -> str:
    result = args[0]
    for a in args[1:]:
        result = f"{helper}({result}, {a})"
    return result


def _all_of(flags: list) -> str:
    flags = [f for f in flags if f != "true"]
    if not flags:
        return "true"
    return flags[0] if len(flags) == 1 else "(" + " && ".join(flags) + ")"
