"""End-to-end runs on the in-process backend: the run folder, failure policies, resume, atomicity."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from rayfuse.errors import InputError, RunFailure
from rayfuse.io import load_params
from rayfuse.method import resolved_config
from rayfuse.models import params_equal
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, load_run_config, new_run_dir, run_experiment

QUIET = Printer(enabled=False)


def run(cfg, run_dir, **kwargs):
    return run_experiment(cfg, InProcessBackend(), run_dir, printer=QUIET, show_tables=False, **kwargs)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One run of every baseline, shared by the tests that only read its folder."""
    from rayfuse.config import validate_config
    from tests.conftest import TINY, merge

    run_dir = tmp_path_factory.mktemp("full") / "run"
    cfg = validate_config(merge(TINY, {"run": {"storage": str(run_dir.parent)}}))
    return cfg, run_dir, run(cfg, run_dir)


def test_results_json_has_every_method_with_its_metrics(full_run):
    cfg, run_dir, results = full_run
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk["status"] == "succeeded" and on_disk["error"] is None
    assert list(on_disk["methods"]) == ["local", "average", "ensemble", "fedavg", "global"]
    for label, entry in on_disk["methods"].items():
        for metric in ("accuracy", "nll", "entropy", "ece"):
            assert 0.0 <= entry[metric] < np.inf, (label, metric)
    assert on_disk["methods"]["global"]["oracle"] is True
    assert "infeasible" in on_disk["methods"]["global"]["note"]
    assert on_disk["methods"]["local"]["accuracy_std"] >= 0
    assert len(on_disk["methods"]["local"]["info"]["per_client"]) == 4
    assert "vote_accuracy" in on_disk["methods"]["ensemble"]
    assert on_disk["methods"]["fedavg"]["rounds"] == 3
    assert on_disk["config"] == resolved_config(cfg)
    assert {"partition", "startup", "local_training", "method/fedavg", "report", "total"} <= set(on_disk["timings"])
    assert any(e["kind"] == "method_done" for e in on_disk["events"])


def test_local_mean_and_std_match_the_per_client_numbers(full_run):
    _, _, results = full_run
    local = results["methods"]["local"]
    accs = [row["accuracy"] for row in local["info"]["per_client"]]
    assert local["accuracy"] == pytest.approx(np.mean(accs))
    assert local["accuracy_std"] == pytest.approx(np.std(accs))


def test_metrics_parquet_has_one_row_per_method_round_metric(full_run):
    _, run_dir, results = full_run
    table = pq.read_table(run_dir / "metrics.parquet").to_pandas()
    assert set(table.columns) == {"method", "method_name", "round", "metric", "value", "client"}
    fedavg = table[(table.method == "fedavg") & (table.metric == "accuracy")]
    assert sorted(fedavg["round"]) == [1, 2, 3]
    assert fedavg[fedavg["round"] == 3]["value"].item() == pytest.approx(results["methods"]["fedavg"]["accuracy"])
    per_client = table[(table.method == "local") & table.client.notna()]
    assert sorted(per_client.client.unique()) == [0, 1, 2, 3]
    assert not table.duplicated(["method", "round", "metric", "client"]).any()


