"""Issue 31, class 1 (a sound derived permutation spec) and class 2's last clause (a width the code fixes is not widened).

* A property test: specs derived for small architectures beyond the registry (dense blocks, inverted residuals, depthwise
  convolutions with layer scale, hand-written attention, gated, tied and shared modules, mixers, the four shapes of
  class 1, SE blocks...) leave the model's output unchanged under random permutations of every group they keep, already
  before the invariance check (the tracer is conservative by construction), and every axis they fix carries a reason.
* The invariance check itself: a model whose hooks the graph does not see gets its group fixed with the reason "failed
  the invariance check" (``rayfuse symmetry --strict`` refuses it), and a wrong group is caught.
* A case table of bad explicit specs (``rayfuse fuse``'s ``parameters.spec``, an aligned method's ``spec:`` by ``rayfuse
  validate``) and ``--strict`` refusals, each exit 2,
  one line naming the key or file, no traceback, nothing written; plus valid-but-unusual inputs that must succeed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rayfuse.cli import main
from rayfuse.errors import InputError
from rayfuse.symmetry import AxisRef, PermGroup, PermutationSpec, derive_spec
from rayfuse.symmetry.invariance import INVARIANCE_REASON, apply_invariance, invariance_failures
from tests.config.test_bad_inputs import Files, _snapshot, refused_line

# ---------------------------------------------------------------------------------------------------------------
# Architectures beyond the registry (tiny widths)


class DenseBlock(nn.Module):
    """DenseNet: each layer reads the concatenation of everything before it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.l1 = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1))
        self.l2 = nn.Sequential(nn.BatchNorm2d(7), nn.ReLU(), nn.Conv2d(7, 3, 3, padding=1))
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat([x, self.l1(x)], 1)
        x = torch.cat([x, self.l2(x)], 1)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class InvertedResidual(nn.Module):
    """MobileNetV2: expand 1x1, depthwise 3x3, project 1x1, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.expand = nn.Sequential(nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.project(self.dw(self.expand(x)))
        return self.head(x.mean((2, 3)))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, LayerNorm over channels (channels last), MLP, layer scale, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 2, stride=2)
        self.dw = nn.Conv2d(4, 4, 7, padding=3, groups=4)
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.gamma = nn.Parameter(torch.full((4,), 1e-6))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = self.stem(x)
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.down(F.gelu(self.up(self.norm(h))))
        x = x + (self.gamma * h).permute(0, 3, 1, 2)
        return self.head(x.mean(dim=(2, 3)))


class HandAttention(nn.Module):
    """Attention written by hand: one qkv Linear, heads by reshape, softmax(q k^T) v, an output projection."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Linear(6, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.embed(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)
        y = (a @ v).transpose(1, 2).reshape(B, T, -1)
        return self.head((h + self.out(y)).mean(1))


class GatedMLP(nn.Module):
    """SwiGLU: a(x) * silu(b(x)), then c."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.c(self.a(x) * F.silu(self.b(x)))


class TiedLM(nn.Module):
    """An embedding whose weight the decoder shares."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.dec = nn.Linear(6, 10, bias=False)
        self.dec.weight = self.emb.weight

    def forward(self, x):
        return self.dec(torch.tanh(self.mid(self.emb(x)))).mean(1)


class SharedTwice(nn.Module):
    """One Linear applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.f = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.f(torch.relu(self.f(torch.relu(self.inp(x))))))


class Mixer(nn.Module):
    """MLP-Mixer: token mixing across the transposed sequence, channel mixing, residuals, LayerNorms."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.norm1, self.norm2 = nn.LayerNorm(8), nn.LayerNorm(8)
        self.tok1, self.tok2 = nn.Linear(4, 5), nn.Linear(5, 4)
        self.ch1, self.ch2 = nn.Linear(8, 12), nn.Linear(12, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.embed(x)
        x = x + self.tok2(F.gelu(self.tok1(self.norm1(x).transpose(1, 2)))).transpose(1, 2)
        x = x + self.ch2(F.gelu(self.ch1(self.norm2(x))))
        return self.head(x.mean(1))


class PoolIndices(nn.Module):
    """``x, _ = pool(x)`` with return_indices=True (shape 1 of class 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1)
        self.fc = nn.Linear(5 * 4 * 4, 3)

    def forward(self, x):
        x, _ = self.pool(torch.relu(self.conv(x)))
        return self.fc(torch.relu(self.conv2(x)).flatten(1))


class FunctionalPoolIndices(nn.Module):
    """``F.max_pool2d(..., return_indices=True)``, both values and indices used."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y, idx = F.max_pool2d(self.conv(x), 2, return_indices=True)
        return self.fc(y.amax(dim=(2, 3)) + idx.float().mean(dim=(2, 3)) * 0.01)


class MeanAxis(nn.Module):
    """``x.mean(axis=(2, 3))`` (shape 2 of class 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(axis=(2, 3)))


class ClampTensor(nn.Module):
    """``h.clamp(max=alpha)`` with a per-unit tensor alpha (shape 3 of class 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)
        self.alpha = nn.Parameter(torch.rand(5))

    def forward(self, x):
        return self.b(self.a(x).clamp(max=self.alpha))


class FlippedLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x).flip(-1)


