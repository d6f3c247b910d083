"""``rayfuse fuse`` with ``merge_method: distill``: checkpoints of different architectures distilled into one student,
with a transfer file of inputs only and data-free; every bad input one line, before anything trains."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import yaml

import rayfuse
from rayfuse.cli import main
from rayfuse.errors import InputError
from rayfuse.io import load_params, save_params
from rayfuse.models import get_params, set_params, train_model

MODULE = """
import torch
from torch import nn


class Student(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class WideInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(100, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three label-skewed teachers on digits (two of the student's class, one of another), a transfer file of inputs
    only, and a test split."""
    from rayfuse.data.datasets import load_dataset

    folder = tmp_path_factory.mktemp("distill-fuse")
    (folder / "distill_fuse_models.py").write_text(MODULE)
    sys.path.insert(0, str(folder))
    import distill_fuse_models as mods

    data = load_dataset("digits")
    X, y = data.X, data.y
    order = np.random.default_rng(0).permutation(len(X))
    test, public, rest = order[:300], order[300:600], order[600:]
    groups = [rest[y[rest] < 4], rest[(y[rest] >= 3) & (y[rest] < 8)], rest[y[rest] >= 6]]
    models = []
    for i, (idx, cls) in enumerate(zip(groups, [mods.Student, mods.Student, mods.Other])):
        torch.manual_seed(i)
        model = cls()
        train_model(model, X[idx], y[idx], epochs=15, batch_size=32, lr=5e-3, seed=i)
        save_params(folder / f"m{i}.safetensors", get_params(model))
        models.append(model.eval())
    np.savez(folder / "transfer.npz", X=X[public])  # inputs only: no labels
    yield folder, mods, models, (X[test], y[test])
    sys.path.remove(str(folder))


def config(folder, **fields):
    base = {
        "merge_method": "distill",
        "architecture": "distill_fuse_models:Student",
        "models": [
            {"model": "m0.safetensors"},
            {"model": "m1.safetensors"},
            {"model": "m2.safetensors", "architecture": "distill_fuse_models:Other"},
        ],
        "data": {"path": "transfer.npz"},
        "parameters": {"steps": 300, "epochs": 3},
        "output": "fused.safetensors",
    }
    base.update(fields)
    path = folder / "fuse.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def accuracy(model, split):
    X, y = split
    with torch.no_grad():
        return float((model(torch.as_tensor(X)).argmax(1).numpy() == y).mean())


@pytest.mark.parametrize("init", ["aligned", "random"])
def test_distill_of_three_teachers_with_an_unlabeled_transfer_file(checkpoints, capsys, init):
    folder, mods, models, test = checkpoints
    out = folder / f"public-{init}.safetensors"
    assert main(["fuse", str(config(folder, parameters={"steps": 300, "epochs": 3, "init": init})), str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("distill: epoch") == 3 and "distill of 3 models" in printed
    student = set_params(mods.Student(), load_params(out)).eval()
    best = max(accuracy(m, test) for m in models)
    assert accuracy(student, test) > best  # each teacher saw 4 of 10 classes; the student learns from all three


def test_data_free_distill_needs_only_the_input_shape(checkpoints):
    folder, mods, models, test = checkpoints
    path = rayfuse.fuse(
        {
            "merge_method": "distill",
            "architecture": "distill_fuse_models:Student",
            "input_shape": [1, 8, 8],
            "models": [{"model": str(folder / f"m{i}.safetensors")} for i in range(2)]
            + [{"model": str(folder / "m2.safetensors"), "architecture": "distill_fuse_models:Other"}],
            "parameters": {"steps": 100, "epochs": 2, "init": "random"},
            "output": str(folder / "free.safetensors"),
        }
    )
    fused = load_params(path)
    assert set(fused) == set(mods.Student().state_dict()) and all(np.isfinite(v).all() for v in fused.values())
    assert accuracy(set_params(mods.Student(), fused).eval(), test) > 0.15  # above chance, from noise and the teachers alone


@pytest.mark.parametrize(
    "fields,path",
    [
        ({"data": None, "input_shape": None}, "input_shape"),
        (
            {"models": [{"model": "m0.safetensors"}, {"model": "m2.safetensors", "architecture": "distill_fuse_models:Missing"}]},
            "models.1.architecture",
        ),
        (
            {"models": [{"model": "m0.safetensors"}, {"model": "m2.safetensors", "architecture": "no_such_module_x:Net"}]},
            "models.1.architecture",
        ),
        (
            {"models": [{"model": "m0.safetensors"}, {"model": "m2.safetensors", "architecture": "distill_fuse_models:WideInput"}]},
            "m2.safetensors: fc.weight",
        ),
        ({"parameters": {"transfer": "public"}, "data": None, "input_shape": [1, 8, 8]}, "data"),
        ({"parameters": {"steps": 0}}, "parameters.steps"),
        ({"parameters": {"holdout": 0.2}, "data": None, "input_shape": [1, 8, 8]}, "parameters.holdout"),
        ({"parameters": {"holdout": 0.999}}, "parameters.holdout"),
    ],
)
def test_bad_distill_input_is_one_line_before_anything_trains(checkpoints, fields, path):
    folder, *_ = checkpoints
    data = {k: v for k, v in fields.items() if v is not None}
    raw = config(folder, **data)
    text = yaml.safe_load(raw.read_text())
    for key, value in fields.items():
        if value is None:
            text.pop(key, None)
    raw.write_text(yaml.safe_dump(text))
    with pytest.raises(InputError) as info:
        rayfuse.fuse(raw)
    assert path in str(info.value).split(": expected")[0], str(info.value)
    assert not (folder / "fused.safetensors").exists()


def test_a_transfer_file_a_teacher_does_not_take_names_that_teacher(checkpoints):
    folder, *_ = checkpoints
    np.savez(folder / "wide.npz", X=np.zeros((20, 1, 10, 10), np.float32))  # 10x10 images: no teacher takes them
    with pytest.raises(InputError) as info:
        rayfuse.fuse(config(folder, data={"path": "wide.npz"}))
    assert "data.path" in info.value.path


def test_a_per_model_architecture_is_refused_by_the_methods_that_fuse_one_architecture(checkpoints):
    folder, *_ = checkpoints
    with pytest.raises(InputError, match="distill") as info:
        rayfuse.fuse(config(folder, merge_method="average", data=None, parameters={}))
    assert info.value.path.endswith("models.2.architecture")
