"""Byzantine-robust aggregators and update-norm clipping, beside :func:`rayfuse.updates.aggregate.weighted_average`.

Every function takes the clients' models as a list of parameter dicts with the same keys and shapes (validated
updates) and returns one parameter dict. The float tensors are read in a fixed key order (the first model's) as one
flat vector per model, in float64, a chunk of coordinates at a time (the stacked ``(n, chunk)`` block of the models
stays small whatever the model's size), and the result is cast back to each tensor's dtype:

* :func:`aggregate_median`: the coordinate-wise median (Yin et al. 2018; Flower's FedMedian).
* :func:`aggregate_trimmed_mean`: per coordinate, the mean after dropping the ``floor(beta n)`` largest and smallest
  values (Yin et al. 2018; Flower's FedTrimmedAvg; ``scipy.stats.trim_mean``).
* :func:`aggregate_krum`: Krum (Blanchard et al. 2017): the model whose summed squared distance to its ``n - f - 2``
  nearest neighbours is smallest; Multi-Krum (``m > 1``): the average of the ``m`` best-scored models.
* :func:`aggregate_bulyan`: Bulyan (El Mhamdi et al. 2018): Krum applied ``n - 2f`` times (each time removing the
  chosen model) selects ``theta = n - 2f`` models; per coordinate, the mean of the ``beta = theta - 2f`` selected values
  closest to their median.
* :func:`aggregate_geometric_median`: the geometric median by the smoothed Weiszfeld iteration of RFA (Pillutla et al.
  2022): ``argmin_z sum_k a_k max(nu, ||w_k - z||)``.
* :func:`clip_updates`: each model's update ``w_k - g`` relative to the global model ``g`` scaled to norm at most
  ``C`` (``g + min(1, C / ||w_k - g||) (w_k - g)``), before any aggregator.

:func:`aggregate` applies an :class:`AggregatorSettings` (the ``aggregator`` key of the methods that average updates,
read by the update pipeline, :mod:`rayfuse.updates.pipeline`, whose last stage it is); its default, ``{name: mean}``,
is :func:`rayfuse.updates.aggregate.weighted_average` itself, so the results of a run that does not set it are
unchanged. :func:`check_aggregator` is each rule's precondition on the number ``n`` of models (run by the pipeline's
pre-start check, before any client trains).

Weighting: ``mean`` and ``geometric_median`` use the sample weights (RFA's ``a_k``); ``median``, ``trimmed_mean``,
Krum's and Bulyan's selection and Bulyan's coordinate-wise step are unweighted, as in their papers and in Flower;
Multi-Krum averages its ``m`` selected models with their sample weights (as Flower does).

Integer tensors (BatchNorm's ``num_batches_tracked``) are counters, not parameters: they take no part in distances,
norms or clipping. ``median``, ``trimmed_mean``, ``bulyan`` and ``geometric_median`` give them their rounded
coordinate-wise median; Krum keeps the chosen model's; ``mean`` and Multi-Krum average them (rounded) as
:func:`~rayfuse.updates.aggregate.weighted_average` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from rayfuse.errors import InputError, RunFailure, key_error
from rayfuse.method import MethodParams
from rayfuse.updates.aggregate import CHUNK, normalize_weights, weighted_average

__all__ = [
    "AggregatorSettings",
    "aggregate",
    "aggregate_median",
    "aggregate_trimmed_mean",
    "aggregate_krum",
    "aggregate_bulyan",
    "aggregate_geometric_median",
    "clip_updates",
    "compute_update_norms",
    "compute_pairwise_distances",
    "score_krum",
    "select_krum",
    "select_bulyan",
    "check_aggregator",
    "check_enough_updates",
]

Params = dict[str, np.ndarray]
Models = Sequence[Mapping[str, np.ndarray]]

NAMES = ("mean", "median", "trimmed_mean", "krum", "bulyan", "geometric_median")
# The settings each rule reads (``clip_norm`` applies to every rule).
_OWN_KEYS = {
    "f": ("krum", "bulyan"),
    "m": ("krum",),
    "beta": ("trimmed_mean",),
    "nu": ("geometric_median",),
    "max_iter": ("geometric_median",),
}
GM_FTOL = 1e-6  # Weiszfeld stops when the objective improves by less than this fraction of itself (RFA's ftol)


class AggregatorSettings(MethodParams):
    """How a method combines its clients' models (the ``aggregator`` key; ``aggregator: median`` is short for
    ``{name: median}``)."""

    name: Literal["mean", "median", "trimmed_mean", "krum", "bulyan", "geometric_median"] = Field(
        "mean", description="mean: the (sample-weighted) average; the others are robust to a minority of bad updates"
    )
    f: int = Field(1, ge=0, description="krum, bulyan: the number of Byzantine clients tolerated")
    m: int = Field(1, ge=1, description="krum: the number of best-scored models averaged (m > 1: Multi-Krum)")
    beta: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: the fraction cut at each end, per coordinate")
    nu: float = Field(1e-6, gt=0, description="geometric_median: the smoothing of the Weiszfeld weights (RFA)")
    max_iter: int = Field(100, ge=1, description="geometric_median: at most this many Weiszfeld iterations")
    clip_norm: float | None = Field(
        None,
        gt=0,
        description="clip each client's update (its model minus the global model) to this L2 norm before aggregating (none: no clipping)",
    )

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _only_own_keys(self) -> AggregatorSettings:
        # Another rule's key at a value other than its default is a mistake (``{name: median, f: 2}`` tolerates nothing
        # more); at its default it is harmless.
        for key, owners in _OWN_KEYS.items():
            if self.name not in owners and getattr(self, key) != type(self).model_fields[key].default:
                raise key_error(key, f"no {key} with aggregator {self.name!r} ({key} is a setting of {' and '.join(owners)})")
        return self

    @model_serializer(mode="wrap")
    def _own_keys_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The rule's own keys (and ``clip_norm``): the resolved config shows what the rule reads."""
        data = handler(self)
        return {k: v for k, v in data.items() if k not in _OWN_KEYS or self.name in _OWN_KEYS[k]}

    @property
    def is_plain_mean(self) -> bool:
        """Today's weighted average, untouched: no robust rule and no clipping."""
        return self.name == "mean" and self.clip_norm is None


