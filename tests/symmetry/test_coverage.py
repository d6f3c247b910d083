"""Coverage the symmetry docs promise (issue 31, class 8): recurrent layers (``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` and
their cells) get their gate-block symmetry; functional ``F.layer_norm`` / ``F.group_norm`` / ``F.linear`` and
GroupNorm with several groups (one group per norm-group block) are modelled; constants whose elements are all equal
(``zeros_like``, ``new_zeros``, ``full_like``...) fix nothing; a tensor passed by keyword traces; Hugging Face models,
which ``torch.fx`` cannot trace, are analysed from ``torch.export``. Every case derives a spec and checks that random
permutations of all its groups leave the model's outputs unchanged, plus what the spec must contain."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rayfuse.errors import InputError
from rayfuse.symmetry import AxisRef, PermGroup, PermutationSpec, derive_spec, read_structure, trace_model


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter random (zero biases, unit norm weights and zero initial states would hide a wrong
    permutation), in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def leaves(out) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, a tuple, a Hugging Face ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in leaves(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in leaves(v)]
    return []


def assert_invariant(model: nn.Module, x: torch.Tensor, spec: PermutationSpec, *, seeds=(0, 1, 2), atol: float = 1e-5) -> None:
    """Random permutations of every group at once (each drawn so that it moves) leave every output unchanged."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = leaves(model(x))
        try:
            for seed in seeds:
                rng = np.random.default_rng(seed)
                perms = {g.name: rng.permutation(g.size) for g in spec.groups}
                for g in spec.groups:
                    while np.array_equal(perms[g.name], np.arange(g.size)):
                        perms[g.name] = rng.permutation(g.size)
                permuted = spec.apply_torch(state, perms)
                assert all(not torch.equal(permuted[a.key], state[a.key]) for g in spec.groups for a in g.axes[:1])
                model.load_state_dict(permuted)
                after = leaves(model(x))
                assert len(after) == len(before)
                for a, b in zip(after, before):
                    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)
        finally:
            model.load_state_dict(state)


def axes(spec: PermutationSpec) -> set[tuple[str, int, int, int, int]]:
    return {(a.key, a.dim, a.start, a.outer, a.inner) for g in spec.groups for a in g.axes}


def group_of(spec: PermutationSpec, key: str, dim: int) -> set[str]:
    return {g.name for g in spec.groups if any(a.key == key and a.dim == dim for a in g.axes)}


# ---------------------------------------------------------------------------------------------------------------
# Models


class Recurrent(nn.Module):
    """A recurrent layer, then a Linear on the last step's output (``head="last"``), on the final state
    (``head="state"``: ``h_n[-1]``), or on the mean over time (``head="mean"``)."""

    def __init__(
        self,
        kind: type[nn.RNNBase],
        *,
        hidden: int = 6,
        layers: int = 1,
        bidirectional: bool = False,
        batch_first: bool = True,
        head: str = "last",
        state: str = "none",
        **extra,
    ) -> None:
        super().__init__()
        self.rnn = kind(5, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, **extra)
        width = (extra.get("proj_size") or hidden) * (2 if bidirectional else 1)
        self.head = nn.Linear(width if head != "state" else (extra.get("proj_size") or hidden), 3)
        self.kind, self.where, self.state = kind, head, state
        self.batch_first = batch_first
        if state == "learned":
            self.h0 = nn.Parameter(torch.zeros(layers * (2 if bidirectional else 1), 1, extra.get("proj_size") or hidden))

    def forward(self, x):
        if self.state == "zeros":  # an initial state built from the input: all zeros, permuted or not
            batch = x.size(0) if self.batch_first else x.size(1)
            h0 = x.new_zeros(self.rnn.num_layers * (2 if self.rnn.bidirectional else 1), batch, self.rnn.proj_size or self.rnn.hidden_size)
            if self.kind is nn.LSTM:
                c0 = torch.zeros_like(h0[..., :1]).expand(-1, -1, self.rnn.hidden_size)
                out, hidden = self.rnn(x, (h0, c0))
            else:
                out, hidden = self.rnn(x, h0)
        elif self.state == "learned":
            batch = x.size(0) if self.batch_first else x.size(1)
            out, hidden = self.rnn(x, self.h0.expand(-1, batch, -1).contiguous())
        else:
            out, hidden = self.rnn(x)
        if self.where == "state":
            h = hidden[0] if isinstance(hidden, tuple) else hidden
            return self.head(h[-1])
        if self.where == "mean":
            return self.head(out.mean(dim=1 if self.batch_first else 0))
        return self.head(out[:, -1] if self.batch_first else out[-1])


class PlainGRU(nn.GRU):
    """A subclass that keeps nn.GRU's forward: modelled as nn.GRU."""


class ClippedGRU(nn.GRU):
    """A subclass with a forward of its own: not what the tracer models, so its units and parameters are fixed."""

    def forward(self, x, hx=None):  # type: ignore[override]
        out, h = super().forward(x, hx)
        return out.clamp(-0.5, 0.5), h


