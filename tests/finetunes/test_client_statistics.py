"""``fedmerge``: statistics computed in the clients for fine-tunes; what a reply holds, the merges against their
formulas, the exported files that ``rayfuse fuse`` merges to the same model, one-line refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import rayfuse
from rayfuse.alignment import diagonal_fisher, input_grams
from rayfuse.config import validate_config
from rayfuse.errors import InputError
from rayfuse.finetunes.statistics import compute_statistics, merge_task_vectors, write_statistics
from rayfuse.fusion.lora.fedmerge import payload_keys
from rayfuse.io import load_params
from rayfuse.models import build_model, get_params
from rayfuse.runner import prepare_run
from tests.conftest import TINY, merge
from tests.helpers import recorded_run

SHAPE, CLASSES = (64,), 10
MODEL = {"name": "mlp", "hidden": [16]}


def recorded_run_fit(cfg: dict[str, Any]) -> tuple[Any, list[tuple[tuple[Any, ...], Any]]]:
    return recorded_run(cfg, "fedmerge.fit")


def config(tmp_path: Path, **params: Any) -> dict[str, Any]:
    cfg = merge(TINY, {"partition": {"num_clients": 3}, "model": MODEL})
    cfg["methods"] = {"fedmerge": {"local_epochs": 2, **params}}
    cfg["run"] = {**cfg["run"], "storage": str(tmp_path / "runs")}
    return cfg


def base_of(result: Any) -> dict[str, np.ndarray]:
    """The run's shared init (the base every client fine-tuned)."""
    from rayfuse.seeding import derive_seed

    cfg = validate_config(merge(TINY, {"model": MODEL}))
    return get_params(build_model(cfg.model, SHAPE, CLASSES, seed=derive_seed(0, "init")))


@pytest.mark.parametrize(("finetune", "merge_"), [("full", "fisher"), ("lora", "regmean"), ("full", "average")])
def test_a_reply_holds_the_update_its_statistics_and_its_count_only(tmp_path, finetune, merge_):
    result, calls = recorded_run_fit(config(tmp_path, finetune=finetune, merge=merge_, target_modules=[".*"], r=2))
    assert len(calls) == 3
    base = base_of(result)
    expected = payload_keys(base, ["layers.0", "layers.1"] if "layers.0.weight" in base else [], finetune, merge_, 2)
    assert expected  # the test's own reading of the model's names is right
    for _, update in calls:
        assert set(update.params) == set(expected)
        for key, value in update.params.items():
            # every tensor is shaped by the model (a parameter, a factor, a fan-in square), none by the samples
            assert value.shape == expected[key].shape, key
            assert np.isfinite(value).all()
        assert any(k.startswith(("delta/", "lora_A/")) for k in update.params)
        assert any(k.startswith("fisher/") for k in update.params) == (merge_ == "fisher")
        assert any(k.startswith("gram/") for k in update.params) == (merge_ == "regmean")
        assert isinstance(update.num_examples, int) and update.num_examples > 0
        assert set(update.metrics) <= {"train_loss", "train_seconds"}
    assert np.isfinite(float(result.metrics.loc["fedmerge"]["accuracy"]))


def test_fisher_merge_of_full_fine_tunes_follows_its_formula(tmp_path):
    result, calls = recorded_run_fit(config(tmp_path, merge="fisher", target_modules=["layers\\.0"]))
    base, fused = base_of(result), result.models["fedmerge"]
    counts = np.array([u.num_examples for _, u in calls], dtype=float)
    w = counts / counts.sum()
    for key in ("layers.0.weight", "layers.0.bias"):
        d = [u.params[f"delta/{key}"].astype(np.float64) for _, u in calls]
        f = [u.params[f"fisher/{key}"] for _, u in calls]
        assert all((fi >= 0).all() and fi.any() for fi in f)
        want = sum(wi * (fi + 1e-8) * di for wi, fi, di in zip(w, f, d)) / sum(wi * (fi + 1e-8) for wi, fi in zip(w, f))
        np.testing.assert_allclose(fused[key].astype(np.float64) - base[key], want, atol=1e-6)
    assert all(np.array_equal(fused[k], base[k]) for k in base if not k.startswith("layers.0."))  # untouched: the base


