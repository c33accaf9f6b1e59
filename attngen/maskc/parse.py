"""Text -> IR under a whitelist; every refusal is an ExprError that quotes the piece and its column.

The text is parsed with Python's `ast` (mode "eval": one expression, no statements), then walked:
each AST node type has a handler, and any node type without one is refused. Names resolve, in
order, to a built-in's parameter (inside built-in templates only), a variable, a built-in, and
otherwise a runtime input. Operator nodes are built with `ir.make`, which checks types and folds
constants; its IRErrors come back here and get the piece's location.

Inputs are typed by the program: in a mask every input is an integer (long long on the GPU); in a
score modifier every input is a float (float on the GPU). Masks are integer-only: no float
literals, no `/`, no float functions, so mask classification needs integer intervals only.
"""

from __future__ import annotations

import ast
import difflib
import math
import re
import warnings
from dataclasses import dataclass

from attngen.maskc import ir
from attngen.maskc.builtins import MASK_BUILTINS, SCORE_MOD_BUILTINS, visible_builtins
from attngen.maskc.ir import Const, Input, IRError, Node, Type

KINDS = ("mask", "score_mod")
MAX_TEXT_CHARS = 2000
MAX_DEPTH = 64
MAX_INPUT_ARITY = 4

INPUT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
# Input names are printed into CUDA source, so none may be a C++/CUDA keyword or builtin, a name
# the emitted code uses itself, or a name that reads as a constant.
RESERVED_NAMES = frozenset((
    "alignas", "alignof", "and", "and_eq", "asm", "auto", "bitand", "bitor", "bool", "break", "case",
    "catch", "char", "char8_t", "char16_t", "char32_t", "class", "compl", "concept", "const", "consteval",
    "constexpr", "constinit", "const_cast", "continue", "co_await", "co_return", "co_yield", "decltype",
    "default", "delete", "do", "double", "dynamic_cast", "else", "enum", "explicit", "export", "extern",
    "false", "float", "for", "friend", "goto", "if", "inline", "int", "long", "mutable", "namespace", "new",
    "noexcept", "not", "not_eq", "nullptr", "operator", "or", "or_eq", "private", "protected", "public",
    "register", "reinterpret_cast", "requires", "restrict", "return", "short", "signed", "sizeof", "static",
    "static_assert", "static_cast", "struct", "switch", "template", "this", "thread_local", "throw", "true",
    "try", "typedef", "typeid", "typename", "union", "unsigned", "using", "virtual", "void", "volatile",
    "wchar_t", "while", "xor", "xor_eq", "NULL", "main", "threadIdx", "blockIdx", "blockDim", "gridDim",
    "warpSize", "tanhf", "expf", "logf", "sqrtf", "fabsf", "fminf", "fmaxf", "q_lo", "q_hi", "kv_lo",
    "kv_hi", "inf", "nan", "pi", "e",
))
RESERVED_PREFIXES = ("maskc_", "_")

INT_FUNCTIONS = {"abs": (1, 1), "min": (2, None), "max": (2, None), "where": (3, 3)}
FLOAT_FUNCTIONS = {name: (1, 1) for name in ir.FLOAT_FUNCTIONS}

_BINARY = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "truediv", ast.FloorDiv: "floordiv",
           ast.Mod: "mod", ast.BitAnd: "and", ast.BitOr: "or"}
_REFUSED_BINARY = {ast.Pow: "power operator '**'", ast.BitXor: "operator '^'", ast.LShift: "shift '<<'",
                   ast.RShift: "shift '>>'", ast.MatMult: "operator '@'"}
_COMPARE = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_REFUSED_COMPARE = {ast.Is: "operator 'is'", ast.IsNot: "operator 'is not'", ast.In: "operator 'in'",
                    ast.NotIn: "operator 'not in'"}
