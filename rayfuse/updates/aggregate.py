"""Aggregation kernels: weighted averages of parameter dicts.

The kernel computes ``out = sum_k w_k * a_k`` in one read pass over the inputs: it walks the arrays in cache-sized
chunks, so the running sum of a chunk stays in cache while each input byte is read from memory once, and adds each
input with one fused BLAS ``axpy`` (``acc += w * a``). It therefore moves fewer bytes than copying the inputs
(``np.copyto`` reads and writes every byte); ``benchmarks/bench_aggregate.py`` measures both in the same run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy.linalg.blas import get_blas_funcs

__all__ = ["weighted_sum", "weighted_average", "normalize_weights"]

CHUNK = 1 << 16  # elements per chunk: the running sum (256 KiB of float32) stays in L2 (measured best of 2^13..2^18)


def normalize_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """Non-negative weights scaled to sum to 1 (uniform when ``None``)."""
    if n == 0:
        raise ValueError("nothing to aggregate")
    if weights is None:
        return [1.0 / n] * n
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"need {n} weights, got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero, got {w.tolist()}")
    return [float(x) for x in w / w.sum()]  # Python floats: float32 arrays stay float32 (NEP 50)


def weighted_sum(
    arrays: Sequence[np.ndarray], weights: Sequence[float], *, out: np.ndarray | None = None, chunk: int = CHUNK
) -> np.ndarray:
    """``sum_k weights[k] * arrays[k]`` for same-shaped arrays (inputs are never modified; read-only inputs are fine).

    Float inputs keep their dtype; other inputs are summed in float64. Inputs are assumed validated (same shapes,
    finite weights).
    """
    # Python floats: with numpy float64 weights, float32 arithmetic would silently run in float64 (NEP 50), 2x slower.
    weights = [float(w) for w in weights]
    first = arrays[0]
    dtype = first.dtype if first.dtype.kind == "f" else np.dtype(np.float64)
    if out is None:
        out = np.empty(first.shape, dtype=dtype)
    elif out.shape != first.shape or not out.flags.c_contiguous:
        # out.reshape(-1) below would be a copy, and the sum would never reach ``out``
        raise ValueError(f"out must be a C-contiguous array of shape {first.shape}, got shape {out.shape}")
    flat = [np.ravel(a) for a in arrays]  # views for contiguous arrays
    out_flat = out.reshape(-1)
    n = out_flat.size
    axpy = get_blas_funcs("axpy", dtype=out.dtype) if out.dtype in (np.float32, np.float64) else None
    tmp = None if axpy is not None else np.empty(min(chunk, n), dtype=out.dtype)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        acc = out_flat[start:stop]
        np.multiply(flat[0][start:stop], weights[0], out=acc, casting="unsafe")
        for a, w in zip(flat[1:], weights[1:]):
            x = a[start:stop]
            if axpy is not None:
                axpy(x if x.dtype == out.dtype else x.astype(out.dtype), acc, a=w)  # in place: acc is a contiguous view
            else:  # float16 and friends: no BLAS routine
                assert tmp is not None  # allocated above exactly when there is no axpy
                np.multiply(x, w, out=tmp[: stop - start], casting="unsafe")
                np.add(acc, tmp[: stop - start], out=acc)
    return out


def weighted_average(params: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None = None) -> dict[str, np.ndarray]:
    """Weighted average of parameter dicts, key by key (FedAvg's aggregation, McMahan et al. 2017, eq. 1).

    ``weights`` default to uniform and are normalised to sum to 1. Float arrays keep their dtype; integer buffers
    (e.g. BatchNorm's ``num_batches_tracked``) are averaged in float64 and rounded back. Inputs must share keys and
    shapes (validated updates).
    """
    w = normalize_weights(weights, len(params))
    out: dict[str, np.ndarray] = {}
    for key in params[0]:
        arrays = [p[key] for p in params]
        if arrays[0].dtype.kind == "f":
            out[key] = weighted_sum(arrays, w)
        else:
            out[key] = np.rint(weighted_sum(arrays, w)).astype(arrays[0].dtype)
    return out
