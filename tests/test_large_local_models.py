"""A client with a large local model and ``run.model_cache`` keeps it on its own storage only, not in memory: the
methods read it from there (memory-mapped), so k hosted clients do not hold k models of several GB between methods.
Forced here on a small model (the size threshold patched to 1 byte): the same numbers as a run that keeps them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import rayfuse
import rayfuse.client as client_module
from rayfuse.client import ClientContext
from rayfuse.io import load_params


def _job(folder: Path) -> dict[str, Any]:
    return {
        "run": {"name": "large-local", "seed": 0, "storage": str(folder), "model_cache": str(folder / "cache")},
        "data": {"dataset": "digits"},
        "partition": {"method": "dirichlet", "num_clients": 3, "alpha": 0.5},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"epochs": 2, "batch_size": 64, "shared_init": True},
        "federation": {"backend": "local"},
        "methods": {"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}, "aligned": {}},
    }


def test_large_local_models_are_read_from_the_clients_storage_with_the_same_results(tmp_path, monkeypatch):
    kept = rayfuse.run(_job(tmp_path / "kept"), run_dir=tmp_path / "kept" / "run", quiet=True)
    read: list[int] = []
    real = ClientContext._read_local_model

    def counted(self: ClientContext) -> Any:
        read.append(self.client_id)
        return real(self)

    monkeypatch.setattr(client_module, "LARGE_MODEL_BYTES", 1)
    monkeypatch.setattr(ClientContext, "_read_local_model", counted)
    on_disk = rayfuse.run(_job(tmp_path / "disk"), run_dir=tmp_path / "disk" / "run", quiet=True)
    assert read  # aligned asked for the local models: each read back from the client's storage
    for label in ("average", "fedavg", "aligned"):
        a = load_params(tmp_path / "kept" / "run" / "models" / f"{label}.safetensors")
        b = load_params(tmp_path / "disk" / "run" / "models" / f"{label}.safetensors")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), label
    assert kept.metrics.to_dict() == on_disk.metrics.to_dict()
