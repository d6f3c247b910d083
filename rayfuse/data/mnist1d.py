"""``mnist1d``: MNIST-1D [MNIST1D], generated here (no download): ten 1-D digit templates of 12 points, each sample
one template padded, stretched, scaled, moved, noised and sheared, then resampled to 40 points.

The recipe, per sample (the reference's defaults, ``rayfuse``'s own code, one seeded ``numpy`` generator):

1. the template (centred, unit variance, shifted to start at 0, divided by 6) padded with ``p`` zeros at its end,
   ``p`` uniform in 36..60, then linearly resampled to 72 points (12 + 60);
2. scaled by ``1 + 0.4 (u - 0.5)``, ``u ~ U(0, 1)``;
3. rolled right by ``k`` positions, ``k`` uniform in 0..47;
4. where the signal is exactly zero (the padding), replaced by correlated noise (``N(0, 0.25^2)`` smoothed by a
   Gaussian filter of width 2); everywhere, ``N(0, 0.02^2)`` noise added;
5. sheared: minus ``0.75 (u - 0.5)`` times a ramp from -0.5 to 0.5;
6. linearly resampled to 40 points.

The whole set is then standardised by its global mean and standard deviation (one scalar each, as the reference
does), and ``test_fraction`` of it (after a shuffle) is the dataset's own test split. Samples are ``(40, 1)``: a
sequence of 40 steps of one feature (rayfuse's sequence layout; an MLP flattens it). The reference's default set has
5000 samples and 4000 for training; a logistic regression reaches about 0.3, an MLP about 0.6 and a small 1-D CNN above
0.9 on it, which is why the set separates models that see shape from those that do not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rayfuse.data.datasets import Dataset, register_dataset
from rayfuse.errors import InputError

__all__ = ["TEMPLATES", "generate_mnist1d"]

#: The ten digit templates (12 points each), as the reference draws them.
TEMPLATES = np.array(
    [
        [5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5],
        [5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5],
        [5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5],
        [5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5],
        [5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5],
        [5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5],
        [5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5],
        [5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5],
        [5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5],
        [5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5],
    ],
    dtype=np.float64,
)
_PADDING = (36, 60)
_LENGTH = 40


def _resample(x: np.ndarray, n: int) -> np.ndarray:
    return np.interp(np.linspace(0.0, 1.0, n), np.linspace(0.0, 1.0, len(x)), x)


def _templates() -> np.ndarray:
    x = TEMPLATES - TEMPLATES.mean(1, keepdims=True)
    x = x / x.std(1, keepdims=True)
    return (x - x[:, :1]) / 6.0


def generate_mnist1d(
    num_samples: int = 5000, *, seed: int = 42, test_fraction: float = 0.2
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X, y, X_test, y_test)``: ``num_samples`` signals (``num_samples // 10`` a class), ``X`` float32 ``(N, 40,
    1)``, labels int64, deterministic for ``seed`` (module docstring)."""
    from scipy.ndimage import gaussian_filter1d

    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 20:
        raise InputError("data.options.num_samples", "an integer >= 20 (at least 2 samples a class)", num_samples)
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise InputError("data.options.test_fraction", "a fraction in (0, 1)", test_fraction)
    rng = np.random.default_rng(seed)
    templates = _templates()
    long = len(TEMPLATES[0]) + _PADDING[1]
    per_class = num_samples // len(templates)
    xs, ys = [], []
    for label, template in enumerate(templates):
        for _ in range(per_class):
            pad = int(rng.integers(_PADDING[0], _PADDING[1] + 1))
            x = _resample(np.concatenate([template + 1e-8, np.zeros(pad)]), long)
            x = x * (1 + 0.4 * (rng.random() - 0.5))
            x = np.roll(x, int(rng.integers(0, 48)))
            noise = gaussian_filter1d(0.25 * rng.standard_normal(long), 2.0)
            x = np.where(x != 0, x, noise) + 0.02 * rng.standard_normal(long)
            x = x - 0.75 * (rng.random() - 0.5) * np.linspace(-0.5, 0.5, long)
            xs.append(_resample(x, _LENGTH))
            ys.append(label)
    order = rng.permutation(len(ys))
    X = np.stack(xs)[order]
    y = np.asarray(ys, dtype=np.int64)[order]
    X = ((X - X.mean()) / X.std()).astype(np.float32)[:, :, None]
    split = int(round(len(y) * (1 - test_fraction)))
    return X[:split], y[:split], X[split:], y[split:]


@register_dataset(
    "mnist1d",
    description="MNIST-1D, generated (no download): 10 classes of 1-D digit signals, (40, 1) sequences; data.options: "
    "num_samples (5000), seed (42), test_fraction (0.2: the dataset's own test split)",
    source="generator",
)
def _load_mnist1d(*, num_samples: int = 5000, seed: int = 42, test_fraction: float = 0.2, **_: Any) -> Dataset:
    X, y, X_test, y_test = generate_mnist1d(num_samples, seed=seed, test_fraction=test_fraction)
    return Dataset("mnist1d", X, y, 10, tuple(str(d) for d in range(10)), X_test, y_test, meta={"kind": "signals"})
