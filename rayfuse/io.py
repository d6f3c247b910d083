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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "check_writable_folder",
    "check_new_output",
    "save_params",
    "load_params",
    "DEFAULT_MAX_SHARD_SIZE",
    "SHARD_INDEX",
    "params_index",
    "params_exist",
    "params_sha256",
    "params_size",
    "read_params_metadata",
    "remove_params",
    "read_checkpoint",
    "save_params_cast",
    "to_jsonable",
    "parse_json",
    "read_json",
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


def check_new_output(path: str | os.PathLike, *, key: str, what: str) -> Path:
    """Check, before anything starts, an output rayfuse creates whole (``what``: "a folder", "a .safetensors file"...):
    nothing is at ``path`` yet, so nothing is overwritten or mixed with an earlier output's files, and its folder can be
    written (:func:`check_writable_folder`). Raises :class:`InputError` at ``key``; returns ``path``."""
    target = Path(path)
    if target.exists():
        raise InputError(key, f"{what} that does not exist yet (nothing is overwritten)", str(target))
    check_writable_folder(target.parent, key=key)
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def parse_json(text: str | bytes, where: str, expected: str, hint: str = "") -> Any:
    """JSON a user can touch (a file, a file's metadata field), or one :class:`InputError` at ``where``: json's
    ``ValueError`` (invalid JSON, bytes that are not UTF-8) and the ``RecursionError`` of nesting deeper than the
    parser recurses (``"[" * 100000``), which is no ``ValueError``. Readers that refuse such a file go through it;
    the run folder's own state files, which fall back on damage (a checkpoint pointer, a method summary, the step
    cache: :mod:`rayfuse.store`) catch ``RecursionError`` beside ``ValueError`` where they read."""
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except (ValueError, RecursionError) as exc:
        raise InputError(where, expected, f"a damaged file ({type(exc).__name__})", hint) from None


def read_json(path: str | os.PathLike, expected: str, hint: str = "", *, where: str | None = None) -> Any:
    """:func:`parse_json` of the file at ``path`` (named by ``where``, default the path), an unreadable file one
    :class:`InputError` too."""
    where = str(path) if where is None else where
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(where, expected, f"unreadable ({exc.strerror or type(exc).__name__})", hint) from None
    return parse_json(raw, where, expected, hint)


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


#: The size above which a parameter file is written as shards (:func:`save_params`): ``run.max_shard_size`` and
#: ``rayfuse fuse --max-shard-size`` override it. 2 GiB, the shard size the Hugging Face hub's own checkpoints use.
DEFAULT_MAX_SHARD_SIZE = 2 * 2**30
#: The index of a sharded parameter file (Hugging Face's name): ``{"metadata": {...}, "weight_map": {tensor: shard}}``.
SHARD_INDEX = "model.safetensors.index.json"
# The safetensors dtype codes of the numpy dtypes a parameter file holds.
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
_TORCH_DTYPES = {
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}


class _Tensor:
    """One tensor to write: its safetensors dtype code, shape, size and, on demand, its bytes (a uint8 view, or the
    one tensor converted, so a writer holds at most one converted tensor at a time)."""

    def __init__(self, code: str, shape: tuple[int, ...], nbytes: int, raw: Callable[[], np.ndarray]) -> None:
        self.code, self.shape, self.nbytes, self.raw = code, shape, nbytes, raw


def _numpy_tensor(name: str, value: Any) -> _Tensor:
    array = np.asarray(value, order="C")  # keeps 0-d arrays 0-d; copies only what is not C-contiguous already
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and not np.little_endian):
        array = array.astype(array.dtype.newbyteorder("<"))
    code = _SAFETENSORS_DTYPES.get(array.dtype.name)
    if code is None:
        raise TypeError(f"{name}: dtype {array.dtype} cannot be stored in a parameter file")
    return _Tensor(code, tuple(int(d) for d in array.shape), int(array.nbytes), lambda: array.reshape(-1).view(np.uint8))


# safetensors' own writer orders tensors by dtype (this order, last first), then by name; readers list them in file
# order, so the same order here keeps every reader's view of a file the same as for one safetensors wrote.
_DTYPE_ORDER = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
    "F64", "I64", "U64",
)  # fmt: skip


def _in_file_order(tensors: Mapping[str, _Tensor]) -> dict[str, _Tensor]:
    return dict(sorted(tensors.items(), key=lambda item: (-_DTYPE_ORDER.index(item[1].code), item[0])))


