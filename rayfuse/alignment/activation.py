"""Activation matching: permutations found by correlating the units' activations on data (Ainsworth et al. 2023,
"Git Re-Basin", section 3.1; Li et al. 2016, "Convergent learning").

The data stay where they are. :func:`collect_correlations` runs a reference model and the own model on the own data
and returns, per permutation group, only sums (:class:`GroupStats`: counts, per-unit sums and squares, and the
``size x size`` cross products): the server adds them up and solves the assignments (:func:`solve_activation_perms`).
:func:`activation_matching` iterates this against an evolving reference (the weighted average of the aligned models).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx
from torch import nn

from rayfuse.alignment._common import (
    Params,
    batches,
    check_models,
    evaluating,
    normalize_weights,
    param_dtype,
    resolve_device,
    sorted_unit_rows,
    weighted_average,
)
from rayfuse.alignment.weight import Alignment, match_weights
from rayfuse.errors import InputError, suggest
from rayfuse.matching import Executor, solve_assignments
from rayfuse.symmetry import PermGroup, Perms, PermutationSpec, Probe

__all__ = ["GroupStats", "collect_correlations", "solve_activation_perms", "activation_matching"]

_FIELDS = ("sum_a", "sum_b", "sumsq_a", "sumsq_b", "cross")


@dataclass
class GroupStats:
    """Sufficient statistics of one group's activations: ``a`` the reference model's units, ``b`` the own model's.

    Attributes
    ----------
    count : float
        How many observations (rows: samples times positions) were summed.
    sum_a, sum_b, sumsq_a, sumsq_b : ndarray, shape (size,)
        Per-unit sums and sums of squares.
    cross : ndarray, shape (size, size)
        ``cross[i, j]`` the sum of ``a_i * b_j``.
    """

    count: float
    sum_a: np.ndarray
    sum_b: np.ndarray
    sumsq_a: np.ndarray
    sumsq_b: np.ndarray
    cross: np.ndarray

    def __add__(self, other: GroupStats) -> GroupStats:
        if not isinstance(other, GroupStats):
            return NotImplemented
        if other.cross.shape != self.cross.shape:
            raise InputError("stats", f"statistics of {self.cross.shape[0]} units", other.cross.shape[0])
        a, b = self.to_arrays(), other.to_arrays()
        return GroupStats.from_arrays({f: a[f] + b[f] for f in a})

    @property
    def size(self) -> int:
        return int(self.cross.shape[0])

    def correlation(self, device: str | torch.device | None = None) -> np.ndarray:
        """Pearson correlation of reference unit ``i`` (rows) with own unit ``j`` (columns); 0 where a unit is constant.

        ``device``: computed there with torch (float64, the same operations; the coordinator's GPU), else with numpy."""
        if device is not None:
            return self._correlation_torch(resolve_device(device))
        n = max(float(self.count), 1.0)
        mean_a, mean_b = self.sum_a / n, self.sum_b / n
        cov = self.cross / n - np.outer(mean_a, mean_b)
        std_a = np.sqrt(np.maximum(self.sumsq_a / n - mean_a**2, 0.0))
        std_b = np.sqrt(np.maximum(self.sumsq_b / n - mean_b**2, 0.0))
        denom = np.outer(std_a, std_b)
        tiny = 1e-12 * max(float(denom.max(initial=0.0)), 1e-300)
        safe = denom > tiny
        return np.where(safe, cov / np.where(safe, denom, 1.0), 0.0)

    def _correlation_torch(self, dev: torch.device) -> np.ndarray:
        """:meth:`correlation` with torch on ``dev``, operation for operation, returned to the CPU as numpy."""

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.float64), device=dev)

        n = max(float(self.count), 1.0)
        mean_a, mean_b = t(self.sum_a) / n, t(self.sum_b) / n
        cov = t(self.cross) / n - torch.outer(mean_a, mean_b)
        std_a = torch.sqrt(torch.clamp(t(self.sumsq_a) / n - mean_a**2, min=0.0))
        std_b = torch.sqrt(torch.clamp(t(self.sumsq_b) / n - mean_b**2, min=0.0))
        denom = torch.outer(std_a, std_b)
        tiny = 1e-12 * max(float(denom.max()) if denom.numel() else 0.0, 1e-300)
        safe = denom > tiny
        corr = torch.where(safe, cov / torch.where(safe, denom, torch.ones_like(denom)), torch.zeros_like(cov))
        return corr.cpu().numpy()

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays (for shipping from a client)."""
        out = {f: np.asarray(getattr(self, f)) for f in _FIELDS}
        out["count"] = np.asarray(self.count, dtype=np.float64)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> GroupStats:
        """The inverse of :meth:`to_arrays`. Raises :class:`InputError` for missing or misshapen arrays."""
        missing = [f for f in ("count", *_FIELDS) if f not in arrays]
        if missing:
            raise InputError("stats", "arrays count, sum_a, sum_b, sumsq_a, sumsq_b, cross", f"missing {missing}")
        cross = np.asarray(arrays["cross"], dtype=np.float64)
        if cross.ndim != 2 or cross.shape[0] != cross.shape[1]:
            raise InputError("stats.cross", "a square matrix", cross.shape)
        vectors = [np.asarray(arrays[f], dtype=np.float64) for f in _FIELDS[:4]]
        for name, vec in zip(_FIELDS, vectors):
            if vec.shape != (cross.shape[0],):
                raise InputError(f"stats.{name}", f"a vector of {cross.shape[0]} units", vec.shape)
        return cls(float(np.asarray(arrays["count"])), vectors[0], vectors[1], vectors[2], vectors[3], cross)


class _Recorder(torch.fx.Interpreter):
    """Runs ``graph`` with ``module``'s submodules and parameters, keeping the outputs of the ``wanted`` nodes."""

    def __init__(self, module: nn.Module, graph_module: torch.fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(module, garbage_collect_values=True, graph=graph_module.graph)
        self.graph_module = graph_module
        self.wanted = wanted
        self.seen: dict[str, torch.Tensor] = {}

    def fetch_attr(self, target: str) -> Any:
        try:
            return super().fetch_attr(target)
        except (AttributeError, RuntimeError):  # constants the tracer attached to the graph module only
            value: Any = self.graph_module
            for atom in target.split("."):
                value = getattr(value, atom)
            return value

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            self.seen[n.name] = out
        return out


@contextlib.contextmanager
def _hooks(model: nn.Module, hooked: set[tuple[str, str]]) -> Iterator[dict[Any, torch.Tensor]]:
    """Forward hooks on ``model``'s submodules: ``(path, "input")`` keeps the first input, ``(path, "output")`` the
    output (its first element when a tuple), in the yielded dict under ``(path, hook)``."""
    seen: dict[Any, torch.Tensor] = {}
    handles = []

    def keep(key: tuple[str, str], value: Any) -> None:
        seen[key] = value[0] if isinstance(value, (tuple, list)) else value

    for path, hook in hooked:
        module = model.get_submodule(path)
        if hook == "input":
            handles.append(module.register_forward_pre_hook(lambda _m, args, key=(path, hook): keep(key, args)))
        else:
            handles.append(module.register_forward_hook(lambda _m, _args, out, key=(path, hook): keep(key, out)))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


_FASTPATH_LOCK = threading.Lock()
_FASTPATH_STATE = {"users": 0, "before": True}


@contextlib.contextmanager
def _python_attention() -> Iterator[None]:
    """PyTorch's fused fast path of ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` (taken in eval mode
    without gradients) calls no submodule, so no hook inside sees anything: off while statistics are collected (a
    process-wide setting: counted, so that clients collecting in threads at once restore it only when the last ends)."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    with _FASTPATH_LOCK:
        if _FASTPATH_STATE["users"] == 0:
            _FASTPATH_STATE["before"] = mha.get_fastpath_enabled()
            mha.set_fastpath_enabled(False)
        _FASTPATH_STATE["users"] += 1
    try:
        yield
    finally:
        with _FASTPATH_LOCK:
            _FASTPATH_STATE["users"] -= 1
            if _FASTPATH_STATE["users"] == 0:
                mha.set_fastpath_enabled(bool(_FASTPATH_STATE["before"]))


def _probe_rows(value: Any, probe: Probe, size: int, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InputError(where, "a probe on a node whose output is a tensor", type(value).__name__)
    dim = probe.dim % value.dim() if -value.dim() <= probe.dim < value.dim() else None
    span = probe.outer * size * probe.inner
    if dim is None or probe.start + span > value.shape[dim]:
        raise InputError(where, f"{probe.outer} x {size} x {probe.inner} units from {probe.start} on axis {probe.dim}", tuple(value.shape))
    seg = value.narrow(dim, probe.start, span)
    seg = seg.reshape(*seg.shape[:dim], probe.outer, size, probe.inner, *seg.shape[dim + 1 :])
    return seg.movedim(dim + 1, -1).reshape(-1, size)


def collect_correlations(
    reference: nn.Module,
    own: nn.Module,
    spec: PermutationSpec,
    graph_ref: torch.fx.GraphModule | None,
    graph_own: torch.fx.GraphModule | None,
    X: np.ndarray,
    *,
    batch_size: int = 256,
    device: str | torch.device | None = None,
) -> dict[str, GroupStats]:
    """Per-group activation statistics of ``reference`` against ``own`` on ``X`` (what a client sends).

    Parameters
    ----------
    reference, own : nn.Module
        The two models (same architecture); their parameters are used as they are, in eval mode.
    spec : PermutationSpec
        Its probes name nodes of the traced graphs.
    graph_ref, graph_own : torch.fx.GraphModule or None
        The traced models (e.g. ``rayfuse.symmetry.trace_model``); run with the modules' own submodules and
        parameters. None: ``torch.fx.symbolic_trace`` of the module.
    X : ndarray
        The inputs, batch first.
    batch_size : int
        Rows per forward pass.
    device : str or torch.device, optional
        Where the models run (they are moved there and back).

    Returns
    -------
    dict of str to GroupStats
        One entry per group with probes, accumulated over the batch and every other axis of the probe's output (and
        over its ``outer`` / ``inner`` blocks). Nothing per sample.
    """
    dev = resolve_device(device)
    data = batches(X, batch_size, param_dtype(reference), dev)
    graph_ref = graph_ref if graph_ref is not None else torch.fx.symbolic_trace(reference)
    graph_own = graph_own if graph_own is not None else torch.fx.symbolic_trace(own)
    probed = [g for g in spec.groups if g.probes]
    nodes = {n.name for n in graph_ref.graph.nodes} & {n.name for n in graph_own.graph.nodes}
    submodules = {name for name, _ in reference.named_modules()} & {name for name, _ in own.named_modules()}
    for g in probed:
        for probe in g.probes:
            if probe.hook and probe.node not in submodules:
                raise InputError(f"spec.{g.name}.probes", "a submodule of both models", probe.node, suggest(probe.node, submodules).strip())
            if not probe.hook and probe.node not in nodes:
                raise InputError(f"spec.{g.name}.probes", "a node of both traced models", probe.node, suggest(probe.node, nodes).strip())
    wanted = {p.node for g in probed for p in g.probes if not p.hook}
    hooked = {(p.node, p.hook) for g in probed for p in g.probes if p.hook}
    acc: dict[str, list[Any]] = {}
    attention = _python_attention() if hooked else contextlib.nullcontext()
    with evaluating(reference, dev), evaluating(own, dev), torch.no_grad(), attention:
        for x in data:
            runs = []
            for module, graph in ((reference, graph_ref), (own, graph_own)):
                recorder = _Recorder(module, graph, wanted)
                with _hooks(module, hooked) as seen:
                    recorder.run(x)
                runs.append({**recorder.seen, **seen})
            for g in probed:
                for probe in g.probes:
                    where = f"spec.{g.name}.probes.{probe.node}"
                    seen_at = (probe.node, probe.hook) if probe.hook else probe.node
                    if seen_at not in runs[0] or seen_at not in runs[1]:
                        raise InputError(where, f"the {probe.hook} of submodule {probe.node} seen in the forward pass", "never called")
                    a = _probe_rows(runs[0][seen_at], probe, g.size, where).to(torch.float64)
                    b = _probe_rows(runs[1][seen_at], probe, g.size, where).to(torch.float64)
                    parts = [float(a.shape[0]), a.sum(0), b.sum(0), (a * a).sum(0), (b * b).sum(0), a.T @ b]
                    if g.name in acc:
                        acc[g.name] = [s + p for s, p in zip(acc[g.name], parts)]
                    else:
                        acc[g.name] = parts
    return {
        name: GroupStats.from_arrays({"count": parts[0], **{f: p.cpu().numpy() for f, p in zip(_FIELDS, parts[1:])}})
        for name, parts in acc.items()
    }


_TIE_WEIGHT = 1e-3


def unit_similarity(
    reference: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray], group: PermGroup, *, device: str | torch.device | None = None
) -> np.ndarray:
    """The cosine similarity of the two models' units by their weights, each unit's values along each of the group's
    axes sorted (so the other groups' permutations do not matter): ``(size, size)``, reference units as rows.
    ``device``: the sorts and the product computed there with torch (float64), else the product with numpy."""
    if device is not None:
        dev = resolve_device(device)

        def device_rows(params: Mapping[str, np.ndarray]) -> torch.Tensor:
            views = [
                torch.as_tensor(axis.view(np.asarray(params[axis.key], dtype=np.float64), group.size), device=dev) for axis in group.axes
            ]
            r = sorted_unit_rows(views)
            return r / torch.clamp(torch.linalg.vector_norm(r, dim=1, keepdim=True), min=1e-12)

        return (device_rows(reference) @ device_rows(model).T).cpu().numpy()

    def rows(params: Mapping[str, np.ndarray]) -> np.ndarray:
        views = [torch.as_tensor(axis.view(np.asarray(params[axis.key], dtype=np.float64), group.size)) for axis in group.axes]
        r = sorted_unit_rows(views).numpy()
        return r / np.maximum(np.linalg.norm(r, axis=1, keepdims=True), 1e-12)

    return rows(reference) @ rows(model).T


def solve_activation_perms(stats: Mapping[str, GroupStats], *, executor: Executor | None = None) -> Perms:
    """Per group, the permutation ``p`` that maximises the summed correlation of own unit ``p[i]`` with reference unit
    ``i`` (so ``spec.apply(own, p)`` is in the reference's frame); the groups are solved through ``executor`` in
    batches (:func:`rayfuse.matching.solve_assignments`)."""
    return solve_activation_perms_many([stats], executor=executor)[0]


def solve_activation_perms_many(
    stats: Sequence[Mapping[str, GroupStats]],
    *,
    executor: Executor | None = None,
    ties: Sequence[Mapping[str, np.ndarray]] | None = None,
    device: str | torch.device | None = None,
) -> list[Perms]:
    """:func:`solve_activation_perms` for several models at once: every (model, group) problem of a sweep goes to
    ``executor`` in one batched call (on Ray: a few tasks for the whole sweep, not one round trip per model).

    ``ties``: per model and group, a similarity in ``[-1, 1]`` that decides between units the activations cannot tell
    apart (a unit that never varies on the data correlates with nothing); weighted ``1e-3``, it changes no assignment
    the correlations decide. ``device``: where the correlations are computed (:meth:`GroupStats.correlation`); the
    assignments are solved on CPUs (scipy) whatever it is."""
    problems = [(k, name) for k, model_stats in enumerate(stats) for name in model_stats]
    costs = []
    for k, name in problems:
        corr = stats[k][name].correlation(device)
        if not np.isfinite(corr).all():
            raise InputError(f"stats.{k}.{name}", "finite statistics", "NaN or infinite correlations")
        tie = ties[k].get(name) if ties is not None else None
        costs.append(-corr if tie is None else -(corr + _TIE_WEIGHT * tie))
    found: list[Perms] = [{} for _ in stats]
    for (k, name), perm in zip(problems, solve_assignments(costs, executor)):
        found[k][name] = perm
    return found


def activation_matching(
    models: Sequence[Mapping[str, np.ndarray]],
    spec: PermutationSpec,
    collect: Callable[[Params], Sequence[Mapping[str, GroupStats]]],
    *,
    weights: Sequence[float] | None = None,
    sweeps: int = 3,
    executor: Executor | None = None,
    fallback: str = "weight",
    device: str | torch.device | None = None,
) -> Alignment:
    """Align N models by activation matching against an evolving reference.

    The reference starts as model 0. Each sweep, ``collect(reference_params)`` returns every model's
    :class:`GroupStats` against the reference, in model order (one client step on every client in a federation; a
    local pass over given data in ``rayfuse fuse``), :func:`solve_activation_perms_many` turns them into each model's
    permutations (every group of every model in one batched executor call), and the reference
    becomes the weighted average of the aligned models. Groups without statistics are aligned by weight matching onto
    the reference (``fallback="weight"``) or left as they are (``fallback="identity"``). It stops when a sweep changes
    no permutation (``converged``) or after ``sweeps`` sweeps.

    Parameters
    ----------
    models : list of dict
        State dicts (same keys and shapes).
    spec : PermutationSpec
        The permutation groups (with probes for the groups matched by activations).
    collect : callable
        ``collect(reference_params) -> [dict[str, GroupStats], ...]``, one per model.
    weights : list of float, optional
        The models' weights in the reference (default equal).
    sweeps : int
        At most this many sweeps.
    executor : callable, optional
        Runs the assignment solves (default threads).
    fallback : {"weight", "identity"}
        What aligns the groups without statistics.
    device : str or torch.device, optional
        Where the cost matrices (correlations, weight similarities, the fallback's weight matching) are computed with
        torch (the coordinator's GPU); default: numpy (and torch) on the CPU. The assignments are solved by scipy on CPUs.

    Returns
    -------
    Alignment
        ``objective`` per sweep: the weighted mean, over models, of the mean correlation of matched units;
        ``quality``: per model and group with statistics, each aligned unit's correlation with its reference unit in
        the last sweep.
    """
    if fallback not in ("weight", "identity"):
        raise InputError("fallback", "'weight' or 'identity'", fallback)
    if sweeps < 1:
        raise InputError("sweeps", "at least 1", sweeps)
    check_models(models)
    spec.check({k: np.shape(v) for k, v in models[0].items()}, where="spec")
    w = normalize_weights(weights, len(models))
    sizes = {g.name: g.size for g in spec.groups}
    reference: Params = {k: np.asarray(v) for k, v in models[0].items()}
    perms: list[Perms] = [spec.identity() for _ in models]
    objective: list[float] = []
    converged = False
    for _ in range(sweeps):
        collected = [dict(stats) for stats in collect(reference)]
        if len(collected) != len(models):
            raise InputError("collect", f"statistics of {len(models)} models", len(collected))
        for k, stats in enumerate(collected):
            for name, s in stats.items():
                if name not in sizes:
                    raise InputError(f"stats.{k}", f"statistics of the spec's groups ({', '.join(sizes)})", name)
                if s.size != sizes[name]:
                    raise InputError(f"stats.{k}.{name}", f"statistics of {sizes[name]} units", s.size)
        new: list[Perms] = []
        scores = []
        quality = []
        ties = [
            {name: unit_similarity(reference, model, spec.group(name), device=device) for name in stats}
            for model, stats in zip(models, collected)
        ]
        solved = solve_activation_perms_many(collected, executor=executor, ties=ties, device=device)
        for model, stats, found in zip(models, collected, solved):
            quality.append({n: stats[n].correlation(device)[np.arange(sizes[n]), p] for n, p in found.items()})
            scores.append(float(np.mean([q.mean() for q in quality[-1].values()])) if found else 0.0)
            model_perms = {**spec.identity(), **found}
            rest = [g for g in spec.groups if g.name not in found]
            if rest and fallback == "weight":
                partial = spec.apply(model, found)
                extra, _ = match_weights(reference, partial, PermutationSpec(tuple(rest)), device=device)
                model_perms.update(extra)
            new.append(model_perms)
        changed = any(not np.array_equal(a[n], b[n]) for a, b in zip(new, perms) for n in a)
        perms = new
        objective.append(float(np.dot(w, scores)))
        reference = weighted_average([spec.apply(m, p) for m, p in zip(models, perms)], w)
        if not changed and len(objective) > 1:
            converged = True
            break
    return Alignment(perms, len(objective), objective, converged, quality)
