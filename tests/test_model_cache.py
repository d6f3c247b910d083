"""The content-addressed cache of trained local models (``run.model_cache``): fusion-only variations train once."""

from __future__ import annotations

import json

from rayfuse.method import resolved_config
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, run_experiment
from rayfuse.store import local_model_key

QUIET = Printer(enabled=False)


def run(cfg, run_dir):
    return run_experiment(cfg, InProcessBackend(), run_dir, printer=QUIET, show_tables=False)


def kinds(results):
    return [e["kind"] for e in results["events"]]


def test_a_fusion_only_change_reuses_the_cached_local_models(make_config, tmp_path):
    cache = str(tmp_path / "cache")
    methods = {"local": {}, "average": {}}
    first = run(make_config(run={"model_cache": cache}, methods=methods), tmp_path / "a")
    assert kinds(first).count("client_trained") == 4 and "local_models_cached" in kinds(first)
    # Another method set (fusion-only change), another run name: same key, no training.
    second = run(make_config(run={"model_cache": cache, "name": "other"}, methods={**methods, "ensemble": {}}), tmp_path / "b")
    assert "client_trained" not in kinds(second)
    assert [e.get("source") for e in second["events"] if e["kind"] == "local_models_restored"] == ["cache"]
    assert second["methods"]["average"]["accuracy"] == first["methods"]["average"]["accuracy"]
    assert second["methods"]["local"]["accuracy"] == first["methods"]["local"]["accuracy"]
    entries = [p for p in (tmp_path / "cache" / "local-models").iterdir() if p.is_dir()]
    assert len(entries) == 1 and sorted(p.name for p in entries[0].iterdir())[-1] == "key.json"


def test_a_training_change_gets_its_own_entry(make_config, tmp_path):
    cache = str(tmp_path / "cache")
    run(make_config(run={"model_cache": cache}, methods={"average": {}}), tmp_path / "a")
    other = run(make_config(run={"model_cache": cache}, train={"epochs": 2}, methods={"average": {}}), tmp_path / "b")
    assert kinds(other).count("client_trained") == 4
    assert len([p for p in (tmp_path / "cache" / "local-models").iterdir() if p.is_dir()]) == 2


def test_the_key_ignores_methods_and_storage_but_not_the_seed(make_config):
    base = resolved_config(make_config())
    key = local_model_key(base, "h")[0]
    assert local_model_key({**base, "methods": {}, "run": {**base["run"], "storage": "x", "name": "y"}}, "h")[0] == key
    assert local_model_key({**base, "run": {**base["run"], "seed": 1}}, "h")[0] != key
    assert local_model_key(base, "other-partition")[0] != key
    fault = {"client": 0, "step": "fedavg.fit", "call": 1, "mode": "raise", "seconds": 1.0}
    later = {**base, "federation": {**base["federation"], "faults": [fault]}}
    assert local_model_key(later, "h")[0] == key  # a fault after local training leaves the local models alone
    early = {**base, "federation": {**base["federation"], "faults": [{**fault, "step": "train_local", "mode": "nan"}]}}
    assert local_model_key(early, "h")[0] != key
    json.dumps(local_model_key(base, "h")[1])  # the key's inputs are written as key.json


def test_step_results_round_trip_nested_arrays_and_values(tmp_path):
    import numpy as np

    from rayfuse.store import StepResultCache

    cache = StepResultCache(tmp_path, "k1", {"step": "kl.bnn_posterior"})
    results = {0: {"bnn": {"w1_mu": np.ones((3, 2)), "b2_var": np.zeros(4)}, "seconds": 1.5, "n": np.int64(7), "note": None},
               1: {"bnn": {"w1_mu": np.full((3, 2), 2.0), "b2_var": np.ones(4)}, "seconds": 2.0, "n": 3, "note": "x"}}
    assert cache.load([0, 1]) is None
    with cache.lock():
        assert cache.save(results)
    back = cache.load([0, 1])
    assert back[1]["bnn"]["w1_mu"].tolist() == results[1]["bnn"]["w1_mu"].tolist() and back[0]["n"] == 7
    assert back[0]["seconds"] == 1.5 and back[0]["note"] is None and back[1]["note"] == "x"
    assert cache.load([0, 1, 2]) is None  # an incomplete entry is a miss
    # a result with values that cannot be stored safely (no pickles) is simply not cached
    other = StepResultCache(tmp_path, "k2")
    assert not other.save({0: {"model": object()}}) and other.load([0]) is None


def test_a_client_state_store_keeps_the_last_two_rounds_on_the_clients_storage(tmp_path):
    """``ClientStateStore``: a client's private state of one method run, under its own ``run.model_cache``."""
    from types import SimpleNamespace

    import numpy as np
    import pytest

    from rayfuse.client import ClientStateStore

    ctx = SimpleNamespace(client_id=3, local_cache=str(tmp_path))
    with pytest.raises(ValueError, match="alphanumeric"):
        ClientStateStore(ctx, "epgan-state", "../x")
    assert ClientStateStore(SimpleNamespace(client_id=3, local_cache=None), "epgan-state", "abc").folder is None
    assert ClientStateStore(SimpleNamespace(client_id=3, local_cache=None), "epgan-state", "abc").save("a", 1, {}) is None
    store = ClientStateStore(ctx, "epgan-state", "abc")
    assert store.folder == tmp_path / "client-state" / "client-3" / "epgan-state" / "abc"
    arrays = {"rng": np.arange(5, dtype=np.uint8), "iterations": np.asarray(7, dtype=np.int64)}
    store.save("a", 1, arrays)
    store.save("a-2", 1, arrays)  # another name in the same store is left alone
    store.save("a", 2, arrays, keep=1)
    store.save("a", 3, arrays, keep=2)
    assert sorted(f.name for f in store.folder.iterdir()) == ["a-00002.safetensors", "a-00003.safetensors", "a-2-00001.safetensors"]
    loaded = store.load("a", 3)
    assert loaded["iterations"].shape == () and int(loaded["iterations"]) == 7 and loaded["rng"].dtype == np.uint8
    assert store.has("a", 2) and not store.has("a", 1)
    with pytest.raises(FileNotFoundError):
        store.load("a", 1)
    assert store.forget() == 3 and not store.folder.exists() and store.forget() == 0
