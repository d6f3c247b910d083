"""Central DP-FedAvg (rayfuse.updates.central_dp and the FedAvg family's ``dp`` key): the accountant is Opacus' own,
every client's contribution is clipped, the noise has the stated scale, adaptive clipping finds the quantile, and a
run with ``stop_at_epsilon`` stops before the round that would exceed it."""

from __future__ import annotations

import numpy as np
import pytest

from rayfuse.errors import InputError
from rayfuse.updates.accountant import compute_epsilon
from rayfuse.updates.central_dp import (
    CentralDPSettings,
    apply_dp_round,
    clip_and_sum,
    compute_update_noise_multiplier,
    find_noise_multiplier,
    plan_dp,
    sample_poisson,
)


def _settings(**kw: object) -> CentralDPSettings:
    return CentralDPSettings.model_validate({"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.1, **kw})


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_the_epsilon_is_opacus_own_for_the_same_noise_rate_and_steps(mechanism):
    from opacus.accountants import PRVAccountant, RDPAccountant

    for z, q, steps in [(1.1, 0.1, 50), (0.8, 0.3, 7), (2.0, 1.0, 3)]:
        theirs = RDPAccountant() if mechanism == "rdp" else PRVAccountant()
        for _ in range(steps):
            theirs.step(noise_multiplier=z, sample_rate=q)
        assert compute_epsilon(z, q, steps, 1e-5, mechanism) == pytest.approx(theirs.get_epsilon(delta=1e-5), rel=1e-9)
    assert compute_epsilon(1.0, 0.1, 0, 1e-5, mechanism) == 0.0


def test_the_noise_for_a_target_epsilon_is_opacus_and_spends_at_most_it():
    from opacus.accountants.utils import get_noise_multiplier

    z = find_noise_multiplier(2.0, 1e-5, 0.1, 40, "rdp")
    assert z == get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.1, steps=40, accountant="rdp")
    assert 2.0 - 0.01 <= compute_epsilon(z, 0.1, 40, 1e-5) <= 2.0


def test_clipping_bounds_every_clients_contribution_to_the_sum():
    rng = np.random.default_rng(0)
    reference = {
        "w": rng.normal(size=(30, 20)).astype(np.float32),
        "b": rng.normal(size=20).astype(np.float32),
        "count": np.array(5, dtype=np.int64),
    }
    scales = [0.01, 0.5, 1.0, 3.0, 40.0, 1e3]
    models = [
        {
            "w": reference["w"] + s * rng.normal(size=(30, 20)).astype(np.float32),
            "b": reference["b"] + s * rng.normal(size=20).astype(np.float32),
            "count": np.array(99, dtype=np.int64),
        }
        for s in scales
    ]
    clip = 2.5
    total, norms = clip_and_sum(models, reference, clip)
    assert set(total) == {"w", "b"}  # integer counters take no part
    together = {k: np.zeros_like(v) for k, v in total.items()}
    for model, norm in zip(models, norms):
        alone, _ = clip_and_sum([model], reference, clip)  # this client's contribution to the sum
        size = np.sqrt(sum(float(np.vdot(a, a)) for a in alone.values()))
        assert size <= clip * (1 + 1e-12)
        if norm <= clip:  # within the norm: untouched
            assert size == pytest.approx(norm, rel=1e-12)
        for k in together:
            together[k] += alone[k]
    for k in total:
        np.testing.assert_allclose(total[k], together[k], rtol=1e-12)
    assert (norms > clip).sum() >= 3  # the case clipped something


def test_the_noise_has_standard_deviation_z_c_over_the_expected_clients():
    settings = _settings(noise_multiplier=1.3, clip_norm=0.7, sample_rate=0.25)
    plan = plan_dp(settings, num_clients=20, rounds=5)
    reference = {"w": np.zeros(1_000_000, dtype=np.float64)}
    done = apply_dp_round([], reference, settings, plan, 0.7, np.random.default_rng(1))
    noise = done.params["w"] * plan.expected_clients  # the noise added to the (empty) sum
    # the sample standard deviation of 1e6 normals is within 0.3% of the true one far beyond 5 sigma
    assert np.std(noise) == pytest.approx(1.3 * 0.7, rel=3e-3)
    assert abs(np.mean(noise)) < 5 * 1.3 * 0.7 / 1000
    assert plan.expected_clients == 5.0


def test_adaptive_clipping_raises_the_update_noise_as_the_paper_says():
    settings = _settings(noise_multiplier=1.0, adaptive={"count_stddev": 2.0})
    plan = plan_dp(settings, num_clients=100, rounds=5)
    assert plan.update_noise_multiplier == pytest.approx((1.0 - 1 / 16) ** -0.5)
    assert plan.update_noise_multiplier == compute_update_noise_multiplier(1.0, 2.0)
    reference = {"w": np.zeros(400_000)}
    done = apply_dp_round([], reference, settings, plan, 0.5, np.random.default_rng(2))
    assert np.std(done.params["w"] * plan.expected_clients) == pytest.approx(plan.update_noise_multiplier * 0.5, rel=5e-3)


@pytest.mark.parametrize("start", [0.01, 100.0])
def test_adaptive_clipping_moves_the_clip_norm_to_the_target_quantile(start):
    rng = np.random.default_rng(3)
    n, dim = 200, 8
    norms = rng.lognormal(mean=0.0, sigma=0.5, size=n)  # the update norms the clients will have
    directions = rng.normal(size=(n, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    reference = {"w": np.zeros(dim)}
    models = [{"w": d * r} for d, r in zip(directions, norms)]
    settings = _settings(
        noise_multiplier=1.0, sample_rate=1.0, clip_norm=start, adaptive={"target_quantile": 0.3, "lr": 0.2, "count_stddev": 2.0}
    )
    plan = plan_dp(settings, num_clients=n, rounds=10)
    clip = start
    for step in range(300):
        clip = apply_dp_round(models, reference, settings, plan, clip, np.random.default_rng(step)).clip_norm
    target = np.quantile(norms, 0.3)
    assert abs(clip - target) / target < 0.1
    assert np.mean(norms <= clip) == pytest.approx(0.3, abs=0.05)


def test_poisson_sampling_is_seeded_and_at_the_rate():
    ids = list(range(1000))
    first = sample_poisson(np.random.default_rng(7), ids, 0.1)
    assert first == sample_poisson(np.random.default_rng(7), ids, 0.1)
    assert first != sample_poisson(np.random.default_rng(8), ids, 0.1)
    assert 70 <= len(first) <= 130 and first == sorted(first)
    assert sample_poisson(np.random.default_rng(7), ids, 1.0) == ids


def test_the_plan_refuses_what_the_guarantee_cannot_hold():
    with pytest.raises(InputError, match=r"^dp.delta: expected delta < 1/n = 0.1 with n = 10 clients"):
        plan_dp(_settings(delta=0.1), num_clients=10, rounds=5)
    with pytest.raises(InputError, match=r"^dp.adaptive.count_stddev: "):
        plan_dp(_settings(noise_multiplier=4.0, adaptive={"count_stddev": 1.0}), num_clients=100, rounds=5)
    with pytest.raises(InputError, match=r"^dp.stop_at_epsilon: expected at least the epsilon of one round"):
        plan_dp(_settings(noise_multiplier=0.3, stop_at_epsilon=0.01), num_clients=100, rounds=5)
    plan = plan_dp(_settings(noise_multiplier=1.0, sample_rate=0.2, stop_at_epsilon=5.0), num_clients=100, rounds=50)
    assert 1 < plan.rounds < 50
    assert compute_epsilon(1.0, 0.2, plan.rounds, 1e-5) <= 5.0 < compute_epsilon(1.0, 0.2, plan.rounds + 1, 1e-5)


def test_a_run_with_stop_at_epsilon_stops_at_the_right_round_and_says_so(tmp_path):
    import pyarrow.parquet as pq

    import rayfuse
    from tests.conftest import TINY, merge

    dp = {"noise_multiplier": 1.5, "clip_norm": 1.0, "sample_rate": 0.5, "stop_at_epsilon": 6.0}
    cfg = merge(
        TINY,
        {
            "run": {"storage": str(tmp_path / "runs")},
            "partition": {"method": "iid", "num_clients": 8},
            "methods": {"dp": {"method": "fedavg", "rounds": 20, "local_epochs": 1, "dp": dp}},
        },
    )
    result = rayfuse.run(cfg, quiet=True)
    entry = result.results["methods"]["dp"]
    expected = max(t for t in range(1, 21) if compute_epsilon(1.5, 0.5, t, 1e-5) <= 6.0)
    assert 1 < expected < 20
    assert entry["rounds"] == expected == entry["info"]["dp"]["rounds"]
    assert entry["epsilon"] == pytest.approx(compute_epsilon(1.5, 0.5, expected, 1e-5))
    assert entry["info"]["dp"]["stopped"].startswith(f"stopped after round {expected} of 20: round {expected + 1} would spend epsilon")
    assert "stop_at_epsilon 6" in entry["note"]
    table = pq.read_table(result.run_dir / "metrics.parquet").to_pandas()
    spent = table[(table.method == "dp") & (table.metric == "dp_epsilon")].sort_values("round")
    assert list(spent["round"]) == list(range(1, expected + 1))
    np.testing.assert_allclose(spent["value"], [compute_epsilon(1.5, 0.5, t, 1e-5) for t in range(1, expected + 1)])
    # the same seed draws the same clients and the same noise
    again = rayfuse.run(cfg, quiet=True).results["methods"]["dp"]
    assert again["accuracy"] == entry["accuracy"]
