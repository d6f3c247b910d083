"""What leaves ``rayfuse fuse`` and comes back: tied tensors, finite values in the dtype written, and a fused model
(widened or not) loadable in one call from the metadata the run writes beside its tensors (:func:`load_fused`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError
from rayfuse.io import TORCH_ONLY_FLOATS, params_exist, parse_json, read_checkpoint, read_params_metadata

__all__ = ["tied_names", "fill_ties", "check_ties", "retie", "check_fused", "load_fused"]


_META_ARCHITECTURE, _META_ARGS, _META_SHAPE, _META_SPEC, _META_WIDTHS = (
    "rayfuse.architecture",
    "rayfuse.architecture_args",
    "rayfuse.input_shape",
    "rayfuse.spec",
    "rayfuse.widths",
)


def tied_names(model: Any) -> list[tuple[str, ...]]:
    """The state-dict keys that name one tensor of ``model`` (tied parameters: an embedding shared with the decoder,
    one layer's weight assigned to another, a module registered under two names), one tuple per tensor held under
    several names, in state-dict order."""
    names: dict[int, list[str]] = {}
    for key, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(key)
    return [tuple(group) for group in names.values() if len(group) > 1]


def fill_ties(params: dict[str, np.ndarray], ties: Sequence[tuple[str, ...]]) -> None:
    """Give every name of a tied tensor its values where a file holds only some of the names (safetensors'
    ``save_model`` keeps one name per shared tensor)."""
    for group in ties:
        present = [k for k in group if k in params]
        if present:
            for key in group:
                params.setdefault(key, params[present[0]])


def check_ties(params: Mapping[str, np.ndarray], ties: Sequence[tuple[str, ...]], *, where: str, after: str = "") -> None:
    """Every name of a tied tensor holds the same values (one line naming the first that differs). ``after``: the
    method that produced ``params`` (a fused model), named in the message."""
    for group in ties:
        present = [k for k in group if k in params]
        for key in present[1:]:
            first, other = np.asarray(params[present[0]]), np.asarray(params[key])
            if first.shape != other.shape or not np.array_equal(first, other, equal_nan=True):
                if after:
                    raise InputError(
                        f"{where}: {key}",
                        f"the values of {present[0]} (the architecture ties them)",
                        f"different values after {after}",
                        "nothing was written; a spec must give tied tensors the same groups",
                    )
                raise InputError(
                    f"{where}: {key}",
                    f"the values of {present[0]} (the architecture ties them: one tensor under two names)",
                    "different values",
                    "a model of this architecture cannot hold two values there",
                )


def retie(model: Any, ties: Sequence[tuple[str, ...]]) -> Any:
    """Make every name of each group in ``ties`` hold one tensor again (the first name's), after a resize gave each
    module a tensor of its own. Returns ``model``."""
    for group in ties:
        tensor = _slot(model, group[0])
        for key in group[1:]:
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if attr in module._parameters:
                module._parameters[attr] = tensor
            else:
                module._buffers[attr] = tensor
    return model


def _slot(model: Any, key: str) -> Any:
    owner, _, attr = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def check_fused(fused: Mapping[str, np.ndarray], ties: Sequence[tuple[str, ...]], dtype: str | None, *, where: str, method: str) -> None:
    """What leaves ``fuse`` is checked like what enters it, before anything is written: every float tensor is finite
    in the dtype it is written in (``dtype``; ``None``: its own), and tied tensors (``ties``) hold one value. One line
    naming the output file and the first tensor that fails."""
    import torch

    # InputError (exit 2), not NonFiniteError (a run that failed, exit 1): the inputs were checked finite and these
    # fusions are deterministic, so a NaN or Inf here follows from the files and the fuse file's weights and dtype,
    # which the user changes; the hint says which
    for key, value in fused.items():
        if value.dtype.kind != "f":
            continue
        if not np.isfinite(value).all():
            raise InputError(
                f"{where}: {key}",
                "finite values in the fused model",
                f"NaN or Inf after {method}",
                "the inputs are finite, so the fusion overflowed (values near the float range, or weights that scale them "
                "past it); nothing was written",
            )
        if dtype is None or np.dtype(value.dtype).name == dtype:
            continue
        if dtype in TORCH_ONLY_FLOATS:
            finite = bool(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)).to(getattr(torch, dtype)).isfinite().all())
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                finite = bool(np.isfinite(value.astype(dtype)).all())
        if not finite:
            largest = float(np.abs(value).max())
            raise InputError(
                f"{where}: {key}",
                f"values that {dtype} can hold",
                f"{largest:.4g} (Inf once written as {dtype})",
                "write a wider dtype (dtype: float32); nothing was written",
            )
    check_ties(fused, ties, where=where, after=method)


def _read_fused(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A model file's tensors and (safetensors) metadata."""
    params, _ = read_checkpoint(path)
    if path.suffix != ".safetensors" and not path.is_dir() and not path.name.endswith(".index.json"):
        return dict(params), {}
    return dict(params), read_params_metadata(path)  # read_checkpoint has read it: the header is valid


def _build_for_load(architecture: Any, args: Mapping[str, Any] | None, meta: Mapping[str, str], where: str) -> Any:
    import copy

    from torch import nn

    if isinstance(architecture, str):
        from rayfuse.models.architecture import build_architecture

        if args is None and meta.get(_META_ARCHITECTURE) == architecture and _META_ARGS in meta:
            args = parse_json(meta[_META_ARGS], f"{where}: metadata {_META_ARGS}", "a JSON object")
        return build_architecture(architecture, args, where="architecture", args_where="args")
    if isinstance(architecture, nn.Module):  # an instance: a copy of it receives the tensors
        if args:
            raise InputError("args", "no arguments with a model instance (they are for a class or factory)", sorted(args))
        return copy.deepcopy(architecture).eval()
    if not callable(architecture):
        raise InputError(
            "architecture", '"module:Class", an nn.Module class or a function returning an nn.Module', type(architecture).__name__
        )
    name = getattr(architecture, "__qualname__", type(architecture).__name__)
    try:
        model = architecture(**dict(args or {}))
    except Exception as exc:  # the user's constructor: one line naming it
        raise InputError(
            "args", f"keyword arguments {name} accepts", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        ) from None
    if not isinstance(model, nn.Module):
        raise InputError("architecture", "a class or function returning a torch.nn.Module", type(model).__name__)
    return model.eval()


def load_fused(
    architecture: Any, path: str | Path, *, args: Mapping[str, Any] | None = None, input_shape: Sequence[int] | None = None
) -> Any:
    """The model a fused file holds, in one call: ``architecture`` built and loaded with the file's tensors, in eval mode.

    Parameters
    ----------
    architecture : str, nn.Module class, function or nn.Module
        ``"module:Class"`` / ``"torchvision:<name>"`` (as a fuse file's ``architecture:``), a class or a function that
        returns the model, or a model (copied).
    path : str or Path
        A ``.safetensors`` file written by ``rayfuse fuse`` (or any checkpoint of the architecture).
    args : mapping, optional
        Keyword arguments for the architecture; by default the fuse file's ``architecture_args`` recorded in the
        output when ``architecture`` is the reference it names.
    input_shape : sequence of int, optional
        One input's shape, for a file whose widths differ from the architecture's and that does not record its
        permutation spec (one not written by ``rayfuse fuse``): the spec is derived on it.

    A file whose groups grew (``merge: nonparametric``) records its spec and widths: the model is built at those
    widths (each layer's size attributes follow) and tied tensors stay one tensor. Raises :class:`InputError` (one
    line naming the file and tensor) for a file that does not fit the architecture.
    """

    import torch

    from rayfuse.models.architecture import check_checkpoint_fits
    from rayfuse.models.params import tensors_over

    file = Path(path)
    if not params_exist(file):
        raise InputError(str(path), "an existing model file (.safetensors, .pt, .pth, .bin)", "no such file")
    params, meta = _read_fused(file)
    model = _build_for_load(architecture, args, meta, str(file))
    ties = tied_names(model)
    fill_ties(params, ties)
    check_ties(params, ties, where=str(file))
    state = model.state_dict()
    if not any(k in params and tuple(np.shape(params[k])) != tuple(v.shape) for k, v in state.items()):
        check_checkpoint_fits(model, params, where=file, ref="the architecture")
        model.load_state_dict(tensors_over(params))
        return model.eval()
    from rayfuse.symmetry import PermutationSpec, derive_spec, resize_with_spec

    shape = tuple(int(n) for n in input_shape) if input_shape is not None else None
    if shape is None and _META_SHAPE in meta:
        listed = parse_json(meta[_META_SHAPE], f"{file}: metadata {_META_SHAPE}", "a JSON list of integers")
        try:
            shape = tuple(int(n) for n in listed)
        except (TypeError, ValueError):
            raise InputError(f"{file}: metadata {_META_SHAPE}", "a JSON list of integers", meta[_META_SHAPE][:40]) from None
    if _META_SPEC in meta:
        where_spec = f"{file}: metadata {_META_SPEC}"
        spec = PermutationSpec.from_dict(parse_json(meta[_META_SPEC], where_spec, "a JSON permutation spec"), where=where_spec)
        try:
            spec.check({k: tuple(v.shape) for k, v in state.items()}, where="spec")
        except InputError as exc:  # the architecture was built otherwise than the fuse file built it
            raise InputError(
                f"{file}: metadata {_META_SPEC}",
                f"the architecture as the fuse file built it ({exc.path.removeprefix('spec.')}: {exc.expected})",
                exc.got,
                "pass the fuse file's architecture_args as args=",
            ) from None
    elif shape is not None:
        spec = derive_spec(model, torch.zeros((2, *shape)))
    else:
        key = next(k for k, v in state.items() if k in params and tuple(np.shape(params[k])) != tuple(v.shape))
        raise InputError(
            f"{file}: {key}",
            f"shape {tuple(state[key].shape)} (the architecture's), or a file that records its widths (rayfuse fuse writes them)",
            tuple(np.shape(params[key])),
            "give input_shape= to derive the groups",
        )
    if shape is None:
        raise InputError(
            f"{file}: metadata {_META_SHAPE}", "one input's shape, to check the widened model runs", "none", "give input_shape="
        )
    return retie(resize_with_spec(model, spec, params, (2, *shape), where=str(file)), ties).eval()
