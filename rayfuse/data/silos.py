"""Silos: each client's own data, read where it lives (``data.silos``).

A silo config gives every client its own data source instead of a share of one dataset (``data.dataset`` +
``partition``). Only the process that uses a silo reads it: :func:`load_silo` runs on the client's node, expands
``${VAR}`` in its path with that node's environment (:func:`expand_path`) and keeps ``val_size`` of the silo as its
held-out split (stratified, seeded) or reads the silo's ``test_path``. The driver never opens a silo path; config
validation (:class:`rayfuse.config.SiloSpec`) checks only its form.

What leaves a client is its schema (:func:`silo_schema`: input shape, dtype, label values, counts and a content
hash; no rows, no paths), which the coordinator compares across silos (:func:`check_schemas`) and records
(:func:`silo_manifest`), and, where features are standardised, per-feature counts, sums and sums of squares
(:func:`feature_moments`), which the server combines into the global mean and scale (:func:`combine_moments`).

Formats: ``npz``, ``parquet`` and ``csv`` through the shared data-file check
(:func:`rayfuse.data.datasets.read_data_file`), ``imagefolder`` (torchvision's ``ImageFolder`` layout: one folder per
class, read with PIL; nothing downloads) and the bundled datasets (for rehearsal on one machine).

The server's public sample may be a file without labels (``data.public: {..., labels: false}``; npz, or parquet / csv
with its ``features`` named): only its inputs are read (:func:`load_server_inputs`), and its :class:`Split` carries
labels of ``-1`` ("unknown") so every code path keeps its types; methods that read those labels are refused before
the run starts (``MethodTags.public_labels``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from rayfuse.config import PATH_VARIABLE, SiloSource, SiloSpec, label_value, silo_source_kind
from rayfuse.data.datasets import Dataset, load_dataset, read_data_file
from rayfuse.data.roles import Normalization, Split
from rayfuse.data.text import TEXT_DTYPE, TextEncoding
from rayfuse.errors import InputError
from rayfuse.seeding import make_rng

if TYPE_CHECKING:
    from rayfuse.config import ExperimentConfig

T = TypeVar("T")

__all__ = [
    "IMAGE_EXTENSIONS",
    "SCHEMA_FORMAT",
    "UNKNOWN_LABEL",
    "SiloClientPlan",
    "SiloPlan",
    "check_schemas",
    "combine_moments",
    "dtype_kind",
    "expand_path",
    "feature_moments",
    "label_value",
    "load_server_inputs",
    "load_server_set",
    "load_silo",
    "load_silo_splits",
    "make_silo_plan",
    "stored_dtype",
    "server_set_size",
    "silo_manifest",
    "silo_schema",
    "wants_standardization",
    "server_split",
]

# the file suffixes torchvision's ImageFolder reads (torchvision.datasets.folder.IMG_EXTENSIONS)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SCHEMA_FORMAT = 1
# the label of every sample of an unlabeled server set (data.public with labels: false): unknown
UNKNOWN_LABEL = -1


@dataclass(frozen=True)
class SiloClientPlan:
    """What one client of a silo config needs: its silo spec as written (``${VAR}`` expands on its own node) and the
    run's seed and the declared label values (``data.classes``, as text; None when not declared); after the silo survey
    also the run's shared facts (label count, input shape), the federated standardisation and its own content hash (the
    key of its local model). Nothing about the other clients."""

    client_id: int
    spec: SiloSpec
    seed: int
    classes: tuple[str, ...] | None = None
    num_classes: int = 0
    input_shape: tuple[int, ...] = ()
    normalization: Normalization | None = None
    content_hash: str = ""
    corruption: str | None = None  # (a silo is never corrupted by rayfuse; the field a ClientPlan has)
    corruption_seed: int = 0
    text: TextEncoding | None = None  # text silos: the run's tokenizer and max_length (tokenised here, on the client)

    @property
    def joined(self) -> bool:
        """Whether this is the plan completed by the silo survey (:meth:`SiloPlan.for_client` after
        :meth:`SiloPlan.with_schemas`), not the plan a client starts with."""
        return bool(self.content_hash)


@dataclass(frozen=True, eq=False)
class SiloPlan:
    """The data plan of a silo config: what the driver and the coordinator know of the clients' data.

    Built without reading any data (:func:`make_silo_plan`: the specs only); the clients' reports (:func:`silo_schema`)
    complete it (:meth:`with_schemas`) with the input shape, label values, sizes, class counts and content hashes, and
    the federated standardisation. It answers what the engine asks of a :class:`rayfuse.data.roles.DataPlan`; its
    manifest is the silo manifest (:func:`silo_manifest`: no indices, no paths). ``public_labeled`` is false when the
    server's public sample is a file without labels (``data.public.labels: false``).
    """

    silos: tuple[SiloSpec, ...]
    seed: int
    classes: tuple[str, ...] | None = None
    schemas: tuple[dict[str, Any], ...] = ()
    normalization: Normalization | None = None
    test_size: int = 0
    public_size: int = 0
    dataset: str = "silos"
    test_source: str = "data.test"
    target: str | None = None
    unassigned: int = 0
    public_labeled: bool = True
    text: TextEncoding | None = None

    @property
    def surveyed(self) -> bool:
        """Whether the clients' schemas are in (the plan is complete)."""
        return len(self.schemas) == len(self.silos)

    @property
    def num_clients(self) -> int:
        return len(self.silos)

    @property
    def num_classes(self) -> int:
        return len(self.schemas[0]["labels"]) if self.schemas else 0

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.schemas[0]["input_shape"]) if self.schemas else ()

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(self.schemas[0]["labels"]) if self.schemas else ()

    @property
    def counts(self) -> np.ndarray:
        """(num_clients, num_classes): each silo's class counts, training and held-out split together."""
        return np.array([np.add(s["class_counts"], s["held_out_class_counts"]) for s in self.schemas], dtype=np.int64)

    @property
    def partition(self) -> dict[str, Any]:
        return {"method": "silos", "num_clients": self.num_clients}

    @property
    def test(self) -> range:
        return range(self.test_size)

    @property
    def public(self) -> range:
        return range(self.public_size)

    @property
    def client_train(self) -> tuple[range, ...]:
        """Sizes only (``len``): a silo plan holds no indices."""
        return tuple(range(int(s["size"])) for s in self.schemas)

    @property
    def client_val(self) -> tuple[range, ...]:
        return tuple(range(int(s["held_out_size"])) for s in self.schemas)

    def num_examples(self, client_id: int) -> int:
        return int(self.schemas[client_id]["size"])

    def for_client(self, client_id: int) -> SiloClientPlan:
        if not self.schemas:
            return SiloClientPlan(client_id, self.silos[client_id], self.seed, self.classes, text=self.text)
        return SiloClientPlan(
            client_id,
            self.silos[client_id],
            self.seed,
            self.classes,
            self.num_classes,
            self.input_shape,
            self.normalization,
            str(self.schemas[client_id]["content_hash"]),
            text=self.text,
        )

    def with_schemas(self, schemas: Sequence[Mapping[str, Any]], normalization: Normalization | None) -> SiloPlan:
        """The plan completed with the clients' reports (checked to agree: :func:`check_schemas`)."""
        check_schemas(schemas, self.silos)
        return replace(self, schemas=tuple(dict(s) for s in schemas), normalization=normalization)

    def digest(self) -> str:
        """SHA-256 of the silos' content hashes, sizes, the seed and the standardisation: two runs with the same
        digest saw the same data."""
        h = hashlib.sha256()
        h.update(f"silos|{self.seed}|".encode())
        h.update(json.dumps(silo_manifest(self.schemas), sort_keys=True).encode())
        if self.normalization is not None:
            h.update(np.ascontiguousarray(self.normalization.mean, dtype=np.float32).tobytes())
            h.update(np.ascontiguousarray(self.normalization.std, dtype=np.float32).tobytes())
        return h.hexdigest()

    def manifest(self) -> dict[str, Any]:
        """The silo manifest (written as ``partition.json``): :func:`silo_manifest` with the seed, the hash, the
        server's set sizes and the federated standardisation (pooled statistics, no rows)."""
        return {
            **silo_manifest(self.schemas),
            "dataset": self.dataset,
            "num_classes": self.num_classes,
            "seed": self.seed,
            "hash": self.digest(),
            "roles": {
                "test": {"source": self.test_source, "size": self.test_size, "held_by": "coordinator (evaluation only)"},
                "public": {"size": self.public_size, "held_by": "coordinator (server's public sample)", "labeled": self.public_labeled},
                "clients": "each client's own silo, read only on its own node",
            },
            "normalization": None
            if self.normalization is None
            else {
                "mean": self.normalization.mean.reshape(-1).tolist(),
                "std": self.normalization.std.reshape(-1).tolist(),
                "source": "federated (the clients' counts, sums and sums of squares)",
            },
        }


