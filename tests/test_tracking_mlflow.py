"""The MLflow sink (``tracking.mlflow``): one MLflow run per run folder, one nested run per method with its params,
its metric rows at ``step=round`` and its fused model; refused before start when MLflow is not installed."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest

from rayfuse.errors import InputError
from rayfuse.runner import InProcessBackend, prepare_run, run_experiment
from rayfuse.store import RunStore
from rayfuse.tracking import RUN_TAG, mlflow_uri


def _run(cfg, run_dir, **kwargs):
    return run_experiment(cfg, InProcessBackend(), run_dir, printer=lambda e: None, show_tables=False, **kwargs)


def test_a_run_with_tracking_mlflow_logs_each_method_nested_with_params_metrics_and_model(make_config, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = make_config(
        methods={"local": {}, "fedavg": {"rounds": 2, "local_epochs": 1, "lr": 0.05}}, tracking={"mlflow": {"experiment": "tiny"}}
    )
    run_dir = tmp_path / "run"
    results = _run(cfg, run_dir)
    assert (run_dir / "mlruns").is_dir()  # the default store: the run folder's own mlruns/
    tracked = results["tracking"]["mlflow"]
    assert tracked["uri"] == (run_dir / "mlruns").resolve().as_uri() and tracked["experiment"] == "tiny"
    client = MlflowClient(tracking_uri=tracked["uri"])
    experiment = client.get_experiment_by_name("tiny")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {run_dir.name, "local", "fedavg"}
    parent = runs[run_dir.name]
    assert parent.info.run_id == tracked["run_id"] and parent.data.params["dataset"] == "digits"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"config.yaml", "comparison.png"}

    fedavg = runs["fedavg"]
    assert fedavg.data.tags["mlflow.parentRunId"] == parent.info.run_id and tracked["methods"]["fedavg"] == fedavg.info.run_id
    assert fedavg.data.params["method"] == "fedavg" and fedavg.data.params["rounds"] == "2" and fedavg.data.params["lr"] == "0.05"
    # per-round metrics at step=round, the unrounded values of the method's rows (metrics.parquet's)
    accuracy = [(m.step, m.value) for m in client.get_metric_history(fedavg.info.run_id, "accuracy")]
    table = pd.read_parquet(run_dir / "metrics.parquet")
    rows = table[(table["method"] == "fedavg") & (table["metric"] == "accuracy") & table["client"].isna()]
    assert sorted(accuracy) == sorted(zip(rows["round"].astype(int), rows["value"])) and [s for s, _ in sorted(accuracy)] == [1, 2]
    assert client.get_metric_history(fedavg.info.run_id, "final/accuracy")[0].value == results["methods"]["fedavg"]["accuracy"]
    model = [a.path for a in client.list_artifacts(fedavg.info.run_id, "model")]
    assert model == [f"model/{results['files']['models']['fedavg'].split('/')[-1]}"]
    assert [a.path for a in client.list_artifacts(fedavg.info.run_id, "plots")] == ["plots/comparison.png"]
    # a client's own rows: client/<id>/<metric>
    local = runs["local"]
    assert "client/0/accuracy" in local.data.metrics and "accuracy" in local.data.metrics


def test_logging_the_same_run_folder_again_replaces_its_earlier_record(make_config, tmp_path):
    from mlflow.tracking import MlflowClient

    from rayfuse.tracking import log_to_mlflow

    cfg = make_config(methods={"fedavg": {"rounds": 1, "local_epochs": 1}}, tracking={"mlflow": {}})
    run_dir = tmp_path / "run"
    results = _run(cfg, run_dir)
    summaries = [RunStore(run_dir).load_method_state("fedavg")]
    again = log_to_mlflow(cfg.tracking.mlflow, cfg=cfg, run_dir=run_dir, resolved=results["config"], summaries=summaries, warn=pytest.fail)
    client = MlflowClient(tracking_uri=again["uri"])
    experiment = client.get_experiment_by_name(cfg.run.name)
    live = client.search_runs([experiment.experiment_id])
    assert {r.info.run_id for r in live} == {again["run_id"], *again["methods"].values()}
    assert all(r.data.tags[RUN_TAG] for r in live)


def test_without_mlflow_installed_the_run_is_refused_before_start_naming_the_key_and_the_install(make_config, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = make_config(tracking={"mlflow": {}})
    with pytest.raises(InputError) as info:
        prepare_run(cfg)
    assert info.value.path == "tracking.mlflow" and "pip install 'rayfuse[mlflow]'" in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    run_dir = tmp_path / "never"
    with pytest.raises(InputError):
        _run(cfg, run_dir)
    assert not run_dir.exists()


def test_the_uri_a_folder_a_file_uri_or_a_server(tmp_path, monkeypatch):
    from rayfuse.config import MlflowConfig

    monkeypatch.chdir(tmp_path)
    assert mlflow_uri(MlflowConfig(), tmp_path / "run") == (tmp_path / "run" / "mlruns").as_uri()
    assert mlflow_uri(MlflowConfig(uri="mlruns"), tmp_path / "run") == (tmp_path / "mlruns").as_uri()
    assert mlflow_uri(MlflowConfig(uri="http://mlflow:5000"), tmp_path) == "http://mlflow:5000"
    assert mlflow_uri(MlflowConfig(uri="file:///srv/mlruns"), tmp_path) == "file:///srv/mlruns"