def _write_safetensors(handle: Any, tensors: Mapping[str, _Tensor], metadata: Mapping[str, str]) -> None:
    """Write one safetensors file tensor by tensor (the format: an 8-byte little-endian header length, the JSON
    header padded with spaces to 8 bytes, then each tensor's bytes in header order): no copy of the whole file is
    ever built in memory, as ``safetensors.numpy.save`` builds one."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        header[name] = {"dtype": tensor.code, "shape": list(tensor.shape), "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    handle.write(len(text).to_bytes(8, "little"))
    handle.write(text)
    for tensor in tensors.values():
        if tensor.nbytes:
            raw = tensor.raw()
            if raw.nbytes != tensor.nbytes:  # a converter that produced other bytes than the header promised
                raise ValueError(f"tensor of {raw.nbytes} bytes where {tensor.nbytes} were announced")
            handle.write(raw.data)
            del raw


def _write_file(path: Path, tensors: Mapping[str, _Tensor], metadata: Mapping[str, str]) -> None:
    with open(path, "wb") as handle:
        _write_safetensors(handle, tensors, metadata)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_in_place(staged: Path, path: Path) -> None:
    """Rename ``staged`` (a file or a shard folder) to ``path``. A rename is atomic when ``path`` is absent or of the
    same kind; a shard folder replacing anything, or a file replacing a shard folder, first renames the old one aside
    and deletes it after: a crash in between leaves ``path`` absent and the old one complete beside it
    (``.<name>.old-*``), never half of either."""
    if path.is_dir() or (staged.is_dir() and path.exists()):
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.replace(path, aside / path.name)
        os.replace(staged, path)
        remove_params(aside)
    else:
        os.replace(staged, path)
    _fsync_folder(path.parent)


def _shard_plan(tensors: Mapping[str, _Tensor], limit: int) -> list[list[str]]:
    """Tensors in order, cut into shards of at most ``limit`` bytes (a larger tensor is a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor.nbytes
    return shards


def _save_tensors(
    path: str | os.PathLike, tensors: Mapping[str, _Tensor], metadata: Mapping[str, Any] | None, max_shard_size: int | None
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    tensors = _in_file_order(tensors)
    limit = DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else int(max_shard_size)
    if limit < 1:
        raise ValueError(f"max_shard_size is a positive number of bytes, got {max_shard_size}")
    total = sum(t.nbytes for t in tensors.values())
    if total <= limit:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            _write_file(Path(tmp), tensors, meta)
            _put_in_place(Path(tmp), path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        plan = _shard_plan(tensors, limit)
        weight_map: dict[str, str] = {}
        for k, names in enumerate(plan):
            shard = f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
            _write_file(staging / shard, {n: tensors[n] for n in names}, meta)
            weight_map.update({n: shard for n in names})
        index = {"metadata": {**meta, "total_size": total}, "weight_map": weight_map}
        with open(staging / SHARD_INDEX, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(index, indent=2) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_folder(staging)
        _put_in_place(staging, path)
    except BaseException:
        remove_params(staging)
        raise
    return path


def save_params(
    path: str | os.PathLike,
    params: Mapping[str, np.ndarray],
    metadata: Mapping[str, Any] | None = None,
    *,
    max_shard_size: int | None = None,
) -> Path:
    """Save a parameter dict as ``safetensors``, atomically, tensor by tensor (no second copy of the model in memory).

    Up to ``max_shard_size`` bytes (default :data:`DEFAULT_MAX_SHARD_SIZE`) it is one file at ``path``; above, ``path``
    is a folder in Hugging Face's sharded layout: ``model-0000k-of-0000n.safetensors`` files of at most that size (a
    larger tensor alone in its shard) and :data:`SHARD_INDEX` naming each tensor's shard, staged in a temporary folder
    and renamed into place. Every reader here (:func:`load_params`, :func:`read_checkpoint`) takes either form at
    the same path; :func:`params_exist`, :func:`params_sha256` and :func:`remove_params` treat them as one thing.
    """
    tensors = {str(name): _numpy_tensor(str(name), value) for name, value in params.items()}
    return _save_tensors(path, tensors, metadata, max_shard_size)


def params_index(path: str | os.PathLike) -> Path | None:
    """The shard index ``path`` stands for: ``path`` itself (a ``*.index.json`` file) or ``<path>/`` :data:`SHARD_INDEX`
    (a shard folder); ``None`` for a single file (or nothing)."""
    path = Path(path)
    if path.is_dir():
        return path / SHARD_INDEX
    if path.name.endswith(".index.json") and path.is_file():
        return path
    return None


def params_exist(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a parameter file: a file, or a shard folder with its index."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and (path / SHARD_INDEX).is_file())


def remove_params(path: str | os.PathLike) -> None:
    """Delete a parameter file or a shard folder (nothing when absent)."""
    import shutil

    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sha256(file: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def params_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a parameter file; of a shard folder, the SHA-256 of its index's SHA-256 and each shard's (in the
    index's order of shards), so a change to any file of the folder changes it."""
    index = params_index(path)
    if index is None:
        return _sha256(Path(path))
    import hashlib

    digest = hashlib.sha256(_sha256(index).encode())
    for shard in _shard_files(index):
        digest.update(f"{shard.name}:{_sha256(shard)}".encode())
    return digest.hexdigest()


def _read_index(index: Path) -> dict[str, str]:
    """The weight map of a shard index (tensor -> shard file name): :class:`InputError` naming the index for one
    that is unreadable, malformed, or names a shard outside its folder or one that is missing."""
    if not index.is_file():
        raise InputError(str(index.parent), f"a parameter file or a shard folder with {SHARD_INDEX}", "a folder without it")
    try:
        info = json.loads(index.read_text(encoding="utf-8"))
        weight_map = info["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not a non-empty mapping of tensor names to shard files")
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise InputError(str(index), "a shard index with a weight_map", f"unreadable ({type(exc).__name__}: {str(exc)[:80]})") from None
    for shard in dict.fromkeys(weight_map.values()):
        if Path(shard).name != shard:
            raise InputError(str(index), "shard file names in the index's folder", shard)
        if not (index.parent / shard).is_file():
            raise InputError(str(index), "an index whose shards all exist", f"missing shard {shard}")
    return {str(k): str(v) for k, v in weight_map.items()}


def _shard_files(index: Path) -> list[Path]:
    return [index.parent / shard for shard in dict.fromkeys(_read_index(index).values())]


def _read_sharded(index: Path, read: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The tensors of a sharded file, read shard by shard with ``read``, checked against the index's weight map."""
    weight_map = _read_index(index)
    out: dict[str, Any] = {}
    for shard in dict.fromkeys(weight_map.values()):
        tensors = read(index.parent / shard)
        expected = {k for k, v in weight_map.items() if v == shard}
        if set(tensors) != expected:
            odd = sorted(set(tensors) ^ expected)
            raise InputError(str(index.parent / shard), f"the tensors {index.name} names for it", f"a difference in {odd[:3]}")
        out.update(tensors)
    return {name: out[name] for name in weight_map}


def read_params_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata a parameter file (or a shard folder's index) carries."""
    index = params_index(path)
    if index is not None:
        _read_index(index)
        meta = json.loads(index.read_text(encoding="utf-8")).get("metadata") or {}
        return {str(k): str(v) for k, v in meta.items() if k != "total_size"}
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        return dict(handle.metadata() or {})


def params_size(path: str | os.PathLike) -> int:
    """Bytes of a parameter file, or of all the shards a shard folder's index names."""
    index = params_index(path)
    return Path(path).stat().st_size if index is None else sum(f.stat().st_size for f in _shard_files(index))


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return dict(load_file(str(path)))  # memory-mapped: each tensor copied once out of the map
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(str(path), "a valid safetensors file", f"unreadable ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - anything else the reader raises on a damaged file (a dtype numpy lacks...)
        raise InputError(str(path), "a valid safetensors file of numpy dtypes", f"unreadable ({type(exc).__name__}: {exc})") from None


def load_params(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a parameter dict from ``.safetensors``, a shard folder or its ``*.index.json`` (:func:`save_params`), or a
    PyTorch file (``torch.load(weights_only=True)``)."""
    path = Path(path)
    index = params_index(path)
    if index is not None:
        return _read_sharded(index, _load_safetensors)
    if not path.is_file():
        raise InputError(str(path), "an existing model file (.safetensors, .pt, .pth, .bin)", "no such file")
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
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


def read_checkpoint(path: str | os.PathLike, *, mapped: bool = False) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A checkpoint trained elsewhere (``rayfuse fuse``): its tensors as numpy arrays and each tensor's stored dtype.

    ``.safetensors`` files and PyTorch files (``torch.load(weights_only=True)``) are read as :func:`load_params` does;
    tensors of a float dtype numpy cannot hold (``bfloat16``, the ``float8`` types) come back as float32 arrays, their
    stored dtype recorded, so they can be fused and written back in it (:func:`save_params_cast`). A sparse, quantized
    or complex tensor is an :class:`InputError` naming the file and the tensor.

    A shard folder or its index (:func:`save_params`) is read shard by shard. With ``mapped``, a safetensors file of
    numpy dtypes comes back as read-only arrays over a memory map of it (no copy in the process's own memory: what
    ``rayfuse fuse`` reads many models with); without, as copies.
    """
    path = Path(path)
    index = params_index(path)
    if index is not None:  # a shard folder or its index: each shard read as a file, its tensors checked against the index
        check_file_fits_in_memory(path)
        dtypes: dict[str, str] = {}

        def shard(file: Path) -> dict[str, np.ndarray]:
            params, stored = _read_checkpoint_file(file, mapped)
            dtypes.update(stored)
            return params

        params = _read_sharded(index, shard)
        return params, {k: dtypes[k] for k in params if k in dtypes}
    if path.is_file():
        check_file_fits_in_memory(path)
    return _read_checkpoint_file(path, mapped)


_NUMPY_DTYPES = {code: name for name, code in _SAFETENSORS_DTYPES.items()}


def _mapped_safetensors(path: Path) -> dict[str, np.ndarray] | None:
    """The tensors of a safetensors file as read-only arrays over a memory map of it (no copy: pages are read as the
    arrays are used, and stay the page cache's, which the kernel can drop); ``None`` when a tensor has a dtype numpy
    lacks or the header does not describe the file exactly (the callers' readers then say what is wrong)."""
    import mmap

    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            n = int.from_bytes(handle.read(8), "little")
            if size < 8 or n > size - 8:
                return None
            header = json.loads(handle.read(n))
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else None
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    header.pop("__metadata__", None)
    out: dict[str, np.ndarray] = {}
    end = 0
    for name, info in sorted(
        header.items(), key=lambda item: tuple(item[1].get("data_offsets", (0, 0))) if isinstance(item[1], dict) else (0, 0)
    ):
        try:
            dtype = np.dtype(_NUMPY_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            start, stop = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return None
        if start != end or stop - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or 8 + n + stop > size:
            return None
        end = stop
        if any(d < 0 for d in shape):
            return None
        if stop == start:
            out[name] = np.zeros(shape, dtype)
        else:
            try:
                array = np.ndarray(shape, dtype, buffer=mapped, offset=8 + n + start)
            except (TypeError, ValueError):  # a header describing what the file does not hold: the readers say what
                return None
            array.flags.writeable = False
            out[name] = array
    if 8 + n + end != size:
        return None
    return out  # in the file's order, as safetensors' own reader lists them


def _read_checkpoint_file(path: Path, mapped: bool) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    arrays = _mapped_safetensors(path) if mapped and path.suffix == ".safetensors" and path.is_file() else None
    if arrays is not None:
        _check_real(path, arrays)
        return arrays, {k: str(v.dtype) for k, v in arrays.items()}
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

    size = params_size(path)
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
    path: str | os.PathLike,
    params: Mapping[str, np.ndarray],
    dtype: str,
    metadata: Mapping[str, str] | None = None,
    *,
    max_shard_size: int | None = None,
) -> Path:
    """:func:`save_params` with every float tensor stored as ``dtype`` (``float16``, ``float32``, ``float64``, or a
    dtype only torch has, such as ``bfloat16``); integer tensors are written as they are. Each tensor is converted as
    it is written (memory holds one converted tensor at a time); sharded past ``max_shard_size`` as :func:`save_params`."""
    if dtype not in TORCH_ONLY_FLOATS:
        tensors = {}
        for name, value in params.items():
            array = np.asarray(value)
            if array.dtype.kind != "f" or array.dtype == np.dtype(dtype):
                tensors[str(name)] = _numpy_tensor(str(name), array)
            else:
                size = int(array.size * np.dtype(dtype).itemsize)
                code = _SAFETENSORS_DTYPES[np.dtype(dtype).name]
                convert = (lambda a: lambda: np.ascontiguousarray(a, dtype=dtype).reshape(-1).view(np.uint8))(array)
                tensors[str(name)] = _Tensor(code, tuple(int(d) for d in array.shape), size, convert)
        return _save_tensors(path, tensors, metadata, max_shard_size)
    import torch

    target = getattr(torch, dtype)
    torch_code = _TORCH_DTYPES.get(dtype)
    if torch_code is None:
        raise ValueError(f"dtype {dtype} cannot be stored in a parameter file")
    itemsize = torch.empty((), dtype=target).element_size()

    def cast(array: np.ndarray) -> Callable[[], np.ndarray]:
        return lambda: torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(target).reshape(-1).view(torch.uint8).numpy()

    tensors = {}
    for name, value in params.items():
        array = np.asarray(value)
        if array.dtype.kind == "f":
            tensors[str(name)] = _Tensor(torch_code, tuple(int(d) for d in array.shape), int(array.size * itemsize), cast(array))
        else:
            tensors[str(name)] = _numpy_tensor(str(name), array)
    return _save_tensors(path, tensors, metadata, max_shard_size)
