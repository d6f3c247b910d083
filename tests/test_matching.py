"""Assignment solves: the wrapper against scipy, the executors agree, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from rayfuse.errors import InputError, NonFiniteError
from rayfuse.matching import balanced_chunks, executor_width, map_chunked, serial_map, solve_assignment, solve_assignments, thread_map


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


@pytest.mark.parametrize(
    "cost,error,match",
    [
        (np.zeros((3, 2)), InputError, "cost"),
        (np.zeros(4), InputError, "cost"),
        (np.array([["a"]]), InputError, "numeric"),
    ],
)
def test_bad_cost_matrices(cost, error, match):
    with pytest.raises(error, match=match):
        solve_assignment(cost)


def test_non_finite_costs_are_refused():
    cost = np.ones((2, 2))
    cost[0, 1] = np.nan
    with pytest.raises(NonFiniteError):
        solve_assignments([np.ones((2, 2)), cost], serial_map)


@pytest.mark.parametrize(
    "n,workers,chunks",
    [
        (10, 2, 2),  # one wave of 5 + 5, not 3 + 3 + 3 + 1
        (5, 2, 2),  # 3 + 2
        (200, 2, 2),
        (9, 4, 3),  # 3 + 3 + 3 on 4 workers: makespan 3, as good as any finer split
        (1, 8, 1),
        (0, 2, 0),
        (7, 1, 1),
    ],
)
def test_balanced_chunks_minimise_the_makespan_with_the_fewest_chunks(n, workers, chunks):
    assert balanced_chunks(n, workers) == chunks


def test_balanced_chunks_never_beaten_by_another_count():
    for n in range(1, 60):
        for workers in (1, 2, 3, 4, 8):

            def span(count):
                size = -(-n // count)
                chunks = -(-n // size)
                return -(-chunks // workers) * size

            best = min(span(count) for count in range(1, min(n, 4 * workers) + 1))
            assert span(balanced_chunks(n, workers)) == best


def test_executor_width_reads_a_federations_parallel_width():
    class Fed:
        def parallel_width(self):
            return 6

        def parallel_map(self, fn, items):
            return [fn(item) for item in items]

    fed = Fed()
    assert executor_width(fed.parallel_map) == 6
    assert executor_width(thread_map) >= 1
    seen = []
    assert map_chunked(lambda x: x + 1, list(range(12)), lambda fn, batches: seen.append(len(batches)) or [fn(b) for b in batches]) == list(
        range(1, 13)
    )
    assert seen and seen[0] >= 1
