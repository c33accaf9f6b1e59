"""The mask / score-modifier expression compiler (attngen.maskc), on the CPU: parsing and refusals,
canonical text and slugs, dense evaluation against plain Python, soundness (and, for the banded
built-ins, exactness) of block classification, and the symbolic derivative against autograd.

Random expressions come from one generator (`MaskExprs`, `ScoreExprs`) that draws through a small
chooser interface, so hypothesis drives it here and a seeded random.Random drives it in
test_maskc_cuda.py."""

from __future__ import annotations

import io
import math
import random
import re
import tokenize

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attngen.maskc import (
    ExprError,
    MaskProgram,
    ScoreModProgram,
    compile_mask,
    compile_score_mod,
    cuda_preamble,
)
from attngen.maskc.ir import Type
from attngen.fuzz.expressions import MaskExprs, ScoreExprs
from attngen.maskc.program import stored_text

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- the random expression generator ------------------------------------------------------------------

# Inputs the random expressions read, with the values the tests give them (in range for any index
# the generator can produce: off and slope/bias by h < 4, doc by q_idx or kv_idx < 64).
MASK_INPUT_VALUES = {"off": [3, -2, 0, 7], "doc": [(i * 7 // 5) % 4 for i in range(64)], "lim": 9}
SCORE_INPUT_VALUES = {"slope": [0.5, 0.25, 0.125, 0.0625], "bias": [1.5, -0.75, 0.0, 2.0]}
MAX_B, MAX_H = 2, 3


class Chooser:
    """randint/choice over hypothesis draws: the interface random.Random already has."""

    def __init__(self, draw):
        self.draw = draw

    def randint(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def choice(self, seq):
        return self.draw(st.sampled_from(seq))


@st.composite
def mask_texts(draw):
    return MaskExprs(Chooser(draw)).mask()


@st.composite
def score_texts(draw):
    return ScoreExprs(Chooser(draw)).score_mod()


# -- plain-Python semantics: the independent statement of what an expression means -----------------


def python_value(text, q, k, q_len, kv_len, b, h, score=None, inputs=None):
    """The expression evaluated by Python itself at one point, built-ins written out from their
    definitions (bottom-right aligned)."""
    shift = kv_len - q_len
    causal = k <= q + shift
    namespace = {
        "q_idx": q, "kv_idx": k, "q_len": q_len, "kv_len": kv_len, "b": b, "h": h,
        "abs": abs, "min": min, "max": max, "where": lambda c, x, y: x if c else y,
        "tanh": math.tanh, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
        "none": True, "causal": causal,
        "sliding_window": lambda left, right: q + shift - left <= k <= q + shift + right,
        "chunked": lambda size: (q + shift) // size == k // size,
        "prefix_lm": lambda n: k < n or causal,
        **(inputs or {}),
    }
    if score is not None:
        namespace["score"] = score
        namespace["softcap"] = lambda c: c * math.tanh(score / c)
        namespace["alibi"] = score - namespace["slope"][h] * abs(q + shift - k)
    return eval(text, {"__builtins__": {}}, namespace)  # test-only: the generator's own text


def tensors(values: dict, dtype) -> dict:
    return {name: torch.tensor(v, dtype=dtype) for name, v in values.items()}


def grid(program: MaskProgram, q_len, kv_len, b=0, h=0, inputs=None):
    return program.dense(torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :], q_len, kv_len, b, h, inputs)


def truth(block: torch.Tensor) -> str:
    return "full" if bool(block.all()) else "empty" if not bool(block.any()) else "partial"


def check_sound(program, visible, rect, q_len, kv_len, b=0, h=0, inputs=None):
    q_lo, q_hi, kv_lo, kv_hi = rect
    got = program.classify(q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, b, h, inputs)
    actual = truth(visible[q_lo:q_hi + 1, kv_lo:kv_hi + 1])
    assert got == actual or got == "partial", (program.canonical, rect, q_len, kv_len, b, h, got, actual)
    return got, actual


# -- parsing, refusals, canonical text, slugs ---------------------------------------------------------

REFUSED_MASKS = [
    ("foo.bar < 3", "foo.bar", 1, "attribute access"),
    ("q_idx < kv_idx and foo.bar", "foo.bar", 20, "attribute access"),
    ("len(q_idx) < 3", "len(q_idx)", 1, "call to unknown function len"),
    ("(lambda: 1)() < 2", "lambda: 1", 2, "lambda"),
    ("[i for i in q_idx]", "[i for i in q_idx]", 1, "comprehension"),
    ("q_idx == 'a'", "'a'", 10, "string literal"),
    ("q_idx ** 2 < kv_idx", "q_idx ** 2", 1, "power operator"),
    ("q_idx[0] < 1", "q_idx[0]", 1, "not an input"),
    ("causal[h]", "causal[h]", 1, "not an input"),
    ("(x := q_idx) < 3", "x := q_idx", 2, "assignment expression"),
    ("q_idx / 2 < 3", "q_idx / 2", 1, "true division"),
    ("q_idx < 2.5", "2.5", 9, "float literal"),
    ("score > 0", "score", 1, "only available in score modifiers"),
    ("tanh(q_idx) > 0", "tanh(q_idx)", 1, "float functions"),
    ("softcap(3)", "softcap(3)", 1, "score-modifier built-in"),
    ("q_idx if causal else kv_idx", "q_idx if causal else kv_idx", 1, "where(cond, a, b)"),
    ("q_idx < 5 & kv_idx > 3", "5 & kv_idx", 9, "'&' on int and int"),
    ("~causal", "~causal", 1, "operator '~'"),
    ("q_idx in doc", "q_idx in doc", 1, "operator 'in'"),
    ("min(q_idx, *doc) < 3", "*doc", 12, "starred"),
    ("where(c=causal, a=1, b=2)", "c=causal", 7, "keyword argument"),
    ("doc[1:3] == 1", "1:3", 5, "slice"),
    ("doc[b][q_idx] == 1", "doc[b][q_idx]", 1, "subscript of an expression"),
    ("inf > q_idx", "inf", 1, "input name inf"),
    ("_secret[h] > 0", "_secret[h]", 1, "input name _secret"),
    ("maskc_t0 > 0", "maskc_t0", 1, "input name maskc_t0"),
    ("int > 0", "int", 1, "input name int"),
    ("(q_idx, kv_idx)", "(q_idx, kv_idx)", 1, "tuple"),
    ("f'{q_idx}'", "f'{q_idx}'", 1, "f-string"),
    ("q_idx < None", "None", 9, "literal None"),
]


@pytest.mark.parametrize("text, piece, column, what", REFUSED_MASKS, ids=[r[0] for r in REFUSED_MASKS])
def test_refused_constructs_name_the_piece_and_column(text, piece, column, what):
    with pytest.raises(ExprError) as info:
        compile_mask(text)
    err = info.value
    assert isinstance(err, ValueError)
    message = str(err)
    assert message.startswith(f"mask: {piece!r} at column {column} is not allowed: "), message
    assert what in message and "; allowed: " in message
    assert (err.piece, err.column, err.kind) == (piece, column, "mask")


# Pieces of hostile text: the expression language's own words and operators, Python that the
# whitelist must refuse (lambdas, imports, attribute access, comprehensions, starred and keyword
# arguments), quotes and escapes, huge literals, control and non-ASCII characters.
HOSTILE_PIECES = list("qkv_idxbhscore()[]{}<>=!+-*/%&|~^@ ,.:;'\"\\0123456789eEjx\n\t#") + [
    "and", "or", "not", " if ", " else ", " for ", " in ", "lambda ", "__import__('os')", ".__class__",
    "causal", "tanh(", "where(", "softcap(", "sliding_window(", "doc[", "1e308", "1e-400", "**", "\x00",
    "\u00e9", "\u202e", "9" * 400, "(" * 40, ")" * 40, "await ", "yield ", ":=", "...", "print(", "exec(",
]


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.one_of(st.text(max_size=80), st.lists(st.sampled_from(HOSTILE_PIECES), max_size=40).map("".join)))
@example(text="q_idx is 1")  # Python warns about these while parsing them (SyntaxWarning; invalid escapes:
@example(text="1(2) > q_idx")  # DeprecationWarning on 3.11, SyntaxWarning on 3.12)
@example(text="'\\d' == q_idx")
@example(text="kv_idx < 5and causal")  # valid, but 3.11 warns "invalid decimal literal" (stored_text parses it again)
def test_hostile_text_is_accepted_or_refused_with_an_expr_error(text):
    """Whatever the text, compiling it as a mask or a score modifier either succeeds or raises
    ExprError (a ValueError naming the piece): no other exception, and no warning from parsing it."""
    import warnings

    for kind, compile_text in (("mask", compile_mask), ("score_mod", compile_score_mod)):
        with warnings.catch_warnings(record=True) as caught:  # ("error" would turn them into SyntaxErrors)
            warnings.simplefilter("always")
            try:
                compile_text(text)
                stored_text(text, kind)  # what a spec stores: parses the text once more
            except ExprError as err:
                assert isinstance(err, ValueError) and err.kind in ("mask", "score_mod") and str(err)
        assert not caught, [str(w.message) for w in caught]


ERRORS = [
    # (kind, text, piece, message fragment)
    ("mask", "q_idx // kv_len < 3", "q_idx // kv_len", "divisor of '//' must be a positive integer constant"),
    ("mask", "q_idx % 0 == 1", "q_idx % 0", "got 0"),
    ("mask", "q_idx % (2 - 5) == 1", "q_idx % (2 - 5)", "got -3"),
    ("mask", "q_idx + kv_idx", "q_idx + kv_idx", "a mask must be a boolean expression; got int"),
    ("mask", "q_idx + causal > 1", "q_idx + causal", "'+' needs int or float operands; got bool"),
    ("mask", "not q_idx", "not q_idx", "'not' needs bool operands; got int"),
    ("mask", "where(q_idx, 1, 2) > 0", "where(q_idx, 1, 2)", "condition of where() needs bool"),
    ("mask", "where(causal, 1, True)", "where(causal, 1, True)", "where() branches must both be bool"),
    ("mask", "causal < causal", "causal < causal", "'<' needs int or float operands"),
    ("mask", "sliding_window(-1, 0)", "-1", "must be >= 0; got -1"),
    ("mask", "sliding_window(4)", "sliding_window(4)", "takes 2 parameters (write sliding_window(left, right)); got 1"),
    ("mask", "sliding_window", "sliding_window", "takes 2 parameters"),
    ("mask", "chunked(0)", "0", "must be >= 1"),
    ("mask", "chunked(q_len)", "q_len", "must be an integer constant"),
    ("mask", "min(q_idx) < 3", "min(q_idx)", "min() takes at least 2 arguments; got 1"),
    ("mask", "abs < 3", "abs", "used without a call"),
    ("mask", "doc[h] < doc[h, b]", "doc[h, b]", "used with 1 and with 2 indices"),
    ("mask", "q_idx < 2**70", "2**70", "power"),
    ("mask", "q_idx < 99999999999999999999", "99999999999999999999", "out of range"),
    ("mask", "q_idx <", "q_idx <", "invalid syntax"),
    ("mask", "x = 1", "x = 1", "assignment"),
    ("mask", "   ", "   ", "empty"),
    ("mask", "causal " + "and causal " * 300, "causal and causal and", "limit is 2000"),
    ("mask", "not " * 70 + "causal", "causal", "nested more than 64 levels"),
    ("mask", "(" * 250 + "causal" + ")" * 250, "(((", "invalid syntax (too many nested parentheses)"),
    ("mask", "-" * 100 + "q_idx < 0", "-", "nested more than 64 levels"),
    ("score_mod", "q_idx + 1", "q_idx + 1", "a score modifier must be a float expression"),
    ("score_mod", "score > 0", "score > 0", "(it replaces score, e.g. score + ...); got bool"),
    ("score_mod", "softcap(0)", "0", "must be > 0"),
    ("score_mod", "softcap(True)", "True", "must be a number constant"),
    ("score_mod", "score + 1e39", "1e39", "outside the float32 range"),
    ("score_mod", "score + 1e999", "1e999", "outside the float32 range"),
    ("score_mod", "score // 2.0", "score // 2.0", "'//' needs int operands; got float"),
    ("score_mod", "bias[score] + score", "score", "an input index must be an integer expression"),
    ("score_mod", "score.real", "score.real", "attribute access"),
    ("score_mod", "exp(score, 2)", "exp(score, 2)", "exp() takes 1 argument; got 2"),
    ("score_mod", "score + int(q_idx)", "int(q_idx)", "q_idx is not a runtime input (int() reads a runtime input"),
    ("score_mod", "score + int(3)", "int(3)", "write int(name) or int(name[i, ...])"),
    ("score_mod", "score + int(off, 2)", "int(off, 2)", "got 2 arguments"),
    ("score_mod", "score + int(off) + off", "off", "read both as int(off) and as off"),
    ("score_mod", "score * bias[h] + int(bias[h])", "bias[h]", "read both as int(bias) and as bias"),
    ("score_mod", "int(slope[h]) + alibi", "alibi", "inside alibi (score - slope[h] *"),  # the call, not the template
]


@pytest.mark.parametrize("kind, text, piece, fragment", ERRORS, ids=[f"{e[0]}:{e[1][:30]}" for e in ERRORS])
def test_errors_quote_the_piece(kind, text, piece, fragment):
    compile_fn = compile_mask if kind == "mask" else compile_score_mod
    with pytest.raises(ExprError) as info:
        compile_fn(text)
    message = str(info.value)
    assert message.startswith(f"{kind}: ") and fragment in message, message
    assert piece in info.value.piece, (piece, info.value.piece)


def test_error_columns_count_characters_from_the_text_as_given():
    with pytest.raises(ExprError) as info:
        compile_mask("  causal and foo.bar")
    assert info.value.column == 14 and info.value.piece == "foo.bar"
    with pytest.raises(ExprError) as info:
        compile_mask("(causal and\n  foo.bar)")
    assert (info.value.line, info.value.column) == (2, 3) and "line 2, column 3" in str(info.value)
    with pytest.raises(ExprError) as info:  # a non-ASCII character before the piece: columns are characters
        compile_mask("q_idx < 3 and 'é' == foo.bar")
    assert info.value.column == 15 and info.value.piece == "'é'"


def test_non_strings_are_type_errors():
    with pytest.raises(TypeError):
        compile_mask(3)


BUILTIN_MASKS = {
    "none": ("True", "none"),
    "causal": ("kv_idx <= q_idx + (kv_len - q_len)", "causal"),
    "sliding_window(128, 0)": ("q_idx + (kv_len - q_len) - 128 <= kv_idx and kv_idx <= q_idx + (kv_len - q_len)",
                               "sliding_window_128_0"),
    "sliding_window(0, 7)": ("q_idx + (kv_len - q_len) <= kv_idx and kv_idx <= q_idx + (kv_len - q_len) + 7",
                             "sliding_window_0_7"),
    "chunked(512)": ("(q_idx + kv_len - q_len) // 512 == kv_idx // 512", "chunked_512"),
    "prefix_lm(16)": ("kv_idx < 16 or kv_idx <= q_idx + (kv_len - q_len)", "prefix_lm_16"),
}


@pytest.mark.parametrize("text", list(BUILTIN_MASKS))
def test_builtin_masks_expand_to_their_definition(text):
    canonical, slug = BUILTIN_MASKS[text]
    program = compile_mask(text)
    assert (program.canonical, program.slug, program.inputs) == (canonical, slug, ())
    assert compile_mask(f" ( {text} ) ").slug == slug  # parentheses and blanks do not change the program
    assert compile_mask(canonical).canonical == canonical and compile_mask(canonical).slug.startswith("expr_")


def test_prefix_lm_takes_a_length_per_sequence_from_a_runtime_input():
    """prefix_lm(prefix[b]) is the expression its template makes (one program, one kernel with the
    spelled-out form); only an integer expression is accepted, and the other built-ins stay constant."""
    program = compile_mask("prefix_lm(prefix[b])")
    assert program == compile_mask("kv_idx < prefix[b] or causal")
    assert program.canonical == "kv_idx < prefix[b] or kv_idx <= q_idx + (kv_len - q_len)"
    assert program.inputs == (("prefix", 1),) and program.slug.startswith("expr_")
    assert stored_text("prefix_lm(prefix[b])", "mask") == program.canonical
    assert compile_mask("prefix_lm(p[b, h] + 2)").inputs == (("p", 2),)
    for text, piece, problem in [("prefix_lm(q_idx > 3)", "q_idx > 3", "an integer constant or an integer expression; got bool"),
                                 ("prefix_lm(-1)", "-1", "must be >= 0; got -1"),
                                 ("sliding_window(w[b], 0)", "w[b]", "must be an integer constant")]:
        with pytest.raises(ExprError, match=re.escape(problem)) as info:
            compile_mask(text)
        assert info.value.piece == piece


@pytest.mark.parametrize("text, hint", [
    ("causl", "('causl' is not a built-in or variable: a bare name reads a runtime input, an integer; did you mean 'causal'?)"),
    ("CAUSAL", "did you mean 'causal'?"),
    ("causal and windw", "('windw' is not a built-in or variable: a bare name reads a runtime input, an integer)"),
])
def test_a_misspelt_builtin_is_named_as_the_input_it_was_read_as(text, hint):
    """A bare name is a runtime input, so a typo in a built-in fails as a type error ("got int"): the
    message says what the name was taken for, and the built-in it is close to."""
    with pytest.raises(ExprError) as info:
        compile_mask(text)
    assert hint in str(info.value)


@pytest.mark.parametrize("text, column", [("q_idx >", 8), ("causal and", 11)])
def test_an_expression_that_ends_too_soon_says_so_at_its_end(text, column):
    """Python reports an unfinished expression as 'invalid syntax' at offset 0: the error said column 1
    and "invalid syntax (invalid syntax)"."""
    with pytest.raises(ExprError) as info:
        compile_mask(text)
    assert info.value.column == column and "the expression ends too soon" in str(info.value)
    assert "(invalid syntax)" not in str(info.value)


def test_builtin_score_mods():
    softcap = compile_score_mod("softcap(30)")
    assert (softcap.canonical, softcap.slug, softcap.inputs) == ("30.0 * tanh(score / 30.0)", "softcap_30", ())
    assert compile_score_mod("softcap(30.0)") == softcap  # an int parameter of a float built-in is that float
    assert compile_score_mod("softcap(2.5)").slug == "softcap_2p5"
    assert compile_score_mod("softcap(1e-3)").slug == "softcap_0p001"
    alibi = compile_score_mod("alibi")
    assert alibi.canonical == "score - slope[h] * abs(q_idx + (kv_len - q_len) - kv_idx)"
    assert (alibi.slug, alibi.inputs) == ("alibi", (("slope", 1),))
    # mask built-ins are bools in a score modifier
    assert compile_score_mod("where(causal, score, score - 10.0)").canonical == \
        "where(kv_idx <= q_idx + (kv_len - q_len), score, score - 10.0)"


def test_combinations_of_builtins():
    both = compile_mask("causal and sliding_window(4096, 0)")
    # the band's right edge is causal's comparison: `and` keeps one copy
    assert both.canonical == "kv_idx <= q_idx + (kv_len - q_len) and q_idx + (kv_len - q_len) - 4096 <= kv_idx"
    assert compile_mask("causal & sliding_window(4096, 0)") == both
    assert compile_mask("(causal) and (sliding_window(4096, 0))") == both
    assert compile_mask("chunked(512) and causal").slug.startswith("expr_")
    assert compile_mask("not causal or prefix_lm(3)").canonical == \
        "not kv_idx <= q_idx + (kv_len - q_len) or kv_idx < 3 or kv_idx <= q_idx + (kv_len - q_len)"


def test_slug_shape():
    for text in ["causal and q_idx % 7 == 3", "kv_idx < lim", "doc[q_idx] == doc[kv_idx]"]:
        slug = compile_mask(text).slug
        assert slug.startswith("expr_") and len(slug) == 15 and slug.replace("_", "").isalnum() and slug.islower()
    assert compile_mask("kv_idx < lim").slug == compile_mask("(kv_idx)<(lim)").slug
    assert compile_mask("kv_idx < lim").slug != compile_mask("kv_idx <= lim").slug
    assert len(compile_mask("sliding_window(123456789012, 123456789012)").slug) <= 40


@pytest.mark.parametrize("text, canonical", [
    ("q_idx+1<kv_idx", "q_idx + 1 < kv_idx"),
    ("((q_idx) + (1)) < (kv_idx)", "q_idx + 1 < kv_idx"),
    ("q_idx - (kv_idx - 1) >= 0", "q_idx - (kv_idx - 1) >= 0"),
    ("(q_idx - kv_idx) - 1 >= 0", "q_idx - kv_idx - 1 >= 0"),
    ("0 <= q_idx - kv_idx < 128", "0 <= q_idx - kv_idx and q_idx - kv_idx < 128"),
    ("causal and (q_idx > 3 and kv_idx > 3)", "kv_idx <= q_idx + (kv_len - q_len) and q_idx > 3 and kv_idx > 3"),
    ("(q_idx < 1) == (kv_idx < 1)", "(q_idx < 1) == (kv_idx < 1)"),
    ("not (q_idx < 1 or kv_idx < 1)", "not (q_idx < 1 or kv_idx < 1)"),
    ("q_idx * (2 + 3) + 0 < kv_idx // 1", "q_idx * 5 < kv_idx"),
    ("-(-q_idx) < --kv_idx", "q_idx < kv_idx"),
    ("q_idx < -3 % 5", "q_idx < 2"),
    ("q_idx < -7 // 2", "q_idx < -4"),
    ("-q_idx * 2 < kv_idx", "-q_idx * 2 < kv_idx"),
    ("q_idx - -3 < kv_idx", "q_idx - -3 < kv_idx"),
    ("True and q_idx < 1 or False", "q_idx < 1"),
    ("where(1 < 2, q_idx, kv_idx) < 3", "q_idx < 3"),
    ("min(q_idx, min(kv_idx, 3)) < max(1, 2)", "min(q_idx, kv_idx, 3) < 2"),
])
def test_canonical_mask_text(text, canonical):
    program = compile_mask(text)
    assert program.canonical == canonical
    assert compile_mask(canonical).canonical == canonical


@pytest.mark.parametrize("text, canonical", [
    ("score*2", "score * 2.0"),
    ("score + q_idx / 2", "score + q_idx / 2.0"),
    ("score + 1 / 4", "score + 0.25"),
    ("score * 1.0 - 0.0", "score"),
    ("score + 0.0", "score + 0.0"),  # not simplified: it turns -0.0 into 0.0
    ("where(q_idx > 3, score, 0)", "where(q_idx > 3, score, 0.0)"),
    ("score + where(q_idx > 3, 1, 2)", "score + where(q_idx > 3, 1, 2)"),
    ("tanh(1.0) + score", f"{math.tanh(1.0)!r} + score"),
    ("log(0.0 - 1.0) + score", "log(-1.0) + score"),  # not folded: NaN stays a run-time value
    ("min(score, 1, 2.5)", "min(score, 1.0, 2.5)"),
    ("score - s[h] * abs(q_idx + int( q_off ) - kv_idx)", "score - s[h] * abs(q_idx + int(q_off) - kv_idx)"),
    ("score + int(w[h, q_idx])", "score + int(w[h, q_idx])"),
])
def test_canonical_score_mod_text(text, canonical):
    assert compile_score_mod(text).canonical == canonical
    assert compile_score_mod(canonical).canonical == canonical


def respaced(text: str, r: random.Random) -> str:
    """The same expression with different blanks and redundant parentheses around names and numbers."""
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    out = []
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.NL):
            continue
        following = tokens[i + 1].string if i + 1 < len(tokens) else ""
        piece = tok.string
        wrappable = (tok.type == tokenize.NUMBER or (tok.type == tokenize.NAME and piece not in
                     ("and", "or", "not", "True", "False"))) and following not in ("(", "[")
        if wrappable and r.random() < 0.3:
            piece = f"( {piece} )"
        word = tok.type in (tokenize.NAME, tokenize.NUMBER)
        out.append(piece + " " * r.randint(1 if word else 0, 2))  # `and True` must stay two words
    return " " * r.randint(0, 2) + "".join(out)


@SETTINGS
@given(text=mask_texts(), seed=st.integers(0, 2**16))
def test_random_masks_canonicalise_stably(text, seed):
    program = compile_mask(text)
    again = compile_mask(program.canonical)
    assert (again.canonical, again.ir) == (program.canonical, program.ir)
    variant = compile_mask(respaced(text, random.Random(seed)))
    assert (variant.canonical, variant.slug) == (program.canonical, program.slug)


@SETTINGS
@given(text=score_texts(), seed=st.integers(0, 2**16))
def test_random_score_mods_canonicalise_stably(text, seed):
    program = compile_score_mod(text)
    again = compile_score_mod(program.canonical)
    assert (again.canonical, again.ir) == (program.canonical, program.ir)
    assert compile_score_mod(respaced(text, random.Random(seed))).canonical == program.canonical


# -- dense evaluation against Python ------------------------------------------------------------------

points = st.tuples(st.integers(0, 63), st.integers(0, 63), st.integers(0, MAX_B), st.integers(0, MAX_H))


@SETTINGS
@given(text=mask_texts(), q_len=st.integers(1, 64), kv_len=st.integers(1, 64),
       pts=st.lists(points, min_size=1, max_size=12))
def test_mask_dense_matches_python(text, q_len, kv_len, pts):
    program = compile_mask(text)
    q, k, b, h = (torch.tensor(column) for column in zip(*pts))
    got = program.dense(q, k, q_len, kv_len, b, h, tensors(MASK_INPUT_VALUES, torch.int64))
    assert got.dtype == torch.bool and got.shape == (len(pts),)
    expected = [bool(python_value(text, *p[:2], q_len, kv_len, *p[2:], inputs=MASK_INPUT_VALUES)) for p in pts]
    assert got.tolist() == expected, program.canonical


@SETTINGS
@given(text=score_texts(), q_len=st.integers(1, 64), kv_len=st.integers(1, 64),
       pts=st.lists(st.tuples(st.floats(-8, 8), points), min_size=1, max_size=12))
def test_score_mod_dense_matches_python(text, q_len, kv_len, pts):
    program = compile_score_mod(text)
    scores = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    q, k, b, h = (torch.tensor(column) for column in zip(*(p[1] for p in pts)))
    got = program.dense(scores, q, k, q_len, kv_len, b, h, tensors(SCORE_INPUT_VALUES, torch.float64))
    assert got.dtype == torch.float64 and got.shape == (len(pts),)
    expected = [python_value(text, *p[1][:2], q_len, kv_len, *p[1][2:], score=p[0], inputs=SCORE_INPUT_VALUES)
                for p in pts]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_dense_broadcasts_and_keeps_the_score_dtype():
    causal = compile_mask("causal")
    visible = grid(causal, 3, 5)
    assert visible.tolist() == [[k <= q + 2 for k in range(5)] for q in range(3)]
    assert grid(compile_mask("none"), 3, 5).shape == (3, 5)  # even where no variable is used
    assert causal.dense(0, 2, 3, 5).dtype == torch.bool and causal.dense(0, 2, 3, 5).shape == ()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        out = compile_score_mod("softcap(30)").dense(torch.full((2, 3), 45.0, dtype=dtype), 0, 0, 1, 1)
        assert out.dtype == dtype and out.shape == (2, 3)
        torch.testing.assert_close(out, torch.full((2, 3), 30 * math.tanh(1.5), dtype=dtype))


def test_dense_inputs():
    docs = compile_mask("doc[b, q_idx] == doc[b, kv_idx]")
    assert docs.inputs == (("doc", 2),)
    doc = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    assert grid(docs, 4, 4, b=1, inputs={"doc": doc})[0].tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="input 'doc' is used by the expression but not given"):
        grid(docs, 4, 4)
    with pytest.raises(ValueError, match="read with 2 indices but has 1 dimensions"):
        grid(docs, 4, 4, inputs={"doc": doc[0]})
    limit = compile_mask("kv_idx < lim")
    assert limit.inputs == (("lim", 0),)
    assert grid(limit, 1, 4, inputs={"lim": 2}).tolist() == [[True, True, False, False]]
    alibi = compile_score_mod("alibi")
    out = alibi.dense(torch.zeros(2, 3), torch.arange(2)[:, None], torch.arange(3)[None, :], 2, 3, h=1,
                      inputs={"slope": [0.5, 0.25]})
    assert out.tolist() == [[-0.25, 0.0, -0.25], [-0.5, -0.25, 0.0]]


