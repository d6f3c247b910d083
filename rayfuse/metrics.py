"""Classification metrics computed from predicted probabilities.

All take ``proba`` of shape ``(n, C)`` (rows summing to 1) and integer labels ``y`` of shape ``(n,)``:

* ``accuracy`` -- fraction of ``argmax proba == y``;
* ``nll`` -- mean negative log-likelihood ``-mean log p(y | x)`` (probabilities floored at 1e-12);
* ``entropy`` -- mean predictive entropy ``-mean sum_c p_c log p_c`` (nats);
* ``ece`` -- expected calibration error with 15 equal-width confidence bins (Guo et al. 2017).

Inputs with NaN / Inf or the wrong shapes raise; a metric is never silently wrong.
"""

from __future__ import annotations

import numpy as np

from rayfuse.errors import NonFiniteError

__all__ = ["compute_metrics", "accuracy", "nll", "entropy", "ece", "METRIC_NAMES"]

METRIC_NAMES = ("accuracy", "nll", "entropy", "ece")
_FLOOR = 1e-12


def _check(proba: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    proba = np.asarray(proba, dtype=np.float64)
    y = np.asarray(y)
    if proba.ndim != 2 or y.ndim != 1 or proba.shape[0] != y.shape[0]:
        raise ValueError(f"metrics need proba (n, C) and labels (n,), got {proba.shape} and {y.shape}")
    if proba.shape[0] == 0:
        raise ValueError("metrics need at least one sample")
    if not np.isfinite(proba).all():
        raise NonFiniteError("model predictions contain NaN or Inf")
    if y.min() < 0 or y.max() >= proba.shape[1]:
        raise ValueError(f"labels must lie in 0..{proba.shape[1] - 1}")
    return proba, y.astype(np.int64)


def accuracy(proba: np.ndarray, y: np.ndarray) -> float:
    proba, y = _check(proba, y)
    return float(np.mean(proba.argmax(axis=1) == y))


def nll(proba: np.ndarray, y: np.ndarray) -> float:
    proba, y = _check(proba, y)
    return float(-np.mean(np.log(np.maximum(proba[np.arange(len(y)), y], _FLOOR))))


def entropy(proba: np.ndarray, y: np.ndarray | None = None) -> float:
    proba = np.asarray(proba, dtype=np.float64)
    if proba.ndim != 2 or proba.shape[0] == 0:
        raise ValueError(f"entropy needs proba of shape (n, C) with n >= 1, got {proba.shape}")
    if not np.isfinite(proba).all():
        raise NonFiniteError("model predictions contain NaN or Inf")
    return float(-np.mean(np.sum(proba * np.log(np.maximum(proba, _FLOOR)), axis=1)))


def ece(proba: np.ndarray, y: np.ndarray, *, num_bins: int = 15) -> float:
    proba, y = _check(proba, y)
    confidence = proba.max(axis=1)
    correct = proba.argmax(axis=1) == y
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    bins = np.clip(np.digitize(confidence, edges[1:-1], right=True), 0, num_bins - 1)
    total = 0.0
    for b in range(num_bins):
        mask = bins == b
        if mask.any():
            total += mask.mean() * abs(correct[mask].mean() - confidence[mask].mean())
    return float(total)


def compute_metrics(proba: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """All of :data:`METRIC_NAMES` at once."""
    proba, y = _check(proba, y)
    return {"accuracy": accuracy(proba, y), "nll": nll(proba, y), "entropy": entropy(proba), "ece": ece(proba, y)}
