"""``rayfuse fuse``: read a fuse file, route it to its registered merge, check everything, then merge and write.

::

    merge_method: weighted_average      # any registered merge (docs/methods/merges.md), or an alias
    models:
      - model: hospital_a.safetensors
        parameters: {weight: 3}         # the merge's per-model parameters (e.g. its sample count)
      - model: hospital_b.pt            # torch.load(weights_only=True): a state_dict of tensors
        parameters: {weight: 1}
    parameters: {normalize: true}       # the merge's own parameters
    dtype: float32                      # optional: the output's float dtype (default: the inputs')
    output: fused.safetensors

:func:`load_fuse_config` validates the file against the one schema (:mod:`rayfuse.merging.schema`), finds its merge in
the registry (:mod:`rayfuse.merging.registry`) and hands it to the loader of the form the merge runs in: the tensor
form (:func:`rayfuse.finetunes.config.load_finetune_config`, streamed by :func:`rayfuse.finetunes.run.run_finetune`),
the checkpoint form (:func:`_load_checkpoints`, run here) or LoRA adapters (:mod:`rayfuse.finetunes.lora`). Each
checks everything first -- the file's keys, the merge's parameters, every model file readable, every model holding
the same tensor names and shapes -- and fails with one line (exit 2) before it merges anything. Model files are read
with ``safetensors`` or ``torch.load(weights_only=True)`` only.

Aligned fusion of any architecture (``weight_matching``, ``activation_matching``) takes the models' class and, where
its parameters need it, a data sample::

    merge_method: activation_matching
    architecture: mypkg.models:ResNetTiny    # or torchvision:<name>
    architecture_args: {num_classes: 10}
    data: {path: sample.npz}                 # arrays X (as the model takes them) and y
    parameters: {merge: average, repair: true}

Every checkpoint is checked against the architecture tensor by tensor, and the data against the model, before
anything is fused; tensors the architecture ties must hold one value (a file that keeps one name of a tied tensor gets
it under every name). What leaves is checked like what enters (:func:`rayfuse.merging.output.check_fused`): every
float tensor finite in the dtype it is written in, tied tensors one value; only then is the file written (a temporary
file renamed). The output's metadata records the architecture, its arguments, the input shape and, for a model whose
groups grew, the permutation spec and each group's width, from which :func:`rayfuse.merging.output.load_fused` builds
the model in one call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
from pydantic import BaseModel

from rayfuse.config import validate_file_section
from rayfuse.errors import InputError, NonFiniteError
from rayfuse.finetunes.config import FinetuneSpec, load_finetune_config
from rayfuse.finetunes.hf import parse_size
from rayfuse.finetunes.lora import LoraSpec, load_lora_config, run_lora
from rayfuse.finetunes.text_fuse import TextFuseSpec, load_text_fuse_config, run_text_fuse
from rayfuse.io import (
    DEFAULT_MAX_SHARD_SIZE,
    check_new_output,
    params_exist,
    read_checkpoint,
    read_params_metadata,
    save_params,
    save_params_cast,
)
from rayfuse.merging.fusers import AlignParams, FuseInputs, Fuser, _spec_for
from rayfuse.merging.output import (
    _META_ARCHITECTURE,
    _META_ARGS,
    _META_SHAPE,
    _META_SPEC,
    _META_WIDTHS,
    check_fused,
    check_ties,
    fill_ties,
    tied_names,
)
from rayfuse.merging.registry import MergeMethod, Route, get_merge
from rayfuse.merging.schema import FuseFile

__all__ = [
    "FuseSpec",
    "load_fuse_config",
    "load_fuse_inputs",
    "fuse_models",
    "run_fuse",
    "check_floats",
    "fused_dtype",
]

# the keys each form reads besides merge_method, models (model, parameters) and parameters; a key set for a form that
# does not read it is refused, naming it and the merge
_KEYS: dict[Route, tuple[str, ...]] = {
    "tensors": ("base_model", "dtype", "out_dtype", "output", "max_shard_size", "threads", "seed"),
    "checkpoints": ("architecture", "architecture_args", "input_shape", "data", "vocab", "dtype", "out_dtype", "output", "max_shard_size"),
    "adapters": ("base_model", "dtype", "out_dtype", "output", "output_kind"),
    "text": ("base_model", "data", "dtype", "out_dtype", "output", "max_shard_size", "threads", "seed"),
}
_MODEL_KEYS: dict[Route, tuple[str, ...]] = {
    "tensors": ("statistics",),
    "checkpoints": ("architecture", "architecture_args"),
    "adapters": (),
    "text": (),
}
_WHY: dict[Route, str] = {
    "tensors": "it merges model files tensor by tensor",
    "checkpoints": "it merges checkpoints of the file's architecture",
    "adapters": "it combines PEFT LoRA adapters",
    "text": "it runs Hugging Face folders on text data",
}


@dataclass(frozen=True)
class FuseSpec:
    """A validated fuse config."""

    method: Fuser
    files: list[Path]
    model_params: list[BaseModel]
    params: BaseModel
    dtype: str | None
    output: Path | None
    architecture: str | None = None
    architecture_args: Mapping[str, Any] | None = None
    input_shape: tuple[int, ...] | None = None
    data: Path | None = None
    data_arrays: tuple[str, str] = ("X", "y")
    config: Path | None = None
    model_architectures: tuple[tuple[str, Mapping[str, Any]] | None, ...] = ()
    vocab: int | None = None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE


def load_fuse_config(
    config: str | Path | Mapping[str, Any], output: str | Path | None = None, max_shard_size: int | None = None
) -> FuseSpec | LoraSpec | FinetuneSpec | TextFuseSpec:
    """Read and validate a fuse config, a YAML file or the same as a dict (its relative paths then from the working
    directory), for the registered merge it names; files are checked to exist, not yet read. ``output`` and
    ``max_shard_size`` (bytes) override the file's."""
    if isinstance(config, Mapping):
        raw: Any = dict(config)
        path = Path("<fuse config>")  # names the errors; relative paths resolve from the working directory
    else:
        from rayfuse.safeyaml import read_yaml_file

        path = Path(config)
        raw = read_yaml_file(path, "fuse config YAML")
    if not isinstance(raw, Mapping):
        raise InputError(str(path), "a mapping (merge_method, models, output...)", type(raw).__name__)
    file = validate_file_section(FuseFile, raw, path)
    method = get_merge(file.merge_method, path)
    route = method.route(file)
    _check_keys(file, method, route, path)
    if route == "adapters":
        return load_lora_config(file, path, output)
    if route == "text":
        text = load_text_fuse_config(file, path, method, output)
        return text if max_shard_size is None else dataclasses.replace(text, max_shard_size=max_shard_size)
    if route == "tensors":
        assert method.tensor is not None
        finetune = load_finetune_config(file, path, method.tensor, output)
        return finetune if max_shard_size is None else dataclasses.replace(finetune, max_shard_size=max_shard_size)
    assert method.fuser is not None
    spec = _load_checkpoints(file, path, method.fuser, output)
    return spec if max_shard_size is None else dataclasses.replace(spec, max_shard_size=max_shard_size)


