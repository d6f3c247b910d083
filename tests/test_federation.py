"""The federation abstraction: gathering, failure policies, restarts, timeouts, broadcasts, privacy guard."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from rayfuse.client import Client, PrivacyError
from rayfuse.config import FaultSpec
from rayfuse.data.roles import load_dataset_from_config, make_plan
from rayfuse.errors import RunFailure
from rayfuse.federation import ClientDied, EventLog, FailurePolicy, InProcessFederation, Update, client_step, step_name


class FakeClient:
    """Runs steps against a tiny context; ``plan`` maps client id -> list of outcomes per call ("ok", "raise", "die")."""

    def __init__(self, client_id: int, plan: dict[int, list[str]], calls: Counter, restarted: bool = False) -> None:
        self.client_id = client_id
        self.plan = plan
        self.calls = calls
        self.restarted = restarted

    def run(self, step, *args, **kwargs):
        n = self.calls[self.client_id]
        self.calls[self.client_id] += 1
        script = self.plan.get(self.client_id, [])
        outcome = script[n] if n < len(script) else "ok"
        if outcome == "raise":
            raise ValueError(f"boom on client {self.client_id}")
        if outcome == "die":
            raise ClientDied(f"client {self.client_id} died")
        return step(self, *args, **kwargs)


@client_step("test.echo")
def echo(ctx, value=0):
    return (ctx.client_id, value)


def make_federation(plan=None, *, policy="retry", max_retries=2, min_clients=1, max_restarts=2, n=4, timeout_s=None):
    calls: Counter = Counter()
    created: list[tuple[int, bool]] = []

    def factory(i, restarted):
        created.append((i, restarted))
        return FakeClient(i, plan or {}, calls, restarted)

    fed = InProcessFederation(factory, n, FailurePolicy(policy, max_retries, min_clients, timeout_s), EventLog(), max_restarts=max_restarts)
    return fed, calls, created


def kinds(fed):
    return [e["kind"] for e in fed.events.since(0)]


def test_gather_returns_every_client_in_order():
    fed, _, _ = make_federation()
    gathered = fed.run(echo, value=7)
    assert gathered.clients == [0, 1, 2, 3]
    assert gathered.values() == [(0, 7), (1, 7), (2, 7), (3, 7)]
    assert gathered.failures == []


def test_map_on_selected_clients_only():
    fed, calls, _ = make_federation()
    gathered = fed.run(echo, clients=[2, 0])
    assert gathered.clients == [0, 2]
    assert calls == Counter({0: 1, 2: 1})


def test_map_rejects_unknown_client_ids():
    fed, _, _ = make_federation()
    with pytest.raises(ValueError, match="unknown client ids"):
        fed.map(echo, clients=[9])


def test_retry_resubmits_a_failed_call_and_records_it():
    fed, calls, _ = make_federation({1: ["raise"]}, policy="retry")
    gathered = fed.run(echo)
    assert gathered.clients == [0, 1, 2, 3]
    assert calls[1] == 2
    assert kinds(fed) == ["client_failed", "client_retry"]
    assert fed.events.since(0)[0]["client"] == 1


def test_retry_gives_up_after_max_retries():
    fed, calls, _ = make_federation({2: ["raise", "raise", "raise"]}, policy="retry", max_retries=2)
    with pytest.raises(RunFailure, match=r"client 2 failed in step test.echo after 3 attempts"):
        fed.run(echo)
    assert calls[2] == 3


def test_drop_leaves_the_client_out_and_records_it():
    fed, _, _ = make_federation({3: ["raise"]}, policy="drop")
    gathered = fed.run(echo)
    assert gathered.clients == [0, 1, 2]
    assert [f.client for f in gathered.failures] == [3]
    assert gathered.failures[0].kind == "error"
    assert "boom on client 3" in gathered.failures[0].message
    assert "client_dropped" in kinds(fed)


def test_drop_fails_the_run_below_the_quorum():
    fed, _, _ = make_federation({0: ["raise"], 1: ["raise"], 2: ["raise"]}, policy="drop", min_clients=2)
    with pytest.raises(RunFailure, match=r"only 1 of 4 clients.*min_clients = 2"):
        fed.run(echo)


def test_fail_policy_fails_on_the_first_error():
    fed, _, _ = make_federation({1: ["raise"]}, policy="fail")
    with pytest.raises(RunFailure, match=r"client 1 failed in step test.echo \(error\).*on_client_failure = fail"):
        fed.run(echo)


def test_a_dead_client_is_restarted_then_retried():
    fed, calls, created = make_federation({1: ["die"]}, policy="retry")
    gathered = fed.run(echo)
    assert gathered.clients == [0, 1, 2, 3]
    assert (1, True) in created  # rebuilt like Ray restarts an actor
    assert "client_restarted" in kinds(fed)


def test_a_client_without_restarts_left_stays_dead():
    fed, _, _ = make_federation({1: ["die", "die"]}, policy="drop", max_restarts=0)
    first = fed.run(echo)
    second = fed.run(echo)
    assert 1 not in first.clients and 1 not in second.clients
    assert second.failures[0].kind == "died"
    assert "client_dead" in kinds(fed)


def test_timeouts_are_not_retried():
    @client_step("test.slow")
    def slow(ctx):
        if ctx.client_id == 0:
            time.sleep(0.3)
        return ctx.client_id

    fed, calls, _ = make_federation(policy="retry", timeout_s=0.1)
    with pytest.raises(RunFailure, match=r"client 0 failed in step test.slow \(timeout\)"):
        fed.run(slow)
    assert calls[0] == 1


def test_broadcast_is_read_only_like_the_object_store():
    @client_step("test.mutate")
    def mutate(ctx, params):
        params["w"] += 1.0
        return 0

    fed, _, _ = make_federation(policy="drop", min_clients=1, n=1)
    original = {"w": np.zeros(3)}
    ref = fed.put(original)
    with pytest.raises(RunFailure):
        fed.run(mutate, ref)
    assert not ref["w"].flags.writeable
    np.testing.assert_array_equal(original["w"], 0.0)


def test_parallel_map_keeps_order():
    fed, _, _ = make_federation()
    assert fed.parallel_map(lambda x: x * x, list(range(50))) == [x * x for x in range(50)]
    assert fed.parallel_map(lambda x: x, []) == []


def test_step_names():
    assert step_name(echo) == "test.echo"
    assert step_name(make_federation).endswith("make_federation")


# ---------------------------------------------------------------------------------------------------------------
# The real Client: shards, faults, and the raw-data guard


@pytest.fixture(scope="module")
def digits_plan():
    from rayfuse.config import validate_config

    cfg = validate_config({"partition": {"method": "iid", "num_clients": 3}, "model": {"hidden": [8]}, "train": {"epochs": 1}})
    return cfg, make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)


def make_client(cfg, plan, client_id=0, faults=()):
    return Client(
        client_id, plan.for_client(client_id), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=cfg.run.seed, faults=faults
    )


def test_client_loads_only_its_own_shard(digits_plan):
    cfg, plan = digits_plan
    client = make_client(cfg, plan, 1)
    assert len(client.ctx.train) == len(plan.client_train[1])
    assert len(client.ctx.val) == len(plan.client_val[1])
    dataset = load_dataset_from_config(cfg.data)
    np.testing.assert_array_equal(client.ctx.train.y, dataset.y[plan.client_train[1]])


@pytest.mark.parametrize("returns", ["X", "y", "view", "nested"])
def test_client_refuses_to_return_raw_data(digits_plan, returns):
    cfg, plan = digits_plan
    client = make_client(cfg, plan)

    @client_step("test.leak")
    def leak(ctx):
        return {
            "X": ctx.train.X,
            "y": ctx.train.y.copy(),
            "view": ctx.train.X[:5],
            "nested": Update({"w": ctx.val.X.copy()}, 1),
        }[returns]

    with pytest.raises(PrivacyError, match="raw data"):
        client.run(leak)


def test_client_returns_summaries(digits_plan):
    cfg, plan = digits_plan
    client = make_client(cfg, plan)

    @client_step("test.summary")
    def summary(ctx):
        return {"counts": np.bincount(ctx.train.y, minlength=10), "mean": ctx.train.X.mean(axis=0)}

    out = client.run(summary)
    assert out["counts"].sum() == len(plan.client_train[0])


@pytest.mark.parametrize("mode", ["raise", "exit", "nan"])
def test_injected_faults_fire_on_the_named_call_only(digits_plan, mode):
    cfg, plan = digits_plan
    fault = FaultSpec(client=0, step="test.params", call=2, mode=mode)
    client = make_client(cfg, plan, faults=[fault])

    @client_step("test.params")
    def params(ctx):
        return Update({"w": np.ones(3, np.float32)}, ctx.num_examples)

    assert np.isfinite(client.run(params).params["w"]).all()
    if mode == "nan":
        assert np.isnan(client.run(params).params["w"]).all()
    else:
        with pytest.raises(ClientDied if mode == "exit" else RuntimeError, match="injected"):
            client.run(params)
    assert np.isfinite(client.run(params).params["w"]).all()  # third call is clean


def test_exit_faults_do_not_fire_again_after_a_restart(digits_plan):
    cfg, plan = digits_plan
    fault = FaultSpec(client=0, step="test.params2", call=1, mode="exit")
    restarted = Client(
        0, plan.for_client(0), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=0, faults=[fault], restarted=True
    )

    @client_step("test.params2")
    def params(ctx):
        return 1

    assert restarted.run(params) == 1


def test_a_client_keeps_its_trained_local_model_in_its_own_cache(digits_plan, tmp_path):
    # run.model_cache: a later run of the same client (a Tune trial) reads its model instead of training; the file is
    # written by the client itself (FedSA's teachers never leave their clients).
    from rayfuse.models import get_params

    cfg, plan = digits_plan
    cache = str(tmp_path / "cache")

    def client(train_cfg=cfg.train, client_id=0):
        return Client(
            client_id,
            plan.for_client(client_id),
            data_cfg=cfg.data,
            model_cfg=cfg.model,
            train_cfg=train_cfg,
            seed=cfg.run.seed,
            local_cache=cache,
        )

    first = client()
    trained = get_params(first.ctx.local_model())
    assert "cached" not in first.ctx.local_stats and list((tmp_path / "cache" / "local-models").glob("*/params.safetensors"))
    again = client()
    restored = get_params(again.ctx.local_model())
    assert again.ctx.local_stats["cached"] == 1.0 and again.ctx.local_stats["train_loss"] == first.ctx.local_stats["train_loss"]
    assert all(np.array_equal(trained[k], restored[k]) for k in trained)
    # another client, or other training settings, is another entry: trained, not read
    second_client = client(client_id=1)
    second_client.ctx.local_model()
    assert "cached" not in second_client.ctx.local_stats
    other = client(train_cfg=cfg.train.model_copy(update={"epochs": 2}))
    other.ctx.local_model()
    assert "cached" not in other.ctx.local_stats
    assert len(list((tmp_path / "cache" / "local-models").glob("*/params.safetensors"))) == 3


@client_step("threads")
def torch_thread_count(ctx):
    import torch

    return torch.get_num_threads()


def test_in_process_steps_run_with_the_thread_count_their_ray_actor_would_have(monkeypatch):
    import torch

    from rayfuse.federation import actor_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # Ray's rule: max(floor(cpus), 1), and 1 when the actor names no CPUs
    assert [actor_threads(c) for c in ("auto", 0, 0.5, 1, 2.7, 4)] == [1, 1, 1, 1, 2, 4]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert actor_threads(2) is None  # set by the user: Ray leaves it, and so does the in-process backend
    monkeypatch.delenv("OMP_NUM_THREADS")

    before = torch.get_num_threads()
    fed = InProcessFederation(
        lambda i, restarted: FakeClient(i, {}, Counter()),
        2,
        FailurePolicy("fail", 0, 1, None),
        EventLog(),
        threads=lambda client_id: 1 + client_id,
    )
    seen = fed.gather(fed.map(torch_thread_count)).results
    assert seen == {0: 1, 1: 2}
    assert torch.get_num_threads() == before  # restored after each step
