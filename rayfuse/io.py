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
    "read_checkpoint",
    "save_params_cast",
    "to_jsonable",
    "check_file_fits_in_memory",
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
        raise InputError(
            key,
            "a folder rayfuse can create or write to",
            str(target),
            f"{existing} is a file, not a folder" if existing != Path(os.path.abspath(target)) else "it is a file, not a folder",
        )
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
        except Exception as exc:  # noqa: BLE001 - anything else the reader raises on a damaged file (a dtype numpy lacks...)
            raise InputError(str(path), "a valid safetensors file of numpy dtypes", f"unreadable ({type(exc).__name__}: {exc})") from None
    return {str(k): v.detach().cpu().numpy() for k, v in _torch_state_dict(path).items()}


def _torch_state_dict(path: Path) -> Mapping[str, Any]:
    """The tensors of a PyTorch weights file (``torch.load(weights_only=True)``; a ``{"state_dict": ...}`` wrapper
    unwrapped). :class:`InputError` naming ``path`` for a file that is not one."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch warns while it validates a sparse tensor: refused by the caller in one line
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for bad files; all mean "not a weights file"
        raise InputError(str(path), "a PyTorch state_dict loadable with weights_only=True", f"unreadable ({type(exc).__name__})") from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(str(path), "a mapping of tensor names to tensors", type(obj).__name__)
    return obj


# Float dtypes numpy has no type for: such tensors are read as float32 and written back through torch.
TORCH_ONLY_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A checkpoint trained elsewhere (``rayfuse fuse``): its tensors as numpy arrays and each tensor's stored dtype.

    ``.safetensors`` files and PyTorch files (``torch.load(weights_only=True)``) are read as :func:`load_params` does;
    tensors of a float dtype numpy cannot hold (``bfloat16``, the ``float8`` types) come back as float32 arrays, their
    stored dtype recorded, so they can be fused and written back in it (:func:`save_params_cast`). A sparse, quantized
    or complex tensor is an :class:`InputError` naming the file and the tensor.
    """
    path = Path(path)
    if path.is_file():
        check_file_fits_in_memory(path)
    if path.suffix == ".safetensors" and path.is_file():
        from safetensors.numpy import load_file as load_numpy

        try:
            params = dict(load_numpy(str(path)))
        except TypeError:  # a dtype numpy has no type for (bfloat16...): read through torch
            from safetensors.torch import load_file as load_torch

            try:
                tensors = load_torch(str(path))
            except Exception as exc:  # noqa: BLE001 - a damaged file: one line, whatever the reader raises
                raise InputError(str(path), "a valid safetensors file", f"unreadable ({type(exc).__name__}: {exc})") from None
            return _from_torch(path, tensors)
        except Exception:  # noqa: BLE001 - load_params names the problem in one line
            return load_params(path), {}
        _check_real(path, params)
        return params, {k: str(v.dtype) for k, v in params.items()}
    if path.suffix == ".safetensors" or not path.is_file():
        return load_params(path), {}  # raises the missing / unreadable file error
    return _from_torch(path, _torch_state_dict(path))


# A checkpoint is held in memory as it is read, then as float32 arrays (a float16 / bfloat16 file doubles), with the
# fused result beside them: its file must fit this many times in the memory available.
CHECKPOINT_MEMORY_FACTOR = 3


def check_file_fits_in_memory(path: Path) -> None:
    """Refuse, before it is read, a checkpoint file that would not fit :data:`CHECKPOINT_MEMORY_FACTOR` times in the
    memory available now (its tensors are loaded whole): one line naming the file, as the model-size check does for
    a configured model."""
    from rayfuse.models.registry import available_memory

    size = path.stat().st_size
    memory = available_memory()
    if memory is not None and size * CHECKPOINT_MEMORY_FACTOR > memory:
        raise InputError(
            str(path),
            f"a checkpoint that fits in memory: at most {memory // CHECKPOINT_MEMORY_FACTOR / 2**30:.2f} GiB "
            f"({CHECKPOINT_MEMORY_FACTOR} copies in the {memory / 2**30:.2f} GiB available)",
            f"{size / 2**30:.2f} GiB",
        )


def _from_torch(path: Path, tensors: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    import torch

    params: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, tensor in tensors.items():
        where = f"{path}: {name}"
        if tensor.layout != torch.strided:
            raise InputError(
                where, "a dense tensor", f"a sparse tensor ({str(tensor.layout).replace('torch.', '')})", "save it with .to_dense()"
            )
        if tensor.is_quantized:
            raise InputError(
                where,
                "a float or integer tensor",
                f"a quantized tensor ({str(tensor.dtype).replace('torch.', '')})",
                "dequantize it before saving",
            )
        dtype = str(tensor.dtype).replace("torch.", "")
        value = tensor.detach().cpu()
        if dtype in TORCH_ONLY_FLOATS:
            value = value.to(torch.float32)
        try:
            params[str(name)] = value.numpy()
        except (TypeError, RuntimeError):
            raise InputError(where, "a float or integer tensor", dtype) from None
        dtypes[str(name)] = dtype
    _check_real(path, params)
    return params, dtypes


def _check_real(path: Path, params: Mapping[str, np.ndarray]) -> None:
    for name, value in params.items():
        if value.dtype.kind not in "fiub":
            raise InputError(f"{path}: {name}", "a float, integer or boolean tensor", str(value.dtype))


def save_params_cast(
    path: str | os.PathLike, params: Mapping[str, np.ndarray], dtype: str, metadata: Mapping[str, str] | None = None
) -> Path:
    """:func:`save_params` with every float tensor stored as ``dtype`` (``float16``, ``float32``, ``float64``, or a
    dtype only torch has, such as ``bfloat16``); integer tensors are written as they are."""
    if dtype not in TORCH_ONLY_FLOATS:
        return save_params(path, {k: v.astype(dtype) if v.dtype.kind == "f" else v for k, v in params.items()}, metadata)
    import torch
    from safetensors.torch import save

    target = getattr(torch, dtype)
    tensors = {
        k: (
            torch.from_numpy(np.array(v, dtype=np.float32, order="C")).to(target)
            if v.dtype.kind == "f"
            else torch.from_numpy(np.array(v, order="C"))
        )
        for k, v in params.items()
    }
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    return atomic_write_bytes(path, save(tensors, metadata=meta))
