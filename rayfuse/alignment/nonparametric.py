"""The nonparametric merge of aligned models: units no other model shares become new global units.

Averaging assumes every unit of every model has a counterpart in the others. When clients learnt different things
(label skew, independent initialisations) some units have none, and averaging them with whatever they were matched to
destroys both. PFNM (Yurochkin et al. 2019) and KL-fusion (Claici et al. 2020) let the global model grow instead: a
local unit that matches no global unit well enough becomes a new global unit, and the global width is inferred (with a
cap). This module does that for any model with a permutation spec, layer by layer as FedMA extends PFNM to deep
networks, after the models are aligned (:mod:`rayfuse.alignment.weight`, :mod:`rayfuse.alignment.activation`):

1. :func:`plan_widths`: per group, each model's aligned unit ``i`` stays at global unit ``i`` when its match
   quality (the correlation of its activations with the reference unit's, or the cosine of its weights with the
   others' barycenter: :func:`unit_agreement`) is at least ``threshold``; otherwise it becomes a new global unit.
   Every global unit keeps at least one model (the best matched); the new units are capped at
   ``(max_width - 1) x`` the group's width, the worst matched first.
2. :func:`merge_nonparametric`: each global tensor is the weighted average of the models' tensors scattered to their
   global positions. Along a unit's *own* axes (the rows that compute it: a Linear's or convolution's output axis, its
   bias, its BatchNorm's vectors) the average runs over the models that hold the unit; along *input* axes (the columns
   that read a unit) a model without the unit contributes zeros, as its model reads nothing from it.

With no new units this is :func:`rayfuse.alignment.merge_average`. With every unit new (``threshold=inf``,
``max_width`` = the number of models) the merged model computes exactly the weighted average of the models' logits
(their ensemble) for networks whose normalisation is per unit (BatchNorm): the global model is the models side by side.

Groups whose width cannot change without changing the function stay at their width, with the reason
(:func:`width_roles`): attention heads and head dimensions, units a LayerNorm or GroupNorm normalises together,
segments of a concatenated axis, tensors of modules whose size attributes are not known, units that one tied tensor
both computes and reads (a tied embedding and decoder), and groups whose width the model's code fixes
(:attr:`~rayfuse.symmetry.PermGroup.fixed_width`: a literal size in a ``view`` or an ``expand``). Tensors tied with the
same role on every axis (one layer's weight shared by two layers) are merged alike under each name, so the tie holds at
any width.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from rayfuse.alignment._common import Params, check_models, normalize_weights
from rayfuse.alignment.repair import _tied_keys
from rayfuse.errors import InputError
from rayfuse.symmetry import PermGroup, PermutationSpec

__all__ = ["WidthRoles", "WidthPlan", "width_roles", "unit_agreement", "plan_widths", "merge_nonparametric", "fuse_nonparametric"]

_RESIZABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.modules.batchnorm._BatchNorm, nn.Embedding)


@dataclass(frozen=True)
class WidthRoles:
    """What the nonparametric merge needs to know of an architecture beyond its spec.

    Attributes
    ----------
    input_axes : frozenset of (str, int)
        The ``(key, dim)`` axes that *read* units (a Linear's or convolution's input axis); every other axis of a group
        is the units' own.
    fixed : dict of str to str
        Groups that keep their width, with the reason.
    """

    input_axes: frozenset[tuple[str, int]]
    fixed: Mapping[str, str] = field(default_factory=dict)


def width_roles(model: nn.Module, spec: PermutationSpec) -> WidthRoles:
    """The input axes of ``model``'s tensors and the groups of ``spec`` that must keep their width (module docstring)."""
    inputs: set[tuple[str, int]] = set()
    owners: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            owners[prefix + attr] = module
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            inputs.add((f"{prefix}weight", 1))
        elif isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
            inputs.add((f"{prefix}weight", 0))
        elif isinstance(module, nn.MultiheadAttention):
            inputs.update((f"{prefix}{k}", 1) for k in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"))
    on_dim: dict[tuple[str, int], int] = {}
    for g in spec.groups:
        for a in g.axes:
            on_dim[(a.key, a.dim)] = on_dim.get((a.key, a.dim), 0) + 1
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    partners = _tied_keys(model)
    fixed: dict[str, str] = {}
    for g in spec.groups:
        reason = _tied_reason(g, partners, inputs) or _fixed_reason(g, owners, shapes, on_dim)
        if reason:
            fixed[g.name] = reason
    return WidthRoles(frozenset(inputs), fixed)


def _tied_reason(g: PermGroup, partners: Mapping[str, list[str]], inputs: set[tuple[str, int]]) -> str:
    """A group whose units one tensor both computes and reads under two names (a tied embedding and decoder): the merge
    averages a unit's own axes over the models holding it and adds zeros on the axes that read it, two values that one
    tensor cannot hold, so the group keeps its width (and the tie holds)."""
    for a in g.axes:
        for other in partners.get(a.key, ()):
            if ((a.key, a.dim) in inputs) != ((other, a.dim) in inputs):
                reads, computes = (a.key, other) if (a.key, a.dim) in inputs else (other, a.key)
                return f"{computes} and {reads} are one tensor (tied) that computes these units and reads them"
    return ""


def _fixed_reason(
    g: PermGroup, owners: Mapping[str, nn.Module], shapes: Mapping[str, tuple[int, ...]], on_dim: Mapping[tuple[str, int], int]
) -> str:
    if g.fixed_width:  # the model's code fixes the width (a literal size in a view / reshape / expand)
        return g.fixed_width
    if g.kind in ("heads", "head_dims"):
        return f"attention {g.kind.replace('_', ' ')} (their number is part of the attention)"
    for a in g.axes:
        module = owners.get(a.key)
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
            return f"{a.key}: a {type(module).__name__} normalises these units together"
        if module is not None and not isinstance(module, _RESIZABLE) and not list(module.children()):
            return f"{a.key}: a {type(module).__name__}, whose size attributes rayfuse does not know"
        if a.key in shapes and (a.start != 0 or a.span(g.size) != shapes[a.key][a.dim] or on_dim[(a.key, a.dim)] > 1):
            return f"{a.key}: a segment of axis {a.dim} (a concatenation or packed projections)"
    return ""


def unit_agreement(
    aligned: Sequence[Mapping[str, np.ndarray]],
    spec: PermutationSpec,
    *,
    weights: Sequence[float] | None = None,
    keys: Collection[str] | None = None,
) -> list[dict[str, np.ndarray]]:
    """How well each aligned unit matches its counterparts, by weights: per model and group, the cosine similarity of
    each unit's values on the group's axes (the tensors ``keys``, default all the spec permutes) with the same unit of
    the weighted average of the other models. ``(size,)`` per group, in ``[-1, 1]``."""
    check_models(aligned, where="aligned")
    w = normalize_weights(weights, len(aligned))
    chosen = set(keys) if keys is not None else spec.keys()
    out: list[dict[str, np.ndarray]] = [{} for _ in aligned]
    for g in spec.groups:
        axes = [a for a in g.axes if a.key in chosen]
        if not axes:
            continue
        rows = [np.concatenate([a.view(np.asarray(m[a.key], dtype=np.float64), g.size) for a in axes], axis=1) for m in aligned]
        for k, own in enumerate(rows):
            others = np.array([0.0 if j == k else w[j] for j in range(len(rows))])
            if others.sum() <= 0:
                others = np.array([0.0 if j == k else 1.0 for j in range(len(rows))])
            center = sum(wj * r for wj, r in zip(others / others.sum(), rows))
            norms = np.linalg.norm(own, axis=1) * np.linalg.norm(center, axis=1)
            out[k][g.name] = np.where(norms > 0, (own * center).sum(1) / np.where(norms > 0, norms, 1.0), 0.0)
    return out


@dataclass
class WidthPlan:
    """Where every aligned unit of every model goes in the global model.

    Attributes
    ----------
    widths : dict of str to int
        The global width of each group.
    index : list of dict
        Per model and group, the global unit of each of its (aligned) units: ``index[k][g][i]``.
    """

    widths: dict[str, int]
    index: list[dict[str, np.ndarray]]

    def holders(self, k: int, group: str) -> np.ndarray:
        """Which global units of ``group`` model ``k`` holds (a boolean mask of the global width)."""
        mask = np.zeros(self.widths[group], dtype=bool)
        mask[self.index[k][group]] = True
        return mask

    def new_units(self, spec: PermutationSpec) -> dict[str, int]:
        """How many units each group gained."""
        return {g.name: self.widths[g.name] - g.size for g in spec.groups}


def plan_widths(
    quality: Sequence[Mapping[str, np.ndarray]],
    spec: PermutationSpec,
    *,
    threshold: float,
    max_width: float = 2.0,
    fixed: Collection[str] = (),
) -> WidthPlan:
    """Decide which aligned units become new global units (see the module docstring).

    Parameters
    ----------
    quality : list of dict
        Per model and group, each aligned unit's match quality (higher is better); groups missing from every model's
        dict keep their width.
    spec : PermutationSpec
        The groups.
    threshold : float
        A unit matched with less than this becomes a new global unit (``inf``: every unit; ``-inf``: none).
    max_width : float
        The global width of a group is at most ``floor(max_width x size)``.
    fixed : collection of str
        Groups that keep their width (:attr:`WidthRoles.fixed`).
    """
    if math.isnan(threshold):
        raise InputError("threshold", "a number (inf: every unit new; -inf: none)", threshold)
    if not (math.isfinite(max_width) and max_width >= 1):
        raise InputError("max_width", "a finite factor >= 1 of each group's width", max_width)
    n = len(quality)
    if n < 1:
        raise InputError("quality", "the match quality of at least one model", 0)
    widths: dict[str, int] = {}
    index: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for g in spec.groups:
        present = [g.name in q for q in quality]
        if g.name in fixed or not any(present) or n == 1:
            widths[g.name] = g.size
            for k in range(n):
                index[k][g.name] = np.arange(g.size)
            continue
        if not all(present):
            raise InputError(f"quality.{present.index(False)}", f"the quality of group {g.name} (as the other models have)", "missing")
        q = np.stack([np.asarray(quality[k][g.name], dtype=np.float64).reshape(-1) for k in range(n)])
        if q.shape != (n, g.size) or not np.isfinite(q).all():
            raise InputError(f"quality.{g.name}", f"finite values for {g.size} units per model", q.shape)
        new = q < threshold
        orphaned = np.flatnonzero(new.all(axis=0))  # every global unit keeps the model that matches it best
        new[q[:, orphaned].argmax(axis=0), orphaned] = False
        candidates = np.argwhere(new)  # (model, unit), in model then unit order
        room = max(int(math.floor(max_width * g.size)) - g.size, 0)
        if len(candidates) > room:
            worst = np.argsort(q[candidates[:, 0], candidates[:, 1]], kind="stable")[:room]
            candidates = candidates[np.sort(worst)]
        widths[g.name] = g.size + len(candidates)
        for k in range(n):
            index[k][g.name] = np.arange(g.size)
        for j, (k, i) in enumerate(candidates):
            index[int(k)][g.name][int(i)] = g.size + j
    return WidthPlan(widths, index)


def _dim_maps(
    key: str, dim: int, ndim: int, length: int, spec: PermutationSpec, plan: WidthPlan, k: int
) -> tuple[np.ndarray, int, np.ndarray]:
    """Along axis ``dim`` of tensor ``key`` (local ``length``): model ``k``'s local-to-global index, the global
    length, and which global positions model ``k`` holds."""
    axes = sorted(((a, g) for g in spec.groups for a in g.axes if a.key == key and a.dim % ndim == dim), key=lambda ag: ag[0].start)
    total = length + sum(a.outer * (plan.widths[g.name] - g.size) * a.inner for a, g in axes)
    mapping = np.empty(length, dtype=np.int64)
    held = np.ones(total, dtype=bool)
    local, shift = 0, 0
    for a, g in axes:
        mapping[local : a.start] = np.arange(local, a.start) + shift
        width = plan.widths[g.name]
        gstart = a.start + shift
        unit_map = plan.index[k][g.name]
        block = (np.arange(a.outer)[:, None, None] * width + unit_map[None, :, None]) * a.inner + np.arange(a.inner)[None, None, :]
        mapping[a.start : a.start + a.span(g.size)] = gstart + block.reshape(-1)
        mask = np.repeat(np.tile(plan.holders(k, g.name), a.outer).reshape(a.outer, width), a.inner, axis=1).reshape(-1)
        held[gstart : gstart + a.outer * width * a.inner] = mask
        local = a.start + a.span(g.size)
        shift += a.outer * (width - g.size) * a.inner
    mapping[local:] = np.arange(local, length) + shift
    return mapping, total, held


def merge_nonparametric(
    aligned: Sequence[Mapping[str, np.ndarray]],
    spec: PermutationSpec,
    plan: WidthPlan,
    roles: WidthRoles,
    *,
    weights: Sequence[float] | None = None,
) -> Params:
    """The global model of ``plan``'s widths from the aligned models (see the module docstring).

    Parameters
    ----------
    aligned : list of dict
        The models in one frame (same keys and shapes).
    spec : PermutationSpec
        Their groups (at the models' widths).
    plan : WidthPlan
        From :func:`plan_widths`.
    roles : WidthRoles
        Which axes read units (:func:`width_roles`).
    weights : list of float, optional
        The models' weights (default equal).

    Returns
    -------
    dict
        Float tensors at the global widths, in the models' dtypes; other tensors (counters) are model 0's.
    """
    check_models(aligned, where="aligned")
    if len(plan.index) != len(aligned):
        raise InputError("plan", f"the units of {len(aligned)} models", len(plan.index))
    w = normalize_weights(weights, len(aligned))
    grown = {g.name for g in spec.groups if plan.widths[g.name] != g.size}
    touched: dict[str, set[int]] = {}
    for g in spec.groups:
        if g.name in grown:
            for a in g.axes:
                touched.setdefault(a.key, set()).add(a.dim % np.ndim(aligned[0][a.key]))
    out: Params = {}
    for key, first in aligned[0].items():
        first = np.asarray(first)
        if first.dtype.kind not in "fc" or key not in touched:
            out[key] = (
                first
                if first.dtype.kind not in "fc"
                else np.asarray(sum(wk * np.asarray(m[key], dtype=np.float64) for wk, m in zip(w, aligned))).astype(first.dtype, copy=False)
            )
            continue
        dims = sorted(touched[key])
        shape = list(first.shape)
        for d in dims:  # the global length of an axis is the same from every model's side
            shape[d] = _dim_maps(key, d, first.ndim, first.shape[d], spec, plan, 0)[1]
        num = np.zeros(shape, dtype=np.float64)
        den = np.zeros([shape[d] if d in dims and (key, d) not in roles.input_axes else 1 for d in range(first.ndim)])
        for k, model in enumerate(aligned):
            index: list[np.ndarray] = [np.arange(n) for n in first.shape]
            mask = np.ones(den.shape)
            for d in dims:
                mapping, _, held = _dim_maps(key, d, first.ndim, first.shape[d], spec, plan, k)
                index[d] = mapping
                if (key, d) not in roles.input_axes:  # an own axis: the average runs over the models holding the unit
                    view = [1] * first.ndim
                    view[d] = shape[d]
                    mask = mask * held.reshape(view)
            num[np.ix_(*index)] += w[k] * np.asarray(model[key], dtype=np.float64)
            den += w[k] * mask
        merged = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
        out[key] = merged.astype(first.dtype, copy=False)
    return out


def fuse_nonparametric(
    aligned: Sequence[Mapping[str, np.ndarray]],
    spec: PermutationSpec,
    roles: WidthRoles,
    *,
    quality: Sequence[Mapping[str, np.ndarray]] | None = None,
    weights: Sequence[float] | None = None,
    threshold: float,
    max_width: float = 2.0,
    keys: Collection[str] | None = None,
) -> tuple[Params, WidthPlan]:
    """:func:`plan_widths` then :func:`merge_nonparametric`: the global model and where every unit went.

    ``quality``: per model and group, each unit's match quality from the alignment (activation matching's
    correlations, :attr:`rayfuse.alignment.Alignment.quality`); groups it does not cover are judged by their weights
    (:func:`unit_agreement` on the tensors ``keys``)."""
    by_weights = unit_agreement(aligned, spec, weights=weights, keys=keys)
    merged_quality = [{**q, **(dict(quality[k]) if quality is not None and k < len(quality) else {})} for k, q in enumerate(by_weights)]
    plan = plan_widths(merged_quality, spec, threshold=threshold, max_width=max_width, fixed=set(roles.fixed))
    return merge_nonparametric(aligned, spec, plan, roles, weights=weights), plan
