"""Assignment solves, one or many at once through a pluggable executor.

Model fusion by matching (KL-fusion, SPAHM, PFNM) solves one linear assignment problem per dataset per sweep. The
solves of one sweep are independent, so they fan out:

* in-process: :func:`thread_map`, a thread pool (scipy's ``linear_sum_assignment`` releases the GIL);
* on Ray: the coordinator passes its federation's ``parallel_map`` (``actors.federation.RayFederation``), which runs
  batched Ray tasks on the cluster. The core never imports Ray: an *executor* is any callable
  ``executor(fn, items) -> [fn(item) for item in items]`` (in order).

Work is batched: :func:`solve_assignments` hands the executor chunks of problems, not single ones, so each task carries
enough work to pay for its dispatch. The chunks are balanced over the executor's width (:func:`executor_width`:
``cpus`` for threads, the cluster's CPUs for a federation's ``parallel_map``): one wave of equal chunks when that is
as fast as more, smaller ones (:func:`balanced_chunks`).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from scipy.optimize import linear_sum_assignment

from rayfuse.errors import InputError, NonFiniteError

__all__ = [
    "Executor",
    "thread_map",
    "serial_map",
    "solve_assignment",
    "solve_assignments",
    "map_chunked",
    "balanced_chunks",
    "executor_width",
]

T = TypeVar("T")
Executor = Callable[[Callable[[Any], Any], Sequence[Any]], list]


def serial_map(fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    """The executor that runs everything here, in order (the reference for parallel runs)."""
    return [fn(item) for item in items]


def thread_map(fn: Callable[[Any], T], items: Sequence[Any], *, max_workers: int | None = None) -> list[T]:
    """``[fn(item) for item in items]`` on a thread pool of ``min(len(items), cpus)`` threads, in order."""
    items = list(items)
    workers = max(1, min(len(items), max_workers or os.cpu_count() or 1))
    if workers == 1:
        return [fn(item) for item in items]
    return list(_pool(workers).map(fn, items))


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """A long-lived pool per size (starting threads on every sweep would cost more than small solves)."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rayfuse-solve")
        return _POOLS[workers]


def _apply_all(fn: Callable[[Any], T], chunk: Sequence[Any]) -> list[T]:
    return [fn(item) for item in chunk]


class _ChunkFn:
    """``fn`` applied to every item of a chunk (a picklable callable, for Ray tasks)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, chunk: Sequence[Any]) -> list[Any]:
        return _apply_all(self.fn, chunk)


def executor_width(executor: Executor) -> int:
    """How many items ``executor`` runs at once: ``executor.__self__.parallel_width()`` for a federation's bound
    ``parallel_map`` (on Ray: the cluster's CPUs over the CPUs per task), else this machine's CPUs."""
    width = getattr(getattr(executor, "__self__", None), "parallel_width", None)
    return max(1, int(width())) if callable(width) else max(1, os.cpu_count() or 1)


def balanced_chunks(n_items: int, workers: int, *, max_waves: int = 4) -> int:
    """The number of chunks for ``n_items`` equal-cost items on ``workers`` workers.

    Among ``workers, 2 x workers, ...`` (at most ``max_waves`` waves), the count whose makespan (waves x chunk size)
    is smallest, the fewest chunks on a tie: 10 items on 2 workers -> 2 chunks of 5 (the default of 4 chunks would
    give 3 + 3 + 3 + 1, a makespan of 6 items instead of 5); 5 on 2 -> 2 chunks of 3 and 2.
    """
    if n_items <= 0:
        return 0
    workers = max(1, workers)
    best, best_span = 1, math.inf
    for waves in range(1, max_waves + 1):
        count = min(n_items, waves * workers)
        size = math.ceil(n_items / count)
        chunks = math.ceil(n_items / size)
        span = math.ceil(chunks / workers) * size
        if span < best_span:
            best, best_span = chunks, span
        if count == n_items:
            break
    return best


def map_chunked(fn: Callable[[Any], T], items: Sequence[Any], executor: Executor | None = None, *, chunks: int | None = None) -> list[T]:
    """``[fn(item) for item in items]`` through ``executor``, batched into ``chunks`` chunks (default
    :func:`balanced_chunks` over :func:`executor_width`)."""
    items = list(items)
    if not items:
        return []
    executor = executor or thread_map
    if executor is serial_map or len(items) == 1:
        return [fn(item) for item in items]
    count = chunks or balanced_chunks(len(items), executor_width(executor))
    size = max(1, math.ceil(len(items) / count))
    batches = [items[i : i + size] for i in range(0, len(items), size)]
    return [value for batch in executor(_ChunkFn(fn), batches) for value in batch]


def solve_assignment(cost: np.ndarray, *, where: str = "cost") -> np.ndarray:
    """Minimum-cost assignment of every row of ``cost`` (``n_rows <= n_cols``) to a distinct column.

    Returns the column of each row (``int64``, length ``n_rows``). Raises :class:`InputError` for a cost that is not
    a finite 2-D array with at most as many rows as columns.
    """
    cost = np.asarray(cost)
    if cost.ndim != 2 or cost.shape[0] > cost.shape[1]:
        raise InputError(where, "a 2-D cost matrix with at most as many rows as columns", f"shape {cost.shape}")
    if cost.dtype.kind not in "fiu":
        raise InputError(where, "a numeric cost matrix", str(cost.dtype))
    try:
        rows, cols = linear_sum_assignment(cost)
    except ValueError as exc:  # scipy raises for NaN entries, and for Inf entries that leave no complete assignment
        raise NonFiniteError(f"{where}: the cost matrix has NaN or infinite entries ({exc})") from None
    if rows.shape[0] != cost.shape[0]:  # scipy only omits rows when the matrix is infeasible (NaN / Inf entries)
        raise NonFiniteError(f"{where}: the cost matrix has NaN or infinite entries; no complete assignment exists")
    out = np.empty(cost.shape[0], dtype=np.int64)
    out[rows] = cols
    return out


def _solve_checked(cost: np.ndarray) -> np.ndarray:
    if not np.isfinite(cost).all():
        raise NonFiniteError(f"cost matrix of shape {cost.shape} has NaN or Inf entries")
    return solve_assignment(cost)


def solve_assignments(costs: Sequence[np.ndarray], executor: Executor | None = None, *, chunks: int | None = None) -> list[np.ndarray]:
    """:func:`solve_assignment` of every cost matrix, fanned out through ``executor`` (default: threads) in chunks."""
    return map_chunked(_solve_checked, list(costs), executor, chunks=chunks)