class Subclassed(nn.Module):
    def __init__(self, kind: type[nn.GRU]) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 4)
        self.rnn = kind(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.rnn(torch.relu(self.inp(x)))
        return self.head(out[:, -1])


class Embedded(nn.Module):
    """An embedding into a GRU (a sequence model on token ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.gru = nn.GRU(6, 7, num_layers=2, batch_first=True)
        self.head = nn.Linear(7, 4)

    def forward(self, ids):
        out, _ = self.gru(self.embed(ids))
        return self.head(torch.relu(out[:, -1]))


class CellLoop(nn.Module):
    """A cell unrolled over a fixed number of steps, its state starting at zeros."""

    def __init__(self, kind: type[nn.RNNCellBase]) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.cell = kind(5, 6)
        self.head = nn.Linear(6, 3)
        self.lstm = kind is nn.LSTMCell

    def forward(self, x):  # x: (B, 3, 4)
        h = x.new_zeros(x.size(0), 6)
        c = torch.zeros_like(h)
        for t in range(3):
            step = torch.tanh(self.inp(x[:, t]))
            if self.lstm:
                h, c = self.cell(step, (h, c))
            else:
                h = self.cell(step, h)
        return self.head(h)


class FunctionalNorms(nn.Module):
    """``F.layer_norm`` with a weight and bias of its own (or without), ``F.group_norm`` with several groups, ``F.linear``."""

    def __init__(self, affine: bool = True, groups: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.w = nn.Parameter(torch.ones(8)) if affine else None
        self.b = nn.Parameter(torch.zeros(8)) if affine else None
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gw, self.gb = nn.Parameter(torch.ones(8)), nn.Parameter(torch.zeros(8))
        self.weight = nn.Parameter(torch.randn(5, 8))
        self.bias = nn.Parameter(torch.zeros(5))
        self.out = nn.Linear(5 + 8, 3)
        self.groups = groups

    def forward(self, x):  # x: (B, 3, 4, 4)
        v = F.layer_norm(self.fc(x.mean((2, 3)).repeat(1, 2)), (8,), self.w, self.b)
        h = F.linear(torch.relu(v), self.weight, self.bias)
        m = F.group_norm(self.conv(x), self.groups, self.gw, self.gb)
        return self.out(torch.cat([torch.relu(h), torch.relu(m).mean((2, 3))], dim=1))


class GroupNormNet(nn.Module):
    """conv -> GroupNorm -> ReLU -> conv -> GroupNorm -> (global pool or flatten) -> Linear."""

    def __init__(self, groups: tuple[int, int] = (2, 4), flatten: bool = False) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.n1 = nn.GroupNorm(groups[0], 8)
        self.c2 = nn.Conv2d(8, 12, 3, padding=1)
        self.n2 = nn.GroupNorm(groups[1], 12)
        self.fc = nn.Linear(12 * (16 if flatten else 1), 3)
        self.flatten = flatten

    def forward(self, x):  # x: (B, 3, 4, 4)
        h = self.n2(self.c2(torch.relu(self.n1(self.c1(x)))))
        h = torch.relu(h)
        return self.fc(h.flatten(1) if self.flatten else h.mean((2, 3)))


class Constants(nn.Module):
    """Units combined with constants whose elements are all equal: zeros_like, ones_like, full_like, new_zeros,
    new_full, torch.zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7 + 2, 6)
        self.c = nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        h = h + torch.zeros_like(h)
        h = h * torch.ones_like(h)
        h = torch.maximum(h, torch.full_like(h, -0.5))
        h = torch.cat([h, h.new_zeros(h.size(0), 2)], dim=1)
        h = torch.relu(self.b(h)) + torch.zeros(1, 6)
        h = h - h.new_full((1, 6), 0.25)
        return self.c(h)


class Keywords(nn.Module):
    """Tensors passed by keyword to modules, Python functions and builtins (``torch.cat(tensors=...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.norm = nn.LayerNorm(6 + 5)
        self.out = nn.Linear(6 + 5, 3)

    def forward(self, x):
        h = F.relu(input=self.fc(input=x))
        h = torch.cat(tensors=[h, torch.tanh(input=x)], dim=1)
        return self.out(input=self.norm(input=h))


class ShapeBranch(nn.Module):
    """A forward that branches on the input's shape: torch.fx cannot trace it, torch.export exports it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        if x.shape[-1] == 5:
            x = x * 2
        return self.out(torch.tanh(self.fc(x)))


class DataBranch(nn.Module):
    """A forward that branches on the input's values: neither torch.fx nor torch.export follows it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class BakedConstants(nn.Module):
    """Constants torch.fx bakes into the graph (``torch.ones(1, 6)``): all-equal ones fix nothing (``uniform=True``);
    an ``arange`` differs per unit and fixes the units it meets."""

    def __init__(self, uniform: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 3)
        self.uniform = uniform

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = h * torch.ones(1, 6) if self.uniform else h * torch.arange(6.0)
        return self.b(h + torch.full((6,), 0.5))


class KeywordLayers(nn.Module):
    """Keyword calls of a convolution, a functional layer norm, a MultiheadAttention and a GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 1)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.gru = nn.GRU(6, 5, batch_first=True)
        self.w = nn.Parameter(torch.ones(6))
        self.head = nn.Linear(5, 3)

    def forward(self, x):  # x: (B, L, 4)
        h = self.conv(input=x.transpose(1, 2)).transpose(1, 2)
        h = F.layer_norm(input=h, normalized_shape=(6,), weight=self.w)
        h = h + self.attn(query=h, key=h, value=h, need_weights=False)[0]
        out, _ = self.gru(input=h)
        return self.head(input=out[:, -1])


