"""A tensor-by-tensor merge's fuse file checked against its registered merge (:func:`load_fuse_config` of
:mod:`rayfuse.merging` validates the file against the one schema and routes it here), in mergekit's spelling.

::

    merge_method: ties                  # a registered merge that reads model files (rayfuse list merges); fisher and
                                        # regmean with each model's statistics: file
    base_model: base/                   # a Hugging Face folder or a .safetensors file
    models:
      - model: site_a/
        parameters: {weight: 1.0, density: 0.5}
      - model: site_b/
        parameters:
          weight: [{filter: self_attn, value: 0.3}, {value: 0.7}]   # per tensor pattern, first match wins
          density: 0.5
    parameters: {lambda: 1.0, normalize: true}
    dtype: bfloat16                     # the output's float dtype (default: each tensor's, as the base stores it)
    output: merged/                     # a folder (Hugging Face layout, sharded) or a .safetensors file
    max_shard_size: 2GB

A parameter's value is a number, a list of numbers (a gradient interpolated over the layers: the tensor's layer ``i``
of ``L`` reads it at ``i / (L - 1)``, a tensor outside the layers at 0, as mergekit does), or a list of
``{filter, value}`` whose first entry with ``filter`` a substring of the tensor's name (or no filter) gives the value.
Per-model parameters fall back to the global ``parameters:``, then to the method's default.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rayfuse.errors import InputError, suggest

if TYPE_CHECKING:
    from rayfuse.finetunes.tensor_merge import TensorMerge
    from rayfuse.merging.schema import FuseFile

__all__ = [
    "TaskVectorMethod",
    "TASK_VECTOR_METHODS",
    "FinetuneSpec",
    "load_finetune_config",
    "evaluate",
    "layer_positions",
]


@dataclass(frozen=True)
class TaskVectorMethod:
    """A task-vector merge: its sparsifier, its consensus rule and mergekit's defaults for its parameters."""

    sparsify: Literal["magnitude", "random"] | None
    consensus: bool
    normalize: bool
    rescale: bool


# mergekit's registry (mergekit/merge_methods/registry.py): the same four rows
TASK_VECTOR_METHODS: dict[str, TaskVectorMethod] = {
    "task_arithmetic": TaskVectorMethod(None, False, normalize=False, rescale=False),
    "ties": TaskVectorMethod("magnitude", True, normalize=True, rescale=False),
    "dare_linear": TaskVectorMethod("random", False, normalize=False, rescale=True),
    "dare_ties": TaskVectorMethod("random", True, normalize=False, rescale=True),
}

# value bounds of the numeric parameters that have one: (low, high, whether low is included, what the value is)
_BOUNDS: dict[str, tuple[float, float, bool, str]] = {
    "density": (0.0, 1.0, False, "a density in (0, 1] (the fraction of each task vector kept)"),
    "alpha": (0.0, 1.0, True, "a number in [0, 1] (the share of the Grams' off-diagonal kept)"),
    "common_space_fraction": (0.0, 1.0, True, "a fraction in [0, 1] (the share of each layer's rank given to the common subspace)"),
}


@dataclass(frozen=True)
class FinetuneSpec:
    """A validated tensor-by-tensor merge (``merge``: the registered merge, ``method`` its name)."""

    method: str
    base: Path | None
    models: tuple[Path, ...]
    model_params: tuple[Mapping[str, Any], ...]
    params: Mapping[str, Any]
    dtype: str | None
    output: Path
    max_shard_size: int
    threads: int
    seed: int
    config: Path
    statistics: tuple[Path, ...] = ()
    merge: TensorMerge | None = None


def _resolve(name: str, config: Path) -> Path:
    file = Path(name)
    if not file.is_absolute() and not file.exists():
        file = config.parent / file
    return file


def merged_output(file: FuseFile, path: Path, output: str | Path | None) -> Path:
    """The merged model's path (``rayfuse fuse CONFIG OUT``'s ``OUT``, else the file's ``output`` relative to it): a
    folder or a ``.safetensors`` file that does not exist yet; one line otherwise."""
    from rayfuse.io import check_new_output

    out = Path(output) if output is not None else (Path(file.output) if file.output else None)
    if out is None:
        raise InputError(f"{path}: output", "the merged model's folder or .safetensors file (output: ... or rayfuse fuse CONFIG OUT)")
    if not out.is_absolute() and output is None:
        out = path.parent / out
    if out.suffix not in ("", ".safetensors"):
        raise InputError(f"{path}: output", "a folder (Hugging Face layout, no suffix) or a .safetensors file", str(out))
    check_new_output(out, key=f"{path}: output", what="a path")
    return out


