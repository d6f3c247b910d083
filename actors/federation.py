"""``RayFederation``: the federation over ``ClientActor`` handles, used inside the coordinator actor.

* ``put`` is one ``ray.put``; the reference is passed to every client call as a top-level argument, so Ray resolves
  it inside each client actor (zero-copy numpy on the same node), once per actor.
* ``map`` sends one ``ClientActor.run_many`` call per actor with the calls of the clients it hosts (one call per
  client in the default one-client-per-actor layout) and keeps the ``ObjectRef`` s; ``gather`` waits with
  ``ray.wait`` and a deadline, then resolves the results in the coordinator: parameters never pass through the
  driver.
* ``stream`` hands out, per wake-up, every actor call already finished whose results fit ``fetch_bytes`` together
  (fetched with one ``ray.get``; a result above it alone), releasing each reply as it is handed out: the coordinator
  holds at most ``fetch_bytes`` of replies, or one reply larger than that, at a time. It wakes up when as many calls
  have finished as fit the budget at the size of the last reply it fetched (one for replies of 64 MiB or more, every
  pending call for 100 replies of 400 KB), so small replies cost one ``ray.wait`` per batch, not one per reply.
* Failures are classified per client: a step that raised -> ``error`` (reported by the actor for that client only);
  ``RayActorError`` -> ``died`` for every client of the actor (Ray restarts it when it has restarts left); the policy
  in :class:`rayfuse.federation.Federation` decides.
* ``parallel_map`` fans server-side work out as Ray tasks, batched so each task carries many items.
* State a client must hold beyond its actor's constructor arguments (:meth:`Federation.install`: the silo plan
  completed by the survey) is stored once per client (``ray.put``) and its reference travels with every call to
  that client's actor: an actor Ray restarted (noticed or not) runs the installed step again before its next step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.experimental import get_local_object_locations
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.aggregator import NodeAggregator, aggregator_name
from actors.client import RefArg
from rayfuse.federation import Call, ClientError, ClientFailed, EventLog, FailurePolicy, Federation, map_arrays

__all__ = ["FETCH_BYTES", "RayFederation"]

T = TypeVar("T")

#: A streamed round fetches the finished replies together while they add up to at most this many bytes (their sizes
#: as Ray records them); a larger reply comes alone. 64 MiB: a model of 32 MB or more is still fetched one reply at a
#: time (the memory bound of streaming is unchanged for the models it matters for), while a round of many small
#: replies (100 x 400 KB) costs one ``ray.get`` per wake-up instead of one per reply.
FETCH_BYTES = 64 * 2**20


def count_nbytes(obj: Any) -> int:
    """Bytes of the numpy arrays inside ``obj`` (dicts, lists, tuples, dataclasses)."""
    total = 0

    def add(array: Any) -> Any:
        nonlocal total
        total += int(array.nbytes)
        return array

    map_arrays(obj, add)
    return total


def _apply_chunk(fn: Callable[[Any], T], chunk: Sequence[Any]) -> list[T]:
    return [fn(item) for item in chunk]


class _Refs:
    """Object references gathered for one remote call, each once, in order: a value that is a reference stands in the
    call's specs as its position (``RefArg``) and the references travel as the call's top-level arguments, so Ray
    resolves each once per call."""

    def __init__(self) -> None:
        self.refs: list[ray.ObjectRef] = []
        self._index: dict[ray.ObjectRef, int] = {}

    def position(self, ref: ray.ObjectRef) -> int:
        if ref not in self._index:
            self._index[ref] = len(self.refs)
            self.refs.append(ref)
        return self._index[ref]

    def slot(self, value: Any) -> Any:
        return RefArg(self.position(value)) if isinstance(value, ray.ObjectRef) else value


@dataclass(frozen=True)
class _Slot:
    """One client's call inside a batched actor call: the actor call's reference and the position of its result.
    Folded per node, ``ref`` is the node aggregator's call and ``origin`` the actor call's slot (read instead, flat,
    if the aggregator died)."""

    ref: ray.ObjectRef
    index: int
    origin: _Slot | None = field(default=None, compare=False)
    node: str | None = field(default=None, compare=False)


class RayFederation(Federation):
    """Parameters
    ----------
    clients : mapping of client id to ``ClientActor`` handle
        Several clients may share one handle (``federation.clients_per_actor > 1``).
    policy : FailurePolicy
    events : EventLog
    task_cpus : float
        CPUs each ``parallel_map`` task requests.
    restart_timeout_s : float
        How long a retry waits for a crashed actor to be restarted.
    run, namespace : str
        The run's name and Ray namespace: the node aggregators (``federation.aggregation: per_node``) are named
        ``<run>/aggregator-<node>`` in it.
    fetch_bytes : int
        :meth:`stream`'s budget: the finished replies fetched at one wake-up add up to at most this many bytes (one
        reply larger than it comes alone); 0: one actor call's results per wake-up.
    """

    def __init__(
        self,
        clients: Mapping[int, Any],
        policy: FailurePolicy,
        events: EventLog | None = None,
        *,
        task_cpus: float = 1.0,
        restart_timeout_s: float = 300.0,
        run: str = "rayfuse",
        namespace: str | None = None,
        fetch_bytes: int = FETCH_BYTES,
    ) -> None:
        super().__init__(policy, events)
        self.fetch_bytes = int(fetch_bytes)
        self._reply_bytes = 0  # the size of the last reply stream fetched: how many replies one wake-up waits for
        self._clients = dict(clients)
        # Any: ray.remote's typed wrapper (its private RemoteFunction1) cannot carry _apply_chunk's type variable
        self._task: Any = ray.remote(num_cpus=task_cpus)(_apply_chunk)
        self._task_cpus = max(task_cpus, 1e-3)
        self._restart_timeout_s = restart_timeout_s
        self._fetched: dict[ray.ObjectRef, Any] = {}
        self._install_refs: dict[int, tuple[Callable[..., Any], ray.ObjectRef]] = {}
        self._install_version = 0
        self.on_bytes: Callable[[str, int], None] | None = None  # ("broadcast" | "upload", bytes): dashboard metrics
        self._run = run
        self._namespace = namespace
        self._nodes: dict[int, str] = {}  # client -> node id of its actor (asked once; again after a restart)
        self._aggregators: dict[str, Any] = {}  # node id -> its NodeAggregator (per_node), created on first use
        self._dead_folds: set[str] = set()  # hex ids of aggregator calls that died: their clients are read flat

    @property
    def client_ids(self) -> list[int]:
        return sorted(self._clients)

    def handle(self, client_id: int) -> Any:
        return self._clients[client_id]

    def put(self, obj: Any) -> ray.ObjectRef:
        if self.on_bytes is not None:
            self.on_bytes("broadcast", count_nbytes(obj))
        return ray.put(obj)

    def get(self, ref: Any) -> Any:
        return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref

    def _on_install(self) -> None:
        self._install_refs = {c: (step, ray.put(arg)) for c, (step, arg) in self._installed.items()}
        self._install_version += 1

    # -- submission ------------------------------------------------------------------------------------------------

    def _submit(self, call: Call) -> _Slot:
        return self._submit_many([call])[0]

    def _submit_many(self, calls: list[Call]) -> list[_Slot]:
        """One ``run_many`` per actor; object references among the top-level arguments travel as top-level arguments
        of that call (deduplicated), so Ray resolves each once per actor."""
        groups: dict[Any, list[int]] = {}
        for position, call in enumerate(calls):
            handle = self._clients[call.client]
            groups.setdefault(getattr(handle, "_actor_id", id(handle)), []).append(position)  # clients sharing an actor
        slots: list[_Slot | None] = [None] * len(calls)
        for positions in groups.values():
            args = _Refs()
            slot_for = args.slot
            specs = [
                (
                    calls[p].client,
                    calls[p].step,
                    tuple(slot_for(a) for a in calls[p].args),
                    {k: slot_for(v) for k, v in calls[p].kwargs.items()},
                )
                for p in positions
            ]
            hosted = sorted({calls[p].client for p in positions})
            installs = [
                (c, self._install_refs[c][0], slot_for(self._install_refs[c][1]), self._install_version)
                for c in hosted
                if c in self._install_refs
            ]
            reducer = calls[positions[0]].reducer  # the calls of one map share it (a retry runs alone, without one)
            extra = {"reducer": reducer} if reducer is not None else {}
            ref = self._clients[calls[positions[0]].client].run_many.remote(specs, *args.refs, installs=installs, **extra)
            for i, p in enumerate(positions):
                slots[p] = _Slot(ref, i)
        folding = [p for p, call in enumerate(calls) if call.reducer is not None and call.node_reducer is not None]
        if folding:
            self._fold_per_node(calls, slots, folding)  # type: ignore[arg-type]
        return slots  # type: ignore[return-value]

    # -- per-node partial sums (federation.aggregation: per_node) ----------------------------------------------------

    def client_nodes(self) -> dict[int, str]:
        """The node id of each client's actor (each actor asked once with ``ping``; again after it restarted). A
        client whose actor does not answer is left out (its calls are not folded per node)."""
        missing = [c for c in self._clients if c not in self._nodes]
        if missing:
            actors: dict[Any, list[int]] = {}
            for c in missing:
                actors.setdefault(self._clients[c], []).append(c)
            pings = []
            for handle, hosted in actors.items():  # all at once, then each reply
                try:
                    pings.append((handle.ping.remote(), hosted))
                except Exception:  # a handle without ping (a stand-in): its clients are not located, so not folded per node
                    continue
            for ping, hosted in pings:
                try:
                    node = ray.get(ping, timeout=self._restart_timeout_s)["node_id"]
                except Exception:  # a dead or restarting actor: asked again next round
                    continue
                self._nodes.update({c: node for c in hosted})
        return dict(self._nodes)

    def _aggregator(self, node: str) -> Any:
        """This run's aggregator actor on ``node``, created (pinned there, owned by the coordinator) on first use."""
        if node not in self._aggregators:
            self._aggregators[node] = (
                ray.remote(NodeAggregator)
                .options(
                    name=aggregator_name(self._run, node),
                    namespace=self._namespace,
                    get_if_exists=True,
                    num_cpus=0,  # it folds while the node's clients wait for the next round: no CPU reserved
                    max_restarts=0,  # a dead aggregator's node is read flat (an event says so); the next round makes a new one
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
                )
                .remote()
            )
        return self._aggregators[node]

    def _fold_per_node(self, calls: list[Call], slots: list[_Slot], folding: list[int]) -> None:
        """Hand each node's actor calls to that node's aggregator: the folding calls' slots point at its call, with
        the actor call's slot kept as ``origin``. Calls of a client whose node is unknown stay as they are (flat)."""
        nodes = self.client_nodes()
        by_node: dict[str, list[int]] = {}
        for p in folding:
            if calls[p].client in nodes:
                by_node.setdefault(nodes[calls[p].client], []).append(p)
        for node, positions in by_node.items():
            actor_calls, resolved = _Refs(), _Refs()  # the actor calls' results (read by the aggregator as they finish)
            specs = []
            for p in positions:
                position = actor_calls.position(slots[p].ref)
                specs.append((calls[p].client, position, slots[p].index, tuple(resolved.slot(a) for a in calls[p].args)))
            fold_ref = self._aggregator(node).fold.remote(calls[positions[0]].node_reducer, specs, actor_calls.refs, *resolved.refs)
            for i, p in enumerate(positions):
                slots[p] = _Slot(fold_ref, i, origin=slots[p], node=node)

    # -- waiting and results ---------------------------------------------------------------------------------------

    def _wait(self, handles: list[_Slot], timeout: float | None, *, one: bool = False) -> list[_Slot]:
        refs = list(dict.fromkeys(slot.ref for slot in handles))
        want = 1
        if one and self.fetch_bytes > 0 and self._reply_bytes > 0:
            # as many finished calls as one fetch can take at the last reply's size: waiting on 100 references once
            # instead of 100 times (the deadline still ends the wait; what is fetched is still capped by the budget)
            want = max(1, min(len(refs), self.fetch_bytes // self._reply_bytes))
        ready, rest = ray.wait(refs, num_returns=want, timeout=timeout)
        if ready and rest and (not one or self.fetch_bytes > 0):  # everything else already done, without waiting
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        if one:  # streaming: the finished actor calls whose results fit the fetch budget (at least one)
            ready = self._within_budget(ready)
        # One ray.get for every ready actor call (one round trip, not one per client); if any failed, _result fetches
        # each again and classifies the failure.
        try:
            self._fetched = dict(zip(ready, ray.get(ready)))
        except Exception:
            self._fetched = {}
        done = set(ready)
        return [slot for slot in handles if slot.ref in done]

    def _finished(self, handles: list[_Slot]) -> list[_Slot]:
        refs = list(dict.fromkeys(slot.ref for slot in handles))
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        arrived = set(done)
        return [slot for slot in handles if slot.ref in arrived]

    def _within_budget(self, ready: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """The first of ``ready`` and, after it, each other whose result still fits ``fetch_bytes`` with those taken
        (sizes as this process's core worker records them for the calls it submitted: no round trip); a result of
        unknown size waits for a later wake-up. The others stay pending and are taken at the next wake-up, at once."""
        if self.fetch_bytes <= 0:
            return ready[:1]
        sizes = {ref: (entry or {}).get("object_size") for ref, entry in get_local_object_locations(ready).items()}
        first = sizes.get(ready[0])
        self._reply_bytes = int(first or 0)
        if first is None or first > self.fetch_bytes:
            return ready[:1]  # a large reply alone: never more than one of them in hand
        taken, total = [ready[0]], first
        for ref in ready[1:]:
            size = sizes.get(ref)
            if size is not None and total + size <= self.fetch_bytes:
                taken.append(ref)
                total += size
        return taken

    def _result(self, handle: _Slot) -> Any:
        if handle.origin is not None and handle.ref.hex() in self._dead_folds:
            return self._result(handle.origin)  # this node's aggregator died: its clients' replies are read flat
        results = self._fetched.get(handle.ref)
        if results is None:
            try:
                results = ray.get(handle.ref)
            except RayTaskError as exc:  # the batch itself failed (e.g. a step that cannot be unpickled)
                cause = exc.cause if exc.cause is not None else exc
                raise ClientFailed(ClientError(-1, "error", f"{type(cause).__name__}: {cause}")) from None
            except RayActorError as exc:
                if handle.origin is not None:  # the node's aggregator died, not the client: fall back to flat
                    self._dead_folds.add(handle.ref.hex())
                    self._aggregators.pop(handle.node or "", None)  # the next round creates a new one there
                    self.events.emit(
                        "aggregation",
                        f"a node aggregator died ({type(exc).__name__}); its node's replies are folded by the coordinator "
                        "this round (flat)",
                        mode="flat",
                    )
                    return self._result(handle.origin)
                raise ClientFailed(ClientError(-1, "died", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")) from None
            ok, value = results[handle.index]
        else:
            # Handed out once: drop this federation's reference to the value (ray.get gave a list of our own), and to
            # the actor call's results once every slot of it is out, so a consumer that drops the value frees it (its
            # object store copy too).
            ok, value = results[handle.index]
            results[handle.index] = (ok, None)
            if all(v is None for _, v in results):
                del self._fetched[handle.ref]
        del results
        if not ok:
            kind, message = value if isinstance(value, tuple) else ("error", value)  # ("died", ...): from a node aggregator
            raise ClientFailed(ClientError(-1, kind, message))
        if self.on_bytes is not None:
            self.on_bytes("upload", count_nbytes(value))
        return value

    def _on_timeout(self, handle: _Slot) -> None:
        for slot in (handle, handle.origin):
            if slot is None:
                continue
            try:
                ray.cancel(slot.ref)
            except Exception:  # cancelling a running sync actor task is not supported; the result is ignored anyway
                pass

    def _before_retry(self, call: Call, error: ClientError) -> None:
        """After a crash, wait until Ray has restarted the actor (its constructor reloads the shards)."""
        if error.kind == "died":
            self._await_restart(call.client)

    def _after_drop(self, error: ClientError) -> None:
        """A crashed client was dropped: wait for Ray's restart of its actor and record it, as a retry does."""
        if error.kind == "died":
            self._await_restart(error.client)

    def _await_restart(self, client: int) -> None:
        """Wait (at most ``restart_timeout_s``) until Ray has restarted ``client``'s crashed actor; record the restart
        (``client_restarted``) or that it has no restarts left (``client_dead``)."""
        deadline = time.monotonic() + self._restart_timeout_s
        actor = self._clients[client]
        self._nodes = {c: n for c, n in self._nodes.items() if self._clients[c] is not actor}  # it may restart elsewhere
        while time.monotonic() < deadline:
            try:
                ray.get(self._clients[client].ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except ActorUnavailableError:
                time.sleep(0.5)  # still restarting
                continue
            except ActorDiedError:
                self.events.emit("client_dead", "actor died with no restarts left", client=client)
                return
            except (GetTimeoutError, RayActorError):
                return  # not back in time: a later call fails and the policy goes on
            self.events.emit("client_restarted", "actor restarted by Ray; shard reloaded", client=client)
            return

    def parallel_width(self) -> int:
        """Tasks of ``parallel_map`` that run at once: the cluster's CPUs over the CPUs each task requests."""
        return max(1, int(ray.cluster_resources().get("CPU", 1) // self._task_cpus))

    def parallel_map(self, fn: Callable[[Any], T], items: Sequence[Any], *, chunk_size: int | None = None) -> list[T]:
        items = list(items)
        if not items:
            return []
        if chunk_size is None:
            chunk_size = max(1, math.ceil(len(items) / (2 * self.parallel_width())))
        refs = [self._task.remote(fn, items[i : i + chunk_size]) for i in range(0, len(items), chunk_size)]
        return [value for chunk in ray.get(refs) for value in chunk]