class SubclassForward(nn.Module):
    """A subclass of nn.Linear that overrides forward (shape 4 of class 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 5), FlippedLinear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class PlainLinear(nn.Linear):
    """A subclass that changes nothing: modelled as nn.Linear."""


class SubclassPlain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = PlainLinear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class FlippedAttention(nn.MultiheadAttention):
    def forward(self, *args, **kwargs):
        out, w = super().forward(*args, **kwargs)
        return out.flip(-1), w


class AttentionSubclass(nn.Module):
    """A subclass of a leaf module (MultiheadAttention) overriding forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.attn = FlippedAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.attn(h, h, h)[0].mean(1))


class TiedIntoUnmodelled(nn.Module):
    """A Linear sharing its weight with a module the tracer does not model: the shared weight must stay put."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.embed2 = nn.Linear(6, 8), nn.Linear(6, 8)
        self.attn = FlippedAttention(8, 2, batch_first=True)
        self.proj = nn.Linear(8, 8)
        self.proj.weight = self.attn.out_proj.weight
        self.head, self.head2 = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        a = self.head(self.attn(h, h, h)[0].mean(1))
        return a + self.head2(torch.relu(self.proj(self.embed2(x))).mean(1))


class ExpandAsGate(nn.Module):
    """A learnt per-unit gate shaped like the hidden units with ``expand_as``: only their shape is read."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)
        self.gate = nn.Parameter(torch.randn(1, 5))

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h * torch.sigmoid(self.gate.expand_as(h)))


class SEBlock(nn.Module):
    """Squeeze and excitation: channel weights from a pooled bottleneck."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(6, 3, 1), nn.Conv2d(3, 6, 1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        s = torch.sigmoid(self.fc2(torch.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return self.head((x * s).mean((2, 3)))


class Inception(nn.Module):
    """Two branches concatenated, then a 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = nn.Conv2d(1, 3, 1), nn.Conv2d(1, 2, 3, padding=1)
        self.mix = nn.Conv2d(5, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.cat([torch.relu(self.b1(x)), torch.relu(self.b2(x))], dim=1)
        return self.head(torch.relu(self.mix(x)).amax(dim=(2, 3)))


class ChannelShuffle(nn.Module):
    """ShuffleNet's channel shuffle (view, transpose, view): the units are split, so fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        B, C, H, W = x.shape
        x = x.view(B, 2, C // 2, H, W).transpose(1, 2).reshape(B, C, H, W)
        return self.head(self.conv2(x).mean((2, 3)))


class SequenceConv(nn.Module):
    """Conv1d over (B, C, L) with BatchNorm1d and a variance pooling written positionally."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm1d(6)
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.cat([h.mean(2), h.var(2, True)], dim=1))


class LiteralView(nn.Module):
    """``view(-1, 8)``: a literal width (class 2: not widened)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).view(-1, 8))


class ExpandLiteral(nn.Module):
    """``h0.expand(B, 5)``: a learnt initial state of a literal width added to the hidden units (class 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)
        self.h0 = nn.Parameter(torch.randn(1, 5))

    def forward(self, x):
        return self.b(torch.relu(self.a(x) + self.h0.expand(x.size(0), 5)))


