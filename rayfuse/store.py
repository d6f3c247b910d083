"""The run folder: where every file of a run lives, written atomically.

::

    <run>/config.yaml                 resolved config (every default filled in)
    <run>/partition.json              partition manifest: roles, indices, class counts per client, seed, hash
    <run>/results.json                final: status, per-method metrics, timings, events (written last)
    <run>/metrics.parquet             one row per method x round x metric (x client)
    <run>/comparison.png              methods compared
    <run>/models/<label>.safetensors  fused models
    <run>/checkpoints/local/client-<i>.safetensors   trained local models (resume without retraining)
    <run>/checkpoints/<label>/latest.json + round-<r>.safetensors   multi-round state
    <run>/state/<label>.json          a finished method's result (resume skips it)

The coordinator writes checkpoints and models; on Ray it is placed on the driver's node so it shares this folder.

:class:`LocalModelCache` is a content-addressed cache of trained local models shared by runs (``run.model_cache``):
``<cache>/local-models/<key>/client-<i>.safetensors`` plus ``key.json`` (what the key was computed from). The key
is a hash of everything local training depends on, so a Tune sweep over fusion-only knobs trains the clients once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.io import atomic_write_json, load_params, save_params

__all__ = ["RunStore", "Checkpointer", "Checkpoint", "LocalModelCache", "local_model_key"]


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

    def load_local_models(self, client_ids: list[int]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]] | None:
        """All clients' checkpointed local models, or ``None`` if any is missing."""
        return _load_local_models(self.root / "checkpoints" / "local", client_ids)


def _save_local_models(folder: Path, updates: Mapping[int, Any]) -> None:
    for client, update in updates.items():
        meta = {"num_examples": update.num_examples, **{k: repr(float(v)) for k, v in update.metrics.items()}}
        save_params(folder / f"client-{client}.safetensors", update.params, meta)


def _load_local_models(folder: Path, client_ids: list[int]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]] | None:
    files = {c: folder / f"client-{c}.safetensors" for c in client_ids}
    if not all(f.is_file() for f in files.values()):
        return None
    from safetensors import safe_open

    out = {}
    for client, file in files.items():
        with safe_open(str(file), framework="numpy") as handle:
            meta = handle.metadata() or {}
        stats = {k: float(v) for k, v in meta.items() if k != "num_examples"}
        out[client] = (load_params(file), stats)
    return out


CACHE_FORMAT = 1
LOCAL_TRAINING_STEPS = ("train_local", "get_local_params")


def local_model_key(config: Mapping[str, Any], partition_hash: str) -> tuple[str, dict[str, Any]]:
    """The cache key of a run's local models and what it is computed from.

    ``config`` is the resolved config (:meth:`ExperimentConfig.resolved`). Local training depends on the data and its
    split (``data``, ``partition``, the partition hash, which also covers the dataset's indices), the model, the
    training settings, the seed and faults injected into local training; nothing under ``methods`` enters, so every
    fusion-only variation of a job shares one key.
    """
    inputs = {
        "format": CACHE_FORMAT,
        "data": config["data"], "partition": config["partition"], "partition_hash": partition_hash,
        "model": config["model"], "train": config["train"], "seed": config["run"]["seed"],
        # faults injected into local training change the local models; faults of later steps do not
        "faults": [f for f in config["federation"]["faults"] if f["step"] in LOCAL_TRAINING_STEPS],
    }
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24], inputs


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created with its folder): runs sharing a cache entry compute it once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class LocalModelCache:
    """One entry of the content-addressed local-model cache under ``root`` (``run.model_cache``).

    An entry is written once, complete (every client), into a temporary folder renamed into place: a reader sees
    all of it or nothing. :meth:`lock` serialises the runs that share a key, so concurrent Tune trials train once
    and the others wait and read (an ``flock``: the cache folder must be on a file system every trial's node shares).
    """

    def __init__(self, root: str | Path, key: str, inputs: Mapping[str, Any] | None = None) -> None:
        self.root = Path(root) / "local-models"
        self.key = key
        self.inputs = dict(inputs or {})
        self.folder = self.root / key

    def lock(self) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.root / f"{self.key}.lock")

    def load(self, client_ids: list[int]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]] | None:
        return _load_local_models(self.folder, client_ids) if self.folder.is_dir() else None

    def save(self, updates: Mapping[int, Any]) -> None:
        self._publish(lambda staging: _save_local_models(staging, updates))

    def _publish(self, write: Any) -> None:
        """``write(staging)`` into a temporary folder, then rename it into place (once: an existing entry wins)."""
        if self.folder.is_dir():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.key}-", dir=self.root))
        try:
            write(staging)
            atomic_write_json(staging / "key.json", self.inputs)
            os.replace(staging, self.folder)
        except OSError:
            if not self.folder.is_dir():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)


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
    """The cache key of one client step's results: the local-model key's inputs plus the step and its arguments."""
    _, inputs = local_model_key(config, partition_hash)
    step_faults = [f for f in config["federation"]["faults"] if f["step"] == step]  # a fault in the step changes its results
    inputs = {**inputs, "step": step, "args": args, "kwargs": kwargs, "step_faults": step_faults}
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24], inputs


class StepResultCache(LocalModelCache):
    """Results of one deterministic client step (e.g. a local posterior fit) for all clients, shared by runs.

    Same layout rules as :class:`LocalModelCache` (written once, complete, renamed into place; ``flock`` per key),
    under ``<run.model_cache>/step-results/<key>/``: ``client-<i>.npz`` (arrays, ``allow_pickle=False``) and
    ``client-<i>.json`` (plain values). Methods whose clients summarise their data in their own step (KL-fusion's
    local posteriors) use it through :meth:`rayfuse.coordinator.ServerContext.run_cached`, so a Tune sweep over
    fusion-only knobs computes the summaries once.
    """

    def __init__(self, root: str | Path, key: str, inputs: Mapping[str, Any] | None = None) -> None:
        super().__init__(root, key, inputs)
        self.root = Path(root) / "step-results"
        self.folder = self.root / key

    def load(self, client_ids: list[int]) -> dict[int, dict[str, Any]] | None:  # type: ignore[override]
        if not self.folder.is_dir():
            return None
        out = {}
        for client in client_ids:
            npz, meta = self.folder / f"client-{client}.npz", self.folder / f"client-{client}.json"
            if not (npz.is_file() and meta.is_file()):
                return None
            with np.load(npz, allow_pickle=False) as arrays:
                out[client] = _unflatten_result({k: arrays[k] for k in arrays.files}, json.loads(meta.read_text()))
        return out

    def save(self, results: Mapping[int, Any]) -> bool:  # type: ignore[override]
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

        self._publish(write)
        return True
