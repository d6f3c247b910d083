"""Weight matching: permutations that bring models into one frame by comparing their weights (git re-basin).

:func:`match_weights` aligns one model onto a target by coordinate descent over the spec's groups (Ainsworth et al.
2023, "Git Re-Basin"): for a group, the cost of sending model unit ``j`` to target unit ``i`` is the inner product of
everything the two units own (their rows on every axis of the group, the other groups' current permutations applied to
the model), and a linear assignment picks the best permutation; the groups are visited in a seeded random order until
no group improves.

:func:`weight_matching` aligns N models the MergeMany way: every model is aligned to the weighted barycenter of the
others, repeatedly. The N alignments of one sweep are independent and run through an executor
(``executor(fn, items)``, see :mod:`rayfuse.matching`): threads in-process, Ray tasks in a federation.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rayfuse.alignment._common import Params, check_models, normalize_weights, resolve_device, sorted_unit_rows, weighted_average
from rayfuse.errors import InputError
from rayfuse.matching import Executor, solve_assignment, thread_map
from rayfuse.symmetry import AxisRef, Perms, PermutationSpec, compose, invert

__all__ = ["Alignment", "match_weights", "weight_matching", "apply_alignment", "resolve_cost_keys", "torch_view"]

_PATIENCE = 3  # sweeps without a lower objective before weight_matching stops (simultaneous updates can cycle)
STATISTICS_SUFFIXES = ("running_mean", "running_var")  # BatchNorm buffers: permuted with their group, not matched on


def resolve_cost_keys(spec: PermutationSpec, cost_keys: Collection[str] | None, *, where: str = "cost_keys") -> list[str]:
    """The spec's tensors the matching cost is computed from: ``cost_keys`` (checked against the spec), or by default
    every tensor the spec permutes except BatchNorm running statistics (keys ending in ``running_mean`` /
    ``running_var``).

    The statistics are permuted with their group like every other tensor, but they describe the data, not the
    function's weights: in the cost, their large values (variances of pre-activations) outweigh the weights and move
    units of models that are already aligned (a shared initialisation), and git re-basin matches parameters only.
    Raises :class:`InputError` for a key the spec does not permute, or an empty selection."""
    keys = spec.keys()
    if cost_keys is None:
        chosen = sorted(k for k in keys if not k.endswith(STATISTICS_SUFFIXES))
        return chosen or sorted(keys)
    chosen = sorted(set(cost_keys))
    for key in chosen:
        if key not in keys:
            raise InputError(f"{where}.{key}", "a tensor the spec permutes", key)
    if not chosen:
        raise InputError(where, "at least one tensor the spec permutes", "none")
    return chosen


@dataclass
class Alignment:
    """The permutations that put N models into one frame.

    Attributes
    ----------
    perms : list of Perms
        One per model: ``spec.apply(models[k], perms[k])`` is model ``k`` in the common frame.
    sweeps : int
        How many sweeps ran (the first one included).
    objective : list of float
        One value per sweep (what each matcher reports; see :func:`weight_matching`, :func:`activation_matching`).
    converged : bool
        Whether the last sweep changed no permutation.
    quality : list of dict, optional
        Per model and group, how well each aligned unit matches (activation matching: its correlation with the
        reference's unit); what :func:`rayfuse.alignment.plan_widths` reads.
    """

    perms: list[Perms]
    sweeps: int
    objective: list[float] = field(default_factory=list)
    converged: bool = False
    quality: list[dict[str, np.ndarray]] | None = None


def apply_alignment(models: Sequence[Mapping[str, np.ndarray]], spec: PermutationSpec, alignment: Alignment) -> list[Params]:
    """Every model in the common frame: ``spec.apply(models[k], alignment.perms[k])``."""
    if len(models) != len(alignment.perms):
        raise InputError("models", f"{len(alignment.perms)} models (one per permutation of the alignment)", len(models))
    return [spec.apply(model, perms) for model, perms in zip(models, alignment.perms)]


def torch_view(tensor: torch.Tensor, axis: AxisRef, size: int) -> torch.Tensor:
    """:meth:`AxisRef.view` for a torch tensor: the axis' units as the rows of a ``(size, rest)`` matrix."""
    dim = axis.dim % tensor.dim()
    seg = tensor.narrow(dim, axis.start, axis.span(size)).movedim(dim, 0)
    seg = seg.reshape(axis.outer, size, axis.inner, -1)
    return seg.movedim(1, 0).reshape(size, -1)


def _check_pair(target: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray], spec: PermutationSpec) -> None:
    spec.check({k: np.shape(v) for k, v in target.items()}, where="spec")
    for key in spec.keys():
        if key not in model:
            raise InputError(f"model.{key}", "the tensors the spec permutes", "missing")
        if np.shape(model[key]) != np.shape(target[key]):
            raise InputError(f"model.{key}", f"shape {tuple(np.shape(target[key]))} (as in the target)", tuple(np.shape(model[key])))


