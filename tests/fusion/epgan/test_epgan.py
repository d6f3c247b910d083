"""EP-GAN (rayfuse.fusion.epgan.algorithm, epgan.nets): backbones, the server's product of factors, rejections, bad input, a
tiny end-to-end run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfuse.data.datasets import gaussians4_mixture, load_dataset
from rayfuse.errors import InputError
from rayfuse.federation import Gathered, Update
from rayfuse.fusion.epgan.algorithm import EPGAN, combine_factors, density_mse, grid_points, mixture_density, score_toy
from rayfuse.fusion.epgan.nets import Discriminator, GANSettings, GANTrainer, Generator, ep_energy
from rayfuse.method import METHODS, resolve_methods

TOY = {
    "data": {"dataset": "gaussians4", "options": {"n_per_mode": 120}, "val_size": 0.0},
    "partition": {"method": "labels", "num_clients": 4, "groups": [[0], [1], [2], [3]]},
}
FAST = {"warmup_epochs": 1, "rounds": 2, "local_epochs": 1, "batch_size": 32, "grid": 20, "eval_samples": 200}


@pytest.fixture(scope="module")
def toy_X():
    return load_dataset("gaussians4", options={"n_per_mode": 64}).X


# ---------------------------------------------------------------------------------------------------------------
# Backbones


@pytest.mark.parametrize("backbone,components", [("wgan", 1), ("probgan", 1), ("ep-bgan", 1), ("ep-probgan", 1), ("ep-probgan", 3)])
def test_backbones_train_with_finite_losses_and_the_right_shapes(toy_X, backbone, components):
    s = GANSettings(backbone=backbone, components=components, batch_size=32, num_generators=4, num_discriminators=3)
    trainer = GANTrainer(s, seed=0)
    if s.uses_ep:
        centre = trainer.prior_from_generator()
        means = {k: np.stack([v] * components) for k, v in centre.items()}
        variances = {k: np.ones_like(v) for k, v in means.items()}
        site_m, site_v, f_bar = trainer.update_ep(toy_X, means, variances, damping=0.5)
        assert f_bar.shape == (components,)
        assert all(site_v[k].shape == means[k].shape and (site_v[k] > 0).all() for k in means)
    stats = trainer.train(toy_X, 2)
    assert np.isfinite(stats["d_loss"]) and np.isfinite(stats["g_loss"])
    assert trainer.sample(10).shape == (10, 2)
    assert trainer.critic_map(grid_points(5)).shape == (25,)
    n_gen = 1 if backbone == "wgan" else 4
    params = trainer.get_params()
    assert params["G/first_weight"].shape == (n_gen, 32, 2)  # one first layer per generator sample
    assert params["D/head.weight"].shape == (1 if backbone == "wgan" else 3, 32)  # one last layer per critic sample
    assert ("pi/logits" in params) == (components > 1)
    assert ("D/f_head.weight" in params) == s.uses_ep


def test_discriminator_history_is_the_running_average_of_the_last_layer():
    d = Discriminator(2, 8, num_samples=2)
    seen = [d.head.weight.detach().clone()]
    for _ in range(3):
        with torch.no_grad():
            d.head.weight.add_(torch.randn_like(d.head.weight))
        seen.append(d.head.weight.detach().clone())
        d.update_history()
    torch.testing.assert_close(d.hist_weight, torch.stack(seen).mean(0))


def test_generator_samples_use_their_own_first_layer():
    g = Generator(2, 8, 2, num_samples=2).eval()
    z = torch.randn(4, 2)
    with torch.no_grad():
        before = g(z)
        g.first_weight[1].add_(1.0)  # only sample 1 changes: the first half of the batch is sample 0's
        after = g(z)
    torch.testing.assert_close(before[:2], after[:2])
    assert not torch.allclose(before[2:], after[2:])


def test_ep_energy_against_a_hand_computed_value():
    theta = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.5])}  # w per sample (N = 2), b shared
    means = {"w": torch.tensor([[0.0, 0.0], [1.0, 1.0]]), "b": torch.tensor([[0.0], [0.5]])}  # J = 2
    half = {"w": torch.full((2, 2), 0.5), "b": torch.full((2, 1), 0.25)}
    energy = ep_energy(theta, means, half, num_samples=2, per_sample={"w"})
    # j = 0: 0.5 (1 + 4 + 9 + 16) + 2 * 0.25 * 0.25 ; j = 1: 0.5 (0 + 1 + 4 + 9) + 2 * 0.25 * 0
    torch.testing.assert_close(energy, torch.tensor([15.125, 7.0]))


def test_the_mixture_ep_loss_is_a_logsumexp_below_the_best_component(toy_X):
    trainer = GANTrainer(GANSettings(backbone="ep-probgan", components=3), seed=0)
    centre = trainer.prior_from_generator()
    means = {k: np.stack([v, v + 1.0, v - 1.0]) for k, v in centre.items()}
    trainer.set_prior(means, {k: np.ones_like(v) for k, v in means.items()})
    loss = float(trainer.ep_loss().detach())
    energy = ep_energy(dict(trainer.G.named_parameters()), *trainer._prior_torch, trainer.G.num_samples, trainer.per_sample).detach()
    # -log sum_j pi_j exp(-E_j) >= min_j E_j (the pi_j sum to 1) and is finite even where exp(-E_j) underflows
    assert np.isfinite(loss) and loss >= float(energy.min()) - 1e-3
    assert float(energy.max()) > 100  # exp(-E) underflows in float32 for the far components


# ---------------------------------------------------------------------------------------------------------------
# Server math and scores


def test_server_product_of_factors_equals_the_closed_form():
    rng = np.random.default_rng(0)
    factors = [({"w": rng.normal(size=(2, 3))}, {"w": rng.uniform(0.1, 2.0, size=(2, 3))}) for _ in range(3)]
    means, variances = combine_factors(factors)
    precision = sum(1.0 / f[1]["w"] for f in factors)
    np.testing.assert_allclose(variances["w"], 1.0 / precision)  # the variance, not the precision (paper's typo)
    np.testing.assert_allclose(means["w"], sum(f[0]["w"] / f[1]["w"] for f in factors) / precision)
    # with the initial prior as one more factor (site mode "ep")
    prior = ({"w": np.zeros((2, 3))}, {"w": np.ones((2, 3))})
    _, v2 = combine_factors(factors, prior)
    np.testing.assert_allclose(v2["w"], 1.0 / (precision + 1.0))


def test_density_mse_is_zero_for_the_truth_and_invariant_to_scale():
    centres, variances = gaussians4_mixture()
    points = grid_points(30)
    truth = mixture_density(points, centres, variances)
    assert density_mse(truth, 7.0 * truth - 3.0) == pytest.approx(0.0, abs=1e-12)
    assert density_mse(truth, np.zeros_like(truth)) > 0.01
    cell = (10.0 / 29) ** 2
    assert truth.sum() * cell == pytest.approx(1.0, abs=0.02)  # a density over [-5, 5]^2


def test_toy_scores_count_modes():
    centres, variances = gaussians4_mixture()
    rng = np.random.default_rng(0)
    points = grid_points(20)
    truth = mixture_density(points, centres, variances)
    all_modes = centres[rng.integers(0, 4, 2000)] + rng.normal(size=(2000, 2)) * 0.5
    one_mode = centres[np.zeros(2000, int)] + rng.normal(size=(2000, 2)) * 0.5
    good = score_toy(truth, all_modes, truth, centres, variances, grid=20)
    bad = score_toy(truth, one_mode, truth, centres, variances, grid=20)
    assert good["modes"] == 4 and bad["modes"] == 1
    assert good["g_dmse"] < bad["g_dmse"] and good["high_quality"] > 0.95


# ---------------------------------------------------------------------------------------------------------------
# Bad input and rejections


@pytest.mark.parametrize(
    "entry,key",
    [
        ({"components": 0}, "components"),
        ({"backbone": "probgan", "components": 4}, "components"),
        ({"backbone": "dcgan"}, "backbone"),
        ({"damping": 0.0}, "damping"),
        ({"prior_var": -1.0}, "prior_var"),
    ],
)
def test_bad_parameters_name_the_key(make_config, entry, key):
    with pytest.raises(InputError, match=rf"methods\.ep\.{key}"):
        make_config(**TOY, methods={"ep": {"method": "epgan", **entry}})


def _update(var: float, mean: float = 0.0, count: int = 10) -> Update:
    return Update(
        {"G/w": np.zeros(2, np.float32), "ep_mean/w": np.full((1, 2), mean), "ep_var/w": np.full((1, 2), var)},
        count,
        {"d_loss": 0.0, "g_loss": 0.0},
    )


def test_a_client_with_nan_moments_or_non_positive_variances_is_rejected_and_recorded(coordinator):
    coord = coordinator(**TOY, methods={"ep": {"method": "epgan", **FAST}})
    from rayfuse.coordinator import MethodServer

    spec = resolve_methods(coord.cfg.methods)[0]
    server = MethodServer(coord, spec, resume=False)
    reference = _update(1.0).params
    n = coord.plan.num_examples
    gathered = Gathered(
        {
            0: _update(1.0, count=n(0)),
            1: _update(np.nan, count=n(1)),
            2: _update(-0.5, count=n(2)),
            3: _update(1.0, mean=np.nan, count=n(3)),
        }
    )
    kept = EPGAN.accept(server, gathered, reference)
    assert list(kept) == [0]
    rejected = [e for e in coord.events.since(0) if e["kind"] == "update_rejected"]
    assert sorted(e["client"] for e in rejected) == [1, 2, 3]
    assert any("non-positive EP variances" in e["message"] for e in rejected)


# ---------------------------------------------------------------------------------------------------------------
# End to end, in-process


def test_tiny_end_to_end_run_in_process(coordinator):
    methods = {
        "wgan": {"method": "epgan", "backbone": "wgan", **FAST},
        "mix": {"method": "epgan", "backbone": "ep-probgan", "components": 2, **FAST},
        "oracle": {
            "method": "epgan-oracle",
            "backbone": "ep-probgan",
            "epochs": 2,
            "local_epochs": 1,
            "batch_size": 32,
            "grid": 20,
            "eval_samples": 200,
        },
    }
    coord = coordinator(
        **TOY,
        methods=methods,
        federation={
            "faults": [{"client": 2, "step": "epgan.train", "call": c, "mode": "nan"} for c in (2, 5)],
            "on_client_failure": "drop",
        },
    )
    wgan = coord.run_method("wgan")
    mix = coord.run_method("mix")
    oracle = coord.run_method("oracle")
    for summary in (wgan, mix, oracle):
        assert {"d_mse", "g_dmse", "modes", "high_quality"} <= set(summary["metrics"])
        assert all(np.isfinite(v) for v in summary["metrics"].values())
    assert oracle["oracle"] and not mix["oracle"]
    # client 2's turn 1 returned NaNs in both federated methods (its calls 2 and 5): rejected, recorded, the turn went on
    assert wgan["info"]["rejected_updates"] == 1 and mix["info"]["rejected_updates"] == 1
    turns = [r for r in mix["history"] if r["metric"] == "clients"]
    assert [r["value"] for r in turns] == [4.0, 3.0, 4.0]
    var = [r["value"] for r in mix["history"] if r["metric"] == "ep_var_mean"]
    assert len(var) == 3 and var[0] == pytest.approx(1.0) and var[2] < var[1] < 1.0  # the product sharpens the prior
    assert set(mix["info"]["maps"]) == {"0", "1", "2"}


# ---------------------------------------------------------------------------------------------------------------
# Image scores (digits)


def test_frechet_distance_and_inception_score_properties():
    from rayfuse.fusion.epgan.algorithm import frechet_distance, inception_score

    rng = np.random.default_rng(0)
    a = rng.normal(size=(500, 4))
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-4)
    assert frechet_distance(a, a + 2.0) == pytest.approx(16.0, rel=1e-3)  # ||mu shift||^2 = 4 * 2^2
    assert inception_score(np.eye(5)[rng.integers(0, 5, 1000)]) == pytest.approx(5.0, rel=0.02)  # confident, all classes
    assert inception_score(np.full((100, 5), 0.2)) == pytest.approx(1.0)  # no information


def test_tiny_digits_run_reports_image_scores(coordinator):
    fast = {**FAST, "hidden": 16, "latent_dim": 4, "out_activation": "sigmoid", "eval_samples": 200}
    coord = coordinator(
        data={"dataset": "digits", "val_size": 0.0},
        partition={"method": "labels", "num_clients": 2, "groups": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]},
        methods={"ep": {"method": "epgan", "backbone": "ep-probgan", **fast}},
    )
    summary = coord.run_method("ep")
    assert {"fd", "is", "classes"} <= set(summary["metrics"]) and all(np.isfinite(v) for v in summary["metrics"].values())
    assert summary["info"]["real_data_scores"]["is"] > 5  # the scoring classifier separates the real digits
    assert np.asarray(summary["info"]["maps"]["2"]["images"]).shape == (16, 8, 8)


# ---------------------------------------------------------------------------------------------------------------
# Resume (turn checkpoints)


def _run(cfg, run_dir, **kwargs):
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    return run_experiment(cfg, InProcessBackend(), run_dir, printer=Printer(enabled=False), show_tables=False, **kwargs)


def _checkpoint(run_dir, label):
    from rayfuse.store import RunStore

    return RunStore(run_dir).checkpointer(label).load()


def _deterministic(history):
    return [r for r in history if r["metric"] != "client_seconds"]  # wall time


def _stored(cache):
    """The GAN states the clients keep in their own storage (``run.model_cache``)."""
    return sorted(str(f.relative_to(cache)) for f in cache.glob("client-state/*/epgan-state/*/*"))


def _interrupt_at_turn_2(make_config, run_dir, methods, cache):
    """Client 1 raises in its third call of epgan.train (turn 2; turn 0 is the warm-up) and the policy is fail: the run
    stops with turns 0 and 1 checkpointed."""
    from rayfuse.errors import RunFailure

    crash = {"on_client_failure": "fail", "faults": [{"client": 1, "step": "epgan.train", "call": 3, "mode": "raise"}]}
    with pytest.raises(RunFailure):
        _run(make_config(**TOY, methods=methods, federation=crash, run={"model_cache": cache}), run_dir)
    assert _checkpoint(run_dir, "ep").round == 1


def _resume(run_dir):
    from rayfuse.config import parse_overrides
    from rayfuse.runner import load_run_config
    from tests.conftest import scramble_global_rngs

    cfg = load_run_config(run_dir, parse_overrides(["federation.faults=[]", "federation.on_client_failure=retry"]))
    scramble_global_rngs()  # a real resume is a new process: nothing may depend on the old one's global random state
    return _run(cfg, run_dir, resume=True)


def _turns_run(results):
    return [e["round"] for e in results["events"] if e["kind"] == "progress" and e.get("method") == "ep"]


@pytest.mark.parametrize("components,site", [(1, "paper"), (2, "ep")])
def test_an_interrupted_ep_probgan_run_resumes_after_its_last_turn_and_equals_the_uninterrupted_run(
    make_config, tmp_path, components, site
):
    import json

    methods = {"ep": {"method": "epgan", "backbone": "ep-probgan", "components": components, "site": site, **FAST, "rounds": 3}}
    straight = _run(make_config(**TOY, methods=methods), tmp_path / "straight")  # no client storage: the plain run
    interrupted, cache = tmp_path / "interrupted", tmp_path / "cache"
    _interrupt_at_turn_2(make_config, interrupted, methods, str(cache))
    # Each client keeps its own GAN state of the checkpointed turn 1 and of the turn before it started from (clients 0,
    # 2 and 3 finished turn 2, which started from turn 1);
    # the server's checkpoint records only which turn each client's state is of, and where (the store id).
    meta = _checkpoint(interrupted, "ep").meta
    assert meta["state_turns"] == [[0, 1], [1, 1], [2, 1], [3, 1]] and meta["store"].isalnum()
    assert _stored(cache) == sorted(
        f"client-state/client-{c}/epgan-state/{meta['store']}/ep-{t:05d}.safetensors"
        for c in range(4)
        for t in ((0, 1) if c == 1 else (1, 2))
    )

    resumed = _resume(interrupted)
    assert resumed["status"] == "succeeded"
    events = resumed["events"]
    assert any(e["kind"] == "resumed" and e.get("method") == "ep" and e["round"] == 1 for e in events)
    assert any(e["kind"] == "info" and "4 clients continue from the GAN state they kept themselves" in e.get("message", "") for e in events)
    assert not [e for e in events if e["kind"] == "warning"]
    # the finished turns 0 and 1 are not redone: the resumed run trains turns 2 and 3 only, each once
    assert _turns_run(resumed) == [2, 3]

    # The same numbers as the uninterrupted run, exactly: scores, per-turn records, maps, the final G / D and the EP
    # prior (float64, every component) in the last checkpoint.
    assert resumed["methods"]["ep"] == {**straight["methods"]["ep"], "seconds": resumed["methods"]["ep"]["seconds"]}
    state = {run: json.loads((tmp_path / run / "state" / "ep.json").read_text()) for run in ("straight", "interrupted")}
    assert _deterministic(state["interrupted"]["history"]) == _deterministic(state["straight"]["history"])
    assert sorted({r["round"] for r in state["interrupted"]["history"]}) == [0, 1, 2, 3]
    assert len(state["interrupted"]["history"]) == len(state["straight"]["history"])  # no turn logged twice
    a, b = _checkpoint(tmp_path / "straight", "ep"), _checkpoint(interrupted, "ep")
    assert a.round == b.round == 3
    for mine, theirs in ((b.params, a.params), (b.state, a.state)):
        assert sorted(mine) == sorted(theirs)
        assert all(np.array_equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in mine), [
            k for k in mine if not np.array_equal(mine[k], theirs[k])
        ]
    assert any(k.startswith("ep_mean/") for k in b.state) and b.state["ep_mean/first_weight"].shape[0] == components
    assert "ep0_mean/mid.weight" in b.state and ("pi/logits" in b.params) == (components > 1)
    # nothing of any client's in the server's checkpoint: no optimiser moments, random generator, iteration counter
    assert set(b.state) == {k for k in b.state if k.startswith(("ep_mean/", "ep_var/", "ep0_mean/", "ep0_var/"))}
    assert b.meta["state_turns"] == [[c, 3] for c in range(4)]
    assert _stored(cache) == []  # the clients' stored states are deleted once the method is done


def test_without_client_storage_resume_restarts_from_turn_0_with_the_same_result(make_config, tmp_path):
    methods = {"ep": {"method": "epgan", "backbone": "ep-probgan", **FAST, "rounds": 3}}
    straight = _run(make_config(**TOY, methods=methods), tmp_path / "straight")
    run_dir = tmp_path / "interrupted"
    _interrupt_at_turn_2(make_config, run_dir, methods, None)
    assert _checkpoint(run_dir, "ep").meta["store"] is None
    resumed = _resume(run_dir)
    warnings = [e["message"] for e in resumed["events"] if e["kind"] == "warning"]
    assert len(warnings) == 1 and "restarting from turn 0" in warnings[0] and "run.model_cache" in warnings[0]
    assert not [e for e in resumed["events"] if e["kind"] == "resumed"]
    assert _turns_run(resumed) == [0, 1, 2, 3]
    assert resumed["methods"]["ep"] == {**straight["methods"]["ep"], "seconds": resumed["methods"]["ep"]["seconds"]}


def test_a_lost_client_state_restarts_from_turn_0_with_the_same_result(make_config, tmp_path):
    methods = {"ep": {"method": "epgan", "backbone": "ep-probgan", **FAST, "rounds": 3}}
    straight = _run(make_config(**TOY, methods=methods), tmp_path / "straight")
    run_dir, cache = tmp_path / "interrupted", tmp_path / "cache"
    _interrupt_at_turn_2(make_config, run_dir, methods, str(cache))
    old_store = _checkpoint(run_dir, "ep").meta["store"]
    (cache / "client-state" / "client-2" / "epgan-state" / old_store / "ep-00001.safetensors").unlink()  # client 2 lost it
    resumed = _resume(run_dir)
    warnings = [e["message"] for e in resumed["events"] if e["kind"] == "warning"]
    assert len(warnings) == 1 and "restarting from turn 0: clients [2] no longer hold their GAN state" in warnings[0]
    assert _turns_run(resumed) == [0, 1, 2, 3]
    assert resumed["methods"]["ep"] == {**straight["methods"]["ep"], "seconds": resumed["methods"]["ep"]["seconds"]}
    assert _checkpoint(run_dir, "ep").meta["store"] != old_store  # a new store for the new start
    assert _stored(cache) == []  # the old store's leftovers and the new run's states are deleted


def test_resuming_after_a_rejected_update_equals_the_uninterrupted_run(make_config, tmp_path):
    """Client 2's turn 1 comes back NaN and is rejected; the run stops after turn 1. The client's GAN state moved on
    in turn 1 all the same (its own storage has it), so the resumed run continues from it, as the uninterrupted one."""
    methods = {"ep": {"method": "epgan", "backbone": "ep-probgan", **FAST, "rounds": 3}}
    nan = {"client": 2, "step": "epgan.train", "call": 2, "mode": "nan"}
    fed = {"on_client_failure": "drop", "faults": [nan]}
    straight = _run(make_config(**TOY, methods=methods, federation=fed), tmp_path / "straight")
    assert straight["methods"]["ep"]["info"]["rejected_updates"] == 1
    run_dir, cache = tmp_path / "interrupted", tmp_path / "cache"
    crash = {"client": 1, "step": "epgan.train", "call": 3, "mode": "raise"}
    from rayfuse.errors import RunFailure

    with pytest.raises(RunFailure):
        _run(
            make_config(
                **TOY, methods=methods, federation={"on_client_failure": "fail", "faults": [nan, crash]}, run={"model_cache": str(cache)}
            ),
            run_dir,
        )
    assert _checkpoint(run_dir, "ep").meta["state_turns"] == [[c, 1] for c in range(4)]
    resumed = _resume(run_dir)
    assert _turns_run(resumed) == [2, 3]
    assert resumed["methods"]["ep"] == {**straight["methods"]["ep"], "seconds": resumed["methods"]["ep"]["seconds"]}


def test_a_client_keeps_its_gan_state_itself_and_uploads_none_of_it(make_config, tmp_path):
    """What an EP-GAN client returns from its turn is its parameters and EP factor: no optimiser moments, no random
    generator state, no iteration counter. It keeps those in its own storage, from which a new client (a resumed
    run's, or a restarted actor) continues exactly."""
    from dataclasses import asdict

    from rayfuse.client import Client, forget_client_state, has_client_state
    from rayfuse.data.roles import load_dataset_from_config, make_plan
    from rayfuse.fusion.epgan.algorithm import STATE, EPGANParams, initial_ep_prior, train_gan

    cfg = make_config(**TOY, methods={"ep": {"method": "epgan", **FAST}})
    plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)
    cache = tmp_path / "cache"

    def new_client():
        return Client(0, plan.for_client(0), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=0, local_cache=str(cache))

    settings = EPGANParams(backbone="ep-probgan", components=2, batch_size=32).settings(2)
    model = GANTrainer(settings, seed=1)
    ep = initial_ep_prior(model, 2, 1.0, 0.05, np.random.default_rng(0))
    broadcast = {"params": model.get_params(), "ep_mean": ep[0], "ep_var": ep[1]}
    args = dict(label="ep", settings=asdict(settings), epochs=1, beta=0.5, damping=0.5, site="paper", store="abc123")
    client = new_client()
    client.run(train_gan, {"params": model.get_params()}, round=0, state_turn=None, **args)
    update = client.run(train_gan, broadcast, round=1, state_turn=0, **args)

    trainer = client.ctx.state["epgan/ep"]
    private = trainer.training_state()
    assert any("exp_avg_sq" in k for k in private) and "rng" in private and "iterations" in private
    expected = set(trainer.get_params()) | {f"ep_{w}/{k}" for w in ("mean", "var") for k in ep[0]}
    assert set(update.params) == expected and "pi/logits" in expected
    assert all(k.startswith(("G/", "D/", "pi/", "ep_mean/", "ep_var/")) for k in update.params)
    returned = [np.asarray(v) for v in update.params.values()] + [np.asarray(v) for v in update.metrics.values()]
    assert not [k for k in list(update.params) + list(update.metrics) if any(w in k for w in ("rng", "exp_avg", "iterations", "resume"))]
    for name, value in private.items():  # no moment or generator state travels, under any name
        if value.size > 1:
            assert not any(r.shape == value.shape and np.array_equal(r, value) for r in returned), name

    # the client's own storage: its state after turns 0 and 1 (turn 1 started from 0)
    kept = cache / "client-state" / "client-0" / "epgan-state" / "abc123"
    assert sorted(f.name for f in kept.iterdir()) == ["ep-00000.safetensors", "ep-00001.safetensors"]
    straight = client.run(train_gan, broadcast, round=2, state_turn=1, **args)
    assert sorted(f.name for f in kept.iterdir()) == ["ep-00001.safetensors", "ep-00002.safetensors"]
    again = new_client()
    assert again.run(has_client_state, kind=STATE, name="ep", round=1, store="abc123") and not again.run(
        has_client_state, kind=STATE, name="ep", round=0, store="abc123"
    )
    resumed = again.run(train_gan, broadcast, round=2, state_turn=1, **args)
    assert all(np.array_equal(straight.params[k], resumed.params[k]) for k in straight.params)
    with pytest.raises(FileNotFoundError, match="no GAN state of 'ep' after turn 0"):  # never silently a fresh one
        new_client().run(train_gan, broadcast, round=2, state_turn=0, **args)
    fresh = new_client().run(train_gan, broadcast, round=2, state_turn=None, **args)  # the stored state matters
    assert not all(np.array_equal(straight.params[k], fresh.params[k]) for k in straight.params)
    files = len(list(kept.iterdir()))  # the fresh start's turn 2 only: it started from no stored turn
    assert files == 1 and new_client().run(forget_client_state, kind=STATE, store="abc123") == files and not kept.exists()


