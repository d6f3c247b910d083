"""Parameters as ``dict[str, numpy.ndarray]``.

This is the only form parameters take outside a model: contiguous CPU arrays keyed by the model's ``state_dict``
names (buffers included). Ray stores such dicts in the object store and readers map them zero-copy (read-only).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from itertools import chain

import numpy as np
import torch
from torch import nn

__all__ = [
    "Params",
    "get_params",
    "take_params",
    "restore_taken",
    "model_with_params",
    "params_layout",
    "set_params",
    "check_params",
    "num_bytes",
    "params_equal",
]

Params = dict[str, np.ndarray]


def get_params(model: nn.Module) -> Params:
    """Copy a model's ``state_dict`` (parameters and buffers) into contiguous CPU numpy arrays."""
    # ndarray.copy(order="C"), not np.ascontiguousarray: the latter turns 0-d buffers (BatchNorm's
    # num_batches_tracked) into shape (1,), which set_params then rejects.
    return {name: t.detach().cpu().numpy().copy(order="C") for name, t in model.state_dict().items()}


def take_params(model: nn.Module) -> Params:
    """:func:`get_params` without the copy, where the model can give its memory away: on the CPU each parameter's
    array *is* that parameter's memory, and the parameter is left empty (``numel() == 0``) until
    :func:`restore_taken` gives it memory of its shape again, so the arrays alias nothing the model still uses.
    Buffers (BatchNorm's statistics: small) are copied as :func:`get_params` copies them. A model with a parameter
    off the CPU or not contiguous is copied out whole (:func:`get_params`) and keeps its memory.

    A client step that returns its work model's parameters and is done with the model (FedAvg's ``fit``) uses it: the
    reply costs no second copy of the model, which for a model of several GB is the difference between 2 and 3 x its
    size in the process that trains it."""
    named = dict(model.named_parameters())
    if not all(p.device.type == "cpu" and p.is_contiguous() for p in named.values()):
        return get_params(model)
    state = model.state_dict()
    taken = {id(p): p.detach().numpy() for p in named.values()}
    out = {
        name: taken[id(t)] if id(t) in taken else t.detach().cpu().numpy().copy(order="C")
        for name, t in ((name, named.get(name, tensor)) for name, tensor in state.items())
    }
    kept = getattr(model, "_rayfuse_taken", [])
    for p in named.values():
        kept.append((p, tuple(p.shape)))
        p.data = torch.empty(0, dtype=p.dtype)
    model._rayfuse_taken = kept  # type: ignore[assignment]
    return out


def restore_taken(model: nn.Module) -> nn.Module:
    """Give each parameter :func:`take_params` emptied new (uninitialised) memory of its shape; nothing to do for a
    model it never emptied. The caller loads values next (:func:`set_params`)."""
    for p, shape in getattr(model, "_rayfuse_taken", ()):
        p.data = torch.empty(shape, dtype=p.dtype)
    if hasattr(model, "_rayfuse_taken"):
        del model._rayfuse_taken
    return model


def tensors_over(params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Tensors over ``params``' arrays (no copy where an array is contiguous), for ``load_state_dict``, which copies
    them into the module (or, with ``assign=True``, only reads them). Arrays read from Ray's object store or
    memory-mapped from a checkpoint are read-only; nothing writes through these tensors, so PyTorch's warning about
    non-writable arrays, which would print before any one-line message, is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in params.items()}


def set_params(model: nn.Module, params: Mapping[str, np.ndarray]) -> nn.Module:
    """Load ``params`` into ``model`` (copying). Keys and shapes must match exactly."""
    problem = check_params(params, {k: v for k, v in model.state_dict().items()}, check_finite=False)
    if problem:
        raise ValueError(f"parameters do not fit the model: {problem}")
    model.load_state_dict(tensors_over(params))
    return model


def build_on_meta(build: Callable[[], nn.Module], *, meta: bool = True) -> nn.Module | None:
    """``build()`` on PyTorch's meta device (shapes and dtypes, no memory, no initialisation), or ``None`` where
    ``meta`` is false (:func:`rayfuse.models.registry.builds_on_meta`) or the build fails there: the caller then builds
    the model for real, which raises the build's own errors."""
    if not meta:
        return None
    try:
        with torch.device("meta"):
            return build()
    except Exception:  # noqa: BLE001 -- any failure here only means "build it for real", which raises its own errors
        return None