def _check_setting(value: Any, key: str, where: str) -> None:
    """A parameter value: a number, a gradient (list of numbers) or a list of {filter, value} (checked recursively)."""
    numbers: list[Any]
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for i, cond in enumerate(value):
            unknown = sorted(set(cond) - {"filter", "value"})
            if unknown or "value" not in cond:
                raise InputError(f"{where}.{i}", "{filter: <part of a tensor name>, value: ...}", unknown or sorted(cond))
            if cond.get("filter") is not None and not isinstance(cond["filter"], str):
                raise InputError(f"{where}.{i}.filter", "a string (part of a tensor name)", cond["filter"])
            _check_setting(cond["value"], key, f"{where}.{i}.value")
        return
    numbers = value if isinstance(value, list) and value else [value]
    for n in numbers:
        if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n):
            raise InputError(where, "a finite number, a list of numbers (over the layers) or a list of {filter, value}", n)
        bound = _BOUNDS.get(key)
        if bound is not None:
            low, high, closed, what = bound
            if not (low <= n if closed else low < n) or n > high:
                raise InputError(where, what, n)


def evaluate(name: str, setting: Any, t: float) -> float | None:
    """A parameter's value for tensor ``name`` at layer position ``t`` (mergekit's ``evaluate_setting``): ``None`` when
    no ``filter`` matches."""
    if isinstance(setting, Mapping):
        setting = [setting]
    if isinstance(setting, bool) or isinstance(setting, int | float | str):
        return setting  # type: ignore[return-value]
    if all(isinstance(e, int | float) for e in setting):
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return (1 - frac) * setting[i0] + frac * setting[i1]
    for cond in setting:
        pattern = cond.get("filter")
        if pattern is None or pattern == "*" or (name and pattern in name):
            return evaluate(name, cond["value"], t)
    return None


_LAYER = re.compile(r"\.(\d+)\.")


def layer_positions(names: list[str]) -> dict[str, float]:
    """Each tensor's position for gradients: ``i / (L - 1)`` for a tensor of layer ``i`` of ``L`` (the first
    ``.<number>.`` of its name), 1 with one layer, and 0 outside the layers (mergekit gives embeddings and the head t = 0;
    the layers are found here from the names, mergekit finds them from its architecture definitions)."""
    index = {n: int(m.group(1)) for n in names if (m := _LAYER.search(n))}
    count = max(index.values(), default=-1) + 1
    return {n: (index[n] / (count - 1) if count > 1 else 1.0) if n in index else 0.0 for n in names}


def _check_parameter(merge: TensorMerge, key: str, value: Any, where: str) -> None:
    """One parameter's value: one of the merge's ``choices`` for it; else a boolean where its default is one; else a
    number (or a gradient / filter list of numbers)."""
    default = merge.globals.get(key, merge.per_model.get(key))
    if key in merge.choices:
        if not any(value is c or (not isinstance(c, bool) and value == c) for c in merge.choices[key]):
            raise InputError(
                where, "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in merge.choices[key]), value
            )
    elif isinstance(default, bool):
        if not isinstance(value, bool):
            raise InputError(where, "true or false", value)
    else:
        _check_setting(value, key, where)


