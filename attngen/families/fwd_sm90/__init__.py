"""The fwd_sm90 kernel family (family.py): Hopper forward with wgmma, TMA and warp specialisation."""

from attngen.families.fwd_sm90.family import FAMILY

__all__ = ["FAMILY"]