def make_silo_plan(cfg: ExperimentConfig, *, test_size: int = 0, public_size: int = 0) -> SiloPlan:
    """The plan of a silo config before any client reports: the specs as written, nothing read."""
    assert cfg.data.silos is not None
    public_labeled = cfg.data.public is None or cfg.data.public.labels
    return SiloPlan(
        tuple(cfg.data.silos),
        cfg.run.seed,
        cfg.data.class_names,
        test_size=test_size,
        public_size=public_size,
        public_labeled=public_labeled,
        text=text_encoding(cfg.data),
    )


def text_encoding(data: Any) -> TextEncoding | None:
    """The run's :class:`~rayfuse.data.text.TextEncoding` (``data.tokenizer``, ``data.max_length``, which the config
    resolves) where its data are texts; ``None`` otherwise."""
    if not getattr(data, "uses_text", False):
        return None
    assert data.tokenizer is not None and data.max_length is not None  # ExperimentConfig._text_encoding
    return TextEncoding(str(data.tokenizer), int(data.max_length))


def wants_standardization(cfg: ExperimentConfig) -> bool:
    """Whether a silo run standardises its features: ``data.standardize`` when set, else the default of silo 0's
    dataset as a simulation on it would have it: tables (``parquet``, ``csv``, the bundled tables) yes; arrays
    (``npz``), images (``imagefolder``, the torchvision folders) and the bundled image sets no."""
    if cfg.data.standardize is not None:
        return bool(cfg.data.standardize)
    assert cfg.data.silos is not None
    if cfg.data.uses_text:  # token ids: never standardised
        return False
    from rayfuse.data.datasets import DATASETS

    name = cfg.data.silos[0].dataset
    if name == "imagefolder":
        return False
    if name == "csv":  # a csv file is a table as a parquet file is (it has no dataset of its own): parquet's default
        name = "parquet"
    return bool(DATASETS.get(name).standardize)


def load_silo_splits(plan: SiloClientPlan) -> tuple[Split, Split, tuple[str, ...], str]:
    """A client's silo read on its own node (:func:`load_silo`) as float32 train / held-out splits, its label values
    (``data.classes`` when declared) and the dtype its file stores the inputs in (what the silo survey compares)."""
    train, held_out = load_silo(plan.spec, client=plan.client_id, seed=plan.seed, classes=plan.classes, text=plan.text)
    return _as_split(train), _as_split(held_out), tuple(str(c) for c in train.class_names), stored_dtype(train)


