"""``RayFederation``: the federation over ``ClientActor`` handles, used inside the coordinator actor.

* ``put`` is one ``ray.put``; the reference is passed to every client call as a top-level argument, so Ray resolves
  it inside each client actor (zero-copy numpy on the same node), once per actor.
* ``map`` sends one ``ClientActor.run_many`` call per actor with the calls of the clients it hosts (one call per
  client in the default one-client-per-actor layout) and keeps the ``ObjectRef`` s; ``gather`` waits with
  ``ray.wait`` and a deadline, then resolves the results in the coordinator: parameters never pass through the
  driver.
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
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from actors.client import RefArg
from rayfuse.federation import Call, ClientError, ClientFailed, EventLog, FailurePolicy, Federation, map_arrays

__all__ = ["RayFederation"]

T = TypeVar("T")


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


@dataclass(frozen=True)
class _Slot:
    """One client's call inside a batched actor call: the actor call's reference and the position of its result."""

    ref: ray.ObjectRef
    index: int


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
    """

    def __init__(
        self,
        clients: Mapping[int, Any],
        policy: FailurePolicy,
        events: EventLog | None = None,
        *,
        task_cpus: float = 1.0,
        restart_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(policy, events)
        self._clients = dict(clients)
        # Any: ray.remote's typed wrapper (its private RemoteFunction1) cannot carry _apply_chunk's type variable
        self._task: Any = ray.remote(num_cpus=task_cpus)(_apply_chunk)
        self._task_cpus = max(task_cpus, 1e-3)
        self._restart_timeout_s = restart_timeout_s
        self._fetched: dict[ray.ObjectRef, Any] = {}
        self._install_refs: dict[int, tuple[Callable[..., Any], ray.ObjectRef]] = {}
        self._install_version = 0
        self.on_bytes: Callable[[str, int], None] | None = None  # ("broadcast" | "upload", bytes): dashboard metrics

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
            refs: list[ray.ObjectRef] = []
            index: dict[ray.ObjectRef, int] = {}

            def slot_for(value: Any) -> Any:
                if isinstance(value, ray.ObjectRef):
                    if value not in index:
                        index[value] = len(refs)
                        refs.append(value)
                    return RefArg(index[value])
                return value

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
            ref = self._clients[calls[positions[0]].client].run_many.remote(specs, *refs, installs=installs, **extra)
            for i, p in enumerate(positions):
                slots[p] = _Slot(ref, i)
        return slots  # type: ignore[return-value]

    # -- waiting and results ---------------------------------------------------------------------------------------

    def _wait(self, handles: list[_Slot], timeout: float | None, *, one: bool = False) -> list[_Slot]:
        refs = list(dict.fromkeys(slot.ref for slot in handles))
        ready, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready and rest and not one:  # collect everything else that is already done, without waiting
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        # One ray.get for every ready actor call (one round trip, not one per client); if any failed, _result fetches
        # each again and classifies the failure. ``one`` (streaming): one actor call's results at a time.
        try:
            self._fetched = dict(zip(ready, ray.get(ready)))
        except Exception:
            self._fetched = {}
        done = set(ready)
        return [slot for slot in handles if slot.ref in done]

    def _result(self, handle: _Slot) -> Any:
        results = self._fetched.get(handle.ref)
        if results is None:
            try:
                results = ray.get(handle.ref)
            except RayTaskError as exc:  # the batch itself failed (e.g. a step that cannot be unpickled)
                cause = exc.cause if exc.cause is not None else exc
                raise ClientFailed(ClientError(-1, "error", f"{type(cause).__name__}: {cause}")) from None
            except RayActorError as exc:
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
            raise ClientFailed(ClientError(-1, "error", value))
        if self.on_bytes is not None:
            self.on_bytes("upload", count_nbytes(value))
        return value

    def _on_timeout(self, handle: _Slot) -> None:
        try:
            ray.cancel(handle.ref)
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
