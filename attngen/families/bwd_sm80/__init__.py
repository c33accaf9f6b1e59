"""bwd_sm80: the FlashAttention-2-class backward on mma.sync tensor cores (family.py)."""

from attngen.families.bwd_sm80.family import FAMILY

__all__ = ["FAMILY"]
