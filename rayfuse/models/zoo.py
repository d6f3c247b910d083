"""Registry models with richer symmetry: a residual CNN with BatchNorm, a VGG-style net and a small transformer.

Each builder takes ``(model_cfg, input_shape, num_classes)`` like the registry's others and builds for the digits
(``(1, 8, 8)``) upwards:

* ``rescnn``: a 3x3 conv stem (``stem.conv``, ``stem.bn``), then one basic block per ``model.channels`` width
  (``blocks.{i}.conv1/bn1/conv2/bn2``; a 1x1 ``blocks.{i}.shortcut`` conv + BN where the width or stride changes),
  global average pooling and ``head``;
* ``vgg``: conv-BN-ReLU stages (``stages.{i}.conv/bn``) each followed by a 2x2 max-pool while the map is at least
  2x2, flatten, then ``classifier.{j}`` Linear layers of widths ``model.hidden`` with ReLU, and ``head``;
* ``transformer``: patches (images, ``model.patch_size``) or single features (vectors) embedded to
  ``d = model.hidden[0]`` (``embed``), a ``cls_token``, a learned ``pos_embedding``, ``model.depth``
  ``nn.TransformerEncoderLayer`` s (``layers.{i}``, ``model.heads`` heads, feed-forward width ``model.hidden[1]``
  or ``2 d``), a final ``norm`` and ``head`` on the cls token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rayfuse.errors import InputError

__all__ = ["BasicBlock", "ResCNN", "VGG", "TransformerClassifier", "ACTIVATIONS"]

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


class _ConvBN(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN, an identity or 1x1 conv-BN shortcut, activation after the sum."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, activation: str = "relu") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.act = ACTIVATIONS[activation]()
        self.shortcut = _ConvBN(in_ch, out_ch, 1, stride) if (stride != 1 or in_ch != out_ch) else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class ResCNN(nn.Module):
    """A small residual CNN: stem, one basic block per width (stride 2 where the width changes and the map is at
    least 4x4), global average pooling, linear head."""

    def __init__(
        self, input_shape: tuple[int, ...], channels: list[int], num_classes: int, *, activation: str = "relu", dropout: float = 0.0
    ) -> None:
        super().__init__()
        in_ch, height, width = input_shape
        self.stem = _ConvBN(in_ch, channels[0])
        self.act = ACTIVATIONS[activation]()
        blocks, prev = [], channels[0]
        for out_ch in channels:
            stride = 2 if out_ch != prev and min(height, width) >= 4 else 1
            blocks.append(BasicBlock(prev, out_ch, stride, activation))
            height, width, prev = (height + 1) // stride, (width + 1) // stride, out_ch
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(prev, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.blocks(self.act(self.stem(x))).mean(dim=(2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class VGG(nn.Module):
    """Conv-BN-activation stages with 2x2 max-pools, flatten, a Linear stack and a head (channel blocks on flatten)."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        channels: list[int],
        hidden: list[int],
        num_classes: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        in_ch, height, width = input_shape
        self.stages = nn.ModuleList()
        self._pools: list[bool] = []
        for out_ch in channels:
            self.stages.append(_ConvBN(in_ch, out_ch))
            pool = min(height, width) >= 2
            self._pools.append(pool)
            if pool:
                height, width = height // 2, width // 2
            in_ch = out_ch
        widths = [in_ch * height * width, *hidden]
        self.classifier = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.act = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(widths[-1], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        for stage, pool in zip(self.stages, self._pools):
            x = self.act(stage(x))
            if pool:
                x = nn.functional.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        for layer in self.classifier:
            x = self.dropout(self.act(layer(x)))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class TransformerClassifier(nn.Module):
    """A small encoder classifier: patch or feature tokens, cls token, learned positions, encoder layers, head."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        d_model: int,
        num_classes: int,
        *,
        heads: int = 2,
        depth: int = 2,
        feedforward: int | None = None,
        patch_size: int = 4,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % heads:
            raise InputError("model.heads", f"a divisor of the model width {d_model} (model.hidden[0])", heads)
        self.image = len(input_shape) == 3
        if self.image:
            in_ch, height, width = input_shape
            if height % patch_size or width % patch_size:
                raise InputError("model.patch_size", f"a divisor of the image size {height}x{width}", patch_size)
            self.embed: nn.Module = nn.Conv2d(in_ch, d_model, patch_size, stride=patch_size)
            tokens = (height // patch_size) * (width // patch_size)
        elif len(input_shape) == 2:  # (L, D) sequences (data.layout: sequence): one token a position, D features each
            self.embed = nn.Linear(int(input_shape[1]), d_model)
            tokens = int(input_shape[0])
        else:
            self.embed = nn.Linear(1, d_model)
            tokens = int(input_shape[0])
        self.sequence = len(input_shape) == 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embedding = nn.Parameter(torch.randn(1, tokens + 1, d_model) * 0.02)
        act: Any = "relu" if activation == "relu" else "gelu" if activation == "gelu" else ACTIVATIONS[activation]()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, feedforward or 2 * d_model, dropout=dropout, activation=act, batch_first=True)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.image:
            x = self.embed(x).flatten(2).transpose(1, 2)
        elif self.sequence:
            x = self.embed(x)
        else:
            x = self.embed(x.flatten(1).unsqueeze(-1))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_rescnn(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return ResCNN(tuple(input_shape), list(cfg.channels), num_classes, activation=cfg.activation, dropout=cfg.dropout)


def build_vgg(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return VGG(tuple(input_shape), list(cfg.channels), list(cfg.hidden), num_classes, activation=cfg.activation, dropout=cfg.dropout)


def build_transformer(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    hidden = list(cfg.hidden)
    return TransformerClassifier(
        tuple(input_shape),
        hidden[0],
        num_classes,
        heads=cfg.heads,
        depth=cfg.depth,
        feedforward=hidden[1] if len(hidden) > 1 else None,
        patch_size=cfg.patch_size,
        activation=cfg.activation,
        dropout=cfg.dropout,
    )
