"""Federated evaluation (``evaluation: federated | both``): what a client sends, the aggregate against central
evaluation, every method family's path, the run folder, and the refusals before anything starts."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from rayfuse.client import Client
from rayfuse.coordinator import Coordinator, MethodServer
from rayfuse.data.roles import load_dataset_from_config, make_plan
from rayfuse.errors import InputError, RunFailure
from rayfuse.evaluation import evaluate_held_out
from rayfuse.federation import EventLog, FailurePolicy, Gathered, InProcessFederation
from rayfuse.metrics import (
    ECE_BINS,
    SUM_KEYS,
    add_metric_sums,
    check_metric_sums,
    compute_metrics,
    metric_sums,
    metrics_from_sums,
)
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, prepare_run, run_experiment

METRICS = ("accuracy", "nll", "entropy", "ece")


def build_coordinator(cfg, run_dir, *, val_from_test: bool = False) -> Coordinator:
    """A coordinator over in-process clients; with ``val_from_test`` the clients' held-out splits partition the
    server's test set (their union is exactly the central test set)."""
    plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)
    if val_from_test:
        assert plan.test_source == "split"  # the test rows are taken from the dataset as the clients' rows are
        plan = dataclasses.replace(plan, client_val=tuple(np.array_split(plan.test, plan.num_clients)))

    def factory(i, restarted):
        return Client(
            i,
            plan.for_client(i),
            data_cfg=cfg.data,
            model_cfg=cfg.model,
            train_cfg=cfg.train,
            seed=cfg.run.seed,
            faults=cfg.federation.faults,
            restarted=restarted,
        )

    fed = InProcessFederation(factory, plan.num_clients, FailurePolicy.from_config(cfg.federation), EventLog())
    return Coordinator(cfg, plan, str(run_dir), fed)


def server_for(coord: Coordinator, label: str) -> MethodServer:
    return MethodServer(coord, next(s for s in coord.specs if s.label == label), resume=False)


# -- the sums ----------------------------------------------------------------------------------------------------


def test_the_metrics_of_summed_parts_equal_the_metrics_of_the_whole():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(500, 7)) * 3
    proba = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = rng.integers(0, 7, size=500)
    parts = [metric_sums(proba[idx], y[idx]) for idx in np.array_split(rng.permutation(500), [0, 3, 120, 121, 400])]
    assert any(p["count"] == 0 for p in parts)  # an empty held-out split adds nothing
    whole = compute_metrics(proba, y)
    federated = metrics_from_sums(add_metric_sums(parts))
    assert federated["accuracy"] == whole["accuracy"]
    for name in ("nll", "entropy", "ece"):
        assert federated[name] == pytest.approx(whole[name], rel=1e-12, abs=1e-15)


def test_a_reply_with_other_keys_per_sample_arrays_or_inconsistent_counts_is_refused():
    good = metric_sums(np.full((4, 2), 0.5), np.array([0, 1, 1, 0]))
    assert check_metric_sums(good) is None
    assert "keys" in check_metric_sums({**good, "proba": np.zeros(4)})
    assert "array of 15" in check_metric_sums({**good, "bin_count": np.zeros(4)})
    assert "inconsistent" in check_metric_sums({**good, "correct": 5.0})
    assert "finite" in check_metric_sums({**good, "nll_sum": float("nan")})
    assert "keys" in check_metric_sums(good, extra=("vote_correct",))


# -- the client step -----------------------------------------------------------------------------------------------


def test_a_clients_evaluation_reply_holds_sums_and_counts_only(make_config, tmp_path):
    cfg = make_config(evaluation="federated", methods={"average": {}})
    coord = build_coordinator(cfg, tmp_path / "run")
    params = coord.reference_params()
    for vote in (False, True):
        replies = coord.federation.run(evaluate_held_out, [params, params], [0.5, 0.5], vote=vote).results
        for client, reply in replies.items():
            assert set(reply) == set(SUM_KEYS) | ({"vote_correct"} if vote else set())
            for key, value in reply.items():
                assert np.shape(value) == ((ECE_BINS,) if key.startswith("bin_") else ()), key
            assert reply["count"] == len(coord.plan.client_val[client]) > 0
            assert check_metric_sums(reply, extra=("vote_correct",) if vote else ()) is None