def _check_keys(file: FuseFile, method: MergeMethod, route: Route, path: Path) -> None:
    """Refuse a key the merge's form does not read, naming it and the merge (a file is routed by its merge, so a key
    of another form is a mistake, not a hint)."""
    given = file.model_fields_set - {"merge_method", "models", "parameters"}
    for key in sorted(given - set(_KEYS[route]), key=list(FuseFile.model_fields).index):
        if route == "tensors" and method.fuser is not None and key in _KEYS["checkpoints"]:  # the averages, without a class
            raise InputError(f"{path}: architecture", f"the class that {key} is for (merge_method {method.name} reads it with one)", "none")
        if key == "architecture" and method.fuser is None:
            why = (
                f"{method.name} merges model files tensor by tensor; the merges of checkpoints of a class: "
                "weight_matching, activation_matching, distill, kl_neurons, the averages"
            )
        else:
            why = _WHY[route]
        raise InputError(f"{path}: {key}", f"no {key} with merge_method {method.name} ({why})", getattr(file, key))
    for i, entry in enumerate(file.models):
        for key in sorted(entry.model_fields_set - {"model", "parameters"} - set(_MODEL_KEYS[route])):
            if key == "statistics" and route == "text" and method.tensor is not None and method.tensor.statistics is not None:
                raise InputError(
                    f"{path}: models.{i}.statistics",
                    f"no statistics file with text data (rayfuse computes {method.name}'s statistics from data:)",
                    entry.statistics,
                    "give either the statistics files or the text",
                )
            if key == "statistics":
                raise InputError(f"{path}: models.{i}.statistics", "statistics only with merge_method fisher or regmean", entry.statistics)
            raise InputError(f"{path}: models.{i}.{key}", f"no {key} with merge_method {method.name} ({_WHY[route]})", getattr(entry, key))


