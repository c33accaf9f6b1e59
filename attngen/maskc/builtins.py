"""The built-in masks and score modifiers, written in the expression language itself.

Each built-in is a template: expression text whose parameter names are bound to constants when a
user writes e.g. `sliding_window(128, 0)`. The parser expands a built-in by parsing its template
with those bindings, exactly as it parses user text (same whitelist, same folding), so a built-in
can be no more powerful than a user expression and needs no code path of its own in any lowering.

Masks are bottom-right aligned: query row q lines up with key column q + (kv_len - q_len), so the
last query row sees the last key (the FlashAttention convention for Sq != Sk).
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.maskc.ir import Type


@dataclass(frozen=True)
class Param:
    name: str
    type: Type  # INT or FLOAT; an int literal is accepted for a FLOAT parameter
    minimum: int | float
    minimum_allowed: bool = True  # False: the value must be strictly greater than minimum
    # True: an integer expression is accepted too (prefix_lm(prefix[b]): a length per sequence, read
    # from a runtime input); the call then compiles as the expression its template makes.
    runtime: bool = False

    def problem(self, value) -> str | None:
        """Why value is out of range, or None when it is fine."""
        if value > self.minimum or (self.minimum_allowed and value == self.minimum):
            return None
        relation = ">=" if self.minimum_allowed else ">"
        return f"must be {relation} {self.minimum}; got {value}"


@dataclass(frozen=True)
class Builtin:
    name: str
    kind: str  # "mask" or "score_mod": the language its template is written in
    params: tuple[Param, ...]
    template: str
    doc: str

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(p.name for p in self.params)})" if self.params else self.name


MASK_BUILTINS = {b.name: b for b in (
    Builtin("none", "mask", (), "True", "every key is visible"),
    Builtin("causal", "mask", (), "kv_idx <= q_idx + (kv_len - q_len)",
            "bottom-right aligned causal: key k is visible to query q when k <= q + (kv_len - q_len)"),
    Builtin("sliding_window", "mask", (Param("left", Type.INT, 0), Param("right", Type.INT, 0)),
            "q_idx + (kv_len - q_len) - left <= kv_idx <= q_idx + (kv_len - q_len) + right",
            "bottom-right aligned band: `left` keys before the aligned diagonal and `right` after it"),
    Builtin("chunked", "mask", (Param("size", Type.INT, 1),),
            "(q_idx + kv_len - q_len) // size == kv_idx // size",
            "keys in the same aligned chunk of `size` positions as the query"),
    Builtin("prefix_lm", "mask", (Param("n", Type.INT, 0, runtime=True),), "kv_idx < n or causal",
            "the first n keys are visible to every query; causal after them (n a constant, or an integer "
            "expression such as prefix[b], a runtime input with a length per sequence)"),
)}

SCORE_MOD_BUILTINS = {b.name: b for b in (
    Builtin("softcap", "score_mod", (Param("c", Type.FLOAT, 0, minimum_allowed=False),),
            "c * tanh(score / c)", "tanh soft-capping of the score to (-c, c)"),
    Builtin("alibi", "score_mod", (), "score - slope[h] * abs(q_idx + (kv_len - q_len) - kv_idx)",
            "ALiBi: a per-head linear penalty `slope[h]` per position of distance from the aligned diagonal"),
)}


def visible_builtins(kind: str) -> dict[str, Builtin]:
    """The built-ins an expression of kind may use: masks see mask built-ins; score modifiers see
    both (a mask built-in is a bool there, e.g. `where(causal, score, score - 10.0)`)."""
    if kind == "mask":
        return MASK_BUILTINS
    return {**MASK_BUILTINS, **SCORE_MOD_BUILTINS}