def server_split(
    spec: SiloSource,
    *,
    key: str,
    labels: Sequence[str],
    input_shape: Sequence[int],
    normalization: Normalization | None,
    classes: Sequence[str] | None = None,
    dtype: str | None = None,
    text: TextEncoding | None = None,
) -> Split:
    """A server set (``data.test``, ``data.public``) read where the coordinator runs, checked against the silos' input
    shape and label values (``classes``: the declared ``data.classes``, which are then the silos' label values), its
    labels numbered as the silos number them, standardised as the clients are; with ``dtype`` (the silos' stored dtype,
    from the survey) its file's stored dtype must be of the same kind (:func:`dtype_kind`). A set without labels
    (``labels: false``) is its inputs only (:func:`load_server_inputs`), every label :data:`UNKNOWN_LABEL`; its
    readers record the dtype its file stores the inputs in, checked against ``dtype`` as a labelled set's is."""
    if not spec.labels:
        X, stored = _server_inputs(spec, key=key, text=text)
        if dtype is not None and dtype_kind(stored) != dtype_kind(dtype):
            where = f" in {spec.path!r}" if spec.path else ""
            raise InputError(
                f"{key}.path" if spec.path else key,
                f"inputs of the same kind as the silos': {dtype_kind(dtype)} ({dtype})",
                f"{stored}{where}",
                _KIND_HINT,
            )
        if tuple(X.shape[1:]) != tuple(input_shape):
            raise InputError(key, f"inputs shaped like the silos' {tuple(input_shape)}", tuple(X.shape[1:]))
        unlabeled = Split(X, np.full(len(X), UNKNOWN_LABEL, dtype=np.int64))
        return unlabeled if normalization is None else Split(normalization.apply(unlabeled.X), unlabeled.y)
    data = load_server_set(spec, key=key, classes=classes, text=text)
    if dtype is not None and dtype_kind(stored_dtype(data)) != dtype_kind(dtype):
        where = f" in {spec.path!r}" if spec.path else ""
        raise InputError(
            f"{key}.path" if spec.path else key,
            f"inputs of the same kind as the silos': {dtype_kind(dtype)} ({dtype})",
            f"{stored_dtype(data)}{where}",
            _KIND_HINT,
        )
    if tuple(data.input_shape) != tuple(input_shape):
        raise InputError(key, f"inputs shaped like the silos' {tuple(input_shape)}", tuple(data.input_shape))
    index = {label_value(name): i for i, name in enumerate(labels)}
    names = [str(n) for n in data.class_names]
    unknown = [names[i] for i in np.unique(data.y) if label_value(names[i]) not in index]
    if unknown:
        raise InputError(key, f"labels among the silos' label values {list(labels)}", unknown[0])
    mapping = np.array([index.get(label_value(n), -1) for n in names], dtype=np.int64)
    split = Split(np.ascontiguousarray(data.X, dtype=np.float32), np.ascontiguousarray(mapping[data.y], dtype=np.int64))
    return split if normalization is None else Split(normalization.apply(split.X), split.y)


def _as_split(data: Dataset) -> Split:
    return Split(np.ascontiguousarray(data.X, dtype=np.float32), np.ascontiguousarray(data.y, dtype=np.int64))


# ---------------------------------------------------------------------------------------------------------------
# Paths


def expand_path(path: str, env: Mapping[str, str] | None = None, *, key: str = "data.silos", client: int | None = None) -> str:
    """``path`` with every ``${NAME}`` replaced by ``env[NAME]`` (default: this process's environment, i.e. the
    environment of the node that reads the silo). Nothing else is expanded (no ``$NAME``, no ``~``).

    Raises :class:`InputError` at ``key`` naming the client and the path as written when a variable is unset.
    """
    env = os.environ if env is None else env
    where = "the server" if client is None else f"client {client}"

    def value(match: Any) -> str:
        name = match.group(1)
        if name not in env:
            raise InputError(
                key,
                f"${{{name}}} set in the environment of {where}'s node",
                path,
                f"set {name} where {where} runs (ray start's environment or the runtime_env's env_vars)",
            )
        return str(env[name])

    return PATH_VARIABLE.sub(value, path)


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_silo(
    spec: SiloSpec | Mapping[str, Any],
    *,
    client: int,
    env: Mapping[str, str] | None = None,
    seed: int = 0,
    classes: Sequence[str] | None = None,
    text: TextEncoding | None = None,
) -> tuple[Dataset, Dataset]:
    """Read client ``client``'s silo on its own node: its training split and its held-out split.

    Parameters
    ----------
    spec : SiloSpec or mapping
        ``data.silos.<client>`` (a mapping is validated as a :class:`~rayfuse.config.SiloSpec`).
    client : int
        The client's id; errors name ``data.silos.<client>``.
    env : mapping, optional
        The environment ``${VAR}`` in paths expands with (default: this process's).
    seed : int
        The run's seed; the held-out split (``val_size`` of each class, stratified) derives from it and the client.
    classes : sequence of str, optional
        The declared label values (``data.classes`` as text, in label order). With them each label is numbered by its
        position there (a silo may hold some of them, one at least) and a label not among them is an
        :class:`InputError`; without them the silo's label values are those its file holds (two at least).
    text : TextEncoding, optional
        A text silo's tokenizer and ``max_length`` (the run's ``data.tokenizer``, ``data.max_length``): its texts are
        tokenised here.

    Returns
    -------
    (Dataset, Dataset)
        The training split and the held-out split; both carry the silo's label values (``classes`` when given) as
        ``class_names``.
    """
    key = f"data.silos.{client}"
    silo: SiloSpec = _validated(spec, SiloSpec, key)
    data = _read_source(silo, key=key, client=client, env=env, classes=classes, text=text)
    if silo.test_path is not None:
        held_out = _read_source(silo, key=key, client=client, env=env, field="test_path", classes=classes, text=text)
        if dtype_kind(stored_dtype(held_out)) != dtype_kind(stored_dtype(data)):
            raise InputError(
                f"{key}.test_path",
                f"inputs of the same kind as the silo's path: {dtype_kind(stored_dtype(data))} ({stored_dtype(data)} in {silo.path!r})",
                f"{stored_dtype(held_out)} in {silo.test_path!r}",
                _KIND_HINT,
            )
        if classes is not None:
            if held_out.input_shape != data.input_shape:
                raise InputError(
                    f"{key}.test_path",
                    f"inputs shaped like the silo's training data {data.input_shape} in {silo.test_path!r}",
                    held_out.input_shape,
                )
            return data, Dataset(
                data.name + "-held-out",
                held_out.X,
                held_out.y,
                held_out.num_classes,
                held_out.class_names,
                stored_dtype=held_out.stored_dtype,
                meta=held_out.meta,
            )
        return data, _aligned_held_out(held_out, data, f"{key}.test_path", silo.test_path)
    assert silo.val_size is not None  # SiloSpec: val_size or test_path
    return _split_held_out(data, float(silo.val_size), key=key, seed=seed, client=client)


