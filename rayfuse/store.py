"""The run folder: where every file of a run lives, written atomically.

::

    <run>/config.yaml                 resolved config (every default filled in)
    <run>/partition.json              partition manifest: roles, indices, class counts per client, seed, hash
    <run>/results.json                final: status, per-method metrics, timings, events (written last)
    <run>/metrics.parquet             one row per method x round x metric (x client)
    <run>/comparison.png              methods compared
    <run>/models/<label>.safetensors  fused models
    <run>/checkpoints/local/client-<i>.safetensors   local models the methods fetched (--resume's fallback)
    <run>/checkpoints/<label>/latest.json + round-<r>.safetensors   multi-round state
    <run>/state/<label>.json          a finished method's result (resume skips it)

The coordinator writes checkpoints and models; on Ray it is placed on the driver's node so it shares this folder.

:class:`LocalModelStore` keeps trained local models on the clients' side (``run.model_cache``), one
content-addressed entry per client model (``<cache>/local-models/<key>/``, :func:`local_model_key`): each client
writes and reads its own, and runs that share a key (the trials of a Tune sweep over fusion-only knobs) train once.
``--resume`` reads the clients' copies first and the run folder's ``checkpoints/local`` when a client's copy is gone.
:class:`StepResultCache` keeps a deterministic client step's results for a whole run. Both are built on
:class:`rayfuse.cas.ContentCache`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfuse.cas import CacheEntry, ContentCache, content_key
from rayfuse.io import atomic_write_json, load_params, save_params

if TYPE_CHECKING:
    from rayfuse.data.roles import ClientPlan

__all__ = ["RunStore", "Checkpointer", "Checkpoint", "LocalModelStore", "StepResultCache", "local_model_key", "step_result_key"]


@dataclass
class Checkpoint:
    round: int
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    meta: dict[str, Any]


class Checkpointer:
    """Round checkpoints of one multi-round method: ``save`` after each round, ``load`` on resume.

    A checkpoint is a safetensors file (``params/<name>`` and ``state/<name>`` arrays) plus ``latest.json``, written
    after it; the JSON is the commit point, so a crash between the two leaves the previous checkpoint in force.
    """

    def __init__(self, folder: Path, keep: int = 2) -> None:
        self.folder = folder
        self.keep = keep

    def save(self, round: int, params: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray] | None = None,
             meta: Mapping[str, Any] | None = None) -> Path:
        arrays = {f"params/{k}": v for k, v in params.items()}
        arrays.update({f"state/{k}": np.asarray(v) for k, v in (state or {}).items()})
        file = self.folder / f"round-{round:05d}.safetensors"
        save_params(file, arrays)
        atomic_write_json(self.folder / "latest.json", {"round": round, "file": file.name, "meta": dict(meta or {})})
        for old in sorted(self.folder.glob("round-*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)
        return file

    def load(self) -> Checkpoint | None:
        pointer = self.folder / "latest.json"
        if not pointer.is_file():
            return None
        info = json.loads(pointer.read_text())
        arrays = load_params(self.folder / info["file"])
        params = {k[len("params/"):]: v for k, v in arrays.items() if k.startswith("params/")}
        state = {k[len("state/"):]: v for k, v in arrays.items() if k.startswith("state/")}
        return Checkpoint(int(info["round"]), params, state, dict(info.get("meta", {})))


class RunStore:
    """Paths of one run folder and the writes into it."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def partition_file(self) -> Path:
        return self.root / "partition.json"

    @property
    def results_file(self) -> Path:
        return self.root / "results.json"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.parquet"

    @property
    def plot_file(self) -> Path:
        return self.root / "comparison.png"

    def model_file(self, label: str) -> Path:
        return self.root / "models" / f"{label}.safetensors"

    def local_model_file(self, client_id: int) -> Path:
        return self.root / "checkpoints" / "local" / f"client-{client_id}.safetensors"

    def checkpointer(self, label: str) -> Checkpointer:
        return Checkpointer(self.root / "checkpoints" / label)

    def method_state_file(self, label: str) -> Path:
        return self.root / "state" / f"{label}.json"

    def save_method_state(self, label: str, summary: Mapping[str, Any]) -> None:
        atomic_write_json(self.method_state_file(label), summary)

    def load_method_state(self, label: str) -> dict[str, Any] | None:
        file = self.method_state_file(label)
        return json.loads(file.read_text()) if file.is_file() else None

    def save_local_models(self, updates: Mapping[int, Any]) -> None:
        _save_local_models(self.root / "checkpoints" / "local", updates)

    def load_local_models(self, client_ids: list[int]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]]:
        """The checkpointed local models of those of ``client_ids`` the run folder holds: client -> (params, stats)."""
        return _load_local_models(self.root / "checkpoints" / "local", client_ids)


