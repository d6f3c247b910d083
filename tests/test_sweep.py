"""Sweep spaces (``rayfuse tune``): every shipped space validates; bad spaces fail with one line before Ray starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayfuse.cli import main
from rayfuse.errors import InputError
from rayfuse.method import resolve_methods
from rayfuse.sweep import grid_points, load_space

ROOT = Path(__file__).resolve().parents[1]
SPACES = sorted((ROOT / "tune_spaces").glob("*.yaml"))

TINY_JOB = {
    "run": {"name": "tiny"},
    "partition": {"num_clients": 2},
    "model": {"hidden": [8]},
    "train": {"epochs": 1},
    "methods": {"average": {}, "fedprox": {"rounds": 3, "local_epochs": 1}},
}


def write_space(tmp_path, **fields):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(TINY_JOB))
    space = {"base": "job.yaml", "space": {"methods.fedprox.mu": {"grid": [0.01, 0.1]}}, "metric": "fused/fedprox/accuracy", **fields}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    return path


def test_there_are_spaces_for_a_fusion_only_and_a_multi_round_method():
    names = {p.name for p in SPACES}
    assert {"gems_eps.yaml", "fedprox_mu.yaml"} <= names


@pytest.mark.parametrize("path", SPACES, ids=[p.name for p in SPACES])
def test_every_shipped_space_validates(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = load_space(path)
    assert spec.num_trials >= 1 and spec.metric.startswith("fused/")
    for point in grid_points(spec) or [{}]:
        sample = {k: d.probe_values()[0] for k, d in spec.space.items() if not d.is_grid}
        spec.trial_config({**sample, **point})


def test_the_space_resolves_the_base_job_and_keeps_only_the_listed_methods(tmp_path):
    spec = load_space(write_space(tmp_path, methods=["fedprox"], set={"methods.fedprox.rounds": 2}), samples=3)
    assert list(spec.base["methods"]) == ["fedprox"] and spec.base["methods"]["fedprox"]["rounds"] == 2
    assert spec.num_trials == 2 * 3
    cfg = spec.trial_config({"methods.fedprox.mu": 0.1})
    assert resolve_methods(cfg.methods)[0].params.mu == 0.1


@pytest.mark.parametrize("stem, name", [("_scratch space", "scratch-space"), ("fedsa.temp", "fedsa.temp"), ("__", "sweep")])
def test_the_default_name_is_a_valid_run_name_start(tmp_path, stem, name):
    """Trials are named ``<sweep name>-<trial id>`` (a run.name): a file stem starting with '_' or '.' must not make
    every trial fail its config validation."""
    path = write_space(tmp_path)
    path = path.rename(tmp_path / f"{stem}.yaml")
    spec = load_space(path)
    assert spec.name == name
    spec.trial_config({"methods.fedprox.mu": 0.1})  # validates
    from rayfuse.config import validate_config

    validate_config({**spec.base, "run": {**spec.base["run"], "name": f"{spec.name}-55e08_00000"}})


def test_asha_defaults_max_t_to_the_methods_rounds(tmp_path):
    spec = load_space(write_space(tmp_path, methods=["fedprox"], scheduler={"type": "asha", "grace_period": 1}))
    assert spec.scheduler.max_t == 3 and spec.scheduler.time_attr == "round"


BAD = [
    ("unknown key", {"space": {"methods.fedprox.muu": {"grid": [0.1]}}}, r"space\.methods\.fedprox\.muu: .*did you mean 'mu'"),
    ("unknown section key", {"space": {"train.epoch": {"randint": [1, 3]}}}, r"space\.train\.epoch: .*did you mean 'epochs'"),
    ("method not in the job", {"space": {"methods.gems.epsilon": {"grid": [0.1]}}}, r"space\.methods\.gems\.epsilon: expected a key"),
    ("unknown domain", {"space": {"methods.fedprox.mu": {"gird": [0.1]}}}, r"space\.methods\.fedprox\.mu: expected a Tune domain.*'grid'"),
    (
        "two domains",
        {"space": {"methods.fedprox.mu": {"grid": [0.1], "choice": [1]}}},
        r"space\.methods\.fedprox\.mu: expected one Tune domain",
    ),
    ("reversed range", {"space": {"methods.fedprox.mu": {"uniform": [1, 0.1]}}}, r"mu\.uniform: expected low < high"),
    ("log of zero", {"space": {"methods.fedprox.mu": {"loguniform": [0, 1]}}}, r"mu\.loguniform: expected low > 0"),
    ("wrong arity", {"space": {"methods.fedprox.mu": {"quniform": [0, 1]}}}, r"mu\.quniform: expected 3 numbers"),
    (
        "value the config refuses",
        {"space": {"methods.fedprox.mu": {"grid": [0.1, -1]}}},
        r"space\.methods\.fedprox\.mu: expected values the config accepts.*got -1",
    ),
    ("integer range the config refuses", {"space": {"train.epochs": {"randint": [-2, 3]}}}, r"space\.train\.epochs: .*got -2"),
    ("empty grid", {"space": {"methods.fedprox.mu": {"grid": []}}}, r"mu\.grid: expected a non-empty list"),
    ("metric of an unknown method", {"metric": "fused/avg/accuracy"}, r"metric: expected fused/<method label>/<metric>"),
    ("typo in a top-level key", {"schedular": {"type": "asha"}}, r"schedular: expected a known key.*did you mean 'scheduler'"),
    ("unknown scheduler", {"scheduler": {"type": "pbt"}}, r"scheduler\.type"),
    (
        "asha over two multi-round methods",
        {"scheduler": {"type": "asha"}, "set": {"methods.fedavg": {"rounds": 2}}},
        r"scheduler: expected ASHA over exactly one",
    ),
    ("label filter typo", {"methods": ["fedprx"]}, r"methods: expected method labels of the base job.*did you mean 'fedprox'"),
    ("bad fixed value", {"set": {"train.epochs": -1}}, r"set train\.epochs"),
    ("missing base", {"base": "nope.yaml"}, r"base: expected an existing job YAML"),
    ("remote storage", {"storage": "s3://bucket/x"}, r"storage: expected a local or shared-file-system folder"),
]


@pytest.mark.parametrize("fields, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spaces_fail_with_the_key_path(tmp_path, fields, match):
    with pytest.raises(InputError, match=match):
        load_space(write_space(tmp_path, **fields))


def test_the_cli_exits_2_before_starting_ray(tmp_path, capsys):
    path = write_space(tmp_path, space={"methods.fedprox.mu": {"gird": [0.1]}})
    assert main(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "space.methods.fedprox.mu" in err
    code = f"import sys; from rayfuse.cli import main; main(['tune', {str(path)!r}]); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"  # nothing of Ray was even imported


def test_check_validates_and_starts_nothing(tmp_path, capsys):
    assert main(["tune", str(write_space(tmp_path)), "--check", "--samples", "2"]) == 0
    assert "4 trials (2 grid points x 2 samples)" in capsys.readouterr().out


def test_domains_become_tune_objects_and_a_trial_gets_one_bundle_per_client(tmp_path):
    from ray.tune.search.sample import Categorical, Float, Integer

    from actors.backend import trial_bundles
    from actors.tune import param_space

    space = {
        "methods.fedprox.mu": {"loguniform": [0.001, 1]},
        "train.epochs": {"randint": [1, 3]},
        "train.lr": {"choice": [0.01, 0.1]},
        "methods.fedprox.rounds": {"grid": [1, 2]},
    }
    spec = load_space(write_space(tmp_path, space=space, set={"federation.clients.num_cpus": 0.5}))
    domains = param_space(spec)
    assert isinstance(domains["methods.fedprox.mu"], Float) and isinstance(domains["train.epochs"], Integer)
    assert isinstance(domains["train.lr"], Categorical) and domains["methods.fedprox.rounds"] == {"grid_search": [1, 2]}
    bundles = trial_bundles(spec.trial_config({}))
    assert bundles == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 1.0}]  # driver+coordinator, 2 clients, server tasks


def test_a_trial_reports_each_round_of_the_metrics_method_with_the_stages_so_far():
    from actors.tune import _TrialReporter

    reports = []
    reporter = _TrialReporter("fused/fedprox/accuracy", reports.append)
    reporter({"kind": "stage_end", "stage": "startup", "seconds": 1.5})
    reporter({"kind": "local_models_restored", "source": "cache"})
    reporter({"kind": "metrics", "method": "fedavg", "round": 1, "client": None, "values": {"accuracy": 0.4}})  # another method: no report
    reporter({"kind": "metrics", "method": "fedprox", "round": 1, "client": None, "values": {"train_loss": 2.0}})  # no accuracy yet
    reporter({"kind": "metrics", "method": "fedprox", "round": 2, "client": 0, "values": {"accuracy": 0.1}})  # a client's row: no report
    reporter({"kind": "progress", "method": "fedprox", "round": 2, "metrics": {"accuracy": 0.9}})  # display text: never read
    reporter({"kind": "metrics", "method": "fedprox", "round": 2, "client": None, "values": {"accuracy": 0.5, "train_loss": 1.0}})
    assert reports == [
        {
            "local/trained": 0,
            "local/cache_hit": 1,
            "time/startup": 1.5,
            "fused/fedavg/accuracy": 0.4,
            "fused/fedprox/train_loss": 1.0,
            "fused/fedprox/accuracy": 0.5,
            "round": 2,
            "stage": "fedprox",
        }
    ]
