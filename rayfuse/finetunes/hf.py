"""Hugging Face checkpoints, any size: reading a model tensor by tensor and writing one shard by shard.

A model is a ``.safetensors`` file or a Hugging Face folder: ``config.json`` with ``model.safetensors``, or sharded
``model-0000x-of-0000y.safetensors`` files named by ``model.safetensors.index.json``. :class:`ModelSource` reads the
headers only (names, shapes, dtypes, byte offsets: nothing is loaded) and then reads one tensor at a time straight
into a tensor of its own (one ``readinto`` at the tensor's offset: the tensor's bytes once in memory, no memory map
whose pages would also count, bfloat16 included). :class:`ShardedWriter` plans the output's
shards from the tensors' shapes and dtypes before any value is known, writes each file's header first and then every
tensor at its offset as soon as it is merged, so a shard is never held in memory whole; the files are written in a
temporary folder renamed to the output at the end (nothing at the output on failure).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rayfuse.errors import InputError

__all__ = [
    "ModelSource",
    "TensorInfo",
    "ShardedWriter",
    "parse_size",
    "copy_model_files",
    "check_config_describes",
    "DTYPES",
    "TORCH_DTYPES",
    "MODEL_FILES",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the files a Hugging Face folder keeps beside the weights, copied from the base model into the output
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
)
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES.values()}
_CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a model: the file holding it, its shape and dtype (``"bfloat16"``...)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str
    # where the tensor's bytes start in ``file`` (the data section's start plus its first data offset)
    offset: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=TORCH_DTYPES[self.dtype]).element_size()


def read_header(file: Path, where: str) -> dict[str, Any]:
    """A safetensors file's JSON header (one line naming ``where`` for a file that is not one)."""
    return _header_and_start(file, where)[0]


