"""Training and prediction loops (rayfuse.models.training)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from rayfuse.config import ModelConfig
from rayfuse.models.params import get_params, params_equal, set_params
from rayfuse.models.registry import build_model
from rayfuse.models.training import compute_loss, predict_proba, train_model

# Three well-separated Gaussian blobs in 4-D: linearly separable, 150 samples.
_RNG = np.random.default_rng(0)
Y = (np.arange(150) % 3).astype(np.int64)
X = (np.array([[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], np.float32)[Y] + _RNG.normal(size=(150, 4))).astype(np.float32)

FAST = {"epochs": 5, "batch_size": 32, "lr": 0.05}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These models are tiny: intra-op threads only add overhead (and contend badly on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model(seed: int = 0, **cfg) -> nn.Module:
    return build_model(ModelConfig(**{"name": "mlp", "hidden": [16], **cfg}), (4,), 3, seed=seed)


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)))


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_training_reduces_the_loss_on_a_separable_problem(optimizer):
    net = model()
    before = compute_loss(net, X, Y)
    stats = train_model(net, X, Y, optimizer=optimizer, **{**FAST, "lr": 0.05 if optimizer == "adam" else 0.2})
    after = compute_loss(net, X, Y)
    assert after < 0.5 * before
    assert after < 0.3
    assert (predict_proba(net, X).argmax(axis=1) == Y).mean() > 0.95
    assert stats.loss < before and math.isfinite(stats.loss)


def test_train_stats_count_steps_and_examples():
    stats = train_model(model(), X, Y, epochs=3, batch_size=32, lr=0.01)
    assert stats.steps == 3 * math.ceil(150 / 32)
    assert stats.examples == 3 * 150
    assert stats.seconds >= 0


def test_early_stopping_on_training_accuracy_stops_after_patience_epochs_without_gain():
    # Keras's EarlyStopping(monitor='acc', mode='max', patience=p): a frozen model (lr ~ 0) never improves on its
    # first epoch's accuracy, so it stops after 1 + p epochs; patience 0 is off
    for patience in (1, 3):
        stats = train_model(model(), X, Y, epochs=50, batch_size=32, lr=1e-12, early_stop_patience=patience)
        assert stats.examples == (1 + patience) * 150 and stats.steps == (1 + patience) * 5
    assert train_model(model(), X, Y, epochs=7, batch_size=32, lr=1e-12).examples == 7 * 150
    # a separable problem reaches accuracy 1.0 within a few epochs and then cannot gain: it stops long before 60
    net = model()
    stopped = train_model(net, X, Y, epochs=60, batch_size=32, lr=0.05, early_stop_patience=3)
    assert 4 * 150 <= stopped.examples < 60 * 150
    assert (predict_proba(net, X).argmax(axis=1) == Y).mean() > 0.95


def test_same_seed_gives_identical_parameters_and_different_seed_differs():
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        net = model(seed=0)  # same initialisation; the training seed only changes the batch order
        train_model(net, X, Y, seed=seed, **FAST)
        runs[name] = get_params(net)
    assert params_equal(runs["a"], runs["b"])
    assert not params_equal(runs["a"], runs["c"])


def test_dropout_training_is_reproducible_and_leaves_the_global_rng_alone():
    torch.manual_seed(99)
    state = torch.get_rng_state()
    a, b = model(dropout=0.5), model(dropout=0.5)
    train_model(a, X, Y, seed=3, **FAST)
    train_model(b, X, Y, seed=3, **FAST)
    assert params_equal(get_params(a), get_params(b))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_proximal_term_keeps_parameters_closer_to_the_start(optimizer):
    start = get_params(model())
    moved = {}
    for mu in (0.0, 1.0, 10.0):
        net = set_params(model(seed=5), start)
        train_model(net, X, Y, epochs=5, batch_size=32, lr=0.05, optimizer=optimizer, proximal_mu=mu, seed=0)
        moved[mu] = distance(get_params(net), start)
    assert moved[10.0] < moved[1.0] < moved[0.0]
    assert moved[10.0] < 0.5 * moved[0.0]


def test_zero_epochs_leaves_the_model_unchanged_and_reports_its_loss():
    net = model()
    before = get_params(net)
    stats = train_model(net, X, Y, epochs=0, batch_size=32, lr=1.0)
    assert params_equal(get_params(net), before)
    assert stats.steps == 0 and stats.examples == 0
    assert stats.loss == pytest.approx(compute_loss(net, X, Y))


def test_empty_training_set_is_a_no_op():
    net = model()
    before = get_params(net)
    stats = train_model(net, X[:0], Y[:0], epochs=3, batch_size=8, lr=1.0)
    assert params_equal(get_params(net), before) and stats.loss == 0.0 and stats.steps == 0


def test_batchnorm_model_skips_a_trailing_batch_of_one():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    stats = train_model(net, X[:33], Y[:33], epochs=2, batch_size=16, lr=0.01)  # batches of 16, 16, 1
    assert stats.steps == 2 * 2
    assert not net.training  # left in eval mode


def test_compute_loss_of_a_zero_model_is_log_num_classes():
    net = model()
    set_params(net, {k: np.zeros_like(v) for k, v in get_params(net).items()})  # uniform logits
    assert compute_loss(net, X, Y) == pytest.approx(math.log(3), rel=1e-6)
    assert compute_loss(net, X, Y, batch_size=7) == pytest.approx(math.log(3), rel=1e-6)


def test_predict_proba_rows_are_distributions():
    net = model()
    proba = predict_proba(net, X)
    assert proba.shape == (150, 3) and proba.dtype == np.float64
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert (proba >= 0).all()


def test_predict_proba_does_not_depend_on_batch_size_and_restores_training_mode():
    net = model(dropout=0.5)
    net.train()
    full = predict_proba(net, X)
    small = predict_proba(net, X, batch_size=7)
    np.testing.assert_allclose(full, small, rtol=1e-6, atol=1e-7)  # eval mode: dropout off, deterministic
    assert net.training


def test_predict_proba_of_nothing_is_empty():
    assert predict_proba(model(), X[:0]).shape[0] == 0
