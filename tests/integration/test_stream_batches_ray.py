"""Real Ray: ``RayFederation.stream`` fetches the replies already in together, within its fetch budget (one
``ray.get`` per batch; a reply larger than the budget alone), and keeps gather's failure policy: a failing client is
dropped per client, a client past its deadline times out, ``min_clients`` still fails the round.

One local Ray (2 CPUs) is started for the whole session by the ``ray_session`` fixture.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from actors.client import RefArg
from rayfuse.errors import RunFailure
from rayfuse.federation import EventLog, FailurePolicy
from rayfuse.method import client_step

pytestmark = pytest.mark.ray
VALUES = 2_000  # float64 values per reply: 16 KB, stored in Ray's in-process memory store, its size still recorded


@client_step("test.stream_batch_reply")
def reply(ctx: Any, scale: float, *, fail: tuple[int, ...] = (), slow: tuple[int, ...] = ()) -> dict[str, Any]:
    if ctx.client_id in fail:
        raise RuntimeError("injected failure")
    if ctx.client_id in slow:
        time.sleep(3.0)
    return {"client": ctx.client_id, "w": np.full(VALUES, scale * ctx.client_id)}


class Host:
    """A stand-in client actor with ``ClientActor.run_many``'s contract (one client per actor here)."""

    def ping(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id()}

    def run_many(self, calls: Any, *refs: Any, installs: Any = (), reducer: Any = None) -> list[tuple[bool, Any]]:
        out: list[tuple[bool, Any]] = []
        for client, step, args, kwargs in calls:
            args = tuple(refs[a.index] if isinstance(a, RefArg) else a for a in args)
            try:
                out.append((True, step(SimpleNamespace(client_id=client), *args, **kwargs)))
            except Exception as exc:
                out.append((False, f"{type(exc).__name__}: {exc}"))
        return out


@pytest.fixture(scope="module")
def hosts(ray_session):
    actors = [ray_session.remote(Host).options(num_cpus=0).remote() for _ in range(8)]
    ray_session.get([a.ping.remote() for a in actors])
    yield actors
    for actor in actors:
        ray_session.kill(actor)


def federation(hosts: list[Any], policy: FailurePolicy, **kwargs: Any):
    from actors.federation import RayFederation

    return RayFederation(dict(enumerate(hosts)), policy, EventLog(), **kwargs)


class FetchSpy:
    """Records each ``ray.get`` of several references (a batch) and the bytes Ray records for it."""

    def __init__(self, ray: Any) -> None:
        self.ray, self.real = ray, ray.get
        self.batches: list[list[int]] = []

    def __call__(self, refs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(refs, list):
            sizes = self.ray.experimental.get_local_object_locations(refs)
            self.batches.append([sizes[r]["object_size"] for r in refs])
        return self.real(refs, *args, **kwargs)


def finished(ray: Any, calls: list[Any]) -> None:
    """Wait until every call is done, so the stream finds them all in at its first wake-up."""
    refs = list({c.handle.ref: None for c in calls})
    ray.wait(refs, num_returns=len(refs))


def test_replies_in_are_fetched_together_within_the_byte_budget(ray_session, hosts, monkeypatch):
    ray = ray_session
    one = federation(hosts, FailurePolicy("fail"))
    calls = one.map(reply, 1.0)
    finished(ray, calls)
    size = max(ray.experimental.get_local_object_locations([c.handle.ref for c in calls])[c.handle.ref]["object_size"] for c in calls)
    budget = int(3.5 * size)  # three replies fit, four do not
    spy = FetchSpy(ray)
    monkeypatch.setattr(ray, "get", spy)
    fed = federation(hosts, FailurePolicy("fail"), fetch_bytes=budget)
    calls = fed.map(reply, 2.0)
    finished(ray, calls)
    got = dict(fed.stream(calls))
    assert sorted(got) == list(range(8))
    for client, value in got.items():
        assert value["client"] == client and value["w"].shape == (VALUES,)
        assert np.all(value["w"] == 2.0 * client)
    batches = [b for b in spy.batches if b]
    assert all(sum(b) <= budget for b in batches), batches
    assert max(len(b) for b in batches) == 3  # batched, not one reply per wake-up
    assert sum(len(b) for b in batches) == 8  # each reply fetched once
    # a reply above the budget comes alone; 0: one actor call per wake-up
    for small in (size // 2, 0):
        spy.batches.clear()
        fed.fetch_bytes = small
        calls = fed.map(reply, 1.0)
        finished(ray, calls)
        assert sorted(dict(fed.stream(calls))) == list(range(8))
        assert [len(b) for b in spy.batches if b] == [1] * 8


def test_a_batched_stream_keeps_the_failure_policy(ray_session, hosts):
    ray = ray_session
    fed = federation(hosts, FailurePolicy("drop", 0, 1, None))
    calls = fed.map(reply, 1.0, fail=(2, 5))
    finished(ray, calls)
    stream = fed.stream(calls)
    assert sorted(dict(stream)) == [0, 1, 3, 4, 6, 7]
    assert [(e.client, e.kind) for e in stream.failures] == [(2, "error"), (5, "error")]
    assert [e["client"] for e in fed.events.since(0) if e["kind"] == "client_dropped"] == [2, 5]

    quorum = federation(hosts, FailurePolicy("drop", 0, 7, None))
    calls = quorum.map(reply, 1.0, fail=(2, 5))
    with pytest.raises(RunFailure, match=r"only 6 of 8 clients returned from test.stream_batch_reply \(federation.min_clients = 7\)"):
        list(quorum.stream(calls))

    deadline = federation(hosts, FailurePolicy("drop", 0, 1, 1.0))
    stream = deadline.stream(deadline.map(reply, 1.0, slow=(4,)))
    received = []
    for client, _ in stream:
        received.append(client)
        time.sleep(0.2)  # a slow consumer: the replies waiting in its batches are not timeouts
    assert sorted(received) == [0, 1, 2, 3, 5, 6, 7]
    assert [(e.client, e.kind) for e in stream.failures] == [(4, "timeout")]
    ray.get(hosts[4].ping.remote())  # the slow call ends before the next test uses its actor
