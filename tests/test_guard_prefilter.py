"""The guard's column prefilter (one value per row looked up before any row is hashed) finds exactly what hashing
every row finds: private rows inside a large array of other values, of zeros (where most rows pass the prefilter and
every row is hashed), reordered or cast; and nothing in a model's parameters."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits

from rayfuse.guard import RawDataGuard, _RowIndex


def _guard() -> tuple[RawDataGuard, np.ndarray]:
    X, y = load_digits(return_X_y=True)
    X = X.astype(np.float32)
    return RawDataGuard([X[:1200], X[1200:]], [y[:1200], y[1200:]]), X


def test_private_rows_hidden_in_a_large_array_are_found_whatever_surrounds_them():
    guard, X = _guard()
    rng = np.random.default_rng(0)
    for filler in (rng.uniform(0.5, 1.5, (200_000, 64)).astype(np.float32), np.zeros((200_000, 64), np.float32)):
        carrier = filler.copy()
        carrier[[17, 90_001, 199_000]] = X[[5, 600, 1500]]
        found = guard.find({"w": carrier.reshape(-1)})
        assert found is not None and "3 rows of the private inputs" in found, found
        assert guard.find({"w": filler.reshape(-1)}) is None
    shuffled = X[rng.permutation(len(X))[:10]].astype(np.float64)  # reordered, and a float64 copy
    assert "rows of the private inputs" in guard.find({"w": np.concatenate([np.ones((5000, 64)), shuffled]).reshape(-1)})


def test_the_prefilter_column_is_where_the_private_rows_differ_most():
    X = np.zeros((50, 8), np.float32)
    X[:, 5] = np.arange(50)  # the only varied column
    X[:, 1] = np.arange(50) % 2
    index = _RowIndex(X, np.arange(50))
    assert index.column == 5 and len(index.column_values) == 50
    assert sorted(index.find(X[[3, 7]])) == [3, 7]
    near = X[[3]].copy()
    near[0, 0] = 1e-7  # equal in the prefilter's column, not in another: hashed, compared, not found
    assert len(index.find(near)) == 0
