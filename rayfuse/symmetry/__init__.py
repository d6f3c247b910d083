"""Permutation symmetry as data: the groups of weight axes that share one permutation (:class:`PermutationSpec`),
their derivation from any model's ``torch.fx`` graph (:func:`derive_spec`, :func:`trace_model`), and the structure
methods read from that graph instead of parameter names (:func:`read_structure`: layers, output layer, feature map)."""

from rayfuse.symmetry.spec import AxisRef, FixedAxis, PermGroup, Perms, PermutationSpec, Probe, compose, invert
from rayfuse.symmetry.structure import (
    Layer,
    ModelStructure,
    build_node_graph,
    read_output_module,
    read_structure,
    resize_model,
    resize_with_spec,
    trace_structure,
)
from rayfuse.symmetry.trace import LEAF_MODULES, derive_spec, trace_model

__all__ = [
    "AxisRef",
    "FixedAxis",
    "PermGroup",
    "Perms",
    "PermutationSpec",
    "Probe",
    "compose",
    "invert",
    "LEAF_MODULES",
    "derive_spec",
    "trace_model",
    "Layer",
    "ModelStructure",
    "build_node_graph",
    "read_structure",
    "read_output_module",
    "resize_model",
    "resize_with_spec",
    "trace_structure",
]
