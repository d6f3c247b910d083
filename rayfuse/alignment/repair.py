"""Repairing a merged model's activation statistics, from statistics the clients compute on their own data.

Averaging aligned models shrinks the variance of their hidden units (Jordan et al. 2022, "REPAIR").

* With BatchNorm, the remedy is to re-estimate the running statistics of the merged model: each client runs
  :func:`batchnorm_statistics` on its own data (a count, a mean and a variance per BatchNorm, nothing per sample), the
  server pools them with :func:`combine_batchnorm` (exactly the statistics of the pooled data) and writes them with
  :func:`apply_batchnorm`.
* Where no normalisation follows a hidden layer (:func:`repair_units`), REPAIR's rescaling: each client computes the
  channel statistics of its own aligned model (:func:`unit_statistics`); the targets are their weighted averages
  (:func:`repair_targets`: means, and standard deviations); each client then computes the merged model's channel
  statistics on its data, averaged the same way, and the server folds the correction into the layers' weights and
  biases (:func:`apply_repair`). A correction changes the statistics of the layers after it, so the merged model's
  statistics are computed again after each fold, once per layer (``passes``): after pass ``p`` the first ``p``
  layers are exact. Comparing like with like (each client's data seen by both models, averaged with the same weights)
  leaves a merge of identical models unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rayfuse.alignment._common import ChannelMoments, Params, batches, evaluating, param_dtype, resolve_device
from rayfuse.errors import InputError
from rayfuse.symmetry import PermutationSpec

__all__ = [
    "batchnorm_statistics",
    "combine_batchnorm",
    "apply_batchnorm",
    "RepairUnit",
    "repair_units",
    "unit_statistics",
    "repair_targets",
    "apply_repair",
]

BNStats = tuple[float, np.ndarray, np.ndarray]


def batchnorm_statistics(
    model: nn.Module, X: np.ndarray, *, batch_size: int = 256, device: str | torch.device | None = None
) -> dict[str, BNStats]:
    """The statistics of every BatchNorm's inputs on ``X``, as the client would re-estimate its running statistics.

    One pass without gradients, the BatchNorm layers in train mode (they normalise with the batch statistics, as when
    running statistics are reset and re-estimated with ``momentum=None``), every other module in eval mode. Returns, per
    BatchNorm module name, ``(count, mean, var)``: the number of values per channel, and their exact mean and
    (population) variance in float64. A BatchNorm applied several times in ``forward`` pools the inputs of every
    application, as its running statistics do in training. The model is left as it was (its buffers and modes are
    restored)."""
    dev = resolve_device(device)
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    moments = ChannelMoments()

    def hook_for(name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, inputs: tuple) -> None:
            moments.add(name, inputs[0], 1)

        return hook

    data = batches(X, batch_size, param_dtype(model), dev)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    momenta = {name: m.momentum for name, m in norms.items()}
    with evaluating(model, dev, [m.register_forward_pre_hook(hook_for(name)) for name, m in norms.items()]):
        try:
            for m in norms.values():
                m.reset_running_stats()
                m.momentum = None
                m.train()
            with torch.no_grad():
                for xb in data:
                    model(xb)
        finally:
            for name, m in norms.items():
                m.momentum = momenta[name]
            model.load_state_dict(saved)
    return moments.result()


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


# ---------------------------------------------------------------------------------------------------------------
# REPAIR's rescaling, for layers no normalisation follows


@dataclass(frozen=True)
class RepairUnit:
    """A Linear or convolution whose output units REPAIR rescales: ``module`` (its name), ``group`` (the permutation
    group of its output units) and ``channel_dim`` (1 for a convolution's output, -1 for a Linear's)."""

    module: str
    group: str
    channel_dim: int
    has_bias: bool


def repair_units(model: nn.Module, spec: PermutationSpec, *, skipped: dict[str, str] | None = None) -> list[RepairUnit]:
    """The layers of ``model`` whose hidden output units REPAIR rescales: every Linear / Conv1d-3d whose output axis is
    a whole permutation group's axis (a hidden layer; the output layer's units are fixed) and whose output no
    BatchNorm reads (BatchNorm re-estimation repairs those). In forward order, each layer once.

    A layer applied several times in ``forward`` (one module called at two places), or whose weight or bias is one
    tensor with another layer's (tied parameters), is left as merged: one rescaling of its tensor cannot give each
    application (or each layer sharing it) its own statistics, and rescaling a tied tensor under one name would untie
    it. ``skipped``, when given, receives those layers' names and the reason (one line each)."""
    from rayfuse.symmetry import trace_structure

    whole = {a.key: g.name for g in spec.groups for a in g.axes if a.dim == 0 and a.start == 0 and a.outer == 1 and a.inner == 1}
    graph = trace_structure(model, "repair")  # its layers are call_module nodes of the torch.fx graph
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    tied = _tied_keys(model)
    out: list[RepairUnit] = []
    seen: set[str] = set()
    for node in graph.graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            continue
        name = str(node.target)
        if name in seen:
            continue
        seen.add(name)
        group = whole.get(f"{name}.weight")
        if group is None or spec.group(group).size != modules[name].weight.shape[0]:
            continue
        if any(user.op == "call_module" and isinstance(modules.get(user.target), nn.modules.batchnorm._BatchNorm) for user in node.users):
            continue
        partners = sorted({*tied.get(f"{name}.weight", ()), *tied.get(f"{name}.bias", ())})
        reason = (
            f"applied {calls[name]} times in forward (one rescaling cannot match each application's statistics)"
            if calls[name] > 1
            else f"its tensors are tied to {', '.join(partners[:2])} (one rescaling cannot match both layers' statistics)"
            if partners
            else ""
        )
        if reason:
            if skipped is not None:
                skipped[name] = reason
            continue
        module = modules[name]
        out.append(RepairUnit(name, group, -1 if isinstance(module, nn.Linear) else 1, module.bias is not None))
    return out


