"""The fast twin of the slow two-node sweep in tests/integration/test_cluster.py: its claims without a cluster.

* A sweep's trials (``actors.tune.run_trial``, what each Tune trial runs), in this process: the trials train the
  clients once (the sweep's model cache), and a trial that fails and is run again under its id (Tune's retry,
  ``FailureConfig``) resumes its run folder and ends with the numbers of a trial that did not fail.
* ``rayfuse tune --address`` from another process, attached to the session's Ray: a one-trial sweep writes its result
  table and a ready ``best.yaml``; run again it is refused without ``--resume`` and continued with it, retraining
  nothing.

Elsewhere in every suite: ASHA on the reported rounds (tests/test_metrics_channel.py), a driver attaching through
``RAY_ADDRESS`` as a Ray job's does (``rayfuse run`` as a job on the secured two-node cluster, the same
``RayBackend._connect``), refusals of a sweep folder on ``--resume`` (tests/test_damaged_state.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from actors.tune import run_trial, sweep_paths
from rayfuse.cli import main
from rayfuse.config import load_config
from rayfuse.errors import RunFailure
from rayfuse.method import resolve_methods
from rayfuse.runner import InProcessBackend
from rayfuse.sweep import load_space

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 300  # an upper bound for the sweep, not a performance assertion
JOB = {
    "run": {"name": "sweep"},
    "partition": {"num_clients": 2},
    "model": {"hidden": [8]},
    "train": {"epochs": 1},
    # fits the session's 2 CPUs: a trial's driver (1 CPU), two clients, the server's tasks
    "federation": {"clients": {"num_cpus": 0.1}, "task_cpus": 0.1, "on_client_failure": "fail"},
    "methods": {"average": {}, "fedprox": {"rounds": 2, "local_epochs": 1}, "ensemble": {}},
}


def write_space(folder: Path, mu: list[float]) -> Path:
    (folder / "job.yaml").write_text(yaml.safe_dump(JOB))
    space = {
        "base": str(folder / "job.yaml"),
        "methods": ["average", "fedprox"],
        "space": {"methods.fedprox.mu": {"grid": mu}},
        "metric": "fused/fedprox/accuracy",
        "storage": str(folder / "tune"),
    }
    (folder / "space.yaml").write_text(yaml.safe_dump(space))
    return folder / "space.yaml"


def test_the_trials_of_a_sweep_train_the_clients_once_and_a_retried_trial_resumes_its_run_folder(tmp_path):
    spec = load_space(write_space(tmp_path, [0.0, 0.1]))
    paths = sweep_paths(spec)

    def trial(trial_id: str, values: dict, reports: list[dict] | None = None) -> list[dict]:
        """One attempt of a trial; ``reports`` (given: kept when the attempt fails) gets what it reported."""
        reports = [] if reports is None else reports
        run_trial(
            values,
            trial_id=trial_id,
            backend=InProcessBackend(),
            report=reports.append,
            base=spec.base,
            name=spec.name,
            runs=str(paths["runs"]),
            cache=str(paths["cache"]),
            metric=spec.metric,
        )
        return reports

    first = trial("t0", {"methods.fedprox.mu": 0.0})
    second = trial("t1", {"methods.fedprox.mu": 0.1})
    # each round of the metric's method, then the final report
    assert [r["round"] for r in first] == [1, 2, 2] and first[-1]["stage"] == "done" and second[-1]["stage"] == "done"
    # local training ran once for both trials: the first trained both clients, the second read the cache
    assert (first[-1]["local/trained"], first[-1]["local/cache_hit"]) == (2, 0)
    assert (second[-1]["local/trained"], second[-1]["local/cache_hit"]) == (0, 1)
    assert len([p for p in paths["cache"].joinpath("local-models").iterdir() if p.is_dir()]) == 2  # one per client model
    assert first[-1]["fused/average/accuracy"] == second[-1]["fused/average/accuracy"]  # the same local models
    assert first[-1]["fused/fedprox/accuracy"] != second[-1]["fused/fedprox/accuracy"]  # ... fused with another mu

    # fedprox round 2 fails on the first attempt (the 2nd fit call of client 0; FedProx runs FedAvg's client step);
    # the second attempt, under the same trial id with new clients, continues from the round-1 checkpoint
    faulty = {"methods.fedprox.mu": 0.0, "federation.faults": [{"client": 0, "step": "fedavg.fit", "call": 2, "mode": "raise"}]}
    failed: list[dict] = []
    with pytest.raises(RunFailure, match="injected fault"):
        trial("t2", faulty, failed)
    assert failed[-1]["round"] == 1 and (failed[-1]["local/trained"], failed[-1]["local/cache_hit"]) == (0, 1)
    retried = trial("t2", faulty)
    assert retried[-1]["resumed"] == 1 and retried[-1]["local/trained"] == 0 and retried[-1]["round"] == 2
    events = json.loads((paths["runs"] / "t2" / "results.json").read_text())["events"]
    assert [e["round"] for e in events if e["kind"] == "resumed"] == [1]
    # the uninterrupted trial's numbers, to the bit (all but the timings)
    numbers = [{k: v for k, v in r[-1].items() if k.startswith("fused/") and not k.endswith("seconds")} for r in (retried, first)]
    assert numbers[0] == numbers[1] and "fused/fedprox/accuracy" in numbers[0], numbers


@pytest.mark.ray
def test_rayfuse_tune_attaches_with_address_and_a_finished_sweep_goes_on_only_with_resume(ray_session, tmp_path, capsys):
    space = write_space(tmp_path, [0.1])
    storage = tmp_path / "tune" / "space"
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    address = ray_session.get_runtime_context().gcs_address
    # from the checkout: the workers of the driver's job import actors.tune from its working directory
    out = subprocess.run(
        [sys.executable, "-m", "rayfuse", "tune", str(space), "--address", address],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert out.returncode == 0 and "best config: " in out.stdout, out.stderr[-4000:]
    table = pd.read_parquet(storage / "results.parquet")
    assert len(table) == 1 and table["stage"].tolist() == ["done"] and table["round"].tolist() == [2]
    assert table["local/trained"].tolist() == [2] and table["config/methods.fedprox.mu"].tolist() == [0.1]
    best = load_config(storage / "best.yaml")  # ready to run
    assert list(best.methods) == ["average", "fedprox"] and resolve_methods(best.methods)[1].params.mu == 0.1

    # in this process (attached to the session's Ray): refused without --resume, continued with it
    assert main(["tune", str(space)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["tune", str(space), "--resume"]) == 0
    again = pd.read_parquet(storage / "results.parquet")
    assert len(again) == 1 and again["local/trained"].tolist() == [2]  # the finished trial kept, nothing retrained
