"""The Python API (rayfuse.run / rayfuse.fuse): configs as paths, dicts and objects; a model class, arrays, a torch
Dataset and methods defined here, in the test module; the result's frames and models; bad input as InputError."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import rayfuse
from rayfuse.config import validate_config
from rayfuse.method import Method, MethodParams, MethodResult, MethodTags, Update, client_step
from tests.conftest import TINY, merge

InputError = rayfuse.InputError

# Tiny runs: 3 clients, 1 epoch, two methods.
SMALL = merge(
    TINY, {"partition": {"num_clients": 3}, "train": {"epochs": 1}, "methods": {"average": {}, "fedavg": {"rounds": 1, "local_epochs": 1}}}
)


class TinyNet(nn.Module):
    """A model defined in the test module: called as TinyNet(input_shape, num_classes)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 8), nn.ReLU())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class LinearNoArgs(nn.Module):
    """A zero-argument factory for 64 features and 10 classes (digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


@client_step("test_api.local_params")
def local_params(ctx) -> Update:
    """The client's trained local model, and whether this process imported the test module (it should not need to)."""
    from rayfuse.models import get_params

    return Update(get_params(ctx.local_model()), ctx.num_examples, {"imported_test_module": float("tests.test_api" in sys.modules)})


class MeanParams(MethodParams):
    weighted: bool = True


class MeanOfLocals(Method[MeanParams, None]):
    """A tiny method defined in a test module: the (weighted) mean of the clients' local models."""

    Params = MeanParams
    tags = MethodTags(uses_local_models=True)

    def run(self, server) -> MethodResult:
        gathered = server.federation.run(local_params)
        result = server.updates.collect(gathered, weighted=self.params.weighted)
        fused, updates = result.params, result.updates
        metrics = server.scoring.evaluate(fused)
        server.log(0, metrics)
        imported = max(u.metrics["imported_test_module"] for u in updates.values())
        return MethodResult(metrics, fused, {"clients": len(updates), "imported_test_module": imported})


def local_run(tmp_path, config=None, **kwargs):
    config = SMALL if config is None else config
    return rayfuse.run(config, backend="local", run_dir=tmp_path / "run", quiet=True, **kwargs)


def test_a_dict_config_runs_and_returns_its_metrics_history_and_models(tmp_path):
    result = local_run(tmp_path)
    assert list(result.metrics.index) == ["average", "fedavg"] and result.metrics.index.name == "label"
    assert {"accuracy", "nll"} <= set(result.metrics.columns)
    assert result.metrics["accuracy"].between(0, 1).all()
    assert {"method", "round", "metric", "value"} <= set(result.history.columns)
    assert set(result.history["method"]) == {"average", "fedavg"}
    assert set(result.models) == {"average", "fedavg"}
    assert result.models["fedavg"]["layers.0.weight"].shape == (16, 64)
    module = result.model("fedavg")
    assert isinstance(module, nn.Module) and module(torch.zeros(2, 64)).shape == (2, 10)
    assert (result.run_dir / "results.json").is_file() and result.results["status"] == "succeeded"


def test_a_path_config_and_an_experiment_config_run_alike(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(merge(SMALL, {"methods": {"average": {}}})))
    from_path = rayfuse.run(path, backend="local", run_dir=tmp_path / "a", quiet=True)
    from_object = rayfuse.run(
        validate_config(merge(SMALL, {"methods": {"average": {}}})), backend="local", run_dir=tmp_path / "b", quiet=True
    )
    assert from_path.metrics.equals(from_object.metrics)


