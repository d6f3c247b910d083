"""Operations on a real two-node Ray cluster secured as docs/security.md says: ``ray job submit`` of ``rayfuse run``
by a member, and a process without the cluster's token or certificates refused.

One cluster (a head and a worker node started with ``ray start`` on loopback, non-default ports, each a "silo" with a
custom resource; token authentication and TLS with a token and certificates of its own) serves both; the fixture ends
exactly its processes. Everything goes through the command lines a user types: ``ray job submit / status / logs``,
``ray list actors`` (the state API), the nodes' Prometheus metrics endpoint, ``python -c "ray.init(...)"``.

Marked slow: ``rayfuse tune`` sweeps on a cluster (``python -m rayfuse tune --address`` and
``ray job submit -- python -m rayfuse tune``), on an unsecured cluster of their own; their fast twin is
tests/test_sweep_trials.py.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pandas as pd
import pytest
import yaml

from rayfuse.config import load_config
from rayfuse.method import resolve_methods
from tests.integration.two_node import ROOT, TwoNodeCluster, make_tls_files, node_addresses, poll

WAIT_S = 300  # an upper bound for waiting on the cluster, not a performance assertion


@pytest.fixture(scope="module")
def cluster():
    """The secured cluster: its commands (:meth:`TwoNodeCluster.run`) run as a member's, with its token and certificates."""
    nodes = TwoNodeCluster(cpus_per_node=4, secured=True).start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def open_cluster():
    """An unsecured cluster for the slow sweeps, as they ran before the shared one was secured. Their retry job
    sometimes fails at the end of ``tuner.fit()`` (Tune's ExperimentAnalysis: FileNotFoundError from ``os.getcwd()``,
    the job driver's working directory gone), seen on the secured cluster and on this one alike; cause not found."""
    nodes = TwoNodeCluster(cpus_per_node=4).start()
    try:
        yield nodes
    finally:
        nodes.stop()


def submit_job(cluster, submission: str, *command: str) -> str:
    """``ray job submit --no-wait`` of ``command`` (the checkout as the working dir), poll ``ray job status`` until it
    ends, assert it succeeded, and return ``ray job logs``."""
    out = cluster.run(
        "ray",
        "job",
        "submit",
        "--address",
        cluster.dashboard_url,
        "--working-dir",
        str(ROOT),
        "--submission-id",
        submission,
        "--no-wait",
        "--",
        *command,
    )
    assert out.returncode == 0, out.stderr[-3000:]

    def finished():
        out = cluster.run("ray", "job", "status", "--address", cluster.dashboard_url, submission)
        status = out.stdout + out.stderr  # the CLI logs its status lines to stderr
        # "Status for job 'x': RUNNING" while it runs, "Job 'x' succeeded" (or failed / stopped) at the end
        found = re.search(r"Job '[^']+' (succeeded|failed|stopped)", status)
        return found.group(1) if found else None

    def logs() -> str:
        out = cluster.run("ray", "job", "logs", "--address", cluster.dashboard_url, submission)
        return out.stdout + out.stderr

    try:
        state = poll(finished, f"job {submission} to finish", timeout=WAIT_S)
    except AssertionError as e:  # say what the job and the cluster were doing, not only that it did not end
        raise AssertionError(f"{e}\n$ ray job logs\n{logs()[-3000:]}\n{cluster.diagnostics()}") from None
    text = logs()
    assert state == "succeeded", text[-4000:]
    return text


def test_the_recipes_certificates_name_every_address_a_node_is_reached_at(tmp_path):
    from cryptography import x509

    env = make_tls_files(tmp_path, node_addresses())
    assert env["RAY_USE_TLS"] == "1" and {k for k in env if k.startswith("RAY_TLS_")} == {
        "RAY_TLS_SERVER_CERT",
        "RAY_TLS_SERVER_KEY",
        "RAY_TLS_CA_CERT",
    }
    node = x509.load_pem_x509_certificate(open(env["RAY_TLS_SERVER_CERT"], "rb").read())
    ca = x509.load_pem_x509_certificate(open(env["RAY_TLS_CA_CERT"], "rb").read())
    node.verify_directly_issued_by(ca)
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == set(node_addresses()) >= {"127.0.0.1"}
    assert (tmp_path / "node.key").stat().st_mode & 0o077 == 0  # the key readable by its owner only