def test_int_reads_an_int32_input_in_a_score_modifier():
    """int(name) in a score modifier reads an int input (a mask's offsets, shared under one name); the dense
    evaluation does integer arithmetic on it, then converts, as the kernels do. In a mask it changes nothing."""
    from attngen.maskc.ir import Input, Type, walk

    shifted = compile_score_mod("score - slope[h] * abs(q_idx + int(q_offset) - kv_idx)")
    assert shifted.inputs == (("q_offset", 0), ("slope", 1))
    types = {n.name: n.type for n in walk(shifted.ir) if isinstance(n, Input)}
    assert types == {"q_offset": Type.INT, "slope": Type.FLOAT}
    out = shifted.dense(torch.zeros(2, 3), torch.arange(2)[:, None], torch.arange(3)[None, :], 2, 3, h=0,
                        inputs={"slope": [0.5], "q_offset": torch.tensor(2, dtype=torch.int32)})
    assert out.tolist() == [[-1.0, -0.5, 0.0], [-1.5, -1.0, -0.5]]
    assert compile_mask("kv_idx <= q_idx + int(q_offset)").canonical == "kv_idx <= q_idx + q_offset"


def test_folded_away_inputs_are_not_inputs():
    assert compile_mask("where(1 < 2, kv_idx, off[h]) < 3").inputs == ()


