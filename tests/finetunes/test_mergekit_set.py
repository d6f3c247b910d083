"""mergekit's remaining merges (:mod:`rayfuse.finetunes.mergekit_set`) against mergekit's code, transcribed here as it
computes each (arcee-ai/mergekit at a6e4028) on small random tensors, 3 models and a base: equal to the bit for the
deterministic merges, and for DELLA's random drop equal to the bit given the same draws, with the drop's rates and
rescale checked. Then cases by hand, where rayfuse parts from mergekit on purpose, and the declared parameters.
(benchmarks/finetunes/compare_mergekit.py runs mergekit itself on the same files.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from rayfuse.finetunes.mergekit_set import MERGES, MODEL_COUNTS, della_magprune, magnitude_outliers

T = torch.tensor


def _merge(
    name: str,
    base: torch.Tensor | None,
    tuned: Sequence[torch.Tensor],
    per_model: Sequence[Mapping[str, float]] | None = None,
    seed: int = 0,
    **globals_: Any,
) -> torch.Tensor:
    """``MERGES[name]`` on copies of the tensors (a merge may overwrite them), its defaults filled in as the runner
    fills them, one generator per model."""
    merge = MERGES[name]
    per_model = per_model or [{} for _ in tuned]
    params = [{**{k: v for k, v in merge.per_model.items() if v is not None}, **p} for p in per_model]
    g = {**{k: v for k, v in merge.globals.items() if v is not None}, **globals_}
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(tuned))]
    return merge.fn(None if base is None else base.clone(), [x.clone() for x in tuned], params, g, gens)


# ---- mergekit's code, transcribed (mergekit/sparsify.py and mergekit/merge_methods/*.py at a6e4028) ----


def _mk_rescaled(tensor: torch.Tensor, mask: torch.Tensor, l1: bool) -> torch.Tensor:
    masked = tensor * mask
    if not l1:
        return masked
    before, after = tensor.abs().sum(), masked.abs().sum()
    if before < 1e-7 or after < 1e-7:
        return masked
    return masked * (before / after)


def _mk_magnitude_outliers(tensor: torch.Tensor, density: float, gamma: float, l1: bool) -> torch.Tensor:
    if density >= 1:
        return tensor
    num = tensor.numel()
    target_n, n_top = int(density * num), int(gamma * num)
    n_bot = num - target_n - n_top
    if n_bot < 0:
        n_top += n_bot
        n_bot = 0
    indices = torch.sort(tensor.abs().view(-1).float(), descending=False).indices
    mask = torch.zeros_like(tensor)
    mask.view(-1)[indices[n_bot:-n_top]] = 1  # empty where n_top == 0: the rows below keep n_top > 0
    return _mk_rescaled(tensor, mask, l1)


def _mk_della_magprune(tensor: torch.Tensor, density: float, epsilon: float, gen: torch.Generator, l1: bool) -> torch.Tensor:
    if density >= 1:
        return tensor
    orig_shape = tensor.shape
    if len(tensor.shape) < 2:
        tensor = tensor.unsqueeze(0)
    ranks = torch.argsort(tensor.abs(), dim=1, descending=False).argsort(dim=1).to(torch.float32) + 1
    min_ranks, max_ranks = ranks.min(dim=1, keepdim=True).values, ranks.max(dim=1, keepdim=True).values
    rank_norm = ((ranks - min_ranks) / (max_ranks - min_ranks)).clamp(0, 1)
    probs = (density - epsilon) + rank_norm * 2 * epsilon
    mask = torch.bernoulli(probs, generator=gen).to(torch.float32)  # mergekit: torch's global generator
    return _mk_rescaled(tensor.to(torch.float32), mask, l1).to(tensor.dtype).reshape(orig_shape)


def _mk_gta(base, tuned, params, g, trim, consensus, gens=None):  # type: ignore[no-untyped-def]
    tvs = []
    for i, (x, p) in enumerate(zip(tuned, params)):
        delta = x.to(base.dtype) - base
        tvs.append(trim(delta, p, g["rescale"], None if gens is None else gens[i]))
    deltas = torch.stack(tvs, dim=0)
    weights = torch.tensor([p["weight"] for p in params], dtype=deltas.dtype)
    while len(deltas.shape) > len(weights.shape):
        weights.unsqueeze_(-1)
    weighted = deltas * weights
    if consensus:
        sign = weighted.sign().to(base.dtype)
        majority = (weighted.sum(dim=0) >= 0).to(base.dtype) * 2 - 1
        mask = sign == majority
        mixed = (weighted * mask).sum(dim=0)
        divisor = (weights * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = weighted.sum(dim=0)
        divisor = weights.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if g["normalize"]:
        mixed /= divisor
    if g["lambda"] != 1:
        mixed *= g["lambda"]
    return (base + mixed).to(base.dtype)


def _mk_breadcrumbs(consensus: bool):  # type: ignore[no-untyped-def]
    def ref(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
        trim = lambda d, p, l1, _: _mk_magnitude_outliers(d, p["density"], p["gamma"], l1)  # noqa: E731
        return _mk_gta(base, tuned, params, g, trim, consensus)

    return ref


def _mk_della(consensus: bool):  # type: ignore[no-untyped-def]
    def ref(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
        trim = lambda d, p, l1, gen: _mk_della_magprune(d, p["density"], p["epsilon"], gen, l1)  # noqa: E731
        return _mk_gta(base, tuned, params, g, trim, consensus, gens)

    return ref


def _mk_sce(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
    task_vectors = torch.stack([t - base for t in tuned], dim=0)
    if g["select_topk"] < 1:
        var = torch.var(task_vectors, dim=0, unbiased=False)
        k = int(torch.count_nonzero(var) * g["select_topk"])
        mask = torch.zeros_like(var, dtype=base.dtype)
        if k > 0:
            mask.view(-1)[torch.topk(var.abs().view(-1), k=k, largest=True)[1]] = 1
        task_vectors = task_vectors * mask.unsqueeze(0)
    sign = task_vectors.sign()
    erase_mask = sign == (task_vectors.sum(dim=0) >= 0).to(base.dtype) * 2 - 1
    weights = torch.mean(task_vectors**2, dim=list(range(1, task_vectors.dim())))
    weight_sum = torch.sum(weights).item()
    tv_weights = torch.ones_like(weights) / weights.shape[0] if abs(weight_sum) < 1e-6 else weights / weight_sum
    while tv_weights.dim() < task_vectors.dim():
        tv_weights = tv_weights.unsqueeze(-1)
    erased_weights = tv_weights * erase_mask
    merged_tv = (task_vectors * erased_weights).sum(dim=0)
    return base + merged_tv / torch.sum(erased_weights, dim=0).clamp(min=1e-6)


def _mk_model_stock(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
    w_0, ws = base, list(tuned)
    out_shape = w_0.shape
    if g["filter_wise"]:
        if w_0.dim() == 1:
            w_0, ws = w_0.unsqueeze(0), [w.unsqueeze(0) for w in ws]
    else:
        w_0, ws = w_0.view(-1), [w.view(-1) for w in ws]
    offsets = [w - w_0 for w in ws]
    cos_thetas = []
    for i, a in enumerate(offsets):
        for j in range(i + 1, len(offsets)):
            b = offsets[j]
            norm_product = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cos_thetas.append(((a * b).sum(dim=-1) / norm_product.clamp(min=1e-6)).clamp(-1, 1))
    cos_theta = torch.stack(cos_thetas).mean(dim=0).unsqueeze(-1)
    n = len(ws)
    t = (n * cos_theta) / (1 + (n - 1) * cos_theta)
    w_avg = sum(ws) / len(ws)
    return (t * w_avg + (1 - t) * w_0).reshape(out_shape)


def _mk_karcher(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
    tensors = [*tuned, base] if base is not None else list(tuned)  # mergekit gathers the base after the models
    alphas = [1.0 / len(tensors)] * len(tensors)
    tol = g["tol"]
    norms, units = [], []
    for t in tensors:
        n = torch.linalg.norm(t.float())
        norms.append(n.item())
        units.append((t / n).to(t.dtype))
    valid = [i for i, n in enumerate(norms) if n > tol]
    alpha_sum = sum(alphas[i] for i in valid)
    normalized = [alphas[i] / alpha_sum for i in valid]
    valid_units = [units[i] for i in valid]
    u = torch.zeros_like(valid_units[0])
    for a, ui in zip(normalized, valid_units):
        u += a * ui
    u = (u / torch.linalg.norm(u.float()).item()).to(u.dtype)
    for _ in range(g["max_iter"]):
        step = torch.zeros_like(u)
        for a, ui in zip(normalized, valid_units):
            dot = torch.clamp(torch.dot(u.flatten(), ui.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < tol:
                continue
            sin_theta = torch.sin(theta)
            step += a * (theta / sin_theta) * (ui - dot * u)
        norm_step = torch.linalg.norm(step.float())
        if norm_step.item() < tol:
            break
        u = (torch.cos(norm_step) * u + torch.sin(norm_step) * (step / norm_step)).to(u.dtype)
        u_norm = torch.linalg.norm(u.float())
        if u_norm.item() > tol:
            u = (u / u_norm).to(u.dtype)
    s = 0.0
    for a, n in zip(alphas, norms):
        s += a * n
    return s * u


def _mk_multislerp(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
    eps = g["eps"]
    tensors = torch.stack(list(tuned), dim=0)
    if base is not None:
        tensors -= base
    tensors_flat = tensors.view(tensors.shape[0], -1)
    weights = torch.tensor([p["weight"] for p in params], dtype=tensors.dtype)
    if g["normalize_weights"]:
        weights = weights / weights.sum()
    norms = torch.norm(tensors_flat, dim=-1, keepdim=True)
    unit_tensors = tensors_flat / (norms + eps)
    mean = (unit_tensors * weights.view(-1, 1)).sum(0)
    mean = mean / torch.norm(mean)
    dots = (unit_tensors * mean).sum(-1, keepdim=True)
    tangent_vectors = unit_tensors - dots * mean
    tangent_result = (tangent_vectors * weights.view(-1, 1)).sum(0)
    tangent_norm = torch.norm(tangent_result) + eps
    result = mean * torch.cos(tangent_norm) + tangent_result * (torch.sin(tangent_norm) / tangent_norm)
    result = (result * (norms.squeeze(-1) * weights).sum()).view(tensors.shape[1:])
    return result + base if base is not None else result


def _mk_nuslerp_fn(t, v0, v1, dim, flatten, eps=1e-8):  # type: ignore[no-untyped-def]
    out_shape = v0.shape

    def _normalize(x: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
        return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=eps)

    if flatten:
        v0, v1 = v0.view(-1), v1.view(-1)
    elif dim != -1:
        v0, v1 = v0.transpose(dim, -1), v1.transpose(dim, -1)
    cos_theta = torch.sum(_normalize(v0) * _normalize(v1), dim=-1, keepdim=True)
    theta = torch.acos(cos_theta.clamp(-1, 1))
    sin_theta = torch.sin(theta)
    colinear = (sin_theta.abs() < eps).squeeze()
    res = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / sin_theta
    res[colinear] = (1 - t) * v0[colinear] + t * v1[colinear]
    if dim != -1 and not flatten:
        res = res.transpose(dim, -1)
    return res.reshape(out_shape)


def _mk_nuslerp(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
    weights = [p["weight"] for p in params]
    t = 0.5 if abs(sum(weights)) < 1e-6 else weights[1] / sum(weights)
    dim, flatten = (0 if g["nuslerp_row_wise"] else -1), g["nuslerp_flatten"]
    if base is not None:
        return base + _mk_nuslerp_fn(t, tuned[0] - base, tuned[1] - base, dim, flatten)
    return _mk_nuslerp_fn(t, tuned[0], tuned[1], dim, flatten)


def _mk_nearswap(base, tuned, params, g, gens):  # type: ignore[no-untyped-def]
    a, b = base, tuned[0]
    weight = (g["t"] / torch.abs(a - b).clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a


REFERENCES = {
    "breadcrumbs": _mk_breadcrumbs(False),
    "breadcrumbs_ties": _mk_breadcrumbs(True),
    "della": _mk_della(True),
    "della_linear": _mk_della(False),
    "sce": _mk_sce,
    "model_stock": _mk_model_stock,
    "karcher": _mk_karcher,
    "multislerp": _mk_multislerp,
    "nuslerp": _mk_nuslerp,
    "nearswap": _mk_nearswap,
}


def _models(shape: tuple[int, ...], n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return base, [base + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]


W3 = [{"weight": 1.0}, {"weight": 0.5}, {"weight": 2.0}]

# (method, shape, fine-tuned models, with a base, each model's parameters, global parameters, dtype)
ROWS = [
    ("breadcrumbs", (16, 12), 3, True, [{**w, "density": 0.5, "gamma": 0.05} for w in W3], {}, torch.float32),
    ("breadcrumbs", (16, 12), 3, True, [{**w, "density": 0.3, "gamma": 0.1} for w in W3], {"rescale": True, "lambda": 0.7}, torch.float32),
    ("breadcrumbs", (64,), 3, True, [{**w, "density": 0.9, "gamma": 0.2} for w in W3], {"normalize": True}, torch.float64),  # n_bot < 0
    ("breadcrumbs_ties", (16, 12), 3, True, [{**w, "density": 0.5, "gamma": 0.05} for w in W3], {}, torch.float32),
    (
        "breadcrumbs_ties",
        (9, 4, 3),
        3,
        True,
        [{**w, "density": 0.4, "gamma": 0.1} for w in W3],
        {"normalize": True, "rescale": True},
        torch.float32,
    ),
    ("della", (16, 12), 3, True, [{**w, "density": 0.5, "epsilon": 0.2} for w in W3], {}, torch.float32),
    ("della", (40,), 3, True, [{**w, "density": 0.6, "epsilon": 0.1} for w in W3], {"lambda": 1.5, "rescale": False}, torch.float64),
    ("della_linear", (16, 12), 3, True, [{**w, "density": 0.4, "epsilon": 0.15} for w in W3], {}, torch.float32),
    ("della_linear", (5, 6, 2), 3, True, [{**w, "density": 0.4, "epsilon": 0.3} for w in W3], {"normalize": True}, torch.float32),
    ("sce", (16, 12), 3, True, [{}] * 3, {}, torch.float32),
    ("sce", (16, 12), 3, True, [{}] * 3, {"select_topk": 0.3}, torch.float32),
    ("sce", (50,), 3, True, [{}] * 3, {"select_topk": 0.5, "int8_mask": True}, torch.float64),
    ("model_stock", (16, 12), 3, True, [{}] * 3, {}, torch.float32),
    ("model_stock", (16, 12), 3, True, [{}] * 3, {"filter_wise": True}, torch.float32),
    ("model_stock", (30,), 2, True, [{}] * 2, {"filter_wise": True}, torch.float32),
    ("karcher", (16, 12), 3, True, [{}] * 3, {}, torch.float32),
    ("karcher", (16, 12), 3, False, [{}] * 3, {"max_iter": 3, "tol": 1e-4}, torch.float32),
    ("multislerp", (16, 12), 3, True, W3, {}, torch.float32),
    ("multislerp", (16, 12), 3, False, W3, {"normalize_weights": False}, torch.float32),
    ("multislerp", (40,), 3, False, W3, {}, torch.float64),
    ("nuslerp", (16, 12), 2, True, [{"weight": 1.0}, {"weight": 3.0}], {}, torch.float32),
    ("nuslerp", (16, 12), 2, False, [{"weight": 1.0}, {"weight": 3.0}], {"nuslerp_flatten": False}, torch.float32),
    ("nuslerp", (16, 12), 2, True, [{"weight": 2.0}, {"weight": 1.0}], {"nuslerp_flatten": False, "nuslerp_row_wise": True}, torch.float32),
    ("nuslerp", (16,), 2, False, [{"weight": 1.0}, {"weight": -1.0}], {"nuslerp_flatten": False, "nuslerp_row_wise": True}, torch.float32),
    ("nearswap", (16, 12), 1, True, [{}], {"t": 0.05}, torch.float32),
    ("nearswap", (40,), 1, True, [{}], {"t": 0.2}, torch.float64),
]


@pytest.mark.parametrize(("name", "shape", "n", "with_base", "per_model", "globals_", "dtype"), ROWS)
def test_each_merge_is_mergekits_to_the_bit(
    name: str,
    shape: tuple[int, ...],
    n: int,
    with_base: bool,
    per_model: list[dict[str, float]],
    globals_: dict[str, Any],
    dtype: torch.dtype,
) -> None:
    """mergekit's code (transcribed above) and rayfuse's on the same tensors; DELLA with the same generators."""
    base, tuned = _models(shape, n, dtype)
    out = _merge(name, base if with_base else None, tuned, per_model, seed=7, **globals_)
    merge = MERGES[name]
    params = [{**{k: v for k, v in merge.per_model.items() if v is not None}, **p} for p in per_model]
    g = {**{k: v for k, v in merge.globals.items() if v is not None}, **globals_}
    gens = [torch.Generator().manual_seed(7 + i) for i in range(n)]
    expected = REFERENCES[name](base.clone() if with_base else None, [x.clone() for x in tuned], params, g, gens)
    assert out.dtype == dtype and out.shape == base.shape
    assert torch.equal(out, expected.to(dtype))


# ---- the random drop ----


def test_della_keeps_each_entry_with_its_rank_probability_and_the_l1_norm() -> None:
    # |delta| increases along each row: column j has rank j + 1 of 5, kept with density - eps + (j / 4) 2 eps
    rows = 4000
    delta = torch.arange(1.0, 6.0).repeat(rows, 1) * torch.where(
        torch.rand(rows, 5, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0
    )
    kept = della_magprune(delta, 0.4, 0.2, torch.Generator().manual_seed(2)) != 0
    for j, p in enumerate([0.2, 0.3, 0.4, 0.5, 0.6]):
        assert abs(kept[:, j].float().mean().item() - p) < 0.03
    assert abs(kept.float().mean().item() - 0.4) < 0.01  # the density on average
    rescaled = della_magprune(delta, 0.4, 0.2, torch.Generator().manual_seed(2), rescale="l1")
    assert torch.equal(rescaled != 0, kept)  # the same draws
    assert rescaled.abs().sum().item() == pytest.approx(delta.abs().sum().item(), rel=1e-5)


def test_della_linear_without_rescale_has_each_task_vector_times_its_keep_probability_as_its_expectation() -> None:
    # every row alike: the mean over rows is the mean over draws. Ranks along a row: 1..5 for the first model, 5..1
    # for the second; keep probabilities 0.2 + 0.1 (rank - 1)
    rows = 20000
    first, second = T([1.0, 2.0, 3.0, 4.0, 5.0]), T([-5.0, 4.0, -3.0, 2.0, -1.0])
    tuned = [first.repeat(rows, 1), second.repeat(rows, 1)]
    per_model = [{"weight": 1.0, "density": 0.4, "epsilon": 0.2}, {"weight": 2.0, "density": 0.4, "epsilon": 0.2}]
    mean = _merge("della_linear", torch.zeros(rows, 5), tuned, per_model, rescale=False).mean(dim=0)
    p = T([0.2, 0.3, 0.4, 0.5, 0.6])
    torch.testing.assert_close(mean, p * first + 2.0 * p.flip(0) * second, rtol=0, atol=0.15)  # ~4 standard deviations


def test_della_draws_from_the_generators_given() -> None:
    base, tuned = _models((8, 9), 3)
    per_model = [{"weight": 1.0, "density": 0.5}] * 3
    a, b = _merge("della", base, tuned, per_model, seed=1), _merge("della", base, tuned, per_model, seed=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, _merge("della", base, tuned, per_model, seed=2))
    assert torch.equal(
        _merge("della", base, tuned, [{"weight": 1.0, "density": 1.0}] * 3), _merge("della", base, tuned, [{"weight": 1.0}] * 3)
    )


# ---- by hand, and where rayfuse parts from mergekit on purpose ----


def test_breadcrumbs_by_hand_drops_the_largest_gamma_and_the_smallest_entries() -> None:
    delta = T([0.1, -0.5, 0.3, -0.2, 0.05, 0.9, -0.7, 0.6, 0.02, -0.4])
    # density 0.5, gamma 0.1: the largest (0.9) and the 4 smallest go; 5 stay
    assert magnitude_outliers(delta, 0.5, 0.1).tolist() == pytest.approx([0, -0.5, 0.3, 0, 0, 0, -0.7, 0.6, 0, -0.4])
    # density 0.95, gamma 0.2: 9 to keep and 2 outliers do not fit in 10: no small entry goes, and 1 outlier only
    assert magnitude_outliers(delta, 0.95, 0.2).tolist() == pytest.approx([0.1, -0.5, 0.3, -0.2, 0.05, 0, -0.7, 0.6, 0.02, -0.4])


def test_breadcrumbs_where_gamma_drops_no_outlier_keeps_the_density() -> None:
    """mergekit at a6e4028 drops the whole task vector here (``indices[n_bot:-0]`` is empty): every tensor under 100
    entries at its default gamma 0.01. rayfuse drops no outlier and keeps the density's largest entries."""
    delta = T([0.1, -0.5, 0.3, -0.2, 0.05, 0.9, -0.7, 0.6, 0.02, -0.4])
    assert magnitude_outliers(delta, 0.5, 0.01).tolist() == pytest.approx([0, -0.5, 0, 0, 0, 0.9, -0.7, 0.6, 0, -0.4])
    assert _mk_magnitude_outliers(delta, 0.5, 0.01, False).abs().sum().item() == 0  # mergekit's