class HookedContainer(nn.Module):
    """A forward hook on a container: torch.fx traces the container's forward and never sees the hook."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
        self.scale = nn.Parameter(torch.rand(5) + 0.5)
        self.out = nn.Linear(5, 3)
        self.block.register_forward_hook(lambda module, inputs, output: output * self.scale)

    def forward(self, x):
        return self.out(self.block(x))


class HookedLinear(nn.Module):
    """A hook on a Linear itself: the module is not modelled (matched by exact semantics only)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.b.register_forward_hook(lambda module, inputs, output: output.flip(-1))

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class WhereGate(nn.Module):
    """``torch.where`` with a per-unit threshold: an op the tracer does not model, fixed with the reason."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)
        self.t = nn.Parameter(torch.randn(5))

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.where(h > self.t, h, torch.zeros_like(h)))


class ResidualMLP(nn.Module):
    """A pre-norm residual MLP with a learnt per-unit bias added with torch.add(..., alpha=)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.shift = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        h = torch.add(h, self.fc2(F.gelu(self.fc1(self.norm(h)))), alpha=0.5) + self.shift
        return self.head(h)


class SliceHead(nn.Module):
    """``h[:, :4]`` reads part of the hidden units: they are not all alike, so fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))[:, :4])


IMG, VEC, SEQ, TOK = (2, 1, 8, 8), (3, 6), (2, 4, 6), (2, 5)

# name -> (factory, input shape, minimum number of groups kept)
ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "dense-block": (DenseBlock, IMG, 2),
    "inverted-residual": (InvertedResidual, IMG, 2),
    "convnext-layer-scale": (ConvNeXtBlock, IMG, 2),
    "hand-attention": (HandAttention, SEQ, 1),
    "gated-mlp": (GatedMLP, VEC, 1),
    "tied-embedding": (TiedLM, TOK, 1),
    "shared-twice": (SharedTwice, VEC, 1),
    "mixer": (Mixer, SEQ, 3),
    "pool-return-indices": (PoolIndices, IMG, 2),
    "functional-pool-indices": (FunctionalPoolIndices, IMG, 0),
    "mean-axis": (MeanAxis, IMG, 1),
    "clamp-tensor-keyword": (ClampTensor, VEC, 1),
    "subclass-overrides-forward": (SubclassForward, VEC, 0),
    "subclass-plain": (SubclassPlain, VEC, 1),
    "attention-subclass": (AttentionSubclass, SEQ, 0),
    "tied-into-an-unmodelled-leaf": (TiedIntoUnmodelled, SEQ, 0),
    "se-block": (SEBlock, IMG, 2),
    "expand-as-gate": (ExpandAsGate, VEC, 1),
    "inception": (Inception, IMG, 2),
    "channel-shuffle": (ChannelShuffle, IMG, 1),
    "sequence-conv": (SequenceConv, (2, 3, 7), 1),
    "literal-view": (LiteralView, VEC, 1),
    "expand-literal": (ExpandLiteral, VEC, 1),
    "hooked-container": (HookedContainer, VEC, 0),
    "hooked-linear": (HookedLinear, VEC, 0),
    "where-gate": (WhereGate, VEC, 0),
    "residual-mlp": (ResidualMLP, VEC, 2),
    "slice-head": (SliceHead, VEC, 0),
}


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    make, shape, _ = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = make().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every value random: zero biases or unit scales would hide a wrong permutation
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.3, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
    x = torch.randint(0, 10, shape, generator=g) if name == "tied-embedding" else torch.randn(shape, generator=g)
    return model, x


def output_change(model: nn.Module, x: torch.Tensor, spec: PermutationSpec, perms: dict[str, np.ndarray]) -> float:
    """Independent of the invariance check: the largest output difference with ``perms`` applied (float64)."""
    model = model.double() if x.is_floating_point() else model.double()
    x = x.double() if x.is_floating_point() else x
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(spec.apply_torch(state, perms))
        after = model(x)
        model.load_state_dict(state)
    return float((after - before).abs().max() / before.abs().max())


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_derived_specs_keep_only_groups_whose_permutations_leave_the_output_unchanged(name):
    model, x = build(name)
    unchecked = derive_spec(model, x, check=False)
    spec = derive_spec(model, x)
    assert len(spec.groups) >= ARCHITECTURES[name][2], spec.describe()
    assert all(f.reason.strip() for f in spec.fixed), spec.describe()
    rng = np.random.default_rng(0)
    for _ in range(3):  # every group at once, then each group alone
        perms = spec.random(rng)
        assert output_change(model, x, spec, perms) < 1e-9, (name, spec.describe())
    for g in spec.groups:
        perm = rng.permutation(g.size)
        while g.size > 1 and np.array_equal(perm, np.arange(g.size)):
            perm = rng.permutation(g.size)
        assert output_change(model, x, spec, {g.name: perm}) < 1e-9, (name, g.name)
    if name not in ("hooked-container",):  # the graph misses the hook: only the invariance check can see it
        # conservative by construction: the tracer alone keeps nothing the check would have to fix
        assert invariance_failures(model, unchecked, x) == {}, (name, unchecked.describe())
        assert [g.name for g in unchecked.groups] == [g.name for g in spec.groups]


def _group_with(spec: PermutationSpec, key: str, dim: int) -> PermGroup | None:
    return next((g for g in spec.groups if any(a.key == key and a.dim == dim for a in g.axes)), None)


def test_the_four_shapes_of_class_1_are_modelled_or_fixed_not_dropped():
    spec = derive_spec(*build("pool-return-indices"))
    group = _group_with(spec, "conv.weight", 0)
    assert group is not None and any(a.key == "conv2.weight" and a.dim == 1 for a in group.axes)  # through x, _ = pool(x)
    spec = derive_spec(*build("mean-axis"))
    group = _group_with(spec, "conv.weight", 0)
    assert group is not None and any(a.key == "fc.weight" and a.dim == 1 for a in group.axes)  # mean over axis=(2, 3)
    spec = derive_spec(*build("clamp-tensor-keyword"))
    group = _group_with(spec, "a.weight", 0)
    assert group is not None and any(a.key == "alpha" for a in group.axes)  # the bound is permuted with the units
    spec = derive_spec(*build("subclass-overrides-forward"))
    # not matched as nn.Linear: traced through its own forward, whose F.linear is modelled (its input columns join the
    # units before it) and whose flip of the output fixes the units it reorders, with the reason
    assert _group_with(spec, "b.weight", 0) is None
    assert any(f.key == "b.weight" and f.dim == 0 and "flip" in f.reason for f in spec.fixed), spec.describe()
    group = _group_with(spec, "a.weight", 0)
    assert group is not None and any(a.key == "b.weight" and a.dim == 1 for a in group.axes), spec.describe()
    spec = derive_spec(*build("subclass-plain"))  # a subclass with the stock semantics is modelled
    assert _group_with(spec, "a.weight", 0) is not None
    spec = derive_spec(*build("attention-subclass"))  # a leaf kept whole, but not the stock module: fixed, by exact type
    assert not any(a.key.startswith("attn.") for g in spec.groups for a in g.axes)
    assert any("FlippedAttention" in f.reason and "exact type" in f.reason for f in spec.fixed), spec.describe()
    assert any(f.key == "attn.in_proj_weight" and f.dim == 0 for f in spec.fixed)  # its own tensors are listed fixed
    spec = derive_spec(*build("tied-into-an-unmodelled-leaf"))  # a tensor it shares is not permuted elsewhere either
    assert not any(a.key in ("proj.weight", "attn.out_proj.weight") and a.dim == 0 for g in spec.groups for a in g.axes)


def test_a_hook_the_graph_does_not_see_fails_the_invariance_check():
    model, x = build("hooked-container")
    unchecked = derive_spec(model, x, check=False)
    assert _group_with(unchecked, "block.0.weight", 0) is not None  # the graph alone believes the units permute
    spec = derive_spec(model, x)
    assert _group_with(spec, "block.0.weight", 0) is None
    reasons = [f.reason for f in spec.fixed if f.key == "block.0.weight" and f.dim == 0]
    assert reasons and INVARIANCE_REASON in reasons[0]
    with pytest.raises(InputError, match=r"^architecture: .*invariance check.*got 'group block\.0 failed the invariance check"):
        derive_spec(model, x, strict=True)


def test_the_invariance_check_catches_a_group_that_misses_an_axis_and_leaves_the_model_as_it_was():
    model, x = build("mean-axis")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    wrong = PermutationSpec((PermGroup("conv", 4, (AxisRef("conv.weight", 0), AxisRef("conv.bias", 0))),))
    failures = invariance_failures(model, wrong, x)
    assert set(failures) == {"conv"} and failures["conv"].startswith(INVARIANCE_REASON)
    fixed = apply_invariance(wrong, failures)
    assert not fixed.groups and {(f.key, f.dim) for f in fixed.fixed} == {("conv.weight", 0), ("conv.bias", 0)}
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.training is False


def test_a_derived_group_the_tracer_got_wrong_is_fixed_by_the_check(monkeypatch):
    """With the tracer's clamp rule switched off (the old behaviour: the tensor bound ignored), the check fixes it."""
    import rayfuse.symmetry.trace as trace

    monkeypatch.setattr(trace, "_BOUND_NAMES", set())
    monkeypatch.setattr(trace, "_LIKE_NAMES", {"to", "type_as", "clamp"})
    model, x = build("clamp-tensor-keyword")
    spec = derive_spec(model, x)
    assert _group_with(spec, "a.weight", 0) is None
    assert any(INVARIANCE_REASON in f.reason for f in spec.fixed if f.key == "a.weight")


