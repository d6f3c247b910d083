"""``ClientActor``: a long-lived Ray actor hosting :class:`rayfuse.client.Client` s.

A plain class, wrapped with ``ray.remote(...)`` where it is created (``actors.backend``). By default it hosts one
client and is named ``<run>/client-<i>``: the deployment model, one process per data owner. With
``federation.clients_per_actor > 1`` (simulation) it hosts several, named ``<run>/clients-<i>-<j>``: their steps run
one after another in the shared process, which saves Ray's per-call cost when many clients share few cores.

Its constructor loads each hosted client's own shard; when the actor dies Ray restarts it (``max_restarts``), which
re-runs the constructor: the shards are reloaded deterministically and local models are retrained on demand with the
same seeds. What the constructor's arguments do not hold (the silo plan completed by the survey: the federated
standardisation) comes with every call (``installs``), and a restarted actor installs it before running anything
else. With a GPU assigned (``num_gpus > 0``) torch work runs on it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rayfuse.client import Client
from rayfuse.data.roles import ClientPlan, load_dataset_from_config
from rayfuse.devices import assigned_device
from rayfuse.errors import InputError
from rayfuse.federation import Reducer, reduce_replies

__all__ = ["ClientActor", "RefArg", "actor_name"]


@dataclass(frozen=True)
class RefArg:
    """Placeholder, in a batched call, for the ``index``-th object reference passed to :meth:`ClientActor.run_many`
    as a top-level argument (so Ray resolves and prefetches it, once for all the calls that share it)."""

    index: int


def actor_name(run: str, client_ids: Sequence[int]) -> str:
    return f"{run}/client-{client_ids[0]}" if len(client_ids) == 1 else f"{run}/clients-{client_ids[0]}-{client_ids[-1]}"


def _assigned_device() -> str:
    """This actor's torch device: ``cuda:0`` when Ray assigned it a GPU (or a fraction of one), else the CPU."""
    return assigned_device(ray.get_gpu_ids())


class ClientActor:
    """Parameters
    ----------
    members : sequence of (client id, ClientPlan)
        The clients this actor hosts, each with its own plan (and nothing about the others).
    data_cfg, model_cfg, train_cfg, seed, faults
        As for :class:`rayfuse.client.Client`; ``model_cfg`` is the model of every hosted client not in ``client_models``.
    client_models : mapping of client id to ModelConfig, optional
        The hosted clients with a model of their own (``federation.client_overrides.<i>.model``).
    """

    def __init__(
        self,
        members: Sequence[tuple[int, ClientPlan]],
        *,
        data_cfg: Any,
        model_cfg: Any,
        train_cfg: Any,
        seed: int,
        faults: Sequence[Any] = (),
        local_cache: str | None = None,
        client_models: Mapping[int, Any] | None = None,
    ) -> None:
        with warnings.catch_warnings():  # Ray's own accessor warns about its internals
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.restarted = restarted
        self._installed: dict[int, int] = {}  # client id -> the install version it ran in this actor's life
        device = _assigned_device()
        # Bad input found here (a silo missing on this node, an ImageFolder without images) is kept and raised by
        # ping: the driver then receives the InputError itself (one line), not the traceback of a dead actor.
        self._startup_error: InputError | None = None
        self.clients: dict[int, Client] = {}
        try:
            dataset = load_dataset_from_config(data_cfg) if len(members) > 1 else None
            self.clients = {
                client_id: Client(
                    client_id,
                    plan,
                    data_cfg=data_cfg,
                    model_cfg=(client_models or {}).get(client_id, model_cfg),
                    train_cfg=train_cfg,
                    seed=seed,
                    device=device,
                    faults=faults,
                    restarted=restarted,
                    die=lambda: os._exit(1),
                    dataset=dataset,
                    local_cache=local_cache,
                )
                for client_id, plan in members
            }
        except InputError as exc:
            self._startup_error = exc

    def run_many(
        self,
        calls: Sequence[tuple[int, Callable[..., Any], tuple, dict]],
        *refs: Any,
        installs: Sequence[tuple[int, Callable[..., Any], RefArg, int]] = (),
        reducer: Reducer | None = None,
    ) -> list[tuple[bool, Any]]:
        """Run ``(client id, step, args, kwargs)`` calls in order; ``refs`` are the resolved :class:`RefArg` values.

        ``installs`` are ``(client id, step, argument, version)``: state each hosted client must hold
        (:meth:`rayfuse.federation.Federation.install`). An actor Ray restarted runs each such step once per version
        before the calls (an actor that never restarted ran it as an ordinary call already).

        Returns ``(True, value)`` or ``(False, "ErrorType: message")`` per call: one client's failing step does not
        fail the others hosted here. With a ``reducer`` (:meth:`rayfuse.federation.Federation.map_reduced`) the
        successful values are folded here into one (:func:`rayfuse.federation.reduce_replies`): the first carries it,
        the others a ``Folded`` marker, so one value leaves this process instead of one per client.
        """
        failed: dict[int, str] = {}
        for client_id, step, arg, version in installs:
            if not self.restarted or self._installed.get(client_id) == version or client_id not in self.clients:
                continue
            try:
                self.clients[client_id].run(step, refs[arg.index])
                self._installed[client_id] = version
            except Exception as exc:  # this client's calls fail; the federation's failure policy decides
                failed[client_id] = f"{type(exc).__name__}: restarted, could not take back the run's state: {exc}"

        def outcomes() -> Iterator[tuple[int, bool, Any, tuple]]:
            for client_id, step, args, kwargs in calls:
                if client_id in failed:
                    yield client_id, False, failed[client_id], ()
                    continue
                args = tuple(refs[a.index] if isinstance(a, RefArg) else a for a in args)
                kwargs = {k: refs[v.index] if isinstance(v, RefArg) else v for k, v in kwargs.items()}
                try:
                    outcome: tuple[bool, Any] = (True, self.clients[client_id].run(step, *args, **kwargs))
                except Exception as exc:  # reported per call, classified by the federation's failure policy
                    outcome = (False, f"{type(exc).__name__}: {exc}")
                yield client_id, outcome[0], outcome[1], args
                del outcome

        if reducer is not None:  # each reply folded as soon as its step returns: one reply in hand at a time
            return reduce_replies(reducer, outcomes())
        return [(ok, value) for _, ok, value, _ in outcomes()]

    def ping(self) -> dict[str, Any]:
        if self._startup_error is not None:
            raise self._startup_error
        ctx = ray.get_runtime_context()
        return {
            "clients": sorted(self.clients),
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "devices": sorted({c.ctx.device for c in self.clients.values()}),  # where the hosted clients' torch work runs
            "restarted": any(c.restarted for c in self.clients.values()),
        }