def test_regmean_merge_of_adapters_is_on_the_products(tmp_path):
    result, calls = recorded_run_fit(
        config(tmp_path, merge="regmean", finetune="lora", r=2, alpha=4.0, regmean_alpha=1.0, target_modules=["layers\\.0"])
    )
    base, fused = base_of(result), result.models["fedmerge"]
    counts = np.array([u.num_examples for _, u in calls], dtype=float)
    s = counts / counts.sum() * len(counts)
    updates = [2.0 * u.params["lora_B/layers.0"].astype(np.float64) @ u.params["lora_A/layers.0"].astype(np.float64) for _, u in calls]
    grams = [u.params["gram/layers.0.weight"] for _, u in calls]
    # digits has pixels that are zero everywhere: the summed Gram is singular there, and RegMean's solve is then the
    # least-squares one (the pseudo-inverse's)
    want = sum(si * di @ g for si, di, g in zip(s, updates, grams)) @ np.linalg.pinv(sum(si * g for si, g in zip(s, grams)))
    np.testing.assert_allclose(fused["layers.0.weight"].astype(np.float64) - base["layers.0.weight"], want, atol=1e-5)
    assert np.array_equal(fused["layers.0.bias"], base["layers.0.bias"])  # an adapter changes the weight only


def test_client_statistics_are_the_full_model_paths_functions(tmp_path):
    model = build_model(validate_config(merge(TINY, {"model": MODEL})).model, SHAPE, CLASSES, seed=1)
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, 64)).astype(np.float32), rng.integers(0, 10, size=40)
    fisher = compute_statistics(model, X, y, "fisher", ["layers.0.weight", "layers.0.bias"], batch_size=16)
    full = diagonal_fisher(model, X, y, batch_size=16)
    assert set(fisher) == {"layers.0.weight", "layers.0.bias"}
    assert all(np.array_equal(fisher[k], full[k]) for k in fisher)
    grams = compute_statistics(model, X, y, "gram", ["layers.0.weight", "layers.0.bias"])
    assert set(grams) == {"layers.0.weight"}
    np.testing.assert_allclose(grams["layers.0.weight"], input_grams(model, X)[0]["layers.0.weight"])
    np.testing.assert_allclose(grams["layers.0.weight"], X.astype(np.float64).T @ X.astype(np.float64), rtol=1e-5)
    path = write_statistics(tmp_path / "s.safetensors", grams, "gram", len(X))
    assert np.array_equal(load_params(path)["layers.0.weight"], grams["layers.0.weight"])
    with pytest.raises(InputError):
        write_statistics(tmp_path / "s.npz", grams, "gram", len(X))


def test_a_text_models_client_grams_leave_the_padding_out(tmp_path):
    """fedmerge's clients on a Hugging Face classifier: the Grams at each text's tokens, as ``rayfuse fuse`` computes
    them from text (the same texts padded to 7 or to 12 give the same Grams; the embedding tables are no target)."""
    from rayfuse.alignment import masked_grams
    from rayfuse.data.text import encode_texts, text_tokenizer
    from rayfuse.models.hf import hf_model
    from tests.data.test_text_silos import tiny_text_bert

    texts = ["the match ended", "a goal", "python code with a bug", "hello"]
    folder = tiny_text_bert(tmp_path / "bert", texts=texts)
    tokenizer = text_tokenizer(folder)
    short, padded = (encode_texts(tokenizer, texts, n) for n in (7, 12))  # the longest text: 7 tokens
    model = hf_model(folder)((12,), 2)
    keys = [k for k, v in model.state_dict().items() if k.endswith(".weight") and v.dim() == 2]
    a = compute_statistics(model, short, None, "gram", keys, batch_size=3)
    b = compute_statistics(model, padded, None, "gram", keys, batch_size=3)
    assert set(a) == set(b) and "bert.encoder.layer.0.attention.self.query.weight" in a
    assert not any("embeddings" in k for k in a)  # row counts are no Linear Gram: not a fedmerge payload
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-8)
        np.testing.assert_array_equal(b[k], masked_grams(model, padded, batch_size=3)[k])


