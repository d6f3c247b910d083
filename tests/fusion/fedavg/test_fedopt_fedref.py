"""FedOpt (FedAdagrad, FedAdam, FedYogi) and FedRef: server steps by hand, the FedRef schedule, resume, bad input."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from rayfuse.config import parse_overrides
from rayfuse.errors import InputError, RunFailure
from rayfuse.federation import Update
from rayfuse.fusion import METHODS
from rayfuse.fusion.fedavg.fedopt import FedAdagrad, FedAdam, FedYogi
from rayfuse.fusion.fedref.algorithm import FedRef, fedref_step, reference_model
from rayfuse.io import load_params
from rayfuse.method import resolve_methods
from rayfuse.models import params_equal
from rayfuse.rounds import decode_state, encode_state
from rayfuse.runner import InProcessBackend, load_run_config, run_experiment


def params_of(cls, **kw):
    return cls.Params.model_validate(kw)


X0 = {"w": np.array([1.0, -2.0], np.float32)}
D1 = np.array([0.5, -0.1])  # pseudo-gradient of round 1
D2 = np.array([0.1, 0.2])  # and of round 2


def two_steps(cls, **kw):
    """Two server steps; returns the two models and the round state (the moments)."""
    method = cls(params_of(cls, eta=0.1, beta1=kw.pop("beta1", 0.9), beta2=0.99, tau=1e-3, **kw))
    state = method.initial_state(X0)
    x1 = state.params = method.server_update(None, state, {"w": (X0["w"] + D1).astype(np.float32)}, {}, 1)
    x2 = state.params = method.server_update(None, state, {"w": (x1["w"] + D2).astype(np.float32)}, {}, 2)
    return x1["w"], x2["w"], state


# ---------------------------------------------------------------------------------------------------------------
# FedOpt: hand-computed steps (eta = 0.1, beta1 = 0.9, beta2 = 0.99, tau = 1e-3, m_0 = v_0 = 0)


def test_fedadam_matches_a_hand_computed_step():
    x1, x2, _ = two_steps(FedAdam)
    # m1 = 0.1 * D1 = [0.05, -0.01]; v1 = 0.01 * D1^2 = [0.0025, 0.0001]; sqrt(v1) = [0.05, 0.01]
    np.testing.assert_allclose(x1, [1.0 + 0.1 * 0.05 / 0.051, -2.0 - 0.1 * 0.01 / 0.011], rtol=1e-6)
    # m2 = 0.9 m1 + 0.1 D2 = [0.055, 0.011]; v2 = 0.99 v1 + 0.01 D2^2 = [0.002575, 0.000499]
    np.testing.assert_allclose(x2, x1 + 0.1 * np.array([0.055, 0.011]) / (np.sqrt([0.002575, 0.000499]) + 1e-3), rtol=1e-5)


def test_fedyogi_matches_a_hand_computed_step():
    x1, x2, _ = two_steps(FedYogi)
    # v1 = 0 - 0.01 D1^2 sign(0 - D1^2) = +0.01 D1^2: the same first step as FedAdam
    np.testing.assert_allclose(x1, [1.0 + 0.1 * 0.05 / 0.051, -2.0 - 0.1 * 0.01 / 0.011], rtol=1e-6)
    # v2 = v1 - 0.01 D2^2 sign(v1 - D2^2) = [0.0025 + 0.0001, 0.0001 + 0.0004]: Yogi grows v additively
    np.testing.assert_allclose(x2, x1 + 0.1 * np.array([0.055, 0.011]) / (np.sqrt([0.0026, 0.0005]) + 1e-3), rtol=1e-5)


def test_fedadagrad_matches_a_hand_computed_step():
    x1, x2, state = two_steps(FedAdagrad, beta1=0.0)
    # m = D (beta1 = 0); v1 = D1^2 = [0.25, 0.01]; v2 = v1 + D2^2 = [0.26, 0.05]
    np.testing.assert_allclose(x1, [1.0 + 0.1 * 0.5 / 0.501, -2.0 - 0.1 * 0.1 / 0.101], rtol=1e-6)
    np.testing.assert_allclose(x2, x1 + 0.1 * D2 / (np.sqrt([0.26, 0.05]) + 1e-3), rtol=1e-5)
    np.testing.assert_allclose(state.v["w"], [0.26, 0.05], rtol=1e-5)


def test_fedadam_bias_correction_scales_the_first_step():
    plain, _, _ = two_steps(FedAdam)
    corrected, _, _ = two_steps(FedAdam, bias_correction=True)
    scale = np.sqrt(1 - 0.99) / (1 - 0.9)  # t = 1
    np.testing.assert_allclose(corrected - X0["w"], scale * (plain - X0["w"]), rtol=1e-5)


def test_fedopt_state_round_trips():
    _, _, state = two_steps(FedYogi)
    restored = decode_state(FedYogi().initial_state({}), *encode_state(state))
    assert restored.steps == 2
    for key in state.m:
        np.testing.assert_array_equal(restored.m[key], state.m[key])
        np.testing.assert_array_equal(restored.v[key], state.v[key])


def test_fedadagrad_refuses_bias_correction():
    with pytest.raises(Exception, match="bias_correction"):
        FedAdagrad.Params.model_validate({"bias_correction": True})


# ---------------------------------------------------------------------------------------------------------------
# FedRef: the reference model, the schedule and the two update forms


def random_params(rng):
    return {"a": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}


def updates_with_losses(losses):
    return {i: Update({}, 10, {"train_loss": float(loss)}) for i, loss in enumerate(losses)}


def drive(method, rounds, seed=0):
    """Feed ``rounds`` random aggregates to FedRef's server step; return (aggregates, outputs, references, round state)."""
    rng = np.random.default_rng(seed)
    aggregates, outputs, references = [], [], []
    state = method.initial_state(random_params(rng))
    for r in range(1, rounds + 1):
        averaged = random_params(rng)
        out = method.server_update(None, state, averaged, updates_with_losses(rng.uniform(0.1, 2.0, size=4)), r)
        aggregates.append(averaged)
        outputs.append(out)
        references.append(state.theta2_prev)
        state.params = out
    return aggregates, outputs, references, state


