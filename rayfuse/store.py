"""The run folder: where every file of a run lives, written atomically.

::

    <run>/config.yaml                 resolved config (every default filled in)
    <run>/identity.json               what the state was computed from: the config's SHA-256, the data files' SHA-256s
    <run>/partition.json              partition manifest: roles, indices, class counts per client, seed, hash
    <run>/results.json                final: status, per-method metrics, timings, events (written last)
    <run>/metrics.parquet             one row per method x round x metric (x client)
    <run>/comparison.png              methods compared
    <run>/models/<label>.safetensors  fused models
    <run>/checkpoints/local/client-<i>.safetensors   local models the methods fetched (--resume's fallback)
    <run>/checkpoints/<label>/latest.json + round-<r>.safetensors   multi-round state (SHA-256s, the previous round kept)
    <run>/checkpoints/local/client-<i>.json   the SHA-256 of client-<i>.safetensors
    <run>/state/<label>.json          a finished method's result (resume skips it; it records its model's SHA-256)
    <run>/.rayfuse-claim              the running process's claim on the folder (:func:`claim_run_folder`)

The coordinator writes checkpoints and models; on Ray it is placed on the driver's node so it shares this folder.

A model file above ``run.max_shard_size`` bytes is a shard folder at the same path (``rayfuse.io.save_params``:
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``); every reader here takes either, and a
folder's SHA-256 (``rayfuse.io.params_sha256``) covers its index and every shard.

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
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfuse.cas import CacheEntry, ContentCache, content_key, discard_entry
from rayfuse.data.identity import content_data, sha256_file
from rayfuse.errors import InputError
from rayfuse.io import (
    atomic_write_json,
    load_params,
    params_exist,
    params_sha256,
    read_checkpoint,
    read_params_metadata,
    remove_params,
    save_params,
)

if TYPE_CHECKING:
    pass

__all__ = [
    "RunStore",
    "RunClaim",
    "claim_run_folder",
    "Checkpointer",
    "Checkpoint",
    "sha256_file",
    "LocalModelStore",
    "StepResultCache",
    "local_model_key",
    "local_model_inputs",
    "step_result_key",
    "run_inputs",
    "KEY_VERSION",
    "note_data_files",
]


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
    ``latest.json`` records the SHA-256 of the newest round's file and the record of the round before it, whose file
    is kept beside the newest: :meth:`load` verifies the newest and falls back to the previous round when the newest
    is missing or damaged (``None``, a restart of the method, when neither is usable), and says so through ``warn``.
    """

    def __init__(self, folder: Path, keep: int = 2, max_shard_size: int | None = None) -> None:
        self.folder = folder
        self.keep = keep  # kept for callers that pass it: the newest round's file and the previous round's are kept
        self.max_shard_size = max_shard_size  # a round file above it is a shard folder (rayfuse.io.save_params)

    @property
    def pointer(self) -> Path:
        return self.folder / "latest.json"

    def save(
        self,
        round: int,
        params: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        arrays = {f"params/{k}": v for k, v in params.items()}
        arrays.update({f"state/{k}": np.asarray(v) for k, v in (state or {}).items()})
        file = self.folder / f"round-{round:05d}.safetensors"
        save_params(file, arrays, max_shard_size=self.max_shard_size)
        previous = self._previous_record(round)
        record = {"round": round, "file": file.name, "sha256": params_sha256(file), "meta": dict(meta or {}), "previous": previous}
        atomic_write_json(self.pointer, record)
        kept = {file.name, *([previous["file"]] if previous else [])}
        for old in self.folder.glob("round-*.safetensors"):
            if old.name not in kept:
                remove_params(old)
        return file

    def _previous_record(self, round: int) -> dict[str, Any] | None:
        """The record of the latest checkpointed round before ``round`` (``latest.json`` or its ``previous``)."""
        try:
            info = json.loads(self.pointer.read_text())
        except (OSError, ValueError, RecursionError):
            return None
        for record in (info, info.get("previous") if isinstance(info, dict) else None):
            if isinstance(record, dict) and isinstance(record.get("round"), int) and record["round"] < round:
                return {k: v for k, v in record.items() if k != "previous"}
        return None

    def load(self, warn: Callable[[str], Any] | None = None) -> Checkpoint | None:
        """The newest usable checkpoint: the newest round's, else the previous round's; ``None`` when there is none.

        A missing or damaged newest file (SHA-256 mismatch, unreadable) falls back to the previous round; a damaged
        ``latest.json`` or no usable round is ``None`` (the method restarts from its first round, with the same
        numbers). Each fallback is reported through ``warn`` (one line naming the file).
        """
        warn = warn or (lambda message: None)
        if not self.pointer.is_file():
            return None
        try:
            info = json.loads(self.pointer.read_text(encoding="utf-8"))
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError, RecursionError) as exc:
            warn(f"{self.pointer}: damaged ({_reason(exc)}); restarting the method from its first round")
            return None
        problems: list[str] = []
        for record in (info, info.get("previous")):
            if record is None:
                continue
            checkpoint, problem = self._read(record)
            if checkpoint is not None:
                if problems:
                    warn(f"{problems[0]}; continuing from round {checkpoint.round} (the previous checkpoint)")
                return checkpoint
            problems.append(problem)
        warn(f"{problems[0] if problems else self.pointer}; no usable checkpoint left, restarting the method from its first round")
        return None

    def _read(self, record: Any) -> tuple[Checkpoint | None, str]:
        """The checkpoint ``record`` names, verified; else ``None`` and what is wrong (naming the file)."""
        if not isinstance(record, dict) or not isinstance(record.get("round"), int) or not isinstance(record.get("file"), str):
            return None, f"{self.pointer}: damaged (a round record without round / file)"
        file = self.folder / Path(record["file"]).name
        if not params_exist(file):
            return None, f"{file}: missing"
        expected = record.get("sha256")
        if expected is not None and params_sha256(file) != expected:  # records written before checksums carry none
            return None, f"{file}: damaged (SHA-256 differs from the one recorded in latest.json)"
        try:
            arrays = load_params(file)
        except InputError as exc:
            return None, f"{file}: damaged ({exc.got})"
        params = {k[len("params/") :]: v for k, v in arrays.items() if k.startswith("params/")}
        state = {k[len("state/") :]: v for k, v in arrays.items() if k.startswith("state/")}
        return Checkpoint(int(record["round"]), params, state, dict(record.get("meta") or {})), ""


