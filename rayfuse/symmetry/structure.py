"""A model's structure read from its ``torch.fx`` graph: the layer chain, the output layer and what it reads, the last
feature map, and the permutation group of each layer's units.

Methods that once found "the last layer" or "the feature map" by parameter names (``layers.{i}.weight``,
``model.features``, torchvision's ``layer4``) read them here instead (structure as data):

* the *layers*: every ``nn.Linear`` / ``nn.ConvNd`` the graph calls, in forward order, with their state-dict keys and
  the :class:`~rayfuse.symmetry.spec.PermutationSpec` groups of their input and output units (layers inside the leaf
  modules of :data:`~rayfuse.symmetry.trace.LEAF_MODULES`, e.g. a transformer layer's feed-forward, are not graph
  nodes and are not listed);
* the *output layer*: the one layer the model's output is computed from with no other layer in between, and the
  *features node*, the graph node whose output that layer reads (an MLP's penultimate activations, a CNN's pooled
  features);
* the *feature map node*: the last ``(B, C, H, W)`` map before the global pooling or flatten that turns maps into the
  vectors the classifier reads (a CNN's last convolutional map, torchvision's ``layer4`` / ``features`` output);
  ``None`` for models without one (MLPs, transformers);
* :func:`resize_model`: a model of one architecture given the widths (group sizes) of a parameter dict, e.g. a fused
  model narrower or wider than the configuration.

Node names are those of :func:`~rayfuse.symmetry.trace.trace_model`'s graph; :func:`build_node_graph` turns the graph
into a module returning any of its nodes' values (gradients flow to the model's own parameters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx
from torch import nn

from rayfuse.errors import InputError
from rayfuse.models.params import tensors_over
from rayfuse.symmetry.spec import PermGroup, PermutationSpec
from rayfuse.symmetry.trace import derive_spec, trace_model

__all__ = [
    "Layer",
    "ModelStructure",
    "LAYER_TYPES",
    "read_structure",
    "read_output_module",
    "build_node_graph",
    "resize_model",
    "resize_with_spec",
    "read_group_sizes",
    "trace_structure",
]

#: Modules listed as layers: they write the units a permutation group reorders.
LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

_GLOBAL_POOL_MODULES = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_GLOBAL_POOL_FUNCTIONS = {"adaptive_avg_pool2d", "adaptive_max_pool2d"}
_REDUCTIONS = {"mean", "amax", "sum", "max", "amin", "min"}


@dataclass(frozen=True)
class Layer:
    """A Linear or convolution the graph calls: module name, graph node, state-dict keys, unit groups.

    ``in_group`` / ``out_group``: the spec group of the units its input columns / output rows index (``None`` where
    those units are fixed: the model's input, its output, or axes the spec could not prove permutable, or when the
    structure was read without a spec)."""

    module: str
    node: str
    kind: str  # "linear" or "conv"
    weight: str
    bias: str | None
    in_group: str | None = None
    out_group: str | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """Its state-dict entries: the weight, then the bias if any."""
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


@dataclass(frozen=True)
class ModelStructure:
    """What :func:`read_structure` reads from a model's graph (see the module docstring)."""

    layers: tuple[Layer, ...]
    output_layer: Layer
    features_node: str
    feature_map_node: str | None
    shapes: Mapping[str, tuple[int, ...]]  # each tensor node's output shape for the example batch
    hidden: tuple[Layer, ...]  # layers the features node depends on (in forward order)
    param_shapes: Mapping[str, tuple[int, ...]]  # the model's state dict: key -> shape
    spec: PermutationSpec | None = None
    graph: torch.fx.GraphModule | None = field(default=None, compare=False, repr=False)

    @property
    def representation_node(self) -> str:
        """The hidden representation a distillation method reads: the feature map if there is one, else the features
        the output layer reads."""
        return self.feature_map_node or self.features_node

    def layer(self, module: str) -> Layer:
        """The layer of that module name (``KeyError`` if there is none)."""
        for layer in self.layers:
            if layer.module == module:
                return layer
        raise KeyError(module)

    def hidden_groups(self) -> list[PermGroup]:
        """The permutation group of each hidden layer's output units, in forward order, each group once (a residual
        stage's convolutions share one); layers whose outputs are fixed have none. Needs the spec."""
        if self.spec is None:
            raise ValueError("the structure was read without a permutation spec (read_structure(..., spec=True))")
        names = [layer.out_group for layer in self.hidden if layer.out_group is not None]
        return [self.spec.group(name) for name in dict.fromkeys(names)]

    def group_sizes(self, shapes: Mapping[str, Sequence[int]], *, where: str = "params") -> dict[str, int]:
        """Each group's number of units in a parameter dict of this architecture (``shapes``: key -> shape), read
        from the axes the group covers whole; an :class:`InputError` naming the first tensor that disagrees."""
        if self.spec is None:
            raise ValueError("the structure was read without a permutation spec (read_structure(..., spec=True))")
        return read_group_sizes(self.spec, self.param_shapes, shapes, where=where)


