"""The benchmarks under ``benchmarks/`` still run on the current engine (a benchmark that no check runs rots).

``bench_round``'s round loop runs at a tiny size on the session's local Ray, through the real coordinator actor and
``MethodServer`` (the acceptance path the engine uses); the scripts are imported as ``python benchmarks/<script>.py``
imports them (their folder on ``sys.path``), and their modules are pickled by value for the actors, whose ``sys.path``
lacks that folder (``actors.backend.pickled_by_value``, as a run does for a script's classes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench_round():
    """``benchmarks/bench_round.py`` as a module (with its sibling ``_common`` and ``_steps``)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_round

        yield bench_round
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.ray
@pytest.mark.parametrize("per_actor", [1, 2], ids=["one-actor-per-client", "2-clients-per-actor"])
def test_bench_round_runs_its_rounds_on_ray(ray_session, bench_round, per_actor):
    from actors.backend import pickled_by_value

    cells = [bench_round.Cell(3, 1_000, per_actor=per_actor)]
    with pickled_by_value(["bench_round", "_steps", "_common"]):
        result = bench_round.run_cells_on_ray(cells, rounds=2, warmup=1, store_bytes=2**30, cpus=2, max_load=1e9, quiet_timeout_s=0)
    assert result["skipped"] == []
    [row] = result["rows"]
    assert row["cell"] == cells[0].label and row["actors"] == (3 if per_actor == 1 else 2)
    assert row["rounds_timed"] == 2 and len(row["round_times_s"]) == 2
    for key in ("round_s", "validate_aggregate_s", "aggregate_s", "bare_round_s"):
        assert row[key] > 0, key
    assert row["round_s"] >= row["validate_aggregate_s"]
    # only the timing dict reaches the driver: the parameters moved through the object store
    assert 0 < row["driver_bytes_received"] < 20_000
    assert not {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)} & {"bench-round/coordinator"}


def test_bench_round_skips_a_cell_the_object_store_cannot_hold(bench_round):
    reason = bench_round.skip_reason(bench_round.Cell(100, 25_000_000), store_bytes=2**30)
    assert reason is not None and "object store" in reason
    assert bench_round.skip_reason(bench_round.Cell(3, 1_000), store_bytes=2**30) is None