_REFUSED_NODES = {
    ast.Attribute: "attribute access", ast.Lambda: "lambda", ast.ListComp: "comprehension",
    ast.SetComp: "comprehension", ast.DictComp: "comprehension", ast.GeneratorExp: "comprehension",
    ast.IfExp: "conditional expression (write where(cond, a, b))", ast.NamedExpr: "assignment expression ':='",
    ast.List: "list display", ast.Tuple: "tuple", ast.Set: "set display", ast.Dict: "dict display",
    ast.JoinedStr: "f-string", ast.FormattedValue: "f-string", ast.Starred: "starred expression",
    ast.Await: "await", ast.Yield: "yield", ast.YieldFrom: "yield", ast.Slice: "slice",
}

ALLOWED = {
    "mask": ("variables b, h, q_idx, kv_idx, q_len, kv_len; inputs name[index, ...] or name (int32); int literals, "
             "True, False; + - * // % (constant positive divisor), unary -; < <= > >= == != (chained); and or not, "
             "& | on bools; abs min max where; built-ins " + ", ".join(b.signature for b in MASK_BUILTINS.values())),
    "score_mod": ("variables score, b, h, q_idx, kv_idx, q_len, kv_len; inputs name[index, ...] or name (float32), "
                  "int(name[index, ...]) or int(name) (int32, e.g. a mask's offset); int and "
                  "float literals, True, False; + - * / // % (constant positive divisor), unary -; comparisons; "
                  "and or not, & | on bools; abs min max where tanh exp log sqrt; built-ins "
                  + ", ".join(b.signature for b in (*SCORE_MOD_BUILTINS.values(), *MASK_BUILTINS.values()))),
}


class ExprError(ValueError):
    """An expression that is refused: `piece` is the offending text, `column` its 1-based column."""

    def __init__(self, kind: str, piece: str, column: int, problem: str, *, line: int = 1,
                 refused: bool = False):
        self.kind, self.piece, self.column, self.line, self.problem = kind, piece, column, line, problem
        where = f"{piece!r} at column {column}" if line == 1 else f"{piece!r} at line {line}, column {column}"
        if refused:
            message = f"{kind}: {where} is not allowed: {problem}; allowed: {ALLOWED[kind]}"
        else:
            message = f"{kind}: {where}: {problem}"
        super().__init__(message)


def quiet_parse(text: str, mode: str) -> ast.AST:
    """ast.parse of a user's text without Python's warnings about it ("invalid escape sequence",
    "'is' with a literal": SyntaxWarning, or DeprecationWarning on 3.11), which are not ours to print."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
        return ast.parse(text, mode=mode)


@dataclass(frozen=True)
class Parsed:
    ir: Node
    # (name, parameter values) when the whole text is one built-in, e.g. ("sliding_window", (128, 0)).
    builtin: tuple | None


def parse(text: str, kind: str) -> Parsed:
    """The IR of a mask (kind "mask", bool) or score modifier (kind "score_mod", float)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    if not isinstance(text, str):
        raise TypeError(f"a {kind} expression must be a str; got {type(text).__name__}")
    parser = _Parser(text, kind)
    root_ast, node = parser.parse()
    want = Type.BOOL if kind == "mask" else Type.FLOAT
    if node.type is not want:
        what = "a mask must be a boolean expression" if kind == "mask" else \
            "a score modifier must be a float expression (it replaces score, e.g. score + ...)"
        raise parser.error(root_ast, f"{what}; got {node.type.value}{parser.input_hint(node)}")
    return Parsed(node, parser.builtin_calls.get(id(root_ast)))


