"""Flower's Ray simulation doing the work of ``bench_round.py``'s target cells: rounds with no local training.

Run it with the Python of the separate Flower environment (Flower pins its own Ray version)::

    benchmarks/.flwr-venv/bin/python benchmarks/flower_round.py [--cells 100x100000 20x10000000] [--rounds 5]

Each cell is one ``flwr.simulation.start_simulation`` run: N ``NumPyClient`` s whose ``fit`` returns a copy of the
received parameters (like ``bench_round``'s echo step), Flower's ``FedAvg`` with every client in every round
(``fraction_fit=1``, ``min_fit_clients = min_available_clients = N``) and no evaluation. A round is timed from the
strategy's ``configure_fit`` to the end of its ``aggregate_fit`` (the aggregation itself is reported too); the
first ``--warmup`` rounds are not timed. Writes ``benchmarks/results/flower_round.json`` (and prints the same
JSON as the last line of its output for ``compare_flower.py``); ``--out DIR`` writes there instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no network here; set before flwr is imported

import flwr
import numpy as np
import ray
from _common import machine_info, median, out_dir, wait_for_quiet, write_results
from flwr.client import NumPyClient
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import start_simulation

NUM_EXAMPLES = 144  # a client's training examples; any positive count gives the same work


class EchoClient(NumPyClient):
    """No local training: ``fit`` returns a copy of the parameters it received."""

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        return [p.copy() for p in parameters], NUM_EXAMPLES, {}


def client_fn(context: Context) -> flwr.client.Client:
    return EchoClient().to_client()


class TimedFedAvg(FedAvg):
    """Flower's ``FedAvg`` with per-round timestamps (round = ``configure_fit`` start to ``aggregate_fit`` end)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.started: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.aggregate_s: dict[int, float] = {}

    def configure_fit(self, server_round, parameters, client_manager):
        self.started[server_round] = time.perf_counter()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        if failures:
            raise RuntimeError(f"round {server_round}: {len(failures)} clients failed: {failures[0]!r}")
        start = time.perf_counter()
        out = super().aggregate_fit(server_round, results, failures)
        self.finished[server_round] = time.perf_counter()
        self.aggregate_s[server_round] = self.finished[server_round] - start
        return out


def run_cell(clients: int, num_params: int, *, rounds: int, warmup: int, cpus: int, client_cpus: float, store_bytes: int) -> dict:
    """One simulation of ``warmup + rounds`` rounds; timings of the last ``rounds``."""
    initial = [np.random.default_rng(0).uniform(0.5, 1.5, num_params).astype(np.float32)]
    strategy = TimedFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=clients,
        min_evaluate_clients=0,
        min_available_clients=clients,
        initial_parameters=ndarrays_to_parameters(initial),
        fit_metrics_aggregation_fn=lambda metrics: {},
    )
    started = time.perf_counter()
    start_simulation(
        client_fn=client_fn,
        num_clients=clients,
        config=ServerConfig(num_rounds=warmup + rounds),
        strategy=strategy,
        client_resources={"num_cpus": client_cpus, "num_gpus": 0.0},
        ray_init_args={
            "address": "local",
            "num_cpus": cpus,
            "include_dashboard": False,
            "object_store_memory": store_bytes,
            "log_to_driver": False,
        },
    )
    total_s = time.perf_counter() - started
    timed = range(warmup + 1, warmup + rounds + 1)
    round_s = [strategy.finished[r] - strategy.started[r] for r in timed]
    return {
        "clients": clients,
        "num_params": num_params,
        "param_bytes": 4 * num_params,
        "client_cpus": client_cpus,
        "rounds_timed": rounds,
        "round_s": median(round_s),
        "aggregate_s": median([strategy.aggregate_s[r] for r in timed]),
        "round_times_s": round_s,
        "startup_s": strategy.started[1] - started,
        "total_s": total_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", default=["100x100000", "20x10000000"], help="CLIENTSxFLOAT32_PARAMS")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per cell")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--cpus", type=int, default=2, help="num_cpus for ray.init")
    parser.add_argument("--client-cpus", type=float, default=1.0, help="client_resources num_cpus (pool size = cpus / this)")
    parser.add_argument("--object-store-gib", type=float, default=4.0)
    parser.add_argument("--max-load", type=float, default=1.0, help="before each cell, wait for the 1-min load average to drop below this")
    parser.add_argument("--quiet-timeout", type=float, default=60.0, help="... for at most this many seconds")
    parser.add_argument("--out", type=Path, default=None, help="folder for flower_round.json (default benchmarks/results/)")
    args = parser.parse_args()

    logging.getLogger("flwr").setLevel(logging.WARNING)
    rows = []
    for spec in args.cells:
        clients, num_params = (int(x) for x in spec.split("x"))
        load = wait_for_quiet(args.max_load, args.quiet_timeout)
        row = run_cell(
            clients,
            num_params,
            rounds=args.rounds,
            warmup=args.warmup,
            cpus=args.cpus,
            client_cpus=args.client_cpus,
            store_bytes=int(args.object_store_gib * 2**30),
        )
        row["load_avg_1m"] = load
        rows.append(row)
        print(
            f"flower {clients} x {4 * num_params / 1e6:g} MB: median round {row['round_s']:.3f} s "
            f"(aggregate_fit {row['aggregate_s']:.3f} s), pool start {row['startup_s']:.1f} s, load {load:.1f}",
            flush=True,
        )
    payload = {"machine": machine_info(), "flwr": flwr.__version__, "ray": ray.__version__, "rows": rows}
    write_results("flower_round", payload, out_dir(args.out, False))
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
