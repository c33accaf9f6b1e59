"""Random expression text from the whole mask and score-modifier grammar (docs/masks.md).

Drawn through any object with random.Random's randint and choice: a random.Random for the fuzzer's
random specs (`attngen fuzz --random-specs`), hypothesis draws in the compiler's CPU tests
(tests/test_maskc.py), which also read the runtime inputs these trees may name (`inputs=True`:
off, doc, lim in masks; bias, slope in score modifiers). Products are kept to leaf * leaf or
* literal, so no value leaves int64 (torch would wrap where Python does not).
"""

from __future__ import annotations

MASK_INPUT_LEAVES = ("off[h]", "doc[q_idx]", "doc[kv_idx]", "lim", "doc[kv_idx % 8 + 3 * b]")
SCORE_INPUT_LEAVES = ("bias[h]", "slope[h]")


class MaskExprs:
    """Random mask text. `inputs`: whether leaves may read the runtime inputs of MASK_INPUT_LEAVES."""

    INT_VARS = ("q_idx", "kv_idx", "q_len", "kv_len", "b", "h")
    CMP = ("<", "<=", ">", ">=", "==", "!=")

    def __init__(self, r, inputs: bool = True):
        self.r = r
        self.inputs = inputs

    def int_leaf(self):
        r = self.r
        kind = r.randint(0, 5)
        if kind <= 2:
            return r.choice(self.INT_VARS)
        if kind == 3 or not self.inputs:
            return str(r.randint(-20, 20))
        return r.choice(MASK_INPUT_LEAVES)

    def int(self, depth):
        r = self.r
        if depth <= 0 or r.randint(0, 4) == 0:
            return self.int_leaf()
        a = lambda: self.int(depth - 1)  # noqa: E731 - a fresh subtree per call
        kind = r.randint(0, 8)
        if kind == 0:
            return f"({a()} {r.choice(['+', '-'])} {a()})"
        if kind == 1:
            return f"({self.int_leaf()} * {r.choice([self.int_leaf(), str(r.randint(-4, 4))])})"
        if kind == 2:
            return f"({a()} {r.choice(['//', '%'])} {r.randint(1, 9)})"
        if kind == 3:
            return f"abs({a()})"
        if kind == 4:
            args = ", ".join(a() for _ in range(r.randint(2, 3)))
            return f"{r.choice(['min', 'max'])}({args})"
        if kind == 5:
            return f"where({self.bool(depth - 1)}, {a()}, {a()})"
        if kind == 6:
            return f"-({a()})"
        return f"({a()} + {a()} * {r.randint(-3, 3)})"

    def builtin(self):
        r = self.r
        return r.choice([
            "none", "causal", f"sliding_window({r.randint(0, 20)}, {r.randint(0, 20)})",
            f"chunked({r.randint(1, 16)})", f"prefix_lm({r.randint(0, 20)})",
        ])

    def bool(self, depth):
        r = self.r
        if depth <= 0 or r.randint(0, 3) == 0:
            kind = r.randint(0, 5)
            if kind <= 2:
                return f"({self.int(depth - 1)} {r.choice(self.CMP)} {self.int(depth - 1)})"
            if kind == 3:
                ops = r.choice(self.CMP), r.choice(self.CMP)
                return f"({self.int(0)} {ops[0]} {self.int(1)} {ops[1]} {self.int(0)})"
            if kind == 4:
                return r.choice(["True", "False"])
            return self.builtin()
        a = lambda: self.bool(depth - 1)  # noqa: E731
        kind = r.randint(0, 6)
        if kind == 0:
            return f"({a()} and {a()})"
        if kind == 1:
            return f"({a()} or {a()})"
        if kind == 2:
            return f"(not {a()})"
        if kind == 3:
            return f"({a()} {r.choice(['&', '|'])} {a()})"
        if kind == 4:
            return f"where({a()}, {a()}, {a()})"
        if kind == 5:
            return f"({a()} {r.choice(['==', '!='])} {a()})"
        return f"({self.int(depth - 1)} {r.choice(self.CMP)} {self.int(depth - 1)})"

    def mask(self):
        return self.bool(self.r.randint(1, 4))


class ScoreExprs(MaskExprs):
    """Random score-modifier text; exp, log, sqrt and / get arguments that keep values finite.
    Inputs are floats in a score modifier, so integer parts read none; `inputs`: whether float
    leaves may read SCORE_INPUT_LEAVES (and use alibi, which reads slope). `smooth`: no kink in the
    score (abs, min, max of float subtrees become sqrt(x * x + 1) and means): where the exact score
    sits within its rounding of a kink, the kernel's derivative of the modifier jumps, which the
    fuzzer's first-order gradient tolerances do not cover."""

    def __init__(self, r, inputs: bool = True, smooth: bool = False):
        super().__init__(r, inputs)
        self.smooth = smooth

    def magnitude(self, x: str) -> str:
        """|x| + 1, or its smooth stand-in: at least 1 either way."""
        return f"sqrt({x} * {x} + 1.0)" if self.smooth else f"(abs({x}) + 1.0)"

    def int_leaf(self):
        r = self.r
        return r.choice(self.INT_VARS) if r.randint(0, 2) else str(r.randint(-20, 20))

    def float(self, depth):
        r = self.r
        if depth <= 0 or r.randint(0, 4) == 0:
            kind = r.randint(0, 7)
            if kind <= 2:
                return "score"
            if kind == 3:
                return r.choice(["0.5", "2.0", "-1.25", "3.0", "0.1"])
            if kind == 4:
                return f"({self.int(1)} * 0.25)"
            if kind == 5:
                return r.choice(SCORE_INPUT_LEAVES) if self.inputs else r.choice(["0.75", "-2.0"])
            return r.choice(["softcap(30)", "softcap(2.5)", "alibi"] if self.inputs else ["softcap(30)", "softcap(2.5)"])
        a = lambda: self.float(depth - 1)  # noqa: E731
        kind = r.randint(0, 11)
        if kind <= 1:
            return f"({a()} {r.choice(['+', '-', '*'])} {a()})"
        if kind == 2:
            return f"({a()} / {self.magnitude(a())})"
        if kind == 3:
            return f"tanh({a()})"
        if kind == 4:
            return f"exp(tanh({a()}))"
        if kind == 5:
            return f"log({self.magnitude(a())})"
        if kind == 6:
            return f"sqrt({self.magnitude(a())})"
        if kind == 7:
            return self.magnitude(a()) if self.smooth else f"abs({a()})"
        if kind == 8:
            if self.smooth:
                return f"(({a()} + {a()}) * 0.5)"
            return f"{r.choice(['min', 'max'])}({a()}, {a()})"
        if kind == 9:
            return f"where({self.bool(depth - 2)}, {a()}, {a()})"
        if kind == 10:
            return f"-({a()})"
        return f"({a()} + {self.int(depth - 1)})"

    def score_mod(self):
        return self.float(self.r.randint(1, 4))
