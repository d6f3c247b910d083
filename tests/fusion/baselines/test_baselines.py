"""The baseline methods: local, average, ensemble, fedavg / fedprox, global; the method registry."""

from __future__ import annotations

import numpy as np
import pytest

from rayfuse.client import set_local_params
from rayfuse.coordinator import MethodServer
from rayfuse.errors import RunFailure
from rayfuse.federation import Gathered, Update
from rayfuse.fusion import METHODS, Method
from rayfuse.fusion.baselines.ensemble import majority_vote
from rayfuse.fusion.fedavg.algorithm import FedAvg, FedAvgParams, FedAvgState
from rayfuse.method import resolve_methods
from rayfuse.models import params_equal


def test_registry_lists_the_baselines_and_resolves_aliases():
    assert {"local", "average", "ensemble", "fedavg", "fedprox", "global"} <= set(METHODS.names())
    assert METHODS.get("centralized") is METHODS.get("global")
    assert METHODS.get("global").tags.oracle is True
    assert all(issubclass(cls, Method) and cls.summary for _, cls in METHODS.items())


def test_averaging_identical_models_returns_the_model(coordinator):
    coord = coordinator(methods={"average": {}})
    params = coord.reference_params()
    coord.prepare_local_models()
    coord.federation.run(set_local_params, params)  # the clients own their local models: the same model on every client
    summary = coord.run_method("average")
    from rayfuse.io import load_params

    fused = load_params(coord.store.root / summary["model_file"])
    assert set(fused) == set(params)
    for key in params:  # equal up to float32 rounding of sum_k w_k * a
        np.testing.assert_allclose(fused[key], params[key], rtol=1e-6, atol=1e-7)


def test_average_is_the_sample_weighted_mean_of_the_local_models(coordinator):
    coord = coordinator(methods={"average": {}})
    updates = coord.local_updates()
    summary = coord.run_method("average")
    from rayfuse.io import load_params

    fused = load_params(coord.store.root / summary["model_file"])
    counts = np.array([u.num_examples for u in updates.values()], dtype=float)
    for key, value in fused.items():
        expected = np.average(np.stack([u.params[key] for u in updates.values()]), axis=0, weights=counts)
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)


def test_majority_vote_by_hand():
    # 3 models, 2 samples, 3 classes. Sample 0: votes 0, 0, 1 -> 0. Sample 1: votes 2, 1, 1 -> 1.
    probas = np.array(
        [
            [[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]],
            [[0.5, 0.4, 0.1], [0.1, 0.8, 0.1]],
            [[0.2, 0.7, 0.1], [0.2, 0.6, 0.2]],
        ]
    )
    assert majority_vote(probas, [1 / 3] * 3).tolist() == [0, 1]


def test_majority_vote_ties_go_to_the_larger_average_probability():
    # 2 models disagree (a 1-1 tie): model 1 is far more confident in class 2.
    probas = np.array([[[0.55, 0.0, 0.45]], [[0.05, 0.0, 0.95]]])
    assert majority_vote(probas, [0.5, 0.5]).tolist() == [2]


def test_ensemble_of_identical_models_matches_the_single_model(coordinator):
    coord = coordinator(methods={"ensemble": {}, "average": {}})
    one = coord.local_updates().results[0]
    coord.federation.run(set_local_params, one.params)  # the clients own their local models: client 0's on every client
    ensemble = coord.run_method("ensemble")["metrics"]
    average = coord.run_method("average")["metrics"]
    for metric in ("accuracy", "nll", "entropy", "ece"):
        assert ensemble[metric] == pytest.approx(average[metric], rel=1e-6, abs=1e-9)  # average: float32 rounding
    assert ensemble["vote_accuracy"] == pytest.approx(average["accuracy"])


def test_local_reports_each_client_on_the_global_test_set(coordinator):
    coord = coordinator(methods={"local": {}})
    summary = coord.run_method("local")
    per_client = summary["info"]["per_client"]
    assert [row["client"] for row in per_client] == [0, 1, 2, 3]
    client_rows = [r for r in summary["history"] if r["client"] is not None and r["metric"] == "accuracy"]
    assert len(client_rows) == 4


