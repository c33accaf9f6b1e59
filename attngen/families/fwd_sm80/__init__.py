"""The fwd_sm80 kernel family (family.py): mma.sync FlashAttention-2-class forward."""

from attngen.families.fwd_sm80.family import FAMILY

__all__ = ["FAMILY"]
