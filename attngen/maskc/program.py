"""Compiled masks and score modifiers: the IR with its canonical text, slug and lowerings."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from attngen.maskc import cuda, interval
from attngen.maskc.diff import derivative
from attngen.maskc.ir import Input, Node, Var, to_text, walk
from attngen.maskc.parse import parse

SLUG_MAX_CHARS = 40
_SLUG = re.compile(r"[a-z0-9_]+")


@dataclass(frozen=True)
class MaskProgram:
    """A boolean expression over (b, h, q_idx, kv_idx, q_len, kv_len) and inputs: True where key
    kv_idx is visible to query q_idx."""

    canonical: str
    slug: str
    ir: Node
    inputs: tuple  # ((name, number of indices), ...), sorted

    def dense(self, q_idx, kv_idx, q_len, kv_len, b=0, h=0, inputs=None):
        """The mask as a torch.bool tensor, broadcast over the (tensor or int) arguments."""
        from attngen.maskc import dense

        env = dense.make_env({"q_idx": q_idx, "kv_idx": kv_idx, "q_len": q_len, "kv_len": kv_len, "b": b, "h": h},
                             inputs)
        return dense.broadcast_result(dense.evaluate(self.ir, env), env)

    def classify(self, q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, b=0, h=0, inputs=None, granule=None) -> str:
        """"empty", "full" or "partial" for the inclusive rectangle [q_lo, q_hi] x [kv_lo, kv_hi].
        Sound: "empty" only if nothing in it is visible, "full" only if everything is. An input is
        read only where its index is exact over the rectangle (and inputs are given), else unknown;
        with a granule, a last index over a range reads the input's min and max over its granules
        (what the kernels' per-call summaries hold, attngen/mask_table.py)."""
        return interval.classify(self.ir, q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, b, h, inputs, granule)

    def cuda_visible(self, input_ref: cuda.InputRef | None = None) -> str:
        """A C++ bool expression over long long q_idx, kv_idx, q_len, kv_len, b, h."""
        return cuda.point_code(self.ir, input_ref)

    def cuda_classify(self, input_ref: cuda.InputRef | None = None, span_ref: cuda.SpanRef | None = None) -> str:
        """The body of a function returning int (0 empty, 1 partial, 2 full) over long long q_lo, q_hi,
        kv_lo, kv_hi, q_len, kv_len, b, h; the same analysis as classify() (with span_ref: as with a
        granule, the span helper reading the summaries)."""
        return cuda.classify_code(self.ir, input_ref, span_ref)


@dataclass(frozen=True)
class ScoreModProgram:
    """A float expression over score and the index variables: the score that replaces score."""

    canonical: str
    slug: str
    ir: Node
    inputs: tuple

    @property
    def is_identity(self) -> bool:
        return self.ir == Var("score", self.ir.type)

    def dense(self, score, q_idx, kv_idx, q_len, kv_len, b=0, h=0, inputs=None):
        """The modified score, computed in score's dtype, broadcast over the arguments."""
        import torch

        from attngen.maskc import dense

        if not isinstance(score, torch.Tensor):
            score = torch.as_tensor(score, dtype=torch.get_default_dtype())
        if not score.is_floating_point():
            raise ValueError(f"score must be a floating-point tensor; got {score.dtype}")
        variables = {"score": score, "q_idx": q_idx, "kv_idx": kv_idx, "q_len": q_len, "kv_len": kv_len, "b": b, "h": h}
        env = dense.make_env(variables, inputs, score.dtype)
        return dense.broadcast_result(dense.evaluate(self.ir, env), env)

    def dense_error(self, score, q_idx, kv_idx, q_len, kv_len, b=0, h=0, inputs=None):
        """A bound on |the kernels' fp32 value - the exact value| of the expression at exact (float64)
        arguments (dense.evaluation_error), broadcast like dense()."""
        import torch

        from attngen.maskc import dense

        variables = {"score": torch.as_tensor(score, dtype=torch.float64), "q_idx": q_idx, "kv_idx": kv_idx,
                     "q_len": q_len, "kv_len": kv_len, "b": b, "h": h}
        env = dense.make_env(variables, inputs, torch.float64)
        return dense.broadcast_result(dense.evaluation_error(self.ir, env)[1].to(torch.float64), env)

    def cuda_expr(self, input_ref: cuda.InputRef | None = None) -> str:
        """A C++ float expression over float score and long long q_idx, kv_idx, q_len, kv_len, b, h."""
        return cuda.point_code(self.ir, input_ref)

    def derivative(self) -> ScoreModProgram:
        """d(modifier)/d(score), simplified; its slug is "d_" + this slug where that fits."""
        return _derivative_program(self)

    def input_derivative(self, name: str) -> ScoreModProgram:
        """d(modifier)/d(inputs[name] at the element's index), for an input every read of which is at
        one index (attngen/families/bwd_shared.py learnable_inputs)."""
        return _derivative_program(self, name)


def program_inputs(node: Node) -> tuple:
    return tuple(sorted({(n.name, len(n.index)) for n in walk(node) if isinstance(n, Input)}))


def make_slug(builtin: tuple | None, canonical: str) -> str:
    """The built-in's name and parameters (e.g. sliding_window_128_0) when the text is exactly one
    built-in, else expr_ and 10 hex digits of the canonical text's sha256."""
    if builtin is not None:
        name, values = builtin
        slug = "_".join([name, *(_slug_number(v) for v in values)])
        if len(slug) <= SLUG_MAX_CHARS and _SLUG.fullmatch(slug):
            return slug
    return "expr_" + hashlib.sha256(canonical.encode()).hexdigest()[:10]


def _slug_number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)  # softcap(30) and softcap(30.0) are one program
    return repr(value).lower().replace(".", "p").replace("-", "m").replace("+", "")


