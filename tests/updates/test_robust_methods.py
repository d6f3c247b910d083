"""The ``aggregator`` setting of the methods that average updates (fedavg, fedadam, average, aligned), in process."""

from __future__ import annotations

import numpy as np

from rayfuse.models import params_equal


def fused_params(coord, label):
    from rayfuse.io import load_params

    return load_params(coord.store.root / coord.run_method(label)["model_file"])


def test_average_with_krum_returns_one_local_model_and_with_median_their_median(coordinator):
    coord = coordinator(
        methods={
            "krum": {"method": "average", "aggregator": {"name": "krum", "f": 0}},
            "median": {"method": "average", "aggregator": "median"},
        }
    )
    local = [u.params for u in coord.local_updates().results.values()]
    chosen = fused_params(coord, "krum")
    assert sum(params_equal(chosen, m) for m in local) >= 1
    median = fused_params(coord, "median")
    for key, value in median.items():
        np.testing.assert_allclose(value, np.median(np.stack([m[key] for m in local]).astype(np.float64), axis=0).astype(value.dtype))


def test_fedavg_family_runs_with_robust_aggregators_and_clipping(coordinator):
    methods = {
        "med": {"method": "fedavg", "rounds": 2, "local_epochs": 1, "aggregator": {"name": "median", "clip_norm": 5.0}},
        "gm": {"method": "fedadam", "rounds": 2, "local_epochs": 1, "aggregator": {"name": "geometric_median"}},
        "plain": {"method": "fedavg", "rounds": 2, "local_epochs": 1},
        "mean": {"method": "fedavg", "rounds": 2, "local_epochs": 1, "aggregator": {"name": "mean"}},
    }
    coord = coordinator(methods=methods)
    for label in ("med", "gm"):
        summary = coord.run_method(label)
        assert 0.0 <= summary["metrics"]["accuracy"] <= 1.0
        assert [r["value"] for r in summary["history"] if r["metric"] == "clients"] == [4.0, 4.0]
    # The default and an explicit mean give the same model: the same label seeds the same client steps.
    a = coordinator(methods={"fl": methods["plain"]})
    b = coordinator(methods={"fl": methods["mean"]})
    assert params_equal(fused_params(a, "fl"), fused_params(b, "fl"))


def test_fedavg_clip_norm_bounds_each_rounds_step(coordinator):
    from rayfuse.coordinator import MethodServer
    from rayfuse.method import resolve_methods

    coord = coordinator(methods={"fl": {"method": "fedavg", "rounds": 1, "local_epochs": 1, "aggregator": {"clip_norm": 0.01}}})
    start = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False).models.initial_params()
    fused = fused_params(coord, "fl")
    step = np.sqrt(sum(float(((fused[k].astype(np.float64) - start[k]) ** 2).sum()) for k in start if start[k].dtype.kind == "f"))
    assert 0 < step <= 0.01 * (1 + 1e-5)


def test_aligned_merge_takes_a_robust_aggregator(coordinator):
    coord = coordinator(methods={"al": {"method": "aligned", "alignment": "weight", "repair": False, "aggregator": "median"}})
    summary = coord.run_method("al")
    assert summary["info"]["aggregator"] == "median" and 0.0 <= summary["metrics"]["accuracy"] <= 1.0