def test_a_model_class_arrays_and_a_method_subclass_from_this_module(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 5)).astype(np.float32)
    y = np.where(X[:, 0] > 0, "yes", "no")  # any labels: mapped to 0..C-1
    config = merge(SMALL, {"train": {"epochs": 10, "lr": 0.05}, "methods": {"fedavg": {"rounds": 2, "local_epochs": 1}}})
    result = local_run(tmp_path, config, model=TinyNet, dataset=(X, y), methods={"mean": MeanOfLocals, "fedavg": "fedavg"})
    assert list(result.metrics.index) == ["fedavg", "mean"]  # the config's entries, then the objects
    assert result.history.query("method == 'fedavg' and metric == 'accuracy'")["round"].max() == 2  # its parameters
    assert result.results["methods"]["mean"]["info"]["clients"] == 3
    assert result.models["mean"]["head.weight"].shape == (2, 8)
    recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert recorded["model"]["name"] == "custom" and recorded["model"]["factory"] == "tests.test_api.TinyNet"
    assert recorded["data"]["dataset"] == "arrays" and len(recorded["data"]["options"]["sha256"]) == 16
    assert recorded["methods"]["mean"] == {"method": "MeanOfLocals", "weighted": True}
    assert result.metrics.loc["mean", "accuracy"] > 0.7  # a linearly separable toy task


