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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rayfuse.errors import InputError

__all__ = ["Statistic", "STATISTIC_OF", "compute_statistics", "write_statistics", "merge_task_vectors"]

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
    tensors ``keys`` (state-dict names; for ``gram``, the 2-d weights among them): float64 arrays. Nothing of the
    samples is kept: a Fisher is a mean of squared gradients, a Gram a sum of outer products of a layer's inputs."""
    from rayfuse.alignment import diagonal_fisher, input_grams

    if kind == "fisher":
        fisher = diagonal_fisher(model, X, y, batch_size=batch_size, device=device)
        missing = [k for k in keys if k not in fisher]
        if missing:
            raise InputError("target_modules", "parameters of the model (a Fisher is a parameter's)", missing[0])
        return {k: np.asarray(fisher[k], dtype=np.float64) for k in keys}
    grams, _ = input_grams(model, X, batch_size=batch_size, device=device)
    weights = [k for k in keys if k.endswith(".weight") and k in grams]
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
