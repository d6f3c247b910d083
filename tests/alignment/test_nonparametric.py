"""The nonparametric merge: unmatched units become new global units (PFNM-style), for any model with a spec.

Its two limits pin the math: with no new units it is the weighted average, and with every unit new the global model is
the models side by side, computing exactly the weighted average of their logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfuse.alignment import fuse_nonparametric, merge_average, merge_nonparametric, plan_widths, unit_agreement, width_roles
from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.models import build_model, get_params
from rayfuse.symmetry import derive_spec, read_structure, resize_model
from tests.alignment.test_derived_specs import randomised

ARCHS = {
    "mlp": (ModelConfig(name="mlp", hidden=[12, 8]), (20,)),
    "cnn": (ModelConfig(name="cnn", channels=[4, 6]), (1, 8, 8)),
    "rescnn": (ModelConfig(name="rescnn", channels=[4, 6]), (1, 8, 8)),
    "vgg": (ModelConfig(name="vgg", channels=[4, 6]), (1, 8, 8)),
}
WEIGHTS = [1.0, 2.0, 3.0]


def three_models(arch):
    cfg, shape = ARCHS[arch]
    models = [randomised(build_model(cfg, shape, 5, seed=s)) for s in range(3)]
    spec = derive_spec(models[0], torch.zeros((2, *shape)))
    return cfg, shape, models, [get_params(m) for m in models], spec


def at_widths(cfg, shape, params):
    model = build_model(cfg, shape, 5, seed=0)
    return resize_model(model, read_structure(model, torch.zeros((2, *shape))), params).eval()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_with_every_unit_new_the_global_model_computes_the_weighted_average_of_the_models_logits(arch):
    cfg, shape, models, params, spec = three_models(arch)
    roles = width_roles(models[0], spec)
    assert not roles.fixed
    fused, plan = fuse_nonparametric(params, spec, roles, weights=WEIGHTS, threshold=float("inf"), max_width=3)
    assert plan.widths == {g.name: 3 * g.size for g in spec.groups}
    x = torch.randn(6, *shape)
    with torch.no_grad():
        expected = sum(w / sum(WEIGHTS) * m(x) for w, m in zip(WEIGHTS, models))
        torch.testing.assert_close(at_widths(cfg, shape, fused)(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_with_no_new_unit_it_is_the_weighted_average(arch):
    _, _, models, params, spec = three_models(arch)
    fused, plan = fuse_nonparametric(params, spec, width_roles(models[0], spec), weights=WEIGHTS, threshold=-float("inf"))
    assert plan.widths == {g.name: g.size for g in spec.groups}
    average = merge_average(params, WEIGHTS)
    for key, value in average.items():
        np.testing.assert_allclose(fused[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


def test_the_plan_keeps_a_holder_for_every_unit_caps_the_width_and_makes_the_worst_matched_units_new():
    _, _, _, _, spec = three_models("mlp")
    first = spec.groups[0]
    rng = np.random.default_rng(0)
    quality = [{g.name: rng.uniform(-1, 1, g.size) for g in spec.groups} for _ in range(3)]
    plan = plan_widths(quality, spec, threshold=0.5, max_width=1.5, fixed={spec.groups[1].name})
    assert plan.widths[spec.groups[1].name] == spec.groups[1].size  # a fixed group keeps its width
    cap = int(1.5 * first.size)
    assert first.size < plan.widths[first.name] <= cap
    for i in range(first.size):  # every global unit of the model's width has at least one model
        assert any(plan.index[k][first.name][i] == i for k in range(3))
    held = np.concatenate([plan.index[k][first.name] for k in range(3)])
    assert set(range(plan.widths[first.name])) <= set(held.tolist())
    new = [(k, i) for k in range(3) for i in range(first.size) if plan.index[k][first.name][i] >= first.size]
    moved = [quality[k][first.name][i] for k, i in new]
    stayed_below = [
        quality[k][first.name][i]
        for k in range(3)
        for i in range(first.size)
        if plan.index[k][first.name][i] < first.size
        and quality[k][first.name][i] < 0.5
        and sum(quality[j][first.name][i] >= 0.5 or plan.index[j][first.name][i] == i for j in range(3)) > 1
    ]
    assert all(q < 0.5 for q in moved)
    assert not stayed_below or max(moved) <= min(stayed_below)  # the cap keeps the worst matched as new units


def test_two_models_that_share_nothing_grow_and_identical_models_do_not():
    _, _, models, params, spec = three_models("cnn")
    roles = width_roles(models[0], spec)
    same, plan_same = fuse_nonparametric([params[0], params[0]], spec, roles, threshold=0.5, max_width=2)
    assert plan_same.widths == {g.name: g.size for g in spec.groups}
    assert unit_agreement([params[0], params[0]], spec)[0][spec.groups[0].name].min() > 0.999
    _, plan = fuse_nonparametric(params[:2], spec, roles, threshold=0.9, max_width=2)
    assert all(plan.widths[g.name] > g.size for g in spec.groups)


def test_attention_heads_and_layernormed_units_keep_their_width_with_the_reason():
    cfg = ModelConfig(name="transformer", hidden=[16], heads=2, depth=1, patch_size=4)
    model = build_model(cfg, (1, 8, 8), 5, seed=0)
    spec = derive_spec(model, torch.zeros(2, 1, 8, 8))
    roles = width_roles(model, spec)
    kinds = {g.name: g.kind for g in spec.groups}
    assert {name for name, kind in kinds.items() if kind in ("heads", "head_dims")} <= set(roles.fixed)
    assert any("LayerNorm" in reason for reason in roles.fixed.values())
    growable = [name for name in kinds if name not in roles.fixed]
    assert growable  # the feed-forward hidden units
    params = [get_params(build_model(cfg, (1, 8, 8), 5, seed=s)) for s in range(2)]
    fused, plan = fuse_nonparametric(params, spec, roles, threshold=float("inf"), max_width=2)
    assert all(plan.widths[n] == spec.group(n).size for n in roles.fixed)
    assert all(plan.widths[n] == 2 * spec.group(n).size for n in growable)
    with torch.no_grad():
        out = at_widths(cfg, (1, 8, 8), fused)(torch.randn(3, 1, 8, 8))
    assert out.shape == (3, 5) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": float("nan")}, "threshold: expected a number"),
        ({"threshold": 0.5, "max_width": 0.5}, "max_width: expected a finite factor >= 1"),
    ],
)
def test_bad_plan_parameters_are_one_line(kwargs, message):
    _, _, _, params, spec = three_models("mlp")
    with pytest.raises(InputError, match=message):
        plan_widths(unit_agreement(params, spec), spec, **kwargs)


def test_a_plan_for_other_models_is_refused():
    _, _, models, params, spec = three_models("mlp")
    plan = plan_widths(unit_agreement(params[:2], spec), spec, threshold=0.0)
    with pytest.raises(InputError, match="plan: expected the units of 3 models"):
        merge_nonparametric(params, spec, plan, width_roles(models[0], spec))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_models_side_by_side_compute_the_average_of_their_logits(name):
    import torchvision

    from rayfuse.symmetry import resize_with_spec

    torch.manual_seed(0)
    models = [randomised(getattr(torchvision.models, name)(num_classes=4)) for _ in range(2)]
    spec = derive_spec(models[0], torch.zeros(2, 3, 32, 32))
    roles = width_roles(models[0], spec)
    params = [get_params(m) for m in models]
    fused, plan = fuse_nonparametric(params, spec, roles, weights=[1.0, 3.0], threshold=float("inf"), max_width=2)
    assert all(plan.widths[g.name] == 2 * g.size for g in spec.groups if g.name not in roles.fixed)
    wide = resize_with_spec(getattr(torchvision.models, name)(num_classes=4).eval(), spec, fused, (2, 3, 32, 32))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(wide(x), 0.25 * models[0](x) + 0.75 * models[1](x), atol=1e-4, rtol=1e-4)
