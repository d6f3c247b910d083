"""Classification metrics computed from predicted probabilities.

All take ``proba`` of shape ``(n, C)`` (rows summing to 1) and integer labels ``y`` of shape ``(n,)``:

* ``accuracy`` -- fraction of ``argmax proba == y``;
* ``nll`` -- mean negative log-likelihood ``-mean log p(y | x)`` (probabilities floored at 1e-12);
* ``entropy`` -- mean predictive entropy ``-mean sum_c p_c log p_c`` (nats);
* ``ece`` -- expected calibration error with 15 equal-width confidence bins (Guo et al. 2017).

Inputs with NaN / Inf or the wrong shapes raise; a metric is never silently wrong.

Federated evaluation (``evaluation: federated``) computes the same four metrics from sums: each client reduces its
held-out split to :func:`metric_sums` (a count, the number correct, the NLL and entropy sums, and per ECE bin a count,
a number correct and a confidence sum; nothing per sample), the server adds the clients' sums
(:func:`add_metric_sums`) and :func:`metrics_from_sums` turns them into the metrics. The metrics of the summed sums
equal :func:`compute_metrics` on the union of the clients' samples, up to float rounding.

The metrics channel: every metric row a method logs (``server.log(round, values, client)``) is one ``metrics`` event,
``{"kind": "metrics", "method": <label>, "round": r, "client": <id or None>, "values": {name: float}}``, at full
float precision (:func:`metrics_event`, read back with :func:`metric_row`). It is separate from the ``progress``
events the screen prints (rounded to 4 decimals): Ray Tune's per-round reports, the Prometheus gauges, the MLflow
sink and ``metrics.parquet`` (the same rows, kept as the method's history) read the channel, never the display text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayfuse.errors import NonFiniteError

__all__ = [
    "compute_metrics",
    "accuracy",
    "nll",
    "entropy",
    "ece",
    "METRIC_NAMES",
    "metric_sums",
    "add_metric_sums",
    "metrics_from_sums",
    "check_metric_sums",
    "majority_vote",
    "SUM_KEYS",
    "ECE_BINS",
    "METRICS_EVENT",
    "MetricRow",
    "metrics_event",
    "metric_row",
]

METRIC_NAMES = ("accuracy", "nll", "entropy", "ece")
ECE_BINS = 15
# what a client's evaluation reply holds: scalars, then arrays of ECE_BINS values (``vote_correct`` with an ensemble)
SUM_KEYS = ("count", "correct", "nll_sum", "entropy_sum", "bin_count", "bin_correct", "bin_confidence")
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


def ece(proba: np.ndarray, y: np.ndarray, *, num_bins: int = ECE_BINS) -> float:
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


def _bins(confidence: np.ndarray, num_bins: int) -> np.ndarray:
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    return np.clip(np.digitize(confidence, edges[1:-1], right=True), 0, num_bins - 1)


def metric_sums(proba: np.ndarray, y: np.ndarray, *, num_bins: int = ECE_BINS) -> dict[str, float | np.ndarray]:
    """The sums :func:`metrics_from_sums` needs, of ``proba`` ``(n, C)`` against labels ``y`` (``n`` may be 0).

    ``count`` (n), ``correct`` (argmax hits), ``nll_sum`` and ``entropy_sum`` (nats), and per confidence bin of
    :func:`ece` ``bin_count``, ``bin_correct`` and ``bin_confidence`` (arrays of ``num_bins``): aggregates only, never a
    per-sample value.
    """
    proba = np.asarray(proba, dtype=np.float64)
    if len(np.asarray(y)) == 0:
        zeros = np.zeros(num_bins)
        return {
            "count": 0.0,
            "correct": 0.0,
            "nll_sum": 0.0,
            "entropy_sum": 0.0,
            "bin_count": zeros,
            "bin_correct": zeros.copy(),
            "bin_confidence": zeros.copy(),
        }
    proba, y = _check(proba, y)
    confidence = proba.max(axis=1)
    correct = (proba.argmax(axis=1) == y).astype(np.float64)
    bins = _bins(confidence, num_bins)
    return {
        "count": float(len(y)),
        "correct": float(correct.sum()),
        "nll_sum": float(-np.sum(np.log(np.maximum(proba[np.arange(len(y)), y], _FLOOR)))),
        "entropy_sum": float(-np.sum(proba * np.log(np.maximum(proba, _FLOOR)))),
        "bin_count": np.bincount(bins, minlength=num_bins).astype(np.float64),
        "bin_correct": np.bincount(bins, weights=correct, minlength=num_bins),
        "bin_confidence": np.bincount(bins, weights=confidence, minlength=num_bins),
    }


def check_metric_sums(sums: object, *, extra: tuple[str, ...] = (), num_bins: int = ECE_BINS) -> str | None:
    """Why ``sums`` is not a valid reply of metric sums (``None`` when it is): the keys of :data:`SUM_KEYS` (and
    ``extra`` scalars) and nothing else, finite non-negative values, bins of ``num_bins``, counts that add up."""
    if not isinstance(sums, dict):
        return f"expected a dict of metric sums, got {type(sums).__name__}"
    wanted = set(SUM_KEYS) | set(extra)
    if set(sums) != wanted:
        return f"expected the keys {sorted(wanted)}, got {sorted(sums)}"
    for key, value in sums.items():
        array = np.asarray(value, dtype=np.float64) if isinstance(value, (int, float, np.ndarray, np.number)) else None
        shape = (num_bins,) if key.startswith("bin_") else ()
        if array is None or array.shape != shape:
            return f"{key}: expected {'an array of ' + str(num_bins) if shape else 'a number'}, got {type(value).__name__}"
        if not np.isfinite(array).all() or (array < 0).any():
            return f"{key}: expected finite values >= 0"
    count = float(sums["count"])
    if count != int(count) or float(np.sum(sums["bin_count"])) != count or float(sums["correct"]) > count:
        return f"inconsistent counts (count {count}, bins {float(np.sum(sums['bin_count']))}, correct {float(sums['correct'])})"
    return None


def add_metric_sums(parts: list[dict[str, float | np.ndarray]]) -> dict[str, float | np.ndarray]:
    """The key-wise sum of several clients' :func:`metric_sums` (in the order given)."""
    if not parts:
        raise ValueError("no metric sums to add")
    total: dict[str, float | np.ndarray] = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        total[key] = (
            np.sum(np.stack([np.asarray(v, dtype=np.float64) for v in values]), axis=0)
            if np.ndim(values[0])
            else float(np.sum(np.asarray(values, dtype=np.float64)))
        )
    return total