def _header_and_start(file: Path, where: str) -> tuple[dict[str, Any], int]:
    """The JSON header and where the data section starts (after the 8-byte length and the header)."""
    try:
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000 or n > file.stat().st_size - 8:
                raise ValueError("header length past the end of the file")
            header = json.loads(handle.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        return header, 8 + n
    except (OSError, ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise InputError(where, "a safetensors file", f"{type(exc).__name__}: {str(exc)[:80]}") from None


class ModelSource:
    """A model to merge: a ``.safetensors`` file, a Hugging Face or shard folder, read from its headers; :meth:`get`
    loads one tensor on demand. A PyTorch file (``.pt`` / ``.pth`` / ``.bin``, ``torch.load(weights_only=True)``) has no
    header to read tensors from one by one: it is read whole, once, and held while the merge runs (its size counts once
    per model; large models are merged from safetensors). ``where``: how errors name it (the config key)."""

    def __init__(self, path: Path, where: str) -> None:
        self.path, self.where = path, where
        self.tensors: dict[str, TensorInfo] = {}
        self.folder = path if path.is_dir() else None
        self._held: dict[str, Any] = {}
        files: list[Path]
        if path.is_file() and path.suffix in (".pt", ".pth", ".bin"):
            self._read_torch(path)
            return
        if path.is_file() and path.name.endswith(".index.json"):  # a shard folder's index, named instead of its folder
            path = path.parent
        if path.is_dir():
            index = path / INDEX
            if index.is_file():
                weight_map = self._weight_map(index)
                files = []
                for name, shard in weight_map.items():
                    file = path / shard
                    if not file.is_file():
                        raise InputError(
                            f"{where}: {INDEX}",
                            f"shard files that exist in {path}",
                            f"{shard} (named for {name})",
                            "the folder is incomplete; copy the missing shard",
                        )
                    if file not in files:
                        files.append(file)
            elif (path / SINGLE).is_file():
                weight_map, files = {}, [path / SINGLE]
            else:
                bins = sorted(p.name for p in path.glob("*.bin"))
                raise InputError(
                    where,
                    f"a Hugging Face folder with {SINGLE} or {INDEX} (safetensors weights)",
                    bins[0] if bins else "neither",
                    "convert .bin weights with save_pretrained(safe_serialization=True)" if bins else "",
                )
        elif path.suffix == ".safetensors" and path.is_file():
            weight_map, files = {}, [path]
        else:
            raise InputError(
                where, "a .safetensors / .pt / .pth / .bin file or a Hugging Face folder (config.json and model.safetensors)", str(path)
            )
        for file in files:
            header, start = _header_and_start(file, f"{where}: {file.name}")
            size = file.stat().st_size
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if weight_map and weight_map.get(name) != file.name:
                    continue  # the index decides which shard holds a tensor
                if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES or not isinstance(entry.get("shape"), list):
                    raise InputError(f"{where}: {file.name}: {name}", f"a tensor entry with a dtype in {sorted(DTYPES)}", entry)
                info = TensorInfo(file, tuple(int(d) for d in entry["shape"]), DTYPES[entry["dtype"]])
                offsets = entry.get("data_offsets")
                if (
                    not isinstance(offsets, list)
                    or len(offsets) != 2
                    or not all(isinstance(o, int) and o >= 0 for o in offsets)
                    or offsets[1] - offsets[0] != info.nbytes
                    or start + offsets[1] > size
                ):
                    raise InputError(
                        f"{where}: {file.name}: {name}",
                        f"data_offsets spanning {info.nbytes} bytes ({info.dtype} {list(info.shape)}) inside the file",
                        offsets,
                        "the file is truncated or not a safetensors file",
                    )
                self.tensors[name] = TensorInfo(info.file, info.shape, info.dtype, start + offsets[0])
        for name in weight_map:
            if name not in self.tensors:
                raise InputError(f"{where}: {INDEX}", f"tensors the shards hold ({weight_map[name]} does not hold it)", name)
        if not self.tensors:
            raise InputError(where, "a model with at least one tensor", "an empty checkpoint")

    def _read_torch(self, path: Path) -> None:
        """A PyTorch file, read and checked as ``rayfuse fuse`` reads any checkpoint (dense real tensors; bfloat16
        held as float32 with its stored dtype recorded)."""
        from rayfuse.io import read_checkpoint

        arrays, stored = read_checkpoint(path)  # its refusals name the file and the tensor
        for name, array in arrays.items():
            dtype = stored.get(name, str(array.dtype))
            self.tensors[name] = TensorInfo(path, tuple(array.shape), dtype if dtype in TORCH_DTYPES else str(array.dtype))
            self._held[name] = array
        if not self.tensors:
            raise InputError(self.where, "a model with at least one tensor", "an empty checkpoint")

    def _weight_map(self, index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise InputError(f"{self.where}: {INDEX}", "a JSON index (weight_map)", f"{type(exc).__name__}: {str(exc)[:80]}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise InputError(f"{self.where}: {INDEX}", "a weight_map of tensor names to shard files", type(weight_map).__name__)
        return weight_map

    def get(self, name: str) -> torch.Tensor:
        """One tensor, as stored (bfloat16 stays bfloat16), in memory of its own (the caller may overwrite it).

        Read with one ``readinto`` at the tensor's offset: the process holds the tensor's bytes once. (safetensors'
        ``get_tensor`` copies out of a memory map, whose pages count in the resident size too while the handle is
        open: twice the tensor at the moment of the read.) safetensors stores little-endian, as torch on this CPU."""
        info = self.tensors[name]
        if name in self._held:  # a PyTorch file's tensor, held since it was read: a copy of its own
            return torch.tensor(self._held[name]).to(TORCH_DTYPES[info.dtype])
        out = torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])
        if info.nbytes == 0:
            return out
        view = out.reshape(-1).view(torch.uint8).numpy().data
        with open(info.file, "rb", buffering=0) as handle:
            handle.seek(info.offset)
            got = 0
            while got < info.nbytes:
                n = handle.readinto(view[got:])
                if not n:
                    raise InputError(
                        f"{self.where}: {info.file.name}: {name}", f"{info.nbytes} bytes", f"{got} (the file shrank while merging)"
                    )
                got += n
        return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*((?:K|M|G|T)i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str, where: str) -> int:
    """A shard size: bytes, or a string with a unit as Hugging Face spells them (``"2GB"`` = 2 * 10**9, ``"200KB"``,
    ``"1GiB"`` = 2**30)."""
    if isinstance(value, bool):
        raise InputError(where, 'a size in bytes or with a unit ("2GB", "500MB", "1GiB")', value)
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise InputError(where, 'a size in bytes or with a unit ("2GB", "500MB", "1GiB")', value)
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if size < 1:
        raise InputError(where, "a positive size", value)
    return size


@dataclass
class _Shard:
    name: str
    tensors: list[str] = field(default_factory=list)
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)
    data_start: int = 0


class ShardedWriter:
    """Writes tensors whose names, shapes and dtypes are known in advance into ``output``: one ``.safetensors`` file
    (``output`` ends in ``.safetensors`` and the tensors fit in ``max_shard_size``) or a folder, sharded past ``max_shard_size`` bytes
    (``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``; one ``model.safetensors`` when it all
    fits in one), in the order given. :meth:`write` takes a tensor in any order (threads); :meth:`commit` renames the
    temporary folder to the output; :meth:`abort` removes it."""

    def __init__(
        self, output: Path, plan: Mapping[str, tuple[tuple[int, ...], str]], max_shard_size: int, metadata: Mapping[str, str]
    ) -> None:
        self.output, self.plan = output, dict(plan)
        # a .safetensors output is one file up to max_shard_size; past it, a folder of shards at that path (as
        # rayfuse.io.save_params writes one, which every reader of model files takes)
        self.single = output.suffix == ".safetensors" and sum(TensorInfo(Path(), s, d).nbytes for s, d in plan.values()) <= max_shard_size
        self.tmp = output.parent / f".{output.name}.tmp-{os.getpid()}-{threading.get_ident()}"
        self.tmp.mkdir(parents=True)
        shards: list[_Shard] = []
        size = 0
        for name, (shape, dtype) in plan.items():
            n = TensorInfo(Path(), shape, dtype).nbytes
            if not shards or (not self.single and shards[-1].tensors and size + n > max_shard_size):
                shards.append(_Shard(""))
                size = 0
            shards[-1].offsets[name] = (size, size + n)
            shards[-1].tensors.append(name)
            size += n
        for k, shard in enumerate(shards):
            shard.name = (
                output.name if self.single else SINGLE if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            )
        self.shards = shards
        self.where = {name: shard for shard in shards for name in shard.tensors}
        self.total = sum(TensorInfo(Path(), s, d).nbytes for s, d in plan.values())
        self._locks = {shard.name: threading.Lock() for shard in shards}
        for shard in shards:
            header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
            for name in shard.tensors:
                shape, dtype = plan[name]
                header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": list(shard.offsets[name])}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            shard.data_start = 8 + len(raw)
            end = shard.offsets[shard.tensors[-1]][1] if shard.tensors else 0
            with open(self.tmp / shard.name, "wb") as handle:
                handle.write(struct.pack("<Q", len(raw)) + raw)
                handle.truncate(shard.data_start + end)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor at its place (its dtype and shape must be the planned ones)."""
        shape, dtype = self.plan[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != TORCH_DTYPES[dtype]:
            raise ValueError(f"{name}: planned {shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}")
        shard = self.where[name]
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        with self._locks[shard.name], open(self.tmp / shard.name, "r+b") as handle:
            handle.seek(shard.data_start + shard.offsets[name][0])
            handle.write(data.data)

    def commit(self, extra: Iterable[Path] = ()) -> None:
        """Write the index (several shards), copy ``extra`` files (a base folder's config and tokenizer) and move the
        result to the output."""
        if self.single:
            os.replace(self.tmp / self.shards[0].name, self.output)
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": {n: s.name for s in self.shards for n in s.tensors}}
            (self.tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for file in extra:
            shutil.copy2(file, self.tmp / file.name)
        os.replace(self.tmp, self.output)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def copy_model_files(folder: Path | None) -> list[Path]:
    """The files besides the weights that a Hugging Face folder keeps (config, generation config, tokenizer)."""
    if folder is None:
        return []
    return [folder / name for name in MODEL_FILES if (folder / name).is_file()]


def check_config_describes(folder: Path, tensors: Mapping[str, TensorInfo]) -> None:
    """Before an output folder is written with ``folder``'s ``config.json`` copied beside ``tensors`` (the output's
    names and shapes): the model that config builds (the class its ``architectures`` names, on the meta device: no
    memory, no values) holds exactly these tensors, so ``from_pretrained`` loads the output; else one line naming the
    config. Tied tensors count once; the keys the class itself lets a checkpoint lack or add are ignored, as
    ``from_pretrained`` ignores them. A config transformers cannot build here (an architecture it does not have: custom
    code, which rayfuse never runs) is not checked."""
    import transformers

    from rayfuse.models.hf import quiet_transformers

    file = folder / "config.json"
    with quiet_transformers():
        try:
            config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
            names = getattr(config, "architectures", None) or []
            cls = getattr(transformers, names[0], None) if names and isinstance(names[0], str) else None
            if cls is None or not hasattr(cls, "_from_config"):
                return
            with torch.device("meta"):
                model = cls._from_config(config)
        except Exception:  # noqa: BLE001 - a config transformers cannot build: the output is written as before
            return
    state = model.state_dict(keep_vars=True)
    prefix = getattr(cls, "base_model_prefix", "")
    if prefix and not set(tensors) & set(state):  # from_pretrained adds or strips the base model's prefix
        added = {f"{prefix}.{k}": v for k, v in tensors.items()}
        tensors = added if set(added) & set(state) else {k.removeprefix(f"{prefix}."): v for k, v in tensors.items()}
    groups: dict[int, list[str]] = {}  # tied tensors: one object under several names
    for key, value in state.items():
        groups.setdefault(id(value), []).append(key)
    ignored = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_missing", None) or [])]
    extra_ok = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])]
    what = "a config.json describing the weights beside it (from_pretrained would fail, or reinitialise what they lack)"
    name = cls.__name__
    for key, info in tensors.items():
        if key in state and tuple(state[key].shape) != info.shape:
            raise InputError(str(file), what, f"{name} with {key} {tuple(state[key].shape)}, in the weights {info.shape}")
    unexpected = [k for k in tensors if k not in state and not any(p.search(k) for p in extra_ok)]
    if unexpected:
        raise InputError(str(file), what, f"{name} without {unexpected[0]} ({len(unexpected)} such)")
    missing = [keys[0] for keys in groups.values() if not any(k in tensors for k in keys) and not any(p.search(keys[0]) for p in ignored)]
    if missing:
        raise InputError(str(file), what, f"{name} with {missing[0]}, not in the weights ({len(missing)} such)")
