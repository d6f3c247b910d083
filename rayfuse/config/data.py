"""The ``data`` section (a dataset and its split, or each client's silo: ``data.silos``, with the server's sets
``data.test`` and ``data.public``) and the ``partition`` section (how a simulation's dataset is split)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import Field, PrivateAttr, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from rayfuse.config.base import StrictModel, _registered
from rayfuse.errors import key_error, suggest

__all__ = [
    "DatasetSource",
    "TargetConfig",
    "SILO_FORMATS",
    "PATH_VARIABLE",
    "silo_source_kind",
    "label_value",
    "MAX_IMAGE_PIXELS",
    "SiloSource",
    "SiloSpec",
    "DataConfig",
    "PartitionConfig",
]


_Source = TypeVar("_Source", bound="DatasetSource")  # with_arrays returns a copy of its own class


class DatasetSource(StrictModel):
    """Which dataset to load, and from where (``data`` and ``data.target``)."""

    dataset: str = Field("digits", description="a registered dataset (rayfuse list datasets)")
    root: str | None = Field(None, description="folder with torchvision datasets (MNIST, FashionMNIST, CIFAR-10)")
    path: str | None = Field(None, description="a user .npz or .parquet file (datasets 'npz', 'parquet')")
    label: str = Field("y", min_length=1, description="label key (npz) or column (parquet)")
    features: str | list[str] | None = Field(
        None, description="feature key (npz) or columns (parquet); default: X / all other numeric columns"
    )
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

    def with_arrays(self: _Source, dataset: Any, digest: str) -> _Source:
        """A copy that loads ``dataset`` (arrays given from Python) instead of a registered source.

        The copy reads ``dataset: arrays`` with ``options: {sha256: digest}`` (a record of the content: two runs of
        different arrays never share a cache key); the arrays themselves ride along with it.
        """
        copy_ = self.model_copy(update={"dataset": "arrays", "root": None, "path": None, "features": None, "options": {"sha256": digest}})
        copy_._arrays = dataset
        return copy_


class TargetConfig(DatasetSource):
    """A new task held by the server (knowledge amalgamation across tasks, FedSA): the coordinator's labelled sample
    (``data.public_size`` of this dataset's pool) and the test set come from here; the clients keep ``data.dataset``."""

    dataset: str = Field(description="a registered dataset (rayfuse list datasets)")
    test_size: float = Field(0.2, gt=0, lt=1, description="fraction of the target dataset held out as the test set")
    resize: list[int] | None = Field(None, min_length=2, max_length=2, description="[H, W]: bilinear resize of the target's images")
    pad: int = Field(
        0, ge=0, description="zero padding on every side after resizing (e.g. digits 8x8 -> resize [20, 20], pad 4 -> MNIST's 28x28)"
    )

    @field_validator("resize")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        return _check_image_size(value)


# ----------------------------------------------------------------------------------------------------------------
# Silos: each client's own data where it lives (data.silos), and the server's optional sets (data.test, data.public)

SILO_FORMATS = ("npz", "parquet", "csv", "imagefolder", "jsonl", "txt")
# formats that hold texts (tokenised where the file is read): jsonl always, txt (one text a line, no labels), and a
# csv or parquet file whose text column is named (``text``)
TEXT_SILO_FORMATS = ("jsonl", "csv", "parquet", "txt")
# ``${NAME}`` in a silo path: expanded on the node that reads the silo (rayfuse.data.silos.expand_path)
PATH_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# data keys of a simulation (one dataset + a partitioner); a silo config gives each client its own data instead
_SIMULATION_DATA_KEYS = (
    "dataset",
    "root",
    "path",
    "label",
    "features",
    "options",
    "target",
    "test_size",
    "public_size",
    "layout",
    "text",
)


def silo_source_kind(dataset: str) -> str:
    """How a silo's ``dataset`` is read: ``"table"`` (npz, parquet, csv: a file with a label; parquet and csv hold texts
    when ``text`` names their column), ``"text"`` (jsonl, txt: texts), ``"imagefolder"`` (class folders of images),
    ``"folder"`` (a torchvision dataset whose ``path`` is its root folder) or ``"bundled"`` (a bundled or generated
    dataset: no path; for rehearsal)."""
    if dataset in ("npz", "parquet", "csv"):
        return "table"
    if dataset in ("jsonl", "txt"):
        return "text"
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
    the public sample's labels (``MethodTags.public_labels``) are then refused."""

    dataset: str = Field(
        description="npz | parquet | csv | imagefolder | jsonl | txt, or a bundled dataset (rayfuse list datasets; for rehearsal)"
    )
    path: str | None = Field(
        None,
        description="the file (npz, parquet, csv), the class folders (imagefolder) or a torchvision "
        "dataset's root; ${VAR} expands on the node that reads it. The driver never opens it",
    )
    label: str | None = Field(None, min_length=1, description="npz, parquet, csv, jsonl: the label array / column (default y)")
    text: str | None = Field(
        None,
        min_length=1,
        description="jsonl, csv, parquet: the text column (texts tokenised on the node that reads the file, with "
        "data.tokenizer; required for jsonl)",
    )
    features: str | list[str] | None = Field(
        None, description="npz: the feature array (default X); parquet, csv: the feature columns (default: every other numeric column)"
    )
    image_size: list[int] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="imagefolder: [H, W] every image is resized to (default: the images' own size, which must then agree)",
    )
    grayscale: bool | None = Field(None, description="imagefolder: read images as one grey channel (default: RGB)")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="a bundled dataset's generator arguments; csv: {delimiter: ';'} (default: sniffed from the header among , ; tab |)",
    )
    labels: bool = Field(
        True,
        description="false: a file without labels (data.public only; npz, or parquet / csv with features "
        "named): only its inputs are read, its labels are unknown (-1), for methods that never read them "
        "(distill with transfer: public)",
    )

    @field_validator("dataset")
    @classmethod
    def _known_format(cls, value: str) -> str:
        from rayfuse.data.datasets import DATASETS

        names = [*SILO_FORMATS, *(n for n, info in DATASETS.items() if info.source in ("bundled", "generator", "local folder"))]
        if value in SILO_FORMATS:
            return value
        if value in DATASETS and DATASETS.canonical(value) in names:
            return DATASETS.canonical(value)
        raise ValueError(
            f"a format in {{{', '.join(SILO_FORMATS)}}} or a bundled dataset in {{{', '.join(names[len(SILO_FORMATS) :])}}}"
            f"{suggest(value, names)}"
        )

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
        if self.text is not None and self.dataset not in TEXT_SILO_FORMATS[:3]:
            raise key_error("text", f"no text column for dataset {fmt} (only jsonl, csv and parquet name theirs), got {self.text!r}")
        if self.dataset == "jsonl" and self.text is None:
            raise key_error("text", "the text column of the jsonl file (dataset is 'jsonl')")
        if self.is_text and self.features is not None:
            raise key_error("features", f"no features for a text file (its inputs are the texts of column text), got {self.features!r}")
        if self.dataset == "txt" and self.label is not None:
            raise key_error("label", f"no label for a txt file (one unlabeled text a line; use jsonl, csv or parquet), got {self.label!r}")
        if kind == "bundled":
            if self.path is not None:
                raise key_error("path", f"no path for the bundled dataset {fmt} (it ships with rayfuse), got {self.path!r}")
        elif self.path is None:
            what = {
                "table": f"the {self.dataset} file",
                "text": f"the {self.dataset} file",
                "imagefolder": "the folder of class folders",
                "folder": f"the root folder of the torchvision dataset {fmt}",
            }[kind]
            raise key_error("path", f"{what} (dataset is {fmt})")
        if kind not in ("table", "text"):
            for key in ("label", "features"):
                if getattr(self, key) is not None:
                    raise key_error(key, f"no {key} for dataset {fmt} (only npz, parquet and csv name theirs), got {getattr(self, key)!r}")
        elif self.dataset == "npz" and isinstance(self.features, list):
            raise key_error("features", f"one array name for an npz file, got {self.features!r}")
        if kind != "imagefolder":
            for key in ("image_size", "grayscale"):
                if getattr(self, key) is not None:
                    raise key_error(key, f"no {key} for dataset {fmt} (imagefolder only), got {getattr(self, key)!r}")
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
                    raise key_error(("options", key), f"{expected} for dataset {fmt}, got {value!r}{suggest(key, allowed)}")
            delimiter = self.options.get("delimiter", ",")
            if self.dataset == "csv" and (not isinstance(delimiter, str) or len(delimiter) != 1):
                raise key_error(("options", "delimiter"), f"one character, got {delimiter!r}")
        return self

    @model_validator(mode="after")
    def _unlabeled_form(self) -> SiloSource:
        # labels: false (a file without labels) is read by its inputs only: a file format whose inputs can be named
        if self.dataset == "txt" and self.labels:
            raise key_error("labels", "false for a txt file (one unlabeled text a line: data.public only), got True")
        if self.labels:
            return self
        fmt = repr(self.dataset)
        if self.is_text:
            if self.label is not None:
                raise key_error("label", f"no label with labels: false (the file holds none), got {self.label!r}")
            return self
        if silo_source_kind(self.dataset) != "table":
            raise key_error("labels", f"true for dataset {fmt} (an unlabeled file is npz, or parquet / csv with features named), got False")
        if self.label is not None:
            raise key_error("label", f"no label with labels: false (the file holds none), got {self.label!r}")
        if self.dataset != "npz" and self.features is None:
            raise key_error(
                "features", f"the feature columns of an unlabeled {self.dataset} file (with labels: false only the columns named are read)"
            )
        return self

    @property
    def is_text(self) -> bool:
        """Whether the source holds texts (jsonl, txt, or csv / parquet with ``text`` named): tokenised where it is read."""
        return self.dataset in ("jsonl", "txt") or self.text is not None


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
            if silo_source_kind(self.dataset) not in ("table", "text", "imagefolder"):
                raise key_error(
                    "test_path", f"no test_path for dataset {self.dataset!r} (its held-out split is val_size of it), got {self.test_path!r}"
                )
            if self.val_size is not None:
                raise key_error("val_size", f"val_size or test_path, not both (test_path is {self.test_path!r}), got {self.val_size}")
        elif not self.val_size:
            raise key_error("val_size", f"a fraction > 0 (the silo's held-out split) or a test_path, got {self.val_size}")
        return self

    @model_validator(mode="after")
    def _unlabeled_form(self) -> SiloSpec:
        # replaces SiloSource's: a client trains on its silo's labels, whatever the format
        if self.dataset == "txt":
            raise key_error(
                "dataset",
                "jsonl, csv or parquet with a text column for a client's silo (a txt file holds no labels: data.public only), got 'txt'",
            )
        if not self.labels:
            raise key_error(
                "labels", "true for a client's silo (a client trains on its labels; labels: false is for data.public), got False"
            )
        return self


