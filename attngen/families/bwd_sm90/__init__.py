"""bwd_sm90: the Hopper backward on warpgroup MMA (wgmma)."""

from attngen.families.bwd_sm90.family import FAMILY

__all__ = ["FAMILY"]
