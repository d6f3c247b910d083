"""``fedlora``: what a client's reply holds, the exactness of ``ffa`` and ``stack``, a tiny digits run, bad inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rayfuse
from rayfuse.config import validate_config
from rayfuse.errors import InputError
from rayfuse.fusion.lora import combine_round, lora_targets
from rayfuse.io import save_params
from rayfuse.models import build_model, get_params
from rayfuse.runner import prepare_run
from tests.conftest import TINY, merge
from tests.helpers import recorded_run

SHAPE, CLASSES = (1, 8, 8), 10
MODEL = {"name": "mlp", "hidden": [16]}


def recorded_run_fit(cfg: dict[str, Any]) -> tuple[Any, list[tuple[tuple[Any, ...], Any]]]:
    return recorded_run(cfg, "fedlora.fit")


def config(tmp_path: Path, **params: Any) -> dict[str, Any]:
    cfg = merge(TINY, {"partition": {"num_clients": 3}, "model": MODEL})
    cfg["methods"] = {"fedlora": {"rounds": 2, "local_epochs": 1, "r": 2, **params}}
    cfg["run"] = {**cfg["run"], "storage": str(tmp_path / "runs")}
    return cfg


def base_file(tmp_path: Path, seed: int = 3) -> tuple[Path, dict[str, np.ndarray]]:
    base = get_params(build_model(validate_config(merge(TINY, {"model": MODEL})).model, SHAPE, CLASSES, seed=seed))
    return save_params(tmp_path / "base.safetensors", base), base


@pytest.mark.parametrize("combine", ["ffa", "stack"])
def test_a_clients_reply_holds_adapter_tensors_and_its_count_only(tmp_path, combine):
    result, calls = recorded_run_fit(config(tmp_path, combine=combine, rounds=1))
    assert len(calls) == 3
    base_keys = set(result.models["fedlora"])
    for _, update in calls:
        assert update.params, "an empty reply"
        assert all(k.endswith((".lora_A", ".lora_B")) for k in update.params)
        assert not base_keys & set(update.params)
        # ffa: A is frozen and shared, only B leaves the client; the others send both factors
        assert any(k.endswith(".lora_A") for k in update.params) == (combine != "ffa")
        assert all(v.ndim == 2 and 2 in v.shape for v in update.params.values())  # rank-2 factors, no sample rows
        assert isinstance(update.num_examples, int) and update.num_examples > 0
        assert set(update.metrics) <= {"train_loss", "train_seconds"}


def test_ffa_combines_to_the_exact_average_of_the_updates(tmp_path):
    path, base = base_file(tmp_path)
    result, calls = recorded_run_fit(config(tmp_path, combine="ffa", rounds=1, base=str(path), alpha=4.0))
    counts = np.array([u.num_examples for _, u in calls], dtype=float)
    w = counts / counts.sum()
    fused = result.models["fedlora"]
    (args0, first) = calls[0]
    adapter = args0[1]  # the round's global adapter: A at its seeded init, identical for every client
    for args, _ in calls:
        assert all(np.array_equal(args[1][k], adapter[k]) for k in adapter)
    scale = 4.0 / 2
    modules = [k.removesuffix(".lora_B") for k in first.params]
    model = build_model(validate_config(merge(TINY, {"model": MODEL})).model, SHAPE, CLASSES, seed=0)
    assert modules == lora_targets(model, None) and len(modules) == 1  # default: every Linear but the last
    for m in modules:
        A = adapter[f"{m}.lora_A"].astype(np.float64)
        exact = sum(wi * scale * (u.params[f"{m}.lora_B"].astype(np.float64) @ A) for wi, (_, u) in zip(w, calls))
        np.testing.assert_allclose(fused[f"{m}.weight"] - base[f"{m}.weight"], exact, atol=1e-6)
    untouched = [k for k in base if not any(k == f"{m}.weight" for m in modules)]
    assert untouched and all(np.array_equal(fused[k], base[k]) for k in untouched)


def factors(rng: np.random.Generator, n: int, r: int, out: int = 7, inp: int = 5) -> list[dict[str, np.ndarray]]:
    return [{"m.lora_A": rng.normal(size=(r, inp)), "m.lora_B": rng.normal(size=(out, r))} for _ in range(n)]


def test_stack_combines_to_the_exact_weighted_sum_then_refactors_to_rank_r():
    rng = np.random.default_rng(0)
    ups, w, scale, r = factors(rng, 3, 2), [0.5, 0.3, 0.2], 1.5, 2
    exact = sum(wi * scale * u["m.lora_B"] @ u["m.lora_A"] for wi, u in zip(w, ups))
    delta, adapter, error = combine_round(ups, w, ["m"], scale, "stack", r)
    np.testing.assert_allclose(delta["m"], exact, atol=1e-10)
    assert adapter["m.lora_A"].shape == (r, 5) and adapter["m.lora_B"].shape == (7, r)
    # the next round's adapter is the best rank-r approximation of the exact sum (Eckart-Young): its error is the tail
    S = np.linalg.svd(exact, compute_uv=False)
    approx = scale * adapter["m.lora_B"] @ adapter["m.lora_A"]
    assert np.isclose(np.linalg.norm(exact - approx), np.sqrt(np.sum(S[r:] ** 2)))
    assert np.isclose(error, np.sqrt(np.sum(S[r:] ** 2)) / np.linalg.norm(exact))


def test_svd_is_the_rank_r_cut_and_average_factors_is_not_the_average_of_the_updates():
    rng = np.random.default_rng(1)
    ups, w = factors(rng, 3, 2), [1 / 3] * 3
    exact = sum(wi * u["m.lora_B"] @ u["m.lora_A"] for wi, u in zip(w, ups))
    delta, _, error = combine_round(ups, w, ["m"], 1.0, "svd", 2)
    U, S, Vt = np.linalg.svd(exact)
    np.testing.assert_allclose(delta["m"], (U[:, :2] * S[:2]) @ Vt[:2], atol=1e-10)
    avg, _, avg_error = combine_round(ups, w, ["m"], 1.0, "average_factors", 2)
    np.testing.assert_allclose(avg["m"], np.mean([u["m.lora_B"] for u in ups], 0) @ np.mean([u["m.lora_A"] for u in ups], 0))
    assert avg_error > error > 0


def test_a_tiny_digits_run_learns_and_exact_combines_beat_averaged_factors(tmp_path):
    # the base is the run's untrained shared init (chance accuracy, 0.1 on ten classes); every Linear adapted
    acc = {}
    for combine in ("ffa", "stack", "average_factors"):
        cfg = config(tmp_path / combine, combine=combine, r=4, local_epochs=5, target_modules=[".*"])
        result = rayfuse.run(cfg, backend="local")
        metrics = result.metrics.loc["fedlora"]
        assert np.isfinite(metrics[["accuracy", "nll"]].to_numpy(dtype=float)).all()
        acc[combine] = float(metrics["accuracy"])
    assert acc["ffa"] > 0.15 and acc["stack"] > 0.3
    assert acc["stack"] > acc["average_factors"]


def refusal(cfg: dict[str, Any]) -> str:
    with pytest.raises(InputError) as info:
        prepare_run(validate_config(cfg))
    line = str(info.value)
    assert "\n" not in line
    return line


def test_bad_inputs_are_one_line_before_start(tmp_path):
    line = refusal(config(tmp_path, target_modules=["net\\.9"]))
    assert line.startswith("methods.fedlora.target_modules.0: expected a pattern matching an nn.Linear")
    assert refusal(config(tmp_path, r=0)).startswith("methods.fedlora.r: ")
    line = refusal(config(tmp_path, r=17))
    assert line.startswith("methods.fedlora.r: expected at most 16")
    other = get_params(build_model(validate_config(merge(TINY, {"model": {"name": "mlp", "hidden": [8]}})).model, SHAPE, CLASSES, seed=0))
    path = save_params(tmp_path / "other.safetensors", other)
    line = refusal(config(tmp_path, base=str(path)))
    assert line.startswith("methods.fedlora.base: expected tensor ") and "shape (8, 64)" in line


@pytest.mark.parametrize("key", ["dp", "aggregator", "attacks"])
def test_stack_refuses_what_acts_on_parameter_updates(tmp_path, key):
    def with_key(combine: str) -> dict[str, Any]:
        if key == "attacks":
            return merge(config(tmp_path, combine=combine), {"federation": {"attacks": [{"client": 1, "kind": "sign_flip"}]}})
        value = {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 1.0} if key == "dp" else {"name": "median"}
        return config(tmp_path, combine=combine, **{key: value})

    assert "fuses adapter factors" in refusal(with_key("stack"))
    prepare_run(validate_config(with_key("ffa")))  # ffa's B updates are parameters: the pipeline acts on them


def test_ffa_runs_through_the_pipelines_central_dp_and_robust_rules(tmp_path):
    cfg = config(tmp_path, dp={"noise_multiplier": 0.5, "clip_norm": 1.0, "sample_rate": 1.0})
    cfg["methods"]["robust"] = {"method": "fedlora", "rounds": 2, "local_epochs": 1, "r": 2, "aggregator": {"name": "median"}}
    cfg = merge(cfg, {"federation": {"attacks": [{"client": 1, "kind": "sign_flip"}]}})
    result = rayfuse.run(cfg, backend="local")
    assert np.isfinite(result.metrics[["accuracy", "nll"]].to_numpy(dtype=float)).all()
    assert result.results["methods"]["fedlora"]["info"]["dp"]["epsilon"] > 0


def test_the_lora_methods_tags_are_their_papers():
    """FFA-LoRA averages the trainable factor exactly (parameters, through the update pipeline) over rounds of the
    round loop's cohort; stacking combines the factors themselves; FedMerge weighs the updates by the clients'
    statistics, one shot."""
    from rayfuse.method import METHODS

    fedlora, fedmerge = METHODS.get("fedlora"), METHODS.get("fedmerge")
    assert fedlora.tags.multi_round and fedlora.tags.cohort and not fedlora.tags.oracle
    assert (
        fedlora.tags_for(fedlora.Params()).fuses == "parameters"
        and fedlora.tags_for(fedlora.Params(combine="stack")).fuses == "adapter factors"
    )
    assert fedmerge.tags.fuses == "statistics" and not (fedmerge.tags.multi_round or fedmerge.tags.oracle)