def _save_local_models(folder: Path, updates: Mapping[int, Any]) -> None:
    for client, update in updates.items():
        meta = {"num_examples": update.num_examples, **{k: repr(float(v)) for k, v in update.metrics.items()}}
        save_params(folder / f"client-{client}.safetensors", update.params, meta)


def _load_local_models(folder: Path, client_ids: list[int]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]]:
    files = {c: folder / f"client-{c}.safetensors" for c in client_ids}
    from safetensors import safe_open

    out = {}
    for client, file in files.items():
        if not file.is_file():
            continue
        with safe_open(str(file), framework="numpy") as handle:
            meta = handle.metadata() or {}
        stats = {k: float(v) for k, v in meta.items() if k != "num_examples"}
        out[client] = (load_params(file), stats)
    return out


CACHE_FORMAT = 1
LOCAL_MODEL_FORMAT = 2
LOCAL_TRAINING_STEPS = ("train_local", "get_local_params")


def _run_inputs(config: Mapping[str, Any], partition_hash: str) -> dict[str, Any]:
    """What every client's local training in a run depends on (the base of :func:`step_result_key`): the data and its
    split (``data``, ``partition``, the partition hash), the model, the training settings, the seed and the faults
    injected into local training; nothing under ``methods``."""
    return {
        "format": CACHE_FORMAT,
        "data": config["data"], "partition": config["partition"], "partition_hash": partition_hash,
        "model": config["model"], "train": config["train"], "seed": config["run"]["seed"],
        # faults injected into local training change the local models; faults of later steps do not
        "faults": [f for f in config["federation"]["faults"] if f["step"] in LOCAL_TRAINING_STEPS],
    }


def _hash_arrays(*arrays: Any) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def local_model_key(config: Mapping[str, Any], plan: ClientPlan) -> tuple[str, dict[str, Any]]:
    """The content key of one client's trained local model, and what it is computed from.

    The one key of a local model: the client names its own copy with it (:meth:`rayfuse.client.ClientContext.
    local_model`), the coordinator computes the same key from the run's config and the client's plan (the lock of a
    run's local training, the events). ``config`` holds the sections ``data``, ``model``, ``train``, ``run.seed`` and
    ``federation.faults`` as plain data (a resolved config, :func:`rayfuse.method.resolved_config`, or a client's own
    sections dumped the same way); ``plan`` is the client's :class:`~rayfuse.data.ClientPlan`. The key covers the
    dataset, the client, its train indices, normalisation and corruption, the model, the training settings, the seed
    and the faults injected into this client's local training; nothing under ``methods``, ``run.name`` or
    ``run.storage``, so every fusion-only variation of a job (the trials of a Tune sweep) shares it.
    """
    norm = plan.normalization
    inputs = {
        "format": LOCAL_MODEL_FORMAT,
        "data": config["data"], "model": config["model"], "train": config["train"], "seed": config["run"]["seed"],
        "client": int(plan.client_id),
        "train_indices": _hash_arrays(np.asarray(plan.train, dtype=np.int64)),
        "normalization": None if norm is None else _hash_arrays(norm.mean, norm.std),
        "corruption": plan.corruption, "corruption_seed": int(plan.corruption_seed),
        "faults": [f for f in config["federation"]["faults"]
                   if f["client"] == plan.client_id and f["step"] in LOCAL_TRAINING_STEPS],
    }
    return content_key(inputs), inputs


