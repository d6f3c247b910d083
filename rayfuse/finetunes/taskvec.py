"""Merges of fine-tunes of one base model, one tensor at a time, as mergekit computes them.

One implementation per idea. A task-vector merge (:func:`task_vector_merge`) is

    delta_i = x_i - base                                    (the task vectors)
    delta_i = sparsify(delta_i, density_i)                  (none | magnitude top-k: TIES | random drop: DARE)
    mask_i  = sign(w_i delta_i) == sign(sum_j w_j delta_j)  (consensus: none | sign election, TIES's "sum" method)
    merged  = sum_i mask_i w_i delta_i / (sum_i mask_i w_i)  (the divisor only with normalize; 0 -> 1)
    out     = base + lambda * merged

and ``task_arithmetic``, ``ties``, ``dare_linear`` and ``dare_ties`` are rows of :data:`TASK_VECTOR_METHODS` (which
sparsifier, which consensus rule, and mergekit's defaults for ``normalize`` and ``rescale``). :func:`linear` is
mergekit's ``linear`` (the weighted average of the models themselves) and :func:`slerp` its spherical interpolation
with the colinear fallback to ``lerp``. Everything is computed on float32 tensors (the caller upcasts); the operations
and their order follow mergekit (the repository and commit are in docs/references.md) so that the same inputs give the
same tensors.

Memory: the streaming forms (:func:`task_vector_merge_stream`, :func:`linear_stream`, :func:`slerp_owned`) take each
model's tensor from a loader, one at a time, and work in place on what the loaders return, so one tensor's merge holds
a fixed number of tensors of its size whatever the number of models (:func:`peak_tensors`): 2 for the averages (the
running sum and the model being added), 3 for task arithmetic (and the base), about 6 for TIES (one task vector while
torch's sort trims it: its float32 magnitudes, int64 indices and the sort's own buffer) and DARE-TIES, whose sign
election reads each model three times instead of holding every task vector (one bit per entry is kept between the
passes). The sums run model by model from zero, which is what ``torch.stack(...).sum(dim=0)`` computes for fewer than
16 models (tested against it), so the results stay mergekit's to the bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch

from rayfuse.finetunes.config import TASK_VECTOR_METHODS, TaskVectorMethod

__all__ = [
    "TaskVectorMethod",
    "TASK_VECTOR_METHODS",
    "peak_tensors",
    "sparsify_magnitude",
    "sparsify_random",
    "rescale_masked",
    "sign_consensus",
    "task_vector_merge",
    "task_vector_merge_stream",
    "linear",
    "linear_stream",
    "slerp",
    "slerp_owned",
]

Rescale = Literal["l1", "density"] | None
# a loader gives one model's tensor as a fresh tensor of the compute dtype that the merge may overwrite
Loader = Callable[[], torch.Tensor]


def peak_tensors(method: str, models: int) -> float:
    """How many tensors of a tensor's size (in the compute dtype) its merge holds at its peak, measured with a little
    margin (tests/finetunes/test_merge_memory.py): the running sum and one model for the averages, the base besides for
    task arithmetic, a random mask besides for DARE, 4 for slerp (both tensors and their directions), and for TIES and
    DARE-TIES the trim of one task vector (torch's sort: the magnitudes, int64 indices and its own buffer) or the last
    pass (sum, divisor, base, one task vector, the boolean masks), whatever the number of models. ``models``: every
    model read, the base included; the data-aware merges (their own code) are counted as every model plus 2."""
    factors = {"linear": 2.5, "average": 2.5, "weighted_average": 2.5, "task_arithmetic": 3.5, "dare_linear": 4.5}
    factors.update({"slerp": 4.5, "ties": 6.5, "dare_ties": 6.5})
    return factors.get(method, models + 2.0)


def rescale_masked(tensor: torch.Tensor, mask: torch.Tensor, rescale: Rescale, density: float, eps: float = 1e-7) -> torch.Tensor:
    """``tensor * mask``, rescaled: ``"l1"`` to the L1 norm ``tensor`` had (mergekit's ``rescale: true``; left as
    masked when either norm is below ``eps``), ``"density"`` by ``1 / density`` (the DARE paper's rescale, which keeps
    each entry's expectation), ``None`` not at all."""
    masked = tensor * mask
    if rescale is None:
        return masked
    if rescale == "density":
        return masked / density
    before, after = tensor.abs().sum(), masked.abs().sum()
    if before < eps or after < eps:
        return masked
    return masked * (before / after)


def sparsify_magnitude(delta: torch.Tensor, density: float, rescale: Rescale = None) -> torch.Tensor:
    """TIES's trim: keep the ``int(density * numel)`` entries of largest magnitude (ties broken as torch's argsort
    breaks them, as in mergekit), zero the rest."""
    if density >= 1:
        return delta
    out = delta.clone(memory_format=torch.contiguous_format)
    _magnitude_(out, density, rescale)
    return out


def _magnitude_(delta: torch.Tensor, density: float, rescale: Rescale) -> Scale:
    """:func:`sparsify_magnitude` in place on a contiguous ``delta``, by selection rather than mergekit's sort: the
    ``k``-th largest float32 magnitude is found with ``numpy.partition`` (introselect, linear time: about 8x faster than
    the sort on tens of millions of entries) and every entry below it is zeroed. That keeps exactly mergekit's top
    ``k`` (``argsort`` then a 0/1 mask) whenever the entries at that magnitude are all kept (no tie to break) or that
    magnitude is 0 (what is trimmed then is zeros, whose value trimming does not change); only when nonzero entries
    tie across the cut does the order argsort would give them decide, and then the magnitudes are sorted as mergekit
    sorts them (:func:`_magnitude_sorted_`). A trimmed entry becomes ``0`` (mergekit's ``x * 0`` differs only in the
    sign of a zero). Peak: ``delta`` plus 2 float32 tensors of its size (the magnitudes and the partition's copy) and
    one boolean mask; the sort fallback's is the module docstring's. Returns the rescale applied (:func:`_rescale_`)."""
    if density >= 1:
        return None
    flat = delta.view(-1)
    n = flat.numel()
    k = int(density * n)
    before = flat.abs().sum() if rescale == "l1" else None
    if k > 0:  # mergekit asserts k > 0; here a tensor too small to keep one entry at this density contributes nothing
        magnitudes = flat.abs().float()  # mergekit sorts float32 magnitudes on the CPU
        cut = float(np.partition(magnitudes.numpy(), n - k)[n - k])  # the k-th largest magnitude
        if cut > 0:
            kept = magnitudes >= cut
            if int(kept.sum()) == k:
                flat.masked_fill_(kept.logical_not_(), 0)
            else:  # nonzero magnitudes tie across the cut: which of them are kept is argsort's order
                del kept
                _magnitude_sorted_(flat, magnitudes, k)
        del magnitudes
    else:
        flat.zero_()
    return _rescale_(flat, rescale, density, before)


def _magnitude_sorted_(flat: torch.Tensor, magnitudes: torch.Tensor, k: int) -> None:
    """Zero the entries of ``flat`` past the ``k`` of largest ``magnitudes`` in the order mergekit's ``argsort`` gives
    (the magnitudes are sorted in place, ``torch.sort`` with them as its values output: the same permutation as
    ``argsort``, tested). Peak: 3 tensors of ``flat``'s size besides it (float32 magnitudes, int64 indices) and torch's
    sort's own buffer (measured: 2 more)."""
    order = torch.empty(flat.numel(), dtype=torch.long)
    torch.sort(magnitudes, descending=True, out=(magnitudes, order))
    flat.index_fill_(0, order[k:], 0)
    del order


# a rescale as applied: ("div", density) or ("mul", the L1 ratio), or None (none)
Scale = tuple[str, "float | torch.Tensor"] | None


def _rescale_(masked: torch.Tensor, rescale: Rescale, density: float, before: torch.Tensor | None, eps: float = 1e-7) -> Scale:
    """:func:`rescale_masked`'s rescale in place (``before``: the L1 norm before masking, for ``"l1"``); returns what
    it applied, for :func:`_apply_scale_` to apply again to the same masked tensor."""
    scale: Scale = None
    if rescale == "density":
        scale = ("div", density)
    elif rescale == "l1":
        assert before is not None
        after = masked.abs().sum()
        if not (before < eps or after < eps):
            scale = ("mul", before / after)
    _apply_scale_(masked, scale)
    return scale


def _apply_scale_(masked: torch.Tensor, scale: Scale) -> None:
    if scale is not None:
        op, value = scale
        masked.div_(value) if op == "div" else masked.mul_(value)


def sparsify_random(delta: torch.Tensor, density: float, generator: torch.Generator, rescale: Rescale = None) -> torch.Tensor:
    """DARE's drop: keep each entry with probability ``density`` (a Bernoulli mask drawn from ``generator``), then
    rescale."""
    if density >= 1:
        return delta
    mask = torch.bernoulli(torch.full_like(delta, density, dtype=torch.float32), generator=generator)
    return rescale_masked(delta.to(torch.float32), mask, rescale, density).to(delta.dtype)


def _random_(delta: torch.Tensor, density: float, generator: torch.Generator, rescale: Rescale) -> Scale:
    """:func:`sparsify_random` in place: the same draws (``bernoulli_`` into the probabilities' own tensor gives
    ``torch.bernoulli``'s mask from the same generator state, tested). Peak: ``delta`` plus one float32 mask."""
    if density >= 1:
        return None
    if delta.dtype != torch.float32:  # float64 inputs: the out-of-place form's float32 round trip, as it is
        delta.copy_(sparsify_random(delta, density, generator, rescale))
        return _REDONE
    before = delta.abs().sum() if rescale == "l1" else None  # first: its magnitude copy is gone before the mask is made
    mask = torch.full_like(delta, density, dtype=torch.float32)
    mask.bernoulli_(mask, generator=generator)
    delta.mul_(mask)
    del mask
    return _rescale_(delta, rescale, density, before)


# the float64 random drop: its float32 round trip cannot be applied again from the kept entries; the stream keeps the
# whole task vector instead (float64 tensors are rare; the bound does not hold for them)
_REDONE: Scale = ("redone", 1.0)


def sign_consensus(weighted: torch.Tensor) -> torch.Tensor:
    """TIES's sign election (mergekit's ``sum`` method): the elected sign of each entry is the sign of the sum of the
    weighted task vectors (``>= 0``: positive); a task vector's entry agrees when its sign is that sign (a zero entry
    never agrees). ``weighted``: the stacked weighted task vectors, models first. Returns the boolean mask."""
    sign = weighted.sign()
    majority = (weighted.sum(dim=0) >= 0).to(weighted.dtype) * 2 - 1
    return sign == majority


def task_vector_merge(
    base: torch.Tensor,
    tuned: Sequence[torch.Tensor],
    weights: Sequence[float],
    densities: Sequence[float],
    method: TaskVectorMethod,
    *,
    normalize: bool,
    lam: float = 1.0,
    rescale: Rescale = None,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """``base + lambda * combine(sparsify(x_i - base))`` (the module docstring), for float32 tensors of one shape.
    ``generators``: one per model, for the random sparsifier. The inputs are left as they are (copies are merged)."""
    return task_vector_merge_stream(
        lambda: base.clone(memory_format=torch.contiguous_format),
        [lambda x=x: x.to(base.dtype, copy=True, memory_format=torch.contiguous_format) for x in tuned],  # type: ignore[misc]
        weights,
        densities,
        method,
        normalize=normalize,
        lam=lam,
        rescale=rescale,
        generators=generators,
    )


def task_vector_merge_stream(
    base: Loader,
    tuned: Sequence[Loader],
    weights: Sequence[float],
    densities: Sequence[float],
    method: TaskVectorMethod,
    *,
    normalize: bool,
    lam: float = 1.0,
    rescale: Rescale = None,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """:func:`task_vector_merge` from loaders, one model's tensor at a time, in place (the module docstring's memory).

    mergekit stacks the task vectors and computes ``(stack * w).sum(0)`` (and, for the sign election, the sum, then
    ``(stack * w * mask).sum(0)`` and ``(w * mask).sum(0)``); here each weighted task vector is added to a running sum
    from zero, in the models' order: the same float32 operations in the same order.

    The sign election needs every task vector twice (its sum elects the signs, then each is masked by them); rather
    than holding them all, each is trimmed once (the costly sort, or the random draw) and only which entries it kept
    (one bit each) and the rescale applied are kept; both later passes read the model's tensor again and redo the
    subtraction, the mask and the rescale, which give the same values (a trimmed entry is 0 either way)."""
    if method.sparsify == "random" and generators is None:
        raise ValueError("the random sparsifier needs one generator per model")

    def delta(i: int, b: torch.Tensor) -> torch.Tensor:
        x = tuned[i]()
        x.sub_(b)
        return x

    def sparsify(i: int, x: torch.Tensor) -> Scale:
        if method.sparsify == "magnitude":
            return _magnitude_(x, densities[i], rescale)
        if method.sparsify == "random":
            assert generators is not None
            return _random_(x, densities[i], generators[i], rescale)
        return None

    if not method.consensus:
        b = base()
        dtype, shape = b.dtype, b.shape
        w = torch.tensor(list(weights), dtype=dtype)
        mixed = torch.zeros(shape, dtype=dtype)
        for i in range(len(tuned)):
            x = delta(i, b)
            sparsify(i, x)
            mixed.add_(x.mul_(w[i]))
            del x
        divisor = w.reshape(-1, *([1] * len(shape))).sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    else:
        # each task vector trimmed once, the base read again for each (so that the sort runs beside nothing else)
        kept: list[tuple[np.ndarray | None, Scale, torch.Tensor | None]] = []
        for i in range(len(tuned)):
            b = base()
            x = delta(i, b)
            del b
            scale = sparsify(i, x)
            if scale == _REDONE:
                kept.append((None, None, x))
            elif method.sparsify is None or densities[i] >= 1:
                kept.append((None, None, None))  # nothing trimmed: the task vector is computed again as it is
            else:
                # the entries kept are the nonzero ones (a kept zero is a zero either way; a rescale only multiplies
                # by a factor >= 1, so it makes no entry zero)
                kept.append((np.packbits((x != 0).numpy().reshape(-1)), scale, None))
            del x
        b = base()
        dtype, shape = b.dtype, b.shape
        w = torch.tensor(list(weights), dtype=dtype)
        numel = b.numel()

        def weighted(i: int) -> torch.Tensor:
            """Model ``i``'s trimmed, rescaled, weighted task vector, computed again."""
            bits, scale, whole = kept[i]
            if whole is not None:
                x = whole.clone()
            else:
                x = delta(i, b)
                if bits is not None:
                    x.mul_(torch.from_numpy(np.unpackbits(bits, count=numel)).view(torch.bool).reshape(shape))
                    _apply_scale_(x, scale)
            return x.mul_(w[i])

        mixed = torch.zeros(shape, dtype=dtype)
        for i in range(len(tuned)):
            mixed.add_(weighted(i))
        positive = mixed >= 0  # the elected sign (sum >= 0: positive)
        mixed.zero_()
        divisor = torch.zeros(shape, dtype=dtype)
        for i in range(len(tuned)):
            x = weighted(i)
            agree = torch.where(positive, x > 0, x < 0)  # sign(x) == elected sign; a zero entry never agrees
            mixed.add_(x.mul_(agree))
            divisor.add_(agree, alpha=float(w[i]))  # w_i * agree, exact (agree is 0 or 1)
            del x, agree
        del positive, kept
        divisor.masked_fill_(divisor == 0, 1)
    if normalize:
        mixed.div_(divisor)
    del divisor
    if lam != 1:
        mixed.mul_(lam)
    return mixed.add_(b).to(dtype)


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, normalize: bool = True) -> torch.Tensor:
    """mergekit's ``linear``: ``sum_i w_i x_i`` (divided by ``sum_i w_i`` with ``normalize``)."""
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in tensors])  # torch.stack's
    return linear_stream(
        [lambda x=x: x.to(dtype, copy=True, memory_format=torch.contiguous_format) for x in tensors],  # type: ignore[misc]
        weights,
        normalize=normalize,
    )


def linear_stream(tensors: Sequence[Loader], weights: Sequence[float], *, normalize: bool = True) -> torch.Tensor:
    """:func:`linear` from loaders, one model's tensor at a time, in place: ``w_i * x_i`` added to a running sum from
    zero in the models' order (what mergekit's ``(w * stack).sum(0)`` computes)."""
    out: torch.Tensor | None = None
    w: torch.Tensor | None = None
    for i, load in enumerate(tensors):
        x = load()
        if out is None or w is None:
            out = torch.zeros_like(x)
            w = torch.tensor(list(weights), dtype=x.dtype)
        out.add_(x.mul_(w[i]))
        del x
    assert out is not None and w is not None
    if normalize:
        out.div_(w.reshape(-1, *([1] * out.dim())).sum(dim=0))
    return out


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = 0.9995, eps: float = 1e-8) -> torch.Tensor:
    """Spherical interpolation from ``v0`` (``t = 0``) to ``v1`` (``t = 1``) of the two tensors seen as flat vectors;
    ``lerp`` when their directions are within ``arccos(dot_threshold)`` of colinear. Computed in numpy float32 as
    mergekit computes it, returned in ``v0``'s dtype."""
    return slerp_owned(t, v0.detach().cpu().float().clone(), v1.detach().cpu().float().clone(), dot_threshold, eps, dtype=v0.dtype)


