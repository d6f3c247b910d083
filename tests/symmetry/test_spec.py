"""PermutationSpec: applying permutations, structured axes, round trips and checks (hand-written specs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from rayfuse.errors import InputError
from rayfuse.symmetry import AxisRef, PermGroup, PermutationSpec, Probe, compose, invert


def mlp_spec(widths=(8, 6)) -> PermutationSpec:
    """git-re-basin's hand-written spec of nn.Sequential(Linear, ReLU, Linear, ReLU, Linear)."""
    groups = []
    for i, width in enumerate(widths):
        layer, nxt = 2 * i, 2 * (i + 1)
        groups.append(
            PermGroup(
                f"P{i}",
                width,
                (AxisRef(f"{layer}.weight", 0), AxisRef(f"{layer}.bias", 0), AxisRef(f"{nxt}.weight", 1)),
                (Probe(f"_{layer + 1}", 1),),
            )
        )
    return PermutationSpec(tuple(groups))


def as_numpy(module):
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def test_a_permutation_from_the_spec_leaves_the_mlps_outputs_unchanged():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    spec = mlp_spec()
    perms = spec.random(np.random.default_rng(1))
    permuted = spec.apply(as_numpy(net), perms)
    x = torch.randn(11, 5)
    before = net(x)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in permuted.items()})
    assert torch.allclose(net(x), before, atol=1e-6)


def test_apply_torch_equals_apply():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    spec = mlp_spec()
    perms = spec.random(np.random.default_rng(2))
    by_numpy = spec.apply(as_numpy(net), perms)
    by_torch = spec.apply_torch(net.state_dict(), perms)
    for key, value in by_numpy.items():
        assert np.array_equal(value, by_torch[key].numpy()), key


def test_a_flatten_block_axis_moves_whole_channel_blocks():
    # a Linear reading a flattened (C=3, H*W=4) map: channel c owns input columns 4c..4c+3
    w = np.arange(2 * 12).reshape(2, 12)
    axis = AxisRef("fc.weight", 1, inner=4)
    moved = axis.permute(w, np.array([2, 0, 1]))
    assert np.array_equal(moved[:, 0:4], w[:, 8:12]) and np.array_equal(moved[:, 4:8], w[:, 0:4])
    assert axis.view(w, 3).shape == (3, 8)
    assert sorted(axis.view(w, 3)[1]) == sorted(w[:, 4:8].reshape(-1))  # unit 1's row: its block's values


def test_segments_and_repeated_blocks():
    # three packed 4-row segments (Q, K, V); the middle one (start 4) holds 2 heads x 2 dims; permute the dims per head
    w = np.arange(12)
    axis = AxisRef("in_proj_weight", 0, start=4, outer=2)
    assert list(axis.permute(w, np.array([1, 0]))) == [0, 1, 2, 3, 5, 4, 7, 6, 8, 9, 10, 11]


def test_compose_and_invert():
    rng = np.random.default_rng(0)
    a, b = rng.permutation(7), rng.permutation(7)
    x = rng.normal(size=7)
    assert np.array_equal(x[a][b], x[compose(a, b)])
    assert np.array_equal(x[a][invert(a)], x)


def test_round_trip_through_json_and_describe():
    spec = mlp_spec()
    again = PermutationSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    text = spec.describe()
    assert "2 permutation groups" in text and "2.weight[1]" in text


def test_check_names_the_axis_that_does_not_fit():
    spec = mlp_spec()
    shapes = {"0.weight": (8, 5), "0.bias": (8,), "2.weight": (6, 8), "2.bias": (6,), "4.weight": (3, 5)}
    with pytest.raises(InputError, match=r"^spec\.P1\.4\.weight: expected 1 x 6 x 1 units"):
        spec.check(shapes)
    with pytest.raises(InputError, match="unique group names"):
        PermutationSpec((PermGroup("a", 2, ()), PermGroup("a", 2, ())))
    with pytest.raises(InputError, match=r"^spec\.groups\.0: expected name, size and axes"):
        PermutationSpec.from_dict({"groups": [{"name": "a"}]})
