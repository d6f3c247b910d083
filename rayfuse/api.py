"""The Python API: run an experiment, or fuse checkpoints, from a script or a notebook.

::

    import rayfuse

    result = rayfuse.run("jobs/quickstart.yaml", methods={"mine": MyMethod}, model=MyNet, dataset=(X, y))
    result.metrics          # one row per method label, one column per final metric
    result.history          # metrics.parquet: method, round, metric, value (and method_name, client)
    result.models["mine"]   # the fused parameters; result.model("mine") is the nn.Module
    rayfuse.fuse("fuse.yaml")  # -> Path of the fused .safetensors

``rayfuse run`` and ``rayfuse fuse`` are a thin layer over :func:`run`, :func:`resume` and :func:`fuse_checkpoints`:
the same checks, the same printed output, the same errors (:class:`InputError`, one line naming the key path).

Objects given here reach the clients and the coordinator with the config:

* ``model``: a callable returning an ``nn.Module``: a class or a function, called ``model(input_shape, num_classes)``
  when it accepts two positional arguments, else ``model()``; ``input_shape`` is one sample's shape (``(D,)`` or
  ``(C, H, W)``). It is called under a seeded RNG wherever the run builds a model. The run's ``config.yaml`` records
  ``model: {name: custom, factory: <module.qualname>}``. Or a mapping ``{client_id: callable, ..., "default":
  callable}`` giving clients models of their own (heterogeneous clients: recorded as
  ``federation.client_overrides.<i>.model``); the clients not listed, and the server, use ``"default"`` if given,
  else the config's ``model:``. Only methods that need the clients' predictions alone (``local``, ``ensemble``,
  ``global``) run with clients of different models.
* ``dataset``: ``(X, y)`` arrays, or a torch ``Dataset`` of ``(x, y)`` pairs (read once, into arrays). The config's
  ``data`` keys still apply (``test_size``, ``val_size``, ``public_size``, ``standardize``) and its ``partition``
  splits the arrays among the clients; ``config.yaml`` records ``data: {dataset: arrays, options: {sha256: ...}}``.
  The arrays travel by value to every client (a simulation: fine for data that fits in memory many times over).
* ``methods``: labels mapped to registered names, :class:`~rayfuse.method.Method` subclasses or instances.

Every argument is checked before the run folder exists (:class:`InputError`, one line naming the argument): a
model instance, or a factory that returns one shared instance, is refused (on every backend; not copied, since every build is seeded);
ragged arrays, a DataFrame alone (a DataFrame or Series as ``X`` or ``y`` is read as its values), a ``Dataset``
whose ``__len__`` / ``__getitem__`` raises, arrays with a silo config or with ``data`` keys they would override, a
``Method`` without ``run`` or whose ``Params`` is not a :class:`~rayfuse.method.MethodParams`, a ``config`` of
another type (``fuse(None)``), ``overrides`` given as one string.

On Ray, the modules that define these objects (a script's ``__main__``, a test module) are pickled by value, so the
actors need not import them. A run given a Python model or arrays cannot be resumed from the command line (its
``config.yaml`` cannot rebuild them).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.config import ExperimentConfig, build_config, read_config_file
from rayfuse.errors import InputError, RunFailure

__all__ = [
    "InputError",
    "RunFailure",
    "RunResult",
    "fuse",
    "fuse_checkpoints",
    "load_fused",
    "resume",
    "run",
    "build_architecture",
    "symmetry",
]

BACKENDS = ("ray", "local")


class ModelFiles(Mapping[str, dict[str, np.ndarray]]):
    """A run's fused models by label, each read from its file (or shard folder) the first time it is asked for and
    kept from then on."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = dict(files)
        self._loaded: dict[str, dict[str, np.ndarray]] = {}

    def __getitem__(self, label: str) -> dict[str, np.ndarray]:
        if label not in self._loaded:
            from rayfuse.io import load_params

            self._loaded[label] = load_params(self.files[label])
        return self._loaded[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __repr__(self) -> str:
        return f"ModelFiles({sorted(self.files)})"


@dataclass
class RunResult:
    """What :func:`run` returns: the run folder and its results, read back as data frames and parameter dicts.

    Attributes
    ----------
    run_dir : Path
        The run folder (``config.yaml``, ``results.json``, ``metrics.parquet``, ``models/``...).
    metrics : pandas.DataFrame
        The final metrics: one row per method label (the index, named ``label``), one column per metric.
    history : pandas.DataFrame
        Every logged metric (``metrics.parquet``): columns ``method`` (the label), ``method_name``, ``round``,
        ``metric``, ``value``, ``client``.
    models : mapping
        The fused parameters by method label (methods that return a model; an ensemble returns none), each read from
        its file in the run folder when first asked for (a run of several-GB models costs no memory until then).
    results : dict
        ``results.json``: status, timings, events, the partition, each method's summary.
    config : ExperimentConfig
        The config the run used (with the model factory and arrays it was given).
    input_shape, num_classes
        One sample's shape and the number of classes (to build :meth:`model`).
    labels : tuple of str
        The method labels, in run order.
    """

    run_dir: Path
    metrics: Any
    history: Any
    models: Mapping[str, dict[str, np.ndarray]]
    results: dict[str, Any]
    config: ExperimentConfig
    input_shape: tuple[int, ...] = ()
    num_classes: int = 0
    labels: tuple[str, ...] = ()

    def model(self, label: str) -> Any:
        """The fused model of method ``label`` as an ``nn.Module`` (in eval mode)."""
        from rayfuse.models import build_model, set_params

        if label not in self.models:
            with_models = sorted(self.models)
            raise InputError(
                "label",
                f"a method that returned a model (one of {with_models})",
                label,
                "this method returned no parameters" if label in self.labels else "",
            )
        model = set_params(build_model(self.config.model, self.input_shape, self.num_classes, seed=0), self.models[label])
        return model.eval()


def run(
    config: str | Path | Mapping[str, Any] | ExperimentConfig | None = None,
    *,
    model: Callable[..., Any] | Mapping[int | str, Callable[..., Any]] | None = None,
    dataset: Any = None,
    methods: Mapping[str, Any] | None = None,
    backend: str | None = None,
    run_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    quiet: bool = False,
    verbose: bool = False,
) -> RunResult:
    """Run an experiment and return its results.

    Parameters
    ----------
    config : str, Path, dict or ExperimentConfig, optional
        A YAML file, the same content as a dict, or a validated config; ``None``: the defaults (the quickstart job).
    model : callable or mapping, optional
        ``model(input_shape, num_classes)`` or ``model()`` returning an ``nn.Module``, instead of ``config.model``; or
        ``{client_id: callable, ..., "default": callable}``: the listed clients' own model factories (each client's
        ``federation.client_overrides.<i>.model``), and ``"default"`` for the other clients and the server (default:
        the config's ``model``).
    dataset : (X, y) arrays or torch Dataset, optional
        The data to split among the clients, instead of ``config.data.dataset``.
    methods : mapping, optional
        Labels mapped to registered method names, ``Method`` subclasses or instances. Parameters for a name or a
        subclass come from the config's ``methods.<label>`` entry if it has one, else the method's defaults. A config
        that names no methods runs these only; one that does runs its own entries and these.
    backend : {"ray", "local"}, optional
        ``"ray"``: client and coordinator actors on Ray (an initialised Ray is reused, else ``federation.address`` /
        ``RAY_ADDRESS`` is joined, else a local Ray is started and stopped at the end); ``"local"``: in-process
        clients. Default: the config's ``federation.backend`` (``"ray"`` unless set).
    run_dir : str or Path, optional
        A new or empty folder for the run; default ``<run.storage>/<run.name>-<time>-<id>``.
    overrides : sequence of str, optional
        ``KEY=VALUE`` overrides, as ``--set`` on the command line.
    quiet, verbose : bool
        Print only the final table / every event (default: one line per notable event, as ``rayfuse run``).

    Returns
    -------
    RunResult

    Raises
    ------
    InputError
        Bad input, before anything starts (one line naming the key path, expected and given value).
    RunFailure
        The run could not go on (``results.json`` records ``status: failed`` and the methods that finished).
    """
    from rayfuse.runner import new_run_dir, prepare_run

    _check_folder_argument(run_dir, "run_dir", optional=True)
    overrides = _overrides(overrides)
    _check_flags(quiet=quiet, verbose=verbose)
    objects = _methods(methods)
    cfg = _config(config, overrides, list(objects))
    if backend is not None:
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise InputError("backend", "'ray' or 'local'", backend)
        cfg = cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"backend": backend})})
    if model is not None:
        cfg = _with_models(cfg, model)
    if dataset is not None:
        from rayfuse.data.datasets import arrays_digest

        _check_dataset_is_used(cfg)
        arrays = _arrays(dataset, as_stored=cfg.data.layout == "sequence")  # (N, L, D) kept as sequences (data.layout)
        cfg = cfg.model_copy(update={"data": cfg.data.with_arrays(arrays, arrays_digest(arrays))})
    _check_outputs(cfg, run_dir)  # before the data loads
    prepared = prepare_run(cfg, methods=objects)  # every check, before a folder or an actor exists
    folder = new_run_dir(cfg, run_dir, key="run_dir")
    user_modules = _user_modules([*(model.values() if isinstance(model, Mapping) else [model]), *objects.values()])
    return _execute(prepared, folder, resume=False, quiet=quiet, verbose=verbose, by_value=user_modules)


