"""The metrics channel: unrounded ``metrics`` events, separate from the rounded ``progress`` events the screen prints,
read by Ray Tune (ASHA), the Prometheus gauges and ``metrics.parquet``."""

from __future__ import annotations

import pandas as pd
import pytest

from rayfuse.metrics import METRICS_EVENT, MetricRow, metric_row, metrics_event
from rayfuse.runner import InProcessBackend, run_experiment


def test_a_metrics_event_round_trips_its_row_at_full_precision():
    kind, message, fields = metrics_event("fedavg", 3, {"accuracy": 0.123456789}, None)
    event = {"t": 0.0, "kind": kind, **fields}
    assert kind == METRICS_EVENT and message == ""
    assert metric_row(event) == MetricRow("fedavg", 3, None, {"accuracy": 0.123456789})
    assert metric_row({"kind": "progress", "method": "fedavg", "round": 3, "metrics": {"accuracy": 0.1235}}) is None


def test_a_run_sends_each_logged_row_unrounded_and_metrics_parquet_holds_the_same_rows(make_config, tmp_path):
    cfg = make_config(methods={"fedavg": {"rounds": 2, "local_epochs": 1}})
    events: list[dict] = []
    run_dir = tmp_path / "run"
    results = run_experiment(cfg, InProcessBackend(), run_dir, printer=events.append, show_tables=False)
    rows = [row for row in map(metric_row, events) if row is not None]
    assert {r.method for r in rows} == {"fedavg"} and {r.round for r in rows if r.client is None} == {1, 2}
    progress = [e for e in events if e["kind"] == "progress" and "round" in e]
    by_round = {r.round: r.values for r in rows if r.client is None}
    # the display is the channel's values rounded to 4 decimals; the channel itself is not rounded
    for event in progress:
        assert event["metrics"] == {k: round(v, 4) for k, v in by_round[event["round"]].items()}
    assert any(round(v, 4) != v for values in by_round.values() for v in values.values())
    # metrics.parquet: exactly the channel's rows
    table = pd.read_parquet(run_dir / "metrics.parquet")
    from_events = sorted((r.method, r.round, name, value) for r in rows for name, value in r.values.items())
    from_file = sorted(zip(table["method"], table["round"].astype(int), table["metric"], table["value"]))
    assert from_file == from_events
    # results.json keeps its event log free of the rows (they are metrics.parquet's)
    assert results["events"] and not any(e["kind"] == METRICS_EVENT for e in results["events"])


def test_the_trial_reporter_reports_exactly_the_channels_value_and_never_the_display():
    from actors.tune import _TrialReporter

    reports: list[dict] = []
    reporter = _TrialReporter("fused/fedavg/accuracy", reports.append)
    reporter({"kind": "progress", "method": "fedavg", "round": 1, "metrics": {"accuracy": 0.1235}})
    assert reports == []
    kind, _, fields = metrics_event("fedavg", 1, {"accuracy": 0.123456789})
    reporter({"kind": kind, **fields})
    assert reports[-1]["fused/fedavg/accuracy"] == 0.123456789 and reports[-1]["round"] == 1


def _trainable(config: dict) -> None:
    """A trial as ``actors.tune._run_trial`` reports it: the run's events through the trial's reporter, each round a
    progress event (the display, rounded) and the metrics event (the channel)."""
    from ray import tune

    from actors.tune import _TrialReporter

    reporter = _TrialReporter("fused/fedavg/accuracy", tune.report)
    for rnd in range(1, 4):
        value = 0.5 + config["offset"]
        reporter({"kind": "progress", "method": "fedavg", "round": rnd, "metrics": {"accuracy": round(value, 4)}})
        kind, _, fields = metrics_event("fedavg", rnd, {"accuracy": value})
        reporter({"kind": kind, **fields})


@pytest.mark.ray
def test_asha_stops_a_trial_worse_only_in_the_sixth_decimal(ray_session, tmp_path):
    """Two trials whose accuracies differ in the 6th decimal (both 0.5 on the screen). The first sets rung 1's cutoff;
    ASHA stops the second at round 1, which it could not do on the display's values (0.5 is not below 0.5)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    scheduler = ASHAScheduler(time_attr="round", max_t=3, grace_period=1, reduction_factor=2, stop_last_trials=False)
    tuner = tune.Tuner(
        tune.with_resources(_trainable, {"cpu": 1}),
        param_space={"offset": tune.grid_search([2e-6, 1e-6])},
        tune_config=tune.TuneConfig(metric="fused/fedavg/accuracy", mode="max", scheduler=scheduler, max_concurrent_trials=1),
        run_config=tune.RunConfig(name="asha", storage_path=str(tmp_path), verbose=0),
    )
    grid = tuner.fit()
    last = {r.config["offset"]: r.metrics for r in grid}
    assert last[2e-6]["round"] == 3 and last[2e-6]["fused/fedavg/accuracy"] == 0.5 + 2e-6
    assert last[1e-6]["round"] == 1 and last[1e-6]["fused/fedavg/accuracy"] == 0.5 + 1e-6  # stopped by ASHA at rung 1
