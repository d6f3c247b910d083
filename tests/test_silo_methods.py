"""More method families on silo data (``data.silos``, in-process ``federation.backend: local``), beside
tests/test_silo_runs.py whose silo files and configs these tests reuse: FedOpt, FedRef, the robust aggregator and central
DP of FedAvg, local DP-SGD, FedSA (its target set from ``data.public``), KL-fusion (bnn; gmm and topics without the
generator's truth), EP-GAN (its evaluation classifier trained on the server's own data), and a Tune sweep over a silo
job on the session's Ray. Refusals of what a silo run cannot do: one line, exit 2, before any client starts.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from rayfuse.cli import main
from tests.test_silo_runs import _blobs, _job, _run


def _server_sets(tmp_path, *, public: bool = False) -> dict:
    """``data.test`` (and ``data.public``) as npz files of the silos' task."""
    X, y = _blobs(30, seed=7)
    np.savez(tmp_path / "test.npz", X=X, y=y)
    sets = {"test": {"dataset": "npz", "path": str(tmp_path / "test.npz")}}
    if public:
        Xp, yp = _blobs(30, seed=8)
        np.savez(tmp_path / "public.npz", X=Xp, y=yp)
        sets["public"] = {"dataset": "npz", "path": str(tmp_path / "public.npz")}
    return sets


def _assert_federated(results: dict, labels) -> None:
    """Each method scored by federated evaluation: finite count-weighted metrics and a per-client table of all three
    silos whose counts add up to the held-out splits (45 rows per silo, val_size 0.1: 4 each)."""
    assert results["status"] == "succeeded" and results["evaluation"] == "federated"
    for label in labels:
        entry = results["methods"][label]
        assert entry["evaluation"] == "federated"
        assert 0.0 <= entry["accuracy"] <= 1.0 and math.isfinite(entry["nll"]) and math.isfinite(entry["ece"])
        rows = entry["client_metrics"]
        assert [row["client"] for row in rows] == [0, 1, 2] and sum(row["count"] for row in rows) == 12
        assert all(math.isfinite(row["accuracy"]) for row in rows)


@pytest.mark.parametrize(
    "methods",
    [
        {
            "fedadam": {"rounds": 2, "local_epochs": 1},
            "fedyogi": {"rounds": 2, "local_epochs": 1},
            "fedref": {"rounds": 2, "local_epochs": 1, "p": 1},
        },
        {
            "median": {"method": "fedavg", "rounds": 2, "local_epochs": 1, "aggregator": "median"},
            "dp": {
                "method": "fedavg",
                "rounds": 2,
                "local_epochs": 1,
                "dp": {"noise_multiplier": 0.5, "clip_norm": 1.0, "sample_rate": 1.0, "delta": 0.01},
            },
        },
    ],
    ids=["fedopt-fedref", "robust-central-dp"],
)
def test_server_side_fedavg_variants_run_on_silo_data(tmp_path, methods):
    results = _run(tmp_path, _job(tmp_path, methods))
    _assert_federated(results, methods)
    if "dp" in methods:  # central DP on silos: the privacy spent is reported as on a simulation
        assert math.isfinite(results["methods"]["dp"]["epsilon"]) and results["methods"]["dp"]["delta"] == 0.01
    if "fedref" in methods:
        assert results["methods"]["fedref"]["rounds"] == 2


def test_local_dp_sgd_runs_on_silo_data(tmp_path):
    job = _job(tmp_path, {"average": {}, "ensemble": {}})
    job["train"]["dp"] = {"noise_multiplier": 0.5, "max_grad_norm": 1.0, "delta": 0.001}
    results = _run(tmp_path, job)
    _assert_federated(results, ["average", "ensemble"])


