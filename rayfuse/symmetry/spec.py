"""A model's permutation symmetry as data: which weight axes share one permutation.

Hidden units of a network can be reordered without changing what it computes, provided every tensor that indexes
those units is reordered alike: a Linear's output rows, its bias, the next layer's input columns, a BatchNorm's four
per-channel vectors, both sides of a residual addition. A :class:`PermutationSpec` lists these *groups* (as
git-re-basin writes them by hand; :func:`rayfuse.symmetry.derive_spec` derives them from the model's graph), and for
each group where its units can be observed in a forward pass (:class:`Probe`), which activation matching needs.

Conventions
-----------
* A permutation of a group of ``size`` units is an integer array ``p`` of length ``size``; applying it takes unit
  ``p[i]`` of the old model to position ``i`` (``new = old.take(p, axis)``), as ``numpy.take`` and torch indexing do.
* An :class:`AxisRef` may cover a part of an axis and a structured view of it. The segment
  ``[start, start + outer * size * inner)`` of axis ``dim`` is viewed as ``(outer, size, inner)`` and the permutation
  acts on the middle index. This covers:

  - a plain axis: ``outer = inner = 1``;
  - a Linear after ``flatten`` of a ``(C, H, W)`` feature map: the C channels are blocks of ``inner = H * W``;
  - a concatenation: each input's units are a segment (``start``);
  - attention: heads are blocks of ``inner = head_dim``; the dimensions within a head repeat ``outer = heads``
    times; Q, K and V packed in one ``in_proj_weight`` are three segments.

Everything here is numpy and plain dataclasses: a spec travels to clients and Ray tasks as is, and round-trips
through JSON (:meth:`PermutationSpec.to_dict` / :meth:`PermutationSpec.from_dict`) so a user may write one by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError

__all__ = [
    "AxisRef",
    "Probe",
    "PermGroup",
    "FixedAxis",
    "PermutationSpec",
    "Perms",
    "invert",
    "compose",
    "axes_compatible",
    "read_spec_json",
]

Perms = dict[str, np.ndarray]


@dataclass(frozen=True)
class AxisRef:
    """Where a group's permutation acts on one tensor of the state dict (see the module docstring)."""

    key: str
    dim: int
    start: int = 0
    outer: int = 1
    inner: int = 1

    def span(self, size: int) -> int:
        return self.outer * size * self.inner

    def view(self, array: np.ndarray, size: int) -> np.ndarray:
        """The units of this axis as the rows of a ``(size, rest)`` matrix (a copy), for cost matrices."""
        seg = np.take(array, np.arange(self.start, self.start + self.span(size)), axis=self.dim)
        seg = np.moveaxis(seg, self.dim, 0).reshape(self.outer, size, self.inner, -1)
        return np.moveaxis(seg, 1, 0).reshape(size, -1)

    def index(self, length: int, perm: np.ndarray) -> np.ndarray:
        """The gather index along an axis of ``length`` that applies ``perm`` to this axis' units."""
        size = len(perm)
        index = np.arange(length)
        block = index[self.start : self.start + self.span(size)].reshape(self.outer, size, self.inner)
        index[self.start : self.start + self.span(size)] = block[:, perm, :].reshape(-1)
        return index

    def permute(self, array: np.ndarray, perm: np.ndarray) -> np.ndarray:
        """``array`` with this axis' units reordered by ``perm`` (a new array)."""
        return np.take(array, self.index(array.shape[self.dim], perm), axis=self.dim)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "dim": self.dim}
        out.update(
            {k: v for k, v in (("start", self.start), ("outer", self.outer), ("inner", self.inner)) if v != (0 if k == "start" else 1)}
        )
        return out


@dataclass(frozen=True)
class Probe:
    """Where a group's units can be observed in a forward pass: the output of graph node ``node`` (a ``torch.fx`` node
    name of the traced model), axis ``dim``, viewed as :class:`AxisRef` views a weight axis. Activation matching
    correlates the two models' values there, over the batch and every other axis.

    ``hook``: ``"input"`` or ``"output"`` when the units live inside a module the graph keeps whole (a
    ``nn.TransformerEncoderLayer``'s feed-forward units): ``node`` is then that submodule's path in the model
    (``encoder.layers.0.linear2``), and a forward hook observes its first input or its output."""

    node: str
    dim: int
    start: int = 0
    outer: int = 1
    inner: int = 1
    hook: str = ""

    def __post_init__(self) -> None:
        if self.hook not in ("", "input", "output"):
            raise InputError(f"probe {self.node}.hook", "'', 'input' or 'output'", self.hook)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "dim": self.dim}
        out.update(
            {k: v for k, v in (("start", self.start), ("outer", self.outer), ("inner", self.inner)) if v != (0 if k == "start" else 1)}
        )
        if self.hook:
            out["hook"] = self.hook
        return out