# -- classification: soundness and exactness ----------------------------------------------------------


@st.composite
def rectangles(draw, q_len, kv_len):
    q = sorted(draw(st.tuples(st.integers(0, q_len - 1), st.integers(0, q_len - 1))))
    k = sorted(draw(st.tuples(st.integers(0, kv_len - 1), st.integers(0, kv_len - 1))))
    return q[0], q[1], k[0], k[1]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=mask_texts(), q_len=st.integers(1, 64), kv_len=st.integers(1, 64),
       b=st.integers(0, MAX_B), h=st.integers(0, MAX_H))
def test_random_mask_classification_is_sound(data, text, q_len, kv_len, b, h):
    program = compile_mask(text)
    inputs = tensors(MASK_INPUT_VALUES, torch.int64)
    visible = grid(program, q_len, kv_len, b, h, inputs)
    for _ in range(6):
        rect = data.draw(rectangles(q_len, kv_len))
        got, _ = check_sound(program, visible, rect, q_len, kv_len, b, h, inputs)
        # without the inputs' values the answer may only get less precise
        without = program.classify(*rect, q_len, kv_len, b, h)
        assert without in (got, "partial")
    whole = program.classify(0, q_len - 1, 0, kv_len - 1, q_len, kv_len, b, h, inputs)
    assert whole in (truth(visible), "partial")


