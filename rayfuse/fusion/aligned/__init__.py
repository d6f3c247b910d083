"""Aligned fusion of any model: permutation groups from the model's graph, N-way matching, merges and repair."""

from rayfuse.fusion.aligned.algorithm import Aligned

__all__ = ["Aligned"]
