"""The fuse file of fine-tune merges, in mergekit's spelling.

::

    merge_method: ties                  # task_arithmetic | ties | dare_linear | dare_ties | slerp | linear | average | weighted_average
                                        # | fisher | regmean (with each model's statistics: file)
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
from typing import Any, Literal

from pydantic import Field, ValidationError

from rayfuse.config import StrictSchema, pydantic_input_error
from rayfuse.errors import InputError, suggest
from rayfuse.io import SHARD_INDEX

__all__ = [
    "TaskVectorMethod",
    "TASK_VECTOR_METHODS",
    "DATA_AWARE",
    "FINETUNE_METHODS",
    "FinetuneSpec",
    "is_finetune",
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

DATA_AWARE = ("fisher", "regmean")
FINETUNE_METHODS = (*TASK_VECTOR_METHODS, "slerp", "linear", "average", "weighted_average", *DATA_AWARE)
_NUMBERS = ("weight", "density", "lambda", "t")
# the keys each method reads: per model, and global (a per-model key may also be given globally, for every model)
_MODEL_KEYS = {
    **{m: ("weight", "density") for m in TASK_VECTOR_METHODS},
    "slerp": (),
    "linear": ("weight",),
    "weighted_average": ("weight",),
    "average": (),
    "fisher": ("weight",),
    "regmean": ("weight",),
}
_GLOBAL_KEYS = {
    **{m: ("weight", "density", "lambda", "normalize", "rescale", "int8_mask") for m in TASK_VECTOR_METHODS},
    "slerp": ("t",),
    "linear": ("weight", "normalize"),
    "weighted_average": ("weight", "normalize"),
    "average": (),
    "fisher": ("weight",),
    "regmean": ("weight", "alpha"),
}
_DTYPE = Literal["bfloat16", "float16", "float32", "float64"]


class _Entry(StrictSchema):
    model: str = Field(min_length=1, description="a Hugging Face folder or a .safetensors file (relative to the config file)")
    parameters: dict[str, Any] = Field(default_factory=dict, description="this model's weight and density")
    statistics: str | None = Field(
        None,
        min_length=1,
        description="fisher / regmean: a .safetensors file of this model's diagonal "
        "Fisher (the tensors' names and shapes) or its layers' input Gram matrices (a weight's name -> (in, in))",
    )


class _File(StrictSchema):
    merge_method: str = Field(min_length=1)
    base_model: str | None = Field(None, min_length=1, description="the model the others are fine-tunes of")
    models: list[_Entry] = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)
    dtype: _DTYPE | None = Field(
        None, description="the output's float dtype (default: each tensor's as the base stores it); the merge computes in float32"
    )
    out_dtype: _DTYPE | None = Field(None, description="mergekit's name for the output dtype; overrides dtype")
    output: str | None = Field(None, min_length=1)
    max_shard_size: int | str = Field("2GB", description='the largest output shard ("2GB", "500MB", bytes)')
    threads: int | None = Field(None, ge=1, description="tensors merged at once (default: the CPU count, at most 8)")
    seed: int = Field(0, description="the seed of DARE's random drop")


@dataclass(frozen=True)
class FinetuneSpec:
    """A validated fine-tune merge."""

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


def is_finetune(raw: Mapping[str, Any], path: Path, output: str | Path | None) -> bool:
    """Whether a fuse file is a fine-tune merge: a ``base_model:``, a merge method only fine-tunes have, or an average
    of Hugging Face folders (or into one)."""
    method = raw.get("merge_method")
    if "base_model" in raw or method in (*TASK_VECTOR_METHODS, "slerp", *DATA_AWARE):
        return True
    if method not in ("average", "weighted_average", "linear"):
        return False
    out = output if output is not None else raw.get("output")
    if isinstance(out, str | Path) and str(out) and Path(out).suffix == "":  # a folder: the Hugging Face layout
        return True
    entries = raw.get("models")
    for entry in entries if isinstance(entries, list) else []:
        model = entry.get("model") if isinstance(entry, Mapping) else None
        folder = _resolve(model, path) if isinstance(model, str) and model else None
        # a folder of shards alone (rayfuse.io.save_params: no config.json) is a model file rayfuse fuse reads itself
        if folder is not None and folder.is_dir() and not ((folder / SHARD_INDEX).is_file() and not (folder / "config.json").is_file()):
            return True
    return False


def _resolve(name: str, config: Path) -> Path:
    file = Path(name)
    if not file.is_absolute() and not file.exists():
        file = config.parent / file
    return file


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
        if key == "density" and not 0 < n <= 1:
            raise InputError(where, "a density in (0, 1] (the fraction of each task vector kept)", n)


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


def _validate(raw: Mapping[str, Any], path: Path) -> _File:
    try:
        return _File.model_validate(dict(raw))
    except ValidationError as exc:
        err = pydantic_input_error(exc, model=_File)
        raise InputError(f"{path}: {err.path}", err.expected, err.got, err.hint) from None


def load_finetune_config(raw: Mapping[str, Any], path: Path, output: str | Path | None = None) -> FinetuneSpec:
    """Validate a fine-tune merge's fuse file (``raw``: the parsed YAML; ``path``: the file, for messages and relative
    paths); files are checked to exist, not yet read."""
    import os

    from rayfuse.finetunes.hf import parse_size
    from rayfuse.io import check_new_output

    spec = _validate(raw, path)
    method = spec.merge_method
    if method not in FINETUNE_METHODS:
        raise InputError(
            f"{path}: merge_method",
            f"a fine-tune merge in {{{', '.join(FINETUNE_METHODS)}}} (with base_model:)",
            method,
            suggest(method, FINETUNE_METHODS).strip(" ()"),
        )
    if spec.base_model is None and (method in TASK_VECTOR_METHODS or method == "slerp"):
        raise InputError(
            f"{path}: base_model",
            f"the model the others are fine-tunes of, for {method} (its task vectors are differences from it)"
            if method != "slerp"
            else "the model slerp starts from (t = 0), for slerp",
        )
    for key, value in spec.parameters.items():
        if key not in _GLOBAL_KEYS[method]:
            raise InputError(
                f"{path}: parameters.{key}",
                f"a parameter of {method} in {{{', '.join(_GLOBAL_KEYS[method])}}}",
                key,
                suggest(key, _GLOBAL_KEYS[method]).strip(" ()"),
            )
        if key in _NUMBERS:
            _check_setting(value, key, f"{path}: parameters.{key}")
        elif key == "rescale" and value not in (True, False, "l1", "density"):
            raise InputError(f"{path}: parameters.rescale", "true (mergekit's L1-norm rescale), false, l1 or density (1 / density)", value)
        elif key in ("normalize", "int8_mask") and not isinstance(value, bool):
            raise InputError(f"{path}: parameters.{key}", "true or false", value)
        elif key == "alpha" and (isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1):
            raise InputError(f"{path}: parameters.alpha", "a number in [0, 1] (the share of the Grams' off-diagonal kept)", value)
    if method == "slerp" and "t" not in spec.parameters:
        raise InputError(f"{path}: parameters.t", "the interpolation position t (0: the base model, 1: the other)")
    base = None
    if spec.base_model is not None:
        base = _resolve(spec.base_model, path)
        if not base.exists():
            raise InputError(f"{path}: base_model", "an existing Hugging Face folder or .safetensors file", spec.base_model)
    models, per_model, statistics = [], [], []
    for i, entry in enumerate(spec.models):
        file = _resolve(entry.model, path)
        if not file.exists():
            raise InputError(f"{path}: models.{i}.model", "an existing Hugging Face folder or .safetensors file", entry.model)
        if method in DATA_AWARE:
            stats = _resolve(entry.statistics, path) if entry.statistics is not None else None
            if stats is None or not stats.is_file() or stats.suffix != ".safetensors":
                what = "diagonal Fisher" if method == "fisher" else "input Gram matrices"
                raise InputError(
                    f"{path}: models.{i}.statistics",
                    f"an existing .safetensors file of this model's {what} for {method}",
                    entry.statistics or "none",
                )
            statistics.append(stats)
        elif entry.statistics is not None:
            raise InputError(f"{path}: models.{i}.statistics", "statistics only with merge_method fisher or regmean", entry.statistics)
        for key, value in entry.parameters.items():
            if key not in _MODEL_KEYS[method]:
                allowed = _MODEL_KEYS[method]
                raise InputError(
                    f"{path}: models.{i}.parameters.{key}",
                    f"a per-model parameter of {method} in {{{', '.join(allowed)}}}"
                    if allowed
                    else f"no per-model parameters with {method}",
                    key,
                )
            _check_setting(value, key, f"{path}: models.{i}.parameters.{key}")
        if base is not None and file.resolve() == base.resolve() and method in TASK_VECTOR_METHODS:
            continue  # mergekit lists the base among the models too; its task vector is zero and it is skipped
        models.append(file)
        per_model.append(dict(entry.parameters))
    if method == "slerp":
        others = [m for m in models if base is None or m.resolve() != base.resolve()]
        if len(others) != 1:
            raise InputError(
                f"{path}: models",
                "exactly two models for slerp: the base_model and one other",
                f"{len(others) + 1} models",
                "merge more models with task_arithmetic, ties or linear",
            )
        models, per_model = others, [{}]
    if not models:
        raise InputError(f"{path}: models", "at least one model besides the base_model", "only the base_model")
    out = Path(output) if output is not None else (Path(spec.output) if spec.output else None)
    if out is None:
        raise InputError(f"{path}: output", "the merged model's folder or .safetensors file (output: ... or rayfuse fuse CONFIG OUT)")
    if not out.is_absolute() and output is None:
        out = path.parent / out
    if out.suffix not in ("", ".safetensors"):
        raise InputError(f"{path}: output", "a folder (Hugging Face layout, no suffix) or a .safetensors file", str(out))
    check_new_output(out, key=f"{path}: output", what="a path")
    threads = spec.threads or max(1, min(8, os.cpu_count() or 1))
    return FinetuneSpec(
        method,
        base,
        tuple(models),
        tuple(per_model),
        dict(spec.parameters),
        spec.out_dtype or spec.dtype,
        out,
        parse_size(spec.max_shard_size, f"{path}: max_shard_size"),
        threads,
        spec.seed,
        path,
        tuple(statistics),
    )
