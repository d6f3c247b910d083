"""Differential privacy on the client (issue 21): local DP-SGD (``train.dp``) and the one-shot DP upload
(``methods.average.dp``): epsilons equal Opacus' accountants', the upload is clipped and noised at the right scale."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rayfuse.cli import main
from rayfuse.config import ModelConfig
from rayfuse.models import build_model, get_params
from rayfuse.models.privacy import clip_and_noise, find_dp_unsupported, train_model_dp
from rayfuse.updates.accountant import compute_epsilon


def _digits(n: int = 240) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data[:n] / 16).astype(np.float32).reshape(n, 1, 8, 8), d.target[:n].astype(np.int64)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_dp_sgd_reports_the_accountants_epsilon_for_its_noise_rate_and_steps(accountant: str) -> None:
    from opacus.accountants import create_accountant

    X, y = _digits()
    model = build_model(ModelConfig(name="mlp", hidden=[16]), (1, 8, 8), 10, seed=0)
    before = get_params(model)
    stats, privacy = train_model_dp(
        model, X, y, epochs=2, batch_size=24, lr=1e-2, noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-4, accountant=accountant, seed=3
    )
    assert privacy["dp_sample_rate"] == pytest.approx(24 / 240) and privacy["dp_steps"] == 20 == stats.steps
    reference = create_accountant(accountant)
    for _ in range(20):
        reference.step(noise_multiplier=1.1, sample_rate=0.1)
    assert privacy["dp_epsilon"] == pytest.approx(reference.get_epsilon(delta=1e-4), rel=1e-9)
    assert any(not np.array_equal(before[k], v) for k, v in get_params(model).items())  # it trained
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # Opacus' hooks and buffers are gone


def test_dp_sgd_with_a_target_epsilon_spends_at_most_it_and_is_reproducible() -> None:
    X, y = _digits()
    runs = []
    for _ in range(2):
        model = build_model(ModelConfig(name="mlp", hidden=[16]), (1, 8, 8), 10, seed=0)
        _, privacy = train_model_dp(model, X, y, epochs=2, batch_size=24, lr=1e-2, target_epsilon=2.0, delta=1e-4, seed=5)
        runs.append((get_params(model), privacy))
    assert 1.8 < runs[0][1]["dp_epsilon"] <= 2.0 + 0.02
    assert all(np.array_equal(a, runs[1][0][k]) for k, a in runs[0][0].items())


def test_opacus_refuses_batchnorm_and_names_the_module() -> None:
    assert find_dp_unsupported(build_model(ModelConfig(name="mlp"), (1, 8, 8), 10, seed=0)) is None
    assert find_dp_unsupported(build_model(ModelConfig(name="rescnn"), (1, 8, 8), 10, seed=0)) == ("stem.bn", "BatchNorm2d")


def test_the_upload_is_clipped_to_c_before_noise_and_the_noise_has_scale_z_c() -> None:
    rng = np.random.default_rng(0)
    params = {
        "w": rng.normal(size=(200, 50)).astype(np.float32),
        "b": rng.normal(size=50).astype(np.float32),
        "count": np.array(7, dtype=np.int64),
    }
    reference = {k: (v * 0.5 if v.dtype.kind == "f" else v) for k, v in params.items()}
    clipped, norm = clip_and_noise(params, reference, clip_norm=2.0, noise_multiplier=0.0, rng=np.random.default_rng(1))
    diff = np.sqrt(sum(float(np.sum((clipped[k].astype(np.float64) - reference[k]) ** 2)) for k in ("w", "b")))
    assert norm > 2.0 and diff == pytest.approx(2.0, rel=1e-5)
    assert clipped["count"] == 7
    small, _ = clip_and_noise(params, params, clip_norm=2.0, noise_multiplier=0.0, rng=np.random.default_rng(1))
    assert all(np.array_equal(small[k], params[k]) for k in params)  # a difference under C is not scaled
    noised, _ = clip_and_noise(params, reference, clip_norm=2.0, noise_multiplier=0.75, rng=np.random.default_rng(2))
    noise = np.concatenate([(noised[k].astype(np.float64) - clipped[k]).ravel() for k in ("w", "b")])
    # 10,050 draws of N(0, 1.5^2): the sample standard deviation is within 3 % (about 4 standard errors), the mean near 0
    assert noise.std() == pytest.approx(1.5, rel=0.03) and abs(noise.mean()) < 4 * 1.5 / np.sqrt(noise.size)


def test_one_release_epsilon_is_the_accountants_for_rate_one_and_one_step() -> None:
    from opacus.accountants import PRVAccountant, RDPAccountant

    for acc, name in ((RDPAccountant(), "rdp"), (PRVAccountant(), "prv")):
        acc.step(noise_multiplier=3.0, sample_rate=1.0)
        assert compute_epsilon(3.0, 1.0, 1, 1e-5, name) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)


def test_a_run_reports_each_clients_epsilon_in_results(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "--set",
                "federation.backend=local",
                "--set",
                "partition.num_clients=3",
                "--set",
                "train.epochs=1",
                "--set",
                "model.hidden=[16]",
                "--set",
                "train.dp={noise_multiplier: 1.0, delta: 1.0e-4}",
                "--set",
                "methods={local: {}, average: {dp: {clip_norm: 10.0, noise_multiplier: 0.5, delta: 1.0e-3}}}",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    local = results["methods"]["local"]
    epsilon = local["info"]["local_dp"]["epsilon"]
    assert sorted(epsilon) == ["0", "1", "2"] and local["dp_sgd_epsilon"] == max(epsilon.values()) > 0
    average = results["methods"]["average"]
    assert average["upload_epsilon"] == pytest.approx(compute_epsilon(0.5, 1.0, 1, 1e-3))
    assert set(average["info"]["upload_dp"]["epsilon"]) == {"0", "1", "2"}
    assert "DP-SGD epsilon" in printed and "upload epsilon" in printed
    assert "dp" not in results["config"]["methods"]["local"]


def test_a_run_without_dp_keeps_its_local_models_keys() -> None:
    # the dump lists train.dp: null; the local model's key is a projection (rayfuse.store.local_model_inputs), the same
    # with dp null or absent (as a run folder of an earlier version wrote it)
    from rayfuse.config import build_config
    from rayfuse.store import local_model_inputs

    train = build_config({}).model_dump(mode="json")["train"]
    assert train["dp"] is None
    plan = type("Plan", (), {"client_id": 0, "train": [0, 1], "normalization": None, "corruption": None, "corruption_seed": 0})()
    config = {"data": {"dataset": "digits"}, "model": {}, "run": {"seed": 0}, "federation": {"faults": []}}
    earlier = {k: v for k, v in train.items() if k != "dp"}
    assert local_model_inputs({**config, "train": train}, plan) == local_model_inputs({**config, "train": earlier}, plan)
    assert build_config({}, ["train.dp={noise_multiplier: 1.0}"]).model_dump(mode="json")["train"]["dp"]["noise_multiplier"] == 1.0


def test_aligned_weight_matching_merges_the_clients_noised_uploads_and_keeps_batchnorm_finite(tmp_path) -> None:
    out = tmp_path / "run"
    dp = "{clip_norm: 5.0, noise_multiplier: 0.5, delta: 1.0e-3}"
    assert (
        main(
            [
                "run",
                "--set",
                "federation.backend=local",
                "--set",
                "partition.num_clients=3",
                "--set",
                "train.epochs=1",
                "--set",
                "model.name=cnn",
                "--set",
                "model.channels=[4, 8]",
                "--set",
                "train.shared_init=true",
                "--set",
                f"methods={{aligned: {{alignment: weight, repair: false, dp: {dp}}}}}",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    entry = json.loads((out / "results.json").read_text())["methods"]["aligned"]
    assert entry["upload_epsilon"] == pytest.approx(compute_epsilon(0.5, 1.0, 1, 1e-3))
    assert set(entry["info"]["upload_dp"]["epsilon"]) == {"0", "1", "2"} and entry["info"]["upload_dp"]["relative_to"] == "shared init"
    assert np.isfinite(entry["accuracy"])  # noised running variances are clamped above zero, so evaluation stays finite


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("", "methods.aligned.alignment"),
        ("alignment: weight", "methods.aligned.repair"),
        ("alignment: weight, repair: false, merge: fisher", "methods.aligned.merge"),
        ("alignment: weight, repair: false, rounds: 2", "methods.aligned.rounds"),
    ],
)
def test_aligned_dp_refuses_settings_that_read_more_than_the_weights(tmp_path, capsys, extra: str, key: str) -> None:
    params = ", ".join(p for p in (extra, "dp: {clip_norm: 5.0, noise_multiplier: 0.5, delta: 1.0e-3}") if p)
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "--set",
                "federation.backend=local",
                "--set",
                "partition.num_clients=3",
                "--set",
                f"methods={{aligned: {{{params}}}}}",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rayfuse: error: {key}: expected") and not out.exists()
