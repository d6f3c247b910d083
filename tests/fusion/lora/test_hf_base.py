"""A local Hugging Face folder as ``fedlora``'s base: a tiny BERT built from a config and saved with save_pretrained,
fine-tuned by fedlora in-process on a small token-sequence task; the refusals of a folder that cannot be the base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import rayfuse
from rayfuse.errors import InputError
from rayfuse.fusion.lora import hf_model
from tests.conftest import TINY, merge

VOCAB, LENGTH = 20, 8
TARGETS = [r"bert\.encoder\.layer\.\d+\.attention\.self\.(query|value)", "classifier"]


def tiny_bert(folder: Path, seed: int = 0) -> Path:
    """A 2-layer BERT of width 32 for 2 classes, randomly initialised and saved as a Hugging Face folder."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def sequences(n: int = 480, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows; the label says whether token 1 occurs more often than token 2 (ties: 0)."""
    rng = np.random.default_rng(seed)
    X = rng.integers(0, VOCAB, size=(n, LENGTH))
    X[rng.random((n, LENGTH)) < 0.25] = 1
    X[rng.random((n, LENGTH)) < 0.2] = 2
    y = ((X == 1).sum(1) > (X == 2).sum(1)).astype(np.int64)
    return X.astype(np.float32), y


def config(tmp_path: Path, base: Path | str, **params: Any) -> dict[str, Any]:
    cfg = merge(TINY, {"partition": {"num_clients": 3, "method": "iid"}, "train": {"lr": 0.01, "batch_size": 32}})
    cfg.pop("data")
    cfg["methods"] = {"fedlora": {"rounds": 2, "local_epochs": 2, "r": 2, "base": str(base), "target_modules": TARGETS, **params}}
    cfg["run"] = {**cfg["run"], "storage": str(tmp_path / "runs")}
    return cfg


def test_fedlora_fine_tunes_a_hugging_face_folder_in_process(tmp_path):
    folder = tiny_bert(tmp_path / "base")
    base = transformers.BertForSequenceClassification.from_pretrained(folder, local_files_only=True).state_dict()
    result = rayfuse.run(config(tmp_path, folder, combine="stack"), model=hf_model(folder), dataset=sequences(), backend="local")
    metrics = result.metrics.loc["fedlora"]
    assert np.isfinite(metrics[["accuracy", "nll"]].to_numpy(dtype=float)).all()
    fused = result.models["fedlora"]
    assert set(fused) == set(base)
    changed = {k for k in fused if not np.array_equal(fused[k], base[k].numpy())}
    # the adapted Linears' weights moved, and nothing else: the base came from the folder, the update only to them
    assert changed == {f"bert.encoder.layer.{i}.attention.self.{m}.weight" for i in range(2) for m in ("query", "value")} | {
        "classifier.weight"
    }
    # the fused weights run in the folder's own class
    model = transformers.BertForSequenceClassification.from_pretrained(folder, local_files_only=True)
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in fused.items()})
    X, _ = sequences(16, seed=1)
    logits = model(input_ids=torch.as_tensor(X, dtype=torch.long)).logits
    assert logits.shape == (16, 2) and torch.isfinite(logits).all()


def test_the_base_is_the_folders_weights_not_the_run_init(tmp_path):
    folder = tiny_bert(tmp_path / "base", seed=3)
    base = transformers.BertForSequenceClassification.from_pretrained(folder, local_files_only=True).state_dict()
    cfg = config(tmp_path, folder, combine="ffa", rounds=1, target_modules=["classifier"])
    result = rayfuse.run(cfg, model=hf_model(folder), dataset=sequences(), backend="local")
    fused = result.models["fedlora"]
    assert all(np.array_equal(fused[k], base[k].numpy()) for k in base if k != "classifier.weight")
    assert not np.array_equal(fused["classifier.weight"], base["classifier.weight"].numpy())


def refusal(cfg: dict[str, Any], folder: Path) -> str:
    with pytest.raises(InputError) as info:  # raised by rayfuse.run's checks, before a run folder or a client exists
        rayfuse.run(cfg, model=hf_model(folder), dataset=sequences(), backend="local")
    assert not (Path(cfg["run"]["storage"])).exists()
    line = str(info.value)
    assert "\n" not in line
    return line


def test_a_folder_that_cannot_be_the_base_is_one_line_before_start(tmp_path):
    folder = tiny_bert(tmp_path / "base")
    line = refusal(config(tmp_path, tmp_path / "missing"), folder)
    assert line.startswith("methods.fedlora.base: ") and "no such file" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refusal(config(tmp_path, empty), folder)
    assert line.startswith("methods.fedlora.base: ") and "no config.json" in line
    line = refusal(config(tmp_path, folder, target_modules=[r"bert\.encoder\.layer\.9\.attention\.self\.query"]), folder)
    assert line.startswith("methods.fedlora.target_modules.0: expected a pattern matching an nn.Linear of the base in ")
    given = line.split(", got ")[-1]
    assert "layer" in given and "9" in given  # the pattern given, after the folder's Linears
    with pytest.raises(InputError) as info:
        hf_model(empty)
    assert "no config.json" in str(info.value)