def test_a_torch_dataset_a_zero_argument_model_and_a_method_instance(tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    pairs = torch.utils.data.TensorDataset(torch.tensor(digits.data[:600], dtype=torch.float32), torch.tensor(digits.target[:600]))
    instance = MeanOfLocals(MeanParams(weighted=False))
    result = local_run(
        tmp_path,
        config={"train": {"epochs": 1}, "partition": {"num_clients": 2}},
        model=LinearNoArgs,
        dataset=pairs,
        methods={"plain-mean": instance},
    )
    assert list(result.metrics.index) == ["plain-mean"]  # a config naming no methods runs the given ones only
    assert result.models["plain-mean"]["linear.weight"].shape == (10, 64)
    assert yaml.safe_load((result.run_dir / "config.yaml").read_text())["methods"]["plain-mean"]["weighted"] is False


def test_a_run_given_a_python_model_cannot_be_resumed_from_the_command_line(tmp_path, capsys):
    from rayfuse.api import resume
    from rayfuse.cli import main

    result = local_run(tmp_path, model=TinyNet, methods={"average": "average"})
    with pytest.raises(InputError, match=r"^--resume: .*model\.name: custom \(tests\.test_api\.TinyNet\).*cannot be resumed"):
        resume(result.run_dir)
    assert main(["run", "--resume", str(result.run_dir)]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line


@pytest.mark.parametrize(
    ("config", "kwargs", "match"),
    [
        pytest.param({"partition": {"alpha": -1}}, {}, r"^partition\.alpha: expected", id="config-key"),
        pytest.param({"methods": {"fedavg": {"rounds": 0}}}, {}, r"^methods\.fedavg\.rounds: expected", id="method-param"),
        pytest.param({}, {"methods": {"mine": 3}}, r"^methods\.mine: expected a method", id="method-object"),
        pytest.param({}, {"methods": ["fedavg"]}, r"^methods: expected a mapping", id="methods-list"),
        pytest.param({}, {"backend": "gpu"}, r"^backend: expected 'ray' or 'local', got 'gpu'", id="backend"),
        pytest.param({}, {"model": 42}, r"^model: expected a callable", id="model-not-callable"),
        pytest.param({}, {"model": lambda a, b, c: None}, r"^model: expected a callable", id="model-signature"),
        pytest.param({}, {"model": lambda: "net"}, r"^model: expected a factory returning a torch\.nn\.Module", id="model-not-a-module"),
        pytest.param({}, {"model": {3: TinyNet}}, r"^model\[3\]: expected a client id in 0\.\.2", id="model-mapping-client-out-of-range"),
        pytest.param(
            {},
            {"model": {"defaults": TinyNet}},
            r"^model\['defaults'\]: expected a client id in 0\.\.2 .* or 'default'",
            id="model-mapping-bad-key",
        ),
        pytest.param({}, {"model": {1: 42}}, r"^model\[1\]: expected a callable", id="model-mapping-not-callable"),
        pytest.param(
            {},
            {"model": {1: LinearNoArgs}, "dataset": (np.zeros((30, 3)), np.arange(30) % 2)},
            r"^federation\.client_overrides\.1\.model\.name: expected a model that accepts inputs of shape \(3,\)",
            id="model-mapping-wrong-input",
        ),
        pytest.param(
            {},
            {"model": LinearNoArgs, "dataset": (np.zeros((30, 3)), np.arange(30) % 2)},
            r"^model\.name: expected a model that accepts inputs of shape \(3,\)",
            id="model-wrong-input",
        ),
        pytest.param(
            {}, {"dataset": (np.zeros((30, 3)), np.zeros(29))}, r"^dataset: expected as many labels as samples", id="dataset-labels"
        ),
        pytest.param({}, {"dataset": np.zeros((30, 3))}, r"^dataset: expected \(X, y\) arrays", id="dataset-kind"),
        pytest.param("nowhere.yaml", {}, r"^nowhere\.yaml: expected an existing YAML config file", id="config-file"),
        pytest.param(3, {}, r"^config: expected a YAML file path, a dict or an ExperimentConfig", id="config-kind"),
    ],
)
def test_bad_input_raises_input_error_with_the_key_path_before_anything_runs(tmp_path, config, kwargs, match):
    if isinstance(config, dict):
        config = merge(SMALL, config)
    with pytest.raises(InputError, match=match):
        rayfuse.run(config, run_dir=tmp_path / "run", quiet=True, **{"backend": "local", **kwargs})
    assert not (tmp_path / "run").exists()


def test_a_used_run_dir_is_refused_under_its_own_name(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x").write_text("")
    with pytest.raises(InputError, match=r"^run_dir: expected a new or empty folder"):
        local_run(tmp_path)


def test_fuse_writes_the_fused_checkpoint_and_returns_its_path(tmp_path):
    from rayfuse.io import load_params, save_params

    for name, value in (("a", 1.0), ("b", 3.0)):
        save_params(tmp_path / f"{name}.safetensors", {"w": np.full((2, 2), value, np.float32)})
    (tmp_path / "fuse.yaml").write_text(
        yaml.safe_dump(
            {"merge_method": "average", "models": [{"model": "a.safetensors"}, {"model": "b.safetensors"}], "output": "fused.safetensors"}
        )
    )
    out = rayfuse.fuse(tmp_path / "fuse.yaml")
    assert out == tmp_path / "fused.safetensors"
    np.testing.assert_allclose(load_params(out)["w"], 2.0)
    with pytest.raises(InputError, match=r"output: expected a path that does not exist yet"):
        rayfuse.fuse(tmp_path / "fuse.yaml")


@pytest.mark.ray
def test_on_ray_a_model_class_and_a_method_from_this_module_reach_the_actors_by_value(ray_session, tmp_path):
    no_methods = {k: v for k, v in SMALL.items() if k != "methods"}
    result = rayfuse.run(no_methods, backend="ray", model=TinyNet, methods={"mean": MeanOfLocals}, run_dir=tmp_path / "run", quiet=True)
    assert list(result.metrics.index) == ["mean"] and 0 < result.metrics.loc["mean", "accuracy"] <= 1
    assert result.results["run"]["backend"] == "ray"
    # the classes and the client step travelled by value: no client imported this module to unpickle them
    assert result.results["methods"]["mean"]["info"]["imported_test_module"] == 0.0
    assert result.models["mean"]["head.weight"].shape == (10, 8)


def test_the_python_api_page_example_is_examples_python_api():
    """docs/python-api.md's first Python block (the README's "Python API" section before the front page was cut to
    its short form) is examples/python_api.py (which was run on Ray and in-process), line for line but for the
    choice of backend."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "python-api.md").read_text()
    section = page[page.index("# Python API") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```\n")]
    example = (root / "examples" / "python_api.py").read_text().replace("backend=backend", 'backend="ray"')
    missing = [line for line in block.splitlines() if line.strip() and line not in example.splitlines()]
    assert missing == [] and "rayfuse.run(" in block
