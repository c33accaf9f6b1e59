"""Score-modifier lowering: a modifier's text -> what every forward family's template needs
(attngen/cuda/score_mod.cuh.j2).

A score modifier is an expression of attngen's expression language (docs/masks.md) over `score`
(the scaled logit softmax_scale * q.k) and `b, h, q_idx, kv_idx, q_len, kv_len`, e.g. the
built-in `softcap(30.0)` (Gemma 2, Grok: `30.0 * tanh(score / 30.0)`) or
`score - 0.5 * abs(q_idx + (kv_len - q_len) - kv_idx)` (ALiBi with a fixed slope). The kernel
applies it to every score before the mask and the softmax; the reference applies the same
compiled expression in float64. Runtime inputs (per-head slopes, a learned bias) are not lowered
yet: a modifier that reads one is refused with a message that says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

BUILTINS = ("softcap(c)",)
ALLOWED = ("a score modifier expression over score, b, h, q_idx, kv_idx, q_len, kv_len (docs/masks.md), e.g. "
           "softcap(30.0), or None")


@dataclass(frozen=True)
class ScoreModLowering:
    text: str  # what a spec stores: the built-in call or the canonical expression
    slug: str  # for kernel names
    expr: str  # C++ float expression over float score and the index variables
    preamble: str
    program: Any  # the compiled attngen.maskc score-modifier program

    def dense(self, score, q_idx, kv_idx, Sq: int, Sk: int, b=0, h=0):
        """The modified scores on broadcastable torch tensors, in score's dtype (the reference's)."""
        return self.program.dense(score, q_idx, kv_idx, Sq, Sk, b=b, h=h)


@functools.lru_cache(maxsize=1024)
def get_score_mod(text: str) -> ScoreModLowering:
    """The lowering of a score modifier's text; ValueError naming score_mod= and what is allowed."""
    from attngen import maskc

    if not isinstance(text, str):
        raise ValueError(f"score_mod={text!r} is invalid; allowed: {ALLOWED}")
    try:
        program = maskc.compile_score_mod(text)
        stored = maskc.stored_text(text, "score_mod")
    except maskc.ExprError as exc:
        raise ValueError(f"score_mod={text!r} is invalid: {exc}; allowed: {ALLOWED}") from None
    if program.inputs:
        names = ", ".join(name for name, _ in program.inputs)
        raise ValueError(f"score_mod={text!r} reads runtime inputs ({names}); score modifiers that read tensors or "
                         "scalars at run time are not supported yet: write the values into the expression")
    return ScoreModLowering(stored, program.slug, program.cuda_expr(), maskc.cuda_preamble(), program)


def canonical(text: str | None) -> str | None:
    """What a spec stores for a score modifier (None for none, or for one that leaves scores as they are)."""
    if text is None:
        return None
    lowering = get_score_mod(text)
    return None if lowering.program.is_identity else lowering.text