def _reason(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


CLAIM_FILE = ".rayfuse-claim"


class RunClaim:
    """The claim of one run folder by this process: an exclusive ``flock`` on ``<run>/.rayfuse-claim``, held until
    :meth:`release` (or the process's end: the kernel drops the lock of a dead process, so a claim left by a killed
    run never blocks the next one; the file stays, with the last claimant's pid, host and time)."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.folder = folder
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_run_folder(folder: str | Path, *, resume: bool = False) -> RunClaim:
    """Claim ``folder`` (created if need be) for one run of this process; :class:`InputError` when another live
    process holds it, or, for a new run (``resume`` false), when another run has written its config there already.

    The claim is an exclusive, non-blocking ``flock`` on ``<folder>/.rayfuse-claim``: two ``rayfuse run --out`` of one
    folder, or two ``--resume`` of it, cannot both run. It holds between the processes of one machine, and between
    machines on a file system with working locks (NFS v4, Lustre, GPFS...).
    """
    import fcntl
    import socket
    import time

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / CLAIM_FILE
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = ""
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            holder = f" by process {info.get('pid')} on {info.get('host')} since {info.get('since')}"
        except (OSError, ValueError, RecursionError, AttributeError):
            pass
        os.close(fd)
        raise InputError(
            str(folder),
            "a run folder no other rayfuse run is using",
            f"claimed{holder}",
            "wait for that run to end, or pick another folder",
        ) from None
    claim = RunClaim(folder, fd)
    if not resume and (folder / "config.yaml").exists():
        claim.release()
        raise InputError(
            str(folder), "a new or empty folder", "another run has started in it", "pick another folder, or continue that run with --resume"
        )
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
    return claim


class RunStore:
    """Paths of one run folder and the writes into it."""

    def __init__(self, root: str | Path, max_shard_size: int | None = None) -> None:
        self.root = Path(root)
        self.max_shard_size = max_shard_size  # ``run.max_shard_size``: model files above it are shard folders

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
        return Checkpointer(self.root / "checkpoints" / label, max_shard_size=self.max_shard_size)

    def method_state_file(self, label: str) -> Path:
        return self.root / "state" / f"{label}.json"

    def save_method_state(self, label: str, summary: Mapping[str, Any]) -> None:
        atomic_write_json(self.method_state_file(label), summary)

    def load_method_state(self, label: str, warn: Callable[[str], Any] | None = None) -> dict[str, Any] | None:
        """A finished method's summary; ``None`` when there is none, or when it is damaged (unreadable JSON, or the
        model file it names is missing or differs from its recorded SHA-256): then ``warn`` says so and the method is
        run again."""
        file = self.method_state_file(label)
        if not file.is_file():
            return None
        try:
            summary = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(summary, dict) or not isinstance(summary.get("metrics"), dict):
                raise ValueError("not a method summary")
        except (OSError, ValueError, RecursionError) as exc:
            if warn is not None:
                warn(f"{file}: damaged ({_reason(exc)}); running {label} again")
            return None
        model, expected = summary.get("model_file"), summary.get("model_sha256")
        if model and expected:
            path = self.root / model
            problem = (
                "missing"
                if not params_exist(path)
                else "damaged (SHA-256 differs from the recorded one)"
                if params_sha256(path) != expected
                else ""
            )
            if problem:
                if warn is not None:
                    warn(f"{path}: {problem}; running {label} again")
                return None
        return summary

    def save_local_models(self, updates: Mapping[int, Any]) -> None:
        _save_local_models(self.root / "checkpoints" / "local", updates, self.max_shard_size)

    def load_local_models(
        self,
        client_ids: list[int],
        warn: Callable[[str], Any] | None = None,
    ) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]]:
        """The checkpointed local models of those of ``client_ids`` the run folder holds: client -> (params, stats).
        A damaged file (unreadable, or its bytes differ from the SHA-256 recorded beside it) is left out, so that
        client trains its (deterministic) model again; ``warn`` says so."""
        return _load_local_models(self.root / "checkpoints" / "local", client_ids, warn)


def _save_local_models(folder: Path, updates: Mapping[int, Any], max_shard_size: int | None = None) -> None:
    for client, update in updates.items():
        meta = {"num_examples": update.num_examples, **{k: repr(float(v)) for k, v in update.metrics.items()}}
        file = save_params(folder / f"client-{client}.safetensors", update.params, meta, max_shard_size=max_shard_size)
        atomic_write_json(file.with_suffix(".json"), {"sha256": params_sha256(file)})  # after the file: the commit point


def _load_local_models(
    folder: Path,
    client_ids: list[int],
    warn: Callable[[str], Any] | None = None,
) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]]:
    files = {c: folder / f"client-{c}.safetensors" for c in client_ids}
    out = {}
    for client, file in files.items():
        if not params_exist(file):
            continue
        try:
            record = file.with_suffix(".json")
            if record.is_file() and json.loads(record.read_text(encoding="utf-8")).get("sha256") != params_sha256(file):
                raise ValueError("SHA-256 differs from the recorded one")
            meta = read_params_metadata(file)
            stats = {k: float(v) for k, v in meta.items() if k != "num_examples"}
            out[client] = (load_params(file), stats)
        except Exception as exc:  # safetensors raises its own error types (and OSError, ValueError) for a damaged file
            if warn is not None:
                warn(
                    f"{file}: damaged ({_reason(exc) if not isinstance(exc, InputError) else exc.got}); client {client} "
                    "trains its local model again"
                )
    return out


#: The version of the cache keys' projection (:func:`local_model_inputs`, :func:`run_inputs`): raise it when what a key
#: covers changes (a field added to the lists below, a new kind of input), so no entry keyed the old way is read as one
#: keyed the new way. 4: the explicit projection below (1-3 hashed the sections' whole YAML dumps; 3: data files by
#: their content, rayfuse.data.identity).
KEY_VERSION = 4
LOCAL_TRAINING_STEPS = ("train_local", "get_local_params")

# What of each config section a client's trained model depends on, named one by one: a key is computed from these
# fields only, so a field added to a section later (with a default that keeps today's training) leaves every key as it
# was; a field that does change training is added here, with KEY_VERSION raised.
#: ``data`` of a simulation: which dataset (a file by its content), how it is read, and how it is split and scaled
#: (the split is also keyed by the client's own indices; the settings are kept so indices into another pool differ)
DATA_KEY_FIELDS = (
    "dataset",
    "root",
    "path",
    "label",
    "features",
    "options",
    "test_size",
    "val_size",
    "public_size",
    "standardize",
    "layout",
)
#: ``data`` of a silo config (``data.silos``): the silos' reading settings (their files are keyed by the survey's
#: content hash of the client's silo), the declared label values, the held-out split and the scaling
SILO_DATA_KEY_FIELDS = ("silos", "classes", "val_size", "standardize")
#: ``data.silos.<i>``: how a silo is read (``path`` and ``test_path`` stand for files keyed by their content)
SILO_KEY_FIELDS = ("dataset", "label", "features", "image_size", "grayscale", "options", "labels", "val_size")
#: the server's sets, for a step's results over the whole run (:func:`run_inputs`): ``data.target`` (simulation),
#: ``data.test`` / ``data.public`` (silos), each with its file by content
TARGET_KEY_FIELDS = ("dataset", "root", "path", "label", "features", "options", "test_size", "resize", "pad")
SERVER_SET_KEY_FIELDS = ("dataset", "path", "label", "features", "image_size", "grayscale", "options", "labels")
#: text data (``data.text`` or a silo's / server set's ``text``, ``data.tokenizer`` by its files, ``data.max_length``):
#: keyed only where the data are texts, so the keys of other data stay as they were (:func:`_text_encoding`)
TEXT_KEY_FIELDS = ("text", "tokenizer", "max_length")
#: ``model`` (the client's own: ``federation.client_overrides.<i>.model`` or ``model``)
MODEL_KEY_FIELDS = ("name", "hidden", "channels", "heads", "depth", "patch_size", "dropout", "activation", "factory")
#: ``train``: every setting of local training
TRAIN_KEY_FIELDS = ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "shared_init", "dp")
#: ``train.dp``: local DP-SGD
DP_KEY_FIELDS = ("noise_multiplier", "target_epsilon", "max_grad_norm", "delta", "accountant")
#: ``partition`` (a step's results over the whole run; a local model is keyed by its client's indices instead)
PARTITION_KEY_FIELDS = (
    "method",
    "num_clients",
    "alpha",
    "balance",
    "min_size",
    "groups",
    "classes_per_client",
    "shards_per_client",
    "shard_size",
    "subset_fraction",
    "corrupt",
)
#: ``federation.faults.<i>``: a fault injected into local training changes the local model
FAULT_KEY_FIELDS = ("client", "step", "call", "mode", "seconds")


def _fields(section: Any, names: Iterable[str]) -> dict[str, Any] | None:
    """``section`` (plain data) projected on ``names``; a name the section lacks is left out (a silo config's data holds
    no simulation keys); ``None`` stays ``None``."""
    if section is None:
        return None
    return {name: section[name] for name in names if name in section}


def _data_inputs(data: Mapping[str, Any], *, local: bool) -> dict[str, Any]:
    """The data section as a key covers it: :data:`DATA_KEY_FIELDS` (or the silo fields), each file by its content
    (:func:`rayfuse.data.identity.content_data`); ``local``: without the server's sets, which local training never reads."""
    data = content_data(data, local=local)
    if data.get("silos"):
        out = _fields(data, SILO_DATA_KEY_FIELDS) or {}
        out["silos"] = [_with_text(_fields(silo, SILO_KEY_FIELDS), silo) for silo in data["silos"]]
        if not local:
            out.update({key: _with_text(_fields(data.get(key), SERVER_SET_KEY_FIELDS), data.get(key)) for key in ("test", "public")})
        return {**out, **_text_encoding(data)}
    out = _fields(data, DATA_KEY_FIELDS) or {}
    if not local:
        out["target"] = _fields(data.get("target"), TARGET_KEY_FIELDS)
    return {**out, **({"text": data["text"]} if data.get("text") is not None else {}), **_text_encoding(data)}