def _load_checkpoints(spec: FuseFile, path: Path, fuser: Fuser, output: str | Path | None) -> FuseSpec:
    """A fuse file for a merge over whole checkpoints of one architecture (:class:`~rayfuse.merging.fusers.Fuser`):
    its parameters, every model file, the output, the data and what the parameters need (architecture, data, input
    shape). Files are checked to exist, not yet read."""
    name = fuser.name
    params = validate_file_section(fuser.Params, spec.parameters, path, "parameters")
    if getattr(params, "spec", None):  # a spec file, relative to the config file like the models
        spec_file = Path(params.spec)  # type: ignore[attr-defined]
        if not spec_file.is_absolute() and not spec_file.is_file():
            spec_file = path.parent / spec_file
        if not spec_file.is_file():
            raise InputError(f"{path}: parameters.spec", "an existing JSON permutation spec (rayfuse symmetry ARCH --json)", params.spec)  # type: ignore[attr-defined]
        params = params.model_copy(update={"spec": str(spec_file)})
    files, per_model, own = [], [], []
    for i, entry in enumerate(spec.models):
        if entry.architecture is None and entry.architecture_args:
            raise InputError(f"{path}: models.{i}.architecture", "the class that this model's architecture_args are for", "none")
        if entry.architecture is not None and not fuser.heterogeneous:
            raise InputError(
                f"{path}: models.{i}.architecture",
                f"no architecture of its own with merge_method {fuser.name} (it fuses "
                "models of one architecture, the file's architecture:)",
                entry.architecture,
                "models of different architectures fuse with merge_method: distill",
            )
        own.append(None if entry.architecture is None else (entry.architecture, dict(entry.architecture_args)))
        file = Path(entry.model)
        if not file.is_absolute() and not file.is_file():
            file = path.parent / file
        if not params_exist(file):
            raise InputError(f"{path}: models.{i}.model", "an existing model file", entry.model)
        if file.is_dir() or file.name.endswith(".index.json"):  # shards (rayfuse.io.save_params): each must exist
            read_params_metadata(file)
        elif file.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
            raise InputError(f"{path}: models.{i}.model", "a .safetensors, .pt, .pth or .bin file", entry.model)
        files.append(file)
        per_model.append(validate_file_section(fuser.ModelParams, entry.parameters, path, f"models.{i}.parameters"))
    shard_size = DEFAULT_MAX_SHARD_SIZE if spec.max_shard_size is None else parse_size(spec.max_shard_size, f"{path}: max_shard_size")
    out = Path(output) if output is not None else (Path(spec.output) if spec.output else None)
    if out is None:
        raise InputError(f"{path}: output", "the fused model's file (output: ... or rayfuse fuse CONFIG OUT)")
    if not out.is_absolute() and output is None:
        out = path.parent / out
    if out.suffix != ".safetensors":
        raise InputError(f"{path}: output", "a .safetensors file", str(out))
    check_new_output(out, key=f"{path}: output", what="a file")
    data = None
    if spec.data is not None and spec.data.max_length is not None:
        raise InputError(
            f"{path}: data.max_length", "no max_length without data.text (it is the texts' length in tokens)", spec.data.max_length
        )
    if spec.data is not None:
        data = Path(spec.data.path)
        if not data.is_absolute() and not data.is_file():
            data = path.parent / data
        if not data.is_file() or data.suffix != ".npz":
            raise InputError(f"{path}: data.path", "an existing .npz file (arrays X and y)", spec.data.path)
    for need, why in fuser.needs(params).items():
        if need == "architecture" and spec.architecture is None:
            raise InputError(f"{path}: architecture", f'the models\' class ("module:Class" or "torchvision:<name>") for {why}')
        if need == "data" and spec.data is None:
            raise InputError(f"{path}: data", f"a sample (data: {{path: sample.npz}} with arrays X and y) for {why}")
        if need == "input_shape" and spec.data is None and spec.input_shape is None:
            raise InputError(f"{path}: input_shape", f"one input's shape (e.g. [1, 8, 8]) for {why}")
    if spec.vocab is not None and not name.endswith("matching") and name not in ("average", "weighted_average"):
        raise InputError(f"{path}: vocab", f"no vocab with merge_method {name} (token ids: weight_matching, or the averages)", spec.vocab)
    if spec.architecture is None and (spec.architecture_args or spec.input_shape):
        raise InputError(f"{path}: architecture", "the class that architecture_args / input_shape are for", "none")
    if spec.architecture is None and spec.vocab is not None:
        raise InputError(f"{path}: architecture", "the class that takes the token ids vocab is for", "none")
    return FuseSpec(
        fuser,
        files,
        per_model,
        params,
        spec.out_dtype or spec.dtype,
        out,
        spec.architecture,
        dict(spec.architecture_args),
        tuple(spec.input_shape) if spec.input_shape else None,
        data,
        (spec.data.features, spec.data.label or "y") if spec.data else ("X", "y"),
        path,
        tuple(own),
        spec.vocab,
        shard_size,
    )


