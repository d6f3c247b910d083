"""``rayfuse split`` (rayfuse.data.split): a simulation's client shards written as silo files plus a silo config.

The written files are read back the way a silo run reads them (rayfuse.data.silos.load_silo / load_server_set) and
compared, bit for bit, with the arrays the simulation's clients and server hold.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
import yaml

from rayfuse.cli import main
from rayfuse.config import validate_config
from rayfuse.data.roles import client_splits, load_dataset_from_config, make_plan, server_splits
from rayfuse.data.silos import load_server_set, load_silo
from rayfuse.data.split import split_simulation
from rayfuse.errors import InputError
from rayfuse.io import load_params
from rayfuse.models import params_equal

SIMULATION = {
    "run": {"name": "sim", "seed": 5},
    "data": {"dataset": "iris", "public_size": 12, "val_size": 0.2},  # iris is standardised by default
    "partition": {"method": "dirichlet", "num_clients": 3, "alpha": 5.0, "corrupt": {1: "noise", 2: "shuffle_labels"}},
    "model": {"name": "mlp", "hidden": [8]},
    "train": {"epochs": 2, "shared_init": True},
    "federation": {"backend": "local", "client_overrides": {0: {"resources": {"site_a": 1}}}},
    "methods": {"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}},
}


def _write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def test_split_writes_each_clients_arrays_exactly_as_the_simulation_holds_them(tmp_path, monkeypatch):
    cfg = validate_config(SIMULATION)
    written = split_simulation(cfg, tmp_path / "out")
    assert written == (tmp_path / "out" / "silos.yaml").resolve()
    silo_cfg = validate_config(yaml.safe_load(written.read_text()))
    assert silo_cfg.data.is_silos and silo_cfg.partition.num_clients == 3 and silo_cfg.data.standardize is False
    assert silo_cfg.evaluation == "central" and silo_cfg.run.seed == 5 and silo_cfg.train.shared_init
    assert silo_cfg.federation.client_overrides[0].resources == {"site_a": 1}
    assert not silo_cfg.partition.corrupt  # the files hold the corrupted data already

    dataset = load_dataset_from_config(cfg.data)
    plan = make_plan(dataset, cfg.data, cfg.partition, cfg.run.seed)
    monkeypatch.chdir(tmp_path.parent)  # the written paths are absolute: any working directory reads them
    for i, silo in enumerate(silo_cfg.data.silos or []):
        assert Path(silo.path).is_absolute() and Path(silo.test_path).is_absolute()
        want_train, want_val = client_splits(dataset, plan.for_client(i))  # standardised, and corrupted for clients 1, 2
        train, held_out = load_silo(silo, client=i, seed=silo_cfg.run.seed)
        for got, want in ((train, want_train), (held_out, want_val)):
            assert got.X.dtype == want.X.dtype and got.X.shape == want.X.shape and np.array_equal(got.X, want.X)
            assert got.y.dtype == want.y.dtype and np.array_equal(got.y, want.y)
        assert train.num_classes == plan.num_classes
    test, public = server_splits(dataset, plan)
    assert silo_cfg.data.test is not None and silo_cfg.data.public is not None
    for source, key, want in ((silo_cfg.data.test, "data.test", test), (silo_cfg.data.public, "data.public", public)):
        got = load_server_set(source, key=key)
        assert len(want) and np.array_equal(got.X, want.X) and np.array_equal(got.y, want.y)
    with np.load(tmp_path / "out" / "client-1" / "train.npz") as archive:
        assert sorted(archive.files) == ["X", "y"]


def test_split_from_the_command_line(tmp_path, capsys):
    config = _write(tmp_path / "sim.yaml", {**SIMULATION, "data": {"dataset": "iris"}})
    assert main(["split", str(config), "--out", str(tmp_path / "silos")]) == 0
    out = capsys.readouterr().out
    assert f"rayfuse run {(tmp_path / 'silos' / 'silos.yaml').resolve()}" in out
    assert not (tmp_path / "silos" / "server" / "public.npz").exists()  # no public sample in this simulation
    assert "public" not in yaml.safe_load((tmp_path / "silos" / "silos.yaml").read_text())["data"]


def _one_line_exit_2(capsys, argv: list[str], pattern: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert re.search(pattern, err), err


def test_split_refuses_a_silo_config(tmp_path, capsys):
    silos = _write(tmp_path / "silos.yaml", {"data": {"silos": [{"dataset": "iris"}, {"dataset": "iris"}]}})
    _one_line_exit_2(
        capsys,
        ["split", str(silos), "--out", str(tmp_path / "out")],
        r"^rayfuse: error: data\.silos: expected a simulation config \(data\.dataset \+ partition\)",
    )
    assert not (tmp_path / "out").exists()


def test_split_refuses_an_out_folder_in_use_or_unwritable(tmp_path, capsys):
    config = _write(tmp_path / "sim.yaml", {**SIMULATION, "data": {"dataset": "iris"}})
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    _one_line_exit_2(
        capsys, ["split", str(config), "--out", str(tmp_path / "used")], r"^rayfuse: error: --out: expected a new or empty folder"
    )
    assert os.listdir(tmp_path / "used") == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    _one_line_exit_2(
        capsys, ["split", str(config), "--out", str(tmp_path / "file")], r"^rayfuse: error: --out: expected a new or empty folder"
    )
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            _one_line_exit_2(
                capsys,
                ["split", str(config), "--out", str(locked / "out")],
                r"^rayfuse: error: --out: expected a folder rayfuse can create or write to",
            )
        finally:
            locked.chmod(stat.S_IRWXU)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            {"data": {"dataset": "iris", "val_size": 0}},
            r"^rayfuse: error: data\.val_size: expected a validation split of at least one sample on every client",
        ),
        ({"methods": {"global": {"epochs": 1}}}, r"^rayfuse: error: methods: expected at least one method a federation can run on silos"),
        (
            {"data": {"dataset": "kl_gmm"}, "partition": {"method": "iid", "num_clients": 2}},
            r"^rayfuse: error: data\.dataset: expected a dataset whose evaluation needs only its arrays",
        ),
    ],
)
def test_split_refuses_what_silo_files_cannot_reproduce_and_leaves_nothing(tmp_path, capsys, change, pattern):
    config = _write(tmp_path / "sim.yaml", {**SIMULATION, "data": {"dataset": "iris"}, **change})
    _one_line_exit_2(capsys, ["split", str(config), "--out", str(tmp_path / "out")], pattern)
    assert not (tmp_path / "out").exists()


def test_split_api_raises_input_error(tmp_path):
    with pytest.raises(InputError, match=r"^out: expected a new or empty folder"):
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "x").write_text("x")
        split_simulation(validate_config(SIMULATION), tmp_path / "out", key="out")


# ---------------------------------------------------------------------------------------------------------------
# The rehearsal: running the written silo config gives the simulation's numbers


def _run_local(config, run_dir: Path) -> dict:
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, prepare_run, run_experiment

    return run_experiment(prepare_run(config), InProcessBackend(), run_dir, printer=Printer(enabled=False), show_tables=False)


@pytest.mark.parametrize("evaluation", ["central", "both"])
def test_running_the_written_silo_config_reproduces_the_simulation(tmp_path, evaluation):
    # standardised (iris), non-IID, two corrupted clients, a public sample; one-shot, round-based and ensemble methods;
    # the oracle is left out of the silo config (no silo run pools the clients' data)
    simulation = {
        **SIMULATION,
        "evaluation": evaluation,
        "federation": {"backend": "local"},
        "methods": {
            "local": {},
            "average": {},
            "ensemble": {},
            "fedavg": {"rounds": 2, "local_epochs": 1},
            "fedprox": {"rounds": 2, "local_epochs": 1, "mu": 0.1},
            "global": {"epochs": 2},
        },
    }
    cfg = validate_config(simulation)
    written = split_simulation(cfg, tmp_path / "silos")
    assert "# Left out: the method(s) global (they read the whole dataset" in written.read_text()
    silo_cfg = validate_config(yaml.safe_load(written.read_text()))
    assert silo_cfg.data.is_silos and "global" not in silo_cfg.methods and silo_cfg.evaluation == evaluation

    sim = _run_local(cfg, tmp_path / "sim")
    silo = _run_local(silo_cfg, tmp_path / "silo")
    assert sim["status"] == silo["status"] == "succeeded"
    assert set(silo["methods"]) == set(sim["methods"]) - {"global"}
    numbers = ("accuracy", "nll", "ece", "federated_accuracy", "federated_nll")
    for label, entry in silo["methods"].items():
        want = sim["methods"][label]
        assert {k: entry.get(k) for k in numbers} == {k: want.get(k) for k in numbers}, label
        assert entry["accuracy"] is not None
        if evaluation == "both":
            assert entry["client_metrics"] == want["client_metrics"], label
    models = sorted(p.name for p in (tmp_path / "silo" / "models").iterdir())
    assert models and all(
        params_equal(load_params(tmp_path / "sim" / "models" / name), load_params(tmp_path / "silo" / "models" / name)) for name in models
    )  # the fused models, to the last bit


QUICKSTART_PARTITION = {"method": "dirichlet", "num_clients": 5, "alpha": 0.5}  # jobs/quickstart.yaml's


@pytest.mark.parametrize(
    "partition",
    [QUICKSTART_PARTITION, {"method": "labels", "num_clients": 5, "groups": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]}],
    ids=["dirichlet-0.5", "label-disjoint"],
)
def test_label_skewed_partitions_split_and_run_with_the_simulations_numbers(tmp_path, partition):
    # the quickstart's data and partition (digits, 5 clients): shards that lack labels are written, and data.classes
    # declares all ten, so every silo numbers its labels as the simulation does
    simulation = {
        "run": {"name": "sim", "seed": 0},
        "data": {"dataset": "digits", "test_size": 0.2, "val_size": 0.1},
        "partition": partition,
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"epochs": 1, "batch_size": 32},
        "federation": {"backend": "local"},
        "evaluation": "both",
        "methods": {"local": {}, "average": {}, "fedavg": {"rounds": 1, "local_epochs": 1}},
    }
    cfg = validate_config(simulation)
    written = split_simulation(cfg, tmp_path / "silos")
    silo_cfg = validate_config(yaml.safe_load(written.read_text()))
    assert silo_cfg.data.classes == list(range(10))
    plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)
    assert (plan.counts == 0).any()  # some client lacks some label: what a silo file could not say without data.classes

    sim = _run_local(cfg, tmp_path / "sim")
    silo = _run_local(silo_cfg, tmp_path / "silo")
    assert sim["status"] == silo["status"] == "succeeded"
    for label, entry in silo["methods"].items():
        want = sim["methods"][label]
        for key in ("accuracy", "nll", "ece", "federated_accuracy", "federated_nll", "client_metrics"):
            assert entry.get(key) == want.get(key), (label, key)
    manifest = json.loads((tmp_path / "silo" / "partition.json").read_text())
    assert manifest["labels"] == [str(c) for c in range(10)]
    assert [np.add(c["class_counts"], c["held_out_class_counts"]).tolist() for c in manifest["clients"]] == plan.counts.tolist()


def test_split_leaves_out_only_the_methods_that_read_the_whole_dataset(tmp_path):
    # transfer is an oracle (the teachers' weights leave their clients) that reads no client's data: it runs on silos
    # and stays in the silo config; global pools every client's data (needs_dataset) and is left out
    from rayfuse.method import METHODS

    assert METHODS.get("transfer").tags.oracle and not METHODS.get("transfer").tags.needs_dataset
    simulation = {**SIMULATION, "methods": {"local": {}, "transfer": {"target_epochs": 1, "adapt_epochs": 1}, "global": {"epochs": 1}}}
    written = split_simulation(validate_config(simulation), tmp_path / "silos")
    text = written.read_text()
    assert "# Left out: the method(s) global (they read the whole dataset; no silo run can)." in text
    silo_cfg = validate_config(yaml.safe_load(text))
    assert list(silo_cfg.methods) == ["local", "transfer"]
    from rayfuse.runner import prepare_run

    prepare_run(silo_cfg)  # the kept oracle passes the silo run's pre-start checks


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative-in-that-folder"])
@pytest.mark.parametrize("parent", ["${HOME}", "a${b", "${NOPE}", "a\nb"])
def test_split_refuses_an_out_folder_below_a_literal_dollar_brace(tmp_path, capsys, monkeypatch, parent, relative):
    # silos.yaml writes absolute paths, and its reader expands ${NAME} and refuses line breaks: such a folder would
    # write a config that does not run (a relative --out is written absolute: the working directory counts)
    config = _write(tmp_path / "sim.yaml", {**SIMULATION, "data": {"dataset": "iris"}})
    if relative:
        (tmp_path / parent).mkdir()
        monkeypatch.chdir(tmp_path / parent)
    out = Path("silos") if relative else tmp_path / parent / "silos"
    _one_line_exit_2(
        capsys, ["split", str(config), "--out", str(out)], r"^rayfuse: error: --out: expected a folder whose absolute path holds no"
    )
    assert not (tmp_path / parent / "silos").exists() and (relative or not (tmp_path / parent).exists())


def test_split_without_a_data_section_keeps_the_quickstarts_public_sample_only_for_a_method_that_reads_one(tmp_path, capsys):
    for methods, public in (({"fedavg": {}}, False), ({"distill": {}}, True)):
        config = _write(tmp_path / "sim.yaml", {"partition": {"num_clients": 2}, "methods": methods})
        out = tmp_path / f"silos-{public}"
        assert main(["split", str(config), "--out", str(out)]) == 0
        assert (out / "server" / "public.npz").exists() == public