def test_local_models_are_trained_once_and_shared_by_methods(coordinator):
    coord = coordinator(methods={"local": {}, "average": {}, "ensemble": {}})
    coord.prepare_local_models()
    for label in ("local", "average", "ensemble"):
        coord.run_method(label)
    trained = [e for e in coord.events.since(0) if e["kind"] == "client_trained"]
    assert sorted(e["client"] for e in trained) == [0, 1, 2, 3]


def random_updates(reference, counts, seed=0):
    rng = np.random.default_rng(seed)
    return {i: Update({k: rng.normal(size=v.shape).astype(v.dtype) for k, v in reference.items()}, int(n)) for i, n in enumerate(counts)}


def test_fedavg_aggregation_is_np_average_and_independent_of_client_order(coordinator):
    coord = coordinator(methods={"fedavg": {}})
    server = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False)
    counts = [coord.plan.num_examples(i) for i in range(3)]  # the planned counts (any other count is rejected)
    updates = random_updates(coord.reference_params(), counts)
    averaged, used = _mean(server, Gathered(updates))
    reordered, _ = _mean(server, Gathered(dict(reversed(list(updates.items())))))
    assert list(used) == [0, 1, 2]
    for key, value in averaged.items():
        expected = np.average(np.stack([u.params[key] for u in updates.values()]), axis=0, weights=counts)
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(reordered[key], value, rtol=1e-5, atol=1e-6)
    uniform, _ = _mean(server, Gathered(updates), weighted=False)
    key = "layers.0.weight"
    np.testing.assert_allclose(uniform[key], np.mean([u.params[key] for u in updates.values()], axis=0), rtol=1e-5, atol=1e-6)
    assert FedAvg(FedAvgParams()).server_update(server, FedAvgState({}), averaged, used, 1) is averaged


def test_a_non_finite_update_is_found_through_the_average_and_left_out(coordinator):
    coord = coordinator(methods={"fedavg": {}})
    server = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False)
    updates = random_updates(coord.reference_params(), [coord.plan.num_examples(i) for i in range(4)])
    updates[2].params["layers.1.bias"][3] = np.inf
    averaged, used = _mean(server, Gathered(updates))
    assert list(used) == [0, 1, 3]
    clean, _ = _mean(server, Gathered({c: updates[c] for c in (0, 1, 3)}))
    assert params_equal(averaged, clean)
    rejected = [e for e in coord.events.since(0) if e["kind"] == "update_rejected"]
    assert [e["client"] for e in rejected] == [2] and "NaN or Inf" in rejected[0]["message"]


def test_fedprox_with_mu_zero_equals_fedavg(coordinator):
    # Same label -> same per-round client seeds; the only difference would be the proximal term.
    from rayfuse.io import load_params

    fedavg = coordinator(methods={"fl": {"method": "fedavg", "rounds": 2}})
    fedavg_summary = fedavg.run_method("fl")
    a = load_params(fedavg.store.root / fedavg_summary["model_file"])
    prox = coordinator(methods={"fl": {"method": "fedprox", "mu": 0.0, "rounds": 2}})
    prox_summary = prox.run_method("fl")
    b = load_params(prox.store.root / prox_summary["model_file"])
    assert prox_summary["method"] == "fedprox" and prox_summary["info"]["mu"] == 0.0
    assert params_equal(a, b)


def test_fedprox_mu_pulls_clients_towards_the_global_model(coordinator):
    from rayfuse.fusion.fedavg.algorithm import fit

    coord = coordinator(methods={"fedavg": {}})
    fed = coord.federation
    start = coord.reference_params()
    args = dict(label="x", round=1, epochs=3, lr=0.01, batch_size=16, optimizer="sgd", momentum=0.0, weight_decay=0.0)
    free = fed.run(fit, fed.put(start), clients=[0], mu=0.0, **args).results[0].params
    prox = fed.run(fit, fed.put(start), clients=[0], mu=10.0, **args).results[0].params
    dist = lambda p: sum(float(np.sum((p[k] - start[k]) ** 2)) for k in start)  # noqa: E731
    assert dist(prox) < dist(free)