def test_federated_metrics_equal_central_metrics_when_the_held_out_splits_partition_the_test_set(make_config, tmp_path):
    cfg = make_config(evaluation="both", methods={"average": {}, "ensemble": {"weighted": True}})
    coord = build_coordinator(cfg, tmp_path / "run", val_from_test=True)
    updates = coord.local_updates().results
    server = server_for(coord, "average")
    averaged = server.updates.collect(Gathered(updates), weighted=True).params  # the sample-weighted mean of the local models
    members = [u.params for u in updates.values()]
    checks = [
        server.scoring.evaluate(averaged),
        server.scoring.evaluate(members[0], resized=True),
        server_for(coord, "ensemble").scoring.evaluate_ensemble(members, [0.1, 0.2, 0.3, 0.4]),
    ]
    for metrics in checks:
        for name in (*METRICS, *(("vote_accuracy",) if "vote_accuracy" in metrics else ())):
            assert metrics[f"federated_{name}"] == pytest.approx(metrics[name], rel=1e-6, abs=1e-9), name
        assert metrics["federated_accuracy"] == metrics["accuracy"]
    assert "vote_accuracy" in checks[2]


def test_federated_aggregate_is_the_count_weighted_mean_of_the_client_table(make_config, tmp_path):
    cfg = make_config(evaluation="federated", methods={"average": {}})
    coord = build_coordinator(cfg, tmp_path / "run")
    summary = coord.run_method("average")
    table = summary["client_metrics"]
    assert [row["client"] for row in table] == [0, 1, 2, 3]
    assert [row["count"] for row in table] == [len(v) for v in coord.plan.client_val]
    counts = np.array([row["count"] for row in table], dtype=float)
    for name in ("accuracy", "nll", "entropy"):
        assert summary["metrics"][name] == pytest.approx(np.sum(counts * [row[name] for row in table]) / counts.sum(), rel=1e-9)
    assert summary["evaluation"] == "federated"


def test_evaluate_proba_on_the_server_test_set_is_refused_under_federated_evaluation(make_config, tmp_path):
    cfg = make_config(evaluation="federated", methods={"average": {}})
    server = server_for(build_coordinator(cfg, tmp_path / "run"), "average")
    with pytest.raises(RunFailure, match="evaluate_proba"):
        server.scoring.evaluate_proba(np.full((3, 10), 0.1))


# -- every method family -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "label, methods, sections",
    [
        ("fedavg", {"fedavg": {"rounds": 2, "local_epochs": 1}}, {}),
        ("average", {"average": {}}, {}),
        ("ensemble", {"ensemble": {}}, {}),
        ("local", {"local": {}}, {}),
        ("global", {"global": {"epochs": 2}}, {}),
        (
            "aligned",
            {"aligned": {"merge": "nonparametric", "new_unit_threshold": 1.0, "max_width": 1.5, "repair": False}},
            {"model": {"name": "mlp", "hidden": [16]}, "train": {"epochs": 3, "shared_init": False}},
        ),
        (
            "gems",
            {"gems": {"num_samples": 50, "r_max": 100.0, "tol": 0.5, "public_samples": 40}},
            {
                "partition": {"method": "labels", "num_clients": 2, "groups": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]},
                "model": {"name": "logreg"},
                "data": {"public_size": 60},
            },
        ),
        (
            "tuned-local",
            {"tuned-local": {"method": "tuned", "base": "local", "public_samples": 30}},
            {"model": {"name": "logreg"}, "data": {"public_size": 50}},
        ),
    ],
)
def test_every_method_family_is_scored_on_the_clients_held_out_splits(make_config, tmp_path, label, methods, sections):
    cfg = make_config(evaluation="federated", methods=methods, **sections)
    prepare_run(cfg)  # accepted before anything starts
    coord = build_coordinator(cfg, tmp_path / "run")
    summary = coord.run_method(label)
    n = coord.plan.num_clients
    assert summary["evaluation"] == "federated"
    assert [row["client"] for row in summary["client_metrics"]] == list(range(n))
    assert all(
        0.0 <= row["accuracy"] <= 1.0 and row["count"] == len(coord.plan.client_val[row["client"]]) for row in summary["client_metrics"]
    )
    assert 0.0 <= summary["metrics"]["accuracy"] <= 1.0 and np.isfinite(summary["metrics"]["nll"])
    rows = [r for r in summary["history"] if r["metric"] == "val_accuracy"]
    assert sorted(r["client"] for r in rows if r["round"] == max(x["round"] for x in rows)) == list(range(n))
    if label == "fedavg":  # per-round federated evaluation: a client table per evaluated round
        assert sorted({r["round"] for r in rows}) == [1, 2]
    if label == "ensemble":
        assert "vote_accuracy" in summary["metrics"]


