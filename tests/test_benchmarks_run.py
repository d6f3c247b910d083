"""The benchmarks under ``benchmarks/`` still run on the current engine (a benchmark that no check runs rots).

``bench_round``'s round loop runs at a tiny size on the session's local Ray, through the real coordinator actor and
``MethodServer`` (the acceptance path the engine uses); the scripts are imported as ``python benchmarks/<script>.py``
imports them (their folder on ``sys.path``), and their modules are pickled by value for the actors, whose ``sys.path``
lacks that folder (``actors.backend.pickled_by_value``, as a run does for a script's classes).
"""

from __future__ import annotations

import json
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

    # the secure round once, on packed actors (tests/updates/test_secure_rounds.py and the aggregation modes' Ray test
    # cover it otherwise)
    modes = [m for m in bench_round.cell_modes(per_actor) if m != "secure" or per_actor > 1]
    cells = [bench_round.Cell(3, 1_000, per_actor=per_actor, mode=mode) for mode in modes]
    with pickled_by_value(["bench_round", "_steps", "_common"]):
        result = bench_round.run_cells_on_ray(cells, rounds=2, warmup=1, store_bytes=2**30, cpus=2, max_load=1e9, quiet_timeout_s=0)
    assert result["skipped"] == []
    assert [row["mode"] for row in result["rows"]] == (
        ["flat", "gathered"] if per_actor == 1 else ["flat", "per_actor", "gathered", "secure"]
    )
    for row, cell in zip(result["rows"], cells):
        assert row["cell"] == cell.label and row["actors"] == (3 if per_actor == 1 else 2)
        assert row["rounds_timed"] == 2 and len(row["round_times_s"]) == 2
        for key in ("round_s", "aggregate_s", "bare_round_s"):
            assert row[key] > 0, key
        # each process's peak resident set over the timed rounds (Linux): coordinator, driver, every client actor
        processes = {k: v for k, v in row["peak_memory"].items() if k != "object_store"}  # and the store's use
        assert {"coordinator", "driver"} <= set(processes) and len(processes) == 2 + row["actors"]
        assert all(p["peak_bytes"] >= p["rest_bytes"] > 0 and p["anon_peak_bytes"] >= p["anon_rest_bytes"] > 0 for p in processes.values())
        # only the timing dict reaches the driver: the parameters moved through the object store
        assert 0 < row["driver_bytes_received"] < 20_000
    assert not {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)} & {"bench-round/coordinator"}


def test_bench_round_skips_a_cell_the_object_store_cannot_hold(bench_round):
    reason = bench_round.skip_reason(bench_round.Cell(100, 25_000_000), store_bytes=2**30)
    assert reason is not None and "object store" in reason
    assert bench_round.skip_reason(bench_round.Cell(3, 1_000), store_bytes=2**30) is None


@pytest.mark.ray
def test_compare_flower_runs_without_flower_and_says_so_in_one_line(ray_session, bench_round, monkeypatch, tmp_path, capsys):
    """compare_flower.py's quick mode (its line in benchmarks/quick.txt, run here rather than there: on the session's
    Ray instead of one of its own), no Flower environment: the rayfuse side runs, one line says why Flower was not
    measured, and the comparison is written, finite."""
    import _common  # noqa: F401  (the script's sibling, imported as the script imports it)
    import compare_flower

    from actors.backend import pickled_by_value
    from tests.test_benchmarks_quick import EXPECTED, finite_numbers

    monkeypatch.setattr(compare_flower, "run_cells", bench_round.run_cells_on_ray)  # the session's Ray, not a new one
    missing = tmp_path / "no-flwr-venv" / "bin" / "python"
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["compare_flower.py", "--quick", "--out", str(out), "--flower-python", str(missing)])
    with pickled_by_value(["bench_round", "_steps", "_common"]):
        compare_flower.main()
    printed = capsys.readouterr().out
    [line] = [line for line in printed.splitlines() if line.strip().startswith("Flower not measured")]
    assert line.strip() == f"Flower not measured: no Flower environment at {missing} (see the usage in this script's docstring)"
    assert "Traceback" not in printed
    name, keys = EXPECTED["benchmarks/compare_flower.py"]
    payload = json.loads((out / name).read_text())
    assert keys <= set(payload) and finite_numbers(payload, name) > 0
    assert payload["quick"] is True and payload["flower"] is None and payload["flower_error"].startswith("no Flower environment")
    assert payload["comparison"] and all(row["rayfuse_round_s"] > 0 and row["target_met"] is None for row in payload["comparison"])


def test_bench_aggregate_quick_runs(bench_round, monkeypatch, tmp_path, capsys):
    """bench_aggregate.py --quick with one pass: every kernel checked against np.average and timed (no Ray)."""
    import bench_aggregate
    from threadpoolctl import threadpool_info, threadpool_limits

    # a quick run writes to --out (default: a new temporary folder), never over the full run's results
    monkeypatch.setattr(sys, "argv", ["bench_aggregate.py", "--quick", "--repeats", "1", "--quiet-timeout", "0", "--out", str(tmp_path)])
    before = [lib["num_threads"] for lib in threadpool_info()]
    with threadpool_limits(limits=None, user_api="blas"):  # restores the BLAS threads main() limits to one
        bench_aggregate.main()
    assert [lib["num_threads"] for lib in threadpool_info()] == before
    payload = json.loads((tmp_path / "bench_aggregate.json").read_text())
    assert {r["method"] for r in payload["rows"]} >= {"weighted_average", "weighted_sum", "np.copyto"}
    assert all(r["gb_s"] > 0 for r in payload["rows"])
    assert "Traceback" not in capsys.readouterr().out
