"""Alignment on specs derived from the model's graph: planted permutations of real architectures are recovered
exactly, and fusing copies of one model returns it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfuse.alignment import activation_matching, collect_correlations, merge_average, weight_matching
from rayfuse.config import ModelConfig
from rayfuse.models import build_model, get_params, set_params
from rayfuse.symmetry import derive_spec, trace_model

ARCHS = {
    "mlp": (ModelConfig(name="mlp", hidden=[24, 16]), (64,)),
    "rescnn": (ModelConfig(name="rescnn", channels=[6, 8]), (1, 8, 8)),
    "vgg": (ModelConfig(name="vgg", channels=[6, 8]), (1, 8, 8)),
    # attention's heads and head dims by weights (no probe inside nn.MultiheadAttention), the rest by activations
    "transformer": (ModelConfig(name="transformer", hidden=[8, 12], heads=2, depth=2), (1, 8, 8)),
}


def randomised(model):
    """Random BatchNorm statistics too, so a wrong permutation of them would show."""
    gen = torch.Generator().manual_seed(7)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=gen))
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=gen) + 0.5)
    return model.eval()


def local_collect(cfg, shape, models, X):
    def collect(reference):
        ref = set_params(build_model(cfg, shape, 10, seed=0), reference).eval()
        out = []
        for params in models:
            own = set_params(build_model(cfg, shape, 10, seed=0), params).eval()
            out.append(collect_correlations(ref, own, spec_of(cfg, shape), trace_model(ref), trace_model(own), X, batch_size=64))
        return out

    return collect


def spec_of(cfg, shape):
    return derive_spec(build_model(cfg, shape, 10, seed=0).eval(), torch.zeros((2, *shape)))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_planted_permutation_is_recovered_exactly_by_weight_and_by_activation_matching(arch):
    cfg, shape = ARCHS[arch]
    # random BatchNorm statistics: some ReLU units never fire on the sample, and only the weights tell those apart
    model = randomised(build_model(cfg, shape, 10, seed=1))
    spec = spec_of(cfg, shape)
    assert spec.groups
    base = get_params(model)
    planted = spec.apply(base, spec.random(np.random.default_rng(3)))
    x = torch.randn(5, *shape)
    with torch.no_grad():  # the planted permutation is a symmetry: same function
        torch.testing.assert_close(set_params(build_model(cfg, shape, 10, seed=0), planted).eval()(x), model(x), atol=1e-5, rtol=1e-5)
    X = np.random.default_rng(4).normal(size=(128, *shape)).astype(np.float32)
    by_weights = weight_matching([base, planted], spec)
    by_activations = activation_matching([base, planted], spec, local_collect(cfg, shape, [base, planted], X))
    for name, result in (("weight", by_weights), ("activation", by_activations)):
        undone = spec.apply(planted, result.perms[1])
        for key, value in base.items():
            np.testing.assert_array_equal(undone[key], value, err_msg=f"{name} matching: {key}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fusing_permuted_copies_of_one_model_returns_the_model(arch):
    cfg, shape = ARCHS[arch]
    spec = spec_of(cfg, shape)
    base = get_params(randomised(build_model(cfg, shape, 10, seed=2)))
    rng = np.random.default_rng(5)
    copies = [base] + [spec.apply(base, spec.random(rng)) for _ in range(3)]
    result = weight_matching(copies, spec)
    fused = merge_average([spec.apply(m, p) for m, p in zip(copies, result.perms)])
    for key, value in base.items():
        np.testing.assert_allclose(fused[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
