"""Files: atomic writes and parameter files.

Every file rayfuse writes goes through :func:`atomic_write_bytes`: the bytes are written to a temporary file in the
same folder, flushed and fsynced, then renamed over the target. A crash therefore leaves either the old file or the
new one, never half of one. Parameter files are ``safetensors``; reading also accepts PyTorch files through
``torch.load(weights_only=True)``. Nothing here unpickles untrusted data.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "check_writable_folder",
    "save_params",
    "load_params",
    "to_jsonable",
]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def check_writable_folder(path: str | os.PathLike, *, key: str) -> Path:
    """Check, before anything starts, that rayfuse can create or write into the folder ``path``: its nearest existing
    ancestor (``path`` itself when it exists) is a folder this process can create entries in. Returns ``path``.

    The check asks the operating system (``os.access``) and then creates and removes an empty folder there, which
    also catches read-only mounts and file systems that refuse writes ``os.access`` allows (root on ``/sys``, for
    instance); nothing is left behind. Raises :class:`InputError` at ``key`` (``--out``, ``run.storage``...).
    """
    target = Path(path)
    existing = Path(os.path.abspath(target))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(key, "a folder rayfuse can create or write to", str(target),
                         f"{existing} is a file, not a folder" if existing != Path(os.path.abspath(target)) else "it is a file, not a folder")
    problem = None
    if not os.access(existing, os.W_OK | os.X_OK):
        problem = "no permission to write"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".rayfuse-write-check-", dir=existing))
        except OSError as exc:
            problem = exc.strerror or type(exc).__name__
    if problem:
        where = "" if existing == Path(os.path.abspath(target)) else f" in {existing}"
        raise InputError(key, "a folder rayfuse can create or write to", str(target), f"{problem.lower()}{where}")
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_jsonable(value: Any) -> Any:
    """Convert numpy scalars / arrays, paths and tuples so ``json.dumps`` accepts them; NaN becomes ``None``."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return to_jsonable(value.item())
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n")


def save_params(path: str | os.PathLike, params: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> Path:
    """Save a parameter dict as ``safetensors``, atomically."""
    from safetensors.numpy import save

    arrays = {name: np.asarray(value, order="C") for name, value in params.items()}  # keeps 0-d arrays 0-d
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    return atomic_write_bytes(path, save(arrays, metadata=meta))


def load_params(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a parameter dict from ``.safetensors`` or a PyTorch file (``torch.load(weights_only=True)``)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(str(path), "an existing model file (.safetensors, .pt, .pth, .bin)", "no such file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise InputError(str(path), "a valid safetensors file", f"unreadable ({exc})") from None
    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for bad files; all mean "not a weights file"
        raise InputError(str(path), "a PyTorch state_dict loadable with weights_only=True", f"unreadable ({type(exc).__name__})") from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(str(path), "a mapping of tensor names to tensors", type(obj).__name__)
    return {str(k): v.detach().cpu().numpy() for k, v in obj.items()}