builtin_masks = st.one_of(
    st.just("causal"),
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda p: f"sliding_window({p[0]}, {p[1]})"),
    st.integers(1, 40).map(lambda s: f"chunked({s})"),
    st.tuples(st.integers(1, 20), st.integers(0, 20)).map(lambda p: f"chunked({p[0]}) and sliding_window({p[1]}, 0)"),
    st.integers(0, 40).map(lambda w: f"causal and sliding_window({w}, 0)"),
    st.integers(0, 70).map(lambda n: f"prefix_lm({n})"),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=builtin_masks, q_len=st.integers(1, 64), kv_len=st.integers(1, 64),
       block_q=st.sampled_from([1, 3, 4, 8, 16]), block_kv=st.sampled_from([2, 4, 5, 16, 32]))
def test_banded_builtins_classify_exactly(data, text, q_len, kv_len, block_q, block_kv):
    """causal, sliding_window, chunked, prefix_lm (and conjunctions with causal): every block-aligned
    tile, and any rectangle, is classified exactly as the dense truth (a tile below the diagonal is
    full, one above it empty)."""
    program = compile_mask(text)
    visible = grid(program, q_len, kv_len)
    exact_chunks = "chunked" not in text or "sliding" not in text  # chunked and a band: only sound
    for q_lo in range(0, q_len, block_q):
        for kv_lo in range(0, kv_len, block_kv):
            rect = (q_lo, min(q_lo + block_q, q_len) - 1, kv_lo, min(kv_lo + block_kv, kv_len) - 1)
            got, actual = check_sound(program, visible, rect, q_len, kv_len)
            assert got == actual or not exact_chunks, (text, rect, got, actual)
    for _ in range(5):
        rect = data.draw(rectangles(q_len, kv_len))
        got, actual = check_sound(program, visible, rect, q_len, kv_len)
        assert got == actual or not exact_chunks, (text, rect, got, actual)


