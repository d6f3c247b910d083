"""Hugging Face folders in and out: a tiny Llama and a tiny BERT (2 layers, hidden 64, built from a config, nothing
downloaded) saved as sharded folders, fine-tuned copies merged with ``rayfuse fuse``, the output loaded with
``from_pretrained`` and run; bf16 stays bf16; streaming keeps the peak memory far below the inputs' size; bad inputs
are refused in one line with exit 2 and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors import safe_open

from rayfuse.cli import main
from rayfuse.finetunes.config import TASK_VECTOR_METHODS
from rayfuse.finetunes.taskvec import task_vector_merge
from tests.config.test_bad_inputs import refused_line

ROOT = Path(__file__).resolve().parents[2]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118 (safe_open is not a mapping)
    return out


def _finetunes(root: Path, model: torch.nn.Module, n: int = 3, dtype: torch.dtype | None = None) -> None:
    """The base and ``n`` perturbed copies (fine-tunes), saved as sharded folders."""
    torch.manual_seed(0)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(root / "base", max_shard_size="200KB")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        model.save_pretrained(root / f"ft{i}", max_shard_size="200KB")
        model.load_state_dict(state)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _write(root: Path, config: dict) -> str:
    path = root / "merge.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_tiny_llama_merged_with_ties_loads_with_from_pretrained_and_runs(tmp_path: Path, capsys) -> None:
    _finetunes(tmp_path, _llama())
    assert (tmp_path / "base" / "model.safetensors.index.json").is_file()  # sharded inputs
    config = _write(
        tmp_path,
        {
            "merge_method": "ties",
            "base_model": "base",
            "models": [{"model": f"ft{i}", "parameters": {"weight": 1.0, "density": 0.5}} for i in range(3)],
            "parameters": {"lambda": 1.0},
            "output": "merged",
            "max_shard_size": "150KB",
            "threads": 2,
        },
    )
    assert main(["fuse", config]) == 0
    assert "ties of 4 models" in capsys.readouterr().out
    out = tmp_path / "merged"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()
    merged, base, tuned = _tensors(out), _tensors(tmp_path / "base"), [_tensors(tmp_path / f"ft{i}") for i in range(3)]
    assert set(merged) == set(base)
    name = "model.layers.1.mlp.up_proj.weight"
    expected = task_vector_merge(base[name], [t[name] for t in tuned], [1.0] * 3, [0.5] * 3, TASK_VECTOR_METHODS["ties"], normalize=True)
    assert torch.equal(merged[name], expected)


def test_a_tiny_bert_merged_with_task_arithmetic_loads_and_runs(tmp_path: Path) -> None:
    cfg = transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=64
    )
    torch.manual_seed(2)
    _finetunes(tmp_path, transformers.AutoModel.from_config(cfg), n=2)
    config = _write(
        tmp_path,
        {
            "merge_method": "task_arithmetic",
            "base_model": "base",
            "models": [{"model": f"ft{i}", "parameters": {"weight": 0.5}} for i in range(2)],
            "parameters": {"lambda": 0.7},
            "output": "merged",
        },
    )
    assert main(["fuse", config]) == 0
    model = transformers.AutoModel.from_pretrained(tmp_path / "merged")
    hidden = model(input_ids=torch.tensor([[1, 5, 7]])).last_hidden_state
    assert hidden.shape == (1, 3, 64) and torch.isfinite(hidden).all()
    base, merged = _tensors(tmp_path / "base"), _tensors(tmp_path / "merged")
    tuned = [_tensors(tmp_path / f"ft{i}") for i in range(2)]
    for name, value in base.items():
        torch.testing.assert_close(merged[name], value + 0.7 * (0.5 * (tuned[0][name] - value) + 0.5 * (tuned[1][name] - value)))


def test_bf16_in_bf16_out_computed_in_float32(tmp_path: Path) -> None:
    _finetunes(tmp_path, _llama(), n=2, dtype=torch.bfloat16)
    config = _write(
        tmp_path,
        {
            "merge_method": "dare_ties",
            "base_model": "base",
            "seed": 5,
            "models": [{"model": f"ft{i}", "parameters": {"weight": 1.0, "density": 0.7}} for i in range(2)],
            "output": "merged",
        },
    )
    assert main(["fuse", config]) == 0
    merged = _tensors(tmp_path / "merged")
    assert {v.dtype for v in merged.values()} == {torch.bfloat16}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    assert torch.isfinite(model(torch.tensor([[3, 4]])).logits.float()).all()
    # the same seed gives the same merge
    config = _write(tmp_path, {**yaml.safe_load(Path(config).read_text()), "output": "again"})
    assert main(["fuse", config]) == 0
    assert all(torch.equal(v, _tensors(tmp_path / "again")[k]) for k, v in merged.items())


_MEMORY = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    root = Path(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    base = {f"model.layers.{i}.w": torch.randn(128, 1024, generator=g) for i in range(96)}
    save_file(base, str(root / "base.safetensors"))
    for k in range(3):
        save_file({n: v + 0.01 * torch.randn(v.shape, generator=g) for n, v in base.items()}, str(root / f"ft{k}.safetensors"))
    del base
    code = '''
    import json, os, sys
    import rayfuse, rayfuse.merging, rayfuse.finetunes.run, safetensors.torch, torch  # everything the merge imports, first
    root = sys.argv[1]
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # the high-water mark of this process's memory map (VmHWM: ru_maxrss would carry the parent's over exec)
    hwm = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
    before = rss()
    rayfuse.fuse({"merge_method": "task_arithmetic", "base_model": root + "/base.safetensors", "threads": 1, "max_shard_size": "20MB",
                  "models": [{"model": f"{root}/ft{k}.safetensors", "parameters": {"weight": 0.5}} for k in range(3)],
                  "output": root + "/out"})
    print(json.dumps({"before": before, "peak": hwm()}))
    '''
    import subprocess
    print(subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True).stdout)
""")