def check_aggregator(settings: AggregatorSettings, n: int, *, where: str = "aggregator", what: str = "clients per round") -> None:
    """Refuse settings whose rule cannot run on ``n`` models (the paper's precondition). Raises :class:`InputError`
    naming ``where.f`` or ``where.m``.

    Trimmed mean's ``2 floor(beta n) < n`` holds for every ``beta < 0.5``, which the settings already require.
    """
    f = settings.f
    if settings.name == "krum":
        if n < 2 * f + 3:
            raise InputError(
                f"{where}.f",
                f"n >= 2f + 3 for krum, so f <= {max((n - 3) // 2, -1)} with n = {n} {what}",
                f,
                "lower f or use more clients" if n >= 3 else "krum needs at least 3 clients",
            )
        if settings.m > n - f:
            raise InputError(f"{where}.m", f"m <= n - f = {n - f} for Multi-Krum (n = {n} {what}, f = {f})", settings.m)
    elif settings.name == "bulyan":
        if n < 4 * f + 3:
            raise InputError(
                f"{where}.f",
                f"n >= 4f + 3 for bulyan, so f <= {max((n - 3) // 4, -1)} with n = {n} {what}",
                f,
                "lower f or use more clients" if n >= 3 else "bulyan needs at least 3 clients",
            )


# ---------------------------------------------------------------------------------------------------------------
# Reading the models a chunk of coordinates at a time


