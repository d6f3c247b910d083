"""What keeps a model of several GB within 3 x its size in each process: the optimizer stepped inside the backward
pass, a reply that takes the trained model's memory instead of copying it, evaluation over the parameters' own memory,
layouts that hold no memory, and a pre-flight check on the meta device. Each is checked for the same results as the
path it replaces, on small models (forced where a size decides)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from rayfuse.config import ModelConfig
from rayfuse.models import (
    build_model,
    check_model_fits,
    check_params,
    get_params,
    model_with_params,
    params_layout,
    predict_proba,
    restore_taken,
    set_params,
    take_params,
    train_model,
)
from rayfuse.models.training import STEP_IN_BACKWARD_BYTES

RNG = np.random.default_rng(0)
X = RNG.normal(size=(200, 12)).astype(np.float32)
Y = RNG.integers(0, 3, 200)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


class _Tied(nn.Module):
    """One weight used twice in the forward pass: its gradient has two contributions, accumulated before its step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(12, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(torch.relu(self.inp(x)))))


@pytest.mark.parametrize(
    "options",
    [
        {"optimizer": "sgd"},
        {"optimizer": "sgd", "momentum": 0.9, "weight_decay": 1e-3},
        {"optimizer": "adam", "weight_decay": 1e-4},
        {"optimizer": "sgd", "proximal_mu": 0.1},
        {"optimizer": "adam", "proximal_mu": 0.05, "early_stop_patience": 1},
    ],
)
@pytest.mark.parametrize("make", [_net, _Tied])
def test_stepping_inside_the_backward_pass_trains_the_same_model_bit_for_bit(options, make):
    one, other = make(), make()
    other.load_state_dict(copy.deepcopy(one.state_dict()))
    a = train_model(one, X, Y, epochs=3, batch_size=32, lr=0.01, seed=4, step_in_backward=False, **options)
    b = train_model(other, X, Y, epochs=3, batch_size=32, lr=0.01, seed=4, step_in_backward=True, **options)
    assert a.loss == b.loss and a.steps == b.steps
    for (name, x), y in zip(one.state_dict().items(), other.state_dict().values()):
        assert torch.equal(x, y), name
    assert all(p.grad is None for p in other.parameters())
    # no hook outlives the call: a later backward leaves the parameters alone and keeps its gradients
    before = [p.detach().clone() for p in other.parameters()]
    nn.functional.cross_entropy(other(torch.as_tensor(X[:8])), torch.as_tensor(Y[:8])).backward()
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), before))
    assert all(p.grad is not None for p in other.parameters())