def test_streaming_keeps_the_peak_memory_far_below_the_inputs(tmp_path: Path) -> None:
    """4 models of 48 MiB (96 tensors of 0.5 MiB): the merge's peak resident memory above what the process held before
    it is a small multiple of one tensor, not the 192 MiB of inputs (measured in a fresh process, VmHWM)."""
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    inputs = 4 * 48 * 2**20
    grew = numbers["peak"] - numbers["before"]
    assert grew < 0.35 * inputs, f"peak grew by {grew / 2**20:.0f} MiB for {inputs / 2**20:.0f} MiB of inputs"
    assert len(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]) == 96


# ---- bad inputs: one line, exit 2, nothing written --------------------------------------------------------------


@pytest.fixture()
def folders(tmp_path: Path) -> Path:
    _finetunes(tmp_path, _llama(), n=2)
    return tmp_path


def _refused(root: Path, capsys, config: dict) -> str:
    path = _write(root, config)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    line = refused_line(["fuse", path], capsys)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    return line


def _ties(**fields) -> dict:
    return {"merge_method": "ties", "base_model": "base", "models": [{"model": "ft0"}, {"model": "ft1"}], "output": "merged", **fields}


def _retensor(folder: Path, name: str, value: torch.Tensor | None) -> None:
    from safetensors.torch import save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    tensors = _tensors_of(shard)
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    if value is None:
        del index["weight_map"][name]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _tensors_of(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118


def test_a_finetune_of_another_shape_is_refused_naming_the_tensor_and_both_shapes(folders: Path, capsys) -> None:
    _retensor(folders / "ft1", "model.layers.0.mlp.up_proj.weight", torch.zeros(100, 64))
    line = _refused(folders, capsys, _ties())
    assert "model.layers.0.mlp.up_proj.weight" in line and "(128, 64)" in line and "(100, 64)" in line and "models.1" in line


def test_a_tensor_missing_from_a_model_is_refused(folders: Path, capsys) -> None:
    _retensor(folders / "ft0", "model.norm.weight", None)
    line = _refused(folders, capsys, _ties())
    assert "model.norm.weight" in line and "missing" in line


def test_a_sharded_index_naming_a_missing_file_is_refused(folders: Path, capsys) -> None:
    index = json.loads((folders / "ft0" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folders / "ft0" / shard).unlink()
    line = _refused(folders, capsys, _ties())
    assert shard in line and "model.safetensors.index.json" in line


@pytest.mark.parametrize("models", [["ft0"], ["ft0", "ft1"]])
def test_slerp_with_other_than_two_models_is_refused(folders: Path, capsys, models: list[str]) -> None:
    config = {
        "merge_method": "slerp",
        "base_model": "base",
        "models": [{"model": m} for m in ["base", *models]] if len(models) > 1 else [{"model": "ft0"}, {"model": "ft1"}, {"model": "base"}],
        "parameters": {"t": 0.5},
        "output": "merged",
    }
    line = _refused(folders, capsys, config)
    assert "exactly two models" in line


@pytest.mark.parametrize("density", [0, 1.5, -0.1])
def test_a_density_outside_zero_one_is_refused(folders: Path, capsys, density: float) -> None:
    line = _refused(folders, capsys, _ties(models=[{"model": "ft0", "parameters": {"density": density}}, {"model": "ft1"}]))
    assert "models.0.parameters.density" in line and "(0, 1]" in line


def test_a_density_in_a_pattern_list_is_checked_too(folders: Path, capsys) -> None:
    line = _refused(folders, capsys, _ties(parameters={"density": [{"filter": "mlp", "value": 2.0}, {"value": 0.5}]}))
    assert "parameters.density.0.value" in line


@pytest.mark.parametrize("lam", [float("nan"), float("inf")])
def test_lambda_not_finite_is_refused(folders: Path, capsys, lam: float) -> None:
    line = _refused(folders, capsys, _ties(parameters={"lambda": lam}))
    assert "parameters.lambda" in line and "finite" in line


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_linear", "dare_ties", "slerp"])
def test_no_base_model_for_a_task_vector_method_is_refused(folders: Path, capsys, method: str) -> None:
    config = {**_ties(), "merge_method": method}
    del config["base_model"]
    line = _refused(folders, capsys, config)
    assert "base_model" in line


def test_an_overflow_after_the_merge_is_refused_and_nothing_is_written(folders: Path, capsys) -> None:
    line = _refused(folders, capsys, _ties(merge_method="task_arithmetic", parameters={"lambda": 1e20, "weight": 1e30}))
    assert "finite values in the merged model" in line and "nothing was written" in line


def test_an_unknown_parameter_is_refused_with_the_methods_keys(folders: Path, capsys) -> None:
    line = _refused(folders, capsys, _ties(parameters={"lamda": 1.0}))
    assert "parameters.lamda" in line and "lambda" in line
