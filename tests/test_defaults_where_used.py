"""Defaults apply to what uses them, and the data's layout is inferred from the model (issue: hardening, round 4).

A config without a data section is the quickstart's data; its public sample of 300 is drawn only when a configured
method reads one (``MethodTags.public_sample`` / ``public_labels``, or the method's ``Params.public_sample``), so a
small dataset with methods that read none runs. An ``(N, C, L)`` array read as grey images by default runs as
sequences when the model takes ``(C, L)`` and not the image, or the refusal names ``data.layout: sequence``. A model
whose forward raises or returns a tuple is one ``InputError`` line through the Python API, as through the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn as nn
from sklearn.datasets import load_wine

import rayfuse
from rayfuse.config import DEFAULT_METHODS, QUICKSTART_PUBLIC_SIZE, ExperimentConfig, build_config, validate_config
from rayfuse.config.experiment import DEFAULT_PUBLIC_READERS
from rayfuse.errors import InputError
from rayfuse.method import METHODS, reads_public_sample, resolve_methods, resolved_config, with_public_default
from rayfuse.runner import prepare_run


def _wine() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_wine(return_X_y=True)
    return X.astype(np.float32), y


def _run(tmp_path, methods, **kwargs):
    cfg = {"run": {"storage": str(tmp_path / "runs")}, "train": {"epochs": 1}, "methods": methods}
    return rayfuse.run(cfg, backend="local", quiet=True, **kwargs)


@pytest.mark.parametrize(
    "methods",
    [
        {"fedavg": {"rounds": 1}, "average": {}},
        {"gems": {"fine_tune": False}},  # GEMS reads the public sample only to fine-tune
        {"epgan": {"warmup_epochs": 1, "rounds": 1, "local_epochs": 1, "eval_samples": 100}},  # a simulation's: never
    ],
)
def test_wine_runs_without_a_data_section_with_methods_that_read_no_public_sample(tmp_path, methods):
    # 178 samples, a training pool of 142: the quickstart's 300 public samples would not fit, and no method reads one
    result = _run(tmp_path, methods, dataset=_wine())
    assert result.results["status"] == "succeeded"
    assert result.results["config"]["data"]["public_size"] == 0


def test_methods_that_read_no_public_sample_score_as_with_public_size_0(tmp_path):
    # no sample carved out of the clients' pool: the same shards, the same models, the same scores
    methods = {"fedavg": {"rounds": 2}, "average": {}}
    default = _run(tmp_path / "default", methods, dataset=_wine()).results["methods"]
    stated = rayfuse.run(
        {"run": {"storage": str(tmp_path / "stated")}, "data": {"public_size": 0}, "train": {"epochs": 1}, "methods": methods},
        dataset=_wine(),
        backend="local",
        quiet=True,
    ).results["methods"]
    for label in methods:
        assert default[label]["accuracy"] == stated[label]["accuracy"] and np.isfinite(default[label]["accuracy"])


@pytest.mark.parametrize(
    ("methods", "size"),
    [
        ({"fedavg": {}, "average": {}}, 0),
        ({"local": {}, "ensemble": {}, "aligned": {}, "global": {}}, 0),
        ({"distill": {"transfer": "synthetic"}}, 0),  # data-free: no public sample
        ({"distill": {}}, QUICKSTART_PUBLIC_SIZE),  # transfer: public
        ({"fedavg": {}, "finetune": {}}, QUICKSTART_PUBLIC_SIZE),
        ({"gems": {}}, QUICKSTART_PUBLIC_SIZE),
        ({"gems": {"fine_tune": False}}, 0),  # its tuning is the only reader
        ({"epgan": {}}, 0),  # reads a silo config's data.public only
        ({"finetune": {}}, QUICKSTART_PUBLIC_SIZE),
        ({"fedsa": {}}, QUICKSTART_PUBLIC_SIZE),
        ({"scratch": {}, "transfer": {}}, QUICKSTART_PUBLIC_SIZE),
    ],
)
def test_the_quickstart_public_sample_is_drawn_only_for_a_method_that_reads_one(methods, size):
    cfg = validate_config({"methods": methods})
    assert cfg.data.public_size is None  # no data section: resolved against the methods
    resolved = with_public_default(cfg, resolve_methods(cfg.methods))
    assert resolved.data.public_size == size
    assert resolved_config(cfg)["data"]["public_size"] == size


def test_an_explicit_public_size_is_kept_and_checked_whatever_the_methods():
    cfg = validate_config({"data": {"dataset": "digits", "public_size": 50}, "methods": {"fedavg": {}}})
    assert with_public_default(cfg, resolve_methods(cfg.methods)).data.public_size == 50
    assert validate_config({"data": {"dataset": "digits"}}).data.public_size == 0  # a data section: none by default


_TOO_LARGE = "data.public_size: expected fewer samples than the training pool (142), got 300"
_QUICKSTART = (
    "; the quickstart's public sample (a config without a data section), read by methods.{}: set data.public_size "
    "below 142 (or a fraction, e.g. 0.2), or run methods that read none"
)


@pytest.mark.parametrize(
    ("cfg", "line"),
    [
        ({"methods": {"distill": {}}}, _TOO_LARGE + _QUICKSTART.format("distill")),
        ({"methods": {"fedavg": {}, "finetune": {}}}, _TOO_LARGE + _QUICKSTART.format("finetune")),
        ({"methods": {"gems": {}, "fedsa": {}}}, _TOO_LARGE + _QUICKSTART.format("gems, methods.fedsa")),
        ({}, _TOO_LARGE + _QUICKSTART.format("distill, methods.distill-rounds")),  # the quickstart's methods: both distills read it
        ({"data": {"public_size": 300}, "methods": {"fedavg": {}}}, _TOO_LARGE),  # stated: checked whoever reads it
    ],
)
def test_a_public_sample_too_large_for_the_data_is_refused_where_read_or_stated(tmp_path, cfg, line):
    with pytest.raises(InputError) as raised:
        rayfuse.run({"run": {"storage": str(tmp_path / "runs")}, **cfg}, dataset=_wine(), backend="local", quiet=True)
    assert str(raised.value) == line
    assert not (tmp_path / "runs").exists()


def test_every_reader_of_the_public_sample_says_so_in_its_tags():
    readers = {name for name, cls in METHODS.items() if reads_public_sample(cls)}
    assert {"distill", "finetune", "gems", "fedsa", "scratch", "transfer"} <= readers
    assert not readers & {"fedavg", "average", "local", "ensemble", "aligned", "global", "epgan-oracle"}
    assert ExperimentConfig().data.public_size is None and resolved_config(ExperimentConfig())["data"]["public_size"] == 300


_SILOS = [{"dataset": "npz", "path": "/silo-a.npz"}, {"dataset": "npz", "path": "/silo-b.npz"}]
_QUICKSTART_METHODS = list(DEFAULT_METHODS)
_NO_DISTILL = [m for m in DEFAULT_METHODS if m not in ("distill", "distill-rounds")]


@pytest.mark.parametrize(
    ("cfg", "methods"),
    [
        ({}, _QUICKSTART_METHODS),  # the quickstart's data: its public sample is drawn for distill
        ({"data": {"public_size": None}}, _QUICKSTART_METHODS),  # the same, stated
        ({"data": {"dataset": "wine"}}, _NO_DISTILL),  # a data section states its own public sample: none
        ({"data": {"dataset": "digits", "public_size": 0}}, _NO_DISTILL),
        ({"data": {"dataset": "digits", "public_size": 0.2}}, _QUICKSTART_METHODS),
        ({"data": {"silos": _SILOS}}, [m for m in _NO_DISTILL if m != "global"]),  # no data.public, no pooling
        ({"data": {"silos": _SILOS, "public": {"dataset": "npz", "path": "/public.npz"}}}, [m for m in DEFAULT_METHODS if m != "global"]),
        ({"data": {"dataset": "wine"}, "methods": {"distill": {}}}, ["distill"]),  # named: kept, and checked
    ],
)
def test_the_default_methods_are_those_the_data_section_can_run(cfg, methods):
    assert list(validate_config(cfg).methods) == methods


@pytest.mark.parametrize(
    ("overrides", "has_distill"),
    [
        (["methods.fedavg.rounds=3"], True),
        (["data.dataset=wine", "methods.fedavg.rounds=3"], False),  # --set data.* counts as the data section
        (["data.public_size=50", "methods.fedavg.rounds=3"], True),
    ],
)
def test_editing_the_default_methods_with_set_keeps_those_the_data_can_run(overrides, has_distill):
    cfg = build_config({}, overrides)
    assert cfg.methods["fedavg"] == {"rounds": 3} and ("distill" in cfg.methods) is has_distill


def test_a_data_section_without_methods_prepares_without_the_public_sample_it_does_not_give():
    # the quickstart's distill (transfer: public) would be refused for data.public_size 0; its data-free twin stays
    prepared = prepare_run(validate_config({"data": {"dataset": "wine"}, "federation": {"backend": "local"}}))
    labels = [spec.label for spec in prepared.specs]
    assert "distill" not in labels and "distill-rounds" not in labels and "distill-free" in labels and len(prepared.plan.public) == 0


def test_the_default_methods_that_read_a_public_sample_are_those_their_tags_say():
    specs = resolve_methods(DEFAULT_METHODS)
    assert {s.label for s in specs if reads_public_sample(s.method_cls, s.params)} == DEFAULT_PUBLIC_READERS


# ---------------------------------------------------------------------------------------------------------------
# (N, C, L) arrays with a model that takes sequences


def _conv1d(channels: int, length: int) -> type[nn.Module]:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(channels, 4, 3)
            self.fc = nn.Linear(4 * (length - 2), 3)

        def forward(self, x):
            return self.fc(self.conv(x).relu().flatten(1))

    return Net


def _sequences(channels: int, length: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 240)
    return (rng.normal(size=(240, channels, length)) + y[:, None, None]).astype(np.float32), y


@pytest.mark.parametrize("channels", [1, 3])
def test_an_n_c_l_array_with_a_conv1d_model_runs_as_sequences(tmp_path, channels):
    result = _run(tmp_path, {"fedavg": {"rounds": 1}}, model=_conv1d(channels, 40), dataset=_sequences(channels))
    assert result.results["status"] == "succeeded" and result.results["config"]["data"]["layout"] == "sequence"
    assert np.isfinite(result.results["methods"]["fedavg"]["accuracy"])


def test_a_model_that_takes_neither_reading_is_refused_naming_data_layout(tmp_path):
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(7, 3)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(InputError) as raised:
        _run(tmp_path, {"fedavg": {}}, model=Flat, dataset=_sequences(1))
    line = str(raised.value)
    assert "\n" not in line and line.startswith("model.name: expected a model that accepts inputs of shape (1, 1, 40)")
    assert line.endswith("data.layout: sequence reads the (N, 1, 40) array as it is, not as grey images")
    assert not (tmp_path / "runs").exists()


def test_grey_images_stay_images(make_config):
    prepared = prepare_run(make_config(data={"dataset": "digits"}, model={"name": "cnn"}, methods={"fedavg": {}}))
    assert prepared.cfg.data.layout == "auto" and prepared.plan is not None


# ---------------------------------------------------------------------------------------------------------------
# The API's model check: one line, as the CLI's


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(13, 3)

    def forward(self, x):
        raise ValueError("boom")


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(13, 3)

    def forward(self, x):
        return self.fc(x), x


class _Dict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(13, 3)

    def forward(self, x):
        return {"logits": self.fc(x)}


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (_Raises, "expected a model that accepts inputs of shape (13,), got 'custom'; the model's forward raised ValueError: boom"),
        (_Pair, "got 'custom returning a tuple of 2'; return the logits alone"),
        (_Dict, "got 'custom returning dict'; return the logits alone"),
    ],
)
def test_a_model_whose_forward_raises_or_returns_more_than_logits_is_one_line(tmp_path, model, says):
    with pytest.raises(InputError) as raised:
        _run(tmp_path, {"average": {}}, model=model, dataset=_wine())
    line = str(raised.value)
    assert "\n" not in line and line.startswith("model.name: expected") and says in line, line
    assert not (tmp_path / "runs").exists()
