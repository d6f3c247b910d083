"""The MLflow sink (``tracking.mlflow``): one MLflow run per run folder, one nested run per method with its params,
its metric rows at ``step=round`` and its fused model; refused before start when MLflow is not installed."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import rayfuse
from rayfuse import tracking
from rayfuse.config import ExperimentConfig
from rayfuse.errors import InputError
from rayfuse.runner import InProcessBackend, prepare_run, run_experiment
from rayfuse.store import RunStore
from rayfuse.tracking import HTTP_SETTINGS, RUN_TAG, check_mlflow_uri, log_to_mlflow, mlflow_uri
from tests.config.test_bad_inputs import Files, _snapshot, call, closed_port, refused_line
from tests.config.test_bad_inputs import isolated as isolated  # noqa: F401  (the harness's fixture: the case's folder as cwd)


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


# ---------------------------------------------------------------------------------------------------------------
# tracking.mlflow.uri checked before start (issue 39): one line naming the key, exit 2, nothing written


def _job(uri: Callable[[Files], str], command: str = "run") -> Callable[[Files], Any]:
    def make(f: Files) -> Any:
        job = f.job(tracking={"mlflow": {"uri": uri(f)}})
        return call(rayfuse.run, str(f.root / job)) if command == "api" else [command, job]

    return make


URI_CASES: dict[str, tuple[Callable[[Files], Any], str]] = {
    "empty": (_job(lambda f: ""), "expected a folder, a file: URI or an http(s):// tracking server, got ''"),
    "a-file": (_job(lambda f: f.a_file()), "expected a folder rayfuse can create or write to, got 'a-file'; it is a file, not a folder"),
    "a-file-uri": (_job(lambda f: (f.root / f.a_file()).as_uri()), "it is a file, not a folder"),
    "below-a-file-uri": (_job(lambda f: (f.root / f.a_file()).as_uri() + "/sub"), "a-file is a file, not a folder"),
    "below-a-file": (_job(lambda f: f.a_file() + "/mlruns"), "expected a folder rayfuse can create or write to, got 'a-file/mlruns'"),
    "read-only": (_job(lambda f: f.readonly() + "/mlruns"), "expected a folder rayfuse can create or write to"),
    "misspelt-http": (_job(lambda f: "htp://127.0.0.1:5000"), "got 'htp://127.0.0.1:5000'; did you mean 'http'?"),
    "misspelt-file": (_job(lambda f: "fiel:mlruns"), "expected a folder or a URI MLflow stores runs at ("),
    "unknown-scheme": (_job(lambda f: "foo:bar"), "got 'foo:bar'; a folder whose name holds a colon: ./foo:bar"),
    "no-host": (_job(lambda f: "https://"), "expected an MLflow tracking server answering within 3 s, got 'https://'; no host"),
    "closed-port": (_job(lambda f: f"http://127.0.0.1:{closed_port()}"), "expected an MLflow tracking server answering within 3 s"),
    "validate-closed-port": (_job(lambda f: f"http://127.0.0.1:{closed_port()}", "validate"), "; connection refused"),
    "api-misspelt-file": (_job(lambda f: "fiel:mlruns", "api"), "did you mean 'file'?"),
}


@pytest.mark.parametrize("name", sorted(URI_CASES))
def test_a_bad_uri_is_refused_before_start_in_one_line(name: str, isolated: Path, capsys) -> None:
    make, expected = URI_CASES[name]
    command = make(Files(isolated))
    capsys.readouterr()
    before = _snapshot(isolated)
    line = refused_line(command, capsys)
    assert "tracking.mlflow.uri: expected " in line and expected in line, line
    assert _snapshot(isolated) == before


@pytest.mark.parametrize("uri", ["mlruns", "./a:b", "file:mlruns", "databricks"])
def test_good_uris_pass_the_check_and_write_nothing(uri: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    check_mlflow_uri(uri)
    assert list(tmp_path.iterdir()) == []


def test_a_server_gone_by_the_end_of_the_run_costs_seconds_and_a_warning(make_config, tmp_path) -> None:
    cfg = make_config(methods={"fedavg": {"rounds": 1}}, tracking={"mlflow": {"uri": f"http://127.0.0.1:{closed_port()}"}})
    warnings: list[str] = []
    t0 = time.perf_counter()
    got = log_to_mlflow(cfg.tracking.mlflow, cfg=cfg, run_dir=tmp_path, resolved={}, summaries=[{"label": "x"}], warn=warnings.append)
    assert got is None and time.perf_counter() - t0 < 5
    assert len(warnings) == 1 and warnings[0].startswith("tracking.mlflow: not logged to http://127.0.0.1:") and "refused" in warnings[0]


def test_mlflows_requests_are_bounded_while_rayfuse_logs_and_restored_after(monkeypatch) -> None:
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # the user's own setting wins
    seen = {}

    def fake_log(*args: Any) -> dict[str, Any]:
        seen.update(retries=MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), timeout=MLFLOW_HTTP_REQUEST_TIMEOUT.get())
        return {}

    monkeypatch.setattr(tracking, "_log", fake_log)
    cfg = ExperimentConfig.model_validate({"data": {"dataset": "digits"}, "methods": {"average": {}}, "tracking": {"mlflow": {}}})
    assert tracking.log_to_mlflow(cfg.tracking.mlflow, cfg=cfg, run_dir=".", resolved={}, summaries=[], warn=pytest.fail) == {}
    assert seen == {"retries": int(HTTP_SETTINGS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]), "timeout": 30}
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"
