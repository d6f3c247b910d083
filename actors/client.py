"""``ClientActor``: a long-lived Ray actor around :class:`rayfuse.client.Client`.

A plain class, wrapped with ``ray.remote(...)`` where it is created (``actors.backend``), named
``<run>/client-<i>``. Its constructor loads the client's own shard; when the actor dies Ray restarts it
(``max_restarts``), which re-runs the constructor: the shard is reloaded deterministically and the local model is
retrained on demand with the same seeds. With a GPU assigned (``num_gpus > 0``) torch work runs on it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Sequence

import ray

from rayfuse.client import Client
from rayfuse.data.roles import ClientPlan

__all__ = ["ClientActor"]


def _assigned_device() -> str:
    if ray.get_gpu_ids():
        import torch

        if torch.cuda.is_available():
            return "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU(s)
    return "cpu"


class ClientActor:
    def __init__(self, client_id: int, plan: ClientPlan, *, data_cfg: Any, model_cfg: Any, train_cfg: Any, seed: int,
                 faults: Sequence[Any] = ()) -> None:
        with warnings.catch_warnings():  # Ray's own accessor warns about its internals
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.client = Client(client_id, plan, data_cfg=data_cfg, model_cfg=model_cfg, train_cfg=train_cfg, seed=seed,
                             device=_assigned_device(), faults=faults, restarted=restarted, die=lambda: os._exit(1))

    def run(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.client.run(step, *args, **kwargs)

    def ping(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {**self.client.ping(), "node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
