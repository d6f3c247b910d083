"""Parameters as ``dict[str, numpy.ndarray]``.

This is the only form parameters take outside a model: contiguous CPU arrays keyed by the model's ``state_dict``
names (buffers included). Ray stores such dicts in the object store and readers map them zero-copy (read-only).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["Params", "get_params", "set_params", "check_params", "num_bytes", "params_equal"]

Params = dict[str, np.ndarray]


def get_params(model: nn.Module) -> Params:
    """Copy a model's ``state_dict`` (parameters and buffers) into contiguous CPU numpy arrays."""
    # ndarray.copy(order="C"), not np.ascontiguousarray: the latter turns 0-d buffers (BatchNorm's
    # num_batches_tracked) into shape (1,), which set_params then rejects.
    return {name: t.detach().cpu().numpy().copy(order="C") for name, t in model.state_dict().items()}


def set_params(model: nn.Module, params: Mapping[str, np.ndarray]) -> nn.Module:
    """Load ``params`` into ``model`` (copying). Keys and shapes must match exactly."""
    problem = check_params(params, {k: v for k, v in model.state_dict().items()}, check_finite=False)
    if problem:
        raise ValueError(f"parameters do not fit the model: {problem}")
    with warnings.catch_warnings():
        # Arrays read from Ray's object store are read-only; load_state_dict copies them, nothing writes through.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state = {k: torch.as_tensor(v) for k, v in params.items()}
    model.load_state_dict(state)
    return model


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