def slerp_owned(
    t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = 0.9995, eps: float = 1e-8, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`slerp` of two contiguous float32 tensors that it may overwrite (the result is computed into ``v0``'s
    memory): at most 4 tensors of their size at once (both inputs, the two directions while their dot product is
    taken). The same numpy float32 operations as :func:`slerp`'s out-of-place form, in place. ``dtype``: the result's
    (``v0``'s own by default)."""
    a, b = v0.numpy(), v1.numpy()
    norm = np.linalg.norm(a)
    a_dir = a / norm if norm > eps else a.copy()  # _unit(a), in memory of its own
    b_dir = _unit(b, eps)
    a_dir *= b_dir
    del b_dir
    dot = np.sum(a_dir)
    del a_dir
    if np.abs(dot) > dot_threshold:
        a *= 1 - t
        b *= t
    else:
        theta_0 = np.arccos(dot)
        sin_theta_0 = np.sin(theta_0)
        theta_t = theta_0 * t
        a *= np.sin(theta_0 - theta_t) / sin_theta_0
        b *= np.sin(theta_t) / sin_theta_0
    a += b
    return v0.to(dtype or v0.dtype)


def _unit(v: np.ndarray, eps: float) -> np.ndarray:
    norm = np.linalg.norm(v)
    return v / norm if norm > eps else v
