"""Per-round time of a fedavg-style round on the real Ray engine, with no local training.

Each cell (number of clients x parameter bytes per client) starts real ``actors.client.ClientActor`` s, created as
``actors/backend.py`` creates them, each holding an iid shard of the numpy-only ``synthetic`` dataset, and the engine's
coordinator actor (:class:`RoundCoordinator`, an ``actors.coordinator.CoordinatorActor``: its ``RayFederation`` over the
client handles, its ``rayfuse.coordinator.Coordinator``) with a real ``MethodServer`` of the config's ``fedavg``. The
coordinator runs the rounds and returns only timings: parameters move through Ray's object store and never through
the driver (the driver's received bytes are reported). One round does what
``rayfuse.fusion.fedavg.algorithm.FedAvg.run`` does:

1. ``server.updates.sample_clients(fraction, round)`` (every client at ``fraction: 1``) and ``federation.put(global_params)``:
   one broadcast object;
2. ``federation.run(echo_step, ref, clients=...)``: every client returns a *copy* of the broadcast in an ``Update``
   (new memory, as a trained update would be); ``gather`` applies the failure policy;
3. + 4. ``server.updates.collect`` (the update pipeline, :mod:`rayfuse.fusion.pipeline`) with FedAvg's default
   aggregator (the plain mean), as FedAvg's round calls it: each update's structure is checked (keys, shapes, dtypes,
   sample counts against the partition plan, metrics) through ``accept_replies``, the updates are averaged with
   ``weighted_average`` weighted by their sample counts, and the average is scanned for NaN / Inf (a non-finite
   average would send every update through the full scan).

Reported per cell: the median round time, the time of ``collect`` (validate + aggregate), the time of the
bare ``weighted_average`` on the same updates (measured after the round, outside it), the clients' copy time and
the *overhead* = round - bare aggregation - client copy wall time. The copy wall time is the clients' summed copy CPU time
divided by the CPUs that run them at once: a lower bound on what the copies cost the round, so the overhead is not
understated. As a reference measured in the same run, every federation round is followed by a *bare Ray* round on
the same actors: ``ray.put``, one ``ClientActor.run`` call per client, one ``ray.get`` of all results and the same
``weighted_average``, with no failure policy and no validation; ``rayfuse / bare`` is the engine's cost over Ray's.

Actor startup is measured separately. Cells whose objects would not fit the object store or the available memory
are skipped, and the output says so.

Usage::

    python benchmarks/bench_round.py                      # the grid and the two target cells
    python benchmarks/bench_round.py --cells targets      # 100 x 400 KB and 20 x 40 MB only
    python benchmarks/bench_round.py --clients 10 50 --sizes 100KB 10MB --rounds 5

Writes ``benchmarks/results/bench_round.json``. Ray workers import ``_steps`` (the echo step) and this module from
``benchmarks/``, which Ray puts on their ``sys.path`` as the driver script's folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from _common import machine_info, median, memory_bytes, print_table, wait_for_quiet, write_results
from _steps import echo_step
from ray import cloudpickle

from actors.backend import actor_options
from actors.client import ClientActor, RefArg, actor_name
from actors.coordinator import CoordinatorActor
from rayfuse.config import validate_config
from rayfuse.data.roles import load_dataset_from_config, make_plan

NAMESPACE = "rayfuse-bench"
WORKER_BYTES = 100 * 2**20  # memory budget per client worker (measured: ~65 MB proportional set size)
COORDINATOR_BYTES = 600 * 2**20  # the coordinator imports torch through rayfuse.coordinator (measured: ~450 MB)
SIZES = {"100KB": 25_000, "400KB": 100_000, "10MB": 2_500_000, "40MB": 10_000_000, "100MB": 25_000_000}  # float32 counts
TIMED_KEYS = ("round_s", "put_s", "map_gather_s", "validate_aggregate_s", "aggregate_s", "client_copy_sum_s", "bare_round_s")


@dataclass(frozen=True)
class Cell:
    clients: int
    num_params: int  # float32 values per client
    target: bool = False
    per_actor: int = 1  # federation.clients_per_actor: 1 is one actor per client (deployment), more is the simulation mode

    @property
    def param_bytes(self) -> int:
        return 4 * self.num_params

    @property
    def actors(self) -> int:
        return -(-self.clients // self.per_actor)

    @property
    def label(self) -> str:
        mb = self.param_bytes / 1e6
        size = f"{self.clients} x {mb:g} MB" if mb >= 1 else f"{self.clients} x {self.param_bytes / 1e3:g} KB"
        return size if self.per_actor == 1 else f"{size} ({self.per_actor}/actor)"


# The two target cells, in the deployment layout (one actor per client) and in the simulation layout
# (federation.clients_per_actor = clients / CPUs, like Flower's actor pool of a few workers).
TARGET_CELLS = [
    Cell(100, 100_000, target=True),
    Cell(20, 10_000_000, target=True),
    Cell(100, 100_000, target=True, per_actor=50),
    Cell(20, 10_000_000, target=True, per_actor=10),
]


class RoundCoordinator(CoordinatorActor):
    """The engine's coordinator actor, running fedavg-style rounds; returns timings only.

    It *is* an ``actors.coordinator.CoordinatorActor`` (the ``RayFederation`` over the client handles with the
    config's failure policy, task CPUs and restart timeout, the event log, the dashboard metrics and the
    ``rayfuse.coordinator.Coordinator``), and a round runs through a real ``MethodServer`` of the config's ``fedavg``
    method: the same objects a run uses, so the benchmark cannot drift from the engine's acceptance path.

    Parameters
    ----------
    cfg : rayfuse.config.ExperimentConfig
    plan : rayfuse.data.roles.DataPlan
        Gives each client's planned sample count (checked against the updates' counts).
    run_dir : str
        The run folder the coordinator would write into; a benchmark round writes nothing (no checkpoint, no model).
    clients : dict of client id to ``ClientActor`` handle
    groups : list of list of int
        The clients each actor hosts (``federation.clients_per_actor``).
    """

    def __init__(self, cfg: Any, plan: Any, run_dir: str, clients: dict[int, Any], groups: list[list[int]]) -> None:
        from rayfuse.coordinator import MethodServer

        super().__init__(cfg, plan, run_dir, clients, time.time())
        self.federation = self.coordinator.federation
        self.groups = [(clients[members[0]], members) for members in groups]  # (actor handle, hosted clients)
        self.server = MethodServer(self.coordinator, self.coordinator.specs[0], resume=False)  # the config's fedavg

    def run_rounds(self, num_params: int, rounds: int, warmup: int, seed: int = 0) -> dict[str, Any]:
        """Run ``warmup + rounds`` pairs of (federation round, bare Ray round); return the last ``rounds`` timings."""
        from rayfuse.fusion.aggregate import weighted_average

        fed, server = self.federation, self.server
        p = server.params  # FedAvgParams: fraction, aggregator and weighting as FedAvg.run reads them
        start_params = {"w": np.random.default_rng(seed).uniform(0.5, 1.5, num_params).astype(np.float32)}
        global_params = start_params
        timings = []
        for rnd in range(warmup + rounds):
            t0 = time.perf_counter()
            clients = server.updates.sample_clients(p.fraction, rnd + 1)
            broadcast = fed.put(global_params)
            t1 = time.perf_counter()
            gathered = fed.run(echo_step, broadcast, clients=clients)
            t2 = time.perf_counter()
            result = server.updates.collect(gathered, global_params, rnd + 1, weighted=p.weighted)
            global_params, updates = result.params, result.updates
            t4 = time.perf_counter()
            copies = [u.metrics["copy_s"] for u in updates.values()]
            t_agg = time.perf_counter()  # the bare aggregation on the same updates, outside the round
            weighted_average([u.params for u in updates.values()], [u.num_examples for u in updates.values()])
            aggregate_s = time.perf_counter() - t_agg
            del gathered, updates

            bare_ref = ray.put(global_params)
            batches = ray.get(
                [h.run_many.remote([(i, echo_step, (RefArg(0),), {}) for i in members], bare_ref) for h, members in self.groups]
            )
            bare = [value for batch in batches for _, value in batch]
            weighted_average([u.params for u in bare], [u.num_examples for u in bare])
            t5 = time.perf_counter()
            del bare, bare_ref
            if rnd >= warmup:
                timings.append(
                    {
                        "round_s": t4 - t0,
                        "put_s": t1 - t0,
                        "map_gather_s": t2 - t1,
                        "validate_aggregate_s": t4 - t2,
                        "aggregate_s": aggregate_s,
                        "client_copy_sum_s": float(np.sum(copies)),
                        "bare_round_s": t5 - t_agg - aggregate_s,
                    }
                )
        # Echo rounds average identical copies: the model must come back unchanged (up to float32 rounding).
        np.testing.assert_allclose(global_params["w"], start_params["w"], rtol=1e-5)
        return {"rounds": timings}


class DriverLink:
    """``ray.get`` that counts the serialized bytes the driver receives."""

    def __init__(self) -> None:
        self.bytes_received = 0

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        value = ray.get(ref, timeout=timeout)
        self.bytes_received += len(cloudpickle.dumps(value))
        return value


def bench_config(num_clients: int) -> Any:
    """A validated config: ``num_clients`` iid shards of the numpy-only synthetic dataset."""
    return validate_config(
        {
            "run": {"name": "bench-round", "seed": 0},
            "data": {"dataset": "synthetic", "options": {"n_samples": 20000}},
            "partition": {"method": "iid", "num_clients": num_clients},
            "federation": {"on_client_failure": "fail"},
            "methods": {"fedavg": {"local_epochs": 0}},
        }
    )


def start_actors(num_clients: int, per_actor: int, link: DriverLink) -> tuple[list[Any], Any, float]:
    """Start the client actors (as ``actors.backend.RayBackend.start`` does) and the coordinator; wait for all."""
    cfg = bench_config(num_clients)
    plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)
    fed = cfg.federation
    started = time.perf_counter()
    client_cls = ray.remote(ClientActor)
    groups = [list(range(first, min(first + per_actor, num_clients))) for first in range(0, num_clients, per_actor)]
    clients: dict[int, Any] = {}
    for members in groups:
        handle = client_cls.options(
            name=actor_name("bench-round", members),
            namespace=NAMESPACE,
            max_restarts=fed.max_restarts,
            max_task_retries=0,
            **actor_options(fed.clients),
        ).remote(
            [(i, plan.for_client(i)) for i in members],
            data_cfg=cfg.data,
            model_cfg=cfg.model,
            train_cfg=cfg.train,
            seed=cfg.run.seed,
            faults=fed.faults,
        )
        clients.update({i: handle for i in members})
    actors = [clients[members[0]] for members in groups]
    # as actors.backend.RayBackend.start creates the coordinator actor (a threaded actor, max_concurrency=4)
    coordinator = (
        ray.remote(RoundCoordinator)
        .options(name="bench-round/coordinator", namespace=NAMESPACE, max_concurrency=4, max_restarts=0, **actor_options(fed.coordinator))
        .remote(cfg, plan, str(Path(tempfile.gettempdir()) / "bench-round"), clients, groups)
    )
    link.get([a.ping.remote() for a in actors] + [coordinator.ready.remote()], timeout=fed.startup_timeout_s)
    return actors, coordinator, time.perf_counter() - started


def stop_actors(actors: list[Any], coordinator: Any) -> None:
    for handle in [*actors, coordinator]:
        ray.kill(handle, no_restart=True)
    time.sleep(2.0)  # let the worker processes exit and give their memory back before the next cell


def skip_reason(cell: Cell, store_bytes: int) -> str | None:
    """Why ``cell`` cannot run here, or ``None``.

    At the peak of a round the object store holds two rounds of updates and broadcasts (like ``FedAvg.run``, the
    coordinator still references the previous round's updates while the next round's arrive), and each client
    briefly holds its copy on its heap before Ray serializes it into the store.
    """
    store_need = 2 * (cell.clients + 1) * cell.param_bytes
    if store_need > 0.8 * store_bytes:
        return f"needs ~{store_need / 2**30:.1f} GiB of object store at peak; the store has {store_bytes / 2**30:.1f} GiB"
    heap_need = cell.clients * (WORKER_BYTES + cell.param_bytes) + COORDINATOR_BYTES + 2 * cell.param_bytes
    available = memory_bytes()[1]
    if store_need + heap_need > 0.8 * available:
        return f"needs ~{(store_need + heap_need) / 2**30:.1f} GiB of RAM; {available / 2**30:.1f} GiB available"
    return None


def summarize(cell: Cell, timings: list[dict[str, float]], cpus: int) -> dict[str, Any]:
    """Medians of the per-round timings, the overhead and the ratio to the bare Ray round."""
    parallel = max(1, min(cpus, cell.actors))  # the clients of one actor copy one after another
    row: dict[str, Any] = {
        "cell": cell.label,
        "clients": cell.clients,
        "clients_per_actor": cell.per_actor,
        "actors": cell.actors,
        "param_bytes": cell.param_bytes,
        "target": cell.target,
        "rounds_timed": len(timings),
    }
    for key in TIMED_KEYS:
        row[key] = median([t[key] for t in timings])
    row["client_copy_wall_s"] = median([t["client_copy_sum_s"] / parallel for t in timings])
    row["overhead_s"] = median([t["round_s"] - t["aggregate_s"] - t["client_copy_sum_s"] / parallel for t in timings])
    row["vs_bare"] = median([t["round_s"] / t["bare_round_s"] for t in timings])
    row["object_store_bytes_per_round"] = (cell.clients + 1) * cell.param_bytes
    row["round_times_s"] = [t["round_s"] for t in timings]
    return row


def timed_rounds(cell: Cell, rounds: int) -> int:
    """Fewer timed rounds for cells that move more than 1 GB per round."""
    return rounds if cell.clients * cell.param_bytes <= 1e9 else max(3, rounds // 2)


def run_cells(
    cells: list[Cell], *, rounds: int, warmup: int, store_bytes: int, cpus: int = 2, max_load: float = 1.0, quiet_timeout_s: float = 60.0
) -> dict[str, Any]:
    """Start Ray once, run every cell (:func:`run_cells_on_ray`), stop Ray; return rows and skips."""
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        object_store_memory=store_bytes,
        namespace=NAMESPACE,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        return run_cells_on_ray(
            cells, rounds=rounds, warmup=warmup, store_bytes=store_bytes, cpus=cpus, max_load=max_load, quiet_timeout_s=quiet_timeout_s
        )
    finally:
        ray.shutdown()


def run_cells_on_ray(
    cells: list[Cell], *, rounds: int, warmup: int, store_bytes: int, cpus: int = 2, max_load: float = 1.0, quiet_timeout_s: float = 60.0
) -> dict[str, Any]:
    """Run every cell on the Ray this process is connected to (actors started once per client count and layout,
    killed after); return rows and skips. ``store_bytes``: that Ray's object store, for :func:`skip_reason`."""
    rows, skipped, startups = [], [], {}
    link = DriverLink()
    for num_clients, per_actor in sorted({(c.clients, c.per_actor) for c in cells}):
        runnable = []
        for cell in (c for c in cells if (c.clients, c.per_actor) == (num_clients, per_actor)):
            reason = skip_reason(cell, store_bytes)
            if reason:
                print(f"  skip {cell.label}: {reason}", flush=True)
                skipped.append({"cell": cell.label, "reason": reason})
            else:
                runnable.append(cell)
        if not runnable:
            continue
        actors, coordinator, startup_s = start_actors(num_clients, per_actor, link)
        startups[f"{num_clients}/{per_actor}"] = startup_s
        print(f"  {len(actors)} client actors ({num_clients} clients) + coordinator up in {startup_s:.1f} s", flush=True)
        try:
            for cell in runnable:
                n = timed_rounds(cell, rounds)
                load = wait_for_quiet(max_load, quiet_timeout_s)
                before = link.bytes_received
                result = link.get(coordinator.run_rounds.remote(cell.num_params, n, warmup))
                row = summarize(cell, result["rounds"], cpus)
                row.update(driver_bytes_received=link.bytes_received - before, startup_s=startup_s, load_avg_1m=load)
                rows.append(row)
                print(
                    f"  {cell.label}: median round {row['round_s'] * 1e3:.1f} ms, overhead {row['overhead_s'] * 1e3:.1f} ms, "
                    f"bare Ray round {row['bare_round_s'] * 1e3:.1f} ms ({n} rounds after {warmup} warm-up, "
                    f"load {load:.1f})",
                    flush=True,
                )
        finally:
            stop_actors(actors, coordinator)
    return {"rows": rows, "skipped": skipped, "startup_s": startups}