class SequenceShapes(nn.Module):
    """Recurrent outputs in other shapes: an unbatched LSTM (``"unbatched"``), a GRU whose output is flattened over
    time (``"flatten"``), a bidirectional GRU whose directions are sliced apart (``"split"``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.rnn = (nn.LSTM if how == "unbatched" else nn.GRU)(5, 4, batch_first=True, bidirectional=how == "split")
        self.head = nn.Linear({"unbatched": 4, "flatten": 4 * 3, "split": 4}[how], 3)
        self.back = nn.Linear(4, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        if self.how == "flatten":
            return self.head(out.reshape(out.size(0), -1))
        if self.how == "split":
            return self.head(out[:, -1, :4]) + self.back(out[:, 0, 4:])
        return self.head(out[-1])


class NormShapes(nn.Module):
    """GroupNorm on a 3-d (B, C, L) and a 2-d (B, C) input; ``F.layer_norm`` over the last two axes; ``F.group_norm``
    without weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 1)
        self.gn1 = nn.GroupNorm(3, 6)
        self.fc = nn.Linear(6 * 4, 8)
        self.gn2 = nn.GroupNorm(2, 8)
        self.fc2 = nn.Linear(8, 4)
        self.out = nn.Linear(4 * 2, 3)

    def forward(self, x):  # x: (B, 3, 4)
        h = torch.relu(self.gn1(self.conv(x)))
        h = F.layer_norm(h, (6, 4))
        h = torch.relu(self.gn2(self.fc(h.flatten(1))))
        h = F.group_norm(self.fc2(h).unsqueeze(-1).expand(-1, -1, 2), 2)
        return self.out(torch.relu(h).flatten(1))