@dataclass(frozen=True)
class PermGroup:
    """Units that share one permutation: ``size`` of them, found on every axis in ``axes``.

    ``kind`` says what the units are (``channels``, ``heads``, ``head_dims``...); ``probes`` where activation matching
    can observe them (empty: weight matching only). ``fixed_width``: why the model's code fixes the number of these
    units (a literal size in a ``view`` / ``reshape`` / ``expand``), so a widening merge must keep it; empty when the
    width may change."""

    name: str
    size: int
    axes: tuple[AxisRef, ...]
    probes: tuple[Probe, ...] = ()
    kind: str = "channels"
    fixed_width: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "size": self.size,
            "kind": self.kind,
            "axes": [a.to_dict() for a in self.axes],
            "probes": [p.to_dict() for p in self.probes],
        }
        if self.fixed_width:
            out["fixed_width"] = self.fixed_width
        return out


@dataclass(frozen=True)
class FixedAxis:
    """An axis left unpermuted, and why (the model's input or output, or an operation not proven to commute)."""

    key: str
    dim: int
    reason: str


@dataclass(frozen=True)
class PermutationSpec:
    """The permutation groups of a model (its state-dict keys and axes), and the axes left fixed with the reason."""

    groups: tuple[PermGroup, ...]
    fixed: tuple[FixedAxis, ...] = ()
    notes: tuple[str, ...] = field(default=())

    # -- looking things up ------------------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InputError("spec.groups", "unique group names", dup)

    def group(self, name: str) -> PermGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [g.name for g in self.groups]

    def keys(self) -> set[str]:
        """The state-dict entries some group permutes."""
        return {a.key for g in self.groups for a in g.axes}

    def groups_of(self, key: str) -> list[PermGroup]:
        return [g for g in self.groups if any(a.key == key for a in g.axes)]

    # -- permutations -----------------------------------------------------------------------------------------------

    def identity(self) -> Perms:
        return {g.name: np.arange(g.size) for g in self.groups}

    def random(self, rng: np.random.Generator) -> Perms:
        return {g.name: rng.permutation(g.size) for g in self.groups}

    def apply(
        self, params: Mapping[str, np.ndarray], perms: Mapping[str, np.ndarray], *, only: Iterable[str] | None = None
    ) -> dict[str, np.ndarray]:
        """``params`` with every group in ``perms`` applied (groups missing from ``perms`` stay as they are).

        ``only``: apply just these groups. Entries no group touches are returned as they are (not copied)."""
        wanted = set(perms) if only is None else set(only) & set(perms)
        out = dict(params)
        for g in self.groups:
            if g.name not in wanted:
                continue
            perm = np.asarray(perms[g.name])
            if perm.shape != (g.size,):
                raise InputError(f"perms.{g.name}", f"a permutation of {g.size} units", tuple(perm.shape))
            if _is_identity(perm):
                continue
            for axis in g.axes:
                out[axis.key] = axis.permute(np.asarray(out[axis.key]), perm)
        return out

    def apply_torch(self, state: Mapping[str, Any], perms: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """:meth:`apply` for a torch state dict (tensors in, tensors out, on their device)."""
        import torch

        out = dict(state)
        for g in self.groups:
            if g.name not in perms or _is_identity(np.asarray(perms[g.name])):
                continue
            perm = np.asarray(perms[g.name])
            for axis in g.axes:
                t = out[axis.key]
                index = axis.index(t.shape[axis.dim], perm)
                out[axis.key] = torch.index_select(t, axis.dim, torch.as_tensor(index, device=t.device))
        return out

    # -- checks -----------------------------------------------------------------------------------------------------

    def check(self, shapes: Mapping[str, Sequence[int]], *, where: str = "spec") -> None:
        """Every axis names an existing tensor and fits inside it (one line naming the first that does not)."""
        for g in self.groups:
            if g.size < 1:
                raise InputError(f"{where}.{g.name}.size", "at least 1 unit", g.size)
            for axis in g.axes:
                if axis.key not in shapes:
                    raise InputError(f"{where}.{g.name}", f"axes on tensors of the model (e.g. {next(iter(shapes), '?')})", axis.key)
                shape = tuple(shapes[axis.key])
                if not -len(shape) <= axis.dim < len(shape):
                    raise InputError(f"{where}.{g.name}.{axis.key}", f"an axis of a {len(shape)}-d tensor", axis.dim)
                if axis.start < 0 or axis.start + axis.span(g.size) > shape[axis.dim]:
                    raise InputError(
                        f"{where}.{g.name}.{axis.key}",
                        f"{axis.outer} x {g.size} x {axis.inner} units from {axis.start} within axis {axis.dim} of "
                        f"length {shape[axis.dim]}",
                        tuple(shape),
                    )

    def check_disjoint(self, shapes: Mapping[str, Sequence[int]] | None = None, *, where: str = "spec") -> None:
        """No two groups (and no group with itself) permute overlapping units of one axis: applying both would move a
        unit twice. Heads and the dimensions within each head (one group's units whole blocks of the other's) commute
        and may share an axis. ``shapes`` (key -> shape) counts ``dim: -1`` and ``dim: 1`` of a 2-d tensor as one
        axis. One line naming the two groups and the axis."""
        seen: dict[tuple[str, int], list[tuple[PermGroup, AxisRef]]] = {}
        for g in self.groups:
            for axis in g.axes:
                ndim = len(shapes[axis.key]) if shapes is not None and axis.key in shapes else 0
                dim = axis.dim % ndim if ndim else axis.dim
                for other, ref in seen.get((axis.key, dim), []):
                    if not axes_compatible(axis, ref, g.size, other.size) or (other is g and axis == ref):
                        what = f"group {g.name} twice" if other is g else f"groups {other.name} and {g.name}"
                        raise InputError(
                            f"{where}.{g.name}", "groups that permute disjoint units of each axis", f"{what} on {axis.key}[{dim}]"
                        )
                seen.setdefault((axis.key, dim), []).append((g, axis))

    # -- serialisation ----------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [g.to_dict() for g in self.groups],
            "fixed": [{"key": f.key, "dim": f.dim, "reason": f.reason} for f in self.fixed],
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "spec") -> PermutationSpec:
        """A spec from its dict form (JSON / YAML, e.g. a user's hand-written spec). Raises :class:`InputError` naming
        the first entry that is not what :meth:`to_dict` writes (a mapping where one is due, an integer, not a bool, for
        sizes and axes, text for names), whatever it holds instead: nothing of it is formatted but its type, so a
        value nested thousands of levels deep is one line too."""
        if not isinstance(data, Mapping) or not isinstance(data.get("groups"), list):
            raise InputError(where, "a mapping with a list of groups", type(data).__name__)
        groups = []
        for i, g in enumerate(data["groups"]):
            at = f"{where}.groups.{i}"
            entry = _entry(
                g,
                at,
                "name, size and axes [{key, dim, start?, outer?, inner?}]",
                ("name", "size", "axes"),
                ("probes", "kind", "fixed_width"),
            )
            name = _text(entry["name"], f"{at}.name")
            size = _integer(entry["size"], f"{at}.size", 1)
            axes = []
            for j, a in enumerate(_list(entry["axes"], f"{at}.axes", need=True)):
                a = _entry(a, f"{at}.axes.{j}", "{key, dim, start?, outer?, inner?}", ("key", "dim"), ("start", "outer", "inner"))
                axes.append(
                    AxisRef(
                        _text(a["key"], f"{at}.axes.{j}.key"), _integer(a["dim"], f"{at}.axes.{j}.dim"), **_segment(a, f"{at}.axes.{j}")
                    )
                )
            probes = []
            for j, p in enumerate(_list(entry.get("probes", []), f"{at}.probes")):
                p = _entry(
                    p,
                    f"{at}.probes.{j}",
                    "{node, dim, start?, outer?, inner?, hook?}",
                    ("node", "dim"),
                    ("start", "outer", "inner", "hook"),
                )
                probes.append(
                    Probe(
                        _text(p["node"], f"{at}.probes.{j}.node"),
                        _integer(p["dim"], f"{at}.probes.{j}.dim"),
                        hook=_text(p.get("hook", ""), f"{at}.probes.{j}.hook"),
                        **_segment(p, f"{at}.probes.{j}"),
                    )
                )
            groups.append(
                PermGroup(
                    name,
                    size,
                    tuple(axes),
                    tuple(probes),
                    _text(entry.get("kind", "channels"), f"{at}.kind"),
                    _text(entry.get("fixed_width", "") or "", f"{at}.fixed_width"),
                )
            )
        fixed = []
        for i, f in enumerate(_list(data.get("fixed", []), f"{where}.fixed")):
            f = _entry(f, f"{where}.fixed.{i}", "{key, dim, reason?}", ("key", "dim"), ("reason",))
            fixed.append(
                FixedAxis(
                    _text(f["key"], f"{where}.fixed.{i}.key"),
                    _integer(f["dim"], f"{where}.fixed.{i}.dim"),
                    _text(f.get("reason", ""), f"{where}.fixed.{i}.reason"),
                )
            )
        notes = tuple(_text(n, f"{where}.notes.{i}") for i, n in enumerate(_list(data.get("notes", []), f"{where}.notes")))
        return cls(tuple(groups), tuple(fixed), notes)

    def describe(self) -> str:
        """A readable listing: one block per group, then the fixed axes with their reasons."""
        lines = [f"{len(self.groups)} permutation groups, {sum(g.size for g in self.groups)} units"]
        for g in self.groups:
            lines.append(f"{g.name}  ({g.kind}, {g.size})" + (f"  width fixed: {g.fixed_width}" if g.fixed_width else ""))
            for a in g.axes:
                extra = "".join(
                    f" {k}={v}" for k, v in (("start", a.start), ("outer", a.outer), ("inner", a.inner)) if v != (0 if k == "start" else 1)
                )
                lines.append(f"    {a.key}[{a.dim}]{extra}")
        if self.fixed:
            lines.append(f"fixed axes ({len(self.fixed)}):")
            lines.extend(f"    {f.key}[{f.dim}]: {f.reason}" for f in self.fixed)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


