"""``CoordinatorActor``: the named actor that runs methods' server loops (``<run>/coordinator``).

It wraps :class:`rayfuse.coordinator.Coordinator` with a :class:`actors.federation.RayFederation` over the client
actors' handles, and exports the run's dashboard metrics (:mod:`actors.metrics`). It is a threaded actor
(``max_concurrency > 1``) so the driver can poll its events while a method runs, and it is placed on the driver's
node so it writes checkpoints and model files into the run folder directly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from actors.federation import RayFederation
from actors.metrics import RunMetrics
from rayfuse.config import ExperimentConfig
from rayfuse.coordinator import Coordinator
from rayfuse.data.roles import DataPlan
from rayfuse.devices import assigned_device
from rayfuse.federation import EventLog, FailurePolicy
from rayfuse.method import MethodSpec

__all__ = ["CoordinatorActor"]


class CoordinatorActor:
    def __init__(
        self,
        cfg: ExperimentConfig,
        plan: DataPlan,
        run_dir: str,
        clients: Mapping[int, Any],
        start_time: float,
        specs: list[MethodSpec] | None = None,
    ) -> None:
        events = EventLog(start=start_time)
        federation = RayFederation(
            clients,
            FailurePolicy.from_config(cfg.federation),
            events,
            task_cpus=cfg.federation.task_cpus,
            restart_timeout_s=cfg.federation.startup_timeout_s,
            run=Path(run_dir).name,
            namespace=cfg.federation.namespace,
        )
        device = assigned_device(ray.get_gpu_ids())  # federation.coordinator.num_gpus: cost matrices, merges, distillation
        # ``specs`` carry the methods' classes: one given as an object (a notebook's Method subclass) arrives by value.
        self.coordinator = Coordinator(cfg, plan, run_dir, federation, specs=specs, device=device)
        # Dashboard metrics (actors.metrics): fed by the event log and the federation's byte counts.
        self.metrics = RunMetrics(Path(run_dir).name, plan.num_clients)
        events.listeners.append(self.metrics.on_event)
        federation.on_bytes = self.metrics.count_bytes

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def survey_silos(self) -> Any:
        return self.coordinator.survey_silos()

    def prepare_local_models(self, resume: bool = False) -> dict[str, Any]:
        return self.coordinator.prepare_local_models(resume)

    def run_method(self, label: str, resume: bool = False) -> dict[str, Any]:
        return self.coordinator.run_method(label, resume)

    def events_since(self, index: int) -> list[dict[str, Any]]:
        return self.coordinator.events_since(index)