@pytest.mark.parametrize("p", [1, 3, 5])
def test_reference_model_is_the_mean_of_the_last_p_aggregates(p):
    method = FedRef(params_of(FedRef, p=p, lam=0.1, lr=0.01))
    aggregates, _, references, state = drive(method, p + 4)
    for r in range(1, p + 5):
        if r <= p:
            assert references[r - 1] is None  # the first reference is formed in round p + 1
            continue
        window = aggregates[r - p : r]
        for key in window[0]:
            np.testing.assert_allclose(references[r - 1][key], np.mean([w[key] for w in window], axis=0), rtol=1e-6, atol=1e-7)
    assert len(state.queue) == p
    np.testing.assert_array_equal(reference_model([aggregates[0]])["a"], aggregates[0]["a"])


@pytest.mark.parametrize("form", ["code", "grad"])
def test_the_first_p_plus_one_rounds_are_plain_fedavg(form):
    p = 3
    method = FedRef(params_of(FedRef, p=p, lam=0.1, lr=0.05, update=form))
    aggregates, outputs, _, _ = drive(method, p + 3)
    for r in range(1, p + 2):
        assert params_equal(outputs[r - 1], aggregates[r - 1]), f"round {r} must be the FedAvg aggregate"
    for r in range(p + 2, p + 4):
        assert not params_equal(outputs[r - 1], aggregates[r - 1]), f"round {r} must be fine-tuned"


def test_gradient_form_with_lambda_zero_is_fedavg_every_round():
    method = FedRef(params_of(FedRef, p=2, lam=0.0, lr=0.05, update="grad"))
    aggregates, outputs, _, _ = drive(method, 7)
    assert all(params_equal(o, a) for o, a in zip(outputs, aggregates))


