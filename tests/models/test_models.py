"""Model registry and parameter dicts (rayfuse.models.registry, rayfuse.models.params)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.models.params import check_params, get_params, num_bytes, params_equal, set_params
from rayfuse.models.registry import MODELS, ModelInfo, build_model, check_model_fits

DIGITS = (1, 8, 8)


def batch(shape=DIGITS, n=5, seed=0) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(seed).random((n, *shape), dtype=np.float32))


# ---------------------------------------------------------------------------------------------------------------
# Building models


@pytest.mark.parametrize(
    ("cfg", "feature_dim"),
    [
        pytest.param(ModelConfig(name="logreg"), 64, id="logreg"),
        pytest.param(ModelConfig(name="mlp", hidden=[]), 64, id="mlp-no-hidden"),
        pytest.param(ModelConfig(name="mlp", hidden=[32]), 32, id="mlp-1"),
        pytest.param(ModelConfig(name="mlp", hidden=[32, 16, 8], dropout=0.5), 8, id="mlp-3-dropout"),
        pytest.param(ModelConfig(name="mlp", hidden=[12, 12], activation="tanh"), 12, id="mlp-tanh"),
        pytest.param(ModelConfig(name="mlp", hidden=[12], activation="gelu"), 12, id="mlp-gelu"),
        pytest.param(ModelConfig(name="cnn", channels=[8]), 8, id="cnn-1"),
        pytest.param(ModelConfig(name="cnn", channels=[4, 8, 16], dropout=0.2), 16, id="cnn-3-dropout"),
    ],
)
def test_model_maps_a_digits_batch_to_logits(cfg, feature_dim):
    model = build_model(cfg, DIGITS, 10, seed=0).eval()
    x = batch()
    out = model(x)
    assert out.shape == (5, 10) and torch.isfinite(out).all()
    assert model.features(x).shape == (5, feature_dim)


def test_parameter_names_and_shapes_are_the_documented_ones():
    logreg = get_params(build_model(ModelConfig(name="logreg"), DIGITS, 10, seed=0))
    assert {k: v.shape for k, v in logreg.items()} == {"linear.weight": (10, 64), "linear.bias": (10,)}
    mlp = get_params(build_model(ModelConfig(name="mlp", hidden=[32, 16]), DIGITS, 10, seed=0))
    assert {k: v.shape for k, v in mlp.items()} == {
        "layers.0.weight": (32, 64),
        "layers.0.bias": (32,),
        "layers.1.weight": (16, 32),
        "layers.1.bias": (16,),
        "layers.2.weight": (10, 16),
        "layers.2.bias": (10,),
    }
    cnn = get_params(build_model(ModelConfig(name="cnn", channels=[4, 8]), DIGITS, 10, seed=0))
    assert {k: v.shape for k, v in cnn.items()} == {
        "convs.0.weight": (4, 1, 3, 3),
        "convs.0.bias": (4,),
        "convs.1.weight": (8, 4, 3, 3),
        "convs.1.bias": (8,),
        "head.weight": (10, 8),
        "head.bias": (10,),
    }


def test_mlp_on_vector_input_and_cnn_on_tiny_images():
    assert build_model(ModelConfig(name="mlp"), (13,), 3, seed=0)(torch.zeros(2, 13)).shape == (2, 3)
    # 2x2 images are too small to pool: the CNN keeps the map and still gives logits
    assert build_model(ModelConfig(name="cnn"), (3, 2, 2), 4, seed=0)(torch.zeros(2, 3, 2, 2)).shape == (2, 4)


def test_dropout_is_active_in_training_and_off_in_eval():
    model = build_model(ModelConfig(name="mlp", hidden=[64], dropout=0.5), DIGITS, 10, seed=0)
    x = batch()
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


@pytest.mark.parametrize("name", ["cnn", "torchvision:resnet18"])
def test_image_model_on_vector_input_names_model_name(name):
    with pytest.raises(InputError, match=r"^model\.name: expected an image dataset \(C, H, W\)"):
        build_model(ModelConfig(name=name), (30,), 2)


def test_unknown_model_name_names_model_name():
    cfg = ModelConfig.model_construct(name="mpl", hidden=[8], channels=[4], dropout=0.0, activation="relu")  # skips validation
    with pytest.raises(InputError, match=r"^model\.name: .*mlp"):
        build_model(cfg, DIGITS, 10)


def test_torchvision_resnet18_adapts_its_first_conv_to_one_channel():
    pytest.importorskip("torchvision")
    model = build_model(ModelConfig(name="torchvision:resnet18"), DIGITS, 10, seed=0).eval()
    assert model.conv1.in_channels == 1 and model.conv1.weight.shape == (64, 1, 7, 7)
    assert model.fc.out_features == 10
    with torch.no_grad():
        assert model(batch(n=2)).shape == (2, 10)
    params = get_params(model)
    assert check_params(params, model.state_dict()) is None  # BatchNorm buffers included
    assert params_equal(get_params(set_params(model, params)), params)


# ---------------------------------------------------------------------------------------------------------------
# Seeding


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn"])
def test_seeded_build_is_deterministic_and_seeds_differ(name):
    cfg = ModelConfig(name=name)
    a, b, c = (get_params(build_model(cfg, DIGITS, 10, seed=s)) for s in (1, 1, 2))
    assert params_equal(a, b)
    assert not params_equal(a, c)


def test_seeded_build_leaves_the_global_torch_rng_alone():
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    build_model(ModelConfig(name="mlp", hidden=[32, 32]), DIGITS, 10, seed=5)
    assert torch.equal(torch.get_rng_state(), state)


def test_unseeded_builds_draw_from_the_global_rng():
    cfg = ModelConfig(name="mlp")
    torch.manual_seed(0)
    first, second = get_params(build_model(cfg, DIGITS, 10)), get_params(build_model(cfg, DIGITS, 10))
    assert not params_equal(first, second)  # two unseeded models are two different initialisations
    torch.manual_seed(0)
    assert params_equal(get_params(build_model(cfg, DIGITS, 10)), first)  # and they follow torch.manual_seed


# ---------------------------------------------------------------------------------------------------------------
# get_params / set_params


def mlp(seed: int) -> nn.Module:
    return build_model(ModelConfig(name="mlp", hidden=[16]), DIGITS, 10, seed=seed)


def test_get_params_returns_contiguous_numpy_copies():
    model = mlp(0)
    params = get_params(model)
    assert all(isinstance(v, np.ndarray) and v.flags.c_contiguous and v.dtype == np.float32 for v in params.values())
    params["layers.0.bias"][:] = 99.0  # writing to the copy does not reach the model
    assert not np.any(model.layers[0].bias.detach().numpy() == 99.0)


def test_set_params_then_get_params_round_trips_exactly():
    source = get_params(mlp(0))
    target = mlp(1)
    assert not params_equal(get_params(target), source)
    set_params(target, source)
    assert params_equal(get_params(target), source)
    x = batch()
    assert torch.equal(mlp(0).eval()(x), target.eval()(x))


def test_set_params_copies_so_later_edits_of_the_source_do_not_leak():
    source = get_params(mlp(0))
    target = set_params(mlp(1), source)
    source["layers.1.weight"][:] = 0.0
    assert np.abs(get_params(target)["layers.1.weight"]).sum() > 0


def test_set_params_accepts_read_only_arrays_without_warning():
    source = get_params(mlp(0))
    for value in source.values():
        value.setflags(write=False)  # as Ray hands them out of the object store
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target = set_params(mlp(1), source)
    assert params_equal(get_params(target), source)


def test_get_params_keeps_0d_buffers_0d_so_a_batchnorm_model_round_trips():
    # np.ascontiguousarray used to turn BatchNorm's 0-d num_batches_tracked into shape (1,), which set_params rejects.
    bn = nn.BatchNorm1d(3)
    params = get_params(bn)
    assert params["num_batches_tracked"].shape == () and params["num_batches_tracked"].dtype == np.int64
    assert check_params(params, bn.state_dict()) is None
    set_params(nn.BatchNorm1d(3), params)


def test_set_params_keeps_buffers():
    bn = nn.BatchNorm1d(3)
    params = get_params(bn)
    assert set(params) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    params["running_mean"] = np.array([1.0, 2.0, 3.0], np.float32)
    params["num_batches_tracked"] = np.array(7, np.int64)
    set_params(bn, params)
    assert bn.running_mean.tolist() == [1.0, 2.0, 3.0] and int(bn.num_batches_tracked) == 7


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param(lambda p: p.pop("layers.1.bias"), r"missing keys \['layers\.1\.bias'\]", id="missing-key"),
        pytest.param(lambda p: p.update(extra=np.zeros(1, np.float32)), r"unexpected keys \['extra'\]", id="extra-key"),
        pytest.param(
            lambda p: p.update({"layers.0.weight": np.zeros((16, 63), np.float32)}),
            r"layers\.0\.weight: shape \(16, 63\), expected \(16, 64\)",
            id="wrong-shape",
        ),
    ],
)
def test_set_params_rejects_wrong_keys_and_shapes(edit, match):
    params = get_params(mlp(0))
    edit(params)
    model = mlp(1)
    before = get_params(model)
    with pytest.raises(ValueError, match=match):
        set_params(model, params)
    assert params_equal(get_params(model), before)  # nothing was loaded


# ---------------------------------------------------------------------------------------------------------------
# check_params

REFERENCE = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32), "count": np.zeros((), np.int64)}


def with_(**changes):
    params = {k: v.copy() for k, v in REFERENCE.items()}
    for key, value in changes.items():
        if value is None:
            params.pop(key)
        else:
            params[key] = value
    return params


@pytest.mark.parametrize(
    ("params", "match"),
    [
        pytest.param(with_(w=np.array([[0, np.nan, 0], [0, 0, 0]], np.float32)), r"^w: NaN or Inf values$", id="nan"),
        pytest.param(with_(b=np.array([np.inf, 0], np.float32)), r"^b: NaN or Inf values$", id="inf"),
        pytest.param(with_(b=np.array([0, -np.inf], np.float32)), r"^b: NaN or Inf values$", id="neg-inf"),
        pytest.param(with_(b=np.array([0, 1], np.float64)), r"^b: dtype float64, expected float32$", id="dtype"),
        pytest.param(with_(b=None), r"^missing keys \['b'\]$", id="missing"),
        pytest.param(with_(extra=np.zeros(1)), r"^unexpected keys \['extra'\]$", id="extra"),
        pytest.param(with_(b=None, extra=np.zeros(1)), r"^missing keys \['b'\]; unexpected keys \['extra'\]$", id="missing-and-extra"),
        pytest.param(with_(w=np.zeros((3, 2), np.float32)), r"^w: shape \(3, 2\), expected \(2, 3\)$", id="transposed"),
        pytest.param(with_(count=np.zeros(1, np.int64)), r"^count: shape \(1,\), expected \(\)$", id="scalar-vs-vector"),
        pytest.param([np.zeros(2)], r"^expected a mapping of arrays, got list$", id="not-a-mapping"),
    ],
)
def test_check_params_explains_what_is_wrong(params, match):
    problem = check_params(params, REFERENCE)
    assert problem is not None and re.search(match, problem), problem


def test_check_params_accepts_a_good_update_and_torch_references():
    assert check_params(with_(), REFERENCE) is None
    model = mlp(0)
    assert check_params(get_params(model), model.state_dict()) is None


def test_check_params_can_skip_the_finiteness_check():
    nan = with_(b=np.array([np.nan, 0], np.float32))
    assert check_params(nan, REFERENCE, check_finite=False) is None


def test_check_params_lists_at_most_three_missing_keys():
    reference = {f"k{i}": np.zeros(1) for i in range(5)}
    assert check_params({}, reference) == "missing keys ['k0', 'k1', 'k2']..."


def test_num_bytes_and_params_equal():
    assert num_bytes(REFERENCE) == 2 * 3 * 4 + 2 * 4 + 8
    assert params_equal(REFERENCE, with_())
    assert not params_equal(REFERENCE, with_(b=np.ones(2, np.float32)))
    assert not params_equal(REFERENCE, with_(b=None))


# ---------------------------------------------------------------------------------------------------------------
# check_model_fits


def test_check_model_fits_returns_the_parameter_count():
    # mlp 64 -> 64 -> 10: (64 * 64 + 64) + (64 * 10 + 10)
    assert check_model_fits(ModelConfig(name="mlp", hidden=[64]), DIGITS, 10) == 4810
    assert check_model_fits(ModelConfig(name="logreg"), (4,), 3) == 4 * 3 + 3


def test_check_model_fits_rejects_non_image_input_for_cnn():
    with pytest.raises(InputError, match=r"^model\.name: "):
        check_model_fits(ModelConfig(name="cnn"), (64,), 10)


@pytest.fixture
def registered(monkeypatch):
    """Register a throw-away model for the duration of one test."""

    def register(name, builder):
        MODELS.canonical(name)  # run the registry's loaders first
        monkeypatch.setitem(MODELS._items, name, ModelInfo(name, builder, "test model"))
        return ModelConfig.model_construct(name=name, hidden=[8], channels=[4], dropout=0.0, activation="relu")

    return register


def test_check_model_fits_reports_a_model_that_cannot_take_the_input(registered):
    cfg = registered("wrong-width", lambda cfg, shape, n: nn.Sequential(nn.Flatten(), nn.Linear(63, n)))
    with pytest.raises(InputError, match=r"^model\.name: expected a model that accepts inputs of shape \(1, 8, 8\)") as info:
        check_model_fits(cfg, DIGITS, 10)
    assert "\n" not in str(info.value)


def test_check_model_fits_reports_the_wrong_number_of_logits(registered):
    cfg = registered("wrong-classes", lambda cfg, shape, n: nn.Sequential(nn.Flatten(), nn.Linear(64, n + 1)))
    with pytest.raises(InputError, match=r"^model\.name: expected a model producing 10 logits, got 'output shape \(2, 11\)'"):
        check_model_fits(cfg, DIGITS, 10)
