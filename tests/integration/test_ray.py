"""Real Ray: client and coordinator actors, the object store, restarts, and the CLI attaching to a running Ray.

One local Ray (2 CPUs) is started for the whole session by the ``ray_session`` fixture.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from rayfuse.io import load_params
from rayfuse.models import params_equal
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, run_experiment
from tests.conftest import TINY

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


class ActorSpy(Printer):
    """Records the named actors alive while the run is in progress (the printer runs in the driver's poll loop)."""

    def __init__(self, ray):
        super().__init__(enabled=False)
        self.ray = ray
        self.seen: set[str] = set()

    def __call__(self, event):
        if event.get("kind") in ("method_start", "progress") and not self.seen:
            self.seen = {a["name"] for a in self.ray.util.list_named_actors(all_namespaces=True)}


def ray_run(cfg, run_dir, printer=None):
    from actors.backend import RayBackend

    return run_experiment(cfg, RayBackend(), run_dir, printer=printer or Printer(enabled=False), show_tables=False)


def test_a_ray_run_equals_the_in_process_run(ray_session, make_config, tmp_path):
    # the tiny config's methods, FedAdam's server optimiser state and FedRef's reference model: one run each way
    methods = {
        **TINY["methods"],
        "fedadam": {"rounds": 3, "local_epochs": 1},
        "fedref": {"rounds": 4, "local_epochs": 1, "p": 1, "lam": 0.1},
    }
    cfg = make_config(federation={"backend": "ray"}, methods=methods)
    spy = ActorSpy(ray_session)
    on_ray = ray_run(cfg, tmp_path / "ray", spy)
    in_process = run_experiment(
        make_config(methods=methods), InProcessBackend(), tmp_path / "local", printer=Printer(enabled=False), show_tables=False
    )
    assert on_ray["status"] == "succeeded" and on_ray["run"]["backend"] == "ray"
    assert set(in_process["methods"]) == set(methods)
    for label, entry in in_process["methods"].items():
        assert on_ray["methods"][label]["accuracy"] == entry["accuracy"], label
    for label in ("fedavg", "fedadam", "fedref"):
        assert params_equal(
            load_params(tmp_path / "ray" / "models" / f"{label}.safetensors"),
            load_params(tmp_path / "local" / "models" / f"{label}.safetensors"),
        ), label
    # named actors: <run>/client-<i> and <run>/coordinator, alive during the run, gone after it
    expected = {f"ray/client-{i}" for i in range(4)} | {"ray/coordinator"}
    assert expected <= spy.seen
    assert set(on_ray["run"]["actors"]) == expected
    assert not expected & {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)}
    assert ray_session.is_initialized()  # the backend did not shut down a Ray it did not start


def test_a_crashed_client_actor_is_restarted_reloads_its_shard_and_the_round_is_retried(ray_session, make_config, tmp_path):
    methods = {"fedavg": {"rounds": 2, "local_epochs": 1}}
    crash = {"backend": "ray", "faults": [{"client": 1, "step": "fedavg.fit", "call": 2, "mode": "exit"}]}
    results = ray_run(make_config(methods=methods, federation=crash), tmp_path / "crash")
    kinds = [(e["kind"], e.get("client")) for e in results["events"]]
    assert ("client_failed", 1) in kinds and ("client_restarted", 1) in kinds and ("client_retry", 1) in kinds
    clean = run_experiment(
        make_config(methods=methods), InProcessBackend(), tmp_path / "clean", printer=Printer(enabled=False), show_tables=False
    )
    assert results["methods"]["fedavg"]["accuracy"] == clean["methods"]["fedavg"]["accuracy"]


@pytest.mark.slow  # its twin: test_a_failing_client_does_not_fail_the_clients_sharing_its_actor (drop on Ray, a raise and a crash)
def test_drop_policy_on_ray(ray_session, make_config, tmp_path):
    federation = {"backend": "ray", "on_client_failure": "drop", "faults": [{"client": 0, "step": "train_local", "mode": "raise"}]}
    results = ray_run(make_config(methods={"local": {}, "average": {}}, federation=federation), tmp_path / "drop")
    assert ("client_dropped", 0) in [(e["kind"], e.get("client")) for e in results["events"]]
    assert [row["client"] for row in results["methods"]["local"]["info"]["per_client"]] == [1, 2, 3]
    assert results["methods"]["average"]["info"]["clients"] == [1, 2, 3]


