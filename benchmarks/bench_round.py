"""Per-round time of a fedavg-style round on the real Ray engine, with no local training.

Each cell (number of clients x parameter bytes per client) starts real ``actors.client.ClientActor`` s, created as
``actors/backend.py`` creates them, each holding an iid shard of the numpy-only ``synthetic`` dataset, and the engine's
coordinator actor (:class:`RoundCoordinator`, an ``actors.coordinator.CoordinatorActor``: its ``RayFederation`` over the
client handles, its ``rayfuse.coordinator.Coordinator``) with a real ``MethodServer`` of the config's ``fedavg``. The
coordinator runs the rounds and returns only timings: parameters move through Ray's object store and never through
the driver (the driver's received bytes are reported). One round does what
``rayfuse.fusion.fedavg.algorithm.FedAvg.run`` does: the round's cohort (``server.updates.cohort(round)``, what the
round loop's ``cohorts()`` hands the method: every client at ``fraction: 1``), then
``server.updates.collect_round(echo_step, global_params, clients, round)``, FedAvg's round:
one broadcast (``federation.put``), every client returns a *copy* of the broadcast in an ``Update`` (new memory, as a
trained update would be), and the update pipeline aggregates them with FedAvg's default aggregator (the weighted mean)
in the cell's mode:

* ``flat`` (streaming, the default): the coordinator folds each reply into a running sum as it arrives (at each
  wake-up, every finished actor call whose replies fit the federation's fetch budget, one ``ray.get``; ``--fetch-bytes
  0`` adds flat cells that take one actor call per wake-up, the stream before batching), after validating it (keys,
  shapes, dtypes, finite values, sample counts against the partition plan, metrics), and drops it;
* ``per_actor`` (streaming, ``clients_per_actor > 1``): each actor validates and sums its clients' copies and sends one
  partial sum;
* ``gathered`` (``federation.streaming: false``): every reply is gathered first, then validated and averaged;
* ``secure`` (``federation.secure_aggregation: true``, ``--aggregation secure``): SecAgg+ over the same actors
  (``rayfuse.updates.secure``): four calls on the cohort (keys, encrypted shares, the echo step with its copy encoded
  and masked, the unmasking shares) and the server's unmasking of the sum; ``x plain`` is its round time over the same
  cell's streamed round (per_actor where the actors host several clients, else flat), run on the same actors.

Reported per cell: the median round time; the bare aggregation (``weighted_average`` of the bare round's updates); the
clients' copy time and the *overhead* = round - bare aggregation - client copy wall time. The copy wall time is the
clients' summed copy CPU time divided by the CPUs that run them at once: a lower bound on what the copies cost the
round, so the overhead is not understated. As a reference measured in the same run on the same actors, each cell's
rounds are followed by as many *bare Ray* rounds: ``ray.put``, one ``ClientActor.run_many`` call per actor, one
``ray.get`` of all results and the same ``weighted_average``, with no failure policy and no validation; ``rayfuse /
bare`` is the ratio of the medians. (The bare rounds run after the timed rounds, not interleaved, so that the peak
memory below is the engine's alone: a bare round gathers every update in the coordinator.)

Peak memory per process (Linux): before the timed rounds the driver resets each process's peak resident set
(``echo 5 > /proc/<pid>/clear_refs``) and records its resident set; after them it reads ``VmHWM`` from
``/proc/<pid>/status``. Reported: the peak over that resting size, in MB and in multiples of the model, for the
coordinator, the largest client actor and the driver (the pids come from the actors themselves).

Actor startup is measured separately. Cells whose objects would not fit the object store or the available memory
are skipped, and the output says so.

Usage::

    python benchmarks/bench_round.py                      # the grid and the two target cells
    python benchmarks/bench_round.py --cells targets      # 100 x 400 KB and 20 x 40 MB only, every mode
    python benchmarks/bench_round.py --cells targets --aggregation per_actor --streaming
    python benchmarks/bench_round.py --clients 10 50 --sizes 100KB 10MB --rounds 5
    python benchmarks/bench_round.py --cells targets --aggregation per_actor flat secure --streaming   # secure vs plain
    python benchmarks/bench_round.py --quick              # one small cell in every mode, seconds

Writes ``benchmarks/results/bench_round.json``. Ray workers import ``_steps`` (the echo step) and this module from
``benchmarks/``, which Ray puts on their ``sys.path`` as the driver script's folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from _common import add_quick_arguments, machine_info, median, memory_bytes, out_dir, print_table, wait_for_quiet, write_results
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
TIMED_KEYS = ("round_s", "client_copy_sum_s")
MODES = ("flat", "per_actor", "gathered", "secure")


@dataclass(frozen=True)
class Cell:
    clients: int
    num_params: int  # float32 values per client
    target: bool = False
    per_actor: int = 1  # federation.clients_per_actor: 1 is one actor per client (deployment), more is the simulation mode
    mode: str = "flat"  # flat, per_actor (streaming; clients_per_actor > 1), gathered (streaming: false) or secure (SecAgg+)
    fetch_bytes: int | None = None  # the coordinator federation's stream fetch budget (None: its default)

    @property
    def param_bytes(self) -> int:
        return 4 * self.num_params

    @property
    def streaming(self) -> bool:
        return self.mode != "gathered"

    @property
    def actors(self) -> int:
        return -(-self.clients // self.per_actor)

    @property
    def label(self) -> str:
        mb = self.param_bytes / 1e6
        size = f"{self.clients} x {mb:g} MB" if mb >= 1 else f"{self.clients} x {self.param_bytes / 1e3:g} KB"
        fetch = "" if self.fetch_bytes is None else f" (fetch {self.fetch_bytes} B)"
        return (size if self.per_actor == 1 else f"{size} ({self.per_actor}/actor)") + f" {self.mode}{fetch}"


def cell_modes(per_actor: int, modes: tuple[str, ...] = MODES) -> list[str]:
    """The modes a layout can run: per_actor needs several clients per actor."""
    return [m for m in modes if m != "per_actor" or per_actor > 1]


# The two target cells, in the deployment layout (one actor per client) and in the simulation layout
# (federation.clients_per_actor = clients / CPUs, like Flower's actor pool of a few workers).
TARGET_CELLS = [
    Cell(n, size, target=True, per_actor=k, mode=mode)
    for n, size, k in [(100, 100_000, 1), (20, 10_000_000, 1), (100, 100_000, 50), (20, 10_000_000, 10)]
    for mode in cell_modes(k)
]
QUICK_CELLS = [Cell(4, 25_000, per_actor=2, mode=mode) for mode in MODES]


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
        self.start: dict[str, np.ndarray] | None = None  # the global model of round 1 (run_rounds)

    def run_rounds(self, num_params: int, rounds: int, mode: str = "flat", seed: int = 0, fetch_bytes: int | None = None) -> dict[str, Any]:
        """Run ``rounds`` FedAvg rounds in ``mode`` (flat, per_actor, gathered or secure) with the stream's fetch
        budget ``fetch_bytes`` (``None``: the federation's default); return their timings."""
        from actors.federation import FETCH_BYTES
        from rayfuse.config import SecureAggregationConfig

        self.federation.fetch_bytes = FETCH_BYTES if fetch_bytes is None else fetch_bytes
        server = self.server
        pipeline = server.updates
        pipeline.streaming = mode != "gathered"  # federation.streaming
        pipeline.aggregation = "flat" if mode == "flat" else None  # federation.aggregation (unset: per_actor when k > 1)
        pipeline.secure = SecureAggregationConfig() if mode == "secure" else None  # federation.secure_aggregation: true
        p = server.params  # FedAvgParams: fraction, aggregator and weighting as FedAvg.run reads them
        if self.start is None or self.start["w"].size != num_params:  # kept across calls: part of the resting size
            self.start = {"w": np.random.default_rng(seed).uniform(0.5, 1.5, num_params).astype(np.float32)}
        start_params = self.start
        global_params = start_params
        timings = []
        for rnd in range(rounds):
            t0 = time.perf_counter()
            clients = pipeline.cohort(rnd + 1)  # the round loop's cohort: every client at fraction 1
            result = pipeline.collect_round(echo_step, global_params, clients, rnd + 1, weighted=p.weighted)
            global_params, updates = result.params, result.updates
            t1 = time.perf_counter()
            # under secure aggregation each client's record carries the cohort's mean train_seconds (the copy's time)
            copies = [u.metrics.get("copy_s", u.metrics.get("train_seconds", 0.0)) for u in updates.values()]
            timings.append({"round_s": t1 - t0, "client_copy_sum_s": float(np.sum(copies))})
            del result, updates
        if rounds:
            assert pipeline.round_mode(1)[0] == mode, (pipeline.round_mode(1), mode)
            # Echo rounds average identical copies: the model must come back unchanged (up to float32 rounding);
            # checked a slice at a time, so the check's temporaries do not count in the rounds' peak memory
            for i in range(0, num_params, 1 << 18):
                np.testing.assert_allclose(global_params["w"][i : i + (1 << 18)], start_params["w"][i : i + (1 << 18)], rtol=1e-5)
        return {"rounds": timings}

    def bare_rounds(self, num_params: int, rounds: int, seed: int = 0) -> dict[str, Any]:
        """The reference: ``rounds`` bare Ray rounds on the same actors (put, one ``run_many`` per actor, one
        ``ray.get`` of everything, ``weighted_average``); their times and the aggregation's."""
        from rayfuse.updates.aggregate import weighted_average

        global_params = {"w": np.random.default_rng(seed).uniform(0.5, 1.5, num_params).astype(np.float32)}
        timings = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            bare_ref = ray.put(global_params)
            batches = ray.get(
                [h.run_many.remote([(i, echo_step, (RefArg(0),), {}) for i in members], bare_ref) for h, members in self.groups]
            )
            bare = [value for batch in batches for _, value in batch]
            t1 = time.perf_counter()
            weighted_average([u.params for u in bare], [u.num_examples for u in bare])
            t2 = time.perf_counter()
            timings.append({"bare_round_s": t2 - t0, "aggregate_s": t2 - t1})
            del bare, bare_ref, batches
        return {"rounds": timings}


def _status_bytes(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` of ``pid`` in bytes (Linux ``/proc``); empty where it cannot be read."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


class AnonSampler:
    """Samples each process's private resident memory (``RssAnon``) every ``interval_s`` in a thread, keeping the
    peak: ``VmHWM`` also counts the object store's shared pages a process has mapped (every object it put or read
    zero-copy stays in its resident set while the store keeps those pages), which are the store's memory, not the
    process's; the private peak is what the process itself allocates (sampled, so a spike shorter than the interval
    can be missed)."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.005) -> None:
        import threading

        self.pids = pids
        self.interval_s = interval_s
        self.rest = {name: _anon_bytes(pid) for name, pid in pids.items()}
        self.peak = dict(self.rest)
        self.store_rest = self.store_peak = _store_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], _anon_bytes(pid))
            self.store_peak = max(self.store_peak, _store_bytes())  # one GCS call, ~20 ms
            self._stop.wait(self.interval_s)

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _store_bytes() -> int:
    """The object store's used bytes (Ray's memory summary; MiB resolution), 0 where it cannot be read."""
    try:
        from ray._private.internal_api import memory_summary

        summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    except Exception:  # a private API: the benchmark goes on without the store's figure
        return 0
    for line in summary.splitlines():
        if line.startswith("Plasma memory usage"):
            return int(line.split()[3]) * 2**20
    return 0


def _anon_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peaks(pids: dict[str, int]) -> dict[str, int]:
    """Reset each process's peak resident set (``clear_refs`` 5) and return its resident set now (bytes); processes
    whose peak cannot be reset here (not Linux, another user) are left out."""
    rest = {}
    for name, pid in pids.items():
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            continue
        status = _status_bytes(pid)
        if "VmRSS" in status:
            rest[name] = status["VmRSS"]
    return rest


def read_peaks(pids: dict[str, int], rest: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each reset process's peak resident set since the reset (``VmHWM``) and its resting size then (bytes)."""
    out = {}
    for name, base in rest.items():
        status = _status_bytes(pids[name])
        if "VmHWM" in status:
            # the peak since the reset includes the reset's own moment; the kernel's RSS counters are per-CPU batched, so
            # a VmHWM read later can fall a few pages short of the VmRSS read at the reset: the larger of the two
            out[name] = {"peak_bytes": max(status["VmHWM"], base), "rest_bytes": base}
    return out


class DriverLink:
    """``ray.get`` that counts the serialized bytes the driver receives."""

    def __init__(self) -> None:
        self.bytes_received = 0

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        value = ray.get(ref, timeout=timeout)
        self.bytes_received += len(cloudpickle.dumps(value))
        return value


def bench_config(num_clients: int, per_actor: int = 1) -> Any:
    """A validated config: ``num_clients`` iid shards of the numpy-only synthetic dataset, ``per_actor`` to an actor."""
    return validate_config(
        {
            "run": {"name": "bench-round", "seed": 0},
            "data": {"dataset": "synthetic", "options": {"n_samples": 20000}},
            "partition": {"method": "iid", "num_clients": num_clients},
            "federation": {"on_client_failure": "fail", "clients_per_actor": per_actor},
            "methods": {"fedavg": {"local_epochs": 0}},
        }
    )


def start_actors(num_clients: int, per_actor: int, link: DriverLink) -> tuple[list[Any], Any, float, dict[str, int]]:
    """Start the client actors (as ``actors.backend.RayBackend.start`` does) and the coordinator; wait for all. Returns
    them, the startup time and the pid of each process (``coordinator``, ``driver``, ``actor-<k>``)."""
    cfg = bench_config(num_clients, per_actor)
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
    replies = link.get([a.ping.remote() for a in actors] + [coordinator.ready.remote()], timeout=fed.startup_timeout_s)
    pids = {f"actor-{k}": int(r["pid"]) for k, r in enumerate(replies[:-1])}
    pids.update(coordinator=int(replies[-1]["pid"]), driver=os.getpid())
    return actors, coordinator, time.perf_counter() - started, pids


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
    # one worker process per actor (clients_per_actor > 1 share one), each holding its clients' copies
    heap_need = cell.actors * WORKER_BYTES + cell.clients * cell.param_bytes + COORDINATOR_BYTES + 2 * cell.param_bytes
    available = memory_bytes()[1]
    if store_need + heap_need > 0.8 * available:
        return f"needs ~{(store_need + heap_need) / 2**30:.1f} GiB of RAM; {available / 2**30:.1f} GiB available"
    return None


def summarize(
    cell: Cell, timings: list[dict[str, float]], bare: list[dict[str, float]], cpus: int, peaks: dict[str, dict[str, int]]
) -> dict[str, Any]:
    """Medians of the per-round timings, the overhead, the ratio to the bare Ray round and the peak memory."""
    parallel = max(1, min(cpus, cell.actors))  # the clients of one actor copy one after another
    aggregate_s = median([t["aggregate_s"] for t in bare])
    row: dict[str, Any] = {
        "cell": cell.label,
        "clients": cell.clients,
        "clients_per_actor": cell.per_actor,
        "mode": cell.mode,
        "fetch_bytes": cell.fetch_bytes,
        "actors": cell.actors,
        "param_bytes": cell.param_bytes,
        "target": cell.target,
        "rounds_timed": len(timings),
    }
    for key in TIMED_KEYS:
        row[key] = median([t[key] for t in timings])
    row["aggregate_s"] = aggregate_s
    row["bare_round_s"] = median([t["bare_round_s"] for t in bare])
    row["client_copy_wall_s"] = median([t["client_copy_sum_s"] / parallel for t in timings])
    row["overhead_s"] = median([t["round_s"] - aggregate_s - t["client_copy_sum_s"] / parallel for t in timings])
    row["vs_bare"] = row["round_s"] / row["bare_round_s"]
    row["object_store_bytes_per_round"] = (cell.clients + 1) * cell.param_bytes
    row["round_times_s"] = [t["round_s"] for t in timings]
    row["peak_memory"] = peaks  # per process: peak_bytes (VmHWM) and rest_bytes (VmRSS at the reset); the store's use
    if "object_store" in peaks:
        store = peaks["object_store"]
        row["store_peak_x_model"] = (store["peak_bytes"] - store["rest_bytes"]) / cell.param_bytes
    for prefix, field in (("", "peak_bytes"), ("anon_", "anon_peak_bytes")):
        rest_field = field.replace("peak", "rest")
        for name in ("coordinator", "driver"):
            if name in peaks and field in peaks[name]:
                extra = peaks[name][field] - peaks[name][rest_field]
                row[f"{name}_{prefix}peak_mb"] = extra / 2**20
                row[f"{name}_{prefix}peak_x_model"] = extra / cell.param_bytes
        actors = [v[field] - v[rest_field] for k, v in peaks.items() if k.startswith("actor-") and field in v]
        if actors:
            row[f"client_actor_{prefix}peak_mb"] = max(actors) / 2**20
            row[f"client_actor_{prefix}peak_x_model"] = max(actors) / cell.param_bytes
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
        actors, coordinator, startup_s, pids = start_actors(num_clients, per_actor, link)
        startups[f"{num_clients}/{per_actor}"] = startup_s
        print(f"  {len(actors)} client actors ({num_clients} clients) + coordinator up in {startup_s:.1f} s", flush=True)
        try:
            for cell in runnable:
                n = timed_rounds(cell, rounds)
                load = wait_for_quiet(max_load, quiet_timeout_s)
                before = link.bytes_received
                link.get(coordinator.run_rounds.remote(cell.num_params, warmup, cell.mode, 0, cell.fetch_bytes))  # warm-up, untimed
                rest = reset_peaks(pids)  # the peaks of the timed rounds alone
                with AnonSampler(pids) as private:
                    result = link.get(coordinator.run_rounds.remote(cell.num_params, n, cell.mode, 0, cell.fetch_bytes))
                peaks = read_peaks(pids, rest)
                for name in peaks:
                    peaks[name].update(anon_peak_bytes=private.peak.get(name, 0), anon_rest_bytes=private.rest.get(name, 0))
                peaks["object_store"] = {"peak_bytes": private.store_peak, "rest_bytes": private.store_rest}
                bare = link.get(coordinator.bare_rounds.remote(cell.num_params, warmup + n))["rounds"][warmup:]
                row = summarize(cell, result["rounds"], bare, cpus, peaks)
                row.update(driver_bytes_received=link.bytes_received - before, startup_s=startup_s, load_avg_1m=load)
                rows.append(row)
                peak = (
                    f", coordinator peak {row['coordinator_peak_x_model']:.1f} x model (private {row['coordinator_anon_peak_x_model']:.1f} x)"
                    if "coordinator_anon_peak_x_model" in row
                    else ""
                )
                print(
                    f"  {cell.label}: median round {row['round_s'] * 1e3:.1f} ms, overhead {row['overhead_s'] * 1e3:.1f} ms, "
                    f"bare Ray round {row['bare_round_s'] * 1e3:.1f} ms{peak} ({n} rounds after {warmup} warm-up, "
                    f"load {load:.1f})",
                    flush=True,
                )
        finally:
            stop_actors(actors, coordinator)
    return {"rows": rows, "skipped": skipped, "startup_s": startups}


def grid(clients: list[int], sizes: list[str], per_actor: list[int], modes: tuple[str, ...] = MODES) -> list[Cell]:
    """The grid plus the target cells (a target cell that is also a grid cell is kept once, marked as a target), in
    ``modes`` (per_actor where a layout hosts several clients per actor)."""
    cells = {
        (c.clients, c.num_params, c.per_actor, c.mode): c
        for c in (Cell(n, SIZES[s], per_actor=k, mode=m) for n in clients for s in sizes for k in per_actor for m in cell_modes(k, modes))
    }
    for target in select_modes(TARGET_CELLS, modes):
        cells[(target.clients, target.num_params, target.per_actor, target.mode)] = target
    return sorted(cells.values(), key=lambda c: (c.clients, c.per_actor, c.num_params, MODES.index(c.mode)))


def select_modes(cells: list[Cell], modes: tuple[str, ...]) -> list[Cell]:
    return [c for c in cells if c.mode in modes]


def wanted_modes(aggregation: list[str], streaming: bool | None) -> tuple[str, ...]:
    """The modes ``--aggregation`` and ``--streaming/--no-streaming`` ask for: streaming rounds in each aggregation
    named, and the gathered round (``--no-streaming``); both when neither flag is given."""
    streamed = tuple(aggregation) if streaming in (None, True) else ()
    return streamed + (("gathered",) if streaming in (None, False) else ())


def default_store_bytes() -> int:
    """8 GiB, or a third of the available RAM when that is less (Ray's default is 30% of RAM)."""
    return int(min(8 * 2**30, memory_bytes()[1] / 3))


def add_secure_ratios(rows: list[dict[str, Any]]) -> None:
    """``x_plain`` of each secure row: its round time over the same cell's streamed plain round (per_actor where the
    actors host several clients, else flat), when that cell ran too."""
    for row in rows:
        if row["mode"] != "secure":
            continue
        plain_mode = "per_actor" if row["clients_per_actor"] > 1 else "flat"
        for other in rows:
            same = all(other[k] == row[k] for k in ("clients", "clients_per_actor", "param_bytes"))
            if same and other["mode"] == plain_mode and other["fetch_bytes"] is None:
                row["x_plain"] = row["round_s"] / other["round_s"]


def print_rows(rows: list[dict[str, Any]]) -> None:
    ms_keys = ("round_s", "aggregate_s", "client_copy_wall_s", "overhead_s", "bare_round_s")
    shown = [{**r, **{k: 1e3 * r[k] for k in ms_keys}, "target": "yes" if r["target"] else ""} for r in rows]
    print_table(
        shown,
        [
            ("cell", "clients x params"),
            ("target", "target"),
            ("round_s", "round ms"),
            ("aggregate_s", "bare aggregate ms"),
            ("client_copy_wall_s", "client copy ms"),
            ("overhead_s", "overhead ms"),
            ("bare_round_s", "bare Ray ms"),
            ("vs_bare", "x bare"),
            ("x_plain", "secure x plain"),
            ("coordinator_peak_x_model", "coord. peak x model"),
            ("coordinator_anon_peak_x_model", "coord. private x model"),
            ("client_actor_peak_x_model", "actor peak x model"),
            ("client_actor_anon_peak_x_model", "actor private x model"),
            ("store_peak_x_model", "store x model"),
            ("driver_peak_mb", "driver peak MB"),
            ("driver_bytes_received", "driver bytes"),
            ("startup_s", "startup s"),
            ("load_avg_1m", "load"),
        ],
        "rayfuse round on Ray (medians; overhead = round - aggregate - client copy wall time; peaks: over each process's resting size)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cells",
        choices=["grid", "targets", "grid-only"],
        default="grid",
        help="targets: only the two target cells; grid-only: no targets",
    )
    add_quick_arguments(parser, "4 x 100 KB, 2 per actor, in each mode, 2 rounds")
    parser.add_argument(
        "--aggregation",
        nargs="+",
        default=["flat", "per_actor"],
        choices=["flat", "per_actor", "secure"],
        help="streaming rounds' aggregation (secure: SecAgg+, federation.secure_aggregation)",
    )
    parser.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--streaming: streamed rounds only; --no-streaming: gathered rounds only; default: both",
    )
    parser.add_argument(
        "--fetch-bytes",
        type=int,
        nargs="+",
        default=[],
        help="also run each flat cell with these stream fetch budgets (0: one actor call per wake-up, the stream before batching)",
    )
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

    modes = wanted_modes(args.aggregation, args.streaming)
    if args.quick:
        cells = select_modes(QUICK_CELLS, modes)
        args.rounds, args.warmup = 2, 1
    elif args.cells == "targets":
        cells = select_modes(TARGET_CELLS, modes)
    else:
        cells = grid(args.clients, args.sizes, args.clients_per_actor, modes)
        if args.cells == "grid-only":
            cells = [
                c
                for c in cells
                if (c.clients, c.num_params, c.per_actor)
                in {(n, SIZES[z], k) for n in args.clients for z in args.sizes for k in args.clients_per_actor}
            ]
    if args.fetch_bytes:  # the same flat cells again with each fetch budget, on the same actors, in the same run
        cells += [
            dataclasses.replace(c, fetch_bytes=b) for b in args.fetch_bytes for c in cells if c.mode == "flat" and c.fetch_bytes is None
        ]
        cells.sort(
            key=lambda c: (c.clients, c.per_actor, c.num_params, MODES.index(c.mode), -1 if c.fetch_bytes is None else c.fetch_bytes)
        )
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
    add_secure_ratios(result["rows"])
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
        out_dir(args.out, args.quick),
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