builtin_combinations = st.lists(st.sampled_from(["none", "causal", "sliding_window(5, 2)", "chunked(8)",
                                                 "prefix_lm(10)", "not causal", "not chunked(3)"]),
                                min_size=1, max_size=3).flatmap(
    lambda names: st.sampled_from([" and ", " or ", " & ", " | "]).map(lambda op: op.join(f"({n})" for n in names)))


@SETTINGS
@given(data=st.data(), text=builtin_combinations, q_len=st.integers(1, 64), kv_len=st.integers(1, 64))
def test_combined_builtins_classify_soundly(data, text, q_len, kv_len):
    program = compile_mask(text)
    visible = grid(program, q_len, kv_len)
    for _ in range(10):
        check_sound(program, visible, data.draw(rectangles(q_len, kv_len)), q_len, kv_len)


def test_causal_blocks_by_diagonal():
    causal = compile_mask("causal")
    # q_len = kv_len = 64: the diagonal is q == k
    assert causal.classify(16, 31, 0, 15, 64, 64) == "full"
    assert causal.classify(0, 15, 16, 31, 64, 64) == "empty"
    assert causal.classify(16, 31, 16, 31, 64, 64) == "partial"
    # bottom-right alignment: with 8 more keys than queries, query 0 sees keys 0..8
    assert causal.classify(0, 0, 0, 8, 4, 12) == "full"
    assert causal.classify(0, 0, 9, 9, 4, 12) == "empty"


