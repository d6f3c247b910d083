"""Hugging Face models in the symmetry layer: analysed from ``torch.export``, which supports weight matching only.

Three sub-classes, each a table of cases on a tiny BERT and a tiny Llama built from their configs (offline):

* ``structure``: every path that reads the ``torch.fx`` structure (activation matching's probes, REPAIR, the output
  layer, a nonparametric widening) refuses such a model up front, in one line saying weight matching only, with
  nothing written;
* ``symmetry``: ``rayfuse symmetry --vocab N`` feeds integer token ids of ``--input-shape``; bad values are one line
  (exit 2);
* ``fuse``: ``rayfuse fuse`` with weight matching, the architecture a function of the user's own module, gives a fused
  file that loads and whose outputs are finite; bad ``vocab`` values and the merges it cannot run are one line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import rayfuse
from rayfuse import symmetry as sym
from rayfuse.api import symmetry as symmetry_api
from rayfuse.cli import main
from rayfuse.errors import InputError
from tests.config.test_bad_inputs import Files, _snapshot, call, refused_line, with_base

MODULE = "hf_arch"
VOCAB, LENGTH = 40, 6
ONLY = "weight matching only"

SOURCE = f"""
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification


def bert():
    return BertForSequenceClassification(BertConfig(vocab_size={VOCAB}, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=24, max_position_embeddings=16, num_labels=3))


def llama():
    return LlamaForSequenceClassification(LlamaConfig(vocab_size={VOCAB}, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                      num_key_value_heads=2, intermediate_size=24, max_position_embeddings=16,
                                                      use_cache=False, num_labels=3, pad_token_id=0))
"""


def build(name: str) -> torch.nn.Module:
    namespace: dict[str, Any] = {}
    exec(compile(SOURCE, MODULE, "exec"), namespace)
    return namespace[name]().eval()


def ids(batch: int = 2, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


class HFFiles(Files):
    """A case folder holding the user's module, two independently initialised checkpoints per model and token ids."""

    def __init__(self, root: Path, checkpoints: Path) -> None:
        super().__init__(root)
        self.checkpoints = checkpoints
        self.text(f"{MODULE}.py", SOURCE)

    def ids_npz(self, name: str = "ids.npz", X: Any = None) -> str:
        X = np.random.default_rng(0).integers(0, VOCAB, (12, LENGTH)) if X is None else X
        np.savez(self.root / name, X=X, y=np.arange(len(X)) % 3)
        return name

    def hf_fuse(self, model: str = "bert", name: str = "fuse.yaml", **fields: Any) -> str:
        data = {
            "merge_method": "weight_matching",
            "architecture": f"{MODULE}:{model}",
            "models": [{"model": str(self.checkpoints / f"{model}{i}.safetensors")} for i in range(2)],
            "input_shape": [int(LENGTH)],
            "vocab": VOCAB,
            "output": "fused.safetensors",
        }
        data.update(fields)
        return self.yaml(name, {k: v for k, v in data.items() if v is not None})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """Two checkpoints per model, initialised apart (seeds 1 and 2)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("hf-checkpoints")
    for model in ("bert", "llama"):
        for i in range(2):
            torch.manual_seed(i + 1)
            save_file({k: v.contiguous() for k, v in build(model).state_dict().items()}, str(folder / f"{model}{i}.safetensors"))
    return folder


@pytest.fixture
def hf_isolated(tmp_path, monkeypatch, checkpoints):
    """The case's folder as the working directory and on sys.path (the user's module), no bytecode written there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    sys.modules.pop(MODULE, None)  # each case imports the module from its own folder
    yield HFFiles(tmp_path, checkpoints)
    sys.modules.pop(MODULE, None)


# ---------------------------------------------------------------------------------------------------------------
# Refusals: one line naming the key, nothing written


@dataclass
class HFCase:
    id: str
    sub: str  # structure, symmetry, fuse
    make: Callable[[HFFiles], Any]
    names: str
    words: str = ""  # further words the line must hold


def _structure(function: Callable[[], Any]) -> Callable[[HFFiles], Any]:
    return lambda f: function


def _read_structure(model: str) -> Callable[[], Any]:
    return lambda: sym.read_structure(build(model), ids())


def _read_output(model: str) -> Callable[[], Any]:
    return lambda: sym.read_output_module(build(model))