def load_server_set(
    spec: SiloSource | Mapping[str, Any],
    *,
    key: str,
    env: Mapping[str, str] | None = None,
    classes: Sequence[str] | None = None,
    text: TextEncoding | None = None,
) -> Dataset:
    """Read a server-side set of a silo config (``data.test``, ``data.public``: ``key``) whole, where the server runs;
    with ``classes`` (``data.classes``) its labels numbered by their position there, as :func:`load_silo` does. A set
    without labels (``labels: false``) is read by :func:`load_server_inputs` instead."""
    source: SiloSource = _validated(spec, SiloSource, key)
    if not source.labels:
        raise InputError(f"{key}.labels", "a labelled set here (read a set without labels with load_server_inputs)", False)
    return _read_source(source, key=key, client=None, env=env, classes=classes, text=text)


def load_server_inputs(
    spec: SiloSource | Mapping[str, Any], *, key: str, env: Mapping[str, str] | None = None, text: TextEncoding | None = None
) -> np.ndarray:
    """The inputs of a server-side set without labels (``data.public`` with ``labels: false``), read where the server
    runs: an ``npz`` file's ``features`` array (default ``X``), or a ``parquet`` / ``csv`` file's ``features`` columns;
    nothing else of the file is read; a text file's texts (``.txt``: its lines; else column ``text``) tokenised with
    ``text``. Float32 ``(N, *input_shape)``; bad files are one line at ``key``."""
    return _server_inputs(spec, key=key, env=env, text=text)[0]


def _server_inputs(
    spec: SiloSource | Mapping[str, Any], *, key: str, env: Mapping[str, str] | None = None, text: TextEncoding | None = None
) -> tuple[np.ndarray, str]:
    """:func:`load_server_inputs` with the dtype the file stores the inputs in (what the survey's kind check compares)."""
    from rayfuse.data.datasets import read_unlabeled_inputs

    source: SiloSource = _validated(spec, SiloSource, key)
    written = source.path
    assert written is not None  # SiloSource: labels false only for a file format, which has a path
    resolved = Path(expand_path(written, env, key=f"{key}.path"))
    if not resolved.is_file():
        hint = f"the server's node resolves it to {str(resolved)!r}" if str(resolved) != written else ""
        raise InputError(f"{key}.path", f"an existing {source.dataset} file on the server's node", written, hint)
    if source.is_text:
        from rayfuse.data.text import read_text_inputs

        encoding = _encoding(text, key)
        return _rekeyed(
            lambda: read_text_inputs(resolved, text=source.text, encoding=encoding, kind=source.dataset, key=f"{key}.path"),
            key,
            "path",
            written,
        )
    return _rekeyed(
        lambda: read_unlabeled_inputs(resolved, kind=source.dataset, features=source.features, delimiter=source.options.get("delimiter")),
        key,
        "path",
        written,
    )


def server_set_size(spec: SiloSource, *, key: str, classes: Sequence[str] | None = None, text: TextEncoding | None = None) -> int:
    """The number of samples of a server-side set (``data.test``, ``data.public``), read where the server runs (bad
    files are one line at ``key``)."""
    if not spec.labels:
        return int(len(load_server_inputs(spec, key=key, text=text)))
    return int(len(load_server_set(spec, key=key, classes=classes, text=text).y))


def _encoding(text: TextEncoding | None, key: str) -> TextEncoding:
    """The run's text encoding for a text source at ``key`` (the config resolves it for every run of text data)."""
    if text is None:
        raise InputError(key, "a text source read with the run's tokenizer (data.tokenizer, data.max_length)", None)
    return text


def _validated(spec: Any, model: type[SiloSource], key: str) -> Any:
    if isinstance(spec, model):
        return spec
    if not isinstance(spec, Mapping):
        raise InputError(key, f"a mapping of {model.__name__} keys (dataset, path...)", type(spec).__name__)
    from pydantic import ValidationError

    from rayfuse.config import pydantic_input_error

    try:
        return model.model_validate(dict(spec))
    except ValidationError as exc:
        raise pydantic_input_error(exc, prefix=key, model=model) from None


