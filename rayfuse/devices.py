"""Where torch work runs: the one place a process's torch device is chosen.

A Ray actor with GPUs assigned (``federation.clients.num_gpus``, ``federation.client_overrides.<i>.num_gpus``,
``federation.coordinator.num_gpus``, fractions included) sees only those GPUs: Ray sets ``CUDA_VISIBLE_DEVICES`` to
their ids before the actor's process imports torch, so the first visible one is ``cuda:0``. The Ray layer passes the
ids it was given (``ray.get_gpu_ids()``) to :func:`assigned_device`; the core never asks Ray itself. Everything else
(the clients' steps, the coordinator's cost matrices, merges and distillation) receives the device string chosen here.

This module does not import torch at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["assigned_device", "is_cuda", "to_device", "to_numpy"]


def assigned_device(gpu_ids: Sequence[Any], *, cuda_available: bool | None = None) -> str:
    """The torch device of a process that was assigned ``gpu_ids`` (Ray's ``ray.get_gpu_ids()``; empty: none).

    ``"cuda:0"`` when it has a GPU and torch can use it, else ``"cpu"``. ``cuda_available`` stands in for
    ``torch.cuda.is_available()`` (tests); ``None`` asks torch, which is imported only when ``gpu_ids`` is not empty.
    A process that was given a GPU its torch build cannot use (a CPU-only wheel) runs on the CPU: the work is the same,
    only slower.
    """
    if not gpu_ids:
        return "cpu"
    if cuda_available is None:
        import torch

        cuda_available = bool(torch.cuda.is_available())
    # Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU(s): the first of them is device 0 in this process. With several
    # GPUs assigned to one actor, its torch work runs on the first (rayfuse's steps use one device per process).
    return "cuda:0" if cuda_available else "cpu"


def is_cuda(device: Any) -> bool:
    """Whether ``device`` (a string, a ``torch.device`` or ``None``) names a CUDA device."""
    return device is not None and str(device).startswith("cuda")


def to_device(array: Any, device: Any, dtype: Any = None) -> Any:
    """``array`` (numpy or a tensor) as a torch tensor on ``device``; a tensor already there (with that dtype) is returned
    as it is, a CPU numpy array is shared, not copied, when ``device`` is the CPU."""
    import torch

    if isinstance(array, torch.Tensor):
        return array.to(device=device, dtype=dtype)
    return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)


def to_numpy(tensor: Any) -> np.ndarray:
    """A tensor on any device as a CPU numpy array of its own (what a step returns: nothing of it stays on the device)."""
    return tensor.detach().cpu().numpy().copy(order="C")