def test_parallel_map_runs_as_ray_tasks(ray_session):
    import ray

    from actors.federation import RayFederation
    from rayfuse.federation import FailurePolicy

    fed = RayFederation({}, FailurePolicy())
    assert fed.parallel_map(abs, list(range(-20, 0))) == list(range(20, 0, -1))
    assert fed.parallel_width() == int(ray.cluster_resources()["CPU"])
    from rayfuse.matching import executor_width, map_chunked

    assert executor_width(fed.parallel_map) == fed.parallel_width()
    assert map_chunked(abs, list(range(-9, 0)), fed.parallel_map) == list(range(9, 0, -1))
    ref = fed.put({"w": np.arange(4.0)})
    assert fed.get(ref)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_cli_attaches_to_a_running_ray_and_leaves_it_running(ray_session, tmp_path):
    address = ray_session.get_runtime_context().gcs_address
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "cli"},
                "partition": {"num_clients": 3},
                "model": {"hidden": [8]},
                "train": {"epochs": 2},
                "methods": {"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}},
            }
        )
    )
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "rayfuse", "run", str(config), "--address", address, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "succeeded" and results["run"]["backend"] == "ray"
    assert "run/coordinator" in results["run"]["actors"]

    @ray_session.remote
    def still_up():
        return 1

    assert ray_session.get(still_up.remote()) == 1


def test_packed_clients_give_the_same_run(ray_session, make_config, tmp_path):
    # 4 clients in 2 actors (simulation mode): same numbers as one actor per client and as in-process.
    cfg = make_config(federation={"backend": "ray", "clients_per_actor": 2})
    packed = ray_run(cfg, tmp_path / "packed")
    in_process = run_experiment(make_config(), InProcessBackend(), tmp_path / "local", printer=Printer(enabled=False), show_tables=False)
    assert packed["run"]["actors"] == ["packed/clients-0-1", "packed/clients-2-3", "packed/coordinator"]
    for label, entry in in_process["methods"].items():
        assert packed["methods"][label]["accuracy"] == entry["accuracy"], label


def test_a_failing_client_does_not_fail_the_clients_sharing_its_actor(ray_session, make_config, tmp_path):
    federation = {
        "backend": "ray",
        "clients_per_actor": 2,
        "on_client_failure": "drop",
        "faults": [
            {"client": 1, "step": "fedavg.fit", "call": 1, "mode": "raise"},
            {"client": 2, "step": "fedavg.fit", "call": 2, "mode": "exit"},
        ],
    }
    results = ray_run(make_config(methods={"fedavg": {"rounds": 3, "local_epochs": 1}}, federation=federation), tmp_path / "p")
    dropped = Counter(e["client"] for e in results["events"] if e["kind"] == "client_dropped")
    # round 1: only client 1 fails; its actor-mate 0 goes on. Round 2: the crash takes clients 2 and 3 (one process);
    # under `drop` a call made while Ray still restarts that actor fails too, so they may miss round 3 as well.
    assert dropped[0] == 0 and dropped[1] == 1
    assert dropped[2] == dropped[3] >= 1
    # the crashed actor is restarted by Ray, and the restart recorded after the drop; under drop no call is retried
    kinds = [(e["kind"], e.get("client")) for e in results["events"]]
    restarted = {client for kind, client in kinds if kind == "client_restarted"}
    assert restarted & {2, 3} and not restarted & {0, 1}, kinds
    first = min(restarted)
    assert kinds.index(("client_dropped", first)) < kinds.index(("client_restarted", first))
    assert not [k for k in kinds if k[0] == "client_retry"]
    history = json.loads((tmp_path / "p" / "state" / "fedavg.json").read_text())["history"]
    clients = [r["value"] for r in history if r["metric"] == "clients"]
    assert clients[:2] == [3.0, 2.0] and clients[2] in (2.0, 4.0)


@pytest.mark.parametrize("alive", [False, True])
def test_a_stale_ray_start_address_is_detected(tmp_path, alive):
    # ray.init() with no address attaches to the last `ray start` recorded on the machine, and retries it forever if
    # that cluster is gone; the backend checks the address first. Run in a subprocess with its own RAY_TMPDIR.
    short = Path(tempfile.mkdtemp(prefix="rf", dir="/tmp"))
    (short / "ray").mkdir()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    if alive:
        server.listen()
    port = server.getsockname()[1]
    (short / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    code = "from actors.backend import stale_local_address; print(stale_local_address())"
    env = {**os.environ, "RAY_TMPDIR": str(short)}
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("None" if alive else f"127.0.0.1:{port}")


def test_aligned_fusion_on_ray_equals_the_in_process_run(ray_session, make_config, tmp_path):
    """Statistics computed by the client actors, assignments solved by Ray tasks (parallel_map): the same numbers."""
    methods = {"act": {"method": "aligned", "sweeps": 2}, "wm": {"method": "aligned", "alignment": "weight", "merge": "fisher"}}
    sections = {"methods": methods, "train": {"epochs": 2, "shared_init": False}}
    on_ray = ray_run(make_config(federation={"backend": "ray"}, **sections), tmp_path / "ray")
    local = run_experiment(
        make_config(**sections), InProcessBackend(), tmp_path / "local", printer=Printer(enabled=False), show_tables=False
    )
    for label in methods:
        assert on_ray["methods"][label]["accuracy"] == local["methods"][label]["accuracy"], label
        assert params_equal(
            load_params(tmp_path / "ray" / "models" / f"{label}.safetensors"),
            load_params(tmp_path / "local" / "models" / f"{label}.safetensors"),
        ), label
