"""Real Ray: a FedAvg run aggregated flat (the coordinator folds every reply as it arrives), per actor (each actor
hosting several clients sends one partial sum), gathered (``federation.streaming: false``) and under secure aggregation
(``federation.secure_aggregation``: the masked sum, exact to half a quantisation step) gives the same model within
float rounding, and each run records its mode.

One local Ray (2 CPUs) is started for the whole session by the ``ray_session`` fixture.
"""

from __future__ import annotations

import numpy as np
import pytest

from rayfuse.io import load_params
from rayfuse.report import Printer
from rayfuse.runner import run_experiment

pytestmark = pytest.mark.ray

METHODS = {
    "fedavg": {"rounds": 2, "local_epochs": 1},
    "clipped": {"method": "fedavg", "rounds": 2, "local_epochs": 1, "aggregator": {"clip_norm": 0.5}},
}
MODES = {
    "gathered": {"clients_per_actor": 2, "streaming": False},
    "flat": {"clients_per_actor": 2, "aggregation": "flat"},
    "per_actor": {"clients_per_actor": 2},  # unset: per_actor, since clients_per_actor > 1
    # SecAgg+ over the actors (rayfuse.updates.secure): the four stages' calls, within half a quantisation step a round
    "secure": {"clients_per_actor": 2, "secure_aggregation": True},
}


def test_flat_per_actor_gathered_and_secure_rounds_give_the_same_model_on_ray(ray_session, make_config, tmp_path):
    from actors.backend import RayBackend

    results, models = {}, {}
    for mode, federation in MODES.items():
        cfg = make_config(federation={"backend": "ray", **federation}, methods=METHODS)
        results[mode] = run_experiment(cfg, RayBackend(), tmp_path / mode, printer=Printer(enabled=False), show_tables=False)
        assert results[mode]["status"] == "succeeded", mode
        models[mode] = {label: load_params(tmp_path / mode / "models" / f"{label}.safetensors") for label in METHODS}
    for mode in MODES:
        for label in METHODS:
            info = results[mode]["methods"][label]["info"]
            assert info["aggregation"]["mode"] == mode, (mode, label)
            for key, value in models["gathered"][label].items():
                got = models[mode][label][key]
                assert got.dtype == value.dtype and np.isfinite(got).all()
                # two rounds of local training from aggregates that differ in the last bits: still float rounding
                np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-5, err_msg=f"{mode} {label} {key}")
    events = [e for e in results["per_actor"]["events"] if e["kind"] == "aggregation"]
    assert {e["mode"] for e in events} == {"per_actor"}