def match_weights(
    target: Mapping[str, np.ndarray],
    model: Mapping[str, np.ndarray],
    spec: PermutationSpec,
    *,
    max_sweeps: int = 100,
    seed: int = 0,
    init: Mapping[str, np.ndarray] | None = None,
    device: str | torch.device | None = None,
    cost_keys: Collection[str] | None = None,
) -> tuple[Perms, int]:
    """Permutations of ``model`` that maximise its inner product with ``target`` (git re-basin weight matching).

    Parameters
    ----------
    target, model : dict of str to ndarray
        State dicts with the spec's tensors (same shapes).
    spec : PermutationSpec
        The groups of axes that share one permutation.
    max_sweeps : int
        At most this many passes over all groups.
    seed : int
        Seeds the random order in which each sweep visits the groups.
    init : Perms, optional
        Starting permutations (default: identity); groups missing from it start at the identity.
    device : str or torch.device, optional
        Where the cost matrices are computed (float64 matrix products); default the CPU.
    cost_keys : collection of str, optional
        The tensors the cost is computed from (:func:`resolve_cost_keys`; default: all the spec permutes but BatchNorm
        running statistics). Every tensor of the spec is still permuted by :meth:`PermutationSpec.apply`.

    Returns
    -------
    perms : Perms
        ``spec.apply(model, perms)`` is ``model`` in ``target``'s frame.
    sweeps : int
        How many sweeps ran; the last one improved no group unless it hit ``max_sweeps``.
    """
    _check_pair(target, model, spec)
    dev = resolve_device(device)
    matched = set(resolve_cost_keys(spec, cost_keys))
    groups = [g for g in spec.groups]
    perms: Perms = {g.name: np.arange(g.size) for g in groups}
    axes_of = {g.name: [axis for axis in g.axes if axis.key in matched] for g in groups}
    for name, perm in (init or {}).items():
        if name in perms:
            perm = np.asarray(perm, dtype=np.int64)
            if perm.shape != perms[name].shape or not np.array_equal(np.sort(perm), perms[name]):
                raise InputError(f"init.{name}", f"a permutation of {len(perms[name])} units", perm.tolist()[:8])
            perms[name] = perm
    a = {k: torch.as_tensor(np.asarray(target[k], dtype=np.float64), device=dev) for k in matched}
    b = {k: torch.as_tensor(np.asarray(model[k], dtype=np.float64), device=dev) for k in matched}
    on_key: dict[str, list[tuple[str, AxisRef]]] = {}
    for g in groups:
        for axis in axes_of[g.name]:
            on_key.setdefault(axis.key, []).append((g.name, axis))
    target_rows = {
        g.name: torch.cat([torch_view(a[axis.key], axis, g.size) for axis in axes_of[g.name]], dim=1) for g in groups if axes_of[g.name]
    }

    def model_rows(name: str, size: int, axes: Sequence[AxisRef]) -> torch.Tensor:
        views = []
        for axis in axes:
            t = b[axis.key]
            for other, other_axis in on_key[axis.key]:
                if other != name:
                    dim = other_axis.dim % t.dim()
                    index = other_axis.index(t.shape[dim], perms[other])
                    t = torch.index_select(t, dim, torch.as_tensor(index, device=dev))
            views.append(torch_view(t, axis, size))
        return torch.cat(views, dim=1)

    if init is None:
        # Start from the better of the identity and a permutation-invariant guess: a unit's values along its other axes,
        # sorted, do not depend on how the other groups are permuted, so matching the sorted rows solves every group
        # at once without the others' (still unknown) permutations. Coordinate descent then refines from there.
        guess = {
            g.name: solve_assignment(
                -(_sorted_rows(a, axes_of[g.name], g.size) @ _sorted_rows(b, axes_of[g.name], g.size).T).cpu().numpy(),
                where=f"cost.{g.name}",
            )
            for g in groups
            if g.size >= 2 and axes_of[g.name]
        }
        if _agreement(a, b, spec, guess, dev) > _agreement(a, b, spec, perms, dev):
            perms.update(guess)
    rng = np.random.default_rng(seed)
    sweeps = 0
    for _ in range(max_sweeps):
        sweeps += 1
        improved = False
        for gi in rng.permutation(len(groups)):
            g = groups[gi]
            if g.size < 2 or g.name not in target_rows:  # nothing to match on: the group keeps its permutation
                continue
            cost = (target_rows[g.name] @ model_rows(g.name, g.size, axes_of[g.name]).T).cpu().numpy()
            new = solve_assignment(-cost, where=f"cost.{g.name}")
            rows = np.arange(g.size)
            old_value, new_value = cost[rows, perms[g.name]].sum(), cost[rows, new].sum()
            if new_value > old_value + 1e-12 * (abs(old_value) + 1.0):
                perms[g.name] = new
                improved = True
        if not improved:
            break
    return perms, sweeps


