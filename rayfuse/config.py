"""The experiment config: one validated schema for the CLI, Ray Jobs and Ray Tune.

A config is YAML with the sections ``run``, ``data``, ``partition``, ``model``, ``train``, ``federation`` and
``methods``, and the key ``evaluation`` (central | federated | both: see :mod:`rayfuse.evaluation`). Every key has
a default; the defaults are the quickstart job (digits, 5 label-skewed clients, the baselines), so an empty file is a
valid config. Unknown keys, wrong types and impossible values are rejected before any cluster work starts, with one
line that names the key path, the expected value and what was given::

    partition.alpha: expected a number greater than 0, got -1.0

``--set a.b=c`` overrides any key; the value is parsed as YAML (``--set methods.fedavg.rounds=20``,
``--set model.hidden=[128,64]``).

``methods`` maps a label to the method's parameters. The label is the method's registered name, or any name with a
``method:`` key, so one method can run twice with different parameters::

    methods:
      fedavg: {rounds: 20}
      fedprox-strong: {method: fedprox, mu: 0.5}
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from rayfuse.accountant import require_one_noise
from rayfuse.errors import InputError, suggest

__all__ = [
    "ExperimentConfig",
    "TrackingConfig",
    "MlflowConfig",
    "RunConfig",
    "DataConfig",
    "SiloSource",
    "SiloSpec",
    "SILO_FORMATS",
    "PATH_VARIABLE",
    "silo_source_kind",
    "PartitionConfig",
    "ModelConfig",
    "TrainConfig",
    "DPSGDConfig",
    "FederationConfig",
    "ResourcesConfig",
    "ClientOverride",
    "other_model_clients",
    "FaultSpec",
    "AttackSpec",
    "CONFIG_SECTIONS",
    "pydantic_input_error",
    "refuse_boolean_number",
    "StrictSchema",
    "build_config",
    "load_config",
    "parse_overrides",
    "read_config_file",
    "apply_overrides",
    "validate_config",
    "dump_config",
    "DEFAULT_METHODS",
]

# The quickstart's methods (jobs/quickstart.yaml spells out the same job; a test keeps the two equal).
DEFAULT_METHODS: dict[str, dict[str, Any]] = {"local": {}, "average": {}, "ensemble": {}, "aligned": {},
                                               "aligned-wide": {"method": "aligned", "merge": "nonparametric"},
                                               "distill": {}, "distill-free": {"method": "distill", "transfer": "synthetic"},
                                               "fedavg": {}, "global": {}}
# The quickstart's public sample: a config without a data section is the quickstart's data, as one without methods is
# the quickstart's methods (an empty data section, or one that names its own keys, has no public sample by default).
QUICKSTART_PUBLIC_SIZE = 300


class StrictSchema(BaseModel):
    """Base of every schema a user's file is read into (config sections, method parameters, fuse and sweep files):
    unknown keys are errors, values are frozen, floats are finite (``allow_inf_nan=False``: ``lr: .inf`` and
    ``lr: nan`` are refused) and a boolean is not a number (``epochs: true`` is not 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: Any) -> Any:
        return refuse_boolean_number(cls, value, info)


class StrictModel(StrictSchema):
    """Base for config sections: a :class:`StrictSchema` whose defaults are validated too.

    ``--set`` values are parsed as YAML, so ``--set run.name=2024`` gives an int: text keys take numbers as text
    (``coerce_numbers_to_str``).
    """

    model_config = ConfigDict(validate_default=True, coerce_numbers_to_str=True)


def refuse_boolean_number(model: type[BaseModel], value: Any, info: Any) -> Any:
    """A ``mode="before"`` field check: a boolean given for a number field (``int``, ``float``, optional or not) is a
    ValueError (pydantic would read ``true`` as 1); ``value`` is returned unchanged otherwise."""
    if info.field_name not in model.model_fields:
        return value
    if isinstance(value, bool):
        kinds = _kinds(model.model_fields[info.field_name].annotation, top=True)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):
        kinds = _kinds(model.model_fields[info.field_name].annotation, top=False)  # the types of list items
    elif isinstance(value, Mapping) and any(isinstance(v, bool) for v in value.values()):
        kinds = _kinds(model.model_fields[info.field_name].annotation, top=False)
    else:
        return value
    if kinds & {int, float} and bool not in kinds:
        raise ValueError("a number, not a boolean")
    return value


def _kinds(annotation: Any, *, top: bool) -> set[Any]:
    """The types an annotation accepts as a value (``top``) or as the items / values of a list, tuple or dict in it."""
    import typing

    found: set[Any] = set()
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is None:
        return {annotation} if top else set()
    if origin in (list, tuple, set, dict) or (isinstance(origin, type) and issubclass(origin, (Sequence, Mapping))):
        if top:
            return found
        items = args[1:] if origin is dict or (isinstance(origin, type) and issubclass(origin, Mapping)) else args
        for arg in items:
            if arg is not Ellipsis:
                found |= _kinds(arg, top=True)
        return found
    for arg in args:  # a Union / Optional / Literal...
        found |= _kinds(arg, top=top)
    return found


def _registered(registry: Any, value: str) -> str:
    """``value`` if ``registry`` knows it (name or alias); else a ValueError listing the choices."""
    if value not in registry:
        names = registry.names(include_aliases=True)
        raise ValueError(f"a {registry.kind} in {{{', '.join(names)}}}{suggest(value, names)}")
    return value


class RunConfig(StrictModel):
    name: str = Field("quickstart", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="run name; the run folder is <storage>/<name>-<time>")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="the one seed every other seed derives from")
    storage: str = Field("runs", min_length=1, description="folder that receives run folders")
    model_cache: str | None = Field(None, min_length=1, description="storage the clients own: each keeps its trained local model there "
                                    "under a content key, so runs (and Tune trials) with the same data, partition, model, train "
                                    "config and seed reuse it instead of retraining, and --resume reads it; null: the clients keep nothing")


