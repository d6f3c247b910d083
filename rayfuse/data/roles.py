"""Data roles and the partition manifest.

A run's data is split once, in the driver, into explicit roles (ARCHITECTURE.md, "Data"):

* **test** -- the global test set, used only to evaluate models (the coordinator holds it). The dataset's official
  test split when it ships one (torchvision), otherwise a stratified ``data.test_size`` hold-out.
* **public** -- the server's public sample (``data.public_size``; empty by default): data the server may train on
  (GEMS fine-tuning, FedSA's labelled target set, distillation). Drawn, stratified, from the training pool before
  partitioning, so no client holds it.
* **client train / val** -- each client's private shard (from the partitioner) and a private validation split of it
  (``data.val_size``). Only the client's own actor ever loads them. ``partition.corrupt`` marks clients whose private
  data is corrupted (random labels, flipped labels ``y -> C - 1 - y``, noised inputs, or permuted pixels: an unrelated
  input domain), applied by the
  client itself when it loads its shard (:func:`corrupt_split`): bad data owners for robustness experiments, and the
  unrelated / corrupted teachers of FedSA.

:class:`DataPlan` records every index, the class counts per client, the seed and a hash: the partition manifest
written to ``partition.json``. Clients receive only their own :class:`ClientPlan` and load their shard themselves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayfuse.data.datasets import Dataset, check_layout, load_dataset
from rayfuse.data.partition import PARTITIONERS, class_counts, partition
from rayfuse.errors import InputError
from rayfuse.seeding import derive_seed, make_rng

__all__ = [
    "ClientPlan",
    "DataPlan",
    "Split",
    "make_plan",
    "load_dataset_from_config",
    "load_target_from_config",
    "client_splits",
    "server_splits",
    "pooled_train",
    "corrupt_split",
    "CORRUPTIONS",
]

CORRUPTIONS = ("shuffle_labels", "noise", "permute_pixels", "flip_labels")


@dataclass(frozen=True)
class Split:
    """Inputs and labels of one role (``X`` float32 ``(n, *input_shape)``, ``y`` int64 ``(n,)``)."""

    X: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class Normalization:
    mean: np.ndarray
    std: np.ndarray

    def apply(self, X: np.ndarray) -> np.ndarray:
        return ((X - self.mean) / self.std).astype(np.float32)


@dataclass(frozen=True)
class ClientPlan:
    """What one client needs to load its own shard (and nothing about the others)."""

    client_id: int
    train: np.ndarray
    val: np.ndarray
    normalization: Normalization | None
    num_classes: int
    input_shape: tuple[int, ...]
    corruption: str | None = None  # partition.corrupt: how this client's private data is corrupted (None: clean)
    corruption_seed: int = 0


@dataclass(frozen=True, eq=False)
class DataPlan:
    dataset: str
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: tuple[str, ...]
    seed: int
    test_source: str  # "split" (held out from the dataset) or "predefined" (the dataset's own test split)
    test: np.ndarray
    public: np.ndarray
    client_train: tuple[np.ndarray, ...]
    client_val: tuple[np.ndarray, ...]
    counts: np.ndarray  # (num_clients, num_classes), train + val
    unassigned: int
    normalization: Normalization | None
    partition: dict[str, Any] = field(default_factory=dict)
    corruptions: dict[int, str] = field(default_factory=dict)  # client id -> corruption (partition.corrupt)
    target: str | None = None  # data.target: the test and public indices refer to this dataset, not to `dataset`

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    @property
    def public_labeled(self) -> bool:
        """Whether the public sample's labels are known: always, for a sample cut from a dataset (a silo config's
        ``data.public`` may come without, :class:`rayfuse.data.silos.SiloPlan`)."""
        return True

    def for_client(self, client_id: int) -> ClientPlan:
        return ClientPlan(
            client_id,
            self.client_train[client_id],
            self.client_val[client_id],
            self.normalization,
            self.num_classes,
            self.input_shape,
            self.corruptions.get(client_id),
            derive_seed(self.seed, "corrupt", client_id),
        )

    def num_examples(self, client_id: int) -> int:
        return int(len(self.client_train[client_id]))

    def digest(self) -> str:
        """SHA-256 of every index and the seed: two runs with the same digest saw the same split."""
        h = hashlib.sha256()
        h.update(f"{self.dataset}|{self.seed}|{self.test_source}".encode())
        for arr in (self.test, self.public, *self.client_train, *self.client_val):
            h.update(np.asarray(arr, dtype=np.int64).tobytes())
            h.update(b"|")
        if self.corruptions:  # (clean runs keep the hashes they had before corruptions existed)
            h.update(repr(sorted(self.corruptions.items())).encode())
        if self.target:
            h.update(f"|target:{self.target}".encode())
        return h.hexdigest()

    def manifest(self) -> dict[str, Any]:
        """The partition manifest (JSON-ready): roles, per-client indices and class counts, seed, hash."""
        return {
            "dataset": self.dataset,
            "num_classes": self.num_classes,
            "class_names": list(self.class_names),
            "input_shape": list(self.input_shape),
            "seed": self.seed,
            "partition": self.partition,
            "hash": self.digest(),
            **({"target": self.target} if self.target else {}),
            "roles": {
                "test": {
                    "source": self.test_source,
                    "size": int(len(self.test)),
                    "held_by": "coordinator (evaluation only)",
                    **({"dataset": self.target} if self.target else {}),
                },
                "public": {
                    "size": int(len(self.public)),
                    "held_by": "coordinator (server's public sample)",
                    "indices": self.public.tolist(),
                    **({"dataset": self.target} if self.target else {}),
                },
                "clients": "private train / val splits, each loaded only by its own client",
            },
            "unassigned": self.unassigned,
            "normalization": None
            if self.normalization is None
            else {"mean": self.normalization.mean.reshape(-1).tolist(), "std": self.normalization.std.reshape(-1).tolist()},
            "clients": [
                {
                    "id": i,
                    "num_train": int(len(self.client_train[i])),
                    "num_val": int(len(self.client_val[i])),
                    "class_counts": self.counts[i].tolist(),
                    **({"corrupt": self.corruptions[i]} if i in self.corruptions else {}),
                    "train": self.client_train[i].tolist(),
                    "val": self.client_val[i].tolist(),
                }
                for i in range(self.num_clients)
            ],
            "test_indices": self.test.tolist() if self.test_source == "split" else None,
        }


def load_dataset_from_config(data_cfg: Any) -> Dataset:
    """Load the dataset a :class:`rayfuse.config.DatasetSource` (``data`` or ``data.target``) names (or the arrays
    given from Python that came with it: ``dataset: arrays``), shaped as ``data.layout`` says
    (:func:`rayfuse.data.datasets.check_layout`; ``data.target`` has none: auto)."""
    layout = getattr(data_cfg, "layout", "auto")
    attached = getattr(data_cfg, "arrays", None)
    if attached is not None:
        return check_layout(attached, layout)
    if data_cfg.dataset == "text":  # texts tokenised here, with the run's tokenizer and max_length
        return load_dataset(
            "text",
            path=data_cfg.path,
            label=data_cfg.label,
            options={"text": data_cfg.text, "tokenizer": data_cfg.tokenizer, "max_length": data_cfg.max_length},
        )
    return check_layout(
        load_dataset(
            data_cfg.dataset,
            root=data_cfg.root,
            path=data_cfg.path,
            label=data_cfg.label,
            features=data_cfg.features,
            options=data_cfg.options,
            as_stored=layout == "sequence",
        ),
        layout,
    )


def load_target_from_config(data_cfg: Any) -> Dataset | None:
    """The server's new-task dataset (``data.target``), resized / padded as it asks; ``None`` when there is none."""
    t = getattr(data_cfg, "target", None)
    if t is None:
        return None
    ds = load_dataset_from_config(t)
    if t.resize is None and not t.pad:
        return ds
    if ds.X.ndim != 4:
        raise InputError("data.target.resize", "an image dataset (N, C, H, W) to resize or pad", f"inputs of shape {ds.X.shape[1:]}")
    import torch
    import torch.nn.functional as F

    def transform(X: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(X))
        if t.resize is not None:
            x = F.interpolate(x, size=tuple(t.resize), mode="bilinear", align_corners=False)
        if t.pad:
            x = F.pad(x, (t.pad,) * 4)
        return np.ascontiguousarray(x.numpy(), dtype=np.float32)

    X_test = None if ds.X_test is None else transform(ds.X_test)
    return Dataset(ds.name, transform(ds.X), ds.y, ds.num_classes, ds.class_names, X_test, ds.y_test, ds.meta)