def _with_text(fields: dict[str, Any] | None, section: Any) -> dict[str, Any] | None:
    """``fields`` with the section's text column where it names one (other data keep the keys they had)."""
    if fields is None or not isinstance(section, Mapping) or section.get("text") is None:
        return fields
    return {**fields, "text": section["text"]}


def _text_encoding(data: Mapping[str, Any]) -> dict[str, Any]:
    """Text data's tokenisation: the tokenizer by its files' content (a folder changed in place gets another key, a
    copy the same) and ``max_length``; nothing for other data (their keys stay as they were)."""
    if data.get("tokenizer") is None:
        return {}
    from rayfuse.data.text import tokenizer_fingerprint

    return {"tokenizer": {"files": tokenizer_fingerprint(data["tokenizer"])}, "max_length": data.get("max_length")}


def _train_inputs(train: Mapping[str, Any]) -> dict[str, Any]:
    out = _fields(train, TRAIN_KEY_FIELDS) or {}
    out["dp"] = _fields(train.get("dp"), DP_KEY_FIELDS)
    return out


def _local_faults(faults: Iterable[Mapping[str, Any]], client: int | None = None) -> list[dict[str, Any] | None]:
    """The faults injected into local training (of ``client``, or of any client): faults of later steps leave the local
    models alone."""
    return [_fields(f, FAULT_KEY_FIELDS) for f in faults if f["step"] in LOCAL_TRAINING_STEPS and (client is None or f["client"] == client)]


