"""The raw-data accident guard: refuses a client step's result that carries the client's own inputs or labels.

Method code is trusted: a client step runs inside the data owner's process with the owner's data in reach, so a method
written to leak can always encode the data in a way no check recognises (a transposed copy, a string, a lossy
projection). This guard catches the *accidents* a method author can make: returning the shard, a view of it, or a copy
that went through a container, a dtype change or a serialisation on the way. :class:`RawDataGuard` walks the result
(dicts, lists, tuples, sets, dataclasses and the attributes of other objects, numpy arrays, torch tensors of any
dtype, ``bytes``, ``tolist()`` output) and looks for

* **rows of the private inputs**, found row by row (a copy with rows dropped, reordered, or split over several
  arrays is still found): each input is flattened to one row of ``d`` values and hashed once per client; an array of
  the result is read as rows of ``d`` values and compared after casting to the coarser of the two dtypes (a float64 or
  float16 copy of float32 inputs, a bfloat16 tensor). Refused when at least two distinct, non-constant input rows
  holding at least ``min_values`` values in all are found anywhere in the result;
* **the label vector**, or a copy of it with a few rows dropped (at one place) or swapped: an integral vector of
  nearly the labels' length that agrees with them at all but 1 % of the positions (or two), including at least ``min_label_rows``
  labels other than the most common one. A vector with the labels in another order is not refused: it tells what
  the class counts tell, and the counts are what clients legitimately share.

Numpy views of the inputs or labels are refused whatever their size (a bounds check). The cost is about one read of
one value per row of the result's numeric data per call: a row can equal a private row only where its value in the
column the private rows differ most in is one of theirs (a sorted lookup), and only those rows are hashed (vectorised)
and then compared byte for byte.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["RawDataGuard", "bfloat16_round"]

_CHUNK_BYTES = 1 << 23  # row hashing works through the rows in chunks of about 8 MB
_BYTES_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
_MIX = np.uint64(0x9E3779B97F4A7C15)


def bfloat16_round(values: np.ndarray) -> np.ndarray:
    """``values`` (float32) rounded to bfloat16 (round to nearest even) and returned as float32: what a bfloat16 copy
    of them holds."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32)


_coefficients: dict[int, np.ndarray] = {}


