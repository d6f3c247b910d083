"""The client is the one owner of its local model, the run folder its fallback: the coordinator keeps no copy, asks
the clients each time a method fuses local models, and gives a client that lost its model (a restarted process) the
run folder's copy back instead of having it train again."""

from __future__ import annotations

import numpy as np

from rayfuse.runner import InProcessBackend, prepare_run, run_experiment


def _started(cfg, run_dir):
    prepared = prepare_run(cfg)
    backend = InProcessBackend()
    events: list[dict] = []
    backend.start(cfg, prepared.plan, run_dir, on_event=events.append, start_time=0.0, specs=prepared.specs)
    backend.prepare_local_models(False)
    return backend, events


def _same(a, b):
    assert sorted(a.results) == sorted(b.results)
    for c in a.results:
        timeless = [{k: v for k, v in u.metrics.items() if k != "train_seconds"} for u in (a.results[c], b.results[c])]
        assert a.results[c].num_examples == b.results[c].num_examples and timeless[0] == timeless[1]
        assert all(np.array_equal(a.results[c].params[k], b.results[c].params[k]) for k in a.results[c].params)


def test_the_coordinator_asks_the_clients_each_time_and_keeps_no_copy(make_config, tmp_path):
    backend, _ = _started(make_config(methods={"average": {}, "ensemble": {}}), tmp_path / "run")
    coordinator, federation = backend.coordinator, backend.federation
    first = coordinator.local_updates()
    second = coordinator.local_updates()
    _same(first, second)
    assert all(federation.client(c)._calls["get_local_params"] == 2 for c in federation.client_ids)
    assert not any(isinstance(v, type(first)) for v in vars(coordinator).values())  # no Gathered of local models kept
    # each model checkpointed once in the run folder, the fallback
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "local").glob("*.safetensors")) == [
        f"client-{c}.safetensors" for c in federation.client_ids
    ]
    backend.stop()


def test_a_client_that_lost_its_model_gets_the_run_folders_copy_back_without_training(make_config, tmp_path):
    backend, events = _started(make_config(methods={"average": {}, "ensemble": {}}), tmp_path / "run")
    coordinator, federation = backend.coordinator, backend.federation
    before = coordinator.local_updates()
    federation._restart(1)  # what a crash does: a fresh process of client 1, without its trained model
    assert not federation.client(1).ctx.has_local_model
    trained = len([e for e in events if e["kind"] == "client_trained"])
    after = coordinator.local_updates()
    _same(before, after)
    assert federation.client(1).ctx.has_local_model  # the client owns it again
    assert len([e for e in events if e["kind"] == "client_trained"]) == trained  # nobody trained again
    restored = [e for e in events if e["kind"] == "local_models_restored" and e.get("source") == "checkpoint"]
    assert restored[-1]["clients"] == [1]
    backend.stop()


def test_a_client_lost_before_the_run_folder_holds_its_model_trains_the_same_model_again(make_config, tmp_path):
    cfg = make_config(methods={"average": {}})
    reference, _ = _started(cfg, tmp_path / "ref")
    expected = reference.coordinator.local_updates()
    reference.stop()
    backend, _ = _started(cfg, tmp_path / "run")
    backend.federation._restart(2)  # before any method fetched (nothing checkpointed yet)
    _same(expected, backend.coordinator.local_updates())
    backend.stop()


def test_a_crash_between_methods_leaves_the_later_methods_numbers_unchanged(make_config, tmp_path):
    """Client 1 crashes in FedAvg (restarted, its round retried); the ensemble after it fuses client 1's model from the
    run folder: its numbers equal those of a run without the crash, and no client trains twice."""
    methods = {"average": {}, "fedavg": {"rounds": 1, "local_epochs": 1}, "ensemble": {}}
    quiet = {"printer": lambda e: None, "show_tables": False}
    clean = run_experiment(make_config(methods=methods), InProcessBackend(), tmp_path / "clean", **quiet)
    crashed_cfg = make_config(
        methods=methods,
        federation={"on_client_failure": "retry", "max_restarts": 1, "faults": [{"client": 1, "step": "fedavg.fit", "mode": "exit"}]},
    )
    crashed = run_experiment(crashed_cfg, InProcessBackend(), tmp_path / "crashed", **quiet)
    kinds = [e["kind"] for e in crashed["events"]]
    assert "client_restarted" in kinds and kinds.count("client_trained") == 4
    assert crashed["methods"]["ensemble"]["accuracy"] == clean["methods"]["ensemble"]["accuracy"]
    assert crashed["methods"]["ensemble"]["nll"] == clean["methods"]["ensemble"]["nll"]
    assert any(e["kind"] == "local_models_restored" and e.get("clients") == [1] for e in crashed["events"])
