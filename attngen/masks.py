"""Mask lowering: the pluggable stage that turns a mask name into kernel code.

Each mask is lowered to four facts the forward template needs, all in terms of the
row index `q`, the key index `k` and the runtime lengths `Sq`, `Sk`:

  visible(q, k)            element predicate, evaluated only in blocks that need it
  kv_end(m0, m1)           exclusive upper bound on keys any row in [m0, m1) can see
  kv_begin(m0, m1)         lowest key any row in [m0, m1) can see
  full_end(m0, m1)         every key in [full_begin, full_end) is visible to every row
  full_begin(m0, m1)       in [m0, m1): blocks inside that range skip per-element masking

From those the kernel classifies each (query block, key block) pair as empty
(never loaded), full (no masking) or partial (masked per element). The same
predicate, evaluated densely, is the reference's mask, so kernel and reference
cannot drift apart. Sliding windows, documents and custom expressions plug in
here as further MaskLowering entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class MaskLowering:
    name: str
    # CUDA expressions over (q, k, Sq, Sk) and (m0, m1, Sq, Sk); all ints.
    visible: str
    kv_begin: str
    kv_end: str
    full_begin: str
    full_end: str
    # The same predicate for the reference: takes broadcastable integer arrays.
    dense_visible: Callable


MASKS: dict[str, MaskLowering] = {}


def register(mask: MaskLowering) -> MaskLowering:
    MASKS[mask.name] = mask
    return mask


register(
    MaskLowering(
        name="none",
        visible="true",
        kv_begin="0",
        kv_end="Sk",
        full_begin="0",
        full_end="Sk",
        dense_visible=lambda q, k, Sq, Sk: (q >= 0) & (k >= 0),
    )
)

# Bottom-right aligned: query q sees keys k <= q + Sk - Sq (FlashAttention convention).
register(
    MaskLowering(
        name="causal",
        visible="k <= q + (Sk - Sq)",
        kv_begin="0",
        kv_end="min(Sk, max(0, m1 + (Sk - Sq)))",
        full_begin="0",
        full_end="min(Sk, max(0, m0 + 1 + (Sk - Sq)))",
        dense_visible=lambda q, k, Sq, Sk: k <= q + (Sk - Sq),
    )
)


def get_mask(name: str) -> MaskLowering:
    try:
        return MASKS[name]
    except KeyError:
        raise ValueError(f"mask={name!r} is not a known mask; allowed: {sorted(MASKS)}") from None
