"""Merges of fine-tunes of one base model, one tensor at a time, as mergekit computes them.

One implementation per idea. A task-vector merge (:func:`task_vector_merge`) is

    delta_i = x_i - base                                    (the task vectors)
    delta_i = sparsify(delta_i, density_i)                  (none | magnitude top-k: TIES | random drop: DARE)
    mask_i  = sign(w_i delta_i) == sign(sum_j w_j delta_j)  (consensus: none | sign election, TIES's "sum" method)
    merged  = sum_i mask_i w_i delta_i / (sum_i mask_i w_i)  (the divisor only with normalize; 0 -> 1)
    out     = base + lambda * merged

and ``task_arithmetic``, ``ties``, ``dare_linear`` and ``dare_ties`` are rows of :data:`TASK_VECTOR_METHODS` (which
sparsifier, which consensus rule, and mergekit's defaults for ``normalize`` and ``rescale``). :func:`linear` is
mergekit's ``linear`` (the weighted average of the models themselves) and :func:`slerp` its spherical interpolation
with the colinear fallback to ``lerp``. Everything is computed on float32 tensors (the caller upcasts); the operations
and their order follow mergekit (the repository and commit are in docs/references.md) so that the same inputs give the
same tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from rayfuse.finetunes.config import TASK_VECTOR_METHODS, TaskVectorMethod

__all__ = [
    "TaskVectorMethod",
    "TASK_VECTOR_METHODS",
    "sparsify_magnitude",
    "sparsify_random",
    "rescale_masked",
    "sign_consensus",
    "task_vector_merge",
    "linear",
    "slerp",
]

Rescale = Literal["l1", "density"] | None


def rescale_masked(tensor: torch.Tensor, mask: torch.Tensor, rescale: Rescale, density: float, eps: float = 1e-7) -> torch.Tensor:
    """``tensor * mask``, rescaled: ``"l1"`` to the L1 norm ``tensor`` had (mergekit's ``rescale: true``; left as
    masked when either norm is below ``eps``), ``"density"`` by ``1 / density`` (the DARE paper's rescale, which keeps
    each entry's expectation), ``None`` not at all."""
    masked = tensor * mask
    if rescale is None:
        return masked
    if rescale == "density":
        return masked / density
    before, after = tensor.abs().sum(), masked.abs().sum()
    if before < eps or after < eps:
        return masked
    return masked * (before / after)


def sparsify_magnitude(delta: torch.Tensor, density: float, rescale: Rescale = None) -> torch.Tensor:
    """TIES's trim: keep the ``int(density * numel)`` entries of largest magnitude (ties broken as torch's argsort
    breaks them, as in mergekit), zero the rest."""
    if density >= 1:
        return delta
    k = int(density * delta.numel())
    mask = torch.zeros_like(delta)
    if k > 0:  # mergekit asserts k > 0; here a tensor too small to keep one entry at this density contributes nothing
        top = torch.argsort(delta.abs().reshape(-1).float(), descending=True)[:k]
        mask.view(-1)[top] = 1
    return rescale_masked(delta, mask, rescale, density)


def sparsify_random(delta: torch.Tensor, density: float, generator: torch.Generator, rescale: Rescale = None) -> torch.Tensor:
    """DARE's drop: keep each entry with probability ``density`` (a Bernoulli mask drawn from ``generator``), then
    rescale."""
    if density >= 1:
        return delta
    mask = torch.bernoulli(torch.full_like(delta, density, dtype=torch.float32), generator=generator)
    return rescale_masked(delta.to(torch.float32), mask, rescale, density).to(delta.dtype)


def sign_consensus(weighted: torch.Tensor) -> torch.Tensor:
    """TIES's sign election (mergekit's ``sum`` method): the elected sign of each entry is the sign of the sum of the
    weighted task vectors (``>= 0``: positive); a task vector's entry agrees when its sign is that sign (a zero entry
    never agrees). ``weighted``: the stacked weighted task vectors, models first. Returns the boolean mask."""
    sign = weighted.sign()
    majority = (weighted.sum(dim=0) >= 0).to(weighted.dtype) * 2 - 1
    return sign == majority


def task_vector_merge(
    base: torch.Tensor,
    tuned: Sequence[torch.Tensor],
    weights: Sequence[float],
    densities: Sequence[float],
    method: TaskVectorMethod,
    *,
    normalize: bool,
    lam: float = 1.0,
    rescale: Rescale = None,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """``base + lambda * combine(sparsify(x_i - base))`` (the module docstring), for float32 tensors of one shape.
    ``generators``: one per model, for the random sparsifier."""
    # the task vectors are written into one stacked tensor and weighted, masked in place: the same operations in the
    # same order as mergekit's (stack, * weights, * mask, sum), with fewer copies of the stack alive at once
    stacked = torch.empty((len(tuned), *base.shape), dtype=base.dtype)
    for i, (x, density) in enumerate(zip(tuned, densities)):
        delta = torch.sub(x.to(base.dtype), base, out=stacked[i])
        if method.sparsify == "magnitude":
            stacked[i] = sparsify_magnitude(delta, density, rescale)
        elif method.sparsify == "random":
            if generators is None:
                raise ValueError("the random sparsifier needs one generator per model")
            stacked[i] = sparsify_random(delta, density, generators[i], rescale)
    w = torch.tensor(list(weights), dtype=stacked.dtype)
    while w.dim() < stacked.dim():
        w = w.unsqueeze(-1)
    weighted = stacked.mul_(w)
    if method.consensus:
        mask = sign_consensus(weighted)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
        mixed = weighted.mul_(mask).sum(dim=0)
        del mask
    else:
        mixed = weighted.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    del weighted, stacked
    if normalize:
        mixed = mixed / divisor
    if lam != 1:
        mixed = mixed * lam
    return (base + mixed).to(base.dtype)


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, normalize: bool = True) -> torch.Tensor:
    """mergekit's ``linear``: ``sum_i w_i x_i`` (divided by ``sum_i w_i`` with ``normalize``)."""
    stacked = torch.stack(list(tensors), dim=0)
    w = torch.tensor(list(weights), dtype=stacked.dtype)
    while w.dim() < stacked.dim():
        w = w.unsqueeze(-1)
    out = (w * stacked).sum(dim=0)
    if normalize:
        out = out / w.sum(dim=0)
    return out


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = 0.9995, eps: float = 1e-8) -> torch.Tensor:
    """Spherical interpolation from ``v0`` (``t = 0``) to ``v1`` (``t = 1``) of the two tensors seen as flat vectors;
    ``lerp`` when their directions are within ``arccos(dot_threshold)`` of colinear. Computed in numpy float32 as
    mergekit computes it, returned in ``v0``'s dtype."""
    a = v0.detach().cpu().float().numpy()
    b = v1.detach().cpu().float().numpy()
    a_dir, b_dir = _unit(a, eps), _unit(b, eps)
    dot = np.sum(a_dir * b_dir)
    if np.abs(dot) > dot_threshold:
        res = (1 - t) * a + t * b
    else:
        theta_0 = np.arccos(dot)
        sin_theta_0 = np.sin(theta_0)
        theta_t = theta_0 * t
        s0 = np.sin(theta_0 - theta_t) / sin_theta_0
        s1 = np.sin(theta_t) / sin_theta_0
        res = s0 * a + s1 * b
    return torch.from_numpy(np.asarray(res)).to(v0.dtype)


def _unit(v: np.ndarray, eps: float) -> np.ndarray:
    norm = np.linalg.norm(v)
    return v / norm if norm > eps else v