def test_code_form_by_hand():
    p, lam, lr = 2, 0.5, 0.1
    method = FedRef(params_of(FedRef, p=p, lam=lam, lr=lr))
    aggs = [{"w": np.array([v], np.float32)} for v in (1.0, 3.0, 2.0, 6.0)]
    losses = [[1.0, 1.0], [0.8, 0.6], [0.6, 0.4], [0.4, 0.2]]
    state = method.initial_state(aggs[0])
    out = [method.server_update(None, state, a, updates_with_losses(loss), r + 1) for r, (a, loss) in enumerate(zip(aggs, losses))]
    # rounds 1-3 (p + 1) are the aggregates; the first reference (round 3) is mean(3, 2) = 2.5
    assert [float(o["w"][0]) for o in out[:3]] == [1.0, 3.0, 2.0]
    # round 4: theta2 = mean(2, 6) = 4; D1 = 6 - 2 = 4 (the pre-fine-tuning aggregate), D2 = 4 - 2.5 = 1.5; c_loss = -0.2
    np.testing.assert_allclose(out[3]["w"], 6.0 - lr * (-0.2 + lam * 4.0 + lam * 1.5), rtol=1e-6)
    # the gradient form: theta1 - lr (2 lam D1 + 2 lam / p D2)
    grad = fedref_step("grad", aggs[3], aggs[2], {"w": np.array([4.0])}, {"w": np.array([2.5])}, c_loss=-0.2, lam=lam, lr=lr, p=p)
    np.testing.assert_allclose(grad["w"], 6.0 - lr * (2 * lam * 4.0 + lam * 1.5), rtol=1e-6)


def test_fedref_state_round_trips_mid_run():
    method = FedRef(params_of(FedRef, p=3, lam=0.1, lr=0.05))
    *_, state = drive(method, 5)
    restored = decode_state(method.initial_state({}), *encode_state(state))
    assert len(restored.queue) == 3 and restored.loss_prev == state.loss_prev
    assert all(params_equal(a, b) for a, b in zip(restored.queue, state.queue))
    assert params_equal(restored.queue[-1], state.queue[-1]) and params_equal(restored.theta2_prev, state.theta2_prev)


# ---------------------------------------------------------------------------------------------------------------
# End to end on in-process clients


def test_fedref_grad_lambda_zero_equals_fedavg_end_to_end(coordinator):
    # Same label -> the same per-round client seeds.
    a = coordinator(methods={"fl": {"method": "fedavg", "rounds": 4, "local_epochs": 1}})
    b = coordinator(methods={"fl": {"method": "fedref", "update": "grad", "lam": 0.0, "p": 1, "rounds": 4, "local_epochs": 1}})
    sa, sb = a.run_method("fl"), b.run_method("fl")
    assert params_equal(load_params(a.store.root / sa["model_file"]), load_params(b.store.root / sb["model_file"]))
    tuned = [r["value"] for r in sb["history"] if r["metric"] == "fine_tuned"]
    assert tuned == [0.0, 0.0, 1.0, 1.0]  # p = 1: rounds 1-2 plain, the step (a no-op at lambda 0) from round 3


def test_every_fedopt_rule_and_fedref_runs_and_logs_client_compute(coordinator):
    methods = {name: {"rounds": 2, "local_epochs": 1} for name in ("fedadagrad", "fedadam", "fedyogi")}
    methods["fedref"] = {"rounds": 3, "local_epochs": 1, "p": 1, "client_loss": "eval"}
    coord = coordinator(methods=methods)
    for label in methods:
        summary = coord.run_method(label)
        assert 0.0 <= summary["metrics"]["accuracy"] <= 1.0
        seconds = [r["value"] for r in summary["history"] if r["metric"] == "client_seconds"]
        assert len(seconds) == methods[label]["rounds"] and all(s > 0 for s in seconds)


def run(cfg, run_dir, resume=False):
    return run_experiment(cfg, InProcessBackend(), run_dir, resume=resume, printer=lambda e: None, show_tables=False)