def test_imprecise_is_partial():
    # each comparison can be false on a diagonal tile; the analysis does not see their `or` never is
    assert compile_mask("kv_idx <= q_idx or kv_idx > q_idx").classify(0, 7, 0, 7, 64, 64) == "partial"


def test_linear_forms_keep_the_correlation_of_a_variable_on_both_sides():
    # 2q >= q + k is q >= k: plain intervals would say partial for a block below the diagonal.
    program = compile_mask("2 * q_idx >= q_idx + kv_idx")
    assert program.classify(16, 31, 0, 15, 64, 64) == "full"
    assert program.classify(0, 15, 16, 31, 64, 64) == "empty"
    assert compile_mask("q_idx - q_idx == 0").classify(0, 63, 0, 63, 64, 64) == "full"
    assert compile_mask("(q_idx - kv_idx) * 3 + kv_idx * 3 == q_idx * 3").classify(0, 9, 0, 9, 10, 10) == "full"


def test_inputs_are_read_where_their_index_is_exact():
    limit = compile_mask("kv_idx < lim[b]")
    inputs = {"lim": torch.tensor([4, 10])}
    assert limit.classify(0, 63, 0, 3, 64, 64, b=0, inputs=inputs) == "full"
    assert limit.classify(0, 63, 4, 9, 64, 64, b=0, inputs=inputs) == "empty"
    assert limit.classify(0, 63, 4, 9, 64, 64, b=1, inputs=inputs) == "full"
    assert limit.classify(0, 63, 0, 3, 64, 64, b=0) == "partial"  # no values given: unknown
    assert limit.classify(0, 63, 0, 3, 64, 64, b=5, inputs=inputs) == "partial"  # out of range: unknown
    docs = compile_mask("doc[q_idx] == doc[kv_idx]")
    doc = torch.tensor([0, 0, 1, 1])
    assert docs.classify(0, 0, 0, 1, 4, 4, inputs={"doc": doc}) == "partial"  # kv index not exact
    assert docs.classify(0, 0, 1, 1, 4, 4, inputs={"doc": doc}) == "full"
    assert docs.classify(0, 0, 2, 2, 4, 4, inputs={"doc": doc.tolist()}) == "empty"  # nested lists work too


def test_with_a_granule_inputs_are_read_over_ranges_of_their_last_index():
    # What the block table's summaries give (attngen/mask_table.py): the min and max over the
    # granules the range touches; exact at one position; unknown outside the tensor.
    docs = compile_mask("doc[b, q_idx] == doc[b, kv_idx]")
    doc = torch.tensor([[0] * 8 + [1] * 8 + [2] * 4, [5] * 20])
    rows = {"doc": doc}
    assert docs.classify(0, 7, 8, 15, 20, 20, b=0, inputs=rows, granule=4) == "empty"
    assert docs.classify(8, 15, 8, 15, 20, 20, b=0, inputs=rows, granule=4) == "full"
    assert docs.classify(0, 15, 16, 19, 20, 20, b=1, inputs=rows, granule=4) == "full"
    assert docs.classify(6, 9, 8, 11, 20, 20, b=0, inputs=rows, granule=4) == "partial"
    # granules of 16: rows 0..7 summarize as doc 0..1, so the same rectangle is no longer empty (sound)
    assert docs.classify(0, 7, 8, 15, 20, 20, b=0, inputs=rows, granule=16) == "partial"
    assert docs.classify(0, 7, 8, 15, 20, 20, b=0, inputs=rows) == "partial"  # no granule: not exact, unknown
    assert docs.classify(0, 7, 8, 15, 20, 20, b=0, inputs={"doc": doc[:, :12]}, granule=4) == "partial"
    # more than MAX_SPAN_GRANULES granules (here 64 of 16 positions) are left unknown, as the kernels do
    same = {"doc": torch.zeros(1, 2048, dtype=torch.int32)}
    assert docs.classify(0, 64 * 16 - 1, 0, 0, 2048, 2048, inputs=same, granule=16) == "full"
    assert docs.classify(0, 64 * 16, 0, 0, 2048, 2048, inputs=same, granule=16) == "partial"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), q_len=st.integers(1, 64), kv_len=st.integers(1, 64), granule=st.sampled_from([1, 4, 16]))
def test_classification_with_granules_is_sound(data, q_len, kv_len, granule):
    """Random document ids (sorted or not) under documents and causal: empty and full are never wrong."""
    program = compile_mask("doc[b, q_idx] == doc[b, kv_idx] and kv_idx <= q_idx + (kv_len - q_len)")
    n = max(q_len, kv_len)
    ids = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="ids")
    if data.draw(st.booleans(), label="sorted"):
        ids = sorted(ids)
    inputs = {"doc": torch.tensor([ids])}
    visible = grid(program, q_len, kv_len, inputs=inputs)
    for _ in range(8):
        q_lo = data.draw(st.integers(0, q_len - 1))
        q_hi = data.draw(st.integers(q_lo, q_len - 1))
        kv_lo = data.draw(st.integers(0, kv_len - 1))
        kv_hi = data.draw(st.integers(kv_lo, kv_len - 1))
        got = program.classify(q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, inputs=inputs, granule=granule)
        actual = truth(visible[q_lo:q_hi + 1, kv_lo:kv_hi + 1])
        assert got == actual or got == "partial", (ids, (q_lo, q_hi, kv_lo, kv_hi), granule, got, actual)


def test_interval_rules():
    # abs, min/max, //, % and where over ranges, checked on rectangles where the answer is known
    assert compile_mask("abs(q_idx - kv_idx) <= 3").classify(10, 12, 9, 13, 64, 64) == "full"
    assert compile_mask("abs(q_idx - kv_idx) <= 3").classify(10, 12, 9, 14, 64, 64) == "partial"
    assert compile_mask("abs(q_idx - kv_idx) <= 4").classify(10, 12, 10, 12, 64, 64) == "full"
    assert compile_mask("kv_idx % 8 < 8").classify(0, 0, 0, 63, 1, 64) == "full"
    assert compile_mask("kv_idx % 8 < 4").classify(0, 0, 8, 11, 1, 64) == "full"
    assert compile_mask("kv_idx % 8 < 4").classify(0, 0, 12, 15, 1, 64) == "empty"
    assert compile_mask("min(q_idx, 5) <= 5").classify(0, 63, 0, 0, 64, 1) == "full"
    assert compile_mask("where(q_idx < 32, kv_idx, 0) < 16").classify(32, 63, 20, 30, 64, 64) == "full"
    assert compile_mask("q_idx * kv_idx >= 0").classify(0, 63, 0, 63, 64, 64) == "full"
    assert compile_mask("(q_idx < 3) == (kv_idx < 3)").classify(0, 2, 0, 2, 64, 64) == "full"
    with pytest.raises(ValueError, match="empty rectangle"):
        compile_mask("causal").classify(3, 2, 0, 0, 4, 4)