def model_with_params(build: Callable[[], nn.Module], params: Mapping[str, np.ndarray], *, meta: bool = True) -> nn.Module:
    """The model ``build()`` makes, holding ``params`` *in their own memory*, to predict with: built on PyTorch's meta
    device (no memory, no initialisation) and given tensors over ``params``' arrays (``load_state_dict(assign=True)``),
    so evaluating a model of several GB costs no second copy of it nor the time to initialise one. Keys, shapes and
    dtypes must match exactly (``ValueError`` otherwise, as :func:`set_params`). A model that cannot be built on the
    meta device (its constructor computes with real tensors) or that holds state ``params`` do not give (buffers
    outside its ``state_dict``) is built for real and loaded by copy (:func:`set_params`) instead.

    The model's tensors are ``params``' memory, which may be read-only (Ray's object store): predict with it, never
    train it. ``meta=False`` (a model whose building code rayfuse does not own:
    :func:`rayfuse.models.registry.builds_on_meta`) builds it for real and copies."""
    model = build_on_meta(build, meta=meta)
    if model is not None:
        problem = check_params(params, model.state_dict(), check_finite=False)
        if problem:
            raise ValueError(f"parameters do not fit the model: {problem}")
        model.load_state_dict(tensors_over(params), assign=True)  # the model only reads them (it predicts)
        if not any(t.is_meta for t in chain(model.parameters(), model.buffers())):
            return model
    return set_params(build(), params)


def params_layout(build: Callable[[], nn.Module], *, meta: bool = True) -> Params:
    """The keys, shapes and dtypes of the model ``build()`` makes, as arrays that hold no memory (read-only zeros
    broadcast to each shape: ``nbytes`` is still the tensor's size): what :func:`check_params` compares a reply or a
    fused model against. Built on PyTorch's meta device, so a model of several GB costs nothing to describe; a model
    that cannot be built there, or has a dtype numpy lacks, is built for real and described from that, as is every
    model with ``meta=False`` (:func:`rayfuse.models.registry.builds_on_meta`)."""
    model = build_on_meta(build, meta=meta)
    try:
        state = model.state_dict() if model is not None else {}
        dtypes = {k: torch.empty((), dtype=t.dtype).numpy().dtype for k, t in state.items()}
    except TypeError:  # a dtype numpy lacks (bfloat16): described from a real build
        model = None
    if model is None:
        real = get_params(build())
        state, dtypes = real, {k: v.dtype for k, v in real.items()}
    return {k: np.broadcast_to(np.zeros((), dtype=dtypes[k]), tuple(t.shape)) for k, t in state.items()}


def check_params(
    params: Mapping[str, object], reference: Mapping[str, np.ndarray | torch.Tensor], *, check_finite: bool = True
) -> str | None:
    """Return why ``params`` cannot stand in for ``reference`` (keys, shapes, non-finite values), or ``None``."""
    if not isinstance(params, Mapping):
        return f"expected a mapping of arrays, got {type(params).__name__}"
    missing = sorted(set(reference) - set(params))
    extra = sorted(set(params) - set(reference))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:3]}{'...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"unexpected keys {extra[:3]}{'...' if len(extra) > 3 else ''}")
        return "; ".join(parts)
    for name, ref in reference.items():
        value = params[name]
        shape = tuple(getattr(value, "shape", ()))
        ref_shape = tuple(ref.shape)
        if shape != ref_shape:
            return f"{name}: shape {shape}, expected {ref_shape}"
        dtype, ref_dtype = getattr(value, "dtype", None), getattr(ref, "dtype", None)
        if dtype is not None and ref_dtype is not None and str(dtype) != str(ref_dtype).replace("torch.", ""):
            return f"{name}: dtype {dtype}, expected {str(ref_dtype).replace('torch.', '')}"
        if check_finite:
            arr = np.asarray(value)
            if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                return f"{name}: NaN or Inf values"
    return None


def num_bytes(params: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.asarray(v).nbytes for v in params.values()))


def params_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """Exact equality of two parameter dicts (same keys, shapes and values)."""
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