def _read_source(
    spec: SiloSource,
    *,
    key: str,
    client: int | None,
    env: Mapping[str, str] | None,
    field: str = "path",
    classes: Sequence[str] | None = None,
    text: TextEncoding | None = None,
) -> Dataset:
    """The whole data source ``spec`` (its ``path``, or its ``test_path`` when ``field`` says so), its labels numbered by
    their position in ``classes`` when declared (:func:`_declared`)."""
    data = _read_whole(spec, key=key, client=client, env=env, field=field, min_labels=2 if classes is None else 1, text=text)
    if classes is None:
        return data
    written = f" in {getattr(spec, field)!r}" if getattr(spec, field, None) is not None else ""
    return _declared(data, classes, key=f"{key}.{field}" if written else f"{key}.dataset", where=written)


def _declared(data: Dataset, classes: Sequence[str], *, key: str, where: str) -> Dataset:
    """``data`` with each label numbered by the position of its value (its class name) in the declared ``classes``;
    :class:`InputError` at ``key`` naming the first value present that is not declared."""
    index = {label_value(name): i for i, name in enumerate(classes)}
    if len(index) < len(classes):
        same = next(c for i, c in enumerate(classes) if label_value(c) in {label_value(d) for d in classes[:i]})
        raise InputError("data.classes", "distinct label values (numbers compare by value)", same)
    names = [str(n) for n in data.class_names]
    unknown = [names[i] for i in np.unique(data.y) if label_value(names[i]) not in index]
    if unknown:
        raise InputError(
            key,
            f"labels among data.classes {list(classes)}{where}",
            unknown[0],
            "add the value to data.classes or leave its rows out of the file",
        )
    mapping = np.array([index.get(label_value(n), -1) for n in names], dtype=np.int64)
    return Dataset(
        data.name, data.X, mapping[data.y], len(classes), tuple(str(c) for c in classes), stored_dtype=data.stored_dtype, meta=data.meta
    )


def _read_whole(
    spec: SiloSource,
    *,
    key: str,
    client: int | None,
    env: Mapping[str, str] | None,
    field: str,
    min_labels: int,
    text: TextEncoding | None = None,
) -> Dataset:
    """The whole data source as its file numbers its labels (``min_labels`` distinct at least: files and class folders);
    a text file's texts tokenised here with ``text`` (:func:`rayfuse.data.text.read_text_dataset`)."""
    kind = silo_source_kind(spec.dataset)
    name = "server" if client is None else f"silo{client}"
    where = "the server" if client is None else f"client {client}"
    if kind == "bundled":
        dataset = _rekeyed(lambda: load_dataset(spec.dataset, options=spec.options), key, field, None)
        return Dataset(name, dataset.X, dataset.y, dataset.num_classes, dataset.class_names, stored_dtype=dataset.stored_dtype)
    written: str = getattr(spec, field)
    resolved = Path(expand_path(written, env, key=f"{key}.{field}", client=client))
    hint = f"{where}'s node resolves it to {str(resolved)!r}" if str(resolved) != written else ""
    if kind in ("imagefolder", "folder"):
        if not resolved.is_dir():
            raise InputError(f"{key}.{field}", f"an existing folder on {where}'s node", written, hint)
        if kind == "folder":
            dataset = _rekeyed(lambda: load_dataset(spec.dataset, root=str(resolved), options=spec.options), key, field, written)
            return Dataset(name, dataset.X, dataset.y, dataset.num_classes, dataset.class_names, stored_dtype=dataset.stored_dtype)
        return _read_image_folder(
            resolved,
            name=name,
            key=f"{key}.{field}",
            written=written,
            image_size=spec.image_size,
            grayscale=bool(spec.grayscale),
            min_classes=min_labels,
        )
    if not resolved.is_file():
        raise InputError(f"{key}.{field}", f"an existing {spec.dataset} file on {where}'s node", written, hint)
    if spec.is_text:
        from rayfuse.data.text import read_text_dataset

        encoding = _encoding(text, key)
        data = _rekeyed(
            lambda: read_text_dataset(
                resolved,
                text=spec.text,
                label=spec.label or "y",
                encoding=encoding,
                kind=spec.dataset,
                key=f"{key}.{field}",
                min_labels=min_labels,
                name=name,
            ),
            key,
            field,
            written,
        )
        return data
    dataset = _rekeyed(
        lambda: read_data_file(
            resolved,
            label=spec.label or "y",
            features=spec.features,
            kind=spec.dataset,
            delimiter=spec.options.get("delimiter"),
            min_labels=min_labels,
        ),
        key,
        field,
        written,
    )
    return Dataset(name, dataset.X, dataset.y, dataset.num_classes, dataset.class_names, stored_dtype=dataset.stored_dtype)


def _rekeyed(read: Callable[[], T], key: str, field: str, written: str | None) -> T:
    """``read()``, with an :class:`InputError` at a ``data.*`` key or a file moved to the silo's key (``data.label`` ->
    ``data.silos.2.label``; a bad file -> ``data.silos.2.path``, naming the path as written, never as resolved)."""
    try:
        return read()
    except InputError as exc:
        path = exc.path
        if path.startswith(f"{key}.") or path in ("data.tokenizer", "data.max_length"):
            raise  # already at the source's key (a text file's reader is given it), or the run's tokenizer
        if path.startswith("data.") and path[5:].split(".", 1)[0] in ("label", "features", "options", "dataset", "text"):
            raise exc.at(f"{key}.{path[5:]}") from None
        if written is None:
            raise exc.at(f"{key}.{field}") from None
        if path == "data.path" or exc.got is InputError._MISSING:  # the resolved path stays on the node
            raise InputError(f"{key}.{field}", exc.expected, written, exc.hint) from None
        raise InputError(f"{key}.{field}", f"{exc.expected} (at {written!r})", exc.got, exc.hint) from None


