"""One registry for ``rayfuse fuse``: every registered tensor merge runs end to end on Hugging Face folders (the output
loads with ``from_pretrained`` and equals the registered function on the tensors), a file is routed by its merge and
the keys it sets whatever its paths look like, a plug-in merge is one registered entry, and a merge's parameters are
checked before anything is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import rayfuse
from rayfuse.errors import InputError
from rayfuse.finetunes.config import FinetuneSpec
from rayfuse.finetunes.tensor_merge import TensorMerge
from rayfuse.merging import MERGES, MergeMethod, load_fuse_config, merge_names, register_merge
from rayfuse.merging.run import FuseSpec
from tests.finetunes.test_hf_folders import _finetunes, _tensors

TENSOR_MERGES = sorted(name for name, m in MERGES.items() if m.tensor is not None and m.tensor.statistics is None)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("registry")
    _finetunes(root, _llama(), n=3)
    return root


def _config(root: Path, name: str, out: str) -> dict:
    merge = MERGES[name].tensor
    assert merge is not None
    low, high = merge.models
    count = 3 if high is None else min(3, high)
    models = [{"model": str(root / f"ft{i}")} for i in range(count)]
    if "weight" in merge.per_model and merge.per_model["weight"] is None:
        for i, m in enumerate(models):
            m["parameters"] = {"weight": 1.0 + i}
    config = {"merge_method": name, "models": models, "output": str(root / out)}
    if merge.base != "none":
        config["base_model"] = str(root / "base")
    if "t" in merge.globals and merge.globals["t"] is None:
        config["parameters"] = {"t": 0.3}
    return config


@pytest.mark.parametrize("name", TENSOR_MERGES)
def test_every_registered_tensor_merge_writes_a_folder_from_pretrained_loads_and_the_registered_function_computed(
    folders: Path, name: str
) -> None:
    config = _config(folders, name, f"out-{name}")
    out = rayfuse.fuse(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    logits = model(torch.arange(8)[None]).logits
    assert torch.isfinite(logits).all()
    merged = _tensors(out)
    # one projection matrix and one norm vector: the file's tensors are the registered function's on the inputs
    spec = load_fuse_config({**config, "output": str(folders / f"again-{name}")})
    assert isinstance(spec, FinetuneSpec) and spec.merge is MERGES[name].tensor
    base = _tensors(folders / "base")
    tuned = [_tensors(Path(m["model"])) for m in config["models"]]
    merge = MERGES[name].tensor
    for key in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"):
        per_model = [
            {k: float(m.get("parameters", {}).get(k, d if d is not None else 1.0)) for k, d in merge.per_model.items()}
            for m in config["models"]
        ]
        g = {k: config.get("parameters", {}).get(k, d) for k, d in merge.globals.items()}
        gens = [torch.Generator().manual_seed(0) for _ in tuned]
        with_base = merge.base != "none" and "base_model" in config
        if merge.exact:
            expected = merge.fn(base[key].float() if with_base else None, [t[key].float() for t in tuned], per_model, g, gens)
            assert torch.equal(merged[key], expected.to(merged[key].dtype)), (name, key)
        assert merged[key].shape == base[key].shape


def _saved(root: Path) -> list[str]:
    """The same two models as a .safetensors file, a .pt file and a shard folder's index."""
    rng = np.random.default_rng(0)
    from rayfuse.io import save_params

    models = [{"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)} for _ in range(3)]
    save_params(root / "a.safetensors", models[0])
    torch.save({k: torch.from_numpy(v) for k, v in models[1].items()}, root / "b.pt")
    save_params(root / "c.safetensors", models[2], max_shard_size=20)
    return ["a.safetensors", "b.pt", "c.safetensors/model.safetensors.index.json"]


def test_a_file_is_routed_by_its_merge_and_keys_whatever_its_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    paths = _saved(tmp_path)
    for models in (paths, paths[:1] + paths[2:], paths[1:]):
        spec = load_fuse_config({"merge_method": "average", "models": [{"model": m} for m in models], "output": "o.safetensors"})
        assert isinstance(spec, FinetuneSpec), models  # the averages' tensor form, whatever the files
    spec = load_fuse_config(
        {
            "merge_method": "average",
            "architecture": "torch.nn:Linear",
            "architecture_args": {"in_features": 3, "out_features": 4},
            "models": [{"model": m} for m in paths],
            "output": "o.safetensors",
        }
    )
    assert isinstance(spec, FuseSpec)  # an architecture: the checkpoint form, which checks them against the class
    fused = rayfuse.fuse({"merge_method": "average", "models": [{"model": m} for m in paths], "output": "avg.safetensors"})
    from rayfuse.io import load_params

    got = load_params(fused)
    models = [
        load_params(tmp_path / "a.safetensors"),
        {k: v.numpy() for k, v in torch.load(tmp_path / "b.pt").items()},
        load_params(tmp_path / "c.safetensors"),
    ]
    np.testing.assert_allclose(got["w"], sum(m["w"] for m in models) / 3, rtol=1e-6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"merge_method": "ties", "architecture": "torch.nn:Linear"}, r"architecture: expected no architecture with merge_method ties"),
        ({"merge_method": "ties", "threads": 2, "output_kind": "merged"}, r"output_kind: expected no output_kind with merge_method ties"),
        (
            {"merge_method": "weight_matching", "base_model": "base"},
            r"base_model: expected no base_model with merge_method weight_matching",
        ),
        (
            {"merge_method": "iso_cts", "parameters": {"common_space_fraction": 1.5}},
            r"parameters\.common_space_fraction: expected a fraction in \[0, 1\]",
        ),
        ({"merge_method": "tsv_m", "parameters": {"density": 0.5}}, r"parameters\.density: expected a parameter of tsv_m in \{lambda\}"),
        ({"merge_method": "wudi", "base_model": None}, r"base_model: expected the model the others are fine-tunes of, for wudi"),
        (
            {"merge_method": "tsv_m", "models": [{"model": "ft0", "statistics": "s.safetensors"}]},
            r"models\.0\.statistics: expected statistics only with",
        ),
        (
            {"merge_method": "nuslerp", "models": [{"model": f"ft{i}", "parameters": {"weight": 1}} for i in range(3)]},
            r"models: expected 2 fine-tuned models for nuslerp",
        ),
        ({"merge_method": "model_stock", "models": [{"model": "ft0"}]}, r"models: expected at least 2 fine-tuned models for model_stock"),
        (
            {"merge_method": "della", "models": [{"model": "ft0", "parameters": {"weight": 1, "density": 0.5, "epsilon": 0.6}}]},
            r"models\.0\.parameters\.epsilon: expected density \+/- epsilon inside \(0, 1\) \(density 0\.5\), got 0\.6; at tensor",
        ),
        (
            {"merge_method": "breadcrumbs", "models": [{"model": "ft0"}]},
            r"models\.0\.parameters\.weight: expected this model's weight for breadcrumbs",
        ),
    ],
)
def test_a_key_or_parameter_the_merge_does_not_take_is_one_line_before_anything_is_written(
    folders: Path, changes: dict, message: str, monkeypatch
) -> None:
    monkeypatch.chdir(folders)
    config = {"merge_method": "ties", "base_model": "base", "models": [{"model": "ft0"}, {"model": "ft1"}], "output": "refused"}
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(InputError, match=message) as raised:
        rayfuse.fuse(config)
    assert "\n" not in str(raised.value)
    assert not (folders / "refused").exists()


