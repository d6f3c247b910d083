"""A silo run's public sample without labels (``data.public: {..., labels: false}``): read by its inputs only (npz, or
parquet / csv with the feature columns named), labelled ``-1`` (unknown) in its Split, standardised as the clients are;
``distill`` with ``transfer: public`` runs on it, the methods that read its labels (``MethodTags.public_labels``) are
refused before anything starts, and ``labels: false`` where labels are needed is one line.

Every file is small and written to tmp_path; runs are in-process (``federation.backend: local``).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rayfuse.cli import main
from rayfuse.config import validate_config
from rayfuse.data.roles import Normalization
from rayfuse.data.silos import UNKNOWN_LABEL, load_server_inputs, server_split
from rayfuse.errors import InputError
from rayfuse.io import load_params
from rayfuse.method import METHODS, resolved_config
from rayfuse.runner import InProcessBackend, prepare_run, run_experiment

DISTILL = {"distill": {"init": "random", "steps": 60, "epochs": 2}}
# every method that reads server.data.public.y (trains or tunes on the public sample's labels)
READERS = {"finetune", "gems", "fedsa", "scratch", "transfer", "epgan"}


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = rng.normal(size=(n, 4)) * 0.5 + 3.0 * np.eye(3, 4)[y] + 10.0  # offset: standardisation matters
    return X.astype(np.float32), y.astype(np.int64)


def _job(tmp_path, methods: dict, *, features: int = 4) -> dict:
    silos = []
    for i in range(3):
        X, y = _blobs(45, seed=i)
        np.savez(tmp_path / f"site{i}.npz", X=X, y=y)
        silos.append({"dataset": "npz", "path": str(tmp_path / f"site{i}.npz")})
    X, _ = _blobs(60, seed=9)
    if features != 4:
        X = np.random.default_rng(9).normal(size=(60, features)).astype(np.float32)
    np.savez(tmp_path / "transfer.npz", X=X)  # inputs only: no label array at all
    return {
        "run": {"name": "unlabeled", "seed": 0, "storage": str(tmp_path / "runs")},
        "data": {"silos": silos, "public": {"dataset": "npz", "path": str(tmp_path / "transfer.npz"), "labels": False}},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 2, "batch_size": 16, "shared_init": True},
        "federation": {"backend": "local"},
        "evaluation": "federated",
        "methods": methods,
    }


def _refused(tmp_path, capsys, job: dict, command: str = "run") -> str:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main([command, str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


# ---------------------------------------------------------------------------------------------------------------
# Runs


def test_distill_runs_end_to_end_on_an_unlabeled_public_file(tmp_path):
    results = run_experiment(
        validate_config(_job(tmp_path, DISTILL)), InProcessBackend(), tmp_path / "runs" / "r", printer=lambda e: None, show_tables=False
    )
    assert results["status"] == "succeeded" and results["evaluation"] == "federated"
    entry = results["methods"]["distill"]
    assert 0.0 <= entry["accuracy"] <= 1.0 and np.isfinite(entry["nll"])
    assert [row["client"] for row in entry["client_metrics"]] == [0, 1, 2]
    student = load_params(tmp_path / "runs" / "r" / "models" / "distill.safetensors")
    assert student and all(np.isfinite(v).all() for v in student.values())
    roles = json.loads((tmp_path / "runs" / "r" / "partition.json").read_text())["roles"]
    assert roles["public"]["size"] == 60 and roles["public"]["labeled"] is False
    # the run's config.yaml keeps the key, so the written config reads back as an unlabeled public sample
    written = yaml.safe_load((tmp_path / "runs" / "r" / "config.yaml").read_text())
    assert written["data"]["public"]["labels"] is False and written["data"]["silos"][0]["labels"] is True


@pytest.mark.parametrize("method", sorted(READERS))
def test_a_method_reading_the_public_labels_is_refused_before_start(tmp_path, method):
    with pytest.raises(InputError) as caught:
        prepare_run(validate_config(_job(tmp_path, {**DISTILL, method: {}})))
    assert caught.value.path == "data.public.labels"
    assert str(caught.value).startswith(f"data.public.labels: expected true (a labelled public sample) for method {method!r}")


def test_the_refusal_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    err = _refused(tmp_path, capsys, _job(tmp_path, {**DISTILL, "finetune": {}}))
    assert err.startswith("rayfuse: error: data.public.labels: expected true (a labelled public sample) for method 'finetune'")
    assert not (tmp_path / "runs").exists()
    assert _refused(tmp_path, capsys, _job(tmp_path, {"gems": {"m_epsilon": 4}}), "validate").startswith(
        "rayfuse: error: data.public.labels: expected true (a labelled public sample) for method 'gems'"
    )


def test_the_methods_that_read_the_public_labels_say_so():
    flagged = {name for name, cls in METHODS.items() if cls.tags.public_labels}
    # the methods known to read them (a new reader is refused too: the method contract's unlabelled-public check)
    assert READERS <= flagged and not METHODS.get("distill").tags.public_labels


def test_an_unlabeled_file_shaped_unlike_the_silos_is_one_line_before_training(tmp_path, capsys):
    err = _refused(tmp_path, capsys, _job(tmp_path, DISTILL, features=5))
    assert err.startswith("rayfuse: error: data.public: expected inputs shaped like the silos' (4,), got (5,)"), err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------------------
# Reading: inputs only, labels unknown, standardised as the clients are


def test_server_split_of_an_unlabeled_npz_is_its_inputs_standardised_labels_unknown(tmp_path):
    X = np.arange(24, dtype=np.float32).reshape(6, 4)
    np.savez(tmp_path / "p.npz", inputs=X)
    spec = validate_config(_job(tmp_path, DISTILL)).data.public.model_copy(update={"path": str(tmp_path / "p.npz"), "features": "inputs"})
    norm = Normalization(np.full((1, 4), 2.0, dtype=np.float32), np.full((1, 4), 4.0, dtype=np.float32))
    split = server_split(spec, key="data.public", labels=("0", "1", "2"), input_shape=(4,), normalization=norm)
    assert split.X.dtype == np.float32 and split.y.dtype == np.int64
    np.testing.assert_allclose(split.X, (X - 2.0) / 4.0)
    assert UNKNOWN_LABEL == -1 and split.y.tolist() == [-1] * 6


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_table_without_labels_is_read_by_its_feature_columns_only(tmp_path, fmt):
    X = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    # a text column and a column of nulls beside the features: never read, so never refused
    table = pa.table({"a": X[:, 0], "note": ["x"] * 7, "b": X[:, 1], "c": X[:, 2], "empty": pa.nulls(7, pa.float64())})
    path = tmp_path / f"public.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        path.write_text("a;note;b;c;empty\n" + "".join(f"{r[0]!r};x;{r[1]!r};{r[2]!r};\n" for r in X.tolist()))
    spec = {
        "dataset": fmt,
        "path": str(path),
        "labels": False,
        "features": ["a", "b", "c"],
        **({"options": {"delimiter": ";"}} if fmt == "csv" else {}),
    }
    np.testing.assert_allclose(load_server_inputs(spec, key="data.public"), X, rtol=1e-6)
    with pytest.raises(InputError, match=r"^data\.public\.features: expected columns of public\.\w+ \(a, note, b, c, empty\), got 'd'$"):
        load_server_inputs({**spec, "features": ["a", "d"]}, key="data.public")


def test_bad_unlabeled_files_are_one_line_at_data_public(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVER_DATA", str(tmp_path))
    with pytest.raises(
        InputError,
        match=r"^data\.public\.path: expected an existing npz file on the server's node, "
        r"got '\$\{SERVER_DATA\}/gone\.npz'",
    ):
        load_server_inputs({"dataset": "npz", "path": "${SERVER_DATA}/gone.npz", "labels": False}, key="data.public")
    np.savez(tmp_path / "other.npz", Z=np.zeros((3, 4)))
    with pytest.raises(InputError, match=r"^data\.public\.features: expected an array name in other\.npz \(Z\), got 'X'"):
        load_server_inputs({"dataset": "npz", "path": "${SERVER_DATA}/other.npz", "labels": False}, key="data.public")


# ---------------------------------------------------------------------------------------------------------------
# Where labels: false does not go


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            lambda d: d.update(test={"dataset": "npz", "path": "/s/test.npz", "labels": False}),
            r"^data\.test\.labels: expected true for data\.test \(the server's test set scores the models on its labels",
        ),
        (
            lambda d: d["silos"][1].update(labels=False),
            r"^data\.silos\.1\.labels: expected true for a client's silo \(a client trains on its labels",
        ),
        (
            lambda d: d.update(public={"dataset": "imagefolder", "path": "/s/images", "labels": False}),
            r"^data\.public\.labels: expected true for dataset 'imagefolder' \(an unlabeled file is npz, or parquet / csv with "
            r"features named\), got False$",
        ),
        (lambda d: d.update(public={"dataset": "digits", "labels": False}), r"^data\.public\.labels: expected true for dataset 'digits'"),
        (
            lambda d: d.update(public={"dataset": "csv", "path": "/s/public.csv", "labels": False}),
            r"^data\.public\.features: expected the feature columns of an unlabeled csv file",
        ),
        (
            lambda d: d.update(public={"dataset": "npz", "path": "/s/public.npz", "labels": False, "label": "y"}),
            r"^data\.public\.label: expected no label with labels: false",
        ),
        (
            lambda d: d.update(public={"dataset": "npz", "path": "/s/public.npz", "lables": False}),
            r"^data\.public\.lables: expected a known key.*did you mean 'labels'",
        ),
    ],
    ids=["test", "client-silo", "imagefolder", "bundled", "csv-without-features", "label-named", "typo"],
)
def test_labels_false_where_labels_are_needed_is_one_line(change, pattern):
    job = {"data": {"silos": [{"dataset": "npz", "path": f"/s/site{i}.npz"} for i in range(2)]}, "methods": DISTILL}
    change(job["data"])
    with pytest.raises(InputError, match=pattern) as caught:
        validate_config(job)
    assert "\n" not in str(caught.value)


def test_a_labelled_public_file_dumps_its_labels_key():
    cfg = validate_config(
        {"data": {"silos": [{"dataset": "npz", "path": "/s/a.npz"}], "public": {"dataset": "npz", "path": "/s/p.npz"}}, "methods": DISTILL}
    )
    data = resolved_config(cfg)["data"]
    assert data["public"]["labels"] is True and cfg.data.public.labels is True
