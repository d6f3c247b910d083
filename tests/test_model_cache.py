"""The content-addressed cache of trained local models (``run.model_cache``): fusion-only variations train once."""

from __future__ import annotations

import json

from rayfuse.method import resolved_config
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, run_experiment
from rayfuse.store import local_model_key

QUIET = Printer(enabled=False)


def run(cfg, run_dir, resume=False):
    return run_experiment(cfg, InProcessBackend(), run_dir, resume=resume, printer=QUIET, show_tables=False)


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
    # one entry per client's model, each kept by its client under its content key (what it was computed from beside it)
    entries = [p for p in (tmp_path / "cache" / "local-models").iterdir() if p.is_dir()]
    assert len(entries) == 4 and all(
        sorted(p.name for p in e.iterdir()) == ["key.json", "params.safetensors", "sha256.json", "stats.json"] for e in entries
    )
    assert sorted(json.loads((e / "key.json").read_text())["client"] for e in entries) == [0, 1, 2, 3]


def test_a_training_change_gets_its_own_entry(make_config, tmp_path):
    cache = str(tmp_path / "cache")
    run(make_config(run={"model_cache": cache}, methods={"average": {}}), tmp_path / "a")
    other = run(make_config(run={"model_cache": cache}, train={"epochs": 2}, methods={"average": {}}), tmp_path / "b")
    assert kinds(other).count("client_trained") == 4
    assert len([p for p in (tmp_path / "cache" / "local-models").iterdir() if p.is_dir()]) == 2 * 4  # 4 clients, 2 keys


def _plans(cfg):
    from rayfuse.data.roles import load_dataset_from_config, make_plan

    return make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)


def test_the_key_ignores_methods_and_storage_but_not_the_seed(make_config):
    cfg = make_config()
    base, plan = resolved_config(cfg), _plans(cfg).for_client(0)
    key = local_model_key(base, plan)[0]
    assert local_model_key({**base, "methods": {}, "run": {**base["run"], "storage": "x", "name": "y"}}, plan)[0] == key
    assert local_model_key({**base, "run": {**base["run"], "seed": 1}}, plan)[0] != key
    assert local_model_key(base, _plans(make_config(partition={"alpha": 0.3})).for_client(0))[0] != key  # another split
    assert local_model_key(base, _plans(cfg).for_client(1))[0] != key  # another client
    fault = {"client": 0, "step": "fedavg.fit", "call": 1, "mode": "raise", "seconds": 1.0}
    later = {**base, "federation": {**base["federation"], "faults": [fault]}}
    assert local_model_key(later, plan)[0] == key  # a fault after local training leaves the local models alone
    early = {**base, "federation": {**base["federation"], "faults": [{**fault, "step": "train_local", "mode": "nan"}]}}
    assert local_model_key(early, plan)[0] != key
    json.dumps(local_model_key(base, plan)[1])  # the key's inputs are written as key.json


def test_the_client_and_the_coordinator_compute_the_same_key(make_config):
    """One key function for both sides: the client names its copy with it, the coordinator computes it from the run."""
    from rayfuse.client import Client

    fault = {"client": 1, "step": "train_local", "call": 1, "mode": "nan"}
    cfg = make_config(federation={"faults": [fault]})
    plan = _plans(cfg)
    for i in (0, 1):
        client = Client(
            i,
            plan.for_client(i),
            data_cfg=cfg.data,
            model_cfg=cfg.model,
            train_cfg=cfg.train,
            seed=cfg.run.seed,
            faults=cfg.federation.faults,
        )
        assert client.ctx.local_model_key() == local_model_key(resolved_config(cfg), plan.for_client(i))
    assert local_model_key(resolved_config(cfg), plan.for_client(1))[1]["faults"] == [{**fault, "seconds": 3600.0}]


def test_resume_reads_the_clients_copies_and_falls_back_to_the_run_folder(make_config, tmp_path):
    import shutil

    from rayfuse.runner import load_run_config

    cache, run_dir = tmp_path / "cache", tmp_path / "r"
    first = run(make_config(run={"model_cache": str(cache)}, methods={"local": {}, "average": {}}), run_dir)
    assert len(list((run_dir / "checkpoints" / "local").glob("client-*.safetensors"))) == 4  # fetched by local / average

    def resume():
        (run_dir / "state" / "average.json").unlink()  # as if the run stopped before `average`
        resumed = run(load_run_config(run_dir), run_dir, resume=True)
        assert "client_trained" not in kinds(resumed)
        assert resumed["methods"]["average"]["accuracy"] == first["methods"]["average"]["accuracy"]
        return [(e["source"], e["clients"]) for e in resumed["events"] if e["kind"] == "local_models_restored"]

    assert resume() == [("cache", [0, 1, 2, 3])]  # the clients' own copies
    shutil.rmtree(cache / "local-models" / local_model_key(first["config"], _plans(make_config()).for_client(2))[0])
    assert resume() == [("cache", [0, 1, 3]), ("checkpoint", [2])]  # client 2 lost its copy: the run folder's
    shutil.rmtree(cache)  # every client's storage is gone
    assert resume() == [("checkpoint", [0, 1, 2, 3])]


def test_parameters_move_only_for_the_methods_that_fuse_them(make_config, tmp_path):
    from rayfuse.client import Client
    from rayfuse.coordinator import Coordinator
    from rayfuse.federation import EventLog, FailurePolicy, InProcessFederation

    cfg = make_config(methods={"local": {}})
    plan = _plans(cfg)

    def client(i, restarted):
        return Client(i, plan.for_client(i), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=cfg.run.seed)

    coord = Coordinator(
        cfg, plan, str(tmp_path / "run"), InProcessFederation(client, 4, FailurePolicy.from_config(cfg.federation), EventLog())
    )
    assert coord.prepare_local_models() == {"clients": [0, 1, 2, 3], "restored": False}  # the clients train, keep their models
    assert not (coord.store.root / "checkpoints" / "local").exists()  # and no parameters travelled
    coord.run_method("local")  # `local` evaluates each client's model on the server: their parameters are fetched once
    assert len(list((coord.store.root / "checkpoints" / "local").glob("client-*.safetensors"))) == 4


def test_step_results_round_trip_nested_arrays_and_values(tmp_path):
    import numpy as np

    from rayfuse.store import StepResultCache

    cache = StepResultCache(tmp_path, "k1", {"step": "kl.bnn_posterior"})
    results = {
        0: {"bnn": {"w1_mu": np.ones((3, 2)), "b2_var": np.zeros(4)}, "seconds": 1.5, "n": np.int64(7), "note": None},
        1: {"bnn": {"w1_mu": np.full((3, 2), 2.0), "b2_var": np.ones(4)}, "seconds": 2.0, "n": 3, "note": "x"},
    }
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
