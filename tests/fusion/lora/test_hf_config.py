"""A local Hugging Face folder named in a config file (``model: {name: "hf:<folder>"}``): it validates and builds the
same model as ``hf_model(folder)``, fedlora and fedmerge run on it from a config with the folder as their base, the
``tokens`` dataset it reads, the example script that makes such a folder, and the one-line refusals before start."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import rayfuse
from rayfuse.config import ExperimentConfig, build_config, load_config
from rayfuse.config.model import ModelConfig
from rayfuse.data.datasets import load_dataset
from rayfuse.errors import InputError
from rayfuse.fusion.lora import hf_model
from rayfuse.models import build_model, get_params

ROOT = Path(__file__).resolve().parents[3]
TARGETS = [r"bert\.encoder\.layer\.\d+\.attention\.self\.(query|value)", "classifier"]
ADAPTED = {f"bert.encoder.layer.{i}.attention.self.{m}.weight" for i in range(2) for m in ("query", "value")} | {"classifier.weight"}


@pytest.fixture(scope="module")
def make_tiny_hf():
    """The example script's function (examples/make_tiny_hf.py), as the docs tell a user to run it."""
    return runpy.run_path(str(ROOT / "examples" / "make_tiny_hf.py"))["make_tiny_hf"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, make_tiny_hf) -> Path:
    """A 2-layer BERT of width 32 for the tokens dataset's defaults (vocab 32, rows of 16, 2 classes)."""
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny-bert", hidden=32, seed=0)


def config(tmp_path: Path, name: str, methods: dict[str, Any], **data: Any) -> dict[str, Any]:
    return {
        "run": {"name": "hfcfg", "seed": 0, "storage": str(tmp_path / "runs")},
        "data": {"dataset": "tokens", "options": {"n_samples": 300, **data}},
        "partition": {"method": "iid", "num_clients": 3},
        "model": {"name": name},
        "train": {"lr": 0.01, "batch_size": 32},
        "federation": {"backend": "local"},
        "methods": methods,
    }


FEDLORA = {"fedlora": {"rounds": 2, "local_epochs": 1, "r": 2, "combine": "stack", "target_modules": TARGETS}}


# -- the config form --------------------------------------------------------------------------------------------------


def test_the_example_script_saves_a_folder_from_pretrained_loads_offline(folder):
    saved = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    assert saved.architectures == ["BertForSequenceClassification"]
    assert (saved.vocab_size, saved.max_position_embeddings, saved.num_labels) == (32, 16, 2)
    assert saved.num_hidden_layers == 2 and saved.hidden_size == 32
    model = transformers.BertForSequenceClassification.from_pretrained(folder, local_files_only=True)
    logits = model(input_ids=torch.randint(0, 32, (3, 16))).logits
    assert logits.shape == (3, 2) and torch.isfinite(logits).all()


def test_the_config_form_builds_the_same_model_as_hf_model(folder):
    cfg = ModelConfig(name=f"hf:{folder}")
    assert cfg.name == f"hf:{folder.resolve()}" and cfg.family == "hf"
    from_config = build_model(cfg, (16,), 2, seed=3)
    from_python = build_model(ModelConfig().with_factory(hf_model(folder), "hf_model"), (16,), 2, seed=3)
    assert type(from_config).__name__ == type(from_python).__name__ == "TokenIdsBertForSequenceClassification"
    a, b = get_params(from_config), get_params(from_python)
    assert set(a) == set(b) == set(transformers.BertForSequenceClassification.from_pretrained(folder).state_dict())
    assert all(np.array_equal(a[k], b[k]) for k in a)  # the same class, the same seeded initialisation
    X = torch.as_tensor(load_dataset("tokens", options={"n_samples": 20}).X[:5])
    out_a, out_b = from_config.eval()(X), from_python.eval()(X)
    assert out_a.shape == (5, 2) and torch.isfinite(out_a).all() and torch.equal(out_a, out_b)


def test_a_relative_folder_is_the_working_directorys(folder, monkeypatch):
    monkeypatch.chdir(folder.parent)
    cfg = ModelConfig(name="hf:tiny-bert")
    assert cfg.name == f"hf:{folder.resolve()}"
    # absolute, so a client process started in another folder reads the same one; validating again keeps it
    assert ModelConfig(name=cfg.name).name == cfg.name