def test_fedsa_takes_its_target_set_from_data_public(tmp_path):
    methods = {"fedsa": {"rounds": 1, "k": 2, "local_epochs": 1, "target_epochs": 1, "adapt_epochs": 1}}
    job = {**_job(tmp_path, methods, **_server_sets(tmp_path, public=True)), "evaluation": "central"}
    results = _run(tmp_path, job)
    entry = results["methods"]["fedsa"]
    assert results["status"] == "succeeded" and entry["evaluation"] == "central"
    assert 0.0 <= entry["accuracy"] <= 1.0 and math.isfinite(entry["nll"])
    assert json.loads((tmp_path / "runs" / "r" / "partition.json").read_text())["roles"]["public"]["size"] == 30


def test_kl_fusion_bnn_runs_on_silo_data_and_scores_on_data_test(tmp_path):
    methods = {"kl": {"application": "bnn", "hidden": 6, "bnn_epochs": 3, "mc_samples": 5}}
    results = _run(tmp_path, {**_job(tmp_path, methods, **_server_sets(tmp_path)), "evaluation": "central"})
    entry = results["methods"]["kl"]
    assert results["status"] == "succeeded" and entry["evaluation"] == "central"
    assert 0.0 <= entry["accuracy"] <= 1.0 and math.isfinite(entry["log_likelihood"]) and entry["hidden_units"] >= 1
    assert sorted(entry["info"]["local"]) == ["0", "1", "2"]  # every silo's local BNN scored beside the fused one


def test_kl_fusion_gmm_and_its_baselines_run_on_silo_data_without_the_generators_truth(tmp_path):
    methods = {
        "kl": {"application": "gmm", "n_components": 3, "n_init": 1, "vi_max_iter": 20},
        "spahm": {"n_components": 3, "n_init": 1, "vi_max_iter": 20},
        "dp_cluster": {"n_components": 3, "n_init": 1, "vi_max_iter": 20},
    }
    results = _run(tmp_path, {**_job(tmp_path, methods, **_server_sets(tmp_path)), "evaluation": "central"})
    assert results["status"] == "succeeded"
    for label in methods:  # no true atoms: the fused model's own size, no Hausdorff distance to a truth
        entry = results["methods"][label]
        assert entry["num_components"] >= 1 and "hausdorff" not in entry and "size_error" not in entry
    assert "true_components" not in results["methods"]["kl"]["info"] and len(results["methods"]["kl"]["info"]["means"][0]) == 4


def test_kl_fusion_topics_runs_on_silo_documents_scored_by_completion_on_data_test(tmp_path):
    rng = np.random.default_rng(0)
    topics = rng.dirichlet(np.full(12, 0.3), size=3)
    for i in range(3):
        docs = np.stack([rng.multinomial(40, rng.dirichlet(np.ones(3)) @ topics) for _ in range(30)])
        np.savez(tmp_path / f"docs{i}.npz", X=docs.astype(np.float32), y=np.arange(30) % 2)
    test = np.stack([rng.multinomial(40, rng.dirichlet(np.ones(3)) @ topics) for _ in range(20)])
    np.savez(tmp_path / "docs_test.npz", X=test.astype(np.float32), y=np.arange(20) % 2)
    job = _job(
        tmp_path,
        {"kl": {"application": "topics", "n_components": 3, "vi_max_iter": 10}},
        test={"dataset": "npz", "path": str(tmp_path / "docs_test.npz")},
    )
    job["data"]["silos"] = [{"dataset": "npz", "path": str(tmp_path / f"docs{i}.npz")} for i in range(3)]
    results = _run(tmp_path, {**job, "evaluation": "central"})
    entry = results["methods"]["kl"]
    assert results["status"] == "succeeded" and math.isfinite(entry["completion_ll"]) and entry["completion_ll"] < 0
    assert math.isfinite(entry["local_completion_ll_mean"]) and "topic_hausdorff" not in entry and "truth_completion_ll" not in entry


