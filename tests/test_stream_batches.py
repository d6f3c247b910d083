"""``Federation.stream`` hands out the replies already in, a batch at a time, with gather's failure policy: a reply that
arrived before its deadline but waited in a batch (or behind a slow consumer) is not a timeout; a call still running
past its deadline is; failures, drops and the quorum are as in :meth:`Federation.gather`."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from rayfuse.errors import RunFailure
from rayfuse.federation import EventLog, FailurePolicy, InProcessFederation, client_step


class Stub:
    def __init__(self, client_id: int) -> None:
        self.client_id = client_id

    def run(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        return step(self, *args, **kwargs)


@client_step("test.stream_value")
def value_of(ctx: Any) -> int:
    if ctx.client_id == 2:
        raise RuntimeError("injected failure")
    return 10 * ctx.client_id


@client_step("test.stream_slow")
def slow_first(ctx: Any) -> int:
    if ctx.client_id == 0:
        time.sleep(0.4)  # past the 0.2 s deadline: a timeout, computed where the call ran
    return ctx.client_id


def federation(policy: str = "drop", *, min_clients: int = 1, timeout_s: float | None = None, n: int = 4) -> InProcessFederation:
    return InProcessFederation(lambda i, restarted: Stub(i), n, FailurePolicy(policy, 0, min_clients, timeout_s), EventLog())


def test_a_reply_in_before_its_deadline_is_kept_while_the_consumer_is_slow():
    fed = federation(timeout_s=0.2)
    calls = fed.map(lambda ctx: ctx.client_id)
    stream = fed.stream(calls)
    received = []
    for client, value in stream:
        received.append((client, value))
        time.sleep(0.25)  # folding the first reply outlasts every call's deadline: the others were in long before
    assert received == [(c, c) for c in range(4)]
    assert stream.failures == []
    assert "client_failed" not in [e["kind"] for e in fed.events.since(0)]


def test_a_call_past_its_deadline_is_still_a_timeout_and_dropped():
    fed = federation(timeout_s=0.2)
    stream = fed.stream(fed.map(slow_first))
    assert dict(stream) == {1: 1, 2: 2, 3: 3}
    assert [(e.client, e.kind) for e in stream.failures] == [(0, "timeout")]


def test_a_streamed_failure_is_dropped_per_client_and_the_quorum_still_applies():
    fed = federation()
    stream = fed.stream(fed.map(value_of))
    assert dict(stream) == {0: 0, 1: 10, 3: 30}
    assert [(e.client, e.kind) for e in stream.failures] == [(2, "error")]
    strict = federation(min_clients=4)
    with pytest.raises(RunFailure, match=r"only 3 of 4 clients returned from test.stream_value \(federation.min_clients = 4\)"):
        list(strict.stream(strict.map(value_of)))
    with pytest.raises(RunFailure, match=r"client 2 failed in step test.stream_value"):
        fail = federation("fail")
        list(fail.stream(fail.map(value_of)))


def test_stream_and_gather_give_the_same_replies_and_failures():
    counts: Counter = Counter()
    for how in ("stream", "gather"):
        fed = federation()
        calls = fed.map(value_of)
        if how == "stream":
            stream = fed.stream(calls)
            results, failures = dict(stream), stream.failures
        else:
            gathered = fed.gather(calls)
            results, failures = gathered.results, gathered.failures
        counts[(tuple(sorted(results.items())), tuple((e.client, e.kind) for e in failures))] += 1
    assert list(counts.values()) == [2]