def _repair_units(model: str) -> Callable[[], Any]:
    def run() -> Any:
        from rayfuse.alignment import repair_units

        net = build(model)
        return repair_units(net, sym.derive_spec(net, ids(), check=False))

    return run


class Branchy(torch.nn.Module):
    """A federation's model that torch.fx cannot trace (a branch on a shape) and torch.export can: analysed like a
    Hugging Face model, on the float data a run's dataset gives."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(int(np.prod(input_shape)), 8)
        self.fc2 = torch.nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if x.shape[0] > 0:  # torch.fx cannot follow a branch on a shape; torch.export sees the shape
            x = torch.relu(self.fc1(x))
        return self.fc2(x)


def _aligned_run(**params: Any) -> Callable[[HFFiles], Any]:
    return lambda f: call(rayfuse.run, with_base(methods={"aligned": params}), model=Branchy, backend="local", quiet=True)


HF_CASES = [
    # structure: what reads the torch.fx graph refuses a model only torch.export follows, saying weight matching only
    HFCase("structure-read-structure-bert", "structure", _structure(_read_structure("bert")), "architecture", ONLY),
    HFCase("structure-read-structure-llama", "structure", _structure(_read_structure("llama")), "architecture", ONLY),
    HFCase("structure-output-module-bert", "structure", _structure(_read_output("bert")), "architecture", ONLY),
    HFCase("structure-output-module-llama", "structure", _structure(_read_output("llama")), "architecture", ONLY),
    HFCase("structure-repair-units-bert", "structure", _structure(_repair_units("bert")), "architecture", ONLY),
    HFCase(
        "structure-fuse-activation-matching",
        "structure",
        lambda f: ["fuse", f.hf_fuse(merge_method="activation_matching", data={"path": f.ids_npz()}, input_shape=None)],
        "merge_method",
        ONLY,
    ),
    HFCase(
        "structure-fuse-activation-matching-llama",
        "structure",
        lambda f: ["fuse", f.hf_fuse("llama", merge_method="activation_matching", data={"path": f.ids_npz()}, input_shape=None)],
        "merge_method",
        ONLY,
    ),
    HFCase(
        "structure-fuse-repair",
        "structure",
        lambda f: ["fuse", f.hf_fuse(parameters={"repair": True}, data={"path": f.ids_npz()}, input_shape=None)],
        "parameters.repair",
        ONLY,
    ),
    HFCase(
        "structure-fuse-nonparametric",
        "structure",
        lambda f: ["fuse", f.hf_fuse(parameters={"merge": "nonparametric"})],
        "parameters.merge",
        ONLY,
    ),
    HFCase(
        "structure-fuse-fisher-on-ids",
        "structure",
        lambda f: ["fuse", f.hf_fuse(parameters={"merge": "fisher"}, data={"path": f.ids_npz()}, input_shape=None)],
        "parameters.merge",
        "fisher",
    ),
    HFCase(
        "structure-fuse-regmean-on-ids",
        "structure",
        lambda f: ["fuse", f.hf_fuse(parameters={"merge": "regmean"}, data={"path": f.ids_npz()}, input_shape=None)],
        "parameters.merge",
        "regmean",
    ),
    HFCase("structure-run-aligned-activation", "structure", _aligned_run(), "model.name", "alignment: activation"),
    HFCase("structure-run-aligned-repair", "structure", _aligned_run(alignment="weight"), "model.name", "repair: true"),
    # symmetry: --vocab
    HFCase(
        "symmetry-vocab-not-a-number", "symmetry", lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6", "--vocab", "x"], "--vocab"
    ),
    HFCase("symmetry-vocab-zero", "symmetry", lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6", "--vocab", "0"], "--vocab"),
    HFCase("symmetry-vocab-negative", "symmetry", lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6", "--vocab=-3"], "--vocab"),
    HFCase(
        "symmetry-vocab-fraction", "symmetry", lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6", "--vocab", "2.5"], "--vocab"
    ),
    HFCase(
        "symmetry-vocab-without-shape", "symmetry", lambda f: ["symmetry", f"{MODULE}:bert", "--vocab", "40"], "--input-shape", "token ids"
    ),
    HFCase(
        "symmetry-vocab-beyond-the-model",
        "symmetry",
        lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6", "--vocab", "1000"],
        "input",
        "vocab at most",
    ),
    # bounds: ids held as float32 (exact to 2^24) and drawn as int64; a vocabulary larger than the model's embedding
    HFCase(
        "symmetry-vocab-overflows-int64",
        "symmetry",
        lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6", "--vocab", str(10**30)],
        "--vocab",
        "[1, 16777216]",
    ),
    HFCase(
        "symmetry-vocab-beyond-float32",
        "symmetry",
        lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6", "--vocab", str(2**24 + 1)],
        "--vocab",
        "[1, 16777216]",
    ),
    HFCase("symmetry-api-vocab-huge", "symmetry", lambda f: call(symmetry_api, f"{MODULE}:bert", input_shape=(6,), vocab=2**63), "vocab"),
    HFCase("fuse-vocab-beyond-the-model", "fuse", lambda f: ["fuse", f.hf_fuse(vocab=1000)], "vocab", "at most the model's vocabulary"),
    HFCase(
        "symmetry-floats-to-a-token-model", "symmetry", lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "6"], "input", "--vocab N"
    ),
    HFCase(
        "symmetry-sequence-too-long", "symmetry", lambda f: ["symmetry", f"{MODULE}:bert", "--input-shape", "64", "--vocab", "40"], "input"
    ),
    HFCase("symmetry-api-vocab-bool", "symmetry", lambda f: call(symmetry_api, f"{MODULE}:bert", input_shape=(6,), vocab=True), "vocab"),
    HFCase("symmetry-api-vocab-string", "symmetry", lambda f: call(symmetry_api, f"{MODULE}:bert", input_shape=(6,), vocab="40"), "vocab"),
    HFCase("symmetry-api-vocab-without-shape", "symmetry", lambda f: call(symmetry_api, f"{MODULE}:bert", vocab=40), "input_shape"),
    # fuse: vocab and the ids
    HFCase("fuse-vocab-zero", "fuse", lambda f: ["fuse", f.hf_fuse(vocab=0)], "vocab"),
    HFCase("fuse-vocab-a-string", "fuse", lambda f: ["fuse", f.hf_fuse(vocab="many")], "vocab"),
    HFCase(
        "fuse-vocab-without-architecture",
        "fuse",
        lambda f: ["fuse", f.hf_fuse(merge_method="average", architecture=None, input_shape=None)],
        "architecture",
        "vocab",
    ),
    HFCase("fuse-vocab-with-distill", "fuse", lambda f: ["fuse", f.hf_fuse(merge_method="distill")], "vocab", "distill"),
    HFCase(
        "fuse-ids-beyond-vocab",
        "fuse",
        lambda f: ["fuse", f.hf_fuse(data={"path": f.ids_npz(X=np.full((4, LENGTH), VOCAB))}, input_shape=None)],
        "data.path",
        "token ids",
    ),
    HFCase(
        "fuse-ids-negative",
        "fuse",
        lambda f: ["fuse", f.hf_fuse(data={"path": f.ids_npz(X=-np.ones((4, LENGTH), np.int64))}, input_shape=None)],
        "data.path",
        "token ids",
    ),
    HFCase(
        "fuse-ids-fractional",
        "fuse",
        lambda f: ["fuse", f.hf_fuse(data={"path": f.ids_npz(X=np.full((4, LENGTH), 1.5))}, input_shape=None)],
        "data.path",
        "token ids",
    ),
    HFCase(
        "fuse-ids-without-vocab",
        "fuse",
        lambda f: ["fuse", f.hf_fuse(vocab=None, data={"path": f.ids_npz()}, input_shape=None)],
        "data.path",
        "indices",
    ),
    HFCase("fuse-shape-without-vocab", "fuse", lambda f: ["fuse", f.hf_fuse(vocab=None)], "input_shape", "indices"),
    HFCase("fuse-no-shape-no-data", "fuse", lambda f: ["fuse", f.hf_fuse(input_shape=None)], "input_shape"),
]


@pytest.mark.parametrize("bad", HF_CASES, ids=[c.id for c in HF_CASES])
def test_a_refusal_is_one_line_and_leaves_nothing_behind(bad: HFCase, hf_isolated: HFFiles, capsys) -> None:
    command = bad.make(hf_isolated)
    capsys.readouterr()
    before = _snapshot(hf_isolated.root)
    line = refused_line(command, capsys)
    assert bad.names in line, line
    assert bad.words in line, line
    assert _snapshot(hf_isolated.root) == before


def test_the_case_table_covers_each_sub_class() -> None:
    counts = {sub: sum(1 for c in HF_CASES if c.sub == sub) for sub in ("structure", "symmetry", "fuse")}
    assert all(n >= 8 for n in counts.values()), counts
    assert len({c.id for c in HF_CASES}) == len(HF_CASES)


# ---------------------------------------------------------------------------------------------------------------
# What must succeed


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_symmetry_vocab_derives_the_groups_from_token_ids(model: str, hf_isolated: HFFiles, capsys) -> None:
    assert main(["symmetry", f"{MODULE}:{model}", "--input-shape", str(LENGTH), "--vocab", str(VOCAB), "--json"]) == 0
    spec = sym.PermutationSpec.from_dict(json.loads(capsys.readouterr().out))
    kinds = {g.kind for g in spec.groups}
    assert "heads" in kinds and len(spec.groups) >= 5, kinds
    assert all(not g.probes for g in spec.groups)  # from torch.export: no probes (weight matching only)
    # the spec is the one derive_spec gives on token ids from Python
    direct = sym.derive_spec(build(model), ids())
    assert [(g.name, g.size) for g in spec.groups] == [(g.name, g.size) for g in direct.groups]


def test_symmetry_vocab_strict_passes_on_bert(hf_isolated: HFFiles, capsys) -> None:
    assert main(["symmetry", f"{MODULE}:bert", "--input-shape", "4", "--vocab", "7", "--strict"]) == 0
    assert "permutation groups" in capsys.readouterr().out


@pytest.mark.parametrize("model,how", [("bert", "shape"), ("bert", "data"), ("llama", "shape")])
def test_fuse_weight_matching_of_a_hf_model_loads_and_runs(model: str, how: str, hf_isolated: HFFiles, capsys) -> None:
    from safetensors.numpy import load_file

    f = hf_isolated
    config = f.hf_fuse(model) if how == "shape" else f.hf_fuse(model, data={"path": f.ids_npz()}, input_shape=None)
    assert main(["fuse", config]) == 0, capsys.readouterr().err
    fused = rayfuse.load_fused(f"{MODULE}:{model}", f.root / "fused.safetensors")
    with torch.no_grad():
        logits = fused(ids(4)).logits
    assert logits.shape == (4, 3) and torch.isfinite(logits).all()
    # the models were aligned, not only averaged: some hidden units were reordered
    a, b, out = (
        load_file(str(p))
        for p in (f.checkpoints / f"{model}0.safetensors", f.checkpoints / f"{model}1.safetensors", f.root / "fused.safetensors")
    )
    assert set(out) == set(a)
    assert any(not np.allclose(out[k], (a[k] + b[k]) / 2) for k in out if out[k].dtype.kind == "f")


def test_weight_matching_on_a_hf_model_is_invariant(hf_isolated: HFFiles) -> None:
    """The fused model of one checkpoint with itself permuted at random is that checkpoint (weight matching undoes the
    permutation): the export-derived spec is applied soundly end to end."""
    from rayfuse.alignment import weight_matching
    from rayfuse.models import get_params, set_params

    model = build("bert")
    spec = sym.derive_spec(model, ids())
    params = get_params(model)
    rng = np.random.default_rng(0)
    perms = {g.name: rng.permutation(g.size) for g in spec.groups}
    permuted = spec.apply(params, perms)
    alignment = weight_matching([params, permuted], spec, seed=0)
    realigned = spec.apply(permuted, alignment.perms[1])
    back = set_params(build("bert"), realigned)
    with torch.no_grad():
        assert torch.allclose(back(ids()).logits, model(ids()).logits, atol=1e-5)


def test_a_run_aligns_such_a_model_by_weight_matching_without_repair(hf_isolated: HFFiles) -> None:
    result = rayfuse.run(
        with_base(methods={"aligned": {"alignment": "weight", "repair": False}}), model=Branchy, backend="local", quiet=True
    )
    assert np.isfinite(result.metrics.loc["aligned", "accuracy"])


def test_read_structure_of_a_traceable_model_is_unchanged() -> None:
    """The refusal is for models torch.fx cannot trace: a plain MLP still reads."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    structure = sym.read_structure(net, torch.zeros(2, 4))
    assert structure.output_layer.module == "2"
    assert sym.read_output_module(net)[0] == "2"


def test_the_refusal_names_the_model_class(hf_isolated: HFFiles) -> None:
    with pytest.raises(InputError) as raised:
        sym.trace_structure(build("llama"), "activation matching")
    assert "LlamaForSequenceClassification" in str(raised.value) and ONLY in str(raised.value)