@pytest.mark.parametrize("name", ["literal-view", "expand-literal"])
def test_a_width_the_code_fixes_is_marked_and_not_widened(name):
    from rayfuse.alignment import width_roles

    model, x = build(name)
    spec = derive_spec(model, x)
    group = _group_with(spec, "a.weight", 0)
    assert group is not None and "size written in the code" in group.fixed_width, spec.describe()
    assert width_roles(model, spec).fixed[group.name] == group.fixed_width
    assert "width fixed" in spec.describe()
    assert PermutationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).group(group.name).fixed_width == group.fixed_width


def test_a_widening_merge_keeps_a_fixed_width():
    from rayfuse.alignment import fuse_nonparametric, width_roles

    model, x = build("literal-view")
    spec = derive_spec(model, x)
    params = [{k: v.numpy().copy() for k, v in model.state_dict().items()} for _ in range(2)]
    params[1]["a.weight"] = -params[1]["a.weight"]  # nothing matches: every unit would become new
    fused, plan = fuse_nonparametric(params, spec, width_roles(model, spec), threshold=float("inf"), max_width=2.0)
    assert plan.widths == {g.name: g.size for g in spec.groups}
    assert fused["a.weight"].shape == (8, 6)


def test_free_widths_still_widen():
    from rayfuse.alignment import width_roles

    model, x = build("gated-mlp")
    spec = derive_spec(model, x)
    assert all(not g.fixed_width for g in spec.groups)
    assert not width_roles(model, spec).fixed


