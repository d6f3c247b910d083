"""Fixtures shared by the method tests."""

from __future__ import annotations

import pytest

from rayfuse.client import Client
from rayfuse.coordinator import Coordinator
from rayfuse.data.roles import load_dataset_from_config, make_plan
from rayfuse.federation import EventLog, FailurePolicy, InProcessFederation


@pytest.fixture
def coordinator(make_config, tmp_path):
    """A coordinator over in-process clients for a tiny digits config."""

    def build(**sections):
        cfg = make_config(**sections)
        plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)

        def factory(i, restarted):
            return Client(i, plan.for_client(i), data_cfg=cfg.data, model_cfg=cfg.client_model(i), train_cfg=cfg.train, seed=cfg.run.seed,
                          faults=cfg.federation.faults, restarted=restarted, local_cache=cfg.run.model_cache)

        fed = InProcessFederation(factory, plan.num_clients, FailurePolicy.from_config(cfg.federation), EventLog())
        return Coordinator(cfg, plan, str(tmp_path / "run"), fed)

    return build