def test_finished_turns_are_not_redone_on_resume(make_config, tmp_path):
    from rayfuse.config import parse_overrides
    from rayfuse.fusion import METHODS
    from rayfuse.runner import load_run_config

    assert METHODS.get("epgan").tags.multi_round
    methods = {"ep": {"method": "epgan", "backbone": "ep-bgan", **FAST, "rounds": 2}}
    run_dir = tmp_path / "r"
    first = _run(make_config(**TOY, methods=methods), run_dir)
    (run_dir / "state" / "ep.json").unlink()  # as if the run stopped after checkpointing its last turn
    # Any epgan.train call in the resumed run fails it: every client raises on its first one.
    trap = [{"client": c, "step": "epgan.train", "call": 1, "mode": "raise"} for c in range(4)]
    cfg = load_run_config(run_dir, parse_overrides([f"federation.faults={trap}".replace("'", '"'), "federation.on_client_failure=fail"]))
    assert len(cfg.federation.faults) == 4
    resumed = _run(cfg, run_dir, resume=True)
    assert any(e["kind"] == "resumed" and e["round"] == 2 for e in resumed["events"])
    assert not [e for e in resumed["events"] if e["kind"] == "progress" and e.get("method") == "ep"]
    assert resumed["methods"]["ep"] == {**first["methods"]["ep"], "seconds": resumed["methods"]["ep"]["seconds"]}