def check_compatible(models: Sequence[Mapping[str, np.ndarray]], files: Sequence[Path]) -> None:
    """Every model must hold the first model's tensor names and shapes (one line naming the first mismatch)."""
    reference = models[0]
    for params, file in zip(models[1:], files[1:]):
        missing = [k for k in reference if k not in params]
        extra = [k for k in params if k not in reference]
        if missing or extra:
            what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
            raise InputError(str(file), f"the tensor names of {files[0].name} ({len(reference)} tensors)", what)
        for key, ref in reference.items():
            if params[key].shape != ref.shape:
                raise InputError(
                    f"{file}: {key}",
                    f"shape {tuple(ref.shape)} as in {files[0].name}",
                    tuple(params[key].shape),
                    "models of different architectures cannot be fused tensor by tensor",
                )
            if (params[key].dtype.kind == "f") != (ref.dtype.kind == "f"):
                raise InputError(f"{file}: {key}", f"a {ref.dtype} tensor as in {files[0].name}", str(params[key].dtype))
        for key, value in params.items():
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise InputError(f"{file}: {key}", "finite values", "NaN or Inf")
    for key, value in reference.items():
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise InputError(f"{files[0]}: {key}", "finite values", "NaN or Inf")


def load_fuse_inputs(spec: FuseSpec, models: Sequence[Mapping[str, np.ndarray]], log: Callable[[str], None] | None = None) -> FuseInputs:
    """Build the architecture (and each model's own, for a method that takes several), check every checkpoint against
    its architecture, load the data and check each architecture takes it."""
    if spec.architecture is None:
        return FuseInputs(log=log)
    from rayfuse.models.architecture import build_architecture, check_checkpoint_fits, check_inputs_fit

    prefix = f"{spec.config}: " if spec.config else ""
    model = build_architecture(spec.architecture, spec.architecture_args, where=f"{prefix}architecture")
    own = spec.model_architectures or tuple(None for _ in models)
    built = [
        model
        if arch is None
        else build_architecture(
            arch[0], arch[1], where=f"{prefix}models.{i}.architecture", args_where=f"{prefix}models.{i}.architecture_args"
        )
        for i, arch in enumerate(own)
    ]
    for i, (params, file, arch) in enumerate(zip(models, spec.files, own)):
        ties = tied_names(built[i])
        fill_ties(cast(dict, params), ties)  # a file saved without the duplicate names (safetensors' save_model)
        check_checkpoint_fits(built[i], params, where=file, ref=spec.architecture if arch is None else arch[0])
        check_ties(params, ties, where=str(file))
    X = y = None
    if spec.data is not None:
        # X as stored, shaped as the model takes it: (N, L, D) sequences for a recurrent or attention model stay
        # (N, L, D) (a training set's (N, H, W) reads as grey images; a model's sample needs no such guess)
        if spec.method.labels:
            from rayfuse.data.datasets import read_data_file

            dataset = read_data_file(spec.data, features=spec.data_arrays[0], label=spec.data_arrays[1], kind="npz", as_stored=True)
            X, y = dataset.X, dataset.y
        else:
            from rayfuse.data.datasets import read_unlabeled_npz

            X = read_unlabeled_npz(spec.data, spec.data_arrays[0], where=f"{prefix}data.path", as_stored=True)
        if spec.vocab is not None:
            X = token_ids(X, spec.vocab, where=f"{prefix}data.path")
        example = X[:2]
        where = f"{prefix}data.path"
    elif spec.input_shape is not None and spec.vocab is not None:
        # random ids (seeded), not zeros: a batch of one repeated token would let the invariance check pass groups that
        # only such inputs leave unchanged
        example = np.random.default_rng(0).integers(0, spec.vocab, (2, *spec.input_shape), dtype=np.int64)
        where = f"{prefix}input_shape"
    elif spec.input_shape is not None:
        example = np.zeros((2, *spec.input_shape), dtype=np.float32)
        where = f"{prefix}input_shape"
    else:
        example = None
    if example is not None:
        try:
            outputs = check_inputs_fit(model, example, where=where)
        except InputError:
            rows = _embedding_rows(model) if spec.vocab is not None else None
            if rows is not None and spec.vocab is not None and spec.vocab > rows:
                raise InputError(
                    f"{prefix}vocab", f"at most the model's vocabulary ({rows} rows in its input embedding)", spec.vocab
                ) from None
            raise
        labels = np.asarray(y) if y is not None else None
        if labels is not None and labels.dtype.kind in "iu" and len(outputs) == 2 and labels.size:
            # class labels (a Fisher's log-likelihood reads the output at each label): within the model's outputs
            if labels.min() < 0 or labels.max() >= outputs[1]:
                raise InputError(
                    f"{prefix}data.path",
                    f"class labels in [0, {outputs[1]}) (the model's {outputs[1]} outputs)",
                    f"labels {int(labels.min())}..{int(labels.max())}",
                )
        for i, (arch, teacher) in enumerate(zip(own, built)):
            if arch is not None:
                check_inputs_fit(teacher, example, where=f"{where} (models.{i}.architecture {arch[0]})", num_outputs=int(outputs[1]))
    heterogeneous = spec.method.heterogeneous
    return FuseInputs(
        model, X, y, example, tuple(built) if heterogeneous else (), tuple(arch is None for arch in own) if heterogeneous else (), log
    )


