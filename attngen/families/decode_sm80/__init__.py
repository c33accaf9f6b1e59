"""decode_sm80: split-KV flash decoding over a paged or contiguous KV cache (family.py)."""

from attngen.families.decode_sm80.family import FAMILY

__all__ = ["FAMILY"]