def test_a_new_merge_is_one_registered_entry(folders: Path) -> None:
    """A plug-in's merge: the elementwise largest-magnitude task vector (a toy), registered once, then run by rayfuse
    fuse like any other, its parameter checked, its row in the registry."""

    def largest(base, tuned, per_model, g, generators):  # type: ignore[no-untyped-def]
        deltas = torch.stack([t - base for t in tuned])
        pick = deltas.abs().argmax(dim=0, keepdim=True)
        return base + float(g["lambda"]) * deltas.gather(0, pick)[0]

    merge = TensorMerge("largest_delta", largest, "the largest task vector entry, entry by entry", "a test", globals={"lambda": 1.0})
    register_merge(MergeMethod(merge.name, merge.summary, merge.reference, tensor=merge))
    try:
        config = _config(folders, "largest_delta", "out-largest")
        config["parameters"] = {"lambda": 0.5}
        out = rayfuse.fuse(config)
        key = "model.layers.0.mlp.up_proj.weight"
        base, tuned = _tensors(folders / "base")[key], [_tensors(folders / f"ft{i}")[key] for i in range(3)]
        assert torch.equal(_tensors(out)[key], largest(base, tuned, [], {"lambda": 0.5}, []))
        with pytest.raises(InputError, match=r"parameters\.lam: expected a parameter of largest_delta in \{lambda\}"):
            rayfuse.fuse({**config, "parameters": {"lam": 1}, "output": str(folders / "nope")})
        assert "largest_delta" in merge_names()
        with pytest.raises(ValueError, match="registered already"):
            register_merge(MergeMethod(merge.name, merge.summary, merge.reference, tensor=merge))
    finally:
        MERGES.pop("largest_delta")