def load_finetune_config(
    file: FuseFile, path: Path, merge: TensorMerge, output: str | Path | None = None, *, computed_statistics: bool = False
) -> FinetuneSpec:
    """Validate a tensor-by-tensor merge's fuse file (``file``: the fuse file, validated; ``path``: where it was read,
    for messages and relative paths) against the registered ``merge``: its parameters, its base, its models and their
    statistics (``computed_statistics``: rayfuse computes them from text data, :mod:`rayfuse.finetunes.text_fuse`,
    and fills ``statistics`` before the merge runs). Files are checked to exist, not yet read."""
    import os

    from rayfuse.finetunes.hf import parse_size

    method = merge.name
    if file.base_model is None and merge.base == "required":
        raise InputError(
            f"{path}: base_model",
            f"the model the others are fine-tunes of, for {method} (its task vectors are differences from it)"
            if method != "slerp"
            else "the model slerp starts from (t = 0), for slerp",
        )
    allowed = (*merge.globals, *(k for k in merge.per_model if k not in merge.globals))
    for key, value in file.parameters.items():
        if key not in allowed:
            raise InputError(
                f"{path}: parameters.{key}",
                f"a parameter of {method} in {{{', '.join(allowed)}}}" if allowed else f"no parameters with {method}",
                key,
                suggest(key, allowed).strip(" ()"),
            )
        _check_parameter(merge, key, value, f"{path}: parameters.{key}")
    for key, default in merge.globals.items():
        if default is None and key not in file.parameters:
            what = "the interpolation position t (0: the base model, 1: the other)" if key == "t" else f"a value of {key} for {method}"
            raise InputError(f"{path}: parameters.{key}", what)
    base = None
    if file.base_model is not None:
        base = _resolve(file.base_model, path)
        if not base.exists():
            raise InputError(f"{path}: base_model", "an existing Hugging Face folder or model file", file.base_model)
    models, per_model, statistics = [], [], []
    for i, entry in enumerate(file.models):
        model = _resolve(entry.model, path)
        if not model.exists():
            raise InputError(f"{path}: models.{i}.model", "an existing Hugging Face folder or model file", entry.model)
        if merge.statistics is not None and not computed_statistics:
            stats = _resolve(entry.statistics, path) if entry.statistics is not None else None
            if stats is None or not stats.is_file() or stats.suffix != ".safetensors":
                what = "diagonal Fisher" if merge.statistics == "fisher" else "input Gram matrices"
                raise InputError(
                    f"{path}: models.{i}.statistics",
                    f"an existing .safetensors file of this model's {what} for {method}",
                    entry.statistics or "none",
                )
            statistics.append(stats)
        elif entry.statistics is not None:
            raise InputError(f"{path}: models.{i}.statistics", "statistics only with merge_method fisher or regmean", entry.statistics)
        for key, value in entry.parameters.items():
            if key not in merge.per_model:
                names = tuple(merge.per_model)
                raise InputError(
                    f"{path}: models.{i}.parameters.{key}",
                    f"a per-model parameter of {method} in {{{', '.join(names)}}}" if names else f"no per-model parameters with {method}",
                    key,
                )
            _check_parameter(merge, key, value, f"{path}: models.{i}.parameters.{key}")
        if base is not None and model.resolve() == base.resolve() and merge.base == "required":
            continue  # mergekit lists the base among the models too; its task vector is zero and it is skipped
        for key, default in merge.per_model.items():
            if default is None and key not in entry.parameters and key not in file.parameters:
                raise InputError(f"{path}: models.{i}.parameters.{key}", f"this model's {key} for {method} (or a global parameters.{key})")
        models.append(model)
        per_model.append(dict(entry.parameters))
    if not models:
        raise InputError(f"{path}: models", "at least one model besides the base_model", "only the base_model")
    low, high = merge.models
    if len(models) < low or (high is not None and len(models) > high):
        if method == "slerp":
            raise InputError(
                f"{path}: models",
                "exactly two models for slerp: the base_model and one other",
                f"{len(models) + 1} models",
                "merge more models with task_arithmetic, ties or linear",
            )
        count = f"{low}" if high == low else f"at least {low}" if high is None else f"{low} to {high}"
        raise InputError(f"{path}: models", f"{count} fine-tuned models for {method} (besides the base_model)", f"{len(models)} models")
    out = merged_output(file, path, output)
    threads = file.threads or max(1, min(8, os.cpu_count() or 1))
    shard = file.max_shard_size if file.max_shard_size is not None else "2GB"
    return FinetuneSpec(
        method,
        base,
        tuple(models),
        tuple(per_model),
        dict(file.parameters),
        file.out_dtype or file.dtype,
        out,
        parse_size(shard, f"{path}: max_shard_size"),
        threads,
        file.seed if file.seed is not None else 0,
        path,
        tuple(statistics),
        merge,
    )
