"""Data-aware merging of fine-tunes: the statistics a site computes on its own data, and the merge of task vectors.

A site holding a fine-tune ``x_i = base + delta_i`` computes, on its own data, with the functions the full-model path
(aligned fusion) uses:

* ``fisher``: the diagonal Fisher of the fine-tuned tensors (:func:`rayfuse.alignment.diagonal_fisher`), one entry
  per entry of each tensor;
* ``regmean``: the Gram matrix of the inputs of each fine-tuned 2-d (Linear) weight
  (:func:`rayfuse.alignment.input_grams`), ``(in, in)``.

:func:`write_statistics` writes them as the ``.safetensors`` file that ``rayfuse fuse``'s ``statistics:`` key reads
(a tensor's name -> its Fisher, or a weight's name -> its Gram), and :func:`merge_task_vectors` merges the task vectors
with them through :func:`rayfuse.alignment.merge_fisher` / :func:`~rayfuse.alignment.merge_regmean`, the merges
``rayfuse fuse``'s ``fisher`` / ``regmean`` run tensor by tensor. Both merges are invariant to adding one base to
every model (the Fisher weights sum to one at each entry; RegMean's ``(sum_i W_i G_i)(sum_i G_i)^-1`` maps a common
``base`` to itself), so merging the task vectors and adding the base equals merging the fine-tuned models.

Each merge is a function of sums over the sites, which is what a secure sum gives (``fedmerge`` under
``federation.secure_aggregation``): :func:`weighted_terms` is one site's share of them, weighted on its own side,
:func:`merge_sums` the merge from their sums, with a bound on its gap from :func:`merge_task_vectors` given a bound on
each sum's error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rayfuse.errors import InputError

__all__ = [
    "Statistic",
    "STATISTIC_OF",
    "compute_statistics",
    "write_statistics",
    "merge_task_vectors",
    "term_shapes",
    "weighted_terms",
    "terms_needed",
    "merge_sums",
]

Statistic = Literal["fisher", "gram"]
#: the statistic each data-aware merge needs (``average`` needs none)
STATISTIC_OF: dict[str, Statistic] = {"fisher": "fisher", "regmean": "gram"}


def compute_statistics(
    model: Any,
    X: np.ndarray,
    y: np.ndarray,
    kind: Statistic,
    keys: Sequence[str],
    *,
    batch_size: int = 256,
    device: Any = None,
) -> dict[str, np.ndarray]:
    """The ``kind`` statistics of ``model`` (the fine-tuned model, its updates in its weights) on ``(X, y)`` for the
    tensors ``keys`` (state-dict names; for ``gram``, the Linear weights among them): float64 arrays. Nothing of the
    samples is kept: a Fisher is a mean of squared gradients, a Gram a sum of outer products of a layer's inputs. A
    model of token-id rows (a Hugging Face classifier, ``masks_padding``) has its Grams at each text's tokens only
    (:func:`rayfuse.alignment.masked_grams`), as ``rayfuse fuse`` computes them from text."""
    from rayfuse.alignment import diagonal_fisher, input_grams, masked_grams

    if kind == "fisher":
        fisher = diagonal_fisher(model, X, y, batch_size=batch_size, device=device)
        missing = [k for k in keys if k not in fisher]
        if missing:
            raise InputError("target_modules", "parameters of the model (a Fisher is a parameter's)", missing[0])
        return {k: np.asarray(fisher[k], dtype=np.float64) for k in keys}
    if getattr(model, "masks_padding", False):  # token-id rows of texts: the Grams at each text's tokens, padding left out
        grams = masked_grams(model, X, batch_size=batch_size)
    else:
        grams, _ = input_grams(model, X, batch_size=batch_size, device=device)
    weights = [k for k in keys if k.endswith(".weight") and k in grams and np.ndim(grams[k]) == 2]
    if not weights:
        raise InputError("target_modules", "at least one nn.Linear weight (RegMean's Grams are a linear layer's inputs')", list(keys)[:3])
    return {k: np.asarray(grams[k], dtype=np.float64) for k in weights}


def write_statistics(path: str | Path, stats: Mapping[str, np.ndarray], kind: Statistic, count: int) -> Path:
    """Write ``stats`` as the ``.safetensors`` file ``rayfuse fuse``'s ``models.<i>.statistics`` reads (float64; the
    metadata says which statistic and over how many samples)."""
    from rayfuse.io import save_params

    file = Path(path)
    if file.suffix != ".safetensors":
        raise InputError(str(file), "a .safetensors file name", file.suffix or "no suffix")
    arrays = {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in stats.items()}
    return save_params(file, arrays, {"rayfuse.statistic": kind, "rayfuse.samples": str(int(count))})


def merge_task_vectors(
    deltas: Sequence[Mapping[str, np.ndarray]],
    stats: Sequence[Mapping[str, np.ndarray]] | None,
    weights: Sequence[float],
    merge: Literal["fisher", "regmean", "average"],
    *,
    regmean_alpha: float = 0.9,
) -> dict[str, np.ndarray]:
    """Merge the task vectors ``deltas`` (each a dict of the fine-tuned tensors' ``x_i - base``) with each site's
    statistics (``fisher``: diagonal Fishers of some of the tensors; ``regmean``: Grams of some 2-d weights), through
    the merges ``rayfuse fuse`` runs; ``average``: their weighted average (task arithmetic with normalised weights).
    Tensors without statistics are averaged with ``weights``. Float64 results."""
    from rayfuse.alignment import merge_average, merge_fisher, merge_regmean

    values = [{k: np.asarray(v, dtype=np.float64) for k, v in d.items()} for d in deltas]
    if merge == "average":
        return merge_average(values, weights)
    if stats is None or len(stats) != len(values):
        raise InputError("statistics", f"one set of statistics per task vector ({len(values)})", 0 if stats is None else len(stats))
    if merge == "fisher":
        return merge_fisher(values, stats, weights)
    return merge_regmean(values, stats, weights, alpha=regmean_alpha)


# -- the merges as functions of sums --------------------------------------------------------------------------------
#
# With w_i a site's weight (its count, or 1), d_i its task vector of a tensor, F_i its Fisher, G'_i its shrunk Gram
# (alpha G + (1 - alpha) diag G) and W the total weight:
#   average: sum_i w_i d_i / W
#   fisher:  (sum_i w_i F_i d_i + eps sum_i w_i d_i) / (sum_i w_i F_i + eps W)   (merge_fisher's w_i (F_i + eps), split
#            so the floor eps W is added exactly by the server: the denominator is never below it)
#   regmean: (sum_i w_i d_i G'_i) (sum_i w_i G'_i)^-1 (merge_regmean's weights scaled to mean 1: a common factor)
# Each site sends, per tensor: sum/<k> = w d; fisher: fisher/<k> = w F, fisher_delta/<k> = w F d; regmean, for a
# weight with a Gram: gram/<k> = w G', gram_delta/<k> = w d G' (d as (out, in)).


def term_shapes(shapes: Mapping[str, Sequence[int]], stat_keys: Sequence[str], merge: str) -> dict[str, tuple[int, ...]]:
    """The keys and shapes of a site's :func:`weighted_terms`: ``shapes`` the task vector's tensors, ``stat_keys`` those
    with a statistic (a Fisher or a Gram)."""
    out = {f"sum/{k}": tuple(int(n) for n in shape) for k, shape in shapes.items()}
    for k in stat_keys:
        shape = tuple(int(n) for n in shapes[k])
        if merge == "fisher":
            out[f"fisher/{k}"] = out[f"fisher_delta/{k}"] = shape
        elif merge == "regmean":
            width = int(np.prod(shape[1:]))
            out[f"gram/{k}"], out[f"gram_delta/{k}"] = (width, width), (shape[0], width)
    return out


def weighted_terms(
    delta: Mapping[str, np.ndarray],
    stats: Mapping[str, np.ndarray] | None,
    weight: float,
    merge: Literal["fisher", "regmean", "average"],
    *,
    regmean_alpha: float = 0.9,
) -> dict[str, np.ndarray]:
    """One site's share of the sums :func:`merge_sums` merges from (see above), weighted by its ``weight``: its task
    vector ``delta`` and its statistics ``stats`` (``fisher``: Fishers; ``regmean``: Grams; ``average``: none). Float64."""
    out: dict[str, np.ndarray] = {}
    for k, d in delta.items():
        d = np.asarray(d, dtype=np.float64)
        out[f"sum/{k}"] = weight * d
        if merge == "average" or stats is None or k not in stats:
            continue
        s = np.asarray(stats[k], dtype=np.float64)
        if merge == "fisher":
            out[f"fisher/{k}"] = weight * s
            out[f"fisher_delta/{k}"] = weight * s * d
        else:
            g = regmean_alpha * s + (1.0 - regmean_alpha) * np.diag(np.diag(s))
            out[f"gram/{k}"] = weight * g
            out[f"gram_delta/{k}"] = weight * (d.reshape(d.shape[0], -1) @ g)
    return out


def terms_needed(present: Sequence[str]) -> list[str]:
    """The terms a merge needs of those some site sent as non-zero (``present``): all but ``sum/<k>`` where
    ``gram/<k>`` is there (RegMean's solve needs the average only where every Gram is zero)."""
    have = set(present)
    return [k for k in present if not (k.startswith("sum/") and f"gram/{k[4:]}" in have)]


def merge_sums(
    sums: Mapping[str, np.ndarray],
    total: float,
    shapes: Mapping[str, Sequence[int]],
    merge: Literal["fisher", "regmean", "average"],
    errors: Mapping[str, float],
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The merge of :func:`merge_task_vectors` from the sites' summed :func:`weighted_terms` (``sums``, every key of
    :func:`term_shapes`; ``total`` the sum of their weights; ``shapes`` the task vector's tensors), and, per tensor, a
    bound on any entry's gap from the merge of the exact sums where each summed entry is within ``errors[key]`` of its
    exact value (float rounding aside; ``inf`` where the sums cannot bound it: a RegMean Gram too close to singular at
    their resolution). Float64 results."""
    from rayfuse.alignment.merge import FISHER_EPS, _solve_right

    merged: dict[str, np.ndarray] = {}
    bounds: dict[str, float] = {}
    for k, shape in shapes.items():
        s_d, e_d = np.asarray(sums[f"sum/{k}"], dtype=np.float64), float(errors.get(f"sum/{k}", 0.0))
        if merge == "fisher" and f"fisher/{k}" in sums:
            e_f, e_fd = float(errors.get(f"fisher/{k}", 0.0)), float(errors.get(f"fisher_delta/{k}", 0.0))
            den = np.asarray(sums[f"fisher/{k}"], dtype=np.float64) + FISHER_EPS * total
            value = (np.asarray(sums[f"fisher_delta/{k}"], dtype=np.float64) + FISHER_EPS * s_d) / den
            # value - exact = (value (den_exact - den) + num - num_exact) / den_exact, den_exact >= max(den - e_f, eps W)
            floor = np.maximum(den - e_f, FISHER_EPS * total)
            bounds[k] = float(np.max((np.abs(value) * e_f + e_fd + FISHER_EPS * e_d) / floor)) if value.size else 0.0
        elif merge == "regmean" and f"gram/{k}" in sums and np.asarray(sums[f"gram/{k}"]).any():
            lhs, rhs = np.asarray(sums[f"gram/{k}"], dtype=np.float64), np.asarray(sums[f"gram_delta/{k}"], dtype=np.float64)
            value = _solve_right(rhs, lhs, s_d.reshape(rhs.shape) / total).reshape(tuple(shape))
            bounds[k] = _solve_bound(
                lhs, value.reshape(rhs.shape), float(errors.get(f"gram/{k}", 0.0)), float(errors.get(f"gram_delta/{k}", 0.0))
            )
        else:  # the average (a RegMean tensor without a Gram, or whose Grams are all zero: merge_regmean's default)
            value, bounds[k] = s_d / total, e_d / total
        merged[k] = value
    return merged, bounds


def _solve_bound(lhs: np.ndarray, value: np.ndarray, e_lhs: float, e_rhs: float) -> float:
    """A bound on ``|X - X_exact|`` entrywise for ``X = rhs lhs^-1`` (``value``) where each entry of ``lhs``, ``rhs``
    is within ``e_lhs``, ``e_rhs`` of the exact one: ``X - X_exact = (dR - X dL) L_exact^-1``, so its spectral norm is
    at most ``(|dR| + |X| |dL|) / (lambda_min(lhs) - |dL|)`` (Weyl), with ``|dL| <= n e_lhs`` and ``|dR| <= sqrt(out n)
    e_rhs`` (Frobenius). On the rows and columns where the summed Gram's diagonal is non-zero: where it is zero, every
    site's diagonal is below half a step there (for :class:`~rayfuse.updates.secure.ScaledSum`, about 2^-61 of the
    largest entry), far below the least-squares cutoff of the exact sums' solve, which leaves those directions out as
    this one does. ``inf`` where those rows hold other non-zero entries, or ``lambda_min`` is within the error."""
    keep = np.diag(lhs) > 0
    if lhs[~keep].any():
        return math.inf
    part = lhs[np.ix_(keep, keep)]
    n = int(keep.sum())
    d_lhs = n * e_lhs
    smallest = float(np.linalg.eigvalsh(part)[0])
    if smallest <= d_lhs:
        return math.inf
    d_rhs = math.sqrt(value.shape[0] * n) * e_rhs
    return (d_rhs + float(np.linalg.norm(value[:, keep], 2)) * d_lhs) / (smallest - d_lhs)