class HandAttention(nn.Module):
    """Attention written by hand: Q/K/V Linears, a reshape into heads, ``F.scaled_dot_product_attention``, the
    heads merged back, an output Linear; ``mask="per-head"`` adds a mask that differs per head (it fixes the heads)."""

    def __init__(self, mask: str = "none", heads: int = 2, scale: bool = False) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8)) if scale else None  # per head and head dim, viewed as (heads, 1, dims)
        self.embed = nn.Linear(5, 8)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.heads, self.mask = heads, mask
        self.register_buffer("bias", torch.randn(1, heads, 4, 4))

    def forward(self, x):  # x: (B, 4, 5)
        h = self.embed(x)
        b, t, e = h.shape
        split = lambda z: z.view(b, t, self.heads, e // self.heads).transpose(1, 2)  # noqa: E731
        mask = self.bias if self.mask == "per-head" else None
        q = split(self.q(h))
        if self.scale is not None:
            q = q * self.scale.view(self.heads, 1, e // self.heads)
        a = F.scaled_dot_product_attention(q, split(self.k(h)), split(self.v(h)), attn_mask=mask)
        h = h + self.o(a.transpose(1, 2).reshape(b, t, e))
        return self.head(h.mean(1))


class ChannelShuffle(nn.Module):
    """conv -> channel shuffle (view into groups, transpose, view back) -> conv: the shuffle splits the channels
    into (groups, channels per group) and the spec permutes both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 6, 1)
        self.b = nn.Conv2d(6, 4, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        n, c, hh, ww = h.shape
        h = h.view(n, 2, c // 2, hh, ww).transpose(1, 2).reshape(n, c, hh, ww)
        return self.fc(torch.relu(self.b(h)).mean((2, 3)))


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=3,
    )
    return randomize(BertForSequenceClassification(config), seed=3)


def tiny_llama(kv_heads: int = 1) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        intermediate_size=24,
        max_position_embeddings=16,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # random weights; the rotary frequencies are buffers and stay as they are
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def ids(batch: int = 2, length: int = 6, vocab: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------------------------
# The table: each derives a spec, checks what it must contain, and that random permutations change no output


@dataclass
class Cov:
    id: str
    sub: str  # recurrent, norms, constants, keywords, attention, export
    model: Callable[[], nn.Module]
    input: Callable[[], torch.Tensor]
    groups: int | None = None  # how many groups (None: not counted)
    has: list[tuple[str, int, int, int, int]] = field(default_factory=list)  # axes some group must have
    fixed: list[tuple[str, int, str]] = field(default_factory=list)  # (key, dim, words in the reason)
    atol: float = 1e-5


def seq(batch: int = 3, steps: int = 4, features: int = 5, *, batch_first: bool = True) -> Callable[[], torch.Tensor]:
    shape = (batch, steps, features) if batch_first else (steps, batch, features)
    return lambda: torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def image() -> torch.Tensor:
    return torch.randn(3, 3, 4, 4, generator=torch.Generator().manual_seed(2))


def vec(n: int = 5) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(4, n, generator=torch.Generator().manual_seed(3))


COV = [
    # recurrent: per layer and direction one group of hidden units across the gate blocks
    Cov(
        "gru",
        "recurrent",
        lambda: randomize(Recurrent(nn.GRU)),
        seq(),
        1,
        has=[
            ("rnn.weight_ih_l0", 0, 0, 3, 1),
            ("rnn.weight_hh_l0", 0, 0, 3, 1),
            ("rnn.weight_hh_l0", 1, 0, 1, 1),
            ("rnn.bias_ih_l0", 0, 0, 3, 1),
            ("rnn.bias_hh_l0", 0, 0, 3, 1),
            ("head.weight", 1, 0, 1, 1),
        ],
        fixed=[("rnn.weight_ih_l0", 1, "model input")],
    ),
    Cov(
        "lstm-2-layers",
        "recurrent",
        lambda: randomize(Recurrent(nn.LSTM, layers=2)),
        seq(),
        2,
        has=[("rnn.weight_ih_l0", 0, 0, 4, 1), ("rnn.weight_ih_l1", 1, 0, 1, 1), ("rnn.weight_hh_l1", 0, 0, 4, 1)],
    ),
    Cov(
        "rnn-tanh-time-first",
        "recurrent",
        lambda: randomize(Recurrent(nn.RNN, batch_first=False, layers=2)),
        seq(batch_first=False),
        2,
        has=[("rnn.weight_hh_l1", 1, 0, 1, 1)],
    ),
    Cov("rnn-relu", "recurrent", lambda: randomize(Recurrent(nn.RNN, nonlinearity="relu")), seq(), 1),
    # bidirectional: a segment of the next layer's (or the head's) input columns per direction
    Cov(
        "lstm-bidirectional",
        "recurrent",
        lambda: randomize(Recurrent(nn.LSTM, layers=2, bidirectional=True, head="mean")),
        seq(),
        4,
        has=[
            ("rnn.weight_ih_l1", 1, 0, 1, 1),
            ("rnn.weight_ih_l1", 1, 6, 1, 1),
            ("rnn.weight_ih_l1_reverse", 1, 6, 1, 1),
            ("head.weight", 1, 6, 1, 1),
        ],
    ),
    Cov("gru-bidirectional-no-bias", "recurrent", lambda: randomize(Recurrent(nn.GRU, bidirectional=True, bias=False)), seq(), 2),
    # the final state read: every layer's (and direction's) units share one order
    Cov(
        "rnn-final-state",
        "recurrent",
        lambda: randomize(Recurrent(nn.RNN, layers=3, head="state")),
        seq(),
        1,
        has=[("rnn.weight_hh_l0", 1, 0, 1, 1), ("rnn.weight_hh_l2", 1, 0, 1, 1), ("head.weight", 1, 0, 1, 1)],
    ),
    Cov(
        "lstm-final-state-bidirectional",
        "recurrent",
        lambda: randomize(Recurrent(nn.LSTM, layers=2, bidirectional=True, head="state")),
        seq(),
        1,
    ),
    # proj_size: the cell units and the projected units are two groups per layer
    Cov(
        "lstm-proj-size",
        "recurrent",
        lambda: randomize(Recurrent(nn.LSTM, layers=2, hidden=7, proj_size=4)),
        seq(),
        4,
        has=[
            ("rnn.weight_hr_l0", 1, 0, 1, 1),
            ("rnn.weight_hr_l0", 0, 0, 1, 1),
            ("rnn.weight_hh_l0", 1, 0, 1, 1),
            ("rnn.weight_ih_l1", 1, 0, 1, 1),
        ],
    ),
    # initial states: zeros built from the input fix nothing; a learned one is permuted with the units it feeds
    Cov("gru-zero-state", "recurrent", lambda: randomize(Recurrent(nn.GRU, layers=2, state="zeros")), seq(), 2),
    Cov("lstm-zero-state", "recurrent", lambda: randomize(Recurrent(nn.LSTM, state="zeros")), seq(), 1),
    Cov(
        "gru-learned-state",
        "recurrent",
        lambda: randomize(Recurrent(nn.GRU, layers=2, state="learned")),
        seq(),
        1,
        has=[("h0", 2, 0, 1, 1), ("rnn.weight_hh_l1", 1, 0, 1, 1)],
    ),
    Cov(
        "gru-subclass-same-forward",
        "recurrent",
        lambda: randomize(Subclassed(PlainGRU)),
        seq(),
        2,
        has=[("rnn.weight_hh_l0", 0, 0, 3, 1), ("rnn.weight_ih_l0", 1, 0, 1, 1)],
    ),
    Cov(
        "gru-subclass-own-forward",
        "recurrent",
        lambda: randomize(Subclassed(ClippedGRU)),
        seq(),
        0,
        fixed=[
            ("inp.weight", 0, "(ClippedGRU) is not modelled (a GRU with its own methods"),
            ("rnn.weight_hh_l0", 1, "is not modelled"),
            ("rnn.weight_ih_l0", 0, "is not modelled"),
            ("rnn.bias_hh_l0", 0, "is not modelled"),
        ],
    ),
    Cov(
        "embedding-gru",
        "recurrent",
        lambda: randomize(Embedded()),
        lambda: ids(3, 5, 20),
        3,
        has=[("embed.weight", 1, 0, 1, 1), ("gru.weight_ih_l0", 1, 0, 1, 1)],
    ),
    Cov(
        "gru-cell-loop",
        "recurrent",
        lambda: randomize(CellLoop(nn.GRUCell)),
        lambda: torch.randn(2, 3, 4),
        2,
        has=[("cell.weight_ih", 0, 0, 3, 1), ("cell.weight_hh", 1, 0, 1, 1), ("head.weight", 1, 0, 1, 1)],
    ),
    Cov("lstm-cell-loop", "recurrent", lambda: randomize(CellLoop(nn.LSTMCell)), lambda: torch.randn(2, 3, 4), 2),
    Cov("rnn-cell-loop", "recurrent", lambda: randomize(CellLoop(nn.RNNCell)), lambda: torch.randn(2, 3, 4), 2),
    Cov("lstm-unbatched", "recurrent", lambda: randomize(SequenceShapes("unbatched")), lambda: torch.randn(3, 5), 1),
    Cov(
        "gru-flattened-over-time",
        "recurrent",
        lambda: randomize(SequenceShapes("flatten")),
        seq(2, 3),
        1,
        has=[("head.weight", 1, 0, 3, 1)],
    ),
    Cov(
        "bigru-directions-sliced",
        "recurrent",
        lambda: randomize(SequenceShapes("split")),
        seq(),
        2,
        has=[("head.weight", 1, 0, 1, 1), ("back.weight", 1, 0, 1, 1), ("rnn.weight_hh_l0_reverse", 1, 0, 1, 1)],
    ),
    # norms: functional layer_norm / group_norm / linear; GroupNorm with several groups splits into blocks
    Cov(
        "functional-norms",
        "norms",
        lambda: randomize(FunctionalNorms()),
        image,
        1 + 1 + 2,
        has=[
            ("w", 0, 0, 1, 1),
            ("b", 0, 0, 1, 1),
            ("weight", 1, 0, 1, 1),
            ("weight", 0, 0, 1, 1),
            ("bias", 0, 0, 1, 1),
            ("gw", 0, 0, 1, 1),
            ("gw", 0, 4, 1, 1),
            ("conv.weight", 0, 4, 1, 1),
        ],
    ),
    Cov("functional-layer-norm-no-affine", "norms", lambda: randomize(FunctionalNorms(affine=False, groups=1)), image, 3),
    Cov("functional-group-norm-per-channel", "norms", lambda: randomize(FunctionalNorms(groups=8)), image, 3),
    Cov(
        "group-norm-blocks",
        "norms",
        lambda: randomize(GroupNormNet((2, 4))),
        image,
        2 + 4,
        has=[
            ("c1.weight", 0, 0, 1, 1),
            ("c1.weight", 0, 4, 1, 1),
            ("n1.weight", 0, 4, 1, 1),
            ("c2.weight", 1, 4, 1, 1),
            ("n2.bias", 0, 9, 1, 1),
            ("fc.weight", 1, 9, 1, 1),
        ],
    ),
    Cov(
        "group-norm-blocks-flatten",
        "norms",
        lambda: randomize(GroupNormNet((4, 3), flatten=True)),
        image,
        4 + 3,
        has=[("fc.weight", 1, 4 * 16, 1, 16), ("n2.weight", 0, 8, 1, 1)],
    ),
    Cov("group-norm-one-and-all", "norms", lambda: randomize(GroupNormNet((1, 12))), image, 2),
    Cov(
        "norm-shapes",
        "norms",
        lambda: randomize(NormShapes()),
        lambda: torch.randn(3, 3, 4),
        3 + 2 + 2,
        has=[("gn1.weight", 0, 4, 1, 1), ("fc.weight", 1, 4 * 4, 1, 4), ("gn2.bias", 0, 4, 1, 1), ("out.weight", 1, 2 * 2, 1, 2)],
    ),
    # constants whose elements are all equal fix no group
    Cov(
        "uniform-constants",
        "constants",
        lambda: randomize(Constants()),
        vec(),
        2,
        has=[("a.weight", 0, 0, 1, 1), ("b.weight", 1, 0, 1, 1), ("c.weight", 1, 0, 1, 1)],
    ),
    Cov("baked-uniform-constants", "constants", lambda: randomize(BakedConstants()), vec(), 1, has=[("a.weight", 0, 0, 1, 1)]),
    Cov(
        "baked-arange-fixes",
        "constants",
        lambda: randomize(BakedConstants(uniform=False)),
        vec(),
        0,
        fixed=[("a.weight", 0, "_tensor_constant0 is not in the state dict")],
    ),  # a constant of the graph, not a weight
    Cov(
        "zero-state-lstm-cell",
        "constants",
        lambda: randomize(CellLoop(nn.LSTMCell)),
        lambda: torch.randn(4, 3, 4),
        2,
        has=[("cell.weight_hh", 1, 0, 1, 1)],
    ),
    # a tensor by keyword traces
    Cov(
        "keyword-layers",
        "keywords",
        lambda: randomize(KeywordLayers()),
        lambda: torch.randn(2, 3, 4),
        1 + 3 + 1,
        has=[
            ("conv.weight", 0, 0, 1, 1),
            ("w", 0, 0, 1, 1),
            ("attn.in_proj_weight", 1, 0, 1, 1),
            ("gru.weight_ih_l0", 1, 0, 1, 1),
            ("head.weight", 1, 0, 1, 1),
        ],
    ),
    Cov(
        "keyword-tensors",
        "keywords",
        lambda: randomize(Keywords()),
        vec(),
        1,
        has=[("fc.weight", 0, 0, 1, 1), ("norm.weight", 0, 0, 1, 1), ("out.weight", 1, 0, 1, 1)],
    ),
    # attention written with a reshape into heads and scaled_dot_product_attention: heads, Q/K dims, V/out dims
    Cov(
        "hand-written-attention",
        "attention",
        lambda: randomize(HandAttention()),
        seq(3, 4, 5),
        1 + 3,
        has=[
            ("q.weight", 0, 0, 1, 4),
            ("k.weight", 0, 0, 2, 1),
            ("v.weight", 0, 0, 2, 1),
            ("o.weight", 1, 0, 1, 4),
            ("o.weight", 1, 0, 2, 1),
        ],
    ),
    Cov(
        "hand-written-attention-4-heads",
        "attention",
        lambda: randomize(HandAttention(heads=4)),
        seq(3, 4, 5),
        1 + 3,
        has=[("q.weight", 0, 0, 1, 2), ("o.weight", 1, 0, 4, 1)],
    ),
    Cov(
        "attention-scale-per-head-dim",
        "attention",
        lambda: randomize(HandAttention(scale=True)),
        seq(3, 4, 5),
        1 + 3,
        has=[("scale", 0, 0, 1, 4), ("scale", 0, 0, 2, 1)],
    ),
    Cov(
        "attention-mask-per-head",
        "attention",
        lambda: randomize(HandAttention(mask="per-head")),
        seq(3, 4, 5),
        1 + 2,
        fixed=[("q.weight", 0, "a mask per head")],
    ),
    Cov(
        "channel-shuffle",
        "attention",
        lambda: randomize(ChannelShuffle()),
        image,
        2 + 1,
        has=[("a.weight", 0, 0, 1, 3), ("a.weight", 0, 0, 2, 1), ("b.weight", 1, 0, 3, 1), ("b.weight", 1, 0, 1, 2)],
    ),
    # torch.export: what torch.fx cannot trace
    Cov(
        "export-shape-branch",
        "export",
        lambda: randomize(ShapeBranch()),
        vec(),
        1,
        has=[("fc.weight", 0, 0, 1, 1), ("out.weight", 1, 0, 1, 1)],
        fixed=[("out.weight", 0, "model output")],
    ),
    Cov(
        "export-bert",
        "export",
        tiny_bert,
        ids,
        1 + 2 * (3 + 1) + 1,
        has=[
            ("bert.embeddings.word_embeddings.weight", 1, 0, 1, 1),
            ("bert.embeddings.LayerNorm.weight", 0, 0, 1, 1),
            ("bert.encoder.layer.0.intermediate.dense.weight", 0, 0, 1, 1),
            ("bert.encoder.layer.1.output.dense.weight", 1, 0, 1, 1),
            ("bert.pooler.dense.weight", 0, 0, 1, 1),
            ("classifier.weight", 1, 0, 1, 1),
        ],
        fixed=[("classifier.weight", 0, "model output")],
        atol=1e-4,
    ),
    Cov(
        "export-llama",
        "export",
        tiny_llama,
        ids,
        None,
        has=[
            ("model.embed_tokens.weight", 1, 0, 1, 1),
            ("model.layers.0.input_layernorm.weight", 0, 0, 1, 1),
            ("model.layers.1.mlp.gate_proj.weight", 0, 0, 1, 1),
            ("model.layers.1.mlp.up_proj.weight", 0, 0, 1, 1),
            ("model.layers.1.mlp.down_proj.weight", 1, 0, 1, 1),
            ("model.norm.weight", 0, 0, 1, 1),
            ("lm_head.weight", 1, 0, 1, 1),
        ],
        fixed=[("lm_head.weight", 0, "model output"), ("model.layers.0.self_attn.q_proj.weight", 0, "shared key/value heads")],
        atol=1e-4,
    ),
    # without grouped-query attention the heads are a group (RoPE, which rotates pairs of head dims, fixes those)
    Cov(
        "export-llama-mha",
        "export",
        lambda: tiny_llama(kv_heads=2),
        ids,
        None,
        has=[
            ("model.layers.0.self_attn.q_proj.weight", 0, 0, 1, 8),
            ("model.layers.0.self_attn.k_proj.weight", 0, 0, 1, 8),
            ("model.layers.0.self_attn.v_proj.weight", 0, 0, 2, 1),
            ("model.layers.0.self_attn.o_proj.weight", 1, 0, 1, 8),
        ],
        atol=1e-4,
    ),
]


@pytest.mark.parametrize("case", COV, ids=[f"{c.sub}-{c.id}" for c in COV])
def test_the_derived_spec_covers_the_model_and_permutations_leave_its_outputs_unchanged(case: Cov):
    torch.manual_seed(0)
    model = case.model()
    x = case.input()
    spec = derive_spec(model, x)
    assert spec.groups or case.groups == 0, spec.describe()
    if case.groups is not None:
        assert len(spec.groups) == case.groups, spec.describe()
    missing = [a for a in case.has if a not in axes(spec)]
    assert not missing, f"{missing}\n{spec.describe()}"
    fixed: dict[tuple[str, int], str] = {}
    for f in spec.fixed:  # one axis may be fixed for several reasons (segments of it)
        fixed[(f.key, f.dim)] = fixed.get((f.key, f.dim), "") + f.reason + "; "
    for key, dim, words in case.fixed:
        assert words in fixed.get((key, dim), ""), (key, dim, fixed.get((key, dim)))
    # every parameter of a modelled recurrent layer is in a group or fixed: never silently neither
    for name, module in model.named_modules():
        if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
            for key, _ in module.named_parameters():
                full = f"{name}.{key}"
                covered = {a.dim for g in spec.groups for a in g.axes if a.key == full} | {f.dim for f in spec.fixed if f.key == full}
                assert 0 in covered, (full, spec.describe())
    if spec.groups:
        assert_invariant(model, x, spec, atol=case.atol)
    assert PermutationSpec.from_dict(spec.to_dict()) == spec


# ---------------------------------------------------------------------------------------------------------------
# Details the table does not show


def test_a_group_norm_with_several_groups_splits_its_units_into_one_group_per_norm_group():
    spec = derive_spec(randomize(GroupNormNet((2, 4))), image())
    names = sorted(spec.names)
    assert names == ["c1.block0", "c1.block1", "c2.block0", "c2.block1", "c2.block2", "c2.block3"]
    block = spec.group("c2.block2")
    assert block.size == 3 and {(a.key, a.dim, a.start) for a in block.axes} >= {
        ("c2.weight", 0, 6),
        ("n2.weight", 0, 6),
        ("fc.weight", 1, 6),
    }
    # a permutation across two norm groups would change the output: the split is needed, not just allowed
    model = randomize(GroupNormNet((2, 4)))
    x = image()
    whole = PermutationSpec((PermGroup("c1", 8, tuple(AxisRef(a.key, a.dim) for a in spec.group("c1.block0").axes)),))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(whole.apply_torch(state, {"c1": np.array([4, 1, 2, 3, 0, 5, 6, 7])}))
        assert not torch.allclose(model(x), before, atol=1e-4)


def test_norm_groups_a_unit_straddles_are_fixed_with_the_reason():
    class Straddle(nn.Module):  # a 6-channel conv concatenated after 2 input channels: its units straddle groups of 4
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 1)
            self.norm = nn.GroupNorm(2, 8)
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            h = torch.cat([x[:, :2], self.conv(x)], dim=1)
            return self.fc(self.norm(h).mean((2, 3)))

    model = randomize(Straddle())
    spec = derive_spec(model, image())
    fixed = {(f.key, f.dim): f.reason for f in spec.fixed}
    assert "norm normalises groups of 4 channels that these units straddle" in fixed[("conv.weight", 0)]
    assert not group_of(spec, "conv.weight", 0)


def test_recurrent_weights_are_grouped_by_gate_blocks_and_a_wrong_block_view_would_break_the_model():
    model = randomize(Recurrent(nn.LSTM))
    x = seq()()
    spec = derive_spec(model, x)
    g = spec.groups[0]
    assert g.kind == "hidden" and g.size == 6
    # the same permutation on weight_ih's 24 rows as a plain axis (not per gate) changes the output
    state = {k: v.clone() for k, v in model.state_dict().items()}
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    wrong = dict(state, **{"rnn.weight_ih_l0": state["rnn.weight_ih_l0"][perm]})
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(wrong)
        assert not torch.allclose(model(x), before, atol=1e-4)
    model.load_state_dict(state)


def test_a_non_constant_initial_state_that_is_not_permuted_fixes_the_hidden_units():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(5, 6, batch_first=True)
            self.fc = nn.Linear(6, 2)

        def forward(self, x):
            h0 = torch.cumsum(torch.ones(1, x.size(0), 6), dim=2)  # differs per unit, not read from any weight
            out, _ = self.rnn(x, h0)
            return self.fc(out[:, -1])

    model = randomize(Noisy())
    spec = derive_spec(model, seq()())
    fixed = {(f.key, f.dim): f.reason for f in spec.fixed}
    assert "initial state is not permuted with its hidden units" in fixed[("rnn.weight_hh_l0", 1)]
    assert not spec.groups


def test_a_keyword_call_reads_like_a_positional_one_for_the_structure_readers_too():
    model = randomize(Keywords())
    gm = trace_model(model)
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert all(n.args and not n.kwargs for n in calls)
    structure = read_structure(model, vec()())
    assert structure.output_layer.module == "out" and [layer.module for layer in structure.hidden] == ["fc"]
    assert structure.features_node == "norm" and structure.output_layer.in_group == "fc"
    torch.testing.assert_close(gm(vec()()), model(vec()()))


def test_a_model_neither_fx_nor_export_follows_is_one_line_naming_both():
    with pytest.raises(InputError) as info:
        derive_spec(DataBranch(), vec()())
    message = str(info.value)
    assert message.startswith("architecture: expected a model torch.fx can trace or torch.export can export")
    assert "torch.fx:" in message and "torch.export:" in message and "\n" not in message


def test_what_is_not_a_module_is_refused_before_any_export():
    with pytest.raises(InputError, match=r"^architecture: expected a torch.nn.Module, got 'function'$"):
        derive_spec(lambda x: x, vec()())


def test_an_exported_bert_has_the_groups_of_multi_head_attention_and_no_probes():
    model = tiny_bert()
    spec = derive_spec(model, ids())
    assert all(not g.probes for g in spec.groups)  # probes name nodes of trace_model's graph; an exported graph has none
    at = "bert.encoder.layer.1.attention"
    heads = spec.group(f"{at}.self.query.heads")
    assert heads.kind == "heads" and heads.size == 2
    assert {(a.key, a.dim, a.start, a.outer, a.inner) for a in heads.axes} == {
        *((f"{at}.self.{p}.{w}", 0, 0, 1, 8) for p in ("query", "key", "value") for w in ("weight", "bias")),
        (f"{at}.output.dense.weight", 1, 0, 1, 8),
    }
    qk, vo = spec.group(f"{at}.self.query.head_dims"), spec.group(f"{at}.self.value.head_dims")
    assert {a.key for a in qk.axes} == {f"{at}.self.{p}.{w}" for p in ("query", "key") for w in ("weight", "bias")}
    assert (f"{at}.output.dense.weight", 1, 0, 2, 1) in {(a.key, a.dim, a.start, a.outer, a.inner) for a in vo.axes}
    # the residual stream is one group from the embeddings to the pooler
    stream = group_of(spec, "bert.embeddings.word_embeddings.weight", 1)
    assert stream == group_of(spec, "bert.encoder.layer.1.output.LayerNorm.weight", 0) == group_of(spec, "bert.pooler.dense.weight", 1)
    assert len(stream) == 1


MODULE = """
import torch
from torch import nn

class GRUNet(nn.Module):
    def __init__(self, hidden=6):
        super().__init__()
        self.rnn = nn.GRU(5, hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(hidden, 10)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])

class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.out = nn.Linear(6, 10)

    def forward(self, x):
        if x.shape[-1] == 5:
            x = x * 2
        return self.out(torch.relu(self.fc(x)))

class DataBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 10)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)
"""


def test_the_symmetry_command_on_recurrent_and_exported_models(capsys, tmp_path, monkeypatch):
    from rayfuse.cli import main

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "covnets.py").write_text(MODULE)
    assert main(["symmetry", "covnets:GRUNet", "--input-shape", "4,5", "--args", '{"hidden": 7}']) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 permutation groups, 14 units") and "rnn.weight_ih_l1[0] outer=3" in out
    assert main(["symmetry", "covnets:ShapeBranch", "--input-shape", "5"]) == 0  # torch.fx cannot trace it; exported
    assert capsys.readouterr().out.startswith("1 permutation groups, 6 units")
    assert main(["symmetry", "covnets:DataBranch", "--input-shape", "5"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("rayfuse: error: architecture: expected a model torch.fx can trace or torch.export can export")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err and not captured.out


# ---------------------------------------------------------------------------------------------------------------
# Bad input on these surfaces: exit 2, one line naming the key, no traceback, nothing written

BAD_MODULE = (
    MODULE
    + """