class _Parser:
    def __init__(self, text: str, kind: str, program_kind: str | None = None, bindings: dict | None = None,
                 inputs: dict | None = None):
        self.text, self.kind = text, kind
        self.program_kind = program_kind or kind  # inputs are typed by the program, not the template
        self.bindings = bindings or {}
        self.inputs = {} if inputs is None else inputs  # name -> (arity, as int(name)), shared with templates
        self.builtin_calls = {}  # id(ast node) -> (name, parameter values), for the slug
        # ast.parse refuses leading blanks ("unexpected indent"): parse the stripped text, and shift
        # the positions it reports back to the text as given.
        stripped = text.lstrip()
        lead = text[: len(text) - len(stripped)]
        self.source = stripped
        self.line_shift = lead.count("\n")
        self.column_shift = len(lead) - (lead.rfind("\n") + 1)

    # -- errors ---------------------------------------------------------------------------------

    def _position(self, node: ast.AST) -> tuple[int, int]:
        lines = self.source.split("\n")
        line = lines[node.lineno - 1] if node.lineno <= len(lines) else ""
        column = len(line.encode()[: node.col_offset].decode("utf-8", errors="ignore")) + 1  # offsets are bytes
        if node.lineno == 1:
            column += self.column_shift
        return node.lineno + self.line_shift, column

    def _piece(self, node: ast.AST) -> str:
        piece = ast.get_source_segment(self.source, node) or ""
        return piece if len(piece) <= 60 else piece[:57] + "..."

    def error(self, node: ast.AST, problem: str, *, refused: bool = False) -> ExprError:
        line, column = self._position(node)
        return ExprError(self.kind, self._piece(node), column, problem, line=line, refused=refused)

    def refuse(self, node: ast.AST, what: str) -> ExprError:
        return self.error(node, what, refused=True)

    def build(self, node: ast.AST, op: str, *args: Node) -> Node:
        try:
            return ir.make(op, *args)
        except IRError as exc:
            raise self.error(node, str(exc) + self.input_hint(*args)) from None

    def input_hint(self, *nodes: Node) -> str:
        """For a type error whose operand is a bare name read as a runtime input: most likely a misspelt
        built-in or variable (`causl`, `CAUSAL`), so say what the name was taken for, and what is close."""
        names = [n.name for n in nodes if isinstance(n, Input) and not n.index and not n.as_int]  # int(x) was meant
        if not names:
            return ""
        known = [*visible_builtins(self.kind), *ir.INDEX_VARS] + ([ir.SCORE] if self.kind == "score_mod" else [])
        close = difflib.get_close_matches(names[0].lower(), known, n=1, cutoff=0.6) or \
            [k for k in known if k == names[0].lower()]
        what = "an integer" if self.program_kind == "mask" else "a float"
        guess = f"; did you mean {close[0]!r}?" if close else ""
        return f" ({names[0]!r} is not a built-in or variable: a bare name reads a runtime input, {what}{guess})"

    # -- entry ----------------------------------------------------------------------------------

    def parse(self) -> tuple[ast.AST, Node]:
        text = self.text
        if len(text) > MAX_TEXT_CHARS:
            raise ExprError(self.kind, text[:40] + "...", 1,
                            f"the expression is {len(text)} characters long; the limit is {MAX_TEXT_CHARS}")
        if not self.source.strip():
            raise ExprError(self.kind, text, 1, "the expression is empty")
        try:
            tree = quiet_parse(self.source, "eval")
        except SyntaxError as exc:
            raise self._syntax_error(exc) from None
        except (ValueError, MemoryError, RecursionError) as exc:  # null bytes; the parser's own limits
            raise ExprError(self.kind, text[:40], 1, f"cannot be parsed: {exc}") from None
        return tree.body, self.expr(tree.body, 0)

    def _syntax_error(self, exc: SyntaxError) -> ExprError:
        try:  # `x = 1` is a statement, not an expression: say so rather than "invalid syntax"
            statements = quiet_parse(self.source, "exec").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            statements = []
        if len(statements) == 1 and isinstance(statements[0], (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            return self.refuse(statements[0], "assignment")
        line = (exc.lineno or 1) + self.line_shift
        column = max(1, exc.offset or 1) + (self.column_shift if (exc.lineno or 1) == 1 else 0)
        piece = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        problem = "invalid syntax" if exc.msg == "invalid syntax" else f"invalid syntax ({exc.msg})"
        if not exc.offset and self.source.count("\n") == 0:  # Python's offset 0: the text ended too soon
            column = len(self.text.rstrip()) + 1
            problem = "invalid syntax: the expression ends too soon (an operand or a closing bracket is missing)"
        return ExprError(self.kind, piece, column, problem, line=line)

    def expr(self, node: ast.AST, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise self.error(node, f"the expression is nested more than {MAX_DEPTH} levels deep")
        handler = _HANDLERS.get(type(node))
        if handler is None:
            raise self.refuse(node, _REFUSED_NODES.get(type(node), f"{type(node).__name__} expression"))
        result = handler(self, node, depth + 1)
        if self.kind == "mask" and result.type is Type.FLOAT:
            raise self.refuse(node, "a float value in a mask (masks are integer-only)")
        return result

    # -- handlers -------------------------------------------------------------------------------

    def constant(self, node: ast.Constant, depth: int) -> Node:
        value = node.value
        if isinstance(value, bool):
            return ir.const(value)
        if isinstance(value, int):
            if abs(value) >= ir.INT_LIMIT:
                raise self.error(node, "integer literal out of range (|value| < 2**62)")
            return ir.const(value)
        if isinstance(value, float):
            if self.kind == "mask":
                raise self.refuse(node, "float literal (masks are integer-only)")
            if not math.isfinite(value) or abs(value) > ir.FLOAT32_MAX:
                raise self.error(node, "float literal outside the float32 range")
            return ir.const(value)
        what = {str: "string literal", bytes: "bytes literal", complex: "complex literal"}.get(type(value))
        raise self.refuse(node, what or f"literal {value!r}")

    def name(self, node: ast.Name, depth: int) -> Node:
        name = node.id
        if name in self.bindings:
            return self.bindings[name]
        if name in ir.INDEX_VARS:
            return ir.var(name)
        if name == ir.SCORE:
            if self.kind != "score_mod":
                raise self.refuse(node, "score in a mask (score is only available in score modifiers)")
            return ir.var(name)
        if name in visible_builtins(self.kind):
            return self.builtin(node, name, [], depth)
        if name in SCORE_MOD_BUILTINS:
            raise self.refuse(node, f"score-modifier built-in {name} in a mask")
        if name in INT_FUNCTIONS or name in FLOAT_FUNCTIONS:
            raise self.refuse(node, f"function {name} used without a call")
        return self.input(node, name, [])

    def binop(self, node: ast.BinOp, depth: int) -> Node:
        op_type = type(node.op)
        if op_type in _REFUSED_BINARY:
            raise self.refuse(node, _REFUSED_BINARY[op_type])
        op = _BINARY[op_type]
        if op == "truediv" and self.kind == "mask":
            raise self.refuse(node, "true division '/' (it gives a float; masks are integer-only: use //)")
        left, right = self.expr(node.left, depth), self.expr(node.right, depth)
        if op in ("and", "or") and not (left.type is Type.BOOL and right.type is Type.BOOL):
            symbol = "&" if op == "and" else "|"
            types = f"{left.type.value} and {right.type.value}"
            raise self.refuse(node, f"'{symbol}' on {types} ('{symbol}' is boolean {op} on bools only; it binds "
                                    f"tighter than comparisons, so write (a < b) {symbol} (c < d))")
        return self.build(node, op, left, right)

    def unaryop(self, node: ast.UnaryOp, depth: int) -> Node:
        if isinstance(node.op, ast.Invert):
            raise self.refuse(node, "operator '~' (write not)")
        operand = self.expr(node.operand, depth)
        if isinstance(node.op, ast.UAdd):
            if operand.type is Type.BOOL:
                raise self.error(node, "unary + needs a number; got bool")
            return operand
        return self.build(node, "not" if isinstance(node.op, ast.Not) else "neg", operand)

    def boolop(self, node: ast.BoolOp, depth: int) -> Node:
        values = [self.expr(v, depth) for v in node.values]
        return self.build(node, "and" if isinstance(node.op, ast.And) else "or", *values)

    def compare(self, node: ast.Compare, depth: int) -> Node:
        # `a < b < c` is `a < b and b < c` (b is evaluated once, and has no side effects anyway).
        left = self.expr(node.left, depth)
        parts = []
        for op, right_ast in zip(node.ops, node.comparators):
            if type(op) in _REFUSED_COMPARE:
                raise self.refuse(node, _REFUSED_COMPARE[type(op)])
            right = self.expr(right_ast, depth)
            parts.append(self.build(node, _COMPARE[type(op)], left, right))
            left = right
        return parts[0] if len(parts) == 1 else self.build(node, "and", *parts)

    def call(self, node: ast.Call, depth: int) -> Node:
        func = node.func
        if isinstance(func, ast.Attribute):
            raise self.refuse(func, "attribute access")
        if not isinstance(func, ast.Name):
            self.expr(func, depth)  # a refused callee (a lambda, ...) is named as such
            raise self.refuse(node, "call of a computed function")
        if node.keywords:
            raise self.refuse(node.keywords[0], "keyword argument")
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise self.refuse(arg, "starred argument")
        name = func.id
        if name == "int":
            return self.int_read(node, depth)
        if name in visible_builtins(self.kind):
            return self.builtin(node, name, node.args, depth)
        if name in SCORE_MOD_BUILTINS:
            raise self.refuse(node, f"score-modifier built-in {name} in a mask")
        if name in FLOAT_FUNCTIONS and self.kind == "mask":
            raise self.refuse(node, f"{name}() in a mask (float functions are only available in score modifiers)")
        arity = INT_FUNCTIONS.get(name) or FLOAT_FUNCTIONS.get(name)
        if arity is None:
            raise self.refuse(node, f"call to unknown function {name}")
        low, high = arity
        if len(node.args) < low or (high is not None and len(node.args) > high):
            count = f"{low}" if low == high else f"at least {low}"
            raise self.error(node, f"{name}() takes {count} argument{'s' if low > 1 else ''}; got {len(node.args)}")
        args = [self.expr(a, depth) for a in node.args]
        return self.build(node, name, *args)

    def int_read(self, node: ast.Call, depth: int) -> Node:
        """int(name) or int(name[i, ...]): an input read as an int32 tensor. What lets a score modifier
        read a mask's int input (a context-parallel shard's q_offset) under the same name; in a mask,
        where inputs are int32 anyway, the same read as without it."""
        what = "int() reads a runtime input as an int32 tensor: write int(name) or int(name[i, ...])"
        if len(node.args) != 1:
            raise self.error(node, f"{what}; got {len(node.args)} arguments")
        arg = node.args[0]
        if isinstance(arg, ast.Subscript):
            return self.subscript(arg, depth, as_int=True)
        if isinstance(arg, ast.Name) and not self._known_name(arg.id):
            return self.input(arg, arg.id, [], as_int=True)
        if isinstance(arg, ast.Name):
            raise self.error(node, f"{arg.id} is not a runtime input ({what})")
        raise self.error(node, what)

    def _known_name(self, name: str) -> bool:
        """Whether a name is a variable, binding, built-in or function rather than an input."""
        return name in self.bindings or name in ir.INDEX_VARS or name == ir.SCORE or name in visible_builtins(self.kind) \
            or name in SCORE_MOD_BUILTINS or name in INT_FUNCTIONS or name in FLOAT_FUNCTIONS

    def subscript(self, node: ast.Subscript, depth: int, as_int: bool = False) -> Node:
        if not isinstance(node.value, ast.Name):
            raise self.refuse(node, "subscript of an expression (an input is read as name[i, j])")
        name = node.value.id
        if self._known_name(name):
            raise self.refuse(node, f"subscript of {name}, which is not an input")
        index_asts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(index_asts) > MAX_INPUT_ARITY:
            raise self.error(node, f"an input takes at most {MAX_INPUT_ARITY} indices; got {len(index_asts)}")
        index = []
        for index_ast in index_asts:
            value = self.expr(index_ast, depth)
            if value.type is not Type.INT:
                raise self.error(index_ast, f"an input index must be an integer expression; got {value.type.value}")
            index.append(value)
        return self.input(node, name, index, as_int)

    # -- names ----------------------------------------------------------------------------------

    def input(self, node: ast.AST, name: str, index: list, as_int: bool = False) -> Node:
        if not INPUT_NAME.fullmatch(name) or name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
            raise self.refuse(node, f"input name {name} (reserved, or not an ASCII name of at most 32 characters)")
        as_int = as_int and self.program_kind != "mask"  # a mask's inputs are int32 without it
        arity, was_int = self.inputs.setdefault(name, (len(index), as_int))
        if arity != len(index):
            raise self.error(node, f"input {name} is used with {arity} and with {len(index)} indices")
        if was_int != as_int:
            raise self.error(node, f"input {name} is read both as int({name}) and as {name}: one input has one "
                                   f"dtype; write int({name}) at every read of an int32 {name}")
        return Input(name, tuple(index), Type.INT if self.program_kind == "mask" or as_int else Type.FLOAT, as_int)

    def builtin(self, node: ast.AST, name: str, arg_asts: list, depth: int) -> Node:
        builtin = visible_builtins(self.kind)[name]
        if len(arg_asts) != len(builtin.params):
            count = len(builtin.params)
            raise self.error(node, f"{name} takes {count} parameter{'' if count == 1 else 's'}"
                                   f"{f' (write {builtin.signature})' if count else ''}; got {len(arg_asts)}")
        bindings, values, constant = {}, [], True
        for param, arg_ast in zip(builtin.params, arg_asts):
            value = self.expr(arg_ast, depth)
            wants_int = param.type is Type.INT
            if param.runtime and not isinstance(value, Const):
                if value.type is not param.type:
                    raise self.error(arg_ast, f"parameter {param.name} of {builtin.signature} must be an integer "
                                              f"constant or an integer expression; got {value.type.value}")
                bindings[param.name] = value  # e.g. prefix[b]: the call is the expression its template makes
                constant = False
                continue
            if not isinstance(value, Const) or value.type is Type.BOOL or (wants_int and value.type is Type.FLOAT):
                what = "an integer" if wants_int else "a number"
                raise self.error(arg_ast, f"parameter {param.name} of {builtin.signature} must be {what} constant")
            number = value.value if wants_int else float(value.value)
            problem = param.problem(number)
            if problem:
                raise self.error(arg_ast, f"parameter {param.name} of {builtin.signature} {problem}")
            bindings[param.name] = ir.const(number)
            values.append(number)
        # The template is parsed like user text; its own built-in calls are not recorded here.
        template = _Parser(builtin.template, builtin.kind, self.program_kind, bindings, self.inputs)
        try:
            _, node_ir = template.parse()
        except ExprError as exc:  # its column would be the template's: name the call instead
            raise self.error(node, f"inside {name} ({builtin.template}): {exc.problem}") from None
        if constant:  # a built-in with a runtime argument has no closed form: it is named by its expression
            self.builtin_calls[id(node)] = (name, tuple(values))
        return node_ir


_HANDLERS = {ast.Constant: _Parser.constant, ast.Name: _Parser.name, ast.BinOp: _Parser.binop,
             ast.UnaryOp: _Parser.unaryop, ast.BoolOp: _Parser.boolop, ast.Compare: _Parser.compare,
             ast.Call: _Parser.call, ast.Subscript: _Parser.subscript}
