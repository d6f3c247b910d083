"""The tensor-by-tensor merges rayfuse computes as mergekit does (:mod:`rayfuse.finetunes.taskvec`) and the data-aware
ones (:mod:`rayfuse.finetunes.statistics`), as :class:`~rayfuse.finetunes.tensor_merge.TensorMerge` entries.

mergekit configures one generalized task arithmetic into its ``task_arithmetic``, ``ties``, ``dare_linear`` and
``dare_ties``; here they are the rows of :data:`~rayfuse.finetunes.config.TASK_VECTOR_METHODS` given to one streaming
merge, with mergekit's parameter names and defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch

from rayfuse.finetunes.config import TASK_VECTOR_METHODS, TaskVectorMethod
from rayfuse.finetunes.taskvec import Rescale, linear_stream, peak_tensors, slerp_owned, task_vector_merge_stream
from rayfuse.finetunes.tensor_merge import Loader, MergeFn, StreamFn, TensorMerge

__all__ = ["MERGES"]

_MERGEKIT = "mergekit (arcee-ai/mergekit at a6e4028)"
PerModel = Sequence[Mapping[str, float]]
Globals = Mapping[str, float | bool]


def _given(x: torch.Tensor) -> Loader:
    """A loader of a tensor already read: a fresh copy each call, as a file's loader gives (the streaming merges work
    in place on what a loader returns, and the sign election reads each model more than once)."""
    return lambda: x.clone()


def _tensor_form(stream: StreamFn) -> MergeFn:
    """A streaming merge called with tensors already read (``TensorMerge.fn``): each given through a loader of copies."""

    def fn(base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, extra: Sequence[Any]) -> torch.Tensor:
        return stream(None if base is None else _given(base), [_given(x) for x in tuned], per_model, g, extra)

    return fn


def _rescale(value: object) -> Rescale:
    return cast(Rescale, "l1" if value is True else None if value is False else value)


def _task_vectors(method: TaskVectorMethod) -> TensorMerge:
    def stream(
        base: Loader | None,
        tuned: Sequence[Loader],
        per_model: PerModel,
        g: Globals,
        generators: Sequence[Any],
    ) -> torch.Tensor:
        assert base is not None  # base="required"
        return task_vector_merge_stream(
            base,
            tuned,
            [p["weight"] for p in per_model],
            [p["density"] for p in per_model],
            method,
            normalize=bool(g["normalize"]),
            lam=float(g["lambda"]),
            rescale=_rescale(g["rescale"]),
            generators=list(generators),
        )

    return TensorMerge(
        "",
        _tensor_form(stream),
        "",
        _MERGEKIT,
        per_model={"weight": 1.0, "density": 1.0},
        globals={"lambda": 1.0, "normalize": method.normalize, "rescale": method.rescale, "int8_mask": False},
        exact=method.sparsify != "random",
        stream=stream,
        choices={"rescale": (True, False, "l1", "density")},
    )


def _slerp_stream(base: Loader | None, tuned: Sequence[Loader], per_model: PerModel, g: Globals, generators: Sequence[Any]) -> torch.Tensor:
    assert base is not None
    return slerp_owned(float(g["t"]), base(), tuned[0]())


def _linear_stream(normalized: bool) -> StreamFn:
    def stream(base: Loader | None, tuned: Sequence[Loader], per_model: PerModel, g: Globals, generators: Sequence[Any]) -> torch.Tensor:
        weights = [1.0] * len(tuned) if normalized else [p["weight"] for p in per_model]
        return linear_stream(tuned, weights, normalize=normalized or bool(g["normalize"]))

    return stream


def _data_aware(kind: Literal["fisher", "regmean"]) -> MergeFn:
    def fn(
        base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, statistics: Sequence[Any]
    ) -> torch.Tensor:
        """Fisher-weighted averaging or RegMean of one tensor (:func:`rayfuse.finetunes.statistics.merge_task_vectors`:
        the merges aligned fusion and the federated ``fedmerge`` use), from each model's statistic. With a base, the
        task vectors ``x_i - base`` are merged and the base added: the same as merging the models where the statistics
        determine the result, and the base's value where they do not (a RegMean Gram singular along inputs no site's
        data excites keeps the base there, where the least-squares merge of the models would zero it)."""
        from rayfuse.finetunes.statistics import merge_task_vectors

        origin = base.double().numpy() if base is not None else None
        values = [{"t": x.double().numpy() - (origin if origin is not None else 0.0)} for x in tuned]
        given = [{"t": s.double().numpy()} for s in statistics]
        merged = merge_task_vectors(values, given, [p["weight"] for p in per_model], kind, regmean_alpha=float(g.get("alpha", 0.9)))["t"]
        if origin is not None:
            merged = origin + merged
        return torch.from_numpy(np.asarray(merged)).to(tuned[0].dtype)

    return fn


def _with(merge: TensorMerge, name: str, summary: str, **changes: object) -> TensorMerge:
    from dataclasses import replace

    return replace(merge, name=name, summary=summary, **changes)  # type: ignore[arg-type]


_TV_SUMMARY = {
    "task_arithmetic": "base + lambda * the weighted sum of the task vectors (Ilharco et al. 2023)",
    "ties": "task vectors trimmed to their largest entries (density), signs elected, agreeing entries averaged (Yadav et al. 2023)",
    "dare_linear": "task vectors randomly dropped (1 - density) and rescaled, then summed (Yu et al. 2024)",
    "dare_ties": "DARE's random drop with TIES's sign election (Yu et al. 2024)",
}


def _linear(name: str, normalized: bool, summary: str, aliases: tuple[str, ...] = ()) -> TensorMerge:
    stream = _linear_stream(normalized)

    return TensorMerge(
        name,
        _tensor_form(stream),
        summary,
        _MERGEKIT,
        per_model={} if normalized else {"weight": None},  # required, as mergekit's linear requires it
        globals={} if normalized else {"normalize": True},
        base="optional",
        stream=stream,
        peak=lambda models: peak_tensors("linear", models),
        aliases=aliases,
    )


MERGES: dict[str, TensorMerge] = {
    **{
        name: _with(_task_vectors(tv), name, _TV_SUMMARY[name], peak=lambda models, name=name: peak_tensors(name, models))
        for name, tv in TASK_VECTOR_METHODS.items()
    },
    "slerp": TensorMerge(
        "slerp",
        _tensor_form(_slerp_stream),
        "spherical interpolation from the base (t = 0) to the other model (t = 1), linear where they are colinear",
        _MERGEKIT,
        globals={"t": None},
        stream=_slerp_stream,
        models=(1, 1),
        peak=lambda models: peak_tensors("slerp", models),
    ),
    "average": _linear("average", True, "uniform parameter average, tensor by tensor (no alignment)"),
    "weighted_average": _linear(
        "weighted_average", False, "sum_k a_k w_k / sum_k a_k with each model's weight a_k (mergekit's linear)", ("linear",)
    ),
    "fisher": TensorMerge(
        "fisher",
        _data_aware("fisher"),
        "Fisher-weighted averaging from each model's diagonal Fisher (statistics:); task vectors with a base (Matena & Raffel 2022)",
        "rayfuse.alignment.merge_fisher",
        per_model={"weight": 1.0},
        base="optional",
        statistics="fisher",
    ),
    "regmean": TensorMerge(
        "regmean",
        _data_aware("regmean"),
        "RegMean: each Linear weight the least-squares merge from its layer's input Gram matrices, an embedding table "
        "by its rows' use counts (statistics:) (Jin et al. 2023)",
        "rayfuse.alignment.merge_regmean",
        per_model={"weight": 1.0},
        globals={"alpha": 0.9},
        base="optional",
        statistics="gram",
    ),
}