def grid(clients: list[int], sizes: list[str], per_actor: list[int]) -> list[Cell]:
    """The grid plus the target cells (a target cell that is also a grid cell is kept once, marked as a target)."""
    cells = {
        (c.clients, c.num_params, c.per_actor): c
        for c in (Cell(n, SIZES[s], per_actor=k) for n in clients for s in sizes for k in per_actor)
    }
    for target in TARGET_CELLS:
        cells[(target.clients, target.num_params, target.per_actor)] = target
    return sorted(cells.values(), key=lambda c: (c.clients, c.per_actor, c.num_params))


def default_store_bytes() -> int:
    """8 GiB, or a third of the available RAM when that is less (Ray's default is 30% of RAM)."""
    return int(min(8 * 2**30, memory_bytes()[1] / 3))


def print_rows(rows: list[dict[str, Any]]) -> None:
    ms_keys = ("round_s", "put_s", "validate_aggregate_s", "aggregate_s", "client_copy_wall_s", "overhead_s", "bare_round_s")
    shown = [{**r, **{k: 1e3 * r[k] for k in ms_keys}, "target": "yes" if r["target"] else ""} for r in rows]
    print_table(
        shown,
        [
            ("cell", "clients x params"),
            ("target", "target"),
            ("round_s", "round ms"),
            ("put_s", "put ms"),
            ("validate_aggregate_s", "validate+aggregate ms"),
            ("aggregate_s", "bare aggregate ms"),
            ("client_copy_wall_s", "client copy ms"),
            ("overhead_s", "overhead ms"),
            ("bare_round_s", "bare Ray ms"),
            ("vs_bare", "x bare"),
            ("driver_bytes_received", "driver bytes"),
            ("startup_s", "startup s"),
            ("load_avg_1m", "load"),
        ],
        "rayfuse round on Ray (medians; overhead = round - aggregate - client copy wall time)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", choices=["grid", "targets"], default="grid", help="targets: only the two target cells")
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--sizes", nargs="+", default=["100KB", "10MB", "100MB"], choices=sorted(SIZES))
    parser.add_argument("--clients-per-actor", type=int, nargs="+", default=[1], help="federation.clients_per_actor values for the grid")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per cell (halved above 1 GB per round)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--cpus", type=int, default=2, help="num_cpus for ray.init")
    parser.add_argument("--object-store-gib", type=float, default=None, help="default: 8, or a third of the available RAM")
    parser.add_argument("--max-load", type=float, default=1.0, help="before each cell, wait for the 1-min load average to drop below this")
    parser.add_argument("--quiet-timeout", type=float, default=60.0, help="... for at most this many seconds")
    args = parser.parse_args()

    cells = list(TARGET_CELLS) if args.cells == "targets" else grid(args.clients, args.sizes, args.clients_per_actor)
    store_bytes = int(args.object_store_gib * 2**30) if args.object_store_gib else default_store_bytes()
    info = machine_info()
    print(
        f"rayfuse round benchmark: {len(cells)} cells, Ray {ray.__version__}, num_cpus={args.cpus}, "
        f"object store {store_bytes / 2**30:.1f} GiB, {info['cpus']} CPUs, load average {info['load_avg_1m']:.2f}",
        flush=True,
    )
    result = run_cells(
        cells,
        rounds=args.rounds,
        warmup=args.warmup,
        store_bytes=store_bytes,
        cpus=args.cpus,
        max_load=args.max_load,
        quiet_timeout_s=args.quiet_timeout,
    )
    print_rows(result["rows"])
    for skip in result["skipped"]:
        print(f"skipped {skip['cell']}: {skip['reason']}")
    path = write_results(
        "bench_round",
        {
            "machine": info,
            "ray": ray.__version__,
            "num_cpus": args.cpus,
            "object_store_bytes": store_bytes,
            "cells": [asdict(c) for c in cells],
            **result,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