def _row_hashes(rows: np.ndarray) -> np.ndarray:
    """One 64-bit hash per row of the contiguous 2-D array ``rows`` (of its bytes; equal bytes, equal hash)."""
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1)
    width = raw.shape[1]
    word = next(w for w in (8, 4, 2, 1) if width % w == 0)
    words = raw.view(f"<u{word}")
    count = words.shape[1]
    coef = _coefficients.get(count)
    if coef is None:
        coef = np.random.default_rng(0x5EED).integers(1, 2**63, size=count, dtype=np.uint64) | np.uint64(1)
        _coefficients[count] = coef
    out = np.empty(len(rows), dtype=np.uint64)
    step = max(1, _CHUNK_BYTES // max(1, count * 8))
    with np.errstate(over="ignore"):
        for start in range(0, len(rows), step):
            chunk = words[start : start + step].astype(np.uint64)
            h = chunk[:, 0] * coef[0] if count == 1 else (chunk * coef).sum(axis=1, dtype=np.uint64)
            h ^= h >> np.uint64(31)
            h *= _MIX
            h ^= h >> np.uint64(29)
            out[start : start + step] = h
    return out


class _RowIndex:
    """The distinct non-constant private rows in one comparison dtype, with their sorted hashes."""

    def __init__(self, rows: np.ndarray, ids: np.ndarray) -> None:
        hashes = _row_hashes(rows)
        unique, first = np.unique(hashes, return_index=True)
        self.hashes = unique
        self.rows = np.ascontiguousarray(rows[first]).view(np.uint8).reshape(len(first), -1)
        self.ids = ids[first]  # the row's index in the private inputs (shared by every comparison dtype)
        # A prefilter before any hashing: a row can equal a private row only if its value in one column (compared as
        # bytes, like the rows) is that row's value there. The column is the one where the private rows differ most
        # (of up to 64 evenly spaced), so a model's parameters read as rows (hundreds of thousands per 40 MB) pass it
        # rarely: one value read per row and a sorted lookup, instead of every row's hash (~10 x the time).
        self.word = np.dtype(f"<u{rows.dtype.itemsize}")
        words = self.rows.view(self.word).reshape(len(first), -1) if len(first) else np.empty((0, 1), self.word)
        width = words.shape[1]
        columns = np.unique(np.linspace(0, width - 1, min(width, 64)).astype(np.intp)) if width else np.zeros(1, np.intp)
        self.column = int(columns[int(np.argmax([len(np.unique(words[:, c])) for c in columns]))]) if len(words) else 0
        self.column_values = np.unique(words[:, self.column]) if len(words) else np.empty(0, self.word)
        # ... looked up in a bit table of the values' low bits first (one gather per row), exactly only where it hits
        self.column_mask = self.word.type(min((1 << 20) - 1, np.iinfo(self.word).max))
        self.column_table = np.zeros(int(self.column_mask) + 1, dtype=bool)
        self.column_table[(self.column_values & self.column_mask).astype(np.intp)] = True
        bits = min(24, max(10, int(len(unique) * 8).bit_length()))  # a prefilter on the hashes' low bits
        self.mask = np.uint64((1 << bits) - 1)
        self.table = np.zeros(1 << bits, dtype=bool)
        self.table[(unique & self.mask).astype(np.intp)] = True

    def find(self, candidate: np.ndarray) -> np.ndarray:
        """The private row ids found among the rows of ``candidate`` (same dtype and width as the index)."""
        if not len(self.hashes) or not len(candidate):
            return np.empty(0, dtype=np.int64)
        keys = candidate[:, self.column].view(self.word)
        maybe = np.flatnonzero(self.column_table[keys & self.column_mask])
        if len(maybe) < len(candidate) // 2:  # else (e.g. rows of zeros, a value private rows share): hash them all
            at = np.searchsorted(self.column_values, keys[maybe]).clip(max=len(self.column_values) - 1)
            maybe = maybe[self.column_values[at] == keys[maybe]]  # the rows that may be private ones
            if not len(maybe):
                return np.empty(0, dtype=np.int64)
            candidate = candidate[maybe]
        hashes = _row_hashes(candidate)
        maybe = np.flatnonzero(self.table[(hashes & self.mask).astype(np.intp)])
        pos = np.searchsorted(self.hashes, hashes[maybe]).clip(max=len(self.hashes) - 1)
        hit = self.hashes[pos] == hashes[maybe]
        rows, pos = maybe[hit], pos[hit]
        if not len(rows):
            return np.empty(0, dtype=np.int64)
        raw = np.ascontiguousarray(candidate[rows]).view(np.uint8).reshape(len(rows), -1)
        same = (raw == self.rows[pos]).all(axis=1)  # byte for byte: a hash collision is not a match
        return np.asarray(self.ids[pos[same]], dtype=np.int64)


class RawDataGuard:
    """Finds a client's private inputs or labels in what a client step returns (an accident guard; see the module).

    Parameters
    ----------
    features : sequence of arrays
        The private inputs (train and validation), each ``(n, *input_shape)``; hashed row by row once, on first use.
    labels : sequence of arrays
        The private label vectors, each ``(n,)``.
    min_values : int
        Input rows found are refused when they hold at least this many values (and are at least two rows).
    min_label_rows : int
        A label vector is recognised only with at least this many labels other than its most common one.
    """

    def __init__(
        self, features: Sequence[np.ndarray], labels: Sequence[np.ndarray], *, min_values: int = 16, min_label_rows: int = 16
    ) -> None:
        self._arrays = [a for a in (*features, *labels) if a.size]
        flat = [a.reshape(len(a), -1) for a in features if a.size and a.ndim >= 1]
        self.width = flat[0].shape[1] if flat else 0
        rows = np.concatenate([a for a in flat if a.shape[1] == self.width]) if flat else np.empty((0, 0), np.float32)
        keep = (rows != rows[:, :1]).any(axis=1) if self.width > 1 else np.ones(len(rows), bool)  # constant rows say nothing
        self._rows, self._ids = np.ascontiguousarray(rows[keep]), np.flatnonzero(keep)
        self.min_values = min_values
        self._rows_needed: int | None = None
        self._labels = [np.asarray(y).reshape(-1).astype(np.int64) for y in labels if np.asarray(y).size]
        self.min_label_rows = min_label_rows
        self._indexes: dict[str, _RowIndex] = {}

    @property
    def rows_needed(self) -> int:
        """How many distinct input rows found make a result refused (at most the distinct rows there are)."""
        if self._rows_needed is None:
            distinct = len(self._index(self._rows.dtype.name).hashes) if len(self._rows) else 0
            self._rows_needed = min(max(2, math.ceil(self.min_values / max(self.width, 1))), distinct)
        return self._rows_needed

    # -- the private rows in each comparison dtype ---------------------------------------------------------------

    def _index(self, key: str) -> _RowIndex:
        index = self._indexes.get(key)
        if index is None:
            if key == "bfloat16":
                rows = bfloat16_round(self._rows).reshape(self._rows.shape)
            else:
                with np.errstate(over="ignore", invalid="ignore"):
                    rows = self._rows.astype(np.dtype(key))
            index = self._indexes[key] = _RowIndex(rows, self._ids)
        return index

    def _comparable(self, array: np.ndarray, precision: str | None) -> tuple[str, np.ndarray] | None:
        """``array`` as rows of the inputs' width in the dtype both can be compared in, and that dtype's key."""
        private = self._rows.dtype
        if not self.rows_needed or array.size < self.width or array.size % self.width:
            return None
        kind = array.dtype.kind
        if private.kind == "f":
            if kind != "f":
                return None  # an integer array holds no float input row (a truncated copy is not the data)
            if precision == "bfloat16":
                key, target = "bfloat16", np.dtype(np.float32)
            elif array.dtype.itemsize >= private.itemsize:
                key, target = private.name, private
            else:
                key, target = array.dtype.name, array.dtype
        elif kind in "iub":
            key, target = private.name, private
        else:
            return None
        with np.errstate(over="ignore", invalid="ignore"):
            rows = np.ascontiguousarray(array.reshape(-1, self.width), dtype=target)
        if key == "bfloat16":
            rows = bfloat16_round(rows).reshape(rows.shape)
        return key, rows

    # -- the checks ----------------------------------------------------------------------------------------------

    def find(self, result: Any) -> str | None:
        """What of the private data ``result`` carries (a short description), or ``None``."""
        found: set[int] = set()
        for path, array, precision in _numeric_leaves(result):
            for private in self._arrays:
                if array.size and np.may_share_memory(array, private):
                    return f"a view of the private data at {path} (shape {array.shape})"
            comparable = self._comparable(array, precision)
            if comparable is not None:
                key, rows = comparable
                found.update(int(i) for i in self._index(key).find(rows))
                if len(found) >= self.rows_needed:
                    return f"{len(found)} rows of the private inputs, the last at {path} (array of shape {array.shape})"
            labels = self._labels_in(array)
            if labels is not None:
                return f"the private labels at {path} ({labels})"
        return None

    def _labels_in(self, array: np.ndarray) -> str | None:
        if array.dtype.kind not in "iubf":
            return None
        vector = array.reshape(-1)
        for y in self._labels:
            m, length = len(y), len(vector)
            if length < self.min_label_rows or not m - max(1, m // 10) <= length <= m:
                continue
            if vector.dtype.kind == "f":
                with np.errstate(invalid="ignore"):
                    if not (np.isfinite(vector).all() and (vector == np.round(vector)).all()):
                        continue
            with np.errstate(invalid="ignore", over="ignore"):
                values = vector.astype(np.int64)
            head, tail = y[:length], y[m - length :]
            start, end = values == head, values == tail
            if length - int((start | end).sum()) > max(2, length // 100):  # a swapped pair: two mismatches
                continue
            common = np.bincount(y - y.min()).argmax() + y.min()
            informative = int(((start & (head != common)) | (end & (tail != common))).sum())
            if informative >= min(self.min_label_rows, int((y != common).sum())) and informative > 0:
                return f"{length} of {m} labels"
        return None


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "detach") and hasattr(obj, "dtype")


def _tensor_array(tensor: Any) -> tuple[np.ndarray, str | None] | None:
    """A torch tensor's values as numpy, and ``"bfloat16"`` when they were bfloat16 (compared at that precision)."""
    t = tensor.detach()
    if str(t.layout) != "torch.strided":  # sparse
        t = t.to_dense()
    t = t.cpu()
    if t.is_complex():
        return None
    precision = "bfloat16" if str(t.dtype) == "torch.bfloat16" else None
    try:
        return (t.float().numpy() if precision or str(t.dtype).startswith("torch.float8") else t.numpy()), precision
    except (TypeError, RuntimeError):  # a dtype numpy has no counterpart for
        return t.float().numpy(), None


def _number_list(obj: Any) -> np.ndarray | None:
    """``obj`` (a list, tuple or set) as a numeric array when it is numbers or nested lists of numbers (``tolist()``
    output); ``None`` otherwise."""
    first = next(iter(obj), None)
    if not isinstance(first, (numbers.Number, list, tuple)):
        return None
    try:
        array = np.asarray(list(obj) if isinstance(obj, (set, frozenset)) else obj)
    except (ValueError, TypeError, OverflowError):
        return None
    return array if array.dtype.kind in "biuf" and array.ndim >= 1 else None


def _bytes_leaves(path: str, raw: bytes) -> Iterator[tuple[str, np.ndarray, str | None]]:
    """``raw`` read as each common numeric dtype its length allows (``np.ndarray.tobytes`` of the data is one)."""
    for dtype in _BYTES_DTYPES:
        if raw and len(raw) % dtype.itemsize == 0:
            yield f"{path} (bytes as {dtype.name})", np.frombuffer(raw, dtype=dtype), None


def _numeric_leaves(result: Any) -> Iterator[tuple[str, np.ndarray, str | None]]:
    """Every numeric array in ``result`` as ``(path, array, precision)``, through containers, dataclasses, objects'
    attributes, tensors, ``bytes`` (read as each common dtype) and lists of numbers."""
    stack: list[tuple[str, Any]] = [("result", result)]
    seen: set[int] = set()
    while stack:
        path, obj = stack.pop()
        if obj is None or isinstance(
            obj,
            (
                str,
                bool,
                numbers.Number,
                np.generic,
                type,
                types.ModuleType,
                types.FunctionType,
                types.BuiltinFunctionType,
                types.MethodType,
            ),
        ):
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind in "biuf":
                yield path, obj, None
            elif obj.dtype.kind == "O":
                stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj.reshape(-1)))
            elif obj.dtype.kind == "V":  # raw or structured records: their bytes
                yield from _bytes_leaves(f"{path}.tobytes()", obj.tobytes())
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            yield from _bytes_leaves(path, bytes(obj))
        elif _is_tensor(obj):
            converted = _tensor_array(obj)
            if converted is not None:
                yield path, converted[0], converted[1]
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                stack.append((f"{path}[{key!r}]", value))
                stack.append((f"{path} key {key!r}", key))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            array = _number_list(obj)
            if array is not None:
                yield path, array, None
            else:
                stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
        elif dataclasses.is_dataclass(obj):
            stack.extend((f"{path}.{f.name}", getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
        else:
            attrs = dict(getattr(obj, "__dict__", {}) or {})
            for name in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(name, str) and hasattr(obj, name):
                    attrs[name] = getattr(obj, name)
            stack.extend((f"{path}.{name}", value) for name, value in attrs.items())