def _embedding_rows(model: Any) -> int | None:
    """The number of token ids ``model`` embeds: its input embedding's rows (a Hugging Face model's
    ``get_input_embeddings()``, else its first ``nn.Embedding``); ``None`` without one."""
    import torch.nn as nn

    embedding = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(embedding.num_embeddings) if embedding is not None else None


def token_ids(X: np.ndarray, vocab: int, *, where: str) -> np.ndarray:
    """``X`` as int64 token ids (the fuse file's ``vocab``): whole numbers in ``[0, vocab)``, else one line naming
    ``where``. The data reader gives float32, which holds every id below 2**24 exactly; larger ids are refused, as
    float32 may already have rounded them."""
    values = np.asarray(X)
    if values.size and (not np.all(values == np.round(values)) or values.min() < 0 or values.max() >= min(vocab, 2**24)):
        bad = values[(values != np.round(values)) | (values < 0) | (values >= min(vocab, 2**24))].flat[0]
        raise InputError(where, f"token ids: whole numbers in [0, {vocab}) (vocab)", float(bad))
    return np.ascontiguousarray(values.astype(np.int64))


def check_floats(models: Sequence[Mapping[str, np.ndarray]], files: Sequence[Path]) -> None:
    """A model to fuse holds at least one floating-point tensor (an integer-only model has nothing to average)."""
    for params, file in zip(models, files):
        if not params:
            raise InputError(str(file), "a model with at least one tensor", "an empty checkpoint")
        if not any(v.dtype.kind == "f" for v in params.values()):
            name, value = next(iter(params.items()))
            raise InputError(f"{file}: {name}", "a model with floating-point tensors to fuse", f"integer tensors only ({value.dtype})")


