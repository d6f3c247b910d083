"""Derive a model's :class:`~rayfuse.symmetry.spec.PermutationSpec` from its ``torch.fx`` graph.

:func:`trace_model` traces any ``nn.Module`` symbolically (attention and transformer layers, whose forwards branch on
their inputs, stay single leaf nodes). :func:`derive_spec` runs an example batch through that graph and tracks, for
every value, which of its axes index *unit spaces*: sets of hidden units that may be reordered together. Each layer
that writes units (a Linear's rows, a convolution's output channels, an embedding's columns) opens a space; every
operation the units flow through either carries them along (activations, normalisation, pooling, reshapes, permutes,
concatenation), joins two spaces into one (a residual addition, a tied weight), or, when the tracer cannot prove that
it commutes with a permutation of the units (an unknown function, a reshape that splits them), leaves the space fixed
and says which node did so. The model's input features and its outputs are fixed.

A model ``torch.fx`` cannot trace (Hugging Face transformers) is analysed from its ``torch.export`` graph instead
(:func:`rayfuse.symmetry.export.export_graph`), with the same rules; such a spec has no probes.

Conservative by construction: units a node's inputs carry that its output does not, and that its rule did not account
for, are fixed (no annotation is dropped silently); ops, keywords and modules the tracer does not model exactly fix
the units they touch; modules are matched by exact type (a subclass with methods of its own, or hooks, is not the
stock module). :func:`derive_spec` then checks the spec on the model (:mod:`rayfuse.symmetry.invariance`). A group
whose width the code fixes (a literal size in a ``view`` / ``expand``) carries ``fixed_width``.

Probes name nodes of the graph :func:`trace_model` returns (node names are deterministic for a given model class),
so activation matching can run that graph with ``torch.fx.Interpreter`` and read the units where they are visible.
"""

from __future__ import annotations

import inspect
import math
import operator
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from rayfuse.errors import InputError
from rayfuse.symmetry.spec import AxisRef, FixedAxis, PermGroup, PermutationSpec, Probe, axes_compatible

__all__ = ["trace_model", "derive_spec", "LEAF_MODULES"]

#: Modules kept as single graph nodes: their forwards branch on their inputs, and :func:`derive_spec` knows their insides.
LEAF_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


# ---------------------------------------------------------------------------------------------------------------
# Tracing


