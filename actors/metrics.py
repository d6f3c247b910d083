"""Ray dashboard metrics of a run (``ray.util.metrics``), exported by the coordinator actor.

The coordinator's event log is the one source: :class:`RunMetrics` listens to it (the fused model's values come from
the metrics channel's ``metrics`` events, :func:`rayfuse.metrics.metric_row`, never from the rounded ``progress``
display) and to the federation's byte counts, so the core stays free of Ray. Every metric carries the tags ``run`` (the run folder's name) and ``method``
(the method label, ``-`` outside a method). Ray exports them through each node's metrics agent in Prometheus format
with a ``ray_`` prefix (``ray_rayfuse_rounds_total``...): the dashboard's Metrics view, Prometheus and the Grafana
dashboard ``docs/grafana/rayfuse.json`` read them.

==================================  =========  ==============================================================
metric                              type       meaning (extra tags)
==================================  =========  ==============================================================
rayfuse_stage_seconds               gauge      duration of the last finished stage (``stage``: local_training,
                                               method, ...)
rayfuse_stages_total                counter    finished stages (``stage``)
rayfuse_round                       gauge      the current round of a multi-round method
rayfuse_rounds_total                counter    finished rounds
rayfuse_bytes_total                 counter    bytes moved through the object store (``direction``: broadcast =
                                               one ``ray.put`` read by the clients, upload = clients' results)
rayfuse_clients_alive               gauge      clients that answered the last call (all of them at start)
rayfuse_client_events_total         counter    client failures (``event``: failed, retry, dropped, restarted,
                                               rejected, trained)
rayfuse_client_train_seconds        histogram  local training time per client
rayfuse_fused_metric                gauge      the fused model's metrics (``metric``: accuracy, nll, ece, ... and
                                               anything a method reports per round, e.g. an assignment cost or a
                                               number of global components)
==================================  =========  ==============================================================
"""

from __future__ import annotations

import math
import threading
from typing import Any

from ray.util import metrics

from rayfuse.metrics import metric_row

__all__ = ["RunMetrics", "METRIC_NAMES"]

METRIC_NAMES = (
    "rayfuse_stage_seconds",
    "rayfuse_stages_total",
    "rayfuse_round",
    "rayfuse_rounds_total",
    "rayfuse_bytes_total",
    "rayfuse_clients_alive",
    "rayfuse_client_events_total",
    "rayfuse_client_train_seconds",
    "rayfuse_fused_metric",
)

_CLIENT_EVENTS = {
    "client_failed": "failed",
    "client_retry": "retry",
    "client_dropped": "dropped",
    "client_restarted": "restarted",
    "update_rejected": "rejected",
    "client_trained": "trained",
}


class RunMetrics:
    """Turns one run's events into Ray metrics. Thread-safe (the coordinator is a threaded actor).

    Parameters
    ----------
    run : str
        The run's name (the run folder's name, also the prefix of its actor names).
    num_clients : int
    """

    def __init__(self, run: str, num_clients: int) -> None:
        self.run = run
        self.num_clients = num_clients
        self.method = "-"
        self._lock = threading.Lock()
        base = ("run", "method")
        self.stage_seconds = metrics.Gauge("rayfuse_stage_seconds", "Duration of the last finished stage (s)", tag_keys=base + ("stage",))
        self.stages = metrics.Counter("rayfuse_stages_total", "Finished stages", tag_keys=base + ("stage",))
        self.round = metrics.Gauge("rayfuse_round", "Current round of a multi-round method", tag_keys=base)
        self.rounds = metrics.Counter("rayfuse_rounds_total", "Finished rounds", tag_keys=base)
        self.bytes = metrics.Counter("rayfuse_bytes_total", "Bytes moved through the object store", tag_keys=base + ("direction",))
        self.alive = metrics.Gauge("rayfuse_clients_alive", "Clients that answered the last call", tag_keys=base)
        self.client_events = metrics.Counter("rayfuse_client_events_total", "Client events", tag_keys=base + ("event",))
        self.train_seconds = metrics.Histogram(
            "rayfuse_client_train_seconds",
            "Local training time per client (s)",
            boundaries=[0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800],
            tag_keys=base,
        )
        self.fused = metrics.Gauge("rayfuse_fused_metric", "Metrics of the fused model", tag_keys=base + ("metric",))
        self.alive.set(num_clients, tags=self._tags())

    def _tags(self, **extra: str) -> dict[str, str]:
        return {"run": self.run, "method": self.method, **extra}

    def count_bytes(self, direction: str, nbytes: int) -> None:
        if nbytes > 0:
            with self._lock:
                self.bytes.inc(nbytes, tags=self._tags(direction=direction))

    def on_event(self, event: dict[str, Any]) -> None:
        """An :class:`rayfuse.federation.EventLog` listener."""
        try:
            with self._lock:
                self._record(event)
        except Exception:  # metrics must never break a run
            pass

    def _record(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "method_start":
            self.method = str(event.get("method", "-"))
        elif kind == "method_done":
            tags = self._tags(stage="method")
            self.stage_seconds.set(float(event.get("seconds", 0.0)), tags=tags)
            self.stages.inc(1, tags=tags)
            self._fused(event.get("metrics") or {})
            self.method = "-"
        elif kind == "stage_end" and "seconds" in event:
            tags = self._tags(stage=str(event.get("stage")))
            self.stage_seconds.set(float(event["seconds"]), tags=tags)
            self.stages.inc(1, tags=tags)
        elif kind == "progress":
            if "method" in event:
                self.method = str(event["method"])
            if "round" in event:
                self.round.set(float(event["round"]), tags=self._tags())
                self.rounds.inc(1, tags=self._tags())
            if "clients" in event:
                self.alive.set(float(event["clients"]), tags=self._tags())
        elif (row := metric_row(event)) is not None and row.client is None:
            # the metrics channel (unrounded values), not the progress events' display values
            self.method = row.method or self.method
            self._fused(row.values)
        elif kind in _CLIENT_EVENTS:
            self.client_events.inc(1, tags=self._tags(event=_CLIENT_EVENTS[kind]))
            if kind == "client_trained" and "seconds" in event:
                self.train_seconds.observe(float(event["seconds"]), tags=self._tags())

    def _fused(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.fused.set(float(value), tags=self._tags(metric=str(name)))
