"""``RayFederation``: the federation over ``ClientActor`` handles, used inside the coordinator actor.

* ``put`` is one ``ray.put``; the reference is passed to every client call, and Ray resolves it inside each client
  (zero-copy numpy on the same node).
* ``map`` submits ``ClientActor.run`` calls and keeps their ``ObjectRef`` s; ``gather`` waits with ``ray.wait`` and a
  deadline, then resolves the results in the coordinator: parameters never pass through the driver.
* A failed call is classified: ``RayTaskError`` -> ``error`` (the step raised), ``RayActorError`` -> ``died`` (Ray
  restarts the actor when it has restarts left); the policy in :class:`rayfuse.federation.Federation` decides.
* ``parallel_map`` fans server-side work out as Ray tasks, batched so each task carries many items.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from rayfuse.federation import Call, ClientError, ClientFailed, EventLog, FailurePolicy, Federation

__all__ = ["RayFederation"]

T = TypeVar("T")


def _apply_chunk(fn: Callable[[Any], T], chunk: Sequence[Any]) -> list[T]:
    return [fn(item) for item in chunk]


class RayFederation(Federation):
    """Parameters
    ----------
    clients : mapping of client id to ``ClientActor`` handle
    policy : FailurePolicy
    events : EventLog
    task_cpus : float
        CPUs each ``parallel_map`` task requests.
    """

    def __init__(self, clients: Mapping[int, Any], policy: FailurePolicy, events: EventLog | None = None, *, task_cpus: float = 1.0,
                 restart_timeout_s: float = 300.0) -> None:
        super().__init__(policy, events)
        self._clients = dict(clients)
        self._restart_timeout_s = restart_timeout_s
        self._fetched: dict[Any, Any] = {}
        self._task = ray.remote(num_cpus=task_cpus)(_apply_chunk)
        self.bytes_put = 0

    @property
    def client_ids(self) -> list[int]:
        return sorted(self._clients)

    def handle(self, client_id: int) -> Any:
        return self._clients[client_id]

    def put(self, obj: Any) -> ray.ObjectRef:
        return ray.put(obj)

    def get(self, ref: Any) -> Any:
        return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref

    def _submit(self, call: Call) -> ray.ObjectRef:
        return self._clients[call.client].run.remote(call.step, *call.args, **call.kwargs)

    def _wait(self, handles: list[Any], timeout: float | None) -> list[Any]:
        ready, rest = ray.wait(handles, num_returns=1, timeout=timeout)
        if ready and rest:  # collect everything else that is already done, without waiting
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        # One ray.get for every ready result (one round trip instead of one per client); if any of them failed, the
        # per-handle path in _result fetches each again and classifies the failure.
        try:
            self._fetched = dict(zip(ready, ray.get(ready)))
        except Exception:
            self._fetched = {}
        return ready

    def _result(self, handle: ray.ObjectRef) -> Any:
        if handle in self._fetched:
            return self._fetched.pop(handle)
        try:
            return ray.get(handle)
        except RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise ClientFailed(ClientError(-1, "error", f"{type(cause).__name__}: {cause}")) from None
        except RayActorError as exc:
            raise ClientFailed(ClientError(-1, "died", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")) from None
        except GetTimeoutError as exc:  # pragma: no cover - ray.wait said it was ready
            raise ClientFailed(ClientError(-1, "timeout", str(exc))) from None

    def _on_timeout(self, handle: Any) -> None:
        try:
            ray.cancel(handle)
        except Exception:  # cancelling a running sync actor task is not supported; the result is ignored anyway
            pass

    def _before_retry(self, call: Call, error: ClientError) -> None:
        """After a crash, wait until Ray has restarted the actor (its constructor reloads the shard)."""
        if error.kind != "died":
            return
        deadline = time.monotonic() + self._restart_timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(self._clients[call.client].ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except ActorUnavailableError:
                time.sleep(0.5)  # still restarting
                continue
            except (ActorDiedError, GetTimeoutError, RayActorError):
                return  # gone for good (restarts exhausted) or not back in time: the retry fails and the policy goes on
            self.events.emit("client_restarted", "actor restarted by Ray; shard reloaded", client=call.client)
            return

    def parallel_map(self, fn: Callable[[Any], T], items: Sequence[Any], *, chunk_size: int | None = None) -> list[T]:
        items = list(items)
        if not items:
            return []
        if chunk_size is None:
            cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
            chunk_size = max(1, math.ceil(len(items) / (2 * cpus)))
        refs = [self._task.remote(fn, items[i:i + chunk_size]) for i in range(0, len(items), chunk_size)]
        return [value for chunk in ray.get(refs) for value in chunk]
