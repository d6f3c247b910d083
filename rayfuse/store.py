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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from rayfuse.io import atomic_write_json, load_params, save_params

__all__ = ["RunStore", "Checkpointer", "Checkpoint"]


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
        for client, update in updates.items():
            meta = {"num_examples": update.num_examples, **{k: repr(float(v)) for k, v in update.metrics.items()}}
            save_params(self.local_model_file(client), update.params, meta)

    def load_local_models(self, client_ids: list[int]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, float]]] | None:
        """All clients' checkpointed local models, or ``None`` if any is missing."""
        files = {c: self.local_model_file(c) for c in client_ids}
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
