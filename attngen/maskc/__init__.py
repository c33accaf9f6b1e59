"""Masks and score modifiers written as small expressions, compiled to torch, intervals and CUDA.

    compile_mask("causal and sliding_window(4096, 0)")         # -> MaskProgram
    compile_score_mod("softcap(30)")                            # -> ScoreModProgram

The language is a whitelisted subset of Python expression syntax (docs/masks.md is the reference):

  variables   b, h (batch, query head), q_idx, kv_idx (query row, key column, 0-based),
              q_len, kv_len (the call's Sq, Sk); score (float) in score modifiers only
  inputs      any other name, read as name[i, j] (integer indices) or name (a scalar): runtime
              tensors, int in masks and float in score modifiers; listed in program.inputs
  operators   + - * // % (divisor: a positive integer constant), / (score modifiers), unary -,
              comparisons (chained), and or not, & | (on bools), abs min max where,
              tanh exp log sqrt (score modifiers)
  built-ins   none, causal, sliding_window(left, right), chunked(size), prefix_lm(n) (masks,
              bottom-right aligned); softcap(c), alibi (score modifiers); written in the language
              itself (builtins.py) and expanded by the parser

Integers follow Python (floor division and modulo); masks are integer-only. Anything else is
refused with an ExprError (a ValueError) that quotes the offending piece and its column. User text
never reaches CUDA source: C++ is printed from the IR, with identifiers from a whitelist and
literals re-printed (cuda.py).

A mask also classifies rectangles of (query, key) positions as "empty", "full" or "partial"
(interval.py), in Python and as emitted C++ that performs the same steps. The invariant is
soundness: "empty" only if nothing in the rectangle is visible, "full" only if everything is.
A kernel skips empty blocks and masks only partial ones, so an unsound answer would be a wrong
result, while an imprecise one ("partial" where "full" was true) only costs time.

Modules, one job each: ir (nodes, types, folding, canonical text), parse (text -> IR), builtins
(the built-in templates), dense (torch), interval (classification), cuda (C++ emitters), diff
(d/dscore), program (the compiled program objects).
"""

from attngen.maskc.cuda import cuda_preamble
from attngen.maskc.parse import ExprError
from attngen.maskc.program import (
    MaskProgram,
    ScoreModProgram,
    compile_mask,
    compile_score_mod,
    stored_text,
)

__all__ = ["ExprError", "MaskProgram", "ScoreModProgram", "compile_mask", "compile_score_mod", "cuda_preamble",
           "stored_text"]