def _float_keys(models: Models) -> list[str]:
    return [k for k, v in models[0].items() if np.asarray(v).dtype.kind == "f"]


def _blocks(models: Models, key: str, chunk: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(start, stop, block)``: the models' values of tensor ``key`` at flat positions ``start:stop`` as an
    ``(n, stop - start)`` float64 array."""
    flat = [np.asarray(m[key]).reshape(-1) for m in models]
    size = flat[0].size
    for start in range(0, size, chunk):
        stop = min(start + chunk, size)
        block = np.empty((len(flat), stop - start), dtype=np.float64)
        for row, a in zip(block, flat):
            row[...] = a[start:stop]
        yield start, stop, block


def _cast_like(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    like = np.asarray(like)
    if like.dtype.kind == "f":
        return value.reshape(like.shape).astype(like.dtype, copy=False)
    return np.rint(value).reshape(like.shape).astype(like.dtype)


def _coordinatewise(models: Models, rule: Callable[[np.ndarray], np.ndarray], chunk: int) -> Params:
    """``rule`` (an ``(n, c)`` float64 block -> its ``(c,)`` aggregate) on every float tensor; integer tensors: their
    rounded median."""
    out: Params = {}
    floats = set(_float_keys(models))
    for key, first in models[0].items():
        first = np.asarray(first)
        acc = np.empty(first.size, dtype=np.float64)
        for start, stop, block in _blocks(models, key, chunk):
            acc[start:stop] = rule(block) if key in floats else _median(block)
        out[key] = _cast_like(acc, first)
    return out


def _integer_medians(models: Models, chunk: int) -> Params:
    return {
        key: _cast_like(np.concatenate([_median(b) for _, _, b in _blocks(models, key, chunk)] or [np.empty(0)]), np.asarray(first))
        for key, first in models[0].items()
        if np.asarray(first).dtype.kind != "f"
    }


# Up to this many models, a full sort down the client axis is faster than numpy's partition-based median (which
# selects column by column): it sorts every coordinate's n values at once. Both give the same values.
SORT_BELOW = 64


def _median(block: np.ndarray) -> np.ndarray:
    """The per-column median of an ``(n, c)`` block, as :func:`numpy.median` gives it (the mean of the two middle values
    for even ``n``)."""
    n = len(block)
    if n > SORT_BELOW:
        return np.median(block, axis=0)
    ordered = np.sort(block, axis=0)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _check_count(models: Models, need: int, rule: str) -> None:
    if len(models) < need:
        raise ValueError(f"{rule} needs at least {need} models, got {len(models)}")


# ---------------------------------------------------------------------------------------------------------------
# The rules


def aggregate_median(models: Models, *, chunk: int = CHUNK) -> Params:
    """The coordinate-wise median of ``models`` (unweighted; the mean of the two middle values for even ``n``).

    Parameters
    ----------
    models : list of dict of ndarray
        The clients' models (same keys and shapes).
    chunk : int
        Coordinates read per block.
    """
    _check_count(models, 1, "median")
    return _coordinatewise(models, _median, chunk)


def aggregate_trimmed_mean(models: Models, beta: float, *, chunk: int = CHUNK) -> Params:
    """Per coordinate, the mean of the values left after dropping the ``floor(beta n)`` largest and smallest
    (unweighted).

    Parameters
    ----------
    models : list of dict of ndarray
        The clients' models.
    beta : float
        The fraction cut at each end, ``0 <= beta < 0.5``.
    chunk : int
        Coordinates read per block.
    """
    n = len(models)
    _check_count(models, 1, "trimmed_mean")
    if not 0 <= beta < 0.5:
        raise ValueError(f"beta must be in [0, 0.5), got {beta}")
    cut = int(math.floor(beta * n))

    def trim(block: np.ndarray) -> np.ndarray:
        if cut == 0:
            return block.mean(axis=0)
        if n <= SORT_BELOW:
            return np.sort(block, axis=0)[cut : n - cut].mean(axis=0)
        part = np.partition(block, (cut, n - cut - 1), axis=0)
        return part[cut : n - cut].mean(axis=0)

    return _coordinatewise(models, trim, chunk)


def compute_pairwise_distances(models: Models, *, chunk: int = CHUNK) -> np.ndarray:
    """The ``(n, n)`` matrix of squared Euclidean distances between the models' float parameters (flattened in the
    first model's key order), accumulated a chunk at a time from Gram matrices of the chunk centred on model 0."""
    n = len(models)
    dist = np.zeros((n, n), dtype=np.float64)
    for key in _float_keys(models):
        for _, _, block in _blocks(models, key, chunk):
            block -= block[0]  # distances do not move with the origin; a near origin keeps the Gram's cancellation small
            gram = block @ block.T
            sq = np.diag(gram)
            dist += sq[:, None] + sq[None, :] - 2.0 * gram
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


def score_krum(dist: np.ndarray, f: int) -> np.ndarray:
    """Krum's score of each model: the sum of its squared distances to its ``max(1, n - f - 2)`` nearest other models."""
    n = dist.shape[0]
    k = max(1, n - f - 2)
    others = dist + np.diag(np.full(n, np.inf))  # never one's own neighbour
    return np.sort(others, axis=1)[:, :k].sum(axis=1) if n > 1 else np.zeros(1)


def aggregate_krum(models: Models, f: int, m: int = 1, weights: Sequence[float] | None = None, *, chunk: int = CHUNK) -> Params:
    """Krum (``m = 1``): the model with the smallest Krum score, as it is; Multi-Krum (``m > 1``): the average of the
    ``m`` models with the smallest scores, weighted by ``weights`` (uniform when ``None``).

    Parameters
    ----------
    models : list of dict of ndarray
        The clients' models; ``n >= 2f + 3`` (Blanchard et al. 2017).
    f : int
        The number of Byzantine models tolerated.
    m : int
        How many best-scored models to average, ``1 <= m <= n - f``.
    weights : list of float, optional
        Multi-Krum: the selected models' weights (their sample counts).
    chunk : int
        Coordinates read per block.
    """
    n = len(models)
    if f < 0 or n < 2 * f + 3:
        raise ValueError(f"krum needs n >= 2f + 3 and f >= 0, got n = {n}, f = {f}")
    if not 1 <= m <= n - f:
        raise ValueError(f"multi-krum needs 1 <= m <= n - f = {n - f}, got m = {m}")
    chosen = select_krum(models, f, m, chunk=chunk)
    if m == 1:
        return {k: np.array(v, copy=True) for k, v in models[chosen[0]].items()}
    w = None if weights is None else [weights[i] for i in chosen]
    return weighted_average([models[i] for i in chosen], w)


def select_krum(models: Models, f: int, m: int = 1, *, chunk: int = CHUNK) -> list[int]:
    """The indices of the ``m`` models with the smallest Krum scores, best first (ties: the lower index)."""
    scores = score_krum(compute_pairwise_distances(models, chunk=chunk), f)
    return [int(i) for i in np.argsort(scores, kind="stable")[:m]]


def select_bulyan(dist: np.ndarray, f: int) -> list[int]:
    """Bulyan's selection: Krum on the remaining models (their distances), ``n - 2f`` times, each time moving the
    chosen model to the selection. Returns the indices in the order chosen."""
    remaining = list(range(dist.shape[0]))
    chosen = []
    for _ in range(dist.shape[0] - 2 * f):
        sub = dist[np.ix_(remaining, remaining)]
        best = int(np.argmin(score_krum(sub, f)))
        chosen.append(remaining.pop(best))
    return chosen


def aggregate_bulyan(models: Models, f: int, *, chunk: int = CHUNK) -> Params:
    """Bulyan over Krum (El Mhamdi et al. 2018), unweighted.

    Parameters
    ----------
    models : list of dict of ndarray
        The clients' models; ``n >= 4f + 3``.
    f : int
        The number of Byzantine models tolerated.
    chunk : int
        Coordinates read per block.
    """
    n = len(models)
    if f < 0 or n < 4 * f + 3:
        raise ValueError(f"bulyan needs n >= 4f + 3 and f >= 0, got n = {n}, f = {f}")
    selected = [models[i] for i in select_bulyan(compute_pairwise_distances(models, chunk=chunk), f)]
    beta = len(selected) - 2 * f

    def closest_to_median(block: np.ndarray) -> np.ndarray:
        med = _median(block)
        if beta == len(block):
            return block.mean(axis=0)
        nearest = np.argpartition(np.abs(block - med), beta - 1, axis=0)[:beta]
        return np.take_along_axis(block, nearest, axis=0).mean(axis=0)

    return _coordinatewise(selected, closest_to_median, chunk)


def aggregate_geometric_median(
    models: Models,
    weights: Sequence[float] | None = None,
    *,
    nu: float = 1e-6,
    max_iter: int = 100,
    ftol: float = GM_FTOL,
    chunk: int = CHUNK,
) -> Params:
    """The weighted geometric median of the models' float parameters by RFA's smoothed Weiszfeld iteration.

    Starts from the weighted mean ``z``; each iteration sets ``b_k = a_k / max(nu, ||w_k - z||)`` and
    ``z = sum_k b_k w_k / sum_k b_k``, until the objective ``sum_k a_k ||w_k - z||`` improves by less than ``ftol``
    times itself or after ``max_iter`` iterations (Pillutla et al. 2022, Algorithm 2).

    Parameters
    ----------
    models : list of dict of ndarray
        The clients' models.
    weights : list of float, optional
        ``a_k``, the models' weights (their sample counts; uniform when ``None``).
    nu : float
        The smoothing: distances below it count as ``nu`` (no division by zero at a model).
    max_iter : int
        At most this many Weiszfeld iterations.
    ftol : float
        Relative objective improvement under which the iteration stops.
    chunk : int
        Coordinates read per block.
    """
    if nu <= 0 or max_iter < 1:
        raise ValueError(f"geometric median needs nu > 0 and max_iter >= 1, got nu = {nu}, max_iter = {max_iter}")
    alphas = np.asarray(normalize_weights(weights, len(models)))
    keys = _float_keys(models)

    def combine(b: np.ndarray) -> dict[str, np.ndarray]:
        z = {}
        for key in keys:
            acc = np.empty(np.asarray(models[0][key]).size, dtype=np.float64)
            for start, stop, block in _blocks(models, key, chunk):
                acc[start:stop] = b @ block
            z[key] = acc
        return z

    def distances(z: dict[str, np.ndarray]) -> np.ndarray:
        sq = np.zeros(len(models))
        for key in keys:
            for start, stop, block in _blocks(models, key, chunk):
                block -= z[key][start:stop]
                sq += np.einsum("ij,ij->i", block, block)
        return np.sqrt(sq)

    z = combine(alphas)
    dist = distances(z)
    objective = float(alphas @ dist)
    for _ in range(max_iter):
        b = alphas / np.maximum(nu, dist)
        z = combine(b / b.sum())
        dist = distances(z)
        previous, objective = objective, float(alphas @ dist)
        if abs(previous - objective) < ftol * objective:
            break
    out = {key: _cast_like(z[key], models[0][key]) for key in keys}
    out.update(_integer_medians(models, chunk))
    return {key: out[key] for key in models[0]}


def compute_update_norms(models: Models, reference: Mapping[str, np.ndarray]) -> np.ndarray:
    """``||w_k - g||``: each model's L2 distance to ``reference`` over the float tensors, in float64."""
    norms = np.zeros(len(models))
    for key, g in reference.items():
        g = np.asarray(g)
        if g.dtype.kind != "f":
            continue
        g64 = g.astype(np.float64).reshape(-1)
        for k, model in enumerate(models):
            d = np.asarray(model[key], dtype=np.float64).reshape(-1) - g64
            norms[k] += float(d @ d)
    return np.sqrt(norms)


def clip_updates(models: Models, reference: Mapping[str, np.ndarray], clip_norm: float) -> list[Params]:
    """Each model with its update ``w_k - g`` (relative to the global model ``g = reference``) scaled to L2 norm at
    most ``clip_norm``: ``g + min(1, C / ||w_k - g||) (w_k - g)``. A model already within the norm is returned as it is;
    integer tensors are never clipped. The norm holds up to the parameters' float precision (the result is cast back
    to their dtype).

    Parameters
    ----------
    models : list of dict of ndarray
        The clients' models.
    reference : dict of ndarray
        The global model the clients started from.
    clip_norm : float
        ``C > 0``.
    """
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be positive, got {clip_norm}")
    out: list[Params] = []
    for model, norm in zip(models, compute_update_norms(models, reference)):
        if norm <= clip_norm:
            out.append(dict(model))
            continue
        scale = clip_norm / norm
        clipped: Params = {}
        for key, value in model.items():
            value = np.asarray(value)
            if value.dtype.kind != "f":
                clipped[key] = value
                continue
            # in the tensor's own dtype (as Flower clips): the norm above is float64, the scaling one rounding per value
            g = np.asarray(reference[key], dtype=value.dtype)
            step = value - g
            step *= value.dtype.type(scale)
            step += g
            clipped[key] = step
        out.append(clipped)
    return out


def aggregate(
    models: Models,
    weights: Sequence[float] | None = None,
    settings: AggregatorSettings | None = None,
    *,
    reference: Mapping[str, np.ndarray] | None = None,
    chunk: int = CHUNK,
) -> Params:
    """``models`` combined by the rule of ``settings`` (default: the weighted mean, exactly
    :func:`rayfuse.updates.aggregate.weighted_average`), each first clipped against ``reference`` when
    ``settings.clip_norm`` is set.

    Parameters
    ----------
    models : list of dict of ndarray
        Validated models (same keys and shapes, finite values).
    weights : list of float, optional
        The models' sample counts (``None``: uniform); used by ``mean``, ``geometric_median`` and Multi-Krum's average.
    settings : AggregatorSettings, optional
        The rule and its parameters.
    reference : dict of ndarray, optional
        The global model the updates are relative to; required with ``clip_norm``.
    chunk : int
        Coordinates read per block.
    """
    s = settings if settings is not None else AggregatorSettings()
    if s.clip_norm is not None:
        if reference is None:
            raise ValueError("clipping needs the reference (global) model")
        models = clip_updates(models, reference, s.clip_norm)
    if s.name == "mean":
        return weighted_average(models, weights)
    if s.name == "median":
        return aggregate_median(models, chunk=chunk)
    if s.name == "trimmed_mean":
        return aggregate_trimmed_mean(models, s.beta, chunk=chunk)
    if s.name == "krum":
        return aggregate_krum(models, s.f, s.m, weights, chunk=chunk)
    if s.name == "bulyan":
        return aggregate_bulyan(models, s.f, chunk=chunk)
    return aggregate_geometric_median(models, weights, nu=s.nu, max_iter=s.max_iter, chunk=chunk)


def check_enough_updates(settings: AggregatorSettings, n: int, label: str) -> None:
    """At run time: refuse to aggregate ``n`` valid updates (fewer than planned when clients failed or were rejected)
    that the rule's precondition excludes. Raises :class:`RunFailure`."""
    try:
        check_aggregator(settings, n, what="valid updates")
    except InputError as exc:
        raise RunFailure(f"{label}: {n} valid updates are too few for aggregator {settings.name!r}: {exc}") from None
