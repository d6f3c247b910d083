"""Each fine-tune merge against its formula on small tensors (hand-computed TIES, DARE and SLERP cases), the
per-tensor-pattern parameters, and a merge through ``rayfuse.fuse`` against the same formulas."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import rayfuse
from rayfuse.finetunes.config import TASK_VECTOR_METHODS, evaluate, layer_positions
from rayfuse.finetunes.taskvec import linear, sign_consensus, slerp, sparsify_magnitude, sparsify_random, task_vector_merge

T = torch.tensor


def _merge(method: str, base: torch.Tensor, tuned: list[torch.Tensor], weights: list[float], densities: list[float], **kw) -> torch.Tensor:
    m = TASK_VECTOR_METHODS[method]
    kw.setdefault("normalize", m.normalize)
    return task_vector_merge(base, tuned, weights, densities, m, **kw)


def test_task_arithmetic_is_base_plus_lambda_times_the_weighted_sum_of_task_vectors() -> None:
    base = T([1.0, 2.0, 3.0])
    x1, x2 = T([2.0, 2.0, 1.0]), T([1.0, 4.0, 3.5])
    out = _merge("task_arithmetic", base, [x1, x2], [0.5, 2.0], [1.0, 1.0], lam=0.8)
    expected = base + 0.8 * (0.5 * (x1 - base) + 2.0 * (x2 - base))
    torch.testing.assert_close(out, expected)
    normalized = _merge("task_arithmetic", base, [x1, x2], [0.5, 2.0], [1.0, 1.0], normalize=True)
    torch.testing.assert_close(normalized, base + (0.5 * (x1 - base) + 2.0 * (x2 - base)) / 2.5)


def test_ties_by_hand_trim_elect_disjoint_mean() -> None:
    base = torch.zeros(4)
    x1, x2 = T([1.0, -2.0, 0.5, 3.0]), T([-3.0, 1.0, 0.2, 1.5])
    # trim at density 0.5: x1 keeps -2, 3; x2 keeps -3, 1.5. Elected signs (sum -3, -2, 0, 4.5): -, -, + (0 counts +), +.
    # Disjoint mean: entry 0 only x2 agrees (-3), entry 1 only x1 (-2), entry 2 nobody (divisor 0 -> 1), entry 3 both.
    out = _merge("ties", base, [x1, x2], [1.0, 1.0], [0.5, 0.5])
    torch.testing.assert_close(out, T([-3.0, -2.0, 0.0, 2.25]))
    # weights enter the election and the divisor: the agreeing weights only
    out_w = _merge("ties", base, [x1, x2], [3.0, 1.0], [0.5, 0.5])
    # weighted: x1 -> [0, -6, 0, 9], x2 -> [-3, 0, 0, 1.5]; all agree where non-zero; entry 3 = (9 + 1.5) / (3 + 1)
    torch.testing.assert_close(out_w, T([-3.0, -2.0, 0.0, 10.5 / 4]))


def test_sign_election_zero_entries_never_agree_and_ties_go_positive() -> None:
    weighted = T([[1.0, 0.0, -1.0], [-1.0, 2.0, 0.0]])
    mask = sign_consensus(weighted)
    # sums: 0 (-> +), 2 (+), -1 (-)
    assert mask.tolist() == [[True, False, True], [False, True, False]]


def test_magnitude_trim_keeps_int_density_times_numel_largest() -> None:
    delta = T([0.1, -0.5, 0.3, -0.2, 0.05])
    assert sparsify_magnitude(delta, 0.4).tolist() == pytest.approx([0.0, -0.5, 0.3, 0.0, 0.0])
    assert sparsify_magnitude(delta, 1.0) is delta
    # too small to keep one entry: it contributes nothing (mergekit asserts instead)
    assert sparsify_magnitude(delta, 0.1).abs().sum().item() == 0


def test_l1_rescale_restores_the_task_vectors_l1_norm() -> None:
    delta = T([0.1, -0.5, 0.3, -0.2])
    kept = sparsify_magnitude(delta, 0.5, rescale="l1")
    assert kept.abs().sum().item() == pytest.approx(delta.abs().sum().item())
    assert (kept != 0).tolist() == [False, True, True, False]


def test_dare_drops_with_probability_one_minus_density_and_rescales() -> None:
    delta = torch.linspace(0.1, 1.0, 20000)
    gen = torch.Generator().manual_seed(3)
    out = sparsify_random(delta, 0.3, gen, rescale="density")
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.3) < 0.02
    torch.testing.assert_close(out[kept], delta[kept] / 0.3)
    same = sparsify_random(delta, 0.3, torch.Generator().manual_seed(3), rescale="density")
    assert torch.equal(out, same)
    other = sparsify_random(delta, 0.3, torch.Generator().manual_seed(4), rescale="density")
    assert not torch.equal(out, other)
    l1 = sparsify_random(delta, 0.3, torch.Generator().manual_seed(3), rescale="l1")
    assert l1.abs().sum().item() == pytest.approx(delta.abs().sum().item(), rel=1e-5)


def test_dare_ties_and_dare_linear_are_the_task_vector_merge_of_the_dropped_vectors() -> None:
    base = T([0.5, -1.0, 2.0, 0.0, 1.0, 1.0])
    tuned = [base + T([1.0, -1.0, 0.5, 2.0, -0.5, 0.1]), base + T([-1.0, -2.0, 0.5, 1.0, 0.5, 0.3])]
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(2)]  # noqa: E731
    dropped = [sparsify_random(t - base, 0.5, g, rescale="l1") for t, g in zip(tuned, gens())]
    lin = _merge("dare_linear", base, tuned, [1.0, 2.0], [0.5, 0.5], rescale="l1", generators=gens())
    torch.testing.assert_close(lin, base + dropped[0] + 2.0 * dropped[1])
    ties = _merge("dare_ties", base, tuned, [1.0, 2.0], [0.5, 0.5], rescale="l1", generators=gens())
    weighted = torch.stack([dropped[0], 2.0 * dropped[1]])
    mask = sign_consensus(weighted)
    torch.testing.assert_close(ties, base + (weighted * mask).sum(0))


def test_slerp_by_hand_and_its_colinear_fallback() -> None:
    out = slerp(0.5, T([1.0, 0.0]), T([0.0, 1.0]))
    torch.testing.assert_close(out, T([math.sqrt(0.5), math.sqrt(0.5)]))
    out = slerp(1 / 3, T([2.0, 0.0]), T([0.0, 1.0]))  # the angle moves by 30 degrees; the lengths mix by sin weights
    s0, s1 = math.sin(math.pi / 3) / 1.0, math.sin(math.pi / 6)
    torch.testing.assert_close(out, T([2.0 * s0, s1]))
    torch.testing.assert_close(slerp(0.25, T([1.0, 2.0]), T([2.0, 4.0])), T([1.25, 2.5]))  # colinear: lerp
    assert slerp(0.3, T([1.0, 0.0], dtype=torch.bfloat16), T([0.0, 1.0])).dtype == torch.bfloat16


def test_linear_is_the_weighted_mean() -> None:
    a, b = T([1.0, 3.0]), T([3.0, -1.0])
    torch.testing.assert_close(linear([a, b], [1.0, 3.0]), (a + 3 * b) / 4)
    torch.testing.assert_close(linear([a, b], [1.0, 3.0], normalize=False), a + 3 * b)


def test_parameters_per_tensor_pattern_and_gradients_over_layers() -> None:
    setting = [{"filter": "self_attn", "value": [0.0, 1.0]}, {"filter": "mlp", "value": 0.3}, {"value": 0.5}]
    assert evaluate("model.layers.1.self_attn.q_proj.weight", setting, 0.25) == pytest.approx(0.25)
    assert evaluate("model.layers.1.mlp.up_proj.weight", setting, 0.25) == 0.3
    assert evaluate("model.norm.weight", setting, 0.0) == 0.5
    assert evaluate("x", [0.0, 1.0, 0.0], 0.75) == pytest.approx(0.5)
    assert evaluate("x", [{"filter": "mlp", "value": 1.0}], 0.0) is None
    pos = layer_positions(["model.embed_tokens.weight", "model.layers.0.a", "model.layers.2.a", "model.layers.1.a", "lm_head.weight"])
    assert pos == {
        "model.embed_tokens.weight": 0.0,
        "model.layers.0.a": 0.0,
        "model.layers.1.a": 0.5,
        "model.layers.2.a": 1.0,
        "lm_head.weight": 0.0,
    }


def _files(tmp_path: Path) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    base = {f"model.layers.{i}.{part}.weight": torch.randn(6, 5, generator=g) for i in range(3) for part in ("self_attn", "mlp")}
    base["model.norm.weight"] = torch.ones(5)
    save_file(base, str(tmp_path / "base.safetensors"))
    tuned = []
    for k in range(3):
        own = {n: v + 0.1 * torch.randn(v.shape, generator=g) for n, v in base.items()}
        save_file(own, str(tmp_path / f"ft{k}.safetensors"))
        tuned.append(own)
    return base, tuned


def test_fuse_ties_with_per_tensor_weights_matches_the_formula(tmp_path: Path) -> None:
    base, tuned = _files(tmp_path)
    weight = [{"filter": "self_attn", "value": 2.0}, {"value": 1.0}]
    config = {
        "merge_method": "ties",
        "base_model": str(tmp_path / "base.safetensors"),
        "models": [
            {"model": str(tmp_path / "base.safetensors")},  # mergekit lists the base too: skipped
            *[{"model": str(tmp_path / f"ft{k}.safetensors"), "parameters": {"weight": weight if k == 0 else 1.0}} for k in range(3)],
        ],
        "parameters": {"density": [0.2, 1.0], "lambda": 0.9},
        "output": str(tmp_path / "out.safetensors"),
    }
    out = load_file(str(rayfuse.fuse(config)))
    assert set(out) == set(base)
    for name, value in base.items():
        t = layer_positions(list(base))[name]
        density = 0.2 + 0.8 * t
        weights = [2.0 if "self_attn" in name else 1.0, 1.0, 1.0]
        expected = _merge("ties", value, [m[name] for m in tuned], weights, [density] * 3, lam=0.9)
        torch.testing.assert_close(out[name], expected, rtol=0, atol=0)


def test_fuse_slerp_with_a_gradient_for_attention(tmp_path: Path) -> None:
    base, tuned = _files(tmp_path)
    config = {
        "merge_method": "slerp",
        "base_model": str(tmp_path / "base.safetensors"),
        "models": [{"model": str(tmp_path / "base.safetensors")}, {"model": str(tmp_path / "ft1.safetensors")}],
        "parameters": {"t": [{"filter": "self_attn", "value": [0.0, 1.0]}, {"value": 0.5}]},
        "output": str(tmp_path / "s.safetensors"),
    }
    out = load_file(str(rayfuse.fuse(config)))
    pos = layer_positions(list(base))
    for name, value in base.items():
        t = pos[name] if "self_attn" in name else 0.5
        torch.testing.assert_close(out[name], slerp(t, value, tuned[1][name]), rtol=0, atol=0)
    assert torch.equal(out["model.layers.0.self_attn.weight"], base["model.layers.0.self_attn.weight"])  # t = 0: the base


def test_fuse_weighted_average_into_a_folder_is_linear(tmp_path: Path) -> None:
    _, tuned = _files(tmp_path)
    config = {
        "merge_method": "weighted_average",
        "models": [{"model": str(tmp_path / f"ft{k}.safetensors"), "parameters": {"weight": float(k + 1)}} for k in range(3)],
        "output": str(tmp_path / "avg"),
    }
    folder = rayfuse.fuse(config)
    out = load_file(str(folder / "model.safetensors"))
    for name in tuned[0]:
        expected = sum((k + 1) * tuned[k][name] for k in range(3)) / 6
        np.testing.assert_allclose(out[name].numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)


def _stats(tmp_path: Path, tuned: list[dict[str, torch.Tensor]], kind: str) -> list[str]:
    g = torch.Generator().manual_seed(7)
    files = []
    for k, model in enumerate(tuned):
        if kind == "fisher":
            stats = {n: torch.rand(v.shape, generator=g) for n, v in model.items() if "mlp" in n}
        else:
            stats = {}
            for n, v in model.items():
                if v.dim() == 2:
                    a = torch.randn(v.shape[1], v.shape[1], generator=g)
                    stats[n] = a @ a.T + 0.1 * torch.eye(v.shape[1])
        save_file(stats, str(tmp_path / f"{kind}{k}.safetensors"))
        files.append(str(tmp_path / f"{kind}{k}.safetensors"))
    return files


def test_fuse_fisher_weights_each_entry_by_the_models_fisher(tmp_path: Path) -> None:
    base, tuned = _files(tmp_path)
    files = _stats(tmp_path, tuned, "fisher")
    config = {
        "merge_method": "fisher",
        "base_model": str(tmp_path / "base.safetensors"),
        "output": str(tmp_path / "f.safetensors"),
        "models": [
            {"model": str(tmp_path / f"ft{k}.safetensors"), "statistics": files[k], "parameters": {"weight": float(k + 1)}}
            for k in range(3)
        ],
    }
    out = load_file(str(rayfuse.fuse(config)))
    fishers = [load_file(f) for f in files]
    w = np.array([1.0, 2.0, 3.0]) / 6.0
    for name in base:
        x = [m[name].double() for m in tuned]
        if "mlp" in name:  # sum w_k (F_k + eps) x_k / sum w_k (F_k + eps)
            num = sum(w[k] * (fishers[k][name].double() + 1e-8) * x[k] for k in range(3))
            den = sum(w[k] * (fishers[k][name].double() + 1e-8) for k in range(3))
            expected = num / den
        else:  # no Fisher: the weighted average
            expected = sum(w[k] * x[k] for k in range(3))
        torch.testing.assert_close(out[name].double(), expected, rtol=1e-6, atol=1e-6)


def test_fuse_regmean_solves_the_least_squares_merge_of_each_linear_weight(tmp_path: Path) -> None:
    base, tuned = _files(tmp_path)
    files = _stats(tmp_path, tuned, "gram")
    config = {
        "merge_method": "regmean",
        "base_model": str(tmp_path / "base.safetensors"),
        "output": str(tmp_path / "r"),
        "parameters": {"alpha": 1.0},
        "models": [{"model": str(tmp_path / f"ft{k}.safetensors"), "statistics": files[k]} for k in range(3)],
    }
    out = load_file(str(rayfuse.fuse(config) / "model.safetensors"))
    grams = [load_file(f) for f in files]
    name = "model.layers.2.self_attn.weight"
    lhs = sum(grams[k][name].double() for k in range(3))
    rhs = sum(tuned[k][name].double() @ grams[k][name].double() for k in range(3))
    torch.testing.assert_close(out[name].double(), rhs @ torch.linalg.inv(lhs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["model.norm.weight"], sum(m["model.norm.weight"] for m in tuned) / 3)


def test_fisher_without_statistics_or_with_a_wrong_shape_is_refused(tmp_path: Path) -> None:
    _, tuned = _files(tmp_path)
    files = _stats(tmp_path, tuned, "fisher")
    models = [{"model": str(tmp_path / f"ft{k}.safetensors"), "statistics": files[k]} for k in range(3)]
    with pytest.raises(rayfuse.InputError, match=r"models\.1\.statistics"):
        rayfuse.fuse({"merge_method": "fisher", "models": [models[0], {"model": models[1]["model"]}], "output": str(tmp_path / "x")})
    save_file({"model.layers.0.mlp.weight": torch.ones(5, 6)}, str(tmp_path / "bad.safetensors"))
    bad = {**load_file(files[2]), "model.layers.0.mlp.weight": torch.ones(5, 6)}
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(rayfuse.InputError, match=r"model\.layers\.0\.mlp\.weight: expected shape \(6, 5\)"):
        rayfuse.fuse(
            {
                "merge_method": "fisher",
                "models": [*models[:2], {**models[2], "statistics": str(tmp_path / "bad.safetensors")}],
                "output": str(tmp_path / "y"),
            }
        )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_regmean_row_counts_of_a_wrong_length_or_sign_are_refused_in_one_line(tmp_path: Path) -> None:
    """A 2-d tensor's statistic may be its rows' use counts (an embedding table's diagonal Gram): (rows,), non-negative."""
    _, tuned = _files(tmp_path)
    files = _stats(tmp_path, tuned, "gram")
    name = "model.layers.0.mlp.weight"  # (6, 5): 6 rows
    counted = []
    for k in range(3):
        save_file({**load_file(files[k]), name: torch.full((6,), float(k + 1))}, str(tmp_path / f"counted{k}.safetensors"))
        counted.append(str(tmp_path / f"counted{k}.safetensors"))
    models = [{"model": str(tmp_path / f"ft{k}.safetensors"), "statistics": counted[k]} for k in range(3)]
    for case, counts, message in (
        ("length", torch.ones(5), r"model\.layers\.0\.mlp\.weight: expected shape \(6,\) \(its rows\), got \(5,\)"),
        ("sign", -torch.ones(6), r"model\.layers\.0\.mlp\.weight: expected finite non-negative statistics"),
    ):
        bad = tmp_path / f"bad-{case}.safetensors"
        save_file({**load_file(files[2]), name: counts}, str(bad))
        out = tmp_path / f"out-{case}.safetensors"
        with pytest.raises(rayfuse.InputError, match=message):
            rayfuse.fuse({"merge_method": "regmean", "models": [*models[:2], {**models[2], "statistics": str(bad)}], "output": str(out)})
        assert not out.exists()
    mixed = tmp_path / "mixed.safetensors"
    save_file({**load_file(files[2]), name: torch.ones(6)}, str(mixed))
    models = [{"model": str(tmp_path / f"ft{k}.safetensors"), "statistics": files[k]} for k in range(3)]
    with pytest.raises(rayfuse.InputError, match=r"mlp\.weight: expected the shape of models\.0's statistic \(5, 5\), got \(6,\)"):
        rayfuse.fuse(
            {"merge_method": "regmean", "models": [*models[:2], {**models[2], "statistics": str(mixed)}], "output": str(tmp_path / "m")}
        )