def test_fedavg_improves_on_its_initialisation_and_samples_clients(coordinator):
    coord = coordinator(methods={"fedavg": {"rounds": 3, "fraction": 0.5}})
    summary = coord.run_method("fedavg")
    clients = [r["value"] for r in summary["history"] if r["metric"] == "clients"]
    assert clients == [2.0, 2.0, 2.0]
    server = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False)
    initial = server.scoring.evaluate(server.models.initial_params())["accuracy"]
    assert summary["metrics"]["accuracy"] > initial
    assert server.updates.sample_clients(0.5, 1) == server.updates.sample_clients(0.5, 1)
    assert len(server.updates.sample_clients(1.0, 1)) == 4


def test_only_oracles_may_read_pooled_client_data(coordinator):
    coord = coordinator(methods={"average": {}})
    server = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False)
    with pytest.raises(RunFailure, match="only oracle methods"):
        server.data.pooled_train()


def test_global_oracle_trains_on_the_pooled_training_splits(coordinator):
    coord = coordinator(methods={"global": {"epochs": 2}})
    summary = coord.run_method("global")
    assert summary["oracle"] is True
    assert summary["info"]["num_examples"] == sum(len(t) for t in coord.plan.client_train)


def test_accept_updates_rejects_bad_keys_shapes_and_values(coordinator):
    coord = coordinator(methods={"average": {}})
    server = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False)
    ref = coord.reference_params()
    n = coord.plan.num_examples
    good = Update({k: v.copy() for k, v in ref.items()}, n(0))
    wrong_key = Update({**{k: v for k, v in ref.items() if k != "layers.0.bias"}, "extra": np.zeros(1)}, n(1))
    wrong_shape = Update({**ref, "layers.0.weight": np.zeros((2, 2), np.float32)}, n(2))
    inf = Update({**ref, "layers.1.bias": np.full_like(ref["layers.1.bias"], np.inf)}, n(3))
    zero_count = Update(dict(ref), 0)
    not_update = {"w": 1}
    gathered = Gathered({0: good, 1: wrong_key, 2: wrong_shape, 3: inf, 4: zero_count, 5: not_update})
    accepted = server.updates.accept(gathered)
    assert list(accepted) == [0]
    reasons = {e["client"]: e["message"] for e in coord.events.since(0) if e["kind"] == "update_rejected"}
    assert "missing keys" in reasons[1] and "unexpected keys" in reasons[1]
    assert "shape" in reasons[2]
    assert "NaN or Inf" in reasons[3]
    assert "num_examples" in reasons[4]
    assert "expected an Update" in reasons[5]


def _mean(server, gathered, weighted=True):
    """The update pipeline's plain mean (``server.updates.collect``): the averaged model and the updates it used."""
    result = server.updates.collect(gathered, weighted=weighted)
    return result.params, result.updates


def test_the_baselines_tags_are_what_they_are():
    """global pools the clients' data (an oracle needing the whole dataset, its own model); local, average and ensemble
    read the clients' data only through their local models; local and ensemble score each client's model in its own
    architecture; finetune combines the clients' weights only when its base is their average."""
    tags = {name: METHODS.get(name).tags for name in ("global", "local", "average", "ensemble", "finetune")}
    assert (
        tags["global"].oracle
        and tags["global"].needs_dataset
        and tags["global"].heterogeneous_clients
        and tags["global"].fuses == "nothing"
    )
    for name in ("local", "average", "ensemble"):
        assert tags[name].local_model_only and not tags[name].oracle and not tags[name].multi_round, name
    assert tags["local"].heterogeneous_clients and tags["ensemble"].heterogeneous_clients and not tags["average"].heterogeneous_clients
    assert (tags["local"].fuses, tags["average"].fuses, tags["ensemble"].fuses) == ("nothing", "parameters", "predictions")
    finetune = METHODS.get("finetune")
    assert not (finetune.tags.oracle or finetune.tags.local_model_only or finetune.tags.multi_round)
    assert (
        finetune.tags_for(finetune.Params(base="local")).fuses == "nothing" and finetune.tags_for(finetune.Params()).fuses == "parameters"
    )
