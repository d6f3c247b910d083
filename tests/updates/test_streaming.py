"""Streaming aggregation and per-actor partial sums (rayfuse/updates/streaming.py, ``UpdatePipeline.collect_round``):
the same aggregate as the gathered path within float rounding, for the rules that are a sum; the rules that are not
still get every update; rejected replies are never folded; the failure policy applies; the memory refusal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rayfuse.client import Client
from rayfuse.coordinator import Coordinator, MethodServer
from rayfuse.errors import InputError, RunFailure
from rayfuse.federation import EventLog, FailurePolicy, Folded, InProcessFederation, reduce_replies
from rayfuse.method import Update, client_step, resolve_methods
from rayfuse.runner import prepare_run
from rayfuse.updates.aggregate import weighted_average
from rayfuse.updates.pipeline import check_aggregation, check_round_memory, round_memory
from rayfuse.updates.streaming import SMALL_TENSOR, PartialSum, RoundFold, RunningSum, nonfinite

# a first layer of 64 x 1100 = 70400 values: above SMALL_TENSOR, so the float32 running sum is exercised
MODEL = {"name": "mlp", "hidden": [1100]}
DP = {"noise_multiplier": 0.8, "clip_norm": 1.5, "sample_rate": 1.0}


@client_step("test.synthetic_update")
def synthetic_update(
    ctx: Any, global_params: dict[str, np.ndarray], *, seed: int, bad: tuple[int, ...] = (), fail: tuple[int, ...] = ()
) -> Update:
    """The broadcast model plus a seeded update of norm a few units (a NaN in it for clients in ``bad``)."""
    if ctx.client_id in fail:
        raise RuntimeError("injected failure")
    rng = np.random.default_rng(1000 * seed + ctx.client_id)
    params = {k: (v + rng.normal(scale=0.02, size=v.shape)).astype(v.dtype) for k, v in global_params.items()}
    if ctx.client_id in bad:
        next(iter(params.values())).reshape(-1)[3] = np.nan
    return Update(params, ctx.num_examples, {"train_loss": float(rng.random())})


def coordinator(
    make_config, tmp_path: Path, *, per_process: int = 1, policy: dict[str, Any] | None = None, method: dict[str, Any]
) -> Coordinator:
    """A coordinator over in-process clients grouped ``per_process`` to a process (as actors group them on Ray)."""
    cfg = make_config(model=MODEL, federation={"backend": "local", **(policy or {})}, methods={"fl": {"method": "fedavg", **method}})
    prepared = prepare_run(cfg)
    plan = prepared.plan

    def factory(i: int, restarted: bool) -> Client:
        return Client(i, plan.for_client(i), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=0, restarted=restarted)

    fed = InProcessFederation(
        factory, plan.num_clients, FailurePolicy.from_config(cfg.federation), EventLog(), clients_per_process=per_process
    )
    return Coordinator(cfg, plan, str(tmp_path / f"run-{per_process}"), fed, specs=prepared.specs)


def one_round(coord: Coordinator, *, streaming: bool, aggregation: str | None = None, weighted: bool = True, **step: Any):
    """One round through ``collect_round``; records on ``coord.arrived`` the type of every value the stream handed
    the pipeline (an Update per client flat, a PartialSum per process per_actor)."""
    fed = coord.federation
    stream = fed.stream
    coord.arrived = []  # type: ignore[attr-defined]

    def recording(calls: Any) -> Any:
        replies = stream(calls)

        class Recorded:
            failures = property(lambda self: replies.failures)

            def __iter__(self):
                for client, value in replies:
                    coord.arrived.append(type(value).__name__)  # type: ignore[attr-defined]
                    yield client, value

        return Recorded()

    fed.stream = recording  # type: ignore[method-assign]
    spec = next(s for s in resolve_methods(coord.cfg.methods) if s.label == "fl")
    server = MethodServer(coord, spec, resume=False)
    pipeline = server.updates
    pipeline.streaming = streaming
    pipeline.aggregation = aggregation  # type: ignore[assignment]
    pipeline._per_actor = getattr(coord.federation, "_per_process", 1)  # type: ignore[attr-defined]
    pipeline.rounds(1)
    reference = coord.reference_params()
    clients = pipeline.cohort(1)
    result = pipeline.collect_round(synthetic_update, reference, clients, 1, weighted=weighted, step_kwargs={"seed": 7, **step})
    return result, pipeline, coord


def modes(coord: Coordinator) -> list[str]:
    return [e["mode"] for e in coord.events.since(0) if e["kind"] == "aggregation"]


def assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Equal within float32 rounding of a sum of 4 models (a few ulps of the values); returns the largest gap."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
        assert np.isfinite(a[key]).all()
        np.testing.assert_allclose(a[key], b[key], rtol=2e-6, atol=2e-7)
        worst = max(worst, float(np.max(np.abs(a[key].astype(np.float64) - b[key]))))
    return worst


METHODS = {
    "weighted mean": {},
    "mean": {"weighted": False},
    "clipped mean": {"aggregator": {"name": "mean", "clip_norm": 0.5}},
}


@pytest.mark.parametrize("name", list(METHODS))
def test_streaming_and_per_actor_sums_equal_the_gathered_aggregate(make_config, tmp_path, name):
    method = METHODS[name]
    weighted = method.get("weighted", True)
    gathered, _, _ = one_round(coordinator(make_config, tmp_path, method=method), streaming=False, weighted=weighted)
    streamed, _, flat_coord = one_round(coordinator(make_config, tmp_path, method=method), streaming=True, weighted=weighted)
    partial, _, actor_coord = one_round(coordinator(make_config, tmp_path, per_process=2, method=method), streaming=True, weighted=weighted)
    assert modes(flat_coord) == ["flat"] and modes(actor_coord) == ["per_actor"]
    assert flat_coord.arrived == ["Update"] * 4 and actor_coord.arrived == ["PartialSum"] * 2  # one per process of 2 clients
    assert assert_close(streamed.params, gathered.params) < 1e-6
    assert assert_close(partial.params, gathered.params) < 1e-6
    # the same clients, counts and metrics; a streamed round keeps no client's parameters
    for result in (streamed, partial):
        assert list(result.updates) == list(gathered.updates) == [0, 1, 2, 3]
        assert all(result.updates[c].params == {} for c in result.updates)
        assert [u.num_examples for u in result.updates.values()] == [u.num_examples for u in gathered.updates.values()]
        assert [u.metrics for u in result.updates.values()] == [u.metrics for u in gathered.updates.values()]


@pytest.mark.parametrize("adaptive", [False, True])
def test_central_dp_streamed_and_per_actor_equal_the_gathered_round_with_the_same_noise_seed(make_config, tmp_path, adaptive):
    dp = {**DP, **({"adaptive": {"target_quantile": 0.5, "lr": 0.2, "count_stddev": 1.0}} if adaptive else {})}
    method = {"dp": dp, "weighted": False}
    gathered, gp, _ = one_round(coordinator(make_config, tmp_path, method=method), streaming=False, weighted=False)
    streamed, sp, _ = one_round(coordinator(make_config, tmp_path, method=method), streaming=True, weighted=False)
    partial, pp, actor_coord = one_round(coordinator(make_config, tmp_path, per_process=2, method=method), streaming=True, weighted=False)
    assert actor_coord.arrived == ["PartialSum"] * 2  # clipped per client in the process; the noise added once, here
    for result, pipeline in ((streamed, sp), (partial, pp)):
        assert assert_close(result.params, gathered.params) < 1e-6
        assert result.metrics == gathered.metrics  # dp_clip_norm, the noised unclipped fraction, epsilon
        assert pipeline.state() == gp.state()  # adaptive clipping's next C
    assert gathered.metrics["dp_epsilon"] > 0


def test_a_robust_rule_still_gets_every_update(make_config, tmp_path):
    method = {"aggregator": {"name": "median"}}
    result, _, coord = one_round(coordinator(make_config, tmp_path, per_process=2, method=method), streaming=True)
    assert modes(coord) == ["gathered"]
    reasons = [e["message"] for e in coord.events.since(0) if e["kind"] == "aggregation"]
    assert "needs every update at once" in reasons[0]
    assert all(u.params for u in result.updates.values())  # the rule received every model
    stacked = np.stack([u.params["layers.0.weight"] for u in result.updates.values()])
    np.testing.assert_array_equal(result.params["layers.0.weight"], np.median(stacked, axis=0).astype(np.float32))


@pytest.mark.parametrize("per_process", [1, 2])
def test_a_rejected_reply_is_recorded_and_not_folded(make_config, tmp_path, per_process):
    coord = coordinator(make_config, tmp_path, per_process=per_process, method={})
    result, _, coord = one_round(coord, streaming=True, bad=(2,))
    assert coord.arrived == (["Update"] * 4 if per_process == 1 else ["PartialSum"] * 2)  # client 2 rejected in its process
    assert list(result.updates) == [0, 1, 3]
    rejected = [(e["client"], e["message"]) for e in coord.events.since(0) if e["kind"] == "update_rejected"]
    assert [c for c, _ in rejected] == [2] and "NaN" in rejected[0][1]
    gathered, _, _ = one_round(coordinator(make_config, tmp_path, method={}), streaming=False, bad=(2,))
    assert list(gathered.updates) == [0, 1, 3]
    assert assert_close(result.params, gathered.params) < 1e-6


@pytest.mark.parametrize("per_process", [1, 2])
def test_the_failure_policy_applies_to_a_streamed_round(make_config, tmp_path, per_process):
    drop = {"on_client_failure": "drop"}
    result, _, coord = one_round(
        coordinator(make_config, tmp_path, per_process=per_process, policy=drop, method={}), streaming=True, fail=(1,)
    )
    assert list(result.updates) == [0, 2, 3]
    assert coord.arrived == (["Update"] * 3 if per_process == 1 else ["PartialSum"] * 2)
    assert [e["client"] for e in coord.events.since(0) if e["kind"] == "client_dropped"] == [1]
    expected = weighted_average(
        [synthetic_update(_Ctx(coord, c), coord.reference_params(), seed=7).params for c in (0, 2, 3)],
        [coord.plan.num_examples(c) for c in (0, 2, 3)],
    )
    assert assert_close(result.params, expected) < 1e-6
    with pytest.raises(RunFailure, match="only 3 of 4 clients"):
        one_round(
            coordinator(make_config, tmp_path, per_process=per_process, policy={**drop, "min_clients": 4}, method={}),
            streaming=True,
            fail=(1,),
        )
    with pytest.raises(RunFailure, match="client 1 failed"):
        one_round(
            coordinator(make_config, tmp_path, per_process=per_process, policy={"on_client_failure": "fail"}, method={}),
            streaming=True,
            fail=(1,),
        )


class _Ctx:
    def __init__(self, coord: Coordinator, client: int) -> None:
        self.client_id = client
        self.num_examples = coord.plan.num_examples(client)


def test_reduce_replies_folds_a_process_replies_into_one_and_keeps_failures_per_client():
    fold = RoundFold("mean", True, {5: 2, 6: 3, 7: 1}, None)
    ref = {"w": np.zeros(3, np.float32)}
    updates = {5: Update({"w": np.full(3, 1.0, np.float32)}, 2), 7: Update({"w": np.full(3, 4.0, np.float32)}, 1)}
    outcomes = [(5, True, updates[5], (ref,)), (6, False, "RuntimeError: boom", (ref,)), (7, True, updates[7], (ref,))]
    out = reduce_replies(fold, iter(outcomes))
    assert out[1] == (False, "RuntimeError: boom") and out[2] == (True, Folded(5))
    partial = out[0][1]
    assert isinstance(partial, PartialSum) and partial.weight == 3.0 and sorted(partial.clients) == [5, 7]
    np.testing.assert_allclose(partial.total["w"], 2 * 1.0 + 1 * 4.0)


def test_the_float32_running_sum_stays_within_float_rounding_of_the_float64_sum():
    rng = np.random.default_rng(0)
    models = [
        {"big": rng.normal(size=4 * SMALL_TENSOR).astype(np.float32), "small": rng.normal(size=10).astype(np.float32)} for _ in range(50)
    ]
    weights = rng.integers(10, 500, size=50).astype(float)
    total = RunningSum(models[0], "mean", None)
    for model, w in zip(models, weights):
        total.add(model, float(w))
    assert total.total["big"].dtype == np.float32 and total.total["small"].dtype == np.float64  # 1 x the model, not 2 x
    mean = total.mean()
    exact = sum(w * m["big"].astype(np.float64) for m, w in zip(models, weights)) / weights.sum()
    gathered = weighted_average(models, list(weights))["big"]
    # both float32 sums are within a few ulps (times K) of the exact mean, and of each other
    scale = float(np.abs(exact).max())
    assert float(np.abs(mean["big"] - exact).max()) < 50 * np.finfo(np.float32).eps * scale
    assert float(np.abs(mean["big"] - gathered).max()) < 50 * np.finfo(np.float32).eps * scale


def test_a_gathered_aggregation_that_does_not_fit_the_coordinator_is_refused_before_start(make_config, tmp_path):
    cfg = make_config(model=MODEL, federation={"backend": "local", "streaming": False}, methods={"fl": {"method": "fedavg"}})
    specs = resolve_methods(cfg.methods)
    params = 64 * 1100 + 1100 + 1100 * 10 + 10
    bound, what = round_memory(specs[0], cfg.federation, 4, 4 * params)
    assert bound == 6 * 4 * params and what == "gathered: 4 updates"
    refused = r"^federation\.streaming: expected an aggregation within the coordinator's memory .*, got '1.9 MiB \(gathered: 4 updates\)'"
    with pytest.raises(InputError, match=refused + r"; set federation\.streaming: true"):
        check_round_memory(specs, cfg.federation, 4, params, available=5 * 4 * params)
    streamed = make_config(model=MODEL, federation={"backend": "local"}, methods={"fl": {"method": "fedavg"}})
    check_round_memory(resolve_methods(streamed.methods), streamed.federation, 4, params, available=5 * 4 * params)  # 3 x fits
    robust = make_config(
        model=MODEL,
        federation={"backend": "local", "coordinator": {"memory": 4 * params * 4}},
        methods={"fl": {"method": "fedavg", "aggregator": {"name": "median"}}},
    )
    with pytest.raises(InputError, match=r"^methods\.fl\.aggregator: .*federation\.coordinator\.memory"):
        check_round_memory(resolve_methods(robust.methods), robust.federation, 4, params)


def test_an_explicit_per_actor_with_a_rule_that_is_not_a_sum_is_refused_in_one_line(make_config):
    cfg = make_config(
        federation={"backend": "local", "clients_per_actor": 2, "aggregation": "per_actor"},
        methods={"fl": {"method": "fedavg", "aggregator": {"name": "krum", "f": 0}}},
    )
    with pytest.raises(InputError, match=r"^federation\.aggregation: expected flat or unset with methods\.fl\.aggregator 'krum'"):
        check_aggregation(resolve_methods(cfg.methods), cfg.federation)
    with pytest.raises(Exception, match="per_actor only with clients_per_actor > 1"):
        make_config(federation={"backend": "local", "aggregation": "per_actor"})


def test_the_finiteness_screen_finds_nan_and_inf_and_passes_large_finite_values():
    big = np.full(1000, 3e30, np.float32)  # its squares overflow the dot product: the value-by-value check decides
    assert nonfinite({"a": np.ones(10, np.float32), "b": big, "c": np.arange(5)}) is None
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(100_000, np.float32)
        x[77_777] = bad
        assert nonfinite({"a": np.ones(3), "b": x}) == "b: NaN or Inf values"
    assert nonfinite({"h": np.array([1.0, np.nan], np.float16)}) == "h: NaN or Inf values"