def test_partition_manifest_and_models_are_written(full_run):
    cfg, run_dir, results = full_run
    manifest = json.loads((run_dir / "partition.json").read_text())
    assert manifest["hash"] == results["partition"]["hash"]
    assert [sum(c["class_counts"]) for c in manifest["clients"]] == [c["num_train"] + c["num_val"] for c in manifest["clients"]]
    for label in ("average", "fedavg", "global"):
        params = load_params(run_dir / results["methods"][label]["model_file"])
        assert "layers.0.weight" in params
    assert (run_dir / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(run_dir.rglob("*.tmp")), "no temporary files left behind"


def test_the_saved_fedavg_model_reproduces_the_reported_accuracy(full_run):
    cfg, run_dir, results = full_run
    from rayfuse.data.roles import load_dataset_from_config, make_plan, server_splits
    from rayfuse.metrics import accuracy
    from rayfuse.models import build_model, predict_proba, set_params

    dataset = load_dataset_from_config(cfg.data)
    test, _ = server_splits(dataset, make_plan(dataset, cfg.data, cfg.partition, cfg.run.seed))
    model = set_params(build_model(cfg.model, test.X.shape[1:], 10), load_params(run_dir / "models" / "fedavg.safetensors"))
    assert accuracy(predict_proba(model, test.X), test.y) == pytest.approx(results["methods"]["fedavg"]["accuracy"])


def test_same_config_same_numbers(full_run, tmp_path):
    cfg, _, results = full_run
    again = run(cfg, tmp_path / "again")
    for label in results["methods"]:
        assert again["methods"][label]["accuracy"] == results["methods"][label]["accuracy"], label


@pytest.mark.parametrize("policy", ["retry", "drop", "fail"])
def test_a_client_that_raises_mid_run_under_each_policy(make_config, tmp_path, policy):
    cfg = make_config(
        methods={"fedavg": {"rounds": 3, "local_epochs": 1}},
        federation={"on_client_failure": policy, "faults": [{"client": 2, "step": "fedavg.fit", "call": 2, "mode": "raise"}]},
    )
    run_dir = tmp_path / policy
    if policy == "fail":
        with pytest.raises(RunFailure, match="client 2 failed in step fedavg.fit"):
            run(cfg, run_dir)
        results = json.loads((run_dir / "results.json").read_text())
        assert results["status"] == "failed" and "client 2" in results["error"]
        assert results["methods"] == {}
        return
    results = run(cfg, run_dir)
    kinds = [(e["kind"], e.get("client")) for e in results["events"]]
    assert ("client_failed", 2) in kinds
    rounds = {
        r["round"]: r["value"] for r in json.loads((run_dir / "state" / "fedavg.json").read_text())["history"] if r["metric"] == "clients"
    }
    if policy == "retry":
        assert ("client_retry", 2) in kinds
        assert rounds == {1: 4, 2: 4, 3: 4}
    else:
        assert ("client_dropped", 2) in kinds
        assert rounds == {1: 4, 2: 3, 3: 4}


def test_a_retried_round_equals_the_undisturbed_round(make_config, tmp_path):
    run(make_config(methods={"fedavg": {"rounds": 2}}), tmp_path / "clean")
    faulty = run(
        make_config(
            methods={"fedavg": {"rounds": 2}}, federation={"faults": [{"client": 0, "step": "fedavg.fit", "call": 1, "mode": "exit"}]}
        ),
        tmp_path / "faulty",
    )
    assert any(e["kind"] == "client_restarted" for e in faulty["events"])
    a = load_params(tmp_path / "clean" / "models" / "fedavg.safetensors")
    b = load_params(tmp_path / "faulty" / "models" / "fedavg.safetensors")
    assert params_equal(a, b)


def test_nan_updates_are_rejected_never_averaged(make_config, tmp_path):
    cfg = make_config(
        methods={"fedavg": {"rounds": 2}}, federation={"faults": [{"client": 1, "step": "fedavg.fit", "call": 2, "mode": "nan"}]}
    )
    results = run(cfg, tmp_path / "nan")
    rejected = [e for e in results["events"] if e["kind"] == "update_rejected"]
    assert [e["client"] for e in rejected] == [1] and "NaN" in rejected[0]["message"]
    params = load_params(tmp_path / "nan" / "models" / "fedavg.safetensors")
    assert all(np.isfinite(v).all() for v in params.values())


def test_every_update_rejected_fails_the_run(make_config, tmp_path):
    faults = [{"client": c, "step": "fedavg.fit", "call": 1, "mode": "nan"} for c in range(4)]
    cfg = make_config(methods={"fedavg": {"rounds": 1}}, federation={"faults": faults})
    with pytest.raises(RunFailure, match="0 valid client updates"):
        run(cfg, tmp_path / "allnan")


def test_resume_after_an_interrupted_run_equals_the_uninterrupted_run(make_config, tmp_path):
    methods = {"local": {}, "fedavg": {"rounds": 5, "local_epochs": 1}}
    straight = run(make_config(methods=methods), tmp_path / "straight")

    # Round 4 fails (policy fail): the run stops after checkpointing rounds 1-3.
    crash = {"on_client_failure": "fail", "faults": [{"client": 3, "step": "fedavg.fit", "call": 4, "mode": "raise"}]}
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RunFailure):
        run(make_config(methods=methods, federation=crash), interrupted)
    assert json.loads((interrupted / "checkpoints" / "fedavg" / "latest.json").read_text())["round"] == 3
    assert (interrupted / "state" / "local.json").is_file()

    # Resume with the fault removed (only federation.* keys may change on resume).
    from rayfuse.config import parse_overrides

    cfg = load_run_config(interrupted, parse_overrides(["federation.faults=[]", "federation.on_client_failure=retry"]))
    resumed = run(cfg, interrupted, resume=True)
    kinds = [e["kind"] for e in resumed["events"]]
    assert "local_models_restored" not in kinds  # local finished in the first attempt: loaded from state/
    assert any(e["kind"] == "resumed" and e["round"] == 3 for e in resumed["events"])
    assert resumed["status"] == "succeeded" and resumed["run"]["resumed"] is True
    assert params_equal(
        load_params(interrupted / "models" / "fedavg.safetensors"), load_params(tmp_path / "straight" / "models" / "fedavg.safetensors")
    )
    assert resumed["methods"]["fedavg"]["accuracy"] == straight["methods"]["fedavg"]["accuracy"]
    assert resumed["methods"]["local"]["accuracy"] == straight["methods"]["local"]["accuracy"]
    history = [r for r in json.loads((interrupted / "state" / "fedavg.json").read_text())["history"] if r["metric"] == "accuracy"]
    assert [r["round"] for r in history] == [1, 2, 3, 4, 5]