def read_group_sizes(
    spec: PermutationSpec, template: Mapping[str, Sequence[int]], shapes: Mapping[str, Sequence[int]], *, where: str = "params"
) -> dict[str, int]:
    """Each group's number of units in ``shapes`` (key -> shape) of the architecture whose own shapes are
    ``template``, read from the axes the group covers whole; an :class:`InputError` naming the first tensor that
    disagrees."""
    sizes: dict[str, int] = {}
    for g in spec.groups:
        if g.kind in ("heads", "head_dims"):
            continue  # attention keeps its heads; their dimensions follow its width (resize_model)
        for axis in g.axes:
            if axis.start != 0 or axis.span(g.size) != template[axis.key][axis.dim]:
                continue  # a segment of its axis (a concatenation, attention's packed Q/K/V): read elsewhere
            if axis.key not in shapes:
                raise InputError(f"{where}.{axis.key}", "an entry of the model's state dict", "missing")
            length = int(tuple(shapes[axis.key])[axis.dim])
            block = axis.outer * axis.inner
            size = length // block
            if length % block or size < 1 or sizes.setdefault(g.name, size) != size:
                raise InputError(
                    f"{where}.{axis.key}",
                    f"axis {axis.dim} of {sizes.get(g.name, '?')} x {block} units (group {g.name})",
                    tuple(shapes[axis.key]),
                )
    return sizes


def _example(model: nn.Module, example_input: torch.Tensor) -> torch.Tensor:
    example = torch.as_tensor(example_input)
    if example.ndim < 1 or example.shape[0] < 2:
        raise InputError("input", "an example batch of two samples or more", tuple(example.shape))
    param = next(model.parameters(), None)
    return example.to(param.device) if param is not None else example


