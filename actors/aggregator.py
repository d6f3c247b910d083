"""``NodeAggregator``: the actor that folds one node's client replies (``federation.aggregation: per_node``).

One per node that hosts clients, named ``<run>/aggregator-<node>`` and pinned to that node
(``NodeAffinitySchedulingStrategy(node_id, soft=False)``); created by :class:`actors.federation.RayFederation` the
first time a round is folded per node, owned by the coordinator actor, so it ends with the run. Each round it is
handed the object references of its node's client actor calls (each a per-actor partial sum and the ``Folded``
markers of the actor's other clients, or the failures), fetches them from its own node's object store as they finish
and folds them with the round's reducer (:class:`rayfuse.updates.streaming.NodeFold`: the same running sum). It
returns one entry per client: the first client that returned carries the node's partial sum, the others a marker,
and a failed client its failure (``("died", message)`` when its actor died), which the coordinator's failure policy
handles as on the flat path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from rayfuse.federation import Reducer, reduce_replies

__all__ = ["NodeAggregator", "aggregator_name"]


def aggregator_name(run: str, node_id: str) -> str:
    """``<run>/aggregator-<node>``: the node id's first 12 hex digits, as the dashboard abbreviates node ids."""
    return f"{run}/aggregator-{node_id[:12]}"


class NodeAggregator:
    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def fold(
        self, reducer: Reducer, specs: Sequence[tuple[int, int, int, tuple]], refs: Sequence[ray.ObjectRef], *resolved: Any
    ) -> list[tuple[bool, Any]]:
        """Fold the replies of this node's clients. ``specs``: per client call ``(client, i, index, args)``: its
        result is entry ``index`` of ``refs[i]`` (an actor call's result list; passed inside a list, so Ray does not
        resolve them before this runs: each is fetched as it finishes, and one actor's failure fails its clients
        alone); ``args``: the call's positional arguments, where ``RefArg(j)`` stands for ``resolved[j]`` (the
        broadcast model, resolved here from this node's store)."""
        from actors.client import RefArg

        by_ref: dict[int, list[int]] = {}
        for position, (_, i, _, _) in enumerate(specs):
            by_ref.setdefault(i, []).append(position)
        order: list[int] = []

        def outcomes() -> Iterator[tuple[int, bool, Any, tuple]]:
            # in the order the actors finish, one actor's results in hand at a time (the reducer folds each reply
            # before it asks for the next)
            waiting = {refs[i]: i for i in by_ref}
            while waiting:
                ready, _ = ray.wait(list(waiting), num_returns=1)
                i = waiting.pop(ready[0])
                failed: Any = None
                try:
                    results = ray.get(ready[0])
                except RayActorError as exc:
                    failed, results = ("died", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"), None
                except RayTaskError as exc:  # the batch itself failed (e.g. a step that cannot be unpickled)
                    cause = exc.cause if exc.cause is not None else exc
                    failed, results = f"{type(cause).__name__}: {cause}", None
                except Exception as exc:  # the result was lost (its node failed...): its clients failed this call
                    failed, results = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", None
                for position in by_ref[i]:
                    client, _, index, args = specs[position]
                    ok, value = (False, failed) if results is None else results[index]
                    if results is not None:
                        results[index] = (ok, None)
                    order.append(position)
                    yield client, ok, value, tuple(resolved[a.index] if isinstance(a, RefArg) else a for a in args)
                    del value
                del results

        folded = reduce_replies(reducer, outcomes())
        out: list[tuple[bool, Any]] = [(False, "not folded")] * len(specs)
        for position, entry in zip(order, folded):
            out[position] = entry
        return out