class DatasetSource(StrictModel):
    """Which dataset to load, and from where (``data`` and ``data.target``)."""

    dataset: str = Field("digits", description="a registered dataset (rayfuse list datasets)")
    root: str | None = Field(None, description="folder with torchvision datasets (MNIST, FashionMNIST, CIFAR-10)")
    path: str | None = Field(None, description="a user .npz or .parquet file (datasets 'npz', 'parquet')")
    label: str = Field("y", min_length=1, description="label key (npz) or column (parquet)")
    features: str | list[str] | None = Field(None, description="feature key (npz) or columns (parquet); default: X / all other numeric columns")
    options: dict[str, Any] = Field(default_factory=dict, description="extra arguments for a procedural generator")
    # ``dataset: arrays``: the in-memory Dataset given to rayfuse.run(dataset=...). It is not config data (not dumped,
    # not in config.yaml) but travels with the section, by value, to every process that loads the data.
    _arrays: Any = PrivateAttr(None)

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        from rayfuse.data.datasets import DATASETS

        return DATASETS.canonical(_registered(DATASETS, value))

    @property
    def arrays(self) -> Any:
        """The in-memory :class:`rayfuse.data.datasets.Dataset` of ``dataset: arrays`` (``None`` otherwise)."""
        return self._arrays

    def with_arrays(self, dataset: Any, digest: str) -> DatasetSource:
        """A copy that loads ``dataset`` (arrays given from Python) instead of a registered source.

        The copy reads ``dataset: arrays`` with ``options: {sha256: digest}`` (a record of the content: two runs of
        different arrays never share a cache key); the arrays themselves ride along with it.
        """
        copy_ = self.model_copy(update={"dataset": "arrays", "root": None, "path": None, "features": None,
                                        "options": {"sha256": digest}})
        copy_._arrays = dataset
        return copy_


class TargetConfig(DatasetSource):
    """A new task held by the server (knowledge amalgamation across tasks, FedSA): the coordinator's labelled sample
    (``data.public_size`` of this dataset's pool) and the test set come from here; the clients keep ``data.dataset``."""

    dataset: str = Field(description="a registered dataset (rayfuse list datasets)")
    test_size: float = Field(0.2, gt=0, lt=1, description="fraction of the target dataset held out as the test set")
    resize: list[int] | None = Field(None, min_length=2, max_length=2, description="[H, W]: bilinear resize of the target's images")
    pad: int = Field(0, ge=0, description="zero padding on every side after resizing (e.g. digits 8x8 -> resize [20, 20], pad 4 -> MNIST's 28x28)")

    @field_validator("resize")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        return _check_image_size(value)


# ----------------------------------------------------------------------------------------------------------------
# Silos: each client's own data where it lives (data.silos), and the server's optional sets (data.test, data.public)

SILO_FORMATS = ("npz", "parquet", "csv", "imagefolder")
# ``${NAME}`` in a silo path: expanded on the node that reads the silo (rayfuse.data.silos.expand_path)
PATH_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# data keys of a simulation (one dataset + a partitioner); a silo config gives each client its own data instead
_SIMULATION_DATA_KEYS = ("dataset", "root", "path", "label", "features", "options", "target", "test_size", "public_size", "layout")


def silo_source_kind(dataset: str) -> str:
    """How a silo's ``dataset`` is read: ``"table"`` (npz, parquet, csv: a file with a label), ``"imagefolder"`` (class
    folders of images), ``"folder"`` (a torchvision dataset whose ``path`` is its root folder) or ``"bundled"`` (a
    bundled or generated dataset: no path; for rehearsal)."""
    if dataset in ("npz", "parquet", "csv"):
        return "table"
    if dataset == "imagefolder":
        return "imagefolder"
    from rayfuse.data.datasets import DATASETS

    return "folder" if DATASETS.get(dataset).source == "local folder" else "bundled"


def label_value(name: Any) -> str | float:
    """A label value as silo labels and ``data.classes`` compare it (rayfuse.data.silos): a number by its value (a
    file's float labels ``1.0`` are the declared class ``1``, its ``0.5`` the declared ``0.5``: never rounded to an
    integer), anything else by its text."""
    try:
        value = float(name)
    except (TypeError, ValueError):
        return str(name)
    # text such as "nan" or "inf" is no number a label file holds (check_labels refuses NaN and Inf labels): text
    return value if math.isfinite(value) else str(name)


def _check_image_size(value: list[int] | None) -> list[int] | None:
    """An image size ``[H, W]`` (its length is the field's own constraint): both at least 1, ``H x W`` at most
    :data:`MAX_IMAGE_PIXELS`."""
    if value is not None and min(value) < 1:
        raise ValueError("[H, W], two sizes >= 1")
    if value is not None and value[0] * value[1] > MAX_IMAGE_PIXELS:
        raise ValueError(f"[H, W] of at most {MAX_IMAGE_PIXELS:,} pixels (PIL's decompression-bomb bound; {value[0] * value[1]:,} given)")
    return value


# The most pixels an image may be resized to: PIL's decompression-bomb bound (PIL.Image.MAX_IMAGE_PIXELS), the same
# one a decoded image is held to, so a resize target cannot allocate what reading such an image is refused for.
MAX_IMAGE_PIXELS = 89_478_485


def _check_path_form(value: str | None) -> str | None:
    """A silo path's form (never whether it exists: the driver does not open silo paths)."""
    if value is None:
        return value
    if not value.strip() or any(c in value for c in "\x00\n\r"):
        raise ValueError("a path (no NUL or line breaks)")
    if "${" in PATH_VARIABLE.sub("", value):
        raise ValueError("a path whose variables read ${NAME} (letters, digits, _)")
    return value


