"""Repairing a merged model's activation statistics: BatchNorm running statistics re-estimated on the clients' data.

Averaging aligned models shrinks the variance of their hidden units (Jordan et al. 2022, "REPAIR"); for a model with
BatchNorm the remedy is to re-estimate the running statistics of the merged model. Each client runs
:func:`batchnorm_statistics` on its own data (a count, a mean and a variance per BatchNorm, nothing per sample), the
server pools them with :func:`combine_batchnorm` (exactly the statistics of the pooled data) and writes them with
:func:`apply_batchnorm`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from rayfuse.alignment._common import Params, resolve_device
from rayfuse.errors import InputError

__all__ = ["batchnorm_statistics", "combine_batchnorm", "apply_batchnorm"]

BNStats = tuple[float, np.ndarray, np.ndarray]


def batchnorm_statistics(model: nn.Module, X: np.ndarray, *, batch_size: int = 256,
                         device: str | torch.device | None = None) -> dict[str, BNStats]:
    """The statistics of every BatchNorm's inputs on ``X``, as the client would re-estimate its running statistics.

    One pass without gradients, the BatchNorm layers in train mode (they normalise with the batch statistics, as when
    running statistics are reset and re-estimated with ``momentum=None``), every other module in eval mode. Returns, per
    BatchNorm module name, ``(count, mean, var)``: the number of values per channel, and their exact mean and
    (population) variance in float64. The model is left as it was (its buffers and modes are restored)."""
    if batch_size < 1:
        raise InputError("batch_size", "at least 1", batch_size)
    dev = resolve_device(device)
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    sums: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, float] = {}

    def hook_for(name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0].detach().to(torch.float64).movedim(1, -1)
            x = x.reshape(-1, x.shape[-1])
            parts = [x.sum(0), (x * x).sum(0)]
            sums[name] = [a + b for a, b in zip(sums[name], parts)] if name in sums else parts
            counts[name] = counts.get(name, 0.0) + float(x.shape[0])
        return hook

    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    modes = [(m, m.training) for m in model.modules()]
    momenta = {name: m.momentum for name, m in norms.items()}
    place = next((p.device for p in model.parameters()), dev)
    handles = [m.register_forward_pre_hook(hook_for(name)) for name, m in norms.items()]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        model.eval().to(dev)
        for m in norms.values():
            m.reset_running_stats()
            m.momentum = None
            m.train()
        with torch.no_grad():
            for lo in range(0, len(X), batch_size):
                model(torch.as_tensor(np.asarray(X[lo:lo + batch_size]), dtype=dtype, device=dev))
    finally:
        for h in handles:
            h.remove()
        for name, m in norms.items():
            m.momentum = momenta[name]
        for module, mode in modes:
            module.train(mode)
        model.load_state_dict(saved)
        model.to(place)
    out: dict[str, BNStats] = {}
    for name, (total, squares) in sums.items():
        n = counts[name]
        mean = (total / n).cpu().numpy()
        var = np.maximum((squares / n).cpu().numpy() - mean**2, 0.0)
        out[name] = (n, mean, var)
    return out


def combine_batchnorm(stats_list: Sequence[Mapping[str, BNStats]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Pool the clients' :func:`batchnorm_statistics`: per BatchNorm, the count-weighted mean and the variance by the law
    of total variance (the mean and population variance of the pooled data)."""
    if not stats_list:
        raise InputError("stats", "the statistics of at least one client", 0)
    names = set(stats_list[0])
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for k, stats in enumerate(stats_list):
        if set(stats) != names:
            raise InputError(f"stats.{k}", "the BatchNorm modules of stats.0", sorted(set(stats) ^ names)[:3])
    for name in sorted(names):
        counts = np.array([float(s[name][0]) for s in stats_list])
        if (counts < 0).any() or counts.sum() <= 0:
            raise InputError(f"stats.{name}", "non-negative counts with a positive sum", counts.tolist())
        means = np.stack([np.asarray(s[name][1], dtype=np.float64) for s in stats_list])
        variances = np.stack([np.asarray(s[name][2], dtype=np.float64) for s in stats_list])
        share = counts[:, None] / counts.sum()
        mean = (share * means).sum(0)
        var = (share * (variances + (means - mean) ** 2)).sum(0)
        out[name] = (mean, var)
    return out


def apply_batchnorm(params: Mapping[str, np.ndarray], combined: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> Params:
    """``params`` with each BatchNorm's ``running_mean`` / ``running_var`` replaced by the combined statistics."""
    out = dict(params)
    for name, (mean, var) in combined.items():
        for suffix, value in (("running_mean", mean), ("running_var", var)):
            key = f"{name}.{suffix}" if name else suffix
            if key not in out:
                raise InputError(f"params.{key}", "the running statistics of a BatchNorm of the model", "missing")
            old = np.asarray(out[key])
            value = np.asarray(value)
            if value.shape != old.shape:
                raise InputError(f"batchnorm.{name}.{suffix}", f"shape {old.shape}", value.shape)
            out[key] = value.astype(old.dtype)
    return out