def test_resume_restores_local_models_instead_of_retraining(make_config, tmp_path):
    methods = {"local": {}, "average": {}}
    run_dir = tmp_path / "r"
    first = run(make_config(methods=methods), run_dir)
    (run_dir / "state" / "average.json").unlink()  # as if the run stopped before `average`
    resumed = run(load_run_config(run_dir), run_dir, resume=True)
    kinds = [e["kind"] for e in resumed["events"]]
    assert "local_models_restored" in kinds and "client_trained" not in kinds
    assert resumed["methods"]["average"]["accuracy"] == first["methods"]["average"]["accuracy"]


def test_resume_refuses_experiment_changes(make_config, tmp_path):
    run_dir = tmp_path / "r"
    run(make_config(methods={"average": {}}), run_dir)
    from rayfuse.config import parse_overrides

    with pytest.raises(InputError, match="only federation"):
        load_run_config(run_dir, parse_overrides(["train.epochs=9"]))
    with pytest.raises(InputError, match="--resume"):
        load_run_config(tmp_path / "nowhere")


def test_out_must_be_new_or_empty(make_config, tmp_path):
    cfg = make_config()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(InputError, match="--out"):
        new_run_dir(cfg, tmp_path / "used")
    assert new_run_dir(cfg, tmp_path / "fresh") == tmp_path / "fresh"
    default = new_run_dir(cfg)
    assert default.parent == tmp_path / "runs" and default.name.startswith("t-")


def test_a_crash_while_reporting_leaves_no_half_written_result(make_config, tmp_path, monkeypatch):
    import rayfuse.runner as runner_module

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(runner_module, "plot_comparison", broken)
    run_dir = tmp_path / "crash"
    with pytest.raises(OSError, match="disk full"):
        run(make_config(methods={"average": {}}), run_dir)
    assert not (run_dir / "results.json").exists()
    assert not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob(".*.tmp"))
    # what was written is whole: the metrics table reads back
    assert pq.read_table(run_dir / "metrics.parquet").num_rows > 0


def test_bad_input_stops_before_any_client_starts(make_config, tmp_path):
    cfg = make_config(data={"dataset": "npz", "path": str(tmp_path / "missing.npz")})
    backend = InProcessBackend()
    with pytest.raises(InputError, match="data.path"):
        run_experiment(cfg, backend, tmp_path / "bad", printer=QUIET, show_tables=False)
    assert backend.coordinator is None
    assert not (tmp_path / "bad").exists()