_EXTREMES = 16  # the largest and smallest values per unit and axis that the invariant start compares


def _sorted_rows(params: Mapping[str, torch.Tensor], axes: Sequence[AxisRef], size: int) -> torch.Tensor:
    """A group's units described independently of the other groups' permutations (:func:`sorted_unit_rows`)."""
    return sorted_unit_rows([torch_view(params[axis.key], axis, size) for axis in axes], extremes=_EXTREMES)


def _agreement(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: PermutationSpec, perms: Perms, dev: torch.device
) -> float:
    """The weight-matching objective ``sum_keys <a, b permuted>`` at ``perms``."""
    total = 0.0
    for key in a:
        t = b[key]
        for g in spec.groups_of(key):
            for axis in g.axes:
                if axis.key == key:
                    dim = axis.dim % t.dim()
                    t = torch.index_select(t, dim, torch.as_tensor(axis.index(t.shape[dim], perms[g.name]), device=dev))
        total += float((a[key] * t).sum())
    return total


class MatchTask:
    """One weight matching as a picklable callable (for thread pools and Ray tasks alike).

    Called with ``(target, model, init)``: ``target`` None means the model is the reference itself (identity)."""

    def __init__(
        self, spec: PermutationSpec, max_sweeps: int, seed: int, device: str | torch.device | None, cost_keys: Collection[str] | None = None
    ) -> None:
        self.spec = spec
        self.max_sweeps = max_sweeps
        self.seed = seed
        self.device = None if device is None else str(device)
        self.cost_keys = None if cost_keys is None else list(cost_keys)

    def __call__(self, item: tuple[Params | None, Params, Perms | None]) -> Perms:
        target, model, init = item
        if target is None:
            return self.spec.identity()
        perms, _ = match_weights(
            target, model, self.spec, max_sweeps=self.max_sweeps, seed=self.seed, init=init, device=self.device, cost_keys=self.cost_keys
        )
        return perms


def _anchor(perms: list[Perms]) -> list[Perms]:
    """The permutations re-expressed in model 0's frame (model 0's become the identity)."""
    undo = {name: invert(np.asarray(p)) for name, p in perms[0].items()}
    return [{name: compose(p, undo[name]) for name, p in model_perms.items()} for model_perms in perms]


def _spread(aligned: Sequence[Params], w: np.ndarray, keys: Sequence[str]) -> float:
    center = weighted_average(aligned, w, keys)
    return float(
        sum(wk * sum(float(np.sum((np.asarray(m[k], dtype=np.float64) - center[k]) ** 2)) for k in keys) for wk, m in zip(w, aligned))
    )


