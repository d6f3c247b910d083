"""Dashboard metrics (``actors.metrics.RunMetrics``): which events become which metric, with which tags.

Ray's metric classes are replaced by recorders here; the real export through a node's Prometheus endpoint is
checked on a two-node cluster in tests/integration/test_cluster.py.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import actors.metrics as run_metrics
from actors.federation import count_nbytes
from rayfuse.federation import Update


class Recorder:
    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.name, self.tag_keys, self.calls = name, tag_keys, []

    def _record(self, op, value, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags)  # every declared tag, nothing else
        self.calls.append((op, value, dict(tags)))

    def set(self, value, tags=None):
        self._record("set", value, tags)

    def inc(self, value=1.0, tags=None):
        self._record("inc", value, tags)

    def observe(self, value, tags=None):
        self._record("observe", value, tags)


@pytest.fixture
def recorded(monkeypatch):
    fake = types.SimpleNamespace(Gauge=Recorder, Counter=Recorder, Histogram=Recorder)
    monkeypatch.setattr(run_metrics, "metrics", fake)
    return run_metrics.RunMetrics("run-1", num_clients=3)


def calls(metric, op=None):
    return [(v, t) for o, v, t in metric.calls if op in (None, o)]


def test_events_become_tagged_metrics(recorded):
    m = recorded
    assert calls(m.alive) == [(3, {"run": "run-1", "method": "-"})]
    m.on_event({"kind": "client_trained", "client": 0, "seconds": 1.5})
    m.on_event({"kind": "stage_end", "stage": "local_training", "seconds": 4.0})
    m.on_event({"kind": "method_start", "method": "fedavg"})
    m.on_event({"kind": "metrics", "method": "fedavg", "round": 1, "client": None, "values": {"accuracy": 0.5, "train_loss": 1.2}})
    m.on_event({"kind": "metrics", "method": "fedavg", "round": 1, "client": 0, "values": {"accuracy": 0.1}})  # a client's row: not fused
    m.on_event({"kind": "progress", "method": "fedavg", "round": 1, "clients": 2, "metrics": {"accuracy": 0.5, "train_loss": 1.2}})
    m.on_event({"kind": "client_dropped", "client": 2})
    m.on_event({"kind": "method_done", "method": "fedavg", "seconds": 2.0, "metrics": {"accuracy": 0.6, "nll": float("nan")}})
    m.on_event({"kind": "progress", "method": "gems", "message": "no round"})
    assert calls(m.train_seconds) == [(1.5, {"run": "run-1", "method": "-"})]
    assert calls(m.stage_seconds) == [
        (4.0, {"run": "run-1", "method": "-", "stage": "local_training"}),
        (2.0, {"run": "run-1", "method": "fedavg", "stage": "method"}),
    ]
    assert calls(m.round) == [(1.0, {"run": "run-1", "method": "fedavg"})] and len(calls(m.rounds)) == 1
    assert calls(m.alive)[-1] == (2.0, {"run": "run-1", "method": "fedavg"})
    assert [t["event"] for _, t in calls(m.client_events)] == ["trained", "dropped"]
    fused = {(t["method"], t["metric"]): v for v, t in calls(m.fused)}
    assert fused == {("fedavg", "accuracy"): 0.6, ("fedavg", "train_loss"): 1.2}  # the NaN is not exported
    assert m.method == "gems"


def test_bytes_are_counted_per_direction_and_a_broken_event_never_raises(recorded):
    recorded.count_bytes("broadcast", 400)
    recorded.count_bytes("upload", 0)
    assert calls(recorded.bytes) == [(400, {"run": "run-1", "method": "-", "direction": "broadcast"})]
    recorded.on_event({"kind": "stage_end", "stage": "x", "seconds": "not a number"})  # swallowed


def test_count_nbytes_walks_updates():
    update = Update({"w": np.zeros((10, 4), np.float32), "b": np.zeros(4, np.float64)}, num_examples=5, metrics={"loss": 1.0})
    assert count_nbytes(update) == 160 + 32
    assert count_nbytes([{"a": np.zeros(3)}, (np.zeros(2, np.int8),), "text"]) == 24 + 2


def test_the_grafana_dashboard_plots_every_exported_metric_and_nothing_else():
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana" / "rayfuse.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\bray_(rayfuse_[a-z_]+)", e)}
    assert used == set(run_metrics.METRIC_NAMES)
    assert all('run=~"$run"' in e for e in exprs)  # every panel follows the run picker
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "run", "method"}