@pytest.mark.ray
def test_a_process_without_the_clusters_token_or_certificates_is_refused(cluster):
    """A member (the token and the certificates) connects; a process with the certificates but another token, or no
    token, is refused by the GCS; one without the cluster's certificate completes no TLS handshake; the job API
    refuses a submission with another token or none (the dashboard's HTTP API checks the token; TLS covers Ray's gRPC
    ports). A member's job: the next test."""
    code = f"import ray; ray.init(address={cluster.address!r}); print('CPU', ray.cluster_resources().get('CPU')); ray.shutdown()"
    other_token = {**cluster.env, "RAY_AUTH_TOKEN": "0" * 64}
    no_token = {k: v for k, v in cluster.env.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}

    def connect(env: dict[str, str]) -> subprocess.CompletedProcess:
        # Ray tries a GCS that refuses it for about 20 s; here every process, the member too, gets 3 tries: the member
        # connects within them, and the others must fail with the GCS's reason, the token
        env = {**env, "RAY_gcs_server_port_wait_time_s": "3"}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=WAIT_S)

    member = connect(cluster.env)
    assert member.returncode == 0 and f"CPU {2 * cluster.cpus_per_node:.1f}" in member.stdout, (member.stdout + member.stderr)[-2000:]
    for env in (other_token, no_token):
        refused = connect(env)
        assert refused.returncode != 0 and "CPU" not in refused.stdout, refused.stdout[-2000:]
        assert "Unauthenticated" in refused.stderr and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]

    # without TLS: the GCS port completes no handshake for a client that presents no certificate of the cluster's CA
    host, port = cluster.address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=cluster.env["RAY_TLS_CA_CERT"])  # trusts the cluster, presents nothing
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if not tls.recv(1):  # the server ends a client without a certificate (mutual TLS): an alert, or a close
                    raise ConnectionError("closed by the server")

    # the job API: a submission with another token or none is refused before anything runs
    for env in (other_token, no_token):
        out = subprocess.run(
            ["ray", "job", "submit", "--address", cluster.dashboard_url, "--", "python", "-c", "print('ran')"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and "ran" not in out.stdout and "AuthenticationError" in out.stderr, (
            out.stdout[-2000:] + out.stderr[-2000:]
        )


@pytest.mark.ray
def test_ray_job_submit_runs_a_job_on_both_nodes_with_named_actors_and_metrics(cluster, tmp_path):
    namespace = f"ops-{uuid.uuid4().hex[:6]}"
    job = {
        "run": {"name": "job", "storage": str(tmp_path / "runs")},
        "partition": {"num_clients": 3},
        "model": {"hidden": [8]},
        "train": {"epochs": 2},
        # actors that cannot be placed fail the job (its own message, in its logs) before the test stops waiting
        "federation": {
            "namespace": namespace,
            "startup_timeout_s": WAIT_S / 2,
            # flat: the coordinator receives each client's update (the byte counts below); unset would sum per node
            # (tests/integration/test_per_node_cluster.py)
            "aggregation": "flat",
            "client_overrides": {0: {"resources": {"silo_a": 0.1}}, 1: {"resources": {"silo_b": 0.1}}},
        },
        "methods": {"average": {}, "fedavg": {"rounds": 3, "local_epochs": 1}},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    logs = submit_job(cluster, f"rayfuse-{namespace}", "python", "-m", "rayfuse", "run", str(config))
    assert "fedavg: round 3/3" in logs and "results: " in logs

    run_dir = Path(re.search(r"results: (\S+)/results\.json", logs).group(1))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "succeeded" and results["run"]["backend"] == "ray"
    assert results["run"]["nodes"] == 2  # client 0 on the head's silo, client 1 on the worker's
    assert (run_dir / "models" / "fedavg.safetensors").is_file() and (run_dir / "metrics.parquet").is_file()

    # the state API keeps the run's named actors (dead now: the run ended and removed them)
    listed = cluster.run(
        "ray",
        "list",
        "actors",
        "--address",
        cluster.dashboard_url,
        "--filter",
        f"ray_namespace={namespace}",
        "--format",
        "json",
        "--detail",
        "--limit",
        "100",
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    actors = {a["name"]: a for a in json.loads(listed.stdout)}
    run = run_dir.name
    assert set(actors) == {f"{run}/client-0", f"{run}/client-1", f"{run}/client-2", f"{run}/coordinator"}
    assert {a["state"] for a in actors.values()} == {"DEAD"}
    assert len({actors[f"{run}/client-{i}"]["node_id"] for i in (0, 1)}) == 2

    # The coordinator (on the driver's node, the head) exported the run's metrics to the head's Prometheus endpoint.
    # Counters and histograms outlive the coordinator process there; gauges (round, clients alive, fused metrics) are
    # only exported while it runs (tests/test_ops_metrics.py checks what they receive).
    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_ports[0]}/metrics", timeout=10).read().decode()
        rows = [line for line in text.splitlines() if line.startswith("ray_rayfuse_") and f'run="{run}"' in line]
        return rows if any(r.startswith("ray_rayfuse_rounds_total") for r in rows) else None

    rows = poll(scrape, "the rayfuse metrics on the head's metrics endpoint", timeout=WAIT_S)

    def value(name: str, **tags: str) -> float:
        found = [r for r in rows if r.startswith(name + "{") and all(f'{k}="{v}"' in r for k, v in tags.items())]
        assert found, (name, tags)
        return float(found[0].rsplit(" ", 1)[1])

    assert value("ray_rayfuse_rounds_total", method="fedavg") == 3
    assert value("ray_rayfuse_stages_total", method="-", stage="local_training") == 1
    assert value("ray_rayfuse_stages_total", method="average", stage="method") == 1
    # fedavg: 3 rounds x one broadcast of the global model; 3 rounds x 3 clients' updates
    broadcast = value("ray_rayfuse_bytes_total", method="fedavg", direction="broadcast")
    assert broadcast > 0 and value("ray_rayfuse_bytes_total", method="fedavg", direction="upload") == 3 * broadcast
    assert value("ray_rayfuse_client_events_total", event="trained") == 3
    assert value("ray_rayfuse_client_train_seconds_count") == 3


@pytest.mark.ray
@pytest.mark.slow
def test_a_tune_sweep_on_the_cluster_trains_the_clients_once(open_cluster, tmp_path):
    """About 90 s of a 2-core machine. Its fast twin, in every suite: tests/test_sweep_trials.py (the trials of a sweep
    train the clients once; a retried trial resumes its run folder)."""
    cluster = open_cluster
    job = {
        "run": {"name": "sweep"},
        "partition": {"num_clients": 2},
        "model": {"hidden": [8]},
        "train": {"epochs": 2},
        "federation": {"clients": {"num_cpus": 0.5}, "task_cpus": 0.5},
        "methods": {"average": {}, "fedprox": {"rounds": 2, "local_epochs": 1}, "ensemble": {}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    storage = tmp_path / "tune"
    space = {
        "base": "job.yaml",
        "methods": ["average", "fedprox"],
        "space": {"methods.fedprox.mu": {"grid": [0.0, 0.1]}},  # two trials: one trains the clients, one reads the cache
        "metric": "fused/fedprox/accuracy",
        "scheduler": {"type": "asha", "grace_period": 1},
        "storage": str(storage),
    }
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    tune = ("python", "-m", "rayfuse", "tune", "space.yaml", "--address", cluster.address)
    out = cluster.run(*tune, cwd=tmp_path, timeout=WAIT_S)
    assert out.returncode == 0, out.stderr[-4000:]

    table = pd.read_parquet(storage / "space" / "results.parquet")
    assert len(table) == 2 and set(table["config/methods.fedprox.mu"]) == {0.0, 0.1}
    # local training ran once for the whole sweep: one trial trained both clients, the other read the cache
    assert table["local/trained"].sum() == 2 and sorted(table["local/cache_hit"]) == [0, 1]
    assert len([p for p in (storage / "model-cache" / "local-models").iterdir() if p.is_dir()]) == 2  # one per client model
    assert table["fused/average/accuracy"].nunique() == 1  # the same local models in every trial
    # every round was reported (ASHA may stop a weak trial after round 1); the finished ones report every stage
    assert set(table["round"]) <= {1, 2} and (table["round"] == 2).any() and table["fused/fedprox/accuracy"].notna().all()
    finished = table[table["stage"] == "done"]
    assert len(finished) >= 1 and finished["time/method/fedprox"].notna().all() and finished["time/startup"].notna().all()

    best = load_config(storage / "space" / "best.yaml")  # ready to run
    assert list(best.methods) == ["average", "fedprox"]
    top = table[table["fused/fedprox/accuracy"] == table["fused/fedprox/accuracy"].max()]
    assert resolve_methods(best.methods)[1].params.mu in set(top["config/methods.fedprox.mu"])

    # A failing trial is retried (FailureConfig) and resumes its run folder: fedprox round 2 fails on the first
    # attempt (the 2nd fit call of client 0's actor); the retry continues from the round-1 checkpoint with new actors.
    # This sweep runs as a Ray job (`ray job submit -- python -m rayfuse tune`, docs/operations.md): its driver
    # attaches to the job's cluster (RAY_ADDRESS), absolute paths for the base job and the storage.
    fault = {"client": 0, "step": "fedavg.fit", "call": 2, "mode": "raise"}  # FedProx runs FedAvg's client step
    retry = {
        **space,
        "name": "retry",
        "base": str(tmp_path / "job.yaml"),
        "methods": ["fedprox"],
        "set": {"federation.on_client_failure": "fail"},
        "space": {"federation.faults": {"grid": [[fault]]}},
        "max_failures": 1,
    }
    retry.pop("scheduler")
    (tmp_path / "retry.yaml").write_text(yaml.safe_dump(retry))
    logs = submit_job(cluster, f"rayfuse-tune-{uuid.uuid4().hex[:6]}", "python", "-m", "rayfuse", "tune", str(tmp_path / "retry.yaml"))
    assert "best.yaml" in logs, logs[-3000:]
    row = pd.read_parquet(storage / "retry" / "results.parquet").iloc[0]
    assert row["resumed"] == 1 and row["stage"] == "done" and row["round"] == 2
    assert row["local/trained"] == 0  # both attempts: the copies the clients keep in the sweep's model cache
    events = json.loads(next((storage / "retry" / "runs").glob("*/results.json")).read_text())["events"]
    assert any(e["kind"] == "resumed" and e.get("round") == 1 for e in events)

    again = cluster.run(*tune, cwd=tmp_path)
    assert again.returncode == 2 and "--resume" in again.stderr
    resumed = cluster.run(*tune, "--resume", cwd=tmp_path, timeout=WAIT_S)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert pd.read_parquet(storage / "space" / "results.parquet")["local/trained"].sum() == 2  # nothing retrained