def metrics_from_sums(sums: dict[str, float | np.ndarray]) -> dict[str, float]:
    """:data:`METRIC_NAMES` (and ``vote_accuracy`` when ``sums`` has ``vote_correct``) from :func:`metric_sums`."""
    n = float(sums["count"])
    if n <= 0:
        raise ValueError("metrics need at least one sample")
    counts = np.asarray(sums["bin_count"], dtype=np.float64)
    filled = counts > 0
    gaps = np.abs(np.asarray(sums["bin_correct"])[filled] / counts[filled] - np.asarray(sums["bin_confidence"])[filled] / counts[filled])
    metrics = {
        "accuracy": float(sums["correct"]) / n,
        "nll": float(sums["nll_sum"]) / n,
        "entropy": float(sums["entropy_sum"]) / n,
        "ece": float(np.sum(counts[filled] / n * gaps)),
    }
    if "vote_correct" in sums:
        metrics["vote_accuracy"] = float(sums["vote_correct"]) / n
    return metrics


def majority_vote(probas: np.ndarray, weights: list[float] | np.ndarray) -> np.ndarray:
    """Predicted classes by majority vote over ``probas`` ``(K, n, C)``; ties broken by the averaged probability."""
    K, n, C = probas.shape
    votes = np.zeros((n, C))
    np.add.at(votes, (np.arange(n)[None, :].repeat(K, 0), probas.argmax(axis=2)), 1.0)
    averaged = np.tensordot(weights, probas, axes=1)  # in [0, 1]: never outweighs one vote
    return (votes + 0.5 * averaged).argmax(axis=1)


#: the kind of the metrics channel's events
METRICS_EVENT = "metrics"


@dataclass(frozen=True)
class MetricRow:
    """One row of the metrics channel: method ``method``'s ``values`` at ``round``, of client ``client`` (``None``:
    the method as a whole)."""

    method: str
    round: int
    client: int | None
    values: dict[str, float]


def metrics_event(method: str, round: int, values: Mapping[str, float], client: int | None = None) -> tuple[str, str, dict[str, Any]]:
    """``(kind, message, fields)`` of the ``metrics`` event of one row, for ``EventLog.emit(kind, message, **fields)``:
    the values as Python floats, unrounded."""
    fields: dict[str, Any] = {
        "method": method,
        "round": int(round),
        "client": None if client is None else int(client),
        "values": {str(name): float(value) for name, value in values.items()},
    }
    return METRICS_EVENT, "", fields


def metric_row(event: Mapping[str, Any]) -> MetricRow | None:
    """The row a ``metrics`` event carries; ``None`` for any other event (or a malformed one)."""
    if event.get("kind") != METRICS_EVENT or not isinstance(event.get("values"), Mapping) or "round" not in event:
        return None
    client = event.get("client")
    return MetricRow(
        str(event.get("method", "")),
        int(event["round"]),
        None if client is None else int(client),
        {str(k): float(v) for k, v in event["values"].items()},
    )