def resume(run_dir: str | Path, *, overrides: Sequence[str] = (), quiet: bool = False, verbose: bool = False) -> RunResult:
    """Continue an interrupted or failed run in its own folder (``rayfuse run --resume``): methods that finished are
    loaded, the others continue from their last checkpoint. Only ``federation.*`` keys may be overridden; a run given a
    Python model, arrays or methods as objects cannot be resumed (its ``config.yaml`` cannot rebuild them)."""
    from rayfuse.config import parse_overrides
    from rayfuse.runner import load_run_config, prepare_run

    _check_folder_argument(run_dir, "run_dir")
    overrides = _overrides(overrides)
    _check_flags(quiet=quiet, verbose=verbose)
    cfg = load_run_config(run_dir, parse_overrides(list(overrides)))
    _check_outputs(cfg, run_dir, key="--resume")
    return _execute(prepare_run(cfg), Path(run_dir), resume=True, quiet=quiet, verbose=verbose, by_value=())


def fuse_checkpoints(
    config: str | Path | Mapping[str, Any],
    out: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    max_shard_size: int | None = None,
) -> dict[str, Any]:
    """Fuse checkpoints trained elsewhere (``rayfuse fuse``): every check first, then load, fuse and write.

    Returns the summary: ``method``, ``models`` (how many), ``tensors``, ``parameters`` and ``output`` (the file).
    ``progress`` receives a line per stage of a long fusion (``distill``: one per epoch). ``max_shard_size`` (bytes)
    overrides the fuse file's ``max_shard_size:``: an output above it is written as a shard folder.
    """
    from rayfuse.merging import load_fuse_config, run_fuse

    if isinstance(config, bool) or not isinstance(config, (str, os.PathLike, Mapping)) or (isinstance(config, str) and not config.strip()):
        raise InputError(
            "config",
            "a fuse config: a YAML file path or a dict (merge_method, models, output...)",
            config if isinstance(config, str) else type(config).__name__,
        )
    _check_folder_argument(out, "out", optional=True, what="an output file path")
    if progress is not None and not callable(progress):
        raise InputError("progress", "a callable taking one line of text (e.g. print), or None", type(progress).__name__)
    if max_shard_size is not None and (isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1):
        raise InputError("max_shard_size", "a positive number of bytes", max_shard_size)
    return run_fuse(load_fuse_config(config, None if out is None else str(out), max_shard_size), progress)