def test_the_task_vector_merge_is_the_model_merge():
    # merging task vectors then adding the base equals merging the fine-tuned models (both merges)
    from rayfuse.alignment import merge_fisher, merge_regmean

    rng = np.random.default_rng(2)
    base = {"w": rng.normal(size=(3, 4))}
    deltas = [{"w": rng.normal(size=(3, 4))} for _ in range(3)]
    fishers = [{"w": rng.random((3, 4))} for _ in range(3)]
    grams = [{"w": (lambda a: a.T @ a)(rng.normal(size=(6, 4)))} for _ in range(3)]
    w = [0.5, 0.3, 0.2]
    models = [{"w": base["w"] + d["w"]} for d in deltas]
    np.testing.assert_allclose(base["w"] + merge_task_vectors(deltas, fishers, w, "fisher")["w"], merge_fisher(models, fishers, w)["w"])
    np.testing.assert_allclose(
        base["w"] + merge_task_vectors(deltas, grams, w, "regmean", regmean_alpha=0.7)["w"], merge_regmean(models, grams, w, alpha=0.7)["w"]
    )
    np.testing.assert_allclose(merge_task_vectors(deltas, None, w, "average")["w"], sum(wi * d["w"] for wi, d in zip(w, deltas)))


@pytest.mark.parametrize(("finetune", "merge_"), [("full", "fisher"), ("lora", "regmean")])
def test_exported_files_merged_by_rayfuse_fuse_give_the_federated_model(tmp_path, finetune, merge_):
    export = tmp_path / "export"
    result, calls = recorded_run_fit(config(tmp_path, merge=merge_, finetune=finetune, r=2, target_modules=[".*"], export=str(export)))
    fused = result.models["fedmerge"]
    clients = sorted(int(p.name.split("-")[1].split(".")[0]) for p in export.glob(f"client-*.{merge_}.safetensors"))
    assert len(clients) == 3
    counts = {c: u.num_examples for c, (_, u) in zip(clients, calls)}
    spec = {
        "merge_method": merge_,
        "base_model": str(export / "base.safetensors"),
        "models": [
            {
                "model": str(export / f"client-{c}.safetensors"),
                "statistics": str(export / f"client-{c}.{merge_}.safetensors"),
                "parameters": {"weight": counts[c]},
            }
            for c in clients
        ],
        "output": str(tmp_path / "offline.safetensors"),
    }
    if merge_ == "regmean":
        spec["parameters"] = {"alpha": 0.9}
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(spec))
    offline = load_params(rayfuse.fuse(tmp_path / "merge.yaml"))
    assert set(offline) == set(fused)
    for key in fused:
        np.testing.assert_allclose(offline[key], fused[key], atol=2e-6, err_msg=key)
    stats = load_params(export / f"client-{clients[0]}.{merge_}.safetensors")
    assert all(v.dtype == np.float64 for v in stats.values())


def refusal(cfg: dict[str, Any]) -> str:
    with pytest.raises(InputError) as info:
        prepare_run(validate_config(cfg))
    line = str(info.value)
    assert "\n" not in line
    return line


def test_bad_inputs_are_one_line_before_start(tmp_path):
    line = refusal(config(tmp_path, target_modules=["layers\\.9"]))
    assert line.startswith("methods.fedmerge.target_modules.0: expected a pattern matching an nn.Linear")
    assert refusal(config(tmp_path, finetune="lora", r=17, target_modules=[".*"])).startswith("methods.fedmerge.r: expected at most")
    line = refusal(config(tmp_path, base=str(tmp_path / "nowhere")))
    assert line.startswith("methods.fedmerge.base: ") and "no such file" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refusal(config(tmp_path, base=str(empty)))
    assert line.startswith("methods.fedmerge.base: ") and "no config.json" in line
    line = refusal(merge(config(tmp_path, merge="fisher"), {"federation": {"attacks": [{"client": 0, "kind": "sign_flip"}]}}))
    assert "statistics" in line