class _Tracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` keeping :data:`LEAF_MODULES` as leaves and remembering which module it was tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, str]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (nn.RNNBase, nn.RNNCellBase)):  # fx cannot trace their forwards (a subclass's neither): the
            return True  # analysis models the stock ones and fixes any other
        # a subclass of a leaf type stays a leaf (its forward may branch too); the analysis models it only when it has
        # the stock semantics (_known), and fixes the units it touches otherwise. A subclass of another modelled type
        # with the stock semantics (``class MyLinear(nn.Linear): pass``) is kept whole too, so it is modelled.
        return isinstance(m, LEAF_MODULES) or _known(m) is not None or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.stack.append((self.path_of_module(m) or "<model>", type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()  # left in place when tracing fails: the innermost module names where it stopped
        return out


def _modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    return [(m, m.training) for m in model.modules()]


def _restore(modes: list[tuple[nn.Module, bool]]) -> None:
    for m, training in modes:
        m.training = training


def trace_model(model: nn.Module) -> torch.fx.GraphModule:
    """Trace ``model`` with ``torch.fx`` (in eval mode), keeping :data:`LEAF_MODULES` as leaf nodes.

    The graph module shares the model's submodules and parameters. Its node names are deterministic for a given model
    class, so two models of one architecture give graphs with the same names (the probes of :func:`derive_spec`).

    Raises
    ------
    InputError
        ``architecture: expected a model torch.fx can trace``, naming the module and line where tracing stopped.
    """
    if not isinstance(model, nn.Module):
        raise InputError("architecture", "a torch.nn.Module", type(model).__name__)
    tracer = _Tracer()
    modes = _modes(model)
    model.eval()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError...: one line naming where
        module, kind = tracer.stack[-1] if tracer.stack else ("<model>", type(model).__name__)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
        line = f", {frames[-1].name} line {frames[-1].lineno}" if frames else ""
        message = (str(exc).strip().splitlines() or [""])[0][:160]
        raise InputError(
            "architecture", "a model torch.fx can trace", f"{module} ({kind}){line}", f"{type(exc).__name__}: {message}"
        ) from None
    finally:
        _restore(modes)
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    _positional(gm)
    return gm


def _positional(gm: torch.fx.GraphModule) -> None:
    """Rewrite calls that pass positional parameters by keyword (``self.fc(input=x)``, ``F.relu(input=x)``) into
    positional form, in place: the same call, so the analysis and the structure readers find a layer's input where a
    positional call puts it. Keyword-only parameters stay keywords; a call that does not bind is left as it is."""
    mods = dict(gm.named_modules())
    changed = False
    for n in gm.graph.nodes:
        if not n.kwargs or n.op not in ("call_module", "call_function"):
            continue
        fn = mods[str(n.target)].forward if n.op == "call_module" else n.target
        try:
            sig = inspect.signature(fn)
            bound = sig.bind(*n.args, **n.kwargs).arguments
        except (TypeError, ValueError):  # a builtin without a signature: torch functions name their first argument
            first = next((k for k in ("input", "tensors") if k in n.kwargs), None)  # `input` (`tensors` for cat, stack)
            if n.op == "call_function" and not n.args and first is not None:
                kwargs = dict(n.kwargs)
                n.args, n.kwargs = (kwargs.pop(first),), kwargs
                changed = True
            continue
        args: list[Any] = []
        kwargs = {}
        gap = False  # a positional parameter left to its default: later ones stay keywords
        for pname, param in sig.parameters.items():
            if pname not in bound:
                gap = gap or param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
                continue
            value = bound[pname]
            if param.kind is param.VAR_POSITIONAL:
                args.extend(value)
            elif param.kind is param.VAR_KEYWORD:
                kwargs.update(value)
            elif param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) and not gap:
                args.append(value)
            else:
                kwargs[pname] = value
        if tuple(args) != tuple(n.args) or kwargs != dict(n.kwargs):
            n.args, n.kwargs = tuple(args), kwargs
            changed = True
    if changed:
        gm.recompile()


# ---------------------------------------------------------------------------------------------------------------
# Unit spaces


class _Piece(NamedTuple):
    """Units of a space along one axis of a value: ``[start, start + outer*size*inner)`` viewed as (outer, size, inner)."""

    space: int
    start: int = 0
    outer: int = 1
    inner: int = 1


@dataclass(frozen=True)
class _Ann:
    """Which pieces each axis of a tensor value carries."""

    dims: tuple[tuple[_Piece, ...], ...]

    @staticmethod
    def empty(ndim: int) -> _Ann:
        return _Ann(tuple(() for _ in range(ndim)))

    def pieces(self) -> Iterator[_Piece]:
        for dim in self.dims:
            yield from dim


@dataclass(frozen=True)
class _Uniform(_Ann):
    """A tensor whose elements are all equal (``zeros_like``, ``new_zeros``, ``torch.full``...): it carries no units
    and is unchanged by any permutation, so an elementwise op or a concatenation with it fixes nothing."""

    @staticmethod
    def of(value: torch.Tensor) -> _Uniform:
        return _Uniform(tuple(() for _ in range(value.ndim)))


def _varying(inputs: Sequence[tuple[Any, _Ann]]) -> list[tuple[Any, _Ann]]:
    """The inputs of an elementwise op or a concatenation that are not :class:`_Uniform` (they alone constrain units)."""
    return [(shape, ann) for shape, ann in inputs if not isinstance(ann, _Uniform)]


@dataclass
class _Space:
    size: int
    name: str
    kind: str
    soft: bool  # a parameter's axis met through get_attr: a unit space only once joined to a real one
    parent: int
    fixed: str | None = None
    axes: list[AxisRef] = field(default_factory=list)
    fixed_width: str | None = None  # why the model's code fixes the number of these units (a widening merge keeps it)


class _Spaces:
    """Union-find over unit spaces, with the weight axes each one permutes."""

    def __init__(self, aliases: dict[str, list[str]]) -> None:
        self.all: list[_Space] = []
        self.aliases = aliases

    def new(self, size: int, name: str, kind: str = "channels", *, soft: bool = False, fixed: str | None = None) -> int:
        self.all.append(_Space(int(size), name, kind, soft, len(self.all), fixed))
        return len(self.all) - 1

    def find(self, i: int) -> int:
        root = i
        while self.all[root].parent != root:
            root = self.all[root].parent
        while self.all[i].parent != root:
            self.all[i].parent, i = root, self.all[i].parent
        return root

    def size(self, i: int) -> int:
        return self.all[i].size

    def pieces(self, i: int) -> tuple[_Piece, ...]:
        return (_Piece(i),) if self.all[i].size > 1 else ()

    def fix(self, i: int, reason: str) -> None:
        root = self.all[self.find(i)]
        if root.fixed is None:
            root.fixed = reason

    def merge(self, a: int, b: int, where: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        sa, sb = self.all[ra], self.all[rb]
        if sa.size != sb.size:  # cannot happen with equal layouts; keep both unpermuted rather than guess
            self.fix(ra, f"{where}: joins {sa.size} and {sb.size} units")
            self.fix(rb, f"{where}: joins {sa.size} and {sb.size} units")
            return
        # the root keeps the earliest real space's name (the first module that wrote the units)
        if (sb.soft, rb) < (sa.soft, ra):
            ra, rb, sa, sb = rb, ra, sb, sa
        sb.parent = ra
        sa.soft = sa.soft and sb.soft
        sa.fixed = sa.fixed or sb.fixed
        sa.fixed_width = sa.fixed_width or sb.fixed_width
        sa.axes.extend(sb.axes)
        sb.axes = []

    def add_axis(self, i: int, key: str, dim: int, start: int = 0, outer: int = 1, inner: int = 1) -> None:
        root = self.all[self.find(i)]
        for k in self.aliases.get(key, [key]):
            root.axes.append(AxisRef(k, dim, start, outer, inner))


# ---------------------------------------------------------------------------------------------------------------
# What the tracer knows

_ACT_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Sigmoid,
    nn.Tanh,
    nn.LeakyReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.Mish,
    nn.Softplus,
    nn.Hardtanh,
    nn.Softsign,
    nn.Tanhshrink,
    nn.LogSigmoid,
)
_PASS_MODULES: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Softmax,
    nn.LogSoftmax,
)
_POOL_MODULES: dict[type[nn.Module], int] = {
    nn.MaxPool1d: 1,
    nn.MaxPool2d: 2,
    nn.MaxPool3d: 3,
    nn.AvgPool1d: 1,
    nn.AvgPool2d: 2,
    nn.AvgPool3d: 3,
    nn.AdaptiveAvgPool1d: 1,
    nn.AdaptiveAvgPool2d: 2,
    nn.AdaptiveAvgPool3d: 3,
    nn.AdaptiveMaxPool1d: 1,
    nn.AdaptiveMaxPool2d: 2,
    nn.AdaptiveMaxPool3d: 3,
}
_NORM_MODULES = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
)

_ACT_NAMES = {
    "relu",
    "relu_",
    "relu6",
    "gelu",
    "silu",
    "hardswish",
    "hardsigmoid",
    "sigmoid",
    "sigmoid_",
    "tanh",
    "tanh_",
    "leaky_relu",
    "elu",
    "celu",
    "selu",
    "mish",
    "softplus",
    "hardtanh",
    "softsign",
    "logsigmoid",
}
_PASS_NAMES = {
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "contiguous",
    "clone",
    "detach",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "type",
    "type_as",
    "softmax",
    "log_softmax",
    "exp",
    "log",
    "abs",
    "neg",
    "sqrt",
    "rsqrt",
    "square",
    "erf",
    "clamp",
    "clamp_",
    "clamp_min",
    "clamp_max",
    "clip",
    "reciprocal",
    "sin",
    "cos",
    "log1p",
    "expm1",
    "sign",
    "requires_grad_",
}
_BINARY_NAMES = {
    "add",
    "add_",
    "sub",
    "sub_",
    "mul",
    "mul_",
    "div",
    "div_",
    "truediv",
    "maximum",
    "minimum",
    "pow",
    "true_divide",
    "multiply",
    "subtract",
    "iadd",
    "isub",
    "imul",
    "itruediv",
    "rsub",
}
_MOVE_NAMES = {
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "permute",
    "transpose",
    "t",
    "squeeze",
    "unsqueeze",
    "expand",
    "view_as",
    "reshape_as",
    "expand_as",
    "movedim",
    "moveaxis",
    "swapaxes",
    "swapdims",
    "narrow",
    "select",
    "repeat",
    "chunk",
    "split",
    "tensor_split",
    "unbind",
    "getitem",
    "flip",
    "roll",
    "tile",
}
_REDUCE_NAMES = {"mean", "sum", "amax", "amin", "logsumexp", "nansum", "nanmean", "var", "std"}
_META_NAMES = {
    "size",
    "dim",
    "numel",
    "ndimension",
    "shape",
    "dtype",
    "device",
    "ndim",
    "is_floating_point",
    "is_contiguous",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "_assert",
    "getattr",
}
_POOL_NAMES = {
    "max_pool1d": 1,
    "max_pool2d": 2,
    "max_pool3d": 3,
    "avg_pool1d": 1,
    "avg_pool2d": 2,
    "avg_pool3d": 3,
    "adaptive_avg_pool1d": 1,
    "adaptive_avg_pool2d": 2,
    "adaptive_avg_pool3d": 3,
    "adaptive_max_pool1d": 1,
    "adaptive_max_pool2d": 2,
    "adaptive_max_pool3d": 3,
    "_max_pool1d": 1,
    "_max_pool2d": 2,
    "_max_pool3d": 3,
    "_adaptive_max_pool1d": 1,
    "_adaptive_max_pool2d": 2,
    "max_pool1d_with_indices": 1,
    "max_pool2d_with_indices": 2,
    "max_pool3d_with_indices": 3,
    "adaptive_max_pool1d_with_indices": 1,
    "adaptive_max_pool2d_with_indices": 2,
    "adaptive_max_pool3d_with_indices": 3,
}
# elementwise ops whose further tensor operands (``clamp(max=alpha)``) are combined elementwise, broadcasting; and ops
# whose further tensor operand only lends its dtype and device. Any other tensor operand of an activation or
# pass-through op is not modelled: the units it touches are fixed.
_BOUND_NAMES = {"clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_max"}
_LIKE_NAMES = {"to", "type_as"}
# the keywords each kind of op is modelled with (any other keyword fixes the units it touches)
_REDUCE_KEYWORDS = {"dim", "axis", "keepdim", "keepdims", "dtype", "unbiased", "correction"}
_CAT_KEYWORDS = {"dim", "axis"}
_KNOWN_MODULES = (torch, F, operator, torch.Tensor, torch.fx)
#: The recurrent layers the tracer models (a subclass too, unless it overrides ``forward``), see ``_recurrent``.
_RECURRENT: tuple[type[nn.Module], ...] = (nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell, nn.GRUCell, nn.RNNCell)
#: Tensors all of whose elements are equal, whatever the input: any permutation of any axis leaves them as they are, so
#: they combine with units without fixing them (``x + torch.zeros_like(x)``, ``h0 = x.new_zeros(...)``).
_UNIFORM_NAMES = {"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "zeros", "ones", "full", "zero_", "fill_"}
#: ATen ops (torch.export graphs) under the name of the torch function that does the same (same argument order).
_ATEN_NAMES = {
    "slice": "narrow",
    "alias": "clone",
    "lift_fresh_copy": "clone",
    "_to_copy": "clone",
    "_assert_tensor_metadata": "_assert",
    "_assert_scalar": "_assert",
    "_assert_async": "_assert",
    "sym_size": "size",
    "sym_numel": "numel",
    "sym_stride": "size",
    "sym_storage_offset": "size",
}

#: What :meth:`_Analysis._module` models, by class. A module is modelled as the class it matches exactly: that type, or
#: a subclass that overrides none of its methods (``forward`` included) and carries no hooks.
_MODELLED: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.Embedding,
    *_ACT_MODULES,
    *_PASS_MODULES,
    nn.PReLU,
    *_POOL_MODULES,
    nn.Flatten,
    nn.Unflatten,
    *LEAF_MODULES,
    *_RECURRENT,
)
# methods a subclass may define without changing what the module computes once built
_HARMLESS = {"__init__", "reset_parameters", "_reset_parameters", "extra_repr", "__repr__", "__setstate__", "__getstate__"}


def _known(mod: nn.Module, kinds: tuple[type[nn.Module], ...] = _MODELLED) -> type[nn.Module] | None:
    """The class among ``kinds`` whose semantics ``mod`` has exactly (see :data:`_MODELLED`), else ``None``: a subclass
    that overrides ``forward`` (or any other method the stock forward may call) is not the stock module."""
    base = next((c for c in type(mod).__mro__ if c in kinds), None)
    if base is None or getattr(mod, "_forward_hooks", None) or getattr(mod, "_forward_pre_hooks", None):
        return None
    for cls in type(mod).__mro__:
        if cls is base:
            return base
        for attr, value in vars(cls).items():
            if (
                attr not in _HARMLESS
                and hasattr(base, attr)
                and (callable(value) or isinstance(value, (property, staticmethod, classmethod)))
            ):
                return None
    return base


def _op_name(node: torch.fx.Node) -> str:
    """``relu``, ``add``, ``view``...: the name of a call_function/call_method target if it comes from torch or
    operator (a user's function of the same name is unknown)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if target is getattr:
        return "getattr"
    if isinstance(target, torch._ops.OpOverload):  # an ATen op of a torch.export graph: aten.add.Tensor is "add"
        return _ATEN_NAMES.get(target._opname, target._opname)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", "")
    if module.split(".")[0] in ("torch", "_operator", "operator") or target in (torch._assert,):  # not torchvision, torch_foo
        return name.lstrip("_") if name.startswith("__") else name
    return ""


def _owner(node: Any, default: str) -> str:
    """The module path of a parameter read by a get_attr node (``enc.fc`` for ``enc.fc.weight``), else ``default``:
    the name of a space a functional layer opens."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        return str(node.target).rpartition(".")[0] or str(node.target)
    return default


def _describe_target(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return str(target)
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if module and name:
        return f"{module.lstrip('_')}.{name}"
    return getattr(target, "__qualname__", None) or name or repr(target)


# ---------------------------------------------------------------------------------------------------------------
# The analysis: an Interpreter that annotates every value


class _Analysis(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, aliases: dict[str, list[str]]) -> None:
        super().__init__(gm)
        self.sp = _Spaces(aliases)
        self.anns: dict[torch.fx.Node, Any] = {}
        self.data: set[torch.fx.Node] = set()
        self.probes: list[tuple[int, int, int, Probe]] = []  # space, rank, node order, probe
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.mods = dict(gm.named_modules())
        self.node: torch.fx.Node | None = None  # the node being annotated
        self.blocks: dict[int, list[int]] = {}  # space -> block sizes its units must stay within (norm groups)
        self.factors: list[tuple[int, int, int]] = []  # space split into (heads, head dims) spaces: see _factor
        self.consumed: set[int] = set()  # spaces the node's rule accounts for without carrying them (a Linear's inputs)

    # -- plumbing ---------------------------------------------------------------------------------------------------

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = super().run_node(n)
        if n.op == "placeholder" or any(m in self.data for m in n.all_input_nodes):
            self.data.add(n)
        self.node = n
        self.consumed = set()
        self.anns[n] = self._annotate(n, args, kwargs, out)
        ann = self.anns[n]
        if n.op not in ("placeholder", "get_attr", "output"):
            self._no_silent_drop(n, args, kwargs, ann)
        if n in self.data and isinstance(out, torch.Tensor) and isinstance(ann, _Ann):
            rank = self._rank(n)
            for d, pieces in enumerate(ann.dims):
                for p in pieces:
                    self.probes.append((p.space, rank, self.order[n], Probe(n.name, d, p.start, p.outer, p.inner)))
        return out

    def _no_silent_drop(self, n: torch.fx.Node, args: Any, kwargs: Any, ann: Any) -> None:
        """Conservative by construction: units a node's inputs carry that its output does not, and that its rule did not
        account for (a Linear reading them, a reduction over them, a shape query), are fixed, naming the node."""
        carried = {self.sp.find(s) for s in _spaces_of(ann)}
        consumed = {self.sp.find(s) for s in self.consumed}
        for _, a in self._tensors(n, args, kwargs):
            for p in a.pieces():
                root = self.sp.find(p.space)
                if root not in carried and root not in consumed:
                    self.sp.fix(root, f"{n.name}: {_describe_target(n)} drops these units (no rule accounts for them)")

    def _consume(self, pieces: Any) -> None:
        for p in pieces:
            self.consumed.add(p.space)

    def _rank(self, n: torch.fx.Node) -> int:
        """Where activation matching should rather look: 0 after an activation, 1 after a normalisation, 2 elsewhere."""
        if n.op == "call_module":
            mod = self.mods[str(n.target)]
            if isinstance(mod, (nn.TransformerEncoderLayer, nn.TransformerEncoder)):  # ends with a LayerNorm unless norm_first
                last = mod if isinstance(mod, nn.TransformerEncoderLayer) else mod.layers[-1]
                return (
                    1 if (isinstance(mod, nn.TransformerEncoder) and mod.norm is not None) or not getattr(last, "norm_first", True) else 2
                )
            return (
                0 if isinstance(mod, _ACT_MODULES) else 1 if isinstance(mod, _NORM_MODULES) else 3 if isinstance(mod, _PASS_MODULES) else 2
            )
        name = _op_name(n)
        return 0 if name in _ACT_NAMES else 3 if name in _PASS_NAMES else 2

    def _tensors(self, n: torch.fx.Node, args: Any, kwargs: Any) -> list[tuple[torch.Tensor, _Ann]]:
        """Every tensor among a node's inputs, with its annotation."""
        found: list[tuple[torch.Tensor, _Ann]] = []

        def leaf(ann: Any, value: Any) -> None:
            if isinstance(value, torch.Tensor):
                found.append((value, ann if isinstance(ann, _Ann) else _Ann.empty(value.ndim)))
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    leaf(ann[i] if isinstance(ann, (list, tuple)) and i < len(ann) else None, v)

        def walk(a: Any, v: Any) -> None:
            if isinstance(a, torch.fx.Node):
                leaf(self.anns.get(a), v)
            elif isinstance(a, (list, tuple)) and isinstance(v, (list, tuple)):
                for x, y in zip(a, v):
                    walk(x, y)
            elif isinstance(a, dict) and isinstance(v, dict):
                for k in a:
                    walk(a[k], v.get(k))

        walk((n.args, n.kwargs), (args, kwargs))
        return found

    def _ann(self, arg: Any, value: Any) -> _Ann:
        if isinstance(arg, torch.fx.Node) and isinstance(self.anns.get(arg), _Ann):
            return self.anns[arg]
        return _Ann.empty(value.ndim if isinstance(value, torch.Tensor) else 0)

    @staticmethod
    def _empty(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _Ann.empty(value.ndim)
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            return tuple(_Analysis._empty(v) for v in value)
        return None

    def _fix_all(self, tensors: Sequence[tuple[torch.Tensor, _Ann]], reason: str) -> None:
        for _, ann in tensors:
            for p in ann.pieces():
                self.sp.fix(p.space, reason)

    def _key(self, p: _Piece) -> tuple[int, int, int, int]:
        return (p.start, p.outer, p.inner, self.sp.size(p.space))

    def _merge_dim(self, where: str, entries: Sequence[tuple[Sequence[_Piece], int]], length: int) -> tuple[_Piece, ...]:
        """The pieces of one output axis of an elementwise op, from its inputs' pieces on that axis (``entries``:
        pieces and the input's length there). Equal layouts join; a layout only some inputs have is fixed."""
        full = [pieces for pieces, size in entries if size == length and length > 1]
        for pieces, size in entries:
            if size != length:  # broadcast from length 1: no units there
                for p in pieces:
                    self.sp.fix(p.space, f"{where}: broadcasts these units")
        keys: dict[tuple[int, int, int, int], list[int]] = {}
        for pieces in full:
            for p in pieces:
                keys.setdefault(self._key(p), []).append(p.space)
        out = []
        for key, spaces in keys.items():
            if len(spaces) == len(full):
                for s in spaces[1:]:
                    self.sp.merge(spaces[0], s, where)
                out.append(_Piece(spaces[0], key[0], key[1], key[2]))
            else:
                for s in spaces:
                    self.sp.fix(s, f"{where}: combines these units elementwise with values that are not permuted alike")
        return tuple(out)

    def _elementwise(self, where: str, inputs: Sequence[tuple[Sequence[int], _Ann]], shape: Sequence[int]) -> _Ann:
        """Broadcasting elementwise op of tensors of ``shape``s (right-aligned) into ``shape``."""
        ndim = len(shape)
        dims = []
        for d in range(ndim):
            entries = []
            for in_shape, ann in _varying(inputs):
                k = d - (ndim - len(in_shape))
                if k >= 0:
                    entries.append((ann.dims[k], int(in_shape[k])))
            dims.append(self._merge_dim(where, entries, int(shape[d])))
        return _Ann(tuple(dims))

    # -- dispatch ---------------------------------------------------------------------------------------------------

    def _annotate(self, n: torch.fx.Node, args: Any, kwargs: Any, out: Any) -> Any:
        if n.op == "placeholder":
            if not isinstance(out, torch.Tensor):
                return None
            reason = f"model input ({n.name})"
            return _Ann(
                ((),)
                + tuple(
                    self.sp.pieces(self.sp.new(size, f"{n.name}.{d}", "input", fixed=reason)) for d, size in enumerate(out.shape) if d > 0
                )
            )
        if n.op == "get_attr":
            if not isinstance(out, torch.Tensor):
                return None
            key = str(n.target)
            if key not in self.sp.aliases and out.numel() > 0 and bool((out == out.reshape(-1)[0]).all()):
                return _Uniform.of(out)  # a constant the tracer baked in (torch.zeros(1, 6)), all of its elements equal
            dims = []
            for d, size in enumerate(out.shape):
                s = self.sp.new(size, f"{key}[{d}]", "parameter", soft=True)
                self.sp.add_axis(s, key, d)
                dims.append(self.sp.pieces(s))
            return _Ann(tuple(dims))
        if n.op == "output":
            for _, ann in self._tensors(n, args, kwargs):
                for p in ann.pieces():
                    self.sp.fix(p.space, f"model output ({n.args[0]})")
            return None
        where = n.name
        tensors = self._tensors(n, args, kwargs)
        if n.op == "call_module":
            return self._module(n, self.mods[str(n.target)], args, kwargs, tensors, out)
        name = _op_name(n)
        uniform = self._uniform(name, tensors, out)
        if uniform is not None:
            self._consume(p for _, a in tensors for p in a.pieces())  # its values do not depend on the units' order
            return uniform
        if not any(True for _, ann in tensors for _ in ann.pieces()):
            return self._empty(out)
        if name in ("layer_norm", "group_norm", "linear", "embedding", "scaled_dot_product_attention"):
            # these rules account for every input: they join its units to weight axes, carry them, or fix them
            result = (
                self._functional(n, name, args, kwargs, tensors, out)
                if name != "scaled_dot_product_attention"
                else self._sdpa(n, args, kwargs, tensors, out)
            )
            self._consume(p for _, a in tensors for p in a.pieces())
            return result
        if name == "getitem" and isinstance(args[0], (list, tuple)):
            held = self.anns.get(n.args[0]) if isinstance(n.args[0], torch.fx.Node) else None
            if isinstance(held, (list, tuple)) and len(held) == len(args[0]):
                for _, a in tensors:  # the element taken carries its units; the others are taken (or not) elsewhere
                    self._consume(a.pieces())
                picked = held[args[1]]
                return tuple(picked) if isinstance(picked, list) else picked
            self._fix_all(tensors, f"{where}: takes an element of a value whose parts the tracer did not follow")
            return self._empty(out)
        if name in _META_NAMES and not (name == "getattr" and args[1] in ("T", "mT", "H", "mH")):
            for _, a in tensors:  # a shape, a dtype, a constant of that shape: nothing that depends on the units' order
                self._consume(a.pieces())
            return self._empty(out)
        if name in _ACT_NAMES or name in _PASS_NAMES:
            first = self._ann(n.args[0], args[0]) if n.args else None
            if first is None or not isinstance(args[0], torch.Tensor):
                self._fix_all(tensors, f"{where}: {_describe_target(n)} without its tensor first is not modelled")
                return self._empty(out)
            if len(tensors) == 1:
                return first
            if name in _BOUND_NAMES and isinstance(out, torch.Tensor):  # clamp(x, min=lo, max=hi): elementwise in all three
                return self._elementwise(where, [(tuple(t.shape), a) for t, a in tensors], tuple(out.shape))
            if name in _LIKE_NAMES:  # x.to(other), x.type_as(other): other's values are not read
                self._consume(p for _, a in tensors[1:] for p in a.pieces())
                return first
            self._fix_all(tensors, f"{where}: {_describe_target(n)} with a further tensor operand is not modelled")
            return self._empty(out)
        if name in _BINARY_NAMES:
            shapes = [(tuple(t.shape), ann) for t, ann in tensors]
            return self._elementwise(where, shapes, tuple(out.shape))
        if name in ("cat", "concat", "concatenate", "stack"):
            return self._cat(n, args, kwargs, out, stack=name == "stack")
        if name in _REDUCE_NAMES:
            return self._reduce(n, args, kwargs, out)
        if name in _POOL_NAMES:
            pooled = self._pool(where, self._ann(n.args[0], args[0]), _POOL_NAMES[name])
            # return_indices: the indices carry the channels as the values do (each channel's argmax positions)
            return tuple(pooled for _ in out) if isinstance(out, (list, tuple)) else pooled
        if name in _MOVE_NAMES or name == "getattr":
            return self._move(n, args, kwargs, out)
        self._fix_all(tensors, f"{where}: {_describe_target(n)} is not known to commute with a permutation of these units")
        return self._empty(out)

    # -- functions --------------------------------------------------------------------------------------------------

    def _cat(self, n: torch.fx.Node, args: Any, kwargs: Any, out: torch.Tensor, *, stack: bool) -> _Ann:
        values = list(args[0])
        nodes = list(n.args[0]) if isinstance(n.args[0], (list, tuple)) else []
        dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0))
        anns = [self._ann(a, v) for a, v in zip(nodes, values)]
        ndim = out.ndim
        unknown = set(kwargs) - _CAT_KEYWORDS
        expected = (len(values) if stack else sum(int(v.shape[dim]) for v in values)) if isinstance(dim, int) and values else -1
        if unknown or len(nodes) != len(values) or not isinstance(dim, int) or int(out.shape[dim]) != expected:
            self._fix_all(
                self._tensors(n, args, kwargs),
                f"{n.name}: {_describe_target(n)} "
                + (f"with keyword {sorted(unknown)[0]} is not modelled" if unknown else "is not modelled for these arguments"),
            )
            return _Ann.empty(ndim)
        dim = dim % ndim
        dims: list[tuple[_Piece, ...]] = []
        for d in range(ndim):
            if d == dim and stack:
                dims.append(())
                continue
            k = d if not stack or d < dim else d - 1
            if d == dim:
                pieces: list[_Piece] = []
                offset = 0
                for v, ann in zip(values, anns):
                    pieces.extend(p._replace(start=p.start + offset) for p in ann.dims[k])
                    offset += v.shape[k]
                dims.append(tuple(pieces))
            else:
                dims.append(
                    self._merge_dim(n.name, [(ann.dims[k], v.shape[k]) for v, ann in _varying(list(zip(values, anns)))], out.shape[d])
                )
        return _Ann(tuple(dims))

    def _reduce(self, n: torch.fx.Node, args: Any, kwargs: Any, out: Any) -> Any:
        """A sum, mean or maximum over whole axes does not depend on the order of the units there; other axes keep theirs."""
        x = args[0]
        tensors = self._tensors(n, args, kwargs)
        unknown = set(kwargs) - _REDUCE_KEYWORDS
        if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or unknown or len(tensors) != 1:
            why = f"keyword {sorted(unknown)[0]}" if unknown else "these arguments"
            self._fix_all(tensors, f"{n.name}: {_describe_target(n)} with {why} is not modelled")
            return self._empty(out)
        ann = self._ann(n.args[0], x)
        dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 and isinstance(args[1], (int, list, tuple)) else None))
        # var / std take ``unbiased`` third: their keepdim is a keyword or the fourth argument
        at = 3 if _op_name(n) in ("var", "std") else 2
        keepdim = bool(kwargs.get("keepdim", kwargs.get("keepdims", args[at] if len(args) > at and isinstance(args[at], bool) else False)))
        if dim is None or (isinstance(dim, (list, tuple)) and not dim):
            reduced = set(range(x.ndim))  # a reduction over every axis: nothing depends on the units' order
        elif isinstance(dim, int) or (isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim)):
            reduced = {d % x.ndim for d in ((dim,) if isinstance(dim, int) else dim)}
        else:
            self._fix_all(tensors, f"{n.name}: {_describe_target(n)} over {dim!r} is not modelled")
            return self._empty(out)
        shape = [1 if d in reduced else x.shape[d] for d in range(x.ndim) if keepdim or d not in reduced]
        if tuple(shape) != tuple(out.shape):  # the arguments were not read as torch read them: model nothing
            self._fix_all(tensors, f"{n.name}: {_describe_target(n)} gave a shape its arguments do not explain")
            return _Ann.empty(out.ndim)
        for d in reduced:
            self._consume(ann.dims[d])
        return _Ann(tuple(() if d in reduced else ann.dims[d] for d in range(x.ndim) if keepdim or d not in reduced))

    def _pool(self, where: str, ann: _Ann, spatial: int) -> _Ann:
        """Pooling: channels (and batch) pass through; units on the pooled axes are fixed."""
        ndim = len(ann.dims)
        for d in range(ndim - spatial, ndim):
            for p in ann.dims[d]:
                self.sp.fix(p.space, f"{where}: pools over these units")
        return _Ann(tuple(ann.dims[d] if d < ndim - spatial else () for d in range(ndim)))

    def _move(self, n: torch.fx.Node, args: Any, kwargs: Any, out: Any) -> Any:
        """Reshape, permute, index...: run the op on tensors of unit labels and read where each space's units went."""
        x = args[0]
        if not isinstance(x, torch.Tensor):
            return self._empty(out)
        ann = self._ann(n.args[0], x)
        if _op_name(n) in ("expand_as", "view_as", "reshape_as") and len(n.args) > 1:
            self._consume(self._ann(n.args[1], args[1]).pieces())  # only the other tensor's shape is read
        if n.op == "call_method":

            def call(lab: torch.Tensor) -> Any:
                return getattr(lab, str(n.target))(*args[1:], **kwargs)
        else:

            def call(lab: torch.Tensor) -> Any:
                return n.target(lab, *args[1:], **kwargs)  # type: ignore[operator]

        return self._relabel(n.name, call, x, ann, out, literal=_has_literal_size((n.args[1:], n.kwargs)))

    def _relabel(
        self, where: str, call: Callable[[torch.Tensor], Any], x: torch.Tensor, ann: _Ann, out: Any, *, literal: bool = False
    ) -> Any:
        """``literal``: the op has sizes written in the code (``view(B, 64)``, ``expand(B, 16)``, ``x[:, :16]``, a
        module's own sizes): units it follows are also followed one unit wider, and where the wider units do not come
        out whole and alike, the group's width is fixed by the code (``fixed_width``, kept by a widening merge)."""
        outs = [out] if isinstance(out, torch.Tensor) else [o for o in out] if isinstance(out, (list, tuple)) else []
        dims: list[list[list[_Piece]]] = [[[] for _ in range(o.ndim)] for o in outs]
        for d, pieces in enumerate(ann.dims):
            for p in pieces:
                size = self.sp.size(p.space)
                units = torch.full((x.shape[d],), -1, dtype=torch.long)
                span = p.outer * size * p.inner
                units[p.start : p.start + span] = torch.arange(size).repeat_interleave(p.inner).repeat(p.outer)
                shape = [1] * x.ndim
                shape[d] = -1
                try:
                    moved = call(units.view(shape).expand(x.shape).contiguous())
                except (RuntimeError, TypeError, IndexError):
                    self.sp.fix(p.space, f"{where}: could not follow these units through the op")
                    continue
                results = [moved] if isinstance(moved, torch.Tensor) else list(moved)
                layout = []
                for k, r in enumerate(results):
                    found = _read_units(r, size)
                    layout.append(found)
                    if found is None and self._factor(p, x.shape[d], r, size, dims[k]):
                        self.consumed.add(p.space)  # split into heads and head dims: the new spaces carry these units
                    elif found is None:
                        self.sp.fix(p.space, f"{where}: splits, selects or reorders these units")
                    elif found:
                        t, start, outer, inner = found
                        dims[k][t].append(_Piece(p.space, start, outer, inner))
                    else:
                        self.consumed.add(p.space)  # none of these units reach this output: it does not depend on them
                if literal and all(f is not None for f in layout) and not self._widens(call, x, d, p, size, layout):
                    root = self.sp.all[self.sp.find(p.space)]
                    root.fixed_width = root.fixed_width or f"{where}: a size written in the code fixes the number of these units"
        anns = [_Ann(tuple(tuple(ps) for ps in od)) for od in dims]
        if isinstance(out, torch.Tensor):
            return anns[0]
        return tuple(anns) if isinstance(out, (list, tuple)) else None

    @staticmethod
    def _widens(call: Callable[[torch.Tensor], Any], x: torch.Tensor, d: int, p: _Piece, size: int, layout: list[Any]) -> bool:
        """Whether the op follows these units one unit wider (axis ``d`` longer by a unit's span) to the same layout."""
        extra = p.outer * p.inner
        units = torch.full((x.shape[d] + extra,), -1, dtype=torch.long)
        units[p.start : p.start + p.outer * (size + 1) * p.inner] = torch.arange(size + 1).repeat_interleave(p.inner).repeat(p.outer)
        shape = list(x.shape)
        shape[d] += extra
        view = [1] * x.ndim
        view[d] = -1
        try:
            moved = call(units.view(view).expand(shape).contiguous())
        except Exception:  # the op refuses the wider tensor: the code fixes the width
            return False
        results = [moved] if isinstance(moved, torch.Tensor) else list(moved) if isinstance(moved, (list, tuple)) else []
        if len(results) != len(layout):
            return False
        for r, found in zip(results, layout):
            wide = _read_units(r, size + 1) if isinstance(r, torch.Tensor) else None
            if (
                wide is None
                or (wide and found and (wide[0], wide[2], wide[3]) != (found[0], found[2], found[3]))
                or bool(wide) != bool(found)
            ):
                return False
        return True

    # -- modules ----------------------------------------------------------------------------------------------------

    def _module(self, n: torch.fx.Node, mod: nn.Module, args: Any, kwargs: Any, tensors: list[tuple[torch.Tensor, _Ann]], out: Any) -> Any:
        name, where = str(n.target), n.name
        x = args[0] if args else None
        ann = self._ann(n.args[0], x) if args else _Ann.empty(0)
        base = _known(mod)
        if (
            base is not None
            and isinstance(mod, LEAF_MODULES)
            and any(_known(m, _MODELLED + (nn.ModuleList,)) is None for m in mod.modules())
        ):
            base = None  # a stock transformer layer holding a module of another kind: its insides are not the stock ones
        if base is None:
            stock = next((c.__name__ for c in type(mod).__mro__ if c in _MODELLED), None)
            reason = f"{where}: module {name} ({type(mod).__name__}) is not modelled" + (
                f" (a {stock} with its own methods, hooks or parts: matched by exact type only)" if stock else ""
            )
            self._fix_all(tensors, reason)
            self._fix_own(name, mod, reason)
            return self._empty(out)
        if isinstance(mod, nn.Linear):
            return self._linear(name, mod, ann)
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return self._conv(where, name, mod, ann)
        if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
            return self._batchnorm(name, mod, ann)
        if isinstance(mod, nn.LayerNorm):
            return self._layernorm(name, mod, ann)
        if isinstance(mod, nn.GroupNorm):
            return self._groupnorm(where, name, mod, ann)
        if isinstance(mod, (nn.RNNBase, nn.RNNCellBase)):
            # the recurrent rules account for every input: the features join weight_ih's columns, the time and batch
            # axes and an initial state not permuted with the units are fixed
            result = self._recurrent(n, name, mod, args, out) if isinstance(mod, nn.RNNBase) else self._cell(n, name, mod, args, out)
            self._consume(p for _, a in tensors for p in a.pieces())
            return result
        if isinstance(mod, nn.Embedding):
            s = self.sp.new(mod.embedding_dim, name, "features")
            self.sp.add_axis(s, f"{name}.weight", 1)
            return _Ann(ann.dims + (self.sp.pieces(s),))
        if isinstance(mod, _ACT_MODULES + _PASS_MODULES):
            return ann
        if isinstance(mod, nn.PReLU):  # one slope, or one per channel (axis 1)
            if mod.num_parameters > 1:
                for p in ann.dims[1 if len(ann.dims) >= 2 else 0]:
                    self.sp.add_axis(p.space, f"{name}.weight", 0, p.start, p.outer, p.inner)
            return ann
        if base in _POOL_MODULES:
            pooled = self._pool(where, ann, _POOL_MODULES[base])
            # return_indices: the indices carry the channels as the values do (each channel's argmax positions)
            return tuple(pooled for _ in out) if isinstance(out, (list, tuple)) else pooled
        if isinstance(mod, (nn.Flatten, nn.Unflatten)):
            return self._relabel(where, mod, x, ann, out, literal=True) if isinstance(x, torch.Tensor) else self._empty(out)
        if isinstance(mod, (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)):
            bound = inspect.signature(mod.forward).bind(*n.args, **n.kwargs).arguments
            values = inspect.signature(mod.forward).bind(*args, **kwargs).arguments
            if isinstance(mod, nn.MultiheadAttention):
                q, k, v = (self._ann(bound[a], values[a]) for a in ("query", "key", "value"))
                return self._attention(where, name, mod, q, k, v, out)
            src = self._ann(bound["src"], values["src"])
            shape = tuple(values["src"].shape)
            if isinstance(mod, nn.TransformerEncoderLayer):
                return self._encoder_layer(where, name, mod, src, shape)
            return self._encoder(where, name, mod, src, shape)
        if not any(True for _, a in tensors for _ in a.pieces()):
            return self._empty(out)
        self._fix_all(tensors, f"{where}: module {name} ({type(mod).__name__}) is not known to commute with a permutation of these units")
        return self._empty(out)

    def _fix_own(self, name: str, mod: nn.Module, reason: str) -> None:
        """Every axis of a module the graph keeps whole but the tracer does not model is fixed (listed with the reason;
        a tensor it shares with modelled layers is then not permuted there either)."""
        for key, value in mod.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):
                for d, size in enumerate(value.shape):
                    if size > 1:
                        self.sp.add_axis(self.sp.new(size, f"{name}.{key}[{d}]", "parameter", fixed=reason), f"{name}.{key}", d)

    def _linear(self, name: str, mod: nn.Linear, ann: _Ann) -> _Ann:
        self._consume(ann.dims[-1])  # read by the weight's columns
        for p in ann.dims[-1]:
            self.sp.add_axis(p.space, f"{name}.weight", 1, p.start, p.outer, p.inner)
        s = self.sp.new(mod.out_features, name, "features")
        self.sp.add_axis(s, f"{name}.weight", 0)
        if mod.bias is not None:
            self.sp.add_axis(s, f"{name}.bias", 0)
        return _Ann(ann.dims[:-1] + (self.sp.pieces(s),))

    def _conv(self, where: str, name: str, mod: nn.Conv1d | nn.Conv2d | nn.Conv3d, ann: _Ann) -> _Ann:
        ndim, spatial = len(ann.dims), len(mod.kernel_size)
        cdim = ndim - spatial - 1
        for d in range(cdim + 1, ndim):
            for p in ann.dims[d]:
                self.sp.fix(p.space, f"{where}: {name} convolves over these units")
        w, b = f"{name}.weight", f"{name}.bias"
        groups, cin, cout = mod.groups, mod.in_channels, mod.out_channels
        if groups == 1:
            self._consume(ann.dims[cdim])  # read by the weight's input channels
            for p in ann.dims[cdim]:
                self.sp.add_axis(p.space, w, 1, p.start, p.outer, p.inner)
            s = self.sp.new(cout, name, "channels")
            self.sp.add_axis(s, w, 0)
            if mod.bias is not None:
                self.sp.add_axis(s, b, 0)
            channels = self.sp.pieces(s)
        elif groups == cin and cout % cin == 0:  # depthwise: output channel c*k+m reads input channel c alone
            k = cout // cin
            pieces = []
            for p in ann.dims[cdim]:
                q = _Piece(p.space, p.start * k, p.outer, p.inner * k)
                self.sp.add_axis(p.space, w, 0, q.start, q.outer, q.inner)
                if mod.bias is not None:
                    self.sp.add_axis(p.space, b, 0, q.start, q.outer, q.inner)
                pieces.append(q)
            channels = tuple(pieces)
        else:
            reason = f"{where}: grouped convolution {name} ({groups} groups of {cin // groups} channels)"
            for p in ann.dims[cdim]:
                self.sp.fix(p.space, reason)
            s = self.sp.new(cout, name, "channels", fixed=reason)
            self.sp.add_axis(s, w, 0)
            if mod.bias is not None:
                self.sp.add_axis(s, b, 0)
            channels = ()
        return _Ann(ann.dims[:cdim] + (channels,) + tuple(() for _ in range(spatial)))

    def _batchnorm(self, name: str, mod: nn.Module, ann: _Ann) -> _Ann:
        cdim = 1 if len(ann.dims) >= 2 else 0
        for p in ann.dims[cdim]:
            for attr in ("weight", "bias", "running_mean", "running_var"):
                if getattr(mod, attr, None) is not None:
                    self.sp.add_axis(p.space, f"{name}.{attr}", 0, p.start, p.outer, p.inner)
        return ann

    def _layernorm(self, name: str, mod: nn.LayerNorm, ann: _Ann) -> _Ann:
        k = len(mod.normalized_shape)
        for j in range(k):
            for p in ann.dims[len(ann.dims) - k + j]:
                for attr in ("weight", "bias"):
                    if getattr(mod, attr, None) is not None:
                        self.sp.add_axis(p.space, f"{name}.{attr}", j, p.start, p.outer, p.inner)
        return ann

    def _groupnorm(self, where: str, name: str, mod: nn.GroupNorm, ann: _Ann) -> _Ann:
        """Per-channel weight and bias; with several groups of several channels, units move only within their group
        (:meth:`_norm_groups`)."""
        cdim = 1
        for p in ann.dims[cdim]:
            for attr in ("weight", "bias"):
                if getattr(mod, attr, None) is not None:
                    self.sp.add_axis(p.space, f"{name}.{attr}", 0, p.start, p.outer, p.inner)
        self._norm_groups(where, name, ann.dims[cdim], mod.num_groups, mod.num_channels)
        return ann

    def _attention(self, where: str, name: str, mod: nn.MultiheadAttention, q: _Ann, k: _Ann, v: _Ann, out: Any) -> Any:
        """Self/cross attention: the embed dim in and out; heads (blocks of head_dim), Q/K's and V/out's head dims."""
        E, H = mod.embed_dim, mod.num_heads
        hd = E // H
        for ann in (q, k, v):
            self._consume(ann.dims[-1])  # read by the input projections
        key = lambda attr: f"{name}.{attr}"  # noqa: E731
        if mod._qkv_same_embed_dim:
            for p in self._merge_dim(where, [(q.dims[-1], E), (k.dims[-1], E), (v.dims[-1], E)], E):
                self.sp.add_axis(p.space, key("in_proj_weight"), 1, p.start, p.outer, p.inner)
            rows = [(key("in_proj_weight"), j * E) for j in range(3)]
        else:
            for ann, attr in ((q, "q_proj_weight"), (k, "k_proj_weight"), (v, "v_proj_weight")):
                for p in ann.dims[-1]:
                    self.sp.add_axis(p.space, key(attr), 1, p.start, p.outer, p.inner)
            rows = [(key(attr), 0) for attr in ("q_proj_weight", "k_proj_weight", "v_proj_weight")]
        for ann in (q, k, v):
            for dim in ann.dims[:-1]:
                for p in dim:
                    self.sp.fix(p.space, f"{where}: attention {name} mixes positions along these units")
        heads = self.sp.new(H, f"{name}.heads", "heads")
        qk = self.sp.new(hd, f"{name}.qk_dims", "head_dims")
        vo = self.sp.new(hd, f"{name}.vo_dims", "head_dims")
        for j, ((wkey, start), dims) in enumerate(zip(rows, (qk, qk, vo))):
            self.sp.add_axis(heads, wkey, 0, start, 1, hd)
            self.sp.add_axis(dims, wkey, 0, start, H, 1)
            if mod.in_proj_bias is not None:
                self.sp.add_axis(heads, key("in_proj_bias"), 0, j * E, 1, hd)
                self.sp.add_axis(dims, key("in_proj_bias"), 0, j * E, H, 1)
        for attr, dims in (("bias_k", qk), ("bias_v", vo)):
            if getattr(mod, attr, None) is not None:
                self.sp.add_axis(heads, key(attr), 2, 0, 1, hd)
                self.sp.add_axis(dims, key(attr), 2, 0, H, 1)
        self.sp.add_axis(heads, key("out_proj.weight"), 1, 0, 1, hd)
        self.sp.add_axis(vo, key("out_proj.weight"), 1, 0, H, 1)
        s = self.sp.new(E, key("out_proj"), "features")
        self.sp.add_axis(s, key("out_proj.weight"), 0)
        if mod.out_proj.bias is not None:
            self.sp.add_axis(s, key("out_proj.bias"), 0)
        result = _Ann(tuple(() for _ in q.dims[:-1]) + (self.sp.pieces(s),))
        if isinstance(out, (list, tuple)):
            weights = out[1]
            weights_ann = None
            if isinstance(weights, torch.Tensor):
                weights_ann = _Ann.empty(weights.ndim)
                if weights.ndim == 4:  # per-head weights (average_attn_weights=False): the heads are visible
                    weights_ann = _Ann(((), self.sp.pieces(heads), (), ()))
            return (result, weights_ann)
        return result

    def _encoder_layer(self, where: str, name: str, mod: nn.TransformerEncoderLayer, x: _Ann, shape: tuple[int, ...]) -> _Ann:
        def ln(attr: str, a: _Ann) -> _Ann:
            return self._layernorm(f"{name}.{attr}", getattr(mod, attr), a)

        def add(a: _Ann, b: _Ann) -> _Ann:
            return self._elementwise(where, [(shape, a), (shape, b)], shape)

        def attend(a: _Ann) -> _Ann:
            return self._attention(where, f"{name}.self_attn", mod.self_attn, a, a, a, None)

        def feed_forward(a: _Ann) -> _Ann:
            hidden = self._linear(f"{name}.linear1", mod.linear1, a)
            act = mod.activation
            if not (act in (F.relu, F.gelu) or isinstance(act, _ACT_MODULES)):
                for p in hidden.pieces():
                    self.sp.fix(p.space, f"{where}: activation {act!r} of {name} is not known to act elementwise")
            self._hook_probes(hidden, f"{name}.linear2", "input", rank=0)  # the units after the activation
            return self._linear(f"{name}.linear2", mod.linear2, hidden)

        if mod.norm_first:
            x = add(x, attend(ln("norm1", x)))
            return add(x, feed_forward(ln("norm2", x)))
        x = ln("norm1", add(x, attend(x)))
        return ln("norm2", add(x, feed_forward(x)))

    def _hook_probes(self, ann: _Ann, module: str, hook: str, *, rank: int) -> None:
        """Probes of the units ``ann`` places, observed by a forward hook on submodule ``module`` (its first input or its
        output): units inside a module the graph keeps whole."""
        order = self.order[self.node] if self.node is not None else len(self.order)
        for d, pieces in enumerate(ann.dims):
            for p in pieces:
                self.probes.append((p.space, rank, order, Probe(module, d, p.start, p.outer, p.inner, hook=hook)))

    def _encoder(self, where: str, name: str, mod: nn.TransformerEncoder, x: _Ann, shape: tuple[int, ...]) -> _Ann:
        for i, layer in enumerate(mod.layers):
            x = self._encoder_layer(where, f"{name}.layers.{i}", layer, x, shape)
            self._hook_probes(x, f"{name}.layers.{i}", "output", rank=2 if layer.norm_first else 1)
        if mod.norm is not None:
            if not isinstance(mod.norm, nn.LayerNorm):
                for p in x.pieces():
                    self.sp.fix(p.space, f"{where}: final norm of {name} is not a LayerNorm")
                return _Ann.empty(len(shape))
            x = self._layernorm(f"{name}.norm", mod.norm, x)
        return x

    # -- coverage: functional norms and layers, constants, recurrent layers ----------------------------------------

    def _uniform(self, name: str, tensors: Sequence[tuple[torch.Tensor, _Ann]], out: Any) -> _Uniform | None:
        """A constant whose elements are all equal (and what known ops make of such constants alone), else None."""
        if not isinstance(out, torch.Tensor):
            return None
        if name in _UNIFORM_NAMES:
            return _Uniform.of(out)
        if (
            tensors
            and all(isinstance(a, _Uniform) for _, a in tensors)
            and (name in _ACT_NAMES or name in _PASS_NAMES or name in _BINARY_NAMES or name in _MOVE_NAMES or name in _REDUCE_NAMES)
        ):
            return _Uniform.of(out)
        return None

    @staticmethod
    def _arg(n: torch.fx.Node, args: Any, kwargs: Any, i: int, key: str) -> tuple[Any, Any]:
        """Argument ``i`` (or keyword ``key``) of a call: its graph form (a node, for a tensor) and its value."""
        if i < len(args):
            return n.args[i], args[i]
        return n.kwargs.get(key), kwargs.get(key)

    def _functional(self, n: torch.fx.Node, name: str, args: Any, kwargs: Any, tensors: list[tuple[torch.Tensor, _Ann]], out: Any) -> Any:
        """``F.layer_norm``, ``F.group_norm``, ``F.linear``, ``F.embedding`` (and their ATen ops in torch.export graphs)."""
        where = n.name
        if name == "embedding":
            # F.embedding(input, weight) and aten.embedding(weight, indices): the floating-point one is the table
            first, second = self._arg(n, args, kwargs, 0, "input"), self._arg(n, args, kwargs, 1, "weight")
            if isinstance(first[1], torch.Tensor) and first[1].is_floating_point():
                first, second = second, first
            (i_node, idx), (w_node, weight) = first, second
        else:
            x_node, x = self._arg(n, args, kwargs, 0, "input")
        if (
            not isinstance(out, torch.Tensor)
            or (name == "embedding" and not (isinstance(idx, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.ndim == 2))
            or (name != "embedding" and not isinstance(x, torch.Tensor))
        ):
            self._fix_all(tensors, f"{where}: {_describe_target(n)} called in a form the tracer does not model")
            return self._empty(out)

        def optional(i: int, key: str) -> list[tuple[torch.Tensor, _Ann]]:
            node, value = self._arg(n, args, kwargs, i, key)
            return [(value, self._ann(node, value))] if isinstance(value, torch.Tensor) else []

        if name == "layer_norm":
            # the mean and variance over the normalised (last) axes do not depend on the order of their elements, and
            # every other axis is normalised row by row: the units pass; the weight and bias act elementwise
            inputs = [(tuple(x.shape), self._ann(x_node, x))] + [
                (tuple(t.shape), a) for t, a in optional(2, "weight") + optional(3, "bias")
            ]
            return self._elementwise(where, inputs, tuple(out.shape))
        if name == "group_norm":
            groups = int(self._arg(n, args, kwargs, 1, "num_groups")[1])
            ann = self._ann(x_node, x)
            if x.ndim < 2:
                self._fix_all(tensors, f"{where}: group_norm of a {x.ndim}-d tensor")
                return self._empty(out)
            channels = int(x.shape[1])
            entries = [(ann.dims[1], channels)] + [(a.dims[0], int(t.shape[0])) for t, a in optional(2, "weight") + optional(3, "bias")]
            merged = self._merge_dim(where, entries, channels)
            self._norm_groups(where, "group_norm", merged, groups, channels)
            return _Ann(ann.dims[:1] + (merged,) + ann.dims[2:])  # positions within a group are normalised together
        if name == "linear":
            w_node, weight = self._arg(n, args, kwargs, 1, "weight")
            if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
                self._fix_all(tensors, f"{where}: {_describe_target(n)} with a weight that is not a matrix")
                return self._empty(out)
            ann, w_ann = self._ann(x_node, x), self._ann(w_node, weight)
            cols, rows = int(weight.shape[1]), int(weight.shape[0])
            soft = [p for p in w_ann.dims[1] if self.sp.find(p.space) == p.space and self.sp.all[p.space].soft]
            if isinstance(w_node, torch.fx.Node) and w_node.op == "get_attr" and len(w_node.users) == 1 and len(soft) == len(w_ann.dims[1]):
                # a parameter read here alone: its columns take the input's pieces as nn.Linear's do (several pieces:
                # a concatenation, heads and head dims), in place of the plain axis its get_attr gave it
                key = str(w_node.target)
                for p in soft:
                    self.sp.all[p.space].axes = [
                        a for a in self.sp.all[p.space].axes if (a.key, a.dim) not in {(k, 1) for k in self.sp.aliases.get(key, [key])}
                    ]
                for p in ann.dims[-1]:
                    self.sp.add_axis(p.space, key, 1, p.start, p.outer, p.inner)
            else:
                self._merge_dim(where, [(ann.dims[-1], cols), (w_ann.dims[1], cols)], cols)
            s = self.sp.new(rows, _owner(w_node, where), "features")
            entries = [(self.sp.pieces(s), rows), (w_ann.dims[0], rows)] + [(a.dims[0], int(t.shape[0])) for t, a in optional(2, "bias")]
            return _Ann(ann.dims[:-1] + (self._merge_dim(where, entries, rows),))
        # embedding: rows are looked up by index (their order is the vocabulary's), columns are the features
        w_ann, i_ann = self._ann(w_node, weight), self._ann(i_node, idx)
        for p in w_ann.dims[0]:
            self.sp.fix(p.space, f"{where}: {_describe_target(n)} looks these rows up by index")
        cols = int(weight.shape[1])
        s = self.sp.new(cols, _owner(w_node, where), "features")
        merged = self._merge_dim(where, [(self.sp.pieces(s), cols), (w_ann.dims[1], cols)], cols)
        return _Ann(i_ann.dims + (merged,))

    def _norm_groups(self, where: str, what: str, pieces: Sequence[_Piece], groups: int, channels: int) -> None:
        """Units on a channel axis normalised in ``groups`` groups: each unit must stay within its group. The space is
        split into blocks of units (one permutation group per block, see :func:`_split_blocks`) when its units tile the
        norm groups; fixed when they straddle them."""
        if groups <= 1 or groups >= channels or channels % groups:
            return  # one group (all together) or one channel per group: any permutation keeps the groups
        per = channels // groups
        for p in pieces:
            size = self.sp.size(p.space)
            if p.start % per or (p.outer > 1 and (size * p.inner) % per):
                self.sp.fix(p.space, f"{where}: {what} normalises groups of {per} channels that these units straddle")
            elif p.inner % per == 0:
                continue  # every unit is whole norm groups: the groups move with their units
            elif per % p.inner:
                self.sp.fix(p.space, f"{where}: {what} normalises groups of {per} channels that these units straddle")
            else:
                self.blocks.setdefault(p.space, []).append(per // p.inner)

    def _recurrent(self, n: torch.fx.Node, name: str, mod: nn.RNNBase, args: Any, out: Any) -> Any:
        """``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``: per layer and direction, the hidden units are one space found on the
        rows of every gate block of ``weight_ih``/``weight_hh`` and their biases (``outer`` = the gates), on
        ``weight_hh``'s columns (or ``weight_hr``'s with ``proj_size``, whose rows and ``weight_hh``'s columns are then the
        projected units), on the next layer's input columns (a segment per direction) and on the output's last axis."""
        where = n.name
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not isinstance(out, tuple):
            self._fix_all(self._tensors(n, args, {}), f"{where}: {name} ({type(mod).__name__}) called with a packed sequence")
            return self._empty(out)
        x_ann = self._ann(n.args[0], x)
        for dim in x_ann.dims[:-1]:  # the steps recur in order; the batch axis is kept fixed as well (conservative)
            for p in dim:
                self.sp.fix(p.space, f"{where}: {name} recurs over these units")
        gates = {"LSTM": 4, "GRU": 3}.get(mod.mode, 1)
        hidden, proj = mod.hidden_size, mod.proj_size
        width = proj or hidden
        directions = 2 if mod.bidirectional else 1
        inputs: tuple[_Piece, ...] = x_ann.dims[-1]
        outs: list[int] = []
        cells: list[int] = []
        for layer in range(mod.num_layers):
            this: list[int] = []
            for d in range(directions):
                suffix = f"_l{layer}" + ("_reverse" if d else "")
                key = lambda w: f"{name}.{w}{suffix}"  # noqa: E731
                h = self.sp.new(hidden, f"{name}{suffix}", "hidden")
                for w in ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if mod.bias else ()):
                    self.sp.add_axis(h, key(w), 0, 0, gates, 1)
                for p in inputs:
                    self.sp.add_axis(p.space, key("weight_ih"), 1, p.start, p.outer, p.inner)
                if proj:
                    q = self.sp.new(proj, f"{name}{suffix}.proj", "hidden")
                    self.sp.add_axis(h, key("weight_hr"), 1)
                    self.sp.add_axis(q, key("weight_hr"), 0)
                    self.sp.add_axis(q, key("weight_hh"), 1)
                else:
                    q = h
                    self.sp.add_axis(h, key("weight_hh"), 1)
                this.append(q)
                cells.append(h)
            outs.extend(this)
            inputs = tuple(_Piece(s, d * width) for d, s in enumerate(this) if width > 1)
        output = _Ann(tuple(() for _ in x_ann.dims[:-1]) + (inputs,))
        is_lstm = mod.mode == "LSTM"
        state_node = n.args[1] if len(n.args) > 1 else None
        state_value = args[1] if len(args) > 1 else None
        given = (
            [(state_node, state_value)]
            if not is_lstm
            else (
                list(zip(state_node, state_value))
                if isinstance(state_node, (list, tuple)) and isinstance(state_value, (list, tuple))
                else [(state_node, state_value)]
                if state_value is not None
                else []
            )
        )
        states = [(outs, width), (cells, hidden)][: len(given) if given else (2 if is_lstm else 1)]
        used = self._state_used(n)
        anns = []
        for k, (spaces, size) in enumerate(states):
            node, value = given[k] if k < len(given) else (None, None)
            ann = self._ann(node, value) if isinstance(value, torch.Tensor) else None
            if used or (ann is not None and not isinstance(ann, _Uniform)):
                # one state tensor (layers x directions, batch, units) holds every layer's units: all share one order
                for s in spaces[1:]:
                    self.sp.merge(spaces[0], s, f"{where}: the state of {name}")
            if ann is not None:
                if not isinstance(ann, _Uniform):  # an initial state that is not a constant must be permuted alike
                    for dim in ann.dims[:-1]:
                        for p in dim:
                            self.sp.fix(p.space, f"{where}: {name}'s initial state along these units")
                    last = ann.dims[-1] if ann.dims else ()
                    if (
                        size > 1
                        and len(last) == 1
                        and (last[0].start, last[0].outer, last[0].inner) == (0, 1, 1)
                        and self.sp.size(last[0].space) == size
                    ):
                        self.sp.merge(spaces[0], last[0].space, where)
                    elif size > 1:
                        for p in last:
                            self.sp.fix(p.space, f"{where}: {name}'s initial state is not permuted with its hidden units")
                        self.sp.fix(spaces[0], f"{where}: {name}'s initial state is not permuted with its hidden units")
            final = out[1][k] if is_lstm else out[1]
            anns.append(_Ann(tuple(() for _ in range(final.ndim - 1)) + (self.sp.pieces(spaces[0]),)))
        return (output, (anns[0], anns[1])) if is_lstm else (output, anns[0])

    def _cell(self, n: torch.fx.Node, name: str, mod: nn.RNNCellBase, args: Any, out: Any) -> Any:
        """``nn.RNNCell`` / ``nn.LSTMCell`` / ``nn.GRUCell``: one step of :meth:`_recurrent` (the state is the hidden
        units, merged with the space of the state passed in)."""
        where = n.name
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            self._fix_all(self._tensors(n, args, {}), f"{where}: {name} called without an input tensor")
            return self._empty(out)
        x_ann = self._ann(n.args[0], x)
        gates = 4 if isinstance(mod, nn.LSTMCell) else 3 if isinstance(mod, nn.GRUCell) else 1
        h = self.sp.new(mod.hidden_size, name, "hidden")
        for w in ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if mod.bias else ()):
            self.sp.add_axis(h, f"{name}.{w}", 0, 0, gates, 1)
        self.sp.add_axis(h, f"{name}.weight_hh", 1)
        for p in x_ann.dims[-1]:
            self.sp.add_axis(p.space, f"{name}.weight_ih", 1, p.start, p.outer, p.inner)
        batch = x_ann.dims[:-1]
        state_node = n.args[1] if len(n.args) > 1 else None
        state_value = args[1] if len(args) > 1 else None
        pairs = (
            list(zip(state_node, state_value))
            if isinstance(state_value, (list, tuple)) and isinstance(state_node, (list, tuple))
            else [(state_node, state_value)]
            if state_value is not None
            else []
        )
        for node, value in pairs:
            ann = self._ann(node, value)
            if isinstance(ann, _Uniform) or not isinstance(value, torch.Tensor):
                continue
            last = ann.dims[-1] if ann.dims else ()
            for dim in ann.dims[:-1]:
                for p in dim:
                    self.sp.fix(p.space, f"{where}: {name}'s state along these units")
            if (
                mod.hidden_size > 1
                and len(last) == 1
                and (last[0].start, last[0].outer, last[0].inner) == (0, 1, 1)
                and self.sp.size(last[0].space) == mod.hidden_size
            ):
                self.sp.merge(h, last[0].space, where)
            elif mod.hidden_size > 1:
                for p in last:
                    self.sp.fix(p.space, f"{where}: {name}'s state is not permuted with its hidden units")
                self.sp.fix(h, f"{where}: {name}'s state is not permuted with its hidden units")
        state = _Ann(tuple(() for _ in batch) + (self.sp.pieces(h),))
        return (state, state) if isinstance(out, tuple) else state

    # -- coverage: attention written with a reshape into heads and scaled_dot_product_attention ---------------------

    def _factor(self, p: _Piece, length: int, labels: torch.Tensor, size: int, dims: list[list[_Piece]]) -> bool:
        """A reshape that splits a whole axis of ``size`` units into two axes ``(heads, head_dim)`` (unit ``h * head_dim
        + d`` at ``[h, d]``, the way attention splits a projection into heads): the space is *factored* into a heads
        space and a head-dims space, whose permutations together are the permutations of the form ``(h, d) -> (ph(h),
        pd(d))`` of the original units (a subset of them: sound). :func:`_unfactor` rewrites the space's weight axes
        into the two views when the analysis ends. False (nothing done) for any other split."""
        if (p.start, p.outer, p.inner) != (0, 1, 1) or length != size:
            return False
        varying = [
            d for d in range(labels.ndim) if labels.shape[d] > 1 and not torch.equal(labels, labels.narrow(d, 0, 1).expand_as(labels))
        ]
        if len(varying) != 2:
            return False
        t1, t2 = varying
        heads, per = int(labels.shape[t1]), int(labels.shape[t2])
        if heads * per != size:
            return False
        index = [slice(None) if d in (t1, t2) else 0 for d in range(labels.ndim)]
        if not torch.equal(labels[tuple(index)], torch.arange(size).view(heads, per)):
            return False
        root = self.sp.all[self.sp.find(p.space)]
        h = self.sp.new(heads, f"{root.name}.heads", "heads", soft=root.soft)  # a parameter's axis stays soft until joined
        d = self.sp.new(per, f"{root.name}.head_dims", "head_dims", soft=root.soft)
        self.factors.append((p.space, h, d))
        dims[t1].extend(self.sp.pieces(h))
        dims[t2].extend(self.sp.pieces(d))
        return True

    def _sdpa(self, n: torch.fx.Node, args: Any, kwargs: Any, tensors: list[tuple[torch.Tensor, _Ann]], out: Any) -> Any:
        """``scaled_dot_product_attention(q, k, v)`` on ``(..., heads, L, E)`` tensors: q, k and v share the heads;
        q's and k's last axes (their dot product) share one space; v's last axis is the output's. Positions and batch
        axes are fixed (attention mixes positions); a mask that differs per head, or k / v with other head counts
        (grouped-query attention), fix the heads."""
        where = n.name
        (qn, q), (kn, k), (vn, v) = (self._arg(n, args, kwargs, i, key) for i, key in enumerate(("query", "key", "value")))
        if not all(isinstance(t, torch.Tensor) and t.ndim >= 3 for t in (q, k, v)) or not isinstance(out, torch.Tensor):
            self._fix_all(tensors, f"{where}: {_describe_target(n)} called in a form the tracer does not model")
            return self._empty(out)
        qa, ka, va = self._ann(qn, q), self._ann(kn, k), self._ann(vn, v)
        reason = f"{where}: attention mixes positions along these units"
        for ann in (qa, ka, va):
            for dim in ann.dims[:-3] + ann.dims[-2:-1]:
                for p in dim:
                    self.sp.fix(p.space, reason)
        mask_node, mask = self._arg(n, args, kwargs, 3, "attn_mask")
        heads = int(q.shape[-3])
        per_head_mask = (
            isinstance(mask, torch.Tensor)
            and mask.ndim >= 3
            and mask.shape[-3] > 1
            and not isinstance(self._ann(mask_node, mask), _Uniform)
        )
        if isinstance(mask, torch.Tensor):
            self._fix_all([(mask, self._ann(mask_node, mask))], f"{where}: an attention mask")
        if per_head_mask or not (k.shape[-3] == v.shape[-3] == heads):
            for ann in (qa, ka, va):
                for p in ann.dims[-3]:
                    self.sp.fix(p.space, f"{where}: a mask per head, or keys and values with other head counts")
            head_pieces: tuple[_Piece, ...] = ()
        else:
            head_pieces = self._joined(
                where,
                [qa.dims[-3], ka.dims[-3], va.dims[-3]],
                heads,
                "queries, keys and values whose heads are not permuted alike (e.g. shared key/value heads)",
            )
        self._joined(where, [qa.dims[-1], ka.dims[-1]], int(q.shape[-1]), "queries and keys whose head dims are not permuted alike")
        # what the units are (their number is part of the attention: nonparametric fusion keeps their width)
        for pieces, kind in ((head_pieces, "heads"), (qa.dims[-1], "head_dims"), (va.dims[-1], "head_dims")):
            for p in pieces:
                self.sp.all[self.sp.find(p.space)].kind = kind
        return _Ann(tuple(() for _ in range(out.ndim - 3)) + (head_pieces, (), va.dims[-1]))

    def _joined(self, where: str, entries: Sequence[Sequence[_Piece]], length: int, reason: str) -> tuple[_Piece, ...]:
        """Pieces that must be permuted alike on several tensors' axes of one ``length``: joined where every tensor
        has the same layout, else all fixed with ``reason``."""
        layouts = [sorted(self._key(p) for p in pieces) for pieces in entries]
        if any(layout != layouts[0] for layout in layouts):
            for pieces in entries:
                for p in pieces:
                    self.sp.fix(p.space, f"{where}: {reason}")
            return ()
        return self._merge_dim(where, [(pieces, length) for pieces in entries], length)

    def _opaque(self, n: torch.fx.Node, name: str, mod: nn.Module, tensors: list[tuple[torch.Tensor, _Ann]], out: Any, reason: str) -> Any:
        """A module the tracer does not model: the units it reads are fixed, and so is every axis of its own
        parameters (listed with the reason, never silently left out)."""
        reason = f"{n.name}: {reason}"
        self._fix_all(tensors, reason)
        for key, param in mod.named_parameters():
            for d, size in enumerate(param.shape):
                s = self.sp.new(size, f"{name}.{key}", "parameter", fixed=reason)
                self.sp.add_axis(s, f"{name}.{key}", d)
        return self._empty(out)

    @staticmethod
    def _state_used(n: torch.fx.Node) -> bool:
        """Whether anything reads a recurrent layer's final state (its output tuple beyond item 0)."""
        for user in n.users:
            if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
                continue
            if user.op == "call_function" and user.target is operator.getitem and not user.users:
                continue
            return True
        return False


def _spaces_of(ann: Any) -> Iterator[int]:
    """Every space an annotation (or a tuple of them) places."""
    if isinstance(ann, _Ann):
        for p in ann.pieces():
            yield p.space
    elif isinstance(ann, (list, tuple)):
        for a in ann:
            yield from _spaces_of(a)


def _has_literal_size(args: Any) -> bool:
    """Whether a node's further arguments hold an integer written in the code (not computed in the graph) above 1."""
    if isinstance(args, torch.fx.Node):
        return False
    if isinstance(args, (list, tuple)):
        return any(_has_literal_size(a) for a in args)
    if isinstance(args, dict):
        return any(_has_literal_size(a) for a in args.values())
    if isinstance(args, slice):
        return any(_has_literal_size(a) for a in (args.start, args.stop, args.step))
    return isinstance(args, int) and not isinstance(args, bool) and args > 1


def _read_units(labels: torch.Tensor, size: int) -> tuple[int, int, int, int] | None | tuple[()]:
    """Where a space's unit labels (``-1`` elsewhere) ended up: ``(dim, start, outer, inner)``; ``()`` if none of
    them is there; ``None`` if they are not whole, or not along one axis in an order an :class:`AxisRef` can view."""
    if labels.numel() == 0 or not bool((labels >= 0).any()):
        return ()
    varying = [d for d in range(labels.ndim) if labels.shape[d] > 1 and not torch.equal(labels, labels.narrow(d, 0, 1).expand_as(labels))]
    if len(varying) != 1:
        return None
    t = varying[0]
    line = labels.movedim(t, 0).reshape(labels.shape[t], -1)[:, 0]
    where = torch.nonzero(line >= 0).flatten()
    start, stop = int(where[0]), int(where[-1]) + 1
    if stop - start != len(where):
        return None
    values = line[start:stop]
    span = stop - start
    inner = int(torch.cumprod((values == values[0]).long(), 0).sum())
    if span % (size * inner):
        return None
    outer = span // (size * inner)
    expected = torch.arange(size).repeat_interleave(inner).repeat(outer)
    if not torch.equal(values, expected):
        return None
    return (t, start, outer, inner)


# ---------------------------------------------------------------------------------------------------------------
# The spec


def _aliases(model: nn.Module) -> tuple[dict[str, list[str]], dict[str, tuple[int, ...]]]:
    state = model.state_dict(keep_vars=True)
    by_storage: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            by_storage.setdefault((value.data_ptr(), tuple(value.shape)), []).append(key)
    aliases = {k: keys for keys in by_storage.values() for k in keys}
    return aliases, {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _settle(sp: _Spaces) -> None:
    """A weight axis reached twice with one layout (a shared module, a tied weight) joins the two spaces; with
    layouts that cannot both apply, both are fixed."""
    changed = True
    while changed:
        changed = False
        seen: dict[tuple[str, int], list[tuple[int, AxisRef]]] = {}
        for i, space in enumerate(sp.all):
            if sp.find(i) != i:
                continue
            for axis in dict.fromkeys(space.axes):
                for j, other in seen.get((axis.key, axis.dim), []):
                    if sp.find(j) == i:
                        continue
                    if (other.start, other.outer, other.inner) == (axis.start, axis.outer, axis.inner) and sp.size(j) == space.size:
                        sp.merge(j, i, f"{axis.key}[{axis.dim}] reached twice")
                        changed = True
                    elif not axes_compatible(axis, other, space.size, sp.size(j)):
                        reason = f"{axis.key}[{axis.dim}] is used with two unit layouts"
                        sp.fix(i, reason)
                        sp.fix(j, reason)
                seen.setdefault((axis.key, axis.dim), []).append((i, axis))
            if changed:
                break


def _unfactor(sp: _Spaces, factors: Sequence[tuple[int, int, int]], blocks: dict[int, list[int]]) -> None:
    """Rewrite each factored space's weight axes (:meth:`_Analysis._factor`) into its heads and head-dims spaces:
    an axis viewing ``size = heads * per`` units as ``(outer, size, inner)`` is ``(outer, heads, per * inner)`` for
    the heads and ``(outer * heads, per, inner)`` for the head dims. A fixed space fixes both; a space factored two
    ways, or also split into norm-group blocks, is fixed."""
    done: dict[int, tuple[int, int]] = {}
    blocked = {sp.find(s) for s in blocks}
    for space, h, d in factors:
        root = sp.find(space)
        if root in done:
            h0, d0 = done[root]
            if (sp.size(h0), sp.size(d0)) == (sp.size(h), sp.size(d)):
                sp.merge(h0, h, "the same units split into heads twice")
                sp.merge(d0, d, "the same units split into heads twice")
            else:
                for s in (h0, d0, h, d):
                    sp.fix(s, "units split into heads in two ways")
            continue
        done[root] = (h, d)
        heads, per = sp.size(h), sp.size(d)
        r = sp.all[root]
        if not r.soft:  # joined to real units after the split: so are its heads and head dims
            sp.all[sp.find(h)].soft = sp.all[sp.find(d)].soft = False
        for a in dict.fromkeys(r.axes):
            sp.all[sp.find(h)].axes.append(AxisRef(a.key, a.dim, a.start, a.outer, per * a.inner))
            sp.all[sp.find(d)].axes.append(AxisRef(a.key, a.dim, a.start, a.outer * heads, a.inner))
        r.axes = []
        reason = r.fixed or ("units split into heads and into norm-group blocks" if root in blocked else None)
        if reason:
            sp.fix(h, reason)
            sp.fix(d, reason)


def _split_blocks(group: PermGroup, block: int | None) -> tuple[list[PermGroup], list[FixedAxis]]:
    """``group`` as one group per block of ``block`` consecutive units (units normalised in groups may move only within
    their norm group: a GroupNorm with several groups of several channels), named ``<group>.block<k>``. An axis or probe
    viewing the units in repeated blocks (``outer`` > 1) cannot be split into a segment per block: then the whole group
    is fixed, with the reason."""
    if not block or block >= group.size:
        return [group], []
    if any(a.outer != 1 for a in group.axes):
        reason = f"units normalised in groups of {block} on an axis the spec views in repeated blocks (cannot be split)"
        return [], [FixedAxis(a.key, a.dim, reason) for a in group.axes]
    out = []
    for k, first in enumerate(range(0, group.size, block)):
        size = min(block, group.size - first)
        axes = tuple(AxisRef(a.key, a.dim, a.start + first * a.inner, 1, a.inner) for a in group.axes)
        probes = tuple(Probe(p.node, p.dim, p.start + first * p.inner, 1, p.inner, p.hook) for p in group.probes if p.outer == 1)
        out.append(PermGroup(f"{group.name}.block{k}", size, axes, probes, group.kind, group.fixed_width))
    return [g for g in out if g.size > 1], []


def derive_spec(model: nn.Module, example_input: torch.Tensor, *, check: bool = True, strict: bool = False) -> PermutationSpec:
    """The permutation groups of ``model``, derived from its ``torch.fx`` graph and one example batch, then checked on
    the model itself (:mod:`rayfuse.symmetry.invariance`).

    Parameters
    ----------
    model : nn.Module
        Any module :func:`trace_model` can trace. Left as it was (its train/eval modes are restored).
    example_input : torch.Tensor
        A batch the model accepts (batch first; two samples or more), e.g. ``torch.randn(2, 1, 8, 8)``.
    check : bool
        Run the invariance check: random permutations of each group must leave the model's output unchanged; a group
        whose permutation changes it is fixed with the reason "failed the invariance check".
    strict : bool
        Refuse (``InputError``) a spec with a group that failed the invariance check, instead of fixing the group.

    Returns
    -------
    PermutationSpec
        One group per space of units that can be reordered together (named after the first module that writes them,
        e.g. ``layer1.0.conv1``; attention adds ``<attn>.heads``, ``<attn>.qk_dims`` and ``<attn>.vo_dims``), each
        with the probes (nodes of :func:`trace_model`'s graph) where activation matching can observe its units: the
        outputs of activations where there are some, else of normalisations, else of any node carrying the units.
        ``fixed`` lists every weight axis left unpermuted, with the reason (naming the graph node), and which of its
        units when only a segment of it is fixed (e.g. one input of a concatenation).

    Raises
    ------
    InputError
        When the model can neither be traced nor exported (``torch.export``, non-strict: tried when ``torch.fx``
        fails), or does not accept ``example_input``; with ``strict``, when a group failed the invariance check.
    """
    try:
        gm = trace_model(model)
        exported = False
    except InputError as untraceable:  # e.g. Hugging Face models: their graph from torch.export instead
        if not isinstance(model, nn.Module):
            raise
        from rayfuse.symmetry.export import export_graph

        gm = export_graph(model, example_input, untraceable)
        exported = True
    aliases, shapes = _aliases(model)
    analysis = _Analysis(gm, aliases)
    modes = _modes(model)
    model.eval()
    try:
        with torch.no_grad():
            analysis.run(example_input)
    except InputError:
        raise
    except Exception as exc:
        message = (str(exc).strip().splitlines() or [""])[0][:160]
        raise InputError(
            "input", "an example batch the model accepts", f"shape {tuple(example_input.shape)}", f"{type(exc).__name__}: {message}"
        ) from None
    finally:
        _restore(modes)
    sp = analysis.sp
    _unfactor(sp, analysis.factors, analysis.blocks)
    _settle(sp)
    for i, space in enumerate(sp.all):
        if sp.find(i) == i and not space.fixed:
            missing = next((a.key for a in space.axes if a.key not in shapes), None)
            if missing is not None:
                space.fixed = f"{missing} is not in the state dict"
    blocks: dict[int, int] = {}
    for s, sizes in analysis.blocks.items():
        blocks[sp.find(s)] = math.gcd(blocks.get(sp.find(s), 0), *sizes)
    probes: dict[int, list[tuple[int, int, Probe]]] = {}
    for s, rank, order, probe in analysis.probes:
        probes.setdefault(sp.find(s), []).append((rank, order, probe))
    groups: list[PermGroup] = []
    fixed: dict[tuple[str, int, str], FixedAxis] = {}
    names: set[str] = set()
    for i, space in enumerate(sp.all):
        if sp.find(i) != i or space.size <= 1 or space.soft or not space.axes:
            continue
        axes = tuple(dict.fromkeys(space.axes))
        if space.fixed:
            for a in (a for a in axes if a.key in shapes):
                part = (
                    ""
                    if (a.start, a.outer, a.inner) == (0, 1, 1) and a.span(space.size) == shapes[a.key][a.dim]
                    else f" (units from {a.start}: {a.outer} x {space.size} x {a.inner})"
                )
                fixed.setdefault((a.key, a.dim, space.fixed + part), FixedAxis(a.key, a.dim, space.fixed + part))
            continue
        name, k = space.name, 2
        while name in names:
            name, k = f"{space.name}#{k}", k + 1
        names.add(name)
        found = probes.get(i, []) if not exported else []  # probes name nodes of trace_model's graph, which has none
        best = min((r for r, _, _ in found), default=None)
        chosen = tuple(dict.fromkeys(p for r, _, p in sorted(found, key=lambda x: x[1]) if r == best))
        kept, unsplit = _split_blocks(PermGroup(name, space.size, axes, chosen, space.kind, space.fixed_width or ""), blocks.get(i))
        groups.extend(kept)
        for f in unsplit:
            fixed.setdefault((f.key, f.dim, f.reason), f)
    spec = PermutationSpec(tuple(groups), tuple(fixed.values()))
    spec.check(shapes, where="derived spec")
    if check:
        from rayfuse.symmetry.invariance import apply_invariance, invariance_failures

        failures = invariance_failures(model, spec, example_input)
        if strict and failures:
            name = next(g.name for g in spec.groups if g.name in failures)
            raise InputError(
                "architecture",
                "a model whose derived permutation groups all pass the invariance check (--strict)",
                f"group {name} {failures[name]}",
            )
        spec = apply_invariance(spec, failures)
    return spec