def fused_dtype(stored: Sequence[Mapping[str, str]], given: str | None) -> str | None:
    """The dtype to write the fused float tensors in: ``given`` (the fuse file's ``dtype:``), else, when some input is
    stored in a dtype below float32 (``float16``, ``bfloat16``...), the inputs' float dtype when they share one and
    torch's promotion of them otherwise; ``None``: the dtype the fusion computed in (inputs of float32 / float64)."""
    if given is not None:
        return given
    floats = {d for s in stored for d in s.values() if "float" in d}
    if not floats or floats <= {"float32", "float64"}:
        return None
    if len(floats) == 1:
        return next(iter(floats))
    import functools

    import torch

    return str(functools.reduce(torch.promote_types, [getattr(torch, d) for d in sorted(floats)])).replace("torch.", "")


def fuse_models(spec: FuseSpec, models: list[dict[str, np.ndarray]], inputs: FuseInputs | None = None) -> dict[str, np.ndarray]:
    """Fuse already loaded, compatible models. Float tensors are fused in their common dtype, at least float32
    (float16 inputs are fused in float32; :func:`fused_dtype` says what to write them in)."""
    common = np.result_type(np.float32, *[v.dtype for m in models for v in m.values() if v.dtype.kind == "f"]) if models else np.float32
    models = [{k: v.astype(common, copy=False) if v.dtype.kind == "f" else v for k, v in m.items()} for m in models]
    # the fuse file's dtype: is applied when the model is written (run_fuse), after check_fused has seen the values in it
    return spec.method.fuse(models, spec.model_params, spec.params, inputs or FuseInputs())


