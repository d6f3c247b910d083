"""Model definitions of the aligned-fusion benchmark: plain PyTorch, importable from any virtualenv with torch.

The same classes are built by the project's scripts (``train.py``, ``accuracy.py``, ``speed.py``) and by the peer
tool's runner (``rebasin_runner.py``, run with the rebasin virtualenv's Python), so a checkpoint written by one side
loads into the other. This module imports only ``torch`` (and ``torchvision`` for ``resnet18``, lazily).

An architecture is described by a JSON-ready dict, the *arch spec*::

    {"arch": "rescnn", "kwargs": {"width": 16}, "input_shape": [1, 8, 8], "num_classes": 10}

and built with :func:`build_arch`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ARCHS",
    "BasicBlock",
    "CNN",
    "MLP",
    "ResCNN",
    "TransformerClassifier",
    "build_arch",
    "build_resnet18",
    "example_input",
    "read_arch_spec",
    "write_arch_spec",
]


class MLP(nn.Module):
    """Three linear layers: ``in -> hidden -> hidden -> classes`` with ReLUs."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 64) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(math.prod(input_shape), hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(self.flatten(x))))))


class CNN(nn.Module):
    """Two conv + BatchNorm + ReLU stages (the second strided), global average pool, linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn1(self.conv1(x)))
        x = self.act(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.pool(x)))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv + BatchNorm; identity shortcut, or 1x1 conv + BatchNorm when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class ResCNN(nn.Module):
    """A small residual CNN: conv stem + BatchNorm, one identity block, one strided block with a 1x1 shortcut, global pool, head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = BasicBlock(width, width)
        self.block2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.block2(self.block1(self.stem(x))))))


class TransformerClassifier(nn.Module):
    """A small transformer encoder on image patches: linear patch embedding + learned positions, encoder layers,
    mean pool, linear head."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        patch: int = 2,
        mlp_ratio: int = 2,
    ) -> None:
        super().__init__()
        channels, height, width = input_shape
        if height % patch or width % patch:
            raise ValueError(f"patch size {patch} does not divide the image size {height}x{width}")
        self.patch = patch
        self.embed = nn.Linear(channels * patch * patch, dim)
        self.pos = nn.Parameter(torch.zeros(1, (height // patch) * (width // patch), dim))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=mlp_ratio * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, _, _ = x.shape
        p = self.patch
        tokens = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        h = self.encoder(self.embed(tokens) + self.pos)
        return self.fc(self.norm(h.mean(dim=1)))


def build_resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """torchvision's resnet18 (``weights=None``: random initialisation, nothing downloaded), its first convolution
    taking ``input_shape[0]`` channels."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if input_shape[0] != 3:
        model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


ARCHS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "rescnn": ResCNN,
    "transformer": TransformerClassifier,
    "resnet18": build_resnet18,
}


def build_arch(spec: Mapping[str, Any], *, seed: int | None = None) -> nn.Module:
    """Build the model an arch spec describes (``seed``: its initialisation, without touching the global RNG)."""
    name = spec["arch"]
    if name not in ARCHS:
        raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {name!r}")
    shape, classes, kwargs = tuple(int(d) for d in spec["input_shape"]), int(spec["num_classes"]), dict(spec.get("kwargs") or {})
    if seed is None:
        return ARCHS[name](shape, classes, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ARCHS[name](shape, classes, **kwargs)


def example_input(spec: Mapping[str, Any], batch: int = 2) -> torch.Tensor:
    """A deterministic input batch of the spec's shape (for tracing a model)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch, *(int(d) for d in spec["input_shape"]), generator=generator)


def write_arch_spec(path: str | Path, spec: Mapping[str, Any]) -> Path:
    """Write an arch spec as JSON."""
    path = Path(path)
    path.write_text(json.dumps(dict(spec), indent=2) + "\n", encoding="utf-8")
    return path


def read_arch_spec(path: str | Path) -> dict[str, Any]:
    """Read an arch spec written by :func:`write_arch_spec`."""
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    missing = {"arch", "input_shape", "num_classes"} - set(spec)
    if missing:
        raise ValueError(f"{path}: the arch spec lacks {sorted(missing)}")
    return dict(spec)