# Pillow's modes of 16-bit grey pixels (16-bit PNG and TIFF); every other mode it reads holds 8 bits per channel, or
# 32-bit integers / floats ("I", "F"), which have no fixed range to scale by (refused)
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def _image_pixels(image: Any, *, grayscale: bool, image_size: list[int] | None) -> tuple[np.ndarray, str]:
    """An opened PIL image as float32 pixels ``(H, W)`` (grey) or ``(H, W, 3)`` in [0, 1], each scaled by the range of
    its own bit depth (8-bit: 255; 16-bit grey PNG / TIFF: 65535, never clipped to 8 bits), resized (bilinear, on the
    full-range values) to ``image_size`` [H, W] when given; and the dtype its pixels are stored in (uint8, uint16).
    Pillow reads a 16-bit colour PNG at 8 bits per channel (scaled, not clipped): it is uint8 here."""
    from PIL import Image

    size = None if image_size is None else (int(image_size[1]), int(image_size[0]))
    if image.mode in _SIXTEEN_BIT_MODES:
        grey = Image.fromarray(np.asarray(image, dtype=np.float32))  # mode F: the 16-bit values kept, as floats
        if size is not None:
            grey = grey.resize(size, Image.Resampling.BILINEAR)
        pixels = np.asarray(grey, dtype=np.float32) / np.float32(65535.0)
        return (pixels if grayscale else np.repeat(pixels[:, :, None], 3, axis=2)), "uint16"  # RGB of grey: 3 equal channels
    if image.mode in ("I", "F"):
        raise ValueError(f"mode {image.mode} ({'32-bit integer' if image.mode == 'I' else 'float'} pixels): no range to scale by")
    image = image.convert("L" if grayscale else "RGB")
    if size is not None:
        image = image.resize(size, Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.float32) / np.float32(255.0), "uint8"


def _read_image_folder(
    folder: Path, *, name: str, key: str, written: str, image_size: list[int] | None, grayscale: bool, min_classes: int = 2
) -> Dataset:
    """torchvision's ``ImageFolder`` layout: ``folder/<class>/**/<image>``, classes in sorted order; images read
    with PIL (RGB, or one grey channel), resized (bilinear) to ``image_size`` [H, W] when given, scaled to [0, 1] by
    their own bit depth (:func:`_image_pixels`: 16-bit images keep their range)."""
    from PIL import Image

    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = {c: sorted(p for p in (folder / c).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS) for c in classes}
    suffixes = ", ".join(IMAGE_EXTENSIONS)
    if not any(files.values()):
        raise InputError(key, f"class folders holding images ({suffixes})", written, "found no image in a class folder there")
    empty = [c for c in classes if not files[c]]
    if empty:
        raise InputError(key, f"images ({suffixes}) in every class folder", f"none in {empty[0]!r} of {written!r}")
    _check_image_headers(folder, files, key=key, written=written, image_size=image_size, grayscale=grayscale)
    if len(classes) < min_classes:
        raise InputError(
            key,
            "at least 2 class folders (or data.classes declaring the task's label values)",
            f"{len(classes)} ({classes[0]!r}) in {written!r}",
        )
    arrays, labels, depths = [], [], set()
    first: tuple[str, tuple[int, ...]] | None = None
    for label, cls in enumerate(classes):
        for file in files[cls]:
            relative = file.relative_to(folder).as_posix()
            try:
                with Image.open(file) as image:
                    pixels, depth = _image_pixels(image, grayscale=grayscale, image_size=image_size)
            except Exception as exc:  # a damaged file can make PIL's decoders raise anything: OSError, EOFError,
                # SyntaxError, struct.error, UnidentifiedImageError...; each is one line naming the file
                raise InputError(key, f"readable images in {written!r}", f"{relative}: {type(exc).__name__}: {str(exc)[:60]}") from None
            if first is None:
                first = (relative, pixels.shape)
            elif pixels.shape != first[1]:
                raise InputError(
                    f"{key.rsplit('.', 1)[0]}.image_size",
                    "[H, W] to resize the images to (they differ in size)",
                    f"{relative} is {pixels.shape[1]}x{pixels.shape[0]}, {first[0]} is {first[1][1]}x{first[1][0]}",
                )
            arrays.append(pixels)
            labels.append(label)
            depths.add(depth)
    X = np.stack(arrays)
    X = np.ascontiguousarray(X[:, None] if X.ndim == 3 else X.transpose(0, 3, 1, 2), dtype=np.float32)  # (N, C, H, W)
    # "uint8 pixels", "uint16 pixels": scaled to [0, 1] here, unlike an npz array of the same dtype (8- and 16-bit
    # images pool: each is scaled by its own range)
    stored = f"{np.result_type(*sorted(depths))} {_PIXELS}"
    return Dataset(name, X, np.asarray(labels, dtype=np.int64), len(classes), tuple(classes), stored_dtype=stored)


def _open_image(file: Path) -> Any:
    """``PIL.Image.open(file)`` (lazy: the header only), with PIL's decompression-bomb warning (an image above
    ``PIL.Image.MAX_IMAGE_PIXELS``, about 89 Mpx) raised as an error: such an image is refused from its header, never
    decoded (above twice that, PIL raises ``DecompressionBombError`` itself)."""
    import warnings

    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(file)


# Bytes per pixel and channel while an image folder is read: the decoded image (16-bit images keep 2 bytes), its copy
# in the stacked array and the float32 array the silo keeps.
IMAGE_BYTES_PER_VALUE = 8


