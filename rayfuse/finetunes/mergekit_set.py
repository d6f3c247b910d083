"""mergekit's merges that :mod:`rayfuse.finetunes.taskvec` lacks, as :class:`TensorMerge` entries for ``rayfuse fuse``.

Each is mergekit's operation for one tensor (arcee-ai/mergekit at commit a6e4028: ``mergekit/sparsify.py`` and
``mergekit/merge_methods/``), with its parameter names and defaults and the same float operations in the same order,
so that a deterministic merge gives mergekit's tensor to the bit:

- ``breadcrumbs``, ``breadcrumbs_ties``, ``della``, ``della_linear``: mergekit's general task arithmetic (the task
  vectors stacked, weighted, summed; the sign election of TIES for ``breadcrumbs_ties`` and ``della``) with its two
  other trims, :func:`magnitude_outliers` and :func:`della_magprune`;
- ``sce``, ``model_stock``, ``karcher``, ``multislerp``, ``nuslerp``, ``nearswap``: mergekit's functions as written.

Where they part from mergekit (each a case where mergekit's result is not what it means, or an error):

- breadcrumbs: where ``int(gamma * numel)`` is 0 (mergekit's default ``gamma: 0.01`` on a tensor of fewer than 100
  entries: norms, biases), mergekit's mask ``indices[n_bot:-0]`` is empty and the whole task vector is dropped; here
  no outlier is dropped and the ``density`` smallest-first trim alone applies.
- della: a row of one entry (the second dimension of size 1, or a 0-D or one-entry tensor) has no rank range, and
  mergekit's keep probability is NaN (``torch.bernoulli`` fails); here it is ``density``, the middle of the range.
- the random drops (della's) draw from the generators given, one per model, not from torch's global generator.
- mergekit orders the models of ``sce`` and ``multislerp`` as a Python set of its model references does (which
  changes with the hash seed of each process), so its own sums over the models change in their last bits from run to
  run; here they are in the models' order (in mergekit's order, the same to the bit).
- ``sce`` with ``select_topk <= 0``: mergekit's mask has the stack's shape and its output the wrong shape; here
  nothing is kept, and the result is the base.

``int8_mask`` (the sign election's mask in int8: a memory saving on mergekit's side) is taken and changes no value.
Model counts (mergekit raises at merge time; the runner checks them first): :data:`MODEL_COUNTS`. Whole-model
options all have a tensor-by-tensor form: ``model_stock``'s ``filter_wise`` (one angle per row, over the last
dimension) and ``nuslerp``'s ``nuslerp_row_wise`` and ``nuslerp_flatten`` are per tensor, and are supported.

Memory: each function is given every model's tensor (and the base's) and keeps mergekit's stacks, so ``peak`` grows
with ``models`` (the models read, the base included): the inputs, the stack of task vectors (written into one by one)
and the work beside it. Measured (VmHWM in a fresh process, 40 MB float32 tensors, 2 to 6 models and a base), in
tensors of that size: ``2 models + 4`` for the trims without sign election, ``4.25 models - 2.25`` with it (the
election's signs and weighted mask are the stack's size), at most ``4 models + 1`` for sce, ``2 models + 2`` for
model_stock, ``2 models + 5`` for karcher, ``3 models + 1`` for multislerp, ``models + 5`` for nuslerp and
``models + 4`` for nearswap; each ``peak`` adds a margin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from rayfuse.finetunes.taskvec import Rescale, rescale_masked, sign_consensus
from rayfuse.finetunes.tensor_merge import MergeFn, TensorMerge

__all__ = ["MERGES", "MODEL_COUNTS", "magnitude_outliers", "della_magprune"]

_MERGEKIT = "mergekit (arcee-ai/mergekit at a6e4028)"

# how many fine-tuned models each merge takes besides the base (at least, at most: None for no bound); mergekit
# raises at merge time, the runner refuses before the run
MODEL_COUNTS: dict[str, tuple[int, int | None]] = {
    "breadcrumbs": (1, None),
    "breadcrumbs_ties": (1, None),
    "della": (1, None),
    "della_linear": (1, None),
    "sce": (1, None),
    "model_stock": (2, None),
    "karcher": (1, None),
    "multislerp": (1, None),
    "nuslerp": (2, 2),
    "nearswap": (1, 1),
}

PerModel = Sequence[Mapping[str, float]]
Globals = Mapping[str, float | bool]


def magnitude_outliers(delta: torch.Tensor, density: float, gamma: float, rescale: Rescale = None) -> torch.Tensor:
    """Model Breadcrumbs' trim (mergekit's ``magnitude_outliers``): drop the ``int(gamma * numel)`` entries of
    largest magnitude and the smallest, so that ``int(density * numel)`` remain (fewer outliers dropped where both do
    not fit), then rescale. The module docstring says where it parts from mergekit (``int(gamma * numel) == 0``)."""
    if density >= 1:
        return delta
    numel = delta.numel()
    target = int(density * numel)
    n_top = int(gamma * numel)
    n_bot = numel - target - n_top
    if n_bot < 0:
        n_top += n_bot
        n_bot = 0
    order = torch.sort(delta.abs().reshape(-1).float(), descending=False).indices  # float32 magnitudes, as mergekit
    mask = torch.zeros_like(delta)
    mask.view(-1)[order[n_bot : numel - n_top]] = 1
    del order
    return rescale_masked(delta, mask, rescale, density)


def della_magprune(
    delta: torch.Tensor, density: float, epsilon: float, generator: torch.Generator, rescale: Rescale = None
) -> torch.Tensor:
    """DELLA's MagPrune (mergekit's ``della_magprune``): each entry kept with a probability from ``density -
    epsilon`` (the smallest magnitude of its row) to ``density + epsilon`` (the largest), linear in its rank along
    the second dimension (a 1-D tensor is one row), drawn from ``generator``; then rescaled, in float32."""
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise ValueError(f"della: density +/- epsilon must be in (0, 1), got density {density}, epsilon {epsilon}")
    work = torch.float32  # mergekit's on the CPU for any dtype but bfloat16 (never given here)
    shape = delta.shape
    rows = delta
    while rows.dim() < 2:  # mergekit unsqueezes once (a 0-D tensor fails there)
        rows = rows.unsqueeze(0)
    ranks = torch.argsort(rows.abs(), dim=1, descending=False).argsort(dim=1).to(work) + 1
    lowest = ranks.min(dim=1, keepdim=True).values
    highest = ranks.max(dim=1, keepdim=True).values
    # 0 / 0 (rows of one entry) is NaN, which mergekit's bernoulli refuses: that entry's probability is density
    rank_norm = ((ranks - lowest) / (highest - lowest)).clamp(0, 1).nan_to_num_(nan=0.5)
    del ranks
    probs = (density - epsilon) + rank_norm * 2 * epsilon
    del rank_norm
    mask = torch.bernoulli(probs, generator=generator).to(work)
    del probs
    return rescale_masked(rows.to(work), mask, rescale, density).to(delta.dtype).reshape(shape)


# a task vector's trim: (task vector, the model's parameters, the rescale, the model's generator or None)
Trim = Callable[[torch.Tensor, Mapping[str, float], Rescale, torch.Generator | None], torch.Tensor]


def _general_task_arithmetic(trim: Trim, consensus: bool) -> MergeFn:
    """mergekit's ``GTATask.execute`` with the trim given: each task vector ``x_i - base`` trimmed, the stack
    weighted, the signs elected (``consensus``) and the agreeing entries summed (divided by their weights with
    ``normalize``), times ``lambda``, added to the base."""

    def merge(
        base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
    ) -> torch.Tensor:
        assert base is not None  # base="required"
        if not tuned:
            return base
        rescale: Rescale = "l1" if g["rescale"] else None
        # torch.stack of the trimmed task vectors, written into the stack one by one (not all held beside it)
        weighted = torch.empty((len(tuned), *base.shape), dtype=base.dtype)
        for i, (x, p) in enumerate(zip(tuned, per_model, strict=True)):
            weighted[i] = trim(x.to(base.dtype).sub_(base), p, rescale, generators[i] if i < len(generators) else None)
        weights = torch.tensor([p["weight"] for p in per_model], dtype=weighted.dtype)
        while weights.dim() < weighted.dim():
            weights.unsqueeze_(-1)
        weighted.mul_(weights)
        if consensus:
            mask = sign_consensus(weighted)
            mixed = weighted.mul_(mask).sum(dim=0)
            divisor = (weights * mask).sum(dim=0)
            del mask
            divisor[divisor == 0] = 1
        else:
            mixed = weighted.sum(dim=0)
            divisor = weights.sum(dim=0)
            divisor[divisor.abs() < 1e-8] = 1
        del weighted
        if g["normalize"]:
            mixed /= divisor
        if g["lambda"] != 1:
            mixed *= g["lambda"]
        return (base + mixed).to(base.dtype)

    return merge


def _breadcrumbs_trim(delta: torch.Tensor, p: Mapping[str, float], rescale: Rescale, generator: torch.Generator | None) -> torch.Tensor:
    return magnitude_outliers(delta, p["density"], p["gamma"], rescale)


def _della_trim(delta: torch.Tensor, p: Mapping[str, float], rescale: Rescale, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:
        raise ValueError("della's random drop needs one generator per model")
    return della_magprune(delta, p["density"], p["epsilon"], generator, rescale)


def sce(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """SCE (mergekit's ``sce_merge``): the task vectors restricted to the ``select_topk`` share of the entries where
    they vary most across the models, signs elected, then averaged with each model's weight its mean squared task
    vector over their sum, among the agreeing entries."""
    assert base is not None  # base="required"
    if not tuned:
        return base
    task_vectors = torch.stack([x.sub_(base) for x in tuned], dim=0)  # x - base, in the inputs' memory
    select_topk = float(g["select_topk"])
    if select_topk < 1:
        task_vectors = task_vectors * _sce_mask(task_vectors, select_topk).unsqueeze(0)
    erase = sign_consensus(task_vectors)
    tv_weights = torch.mean(task_vectors**2, dim=list(range(1, task_vectors.dim())))
    weight_sum = torch.sum(tv_weights).item()
    if abs(weight_sum) < 1e-6:
        tv_weights = torch.ones_like(tv_weights) / tv_weights.shape[0]
    else:
        tv_weights = tv_weights / weight_sum
    while tv_weights.dim() < task_vectors.dim():
        tv_weights = tv_weights.unsqueeze(-1)
    erased = tv_weights * erase
    del erase
    merged = (task_vectors * erased).sum(dim=0)
    del task_vectors
    return base + merged / torch.sum(erased, dim=0).clamp(min=1e-6)


def _sce_mask(task_vectors: torch.Tensor, density: float) -> torch.Tensor:
    """mergekit's ``sce_mask``: 1 on the ``int(density * nonzero)`` entries of largest variance across the models."""
    if density <= 0:  # nothing kept (mergekit's mask has the stack's shape here: the module docstring)
        return torch.zeros_like(task_vectors[0])
    var = torch.var(task_vectors, dim=0, unbiased=False)
    k = int(torch.count_nonzero(var) * density)  # a float32 product, as mergekit's
    if k == 0:
        return torch.zeros_like(var)
    _, indices = torch.topk(var.abs().view(-1), k=k, largest=True)
    mask = torch.zeros_like(var)
    mask.view(-1)[indices] = 1
    return mask


def model_stock(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Model Stock (mergekit's ``ModelStockMergeTask``): ``t * mean(models) + (1 - t) * base`` with ``t = N cos /
    (1 + (N - 1) cos)``, ``cos`` the mean pairwise cosine of the task vectors: of the whole tensor, or of each row
    (the last dimension; a 1-D tensor is one row) with ``filter_wise``."""
    assert base is not None  # base="required"
    if not tuned:
        return base
    if len(tuned) < 2:
        raise ValueError("model_stock needs at least 2 models besides the base")
    shape = base.shape
    w_0, ws = base, list(tuned)
    if g["filter_wise"]:
        if w_0.dim() == 1:
            w_0, ws = w_0.unsqueeze(0), [w.unsqueeze(0) for w in ws]
    else:
        w_0, ws = w_0.reshape(-1), [w.reshape(-1) for w in ws]
    offsets = [w - w_0 for w in ws]
    cos_thetas = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1 :]:
            norm_product = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cos_thetas.append(((a * b).sum(dim=-1) / norm_product.clamp(min=1e-6)).clamp(-1, 1))
    del offsets
    cos_theta = torch.stack(cos_thetas).mean(dim=0).unsqueeze(-1)
    n = len(ws)
    t = (n * cos_theta) / (1 + (n - 1) * cos_theta)
    total = ws[0] + 0  # Python's sum(ws): 0 + ws[0] + ws[1] + ...
    for w in ws[1:]:
        total += w
    return (t * (total / n) + (1 - t) * w_0).reshape(shape)


def karcher(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """The Karcher (Riemannian) mean of the models' directions on the unit sphere, scaled by the mean of their norms
    (mergekit's ``karcher_merge_tensors``, equal weights); a base given is one more model, the last (mergekit
    gathers ``base_model`` after the models and averages it with them)."""
    tensors = [*tuned, *([base] if base is not None else [])]
    if len(tensors) == 1:
        return tensors[0]
    max_iter, tol = int(g["max_iter"]), float(g["tol"])
    alphas = [1.0 / len(tensors)] * len(tensors)
    norms: list[float] = []
    units: list[torch.Tensor] = []
    for x in tensors:
        n = torch.linalg.norm(x.float())
        if n.item() == 0.0:
            norms.append(0.0)
            units.append(torch.zeros_like(x))
        else:
            norms.append(n.item())
            units.append((x / n).to(x.dtype))
    valid = [i for i, n_i in enumerate(norms) if n_i > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    alpha_sum = sum(alphas[i] for i in valid)
    weights = [alphas[i] / alpha_sum for i in valid]
    valid_units = [units[i] for i in valid]
    u = torch.zeros_like(valid_units[0])
    for a, ui in zip(weights, valid_units, strict=True):
        u += a * ui
    norm_u = torch.linalg.norm(u.float()).item()
    u = valid_units[0].clone() if norm_u < tol else (u / norm_u).to(u.dtype)
    for _ in range(max_iter):
        step = torch.zeros_like(u)
        for a, ui in zip(weights, valid_units, strict=True):
            dot = torch.clamp(torch.dot(u.flatten(), ui.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < tol:
                continue
            step += a * (theta / torch.sin(theta)) * (ui - dot * u)
        norm_step = torch.linalg.norm(step.float())
        if norm_step.item() < tol:
            break
        u = (torch.cos(norm_step) * u + torch.sin(norm_step) * (step / norm_step)).to(u.dtype)
        u_norm = torch.linalg.norm(u.float())
        if u_norm.item() > tol:
            u = (u / u_norm).to(u.dtype)
    s = 0.0
    for a, n_i in zip(alphas, norms, strict=True):
        s += a * n_i
    return s * u


def multislerp(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Multi-SLERP (mergekit's ``multislerp``): the models (or, with a base, their task vectors) projected onto the
    unit sphere, averaged with their weights in the tangent space at their weighted mean direction, mapped back and
    scaled by the weighted mean norm (plus the base). Two models whose weighted directions cancel are averaged
    linearly; more raise, as in mergekit (the data decide; no check before the run can)."""
    if len(tuned) == 1:
        return tuned[0]
    eps = float(g["eps"])
    shape = tuned[0].shape
    stack = torch.stack(list(tuned), dim=0)
    if base is not None:
        stack -= base
    flat = stack.view(len(tuned), -1)
    weights = torch.tensor([p["weight"] for p in per_model], dtype=stack.dtype)
    if g["normalize_weights"]:
        weights = weights / weights.sum()
    norms = torch.norm(flat, dim=-1, keepdim=True)
    unit = flat.div_(norms + eps)  # mergekit's tensors_flat / (norms + eps), in the stack's memory
    del stack, flat
    mean = (unit * weights.view(-1, 1)).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps:
        if len(tuned) == 2:  # mergekit's stacked models (task vectors), computed again
            a, b = (tuned[0] - base, tuned[1] - base) if base is not None else (tuned[0], tuned[1])
            res = (a * weights[0] + b * weights[1]).view(shape)
            return res + base if base is not None else res
        raise ValueError(
            "multislerp: the weighted sum of the models' directions is zero (antipodal models with weights that "
            "balance out); give other weights"
        )
    mean = mean / mean_norm
    dots = (unit * mean).sum(-1, keepdim=True)
    tangent = dots * mean
    torch.sub(unit, tangent, out=tangent)  # mergekit's unit_tensors - dots * mean
    del unit, dots
    tangent_result = tangent.mul_(weights.view(-1, 1)).sum(0)
    del tangent
    tangent_norm = torch.norm(tangent_result) + eps
    result = mean * torch.cos(tangent_norm) + tangent_result * (torch.sin(tangent_norm) / tangent_norm)
    result = (result * (norms.squeeze(-1) * weights).sum()).view(shape)
    return result + base if base is not None else result


def nuslerp(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """NuSLERP (mergekit's ``NuSlerpTask``): SLERP of the two models (or, with a base, of their task vectors, plus
    the base) at ``t = w_2 / (w_1 + w_2)`` (0.5 where the weights sum to about 0): of the flattened tensors
    (``nuslerp_flatten``), else of each row along the last dimension, or along the first with
    ``nuslerp_row_wise``; linear where colinear."""
    if len(tuned) != 2:
        raise ValueError("nuslerp merges exactly 2 models besides the base")
    weights = [p["weight"] for p in per_model]
    t = 0.5 if abs(sum(weights)) < 1e-6 else weights[1] / sum(weights)
    dim, flatten = 0 if g["nuslerp_row_wise"] else -1, bool(g["nuslerp_flatten"])
    if base is not None:
        return base + _nuslerp(t, tuned[0] - base, tuned[1] - base, dim=dim, flatten=flatten)
    return _nuslerp(t, tuned[0], tuned[1], dim=dim, flatten=flatten)


def _nuslerp(t: float, v0: torch.Tensor, v1: torch.Tensor, dim: int, flatten: bool, eps: float = 1e-8) -> torch.Tensor:
    """mergekit's ``nuslerp`` function."""
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif dim != -1:
        v0, v1 = v0.transpose(dim, -1), v1.transpose(dim, -1)
    v0_u = v0 / torch.norm(v0, dim=-1, keepdim=True).clamp(min=1e-7)
    v1_u = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=1e-7)
    cos_theta = torch.sum(v0_u * v1_u, dim=-1, keepdim=True)
    del v0_u, v1_u
    theta = torch.acos(cos_theta.clamp(-1, 1))
    sin_theta = torch.sin(theta)
    colinear = (sin_theta.abs() < eps).squeeze()
    res = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / sin_theta
    res[colinear] = (1 - t) * v0[colinear] + t * v1[colinear]
    if dim != -1 and not flatten:
        res = res.transpose(dim, -1)
    return res.reshape(shape)


def nearswap(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """NearSwap (mergekit's ``nearswap_merge``): each entry moves from the base to the model by ``min(1, t / |model -
    base|)``: entries where the two are within ``t`` take the model's value, the others keep nearer the base."""
    assert base is not None  # base="required"
    if not tuned:
        return base
    if len(tuned) != 1:
        raise ValueError("nearswap merges exactly 1 model with the base")
    a, b = base, tuned[0]
    weight = (float(g["t"]) / torch.abs(a - b).clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a


_TASK_ARITHMETIC = {"int8_mask": False, "lambda": 1.0}

MERGES: dict[str, TensorMerge] = {
    "breadcrumbs": TensorMerge(
        "breadcrumbs",
        _general_task_arithmetic(_breadcrumbs_trim, consensus=False),
        "task arithmetic on task vectors stripped of their largest (gamma) and smallest entries (Davari & Belilovsky 2023)",
        _MERGEKIT,
        per_model={"weight": None, "density": 1.0, "gamma": 0.01},
        globals={**_TASK_ARITHMETIC, "normalize": False, "rescale": False},
        peak=lambda models: 2 * models + 5.0,
    ),
    "breadcrumbs_ties": TensorMerge(
        "breadcrumbs_ties",
        _general_task_arithmetic(_breadcrumbs_trim, consensus=True),
        "Model Breadcrumbs' trim with TIES's sign election (Davari & Belilovsky 2023)",
        _MERGEKIT,
        per_model={"weight": None, "density": 1.0, "gamma": 0.01},
        globals={**_TASK_ARITHMETIC, "normalize": False, "rescale": False},
        peak=lambda models: 4.5 * models,
    ),
    "della": TensorMerge(
        "della",
        _general_task_arithmetic(_della_trim, consensus=True),
        "task vectors dropped at random, the smaller entries of each row more often (density +/- epsilon), rescaled, "
        "signs elected (Deep et al. 2024)",
        _MERGEKIT,
        per_model={"weight": None, "density": 1.0, "epsilon": 0.15},
        globals={**_TASK_ARITHMETIC, "normalize": True, "rescale": True},
        exact=False,
        peak=lambda models: 4.5 * models,
    ),
    "della_linear": TensorMerge(
        "della_linear",
        _general_task_arithmetic(_della_trim, consensus=False),
        "DELLA's magnitude-ranked random drop, then task arithmetic (Deep et al. 2024)",
        _MERGEKIT,
        per_model={"weight": None, "density": 1.0, "epsilon": 0.15},
        globals={**_TASK_ARITHMETIC, "normalize": False, "rescale": True},
        exact=False,
        peak=lambda models: 2 * models + 5.0,
    ),
    "sce": TensorMerge(
        "sce",
        sce,
        "task vectors kept where they vary most across models (select_topk), signs elected, averaged with weights "
        "from their mean squares (Wan et al. 2024)",
        _MERGEKIT,
        globals={"int8_mask": False, "select_topk": 1.0},
        peak=lambda models: 4.25 * models + 1.0,
    ),
    "model_stock": TensorMerge(
        "model_stock",
        model_stock,
        "the models' average pulled towards the base by the mean angle between their task vectors (Jang et al. 2024)",
        _MERGEKIT,
        globals={"filter_wise": False},
        peak=lambda models: 2 * models + 3.0,
    ),
    "karcher": TensorMerge(
        "karcher",
        karcher,
        "the Riemannian (Karcher) mean of the models' directions, scaled by their mean norm; a base is one more model",
        _MERGEKIT,
        globals={"max_iter": 10, "tol": 1e-5},
        base="optional",
        peak=lambda models: 2 * models + 6.0,
    ),
    "multislerp": TensorMerge(
        "multislerp",
        multislerp,
        "spherical barycentric interpolation of the models (of their task vectors with a base), with their weights",
        _MERGEKIT,
        per_model={"weight": None},
        globals={"normalize_weights": True, "eps": 1e-8},
        base="optional",
        peak=lambda models: 3 * models + 2.0,
    ),
    "nuslerp": TensorMerge(
        "nuslerp",
        nuslerp,
        "SLERP of two models (of their task vectors with a base) at t = w2 / (w1 + w2), whole or row by row",
        _MERGEKIT,
        per_model={"weight": None},
        globals={"nuslerp_row_wise": False, "nuslerp_flatten": True},
        base="optional",
        peak=lambda models: models + 6.0,
    ),
    "nearswap": TensorMerge(
        "nearswap",
        nearswap,
        "each entry takes the model's value where it is within t of the base's, else moves towards it by t / |diff|",
        _MERGEKIT,
        globals={"t": None},
        peak=lambda models: models + 5.0,
    ),
}


def _della_window(per_model: PerModel, g: Globals) -> tuple[str, str, object] | None:
    """DELLA keeps each entry with a probability from ``density - epsilon`` (the smallest magnitude of its row) to
    ``density + epsilon`` (the largest; :func:`della_magprune`): that window must lie inside (0, 1) wherever the
    density trims at all."""
    for i, p in enumerate(per_model):
        density, epsilon = float(p["density"]), float(p["epsilon"])
        if 0 < density < 1 and not (0 < density - epsilon and density + epsilon < 1):
            return (f"models.{i}.parameters.epsilon", f"density +/- epsilon inside (0, 1) (density {density:g})", epsilon)
    return None


MERGES = {
    name: replace(merge, models=MODEL_COUNTS[name], check=_della_window if name.startswith("della") else None)
    for name, merge in MERGES.items()
}