@pytest.mark.parametrize("application", ["gmm", "topics"])
def test_kl_fusion_with_the_true_component_counts_on_silos_is_refused_before_anything_starts(tmp_path, capsys, application):
    job = {**_job(tmp_path, {"klf": {"method": "kl", "application": application}}, **_server_sets(tmp_path)), "evaluation": "central"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["run", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfuse: error: methods.klf.n_components: expected a number of local components with data.silos")
    assert "\n" not in err and not (tmp_path / "runs").exists()


def _image_silos(tmp_path) -> tuple[list[dict], dict]:
    """Two silos of 8 x 8 images (bars: class 0 horizontal, class 1 vertical, in [0, 1]) and a server test set."""

    def images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        y = np.arange(n) % 2
        X = rng.uniform(0.0, 0.2, size=(n, 1, 8, 8))
        for i, label in enumerate(y):
            row = rng.integers(0, 8)
            if label:
                X[i, 0, :, row] = 1.0
            else:
                X[i, 0, row, :] = 1.0
        return X.astype(np.float32), y.astype(np.int64)

    silos = []
    for i in range(2):
        X, y = images(40, i)
        np.savez(tmp_path / f"img{i}.npz", X=X, y=y)
        silos.append({"dataset": "npz", "path": str(tmp_path / f"img{i}.npz")})
    X, y = images(300, 9)
    np.savez(tmp_path / "img_test.npz", X=X, y=y)
    return silos, {"dataset": "npz", "path": str(tmp_path / "img_test.npz")}


def test_epgan_runs_on_silo_images_with_its_classifier_trained_on_the_servers_test_set(tmp_path):
    silos, test = _image_silos(tmp_path)
    methods = {
        "ep": {
            "method": "epgan",
            "backbone": "wgan",
            "rounds": 1,
            "warmup_epochs": 1,
            "local_epochs": 1,
            "batch_size": 16,
            "hidden": 8,
            "latent_dim": 2,
            "out_activation": "sigmoid",
            "eval_samples": 100,
        }
    }
    job = {**_job(tmp_path, methods, test=test), "evaluation": "central"}
    job["data"]["silos"] = silos
    results = _run(tmp_path, job)
    entry = results["methods"]["ep"]
    assert results["status"] == "succeeded" and entry["evaluation"] == "central"
    assert {"fd", "is", "classes"} <= set(entry) and all(math.isfinite(entry[k]) for k in ("fd", "is", "classes"))
    assert entry["info"]["real_data_scores"]["is"] > 1.5  # the instrument, trained on data.test, separates the two classes


def test_epgan_on_silos_without_data_test_is_refused_before_anything_starts(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_job(tmp_path, {"epgan": {"rounds": 1}})))
    assert main(["run", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfuse: error: data.test: expected the server's test set with data.silos (EP-GAN") and "\n" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("method", ["epgan-oracle", "global"])
def test_oracles_needing_every_silo_pooled_stay_refused(tmp_path, capsys, method):
    job = {**_job(tmp_path, {"oracle": {"method": method}}, **_server_sets(tmp_path)), "evaluation": "central"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["run", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfuse: error: methods.oracle: expected methods that run without a dataset of their own with data.silos")
    assert not (tmp_path / "runs").exists()


def test_rayfuse_tune_runs_a_sweep_over_a_silo_job(tmp_path, capsys, ray_session):
    job = _job(tmp_path, {"fedavg": {"rounds": 1, "local_epochs": 1}})
    job["federation"] = {"clients": {"num_cpus": 0.1}, "coordinator": {"num_cpus": 0.1}, "task_cpus": 0.1}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    space = {
        "base": "job.yaml",
        "space": {"methods.fedavg.lr": {"grid": [0.01]}},
        "metric": "fused/fedavg/accuracy",
        "storage": str(tmp_path / "tune"),
    }
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    assert main(["tune", str(tmp_path / "space.yaml")]) == 0
    out = capsys.readouterr().out
    assert "1 trials" in out and "best: fused/fedavg/accuracy = " in out
    runs = list((tmp_path / "tune").rglob("results.json"))
    assert len(runs) == 1
    results = json.loads(runs[0].read_text())
    assert results["status"] == "succeeded" and results["evaluation"] == "federated"
    assert [row["client"] for row in results["methods"]["fedavg"]["client_metrics"]] == [0, 1, 2]