@pytest.mark.parametrize("method,extra", [("fedref", {"p": 2, "lam": 0.05}), ("fedadam", {})])
def test_resume_mid_run_reproduces_the_uninterrupted_run(make_config, tmp_path, method, extra):
    methods = {method: {"rounds": 5, "local_epochs": 1, **extra}}
    straight = run(make_config(methods=methods), tmp_path / "straight")
    # Round 5 fails: the run stops after checkpointing round 4 (FedRef p = 2 has fine-tuned in round 4 already).
    crash = {"on_client_failure": "fail", "faults": [{"client": 2, "step": "fedavg.fit", "call": 5, "mode": "raise"}]}
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RunFailure):
        run(make_config(methods=methods, federation=crash), interrupted)
    assert json.loads((interrupted / "checkpoints" / method / "latest.json").read_text())["round"] == 4
    cfg = load_run_config(interrupted, parse_overrides(["federation.faults=[]", "federation.on_client_failure=retry"]))
    resumed = run(cfg, interrupted, resume=True)
    assert any(e["kind"] == "resumed" and e["round"] == 4 for e in resumed["events"])
    assert params_equal(
        load_params(interrupted / "models" / f"{method}.safetensors"),
        load_params(tmp_path / "straight" / "models" / f"{method}.safetensors"),
    )
    assert resumed["methods"][method]["accuracy"] == straight["methods"][method]["accuracy"]


def test_a_client_reporting_a_nan_loss_is_rejected_and_recorded(make_config, tmp_path):
    cfg = make_config(
        methods={"fedref": {"rounds": 4, "local_epochs": 1, "p": 1}},
        federation={"faults": [{"client": 1, "step": "fedavg.fit", "call": 3, "mode": "nan_metrics"}]},
    )
    results = run(cfg, tmp_path / "nanloss")
    rejected = [e for e in results["events"] if e["kind"] == "update_rejected"]
    assert [e["client"] for e in rejected] == [1] and "train_loss" in rejected[0]["message"]
    assert results["status"] == "succeeded"
    history = json.loads((tmp_path / "nanloss" / "state" / "fedref.json").read_text())["history"]
    assert [r["value"] for r in history if r["metric"] == "clients"] == [4.0, 4.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "entry,path",
    [
        ({"p": 0}, "methods.fedref.p"),
        ({"lam": -0.1}, "methods.fedref.lam"),
        ({"update": "adam"}, "methods.fedref.update"),
        ({"server_lr": 0}, "methods.fedref.server_lr"),
    ],
)
def test_bad_fedref_parameters_name_the_key(make_config, entry, path):
    with pytest.raises(InputError) as err:
        resolve_methods(make_config(methods={"fedref": entry}).methods)
    assert err.value.path == path


@pytest.mark.parametrize(
    "entry,path", [({"tau": 0}, "methods.fedadam.tau"), ({"beta2": 1.0}, "methods.fedadam.beta2"), ({"eta": -1}, "methods.fedadam.eta")]
)
def test_bad_fedopt_parameters_name_the_key(make_config, entry, path):
    with pytest.raises(InputError) as err:
        resolve_methods(make_config(methods={"fedadam": entry}).methods)
    assert err.value.path == path


def test_registry_has_the_new_methods():
    assert {"fedadagrad", "fedadam", "fedyogi", "fedref"} <= set(METHODS.names())
    assert all(METHODS.get(n).tags.multi_round for n in ("fedadagrad", "fedadam", "fedyogi", "fedref"))


def test_the_fedavg_familys_tags_are_their_papers():
    """Rounds that average the weights of the cohort each round trains (central DP's precondition; a sum, so secure
    aggregation applies); FedRef's server step reads each client's loss, which neither DP-FedAvg's noise nor a secure
    sum covers: its tags are FedAvg's but for that."""
    for name in ("fedavg", "fedprox", "fedadagrad", "fedadam", "fedyogi", "fedref"):
        tags = METHODS.get(name).tags
        assert tags.fuses == "parameters" and tags.multi_round and tags.cohort and tags.federated_evaluation, name
        assert not (tags.oracle or tags.uses_local_models or tags.local_model_only or tags.heterogeneous_clients), name
        assert bool(tags.no_dp) is (name == "fedref") and tags.sums is (name != "fedref"), name
    fedref = METHODS.get("fedref").tags
    assert fedref == dataclasses.replace(METHODS.get("fedavg").tags, no_dp=fedref.no_dp, sums=False)
