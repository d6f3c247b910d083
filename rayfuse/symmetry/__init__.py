"""Permutation symmetry as data: the groups of weight axes that share one permutation (:class:`PermutationSpec`)."""

from rayfuse.symmetry.spec import AxisRef, FixedAxis, PermGroup, Perms, PermutationSpec, Probe, compose, invert

__all__ = ["AxisRef", "FixedAxis", "PermGroup", "Perms", "PermutationSpec", "Probe", "compose", "invert"]