class SiloSource(StrictModel):
    """One data source of a silo config, read only by the process that uses it: ``data.test`` and ``data.public`` (the
    server's), and the base of each client's :class:`SiloSpec`. Keys that do not apply to ``dataset`` are refused.

    ``labels: false`` says the file holds no labels (``data.public`` only, an ``npz`` file or a ``parquet`` / ``csv``
    file with its ``features`` named): only its inputs are read, and its labels are unknown (``-1``). Methods that read
    the public sample's labels (``Method.public_labels``) are then refused."""

    dataset: str = Field(description="npz | parquet | csv | imagefolder, or a bundled dataset (rayfuse list datasets; for rehearsal)")
    path: str | None = Field(None, description="the file (npz, parquet, csv), the class folders (imagefolder) or a torchvision "
                             "dataset's root; ${VAR} expands on the node that reads it. The driver never opens it")
    label: str | None = Field(None, min_length=1, description="npz, parquet, csv: the label array / column (default y)")
    features: str | list[str] | None = Field(None, description="npz: the feature array (default X); parquet, csv: the feature columns "
                                             "(default: every other numeric column)")
    image_size: list[int] | None = Field(None, min_length=2, max_length=2, description="imagefolder: [H, W] every image is resized to "
                                         "(default: the images' own size, which must then agree)")
    grayscale: bool | None = Field(None, description="imagefolder: read images as one grey channel (default: RGB)")
    options: dict[str, Any] = Field(default_factory=dict, description="a bundled dataset's generator arguments; csv: {delimiter: ';'} "
                                    "(default: sniffed from the header among , ; tab |)")
    labels: bool = Field(True, description="false: a file without labels (data.public only; npz, or parquet / csv with features "
                         "named): only its inputs are read, its labels are unknown (-1), for methods that never read them "
                         "(distill with transfer: public)")

    @field_validator("dataset")
    @classmethod
    def _known_format(cls, value: str) -> str:
        from rayfuse.data.datasets import DATASETS

        names = [*SILO_FORMATS, *(n for n, info in DATASETS.items() if info.source in ("bundled", "generator", "local folder"))]
        if value in SILO_FORMATS:
            return value
        if value in DATASETS and DATASETS.canonical(value) in names:
            return DATASETS.canonical(value)
        raise ValueError(f"a format in {{{', '.join(SILO_FORMATS)}}} or a bundled dataset in {{{', '.join(names[len(SILO_FORMATS):])}}}"
                         f"{suggest(value, names)}")

    @field_validator("path")
    @classmethod
    def _path_form(cls, value: str | None) -> str | None:
        return _check_path_form(value)

    @field_validator("image_size")
    @classmethod
    def _positive_size(cls, value: list[int] | None) -> list[int] | None:
        return _check_image_size(value)

    @model_validator(mode="after")
    def _keys_fit_format(self) -> SiloSource:
        kind = silo_source_kind(self.dataset)
        fmt = repr(self.dataset)
        if kind == "bundled":
            if self.path is not None:
                raise ValueError(f"@path@ no path for the bundled dataset {fmt} (it ships with rayfuse), got {self.path!r}")
        elif self.path is None:
            what = {"table": f"the {self.dataset} file", "imagefolder": "the folder of class folders",
                    "folder": f"the root folder of the torchvision dataset {fmt}"}[kind]
            raise ValueError(f"@path@ {what} (dataset is {fmt})")
        if kind != "table":
            for key in ("label", "features"):
                if getattr(self, key) is not None:
                    raise ValueError(f"@{key}@ no {key} for dataset {fmt} (only npz, parquet and csv name theirs), got {getattr(self, key)!r}")
        elif self.dataset == "npz" and isinstance(self.features, list):
            raise ValueError(f"@features@ one array name for an npz file, got {self.features!r}")
        if kind != "imagefolder":
            for key in ("image_size", "grayscale"):
                if getattr(self, key) is not None:
                    raise ValueError(f"@{key}@ no {key} for dataset {fmt} (imagefolder only), got {getattr(self, key)!r}")
        if self.options:
            if self.dataset == "csv":
                allowed: tuple[str, ...] = ("delimiter",)
            elif kind in ("bundled", "folder"):
                from rayfuse.data.datasets import DATASETS

                allowed = DATASETS.get(self.dataset).options
            else:
                allowed = ()
            for key, value in self.options.items():
                if key not in allowed:
                    expected = f"options among {{{', '.join(allowed)}}}" if allowed else "no options"
                    raise ValueError(f"@options.{key}@ {expected} for dataset {fmt}, got {value!r}{suggest(key, allowed)}")
            delimiter = self.options.get("delimiter", ",")
            if self.dataset == "csv" and (not isinstance(delimiter, str) or len(delimiter) != 1):
                raise ValueError(f"@options.delimiter@ one character, got {delimiter!r}")
        return self

    @model_validator(mode="after")
    def _unlabeled_form(self) -> SiloSource:
        # labels: false (a file without labels) is read by its inputs only: a file format whose inputs can be named
        if self.labels:
            return self
        fmt = repr(self.dataset)
        if silo_source_kind(self.dataset) != "table":
            raise ValueError(f"@labels@ true for dataset {fmt} (an unlabeled file is npz, or parquet / csv with features named), got False")
        if self.label is not None:
            raise ValueError(f"@label@ no label with labels: false (the file holds none), got {self.label!r}")
        if self.dataset != "npz" and self.features is None:
            raise ValueError(f"@features@ the feature columns of an unlabeled {self.dataset} file (with labels: false only the "
                             "columns named are read)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a labelled source (the default) dumps as it did before the key existed: silo runs' local models keep their keys
        data = handler(self)
        if self.labels and isinstance(data, dict):
            data.pop("labels", None)
        return data


class SiloSpec(SiloSource):
    """One client's data (``data.silos.<i>``): a :class:`SiloSource` and its held-out split, ``val_size`` of it
    (stratified, seeded; default ``data.val_size``) or the file / folder ``test_path``."""

    val_size: float | None = Field(None, ge=0, lt=1, description="fraction of the silo kept as its held-out split (default data.val_size)")
    test_path: str | None = Field(None, description="the silo's own held-out file / folder, in the silo's format (instead of val_size)")

    @field_validator("test_path")
    @classmethod
    def _test_path_form(cls, value: str | None) -> str | None:
        return _check_path_form(value)

    @model_validator(mode="after")
    def _one_held_out_split(self) -> SiloSpec:
        if self.test_path is not None:
            if silo_source_kind(self.dataset) not in ("table", "imagefolder"):
                raise ValueError(f"@test_path@ no test_path for dataset {self.dataset!r} (its held-out split is val_size of it), "
                                 f"got {self.test_path!r}")
            if self.val_size is not None:
                raise ValueError(f"@val_size@ val_size or test_path, not both (test_path is {self.test_path!r}), got {self.val_size}")
        elif not self.val_size:
            raise ValueError(f"@val_size@ a fraction > 0 (the silo's held-out split) or a test_path, got {self.val_size}")
        return self

    @model_validator(mode="after")
    def _unlabeled_form(self) -> SiloSpec:
        # replaces SiloSource's: a client trains on its silo's labels, whatever the format
        if not self.labels:
            raise ValueError("@labels@ true for a client's silo (a client trains on its labels; labels: false is for data.public), "
                             "got False")
        return self


class DataConfig(DatasetSource):
    test_size: float = Field(0.2, gt=0, lt=1, description="fraction held out as the global test set (datasets without one)")
    val_size: float = Field(0.1, ge=0, lt=1, description="fraction of each client's shard kept as its private validation split")
    public_size: float = Field(0, ge=0, description="server's public sample: a fraction (< 1) or a count (>= 1) of the training pool")
    standardize: bool | None = Field(None, description="z-score features with training-pool statistics; default per dataset")
    layout: Literal["auto", "image", "sequence"] = Field(
        "auto", description="how an npz file's (N, A, B) array is read: image, grey images (N, 1, A, B); sequence, kept as "
                            "(N, L, D) for a sequence model; auto (default): image")
    target: TargetConfig | None = Field(None, description="a new task for the server: its public sample and the test set come from this "
                                        "dataset (data.test_size is then unused: the clients share all of data.dataset)")
    silos: list[SiloSpec] | None = Field(None, description="each client's own data, in client order, instead of data.dataset + partition "
                                         "(read only on the client's node)")
    test: SiloSource | None = Field(None, description="with silos: the server's test set (central evaluation)")
    public: SiloSource | None = Field(None, description="with silos: the server's public / target sample")
    # int | float | str: a float label value (0.5) stays a float (its text "0.5" is what a file's label reads back as)
    classes: list[int | float | str] | None = Field(None, description="with silos: the task's label values in label order, as they "
                                                    "appear in the files (a silo may hold some of them; numbers compare by value); "
                                                    "default: every silo holds the same label values")

    @model_validator(mode="before")
    @classmethod
    def _silo_val_size(cls, data: Any) -> Any:
        # A silo without val_size or test_path keeps data.val_size of its data as its held-out split.
        if isinstance(data, Mapping) and isinstance(data.get("silos"), list):
            default = data.get("val_size", cls.model_fields["val_size"].default)
            silos = [{**silo, "val_size": default} if isinstance(silo, Mapping) and silo.get("val_size") is None
                     and silo.get("test_path") is None else silo for silo in data["silos"]]
            data = {**data, "silos": silos}
        return data

    @field_validator("public_size")
    @classmethod
    def _public_size(cls, value: float) -> float:
        if value >= 1 and value != int(value):
            raise ValueError("a fraction below 1 or a whole count")
        return value

    @model_validator(mode="after")
    def _file_datasets_need_path(self) -> DataConfig:
        if self.dataset in ("npz", "parquet") and not self.path:
            raise ValueError(f"@path@ the {self.dataset} file to load (data.dataset is {self.dataset!r})")
        return self

    @model_validator(mode="after")
    def _silos_or_simulation(self) -> DataConfig:
        if self.silos is None:
            for key in ("test", "public"):
                if getattr(self, key) is not None:
                    raise ValueError(f"@{key}@ data.{key} only with data.silos (a simulation's server sets come from data.dataset: "
                                     "test_size, public_size, target)")
            if self.classes is not None:
                raise ValueError(f"@classes@ data.classes only with data.silos (a simulation's label values are its dataset's), "
                                 f"got {self.classes!r}")
            return self
        if not self.silos:
            raise ValueError("@silos@ at least one silo (one per client), got []")
        if self.test is not None and not self.test.labels:
            raise ValueError("@test.labels@ true for data.test (the server's test set scores the models on its labels; labels: false "
                             "is for data.public), got False")
        for key in _SIMULATION_DATA_KEYS:
            if key in self.model_fields_set:
                raise ValueError(f"@{key}@ no data.{key} with data.silos (each client reads its own silo; the server's sets are "
                                 f"data.test and data.public), got {getattr(self, key)!r}")
        if self.classes is not None:
            names = [str(c) for c in self.classes]
            if len(names) < 2:
                raise ValueError(f"@classes@ at least 2 label values, got {self.classes!r}")
            values = [label_value(c) for c in self.classes]  # numbers by value: 1 and 1.0 are one label
            repeated = next((c for i, c in enumerate(self.classes) if values[i] in values[:i]), None)
            if repeated is not None:
                raise ValueError(f"@classes@ distinct label values, got {repeated!r} twice")
        return self

    @property
    def class_names(self) -> tuple[str, ...] | None:
        """``data.classes`` as the label names a silo's file reads back (text), or None when not declared."""
        return None if self.classes is None else tuple(str(c) for c in self.classes)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A simulation's data section dumps as it always did (its content keys are unchanged); a silo config's holds
        # only the keys that apply to it, so its dump validates again.
        data = handler(self)
        for key in (("silos", "test", "public", "classes") if self.silos is None else _SIMULATION_DATA_KEYS):
            data.pop(key, None)
        if data.get("classes", 0) is None:  # undeclared: a silo config dumps as it did before data.classes
            data.pop("classes")
        if data.get("layout") == "auto":  # the default dumps as it did before data.layout (same config.yaml, same digests)
            data.pop("layout")
        return data

    @property
    def is_silos(self) -> bool:
        """Whether each client reads its own silo (``data.silos``) instead of a share of ``data.dataset``."""
        return self.silos is not None


_PARTITION_PARAMS = {
    "iid": (),
    "dirichlet": ("alpha", "balance", "min_size"),
    "labels": ("groups",),
    "pathological": ("classes_per_client",),
    "shards": ("shards_per_client", "shard_size"),
    "subsets": ("subset_fraction",),
}


class PartitionConfig(StrictModel):
    method: str = Field("dirichlet", description="iid | dirichlet | labels | pathological | shards | subsets (aliases homo, hetero-dir)")
    num_clients: int = Field(5, ge=1, le=100_000)
    alpha: float = Field(0.5, gt=0, description="dirichlet concentration")
    balance: bool = Field(True, description="dirichlet: PFNM balancing rule (stop giving to clients holding >= N/J)")
    min_size: int = Field(10, ge=0, description="dirichlet: redraw until every client holds at least this many samples")
    groups: list[list[int]] | None = Field(None, description="labels: the label set of each client")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client")
    shards_per_client: int = Field(2, ge=1, description="shards: shards per client")
    shard_size: int | None = Field(None, ge=1, description="shards: samples per shard (default: pool / total shards)")
    subset_fraction: tuple[float, float] = Field((0.4, 0.9), description="subsets: each client's fraction of the pool ~ U[low, high] (overlapping)")
    corrupt: dict[int, Literal["shuffle_labels", "noise", "permute_pixels", "flip_labels"]] = Field(
        default_factory=dict, description="clients whose private data is corrupted, by client id: shuffle_labels (random labels), "
        "noise (inputs + Gaussian noise, 2x the shard's std), permute_pixels (one fixed feature permutation: an unrelated input domain), "
        "flip_labels (label y becomes C - 1 - y: the label-flipping attack)")

    @field_validator("method")
    @classmethod
    def _known_partitioner(cls, value: str) -> str:
        from rayfuse.data.partition import PARTITIONERS

        return _registered(PARTITIONERS, value)

    @property
    def canonical_method(self) -> str:
        from rayfuse.data.partition import PARTITIONERS

        return PARTITIONERS.canonical(self.method)

    @model_validator(mode="after")
    def _params_match_method(self) -> PartitionConfig:
        # Parameters of other partitioners are ignored (not errors), so `--set partition.method=iid` works on a
        # config that sets alpha; the resolved partition parameters are the chosen method's only (``params()``).
        if self.canonical_method == "labels":
            if self.groups is None:
                raise ValueError("@groups@ each client's label list (partition.method is 'labels')")
            if len(self.groups) != self.num_clients:
                raise ValueError(f"@groups@ one label list per client ({self.num_clients}), got {len(self.groups)} lists")
            for i, group in enumerate(self.groups):
                if not group:
                    raise ValueError(f"@groups.{i}@ at least one label for client {i}, got []")
                if any(label < 0 for label in group):
                    raise ValueError(f"@groups.{i}@ labels >= 0, got {group}")
        for client in self.corrupt:
            if not 0 <= client < self.num_clients:
                raise ValueError(f"@corrupt.{client}@ a client id in 0..{self.num_clients - 1}, got {client}")
        if self.canonical_method == "subsets":
            low, high = self.subset_fraction
            if not 0 < low <= high <= 1:
                raise ValueError(f"@subset_fraction@ [low, high] with 0 < low <= high <= 1, got [{low}, {high}]")
        return self

    def params(self) -> dict[str, Any]:
        """The parameters the chosen partitioner uses (defaults filled in)."""
        return {name: getattr(self, name) for name in _PARTITION_PARAMS[self.canonical_method]}


class ModelConfig(StrictModel):
    name: str = Field("mlp", description="logreg | mlp | cnn | rescnn | vgg | transformer | torchvision:<name> (e.g. torchvision:resnet18)")
    hidden: list[int] = Field(default_factory=lambda: [64, 64], description="mlp, vgg: hidden layer widths; transformer: [width, feed-forward width]")
    channels: list[int] = Field(default_factory=lambda: [16, 32], description="cnn, rescnn, vgg: channels of the 3x3 conv layers")
    heads: int = Field(2, ge=1, description="transformer: attention heads (a divisor of hidden[0])")
    depth: int = Field(2, ge=1, le=64, description="transformer: encoder layers")
    patch_size: int = Field(4, ge=1, description="transformer: patch side on image inputs (a divisor of the image size)")
    dropout: float = Field(0.0, ge=0, lt=1)
    activation: Literal["relu", "tanh", "gelu"] = "relu"
    factory: str | None = Field(None, description="name: custom: the qualified name of the model factory given to rayfuse.run(model=...) "
                                "(a record: a config file cannot hold a Python object, so such a run cannot be resumed from the CLI)")
    # ``name: custom``: the callable itself; not config data, but it travels with the section (by value) to every
    # process that builds the model.
    _factory: Any = PrivateAttr(None)

    @field_validator("hidden", "channels")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(v < 1 for v in value):
            raise ValueError("positive widths")
        return value

    @field_validator("name")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from rayfuse.models.registry import MODELS, torchvision_model_names

        if value.startswith("torchvision:"):
            tv_name = value.split(":", 1)[1]
            names = torchvision_model_names()
            if tv_name not in names:
                raise ValueError(f"a torchvision classification model name{suggest(tv_name, names)}")
            return value
        if value not in MODELS:
            known = MODELS.names() + ["torchvision:<name>"]
            raise ValueError(f"a model in {{{', '.join(known)}}}{suggest(value, known)}")
        return value

    @model_validator(mode="after")
    def _factory_only_for_custom(self) -> ModelConfig:
        if self.factory is not None and self.name != "custom":
            raise ValueError(f"@factory@ no factory for model {self.name!r} (only name: custom records one), got {self.factory!r}")
        return self

    @property
    def family(self) -> str:
        return "torchvision" if self.name.startswith("torchvision:") else self.name

    @property
    def custom_factory(self) -> Any:
        """The callable of ``name: custom`` (given to ``rayfuse.run(model=...)``); ``None`` otherwise."""
        return self._factory

    def with_factory(self, factory: Any, qualname: str) -> ModelConfig:
        """A copy that builds its model with ``factory`` (``name: custom``, ``factory: qualname``)."""
        copy_ = self.model_copy(update={"name": "custom", "factory": qualname})
        copy_._factory = factory
        return copy_


class DPSGDConfig(StrictModel):
    """``train.dp``: each client trains its local model with DP-SGD (Opacus: per-example gradient clipping to
    ``max_grad_norm``, Gaussian noise of standard deviation ``noise_multiplier * max_grad_norm`` on each batch's sum,
    Poisson sampling of batches at rate ``batch_size / n``). The privacy unit is one example of the client's data; the
    client reports the epsilon it spent at ``delta`` (:mod:`rayfuse.models.privacy`)."""

    # > 0: without noise the accountant's epsilon is infinite and every local model was rejected after training
    noise_multiplier: float | None = Field(None, gt=0, description="the noise's standard deviation over max_grad_norm, > 0 (or give "
                                           "target_epsilon)")
    target_epsilon: float | None = Field(None, gt=0, description="the epsilon each client may spend: Opacus picks the noise multiplier "
                                         "for it from the client's sample rate and steps (or give noise_multiplier)")
    max_grad_norm: float = Field(1.0, gt=0, description="per-example gradient clipping norm C")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee; below 1 / (smallest client's train size)")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus' privacy accountant: rdp (Renyi DP) or prv (privacy random variables)")

    @model_validator(mode="after")
    def _one_noise(self) -> DPSGDConfig:
        require_one_noise(self.noise_multiplier, self.target_epsilon)
        return self


class TrainConfig(StrictModel):
    """Local training of each client's model (and of the pooled oracle)."""

    epochs: int = Field(20, ge=0, le=100_000)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(5e-3, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd momentum")
    weight_decay: float = Field(0.0, ge=0)
    shared_init: bool = Field(False, description="all clients start from one seeded initialisation (default: each its own, as "
                                                 "models trained apart do; aligned fusion is for that case)")
    dp: DPSGDConfig | None = Field(None, description="local DP-SGD (Opacus) for each client's local model: {noise_multiplier | "
                                   "target_epsilon, max_grad_norm, delta, accountant}; null: no DP")

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a run without DP dumps as it always did: its config.yaml and its local models' cache keys are unchanged
        data = handler(self)
        if self.dp is None and isinstance(data, dict):
            data.pop("dp", None)
        return data


class ResourcesConfig(StrictModel):
    num_cpus: float | Literal["auto"] = Field("auto", description="CPUs reserved per actor; 'auto': Ray's actor default (1 to place it, 0 while it runs)")
    num_gpus: float = Field(0.0, ge=0, description="a fraction of a GPU per actor; torch work runs on it when > 0")
    memory: int | None = Field(None, ge=0, description="bytes of memory to reserve")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources, e.g. {silo_a: 1}")

    @field_validator("num_cpus")
    @classmethod
    def _non_negative(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and value < 0:
            raise ValueError("a number >= 0 or 'auto'")
        return value


class ClientOverride(ResourcesConfig):
    """``federation.client_overrides.<i>``: what client ``i`` does not share with the others. The resource keys it
    sets replace those of ``federation.clients`` for that client's actor; ``model`` gives the client its own model
    (a section with the schema of the top-level ``model:``), which it trains, keeps and sends instead of the run's.
    Only the keys given are dumped, so a written config reads back with the same overrides."""

    model: ModelConfig | None = Field(None, description="this client's own model (the schema of the top-level model:); "
                                      "default: the run's model. Only methods that need the clients' predictions alone "
                                      "(local, ensemble, global) accept clients of different models")

    @property
    def resource_keys(self) -> list[str]:
        """The resource keys this override sets (those replacing ``federation.clients``' for its client)."""
        return sorted(k for k in self.model_fields_set if k != "model")

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k in self.model_fields_set}
        return data


def other_model_clients(models: Sequence[ModelConfig]) -> list[int]:
    """The clients (indices of ``models``, each client's model in client order) whose model is not client 0's."""
    return [i for i, model in enumerate(models) if i > 0 and model != models[0]]


class FaultSpec(StrictModel):
    """An injected fault, for testing failure policies on a real run (chaos testing)."""

    client: int = Field(ge=0)
    step: str = Field(min_length=1, description="client step name, e.g. fedavg.fit or train_local")
    call: int = Field(1, ge=1, description="the n-th call of that step on that client (per actor life)")
    mode: Literal["raise", "exit", "nan", "nan_metrics", "hang"] = Field(
        "raise", description="raise an error, exit the process, NaN every float in the result, NaN the reported metrics (a NaN loss), or hang")
    seconds: float = Field(3600.0, gt=0, description="hang: how long to sleep")


class AttackSpec(StrictModel):
    """An attack on one client's model updates, to measure robust aggregation against (``rayfuse.attacks``).

    Applied by the server to the client's update where a method combines updates (the FedAvg family and ``average``),
    before aggregation: a simulation of a compromised client, recorded as an ``attack`` event. Never applied unless
    configured.
    """

    client: int = Field(ge=0)
    kind: Literal["sign_flip", "scale", "gaussian", "little_is_enough"] = Field(
        description="sign_flip (w_ref - (w - w_ref)), scale (w_ref + scale (w - w_ref)), gaussian (w_ref + N(0, std^2)), "
        "little_is_enough (the colluders send mean - z std of the honest updates, Baruch et al. 2019)")
    rounds: list[int] | Literal["all"] = Field("all", description="the rounds attacked (one-shot methods: round 1), or all")
    scale: float | None = Field(None, description="scale: the factor s (default 10)")
    std: float | None = Field(None, gt=0, description="gaussian: the noise's standard deviation (default 1)")
    z: float | None = Field(None, gt=0, description="little_is_enough: the number of standard deviations (default: the "
                            "paper's z_max for the round's n and colluders)")

    @field_validator("rounds", mode="before")
    @classmethod
    def _positive_rounds(cls, value: Any) -> Any:
        # before the union's own validation, so a bad value is one line naming the key, not one line per union member
        if value == "all":
            return value
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError("a non-empty list of rounds (>= 1) or 'all'")
        for r in value:
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError("a list of rounds >= 1 (integers) or 'all'")
        return list(value)

    @model_validator(mode="after")
    def _own_keys(self) -> AttackSpec:
        own = {"scale": "scale", "std": "gaussian", "z": "little_is_enough"}
        for key, kind in own.items():
            if getattr(self, key) is not None and self.kind != kind:
                raise ValueError(f"@{key}@ {key} only with kind {kind} (kind is {self.kind}), got {getattr(self, key)}")
        return self

    def attacks_round(self, round: int) -> bool:
        """Whether this attack applies to ``round``."""
        return self.rounds == "all" or round in self.rounds


_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
_PORT = r"(?:6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})"
_RAY_ADDRESS = re.compile(rf"auto|local|ray://{_HOST}(?::{_PORT})?|{_HOST}:{_PORT}")


class FederationConfig(StrictModel):
    backend: Literal["ray", "local"] = Field("ray", description="ray: Ray actors; local: in-process clients (debugging)")
    address: str | None = Field(None, description="Ray cluster address; default: RAY_ADDRESS, a running job's cluster, or a new local Ray")
    namespace: str = Field("rayfuse", min_length=1, description="Ray namespace of the run's named actors")
    timeout_s: float = Field(900.0, gt=0, description="how long a gather waits for the clients of one call")
    on_client_failure: Literal["retry", "drop", "fail"] = "retry"
    max_retries: int = Field(2, ge=0, description="retry: re-submissions of a failed call before the run fails")
    min_clients: int = Field(1, ge=1, description="quorum: fewer surviving clients than this fails the run")
    max_restarts: int = Field(2, ge=-1, description="Ray restarts of a dead client actor (-1: unlimited)")
    clients: ResourcesConfig = Field(default_factory=ResourcesConfig)
    client_overrides: dict[int, ClientOverride] = Field(default_factory=dict, description="per-client resources and model by "
                                                        "client id: {<i>: {num_gpus: 1, resources: {site_a: 1}, model: {name: cnn}}}")
    coordinator: ResourcesConfig = Field(default_factory=lambda: ResourcesConfig(num_cpus=0))
    clients_per_actor: int = Field(1, ge=1, description="simulation: clients hosted by one actor process. 1 (default): one named "
                                   "actor per client, the deployment model. More cuts Ray's per-call cost when many clients share few "
                                   "cores, as Flower's actor pool does; the clients of one actor share its process and resources")
    task_cpus: float = Field(1.0, gt=0, description="CPUs each server-side fan-out task requests (parallel assignment solves...)")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for the actors to start (resources to appear)")
    ray_init: dict[str, Any] = Field(default_factory=dict,
                                     description="arguments for ray.init when rayfuse starts a local Ray (num_cpus, include_dashboard...)")
    faults: list[FaultSpec] = Field(default_factory=list)
    attacks: list[AttackSpec] = Field(default_factory=list, description="attacks on clients' model updates, to measure "
                                      "robust aggregation against (FedAvg family and average)")

    @field_validator("address")
    @classmethod
    def _address_form(cls, value: str | None) -> str | None:
        # Whether anything answers there is checked when a run starts (actors.backend.check_reachable_address).
        if value is not None and not _RAY_ADDRESS.fullmatch(value):
            raise ValueError("a Ray address: host:port, ray://host:port, auto or local")
        return value

    def client_resources(self, client_id: int) -> ResourcesConfig:
        """Client ``client_id``'s resources: ``clients``, with the keys its ``client_overrides`` entry sets replaced."""
        override = self.client_overrides.get(client_id)
        if override is None or not override.resource_keys:
            return self.clients
        return self.clients.model_copy(update={k: getattr(override, k) for k in override.resource_keys})


class MlflowConfig(StrictModel):
    """``tracking.mlflow``: log each method of the run to MLflow (``rayfuse.tracking``; needs ``pip install 'rayfuse[mlflow]'``)."""

    uri: str | None = Field(None, description="MLflow tracking URI: a folder (relative to the working directory), file:..., "
                            "http(s)://... of a tracking server. Default: the run folder's mlruns/ (a local file store)")
    experiment: str | None = Field(None, min_length=1, description="MLflow experiment name. Default: run.name")


class TrackingConfig(StrictModel):
    """``tracking``: experiment-tracking sinks fed by the run's metrics channel. Where results are also sent, not what
    is computed: no part of a run folder's state or of a cache key."""

    mlflow: MlflowConfig | None = Field(None, description="log each method as an MLflow run (params, per-round metrics, "
                                        "the fused model and the plots), nested under one run of the experiment; "
                                        "{} for the defaults")


# The top-level sections: an error path starting with one of these is absolute (``Method.check``'s convention).
CONFIG_SECTIONS = ("run", "data", "partition", "model", "train", "federation", "methods", "evaluation", "tracking")


class ExperimentConfig(StrictModel):
    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=lambda: DataConfig(public_size=QUICKSTART_PUBLIC_SIZE),
                             description="the data; without this section, the quickstart's (digits, a public sample of 300)")
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    methods: dict[str, dict[str, Any]] = Field(default_factory=lambda: copy.deepcopy(DEFAULT_METHODS))
    evaluation: Literal["federated", "central", "both"] = Field(
        "central", description="where models are scored: central (the server's test set), federated (each client on its own "
        "held-out split, data.val_size; sums and counts only, aggregated count-weighted) or both (federated under federated_<metric>). "
        "Default: federated with data.silos, central without")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(), description="experiment-tracking sinks (MLflow)")

    @model_validator(mode="before")
    @classmethod
    def _silo_clients(cls, data: Any) -> Any:
        # With data.silos there is one client per silo and no partitioner: partition.num_clients is len(data.silos).
        if not isinstance(data, Mapping):
            return data
        section = data.get("data")
        silos = section.get("silos") if isinstance(section, Mapping) else getattr(section, "silos", None)
        if not isinstance(silos, list) or not silos:
            return data  # a simulation, or data.silos' own error
        n = len(silos)
        partition = data.get("partition")
        if partition is None:
            partition = {}
        elif isinstance(partition, BaseModel):
            partition = partition.model_dump(exclude_unset=True)
        if not isinstance(partition, Mapping):
            return data  # the partition section's own error
        for key, value in partition.items():
            if key != "num_clients":
                raise ValueError(f"@partition.{key}@ no partition key but num_clients with data.silos (each silo is one client's "
                                 f"data), got {value!r}")
        if "num_clients" in partition and partition["num_clients"] != n:
            raise ValueError(f"@partition.num_clients@ len(data.silos) ({n}) or unset, got {partition['num_clients']!r}")
        # and the server holds no test set unless data.test is given: evaluation defaults to federated
        data = {**data, "partition": {"num_clients": n}, "evaluation": data.get("evaluation", "federated")}
        if data.get("methods") is None:  # the default methods but the oracle (no process may pool the silos) and, without
            # a server sample (data.public), the distillation on it
            section = data.get("data")
            public = section.get("public") if isinstance(section, Mapping) else getattr(section, "public", None)
            skip = {"global"} | (set() if public is not None else {"distill"})
            data["methods"] = {k: v for k, v in copy.deepcopy(DEFAULT_METHODS).items() if k not in skip}
        return data

    @field_validator("methods", mode="before")
    @classmethod
    def _methods_list_form(cls, value: Any) -> Any:
        # ``methods: [local, fedavg]`` is shorthand for ``methods: {local: {}, fedavg: {}}``.
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, str) for v in value):
                raise ValueError("a list of method names or a mapping of labels to parameters")
            return {name: {} for name in value}
        if isinstance(value, Mapping):
            return {str(k): ({} if v is None else v) for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> ExperimentConfig:
        n = self.partition.num_clients
        if not self.methods:
            raise ValueError("@methods@ at least one method, got none")
        if self.federation.min_clients > n:
            raise ValueError(f"@federation.min_clients@ at most partition.num_clients ({n}), got {self.federation.min_clients}")
        if self.federation.clients_per_actor > 1 and any(o.resource_keys for o in self.federation.client_overrides.values()):
            # (an override that gives a client only its own model is fine: clients of one actor share its resources only)
            raise ValueError("@federation.clients_per_actor@ 1 when federation.client_overrides gives clients their own "
                             f"resources, got {self.federation.clients_per_actor}")
        for client in self.federation.client_overrides:
            if not 0 <= client < n:
                raise ValueError(f"@federation.client_overrides.{client}@ a client id in 0..{n - 1}, got {client}")
        for i, fault in enumerate(self.federation.faults):
            if fault.client >= n:
                raise ValueError(f"@federation.faults.{i}.client@ a client id in 0..{n - 1}, got {fault.client}")
        seen: set[int] = set()
        for i, attack in enumerate(self.federation.attacks):
            if attack.client >= n:
                raise ValueError(f"@federation.attacks.{i}.client@ a client id in 0..{n - 1}, got {attack.client}")
            if attack.client in seen:
                raise ValueError(f"@federation.attacks.{i}.client@ one attack per client, got client {attack.client} twice")
            seen.add(attack.client)
        return self

    def client_model(self, client_id: int) -> ModelConfig:
        """Client ``client_id``'s model: its ``federation.client_overrides.<i>.model``, else the run's ``model``."""
        override = self.federation.client_overrides.get(client_id)
        return override.model if override is not None and override.model is not None else self.model

    def client_models(self) -> tuple[ModelConfig, ...]:
        """Every client's model, in client order (``range(partition.num_clients)``)."""
        return tuple(self.client_model(i) for i in range(self.partition.num_clients))

    @property
    def heterogeneous_clients(self) -> bool:
        """Whether some client's model is not the run's ``model`` (``federation.client_overrides.<i>.model``): clients of
        several architectures, or clients of one architecture other than the server's."""
        return any(model != self.model for model in self.client_models())

    @model_validator(mode="after")
    def _evaluation(self) -> ExperimentConfig:
        if self.data.is_silos and self.evaluation != "federated" and self.data.test is None:
            raise ValueError(f"@evaluation@ federated when data.silos comes without data.test (the server holds no test set), "
                             f"got {self.evaluation!r}")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A simulation with central evaluation dumps as it always did; a silo config's partition is its client count only.
        data = handler(self)
        if not self.data.is_silos:
            if self.evaluation == "central":
                data.pop("evaluation", None)
        elif isinstance(data.get("partition"), dict):
            data["partition"] = {k: v for k, v in data["partition"].items() if k == "num_clients"}
        return data


# ----------------------------------------------------------------------------------------------------------------
# Loading, overrides and error messages


def pydantic_input_error(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> InputError:
    """Turn pydantic's first error into one :class:`InputError` line (key path, expected, got)."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    loc = [str(p) for p in error["loc"]]
    msg = str(error.get("msg", "invalid value"))
    got = error.get("input", InputError._MISSING)
    kind = error.get("type", "")
    # Our validators mark a more precise key path with @key@ (relative to the model that raised).
    # Our cross-field validators start their message with @key.path@ (relative to the model that raised, or absolute
    # when it starts with a top-level section); the rest of the message is the expected value and what was given.
    marked = re.search(r"@([A-Za-z0-9_.]+)@ ?", msg)
    if marked:
        sub = marked.group(1).split(".")
        msg = msg[: marked.start()] + msg[marked.end():]
        loc = sub if sub[0] in ExperimentConfig.model_fields and len(loc) == 0 else loc + sub
        got = InputError._MISSING
    path = ".".join(p for p in [prefix, *loc] if p) or "config"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if kind == "extra_forbidden":
        parent = loc[:-1]
        known = _known_keys(model or ExperimentConfig, parent)
        hint = suggest(loc[-1], known).strip(" ()") if known else ""
        expected = f"one of the keys {{{', '.join(known)}}}" if known else "no such key"
        return InputError(path, f"a known key, not {loc[-1]!r}: " + expected, InputError._MISSING, hint + more)
    if kind == "missing":
        return InputError(path, "this required key to be set", InputError._MISSING, more.strip())
    msg = re.sub(r"^(Value error, |Assertion failed, )", "", msg)
    msg = re.sub(r"^Input should be ", "", msg)
    msg = msg[0].lower() + msg[1:] if msg else msg
    found = re.search(r" \((did you mean '[^']*'\?)\)$", msg)  # from suggest(): goes after "got"
    if found:
        msg = msg[: found.start()]
    return InputError(path, msg, got, "; ".join(h for h in (found.group(1) if found else "", more.strip()) if h))


def _known_keys(model: type[BaseModel], parent: list[str]) -> list[str]:
    """The keys a nested section of ``model`` accepts (for "did you mean" on an unknown key)."""
    for part in parent:
        if part.isdigit():  # an item of a list of sections (data.silos.0)
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        candidates = _section_models(field.annotation)
        if not candidates:
            return []
        model = candidates[0]
    return sorted(model.model_fields)


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    """The config sections (models) an annotation holds: itself, or inside an Optional, a list or a dict's values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _section_models(arg)]


def parse_overrides(pairs: Sequence[str]) -> list[tuple[list[str], Any]]:
    """Parse ``--set a.b=c`` strings into (key path, YAML value) pairs."""
    parsed = []
    for pair in pairs:
        if "=" not in pair:
            raise InputError("--set", "KEY=VALUE (e.g. partition.num_clients=10)", pair)
        key, _, raw = pair.partition("=")
        parts = key.strip().split(".")
        if not all(re.fullmatch(r"[A-Za-z0-9_@+-]+", p) for p in parts):
            raise InputError("--set", "a dotted key path such as methods.fedavg.rounds", key)
        value = _parse_override_value(raw, key.strip())
        parsed.append((parts, value))
    return parsed


def _parse_override_value(raw: str, key: str) -> Any:
    """A ``--set`` value parsed as YAML (bounded, see :mod:`rayfuse.safeyaml`); text that is not valid YAML stays text."""
    from rayfuse.safeyaml import parse_yaml

    if not raw.strip():
        return None
    try:
        return parse_yaml(raw, f"--set {key}")
    except InputError as exc:
        if exc.expected == "valid YAML":
            return raw
        raise


def apply_overrides(data: dict[str, Any], overrides: Sequence[tuple[list[str], Any]]) -> dict[str, Any]:
    """Return a copy of ``data`` with each (path, value) set, creating mappings on the way."""
    data = copy.deepcopy(data)
    for parts, value in overrides:
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if isinstance(child, list) and part == "methods":  # list shorthand: turn into a mapping first
                child = node[part] = {name: {} for name in child}
            if not isinstance(child, dict):
                raise InputError(".".join(parts[: i + 1]), "a mapping to set a key inside", child)
            node = child
        node[parts[-1]] = value
    return data


def validate_config(data: Mapping[str, Any] | None) -> ExperimentConfig:
    """Validate plain data into an :class:`ExperimentConfig` (the schema; ``methods`` entries are resolved against
    the method registry by :func:`rayfuse.method.resolve_methods`)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise InputError("config", "a mapping of sections (run, data, partition, model, train, federation, methods)", type(data).__name__)
    try:
        config = ExperimentConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise pydantic_input_error(exc) from None
    return config


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read a YAML config (or start from the defaults), apply ``--set`` overrides and validate."""
    return build_config({} if path is None else read_config_file(path), overrides)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping of sections in a YAML config file, not yet validated (raises :class:`InputError`)."""
    from rayfuse.safeyaml import read_yaml_file

    path = Path(path)
    data = read_yaml_file(path, "YAML config file") or {}
    if not isinstance(data, dict):
        raise InputError(str(path), "a YAML mapping of sections", type(data).__name__)
    return data


def build_config(data: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Apply ``--set`` overrides to a config given as plain data, and validate (``data`` is not modified)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise InputError("config", "a mapping of sections (run, data, partition, model, train, federation, methods)", type(data).__name__)
    data = dict(data)
    parsed = parse_overrides(overrides)
    if "methods" not in data and any(parts[0] == "methods" and len(parts) > 1 for parts, _ in parsed):
        # The empty config is the quickstart: `--set methods.fedavg.rounds=3` edits its methods, not replaces them.
        data["methods"] = copy.deepcopy(DEFAULT_METHODS)
    return validate_config(apply_overrides(data, parsed))


def dump_config(resolved: Mapping[str, Any]) -> str:
    """YAML text of a resolved config (:func:`rayfuse.method.resolved_config`: every default filled in)."""
    return yaml.safe_dump(dict(resolved), sort_keys=False)
