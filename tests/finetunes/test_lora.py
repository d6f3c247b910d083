"""``merge_method: lora`` (rayfuse.finetunes.lora): PEFT adapters of a tiny Llama / BERT built from a config (no
downloads), combined by stacking, SVD or averaging the factors, written as an adapter or folded into the base; each
checked against the formula it claims, against PEFT's own deltas and outputs, and its bad inputs refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import peft
import pytest
import torch
import transformers
import yaml

import rayfuse
from rayfuse.errors import InputError
from rayfuse.finetunes.lora import METADATA_FILE, combine_module, read_adapter
from tests.config.test_bad_inputs import Files, _snapshot, refused_line
from tests.config.test_bad_inputs import isolated as isolated  # noqa: F401  (the harness's fixture: the case's folder as cwd)

LLAMA = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# name: (rank, alpha, target modules, extra LoraConfig arguments); three ranks, rsLoRA, PEFT's per-module patterns and
# adapters of different target modules
ADAPTERS: dict[str, tuple[int, int, list[str], dict[str, Any]]] = {
    "a0": (2, 4, ["q_proj", "v_proj"], {}),
    "a1": (4, 8, ["q_proj", "k_proj"], {"use_rslora": True}),
    "a2": (4, 16, ["q_proj", "v_proj", "down_proj"], {"rank_pattern": {"v_proj": 3}, "alpha_pattern": {"v_proj": 6}}),
    "e0": (4, 8, ["q_proj", "v_proj"], {}),
    "e1": (4, 8, ["q_proj", "v_proj"], {}),
}


def _lora_config(rank: int, alpha: int, targets: list[str], **extra: Any) -> Any:
    return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Path:
    """A tiny Llama base, a second base whose v_proj has another shape, a tiny BERT with two adapters, and the adapters
    above (random factors: init_lora_weights=False)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(root / "base")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "num_key_value_heads": 4})).save_pretrained(root / "base_wide")
    for seed, (name, (rank, alpha, targets, extra)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        model = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        peft.get_peft_model(model, _lora_config(rank, alpha, targets, **extra)).save_pretrained(root / name)
    bert = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    transformers.BertModel(bert).save_pretrained(root / "bert")
    for seed, rank in enumerate((2, 3)):
        torch.manual_seed(200 + seed)
        model = transformers.BertModel.from_pretrained(root / "bert")
        peft.get_peft_model(model, _lora_config(rank, 2 * rank, ["query", "value", "dense"])).save_pretrained(root / f"b{seed}")
    return root


def fuse(env: Path, name: str, models: list[str], weights: list[float] | None = None, **fields: Any) -> Path:
    config = {
        "merge_method": "lora",
        "models": [
            {"model": str(env / m), **({"parameters": {"weight": w}} if weights else {})}
            for m, w in zip(models, weights or [1.0] * len(models))
        ],
        "output": str(env / name),
        **fields,
    }
    return rayfuse.fuse(config)


def peft_deltas(base: Path, adapter: Path) -> dict[str, np.ndarray]:
    """PEFT's own update of every LoRA layer (``get_delta_weight``: scaling * B @ A), by module name in the base."""
    cls = transformers.LlamaForCausalLM if (base / "generation_config.json").is_file() else transformers.BertModel
    model = peft.PeftModel.from_pretrained(cls.from_pretrained(base), adapter)
    out = {}
    for name, module in model.base_model.model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            out[name] = module.get_delta_weight("default").detach().double().numpy()
    return out


def weighted(env: Path, models: list[str], weights: list[float], base: str = "base") -> dict[str, np.ndarray]:
    """sum_i w_i s_i B_i A_i from PEFT's deltas (a module an adapter does not target: zero)."""
    total: dict[str, np.ndarray] = {}
    for model, w in zip(models, weights):
        for name, delta in peft_deltas(env / base, env / model).items():
            total[name] = total.get(name, 0) + w * delta
    return total


def output_deltas(folder: Path) -> dict[str, np.ndarray]:
    """B @ A of an output adapter's factors (its scaling is 1: lora_alpha equals the rank)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    out = {}
    for key in tensors:
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            out[module] = tensors[key.replace("lora_A", "lora_B")].astype(np.float64) @ tensors[key].astype(np.float64)
    return out


def logits(model: Any, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=ids)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).double().numpy()


IDS = torch.arange(24).reshape(2, 12) % 128


def test_stack_equals_the_weighted_sum_of_the_updates_at_the_sum_of_the_ranks(env) -> None:
    models, raw = ["a0", "a1", "a2"], [3.0, 1.0, 2.0]
    out = fuse(env, "stack", models, raw, parameters={"combine": "stack"})
    expected = weighted(env, models, [w / sum(raw) for w in raw])
    got = output_deltas(out)
    assert sorted(got) == sorted(expected)  # the union of the target modules (k_proj from a1 only, down_proj from a2 only)
    for module, delta in expected.items():
        np.testing.assert_allclose(got[module], delta, atol=1e-5, rtol=0)
    config = json.loads((out / "adapter_config.json").read_text())
    q = "model.layers.0.self_attn.q_proj"
    ranks = {m: int(config["rank_pattern"].get(m, config["r"])) for m in config["target_modules"]}
    assert ranks[q] == 2 + 4 + 4 and ranks["model.layers.0.self_attn.v_proj"] == 2 + 3 and ranks["model.layers.0.self_attn.k_proj"] == 4
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["exact"] is True and meta["relative_error"] < 1e-12
    # PEFT loads it and applies exactly the weighted update (its own scaling of the output: 1)
    for module, delta in peft_deltas(env / "base", out).items():
        np.testing.assert_allclose(delta, expected[module], atol=1e-5, rtol=0)


def test_the_output_adapter_runs_in_peft_as_the_base_with_the_update_folded_in(env) -> None:
    models = ["a0", "a2"]
    out = fuse(env, "stack_run", models, parameters={"combine": "stack"})
    expected = weighted(env, models, [0.5, 0.5])
    base = transformers.LlamaForCausalLM.from_pretrained(env / "base").eval()
    folded = transformers.LlamaForCausalLM.from_pretrained(env / "base").eval()
    with torch.no_grad():
        for module, delta in expected.items():
            folded.get_submodule(module).weight += torch.from_numpy(delta).float()
    adapted = peft.PeftModel.from_pretrained(base, out).eval()
    np.testing.assert_allclose(logits(adapted, IDS), logits(folded, IDS), atol=1e-5, rtol=0)
    assert np.abs(logits(folded, IDS) - logits(transformers.LlamaForCausalLM.from_pretrained(env / "base"), IDS)).max() > 1e-3


def test_svd_is_the_best_rank_r_approximation_and_its_error_the_tail_singular_values(env) -> None:
    models = ["a0", "a1", "a2"]
    out = fuse(env, "svd3", models, parameters={"combine": "svd", "rank": 3})
    expected = weighted(env, models, [1 / 3] * 3)
    got = output_deltas(out)
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["exact"] is False and meta["combine"] == "svd"
    tails, norms = [], []
    for module, delta in expected.items():
        U, S, Vt = np.linalg.svd(delta)
        best = (U[:, :3] * S[:3]) @ Vt[:3]
        np.testing.assert_allclose(got[module], best, atol=1e-5, rtol=0)
        assert np.linalg.matrix_rank(got[module], tol=1e-6) <= 3
        tail = float(np.sqrt(np.sum(S[3:] ** 2)))
        np.testing.assert_allclose(np.linalg.norm(delta - got[module]), tail, rtol=1e-4)
        np.testing.assert_allclose(meta["modules"][module]["relative_error"], tail / np.linalg.norm(delta), rtol=1e-6, atol=1e-12)
        tails.append(tail)
        norms.append(float(np.linalg.norm(delta)))
    np.testing.assert_allclose(meta["relative_error"], np.sqrt(np.sum(np.square(tails))) / np.sqrt(np.sum(np.square(norms))), rtol=1e-6)
    assert meta["relative_error"] > 1e-3  # rank 3 cuts updates of stacked rank up to 10


def test_svd_at_the_full_stacked_rank_is_exact(env) -> None:
    out = fuse(env, "svd_full", ["e0", "e1"], parameters={"combine": "svd", "rank": 8})
    expected = weighted(env, ["e0", "e1"], [0.5, 0.5])
    got = output_deltas(out)
    for module, delta in expected.items():
        np.testing.assert_allclose(got[module], delta, atol=1e-5, rtol=0)
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["exact"] is True and meta["relative_error"] < 1e-7


def test_average_factors_is_labelled_inexact_and_its_error_reported(env) -> None:
    out = fuse(env, "avg", ["e0", "e1"], [1.0, 3.0], parameters={"combine": "average_factors"})
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["exact"] is False and "inexact" in meta["note"]
    a0, a1 = read_adapter(env / "e0"), read_adapter(env / "e1")
    expected = weighted(env, ["e0", "e1"], [0.25, 0.75])
    got = output_deltas(out)
    errors, norms = [], []
    for module, delta in expected.items():
        s = a0.scaling[module]  # one scaling for both (same r and alpha): Flower's s mean(B) mean(A)
        flower = s * (0.25 * a0.B[module] + 0.75 * a1.B[module]) @ (0.25 * a0.A[module] + 0.75 * a1.A[module])
        np.testing.assert_allclose(got[module], flower, atol=1e-5, rtol=0)
        errors.append(np.linalg.norm(delta - flower))
        norms.append(np.linalg.norm(delta))
    relative = float(np.sqrt(np.sum(np.square(errors))) / np.sqrt(np.sum(np.square(norms))))
    assert relative > 0.05  # random factors: far from the average of the updates
    np.testing.assert_allclose(meta["relative_error"], relative, rtol=1e-6)
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as handle:
        assert handle.metadata()["rayfuse.exact"] == "false"


def test_combine_module_against_the_formulas_on_random_factors() -> None:
    rng = np.random.default_rng(0)
    ranks, weights, scalings = [2, 5, 3], [0.2, 0.5, 0.3], [2.0, 0.5, 1.5]
    Bs = [rng.normal(size=(12, r)) for r in ranks]
    As = [rng.normal(size=(r, 9)) for r in ranks]
    D = sum(w * s * b @ a for w, s, b, a in zip(weights, scalings, Bs, As))
    stack = combine_module(Bs, As, weights, scalings, "stack")
    assert stack.rank == 10 and stack.error == 0.0
    np.testing.assert_allclose(stack.B @ stack.A, D, atol=1e-10)
    S = np.linalg.svd(D, compute_uv=False)
    for rank in (1, 4, 9):
        svd = combine_module(Bs, As, weights, scalings, "svd", rank)
        np.testing.assert_allclose(np.linalg.svd(svd.B @ svd.A, compute_uv=False)[:rank], S[:rank], rtol=1e-9)
        np.testing.assert_allclose(svd.error, np.sqrt(np.sum(S[rank:] ** 2)), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(np.linalg.norm(D - svd.B @ svd.A), svd.error, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(stack.norm, np.linalg.norm(D), rtol=1e-10)


def test_average_factors_is_exact_when_the_adapters_share_one_frozen_a() -> None:
    # FFA-LoRA's federated case: A frozen and the same at every site, only B trained
    rng = np.random.default_rng(1)
    A = rng.normal(size=(4, 9))
    Bs = [rng.normal(size=(12, 4)) for _ in range(3)]
    weights, scalings = [0.5, 0.3, 0.2], [2.0, 2.0, 2.0]
    merged = combine_module(Bs, [A, A, A], weights, scalings, "average_factors")
    np.testing.assert_allclose(merged.B @ merged.A, sum(w * s * b @ A for w, s, b in zip(weights, scalings, Bs)), atol=1e-12)
    assert merged.error < 1e-9 * merged.norm
    other = combine_module(Bs, [A, A + rng.normal(size=A.shape), A], weights, scalings, "average_factors")
    assert other.error > 1e-2 * other.norm


def test_the_output_records_what_writing_in_a_narrower_dtype_adds(env) -> None:
    full = json.loads((fuse(env, "f32", ["e0", "e1"]) / METADATA_FILE).read_text())
    half = json.loads((fuse(env, "bf16", ["e0", "e1"], dtype="bfloat16") / METADATA_FILE).read_text())
    assert full["dtype"] == "float32" and half["dtype"] == "bfloat16"
    assert full["cast_relative_error"] < 1e-6 < 1e-4 < half["cast_relative_error"] < 1e-1
    from safetensors import safe_open

    with safe_open(str(env / "bf16" / "adapter_model.safetensors"), framework="pt") as handle:
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}


def test_a_merged_folder_loads_with_from_pretrained_and_matches_peft_merge_and_unload(env) -> None:
    models = ["a0", "a1", "a2"]
    adapter = fuse(env, "for_merge", models, parameters={"combine": "svd", "rank": 4}, base_model=str(env / "base"))
    merged = fuse(env, "merged", models, parameters={"combine": "svd", "rank": 4}, base_model=str(env / "base"), output_kind="merged")
    assert (merged / "config.json").is_file() and json.loads((merged / METADATA_FILE).read_text())["output_kind"] == "merged"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    reference = (
        peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(env / "base"), adapter).merge_and_unload().eval()
    )
    np.testing.assert_allclose(logits(loaded, IDS), logits(reference, IDS), atol=1e-5, rtol=0)


def test_a_bert_base_merges_through_automodel(env) -> None:
    merged = fuse(env, "bert_merged", ["b0", "b1"], parameters={"combine": "stack"}, base_model=str(env / "bert"), output_kind="merged")
    loaded = transformers.AutoModel.from_pretrained(merged).eval()
    expected = weighted(env, ["b0", "b1"], [0.5, 0.5], base="bert")
    base = transformers.BertModel.from_pretrained(env / "bert").eval()
    with torch.no_grad():
        for module, delta in expected.items():
            base.get_submodule(module).weight += torch.from_numpy(delta).float()
    np.testing.assert_allclose(logits(loaded, IDS), logits(base, IDS), atol=1e-5, rtol=0)


def test_mixed_ranks_stack_and_svd_and_the_cli_summary(env, capsys) -> None:
    from rayfuse.cli import main

    config = env / "mixed.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "merge_method": "lora",
                "base_model": "base",
                "models": [{"model": "a0"}, {"model": "a1"}],
                "parameters": {"combine": "svd", "rank": 6},
                "output": "mixed",
            }
        )
    )
    assert main(["fuse", str(config)]) == 0
    out = capsys.readouterr().out
    assert "lora: svd of 2 adapters" in out and "(exact)" in out and "lora (svd) of 2 models" in out
    got = output_deltas(env / "mixed")
    for module, delta in weighted(env, ["a0", "a1"], [0.5, 0.5]).items():
        np.testing.assert_allclose(got[module], delta, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written (the CLI harness of tests/config/test_bad_inputs.py)


def _copy(env: Path, f: Files, *names: str) -> None:
    for name in names:
        shutil.copytree(env / name, f.root / name)


def _fuse_file(f: Files, models: list[str], **fields: Any) -> str:
    return f.yaml("fuse.yaml", {"merge_method": "lora", "models": [{"model": m} for m in models], "output": "out", **fields})


def _bad_shapes(env: Path, f: Files) -> list[str]:
    from safetensors.numpy import load_file, save_file

    _copy(env, f, "a0", "a1")
    tensors = load_file(str(f.root / "a0" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key] = np.zeros((32, 3), np.float32)  # rank 3 against lora_A's 2
    save_file(tensors, str(f.root / "a0" / "adapter_model.safetensors"))
    return ["fuse", _fuse_file(f, ["a1", "a0"])]


def _no_config(env: Path, f: Files) -> list[str]:
    _copy(env, f, "a0", "a1")
    (f.root / "a1" / "adapter_config.json").unlink()
    return ["fuse", _fuse_file(f, ["a0", "a1"])]


def _target_not_in_base(env: Path, f: Files) -> list[str]:
    _copy(env, f, "a0", "bert")
    return ["fuse", _fuse_file(f, ["a0"], base_model="bert")]


def _base_shape(env: Path, f: Files) -> list[str]:
    _copy(env, f, "a0", "base_wide")
    return ["fuse", _fuse_file(f, ["a0"], base_model="base_wide", output_kind="merged")]


def _cli(models: list[str], **fields: Any) -> Any:
    def make(env: Path, f: Files) -> list[str]:
        _copy(env, f, *{*models, *([fields["base_model"]] if "base_model" in fields else [])})
        return ["fuse", _fuse_file(f, models, **fields)]

    return make


def _api_no_config(env: Path, f: Files) -> Any:
    (f.root / "empty").mkdir()
    config = {"merge_method": "lora", "models": [{"model": "empty"}], "output": "out"}
    return lambda: rayfuse.fuse(config)


BAD = {
    "lora-ab-shapes-disagree": (_bad_shapes, ["a0/adapter_model.safetensors: model.layers.1.self_attn.v_proj", "(2, 64)", "(32, 3)"]),
    "lora-missing-adapter-config": (_no_config, ["models.1.model", "a1/adapter_config.json"]),
    "lora-target-not-in-base": (_target_not_in_base, ["models.0.model: model.layers.0.self_attn.q_proj", "no such module in the base"]),
    "lora-base-shape-mismatch": (_base_shape, ["base_wide: model.layers.0.self_attn.v_proj.weight", "(32, 64)", "(64, 64)"]),
    "lora-svd-without-rank": (_cli(["a0", "a1"], parameters={"combine": "svd"}), ["parameters.rank", "combine: svd"]),
    "lora-svd-rank-above-stacked": (
        _cli(["a0", "a1"], parameters={"combine": "svd", "rank": 7}),
        ["parameters.rank", "at most 6", "[2, 4]"],
    ),
    "lora-average-factors-mixed-ranks": (
        _cli(["a0", "a1"], parameters={"combine": "average_factors"}),
        ["parameters.combine", "models.0.model rank 2", "models.1.model rank 4"],
    ),
    "lora-merged-without-base": (_cli(["a0"], output_kind="merged"), ["base_model", "output_kind: merged"]),
    "lora-unknown-combine": (_cli(["a0"], parameters={"combine": "mean"}), ["parameters.combine"]),
    "lora-rank-with-stack": (_cli(["a0"], parameters={"combine": "stack", "rank": 2}), ["parameters.rank"]),
    "lora-output-exists": (lambda env, f: (f.root.joinpath("out").mkdir(), _cli(["a0"])(env, f))[1], ["output", "does not exist yet"]),
    "api-lora-missing-adapter-config": (_api_no_config, ["models.0.model", "adapter_config.json"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_lora_input_is_refused_in_one_line_and_leaves_nothing_behind(name, env, isolated, capsys) -> None:
    make, names = BAD[name]
    command = make(env, Files(isolated))
    capsys.readouterr()
    before = _snapshot(isolated)
    line = refused_line(command, capsys)
    for part in names:
        assert part in line, line
    assert _snapshot(isolated) == before


def test_dora_and_modules_to_save_are_refused(env, tmp_path) -> None:
    shutil.copytree(env / "a0", tmp_path / "a0")
    config = json.loads((tmp_path / "a0" / "adapter_config.json").read_text())
    (tmp_path / "a0" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(InputError, match="use_dora"):
        read_adapter(tmp_path / "a0")
    (tmp_path / "a0" / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(InputError, match="modules_to_save"):
        read_adapter(tmp_path / "a0")


def test_fan_in_fan_out_layers_of_gpt2_fold_transposed_as_peft_folds_them(tmp_path) -> None:
    # GPT-2's Conv1D stores its weight as in x out: PEFT's adapters there say fan_in_fan_out and their update is (B A)^T
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    for seed, rank in enumerate((2, 3)):
        torch.manual_seed(300 + seed)
        model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
        lora = peft.LoraConfig(r=rank, lora_alpha=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, init_lora_weights=False)
        peft.get_peft_model(model, lora).save_pretrained(tmp_path / f"g{seed}")
    models = [{"model": str(tmp_path / "g0")}, {"model": str(tmp_path / "g1")}]
    common = {"merge_method": "lora", "base_model": str(tmp_path / "gpt2"), "models": models, "parameters": {"combine": "stack"}}
    adapter = rayfuse.fuse({**common, "output": str(tmp_path / "adapter")})
    merged = rayfuse.fuse({**common, "output_kind": "merged", "output": str(tmp_path / "merged")})
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    reference = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"), adapter).merge_and_unload()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    np.testing.assert_allclose(logits(loaded, IDS), logits(reference.eval(), IDS), atol=1e-5, rtol=0)
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
    assert np.abs(logits(loaded, IDS) - logits(base, IDS)).max() > 1e-3
    # and against PEFT's own deltas of the two inputs (get_delta_weight transposes for fan_in_fan_out), averaged
    with torch.no_grad():
        for seed in range(2):
            adapted = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"), tmp_path / f"g{seed}")
            for name, module in adapted.base_model.model.named_modules():
                if isinstance(module, peft.tuners.lora.LoraLayer):
                    base.get_submodule(name).weight += 0.5 * module.get_delta_weight("default")
    np.testing.assert_allclose(logits(loaded, IDS), logits(base, IDS), atol=1e-5, rtol=0)