# -- the derivative of score modifiers ----------------------------------------------------------------


def test_derivative_of_builtins():
    softcap = compile_score_mod("softcap(30)")
    d = softcap.derivative()
    assert isinstance(d, ScoreModProgram)
    assert d.canonical == "1.0 - tanh(score / 30.0) * tanh(score / 30.0)" and d.slug == "d_softcap_30"
    assert compile_score_mod("alibi").derivative().canonical == "1.0"
    assert compile_score_mod("score").is_identity and not softcap.is_identity
    assert compile_score_mod("score").derivative().canonical == "1.0"
    assert compile_score_mod("2.0 * score * 3.0").derivative().canonical == "6.0"
    assert compile_score_mod("q_idx * 0.5 + 1.0").derivative().canonical == "0.0"
    assert compile_score_mod("score / 3.0").derivative().canonical == "0.3333333333333333"
    assert compile_score_mod("exp(score)").derivative().canonical == "exp(score)"
    assert compile_score_mod("softcap(30)").derivative().derivative().ir.type is Type.FLOAT


def check_derivative(program, scores, q, k, q_len, kv_len, b, h):
    inputs = tensors(SCORE_INPUT_VALUES, torch.float64)
    x = scores.clone().requires_grad_(True)
    y = program.dense(x, q, k, q_len, kv_len, b, h, inputs)
    expected = torch.zeros_like(scores)
    if y.requires_grad:  # a constant modifier has no graph
        (grad,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
        expected = expected if grad is None else grad
    derivative = program.derivative()
    got = derivative.dense(scores, q, k, q_len, kv_len, b, h, inputs)
    # At a kink (abs at 0, a tie of min/max) the derivative is a convention: abs takes 0 as autograd
    # does, a tie takes the first argument's side where autograd splits it. There, got must be
    # autograd's value, or a subgradient: between the one-sided derivatives. Kinks can coincide,
    # and at an exact tie of a max or min the conventions can leave an isolated point where neither
    # got nor autograd is the derivative the function has on both sides (min(log(abs(score) + 1.0),
    # score) at 0: slope 1 both sides, got 0 through abs's convention, autograd 0.5 by its split):
    # such a point, where our derivative is discontinuous but the sides agree, is measure zero and
    # left out; everywhere our derivative is continuous it must equal autograd's.
    left = derivative.dense(scores - 1e-6, q, k, q_len, kv_len, b, h, inputs)
    right = derivative.dense(scores + 1e-6, q, k, q_len, kv_len, b, h, inputs)
    smooth = torch.isclose(left, right, rtol=1e-4, atol=1e-6, equal_nan=True)
    near = [torch.isclose(got, other, rtol=1e-4, atol=1e-6, equal_nan=True) for other in (expected, left, right)]
    # (the sides are sampled 1e-6 away: a side's slope may still move by ~|f''| x 1e-6 from its limit,
    # min(score * score, score) at 0 has sides 1 and 2e-6 and the subgradients [0, 1])
    between = (got >= torch.minimum(left, right) - 1e-4) & (got <= torch.maximum(left, right) + 1e-4)
    assert (smooth | near[0] | near[1] | near[2] | between).all(), (program.canonical, scores, got, expected, left, right)
    continuous = smooth & near[1]
    torch.testing.assert_close(got[continuous], expected[continuous], rtol=1e-7, atol=1e-9, equal_nan=True,
                               msg=lambda m: f"{program.canonical}\n d: {derivative.canonical}\n{m}")


@SETTINGS
@given(text=st.one_of(score_texts(), st.sampled_from(["softcap(30)", "softcap(0.5)", "alibi", "score"])),
       pts=st.lists(st.tuples(st.floats(-8, 8), points), min_size=1, max_size=12),
       q_len=st.integers(1, 64), kv_len=st.integers(1, 64))
def test_derivative_matches_autograd(text, pts, q_len, kv_len):
    program = compile_score_mod(text)
    scores = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    q, k, b, h = (torch.tensor(column) for column in zip(*(p[1] for p in pts)))
    check_derivative(program, scores, q, k, q_len, kv_len, b, h)


# -- emitted C++ (compiled and run in test_maskc_cuda.py) ---------------------------------------------


def test_emitted_cuda_is_printed_from_the_ir():
    program = compile_mask("doc[b, q_idx] == doc[b, kv_idx] and kv_idx // 4 < lim")
    code = program.cuda_visible()
    # Over input reads, `and`, `or` and `where` evaluate every operand (no branch between the reads:
    # mask.cuh.j2 shown_in_bounds); without reads they stay C++'s own.
    assert code == ("maskc_and((((long long)(doc[b][q_idx])) == ((long long)(doc[b][kv_idx]))), "
                    "(((long long)(maskc_floordiv32(((int)kv_idx), 4))) < ((long long)(lim))))")
    assert compile_mask("q_idx >= kv_idx or kv_idx % 7 == 0").cuda_visible().count(" || ") == 1
    assert "maskc_where<" in compile_mask("where(q_idx > 3, doc[b, kv_idx], 0) == 1").cuda_visible()
    routed = program.cuda_visible(lambda name, index: f"p.{name}[{' * 64 + '.join(index)}]" if index else f"p.{name}")
    assert "p.doc[b * 64 + q_idx]" in routed and "p.lim" in routed
    assert "return 1;" in program.cuda_classify() and "p.doc[" in program.cuda_classify(
        lambda name, index: f"p.{name}[{']['.join(index)}]")
    softcap = compile_score_mod("softcap(30)").cuda_expr()
    # A constant divisor becomes a multiply by its float32 reciprocal (no IEEE division's slow path per
    # element); a runtime divisor, or one whose reciprocal is not a normal float32, keeps the division.
    assert softcap == "(30.0f * maskc_tanhf((score * 0.0333333351f)))"
    assert compile_score_mod("score / (q_idx + 1)").cuda_expr().count(" / ") == 1
    assert compile_score_mod("score / 1e38").cuda_expr() == "(score / 9.99999968e+37f)"
    assert "double" not in softcap and "tanh(" not in softcap
    assert compile_score_mod("score * 0.1").cuda_expr() == "(score * 0.100000001f)"
    assert compile_score_mod("score - 1e-50").cuda_expr() == "(score - 0.0f)"
    assert "__host__ __device__" in cuda_preamble() and "maskc_floordiv" in cuda_preamble()


def test_point_code_picks_int_where_every_value_fits_in_int32():
    # kv_idx % 3 and the comparisons are int: no 64-bit arithmetic, and so no 64-bit division.
    code = compile_mask("kv_idx % 3 != 1").cuda_visible()
    assert code == "(maskc_mod32(((int)kv_idx), 3) != 1)"
    assert "long long" not in code and "LL" not in code and "maskc_mod(" not in code
    both = compile_mask("kv_idx%3 != 1 or (q_idx == kv_idx and h == 0)").cuda_visible()
    assert "long long" not in both and "(((int)q_idx) == ((int)kv_idx))" in both
    # causal: kv_len - q_len fits in int32, but q_idx + (kv_len - q_len) can reach 2^32 - 4, so the
    # sum and the comparison are long long, the int difference promoted explicitly before the add.
    assert compile_mask("causal").cuda_visible() == \
        "(kv_idx <= (q_idx + ((long long)((((int)kv_len) - ((int)q_len))))))"
    # chunked: the dividend is long long; the quotient fits, so it is narrowed to compare as int.
    assert compile_mask("chunked(512)").cuda_visible() == \
        "(((int)(maskc_floordiv(((q_idx + kv_len) - q_len), 512LL))) == maskc_floordiv32(((int)kv_idx), 512))"
    # products and sums that may leave int32 stay long long; a mixed comparison promotes explicitly.
    assert compile_mask("q_idx * 2 < kv_idx").cuda_visible() == "((q_idx * 2LL) < kv_idx)"
    assert compile_mask("q_idx // 2 + kv_idx > kv_len").cuda_visible() == \
        "((((long long)(maskc_floordiv32(((int)q_idx), 2))) + kv_idx) > kv_len)"
    assert compile_mask("(h * 100 + b) % 7 == 0").cuda_visible() == \
        "(maskc_mod32(((((int)h) * 100) + ((int)b)), 7) == 0)"
    # a divisor beyond int32 keeps the division long long, however small the dividend
    assert compile_mask("h // 3000000000 == 0").cuda_visible() == "(((int)(maskc_floordiv(h, 3000000000LL))) == 0)"
    # inputs are long long; their indices reach input_ref as long long
    assert compile_mask("off[kv_idx % 4] < h").cuda_visible() == \
        "(((long long)(off[((long long)(maskc_mod32(((int)kv_idx), 4)))])) < h)"
    # score modifiers: int parts as int, converted to float from int
    assert compile_score_mod("score + (q_idx - kv_idx) // 3 * 0.5").cuda_expr() == \
        "(score + (((float)(maskc_floordiv32((((int)q_idx) - ((int)kv_idx)), 3))) * 0.5f))"
    # the classifier divides on int where the dividend's range fits, else on long long
    classify = compile_mask("chunked(512)").cuda_classify()
    assert "maskc_floordiv32((int)(kv_lo), 512)" in classify and "maskc_floordiv(maskc_t0, 512LL)" in classify
    preamble = cuda_preamble()
    for helper in ("floordiv32", "mod32", "min32", "max32", "abs32"):
        assert f"__host__ __device__ __forceinline__ int maskc_{helper}(" in preamble


def test_static_ranges():
    from attngen.maskc.cuda import fits_int32, static_range

    def rng(text):
        return static_range(compile_mask(f"({text}) == 0").ir.args[0])

    assert rng("kv_idx % 3") == (0, 2)
    assert rng("q_idx + (kv_len - q_len)") == (-(2**31 - 2), 2**32 - 4)
    assert not fits_int32(rng("q_idx + (kv_len - q_len)")) and fits_int32(rng("kv_len - q_len"))
    assert rng("abs(q_idx - kv_idx) // 2") == (0, 2**30 - 1)
    assert rng("h * b") == (0, 65534**2) and rng("-h") == (-65534, 0)
    assert rng("min(q_idx, 7, kv_len)") == (0, 7) and rng("max(q_len, h)") == (1, 2**31 - 1)
    assert rng("where(causal, h, b - 1)") == (-1, 65534)
    assert rng("off[h]") is None and rng("off[h] + 1") is None and rng("off[h] % 5") == (0, 4)
    assert rng("(q_idx + 4) % 8") == (0, 7) and rng("(h + 4) % 100000") == (4, 65538)


# Points at and near the ends of the variables' documented ranges (cuda.VAR_RANGES).
def boundary_values(name):
    from attngen.maskc.cuda import VAR_RANGES

    lo, hi = VAR_RANGES[name]
    return st.one_of(st.sampled_from([lo, lo + 1, lo + 2, hi - 2, hi - 1, hi, (lo + hi) // 2]), st.integers(lo, hi))


class Wrapping(list):
    """A list read at any integer index, modulo its length: inputs for points far out of range."""

    def __getitem__(self, i):
        return list.__getitem__(self, i % len(self))


def wrapped(values: dict) -> dict:
    return {name: Wrapping(v) if isinstance(v, list) else v for name, v in values.items()}


def int_values(node, point: dict, inputs: dict | None = None) -> list:
    """(node, value) for every int node of the tree at one point, by Python's unbounded ints; every
    node is evaluated (both branches of where), unlike C++, which evaluates one."""
    from attngen.maskc.ir import SCALAR_SEMANTICS, Const, Input, Var, walk

    memo = {}

    def value(n):
        if n not in memo:
            if isinstance(n, Const):
                memo[n] = n.value
            elif isinstance(n, Var):
                memo[n] = point[n.name]
            elif isinstance(n, Input):
                v = inputs[n.name]
                for i in n.index:
                    v = v[value(i)]
                memo[n] = v
            else:
                memo[n] = SCALAR_SEMANTICS[n.op](*(value(a) for a in n.args))
        return memo[n]

    return [(n, value(n)) for n in walk(node) if n.type is Type.INT]


@SETTINGS
@given(text=st.one_of(mask_texts(), st.sampled_from(["causal", "chunked(512) or kv_idx % 3 == 1"])),
       pts=st.lists(st.fixed_dictionaries({n: boundary_values(n) for n in ("q_idx", "kv_idx", "q_len", "kv_len",
                                                                              "b", "h")}), min_size=1, max_size=8))
def test_static_ranges_are_sound_at_the_ends_of_the_variable_ranges(text, pts):
    """The width choice of the CUDA emitter rests on static_range: every value lies inside it."""
    from attngen.maskc.cuda import static_range

    program = compile_mask(text)
    memo = {}
    for point in pts:
        for node, value in int_values(program.ir, point, wrapped(MASK_INPUT_VALUES)):
            bounds = static_range(node, memo)
            assert bounds is None or bounds[0] <= value <= bounds[1], (program.canonical, node, point, value, bounds)