class DataConfig(DatasetSource):
    test_size: float = Field(0.2, gt=0, lt=1, description="fraction held out as the global test set (datasets without one)")
    val_size: float = Field(0.1, ge=0, lt=1, description="fraction of each client's shard kept as its private validation split")
    public_size: float | None = Field(
        0,
        ge=0,
        description="server's public sample: a fraction (< 1) or a count (>= 1) of the training pool; without a data "
        "section, the quickstart's 300 when a configured method reads a public sample, else none",
    )
    standardize: bool | None = Field(None, description="z-score features with training-pool statistics; default per dataset")
    layout: Literal["auto", "image", "sequence"] = Field(
        "auto",
        description="how an (N, A, B) array (an npz file's, or arrays from Python) is read: image, grey images "
        "(N, 1, A, B); sequence, kept as (N, L, D) for a sequence model or (N, C, L) for a Conv1d; auto (default): "
        "image, or sequence when the model takes (A, B) and not the image",
    )
    target: TargetConfig | None = Field(
        None,
        description="a new task for the server: its public sample and the test set come from this "
        "dataset (data.test_size is then unused: the clients share all of data.dataset)",
    )
    silos: list[SiloSpec] | None = Field(
        None, description="each client's own data, in client order, instead of data.dataset + partition (read only on the client's node)"
    )
    test: SiloSource | None = Field(None, description="with silos: the server's test set (central evaluation)")
    public: SiloSource | None = Field(None, description="with silos: the server's public / target sample")
    text: str | None = Field(
        None, min_length=1, description="dataset text: the text column of data.path (.jsonl, .csv, .parquet), labels in data.label"
    )
    tokenizer: str | None = Field(
        None,
        description="text data: the Hugging Face folder whose tokenizer tokenises the texts, where they are read "
        "(default: the folder of model.name: hf:<folder>)",
    )
    max_length: int | None = Field(
        None,
        ge=2,
        description="text data: tokens a text is truncated / padded (with -1) to; default min(128, the model's "
        "max_position_embeddings), at most that",
    )
    # int | float | str: a float label value (0.5) stays a float (its text "0.5" is what a file's label reads back as)
    classes: list[int | float | str] | None = Field(
        None,
        description="with silos: the task's label values in label order, as they "
        "appear in the files (a silo may hold some of them; numbers compare by value); "
        "default: every silo holds the same label values",
    )
    # The labels of the methods the quickstart's public sample is drawn for (with_public_default): the config states no
    # size, so the refusal of one too large for the data names them. Not config data (not dumped).
    _public_readers: tuple[str, ...] = PrivateAttr(())

    @model_validator(mode="before")
    @classmethod
    def _silo_val_size(cls, data: Any) -> Any:
        # A silo without val_size or test_path keeps data.val_size of its data as its held-out split.
        if isinstance(data, Mapping) and isinstance(data.get("silos"), list):
            default = data.get("val_size", cls.model_fields["val_size"].default)
            silos = [
                {**silo, "val_size": default}
                if isinstance(silo, Mapping) and silo.get("val_size") is None and silo.get("test_path") is None
                else silo
                for silo in data["silos"]
            ]
            data = {**data, "silos": silos}
        return data

    @field_validator("public_size")
    @classmethod
    def _public_size(cls, value: float | None) -> float | None:
        if value is not None and value >= 1 and value != int(value):
            raise ValueError("a fraction below 1 or a whole count")
        return value

    @property
    def public_readers(self) -> tuple[str, ...]:
        """The method labels the quickstart's public sample is drawn for; empty where the config states ``public_size``."""
        return self._public_readers

    def with_public_default(self, size: int, readers: tuple[str, ...]) -> DataConfig:
        """A copy whose unstated ``public_size`` (no data section) is ``size``, drawn for the methods ``readers``
        (:func:`rayfuse.method.with_public_default` decides both)."""
        copy_ = self.model_copy(update={"public_size": size})
        copy_._public_readers = readers
        return copy_

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_folder(cls, value: str | None) -> str | None:
        # absolute, as model.name's hf:<folder> is: the processes that tokenise start elsewhere
        import os

        if value is None:
            return value
        if not value.strip() or any(c in value for c in "\0\n\r"):
            raise ValueError("a local Hugging Face folder with a tokenizer")
        return os.path.abspath(os.path.expanduser(value))

    @model_validator(mode="after")
    def _file_datasets_need_path(self) -> DataConfig:
        if self.dataset in ("npz", "parquet", "text") and not self.path:
            raise key_error("path", f"the {self.dataset} file to load (data.dataset is {self.dataset!r})")
        return self

    @model_validator(mode="after")
    def _text_keys(self) -> DataConfig:
        if self.silos is None:
            if self.dataset == "text":
                suffix = (self.path or "").rsplit(".", 1)[-1].lower()
                if suffix not in TEXT_SILO_FORMATS[:3]:
                    raise key_error(
                        "path",
                        f"a .jsonl, .csv or .parquet file of labeled texts for dataset 'text' (a .txt file holds no labels), got {self.path!r}",
                    )
                if self.text is None:
                    raise key_error("text", f"the text column of {self.path!r} (data.dataset is 'text')")
                if self.options:
                    raise key_error(
                        "options",
                        f"no options for dataset 'text' (data.text, data.tokenizer, data.max_length say how it is read), got {self.options!r}",
                    )
            elif self.text is not None:
                raise key_error("text", f"dataset: text for a text column (data.dataset is {self.dataset!r}), got {self.text!r}")
        else:
            sources: list[tuple[tuple[str | int, ...], SiloSource]] = [(("silos", i), s) for i, s in enumerate(self.silos)]
            sources += [((key,), getattr(self, key)) for key in ("test", "public") if getattr(self, key) is not None]
            texts = [loc for loc, source in sources if source.is_text]
            odd = next((pair for pair in sources if not pair[1].is_text), None)
            if texts and odd is not None:
                first = ".".join(map(str, texts[0]))
                raise key_error(
                    (*odd[0], "dataset"),
                    f"a text source (jsonl, txt, or csv / parquet with text named) as data.{first} is (a run's data are "
                    f"texts or not), got {odd[1].dataset!r}",
                )
        if self.uses_text and self.standardize:
            raise key_error("standardize", "false or unset for text data (token ids are never scaled), got True")
        if not self.uses_text:
            for key in ("tokenizer", "max_length"):
                if getattr(self, key) is not None:
                    raise key_error(key, f"no {key} without text data (dataset: text, or text silos), got {getattr(self, key)!r}")
        return self

    @property
    def uses_text(self) -> bool:
        """Whether the run's data are texts (``dataset: text``, or silos of texts), tokenised where they are read."""
        if self.silos is None:
            return self.dataset == "text"
        return any(s.is_text for s in self.silos)

    @model_validator(mode="after")
    def _silos_or_simulation(self) -> DataConfig:
        if self.silos is None:
            for key in ("test", "public"):
                if getattr(self, key) is not None:
                    raise key_error(
                        key,
                        f"data.{key} only with data.silos (a simulation's server sets come from data.dataset: "
                        "test_size, public_size, target)",
                    )
            if self.classes is not None:
                raise key_error(
                    "classes", f"data.classes only with data.silos (a simulation's label values are its dataset's), got {self.classes!r}"
                )
            return self
        if not self.silos:
            raise key_error("silos", "at least one silo (one per client), got []")
        if self.test is not None and not self.test.labels:
            raise key_error(
                ("test", "labels"),
                "true for data.test (the server's test set scores the models on its labels; labels: false is for data.public), got False",
            )
        for key in _SIMULATION_DATA_KEYS:
            if key in self.model_fields_set:
                raise key_error(
                    key,
                    f"no data.{key} with data.silos (each client reads its own silo; the server's sets are "
                    f"data.test and data.public), got {getattr(self, key)!r}",
                )
        if self.classes is not None:
            names = [str(c) for c in self.classes]
            if len(names) < 2:
                raise key_error("classes", f"at least 2 label values, got {self.classes!r}")
            values = [label_value(c) for c in self.classes]  # numbers by value: 1 and 1.0 are one label
            repeated = next((c for i, c in enumerate(self.classes) if values[i] in values[:i]), None)
            if repeated is not None:
                raise key_error("classes", f"distinct label values, got {repeated!r} twice")
        return self

    @property
    def class_names(self) -> tuple[str, ...] | None:
        """``data.classes`` as the label names a silo's file reads back (text), or None when not declared."""
        return None if self.classes is None else tuple(str(c) for c in self.classes)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Kept: it changes what a dump is, not only how it reads. A simulation's data section holds no silo keys and a
        # silo config's no simulation keys: _silos_or_simulation refuses a simulation key given with data.silos, so a
        # silo config's dump would not validate again with them.
        data = handler(self)
        for key in ("silos", "test", "public", "classes") if self.silos is None else _SIMULATION_DATA_KEYS:
            data.pop(key, None)
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
    num_clients: int = Field(
        5, ge=1, le=100_000, description="number of clients the pool is split among (with data.silos: len(data.silos), set for you)"
    )
    alpha: float = Field(0.5, gt=0, description="dirichlet concentration")
    balance: bool = Field(True, description="dirichlet: PFNM balancing rule (stop giving to clients holding >= N/J)")
    min_size: int = Field(10, ge=0, description="dirichlet: redraw until every client holds at least this many samples")
    groups: list[list[int]] | None = Field(None, description="labels: the label set of each client")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client")
    shards_per_client: int = Field(2, ge=1, description="shards: shards per client")
    shard_size: int | None = Field(None, ge=1, description="shards: samples per shard (default: pool / total shards)")
    subset_fraction: tuple[float, float] = Field(
        (0.4, 0.9), description="subsets: each client's fraction of the pool ~ U[low, high] (overlapping)"
    )
    corrupt: dict[int, Literal["shuffle_labels", "noise", "permute_pixels", "flip_labels"]] = Field(
        default_factory=dict,
        description="clients whose private data is corrupted, by client id: shuffle_labels (random labels), "
        "noise (inputs + Gaussian noise, 2x the shard's std), permute_pixels (one fixed feature permutation: an unrelated input domain), "
        "flip_labels (label y becomes C - 1 - y: the label-flipping attack)",
    )

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
                raise key_error("groups", "each client's label list (partition.method is 'labels')")
            if len(self.groups) != self.num_clients:
                raise key_error("groups", f"one label list per client ({self.num_clients}), got {len(self.groups)} lists")
            for i, group in enumerate(self.groups):
                if not group:
                    raise key_error(("groups", i), f"at least one label for client {i}, got []")
                if any(label < 0 for label in group):
                    raise key_error(("groups", i), f"labels >= 0, got {group}")
        for client in self.corrupt:
            if not 0 <= client < self.num_clients:
                raise key_error(("corrupt", client), f"a client id in 0..{self.num_clients - 1}, got {client}")
        if self.canonical_method == "subsets":
            low, high = self.subset_fraction
            if not 0 < low <= high <= 1:
                raise key_error("subset_fraction", f"[low, high] with 0 < low <= high <= 1, got [{low}, {high}]")
        return self

    def params(self) -> dict[str, Any]:
        """The parameters the chosen partitioner uses (defaults filled in)."""
        return {name: getattr(self, name) for name in _PARTITION_PARAMS[self.canonical_method]}
