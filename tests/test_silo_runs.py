"""Silo configs run end to end (``data.silos``, in-process ``federation.backend: local``; one Ray test for the
actor-startup error path): each method family on silo data, federated evaluation against central evaluation, the
federated standardisation's payloads, bad silos (one line, exit 2, nothing written), a Tune space over a silo job.

Every silo is a small file written to tmp_path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from rayfuse.cli import main
from rayfuse.client import report_silo
from rayfuse.config import validate_config
from rayfuse.data.silos import combine_moments
from rayfuse.errors import InputError
from rayfuse.runner import InProcessBackend, prepare_run, run_experiment


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = rng.normal(size=(n, 4)) * 0.5 + 3.0 * np.eye(3, 4)[y] + 10.0  # offset: standardisation matters
    return X.astype(np.float32), y.astype(np.int64)


def _silos(tmp_path, n: int = 3, size: int = 45) -> list[dict]:
    silos = []
    for i in range(n):
        X, y = _blobs(size, seed=i)
        np.savez(tmp_path / f"site{i}.npz", X=X, y=y)
        silos.append({"dataset": "npz", "path": str(tmp_path / f"site{i}.npz")})
    return silos


def _job(tmp_path, methods: dict, **data) -> dict:
    return {
        "run": {"name": "silo", "seed": 0, "storage": str(tmp_path / "runs")},
        "data": {"silos": _silos(tmp_path), **data},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 2, "batch_size": 16, "shared_init": True},
        "federation": {"backend": "local"},
        "methods": methods,
    }


def _run(tmp_path, job: dict) -> dict:
    return run_experiment(validate_config(job), InProcessBackend(), tmp_path / "runs" / "r", printer=lambda e: None, show_tables=False)


@pytest.mark.parametrize(
    "methods",
    [
        {"fedavg": {"rounds": 2, "local_epochs": 1}, "fedprox": {"rounds": 1, "local_epochs": 1, "mu": 0.1}},
        {"local": {}, "average": {}, "ensemble": {}, "aligned": {}},
        {"gems": {"m_epsilon": 4}},
    ],
    ids=["fedavg-family", "one-shot", "gems"],
)
def test_method_families_run_on_silo_data(tmp_path, methods):
    results = _run(tmp_path, _job(tmp_path, methods))
    assert results["status"] == "succeeded" and results["evaluation"] == "federated"
    for label in methods:
        entry = results["methods"][label]
        assert 0.0 <= entry["accuracy"] <= 1.0 and [row["client"] for row in entry["client_metrics"]] == [0, 1, 2]
    manifest = json.loads((tmp_path / "runs" / "r" / "partition.json").read_text())
    assert manifest["kind"] == "silos" and [c["size"] for c in manifest["clients"]] == [41, 41, 41]
    text = json.dumps(manifest)
    assert "site0" not in text and "indices" not in text and "train" not in manifest["clients"][0]


def test_methods_needing_server_data_take_data_public(tmp_path):
    X, y = _blobs(30, seed=9)
    np.savez(tmp_path / "public.npz", X=X, y=y)
    np.savez(tmp_path / "test.npz", X=X, y=y)
    job = _job(
        tmp_path,
        {"gems": {"m_epsilon": 4, "fine_tune": True}, "transfer": {"target_epochs": 1}},
        public={"dataset": "npz", "path": str(tmp_path / "public.npz")},
        test={"dataset": "npz", "path": str(tmp_path / "test.npz")},
    )
    results = _run(tmp_path, {**job, "evaluation": "central"})
    assert results["status"] == "succeeded"
    assert json.loads((tmp_path / "runs" / "r" / "partition.json").read_text())["roles"]["public"]["size"] == 30


def test_a_method_needing_a_public_sample_without_data_public_is_refused_before_anything_starts(tmp_path, capsys):
    job = _job(tmp_path, {"finetune": {}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["run", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfuse: error: data.public: expected the server's public / target sample") and "\n" not in err
    assert not (tmp_path / "runs").exists()


def test_federated_evaluation_equals_central_when_the_held_out_splits_are_the_test_set(tmp_path):
    silos, tests = [], []
    for i in range(2):
        X, y = _blobs(36, seed=i)
        Xt, yt = _blobs(12, seed=10 + i)
        np.savez(tmp_path / f"train{i}.npz", X=X, y=y)
        np.savez(tmp_path / f"test{i}.npz", X=Xt, y=yt)
        silos.append({"dataset": "npz", "path": str(tmp_path / f"train{i}.npz"), "test_path": str(tmp_path / f"test{i}.npz")})
        tests.append((Xt, yt))
    np.savez(tmp_path / "test.npz", X=np.concatenate([t[0] for t in tests]), y=np.concatenate([t[1] for t in tests]))
    job = _job(
        tmp_path, {"fedavg": {"rounds": 2, "local_epochs": 1}, "ensemble": {}}, test={"dataset": "npz", "path": str(tmp_path / "test.npz")}
    )
    job["data"]["silos"] = silos
    results = _run(tmp_path, {**job, "evaluation": "both"})
    for label in ("fedavg", "ensemble"):
        entry = results["methods"][label]
        for metric in ("accuracy", "nll", "ece"):
            assert entry["federated_" + metric] == pytest.approx(entry[metric], abs=1e-5)
        assert sum(row["count"] for row in entry["client_metrics"]) == 24


def test_standardisation_is_federated_and_its_payloads_are_statistics_only(tmp_path):
    job = _job(tmp_path, {"fedavg": {"rounds": 1, "local_epochs": 1}}, standardize=True)
    cfg = validate_config(job)
    backend = InProcessBackend()
    prepared = prepare_run(cfg)
    backend.start(cfg, prepared.plan, tmp_path / "r", on_event=lambda e: None, start_time=0.0, specs=prepared.specs)
    federation = backend.federation
    reports = federation.run(report_silo, moments=True).results
    for report in reports.values():  # a schema (counts, labels, a hash) and three moments; no row of the silo
        assert set(report) == {"schema", "moments"} and set(report["schema"]) >= {"size", "class_counts", "content_hash"}
        count, total, squares = report["moments"]
        assert count == 45 and total.shape == (4,) and squares.shape == (4,)
    plan = backend.survey_silos()
    pooled = np.concatenate([np.load(tmp_path / f"site{i}.npz")["X"] for i in range(3)]).astype(np.float64)
    mean, scale = combine_moments([r["moments"] for r in reports.values()])
    np.testing.assert_allclose(plan.normalization.mean[0], pooled.mean(0), rtol=1e-5)
    np.testing.assert_allclose(plan.normalization.std[0], pooled.std(0), rtol=1e-4)
    np.testing.assert_array_equal(plan.normalization.mean, mean)
    train = federation.client(0).ctx.train.X  # the client standardised its own split with the broadcast statistics
    assert abs(float(train.mean())) < 1.0 and float(train.min()) < 0.0
    backend.stop()


def _bad_silo(tmp_path, kind: str) -> tuple[dict, str]:
    if kind == "missing":
        return (
            {"dataset": "npz", "path": "${SITE_DATA}/nowhere.npz"},
            r"data\.silos\.1\.path: expected an existing npz file on client 1's node, got '\$\{SITE_DATA\}/nowhere\.npz'",
        )
    if kind == "no-images":
        for cls in ("a", "b"):
            (tmp_path / "images" / cls).mkdir(parents=True)
        return {"dataset": "imagefolder", "path": str(tmp_path / "images")}, r"data\.silos\.1\.path: expected class folders holding images"
    (tmp_path / "table.csv").write_text("f0,f1\n1,2\n3,4\n")
    return {"dataset": "csv", "path": str(tmp_path / "table.csv"), "label": "diagnosis"}, r"data\.silos\.1\..*diagnosis"


@pytest.mark.parametrize("kind", ["missing", "no-images", "no-label-column"])
def test_a_bad_silo_is_one_line_and_exit_2_with_nothing_written(tmp_path, monkeypatch, capsys, kind):
    import re

    monkeypatch.setenv("SITE_DATA", str(tmp_path))
    job = _job(tmp_path, {"fedavg": {"rounds": 1}})
    job["data"]["silos"][1], pattern = _bad_silo(tmp_path, kind)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["run", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(pattern, err), err
    assert not (tmp_path / "runs").exists()


def test_a_tune_space_over_a_silo_job_checks(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_job(tmp_path, {"fedavg": {"rounds": 1}})))
    space = {"base": "job.yaml", "space": {"methods.fedavg.lr": {"grid": [0.01, 0.1]}}, "metric": "fused/fedavg/accuracy"}
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    assert main(["tune", str(tmp_path / "space.yaml"), "--check"]) == 0
    assert "2 trials" in capsys.readouterr().out


def test_on_ray_a_silo_missing_on_its_node_is_the_input_error(tmp_path, ray_session):
    job = _job(tmp_path, {"fedavg": {"rounds": 1}})
    job["data"]["silos"][2] = {"dataset": "npz", "path": str(tmp_path / "gone.npz")}
    job["federation"] = {"backend": "ray"}
    from actors.backend import RayBackend

    with pytest.raises(InputError, match=r"^data\.silos\.2\.path: expected an existing npz file on client 2's node"):
        run_experiment(validate_config(job), RayBackend(), tmp_path / "runs" / "r", printer=lambda e: None, show_tables=False)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("step", ["train_local", "fedavg.fit"])
def test_a_restarted_silo_client_takes_the_federated_standardisation_back(tmp_path, step):
    # a client process that dies after the silo survey is rebuilt from the plan it started with (as Ray re-runs an
    # actor's constructor); the federation re-installs the completed plan, so its numbers are the fault-free run's
    job = _job(tmp_path, {"local": {}, "fedavg": {"rounds": 2, "local_epochs": 1}}, standardize=True)
    clean = _run(tmp_path, job)
    faulty = {
        **job,
        "run": {**job["run"], "storage": str(tmp_path / "faulty")},
        "federation": {
            "backend": "local",
            "on_client_failure": "retry",
            "max_restarts": 2,
            "faults": [{"client": 1, "step": step, "call": 1, "mode": "exit"}],
        },
    }
    results = run_experiment(
        validate_config(faulty), InProcessBackend(), tmp_path / "faulty" / "r", printer=lambda e: None, show_tables=False
    )
    assert [e["client"] for e in results["events"] if e["kind"] == "client_restarted"] == [1]
    for label in ("local", "fedavg"):
        for key in ("accuracy", "nll", "client_metrics"):
            assert results["methods"][label][key] == clean["methods"][label][key], (label, key)


def test_on_ray_a_restarted_silo_actor_takes_the_federated_standardisation_back(tmp_path, ray_session):
    # Ray re-runs the crashed actor's constructor with its creation arguments (the plan before the survey); the
    # completed plan travels with every call to it and is installed first, so the numbers are the fault-free run's
    from actors.backend import RayBackend

    job = _job(tmp_path, {"fedavg": {"rounds": 2, "local_epochs": 1}}, standardize=True)
    clean = _run(tmp_path, job)
    faulty = {
        **job,
        "run": {**job["run"], "storage": str(tmp_path / "faulty")},
        "federation": {
            "backend": "ray",
            "on_client_failure": "retry",
            "max_restarts": 2,
            "faults": [{"client": 1, "step": "fedavg.fit", "call": 1, "mode": "exit"}],
        },
    }
    results = run_experiment(validate_config(faulty), RayBackend(), tmp_path / "faulty" / "r", printer=lambda e: None, show_tables=False)
    assert [e["client"] for e in results["events"] if e["kind"] == "client_restarted"] == [1]
    for key in ("accuracy", "nll", "client_metrics"):
        assert results["methods"]["fedavg"][key] == clean["methods"]["fedavg"][key], key


def test_label_skewed_silos_run_with_data_classes_and_an_undeclared_value_is_one_line(tmp_path, capsys):
    job = _job(tmp_path, {"fedavg": {"rounds": 1, "local_epochs": 1}}, classes=[0, 1, 2])
    X, y = _blobs(45, seed=1)
    np.savez(tmp_path / "site1.npz", X=X[y > 0], y=y[y > 0])  # site 1 has no case of label 0
    results = _run(tmp_path, job)
    assert results["status"] == "succeeded"
    manifest = json.loads((tmp_path / "runs" / "r" / "partition.json").read_text())
    assert manifest["labels"] == ["0", "1", "2"] and manifest["clients"][1]["class_counts"][0] == 0
    np.savez(tmp_path / "site2.npz", X=X, y=np.where(y == 2, 7, y))  # 7 is not a declared label value
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**job, "run": {**job["run"], "storage": str(tmp_path / "again")}}))
    assert main(["run", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("rayfuse: error: data.silos.2.path: expected labels among data.classes ['0', '1', '2']")
    assert "got '7'" in err and not (tmp_path / "again").exists()
