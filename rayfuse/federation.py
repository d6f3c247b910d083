"""The federation abstraction: what a method's server loop sees of its clients.

A method is written once against :class:`Federation` and runs on two implementations:

* :class:`InProcessFederation` (here): clients are plain :class:`rayfuse.client.Client` objects in this process;
  used by unit tests and ``federation.backend: local`` debug runs.
* ``actors.federation.RayFederation``: clients are long-lived Ray actors; ``put`` is ``ray.put``, calls return
  ``ObjectRef`` s and gathering uses ``ray.wait`` with a timeout.

The interface is small::

    ref = federation.put(global_params)                  # one broadcast object, passed to every client
    calls = federation.map(fit, ref, epochs=2)           # run client step ``fit`` on every (or selected) client
    gathered = federation.gather(calls)                  # wait, apply the failure policy, check the quorum
    gathered.results  -> {client_id: value}; gathered.failures -> [ClientError, ...]
    for client, value in federation.stream(calls): ...   # the replies one at a time as they arrive (same policy)
    federation.parallel_map(solve, items)                # server-side fan-out (assignment solves, restarts...)

A *client step* is a module-level function ``step(ctx, *args, **kwargs)`` that runs inside a client with its
:class:`rayfuse.client.ClientContext` (its private shard, its local model). Steps return parameters, summaries,
losses and counts, never raw data. Decorate steps with :func:`client_step` to give them a stable name (used in
events and fault injection).

:meth:`Federation.stream` hands the replies out one at a time, in arrival order, and keeps none of them: a streaming
aggregation folds each into a running sum and drops it, so the coordinator holds one reply at a time, not K.
:meth:`Federation.map_reduced` lets the process that hosts several clients fold their replies into one (a
*reducer*, :func:`reduce_replies`): it returns one value for them, and each other client of it a :class:`Folded` marker.

Failure policy (``federation.on_client_failure``), applied in :meth:`Federation.gather` and :meth:`Federation.stream`
(one generator, :meth:`Federation._replies`, the one place it lives):

* ``retry`` -- re-submit a failed call up to ``max_retries`` times (a dead Ray actor is restarted by Ray and reloads
  its shard first); a call still failing after that fails the run. Timeouts are not retried.
* ``drop`` -- leave the client out of this call's results and record a ``client_dropped`` event; the run fails only
  when fewer than ``min_clients`` clients remain. A crashed client is restarted (Ray restarts its actor) and the
  restart is recorded (``client_restarted``, or ``client_dead`` when it has no restarts left) once the call's other
  results are in.
* ``fail`` -- the first failure fails the run.

Every failure, retry, drop and restart is recorded in the :class:`EventLog`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from rayfuse.errors import RunFailure
from rayfuse.method import ClientError, Folded, Gathered, Update, client_step, step_name

__all__ = [
    "Federation",
    "InProcessFederation",
    "FailurePolicy",
    "Update",
    "ClientError",
    "Gathered",
    "Call",
    "EventLog",
    "ClientDied",
    "client_step",
    "step_name",
    "freeze",
    "map_arrays",
    "Folded",
    "ReplyStream",
    "Reducer",
    "reduce_replies",
]

T = TypeVar("T")


@dataclass(frozen=True)
class FailurePolicy:
    on_client_failure: str = "retry"
    max_retries: int = 2
    min_clients: int = 1
    timeout_s: float | None = None

    @classmethod
    def from_config(cls, federation_cfg: Any) -> FailurePolicy:
        return cls(federation_cfg.on_client_failure, federation_cfg.max_retries, federation_cfg.min_clients, federation_cfg.timeout_s)


class EventLog:
    """Append-only, thread-safe list of run events (dicts with ``t`` seconds since the log started and ``kind``).

    Listeners are called synchronously on every event (the in-process backend prints progress this way); the Ray
    backend polls :meth:`since` from the driver instead.
    """

    def __init__(self, start: float | None = None) -> None:
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._start = time.time() if start is None else start
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def emit(self, kind: str, message: str = "", **fields: Any) -> dict[str, Any]:
        event = {"t": round(time.time() - self._start, 3), "kind": kind, **({"message": message} if message else {}), **fields}
        with self._lock:
            self._events.append(event)
        for listener in list(self.listeners):
            listener(event)
        return event

    def since(self, index: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events[index:])

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)


class ClientDied(RuntimeError):
    """In-process stand-in for a client process that died (a Ray actor would be restarted by Ray)."""


class Reducer(Protocol):
    """Folds the successful replies of the clients one process hosts into one value (run in that process).

    ``reduce`` gets an iterator of ``(client, value, args)`` per successful call, ``args`` the call's positional
    arguments as the step received them (resolved); it must consume all of it, dropping each value once folded (the
    next call runs only when it asks for the next reply, so the process holds one client's reply at a time), and
    returns the one value sent back for all of them."""

    def reduce(self, replies: Iterator[tuple[int, Any, tuple]]) -> Any: ...


def reduce_replies(reducer: Reducer, outcomes: Iterable[tuple[int, bool, Any, tuple]]) -> list[tuple[bool, Any]]:
    """One process's calls folded by ``reducer``: ``outcomes`` gives ``(client, ok, value or message, args)`` per call,
    in order (lazily: a generator that runs each call when asked). Returns ``(ok, value or message)`` per call: the
    first successful call's entry carries the folded value, every other successful call's a :class:`Folded` marker
    naming it; failed calls are kept as they are (the failure policy handles each client). A reducer that raises
    fails every call it was folding."""
    out: list[tuple[bool, Any]] = []
    clients: list[int] = []

    def successes() -> Iterator[tuple[int, Any, tuple]]:
        for client, ok, value, args in outcomes:
            clients.append(client)
            out.append((ok, None if ok else value))
            if ok:
                yield client, value, args
            del value

    replies = successes()
    try:
        folded, error = reducer.reduce(replies), None
    except Exception as exc:  # reported per client; the policy decides
        folded, error = None, f"{type(exc).__name__}: folding the replies of this process's clients: {exc}"
    for _ in replies:  # the calls the reducer did not ask for (it raised) still run, and fail with it
        pass
    ok = [i for i, (good, _) in enumerate(out) if good]
    for i in ok:
        out[i] = (False, error) if error is not None else (True, folded if i == ok[0] else Folded(clients[ok[0]]))
    return out


@dataclass
class Call:
    """One submitted client call; kept so the policy can re-submit it."""

    client: int
    step: Callable[..., Any]
    args: tuple
    kwargs: dict
    attempt: int = 0
    handle: Any = None
    deadline: float | None = None
    reducer: Any = None  # a Reducer: the calls of one process are folded there into one reply (map_reduced)
    node_reducer: Any = None  # a Reducer: the folded replies of one node's processes are folded once more there (per_node)

    @property
    def name(self) -> str:
        return step_name(self.step)


def map_arrays(obj: Any, fn: Callable[[np.ndarray], Any]) -> Any:
    """``obj`` with ``fn`` applied to every numpy array inside it (through dicts, lists, tuples and dataclasses)."""
    if isinstance(obj, np.ndarray):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_arrays(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_arrays(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_arrays(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init})
    return obj


def _read_only_copy(array: np.ndarray) -> np.ndarray:
    out = array.copy()
    out.setflags(write=False)
    return out


def freeze(obj: Any) -> Any:
    """Read-only copy of the arrays in ``obj`` (dicts, lists, tuples, dataclasses), like Ray's object store gives."""
    return map_arrays(obj, _read_only_copy)


class Federation(ABC):
    """Clients as seen from a method's server loop. Subclasses provide transport; policy lives here."""

    def __init__(self, policy: FailurePolicy, events: EventLog | None = None) -> None:
        self.policy = policy
        self.events = events if events is not None else EventLog()
        # client id -> (step, argument): state every process of that client must hold (see :meth:`install`)
        self._installed: dict[int, tuple[Callable[..., Any], Any]] = {}

    # -- transport, provided by subclasses -------------------------------------------------------------------------

    @property
    @abstractmethod
    def client_ids(self) -> list[int]:
        """Ids of the clients in this federation, ascending."""

    @abstractmethod
    def put(self, obj: Any) -> Any:
        """Store ``obj`` once for a broadcast; pass the returned reference to :meth:`map`."""

    @abstractmethod
    def get(self, ref: Any) -> Any:
        """Resolve a reference returned by :meth:`put`."""

    @abstractmethod
    def _submit(self, call: Call) -> Any:
        """Start ``call`` on its client and return a handle."""

    @abstractmethod
    def _wait(self, handles: list[Any], timeout: float | None, *, one: bool = False) -> list[Any]:
        """Return the handles among ``handles`` that are done (waiting at most ``timeout`` seconds for one); ``one``
        (streaming): a bounded batch of them, at least one (the coordinator holds a bounded number of replies at a
        time: one process's replies in-process; on Ray, those that fit its fetch budget)."""

    def _finished(self, handles: list[Any]) -> list[Any]:
        """Those of ``handles`` whose reply is in, without waiting or fetching it (a deadline passed while the reply
        waited in a batch is not a timeout). In-process every submitted call has run."""
        return list(handles)

    @abstractmethod
    def _result(self, handle: Any) -> Any:
        """The value of a done handle; raise :class:`ClientFailed` with a classified :class:`ClientError` if it failed.
        Called once per handle: the transport releases its own reference to the value here."""

    def parallel_width(self) -> int:
        """How many items :meth:`parallel_map` runs at once (chunking uses it; see ``rayfuse.matching``)."""
        return _thread_count(1 << 30)

    @abstractmethod
    def parallel_map(self, fn: Callable[[Any], T], items: Sequence[Any], *, chunk_size: int | None = None) -> list[T]:
        """``[fn(item) for item in items]`` computed in parallel (server-side fan-out), in order."""

    # -- the interface methods use --------------------------------------------------------------------------------

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    def _start_many(self, calls: list[Call]) -> list[Call]:
        deadline = None if self.policy.timeout_s is None else time.monotonic() + self.policy.timeout_s
        for call, handle in zip(calls, self._submit_many(calls)):
            call.deadline, call.handle = deadline, handle
        return calls

    def _start(self, call: Call) -> Call:
        return self._start_many([call])[0]

    def _submit_many(self, calls: list[Call]) -> list[Any]:
        """Start several calls at once (a transport may batch the calls that go to the same process)."""
        return [self._submit(call) for call in calls]

    def map_reduced(
        self,
        step: Callable[..., Any],
        *args: Any,
        reducer: Reducer,
        clients: Iterable[int] | None = None,
        node_reducer: Reducer | None = None,
        **kwargs: Any,
    ) -> list[Call]:
        """:meth:`map`, with the replies of the clients one process hosts folded there by ``reducer`` into one
        (:func:`reduce_replies`): :meth:`stream` then gives that value once and nothing for the clients folded into
        it. A retried call runs alone, unfolded. A transport that hosts one client per process folds each reply alone.
        ``node_reducer``: the folded values of the processes on one node are folded once more, on that node, by it
        (``federation.aggregation: per_node``; a transport without nodes, :meth:`client_nodes` ``None``, ignores it)."""
        calls = self._calls(step, args, clients, kwargs)
        return self._start_many([dataclasses.replace(c, reducer=reducer, node_reducer=node_reducer) for c in calls])

    def client_nodes(self) -> Mapping[int, str] | None:
        """The node each client's process runs on (a node id), or ``None`` for a transport without nodes."""
        return None

    def map(self, step: Callable[..., Any], *args: Any, clients: Iterable[int] | None = None, **kwargs: Any) -> list[Call]:
        """Run ``step(ctx, *args, **kwargs)`` on each of ``clients`` (default: all); returns the pending calls."""
        return self._start_many(self._calls(step, args, clients, kwargs))

    def _calls(self, step: Callable[..., Any], args: tuple, clients: Iterable[int] | None, kwargs: dict[str, Any]) -> list[Call]:
        targets = self.client_ids if clients is None else sorted(set(int(c) for c in clients))
        unknown = set(targets) - set(self.client_ids)
        if unknown:
            raise ValueError(f"unknown client ids {sorted(unknown)}")
        return [Call(c, step, args, dict(kwargs)) for c in targets]

    def gather(self, calls: Sequence[Call]) -> Gathered[Any]:
        """Wait for ``calls``, applying the failure policy; raise :class:`RunFailure` when it says so."""
        failures: list[ClientError] = []
        results = dict(self._replies(calls, failures, one_at_a_time=False))
        ordered = {c: results[c] for c in sorted(results)}
        return Gathered(ordered, sorted(failures, key=lambda e: e.client))

    def stream(self, calls: Sequence[Call]) -> ReplyStream:
        """The replies of ``calls`` one at a time, as they arrive: ``(client, value)``, with :meth:`gather`'s failure
        policy, deadlines, retries and quorum (checked when the last reply is in; raises :class:`RunFailure`). The
        federation keeps no reference to a reply it handed out, so a consumer that drops it frees it. A value folded
        by a reducer (:meth:`map_reduced`) comes once, from its first client; the clients folded into it give nothing."""
        return ReplyStream(self, calls)

    def _replies(self, calls: Sequence[Call], failures: list[ClientError], *, one_at_a_time: bool) -> Iterator[tuple[int, Any]]:
        """The one policy loop of :meth:`gather` and :meth:`stream`: yields ``(client, value)`` as replies arrive,
        records failures in ``failures``, and raises :class:`RunFailure` when the policy or the quorum says so."""
        pending: dict[Any, Call] = {call.handle: call for call in calls}
        received = 0
        total = len(calls)
        name = calls[0].name if calls else "a step"
        while pending:
            deadlines = [c.deadline for c in pending.values() if c.deadline is not None]
            timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            ready = self._wait(list(pending), timeout, one=one_at_a_time)
            ready.reverse()
            while ready:  # each handle dropped as its reply is handed out (a batch pins none of the replies it passed)
                handle = ready.pop()
                call = pending.pop(handle)
                call.handle = None  # the reply is the consumer's alone from here
                try:
                    value = self._result(handle)
                except ClientFailed as failed:
                    error = dataclasses.replace(failed.error, client=call.client, step=call.name, attempt=call.attempt)
                    retry = self._on_failure(call, error, failures)
                    if retry is not None:
                        pending[retry.handle] = retry
                    continue
                del handle
                received += 1
                if not isinstance(value, Folded):
                    yield call.client, value
                del value
            now = time.monotonic()
            expired = [handle for handle, call in pending.items() if call.deadline is not None and now >= call.deadline]
            arrived = set(self._finished(expired)) if expired else set()
            for handle in expired:
                call = pending[handle]
                if handle not in arrived:  # a reply that is in (not yet handed out) is taken at the next wake-up
                    del pending[handle]
                    call.handle = None
                    self._on_timeout(handle)
                    error = ClientError(call.client, "timeout", f"no reply within {self.policy.timeout_s:g} s", call.name, call.attempt)
                    self._on_failure(call, error, failures)
        need = min(self.policy.min_clients, total)
        if received < need:
            raise RunFailure(
                f"only {received} of {total} clients returned from {name} (federation.min_clients = {self.policy.min_clients})"
            )
        for error in failures:  # dropped (policy drop): the round is settled, the transport may now look at the client
            self._after_drop(error)

    def run(self, step: Callable[..., Any], *args: Any, clients: Iterable[int] | None = None, **kwargs: Any) -> Gathered[Any]:
        """:meth:`map` then :meth:`gather`."""
        return self.gather(self.map(step, *args, clients=clients, **kwargs))

    def install(self, step: Callable[..., Any], per_client: Mapping[int, Any]) -> None:
        """Keep ``step(ctx, per_client[c])`` as state that client ``c``'s process must hold (the silo plan a survey
        completed: :func:`rayfuse.client.join_silo_plan`): a process that replaces a crashed one (a Ray actor Ray
        restarted, whose constructor knows only what it was created with) runs it again before any other step.
        ``step`` must be idempotent (the clients that did not restart run it again too on Ray, where a restart can
        go unnoticed). Call it after the clients ran the step themselves."""
        unknown = set(per_client) - set(self.client_ids)
        if unknown:
            raise ValueError(f"unknown client ids {sorted(unknown)}")
        self._installed.update({int(c): (step, arg) for c, arg in per_client.items()})
        self._on_install()

    def _on_install(self) -> None:
        """Hook: :meth:`install` changed the installed state (Ray stores each client's argument once)."""

    def _on_failure(self, call: Call, error: ClientError, failures: list[ClientError]) -> Call | None:
        policy = self.policy.on_client_failure
        retryable = error.kind != "timeout"  # a straggler's actor is still busy: re-submitting would queue behind it
        fields = {"client": call.client, "step": call.name, "error_kind": error.kind, "attempt": call.attempt}
        self.events.emit("client_failed", error.message, **fields)
        if policy == "retry" and retryable and call.attempt < self.policy.max_retries:
            self._before_retry(call, error)
            self.events.emit("client_retry", f"re-submitting (attempt {call.attempt + 2})", client=call.client, step=call.name)
            return self._start(Call(call.client, call.step, call.args, call.kwargs, attempt=call.attempt + 1))
        if policy == "drop":
            failures.append(error)
            self.events.emit("client_dropped", error.message, client=call.client, step=call.name)
            return None
        detail = f" after {call.attempt + 1} attempts" if policy == "retry" and retryable else ""
        raise RunFailure(
            f"client {call.client} failed in step {call.name}{detail} ({error.kind}): {error.message} "
            f"[federation.on_client_failure = {policy}]"
        )

    def _on_timeout(self, handle: Any) -> None:
        """Hook: give up on a straggler's handle (Ray cancels it)."""

    def _before_retry(self, call: Call, error: ClientError) -> None:
        """Hook: prepare a retry (Ray waits for a dead actor's restart to finish)."""

    def _after_drop(self, error: ClientError) -> None:
        """Hook: a client's call was dropped (policy ``drop``) and every call of the gather is settled. Ray waits for a
        crashed actor's restart and records it (``client_restarted``), as a retry does; in-process restarts are
        recorded when they happen."""


class ClientFailed(Exception):
    """Raised by :meth:`Federation._result` for a failed call."""

    def __init__(self, error: ClientError) -> None:
        super().__init__(error.message)
        self.error = error


class ReplyStream:
    """:meth:`Federation.stream`'s iterator of ``(client, value)``; ``failures`` (the dropped clients' errors, in
    client order) is complete once the iteration ended."""

    def __init__(self, federation: Federation, calls: Sequence[Call]) -> None:
        self._failures: list[ClientError] = []
        self._iterator = federation._replies(calls, self._failures, one_at_a_time=True)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self._iterator

    @property
    def failures(self) -> list[ClientError]:
        return sorted(self._failures, key=lambda e: e.client)


@dataclass(eq=False)  # identity-hashed: used as a dict key while pending
class _Done:
    value: Any = None
    error: ClientError | None = None


def _outcome(done: _Done) -> tuple[bool, Any]:
    return (True, done.value) if done.error is None else (False, done.error.message)


def actor_threads(num_cpus: float | str) -> int | None:
    """The intra-op thread count a Ray actor reserving ``num_cpus`` runs torch with: Ray sets ``OMP_NUM_THREADS`` to
    ``max(floor(cpus), 1)`` (1 when no CPUs are named) unless the environment already sets it. ``None`` when the
    environment sets it (this process then already uses what the actors would)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(math.floor(1.0 if num_cpus == "auto" else float(num_cpus)), 1)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads (``None``: as is). The in-process backend runs each step
    with the thread count its actor would have on Ray: a float reduction split over another number of threads rounds
    differently in the last bits, and a local rehearsal must give the Ray run's exact numbers."""
    if count is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _thread_count(n_items: int) -> int:
    return max(1, min(n_items, os.cpu_count() or 1))


class InProcessFederation(Federation):
    """Clients as plain objects in this process (tests, ``federation.backend: local``).

    Calls run synchronously in :meth:`map`. A client that "dies" (raises :class:`ClientDied`, the in-process form of
    a crashed actor) is rebuilt from ``client_factory`` like Ray restarts an actor, at most ``max_restarts`` times.
    ``put`` returns read-only copies so a step that writes into a broadcast fails here as it would on Ray.

    Parameters
    ----------
    client_factory : callable ``(client_id, restarted) -> Client``
    num_clients : int
    policy : FailurePolicy
    events : EventLog, optional
    max_restarts : int
        -1 for unlimited.
    threads : callable ``client_id -> int | None``, optional
        The torch thread count each client's steps run with (:func:`actor_threads` of its resources, so the numbers
        equal a Ray run's); ``None``: this process's setting.
    clients_per_process : int
        How the clients would be grouped into processes on Ray (``federation.clients_per_actor``: consecutive ids):
        the calls of one group are folded together by a reducer (:meth:`Federation.map_reduced`), as an actor folds them.
    processes_per_node : int, optional
        Tests only: group the processes into simulated nodes (consecutive processes), so a ``node_reducer``
        (:meth:`Federation.map_reduced`, ``federation.aggregation: per_node``) folds each node's replies as the node's
        aggregator actor does on Ray. ``None`` (a run's in-process backend): no nodes; per_node is refused for it.
    """

    def __init__(
        self,
        client_factory: Callable[[int, bool], Any],
        num_clients: int,
        policy: FailurePolicy,
        events: EventLog | None = None,
        *,
        max_restarts: int = 2,
        threads: Callable[[int], int | None] | None = None,
        clients_per_process: int = 1,
        processes_per_node: int | None = None,
    ) -> None:
        super().__init__(policy, events)
        self._per_process = max(1, int(clients_per_process))
        self._per_node = None if processes_per_node is None else max(1, int(processes_per_node))
        self._factory = client_factory
        self._clients = {i: client_factory(i, False) for i in range(num_clients)}
        self._restarts = {i: 0 for i in range(num_clients)}
        self._max_restarts = max_restarts
        self._dead: set[int] = set()
        self._threads = threads

    @property
    def client_ids(self) -> list[int]:
        return sorted(self._clients)

    def client(self, client_id: int) -> Any:
        return self._clients[client_id]

    def put(self, obj: Any) -> Any:
        return freeze(obj)

    def get(self, ref: Any) -> Any:
        return ref

    def _submit(self, call: Call) -> _Done:
        if call.client in self._dead:
            return _Done(error=ClientError(call.client, "died", "the client died and has no restarts left", call.name, call.attempt))
        started = time.monotonic()
        try:
            with torch_threads(self._threads(call.client) if self._threads else None):
                value = self._clients[call.client].run(call.step, *call.args, **call.kwargs)
        except ClientDied as exc:
            self._restart(call.client)
            return _Done(error=ClientError(call.client, "died", str(exc) or "client died", call.name, call.attempt))
        except Exception as exc:  # a failing step is a client error, reported through the policy
            return _Done(error=ClientError(call.client, "error", f"{type(exc).__name__}: {exc}", call.name, call.attempt))
        if self.policy.timeout_s is not None and time.monotonic() - started > self.policy.timeout_s:
            return _Done(error=ClientError(call.client, "timeout", f"no reply within {self.policy.timeout_s:g} s", call.name, call.attempt))
        return _Done(value=value)

    def _submit_many(self, calls: list[Call]) -> list[Any]:
        done = [self._submit(call) for call in calls]
        groups: dict[int, list[int]] = {}
        for i, call in enumerate(calls):
            if call.reducer is not None:
                groups.setdefault(call.client // self._per_process, []).append(i)
        for positions in groups.values():  # the calls one process would run, folded there (reduce_replies)
            outcomes = [(calls[i].client, *_outcome(done[i]), calls[i].args) for i in positions]
            folded = reduce_replies(calls[positions[0]].reducer, outcomes)
            for i, (ok, value) in zip(positions, folded):
                if ok:
                    done[i] = _Done(value=value)
                elif done[i].error is None:  # the reducer failed
                    done[i] = _Done(error=ClientError(calls[i].client, "error", value, calls[i].name, calls[i].attempt))
        nodes = self.client_nodes()
        if nodes is None:
            return done
        by_node: dict[str, list[int]] = {}
        for i, call in enumerate(calls):
            if call.reducer is not None and call.node_reducer is not None:
                by_node.setdefault(nodes[call.client], []).append(i)
        for positions in by_node.values():  # the processes of one simulated node, folded once more (per_node)
            outcomes = [(calls[i].client, *_outcome(done[i]), calls[i].args) for i in positions]
            folded = reduce_replies(calls[positions[0]].node_reducer, outcomes)
            for i, (ok, value) in zip(positions, folded):
                if ok:
                    done[i] = _Done(value=value)
                elif done[i].error is None:
                    done[i] = _Done(error=ClientError(calls[i].client, "error", value, calls[i].name, calls[i].attempt))
        return done

    def client_nodes(self) -> Mapping[int, str] | None:
        """``processes_per_node`` set (tests): the simulated node of each client (consecutive processes share one)."""
        if self._per_node is None:
            return None
        return {c: f"node-{c // self._per_process // self._per_node}" for c in self._clients}

    def _restart(self, client_id: int) -> None:
        if self._max_restarts != -1 and self._restarts[client_id] >= self._max_restarts:
            self._dead.add(client_id)
            self.events.emit("client_dead", "no restarts left", client=client_id)
            return
        self._restarts[client_id] += 1
        self._clients[client_id] = self._factory(client_id, True)
        if client_id in self._installed:  # what the replaced client held beyond its constructor's arguments
            step, arg = self._installed[client_id]
            try:
                self._clients[client_id].run(step, arg)
            except Exception as exc:  # a client that cannot take the run's state back cannot serve it
                self._dead.add(client_id)
                self.events.emit("client_dead", f"restarted, but {step_name(step)} failed: {type(exc).__name__}: {exc}", client=client_id)
                return
        self.events.emit("client_restarted", f"restart {self._restarts[client_id]}; shard reloaded", client=client_id)

    def _wait(self, handles: list[Any], timeout: float | None, *, one: bool = False) -> list[Any]:
        return list(handles[:1]) if one else list(handles)

    def _result(self, handle: _Done) -> Any:
        if handle.error is not None:
            raise ClientFailed(handle.error)
        value, handle.value = handle.value, None  # handed out once; the federation keeps no reference
        return value

    def parallel_map(self, fn: Callable[[Any], T], items: Sequence[Any], *, chunk_size: int | None = None) -> list[T]:
        items = list(items)
        if len(items) <= 1:
            return [fn(item) for item in items]
        with concurrent.futures.ThreadPoolExecutor(max_workers=_thread_count(len(items))) as pool:
            return list(pool.map(fn, items))