def _node_shapes(gm: torch.fx.GraphModule, example: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Each node's output shape (tensor nodes only) for ``example``, run in eval mode without gradients."""
    shapes: dict[str, tuple[int, ...]] = {}

    class _Shapes(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                shapes[n.name] = tuple(out.shape)
            return out

    modes = [(m, m.training) for m in gm.modules()]
    gm.eval()
    try:
        with torch.no_grad():
            _Shapes(gm).run(example)
    except Exception as exc:
        message = (str(exc).strip().splitlines() or [""])[0][:160]
        raise InputError(
            "input", "an example batch the model accepts", f"shape {tuple(example.shape)}", f"{type(exc).__name__}: {message}"
        ) from None
    finally:
        for m, training in modes:
            m.training = training
    return shapes


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _first_input(node: torch.fx.Node) -> torch.fx.Node | None:
    first = node.args[0] if node.args else None
    return first if isinstance(first, torch.fx.Node) else None


def _is_global_pool(node: torch.fx.Node, modules: Mapping[str, nn.Module], shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """An adaptive pool to 1x1, or a mean / max over the last two axes: a map reduced to one value per channel."""
    out = shapes.get(node.name)
    if out is None or len(out) not in (2, 4) or (len(out) == 4 and out[2:] != (1, 1)):
        return False
    if node.op == "call_module":
        return isinstance(modules[str(node.target)], _GLOBAL_POOL_MODULES)
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in _GLOBAL_POOL_FUNCTIONS:
        return True
    if name in _REDUCTIONS:
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
        return sorted(int(d) % 4 for d in dims if isinstance(d, int)) == [2, 3]
    return False


def _feature_map(
    features: torch.fx.Node,
    hidden: set[torch.fx.Node],
    modules: Mapping[str, nn.Module],
    shapes: Mapping[str, tuple[int, ...]],
    order: Mapping[torch.fx.Node, int],
) -> str | None:
    """The last ``(B, C, H, W)`` map the features are computed from, before the global pooling or flatten that makes
    it a vector: the 4-d input of the last node turning a 4-d value into a 2-d one, global pools stepped over."""
    upstream = _ancestors(features) | {features}
    flat = [
        n
        for n in upstream
        if len(shapes.get(n.name, ())) == 2 and (src := _first_input(n)) is not None and len(shapes.get(src.name, ())) == 4
    ]
    if not flat:
        return None
    node = _first_input(max(flat, key=order.__getitem__))
    while node is not None and _is_global_pool(node, modules, shapes):
        node = _first_input(node)
    if node is None or len(shapes.get(node.name, ())) != 4 or not (_ancestors(node) | {node}) & hidden:
        return None  # the input itself flattened (an MLP on images): no map computed by the model
    return node.name


def _output_node(gm: torch.fx.GraphModule, model: nn.Module) -> torch.fx.Node:
    """The one layer node the graph's output is computed from with no other layer in between."""
    modules = dict(gm.named_modules())
    found: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n.op == "output"]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent in seen:
                continue
            seen.add(parent)
            is_layer = parent.op == "call_module" and isinstance(modules[str(parent.target)], LAYER_TYPES)
            (found if is_layer else stack).append(parent)
    if len(found) != 1:
        raise InputError(
            "architecture",
            "a model whose output comes from one last Linear or convolution layer",
            f"{type(model).__name__} ({', '.join(str(n.target) for n in found) or 'no such layer'})",
        )
    return found[0]


def trace_structure(model: nn.Module, what: str, *, where: str = "architecture") -> torch.fx.GraphModule:
    """``model``'s ``torch.fx`` graph (:func:`~rayfuse.symmetry.trace.trace_model`), for ``what`` (e.g. "activation
    matching"): the graph whose node names probes, structure and repair read.

    A model ``torch.fx`` cannot trace (Hugging Face models) is refused here, before any work, in one line saying that it
    supports weight matching only: its permutation spec comes from ``torch.export`` (:func:`derive_spec`), whose ATen
    graph has no ``call_module`` nodes for layers and no node names stable across models, so there is no sound way to
    read layers, probes or an output layer from it."""
    try:
        return trace_model(model)
    except InputError as exc:
        if not isinstance(model, nn.Module):
            raise
        raise InputError(
            where,
            f"a model torch.fx can trace for {what}",
            type(model).__name__,
            "a model torch.fx cannot trace (e.g. Hugging Face) is analysed from torch.export, which supports "
            f"weight matching only (torch.fx: {exc.hint or exc.got})",
        ) from None


def read_output_module(model: nn.Module) -> tuple[str, nn.Module]:
    """The name and module of ``model``'s output layer (as :func:`read_structure` finds it), from the graph alone: no
    example input needed. A model ``torch.fx`` cannot trace is refused (:func:`trace_structure`)."""
    node = _output_node(trace_structure(model, "reading its output layer"), model)
    return str(node.target), model.get_submodule(str(node.target))


def read_structure(model: nn.Module, example_input: torch.Tensor, *, spec: bool = True) -> ModelStructure:
    """The structure of ``model`` read from its ``torch.fx`` graph (see the module docstring).

    Parameters
    ----------
    model : nn.Module
        Any module :func:`~rayfuse.symmetry.trace.trace_model` can trace; left as it was (modes restored).
    example_input : torch.Tensor
        A batch the model accepts, two samples or more (e.g. ``torch.zeros(2, 1, 8, 8)``); only shapes matter.
    spec : bool
        Also derive the :class:`PermutationSpec` (:func:`~rayfuse.symmetry.trace.derive_spec`) and fill in each
        layer's groups. Without it the graph alone is read (cheaper).

    Returns
    -------
    ModelStructure

    Raises
    ------
    InputError
        ``architecture`` when the model cannot be traced (a model only ``torch.export`` can follow, such as a Hugging
        Face model, supports weight matching only: :func:`trace_structure`) or its output does not come from one last
        Linear or convolution; ``input`` when it does not accept ``example_input``.
    """
    example = _example(model, example_input)
    gm = trace_structure(model, "reading its layers and output layer")
    shapes = _node_shapes(gm, example)
    modules = dict(gm.named_modules())
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    layer_nodes = [n for n in nodes if n.op == "call_module" and isinstance(modules[str(n.target)], LAYER_TYPES)]
    out_node = _output_node(gm, model)
    features = _first_input(out_node)
    if features is None:
        raise InputError("architecture", "an output layer that reads one tensor", str(out_node.target))
    derived = derive_spec(model, example) if spec else None
    param_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def groups_of(key: str, dim: int) -> str | None:
        if derived is None:
            return None
        return next((g.name for g in derived.groups if any(a.key == key and a.dim == dim for a in g.axes)), None)

    layers = []
    for n in layer_nodes:
        name = str(n.target)
        mod = modules[name]
        weight = f"{name}.weight"
        bias = f"{name}.bias" if getattr(mod, "bias", None) is not None and f"{name}.bias" in param_shapes else None
        kind = "linear" if isinstance(mod, nn.Linear) else "conv"
        layers.append(Layer(name, n.name, kind, weight, bias, groups_of(weight, 1), groups_of(weight, 0)))
    by_node = {layer.node: layer for layer in layers}
    upstream = _ancestors(features) | {features}
    hidden_nodes = {n for n in layer_nodes if n in upstream}
    return ModelStructure(
        layers=tuple(layers),
        output_layer=by_node[out_node.name],
        features_node=features.name,
        feature_map_node=_feature_map(features, hidden_nodes, modules, shapes, order),
        shapes=shapes,
        hidden=tuple(by_node[n.name] for n in layer_nodes if n in hidden_nodes),
        param_shapes=param_shapes,
        spec=derived,
        graph=gm,
    )


def build_node_graph(structure: ModelStructure, nodes: Sequence[str]) -> torch.fx.GraphModule:
    """A module computing the model's graph up to ``nodes`` and returning their values (a tuple, in that order).

    It shares the model's submodules and parameters (gradients reach them; the model's train/eval modes apply), and
    leaves out what the returned values do not need (e.g. the head, for a representation alone).
    """
    assert structure.graph is not None
    gm = structure.graph
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    missing = [name for name in nodes if name not in by_name]
    if missing:
        raise KeyError(missing[0])
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        env[n] = graph.node_copy(n, lambda m: env[m])
    graph.output(tuple(env[by_name[name]] for name in nodes))
    out = torch.fx.GraphModule(gm, graph, f"{type(gm).__name__}Nodes")
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


def _update_attributes(module: nn.Module, name: str) -> None:
    """Size attributes of a module whose tensors were resized, from its tensors (``InputError`` for a module type
    whose forward may depend on sizes it does not read from its tensors)."""
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        out_ch = module.weight.shape[0]
        if module.groups > 1:
            per_group_out = module.out_channels // module.groups
            if out_ch % per_group_out:
                raise InputError(f"params.{name}.weight", f"output channels in groups of {per_group_out}", out_ch)
            module.groups = out_ch // per_group_out
        module.out_channels, module.in_channels = out_ch, module.weight.shape[1] * module.groups
    elif isinstance(module, nn.modules.batchnorm._NormBase):  # BatchNorm, InstanceNorm
        ref = module.weight if module.weight is not None else module.running_mean
        if ref is not None:
            module.num_features = ref.shape[0]
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            module.normalized_shape = tuple(module.weight.shape)
    elif isinstance(module, nn.GroupNorm):
        if module.weight is not None:
            module.num_channels = module.weight.shape[0]
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = module.weight.shape
    elif isinstance(module, nn.MultiheadAttention):
        embed = module.out_proj.weight.shape[0]
        if embed % module.num_heads:
            raise InputError(f"params.{name}.out_proj.weight", f"a width divisible by its {module.num_heads} heads", embed)
        module.embed_dim, module.head_dim = embed, embed // module.num_heads
        if module._qkv_same_embed_dim:
            module.kdim = module.vdim = embed
    elif type(module).forward is not nn.Module.forward and any(True for _ in module.children()):
        return  # a container (its own tensors are plain parameters such as a cls token)
    else:
        raise InputError(f"params.{name}", "widths a known module type can take (Linear, Conv, norms, attention)", type(module).__name__)


def _check_runs(model: nn.Module, example_shape: Sequence[int], where: str) -> None:
    """Run the resized model on a zero batch of the example's shape: sizes no group explains fail here."""
    param = next(model.parameters(), None)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(tuple(example_shape), device=param.device if param is not None else "cpu"))
    except Exception as exc:
        message = (str(exc).strip().splitlines() or [""])[0][:160]
        raise InputError(
            where, "the parameters of one model of this architecture (widths may differ)", f"{type(exc).__name__}: {message}"
        ) from None
    finally:
        for m, training in modes:
            m.training = training


def resize_model(model: nn.Module, structure: ModelStructure, params: Mapping[str, np.ndarray], *, where: str = "params") -> nn.Module:
    """``model`` with its tensors resized to ``params``' shapes and loaded with them, in place.

    ``params`` is a state dict of ``model``'s architecture whose permutation groups may have other sizes (a fused
    model narrower or wider than the configuration); ``structure`` is ``model``'s (read with the spec). The widths are
    the groups' sizes read from ``params`` (:meth:`ModelStructure.group_sizes`); every other axis must keep its length.

    Raises
    ------
    InputError
        Naming the first entry that is missing, or whose shape no group sizes explain.
    """
    if structure.spec is None:
        raise ValueError("the structure was read without a permutation spec (read_structure(..., spec=True))")
    example = next(iter(structure.shapes.values()))  # the placeholder's: the example batch
    return resize_with_spec(model, structure.spec, params, example, where=where)


def resize_with_spec(
    model: nn.Module, spec: PermutationSpec, params: Mapping[str, np.ndarray], example_shape: Sequence[int], *, where: str = "params"
) -> nn.Module:
    """:func:`resize_model` from the model's permutation spec (at its own widths) and the shape of an example batch
    (the resized model is run on zeros of that shape)."""
    read_group_sizes(
        spec, {k: tuple(v.shape) for k, v in model.state_dict().items()}, {k: np.shape(v) for k, v in params.items()}, where=where
    )  # the widths agree
    covered = {(a.key, a.dim) for g in spec.groups for a in g.axes}
    resized: set[str] = set()
    for key, tensor in model.state_dict().items():
        if key not in params:
            raise InputError(f"{where}.{key}", "an entry of the model's state dict", "missing")
        shape = tuple(np.shape(params[key]))
        if shape == tuple(tensor.shape):
            continue
        if len(shape) != tensor.ndim or any(a != b and (key, d) not in covered for d, (a, b) in enumerate(zip(shape, tensor.shape))):
            raise InputError(f"{where}.{key}", f"shape {tuple(tensor.shape)} up to the widths of permutation groups", shape)
        owner, _, attr = key.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if attr in module._parameters:
            old = module._parameters[attr]
            assert old is not None
            module._parameters[attr] = nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), old.requires_grad)
        else:
            old_buffer = module._buffers[attr]
            assert old_buffer is not None
            module._buffers[attr] = torch.empty(shape, dtype=old_buffer.dtype, device=old_buffer.device)
        resized.add(owner)
    for owner in sorted(resized):
        _update_attributes(model.get_submodule(owner) if owner else model, owner)
    with torch.no_grad():
        model.load_state_dict(tensors_over(params))
    if resized:
        _check_runs(model, example_shape, where)
    return model