class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.gru = nn.GRU(6, 4, batch_first=True)
        self.fc = nn.Linear(4, 10)

    def forward(self, ids):
        out, _ = self.gru(self.embed(ids))
        return self.fc(out[:, -1])
"""
)


@dataclass(frozen=True)
class Bad:
    id: str
    argv: list[str]
    names: str  # what the one line must start with, after "rayfuse: error: "


BAD = [
    Bad(
        "untraceable-and-unexportable",
        ["symmetry", "badnets:DataBranch", "--input-shape", "5"],
        "architecture: expected a model torch.fx can trace or torch.export can export",
    ),
    Bad("gru-wrong-feature-count", ["symmetry", "badnets:GRUNet", "--input-shape", "4,6"], "input: expected an example batch"),
    Bad("exported-model-wrong-width", ["symmetry", "badnets:ShapeBranch", "--input-shape", "6"], "input: expected an example batch"),
    Bad("token-model-given-floats", ["symmetry", "badnets:Tokens", "--input-shape", "5"], "input: expected an example batch"),
    Bad(
        "gru-bad-hidden-arg",
        ["symmetry", "badnets:GRUNet", "--input-shape", "4,5", "--args", '{"hidden": "six"}'],
        "--args: expected keyword arguments",  # the command's own flag
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_bad_input_on_the_symmetry_surfaces_is_one_line_and_leaves_nothing(bad: Bad, tmp_path, monkeypatch, capsys):
    from rayfuse.cli import main
    from tests.config.test_bad_inputs import _snapshot

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "badnets.py").write_text(BAD_MODULE)
    monkeypatch.syspath_prepend(str(modules))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _snapshot(work)
    capsys.readouterr()
    assert main(bad.argv) == 2
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and "Traceback" not in out + err and not out, err
    assert err.startswith(f"rayfuse: error: {bad.names}"), err
    assert _snapshot(work) == before