def test_the_job_validates_with_a_folder_made_by_the_script(folder):
    cfg = load_config(ROOT / "jobs" / "fedlora_hf.yaml", [f"model.name=hf:{folder}"])
    assert cfg.model.name == f"hf:{folder.resolve()}" and cfg.data.dataset == "tokens"
    from rayfuse.runner import prepare_run

    prepared = prepare_run(cfg)  # every check before start: the model against the data, the methods' bases
    assert set(prepared.resolved()["methods"]) == {"fedlora_ffa", "fedlora_stack", "fedmerge_fisher"}
    assert ExperimentConfig.model_validate(prepared.resolved()).model.name == cfg.model.name


# -- runs from a config --------------------------------------------------------------------------------------------


def test_fedlora_runs_from_a_config_dict_with_the_folder_as_its_base(tmp_path, folder):
    base = transformers.BertForSequenceClassification.from_pretrained(folder, local_files_only=True).state_dict()
    result = rayfuse.run(config(tmp_path, f"hf:{folder}", FEDLORA), quiet=True)
    metrics = result.metrics.loc["fedlora"]
    assert np.isfinite(metrics[["accuracy", "nll"]].to_numpy(dtype=float)).all()
    fused = result.models["fedlora"]
    assert set(fused) == set(base)
    # no base: given, so the base is the folder's weights (not the run's init): only the adapted Linears moved
    changed = {k for k in fused if not np.array_equal(fused[k], base[k].numpy())}
    assert changed == ADAPTED
    assert all(np.isfinite(fused[k]).all() for k in changed)


def test_fedmerge_runs_from_a_config_dict_with_the_folder_as_its_base(tmp_path, folder):
    base = transformers.BertForSequenceClassification.from_pretrained(folder, local_files_only=True).state_dict()
    methods = {"fedmerge": {"finetune": "full", "merge": "fisher", "local_epochs": 1, "target_modules": ["classifier"]}}
    result = rayfuse.run(config(tmp_path, f"hf:{folder}", methods), quiet=True)
    assert np.isfinite(result.metrics.loc["fedmerge"][["accuracy", "nll"]].to_numpy(dtype=float)).all()
    fused = result.models["fedmerge"]
    changed = {k for k in fused if not np.array_equal(fused[k], base[k].numpy())}
    assert changed == {"classifier.weight", "classifier.bias"}


# -- the tokens dataset -------------------------------------------------------------------------------------------


def test_tokens_are_seeded_whole_ids_labelled_by_the_most_frequent_marker():
    data = load_dataset("tokens", options={"n_samples": 500, "length": 12, "vocab": 20, "n_classes": 3, "random_state": 4})
    again = load_dataset("tokens", options={"n_samples": 500, "length": 12, "vocab": 20, "n_classes": 3, "random_state": 4})
    other = load_dataset("tokens", options={"n_samples": 500, "length": 12, "vocab": 20, "n_classes": 3, "random_state": 5})
    assert data.X.shape == (500, 12) and data.X.dtype == np.float32 and data.num_classes == 3
    assert np.array_equal(data.X, again.X) and np.array_equal(data.y, again.y) and not np.array_equal(data.X, other.X)
    ids = data.X.astype(np.int64)
    assert np.array_equal(ids, data.X) and ids.min() >= 1 and ids.max() <= 19
    counts = np.stack([(ids == c + 1).sum(1) for c in range(3)], axis=1)
    assert (np.sort(counts, axis=1)[:, -1] > np.sort(counts, axis=1)[:, -2]).all()  # no ties
    assert np.array_equal(data.y, counts.argmax(1))
    assert set(np.bincount(data.y, minlength=3)) and np.bincount(data.y).min() > 100  # every class, roughly balanced


@pytest.mark.parametrize(
    ("options", "key"),
    [({"vocab": 3}, "vocab"), ({"length": 1}, "length"), ({"marker_rate": 0}, "marker_rate"), ({"n_classes": 1}, "n_classes")],
)
def test_tokens_options_are_checked(options, key):
    with pytest.raises(InputError) as info:
        load_dataset("tokens", options=options)
    assert str(info.value).startswith(f"data.options.{key}: expected ")


# -- refusals: one line, before a run folder or a client exists ----------------------------------------------------


