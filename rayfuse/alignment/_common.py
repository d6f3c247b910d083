"""Helpers shared by the alignment modules: checking model lists and weights, torch devices, passes over data."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

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


def param_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first floating-point parameter (float32 if it has none): what its inputs are cast to."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def batches(X: np.ndarray, batch_size: int, dtype: torch.dtype, dev: torch.device) -> Iterator[torch.Tensor]:
    """``X`` in batches of ``batch_size`` rows as tensors on ``dev``. Raises :class:`InputError` for a batch size below 1."""
    if batch_size < 1:
        raise InputError("batch_size", "at least 1", batch_size)
    return (torch.as_tensor(np.asarray(X[lo : lo + batch_size]), dtype=dtype, device=dev) for lo in range(0, len(X), batch_size))


@contextmanager
def evaluating(model: torch.nn.Module, dev: torch.device, handles: Sequence[torch.utils.hooks.RemovableHandle] = ()) -> Iterator[None]:
    """``model`` in eval mode on ``dev`` for a pass over data; afterwards ``handles`` removed, every module's mode restored
    and the model moved back where it was."""
    modes = [(m, m.training) for m in model.modules()]
    place = next((p.device for p in model.parameters()), dev)
    try:
        model.eval().to(dev)
        yield
    finally:
        for h in handles:
            h.remove()
        for module, mode in modes:
            module.train(mode)
        model.to(place)


class ChannelMoments:
    """Per name, the running count, sum and sum of squares of each channel of the tensors added (float64)."""

    def __init__(self) -> None:
        self.sums: dict[str, list[torch.Tensor]] = {}
        self.counts: dict[str, float] = {}

    def add(self, name: str, x: torch.Tensor, channel_dim: int) -> None:
        """Add every value of ``x`` to its channel (axis ``channel_dim``)."""
        rows = x.detach().to(torch.float64).movedim(channel_dim, -1)
        rows = rows.reshape(-1, rows.shape[-1])
        parts = [rows.sum(0), (rows * rows).sum(0)]
        self.sums[name] = [a + b for a, b in zip(self.sums[name], parts)] if name in self.sums else parts
        self.counts[name] = self.counts.get(name, 0.0) + float(rows.shape[0])

    def result(self) -> dict[str, tuple[float, np.ndarray, np.ndarray]]:
        """Per name, ``(count, mean, var)``: the number of values per channel, their mean and population variance."""
        out = {}
        for name, (total, squares) in self.sums.items():
            n = self.counts[name]
            mean = (total / n).cpu().numpy()
            out[name] = (n, mean, np.maximum((squares / n).cpu().numpy() - mean**2, 0.0))
        return out
