"""Robust aggregators (rayfuse.updates.robust): each rule against its formula on hand-computed cases and against
independent implementations (np.median, scipy's trim_mean, scipy's minimiser for the geometric median), their
behaviour under planted outliers, clipping's bound, the default ``mean`` being today's average byte for byte, the
``aggregator`` setting of fedavg / fedopt / average / aligned, and its preconditions refused before anything runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import optimize, stats

from rayfuse.errors import InputError, RunFailure
from rayfuse.models import params_equal
from rayfuse.updates.aggregate import weighted_average
from rayfuse.updates.robust import (
    AggregatorSettings,
    aggregate,
    aggregate_bulyan,
    aggregate_geometric_median,
    aggregate_krum,
    aggregate_median,
    aggregate_trimmed_mean,
    check_aggregator,
    check_enough_updates,
    clip_updates,
    compute_pairwise_distances,
    compute_update_norms,
    select_krum,
)

SHAPES = {"w": (5, 3), "b": (7,), "conv": (2, 3, 2, 2)}


def random_models(n: int, seed: int = 0, dtype=np.float64, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{k: (scale * rng.normal(size=s)).astype(dtype) for k, s in SHAPES.items()} for _ in range(n)]


def scalars(*values: float) -> list[dict[str, np.ndarray]]:
    """One-parameter models (a 1-vector each): hand-computable."""
    return [{"x": np.array([v], dtype=np.float64)} for v in values]


def flat(model: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(model[k], dtype=np.float64).ravel() for k in model])


# ---------------------------------------------------------------------------------------------------------------
# Each rule against its formula


def test_median_by_hand_odd_and_even():
    models = [{"w": np.array([1.0, 2.0, 3.0])}, {"w": np.array([4.0, 0.0, 3.0])}, {"w": np.array([10.0, 1.0, 3.0])}]
    assert aggregate_median(models)["w"].tolist() == [4.0, 1.0, 3.0]
    models.append({"w": np.array([0.0, 5.0, 7.0])})  # even n: the mean of the two middle values
    assert aggregate_median(models)["w"].tolist() == [2.5, 1.5, 3.0]


def test_trimmed_mean_by_hand():
    models = scalars(1.0, 2.0, 3.0, 100.0)
    assert aggregate_trimmed_mean(models, 0.25)["x"].tolist() == [2.5]  # floor(0.25 * 4) = 1 cut at each end
    assert aggregate_trimmed_mean(models, 0.2)["x"].tolist() == [26.5]  # floor(0.8) = 0: the mean


def test_krum_by_hand():
    # f = 1, n = 5: each score sums the n - f - 2 = 2 smallest squared distances to the others.
    # 0: 1 + 4 = 5; 1: 1 + 1 = 2; 2: 1 + 4 = 5; 10: 1 + 64 = 65; 11: 1 + 81 = 82.
    models = scalars(0.0, 1.0, 2.0, 10.0, 11.0)
    assert select_krum(models, f=1, m=5) == [1, 0, 2, 3, 4]
    assert aggregate_krum(models, f=1)["x"].tolist() == [1.0]
    # Multi-Krum, m = 3: models 1, 0, 2 averaged with their weights 1, 1, 2.
    assert aggregate_krum(models, f=1, m=3, weights=[1, 1, 2, 1, 1])["x"].tolist() == [1.25]
    assert aggregate_krum(models, f=1, m=3)["x"].tolist() == [1.0]


def test_bulyan_by_hand():
    # f = 1, n = 7: Krum picks, from the remaining models each time, 2, then 1 (a tie with 3: the first), 3, 0, and
    # finally 50 (of 4, 50, 60 with one neighbour each: 50 and 60 score 100, 4 scores 46^2). theta = 5 selected,
    # beta = 3: the three selected values closest to their median 2 are 1, 2, 3 -> 2.
    models = scalars(0.0, 1.0, 2.0, 3.0, 4.0, 50.0, 60.0)
    assert aggregate_bulyan(models, f=1)["x"].tolist() == [2.0]


def test_geometric_median_equals_scipys_minimiser_of_the_weighted_distance_sum():
    rng = np.random.default_rng(3)
    points = rng.normal(size=(6, 4))
    weights = np.array([1.0, 2.0, 1.0, 3.0, 1.0, 2.0])
    models = [{"a": p[:3].copy(), "b": p[3:].copy()} for p in points]
    gm = aggregate_geometric_median(models, weights, max_iter=5000, ftol=1e-14)
    z = np.concatenate([gm["a"], gm["b"]])

    def objective(v):
        return float(weights @ np.linalg.norm(points - v, axis=1))

    best = optimize.minimize(
        objective, points.mean(axis=0), method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000}
    )
    assert objective(z) <= best.fun + 1e-8
    np.testing.assert_allclose(z, best.x, atol=1e-3)


def test_geometric_median_of_three_points_on_a_line_is_the_middle_one():
    gm = aggregate_geometric_median(scalars(0.0, 1.0, 10.0), max_iter=5000, ftol=1e-14)
    assert gm["x"][0] == pytest.approx(1.0, abs=1e-3)


def test_clipping_by_hand():
    reference = {"x": np.array([1.0, 1.0])}
    far, near = {"x": np.array([4.0, 5.0])}, {"x": np.array([1.3, 1.4])}  # updates (3, 4) and (0.3, 0.4)
    clipped = clip_updates([far, near], reference, 1.0)
    np.testing.assert_allclose(clipped[0]["x"], [1.6, 1.8])
    assert clipped[1]["x"] is near["x"]  # within the norm: untouched


def test_median_and_trimmed_mean_equal_numpy_and_scipy_on_random_arrays():
    models = random_models(9, seed=1)
    med, trim = aggregate_median(models), aggregate_trimmed_mean(models, 0.2)
    for key in SHAPES:
        stack = np.stack([m[key] for m in models])
        np.testing.assert_allclose(med[key], np.median(stack, axis=0), rtol=0, atol=0)
        np.testing.assert_allclose(trim[key], stats.trim_mean(stack, 0.2, axis=0), rtol=1e-14, atol=1e-15)


def test_pairwise_distances_equal_the_direct_ones_far_from_the_origin():
    models = random_models(5, seed=2)
    for m in models:  # a large common offset: the Gram-matrix form must not lose the small differences
        m["w"] += 1e4
    dist = compute_pairwise_distances(models, chunk=4)
    vectors = np.stack([flat(m) for m in models])
    direct = ((vectors[:, None, :] - vectors[None, :, :]) ** 2).sum(axis=2)
    np.testing.assert_allclose(dist, direct, rtol=1e-9)


@pytest.mark.parametrize(
    "settings",
    [
        {"name": "median"},
        {"name": "trimmed_mean", "beta": 0.2},
        {"name": "krum", "f": 1, "m": 3},
        {"name": "bulyan", "f": 1},
        {"name": "geometric_median"},
    ],
)
def test_every_rule_reads_the_models_a_chunk_at_a_time_with_the_same_result(settings):
    models = random_models(7, seed=4)
    s = AggregatorSettings(**settings)
    small, whole = aggregate(models, settings=s, chunk=5), aggregate(models, settings=s)
    for key in SHAPES:
        np.testing.assert_allclose(small[key], whole[key], rtol=1e-12, atol=1e-12)


def test_float32_models_come_back_float32_and_integer_buffers_as_their_median():
    models = random_models(5, seed=5, dtype=np.float32)
    for k, m in enumerate(models):
        m["num_batches_tracked"] = np.array(10 + k, dtype=np.int64)
    for name in ("median", "trimmed_mean", "bulyan", "geometric_median"):
        out = aggregate(models, settings=AggregatorSettings(name=name, **({"f": 0} if name == "bulyan" else {})))
        assert list(out) == list(models[0])
        assert all(out[k].dtype == np.float32 for k in SHAPES), name
        assert out["num_batches_tracked"].dtype == np.int64 and int(out["num_batches_tracked"]) == 12, name


# ---------------------------------------------------------------------------------------------------------------
# The default is today's average; robust rules under outliers; clipping's bound


def test_the_default_mean_is_weighted_average_byte_for_byte():
    models = random_models(5, seed=6, dtype=np.float32)
    weights = [3, 1, 4, 1, 5]
    assert params_equal(aggregate(models, weights), weighted_average(models, weights))
    assert params_equal(aggregate(models, weights, AggregatorSettings(name="mean")), weighted_average(models, weights))
    assert AggregatorSettings().is_plain_mean and not AggregatorSettings(clip_norm=1.0).is_plain_mean


def planted(honest: int, bad: int, seed: int = 7) -> tuple[list[dict[str, np.ndarray]], np.ndarray, np.ndarray]:
    """``honest`` models near 0 and ``bad`` models at 1e6 (the attackers last); the honest range per coordinate."""
    models = random_models(honest, seed=seed) + [{k: np.full(s, 1e6) for k, s in SHAPES.items()} for _ in range(bad)]
    stack = np.stack([flat(m) for m in models[:honest]])
    return models, stack.min(axis=0), stack.max(axis=0)


@pytest.mark.parametrize("settings", [{"name": "median"}, {"name": "trimmed_mean", "beta": 0.25}, {"name": "bulyan", "f": 2}])
def test_coordinatewise_rules_stay_in_the_honest_range_with_f_planted_outliers(settings):
    models, low, high = planted(honest=9, bad=2)  # n = 11 >= 4f + 3
    out = flat(aggregate(models, settings=AggregatorSettings(**settings)))
    assert (out >= low).all() and (out <= high).all()


def test_krum_and_multi_krum_pick_from_the_honest_cluster():
    models, _, _ = planted(honest=7, bad=2)  # n = 9 >= 2f + 3 with f = 2
    assert select_krum(models, f=2)[0] < 7
    assert sorted(select_krum(models, f=2, m=7)) == list(range(7))  # m = n - f: exactly the honest models
    assert flat(aggregate_krum(models, f=2)).max() < 10


def test_geometric_median_stays_near_the_honest_models_under_outliers():
    models, _, _ = planted(honest=7, bad=3)
    honest_mean = np.mean([flat(m) for m in models[:7]], axis=0)
    gm = flat(aggregate_geometric_median(models))
    assert np.linalg.norm(gm - honest_mean) < 5.0  # the attackers sit ~6e6 away; the mean moves by ~2e6
    assert np.linalg.norm(flat(weighted_average(models)) - honest_mean) > 1e6


def test_clipping_bounds_every_contribution_and_keeps_its_direction():
    reference = random_models(1, seed=8, dtype=np.float32)[0]
    models = random_models(6, seed=9, dtype=np.float32, scale=3.0)
    models[0] = {k: v.copy() for k, v in reference.items()}  # a zero update
    clipped = clip_updates(models, reference, 2.0)
    norms = compute_update_norms(clipped, reference)
    assert (norms <= 2.0 * (1 + 1e-6)).all() and norms[0] == 0.0
    before = compute_update_norms(models, reference)
    for k in range(1, 6):
        d_in = flat(models[k]) - flat(reference)
        d_out = flat(clipped[k]) - flat(reference)
        assert before[k] > 2.0 and norms[k] == pytest.approx(2.0, rel=1e-6)
        np.testing.assert_allclose(d_out, d_in * (2.0 / before[k]), rtol=1e-4, atol=1e-5)


def test_clip_then_mean_bounds_the_step_from_the_global_model():
    reference = {k: np.zeros(s) for k, s in SHAPES.items()}
    models, _, _ = planted(honest=3, bad=1)
    out = aggregate(models, settings=AggregatorSettings(clip_norm=1.5), reference=reference)
    assert np.linalg.norm(flat(out)) <= 1.5 + 1e-9  # a mean of points in the ball stays in it


def test_fedopts_pseudo_gradient_under_a_robust_rule_is_the_rule_applied_to_the_updates():
    # Every rule is translation-equivariant: aggregating the models and subtracting the global model is aggregating
    # the pseudo-gradients (what FedOpt's server step uses).
    models = random_models(7, seed=10)
    g = random_models(1, seed=11)[0]
    deltas = [{k: m[k] - g[k] for k in m} for m in models]
    for settings in (
        {"name": "median"},
        {"name": "trimmed_mean", "beta": 0.2},
        {"name": "krum", "f": 1, "m": 2},
        {"name": "bulyan", "f": 1},
        {"name": "geometric_median"},
    ):
        s = AggregatorSettings(**settings)
        on_models, on_deltas = aggregate(models, settings=s), aggregate(deltas, settings=s)
        for key in SHAPES:
            np.testing.assert_allclose(on_models[key] - g[key], on_deltas[key], atol=1e-6, err_msg=str(settings))


# ---------------------------------------------------------------------------------------------------------------
# Settings and preconditions


@pytest.mark.parametrize(
    ("settings", "n", "path", "fragment"),
    [
        ({"name": "krum", "f": 2}, 6, "aggregator.f", "n >= 2f + 3 for krum, so f <= 1 with n = 6"),
        ({"name": "krum", "f": 1, "m": 6}, 6, "aggregator.m", "m <= n - f = 5"),
        ({"name": "bulyan", "f": 1}, 6, "aggregator.f", "n >= 4f + 3 for bulyan, so f <= 0 with n = 6"),
        ({"name": "bulyan", "f": 0}, 2, "aggregator.f", "bulyan needs at least 3 clients"),
    ],
)
def test_preconditions_are_one_line_errors_naming_the_key(settings, n, path, fragment):
    with pytest.raises(InputError) as err:
        check_aggregator(AggregatorSettings(**settings), n)
    assert err.value.path == path and fragment in str(err.value) and "\n" not in str(err.value)


def test_the_limits_themselves_are_accepted():
    check_aggregator(AggregatorSettings(name="krum", f=2, m=5), 7)
    check_aggregator(AggregatorSettings(name="bulyan", f=2), 11)
    check_aggregator(AggregatorSettings(name="trimmed_mean", beta=0.49), 2)


def test_too_few_updates_at_run_time_is_a_run_failure():
    with pytest.raises(RunFailure, match="fl: 4 valid updates are too few for aggregator 'bulyan'"):
        check_enough_updates(AggregatorSettings(name="bulyan", f=1), 4, "fl")


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        ({"aggregator": {"name": "medain"}}, "methods.fedavg.aggregator.name"),
        ({"aggregator": {"name": "krum", "f": -1}}, "methods.fedavg.aggregator.f"),
        ({"aggregator": {"name": "krum", "m": 0}}, "methods.fedavg.aggregator.m"),
        ({"aggregator": {"name": "trimmed_mean", "beta": 0.5}}, "methods.fedavg.aggregator.beta"),
        ({"aggregator": {"name": "trimmed_mean", "beta": -0.1}}, "methods.fedavg.aggregator.beta"),
        ({"aggregator": {"clip_norm": -1.0}}, "methods.fedavg.aggregator.clip_norm"),
        ({"aggregator": {"clip_norm": 0}}, "methods.fedavg.aggregator.clip_norm"),
        ({"aggregator": {"name": "median", "f": 2}}, "methods.fedavg.aggregator.f"),
        ({"aggregator": {"name": "krum", "beta": 0.3}}, "methods.fedavg.aggregator.beta"),
        ({"aggregator": {"name": "krum", "k": 1}}, "methods.fedavg.aggregator.k"),
    ],
)
def test_bad_aggregator_settings_name_the_key(make_config, entry, path):
    from rayfuse.method import resolve_methods

    with pytest.raises(InputError) as err:
        resolve_methods(make_config(methods={"fedavg": entry}).methods)
    assert err.value.path == path, str(err.value)


def test_the_resolved_config_shows_the_rules_own_keys_and_reads_back(make_config):
    dumped = AggregatorSettings(name="krum", f=2, m=3, clip_norm=1.5).model_dump(mode="json")
    assert dumped == {"name": "krum", "f": 2, "m": 3, "clip_norm": 1.5}
    assert AggregatorSettings.model_validate(dumped) == AggregatorSettings(name="krum", f=2, m=3, clip_norm=1.5)
    full = {**AggregatorSettings().model_dump(), "f": 1, "beta": 0.1}  # another rule's keys at their defaults: harmless
    assert AggregatorSettings.model_validate(full) == AggregatorSettings()


def test_a_name_alone_is_short_for_the_rule_with_its_defaults(make_config):
    from rayfuse.method import resolve_methods

    spec = resolve_methods(make_config(methods={"fedavg": {"aggregator": "median"}}).methods)[0]
    assert spec.params.aggregator == AggregatorSettings(name="median")


@pytest.mark.parametrize(
    ("methods", "partition", "message"),
    [
        (
            {"fedavg": {"aggregator": {"name": "krum"}}},
            {},
            "methods.fedavg.aggregator.f: expected n >= 2f + 3 for krum, so f <= 0 with n = 4 clients per round, got 1",
        ),
        (
            {"fedavg": {"fraction": 0.5, "aggregator": {"name": "bulyan", "f": 1}}},
            {"num_clients": 8},
            "methods.fedavg.aggregator.f: expected n >= 4f + 3 for bulyan, so f <= 0 with n = 4 clients per round, got 1",
        ),
        ({"fedadam": {"aggregator": {"name": "krum", "f": 0, "m": 5}}}, {}, "methods.fedadam.aggregator.m: expected m <= n - f = 4"),
        ({"average": {"aggregator": {"name": "bulyan", "f": 1}}}, {}, "methods.average.aggregator.f: expected n >= 4f + 3"),
        ({"aligned": {"aggregator": {"name": "krum", "f": 1}}}, {}, "methods.aligned.aggregator.f: expected n >= 2f + 3"),
        (
            {"aligned": {"merge": "fisher", "aggregator": "median"}},
            {},
            "methods.aligned.aggregator: expected the default mean with merge 'fisher'",
        ),
    ],
)
def test_preconditions_are_checked_before_anything_starts(make_config, methods, partition, message):
    from rayfuse.runner import prepare_run

    with pytest.raises(InputError) as err:
        prepare_run(make_config(methods=methods, partition=partition))
    assert str(err.value).startswith(message), str(err.value)


def test_fraction_sets_n_and_a_run_that_meets_the_precondition_passes_the_check(make_config):
    from rayfuse.runner import prepare_run

    prepare_run(make_config(methods={"fedavg": {"fraction": 1.0, "aggregator": {"name": "bulyan", "f": 1}}}, partition={"num_clients": 8}))


def test_the_cli_refuses_f_too_large_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from rayfuse.cli import main

    monkeypatch.chdir(tmp_path)
    job = {
        "run": {"name": "robust", "seed": 0, "storage": str(tmp_path / "runs")},
        "data": {"dataset": "digits"},
        "partition": {"method": "iid", "num_clients": 4},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 1},
        "methods": {"fedavg": {"rounds": 1, "aggregator": {"name": "bulyan", "f": 1}}},
    }
    Path("job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    capsys.readouterr()
    assert main(["run", "job.yaml"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "rayfuse: error: methods.fedavg.aggregator.f: expected n >= 4f + 3 for bulyan, so f <= 0 with n = 4 clients per round, "
        "got 1; lower f or use more clients"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


# ---------------------------------------------------------------------------------------------------------------
# Against Flower's implementation (its own virtualenv, as benchmarks/compare_flower.py uses; nothing is installed)

FLOWER_PYTHON = Path(__file__).resolve().parents[2] / "benchmarks" / ".flwr-venv" / "bin" / "python"


@pytest.mark.skipif(not FLOWER_PYTHON.exists(), reason="no Flower environment at benchmarks/.flwr-venv (benchmarks/README.md)")
def test_equal_to_flowers_aggregators_on_random_arrays(monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(FLOWER_PYTHON.parents[2]))
    from compare_flower_robust import compare

    payload = compare(argparse.Namespace(clients=9, params=3000, repeats=1, f=1, m=3, beta=0.2))
    compared = [row for row in payload["rows"] if "equal" in row]
    assert {row["rule"] for row in compared} == {"mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan"}, payload[
        "flower_missing"
    ]
    assert all(row["equal"] for row in compared), compared
