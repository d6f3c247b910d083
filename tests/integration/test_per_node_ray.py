"""Real Ray, one node: ``RayFederation``'s per-node fold (``federation.aggregation: per_node``) over stand-in client
actors: the node's aggregator actor (named ``<run>/aggregator-<node>``) folds the per-actor partial sums into one, a
failed client is reported per client (the failure policy drops it), and when the aggregator dies the round's replies
are read flat, with an ``aggregation`` event, and give the same sum.

One local Ray (2 CPUs) is started for the whole session by the ``ray_session`` fixture.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from actors.aggregator import NodeAggregator, aggregator_name
from actors.client import RefArg
from rayfuse.federation import EventLog, FailurePolicy, reduce_replies
from rayfuse.method import Update, client_step
from rayfuse.updates.streaming import NodeFold, PartialSum, RoundFold

pytestmark = pytest.mark.ray
REFERENCE = {"w": np.zeros((300, 300), np.float32), "b": np.zeros(4, np.float32)}  # w above the float32 sum's threshold
PLANNED = {c: 10 + c for c in range(4)}


@client_step("test.per_node_update")
def shifted(ctx: Any, reference: dict[str, np.ndarray]) -> Update:
    if ctx.client_id == 3:
        raise RuntimeError("injected failure")
    return Update({k: v + (ctx.client_id + 1) for k, v in reference.items()}, PLANNED[ctx.client_id], {"loss": 0.5})


class Host:
    """A stand-in client actor: ``ClientActor.run_many``'s contract (batched calls, per-call outcomes, a reducer)."""

    def ping(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id()}

    def run_many(self, calls: Any, *refs: Any, installs: Any = (), reducer: Any = None) -> list[tuple[bool, Any]]:
        def outcomes():
            for client, step, args, kwargs in calls:
                args = tuple(refs[a.index] if isinstance(a, RefArg) else a for a in args)
                try:
                    outcome = (True, step(SimpleNamespace(client_id=client), *args, **kwargs))
                except Exception as exc:
                    outcome = (False, f"{type(exc).__name__}: {exc}")
                yield client, outcome[0], outcome[1], args

        if reducer is not None:
            return reduce_replies(reducer, outcomes())
        return [(ok, value) for _, ok, value, _ in outcomes()]


class DyingAggregator(NodeAggregator):
    def fold(self, *args: Any, **kwargs: Any) -> Any:
        os._exit(1)


def federation(ray, run: str):
    from actors.federation import RayFederation

    hosts = [ray.remote(Host).options(num_cpus=0).remote() for _ in range(2)]
    clients = {0: hosts[0], 1: hosts[0], 2: hosts[1], 3: hosts[1]}
    events = EventLog()
    return RayFederation(clients, FailurePolicy("drop"), events, run=run, namespace="rayfuse-tests"), events


def fold_round(fed) -> tuple[list[tuple[int, Any]], list[int]]:
    fold = RoundFold("mean", True, PLANNED, None)
    calls = fed.map_reduced(shifted, fed.put(REFERENCE), reducer=fold, node_reducer=NodeFold(fold))
    stream = fed.stream(calls)
    replies = list(stream)
    return replies, [e.client for e in stream.failures]


def expected_sum() -> dict[str, np.ndarray]:
    return {k: sum(PLANNED[c] * (v + c + 1) for c in (0, 1, 2)) for k, v in REFERENCE.items()}


def check(partials: list[Any]) -> None:
    assert all(isinstance(p, PartialSum) for p in partials)
    assert sorted(c for p in partials for c in p.clients) == [0, 1, 2]
    assert sum(p.weight for p in partials) == sum(PLANNED[c] for c in (0, 1, 2))
    for key, value in expected_sum().items():
        total = sum(np.asarray(p.total[key], np.float64) for p in partials)
        assert np.isfinite(total).all() and total.shape == value.shape
        np.testing.assert_allclose(total, value, rtol=1e-6)


def test_the_node_aggregator_sends_one_partial_sum_for_the_node_and_keeps_failures_per_client(ray_session):
    ray = ray_session
    fed, events = federation(ray, "pn-ok")
    replies, failed = fold_round(fed)
    assert failed == [3]  # the failing client is dropped by the policy, not the node's sum
    assert len(replies) == 1  # one partial sum for the node's 2 actors and 3 clients that returned
    check([value for _, value in replies])
    node = ray.get_runtime_context().get_node_id()
    assert ray.get(ray.get_actor(aggregator_name("pn-ok", node), namespace="rayfuse-tests").ping.remote())["node_id"] == node
    assert not [e for e in events.since(0) if e["kind"] == "aggregation"]


def test_a_dead_aggregator_makes_the_round_fall_back_to_flat_with_an_event(ray_session, monkeypatch):
    import actors.federation

    monkeypatch.setattr(actors.federation, "NodeAggregator", DyingAggregator)
    fed, events = federation(ray_session, "pn-dead")
    replies, failed = fold_round(fed)
    assert failed == [3]
    assert len(replies) == 2  # read flat: each actor's own partial sum
    check([value for _, value in replies])
    fallback = [e for e in events.since(0) if e["kind"] == "aggregation"]
    assert len(fallback) == 1 and "flat" in fallback[0]["message"]