def test_della_gives_a_row_of_one_entry_the_density() -> None:
    """mergekit's rank range is 0 / 0 there and its bernoulli refuses the NaN probability."""
    delta = torch.ones(4000, 1)
    with pytest.raises(RuntimeError):
        _mk_della_magprune(delta, 0.3, 0.1, torch.Generator().manual_seed(0), False)
    kept = della_magprune(delta, 0.3, 0.1, torch.Generator().manual_seed(0)) != 0
    assert abs(kept.float().mean().item() - 0.3) < 0.03
    assert della_magprune(T(2.0), 0.5, 0.1, torch.Generator().manual_seed(0)).shape == ()


def test_sce_keeping_no_entry_is_the_base() -> None:
    base, tuned = _models((5, 4), 3)
    assert torch.equal(_merge("sce", base, tuned, select_topk=0.0), base)


def test_nearswap_by_hand() -> None:
    out = _merge("nearswap", torch.zeros(3), [T([0.05, 1.0, -0.2])], t=0.1)
    torch.testing.assert_close(out, T([0.05, 0.1, -0.1]))  # weights min(1, 0.1 / |diff|): 1, 0.1, 0.5


def test_model_stock_by_hand_orthogonal_task_vectors_give_the_base_and_equal_ones_their_average() -> None:
    base = T([1.0, 1.0, 1.0])
    assert torch.equal(_merge("model_stock", base, [base + T([1.0, 0.0, 0.0]), base + T([0.0, 2.0, 0.0])]), base)  # cos 0: t 0
    same = [base + T([1.0, -1.0, 0.5]), base + T([1.0, -1.0, 0.5])]
    torch.testing.assert_close(_merge("model_stock", base, same), same[0])  # cos 1: t = 2 / 2


