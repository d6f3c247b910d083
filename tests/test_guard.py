"""The raw-data accident guard (``rayfuse.guard``): each way a copy of a client's data can slip into a result is
found, and what clients legitimately return (parameters, statistics, counts) passes."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from rayfuse.client import Client, PrivacyError
from rayfuse.config import validate_config
from rayfuse.data.roles import load_dataset_from_config, make_plan
from rayfuse.federation import Update, client_step
from rayfuse.guard import RawDataGuard, bfloat16_round


def private_data(n: int = 60, d: int = 12, classes: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return X, y


@pytest.fixture
def guard_and_data():
    X, y = private_data()
    Xv, yv = private_data(20, seed=1)
    return RawDataGuard([X, Xv], [y, yv]), X, y, Xv


@dataclasses.dataclass
class Box:
    payload: object


class Holder:
    def __init__(self, payload):
        self.payload = payload


EVASIONS = {
    "verbatim": lambda X, y: X.copy(),
    "view": lambda X, y: X[3:5],
    "float64": lambda X, y: X.astype(np.float64),
    "float16": lambda X, y: X.astype(np.float16),
    "torch float32": lambda X, y: torch.from_numpy(X.copy()),
    "torch float64": lambda X, y: torch.from_numpy(X).double(),
    "torch bfloat16": lambda X, y: torch.from_numpy(X).to(torch.bfloat16),
    "torch half": lambda X, y: torch.from_numpy(X).half(),
    "torch sparse": lambda X, y: torch.from_numpy(X.copy()).to_sparse(),
    "bytes": lambda X, y: X.tobytes(),
    "float64 bytes": lambda X, y: X.astype(np.float64).tobytes(),
    "bytearray": lambda X, y: bytearray(X.tobytes()),
    "tolist": lambda X, y: X.tolist(),
    "tolist of one row per key": lambda X, y: {i: row for i, row in enumerate(X.tolist())},
    "dropped row": lambda X, y: np.delete(X, 7, axis=0),
    "reordered rows": lambda X, y: X[np.random.default_rng(3).permutation(len(X))],
    "a few rows among other rows": lambda X, y: np.concatenate([np.zeros((5, X.shape[1]), np.float32), X[10:13]]),
    "rows split over arrays": lambda X, y: [X[0].copy(), X[1].copy(), X[2].copy()],
    "flattened": lambda X, y: X.reshape(-1).copy(),
    "set of row tuples": lambda X, y: {tuple(row) for row in X.tolist()},
    "nested containers": lambda X, y: {"a": [({"b": (X[5:9].copy(),)},)]},
    "dataclass": lambda X, y: Box(X[:4].copy()),
    "Update": lambda X, y: Update({"w": X[:4].copy()}, 10),
    "object attribute": lambda X, y: Holder(X[:4].copy()),
    "torch module buffer": lambda X, y: _module_with_buffer(X[:4].copy()),
    "object array": lambda X, y: np.array([X[0].copy(), X[1].copy(), "tag"], dtype=object),
    "labels": lambda X, y: y.copy(),
    "labels int32": lambda X, y: y.astype(np.int32),
    "labels float": lambda X, y: y.astype(np.float32),
    "labels tensor": lambda X, y: torch.from_numpy(y.copy()),
    "labels tolist": lambda X, y: y.tolist(),
    "labels bytes": lambda X, y: y.tobytes(),
    "labels with a dropped row": lambda X, y: np.delete(y, 20),
    "labels with two rows swapped": lambda X, y: y[np.r_[1, 0, 2 : len(y)]],
    "labels as a column": lambda X, y: y.reshape(-1, 1).astype(np.float64),
}


def _module_with_buffer(values):
    module = torch.nn.Linear(2, 2)
    module.register_buffer("kept", torch.from_numpy(values))
    return module


@pytest.mark.parametrize("evasion", list(EVASIONS))
def test_a_copy_of_the_private_data_is_found(guard_and_data, evasion):
    guard, X, y, _ = guard_and_data
    assert guard.find(EVASIONS[evasion](X, y)) is not None


def test_validation_rows_are_private_too(guard_and_data):
    guard, _, _, Xv = guard_and_data
    assert "rows of the private inputs" in guard.find({"v": Xv[::-1].copy()})


def test_one_row_alone_or_a_different_width_passes(guard_and_data):
    guard, X, _, _ = guard_and_data
    assert guard.find(X[0].copy()) is None  # one row: fewer than two rows (a view would be refused, this is a copy)
    assert guard.find(X[:, :-1].copy()) is None  # a column dropped: not recognised (stated in the docs)


def test_parameters_statistics_and_counts_pass(guard_and_data):
    guard, X, y, _ = guard_and_data
    rng = np.random.default_rng(5)
    legit = {
        "params": {
            "w": rng.normal(size=(8, X.shape[1])).astype(np.float32),
            "b": np.zeros(8, np.float32),
            "w16": torch.randn(8, X.shape[1], dtype=torch.bfloat16),
        },
        "zeros shaped like rows": np.zeros((30, X.shape[1]), np.float32),
        "mean": X.mean(axis=0),
        "cov": np.cov(X.T),
        "gram": X.T @ X,
        "class counts": np.bincount(y, minlength=4),
        "counts list": np.bincount(y).tolist(),
        "constant labels": np.full(len(y), np.bincount(y).argmax()),
        "shuffled labels": y[np.random.default_rng(9).permutation(len(y))],  # only what the class counts say
        "num_examples": len(y),
        "loss": 0.25,
        "name": "fedavg",
        "flags": [True, False],
        "update": Update({"w": rng.normal(size=(4, 3)).astype(np.float32)}, len(y), {"train_loss": 0.5}),
    }
    assert guard.find(legit) is None


def test_constant_private_rows_are_not_matched():
    X = np.zeros((40, 6), np.float32)
    X[:20] = np.random.default_rng(0).normal(size=(20, 6))
    guard = RawDataGuard([X], [np.zeros(40, np.int64)])
    assert guard.find({"zero weights": np.zeros((16, 6), np.float32)}) is None
    assert guard.find(X[:4].copy()) is not None


def test_bfloat16_round_matches_torch():
    values = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    expected = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(bfloat16_round(values), expected)


def test_cyclic_containers_end():
    X, y = private_data()
    guard = RawDataGuard([X], [y])
    loop: list = [1.5]
    loop.append(loop)
    assert guard.find({"loop": loop, "holder": Holder(None)}) is None


@pytest.fixture(scope="module")
def client():
    cfg = validate_config({"partition": {"method": "iid", "num_clients": 3}, "model": {"hidden": [8]}, "train": {"epochs": 1}})
    plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)
    return Client(0, plan.for_client(0), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=cfg.run.seed)


@pytest.mark.parametrize("evasion", ["float64", "dropped row", "tolist", "bytes", "torch bfloat16", "labels with a dropped row"])
def test_a_client_step_returning_a_copy_is_refused(client, evasion):
    @client_step("test.guard.leak")
    def leak(ctx):
        return {"stats": np.ones(3), "leak": EVASIONS[evasion](ctx.train.X, ctx.train.y)}

    with pytest.raises(PrivacyError, match="raw data"):
        client.run(leak)


def test_a_client_step_returning_its_local_model_passes(client):
    @client_step("test.guard.model")
    def model(ctx):
        from rayfuse.models import get_params

        return pickle.loads(pickle.dumps(Update(get_params(ctx.local_model()), ctx.num_examples, dict(ctx.local_stats))))

    assert client.run(model).num_examples == client.ctx.num_examples