def test_the_oracle_resumes_after_its_last_block_of_epochs(coordinator, monkeypatch):
    methods = {
        "oracle": {
            "method": "epgan-oracle",
            "backbone": "ep-probgan",
            "epochs": 3,
            "local_epochs": 1,
            "batch_size": 32,
            "grid": 20,
            "eval_samples": 200,
        }
    }
    straight = coordinator(**TOY, methods=methods).run_method("oracle")
    from rayfuse.fusion.epgan import nets as epgan_nets

    class Stop(Exception):
        pass

    train, calls = epgan_nets.GANTrainer.train, []

    def stop_at_the_third_block(self, *args, **kwargs):  # as if the run were killed during epoch 3
        calls.append(1)
        if len(calls) == 3:
            raise Stop
        return train(self, *args, **kwargs)

    monkeypatch.setattr(epgan_nets.GANTrainer, "train", stop_at_the_third_block)
    with pytest.raises(Stop):
        coordinator(**TOY, methods=methods).run_method("oracle")
    monkeypatch.setattr(epgan_nets.GANTrainer, "train", train)
    coord = coordinator(**TOY, methods=methods)
    resumed = coord.run_method("oracle", resume=True)
    assert any(e["kind"] == "resumed" and e["round"] == 2 for e in coord.events.since(0))
    assert [e.get("message") for e in coord.events.since(0) if e["kind"] == "progress"] == ["epoch 3/3"]
    assert resumed["metrics"] == straight["metrics"]
    assert _deterministic(resumed["history"]) == _deterministic(straight["history"])


def test_the_epgan_tags_are_its_papers():
    """EP-GAN: rounds of GAN training whose EP factors (Gaussian posteriors) the server multiplies, scored generatively
    (central only); its centralised column pools the clients' data."""
    tags, oracle = METHODS.get("epgan").tags, METHODS.get("epgan-oracle").tags
    assert tags.fuses == "posteriors" and tags.multi_round and not tags.federated_evaluation and not tags.oracle
    assert oracle.oracle and oracle.needs_dataset and not oracle.federated_evaluation and not oracle.multi_round