@pytest.mark.ray
def test_fedmerge_on_ray_equals_the_in_process_run(ray_session, make_config, tmp_path):
    """The statistics computed by client actors on a real local Ray, the exports written by them: the same model."""
    from actors.backend import RayBackend
    from rayfuse.models import params_equal
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    def methods(where: str) -> dict[str, Any]:
        common = {"method": "fedmerge", "local_epochs": 1, "target_modules": [".*"], "r": 2}
        return {"fisher": {**common, "merge": "fisher"}, "regmean": {**common, "merge": "regmean", "finetune": "lora", "export": where}}

    quiet = Printer(enabled=False)
    on_ray = run_experiment(
        make_config(methods=methods(str(tmp_path / "ray-export")), federation={"backend": "ray"}),
        RayBackend(),
        tmp_path / "ray",
        printer=quiet,
        show_tables=False,
    )
    local = run_experiment(
        make_config(methods=methods(str(tmp_path / "local-export"))),
        InProcessBackend(),
        tmp_path / "local",
        printer=quiet,
        show_tables=False,
    )
    assert on_ray["status"] == "succeeded" and on_ray["run"]["backend"] == "ray"
    for label in ("fisher", "regmean"):
        assert on_ray["methods"][label]["accuracy"] == local["methods"][label]["accuracy"], label
        assert params_equal(
            load_params(tmp_path / "ray" / "models" / f"{label}.safetensors"),
            load_params(tmp_path / "local" / "models" / f"{label}.safetensors"),
        ), label
    written = sorted(p.name for p in (tmp_path / "ray-export").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "local-export").iterdir()) and "base.safetensors" in written
    assert len([n for n in written if n.endswith(".regmean.safetensors")]) == 4


@pytest.mark.parametrize(("finetune", "merge_"), [("full", "fisher"), ("lora", "regmean")])
def test_fedmerge_on_a_hugging_face_folder(tmp_path, finetune, merge_):
    """A tiny BERT saved with save_pretrained as the base: the clients' Fisher (per-sample gradients through the
    transformer) and Grams (the attention projections' inputs, every position a row) come back model-shaped."""
    import transformers

    from rayfuse.fusion.lora import hf_model
    from tests.fusion.lora.test_hf_base import TARGETS, sequences, tiny_bert

    folder = tiny_bert(tmp_path / "base")
    base = {
        k: v.numpy()
        for k, v in transformers.BertForSequenceClassification.from_pretrained(folder, local_files_only=True).state_dict().items()
    }
    cfg = merge(TINY, {"partition": {"num_clients": 3, "method": "iid"}, "train": {"lr": 0.01, "batch_size": 32}})
    cfg.pop("data")
    cfg["run"] = {**cfg["run"], "storage": str(tmp_path / "runs")}
    cfg["methods"] = {
        "fedmerge": {
            "merge": merge_,
            "finetune": finetune,
            "local_epochs": 1,
            "r": 2,
            "base": str(folder),
            "target_modules": TARGETS,
            "samples": 48,
        }
    }
    result, calls = recorded_run(cfg, "fedmerge.fit", model=hf_model(folder), dataset=sequences())
    replies = [reply for _, reply in calls]
    targets = [f"bert.encoder.layer.{i}.attention.self.{m}" for i in range(2) for m in ("query", "value")] + ["classifier"]
    expected = payload_keys(base, targets, finetune, merge_, 2)
    assert len(replies) == 3
    for update in replies:
        assert {k: v.shape for k, v in update.params.items()} == {k: v.shape for k, v in expected.items()}
        assert all(np.isfinite(v).all() for v in update.params.values())
    fused = result.models["fedmerge"]
    changed = {k for k in fused if not np.array_equal(fused[k], base[k])}
    assert changed and changed <= {k for t in targets for k in (f"{t}.weight", f"{t}.bias")}
    assert np.isfinite(float(result.metrics.loc["fedmerge"]["nll"]))
