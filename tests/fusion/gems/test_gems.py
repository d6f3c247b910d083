"""GEMS: ball sampling, the radius search, intersections, neuron fusion, the method end to end, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfuse.errors import InputError
from rayfuse.fusion import METHODS
from rayfuse.fusion.gems.balls import (
    cluster_neurons,
    compute_fisher,
    ellipsoid_axes,
    flatten_linear,
    fuse_neurons,
    intersect_balls,
    neuron_distance,
    sample_surface,
    search_radii,
    softmax_accuracy,
)
from rayfuse.io import load_params
from rayfuse.method import resolve_methods
from rayfuse.models.registry import MLP
from rayfuse.runner import prepare_run

# -- sampling on the surface --------------------------------------------------------------------------------------


def test_sphere_samples_lie_on_the_sphere_surface():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 20))
    radii = np.array([0.5, 2.0, 40.0])
    points = sample_surface(centers, radii, 200, rng)
    assert points.shape == (3, 200, 20)
    np.testing.assert_allclose(np.linalg.norm(points - centers[:, None], axis=2), radii[:, None].repeat(200, 1), rtol=1e-12)


def test_ellipsoid_samples_lie_on_the_ellipsoid_surface():
    rng = np.random.default_rng(1)
    center = rng.normal(size=(1, 30))
    axes = ellipsoid_axes(rng.exponential(size=30), floor=0.1)[None, :]
    assert axes.min() >= 0.1 and axes.max() == pytest.approx(1.0)
    points = sample_surface(center, np.array([3.0]), 300, rng, axes=axes)
    # sum_i ((w_i - c_i) / (sigma_i R))^2 = 1
    np.testing.assert_allclose(np.sum(((points - center[:, None]) / (axes[:, None] * 3.0)) ** 2, axis=2), 1.0, rtol=1e-12)
    # and they spread along the long axes: not a sphere
    assert np.linalg.norm(points[0] - center, axis=1).std() > 0.05


def test_masked_samples_move_only_the_searched_coordinates():
    rng = np.random.default_rng(2)
    mask = (rng.random((1, 25)) < 0.4).astype(float)
    points = sample_surface(np.zeros((1, 25)), np.array([1.5]), 50, rng, masks=mask)
    assert np.all(points[0][:, mask[0] == 0] == 0)
    np.testing.assert_allclose(np.linalg.norm(points[0], axis=1), 1.5, rtol=1e-12)


def test_float32_samples_lie_on_the_surface_and_replay_from_the_seed():
    # The client steps' fast path: torch float32 draws seeded from the numpy generator.
    rng = np.random.default_rng(4)
    centers = rng.normal(size=(2, 40))
    axes = ellipsoid_axes(rng.exponential(size=(2, 40)), floor=0.1)
    mask = (rng.random((2, 40)) < 0.5).astype(float)
    points = sample_surface(centers, np.array([2.0, 7.0]), 100, np.random.default_rng(5), axes=axes, masks=mask, dtype="float32")
    assert isinstance(points, torch.Tensor) and points.dtype == torch.float32 and points.shape == (2, 100, 40)
    diff = points.double().numpy() - centers[:, None]
    assert np.all(np.abs(diff[mask[:, None, :].repeat(100, 1) == 0]) < 1e-5)
    scaled = np.where(mask[:, None] > 0, diff / (axes[:, None] * np.array([2.0, 7.0])[:, None, None]), 0.0)
    np.testing.assert_allclose(np.sum(scaled**2, axis=2), 1.0, rtol=1e-4)
    again = sample_surface(centers, np.array([2.0, 7.0]), 100, np.random.default_rng(5), axes=axes, masks=mask, dtype="float32")
    assert torch.equal(points, again)
    with pytest.raises(ValueError, match="dtype"):
        sample_surface(centers, np.array([1.0, 1.0]), 3, rng, dtype="float16")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_shared_draws_give_every_ball_its_own_surface_points_along_common_directions(dtype):
    rng = np.random.default_rng(6)
    centers = rng.normal(size=(4, 12))
    radii = np.array([0.5, 1.0, 2.0, 8.0])
    points = sample_surface(centers, radii, 60, rng, dtype=dtype, shared=True)
    points = points.double().numpy() if dtype == "float32" else points
    assert points.shape == (4, 60, 12)
    offsets = points - centers[:, None]
    np.testing.assert_allclose(np.linalg.norm(offsets, axis=2), radii[:, None].repeat(60, 1), rtol=1e-5)
    directions = offsets / radii[:, None, None]
    np.testing.assert_allclose(directions[0], directions[3], atol=1e-5)  # common directions across balls...
    assert np.abs(directions[0] @ directions[0].T - np.eye(60)).max() > 0.05  # ...but p distinct ones per ball
    assert np.linalg.matrix_rank(directions[0]) == 12


# -- the binary search --------------------------------------------------------------------------------------------


def test_binary_search_returns_a_radius_whose_samples_pass_and_whose_next_step_fails():
    # Q passes iff the model is within an (unknown to the search) ellipsoid-shaped region: ||D (w - c)|| <= 2.5.
    rng = np.random.default_rng(3)
    scale = rng.uniform(0.5, 1.5, size=10)
    tested: dict[float, bool] = {}

    def passes(samples, ids):
        ok = np.linalg.norm(samples * scale, axis=2) <= 2.5
        for R, row in zip(np.linalg.norm(samples[:, 0], axis=1), ok):
            tested[round(float(R), 9)] = bool(row.all())
        return ok

    result = search_radii(passes, np.zeros((1, 10)), num_samples=100, r_max=4000.0, tol=0.01, rng=rng, record=True)
    radius, upper = float(result.radius[0]), float(result.upper[0])
    assert tested[round(radius, 9)] is True  # every sampled model at the returned radius passed
    assert tested[round(upper, 9)] is False  # and the step above it failed
    assert 0 < upper - radius < 0.01
    assert 2.5 / scale.max() - 0.01 <= radius <= 2.5 / scale.min()


def test_batched_search_matches_a_one_model_at_a_time_loop():
    rng_data = np.random.default_rng(4)
    X = rng_data.normal(size=(60, 6)).astype(np.float32)
    W = rng_data.normal(size=(3, 6))
    y = (X @ W.T).argmax(1)
    center = flatten_linear(W, np.zeros(3))[None, :]

    def batched(samples, ids):
        return softmax_accuracy(samples, X, y, 3) >= 0.8

    def looped(samples, ids):
        out = np.zeros(samples.shape[:2], dtype=bool)
        for b in range(samples.shape[0]):
            for s in range(samples.shape[1]):
                w = samples[b, s]
                logits = X @ w[:18].reshape(3, 6).T + w[18:]
                out[b, s] = np.mean(logits.argmax(1) == y) >= 0.8
        return out

    a = search_radii(batched, center, num_samples=40, r_max=100.0, tol=0.05, rng=np.random.default_rng(9))
    b = search_radii(looped, center, num_samples=40, r_max=100.0, tol=0.05, rng=np.random.default_rng(9))
    assert a.radius[0] == b.radius[0] > 0


def test_neuron_distance_is_eq3():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(15, 4)).astype(np.float32)
    neurons = rng.normal(size=(2, 5))
    z = np.maximum(X @ neurons[:, :4].T + neurons[:, 4], 0)
    samples = neurons[:, None, :] + rng.normal(size=(2, 3, 5))
    got = neuron_distance(samples, X, z)
    for b in range(2):
        for s in range(3):
            expected = np.linalg.norm(np.maximum(X @ samples[b, s, :4] + samples[b, s, 4], 0) - z[:, b]) / 15
            assert got[b, s] == pytest.approx(expected, rel=1e-5)
    assert np.all(neuron_distance(neurons[:, None, :], X, z) < 1e-6)  # a neuron is at distance 0 from itself


def test_fisher_of_softmax_regression_matches_autograd():
    rng = np.random.default_rng(6)
    W, b, X = rng.normal(size=(3, 4)), rng.normal(size=3), rng.normal(size=(5, 4))
    fisher = compute_fisher(W, b, X, 5, np.random.default_rng(7))
    # the same draws, by autograd
    r = np.random.default_rng(7)
    idx = r.choice(5, size=5, replace=False)
    Wt = torch.tensor(W, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    logp = torch.log_softmax(torch.tensor(X[idx]) @ Wt.T + bt, dim=1)
    c = (torch.softmax(logp, 1).detach().numpy().cumsum(1) > r.random((5, 1))).argmax(1)
    total = np.zeros(15)
    for i in range(5):
        gW, gb = torch.autograd.grad(logp[i, c[i]], (Wt, bt), retain_graph=True)
        total += np.concatenate([gW.numpy().ravel(), gb.numpy()]) ** 2
    np.testing.assert_allclose(fisher, total / 5, rtol=1e-10)


# -- intersections --------------------------------------------------------------------------------------------------


def test_intersection_of_two_overlapping_balls_lies_in_both():
    centers = np.array([[0.0, 0.0, 0.0], [3.0, 0.0, 1.0]])
    radii = np.array([2.0, 1.5])
    result = intersect_balls(centers, radii)
    assert result.found and result.distance_left == 0.0
    assert np.all(np.linalg.norm(result.point - centers, axis=1) <= radii + 1e-9)


def test_intersection_of_overlapping_ellipsoids_lies_in_both():
    centers = np.array([[0.0, 0.0], [4.0, 0.0]])
    axes = np.array([[1.0, 0.2], [1.0, 0.2]])
    radii = np.array([2.5, 2.5])  # the long axes overlap on [1.5, 2.5]
    result = intersect_balls(centers, radii, axes=axes)
    assert result.found
    assert np.all(np.sum(((result.point - centers) / (axes * radii[:, None])) ** 2, axis=1) <= 1 + 1e-9)


def test_disjoint_balls_are_reported_with_the_distance_left():
    centers = np.array([[0.0, 0.0], [10.0, 0.0]])
    result = intersect_balls(centers, np.array([2.0, 3.0]))
    assert not result.found
    assert result.distance_left == pytest.approx(5.0, rel=1e-3)  # the gap between the two spheres


def test_one_ball_intersection_is_its_centre():
    center = np.random.default_rng(8).normal(size=(1, 12))
    result = intersect_balls(center, np.array([0.3]))
    assert result.found and np.array_equal(result.point, center[0])


# -- neurons ---------------------------------------------------------------------------------------------------------


def test_neuron_clustering_keeps_every_neuron():
    rng = np.random.default_rng(10)
    centers = rng.normal(size=(30, 6))
    radii = rng.uniform(0.2, 2.5, size=30)
    labels = cluster_neurons(centers, 7, random_state=0)
    assert set(labels) == set(range(7))  # every cluster, cluster 0 included
    fused = fuse_neurons(centers, radii, labels)
    members = sorted(i for group in fused.groups for i in group)
    assert members == list(range(30))  # each neuron in exactly one output unit
    assert len(fused.vectors) == len(fused.groups) >= 7
    for vector, group in zip(fused.vectors, fused.groups):
        if len(group) == 1:  # an unmatched neuron is kept unchanged
            np.testing.assert_array_equal(vector, centers[group[0]])
        else:  # a merged group's balls pairwise intersect
            for i in group:
                for j in group:
                    assert np.linalg.norm(centers[i] - centers[j]) <= radii[i] + radii[j]
    with_bug = fuse_neurons(centers, radii, labels, skip_first_cluster=True)  # the reference code's loop
    assert sorted(with_bug.dropped) == np.flatnonzero(labels == 0).tolist()


def test_identical_neurons_merge_into_one():
    centers = np.array([[1.0, 2.0, 0.5]] * 3 + [[9.0, 9.0, 9.0]])
    fused = fuse_neurons(centers, np.ones(4), np.zeros(4, dtype=int))
    assert fused.groups == [[3], [0, 1, 2]]
    np.testing.assert_allclose(fused.vectors[1], centers[0])


# -- the method ------------------------------------------------------------------------------------------------------


FAST = {"num_samples": 50, "r_max": 100.0}
LABELS2 = {"method": "labels", "num_clients": 2, "groups": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]}


def test_gems_is_registered():
    assert METHODS.get("gems").tags.uses_local_models and METHODS.get("tuned").summary


def test_gems_logreg_finds_a_model_in_every_ball(coordinator):
    coord = coordinator(partition=LABELS2, model={"name": "logreg"}, data={"public_size": 60}, methods={"gems": {**FAST, "tol": 0.5}})
    summary = coord.run_method("gems")
    info = summary["info"]
    assert info["intersection_found"] and info["distance_left"] == 0.0
    assert all(r > 0 for r in info["radii"])
    assert 0.3 < summary["metrics"]["accuracy"] <= 1 and "tuned_accuracy" in summary["metrics"]
    fused = load_params(coord.store.root / summary["model_file"])
    assert fused["linear.weight"].shape == (10, 64)


def test_gems_with_one_client_returns_its_model(coordinator):
    coord = coordinator(
        partition={"method": "iid", "num_clients": 1}, model={"name": "logreg"}, methods={"gems": {**FAST, "fine_tune": False}}
    )
    local = next(iter(coord.local_updates().values())).params
    summary = coord.run_method("gems")
    fused = load_params(coord.store.root / summary["model_file"])
    for key in local:
        np.testing.assert_allclose(fused[key], local[key], rtol=1e-6, atol=1e-7)


def test_gems_mlp_fuses_layer_by_layer(coordinator):
    coord = coordinator(
        partition=LABELS2,
        model={"name": "mlp", "hidden": [12, 8]},
        methods={"gems": {**FAST, "tol": 0.5, "neuron_tol": 2.0, "m_epsilon": [6, 4], "fine_tune": False, "retrain_epochs": 2}},
    )
    summary = coord.run_method("gems")
    info = summary["info"]
    units = info["hidden_units"]
    assert units[0] >= 6 and units[1] >= 4 and units[0] <= 24 and units[1] <= 16
    for layer in info["layers"]:
        assert layer["merged_units"] + layer["unmatched"] == layer["units"]
    fused = load_params(coord.store.root / summary["model_file"])
    assert fused["layers.0.weight"].shape == (units[0], 64)
    assert fused["layers.1.weight"].shape == (units[1], units[0])
    assert fused["layers.2.weight"].shape == (10, units[1])
    assert np.isfinite(summary["metrics"]["accuracy"])


def test_tuned_baselines_run(coordinator):
    coord = coordinator(
        partition=LABELS2,
        model={"name": "logreg"},
        data={"public_size": 50},
        methods={
            "raw": {"method": "tuned", "base": "raw", "public_samples": [20, 50]},
            "tuned-local": {"method": "tuned", "base": "local", "public_samples": 30},
        },
    )
    raw = coord.run_method("raw")
    assert [row["public_samples"] for row in raw["info"]["tuning_curve"]] == [20.0, 50.0]
    local = coord.run_method("tuned-local")
    assert "accuracy_std" in local["metrics"] and len(local["info"]["per_client"]) == 2


def test_raw_reference_protocol_trains_with_dropout_and_stops_early(coordinator):
    # the reference's raw network (learn_dnn2): dropout 0.5 and EarlyStopping on the training accuracy, patience 3
    coord = coordinator(
        partition=LABELS2,
        model={"name": "mlp", "hidden": [8]},
        data={"public_size": 50},
        methods={"raw-reference": {"method": "tuned", "base": "raw", "public_samples": [50], "raw_dropout": 0.5, "raw_early_stop": 3}},
    )
    raw = coord.run_method("raw-reference")
    assert raw["info"]["dropout"] == 0.5 and raw["info"]["early_stop"] == 3
    assert 0.0 < raw["metrics"]["accuracy"] <= 1.0


@pytest.mark.parametrize(
    "params, key",
    [
        ({"base": "average", "raw_early_stop": 3}, "raw_early_stop"),
        ({"base": "local", "raw_epochs": 10}, "raw_epochs"),
        ({"base": "raw", "raw_dropout": 0.5}, "raw_dropout"),  # a logreg has no hidden layer to drop
    ],
)
def test_raw_only_settings_are_refused_elsewhere(make_config, params, key):
    cfg = make_config(
        partition=LABELS2, model={"name": "logreg"}, data={"public_size": 50}, methods={"tuned": {**params, "public_samples": [50]}}
    )
    with pytest.raises(InputError, match=rf"methods\.tuned\.{key}"):
        prepare_run(cfg)


def test_converged_last_layer_matches_scikit_learns_logistic_regression_from_any_start():
    from sklearn.linear_model import LogisticRegression

    from rayfuse.fusion.baselines.finetune import fit_last_layer

    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=120)
    features = {}
    for start in (0.0, 5.0):  # the fit is strictly convex: where the last layer starts does not matter
        torch.manual_seed(1)
        model = MLP(6, [8], 3)
        with torch.no_grad():
            model.layers[-1].weight.fill_(start)
        fit_last_layer(model, X, y, l2=1.0)
        features[start] = model.features(torch.as_tensor(X)).detach().numpy()
        coef = model.layers[-1].weight.detach().numpy()
        # in float64: scikit-learn's lbfgs keeps float32 input in float32 and stops ~1e-3 short on these features
        ref = LogisticRegression(C=1.0, tol=1e-10, max_iter=10_000).fit(features[start].astype(np.float64), y)
        # scikit-learn's multinomial coefficients are defined up to a constant per feature: compare centred over classes
        np.testing.assert_allclose(coef - coef.mean(0), ref.coef_ - ref.coef_.mean(0), atol=1e-4)
        bias = model.layers[-1].bias.detach().numpy()
        np.testing.assert_allclose(bias - bias.mean(), ref.intercept_ - ref.intercept_.mean(), atol=1e-4)
    np.testing.assert_array_equal(features[0.0], features[5.0])  # only the last layer moved


def test_gems_and_tuned_fit_the_last_layer_to_convergence_on_request(coordinator):
    coord = coordinator(
        partition=LABELS2,
        model={"name": "mlp", "hidden": [12]},
        data={"public_size": 60},
        methods={
            "gems": {
                **FAST,
                "tol": 0.5,
                "neuron_tol": 2.0,
                "m_epsilon": 6,
                "retrain_epochs": 2,
                "tune_solver": "lbfgs",
                "public_samples": [30, 60],
            },
            "tuned": {"base": "average", "tune_solver": "lbfgs", "public_samples": 60},
        },
    )
    gems = coord.run_method("gems")
    assert [row["public_samples"] for row in gems["info"]["tuning_curve"]] == [30.0, 60.0]
    assert 0.1 < gems["metrics"]["tuned_accuracy"] <= 1
    fused = load_params(coord.store.root / gems["model_file"])
    assert fused["layers.0.weight"].shape[1] == 64  # the stored model is the fused one, not a tuned copy
    assert 0.1 < coord.run_method("tuned")["metrics"]["accuracy"] <= 1


@pytest.mark.parametrize(
    "model, params, expected",
    [
        ({"name": "logreg"}, {"method": "gems"}, "model without hidden layers"),
        ({"name": "logreg"}, {"method": "tuned", "base": "average"}, "model without hidden layers"),
        ({"name": "mlp", "hidden": [8]}, {"method": "tuned", "base": "raw"}, "base: raw"),
        ({"name": "mlp", "hidden": [8]}, {"method": "tuned", "base": "local"}, "last_layer_only"),  # local tunes every layer
        ({"name": "mlp", "hidden": [8]}, {"method": "gems", "last_layer_only": False}, "last_layer_only"),
    ],
)
def test_converged_fit_is_refused_where_there_is_no_last_layer_to_fit(make_config, model, params, expected):
    cfg = make_config(
        partition=LABELS2, model=model, data={"public_size": 50}, methods={"m": {**params, "tune_solver": "lbfgs", "public_samples": [50]}}
    )
    with pytest.raises(InputError, match=r"methods\.m\.tune_solver") as err:
        prepare_run(cfg)
    assert expected in str(err.value)


def test_tuned_baselines_use_the_reference_optimiser_per_base():
    from rayfuse.fusion.baselines.finetune import FinetuneParams

    # average: create_dnn2 (Adam 0.01, layer 0 frozen); local: the local models' Adam 1e-3, nothing frozen; raw: 1e-3
    assert (FinetuneParams(base="average").resolved().tune_lr, FinetuneParams(base="average").resolved().last_layer_only) == (0.01, True)
    assert (FinetuneParams(base="local").resolved().tune_lr, FinetuneParams(base="local").resolved().last_layer_only) == (1e-3, False)
    assert FinetuneParams(base="raw").resolved().tune_lr == 1e-3
    assert FinetuneParams(base="local", tune_lr=0.05, last_layer_only=True).resolved().tune_lr == 0.05


# -- bad input -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, key",
    [
        ({"epsilon": 1.5}, "methods.gems.epsilon"),
        ({"epsilon": -0.1}, "methods.gems.epsilon"),
        ({"m_epsilon": 0}, "methods.gems.m_epsilon"),
        ({"hidden_epsilon": -1}, "methods.gems.hidden_epsilon"),
        ({"floor": 0}, "methods.gems.floor"),
        ({"public_samples": [0, 10]}, "methods.gems.public_samples"),
    ],
)
def test_bad_parameters_are_rejected_with_their_key(make_config, params, key):
    with pytest.raises(InputError, match=key.replace(".", r"\.")):
        resolve_methods(make_config(methods={"gems": params}).methods)


def test_m_epsilon_larger_than_the_number_of_neurons(make_config):
    cfg = make_config(partition=LABELS2, model={"name": "mlp", "hidden": [4]}, methods={"gems": {"m_epsilon": 9}})
    with pytest.raises(InputError, match=r"methods\.gems\.m_epsilon: expected at most .* \(2 x 4 = 8\), got 9"):
        prepare_run(cfg)
    with pytest.raises(InputError, match="m_epsilon"):
        cluster_neurons(np.zeros((5, 3)), 6)


def test_mismatched_architectures_across_clients(coordinator):
    coord = coordinator(partition=LABELS2, model={"name": "mlp", "hidden": [6]}, methods={"gems": {**FAST, "neuron_tol": 5.0}})
    odd = MLP(64, [5], 10)  # client 1 holds a narrower network than the config says
    coord.federation.client(1).ctx.set_local_model(odd)
    with pytest.raises(InputError, match=r"model: expected the same architecture on every client.*client 1 \(5, 65\)"):
        coord.run_method("gems")
    with pytest.raises(InputError, match="masks"):
        intersect_balls(np.zeros((2, 3)), np.ones(2), masks=np.ones((2, 4)))


def test_gems_refuses_other_models(make_config):
    cfg = make_config(model={"name": "cnn", "channels": [4]}, methods={"gems": {}})
    with pytest.raises(InputError, match="model.name"):
        prepare_run(cfg)


def test_tuning_without_a_public_sample(make_config):
    cfg = make_config(partition=LABELS2, model={"name": "logreg"}, methods={"tuned": {"base": "average"}})
    with pytest.raises(InputError, match="data.public_size"):
        prepare_run(cfg)


def test_fine_tuning_any_registry_model_moves_only_the_output_layer_its_graph_names():
    from rayfuse.config import ModelConfig
    from rayfuse.fusion.baselines.finetune import fine_tune, model_for_params
    from rayfuse.models import build_model, get_params, predict_proba

    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=40)
    cfg = ModelConfig(name="rescnn", channels=[4, 8])
    params = get_params(build_model(cfg, (1, 8, 8), 10, seed=0))
    args = dict(model_cfg=cfg, num_classes=10, epochs=2, lr=0.01, batch_size=16, seed=0)
    head_only = fine_tune(params, X, y, last_layer_only=True, **args)
    moved = {k for k in params if not np.array_equal(head_only[k], params[k]) and "running" not in k and "num_batches" not in k}
    assert moved == {"head.weight", "head.bias"}
    every = fine_tune(params, X, y, last_layer_only=False, **args)
    assert not np.array_equal(every["stem.conv.weight"], params["stem.conv.weight"])
    # a fused model of other widths (GEMS' are): the widths come from the spec's groups, read from the parameters
    narrow = build_model(ModelConfig(name="rescnn", channels=[3, 5]), (1, 8, 8), 10, seed=1).eval()
    model = model_for_params(get_params(narrow), cfg, (1, 8, 8), 10)
    np.testing.assert_array_equal(predict_proba(model, X), predict_proba(narrow, X))


def test_gems_tags_are_its_papers():
    """GEMS intersects the clients' balls of good models (statistics, not weights), one shot."""
    tags = METHODS.get("gems").tags
    assert tags.fuses == "statistics" and tags.uses_local_models and not (tags.oracle or tags.multi_round or tags.local_model_only)