def refusal(tmp_path: Path, name: str, **data: Any) -> str:
    cfg = config(tmp_path, name, FEDLORA, **data)
    with pytest.raises(InputError) as info:
        rayfuse.run(cfg, quiet=True)
    assert not (tmp_path / "runs").exists()
    line = str(info.value)
    assert "\n" not in line
    return line


def saved_config(folder: Path, **changes: Any) -> Path:
    folder.mkdir(parents=True)
    config_json = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).to_dict()
    (folder / "config.json").write_text(json.dumps({**config_json, **changes}))
    return folder


def test_a_missing_folder_or_config_json_is_refused(tmp_path):
    line = refusal(tmp_path, f"hf:{tmp_path / 'missing'}")
    assert line.startswith("model.name: expected an existing Hugging Face folder") and "no such folder" in line
    (tmp_path / "empty").mkdir()
    line = refusal(tmp_path, f"hf:{tmp_path / 'empty'}")
    assert line.startswith("model.name: expected a Hugging Face folder with its config.json") and "no config.json in" in line
    with pytest.raises(InputError) as info:
        build_config({"model": {"name": "hf: "}})
    assert str(info.value).startswith("model.name: expected hf:<folder>")


def test_an_architecture_transformers_cannot_build_is_refused(tmp_path):
    unknown = saved_config(tmp_path / "unknown", architectures=["FooForSequenceClassification"])
    line = refusal(tmp_path, f"hf:{unknown}")
    assert line.startswith("model.name: expected an architecture transformers") and "'FooForSequenceClassification'" in line
    bad_type = saved_config(tmp_path / "bad-type", model_type="no-such-model-type")
    line = refusal(tmp_path, f"hf:{bad_type}")
    assert line.startswith("model.name: expected a Hugging Face config in ")
    masked = saved_config(tmp_path / "masked", architectures=["BertForMaskedLM"])
    line = refusal(tmp_path, f"hf:{masked}")
    assert line.startswith("model.name: expected a sequence classifier") and "BertForMaskedLM" in line


def test_data_the_model_does_not_take_is_refused_saying_what_it_must_be(tmp_path, folder):
    need = "rows of at most 16 token ids (whole numbers in 0..31), shape (N, L)"
    line = refusal(tmp_path, f"hf:{folder}", length=20)  # rows longer than the model's positions
    assert line.startswith(f"model.name: expected data the model in {folder.resolve()} takes: {need}, got 'inputs of shape (20,)'")
    line = refusal(tmp_path, f"hf:{folder}", vocab=64)  # ids past the model's vocabulary
    assert line.startswith(f"data: expected token ids the model in {folder.resolve()} takes: {need}, got 'values in 1..63'")
    assert "data.dataset: tokens" in line
    line = refusal(tmp_path, f"hf:{folder}", n_classes=3)
    assert line.startswith("model.name: expected a classifier of the data's 3 classes, got 'num_labels 2 in ")


def test_images_and_real_valued_features_are_refused(tmp_path, folder):
    cfg = config(tmp_path, f"hf:{folder}", FEDLORA)
    cfg["data"] = {"dataset": "digits"}
    with pytest.raises(InputError) as info:
        rayfuse.run(cfg, quiet=True)
    assert str(info.value).startswith("model.name: expected data the model in ") and "got 'inputs of shape (1, 8, 8)'" in str(info.value)
    cfg["data"] = {"dataset": "synthetic", "options": {"n_features": 8, "n_informative": 4, "n_classes": 2, "n_samples": 100}}
    with pytest.raises(InputError) as info:
        rayfuse.run(cfg, quiet=True)
    assert str(info.value).startswith("data: expected token ids the model in ") and "not whole numbers" in str(info.value)
    assert not (tmp_path / "runs").exists()


def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    from rayfuse.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{name: 'hf:{tmp_path / 'missing'}'}}\ndata: {{dataset: tokens}}\nmethods: {{fedlora: {{}}}}\n")
    assert main(["validate", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfuse: error: model.name: expected an existing Hugging Face folder") and "\n" not in err


def test_rayfuse_list_names_the_hf_model_and_the_tokens_dataset(capsys):
    from rayfuse.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "hf:<folder>" in out.split("models:")[1] and "tokens" in out.split("datasets:")[1].split("partitioners:")[0]