def _check_image_headers(
    folder: Path, files: Mapping[str, Sequence[Path]], *, key: str, written: str, image_size: list[int] | None, grayscale: bool
) -> None:
    """Before any image of an image folder is decoded: every image's header is read (PIL opens lazily), an image PIL
    cannot identify or one above its decompression-bomb bound (:func:`_open_image`) is one line naming it, and the
    memory the folder needs at the first image's size (or ``image_size``) is bounded (:func:`_check_image_memory`)."""
    count = sum(len(names) for names in files.values())
    bounded = False
    for names in files.values():
        for file in names:
            try:
                with _open_image(file) as image:
                    size = image_size or [image.height, image.width]
            except Exception as exc:  # noqa: BLE001 - PIL's plugins raise many types (OSError, SyntaxError, a bomb's error...)
                raise InputError(
                    key, f"readable images in {written!r}", f"{file.relative_to(folder).as_posix()}: {type(exc).__name__}: {str(exc)[:60]}"
                ) from None
            if not bounded:
                _check_image_memory(
                    count, size, 1 if grayscale else 3, key=key if image_size is None else f"{key.rsplit('.', 1)[0]}.image_size"
                )
                bounded = True


def _check_image_memory(count: int, size: Sequence[int], channels: int, *, key: str) -> None:
    """``count`` images of ``size`` [H, W] with ``channels`` fit in the memory available now, checked from the first
    image's header (or ``image_size``) before any is decoded; :class:`InputError` at ``key`` otherwise."""
    from rayfuse.data.datasets import format_bytes
    from rayfuse.models.registry import available_memory

    need = count * int(size[0]) * int(size[1]) * channels * IMAGE_BYTES_PER_VALUE
    memory = available_memory()
    if memory is not None and need > memory:
        raise InputError(
            key,
            f"images that fit in the {format_bytes(memory)} available ({count} images of {channels} channel(s))",
            f"[{size[0]}, {size[1]}]",
            f"reading them needs {format_bytes(need)}",
        )


def _aligned_held_out(held_out: Dataset, train: Dataset, key: str, written: str) -> Dataset:
    """The silo's own test file with its labels mapped to the training data's label values (and its shape checked)."""
    if held_out.input_shape != train.input_shape:
        raise InputError(key, f"inputs shaped like the silo's training data {train.input_shape} in {written!r}", held_out.input_shape)
    index = {name: i for i, name in enumerate(train.class_names)}
    present = np.unique(held_out.y)
    unknown = [held_out.class_names[i] for i in present if held_out.class_names[i] not in index]
    if unknown:
        raise InputError(key, f"labels among the silo's training labels {list(train.class_names)} in {written!r}", unknown[0])
    mapping = np.array([index.get(name, -1) for name in held_out.class_names], dtype=np.int64)
    return Dataset(
        train.name + "-held-out",
        held_out.X,
        mapping[held_out.y],
        train.num_classes,
        train.class_names,
        stored_dtype=held_out.stored_dtype,
        meta=held_out.meta,
    )


def _split_held_out(data: Dataset, val_size: float, *, key: str, seed: int, client: int) -> tuple[Dataset, Dataset]:
    """``val_size`` of each class held out (largest remainders; every class keeps at least one training sample),
    chosen with a generator seeded by the run's seed and the client."""
    rng = make_rng(seed, "silo-held-out", client)
    counts = np.bincount(data.y, minlength=data.num_classes)
    want = val_size * counts
    take = np.floor(want).astype(np.int64)
    total = max(1, int(round(val_size * len(data.y))))
    for c in np.argsort(-(want - take), kind="stable"):  # largest remainders first, up to the total
        if take.sum() >= total:
            break
        take[c] += 1
    take = np.minimum(take, np.maximum(counts - 1, 0))
    if take.sum() == 0:
        raise InputError(
            f"{key}.val_size",
            "a held-out split of at least one sample (a class with 2 or more samples)",
            f"{val_size} of {len(data.y)} samples",
            "give more data or a test_path",
        )
    held = np.zeros(len(data.y), dtype=bool)
    for c in range(data.num_classes):
        members = np.flatnonzero(data.y == c)
        held[rng.permutation(members)[: take[c]]] = True
    train = Dataset(
        data.name, data.X[~held], data.y[~held], data.num_classes, data.class_names, stored_dtype=data.stored_dtype, meta=data.meta
    )
    held_out = Dataset(
        data.name + "-held-out",
        data.X[held],
        data.y[held],
        data.num_classes,
        data.class_names,
        stored_dtype=data.stored_dtype,
        meta=data.meta,
    )
    return train, held_out


# ---------------------------------------------------------------------------------------------------------------
# What a client reports: schema, counts, content hash; the coordinator's checks and manifest


_PIXELS = "pixels"
_KIND_HINT = (
    "integers (e.g. uint8 pixels, 0..255) and floats (e.g. 0..1) are on different scales: store every silo's inputs "
    "as one kind (a csv column of whole numbers reads as integers: write 1.0)"
)


def stored_dtype(data: Dataset) -> str:
    """The dtype ``data``'s source stores its inputs in (its file's; the array's own where the reader does not say)."""
    return data.stored_dtype or str(data.X.dtype)


def dtype_kind(dtype: str) -> str:
    """What the silo survey compares of stored dtypes: their kind, ``integer`` (signed or unsigned, any width),
    ``float`` or ``boolean``, and images' pixels (``"uint8 pixels"``, ``"uint16 pixels"``), which the reader scales to
    [0, 1] by their bit depth, so they pool with each other and with nothing stored as it is read (an npz array of
    uint8 stays 0..255); widths of one kind pool (int32 with int64, float32 with float64). A dtype numpy does not
    know is its own kind."""
    if str(dtype).endswith(f" {_PIXELS}"):
        return "image pixels scaled to [0, 1]"
    if str(dtype) == TEXT_DTYPE:  # texts tokenised where they are read: padded with -1, never scaled
        return "token ids of texts"
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        return str(dtype)
    return {"i": "integer", "u": "integer", "f": "float", "b": "boolean"}.get(kind, str(dtype))