def run_fuse(spec: FuseSpec | LoraSpec | FinetuneSpec | TextFuseSpec, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load, check, fuse and write; return a summary (tensors, parameters, output).

    Checkpoints in ``bfloat16`` / ``float16`` are fused in float32 and written back in the inputs' dtype (or the fuse
    file's ``dtype:``). LoRA adapters (``merge_method: lora``) go to :func:`rayfuse.finetunes.lora.run_lora`."""
    if isinstance(spec, LoraSpec):
        return run_lora(spec, log)
    if isinstance(spec, TextFuseSpec):  # Hugging Face folders on text (rayfuse.finetunes.text_fuse)
        return run_text_fuse(spec, log)
    if isinstance(spec, FinetuneSpec):  # streamed tensor by tensor (rayfuse.finetunes.run)
        from rayfuse.finetunes.run import run_finetune

        return run_finetune(spec, log)
    loaded = [read_checkpoint(file, mapped=True) for file in spec.files]  # memory-mapped: pages, not copies
    models = [params for params, _ in loaded]
    check_floats(models, spec.files)
    # with an architecture, each checkpoint is checked against it first, which also gives every name of a tied tensor
    # its values: a file that keeps one name of it (safetensors' save_model) then fuses with files that keep both
    inputs = load_fuse_inputs(spec, models, log)
    if not spec.method.heterogeneous:
        check_compatible(models, spec.files)
    else:  # each against its own architecture (load_fuse_inputs), and finite
        for params, file in zip(models, spec.files):
            check_compatible([params], [file])
    try:
        fused = fuse_models(spec, models, inputs)
    except NonFiniteError as exc:  # finite inputs whose products overflow (a matching's costs): the largest names the cause
        raise _overflowed(spec, models, inputs, exc) from None
    output = Path(spec.output) if spec.output is not None else Path("fused.safetensors")  # load_fuse_config always sets it
    dtype = fused_dtype([dtypes for _, dtypes in loaded], spec.dtype)
    check_fused(fused, tied_names(inputs.model) if inputs.model is not None else [], dtype, where=str(output), method=spec.method.name)
    reference = (
        {k: tuple(v.shape) for k, v in inputs.model.state_dict().items()}
        if inputs.model is not None
        else {k: tuple(np.shape(v)) for k, v in models[0].items()}
    )
    resized = {k: (reference[k], tuple(np.shape(v))) for k, v in fused.items() if k in reference and reference[k] != tuple(np.shape(v))}
    metadata = {"method": spec.method.name, "models": ",".join(f.name for f in spec.files), **_fused_metadata(spec, inputs, fused, resized)}
    del loaded, models  # the inputs' maps: the output is written from the fused arrays alone
    # every check is done: the file (or shard folder, past max_shard_size) is staged and renamed, whole or not at all
    if dtype is None:
        save_params(output, fused, metadata, max_shard_size=spec.max_shard_size)
    else:
        save_params_cast(output, fused, dtype, metadata, max_shard_size=spec.max_shard_size)
    return {
        "method": spec.method.name,
        "models": len(spec.files),
        "tensors": len(fused),
        "parameters": int(sum(v.size for v in fused.values())),
        "output": str(spec.output),
        "resized": resized,
    }


def _overflowed(spec: FuseSpec, models: Sequence[Mapping[str, np.ndarray]], inputs: FuseInputs, exc: NonFiniteError) -> InputError:
    """The fusion of finite inputs met a NaN or Inf on the way (a matching's costs overflowed): one line naming the
    input with the largest magnitude, the checkpoint tensor or the data, whose values drive the overflow."""
    where, largest = "", -1.0
    for params, file in zip(models, spec.files):
        for key, value in params.items():
            if value.dtype.kind == "f" and value.size and float(np.abs(value).max()) > largest:
                where, largest = f"{file}: {key}", float(np.abs(value).max())
    if inputs.X is not None and np.asarray(inputs.X).dtype.kind == "f" and np.size(inputs.X):
        if float(np.abs(inputs.X).max()) > largest:
            where, largest = f"{spec.config}: data.path" if spec.config else "data.path", float(np.abs(inputs.X).max())
    return InputError(
        where,
        f"values {spec.method.name} can compute with (it met a NaN or Inf from these finite inputs)",
        f"{largest:.3g}",
        f"{exc}; nothing was written",
    )


def _fused_metadata(spec: FuseSpec, inputs: FuseInputs, fused: Mapping[str, np.ndarray], resized: Mapping[str, Any]) -> dict[str, str]:
    """What :func:`load_fused` needs besides the tensors: the architecture and its arguments, the input shape, and for
    a model whose groups grew (a nonparametric merge) the permutation spec at the architecture's widths and each
    group's width in the file."""
    import json

    out: dict[str, str] = {}
    if spec.architecture is not None:
        out[_META_ARCHITECTURE] = spec.architecture
        # a record for the reader: arguments JSON cannot hold (a Python API caller's objects) are written as repr
        out[_META_ARGS] = json.dumps(dict(spec.architecture_args or {}), sort_keys=True, default=repr)
    if inputs.example is not None:
        out[_META_SHAPE] = json.dumps([int(n) for n in np.shape(inputs.example)[1:]])
    if resized and inputs.model is not None and inputs.example is not None:
        from rayfuse.symmetry.structure import read_group_sizes

        run_spec = _spec_for(inputs, AlignParams(spec=getattr(spec.params, "spec", None)))
        template = {k: tuple(v.shape) for k, v in inputs.model.state_dict().items()}
        out[_META_SPEC] = json.dumps(run_spec.to_dict(), sort_keys=True)
        out[_META_WIDTHS] = json.dumps(read_group_sizes(run_spec, template, {k: np.shape(v) for k, v in fused.items()}), sort_keys=True)
    return out
