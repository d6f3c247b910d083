"""Model registry: logistic regression, MLP, a small CNN, and torchvision classifiers by name.

Parameter names are stable and readable so fusion methods can describe a model's structure as data:

* ``logreg``: ``linear.weight`` ``(C, D)``, ``linear.bias``;
* ``mlp``: ``layers.{i}.weight`` ``(out, in)`` and ``layers.{i}.bias``, the last layer being the classifier;
* ``cnn``: ``convs.{i}.weight`` ``(out, in, 3, 3)``, ``convs.{i}.bias``, then ``head.weight`` / ``head.bias``;
* ``rescnn``, ``vgg``, ``transformer``: see :mod:`rayfuse.models.zoo`;
* ``torchvision:<name>``: torchvision's own names (first convolution adapted to the input channels);
* ``hf:<folder>``: a local Hugging Face sequence classifier (:mod:`rayfuse.models.hf`), taking token ids: its own names;
* ``custom``: a factory given from Python (``rayfuse.run(model=...)``): its own names.

Every model maps a float32 batch ``(B, *input_shape)`` to logits ``(B, num_classes)`` and exposes
``features(x)``: the representation the classifier reads (penultimate activations or the last conv feature map).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayfuse.errors import InputError
from rayfuse.memory import available_memory  # also imported from here by the data readers and io
from rayfuse.models.params import build_on_meta
from rayfuse.models.zoo import build_rescnn, build_transformer, build_vgg
from rayfuse.registry import Registry

__all__ = [
    "MODELS",
    "ModelInfo",
    "TRAINING_COPIES",
    "available_memory",
    "build_model",
    "check_model_size",
    "count_parameters_unbuilt",
    "call_model_factory",
    "factory_arity",
    "register_model",
    "torchvision_model_names",
    "LogisticRegression",
    "MLP",
    "SmallCNN",
]

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


class LogisticRegression(nn.Module):
    """Multinomial logistic regression on flattened inputs."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Fully connected network ``in -> hidden[0] -> ... -> hidden[-1] -> num_classes``."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int, *, dropout: float = 0.0, activation: str = "relu") -> None:
        super().__init__()
        widths = [in_features, *hidden, num_classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.activation = _ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.layers[:-1]:
            x = self.dropout(self.activation(layer(x)))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[-1](self.features(x))


class SmallCNN(nn.Module):
    """3x3 convolutions (each followed by the activation, and a 2x2 max-pool while the map is at least 4x4),
    global average pooling and a linear head."""

    def __init__(
        self, input_shape: tuple[int, ...], channels: list[int], num_classes: int, *, dropout: float = 0.0, activation: str = "relu"
    ) -> None:
        super().__init__()
        in_ch, height, width = input_shape
        self.convs = nn.ModuleList()
        pools = []
        for out_ch in channels:
            self.convs.append(nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1))
            pool = min(height, width) >= 4
            pools.append(pool)
            if pool:
                height, width = height // 2, width // 2
            in_ch = out_ch
        self._pools = pools
        self.activation = _ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(in_ch, num_classes)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        for conv, pool in zip(self.convs, self._pools):
            x = self.activation(conv(x))
            if pool:
                x = nn.functional.max_pool2d(x, 2)
        return x

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.feature_map(x).mean(dim=(2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@dataclass(frozen=True)
class ModelInfo:
    name: str
    builder: Callable[[Any, tuple[int, ...], int], nn.Module]
    description: str
    image_only: bool = False


MODELS: Registry[ModelInfo] = Registry("model")


def register_model(name: str, *, description: str, image_only: bool = False):
    """Decorator registering ``builder(model_cfg, input_shape, num_classes) -> nn.Module``."""

    def decorate(builder: Callable[[Any, tuple[int, ...], int], nn.Module]):
        MODELS.register(name, ModelInfo(name, builder, description, image_only))
        return builder

    return decorate


def _flat(shape: tuple[int, ...]) -> int:
    size = 1
    for d in shape:
        size *= int(d)
    return size


@register_model("logreg", description="multinomial logistic regression (softmax regression)")
def _build_logreg(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return LogisticRegression(_flat(input_shape), num_classes)


@register_model("mlp", description="MLP; model.hidden widths, model.dropout, model.activation")
def _build_mlp(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MLP(_flat(input_shape), list(cfg.hidden), num_classes, dropout=cfg.dropout, activation=cfg.activation)


@register_model("cnn", description="small CNN: 3x3 convs (model.channels), max-pool, global average pool, linear head", image_only=True)
def _build_cnn(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return SmallCNN(input_shape, list(cfg.channels), num_classes, dropout=cfg.dropout, activation=cfg.activation)


@register_model(
    "rescnn",
    description="residual CNN with BatchNorm: stem, one basic block per model.channels width "
    "(1x1-conv shortcuts where the width changes), global average pool, linear head",
    image_only=True,
)
def _build_rescnn(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return build_rescnn(cfg, input_shape, num_classes)


@register_model(
    "vgg",
    description="VGG-style: conv-BN-ReLU stages (model.channels) with 2x2 max-pool, flatten, "
    "Linear-ReLU layers (model.hidden), linear head",
    image_only=True,
)
def _build_vgg(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return build_vgg(cfg, input_shape, num_classes)


@register_model(
    "transformer",
    description="small encoder classifier: patch (model.patch_size), sequence ((L, D) inputs: one "
    "token a position) or feature tokens, cls token, "
    "learned positions, model.depth encoder layers of width model.hidden[0] (feed-forward model.hidden[1]) "
    "with model.heads heads, linear head",
)
def _build_transformer(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return build_transformer(cfg, input_shape, num_classes)


@register_model("custom", description="a model factory given from Python: rayfuse.run(model=...); not loadable from a config file")
def _build_custom(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    factory = getattr(cfg, "custom_factory", None)
    if factory is None:  # a config file naming `custom`, or a resumed Python run
        raise InputError(
            "model.name",
            "a model a config file can build ('custom' is only a model factory given to rayfuse.run(model=...) from Python)",
            "custom",
        )
    return call_model_factory(factory, tuple(input_shape), num_classes, where=getattr(cfg, "factory", None) or "model")


def factory_arity(factory: Any) -> int:
    """How :func:`call_model_factory` calls ``factory``: 2 (``factory(input_shape, num_classes)``) when it accepts two
    positional arguments, else 0 (``factory()``); -1 when it is not callable either way."""
    import inspect

    if not callable(factory):
        return -1
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: try the two-argument form
        return 2
    for arity, args in ((2, ((1,), 2)), (0, ())):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return arity
    return -1


def call_model_factory(factory: Any, input_shape: tuple[int, ...], num_classes: int, *, where: str = "model") -> nn.Module:
    """``factory(input_shape, num_classes)`` or ``factory()`` (see :func:`factory_arity`); the result must be an
    ``nn.Module``. Raises :class:`InputError` naming ``where`` when the factory cannot be called or fails."""
    arity = factory_arity(factory)
    if arity < 0:
        raise InputError("model", "a callable taking (input_shape, num_classes) or no arguments", factory)
    try:
        model = factory(tuple(input_shape), num_classes) if arity == 2 else factory()
    except Exception as exc:  # the user's code: one line naming it, not a traceback from deep inside a worker
        raise InputError(
            "model",
            f"a factory that builds a model for inputs {tuple(input_shape)} and {num_classes} classes",
            f"{where} raised {type(exc).__name__}: {exc}",
        ) from None
    if not isinstance(model, nn.Module):
        raise InputError("model", "a factory returning a torch.nn.Module", f"{where} returned {type(model).__name__}")
    return model


@functools.lru_cache(maxsize=1)
def torchvision_model_names() -> tuple[str, ...]:
    import torchvision.models as tvm

    return tuple(sorted(tvm.list_models(module=tvm)))


def _build_torchvision(name: str, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any) -> nn.Module:
    import torchvision.models as tvm

    model = tvm.get_model(name, weights=None, **{"num_classes": num_classes, **kwargs})
    in_ch = input_shape[0]
    for parent in model.modules():  # adapt the first convolution to the input's channels
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                if child.in_channels != in_ch:
                    # torch types _ConvNd's kernel_size/stride/padding/dilation as tuple[int, ...]; a Conv2d's are pairs
                    setattr(
                        parent,
                        child_name,
                        nn.Conv2d(
                            in_ch,
                            child.out_channels,
                            child.kernel_size,  # type: ignore[arg-type]
                            child.stride,  # type: ignore[arg-type]
                            child.padding,  # type: ignore[arg-type]
                            child.dilation,  # type: ignore[arg-type]
                            child.groups,
                            child.bias is not None,
                        ),
                    )
                return model
    return model


def build_model(cfg: Any, input_shape: tuple[int, ...], num_classes: int, *, seed: int | None = None) -> nn.Module:
    """Build the model a :class:`rayfuse.config.ModelConfig` describes.

    Parameters
    ----------
    cfg : ModelConfig
    input_shape : tuple of int
        One sample's shape, ``(D,)`` for vectors or ``(C, H, W)`` for images.
    num_classes : int
    seed : int, optional
        Seeds the initialisation without touching the global torch RNG. ``None`` draws from the global torch RNG.
    """
    image = len(input_shape) == 3
    if cfg.name.startswith("torchvision:"):
        if not image:
            raise InputError("model.name", "an image dataset (C, H, W) for torchvision models", f"inputs of shape {tuple(input_shape)}")
        tv_name = cfg.name.split(":", 1)[1]
        builder = lambda _cfg, shape, n: _build_torchvision(tv_name, shape, n)  # noqa: E731
    elif cfg.name.startswith("hf:"):
        from rayfuse.models.hf import HFModel

        factory = HFModel(cfg.name[3:], where="model.name")
        builder = lambda _cfg, shape, n: factory(shape, n)  # noqa: E731
    else:
        info = MODELS.get(cfg.name, path="model.name")
        if info.image_only and not image:
            raise InputError(
                "model.name", f"an image dataset (C, H, W) for {cfg.name!r}", f"inputs of shape {tuple(input_shape)}", "use mlp or logreg"
            )
        builder = info.builder
    if seed is None:
        # Unseeded: draw from (and advance) the global torch RNG like constructing the module directly. Forking here
        # would restore the RNG afterwards, so every unseeded build would return the same initialisation.
        return builder(cfg, tuple(input_shape), num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(cfg, tuple(input_shape), num_classes)


def builds_on_meta(cfg: Any) -> bool:
    """Whether the model ``cfg`` describes may be built on PyTorch's meta device (to describe it, check it or fill it
    with given parameters, without memory or initialisation): only where rayfuse owns the code that builds it (its
    registry's own builders, torchvision's). A user's factory (``name: custom``) or registered builder, and a Hugging
    Face folder, may keep state across builds -- a tensor cached on the meta device by one build would break every
    later real one -- so they are always built for real."""
    if getattr(cfg, "custom_factory", None) is not None or cfg.name == "custom" or cfg.name.startswith("hf:"):
        return False
    if cfg.name.startswith("torchvision:"):
        return True
    try:
        info = MODELS.get(cfg.name, path="model.name")
    except InputError:
        return False
    return str(getattr(info.builder, "__module__", "")).startswith("rayfuse.")


def count_parameters_unbuilt(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> int | None:
    """The parameter count of the model ``cfg`` describes, built on torch's ``meta`` device (shapes only, no memory,
    no random numbers drawn). ``None`` for a model given from Python (``name: custom``: its factory is the user's
    code) or one that cannot be built on the meta device; :class:`InputError` from the build passes through."""
    if cfg.name == "custom":
        return None
    try:
        with torch.device("meta"):
            model = build_model(cfg, tuple(input_shape), num_classes, seed=0)
    except InputError:
        raise
    except Exception:  # a builder that needs real tensors: the real build below decides
        return None
    return sum(p.numel() for p in model.parameters())


# Training a model holds its parameters, their gradients and (Adam) two moments: four float32 copies.
TRAINING_COPIES = 4


def check_model_size(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Refuse, before anything is allocated, a model whose training copies (parameters, gradients, two optimizer
    moments: :data:`TRAINING_COPIES` float32 tensors each) need more memory than is available now. The error names the
    key that makes the model large (``model.hidden``, ``model.channels``, else ``model.name``)."""
    count = count_parameters_unbuilt(cfg, input_shape, num_classes)
    memory = available_memory()
    if count is None or memory is None:
        return
    limit = memory // (4 * TRAINING_COPIES)
    if count <= limit:
        return
    key = "model.name"
    for field in ("hidden", "channels"):
        widths = getattr(cfg, field, None)
        if widths and max(widths) > 1:
            smaller = count_parameters_unbuilt(cfg.model_copy(update={field: [1] * len(widths)}), input_shape, num_classes)
            if smaller is not None and smaller <= limit:
                key = f"model.{field}"
                break
    given = getattr(cfg, key.split(".")[1])
    raise InputError(
        key,
        f"a model that fits in memory: at most {limit:,} parameters ({TRAINING_COPIES} float32 copies to train "
        f"in the {memory / 2**30:.1f} GiB available)",
        given,
        f"that model has {count:,} parameters",
    )


def check_model_fits(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Build the model and run one dummy batch; return the parameter count. Raises :class:`InputError` if it cannot
    (a model too large for the memory is refused before it is built: :func:`check_model_size`)."""
    check_model_size(cfg, input_shape, num_classes)
    # on PyTorch's meta device first, where rayfuse builds it: shapes without memory or initialisation (a model of
    # several GB is free); a model the meta device cannot build or run is checked for real below, with its own errors
    meta = build_on_meta(lambda: build_model(cfg, input_shape, num_classes, seed=0), meta=builds_on_meta(cfg))
    if meta is not None:
        try:
            with torch.device("meta"), torch.no_grad():
                out = meta.eval()(torch.zeros((2, *input_shape)))
            if tuple(out.shape) == (2, num_classes):
                return sum(p.numel() for p in meta.parameters())
        except Exception:  # noqa: BLE001 -- see above: the real check decides
            pass
    model = build_model(cfg, input_shape, num_classes, seed=0)
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros((2, *input_shape)))
    except Exception as exc:  # noqa: BLE001 -- the model's forward (a user's code): whatever it raises is one line
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "no message")[:100]
        reason = first if isinstance(exc, RuntimeError) else f"the model's forward raised {type(exc).__name__}: {first}"
        raise InputError("model.name", f"a model that accepts inputs of shape {tuple(input_shape)}", cfg.name, reason) from None
    if not isinstance(out, torch.Tensor):  # a tuple (logits, features), a dict, a ModelOutput: training reads a tensor
        kind = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise InputError(
            "model.name",
            f"a model whose forward returns its {num_classes} logits as one tensor (batch, classes)",
            f"{cfg.name} returning {kind}",
            "return the logits alone (keep features for a forward hook or another method)",
        )
    if tuple(out.shape) != (2, num_classes):
        raise InputError("model.name", f"a model producing {num_classes} logits", f"output shape {tuple(out.shape)}")
    return sum(p.numel() for p in model.parameters())
