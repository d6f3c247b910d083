"""GEMS (Gupta et al. 2021): one-shot fusion by intersecting each client's ball of good models."""

from rayfuse.fusion.gems.algorithm import GEMS, GEMSParams

__all__ = ["GEMS", "GEMSParams"]
