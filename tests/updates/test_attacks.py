"""Attacks to measure robust aggregation against (``federation.attacks``, ``partition.corrupt: flip_labels``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from rayfuse.config import AttackSpec
from rayfuse.data.roles import Split, corrupt_split
from rayfuse.errors import InputError
from rayfuse.method import Update
from rayfuse.seeding import make_rng
from rayfuse.updates.attacks import (
    apply_attacks,
    attack_gaussian,
    attack_little_is_enough,
    attack_scale,
    attack_sign_flip,
    compute_lie_z,
)

REF = {"w": np.array([1.0, 2.0, -1.0], dtype=np.float32), "count": np.array(3, dtype=np.int64)}
MINE = {"w": np.array([1.5, 1.0, -1.0], dtype=np.float32), "count": np.array(7, dtype=np.int64)}


def test_sign_flip_by_hand():
    out = attack_sign_flip(MINE, REF)  # w_ref - (w - w_ref) = 2 w_ref - w
    np.testing.assert_array_equal(out["w"], np.array([0.5, 3.0, -1.0], dtype=np.float32))
    assert out["w"].dtype == np.float32
    assert int(out["count"]) == 7  # integer counters stay the client's


def test_scale_by_hand():
    out = attack_scale(MINE, REF, 10.0)  # w_ref + 10 (w - w_ref)
    np.testing.assert_array_equal(out["w"], np.array([6.0, -8.0, -1.0], dtype=np.float32))
    np.testing.assert_array_equal(attack_scale(MINE, REF, -1.0)["w"], attack_sign_flip(MINE, REF)["w"])


def test_gaussian_is_the_reference_plus_seeded_noise():
    out = attack_gaussian(MINE, REF, 0.5, make_rng(0, "attack", 2, 1))
    noise = make_rng(0, "attack", 2, 1).normal(0.0, 0.5, size=3)
    np.testing.assert_array_equal(out["w"], (REF["w"].astype(np.float64) + noise).astype(np.float32))
    assert int(out["count"]) == 7


def test_little_is_enough_by_hand():
    honest = [{"w": np.array([0.0, 1.0]), "n": np.array(1)}, {"w": np.array([2.0, 1.0]), "n": np.array(2)}]
    out = attack_little_is_enough(honest, 1.5, own={"w": np.array([9.0, 9.0]), "n": np.array(5)})
    # mean [1, 1], population std [1, 0]: mean - 1.5 std
    np.testing.assert_array_equal(out["w"], [-0.5, 1.0])
    assert int(out["n"]) == 5


def test_the_papers_z_max():
    # Baruch et al. 2019: n = 50, m = 12 -> s = 14, z = Phi^-1(36 / 50) ~ 0.583; n = 10, m = 2 -> Phi^-1(0.6)
    assert compute_lie_z(50, 12) == pytest.approx(0.5828, abs=1e-4)
    assert compute_lie_z(10, 2) == pytest.approx(0.2533, abs=1e-4)
    assert compute_lie_z(10, 1) == 0.0  # (n - s) / n = 1/2
    assert compute_lie_z(3, 3) == pytest.approx(3.0902, abs=1e-4)  # capped at 0.999


def _updates(values: dict[int, list[float]]) -> dict[int, Update]:
    return {c: Update({"w": np.array(v, dtype=np.float64)}, 10) for c, v in values.items()}


def test_apply_attacks_touches_only_the_attackers_of_the_round():
    updates = _updates({0: [1.0, 1.0], 1: [3.0, 1.0], 2: [5.0, 5.0], 3: [2.0, 2.0]})
    ref = {"w": np.zeros(2)}
    attacks = [
        AttackSpec(client=2, kind="sign_flip", rounds=[1, 3]),
        AttackSpec(client=3, kind="little_is_enough", z=1.0),
        AttackSpec(client=9, kind="scale"),
    ]  # a client not in the round does nothing
    out, applied = apply_attacks(updates, ref, attacks, round=1, seed=0)
    assert [(a.client, a.kind) for a in applied] == [(2, "sign_flip"), (3, "little_is_enough")]
    np.testing.assert_array_equal(out[2].params["w"], [-5.0, -5.0])
    np.testing.assert_array_equal(out[3].params["w"], [1.0, 1.0])  # honest 0 and 1: mean [2, 1], std [1, 0]
    assert out[0] is updates[0] and out[1] is updates[1]
    assert out[2].num_examples == 10
    out2, applied2 = apply_attacks(updates, ref, attacks, round=2, seed=0)
    assert [a.client for a in applied2] == [3] and out2[2] is updates[2]


def test_gaussian_attacks_are_deterministic_in_seed_client_and_round():
    updates = _updates({0: [0.0] * 4, 1: [0.0] * 4})
    attacks = [AttackSpec(client=0, kind="gaussian", std=2.0), AttackSpec(client=1, kind="gaussian", std=2.0)]

    def draw(seed: int, rnd: int) -> tuple[np.ndarray, np.ndarray]:
        out, _ = apply_attacks(updates, {"w": np.zeros(4)}, attacks, round=rnd, seed=seed)
        return out[0].params["w"], out[1].params["w"]

    a0, a1 = draw(0, 1)
    np.testing.assert_array_equal(draw(0, 1)[0], a0)
    assert not np.array_equal(a0, a1)
    assert not np.array_equal(draw(0, 2)[0], a0)
    assert not np.array_equal(draw(1, 1)[0], a0)


def test_flip_labels_maps_y_to_c_minus_1_minus_y():
    split = Split(np.zeros((4, 2), dtype=np.float32), np.array([0, 1, 2, 9]))
    out = corrupt_split(split, "flip_labels", 0, num_classes=10)
    np.testing.assert_array_equal(out.y, [9, 8, 7, 0])
    np.testing.assert_array_equal(out.X, split.X)


@pytest.mark.parametrize(
    ("attacks", "path", "fragment"),
    [
        ([{"client": 4, "kind": "sign_flip"}], "federation.attacks.0.client", "a client id in 0..3, got 4"),
        ([{"client": 1, "kind": "flip"}], "federation.attacks.0.kind", "flip"),
        ([{"client": 1, "kind": "sign_flip", "scale": 3}], "federation.attacks.0.scale", "scale only with kind scale"),
        ([{"client": 1, "kind": "gaussian", "std": -1}], "federation.attacks.0.std", "-1"),
        ([{"client": 1, "kind": "gaussian", "rounds": [0]}], "federation.attacks.0.rounds", "rounds >= 1 (integers) or 'all', got [0]"),
        ([{"client": 1, "kind": "scale", "rounds": "some"}], "federation.attacks.0.rounds", "or 'all', got 'some'"),
        ([{"client": 1, "kind": "scale"}, {"client": 1, "kind": "sign_flip"}], "federation.attacks.1.client", "one attack per client"),
        ([{"kind": "scale"}], "federation.attacks.0.client", ""),
    ],
)
def test_bad_attacks_are_one_line_errors_naming_the_key(make_config, attacks, path, fragment):
    with pytest.raises(InputError) as err:
        make_config(federation={"attacks": attacks})
    assert err.value.path == path, str(err.value)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_flip_labels_is_a_known_corruption_and_others_are_refused(make_config):
    assert make_config(partition={"corrupt": {1: "flip_labels"}}).partition.corrupt == {1: "flip_labels"}
    with pytest.raises(InputError) as err:
        make_config(partition={"corrupt": {1: "flip"}})
    assert err.value.path.startswith("partition.corrupt"), str(err.value)


def _run(tmp_path: Path, attacks: list[dict], label: str):
    import rayfuse
    from tests.conftest import TINY, merge

    fedavg = {"method": "fedavg", "rounds": 5, "local_epochs": 1}
    methods = {"mean": fedavg, "median": {**fedavg, "aggregator": "median"}, "krum": {**fedavg, "aggregator": {"name": "krum", "f": 2}}}
    cfg = merge(
        TINY,
        {
            "run": {"name": label, "storage": str(tmp_path / "runs")},
            "partition": {"method": "iid", "num_clients": 7},
            "methods": methods,
            "federation": {"attacks": attacks},
        },
    )
    return rayfuse.run(cfg, quiet=True)


def test_sign_flip_attackers_hurt_the_mean_and_robust_rules_recover(tmp_path):
    clean = _run(tmp_path, [], "clean")
    attacks = [{"client": 0, "kind": "sign_flip"}, {"client": 1, "kind": "sign_flip"}]
    attacked = _run(tmp_path, attacks, "attacked")
    acc = {label: m["accuracy"] for label, m in attacked.results["methods"].items()}
    clean_mean = clean.results["methods"]["mean"]["accuracy"]
    assert acc["mean"] < clean_mean - 0.1
    assert acc["median"] > acc["mean"] + 0.1
    assert acc["krum"] > acc["mean"] + 0.1
    # recorded as what they are: one event per attacked update, and the attacks in results.json
    events = [e for e in attacked.results["events"] if e["kind"] == "attack"]
    assert len(events) == 3 * 5 * 2
    assert {(e["method"], e["client"], e["round"], e["attack"]) for e in events} == {
        (m, c, r, "sign_flip") for m in ("mean", "median", "krum") for c in (0, 1) for r in range(1, 6)
    }
    assert attacked.results["attacks"] == [
        {"client": 0, "kind": "sign_flip", "rounds": "all"},
        {"client": 1, "kind": "sign_flip", "rounds": "all"},
    ]
    assert "attacks" not in clean.results
    assert not [e for e in clean.results["events"] if e["kind"] == "attack"]


def test_average_is_attacked_in_round_one_relative_to_the_initial_model(tmp_path):
    import rayfuse
    from tests.conftest import TINY, merge

    cfg = merge(
        TINY,
        {
            "run": {"storage": str(tmp_path / "runs")},
            "partition": {"method": "iid", "num_clients": 4},
            "methods": {"average": {}, "once": {"method": "average", "aggregator": "median"}},
            "federation": {
                "attacks": [{"client": 2, "kind": "scale", "scale": 50.0, "rounds": [1]}, {"client": 3, "kind": "gaussian", "rounds": [2]}]
            },
        },
    )
    result = rayfuse.run(cfg, quiet=True)
    events = [(e["method"], e["client"], e["round"], e["attack"]) for e in result.results["events"] if e["kind"] == "attack"]
    assert events == [("average", 2, 1, "scale"), ("once", 2, 1, "scale")]  # no round 2 in a one-shot method
    assert result.results["methods"]["once"]["accuracy"] > result.results["methods"]["average"]["accuracy"]


def test_the_cli_refuses_a_bad_attack_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from rayfuse.cli import main

    monkeypatch.chdir(tmp_path)
    job = {
        "run": {"name": "attack", "seed": 0, "storage": str(tmp_path / "runs")},
        "data": {"dataset": "digits"},
        "partition": {"method": "iid", "num_clients": 4},
        "model": {"name": "mlp", "hidden": [8]},
        "federation": {"backend": "local", "attacks": [{"client": 5, "kind": "sign_flip"}]},
        "methods": {"fedavg": {"rounds": 1}},
    }
    Path("job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    capsys.readouterr()
    assert main(["run", "job.yaml"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["rayfuse: error: federation.attacks.0.client: expected a client id in 0..3, got 5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def _aligned_models(tmp_path: Path, attacks: list[dict], label: str) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    import rayfuse
    from rayfuse.io import load_params
    from tests.conftest import TINY, merge

    aligned = {"method": "aligned", "alignment": "weight", "merge": "average", "repair": False}
    cfg = merge(
        TINY,
        {
            "run": {"name": label, "storage": str(tmp_path / "runs")},
            "partition": {"method": "iid", "num_clients": 5},
            "methods": {"mean": aligned, "median": {**aligned, "aggregator": "median"}},
            "federation": {"attacks": attacks},
        },
    )
    result = rayfuse.run(cfg, quiet=True)
    return result.results, {m: load_params(result.run_dir / result.results["methods"][m]["model_file"]) for m in ("mean", "median")}


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k].astype(np.float64)) ** 2) for k in a if a[k].dtype.kind == "f")))


def test_a_sign_flipper_moves_the_aligned_mean_merge_and_the_median_merge_resists(tmp_path):
    clean_results, clean = _aligned_models(tmp_path, [], "clean")
    results, attacked = _aligned_models(tmp_path, [{"client": 1, "kind": "sign_flip"}], "attacked")
    moved = {m: _distance(attacked[m], clean[m]) for m in ("mean", "median")}
    assert 0 < moved["median"] < moved["mean"], moved  # the attack reached both merges; the median moved less
    acc = {m: results["methods"][m]["accuracy"] for m in ("mean", "median")}
    clean_acc = {m: clean_results["methods"][m]["accuracy"] for m in ("mean", "median")}
    assert acc["mean"] < clean_acc["mean"] - 0.05, (acc, clean_acc)  # one sign flipper of 5 costs the mean
    assert acc["median"] > clean_acc["median"] - 0.02, (acc, clean_acc)  # and not the median
    events = [(e["method"], e["client"], e["round"], e["attack"]) for e in results["events"] if e["kind"] == "attack"]
    assert events == [("mean", 1, 1, "sign_flip"), ("median", 1, 1, "sign_flip")]
    assert not [e for e in clean_results["events"] if e["kind"] == "attack"]


def test_aligned_rounds_are_attacked_relative_to_the_broadcast_model_and_other_merges_are_not(tmp_path):
    import rayfuse
    from tests.conftest import TINY, merge

    aligned = {"method": "aligned", "alignment": "weight", "repair": False}
    cfg = merge(
        TINY,
        {
            "run": {"storage": str(tmp_path / "runs")},
            "partition": {"method": "iid", "num_clients": 4},
            "methods": {"fedma": {**aligned, "rounds": 2}},
            "federation": {"attacks": [{"client": 3, "kind": "scale", "scale": 5.0}]},
        },
    )
    result = rayfuse.run(cfg, quiet=True)
    events = [(e["method"], e["client"], e["round"]) for e in result.results["events"] if e["kind"] == "attack"]
    assert events == [("fedma", 3, 1), ("fedma", 3, 2)]
    # a merge by the clients' statistics (regmean) is never attacked: the update pipeline refuses it before start
    with pytest.raises(
        InputError, match=r"^federation\.attacks: expected no attacks with method 'aligned' \(methods\.regmean fuses statistics"
    ):
        rayfuse.run(merge(cfg, {"methods": {"regmean": {**aligned, "merge": "regmean"}}}), quiet=True)