# ---------------------------------------------------------------------------------------------------------------
# Bad explicit specs and --strict refusals: exit 2, one line naming the key or file, nothing written

NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
        self.scale = nn.Parameter(torch.rand(5) + 0.5)
        self.out = nn.Linear(5, 3)
        self.block.register_forward_hook(lambda m, i, o: o * self.scale)

    def forward(self, x):
        return self.out(self.block(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        return torch.relu(self.lin(x))


class HookedCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.offset = nn.Parameter(torch.randn(5))
        self.out = nn.Linear(5, 3)
        self.block.register_forward_hook(lambda m, i, o: o + self.offset)

    def forward(self, x):
        return self.out(self.block(x))


class Tracing(nn.Module):
    """Computes something else when torch.fx traces it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if not torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            h = h.flip(-1)
        return self.b(h)


class Quirky(nn.Module):
    """The four shapes of class 1 in one model: --strict accepts it (the tracer models or fixes each)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3, padding=1)
        self.pool = nn.MaxPool1d(2, return_indices=True)
        self.alpha = nn.Parameter(torch.rand(4, 1) + 0.5)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x, _ = self.pool(torch.relu(self.conv(x.unsqueeze(1))))
        return self.fc(x.clamp(max=self.alpha).mean(axis=2))
'''

HIDDEN = [{"key": "fc1.weight", "dim": 0}, {"key": "fc1.bias", "dim": 0}, {"key": "fc2.weight", "dim": 1}]


def _group(name: str = "h", size: int = 8, axes: Any = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "size": size, "axes": HIDDEN if axes is None else axes, **extra}


class SymFiles(Files):
    """:class:`Files` plus a user's model module (a name of its own per case: modules stay imported) and its
    checkpoints."""

    counter = 0

    def module(self) -> str:
        SymFiles.counter += 1
        name = f"symnets_{SymFiles.counter}"
        self.text(f"{name}.py", NET)
        return name

    def checkpoints(self, name: str) -> list[str]:
        ns: dict[str, Any] = {}
        exec(compile(NET, "symnets", "exec"), ns)
        out = []
        for i in range(2):
            torch.manual_seed(i)
            out.append(self.params(f"n{i}.safetensors", {k: v.detach().clone() for k, v in ns["Net"]().state_dict().items()}))
        return out

    def spec_fuse(self, spec: Any, *, raw: bytes | None = None, input_shape: Any = (6,), **params: Any) -> list[str]:
        module = self.module()
        models = self.checkpoints(module)
        if raw is not None:
            self.raw("spec.json", raw)
        elif spec is not None:
            self.text("spec.json", json.dumps(spec))
        config: dict[str, Any] = {
            "merge_method": "weight_matching",
            "architecture": f"{module}:Net",
            "models": [{"model": m} for m in models],
            "output": "fused.safetensors",
            "parameters": {"spec": "spec.json", **params},
        }
        if input_shape is not None:
            config["input_shape"] = list(input_shape)
        return ["fuse", self.yaml("fuse.yaml", config)]


@dataclass(frozen=True)
class SymCase:
    id: str
    make: Callable[[SymFiles], list[str]]
    names: str
    sub: str  # "explicit" (a bad parameters.spec) or "strict" (rayfuse symmetry --strict)


def spec_case(id: str, names: str, spec: Any = None, **kw: Any) -> SymCase:
    return SymCase(id, lambda f: f.spec_fuse(spec, **kw), names, "explicit")


def strict_case(id: str, cls: str) -> SymCase:
    return SymCase(id, lambda f: ["symmetry", f"{f.module()}:{cls}", "--input-shape", "6", "--strict"], "architecture", "strict")


MLP_HIDDEN = [{"key": "layers.0.weight", "dim": 0}, {"key": "layers.0.bias", "dim": 0}, {"key": "layers.1.weight", "dim": 1}]


def _mlp_group(name: str = "h", size: Any = 8, axes: Any = None) -> dict[str, Any]:
    """A group of the registry mlp (hidden [8], the harness's base job)."""
    return {"name": name, "size": size, "axes": MLP_HIDDEN if axes is None else axes}


def run_spec_case(id: str, names: str, spec: Any) -> SymCase:
    return SymCase(id, lambda f: ["validate", f.job(methods={"aligned": {"spec": spec}})], names, "explicit")


SYM_CASES = [
    # groups that overlap: one unit moved twice
    spec_case("overlap-two-groups", "parameters.spec.b", {"groups": [_group("a"), _group("b", axes=[{"key": "fc1.weight", "dim": 0}])]}),
    spec_case("overlap-same-axis-twice", "parameters.spec.h", {"groups": [_group(axes=HIDDEN + [{"key": "fc1.weight", "dim": 0}])]}),
    spec_case(
        "overlap-segments",
        "parameters.spec.b",
        {"groups": [_group("a", 4, [{"key": "fc1.weight", "dim": 0}]), _group("b", 4, [{"key": "fc1.weight", "dim": 0, "start": 2}])]},
    ),
    spec_case(
        "overlap-negative-dim",
        "parameters.spec.b",
        {"groups": [_group("a", 8, [{"key": "fc2.weight", "dim": 1}]), _group("b", 8, [{"key": "fc2.weight", "dim": -1}])]},
    ),
    # groups whose permutation changes what the model computes
    spec_case("invariance-forgets-the-next-layer", "parameters.spec.h", {"groups": [_group(axes=HIDDEN[:2])]}),
    spec_case("invariance-forgets-the-bias", "parameters.spec.h", {"groups": [_group(axes=[HIDDEN[0], HIDDEN[2]])]}),
    spec_case(
        "invariance-permutes-the-output",
        "parameters.spec.out",
        {"groups": [_group("out", 3, [{"key": "fc2.weight", "dim": 0}, {"key": "fc2.bias", "dim": 0}])]},
    ),
    spec_case("invariance-permutes-the-input", "parameters.spec.in", {"groups": [_group("in", 6, [{"key": "fc1.weight", "dim": 1}])]}),
    spec_case(
        "invariance-segments-that-differ", "parameters.spec.h", {"groups": [_group(size=4, axes=[*HIDDEN[:2], {**HIDDEN[2], "start": 4}])]}
    ),
    spec_case("invariance-blocks-of-two", "parameters.spec.h", {"groups": [_group(size=4, axes=[*HIDDEN[:2], {**HIDDEN[2], "inner": 2}])]}),
    # malformed specs
    spec_case("unknown-tensor", "parameters.spec.h", {"groups": [_group(axes=[{"key": "fc9.weight", "dim": 0}])]}),
    spec_case("axis-out-of-range", "parameters.spec.h.fc1.weight", {"groups": [_group(axes=[{"key": "fc1.weight", "dim": 5}])]}),
    spec_case("size-larger-than-the-axis", "parameters.spec.h.fc1.weight", {"groups": [_group(size=9)]}),
    spec_case("size-zero", "parameters.spec.groups.0.size", {"groups": [_group(size=0)]}),
    spec_case("size-float", "parameters.spec.groups.0.size", {"groups": [_group(size=7.5)]}),
    spec_case("size-boolean", "parameters.spec.groups.0.size", {"groups": [_group(size=True)]}),
    spec_case("dim-string", "parameters.spec.groups.0.axes.0.dim", {"groups": [_group(axes=[{"key": "fc1.weight", "dim": "0"}])]}),
    spec_case(
        "outer-zero", "parameters.spec.groups.0.axes.0.outer", {"groups": [_group(axes=[{"key": "fc1.weight", "dim": 0, "outer": 0}])]}
    ),
    spec_case("axes-empty", "parameters.spec.groups.0.axes", {"groups": [_group(axes=[])]}),
    spec_case("axes-missing", "parameters.spec.groups.0", {"groups": [{"name": "h", "size": 8}]}),
    spec_case("group-not-a-mapping", "parameters.spec.groups.0", {"groups": ["h"]}),
    spec_case("axis-unknown-field", "parameters.spec.groups.0.axes.0", {"groups": [_group(axes=[{"key": "fc1.weight", "dims": 0}])]}),
    spec_case("spec-a-list", "parameters.spec", [_group()]),
    spec_case("duplicate-group-names", "spec.groups", {"groups": [_group(), _group()]}),
    spec_case("fixed-malformed", "parameters.spec.fixed", {"groups": [_group()], "fixed": [{"dim": 0}]}),
    spec_case("probe-malformed", "parameters.spec.groups.0.probes", {"groups": [_group(probes=[{"nod": "x"}])]}),
    spec_case("spec-not-utf8", "parameters.spec", raw=b'\xff\xfe{"groups": []}'),
    spec_case("spec-not-json", "parameters.spec", raw=b"{groups: [}"),
    spec_case("spec-nested-deeply", "parameters.spec", raw=b"[" * 200_000 + b"]" * 200_000),
    spec_case("spec-without-an-input-shape", "input_shape", {"groups": [_group()]}, input_shape=None),
    # the same checks on a federation's aligned method (spec: in its parameters), by rayfuse validate
    run_spec_case("validate-overlap", "methods.aligned.spec.b", {"groups": [_mlp_group("a"), _mlp_group("b")]}),
    run_spec_case("validate-invariance-forgets-the-next-layer", "methods.aligned.spec.h", {"groups": [_mlp_group(axes=MLP_HIDDEN[:2])]}),
    run_spec_case(
        "validate-invariance-permutes-the-output",
        "methods.aligned.spec.out",
        {"groups": [_mlp_group("out", 10, [{"key": "layers.1.weight", "dim": 0}, {"key": "layers.1.bias", "dim": 0}])]},
    ),
    run_spec_case("validate-size-a-string", "methods.aligned.spec.groups.0.size", {"groups": [_mlp_group(size="8")]}),
    # --strict: a group the graph cannot see through fails the invariance check
    strict_case("strict-hook-on-a-container", "Hooked"),
    strict_case("strict-hook-on-a-custom-module", "HookedCustom"),
    strict_case("strict-forward-branches-on-tracing", "Tracing"),
]


@pytest.fixture
def sym_isolated(tmp_path, monkeypatch):
    """The case's folder as the working directory and on sys.path (the user's module), no bytecode written there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    return tmp_path


@pytest.mark.parametrize("bad", SYM_CASES, ids=[c.id for c in SYM_CASES])
def test_a_bad_spec_or_a_strict_refusal_is_one_line_and_leaves_nothing_behind(bad: SymCase, sym_isolated: Path, capsys) -> None:
    command = bad.make(SymFiles(sym_isolated))
    capsys.readouterr()
    before = _snapshot(sym_isolated)
    line = refused_line(command, capsys)
    assert bad.names in line, line
    if bad.id.startswith("invariance"):
        assert INVARIANCE_REASON in line
    if bad.sub == "strict":
        assert "--strict" in line and INVARIANCE_REASON in line
    assert _snapshot(sym_isolated) == before


def test_the_case_table_covers_both_kinds():
    counts = {sub: sum(1 for c in SYM_CASES if c.sub == sub) for sub in ("explicit", "strict")}
    assert len(SYM_CASES) >= 20 and counts["explicit"] >= 20 and counts["strict"] >= 3, counts
    assert len({c.id for c in SYM_CASES}) == len(SYM_CASES)


# valid but unusual: must succeed

VALID_SPECS = {
    "the-derived-group": {"groups": [_group()]},
    "half-the-units": {"groups": [_group(size=4)]},
    "heads-and-dims-share-an-axis": {
        "groups": [
            _group(
                "blocks",
                4,
                [
                    {"key": "fc1.weight", "dim": 0, "inner": 2},
                    {"key": "fc1.bias", "dim": 0, "inner": 2},
                    {"key": "fc2.weight", "dim": 1, "inner": 2},
                ],
            ),
            _group(
                "within",
                2,
                [
                    {"key": "fc1.weight", "dim": 0, "outer": 4},
                    {"key": "fc1.bias", "dim": 0, "outer": 4},
                    {"key": "fc2.weight", "dim": 1, "outer": 4},
                ],
            ),
        ]
    },
    "disjoint-segments": {
        "groups": [
            _group("lo", 4, [{"key": "fc1.weight", "dim": 0}, {"key": "fc1.bias", "dim": 0}, {"key": "fc2.weight", "dim": 1}]),
            _group(
                "hi",
                4,
                [
                    {"key": "fc1.weight", "dim": 0, "start": 4},
                    {"key": "fc1.bias", "dim": 0, "start": 4},
                    {"key": "fc2.weight", "dim": 1, "start": 4},
                ],
            ),
        ]
    },
    "negative-dim-and-a-fixed-list": {
        "groups": [_group(axes=[*HIDDEN[:2], {"key": "fc2.weight", "dim": -1}])],
        "fixed": [{"key": "fc2.weight", "dim": 0, "reason": "the output"}],
    },
}


@pytest.mark.parametrize("name", list(VALID_SPECS))
def test_a_sound_explicit_spec_fuses(name, sym_isolated, capsys):
    command = SymFiles(sym_isolated).spec_fuse(VALID_SPECS[name])
    assert main(command) == 0, capsys.readouterr().err
    assert (sym_isolated / "fused.safetensors").is_file()


def test_strict_accepts_a_model_with_the_four_shapes(sym_isolated, capsys):
    module = SymFiles(sym_isolated).module()
    assert main(["symmetry", f"{module}:Quirky", "--input-shape", "6", "--strict", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    keys = {(a["key"], a["dim"]) for g in spec["groups"] for a in g["axes"]}
    assert {("conv.weight", 0), ("alpha", 0), ("fc.weight", 1)} <= keys


def test_without_strict_the_failing_group_is_listed_fixed(sym_isolated, capsys):
    module = SymFiles(sym_isolated).module()
    assert main(["symmetry", f"{module}:Hooked", "--input-shape", "6"]) == 0
    out = capsys.readouterr().out
    assert f"block.0.weight[0]: block.0: {INVARIANCE_REASON}" in out


def test_a_sound_explicit_spec_validates_for_a_federation(sym_isolated, capsys):
    job = SymFiles(sym_isolated).job(methods={"aligned": {"spec": {"groups": [_mlp_group()]}}})
    assert main(["validate", job]) == 0, capsys.readouterr().err