# -- the run folder ---------------------------------------------------------------------------------------------------


def test_both_reports_central_and_federated_metrics_and_the_client_table(make_config, tmp_path, capsys):
    cfg = make_config(evaluation="both", methods={"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}})
    run_dir = tmp_path / "both"
    run_experiment(cfg, InProcessBackend(), run_dir, printer=Printer(enabled=False), show_tables=True)
    printed = capsys.readouterr().out
    results = json.loads((run_dir / "results.json").read_text())
    assert results["evaluation"] == "both" and results["config"]["evaluation"] == "both"
    for label in ("average", "fedavg"):
        entry = results["methods"][label]
        assert entry["evaluation"] == "both"
        for name in METRICS:
            assert 0.0 <= entry[name] < np.inf and 0.0 <= entry[f"federated_{name}"] < np.inf
        assert [row["client"] for row in entry["client_metrics"]] == [0, 1, 2, 3]
        assert f"  {label}: " in printed
    assert "federated evaluation" in printed
    table = pq.read_table(run_dir / "metrics.parquet").to_pandas()
    per_client = table[(table.method == "fedavg") & (table.metric == "val_accuracy")]
    assert sorted(per_client.client.unique()) == [0, 1, 2, 3] and sorted(per_client["round"].unique()) == [1, 2]
    assert not table.duplicated(["method", "round", "metric", "client"]).any()
    assert (run_dir / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_central_is_the_default_and_reports_no_client_table(make_config, tmp_path):
    cfg = make_config(methods={"average": {}})
    assert cfg.evaluation == "central"
    summary = build_coordinator(cfg, tmp_path / "run").run_method("average")
    assert summary["evaluation"] == "central" and "client_metrics" not in summary
    assert not any(r["metric"].startswith("val_") for r in summary["history"])


# -- refusals before anything starts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sections, match",
    [
        ({"evaluation": "federated", "methods": {"kl": {"application": "bnn"}}}, "central for method 'kl'"),
        ({"evaluation": "both", "methods": {"epgan": {}}}, "central for method 'epgan'"),
        ({"evaluation": "federated", "data": {"val_size": 0}, "methods": {"average": {}}}, "data.val_size is 0"),
        (
            {"evaluation": "federated", "data": {"public_size": 0.05, "target": {"dataset": "digits"}}, "methods": {"average": {}}},
            "data.target",
        ),
    ],
)
def test_federated_evaluation_is_refused_where_the_clients_cannot_score(make_config, sections, match):
    cfg = make_config(**sections)
    with pytest.raises(InputError, match=match) as info:
        prepare_run(cfg)
    assert info.value.path == "evaluation"


def test_an_unknown_evaluation_is_one_line_naming_the_key(make_config):
    with pytest.raises(InputError, match="evaluation: expected 'federated', 'central' or 'both'"):
        make_config(evaluation="fedrated")


def test_the_federated_plot_and_summary_show_each_clients_accuracy(tmp_path):
    from rayfuse.report import format_client_summary, plot_comparison

    rows = [{"client": 0, "count": 10, "accuracy": 0.5}, {"client": 1, "count": 30, "accuracy": 0.9}, {"client": 2, "count": 0}]
    methods = {"fedavg": {"accuracy": 0.8, "evaluation": "federated", "client_metrics": rows, "seconds": 1.0}}
    history = [{"round": r, "metric": "accuracy", "value": 0.1 * r, "client": None} for r in (1, 2)]
    plot_comparison(tmp_path / "plot.png", methods, [{"label": "fedavg", "history": history}], evaluation="federated")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = format_client_summary(methods, "federated")
    assert "fedavg: 0.8000 over 2 clients (40 samples); lowest client 0 0.5000, highest client 1 0.9000" in summary