def _split_test(dataset: Dataset, test_size: float, seed: int, key: str) -> tuple[str, np.ndarray, np.ndarray]:
    """(test source, test indices, pool indices): the dataset's own test split, or ``test_size`` of it held out."""
    y = dataset.y
    if dataset.has_test_split:
        assert dataset.y_test is not None  # Dataset.__post_init__: a test split comes with its labels
        return "predefined", np.arange(len(dataset.y_test), dtype=np.int64), np.arange(len(y), dtype=np.int64)
    n_test = int(round(test_size * len(y)))
    if not 1 <= n_test < len(y):
        raise InputError(key, f"a fraction leaving both a test set and a training pool ({len(y)} samples)", test_size)
    test, pool = _stratified_take(y, n_test, make_rng(seed, "test-split"))
    return "split", test, pool


def _stratified_take(labels: np.ndarray, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split ``arange(len(labels))`` into (taken, rest) with ``size`` taken, stratified by label where possible."""
    n = len(labels)
    if size <= 0:
        return np.zeros(0, np.int64), np.arange(n, dtype=np.int64)
    if size >= n:
        raise ValueError("size must be smaller than the number of samples")
    from sklearn.model_selection import train_test_split

    idx = np.arange(n)
    seed = int(rng.integers(2**31 - 1))
    try:
        rest, taken = train_test_split(idx, test_size=size, stratify=labels, random_state=seed)
    except ValueError:  # a class too small to stratify: fall back to a plain random split
        rest, taken = train_test_split(idx, test_size=size, random_state=seed)
    return np.sort(taken).astype(np.int64), np.sort(rest).astype(np.int64)


def make_plan(dataset: Dataset, data_cfg: Any, partition_cfg: Any, seed: int, target: Dataset | None = None) -> DataPlan:
    """Split ``dataset`` into roles and partition the training pool among the clients (deterministic in ``seed``).

    With a ``target`` dataset (``data.target``) the test set and the server's public sample come from it, and the
    clients share all of ``dataset``.
    """
    y = dataset.y
    if target is None:
        source, test_key, test_size, pool_name = dataset, "data.test_size", data_cfg.test_size, "the training pool"
    else:
        if target.input_shape != dataset.input_shape:
            raise InputError(
                "data.target",
                f"inputs shaped like data.dataset's {dataset.input_shape} (data.target.resize / pad)",
                f"{target.name} {target.input_shape}",
            )
        if target.num_classes != dataset.num_classes:
            raise InputError(
                "data.target.dataset",
                f"as many classes as data.dataset ({dataset.num_classes})",
                f"{target.name} with {target.num_classes}",
            )
        source, test_key, test_size, pool_name = target, "data.target.test_size", data_cfg.target.test_size, "the target's pool"
    # the test set and the public sample come from `source`; the clients share the rest of it (all of `dataset` with a target)
    test_source, test, pool = _split_test(source, test_size, seed, test_key)
    public_size = data_cfg.public_size or 0  # None (no data section) left unresolved by the caller: no public sample
    n_public = int(round(public_size * len(pool))) if public_size < 1 else int(public_size)
    if n_public >= len(pool):
        readers = data_cfg.public_readers
        hint = (
            f"the quickstart's public sample (a config without a data section), read by {', '.join(f'methods.{r}' for r in readers)}: set "
            f"data.public_size below {len(pool)} (or a fraction, e.g. 0.2), or run methods that read none"
            if readers
            else ""
        )
        got = public_size if public_size < 1 else n_public  # a count as written (300, not the float field's 300.0)
        raise InputError("data.public_size", f"fewer samples than {pool_name} ({len(pool)})", got, hint)
    taken, rest = _stratified_take(source.y[pool], n_public, make_rng(seed, "public-split"))
    public, pool = pool[taken], (pool[rest] if target is None else np.arange(len(y), dtype=np.int64))

    method = PARTITIONERS.canonical(partition_cfg.method)
    params = partition_cfg.params()
    parts = partition(y[pool], partition_cfg.num_clients, method, seed=derive_seed(seed, "partition"), **params)
    shards = [pool[p] for p in parts]
    unassigned = len(pool) - len(np.unique(np.concatenate(shards))) if shards else len(pool)

    train, val = [], []
    for i, shard in enumerate(shards):
        order = make_rng(seed, "val-split", i).permutation(shard)
        n_val = int(round(data_cfg.val_size * len(shard)))
        if data_cfg.val_size > 0 and len(shard) >= 2:
            n_val = min(max(n_val, 1), len(shard) - 1)
        else:
            n_val = 0
        val.append(np.sort(order[:n_val]))
        train.append(np.sort(order[n_val:]))

    standardize = data_cfg.standardize
    if standardize is None:
        from rayfuse.data.datasets import DATASETS

        standardize = DATASETS.get(data_cfg.dataset).standardize
    normalization = None
    if standardize:
        # Feature statistics of the training pool (never the test set), shared with every client as preprocessing.
        X_pool = dataset.X[pool] if target is not None else dataset.X[np.concatenate([pool, public])]
        mean = X_pool.mean(axis=0, keepdims=True)
        std = X_pool.std(axis=0, keepdims=True)
        normalization = Normalization(mean.astype(np.float32), np.where(std > 1e-12, std, 1.0).astype(np.float32))

    counts = class_counts(y, [np.concatenate([t, v]) for t, v in zip(train, val)], dataset.num_classes)
    corrupt = dict(getattr(partition_cfg, "corrupt", None) or {})
    return DataPlan(
        dataset=dataset.name,
        num_classes=dataset.num_classes,
        input_shape=dataset.input_shape,
        class_names=dataset.class_names,
        seed=seed,
        test_source=test_source,
        test=test,
        public=public,
        client_train=tuple(train),
        client_val=tuple(val),
        counts=counts,
        unassigned=int(unassigned),
        normalization=normalization,
        partition={
            "method": method,
            "num_clients": partition_cfg.num_clients,
            **params,
            **({"corrupt": {int(k): v for k, v in corrupt.items()}} if corrupt else {}),
        },
        corruptions={int(k): str(v) for k, v in corrupt.items()},
        target=None if target is None else target.name,
    )


def _take(dataset: Dataset, idx: np.ndarray, normalization: Normalization | None, *, test: bool = False) -> Split:
    X = dataset.X_test if test else dataset.X
    y = dataset.y_test if test else dataset.y
    assert X is not None and y is not None  # test=True only for a dataset with a test split (X_test and y_test)
    X, y = X[idx], y[idx]
    if normalization is not None:
        X = normalization.apply(X)
    return Split(np.ascontiguousarray(X, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64))


def client_splits(dataset: Dataset, plan: ClientPlan) -> tuple[Split, Split]:
    """A client's private (train, val) splits, from its own plan only (corrupted when ``plan.corruption`` says so)."""
    train, val = _take(dataset, plan.train, plan.normalization), _take(dataset, plan.val, plan.normalization)
    if plan.corruption is None:
        return train, val
    return (
        corrupt_split(train, plan.corruption, plan.corruption_seed, "train", num_classes=plan.num_classes),
        corrupt_split(val, plan.corruption, plan.corruption_seed, "val", num_classes=plan.num_classes),
    )


def corrupt_split(split: Split, kind: str, seed: int, role: str = "train", *, num_classes: int | None = None) -> Split:
    """``split`` corrupted the ``kind`` way (deterministic in ``seed``).

    * ``shuffle_labels`` -- the labels permuted among the samples (random labels: a corrupted task);
    * ``flip_labels`` -- every label ``y`` replaced by ``C - 1 - y`` (``C = num_classes``; the label-flipping attack of
      the robustness literature, e.g. Fang et al. 2020);
    * ``noise`` -- Gaussian noise with twice the split's feature standard deviation added to every input;
    * ``permute_pixels`` -- one fixed random permutation of the input features (the same for train and val, a new
      input domain: an unrelated task for which the client's features do not transfer to clean inputs).
    """
    if kind not in CORRUPTIONS:
        raise InputError("partition.corrupt", f"one of {CORRUPTIONS}", kind)
    X, y = split.X, split.y
    if kind == "shuffle_labels":
        y = make_rng(seed, "labels", role).permutation(y)
    elif kind == "flip_labels":
        if num_classes is None:
            raise ValueError("flip_labels needs num_classes")
        y = (num_classes - 1) - y
    elif kind == "noise":
        scale = 2.0 * float(X.std()) if X.size else 0.0
        X = X + make_rng(seed, "noise", role).normal(0.0, scale, size=X.shape).astype(np.float32)
    else:
        flat = X.reshape(len(X), int(np.prod(X.shape[1:])))
        order = make_rng(seed, "pixels").permutation(flat.shape[1])  # no role tag: train and val share the domain
        X = flat[:, order].reshape(X.shape)
    return Split(np.ascontiguousarray(X, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64))


def server_splits(dataset: Dataset, plan: DataPlan) -> tuple[Split, Split]:
    """The coordinator's (test, public) splits (``dataset``: the target dataset when ``plan.target`` is set)."""
    test = _take(dataset, plan.test, plan.normalization, test=plan.test_source == "predefined")
    return test, _take(dataset, plan.public, plan.normalization)


def pooled_train(dataset: Dataset, plan: DataPlan) -> Split:
    """All clients' training splits pooled: only for the ``global`` oracle, which a real federation cannot run."""
    # unique: with an overlapping partition (``subsets``) a sample shared by clients is pooled once
    return _take(dataset, np.unique(np.concatenate(plan.client_train)), plan.normalization)
