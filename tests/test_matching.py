"""Assignment solves: the wrapper against scipy, the executors agree, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from rayfuse.errors import InputError, NonFiniteError
from rayfuse.matching import map_chunked, serial_map, solve_assignment, solve_assignments, thread_map


def test_solve_assignment_equals_scipy_on_rectangular_costs():
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (3, 7), (20, 20), (15, 40)]:
        cost = rng.random(shape)
        rows, cols = linear_sum_assignment(cost)
        got = solve_assignment(cost)
        np.testing.assert_array_equal(got[rows], cols)
        assert len(set(got.tolist())) == shape[0]


def test_executors_agree_and_keep_order():
    rng = np.random.default_rng(1)
    costs = [rng.random((n, n + 3)) for n in rng.integers(1, 30, 25)]
    serial = solve_assignments(costs, serial_map)
    for executor in (thread_map, None):
        for got, want in zip(solve_assignments(costs, executor), serial):
            np.testing.assert_array_equal(got, want)
    assert map_chunked(lambda x: x * 2, list(range(11)), thread_map, chunks=3) == [x * 2 for x in range(11)]


@pytest.mark.parametrize("cost,error,match", [
    (np.zeros((3, 2)), InputError, "cost"),
    (np.zeros(4), InputError, "cost"),
    (np.array([["a"]]), InputError, "numeric"),
])
def test_bad_cost_matrices(cost, error, match):
    with pytest.raises(error, match=match):
        solve_assignment(cost)


def test_non_finite_costs_are_refused():
    cost = np.ones((2, 2))
    cost[0, 1] = np.nan
    with pytest.raises(NonFiniteError):
        solve_assignments([np.ones((2, 2)), cost], serial_map)