def fuse(config: str | Path | Mapping[str, Any], out: str | Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Fuse the checkpoints a fuse config names (a mergekit-style YAML file, or the same keys as a dict whose relative
    paths start from the working directory); return the fused ``.safetensors`` file, or the Hugging Face folder a
    fine-tune merge (``base_model:``, :mod:`rayfuse.finetunes`) was written to.

    ``out`` overrides the config's ``output:``. Raises :class:`InputError` before anything is written. For example,
    aligned fusion of three checkpoints of a user's class::

        rayfuse.fuse({"merge_method": "activation_matching", "architecture": "mypkg.models:Net",
                      "models": [{"model": "a.safetensors"}, {"model": "b.safetensors"}, {"model": "c.pt"}],
                      "data": {"path": "sample.npz"}, "output": "fused.safetensors"})

    Distillation of checkpoints of different architectures into one student of ``architecture`` (data-free without
    ``data``, which then needs ``input_shape``)::

        rayfuse.fuse({"merge_method": "distill", "architecture": "mypkg.models:Student",
                      "models": [{"model": "a.safetensors"}, {"model": "b.safetensors", "architecture": "mypkg.models:Other"}],
                      "data": {"path": "transfer.npz"}, "parameters": {"init": "aligned", "steps": 2000},
                      "output": "fused.safetensors"}, progress=print)

    PEFT LoRA adapters of one base (``merge_method: lora``, :mod:`rayfuse.finetunes.lora`) go in and come out as folders:
    the returned path is the output folder (a PEFT adapter, or with ``output_kind: merged`` the base with the update
    folded in)::

        rayfuse.fuse({"merge_method": "lora", "base_model": "base", "models": [{"model": "site_a"}, {"model": "site_b"}],
                      "parameters": {"combine": "stack"}, "output": "combined"})
    """
    return Path(fuse_checkpoints(config, out, progress)["output"])


def load_fused(
    architecture: Any, path: str | Path, *, args: Mapping[str, Any] | None = None, input_shape: Sequence[int] | None = None
) -> Any:
    """The model a fused file holds, in one call (:func:`rayfuse.merging.load_fused`): ``architecture``
    (``"module:Class"``, a class or a function returning the model, or a model) built at the widths the file records
    (a ``merge: nonparametric`` model is wider than the architecture) and loaded, in eval mode, tied tensors kept tied::

        fused = rayfuse.fuse("fuse.yaml")
        model = rayfuse.load_fused("mypkg.models:Net", fused)   # the fuse file's architecture_args by default
    """
    from rayfuse.merging import load_fused as load

    return load(architecture, path, args=args, input_shape=input_shape)


def build_architecture(
    architecture: str, *, input_shape: Sequence[int] | None = None, dataset: str = "digits", args: Mapping[str, Any] | None = None
) -> tuple[Any, tuple[int, ...]]:
    """The model ``architecture`` names and the shape of one of its samples (``rayfuse symmetry``).

    Parameters
    ----------
    architecture : str
        A registry model (``mlp``, ``rescnn``...; ``args`` are :class:`~rayfuse.config.ModelConfig` fields),
        ``torchvision:<name>`` (``args`` go to ``torchvision.models.get_model``; no pretrained weights) or
        ``module:Class`` (importable; built as ``Class(**args)``).
    input_shape : sequence of int, optional
        One sample's shape; by default the shape of ``dataset``'s samples.
    dataset : str
        Gives the default sample shape and the number of classes (registry and torchvision models).
    """
    from rayfuse.config import ModelConfig, pydantic_input_error
    from rayfuse.data.datasets import load_dataset
    from rayfuse.errors import suggest
    from rayfuse.models.registry import MODELS, _build_torchvision, build_model, torchvision_model_names

    if not isinstance(architecture, str) or not architecture.strip():
        raise InputError(
            "architecture",
            "a registry model name, torchvision:<name> or module:Class",
            architecture if isinstance(architecture, str) else type(architecture).__name__,
        )
    if args is not None and not isinstance(args, Mapping):
        raise InputError("args", "a mapping of keyword arguments (a dict), or None", type(args).__name__)
    if not isinstance(dataset, str):
        raise InputError("dataset", "a registered dataset name (rayfuse list datasets)", type(dataset).__name__)
    if isinstance(input_shape, np.ndarray) and input_shape.ndim == 1:  # a numpy shape: read as its list
        input_shape = input_shape.tolist()
    if input_shape is not None:
        _check_input_shape(input_shape)
    kwargs = dict(args or {})
    if ":" not in architecture and architecture not in MODELS:
        known = MODELS.names()
        raise InputError(
            "architecture",
            f"a registry model ({', '.join(known)}), torchvision:<name> or module:Class",
            architecture,
            suggest(architecture, known).strip(" ()"),
        )
    try:
        data = load_dataset(dataset)
    except InputError as exc:
        raise (exc.at("dataset") if exc.path == "data.dataset" else exc) from None
    shape = tuple(int(s) for s in (input_shape if input_shape is not None else data.X.shape[1:]))
    num_classes = data.num_classes
    prefix, _, name = architecture.partition(":")
    if not name:
        from pydantic import ValidationError

        from rayfuse.models.registry import check_model_size

        try:
            cfg = ModelConfig.model_validate({"name": architecture, **kwargs})
        except ValidationError as exc:
            raise pydantic_input_error(exc, "args", ModelConfig) from None
        try:
            check_model_size(cfg, shape, num_classes)
        except InputError as exc:
            raise exc.at("args." + exc.path.split(".", 1)[1]) from None
        return build_model(cfg, shape, num_classes, seed=0), shape
    if prefix == "torchvision":
        names = torchvision_model_names()
        if name not in names:
            raise InputError("architecture", "a torchvision classification model name", architecture, suggest(name, names).strip(" ()"))
        if len(shape) != 3:
            raise InputError("input_shape", "an image shape C,H,W for a torchvision model", shape)
        try:
            return _build_torchvision(name, shape, num_classes, **kwargs), shape
        except InputError:
            raise
        except (TypeError, ValueError, AssertionError) as exc:  # torchvision's checks of its arguments (torch._assert)
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
            patch = name.rsplit("_", 1)[-1]
            if name.startswith("vit_") and "patch" in first and patch.isdigit():  # vit_b_16: 16-pixel patches
                first += f"; a ViT's image_size is a multiple of its patch size {patch}, e.g. {int(patch) * 14}"
            raise InputError("args", f"arguments torchvision's {name} accepts", kwargs, first) from None
    from rayfuse.models.architecture import build_architecture as build_named

    return build_named(architecture, kwargs, where="architecture", args_where="args"), shape


MAX_SAMPLE_VALUES = 1 << 24  # one example sample of build_architecture / symmetry: 64 MiB of float32 (a 3 x 2364^2 image)


def _check_input_shape(input_shape: Any) -> None:
    """One sample's shape: 1 to 8 whole numbers >= 1 (not booleans), at most ``MAX_SAMPLE_VALUES`` values in all
    (the example batch is allocated from it)."""
    ok = (
        isinstance(input_shape, Sequence)
        and not isinstance(input_shape, (str, bytes))
        and 1 <= len(input_shape) <= 8
        and all(isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) and n >= 1 for n in input_shape)
    )
    if not ok:
        raise InputError(
            "input_shape",
            "one sample's shape: 1 to 8 whole numbers >= 1, such as (1, 8, 8)",
            input_shape if isinstance(input_shape, (str, Sequence)) else type(input_shape).__name__,
        )
    values = int(np.prod([int(n) for n in input_shape], dtype=object))
    if values > MAX_SAMPLE_VALUES:
        raise InputError("input_shape", f"at most {MAX_SAMPLE_VALUES:,} values per sample", f"{tuple(input_shape)}: {values:,}")


def symmetry(
    architecture: str,
    *,
    input_shape: Sequence[int] | None = None,
    dataset: str = "digits",
    args: Mapping[str, Any] | None = None,
    strict: bool = False,
    vocab: int | None = None,
) -> Any:
    """The :class:`~rayfuse.symmetry.PermutationSpec` derived from the model ``architecture`` names (see
    :func:`build_architecture`), traced on a random batch of two samples of ``input_shape`` and checked on the model
    (groups that fail the invariance check are fixed, or with ``strict`` refused).

    ``vocab``: the model takes token ids (a Hugging Face model): the batch holds random integer ids in ``[0, vocab)``
    of ``input_shape`` (e.g. ``(16,)``: a sequence length; required then), instead of floats."""
    import torch

    from rayfuse.data.tokens import MAX_VOCAB
    from rayfuse.symmetry import derive_spec

    if vocab is not None and (
        isinstance(vocab, (bool, np.bool_)) or not isinstance(vocab, (int, np.integer)) or not 1 <= vocab <= MAX_VOCAB
    ):
        raise InputError("vocab", f"the number of token ids the model takes: a whole number in [1, {MAX_VOCAB}], or None", vocab)
    if vocab is not None and input_shape is None and dataset == "digits":  # another dataset gives the ids' shape
        raise InputError(
            "input_shape", "the token ids' shape with vocab, such as (16,) for sequences of 16 tokens (the dataset's shape is an image's)"
        )
    _check_flags(strict=strict)
    model, shape = build_architecture(architecture, input_shape=input_shape, dataset=dataset, args=args)
    generator = torch.Generator().manual_seed(0)
    if vocab is not None:
        example = torch.randint(0, int(vocab), (2, *shape), generator=generator)
    else:
        example = torch.randn((2, *shape), generator=generator)
    try:
        return derive_spec(model, example, strict=strict)
    except InputError as exc:
        floats_refused = "Long, Int" in str(exc.hint)  # an embedding's message for float indices
        if exc.path != "input" or (vocab is None and not floats_refused):
            raise
        # the model refused the batch: say which choice of ours it was fed (floats, or ids below vocab)
        fed = (
            f"random token ids in [0, {vocab}): is vocab at most the model's vocabulary size?"
            if vocab is not None
            else "random floats: a model that takes token ids needs vocab (rayfuse symmetry --vocab N)"
        )
        raise InputError(exc.path, exc.expected, exc.got, f"{exc.hint}; fed {fed}" if exc.hint else f"fed {fed}") from None


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def _config(config: Any, overrides: Sequence[str], method_labels: Sequence[str]) -> ExperimentConfig:
    """The validated config. With methods given as objects (``method_labels``), a config that names no methods runs
    those only, not the quickstart's default methods."""
    if isinstance(config, ExperimentConfig):
        if not overrides and not (method_labels and "methods" not in config.model_fields_set):
            return config
        data = config.model_dump(mode="json", exclude_unset=True)
    elif config is None or isinstance(config, Mapping):
        data = dict(config or {})
    elif isinstance(config, (str, Path)):
        data = read_config_file(config)
    else:
        raise InputError("config", "a YAML file path, a dict or an ExperimentConfig", type(config).__name__)
    if method_labels and "methods" not in data:
        data["methods"] = {label: {} for label in method_labels}
    return build_config(data, list(overrides))


def _check_outputs(cfg: ExperimentConfig, run_dir: str | Path | None, *, key: str = "run_dir") -> None:
    """The run folder (``run_dir``, else under ``run.storage``) and ``run.model_cache`` can be written."""
    from rayfuse.io import check_writable_folder

    if run_dir is not None:
        check_writable_folder(run_dir, key=key)
    else:
        check_writable_folder(cfg.run.storage, key="run.storage")
    if cfg.run.model_cache is not None:
        check_writable_folder(cfg.run.model_cache, key="run.model_cache")


def _check_folder_argument(value: Any, name: str, *, optional: bool = False, what: str = "a folder path") -> None:
    """A path argument: a non-empty ``str`` or ``os.PathLike`` (``None`` too when ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value.strip()):
        raise InputError(
            name, f"{what} (str or Path)" + (" or None" if optional else ""), value if isinstance(value, str) else type(value).__name__
        )


def _overrides(overrides: Any) -> list[str]:
    """``KEY=VALUE`` strings: a sequence of them (a single string would be read one character at a time)."""
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence) or not all(isinstance(o, str) for o in overrides):
        given = repr(overrides) if isinstance(overrides, (str, bytes)) else type(overrides).__name__
        hint = f"overrides=[{overrides!r}]" if isinstance(overrides, str) else ""
        raise InputError("overrides", "a list of KEY=VALUE strings", given, hint)
    return list(overrides)


def _check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise InputError(name, "True or False", value)


def _methods(methods: Any) -> dict[str, Any]:
    if methods is None:
        return {}
    if not isinstance(methods, Mapping) or not all(isinstance(k, str) for k in methods):
        raise InputError("methods", "a mapping of labels to method names, Method subclasses or instances", type(methods).__name__)
    if not methods:
        raise InputError("methods", "at least one method", "{}")
    for label, given in methods.items():
        _check_method_object(given, f"methods[{label!r}]")
    return dict(methods)


def _check_method_object(given: Any, where: str) -> None:
    """A method given as a class or an instance has a server loop (``run``, not abstract) and a params model
    (``Params``: a :class:`~rayfuse.method.MethodParams` subclass; an instance's ``params`` one of them): checked here,
    before the run folder exists, not when the coordinator first instantiates it."""
    import inspect

    from rayfuse.method import Method, MethodParams

    cls = given if isinstance(given, type) else type(given)
    if not issubclass(cls, Method):
        return  # a registered name, or anything else: resolve_methods names what it expects
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract or not callable(getattr(cls, "run", None)):
        raise InputError(
            where,
            "a Method subclass that defines run(self, server) (its server loop)",
            f"{cls.__qualname__} without {', '.join(abstract) or 'a callable run'}",
        )
    params_cls = getattr(cls, "Params", None)
    if not (inspect.isclass(params_cls) and issubclass(params_cls, MethodParams)):
        raise InputError(
            f"{where}.Params",
            "a params model: a subclass of rayfuse.method.MethodParams (pydantic)",
            params_cls if not inspect.isclass(params_cls) else params_cls.__qualname__,
            "declare class Params(MethodParams) with typed fields and defaults",
        )
    if not isinstance(given, type) and not isinstance(getattr(given, "params", None), params_cls):
        raise InputError(f"{where}.params", f"an instance of {cls.__qualname__}.Params", type(getattr(given, "params", None)).__name__)


def _check_dataset_is_used(cfg: ExperimentConfig) -> None:
    """Arrays replace the config's ``data.dataset``; refuse them where the config names data they would silently
    replace or could not join: silos (each client reads its own), or a file, folder, feature list or generator options
    of ``data`` (keys the arrays make meaningless)."""
    data = cfg.data
    if data.is_silos:
        raise InputError(
            "dataset",
            "no dataset argument with a silo config (data.silos: each client reads its own data)",
            "arrays and data.silos",
            "drop dataset=, or data.silos from the config",
        )
    ignored = [f"data.{key}" for key in ("path", "root", "features", "options") if getattr(data, key)]
    if ignored:
        raise InputError(
            "dataset",
            f"arrays, or a config whose data names a source, not both ({', '.join(ignored)} would be ignored)",
            ignored[0] + " and dataset=",
            f"drop dataset= or {', '.join(ignored)}",
        )


def _check_factory(model: Any, where: str = "model") -> Any:
    from torch import nn

    from rayfuse.models.registry import factory_arity

    if isinstance(model, nn.Module):  # callable (its forward), but one instance every client would share
        raise InputError(
            where,
            "a model factory (the class, or a function returning a new nn.Module), not a model instance",
            f"an instance of {type(model).__qualname__}",
            f"pass model={type(model).__name__} or lambda: {type(model).__name__}(...)",
        )
    if factory_arity(model) < 0:
        raise InputError(where, "a callable returning an nn.Module, taking (input_shape, num_classes) or no arguments", model)
    return model


def _with_models(cfg: ExperimentConfig, model: Any) -> ExperimentConfig:
    """``cfg`` building its models with ``model``: one factory for the run (``model: {name: custom}``), or a mapping of
    client ids (each that client's ``federation.client_overrides.<i>.model``) and ``"default"`` (the run's ``model``) to
    factories. Raises :class:`InputError` at ``model[<key>]`` for a key that is neither a client id of the run nor
    ``"default"``, or a value that is not a model factory."""
    from rayfuse.config import ClientOverride

    if not isinstance(model, Mapping):
        return cfg.model_copy(update={"model": cfg.model.with_factory(_check_factory(model), _qualname(model))})
    n = cfg.partition.num_clients
    if not model:
        raise InputError("model", "a model factory, or a mapping of client ids and 'default' to model factories", "{}")
    clients: dict[int, Any] = {}
    default = None
    for key, factory in model.items():
        if isinstance(key, str) and key == "default":
            default = _check_factory(factory, where="model['default']")
            continue
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= int(key) < n:
            raise InputError(f"model[{key!r}]", f"a client id in 0..{n - 1} (partition.num_clients is {n}) or 'default'", key)
        clients[int(key)] = _check_factory(factory, where=f"model[{int(key)}]")
    if default is not None:
        cfg = cfg.model_copy(update={"model": cfg.model.with_factory(default, _qualname(default))})
    overrides = dict(cfg.federation.client_overrides)
    for client, factory in sorted(clients.items()):
        override = overrides.get(client)
        base = override.model if override is not None and override.model is not None else cfg.model
        own = base.with_factory(factory, _qualname(factory))
        overrides[client] = ClientOverride(model=own) if override is None else override.model_copy(update={"model": own})
    if clients:
        cfg = cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"client_overrides": overrides})})
    return cfg


def _qualname(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(type(obj), "__qualname__", type(obj).__name__)
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", None)
    return f"{module}.{name}" if module else str(name)


def _arrays(dataset: Any, *, as_stored: bool = False) -> Any:
    """A :class:`rayfuse.data.datasets.Dataset` of ``(X, y)`` arrays or of a torch ``Dataset``'s ``(x, y)`` pairs.

    pandas objects: a DataFrame or Series as ``X`` or ``y`` is read as its values (what passing it clearly means;
    a non-numeric feature column is refused by name); a DataFrame alone is refused, since which of its columns holds
    the labels is not ours to guess."""
    from rayfuse.data.datasets import dataset_from_arrays

    if _is_pandas(dataset):
        raise InputError(
            "dataset",
            "(X, y) arrays or a torch Dataset of (x, y) pairs",
            f"a pandas {type(dataset).__name__}",
            "pass (frame.drop(columns=label), frame[label]): which column holds the labels is yours to say",
        )
    if isinstance(dataset, (tuple, list)) and len(dataset) == 2:
        X, y = dataset
        X, y = _to_numpy(X, "dataset[0] (X)", features=True), _to_numpy(y, "dataset[1] (y)")
    elif (
        hasattr(dataset, "__getitem__")
        and hasattr(dataset, "__len__")
        and not isinstance(dataset, (str, bytes, Mapping, tuple, list, np.ndarray))
    ):
        X, y = _read_pairs(dataset)
    else:
        raise InputError("dataset", "(X, y) arrays or a torch Dataset of (x, y) pairs", type(dataset).__name__)
    return dataset_from_arrays("arrays", X, y, features_key="dataset", label_key="dataset", as_stored=as_stored)


def _read_pairs(dataset: Any) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(x, y)`` pair of a map-style dataset; the user's ``__len__`` / ``__getitem__`` failing is one line
    naming the item, not a traceback from inside it."""
    try:
        n = len(dataset)
    except Exception as exc:  # the user's __len__: whatever it raises
        raise InputError("dataset", "a torch Dataset whose len() works", f"len() raised {type(exc).__name__}: {exc}") from None
    xs, ys = [], []
    for i in range(n):
        try:
            item = dataset[i]
        except Exception as exc:  # the user's __getitem__: whatever it raises
            raise InputError(f"dataset[{i}]", "an (x, y) pair", f"__getitem__ raised {type(exc).__name__}: {exc}") from None
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InputError(f"dataset[{i}]", "an (x, y) pair", type(item).__name__)
        xs.append(_to_numpy(item[0], f"dataset[{i}][0] (x)", features=True))
        ys.append(_to_numpy(item[1], f"dataset[{i}][1] (y)"))
    if not xs:
        raise InputError("dataset", "a non-empty dataset", "0 samples")
    if len({x.shape for x in xs}) > 1:
        raise InputError("dataset", "samples of one shape", sorted({x.shape for x in xs})[:3])
    return np.stack(xs), np.stack([y.reshape(()) if y.size == 1 else y for y in ys])


def _is_pandas(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "pandas" and hasattr(value, "to_numpy")


def _to_numpy(value: Any, where: str, *, features: bool = False) -> np.ndarray:
    """``value`` as a numpy array: a torch tensor (any device; bfloat16 and half widened to float32), a pandas
    DataFrame or Series (its values), or anything ``np.asarray`` reads as a rectangular array."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        tensor = value.detach().cpu()
        if getattr(tensor, "is_sparse", False) or getattr(tensor, "layout", None) is not None and str(tensor.layout) != "torch.strided":
            tensor = tensor.to_dense()
        if str(tensor.dtype) in ("torch.bfloat16", "torch.float16"):
            tensor = tensor.float()
        try:
            return tensor.numpy()
        except (TypeError, RuntimeError) as exc:
            raise InputError(where, "a tensor numpy can read", f"{tensor.dtype}: {exc}") from None
    if _is_pandas(value):
        if features and hasattr(value, "columns"):
            odd = [(column, dtype) for column, dtype in value.dtypes.items() if not _numeric_dtype(dtype)]
            if odd:
                raise InputError(where, "numeric feature columns", f"column {odd[0][0]!r} of dtype {odd[0][1]}", "drop or encode it")
        if hasattr(value, "columns") and not features and value.shape[1] != 1:
            raise InputError(where, "one label column", f"a DataFrame of {value.shape[1]} columns")
        try:
            array = value.to_numpy(dtype=float, na_value=np.nan) if features else value.to_numpy()
        except (TypeError, ValueError) as exc:
            raise InputError(where, "values numpy can read", str(exc).splitlines()[0][:100]) from None
        return array.reshape(-1) if not features and array.ndim == 2 else array
    try:
        return np.asarray(value)
    except ValueError as exc:  # ragged nested lists: "inhomogeneous shape"
        raise InputError(
            where, "a rectangular array (every sample of one shape)", "ragged sequences", str(exc).split(". ")[0][:100]
        ) from None


def _numeric_dtype(dtype: Any) -> bool:
    """A numpy or pandas extension dtype of real numbers (``float32``, ``Int64``, ``Float64``, ``boolean``...)."""
    return getattr(dtype, "kind", "O") in "biuf"


def _user_modules(objects: Sequence[Any]) -> list[str]:
    """The modules of the objects given (and of their classes' bases) that are neither rayfuse's nor installed: a
    script's or a test's own modules, which Ray pickles by value so that the actors need not import them."""
    import inspect

    paths = sysconfig.get_paths()
    installed = {Path(paths[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key)}
    items: list[Any] = []
    for obj in objects:
        if obj is None or isinstance(obj, str):
            continue
        if isinstance(obj, type):
            items.extend(obj.__mro__)  # a class: a Method subclass, an nn.Module factory
        elif inspect.isfunction(obj) or inspect.ismethod(obj):
            items.append(obj)  # a factory function
        else:
            items.extend(type(obj).__mro__)  # a Method instance, a callable object
    names: list[str] = []
    for item in items:
        name = getattr(item, "__module__", None)
        if not isinstance(name, str):
            continue
        module = sys.modules.get(name)
        if module is None or name in names or name == "__main__" or name.split(".")[0] in ("rayfuse", "actors", "builtins"):
            continue
        file = getattr(module, "__file__", None)
        if file is None or any(root in Path(file).resolve().parents for root in installed):
            continue
        names.append(name)
    return names


def _execute(prepared: Any, folder: Path, *, resume: bool, quiet: bool, verbose: bool, by_value: Sequence[str]) -> RunResult:
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    if prepared.cfg.federation.backend == "local":
        backend: Any = InProcessBackend()
    else:
        from actors.backend import RayBackend  # the Ray layer, imported only when a run asks for it

        backend = RayBackend(pickle_by_value=by_value)
    printer = Printer(verbose=verbose, enabled=not quiet)
    try:
        results = run_experiment(prepared, backend, folder, resume=resume, printer=printer, show_tables=True)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM under rayfuse.interrupts: say which folder to resume
        from rayfuse.interrupts import as_interrupted

        interrupted = as_interrupted(exc)
        interrupted.run_dir = folder if (folder / "config.yaml").is_file() else None
        if interrupted is exc:
            raise
        raise interrupted from exc
    return _read_result(prepared, folder, results)


def _read_result(prepared: Any, folder: Path, results: dict[str, Any]) -> RunResult:
    import pandas as pd

    from rayfuse.store import RunStore

    store = RunStore(folder)
    labels = [spec.label for spec in prepared.specs]
    rows = {}
    for label in labels:
        summary = store.load_method_state(label) or {}
        rows[label] = dict(summary.get("metrics") or {})
    metrics = pd.DataFrame.from_dict(rows, orient="index")
    metrics.index.name = "label"
    history_columns = ["method", "method_name", "round", "metric", "value", "client"]
    history = pd.read_parquet(store.metrics_file) if store.metrics_file.is_file() else pd.DataFrame(columns=history_columns)
    models = ModelFiles({label: folder / file for label, file in (results.get("files", {}).get("models") or {}).items()})
    input_shape, num_classes = tuple(prepared.plan.input_shape), int(prepared.plan.num_classes)
    if prepared.cfg.data.is_silos:  # known once the clients reported: the silo manifest records it
        from rayfuse.io import read_json

        manifest = read_json(store.partition_file, "the run's partition manifest")
        input_shape, num_classes = tuple(manifest["input_shape"]), int(manifest["num_classes"])
    return RunResult(
        run_dir=folder,
        metrics=metrics,
        history=history,
        models=models,
        results=results,
        config=prepared.cfg,
        input_shape=input_shape,
        num_classes=num_classes,
        labels=tuple(labels),
    )