class LocalModelStore:
    """Trained local models, each kept by its own client under its content key (:func:`local_model_key`).

    ``<run.model_cache>/local-models/<key>/``: ``params.safetensors``, ``stats.json`` (the training statistics) and
    ``key.json`` (what the key was computed from), published once, complete (:class:`rayfuse.cas.ContentCache`).
    Written and read by the client's own process; the coordinator only takes :meth:`lock_run` while a run's clients
    train, so concurrent Tune trials sharing the keys train once and the others read.
    """

    def __init__(self, root: str | Path) -> None:
        self.cache = ContentCache(Path(root) / "local-models")

    @property
    def root(self) -> Path:
        return self.cache.root

    def entry(self, key: str, inputs: Mapping[str, Any] | None = None) -> CacheEntry:
        return CacheEntry(self.cache.root, key, dict(inputs or {}))

    def load(self, key: str) -> tuple[dict[str, np.ndarray], dict[str, float]] | None:
        """The kept parameters and training statistics of ``key``; ``None`` when nothing is kept."""
        entry = self.entry(key)
        if not entry.exists:
            return None
        stats = json.loads((entry.folder / "stats.json").read_text())
        return load_params(entry.folder / "params.safetensors"), {k: float(v) for k, v in stats.items()}

    def save(self, key: str, inputs: Mapping[str, Any], params: Mapping[str, np.ndarray], stats: Mapping[str, float]) -> bool:
        """Keep ``params`` and ``stats`` under ``key``; ``False`` when the entry existed already (it stands)."""

        def write(staging: Path) -> None:
            save_params(staging / "params.safetensors", params)
            atomic_write_json(staging / "stats.json", {k: float(v) for k, v in stats.items()})

        return self.entry(key, inputs).publish(write)

    def lock(self, key: str) -> contextlib.AbstractContextManager[Any]:
        """The lock of one client's entry (held by the client while it trains or reads)."""
        return self.entry(key).lock()

    def lock_run(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[Any]:
        """One lock over a run's entries (held by the coordinator while the run's clients train or read theirs)."""
        return self.cache.lock("run-" + content_key({"clients": sorted(keys)}))


# -- cached client-step results ------------------------------------------------------------------------------------


def _flatten_result(value: Any, prefix: str, arrays: dict[str, np.ndarray], scalars: dict[str, Any]) -> bool:
    """Split a client step's result (nested dicts of arrays and plain values) into arrays and JSON values."""
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and "/" not in k and _flatten_result(v, f"{prefix}{k}/", arrays, scalars)
                   for k, v in value.items())
    key = prefix[:-1]
    if isinstance(value, np.ndarray) and value.dtype != object:
        arrays[key] = value
    elif isinstance(value, np.generic):
        scalars[key] = value.item()
    elif value is None or isinstance(value, (bool, int, float, str)):
        scalars[key] = value
    else:
        return False  # not cacheable (the step's result is then simply not cached)
    return True


def _unflatten_result(arrays: Mapping[str, np.ndarray], scalars: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in [*arrays.items(), *scalars.items()]:
        node = out
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def step_result_key(config: Mapping[str, Any], partition_hash: str, step: str, args: Any, kwargs: Any) -> tuple[str, dict[str, Any]]:
    """The cache key of one client step's results for a whole run: what the run's local training depends on (data,
    partition and its hash, model, training settings, seed, local-training faults) plus the step and its arguments."""
    step_faults = [f for f in config["federation"]["faults"] if f["step"] == step]  # a fault in the step changes its results
    inputs = {**_run_inputs(config, partition_hash), "step": step, "args": args, "kwargs": kwargs, "step_faults": step_faults}
    return content_key(inputs), inputs


class StepResultCache:
    """Results of one deterministic client step (e.g. a local posterior fit) for all clients, shared by runs.

    One entry of a :class:`rayfuse.cas.ContentCache` under ``<run.model_cache>/step-results/`` (written once,
    complete, renamed into place; a ``filelock`` per key): ``<key>/client-<i>.npz`` (arrays, ``allow_pickle=False``),
    ``client-<i>.json`` (plain values) and ``key.json``. Methods whose clients summarise their data in their own step
    (KL-fusion's local posteriors) use it through :meth:`rayfuse.coordinator.MethodServer.run_cached`, so a Tune sweep
    over fusion-only knobs computes the summaries once.
    """

    def __init__(self, root: str | Path, key: str, inputs: Mapping[str, Any] | None = None) -> None:
        self.entry = CacheEntry(Path(root) / "step-results", key, dict(inputs or {}))
        self.key = key
        self.folder = self.entry.folder

    def lock(self) -> contextlib.AbstractContextManager[Any]:
        return self.entry.lock()

    def load(self, client_ids: list[int]) -> dict[int, dict[str, Any]] | None:
        """Every client's results; ``None`` when the entry is missing or lacks a client."""
        if not self.entry.exists:
            return None
        out = {}
        for client in client_ids:
            npz, meta = self.folder / f"client-{client}.npz", self.folder / f"client-{client}.json"
            if not (npz.is_file() and meta.is_file()):
                return None
            with np.load(npz, allow_pickle=False) as arrays:
                out[client] = _unflatten_result({k: arrays[k] for k in arrays.files}, json.loads(meta.read_text()))
        return out

    def save(self, results: Mapping[int, Any]) -> bool:
        """Write the results; ``False`` (nothing written) when a result holds values that cannot be stored."""
        flat = {}
        for client, result in results.items():
            arrays: dict[str, np.ndarray] = {}
            scalars: dict[str, Any] = {}
            if not _flatten_result(result, "", arrays, scalars) or not arrays and not scalars:
                return False
            flat[client] = (arrays, scalars)

        def write(staging: Path) -> None:
            for client, (arrays, scalars) in flat.items():
                # mypy matches **arrays against savez's allow_pickle: bool keyword (numpy stub), though no key is that
                np.savez(staging / f"client-{client}.npz", **arrays)  # type: ignore[arg-type]
                atomic_write_json(staging / f"client-{client}.json", scalars)

        self.entry.publish(write)
        return True