@functools.lru_cache(maxsize=512)
def compile_mask(text: str) -> MaskProgram:
    """Parse, check and fold a mask; ExprError (a ValueError) says what is refused and where."""
    parsed = parse(text, "mask")
    canonical = to_text(parsed.ir)
    return MaskProgram(canonical, make_slug(parsed.builtin, canonical), parsed.ir, program_inputs(parsed.ir))


@functools.lru_cache(maxsize=512)
def compile_score_mod(text: str) -> ScoreModProgram:
    """Parse, check and fold a score modifier; ExprError says what is refused and where."""
    parsed = parse(text, "score_mod")
    canonical = to_text(parsed.ir)
    return ScoreModProgram(canonical, make_slug(parsed.builtin, canonical), parsed.ir, program_inputs(parsed.ir))


@functools.lru_cache(maxsize=512)
def _derivative_program(program: ScoreModProgram, wrt: str | None = None) -> ScoreModProgram:
    node = derivative(program.ir, wrt)
    canonical = to_text(node)
    slug = ("d_" if wrt is None else f"d_{wrt}_") + program.slug
    if len(slug) > SLUG_MAX_CHARS:
        slug = make_slug(None, canonical)
    return ScoreModProgram(canonical, slug, node, program_inputs(node))


def stored_text(text: str, kind: str) -> str:
    """What a spec stores for a mask or score modifier: a single built-in as its call ("causal",
    "sliding_window(128, 0)", "softcap(30.0)"), a mask that is a conjunction of built-ins as their
    calls joined by "and" in sorted order ("causal and chunked(8192)"), else the canonical
    expression; so one program has one spec key however it was spelled, and the kernels can use
    the built-ins' closed-form bounds. ExprError as compile_mask / compile_score_mod."""
    program = compile_mask(text) if kind == "mask" else compile_score_mod(text)
    builtin = parse(text, kind).builtin
    if builtin is not None:
        return _call_text(builtin)
    if kind == "mask":
        terms = builtin_conjunction(text)
        if terms is not None:
            return " and ".join(sorted(set(terms)))
    return program.canonical


def _call_text(builtin: tuple) -> str:
    name, values = builtin
    return name if not values else f"{name}({', '.join(repr(v) for v in values)})"


def builtin_conjunction(text: str) -> list[str] | None:
    """The built-in calls of a mask written as `A and B and ...` of built-ins alone (each as its
    stored call), else None. The text has compiled already, so each term is a valid built-in."""
    import ast

    from attngen.maskc.parse import quiet_parse

    try:
        tree = quiet_parse(text.strip(), "eval").body
    except SyntaxError:
        return None
    if not (isinstance(tree, ast.BoolOp) and isinstance(tree.op, ast.And)):
        return None
    terms = []
    for term in tree.values:
        builtin = parse(ast.unparse(term), "mask").builtin
        if builtin is None:
            return None
        terms.append(_call_text(builtin))
    return terms
