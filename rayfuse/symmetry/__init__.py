"""Permutation symmetry as data: the groups of weight axes that share one permutation (:class:`PermutationSpec`),
and their derivation from any model's ``torch.fx`` graph (:func:`derive_spec`, :func:`trace_model`)."""

from rayfuse.symmetry.spec import AxisRef, FixedAxis, PermGroup, Perms, PermutationSpec, Probe, compose, invert
from rayfuse.symmetry.trace import LEAF_MODULES, derive_spec, trace_model

__all__ = ["AxisRef", "FixedAxis", "PermGroup", "Perms", "PermutationSpec", "Probe", "compose", "invert",
           "LEAF_MODULES", "derive_spec", "trace_model"]