def silo_schema(train: Dataset, held_out: Dataset) -> dict[str, Any]:
    """What a client reports about its silo (plain values; no rows, no paths): input shape, the dtype its file stores
    the inputs in (:func:`stored_dtype`: before the float32 cast, so the survey compares what the files hold), its label
    values (``labels``, in label order), the sizes and class counts of both splits, and a SHA-256 of the arrays."""
    digest = hashlib.sha256()
    for array in (train.X, train.y, held_out.X, held_out.y):
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}|".encode())
        digest.update(array.tobytes())
    return {
        "format": SCHEMA_FORMAT,
        "input_shape": [int(d) for d in train.input_shape],
        "dtype": stored_dtype(train),
        "labels": [str(name) for name in train.class_names],
        "size": int(len(train.y)),
        "held_out_size": int(len(held_out.y)),
        "class_counts": np.bincount(train.y, minlength=train.num_classes).astype(int).tolist(),
        "held_out_class_counts": np.bincount(held_out.y, minlength=train.num_classes).astype(int).tolist(),
        "content_hash": digest.hexdigest(),
        **({"text": dict(train.meta["text"])} if "text" in train.meta else {}),
    }


def check_schemas(schemas: Sequence[Mapping[str, Any]], silos: Sequence[SiloSource] = ()) -> None:
    """Every silo's schema (client order) agrees with silo 0's: input shape, the kind of its stored dtype
    (:func:`dtype_kind`: a silo of uint8 pixels does not pool with one of floats) and label values. ``silos``, the
    specs as written, name the files in the error (the schemas hold no paths).

    Raises :class:`InputError` naming the first silo that differs from ``data.silos.0``.
    """
    if not schemas:
        raise InputError("data.silos", "at least one silo schema", [])
    base = schemas[0]

    def written(i: int) -> str:
        path = getattr(silos[i], "path", None) if i < len(silos) else None
        return f" in {path!r}" if path else ""

    for i, schema in enumerate(schemas[1:], start=1):
        if dtype_kind(schema["dtype"]) != dtype_kind(base["dtype"]):
            raise InputError(
                f"data.silos.{i}",
                f"inputs of the same kind as data.silos.0's: {dtype_kind(base['dtype'])} ({base['dtype']}{written(0)})",
                f"{schema['dtype']}{written(i)}",
                _KIND_HINT,
            )
        if schema.get("text") != base.get("text"):
            raise InputError(
                f"data.silos.{i}",
                f"texts tokenised as data.silos.0's {base.get('text')}{written(0)}",
                f"{schema.get('text')}{written(i)}",
                "every client must tokenise with the same tokenizer files (data.tokenizer) and max_length",
            )
        for field, what in (("input_shape", "input shape"), ("labels", "label values")):
            mine = list(schema[field]) if isinstance(schema[field], (list, tuple)) else schema[field]
            theirs = list(base[field]) if isinstance(base[field], (list, tuple)) else base[field]
            if mine != theirs:
                hint = (
                    (
                        "every silo must hold the same label values unless the config declares them: data.classes, the task's "
                        "label values in label order (a silo may then lack some)"
                    )
                    if field == "labels"
                    else "every silo must hold the same kind of inputs"
                )
                raise InputError(f"data.silos.{i}", f"the {what} of data.silos.0 {theirs}", mine, hint)


def silo_manifest(schemas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The silo manifest (a silo run's record of its data, in place of the partition manifest): per client its size,
    held-out size, class counts and content hash, with the shared input shape and label values. No indices, no paths."""
    check_schemas(schemas)
    return {
        "format": SCHEMA_FORMAT,
        "kind": "silos",
        "num_clients": len(schemas),
        "input_shape": list(schemas[0]["input_shape"]),
        "labels": list(schemas[0]["labels"]),
        "clients": [
            {
                "client": i,
                "size": int(s["size"]),
                "held_out_size": int(s["held_out_size"]),
                "class_counts": list(s["class_counts"]),
                "held_out_class_counts": list(s["held_out_class_counts"]),
                "content_hash": s["content_hash"],
            }
            for i, s in enumerate(schemas)
        ],
    }


# ---------------------------------------------------------------------------------------------------------------
# Federated standardisation: clients send counts, sums and sums of squares; the server sends back mean and scale


def feature_moments(X: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """A silo's standardisation statistics: the sample count and the per-feature sum and sum of squares (float64,
    shaped like one input)."""
    X64 = np.asarray(X, dtype=np.float64)
    return int(X64.shape[0]), X64.sum(axis=0), np.square(X64).sum(axis=0)


def combine_moments(moments: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The global per-feature mean and scale from every silo's :func:`feature_moments`, shaped ``(1, *input_shape)``
    (float32): the mean and the population standard deviation of the silos' data pooled, a scale of 1 where a feature
    is constant, as the simulation standardises with its training pool's statistics."""
    if not moments:
        raise InputError("data.silos", "the feature moments of at least one silo", [])
    shape = np.shape(moments[0][1])
    for i, (_, total, squares) in enumerate(moments):
        if np.shape(total) != shape or np.shape(squares) != shape:
            raise InputError(f"data.silos.{i}", f"feature moments shaped like data.silos.0's {shape}", np.shape(total))
    count = sum(int(m[0]) for m in moments)
    if count <= 0:
        raise InputError("data.silos", "at least one sample across the silos", count)
    mean = np.sum([np.asarray(m[1], dtype=np.float64) for m in moments], axis=0) / count
    variance = np.maximum(np.sum([np.asarray(m[2], dtype=np.float64) for m in moments], axis=0) / count - np.square(mean), 0.0)
    std = np.sqrt(variance)
    scale = np.where(std > 1e-12, std, 1.0)
    return mean.astype(np.float32)[None], scale.astype(np.float32)[None]