def weight_matching(
    models: Sequence[Mapping[str, np.ndarray]],
    spec: PermutationSpec,
    *,
    weights: Sequence[float] | None = None,
    max_sweeps: int = 20,
    inner_sweeps: int = 100,
    seed: int = 0,
    executor: Executor | None = None,
    device: str | torch.device | None = None,
    cost_keys: Collection[str] | None = None,
) -> Alignment:
    """Align N models by weight matching, MergeMany style (Ainsworth et al. 2023, algorithm 3).

    The first sweep aligns every model to model 0 (whose frame is the common one). Each further sweep aligns every
    model to the weighted barycenter of the others (in the common frame), starting from its current permutations; the
    N alignments of a sweep are independent and go through ``executor`` as N items. After each sweep the permutations
    are re-expressed in model 0's frame. It stops when a sweep changes no permutation (``converged``), after
    ``max_sweeps`` sweeps, or when three sweeps in a row did not lower the objective (simultaneous updates can cycle);
    unless it converged, it returns the permutations of the sweep with the lowest objective. With two models this is
    :func:`match_weights` of model 1 onto model 0.

    Parameters
    ----------
    models : list of dict
        State dicts with the same keys and shapes.
    spec : PermutationSpec
        The permutation groups.
    weights : list of float, optional
        The models' weights in the barycenters (default equal).
    max_sweeps : int
        At most this many sweeps (the first included).
    inner_sweeps : int
        ``max_sweeps`` of each :func:`match_weights`.
    seed : int
        Seeds the group order of every matching.
    executor : callable, optional
        ``executor(fn, items) -> [fn(item) for item in items]``; default :func:`rayfuse.matching.thread_map`.
    device : str or torch.device, optional
        Where cost matrices are computed.
    cost_keys : collection of str, optional
        The tensors matched on (:func:`resolve_cost_keys`; default: all the spec permutes but BatchNorm running
        statistics); the objective is computed on the same tensors.

    Returns
    -------
    Alignment
        ``objective`` per sweep: the weighted sum of squared distances of the aligned models (the ``cost_keys``
        tensors) to their weighted average.
    """
    check_models(models)
    w = normalize_weights(weights, len(models))
    spec.check({k: np.shape(v) for k, v in models[0].items()}, where="spec")
    if max_sweeps < 1:
        raise InputError("max_sweeps", "at least 1", max_sweeps)
    keys = sorted(spec.keys())
    cost = resolve_cost_keys(spec, cost_keys)
    own = [{k: np.asarray(m[k]) for k in keys} for m in models]
    if len(models) == 1:
        return Alignment([spec.identity()], 0, [], True)
    run = executor or thread_map
    task = MatchTask(spec, inner_sweeps, seed, device, cost)
    perms = _anchor(list(run(task, [(None if k == 0 else own[0], own[k], None) for k in range(len(own))])))
    aligned = [spec.apply(m, p) for m, p in zip(own, perms)]
    objective = [_spread(aligned, w, cost)]
    converged = False
    best, best_perms, stale = objective[0], perms, 0
    while len(objective) < max_sweeps and stale < _PATIENCE:
        items = []
        for k in range(len(own)):
            others = np.array([0.0 if j == k else w[j] for j in range(len(own))])
            if others.sum() <= 0:
                others = np.array([0.0 if j == k else 1.0 for j in range(len(own))])
            items.append((weighted_average(aligned, others / others.sum(), keys), own[k], perms[k]))
        new = _anchor(list(run(task, items)))
        changed = any(not np.array_equal(new[k][name], perms[k][name]) for k in range(len(own)) for name in perms[k])
        perms = new
        aligned = [spec.apply(m, p) for m, p in zip(own, perms)]
        objective.append(_spread(aligned, w, cost))
        if not changed:
            converged = True
            break
        if objective[-1] < best - 1e-12 * (abs(best) + 1.0):
            best, best_perms, stale = objective[-1], perms, 0
        else:
            stale += 1
    if not converged:
        perms = best_perms
    return Alignment(perms, len(objective), objective, converged)