def _tied_keys(model: nn.Module) -> dict[str, list[str]]:
    """Each state-dict key of a tensor that ``model`` holds under several names, with its other names (in state-dict
    order)."""
    names: dict[int, list[str]] = {}
    for key, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(key)
    return {key: [k for k in group if k != key] for group in names.values() if len(group) > 1 for key in group}


def unit_statistics(
    model: nn.Module, X: np.ndarray, units: Sequence[RepairUnit], *, batch_size: int = 256, device: str | torch.device | None = None
) -> dict[str, BNStats]:
    """Per unit layer, ``(count, mean, var)`` of each output channel of ``model`` on ``X`` (over the batch and every
    other axis), in float64, the model in eval mode. The model is left as it was."""
    dev = resolve_device(device)
    modules = dict(model.named_modules())
    moments = ChannelMoments()

    def hook_for(unit: RepairUnit) -> Callable[[nn.Module, tuple, torch.Tensor], None]:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            moments.add(unit.module, output, unit.channel_dim)

        return hook

    data = batches(X, batch_size, param_dtype(model), dev)
    with evaluating(model, dev, [modules[u.module].register_forward_hook(hook_for(u)) for u in units]), torch.no_grad():
        for xb in data:
            model(xb)
    return moments.result()


def repair_targets(
    stats: Sequence[Mapping[str, BNStats]],
    units: Sequence[RepairUnit],
    weights: Sequence[float],
    *,
    index: Sequence[Mapping[str, np.ndarray]] | None = None,
    widths: Mapping[str, int] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per layer and channel, the weighted average of the clients' means and of their standard deviations (each
    client's :func:`unit_statistics` on its own data): REPAIR's targets from the aligned models, and the merged
    model's statistics in the same form (so a merge of identical models is left unchanged).

    ``index`` / ``widths`` (a nonparametric merge's :class:`rayfuse.alignment.WidthPlan`): each model's channels are
    placed at their global units and a global unit averages the models that hold it."""
    if len(stats) != len(weights) or not stats:
        raise InputError("stats", f"one client's statistics per weight ({len(weights)})", len(stats))
    w = np.asarray(weights, dtype=np.float64)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for unit in units:
        for k, client in enumerate(stats):
            if unit.module not in client:
                raise InputError(f"stats.{k}", f"the statistics of layer {unit.module}", "missing")
        size = len(stats[0][unit.module][1])
        width = widths[unit.group] if widths is not None else size
        mean, std, total = np.zeros(width), np.zeros(width), np.zeros(width)
        for k, client in enumerate(stats):
            _, m, v = client[unit.module]
            at = np.asarray(index[k][unit.group]) if index is not None else np.arange(width)
            if len(at) != len(m):
                raise InputError(f"stats.{k}.{unit.module}", f"statistics of {len(at)} channels", len(m))
            mean[at] += w[k] * np.asarray(m, dtype=np.float64)
            std[at] += w[k] * np.sqrt(np.asarray(v, dtype=np.float64))
            total[at] += w[k]
        safe = np.where(total > 0, total, 1.0)
        out[unit.module] = (mean / safe, std / safe)
    return out


def apply_repair(
    params: Mapping[str, np.ndarray],
    units: Sequence[RepairUnit],
    merged: Mapping[str, tuple[np.ndarray, np.ndarray]],
    targets: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> Params:
    """``params`` with each layer's output channels moved from the merged model's statistics to the targets (both
    ``(mean, std)`` per layer, :func:`repair_targets`): ``W' = W s``, ``b' = (b - mean) s + target_mean`` with
    ``s = target_std / std`` (1 for a channel that does not vary). A layer without a bias is only rescaled."""
    out = dict(params)
    for unit in units:
        if unit.module not in merged or unit.module not in targets:
            raise InputError(f"repair.{unit.module}", "the merged statistics and the targets of every layer", "missing")
        mean, std = (np.asarray(a, dtype=np.float64) for a in merged[unit.module])
        mean_t, std_t = (np.asarray(a, dtype=np.float64) for a in targets[unit.module])
        varies = std > 1e-8 * max(float(std.max(initial=0.0)), 1e-30)
        scale = np.where(varies, std_t / np.where(varies, std, 1.0), 1.0)
        key = f"{unit.module}.weight"
        weight = np.asarray(out[key])
        if scale.shape != (weight.shape[0],):
            raise InputError(f"repair.{unit.module}", f"statistics of {weight.shape[0]} channels", scale.shape)
        out[key] = (weight.astype(np.float64) * scale.reshape(-1, *([1] * (weight.ndim - 1)))).astype(weight.dtype)
        if unit.has_bias:
            bias = np.asarray(out[f"{unit.module}.bias"])
            out[f"{unit.module}.bias"] = ((bias.astype(np.float64) - mean) * scale + mean_t).astype(bias.dtype)
    return out
