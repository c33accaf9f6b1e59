"""Score-modifier lowering: a modifier's text -> what every forward family's template needs
(attngen/cuda/score_mod.cuh.j2).

A score modifier is an expression of attngen's expression language (docs/masks.md) over `score`
(the scaled logit softmax_scale * q.k) and `b, h, q_idx, kv_idx, q_len, kv_len`, e.g. the
built-in `softcap(30.0)` (Gemma 2, Grok: `30.0 * tanh(score / 30.0)`), `alibi` (per-head
slopes read from a runtime input `slope[h]`) or `score - 0.5 * abs(q_idx - kv_idx)`. The kernel
applies it to every score before the mask and the softmax; the reference applies the same
compiled expression in float64. Runtime inputs: attngen/runtime_inputs.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from attngen.errors import show

BUILTINS = ("softcap(c)", "alibi")
ALLOWED = ("a score modifier expression over score, b, h, q_idx, kv_idx, q_len, kv_len (docs/masks.md), e.g. "
           "softcap(30.0), or None")


@dataclass(frozen=True)
class ScoreModLowering:
    text: str  # what a spec stores: the built-in call or the canonical expression
    slug: str  # for kernel names
    expr: str  # C++ float expression over float score and the index variables
    preamble: str
    program: Any  # the compiled attngen.maskc score-modifier program

    def dense(self, score, q_idx, kv_idx, Sq: int, Sk: int, b=0, h=0, inputs=None):
        """The modified scores on broadcastable torch tensors, in score's dtype (the reference's);
        `inputs`: the runtime inputs it reads, by name."""
        return self.program.dense(score, q_idx, kv_idx, Sq, Sk, b=b, h=h, inputs=inputs)


def get_score_mod(text: str) -> ScoreModLowering:
    """The lowering of a score modifier's text; ValueError naming score_mod= and what is allowed."""
    if not isinstance(text, str):  # before the cache: an unhashable value is a user mistake too
        raise ValueError(f"score_mod={show(text)} is invalid; allowed: {ALLOWED}")
    return _lower(text)


@functools.lru_cache(maxsize=1024)
def _lower(text: str) -> ScoreModLowering:
    from attngen import maskc
    from attngen.runtime_inputs import input_ref

    try:
        stored = maskc.stored_text(text, "score_mod")
        program = maskc.compile_score_mod(stored)  # every spelling lowers from the stored text: one kernel
    except maskc.ExprError as exc:
        raise ValueError(f"score_mod={show(text)} is invalid: {exc}; allowed: {ALLOWED}") from None
    # Runtime inputs are read from the kernel's argument struct p (attngen/runtime_inputs.py).
    return ScoreModLowering(stored, program.slug, program.cuda_expr(input_ref), maskc.cuda_preamble(), program)


SINK_ALLOWED = ("an expression over b, h, q_idx, q_len, kv_len and runtime inputs giving the row's sink logit, "
                "e.g. sinks[h] with inputs={'sinks': a float32 (heads_q,) tensor}, or None")
SINK_VARIABLES = {"b", "h", "q_idx", "q_len", "kv_len"}


def canonical_sink(text: str) -> str:
    """What a spec stores for an attention-sink expression: a per-row logit that joins the softmax's
    denominator only. ValueError naming sink= and what is allowed."""
    from attngen import maskc
    from attngen.maskc.ir import Var, walk

    if not isinstance(text, str):
        raise ValueError(f"sink={show(text)} is invalid; allowed: {SINK_ALLOWED}")
    try:
        program = maskc.compile_score_mod(text)
    except maskc.ExprError as exc:
        raise ValueError(f"sink={show(text)} is invalid: {exc}; allowed: {SINK_ALLOWED}") from None
    used = {node.name for node in walk(program.ir) if isinstance(node, Var)} - SINK_VARIABLES
    if used:
        raise ValueError(f"sink={show(text)} reads {sorted(used)}: a sink is one logit per row; allowed: {SINK_ALLOWED}")
    return maskc.stored_text(text, "score_mod")


def canonical(text: str | None) -> str | None:
    """What a spec stores for a score modifier (None for none, or for one that leaves scores as they are)."""
    if text is None:
        return None
    lowering = get_score_mod(text)
    return None if lowering.program.is_identity else lowering.text
