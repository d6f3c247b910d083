"""rayfuse.alignment: weight and activation matching recover planted permutations; merges, statistics and repair."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.fx
from torch import nn

from rayfuse.alignment import (
    GroupStats,
    activation_matching,
    apply_alignment,
    apply_batchnorm,
    batchnorm_statistics,
    collect_correlations,
    combine_batchnorm,
    diagonal_fisher,
    input_grams,
    match_weights,
    merge_average,
    merge_fisher,
    merge_regmean,
    permute_fisher,
    permute_grams,
    resolve_cost_keys,
    solve_activation_perms,
    weight_matching,
)
from rayfuse.errors import InputError
from rayfuse.matching import serial_map
from rayfuse.symmetry import AxisRef, PermGroup, PermutationSpec, Probe
from tests.symmetry.test_spec import mlp_spec  # git re-basin's hand-written spec of the 3-layer MLP below


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 5),
    )


def bn_axes(prefix: str) -> tuple[AxisRef, ...]:
    return tuple(AxisRef(f"{prefix}.{name}", 0) for name in ("weight", "bias", "running_mean", "running_var"))


def cnn_spec() -> PermutationSpec:
    c0 = PermGroup("C0", 8, (AxisRef("0.weight", 0), AxisRef("0.bias", 0), *bn_axes("1"), AxisRef("3.weight", 1)), (Probe("_1", 1),))
    c1 = PermGroup(
        "C1", 6, (AxisRef("3.weight", 0), AxisRef("3.bias", 0), *bn_axes("4"), AxisRef("7.weight", 1, inner=16)), (Probe("_4", 1),)
    )
    return PermutationSpec((c0, c1))


CASES = {"mlp": (mlp, mlp_spec, (5,)), "cnn": (cnn, cnn_spec, (3, 4, 4))}


def params_of(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def random_model(build, seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    net = build()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):  # informative BatchNorm parameters and statistics
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
                m.running_mean.normal_(0.0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return params_of(net)


def load(build, params: dict[str, np.ndarray]) -> nn.Module:
    net = build()
    net.load_state_dict({k: torch.as_tensor(v) for k, v in params.items()})
    return net


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = 0.0) -> None:
    assert set(a) == set(b)
    for key in a:
        if atol:
            np.testing.assert_allclose(a[key], b[key], atol=atol, rtol=0, err_msg=key)
        else:
            assert np.array_equal(a[key], b[key]), key


def local_collect(build, spec, models, X, *, traced: bool = False):
    def collect(reference: dict[str, np.ndarray]) -> list[dict[str, GroupStats]]:
        out = []
        for model in models:
            ref, own = load(build, reference), load(build, model)
            graphs = (torch.fx.symbolic_trace(ref), torch.fx.symbolic_trace(own)) if traced else (None, None)
            out.append(collect_correlations(ref, own, spec, *graphs, X, batch_size=32))
        return out

    return collect


@pytest.mark.parametrize("case", sorted(CASES))
def test_match_weights_recovers_a_planted_permutation(case):
    build, make_spec, _ = CASES[case]
    spec = make_spec()
    model = random_model(build, 0)
    permuted = spec.apply(model, spec.random(np.random.default_rng(1)))
    perms, sweeps = match_weights(model, permuted, spec, seed=3)
    assert_same(spec.apply(permuted, perms), model)
    assert 1 <= sweeps <= 100


def test_weight_matching_matches_on_weights_not_on_batchnorm_statistics():
    spec = cnn_spec()
    model = random_model(cnn, 40)
    planted = spec.random(np.random.default_rng(41))
    permuted = spec.apply(model, planted)
    rng = np.random.default_rng(42)
    for key in permuted:  # statistics of other data, with variances large enough to dominate a cost that counted them
        if key.endswith("running_var"):
            permuted[key] = rng.uniform(0.0, 50.0, permuted[key].shape).astype(np.float32)
        elif key.endswith("running_mean"):
            permuted[key] = rng.normal(0.0, 10.0, permuted[key].shape).astype(np.float32)
    assert resolve_cost_keys(spec, None) == sorted(k for k in spec.keys() if "running" not in k)
    perms, _ = match_weights(model, permuted, spec, seed=3)
    back = spec.apply(permuted, perms)
    assert_same(
        {k: v for k, v in back.items() if "running" not in k and k in spec.keys()},
        {k: v for k, v in model.items() if "running" not in k and k in spec.keys()},
    )
    result = weight_matching([model, permuted], spec, seed=3, executor=serial_map)
    assert all(np.array_equal(result.perms[1][name], perms[name]) for name in spec.names)
    with pytest.raises(InputError, match=r"^cost_keys\.9\.weight: expected a tensor the spec permutes"):
        match_weights(model, permuted, spec, cost_keys=["9.weight"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_activation_matching_recovers_a_planted_permutation(case):
    build, make_spec, shape = CASES[case]
    spec = make_spec()
    model = random_model(build, 0)
    permuted = spec.apply(model, spec.random(np.random.default_rng(2)))
    X = np.random.default_rng(3).normal(size=(64, *shape)).astype(np.float32)
    models = [model, permuted]
    result = activation_matching(models, spec, local_collect(build, spec, models, X, traced=case == "cnn"), sweeps=3)
    aligned = apply_alignment(models, spec, result)
    assert_same(aligned[0], model)
    assert_same(aligned[1], model)
    assert result.converged and result.sweeps == 2
    assert result.objective[-1] == pytest.approx(1.0)


def test_activation_matching_falls_back_to_weight_matching_for_groups_without_probes():
    spec = mlp_spec()
    blind = PermutationSpec((spec.groups[0], PermGroup("P1", 6, spec.groups[1].axes)))
    model = random_model(mlp, 4)
    permuted = blind.apply(model, blind.random(np.random.default_rng(5)))
    X = np.random.default_rng(6).normal(size=(64, 5)).astype(np.float32)
    models = [model, permuted]
    result = activation_matching(models, blind, local_collect(mlp, blind, models, X), sweeps=2)
    assert_same(blind.apply(permuted, result.perms[1]), model)
    stuck = activation_matching(models, blind, local_collect(mlp, blind, models, X), sweeps=1, fallback="identity")
    assert np.array_equal(stuck.perms[1]["P1"], np.arange(6))
    with pytest.raises(InputError, match=r"^fallback: expected 'weight' or 'identity'"):
        activation_matching(models, blind, local_collect(mlp, blind, models, X), fallback="nothing")


class CountingExecutor:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, fn, items):
        self.calls.append(len(items))
        return serial_map(fn, items)


def test_four_permuted_copies_align_to_one_model_and_every_merge_returns_it():
    spec = cnn_spec()
    model = random_model(cnn, 7)
    rng = np.random.default_rng(8)
    copies = [model] + [spec.apply(model, spec.random(rng)) for _ in range(3)]
    executor = CountingExecutor()
    result = weight_matching(copies, spec, executor=executor, seed=1)
    assert result.converged
    assert executor.calls == [4] * result.sweeps  # one item per model per sweep
    assert result.objective[-1] == pytest.approx(0.0, abs=1e-20)
    aligned = apply_alignment(copies, spec, result)
    for one in aligned:
        assert_same(one, model)
    assert_same(merge_average(aligned, weights=[1, 2, 3, 4]), model, atol=1e-6)
    fishers = [{k: rng.uniform(0, 2, size=v.shape) for k, v in model.items() if v.dtype.kind == "f"} for _ in copies]
    assert_same(merge_fisher(aligned, fishers), model, atol=1e-6)
    grams = []
    for _ in copies:
        grams.append({})
        for key in ("0.weight", "3.weight", "7.weight"):
            width = int(np.prod(model[key].shape[1:]))
            a = rng.normal(size=(width + 3, width))
            grams[-1][key] = a.T @ a
    assert_same(merge_regmean(aligned, grams), model, atol=1e-5)


def test_two_models_reduce_to_matching_model_one_onto_model_zero():
    spec = mlp_spec()
    a, b = random_model(mlp, 10), random_model(mlp, 11)
    result = weight_matching([a, b], spec, seed=4, executor=serial_map)
    direct, _ = match_weights(a, b, spec, seed=4)
    for name in spec.names:
        assert np.array_equal(result.perms[0][name], np.arange(spec.group(name).size))
        assert np.array_equal(result.perms[1][name], direct[name])
    assert result.converged


def test_n_way_matching_of_different_models_returns_its_best_sweep():
    spec = mlp_spec()
    models = [random_model(mlp, s) for s in (30, 31, 32, 33)]
    result = weight_matching(models, spec, max_sweeps=12)
    aligned = apply_alignment(models, spec, result)
    center = merge_average(aligned)
    spread = sum(0.25 * float(np.sum((m[k].astype(np.float64) - center[k]) ** 2)) for m in aligned for k in spec.keys())
    assert spread == pytest.approx(min(result.objective), rel=1e-5)
    assert min(result.objective) < result.objective[0]
    assert len(result.objective) == result.sweeps <= 12


def test_group_stats_add_up_to_the_stats_of_the_concatenated_data():
    spec = cnn_spec()
    ref, own = load(cnn, random_model(cnn, 12)), load(cnn, random_model(cnn, 13))
    X = np.random.default_rng(14).normal(size=(40, 3, 4, 4)).astype(np.float32)
    whole = collect_correlations(ref, own, spec, None, None, X, batch_size=16)
    first = collect_correlations(ref, own, spec, None, None, X[:15], batch_size=7)
    second = collect_correlations(ref, own, spec, None, None, X[15:])
    assert set(whole) == {"C0", "C1"}
    for name, stats in whole.items():
        summed = first[name] + second[name]
        assert summed.count == stats.count == 40 * 16
        for field in ("sum_a", "sum_b", "sumsq_a", "sumsq_b", "cross"):
            np.testing.assert_allclose(getattr(summed, field), getattr(stats, field), rtol=1e-6, atol=1e-6, err_msg=field)  # float32 runs
        again = GroupStats.from_arrays(stats.to_arrays())
        assert np.array_equal(again.correlation(), stats.correlation())
    corr = whole["C1"].correlation()
    assert corr.shape == (6, 6) and np.all(np.abs(corr) <= 1 + 1e-9)


def test_correlation_of_a_constant_unit_is_zero_and_solving_takes_the_best_pairs():
    a = np.array([[1.0, 0.0, 2.0], [2.0, 0.0, 1.0], [3.0, 0.0, 5.0], [4.0, 0.0, 3.0]])
    b = a[:, [2, 0, 1]]
    stats = GroupStats(4.0, a.sum(0), b.sum(0), (a * a).sum(0), (b * b).sum(0), a.T @ b)
    corr = stats.correlation()
    assert np.all(np.isfinite(corr)) and np.all(corr[1] == 0) and np.all(corr[:, 2] == 0)
    perm = solve_activation_perms({"g": stats}, executor=serial_map)["g"]
    assert list(perm[[0, 2]]) == [1, 0]  # own unit 1 is reference unit 0, own unit 0 is reference unit 2


def test_regmean_of_linear_regressions_is_the_pooled_regression():
    rng = np.random.default_rng(15)
    true = rng.normal(size=(3, 4))
    datasets = []
    for n, shift in ((30, 0.0), (50, 2.0)):
        x = rng.normal(shift, 1.0, size=(n, 4))
        datasets.append((x, x @ true.T + rng.normal(size=(n, 3))))
    fits, grams = [], []
    for x, y in datasets:
        w = np.linalg.lstsq(x, y, rcond=None)[0].T
        layer = nn.Linear(4, 3, bias=False).double()
        layer.weight.data = torch.as_tensor(w)
        gram, count = input_grams(layer, x, batch_size=16)
        assert count == len(x)
        np.testing.assert_allclose(gram["weight"], x.T @ x, rtol=1e-12)
        fits.append({"weight": w})
        grams.append(gram)
    pooled_x = np.concatenate([x for x, _ in datasets])
    pooled_y = np.concatenate([y for _, y in datasets])
    pooled = np.linalg.lstsq(pooled_x, pooled_y, rcond=None)[0].T
    np.testing.assert_allclose(merge_regmean(fits, grams, alpha=1.0)["weight"], pooled, rtol=1e-9, atol=1e-12)
    assert not np.allclose(merge_average(fits)["weight"], pooled, atol=1e-3)


def test_an_embeddings_row_counts_give_the_regmean_of_the_linear_on_one_hot_inputs():
    """An embedding table (rows, dim) is the Linear (dim, rows) on one-hot inputs, whose Gram is diag(counts): merging
    the table from each model's row counts is RegMean of that Linear with its full Grams (every row used by some
    model), at any alpha (a diagonal Gram keeps its off-diagonal zeros); a row no model used keeps the weighted average."""
    rng = np.random.default_rng(18)
    rows, dim = 6, 3
    tables = [{"emb": rng.normal(size=(rows, dim))} for _ in range(3)]
    counts = [np.array([5.0, 0, 1, 0, 2, 0]), np.array([0.0, 3, 1, 0, 0, 4]), np.array([2.0, 0, 0, 7, 1, 0])]
    weights = [1.0, 2.0, 0.5]
    as_linear = [{"emb": t["emb"].T} for t in tables]  # (dim, rows): y = W onehot
    full = merge_regmean(as_linear, [{"emb": np.diag(c)} for c in counts], weights, alpha=1.0)["emb"].T
    for alpha in (1.0, 0.5):
        np.testing.assert_allclose(merge_regmean(tables, [{"emb": c} for c in counts], weights, alpha=alpha)["emb"], full, rtol=1e-12)
    unused = [{"emb": np.where(np.arange(rows) == 3, 0.0, c)} for c in counts]
    merged = merge_regmean(tables, unused, weights)["emb"]
    np.testing.assert_allclose(merged[3], merge_average(tables, weights)["emb"][3], rtol=1e-12)
    np.testing.assert_allclose(merged[0], (5 * tables[0]["emb"][0] + 0.5 * 2 * tables[2]["emb"][0]) / (5 + 0.5 * 2), rtol=1e-12)
    with pytest.raises(InputError, match=r"grams\.1\.emb: expected \(6,\) row counts"):
        merge_regmean(tables, [{"emb": counts[0]}, {"emb": counts[1][:4]}, {"emb": counts[2]}])
    with pytest.raises(InputError, match="finite non-negative row counts"):
        merge_regmean(tables, [{"emb": counts[0]}, {"emb": -counts[1]}, {"emb": counts[2]}])


def test_a_convolutions_gram_gives_its_output_energy():
    torch.manual_seed(16)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2, bias=False)).double()
    X = np.random.default_rng(17).normal(size=(5, 2, 6, 6))
    grams, _ = input_grams(net, X, batch_size=2)
    w = net[0].weight.detach().numpy().reshape(3, -1)
    with torch.no_grad():
        energy = float((net(torch.as_tensor(X)) ** 2).sum())
    assert np.trace(w @ grams["0.weight"] @ w.T) == pytest.approx(energy, rel=1e-10)


def test_fisher_merge_with_equal_fishers_is_the_average_and_the_fisher_is_per_sample():
    rng = np.random.default_rng(18)
    models = [random_model(mlp, s) for s in (19, 20, 21)]
    fisher = {k: rng.uniform(0, 1, size=v.shape) for k, v in models[0].items()}
    assert_same(merge_fisher(models, [fisher] * 3, weights=[1, 1, 2]), merge_average(models, weights=[1, 1, 2]), atol=1e-6)
    net = load(mlp, models[0])
    X = rng.normal(size=(4, 5)).astype(np.float32)
    y = np.array([0, 2, 1, 2])
    got = diagonal_fisher(net, X, y, batch_size=3)
    expected = {k: np.zeros(v.shape) for k, v in net.named_parameters()}
    for x, label in zip(X, y):
        net.zero_grad()
        torch.log_softmax(net(torch.as_tensor(x[None])), -1)[0, label].backward()
        for k, p in net.named_parameters():
            expected[k] += p.grad.double().numpy() ** 2 / len(X)
    assert_same(got, expected, atol=1e-7)


def test_statistics_follow_the_alignment():
    spec = mlp_spec()
    model = random_model(mlp, 22)
    perms = spec.random(np.random.default_rng(23))
    X = np.random.default_rng(24).normal(size=(20, 5)).astype(np.float32)
    y = np.arange(20) % 3
    grams, _ = input_grams(load(mlp, model), X)
    moved = spec.apply(model, perms)
    grams_moved, _ = input_grams(load(mlp, moved), X)
    shapes = {k: v.shape for k, v in model.items()}
    assert_same(permute_grams(grams, spec, perms, shapes), grams_moved, atol=1e-5)  # float32 runs
    fisher = diagonal_fisher(load(mlp, model), X, y)
    assert_same(permute_fisher(fisher, spec, perms), diagonal_fisher(load(mlp, moved), X, y), atol=1e-7)


def test_combined_batchnorm_statistics_are_the_pooled_datas():
    torch.manual_seed(25)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))
    before = params_of(net)
    rng = np.random.default_rng(26)
    parts = [rng.normal(loc, 1.0, size=(n, 3, 5, 5)).astype(np.float32) for n, loc in ((7, 0.0), (12, 1.5))]
    stats = [batchnorm_statistics(net, X, batch_size=5) for X in parts]
    assert_same(params_of(net), before)  # the model is left as it was
    combined = combine_batchnorm(stats)
    with torch.no_grad():
        features = net[0](torch.as_tensor(np.concatenate(parts))).double().numpy()
    np.testing.assert_allclose(combined["1"][0], features.mean(axis=(0, 2, 3)), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(combined["1"][1], features.var(axis=(0, 2, 3)), rtol=1e-9)
    assert stats[0]["1"][0] == 7 * 9 and set(combined) == {"1", "4"}
    repaired = apply_batchnorm(before, combined)
    assert np.array_equal(repaired["4.running_var"], combined["4"][1].astype(np.float32))
    with pytest.raises(InputError, match=r"^params\.9\.running_mean"):
        apply_batchnorm(before, {"9": combined["1"]})


def test_bad_input_names_its_key():
    spec = mlp_spec()
    model = random_model(mlp, 27)
    with pytest.raises(InputError, match=r"^weights: expected one weight per model \(2\)"):
        weight_matching([model, model], spec, weights=[1.0])
    small = dict(model)
    small["2.weight"] = model["2.weight"][:, :4]
    with pytest.raises(InputError, match=r"^models\.1\.2\.weight: expected shape \(6, 8\)"):
        weight_matching([model, small], spec)
    with pytest.raises(InputError, match=r"^grams\.1\.2\.weight: expected a \(8, 8\) Gram matrix"):
        merge_regmean([model, model], [{"2.weight": np.eye(8)}, {"2.weight": np.eye(5)}])
