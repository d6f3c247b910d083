"""Helpers shared by the alignment modules: checking model lists and weights, torch devices."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from rayfuse.errors import InputError

Params = dict[str, np.ndarray]


def sorted_unit_rows(views: Sequence[torch.Tensor], *, extremes: int | None = None) -> torch.Tensor:
    """Each unit's values along each of a group's axes (``views``: one ``(units, rest)`` matrix per axis), sorted, side
    by side: invariant to the permutations of every other group. ``extremes``: for rows longer than twice this, only
    the ``extremes`` largest and smallest values (a tenth of a full sort's cost on a resnet)."""
    parts = []
    for rows in views:
        if extremes is None or rows.shape[1] <= 2 * extremes:
            parts.append(torch.sort(rows, dim=1).values)
        else:
            parts += [torch.topk(rows, extremes, dim=1).values, torch.topk(rows, extremes, dim=1, largest=False).values]
    return torch.cat(parts, dim=1)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a :class:`torch.device` (``None``: the CPU)."""
    return torch.device("cpu") if device is None else torch.device(device)


def normalize_weights(weights: Sequence[float] | None, n: int, *, where: str = "weights") -> np.ndarray:
    """``n`` non-negative weights summing to one (``None``: equal weights). Raises :class:`InputError`."""
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != (n,):
        raise InputError(where, f"one weight per model ({n})", len(w))
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise InputError(where, "finite non-negative weights with a positive sum", w.tolist())
    return w / w.sum()


def check_models(models: Sequence[Mapping[str, np.ndarray]], *, where: str = "models") -> None:
    """At least one model, all with the keys and shapes of the first. Raises :class:`InputError`."""
    if len(models) == 0:
        raise InputError(where, "at least one model", 0)
    first = models[0]
    for k, model in enumerate(models[1:], start=1):
        if set(model) != set(first):
            missing = sorted(set(first) ^ set(model))
            raise InputError(f"{where}.{k}", "the state-dict keys of model 0", missing[:3])
        for key, value in model.items():
            if np.shape(value) != np.shape(first[key]):
                raise InputError(f"{where}.{k}.{key}", f"shape {tuple(np.shape(first[key]))} (as in model 0)", tuple(np.shape(value)))


def weighted_average(models: Sequence[Mapping[str, np.ndarray]], w: np.ndarray, keys: Sequence[str] | None = None) -> Params:
    """The ``w``-weighted average of ``models`` (float tensors in float64 then cast back; others: model 0's)."""
    out: Params = {}
    for key in keys if keys is not None else list(models[0]):
        first = np.asarray(models[0][key])
        if first.dtype.kind not in "fc":
            out[key] = first
            continue
        total = np.zeros(first.shape, dtype=np.float64)
        for weight, model in zip(w, models):
            if weight:
                total += weight * np.asarray(model[key], dtype=np.float64)
        out[key] = total.astype(first.dtype, copy=False)
    return out