def test_the_hooks_are_removed_when_training_fails():
    model = _net()
    with pytest.raises(IndexError):  # labels beyond the 3 classes
        train_model(model, X, np.full(200, 7), epochs=1, batch_size=32, lr=0.01, optimizer="sgd", step_in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.cross_entropy(model(torch.as_tensor(X[:8])), torch.as_tensor(Y[:8])).backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_large_model_steps_inside_the_backward_pass_by_default(monkeypatch):
    import rayfuse.models.training as training

    seen = []

    class Spy(training._StepInBackward):
        def __init__(self, *args, **kwargs):
            seen.append(True)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(training, "_StepInBackward", Spy)
    train_model(_net(), X, Y, epochs=1, batch_size=64, lr=0.01, optimizer="sgd")
    assert not seen  # a small model keeps one optimizer
    monkeypatch.setattr(training, "STEP_IN_BACKWARD_BYTES", 1)
    train_model(_net(), X, Y, epochs=1, batch_size=64, lr=0.01, optimizer="sgd")
    assert seen and STEP_IN_BACKWARD_BYTES == 256 * 2**20


def test_take_params_gives_the_models_memory_away_and_work_models_get_it_back():
    model = _net()
    train_model(model, X, Y, epochs=1, batch_size=64, lr=0.01, optimizer="sgd")
    expected = get_params(model)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    taken = take_params(model)
    assert taken.keys() == expected.keys()
    for name, value in taken.items():
        assert np.array_equal(value, expected[name]) and value.dtype == expected[name].dtype and value.shape == expected[name].shape
        assert value.flags.c_contiguous and value.flags.writeable
    # parameters: the very memory the model trained in (no copy); buffers (BatchNorm's statistics): copies
    assert all(taken[name].ctypes.data == pointer for name, pointer in pointers.items())
    assert taken["1.running_mean"].ctypes.data != model.state_dict()["1.running_mean"].data_ptr()
    # the model gave it away: changing the model later cannot change the reply
    assert all(p.numel() == 0 for p in model.parameters())
    restore_taken(model)
    set_params(model, get_params(_net()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(np.array_equal(taken[k], expected[k]) for k in taken)
    assert [tuple(p.shape) for p in model.parameters()] == [tuple(p.shape) for p in _net().parameters()]
    restore_taken(model)  # a model take_params never emptied: nothing to do
    assert all(p.numel() > 0 for p in model.parameters())


def test_take_params_copies_what_it_cannot_take():
    model = nn.Linear(4, 3)
    model.weight.data = model.weight.data.t().contiguous().t()  # a transposed view: not contiguous
    taken = take_params(model)
    assert np.array_equal(taken["weight"], model.weight.detach().numpy())  # copied, the model keeps its parameters
    assert model.weight.numel() == 12


def test_model_with_params_predicts_over_the_arrays_own_memory():
    cfg = ModelConfig(name="mlp", hidden=[32, 32])
    params = get_params(build_model(cfg, (12,), 3, seed=5))
    for value in params.values():
        value.flags.writeable = False  # as Ray's object store hands them out
    built = model_with_params(lambda: build_model(cfg, (12,), 3), params)
    assert all(p.data_ptr() == params[name].ctypes.data for name, p in built.named_parameters())
    reference = set_params(build_model(cfg, (12,), 3), params)
    assert np.array_equal(predict_proba(built, X), predict_proba(reference, X))
    with pytest.raises(ValueError, match="parameters do not fit the model"):
        model_with_params(lambda: build_model(cfg, (12,), 3), {k: v for k, v in params.items() if k != "layers.0.bias"})
    with pytest.raises(ValueError, match="dtype float64"):
        model_with_params(lambda: build_model(cfg, (12,), 3), {k: v.astype(np.float64) for k, v in params.items()})


class _WithScratch(nn.Module):
    """A buffer outside the state_dict (non-persistent): the meta device cannot give it values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 3)
        self.register_buffer("scale", torch.full((3,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_model_with_params_builds_for_real_what_the_meta_device_cannot_hold():
    params = get_params(_WithScratch())
    built = model_with_params(_WithScratch, params)
    assert torch.equal(built.scale, torch.full((3,), 2.0))
    assert np.array_equal(built.lin.weight.detach().numpy(), params["lin.weight"])


def test_a_layout_holds_no_memory_and_checks_as_the_model_does():
    cfg = ModelConfig(name="mlp", hidden=[4096, 4096])
    layout = params_layout(lambda: build_model(cfg, (12,), 3))
    real = get_params(build_model(cfg, (12,), 3, seed=0))
    assert {k: (v.shape, v.dtype) for k, v in layout.items()} == {k: (v.shape, v.dtype) for k, v in real.items()}
    assert sum(v.nbytes for v in layout.values()) == sum(v.nbytes for v in real.values())  # its size, as the model's
    assert all(v.base is not None and v.strides == (0,) * v.ndim for v in layout.values())  # one value broadcast
    assert check_params(real, layout) is None
    assert "shape" in check_params({**real, "layers.1.weight": real["layers.1.weight"][:10]}, layout)
    bn = params_layout(_net)  # BatchNorm's integer counter keeps its dtype
    assert bn["1.num_batches_tracked"].dtype == np.int64


def test_the_pre_flight_check_counts_the_same_parameters_on_the_meta_device():
    for cfg, shape in [
        (ModelConfig(name="mlp", hidden=[64, 64]), (12,)),
        (ModelConfig(name="cnn"), (1, 28, 28)),
        (ModelConfig(name="rescnn"), (3, 32, 32)),
    ]:
        count = check_model_fits(cfg, shape, 10)
        assert count == sum(p.numel() for p in build_model(cfg, shape, 10, seed=0).parameters())


def test_only_models_rayfuse_builds_are_built_on_the_meta_device():
    """A user's factory or registered builder may cache state across builds (a tensor made on the meta device would
    break every later real build): only rayfuse's own builders and torchvision's run there."""
    from rayfuse.models import register_model
    from rayfuse.models.registry import MODELS, builds_on_meta

    for name in ("mlp", "cnn", "rescnn", "logreg", "torchvision:resnet18"):
        assert builds_on_meta(ModelConfig(name=name)), name
    for name in ("custom", "hf:/some/folder"):
        assert not builds_on_meta(ModelConfig(name=name)), name
    assert not builds_on_meta(SimpleNamespace(name="no-such-model"))

    @register_model("user-net-meta-test", description="a user's builder")
    def _user(cfg, shape, classes):  # noqa: ARG001
        return nn.Linear(int(np.prod(shape)), classes)

    try:
        assert not builds_on_meta(ModelConfig(name="user-net-meta-test"))
        assert check_model_fits(ModelConfig(name="user-net-meta-test"), (12,), 3) == 39  # checked by a real build
    finally:
        MODELS._items.pop("user-net-meta-test", None)