@pytest.mark.parametrize("name", ["karcher", "multislerp", "nuslerp"])
def test_spherical_means_of_two_orthogonal_unit_vectors_are_their_normalized_midpoint(name: str) -> None:
    per_model = [{"weight": 1.0}, {"weight": 1.0}]
    out = _merge(name, None, [T([1.0, 0.0]), T([0.0, 1.0])], per_model)
    torch.testing.assert_close(out, T([0.5**0.5, 0.5**0.5]))


def test_multislerp_of_two_cancelling_models_is_linear_and_of_three_refused() -> None:
    a = T([1.0, 2.0])
    torch.testing.assert_close(_merge("multislerp", None, [a, -a], [{"weight": 1.0}] * 2), T([0.0, 0.0]))
    with pytest.raises(ValueError, match="weighted sum of the models' directions is zero"):
        _merge("multislerp", None, [a, -a, a, -a], [{"weight": 1.0}] * 4)


# ---- the declarations: mergekit's parameter names and defaults (None: required) ----

TASK_ARITHMETIC = {"int8_mask": False, "lambda": 1.0}
DECLARED = [
    (
        "breadcrumbs",
        {"weight": None, "density": 1.0, "gamma": 0.01},
        {**TASK_ARITHMETIC, "normalize": False, "rescale": False},
        "required",
        True,
    ),
    (
        "breadcrumbs_ties",
        {"weight": None, "density": 1.0, "gamma": 0.01},
        {**TASK_ARITHMETIC, "normalize": False, "rescale": False},
        "required",
        True,
    ),
    (
        "della",
        {"weight": None, "density": 1.0, "epsilon": 0.15},
        {**TASK_ARITHMETIC, "normalize": True, "rescale": True},
        "required",
        False,
    ),
    (
        "della_linear",
        {"weight": None, "density": 1.0, "epsilon": 0.15},
        {**TASK_ARITHMETIC, "normalize": False, "rescale": True},
        "required",
        False,
    ),
    ("sce", {}, {"int8_mask": False, "select_topk": 1.0}, "required", True),
    ("model_stock", {}, {"filter_wise": False}, "required", True),
    ("karcher", {}, {"max_iter": 10, "tol": 1e-5}, "optional", True),
    ("multislerp", {"weight": None}, {"normalize_weights": True, "eps": 1e-8}, "optional", True),
    ("nuslerp", {"weight": None}, {"nuslerp_row_wise": False, "nuslerp_flatten": True}, "optional", True),
    ("nearswap", {}, {"t": None}, "required", True),
]


@pytest.mark.parametrize(("name", "per_model", "globals_", "base", "exact"), DECLARED)
def test_declared_as_mergekit_declares(name: str, per_model: dict[str, Any], globals_: dict[str, Any], base: str, exact: bool) -> None:
    merge = MERGES[name]
    assert (merge.name, dict(merge.per_model), dict(merge.globals), merge.base, merge.exact) == (name, per_model, globals_, base, exact)
    assert "a6e4028" in merge.reference and merge.summary
    assert merge.peak(4) >= 4  # every model's tensor is held


def test_every_merge_is_declared_and_counted() -> None:
    assert set(MERGES) == {row[0] for row in DECLARED} == set(MODEL_COUNTS)