def run_inputs(config: Mapping[str, Any], partition_hash: str) -> dict[str, Any]:
    """What every client's local training in a run depends on (the base of :func:`step_result_key`): the data and its
    split (the data fields, its files by content, the server's sets, ``partition``, the partition hash), the model, the
    training settings, the seed and the faults injected into local training; nothing under ``methods``."""
    return {
        "version": KEY_VERSION,
        "data": _data_inputs(config["data"], local=False),
        "partition": _fields(config["partition"], PARTITION_KEY_FIELDS),
        "partition_hash": partition_hash,
        "model": _fields(config["model"], MODEL_KEY_FIELDS),
        "train": _train_inputs(config["train"]),
        "seed": config["run"]["seed"],
        "faults": _local_faults(config["federation"]["faults"]),
    }


def _hash_arrays(*arrays: Any) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def local_model_inputs(config: Mapping[str, Any], plan: Any) -> dict[str, Any]:
    """Everything one client's trained local model depends on, and nothing else (the projection
    :func:`local_model_key` hashes, written beside the model as ``key.json``).

    ``config`` holds the sections ``data``, ``model`` (the client's own), ``train``, ``run.seed`` and
    ``federation.faults`` as plain data (a resolved config, :func:`rayfuse.method.resolved_config`, or a client's own
    sections dumped the same way); ``plan`` is the client's :class:`~rayfuse.data.ClientPlan` (or silo plan). Covered:
    the dataset (:data:`DATA_KEY_FIELDS`, a data file by its content, :func:`rayfuse.data.identity.content_data`: a file
    regenerated in place gets another key, a renamed or touched one the same), the client, its train indices (a silo
    client: its silo's content hash), normalisation and corruption, the model (:data:`MODEL_KEY_FIELDS`), the training
    settings (:data:`TRAIN_KEY_FIELDS`), the seed and the faults injected into this client's local training. Nothing
    under ``methods``, ``run.name`` or ``run.storage``, so every fusion-only variation of a job (the trials of a Tune
    sweep) shares it; no field a section gains later unless it is added here (with :data:`KEY_VERSION` raised).
    """
    norm = plan.normalization
    return {
        "version": KEY_VERSION,
        "data": _data_inputs(config["data"], local=True),
        "model": _fields(config["model"], MODEL_KEY_FIELDS),
        "train": _train_inputs(config["train"]),
        "seed": config["run"]["seed"],
        "client": int(plan.client_id),
        # a silo client (data.silos) is keyed by its data's content hash: it has no indices
        **(
            {"silo": plan.content_hash}
            if hasattr(plan, "content_hash")
            else {"train_indices": _hash_arrays(np.asarray(plan.train, dtype=np.int64))}
        ),
        "normalization": None if norm is None else _hash_arrays(norm.mean, norm.std),
        "corruption": plan.corruption,
        "corruption_seed": int(plan.corruption_seed),
        "faults": _local_faults(config["federation"]["faults"], plan.client_id),
    }


