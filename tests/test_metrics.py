"""Classification metrics (rayfuse.metrics): hand-computed toy cases, limiting cases, and loud failure on bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rayfuse.errors import NonFiniteError
from rayfuse.metrics import METRIC_NAMES, accuracy, compute_metrics, ece, entropy, nll

# Three samples, three classes. Predictions 0, 0, 2 (confidences 0.7, 0.72, 0.5); labels 0, 1, 2.
PROBA = np.array([[0.7, 0.2, 0.1], [0.72, 0.18, 0.1], [0.2, 0.3, 0.5]])
Y = np.array([0, 1, 2])


def test_accuracy_by_hand():
    assert accuracy(PROBA, Y) == pytest.approx(2 / 3)


def test_nll_by_hand():
    # -mean log p(y|x) = -(log 0.7 + log 0.18 + log 0.5) / 3
    assert nll(PROBA, Y) == pytest.approx(-(math.log(0.7) + math.log(0.18) + math.log(0.5)) / 3)


def test_entropy_by_hand():
    def h(row):
        return -sum(p * math.log(p) for p in row)

    assert entropy(PROBA) == pytest.approx((h([0.7, 0.2, 0.1]) + h([0.72, 0.18, 0.1]) + h([0.2, 0.3, 0.5])) / 3)
    assert entropy(PROBA, Y) == entropy(PROBA)  # labels are accepted and ignored


def test_ece_by_hand():
    # 15 bins of width 1/15. Confidences 0.7 and 0.72 share bin (10/15, 11/15]: mean confidence 0.71, accuracy 1/2,
    # gap 0.21, weight 2/3. Confidence 0.5 is alone in bin (7/15, 8/15]: accuracy 1, gap 0.5, weight 1/3.
    assert ece(PROBA, Y) == pytest.approx(2 / 3 * 0.21 + 1 / 3 * 0.5)


def test_ece_with_one_bin_is_the_gap_between_mean_confidence_and_accuracy():
    # mean confidence (0.7 + 0.72 + 0.5) / 3 = 0.64, accuracy 2/3
    assert ece(PROBA, Y, num_bins=1) == pytest.approx(abs(0.64 - 2 / 3))


def reference_ece(proba, y, num_bins=15):
    """Guo et al. 2017, eq. (3), written out bin by bin with explicit (lo, hi] edges."""
    confidence, correct = proba.max(axis=1), proba.argmax(axis=1) == y
    total = 0.0
    for b in range(num_bins):
        lo, hi = b / num_bins, (b + 1) / num_bins
        mask = (confidence > lo) & (confidence <= hi)
        if mask.any():
            total += mask.mean() * abs(correct[mask].mean() - confidence[mask].mean())
    return total


@pytest.mark.parametrize("seed", range(5))
def test_ece_matches_a_written_out_reference_on_random_predictions(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(200, 4))
    proba = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = rng.integers(0, 4, size=200)
    assert ece(proba, y) == pytest.approx(reference_ece(proba, y), abs=1e-12)


def test_perfect_confident_predictions():
    y = np.array([2, 0, 1, 1])
    proba = np.eye(3)[y]
    assert accuracy(proba, y) == 1.0
    assert nll(proba, y) == pytest.approx(0.0, abs=1e-12)
    assert entropy(proba) == pytest.approx(0.0, abs=1e-12)
    assert ece(proba, y) == 0.0


def test_confidently_wrong_predictions_hit_the_floor_not_infinity():
    y = np.array([0, 1])
    proba = np.eye(2)[[1, 0]]
    assert accuracy(proba, y) == 0.0
    assert nll(proba, y) == pytest.approx(-math.log(1e-12))  # probabilities floored at 1e-12
    assert ece(proba, y) == 1.0


@pytest.mark.parametrize("num_classes", [2, 3, 10])
def test_uniform_predictions_have_entropy_and_nll_log_c(num_classes):
    proba = np.full((6, num_classes), 1.0 / num_classes)
    y = np.arange(6) % num_classes
    assert entropy(proba) == pytest.approx(math.log(num_classes))
    assert nll(proba, y) == pytest.approx(math.log(num_classes))


def test_compute_metrics_returns_every_metric():
    metrics = compute_metrics(PROBA, Y)
    assert tuple(metrics) == METRIC_NAMES
    assert metrics == {"accuracy": accuracy(PROBA, Y), "nll": nll(PROBA, Y), "entropy": entropy(PROBA), "ece": ece(PROBA, Y)}
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize(
    "metric", [accuracy, nll, ece, compute_metrics, lambda p, y: entropy(p)], ids=["accuracy", "nll", "ece", "all", "entropy"]
)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_predictions_raise(metric, bad):
    proba = PROBA.copy()
    proba[1, 1] = bad
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        metric(proba, Y)


@pytest.mark.parametrize("metric", [accuracy, nll, ece, compute_metrics], ids=["accuracy", "nll", "ece", "all"])
@pytest.mark.parametrize(
    ("proba", "y", "match"),
    [
        pytest.param(PROBA, Y[:2], r"proba \(n, C\) and labels \(n,\), got \(3, 3\) and \(2,\)", id="fewer-labels"),
        pytest.param(PROBA[0], Y[:1], r"proba \(n, C\)", id="1d-proba"),
        pytest.param(PROBA, Y[:, None], r"labels \(n,\)", id="2d-labels"),
        pytest.param(PROBA[:0], Y[:0], r"at least one sample", id="empty"),
        pytest.param(PROBA, np.array([0, 1, 3]), r"labels must lie in 0\.\.2", id="label-too-large"),
        pytest.param(PROBA, np.array([0, -1, 2]), r"labels must lie in 0\.\.2", id="negative-label"),
    ],
)
def test_bad_shapes_and_labels_raise_value_error(metric, proba, y, match):
    with pytest.raises(ValueError, match=match):
        metric(proba, y)
