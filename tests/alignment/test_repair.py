"""REPAIR's rescaling of hidden layers no BatchNorm follows: which layers, what it computes, what a client sends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfuse.alignment import apply_repair, merge_average, repair_targets, repair_units, unit_statistics
from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.models import build_model, get_params, set_params
from rayfuse.symmetry import derive_spec

MLP = (ModelConfig(name="mlp", hidden=[12, 8]), (20,))


def models_and_spec(cfg, shape, n=2):
    models = [build_model(cfg, shape, 5, seed=s).eval() for s in range(n)]
    return models, derive_spec(models[0], torch.zeros((2, *shape)))


@pytest.mark.parametrize(
    ("cfg", "shape", "expected"),
    [
        (*MLP, ["layers.0", "layers.1"]),
        (ModelConfig(name="rescnn", channels=[4, 6]), (1, 8, 8), []),  # every convolution feeds a BatchNorm
        (ModelConfig(name="vgg", channels=[4, 6]), (1, 8, 8), ["classifier.0", "classifier.1"]),
    ],
)
def test_the_layers_repaired_are_the_hidden_ones_no_batchnorm_follows(cfg, shape, expected):
    models, spec = models_and_spec(cfg, shape)
    assert [u.module for u in repair_units(models[0], spec)] == expected


def test_after_one_pass_per_layer_the_merged_models_statistics_are_the_targets():
    cfg, shape = MLP
    models, spec = models_and_spec(cfg, shape, 3)
    units = repair_units(models[0], spec)
    X = np.random.default_rng(0).normal(size=(256, *shape)).astype(np.float32)
    params = [get_params(m) for m in models]
    weights = [1.0, 2.0, 1.0]
    targets = repair_targets([unit_statistics(m, X, units) for m in models], units, weights)
    merged = merge_average(params, weights)
    for _ in units:
        stats = unit_statistics(set_params(build_model(cfg, shape, 5), merged).eval(), X, units)
        merged = apply_repair(merged, units, repair_targets([stats], units, [1.0]), targets)
    final = unit_statistics(set_params(build_model(cfg, shape, 5), merged).eval(), X, units)
    for unit in units:
        _, mean, var = final[unit.module]
        np.testing.assert_allclose(mean, targets[unit.module][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.sqrt(var), targets[unit.module][1], rtol=1e-4, atol=1e-5)


def test_repairing_a_merge_of_identical_models_changes_nothing():
    cfg, shape = MLP
    models, spec = models_and_spec(cfg, shape)
    units = repair_units(models[0], spec)
    params = get_params(models[0])
    per_client = [
        unit_statistics(models[0], np.random.default_rng(k).normal(size=(64, *shape)).astype(np.float32), units) for k in range(2)
    ]
    targets = repair_targets(per_client, units, [3.0, 1.0])
    out = apply_repair(params, units, repair_targets(per_client, units, [3.0, 1.0]), targets)
    for key, value in params.items():
        np.testing.assert_allclose(out[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


def test_statistics_of_the_wrong_width_are_one_line():
    cfg, shape = MLP
    models, spec = models_and_spec(cfg, shape)
    units = repair_units(models[0], spec)
    stats = unit_statistics(models[0], np.zeros((4, *shape), np.float32), units)
    with pytest.raises(InputError, match=r"stats\.0\.layers\.0: expected statistics of 24 channels, got 12"):
        repair_targets(
            [stats], units, [1.0], index=[{g.name: np.arange(24) for g in spec.groups}], widths={g.name: 24 for g in spec.groups}
        )
