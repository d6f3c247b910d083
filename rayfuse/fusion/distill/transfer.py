"""Transfer inputs of a distillation: augmented public samples, and a generator for data-free distillation.

**Public transfer** (FedDF [FEDDF]): each pass draws a *bank* of inputs from the server's unlabeled sample: each a
random sample shifted by up to ``shift`` pixels (images) or steps (sequences ``(L, D)``; zero padding), and a fraction
``mixup`` of them mixed with a second sample, ``x = lam x_i + (1 - lam) x_j`` with ``lam ~ U(0, 1)``; optionally
scaled (``scale``) and noised (``noise``), the augmentations of a 1-D signal or a table's row. The teachers are evaluated on the mixed input
itself (the target is the ensemble's output there, not a mix of labels), which is what lets 300 samples cover the
space between the classes.

**Synthetic transfer** (DENSE [DENSE]): :class:`Generator` maps ``z ~ N(0, I)`` to an input. Its last layer is a
BatchNorm without affine parameters followed by a fixed per-element affine map to the clients' pooled input mean and
standard deviation when the clients report their input moments (counts, sums and sums of squares: the same statistics
a silo run standardises with), so generated inputs have the data's first two moments per pixel or feature; without
them, the outputs are standardised (mean 0, variance 1 per element). :class:`SyntheticBank` keeps past batches with
the teachers' logits on them (the teachers are fixed, so their outputs on a stored input never change), DENSE's data
pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["augment_bank", "drop_tokens", "shift_images", "shift_sequences", "Generator", "SyntheticBank", "pooled_moments"]


def shift_images(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Each image ``(N, C, H, W)`` moved by ``(dy, dx)`` drawn uniformly from ``[-max_shift, max_shift]^2`` (zero padded);
    other shapes are returned unchanged."""
    if x.dim() != 4 or max_shift <= 0:
        return x
    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (max_shift,) * 4)
    dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device)[None])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device)[None])[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def shift_sequences(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Each sequence ``(N, L, D)`` (rayfuse's sequence layout: ``L`` steps of ``D`` features) moved along its steps by
    ``d`` drawn uniformly from ``[-max_shift, max_shift]`` (zero padded); other shapes are returned unchanged."""
    if x.dim() != 3 or max_shift <= 0:
        return x
    n, length, _ = x.shape
    padded = torch.nn.functional.pad(x, (0, 0, max_shift, max_shift))
    d = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(x.device)
    steps = (d[:, None] + torch.arange(length, device=x.device)[None])[:, :, None].expand(-1, -1, x.shape[2])
    return padded.gather(1, steps)


def _moved(X: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    return shift_sequences(X, shift, generator) if X.dim() == 3 else shift_images(X, shift, generator)


def augment_bank(
    X: torch.Tensor,
    size: int,
    *,
    shift: int,
    mixup: float,
    generator: torch.Generator,
    scale: float = 0.0,
    noise: float = 0.0,
) -> torch.Tensor:
    """``size`` transfer inputs drawn from ``X`` ``(N, *input_shape)``: shifted (images by up to ``shift`` pixels each
    way, sequences ``(N, L, D)`` by up to ``shift`` steps), and, for a fraction ``mixup`` of them, mixed with a second
    shifted sample at a uniform ratio; then each scaled by a factor drawn from ``U(1 - scale, 1 + scale)`` and given
    Gaussian noise of ``noise`` times each input element's standard deviation over ``X`` (the amplitude and noise of a
    1-D signal or a table's row; ``0``: neither, and no draw is made)."""
    n = X.shape[0]
    first = _moved(X[torch.randint(0, n, (size,), generator=generator).to(X.device)], shift, generator)
    if mixup > 0:
        second = _moved(X[torch.randint(0, n, (size,), generator=generator).to(X.device)], shift, generator)
        lam = torch.rand(size, generator=generator).to(X.device)
        lam = torch.where(torch.rand(size, generator=generator).to(X.device) < mixup, lam, torch.ones_like(lam))
        lam = lam.view(-1, *[1] * (X.dim() - 1)).to(X.dtype)
        first = lam * first + (1 - lam) * second
    if scale > 0:
        factor = 1 + scale * (2 * torch.rand(size, generator=generator) - 1)
        first = first * factor.to(X.device, X.dtype).view(-1, *[1] * (X.dim() - 1))
    if noise > 0:
        std = X.std(0, keepdim=True) if n > 1 else torch.ones_like(X[:1])
        first = first + noise * std * torch.randn(first.shape, generator=generator).to(X.device, X.dtype)
    return first


def drop_tokens(X: torch.Tensor, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Word dropout on token-id rows ``(N, L)`` (``-1``: padding, :mod:`rayfuse.data.text`): each real token but a
    row's first and last (the class and separator tokens) dropped with probability ``rate``, the kept ones closed up in order and
    the row padded again; the text analogue of an image's shift (a nearby input the teachers label afresh)."""
    if rate <= 0:
        return X
    real = X >= 0
    pos = torch.arange(X.shape[1], device=X.device).expand_as(X)
    last = real.sum(1, keepdim=True) - 1
    drop = (torch.rand(X.shape, generator=generator).to(X.device) < rate) & real & (pos > 0) & (pos < last)
    keep = real & ~drop
    order = torch.argsort((~keep).long() * X.shape[1] + pos, dim=1)  # kept tokens first, each group in order
    return torch.where(keep.gather(1, order), X.gather(1, order), torch.full_like(X, -1.0))


def mix_texts(X: torch.Tensor, pool: torch.Tensor, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Mixup for token-id rows ``(N, L)`` (MixKD's, in embedding space: two texts' ids cannot be averaged): a share
    ``rate`` of the rows paired with a text drawn from ``pool`` ``(M, L)`` and a ratio ``U(0, 1)``; returns ``(N, 3, L)``
    rows of the first text's ids, the second's and the ratio (a row not mixed: its text twice, ratio 1), which a
    Hugging Face classifier of rayfuse (:mod:`rayfuse.models.hf`) reads as the ratio's mix of the two texts' word
    embeddings, attending where either has a token. ``0``: ``X`` unchanged, and no draw is made."""
    if rate <= 0:
        return X
    n = X.shape[0]
    second = pool[torch.randint(0, pool.shape[0], (n,), generator=generator).to(X.device)]
    lam = torch.rand(n, generator=generator).to(X.device)
    mixed = torch.rand(n, generator=generator).to(X.device) < rate
    second = torch.where(mixed[:, None], second, X)
    lam = torch.where(mixed, lam, torch.ones_like(lam)).to(X.dtype)
    return torch.stack([X, second, lam[:, None].expand_as(X)], dim=1)


def pooled_moments(moments: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The pooled per-element mean and population standard deviation (float32, shaped like one input) of the clients'
    ``(count, sum, sum of squares)``: what generated inputs take. Unlike a standardisation scale, a constant element
    keeps its standard deviation of 0 (an image's always-blank border stays blank)."""
    count = float(sum(int(c) for c, _, _ in moments))
    if count <= 0:
        raise ValueError("input moments: no samples")
    mean = np.sum([np.asarray(s, np.float64) for _, s, _ in moments], axis=0) / count
    var = np.maximum(np.sum([np.asarray(q, np.float64) for _, _, q in moments], axis=0) / count - mean**2, 0.0)
    return mean.astype(np.float32), np.sqrt(var).astype(np.float32)


class Generator(nn.Module):
    """DENSE's generator, sized for any input shape.

    Images ``(C, H, W)``: ``z -> Linear -> (2 width, ceil(H/4), ceil(W/4))``, two nearest-neighbour upsamplings each
    followed by a 3x3 convolution, BatchNorm and LeakyReLU(0.2), a 3x3 convolution to ``C`` channels, cropped to
    ``(H, W)`` (DENSE's generator is this at ``width`` 64). Vectors: ``z -> 8 width -> 8 width -> D`` with BatchNorm
    and LeakyReLU. Both end in BatchNorm without affine
    parameters, then ``x = x_hat * scale + mean`` per element (``moments``: the data's mean and standard deviation,
    shaped like one input). Without moments the last BatchNorm learns its affine parameters instead.
    """

    def __init__(
        self, input_shape: Sequence[int], latent_dim: int = 256, width: int = 32, moments: tuple[np.ndarray, np.ndarray] | None = None
    ) -> None:
        super().__init__()
        self.input_shape = tuple(int(d) for d in input_shape)
        self.latent_dim = int(latent_dim)
        self.image = len(self.input_shape) == 3
        if self.image:
            c, h, w = self.input_shape
            self.start = (max(1, math.ceil(h / 4)), max(1, math.ceil(w / 4)))
            self.width = int(width)
            self.project = nn.Linear(self.latent_dim, 2 * self.width * self.start[0] * self.start[1])
            self.body = nn.Sequential(
                nn.BatchNorm2d(2 * self.width),
                nn.Upsample(scale_factor=2),
                nn.Conv2d(2 * self.width, 2 * self.width, 3, padding=1, bias=False),
                nn.BatchNorm2d(2 * self.width),
                nn.LeakyReLU(0.2),
                nn.Upsample(scale_factor=2),
                nn.Conv2d(2 * self.width, self.width, 3, padding=1, bias=False),
                nn.BatchNorm2d(self.width),
                nn.LeakyReLU(0.2),
                nn.Conv2d(self.width, c, 3, padding=1),
                nn.BatchNorm2d(c, affine=False),
            )
        else:
            d, hidden = int(np.prod(self.input_shape)), 8 * int(width)
            self.project = nn.Linear(self.latent_dim, hidden)
            self.body = nn.Sequential(
                nn.BatchNorm1d(hidden),
                nn.LeakyReLU(0.2),
                nn.Linear(hidden, hidden),
                nn.BatchNorm1d(hidden),
                nn.LeakyReLU(0.2),
                nn.Linear(hidden, d),
                nn.BatchNorm1d(d, affine=False),
            )
        mean, scale = (np.zeros(self.input_shape, np.float32), np.ones(self.input_shape, np.float32)) if moments is None else moments
        if moments is None:  # no statistics of the data: the output's per-channel scale and shift are learnt
            last = self.body[-1]
            assert isinstance(last, (nn.BatchNorm1d, nn.BatchNorm2d))
            self.body[-1] = type(last)(last.num_features, affine=True)
        self.register_buffer("mean", torch.as_tensor(np.asarray(mean, np.float32).reshape(self.input_shape)))
        self.register_buffer("scale", torch.as_tensor(np.asarray(scale, np.float32).reshape(self.input_shape)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.project(z)
        if self.image:
            h = h.view(z.shape[0], 2 * self.width, *self.start)
            out = self.body(h)[:, :, : self.input_shape[1], : self.input_shape[2]]
        else:
            out = self.body(h).view(z.shape[0], *self.input_shape)
        return out * self.scale + self.mean


class SyntheticBank:
    """Past synthetic batches with the teachers' logits on them and the labels they were generated for (first in,
    first out beyond ``max_samples``)."""

    def __init__(self, max_samples: int) -> None:
        self.max_samples = int(max_samples)
        self._x: list[torch.Tensor] = []
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, x: torch.Tensor, member_logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Keep a batch: inputs ``(B, ...)``, the teachers' logits ``(K, B, C)``, the sampled labels ``(B,)``."""
        self._x.append(x.detach())
        self._logits.append(member_logits.detach())
        self._labels.append(labels.detach())
        self._size += x.shape[0]
        while self._size > self.max_samples and len(self._x) > 1:
            self._size -= self._x.pop(0).shape[0]
            self._logits.pop(0)
            self._labels.pop(0)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs ``(N, ...)``, the teachers' logits ``(K, N, C)`` and the labels ``(N,)`` of every kept batch."""
        return torch.cat(self._x), torch.cat(self._logits, dim=1), torch.cat(self._labels)