def local_model_key(config: Mapping[str, Any], plan: Any) -> tuple[str, dict[str, Any]]:
    """The content key of one client's trained local model, and what it is computed from (:func:`local_model_inputs`).

    The one key of a local model: the client names its own copy with it (:meth:`rayfuse.client.ClientContext.
    local_model`), the coordinator computes the same key from the run's config and the client's plan (the lock of a
    run's local training, the events).
    """
    inputs = local_model_inputs(config, plan)
    return content_key(inputs), inputs


class LocalModelStore:
    """Trained local models, each kept by its own client under its content key (:func:`local_model_key`).

    ``<run.model_cache>/local-models/<key>/``: ``params.safetensors``, ``sha256.json`` (its SHA-256), ``stats.json``
    (the training statistics) and ``key.json`` (what the key was computed from), published once, complete
    (:class:`rayfuse.cas.ContentCache`). An entry that no longer reads back intact is discarded (the client trains again).
    Written and read by the client's own process; the coordinator only takes :meth:`lock_run` while a run's clients
    train, so concurrent Tune trials sharing the keys train once and the others read.
    """

    def __init__(self, root: str | Path, max_shard_size: int | None = None) -> None:
        self.cache = ContentCache(Path(root) / "local-models")
        self.max_shard_size = max_shard_size  # a model above it is kept as a shard folder (rayfuse.io.save_params)

    @property
    def root(self) -> Path:
        return self.cache.root

    def entry(self, key: str, inputs: Mapping[str, Any] | None = None) -> CacheEntry:
        return CacheEntry(self.cache.root, key, dict(inputs or {}))

    def load(self, key: str, *, mapped: bool = False) -> tuple[dict[str, np.ndarray], dict[str, float]] | None:
        """The kept parameters and training statistics of ``key``; ``None`` when nothing is kept. ``mapped``: the
        parameters as read-only arrays over a memory map of the file (no copy in the process's own memory: a model of
        several GB is read as it is used, its pages the page cache's)."""
        entry = self.entry(key)
        if not entry.exists:
            return None
        try:
            record = entry.folder / "sha256.json"
            if record.is_file() and json.loads(record.read_text()).get("sha256") != params_sha256(entry.folder / "params.safetensors"):
                raise ValueError("SHA-256 differs from the recorded one")
            stats = json.loads((entry.folder / "stats.json").read_text())
            file = entry.folder / "params.safetensors"
            params = read_checkpoint(file, mapped=True)[0] if mapped else load_params(file)
            return params, {k: float(v) for k, v in stats.items()}
        except (InputError, OSError, ValueError, RecursionError, TypeError, AttributeError):
            discard_entry(entry.folder)  # damaged: the client trains the (deterministic) model again and republishes
            return None

    def save(self, key: str, inputs: Mapping[str, Any], params: Mapping[str, np.ndarray], stats: Mapping[str, float]) -> bool:
        """Keep ``params`` and ``stats`` under ``key``; ``False`` when the entry existed already (it stands)."""

        def write(staging: Path) -> None:
            file = save_params(staging / "params.safetensors", params, max_shard_size=self.max_shard_size)
            atomic_write_json(staging / "sha256.json", {"sha256": params_sha256(file)})
            atomic_write_json(staging / "stats.json", {k: float(v) for k, v in stats.items()})

        return self.entry(key, inputs).publish(write)

    def lock(self, key: str) -> contextlib.AbstractContextManager[Any]:
        """The lock of one client's entry (held by the client while it trains or reads)."""
        return self.entry(key).lock()

    def lock_run(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[Any]:
        """One lock over a run's entries (held by the coordinator while the run's clients train or read theirs)."""
        return self.cache.lock("run-" + content_key({"clients": sorted(keys)}))


def note_data_files(root: str | Path, files: Mapping[str, Mapping[str, str]]) -> list[tuple[str, str, str, str]]:
    """Record in the model cache ``root`` the content of each data file a run uses (``files``:
    :func:`rayfuse.data.identity.data_files`, plus silos by their survey hash), and return those whose content differs
    from what an earlier run sharing the cache recorded for the same file: ``(key, path, before, now)`` each.

    The cache's entries are keyed by content, so an entry computed from a file's old content is never read for its new
    content; this record is how a run can *say* so (one warning line per file) instead of silently training again.
    ``<root>/data-files/<key>.json`` per file (named by its key path and path), written atomically; the last run wins.
    """
    from rayfuse.data.identity import changed_files

    folder = Path(root) / "data-files"
    changed = []
    for key, now in files.items():
        record = folder / f"{content_key({'key': key, 'path': now['path']})}.json"
        try:
            before = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            before = None  # first use of this file with this cache (or a damaged record: rewritten below)
        if isinstance(before, dict):
            changed += changed_files({key: before}, {key: now})
        if before != dict(now):
            with contextlib.suppress(OSError):  # a read-only cache: nothing to record, nothing lost but the warning next time
                atomic_write_json(record, dict(now))
    return changed


# -- cached client-step results ------------------------------------------------------------------------------------


def _flatten_result(value: Any, prefix: str, arrays: dict[str, np.ndarray], scalars: dict[str, Any]) -> bool:
    """Split a client step's result (nested dicts of arrays and plain values) into arrays and JSON values."""
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and "/" not in k and _flatten_result(v, f"{prefix}{k}/", arrays, scalars) for k, v in value.items())
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
    """The cache key of one client step's results for a whole run: what the run's local training depends on
    (:func:`run_inputs`: data, partition and its hash, model, training settings, seed, local-training faults) plus the
    step and its arguments."""
    # a fault in the step changes its results
    step_faults = [_fields(f, FAULT_KEY_FIELDS) for f in config["federation"]["faults"] if f["step"] == step]
    inputs = {**run_inputs(config, partition_hash), "step": step, "args": args, "kwargs": kwargs, "step_faults": step_faults}
    return content_key(inputs), inputs


class StepResultCache:
    """Results of one deterministic client step (e.g. a local posterior fit) for all clients, shared by runs.

    One entry of a :class:`rayfuse.cas.ContentCache` under ``<run.model_cache>/step-results/`` (written once,
    complete, renamed into place; a ``filelock`` per key): ``<key>/client-<i>.npz`` (arrays, ``allow_pickle=False``),
    ``client-<i>.json`` (plain values) and ``key.json``. Methods whose clients summarise their data in their own step
    (KL-fusion's local posteriors) use it through :meth:`rayfuse.coordinator.MethodUpdates.run_cached`, so a Tune sweep
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