# A spec file's size bound, checked before it is read: a spec lists each group's axes, a few hundred bytes per
# tensor; a model of a million tensors stays below it.
MAX_SPEC_BYTES = 256 * 2**20


def read_spec_json(path: str | Path) -> Any:
    """The data of a JSON permutation spec file (``rayfuse symmetry --json`` writes one), for
    :meth:`PermutationSpec.from_dict`. :class:`InputError` naming the file when it is missing, larger than
    :data:`MAX_SPEC_BYTES`, not UTF-8 text, not JSON, or nested deeper than the parser's recursion allows."""
    import json

    file = Path(path)
    try:
        size = file.stat().st_size
        if not file.is_file():
            raise InputError(str(file), "a JSON permutation spec file", "not a regular file")
        if size > MAX_SPEC_BYTES:
            raise InputError(str(file), f"a JSON permutation spec of at most {MAX_SPEC_BYTES // 2**20} MiB", f"{size / 2**20:.0f} MiB")
        raw = file.read_bytes()
    except OSError as exc:
        raise InputError(str(file), "a readable JSON permutation spec file", exc.strerror or type(exc).__name__) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(str(file), "UTF-8 text", f"byte 0x{raw[exc.start]:02x} at line {line}", "save the file as UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(str(file), "a JSON permutation spec", f"invalid JSON at line {exc.lineno}, column {exc.colno}", exc.msg) from None
    except RecursionError:
        raise InputError(str(file), "a JSON permutation spec nested a few hundred levels at most", "deeper nesting") from None


def _segment(entry: Mapping[str, Any], where: str) -> dict[str, int]:
    """An axis' or a probe's segment fields ``start`` (>= 0), ``outer`` and ``inner`` (>= 1), defaults filled in."""
    return {
        key: _integer(entry.get(key, default), f"{where}.{key}", low)
        for key, default, low in (("start", 0, 0), ("outer", 1, 1), ("inner", 1, 1))
    }


def _kind(value: Any) -> str:
    """What a value of a spec is, in words that never format the value itself (it may be nested arbitrarily deep)."""
    return repr(value) if isinstance(value, (int, float, str)) and len(str(value)) < 40 else type(value).__name__


def _entry(value: Any, where: str, expected: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``value`` as a mapping holding the ``required`` keys (``optional`` ones documents what else it may hold)."""
    if not isinstance(value, Mapping):
        raise InputError(where, expected, f"{_kind(value)}, not a mapping")
    for key in required:
        if key not in value:
            raise InputError(where, expected, f"no {key}")
    return value  # other keys are ignored, as they always were (a later version's fields read by an older one)


def _list(value: Any, where: str, *, need: bool = False) -> list[Any]:
    if not isinstance(value, (list, tuple)) or (need and not value):
        raise InputError(where, "a non-empty list" if need else "a list", _kind(value))
    return list(value)


def _integer(value: Any, where: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(where, "an integer", _kind(value))
    if low is not None and value < low:
        raise InputError(where, f"an integer >= {low}", int(value))
    return int(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InputError(where, "text", _kind(value))
    return value


def axes_compatible(a: AxisRef, b: AxisRef, size_a: int, size_b: int) -> bool:
    """Two groups may both permute one axis if their segments are disjoint, or if one's units are whole blocks of
    the other's (heads of head_dim dims and the dimensions within each head)."""
    if a.start + a.span(size_a) <= b.start or b.start + b.span(size_b) <= a.start:
        return True
    if a.start != b.start or a.span(size_a) != b.span(size_b):
        return False
    return a.inner % (size_b * b.inner) == 0 or b.inner % (size_a * a.inner) == 0


def _is_identity(perm: np.ndarray) -> bool:
    return bool(np.array_equal(perm, np.arange(len(perm))))


def invert(perm: np.ndarray) -> np.ndarray:
    """The permutation that undoes ``perm``."""
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(len(perm))
    return inverse


def compose(first: np.ndarray, then: np.ndarray) -> np.ndarray:
    """Applying ``first`` and then ``then`` equals applying ``compose(first, then)`` once."""
    return np.asarray(first)[np.asarray(then)]
