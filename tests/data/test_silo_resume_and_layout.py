"""Issue 31's leftovers (hardening round 3), three classes:

1. ``--resume`` of a silo run (``data.silos``) whose split cannot be resumed (its ``partition.json`` names no content
   hash per silo and the silos' data differs; a missing or damaged ``partition.json``) is refused in one line, exit 2,
   before any client trains; the client processes started for the silo survey are stopped, and the run folder is left
   as it was. A silo regenerated in place is still computed again with a warning (not refused).
2. A public set without labels (``data.public`` with ``labels: false``) is held to the silos' dtype kind as a labelled
   one is: its readers record the dtype its file stores the inputs in.
3. ``data.layout`` (``auto`` | ``image`` | ``sequence``): an npz file's ``(N, L, D)`` array kept as sequences for a
   sequence model; ``auto`` (the default) reads it as grey images as before; a layout the inputs cannot have, or a
   value that is none of the three, is one line.

Every run is in-process (``federation.backend: local``) on small files written to the test's folder, but one, which
resumes a silo run on a real local Ray to show its actors are gone after the refusal.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rayfuse.config import validate_config
from rayfuse.data.datasets import read_unlabeled_file, read_unlabeled_inputs, read_unlabeled_npz
from rayfuse.data.silos import server_split
from rayfuse.errors import InputError
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, load_run_config, prepare_run, run_experiment
from tests.config.test_bad_inputs import refused_line
from tests.test_content_identity import snapshot

QUIET = Printer(enabled=False)


def blobs(seed: int, n: int = 60, features: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = rng.normal(size=(n, features)) + 2.0 * np.eye(3, features)[y]
    return X.astype(np.float32), y.astype(np.int64)


def write_job(folder: Path, job: dict[str, Any], name: str = "job.yaml") -> str:
    (folder / name).write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return str(folder / name)


# -- 1. a silo run's --resume that cannot be resumed ------------------------------------------------------------------


class SpyBackend(InProcessBackend):
    """The in-process backend, recording whether it started and stopped, and whether any client trained."""

    def __init__(self) -> None:
        super().__init__()
        self.started = self.stopped = 0
        self.calls: list[str] = []

    def start(self, *args: Any, **kwargs: Any) -> None:
        self.started += 1
        super().start(*args, **kwargs)

    def survey_silos(self) -> Any:
        self.calls.append("survey_silos")
        return super().survey_silos()

    def prepare_local_models(self, resume: bool = False) -> Any:
        self.calls.append("prepare_local_models")
        return super().prepare_local_models(resume)

    def run_method(self, label: str, resume: bool = False) -> Any:
        self.calls.append("run_method")
        return super().run_method(label, resume)

    def stop(self) -> None:
        self.stopped += 1
        super().stop()


def silo_job(tmp_path: Path, *, storage: Path | None = None) -> dict[str, Any]:
    silos = []
    for i in range(2):
        X, y = blobs(10 + i)
        np.savez(tmp_path / f"site{i}.npz", X=X, y=y)
        silos.append({"dataset": "npz", "path": str(tmp_path / f"site{i}.npz")})
    X, y = blobs(20, n=45)
    np.savez(tmp_path / "test.npz", X=X, y=y)
    return {
        "run": {"name": "leftover-silo", "seed": 0, "storage": str(storage or tmp_path / "runs")},
        "evaluation": "central",
        "data": {"silos": silos, "test": {"dataset": "npz", "path": str(tmp_path / "test.npz")}},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 1, "batch_size": 16, "shared_init": True},
        "federation": {"backend": "local"},
        "methods": {"average": {}, "fedavg": {"rounds": 1, "local_epochs": 1}},
    }


def first_silo_run(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    run_experiment(validate_config(silo_job(tmp_path)), InProcessBackend(), folder, printer=QUIET, show_tables=False)
    return folder


def regenerate_silo(tmp_path: Path, i: int = 1) -> None:
    file = tmp_path / f"site{i}.npz"
    with np.load(file) as arrays:
        X, y = arrays["X"] + 0.25, arrays["y"]
    with open(file, "wb") as handle:  # in place: same size, same labels, other values
        np.savez(handle, X=X, y=y)


def as_earlier_version(folder: Path) -> None:
    """The folder's partition.json as a version before per-silo content hashes wrote it (no ``content_hash``)."""
    manifest = json.loads((folder / "partition.json").read_text(encoding="utf-8"))
    for client in manifest["clients"]:
        client.pop("content_hash")
    (folder / "partition.json").write_text(json.dumps(manifest), encoding="utf-8")


def resume(folder: Path, backend: Any) -> dict[str, Any]:
    return run_experiment(load_run_config(folder), backend, folder, resume=True, printer=QUIET, show_tables=False)


TRAINING = {"prepare_local_models", "run_method"}


def test_a_silo_resume_whose_split_cannot_be_told_is_refused_after_the_survey_and_stops_the_clients(tmp_path):
    folder = first_silo_run(tmp_path)
    as_earlier_version(folder)
    regenerate_silo(tmp_path)
    before = snapshot(folder)
    backend = SpyBackend()
    with pytest.raises(InputError) as raised:
        resume(folder, backend)
    line = str(raised.value)
    assert raised.value.path == "--resume" and "partition hash" in line and "content hash per silo" in line and "\n" not in line
    assert backend.calls == ["survey_silos"] and not TRAINING & set(backend.calls)  # no client trained
    assert backend.started == 1 and backend.stopped == 1 and backend.coordinator is None and backend.federation is None
    assert snapshot(folder) == before  # nothing written, nothing removed


def test_the_same_refusal_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    folder = first_silo_run(tmp_path)
    as_earlier_version(folder)
    regenerate_silo(tmp_path, 0)
    before = snapshot(folder)
    capsys.readouterr()
    line = refused_line(["run", "--resume", str(folder)], capsys)
    assert line.startswith("rayfuse: error: --resume: expected the same data split as the original run"), line
    assert snapshot(folder) == before


@pytest.mark.parametrize(
    "damage,names",
    [
        (lambda f: f.unlink(), "--resume"),
        (lambda f: f.write_text("{not json", encoding="utf-8"), "partition.json"),
        (lambda f: f.write_text("[1, 2]", encoding="utf-8"), "partition.json"),
        (lambda f: f.write_text('{"hash": 3}', encoding="utf-8"), "partition.json"),
    ],
    ids=["missing", "not-json", "not-an-object", "hash-not-a-string"],
)
def test_a_silo_resume_without_a_readable_partition_json_is_refused_before_any_client_starts(tmp_path, damage, names):
    folder = first_silo_run(tmp_path)
    damage(folder / "partition.json")
    before = snapshot(folder)
    backend = SpyBackend()
    with pytest.raises(InputError) as raised:
        resume(folder, backend)
    assert names in str(raised.value) and "\n" not in str(raised.value)
    assert backend.started == 0 and backend.calls == []  # refused in the driver: no client process was started
    assert snapshot(folder) == before


def test_a_silo_regenerated_in_place_is_still_recomputed_with_a_warning_not_refused(tmp_path):
    folder = first_silo_run(tmp_path)
    regenerate_silo(tmp_path)
    backend = SpyBackend()
    resumed = resume(folder, backend)
    said = [e["message"] for e in resumed["events"] if e["kind"] == "warning"]
    assert len(said) == 1 and said[0].startswith("data.silos.1.path (client 1: ") and "content changed" in said[0], said
    assert "run_method" in backend.calls and backend.stopped == 1  # trained, then stopped at the end as always
    assert resumed["status"] == "succeeded"


def test_an_earlier_versions_silo_folder_with_unchanged_silos_still_resumes(tmp_path):
    folder = first_silo_run(tmp_path)
    as_earlier_version(folder)
    backend = SpyBackend()
    resumed = resume(folder, backend)
    loaded = [e["method"] for e in resumed["events"] if e["kind"] == "info" and "loaded from state/" in e.get("message", "")]
    assert sorted(loaded) == ["average", "fedavg"] and "run_method" not in backend.calls


def test_on_ray_a_refused_silo_resume_leaves_no_actor_running(tmp_path, ray_session):
    from actors.backend import RayBackend

    folder = first_silo_run(tmp_path)
    as_earlier_version(folder)
    regenerate_silo(tmp_path)
    before = snapshot(folder)
    cfg = load_run_config(folder, [(["federation", "backend"], "ray")])
    backend = RayBackend()  # held here: its actor handles alone would keep the actors alive (Ray ends unreferenced ones)
    with pytest.raises(InputError, match=r"^--resume: expected the same data split as the original run"):
        run_experiment(cfg, backend, folder, resume=True, printer=QUIET, show_tables=False)
    assert snapshot(folder) == before
    assert backend.coordinator is None and backend.clients == {}

    def ours() -> list[str]:
        return [a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True) if a["name"].startswith("run/")]

    deadline = time.monotonic() + 30
    while ours() and time.monotonic() < deadline:  # ray.kill is asynchronous: the names go once the processes are gone
        time.sleep(0.2)
    assert ours() == []


# -- 2. a public set without labels, held to the silos' dtype kind ---------------------------------------------------


def public_job(tmp_path: Path, public: dict[str, Any]) -> dict[str, Any]:
    job = silo_job(tmp_path)
    job["data"]["public"] = {**public, "labels": False}
    job["methods"] = {"distill": {"init": "random", "steps": 10, "epochs": 1}}
    return job


def write_public(tmp_path: Path, kind: str, dtype: str) -> dict[str, Any]:
    X = (np.abs(blobs(30, n=40)[0]) * 10).astype(dtype)
    if kind == "npz":
        np.savez(tmp_path / "public.npz", X=X)
        return {"dataset": "npz", "path": str(tmp_path / "public.npz")}
    columns = ["a", "b", "c", "d"]
    if kind == "parquet":
        pq.write_table(pa.table({c: X[:, j] for j, c in enumerate(columns)}), tmp_path / "public.parquet")
    else:
        rows = [",".join(columns)] + [",".join(str(v) for v in row) for row in X.tolist()]
        (tmp_path / "public.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return {"dataset": kind, "path": str(tmp_path / f"public.{kind}"), "features": columns}


@pytest.mark.parametrize(
    "kind,dtype,stored",
    [
        ("npz", "uint8", "uint8"),
        ("npz", "int32", "int32"),
        ("npz", "float64", "float64"),
        ("parquet", "int64", "int64"),
        ("parquet", "float32", "float32"),
        ("csv", "int64", "int64"),
        ("csv", "float64", "float64"),
    ],
    ids=lambda v: str(v),
)
def test_the_unlabeled_readers_record_the_stored_dtype(tmp_path, kind, dtype, stored):
    spec = write_public(tmp_path, kind, dtype)
    X, found = read_unlabeled_inputs(spec["path"], kind=kind, features=spec.get("features"))
    assert found == stored and X.dtype == np.float32 and X.shape == (40, 4)
    np.testing.assert_array_equal(read_unlabeled_file(spec["path"], kind=kind, features=spec.get("features")), X)
    if kind == "npz":
        np.testing.assert_array_equal(read_unlabeled_npz(spec["path"]), X)


REFUSED_PUBLIC = [("npz", "uint8"), ("npz", "int64"), ("parquet", "int32"), ("csv", "int64")]


@pytest.mark.parametrize("kind,dtype", REFUSED_PUBLIC, ids=[f"{k}-{d}" for k, d in REFUSED_PUBLIC])
def test_an_unlabeled_public_set_of_another_kind_than_the_silos_is_one_line(tmp_path, capsys, kind, dtype):
    """Float silos beside a public set of integers (a uint8 array stays 0..255 while the silos are floats near 0)."""
    job = public_job(tmp_path, write_public(tmp_path, kind, dtype))
    capsys.readouterr()
    line = refused_line(["run", write_job(tmp_path, job)], capsys)
    assert line.startswith("rayfuse: error: data.public.path: expected inputs of the same kind as the silos': float (float32)"), line
    assert f'got "{dtype} in ' in line  # (the file's path follows, cut short in a long temporary folder)
    assert not (tmp_path / "runs").exists()  # nothing written


ACCEPTED_PUBLIC = [("npz", "float64"), ("npz", "float16"), ("parquet", "float64"), ("csv", "float64")]


@pytest.mark.parametrize("kind,dtype", ACCEPTED_PUBLIC, ids=[f"{k}-{d}" for k, d in ACCEPTED_PUBLIC])
def test_an_unlabeled_public_set_of_the_silos_kind_in_another_width_is_read(tmp_path, kind, dtype):
    spec = write_public(tmp_path, kind, dtype)
    split = server_split(
        validate_config(public_job(tmp_path, spec)).data.public,
        key="data.public",
        labels=["0", "1", "2"],
        input_shape=(4,),
        normalization=None,
        dtype="float32",
    )
    assert split.X.shape == (40, 4) and (split.y == -1).all()


def test_an_unlabeled_integer_public_set_pools_with_integer_silos(tmp_path):
    """Integer silos (int64 arrays) beside an int32 public set without labels: one kind, the run goes on."""
    job = silo_job(tmp_path)
    for name, seed in (("site0", 10), ("site1", 11), ("test", 20)):  # the labelled test set is held to the kind too
        X, y = blobs(seed)
        np.savez(tmp_path / f"{name}.npz", X=(np.abs(X) * 10).astype(np.int64), y=y)
    job["data"]["public"] = {**write_public(tmp_path, "npz", "int32"), "labels": False}
    job["methods"] = {"distill": {"init": "random", "steps": 10, "epochs": 1}}
    results = run_experiment(validate_config(job), InProcessBackend(), tmp_path / "run", printer=QUIET, show_tables=False)
    assert results["status"] == "succeeded" and "distill" in results["methods"]


# -- 3. data.layout: (N, L, D) npz arrays as sequences -----------------------------------------------------------------


def sequences(tmp_path: Path, shape: tuple[int, ...] = (6, 4), name: str = "seq.npz") -> str:
    rng = np.random.default_rng(0)
    y = np.arange(120) % 3
    X = rng.normal(size=(120, *shape)) + 2.0 * np.eye(3, int(np.prod(shape))).reshape(3, *shape)[y]
    np.savez(tmp_path / name, X=X.astype(np.float32), y=y)
    return str(tmp_path / name)


def seq_job(path: str, storage: Path, layout: str | None = None, model: dict[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"dataset": "npz", "path": path, **({"layout": layout} if layout is not None else {})}
    return {
        "run": {"name": "seq", "seed": 0, "storage": str(storage)},
        "data": data,
        "partition": {"method": "iid", "num_clients": 2},
        "model": model or {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 1, "batch_size": 32},
        "federation": {"backend": "local"},
        "methods": {"average": {}},
    }


@pytest.mark.parametrize(
    "layout,shape",
    [(None, (1, 6, 4)), ("auto", (1, 6, 4)), ("image", (1, 6, 4)), ("sequence", (6, 4))],
    ids=["default", "auto", "image", "sequence"],
)
def test_the_layout_decides_how_a_3d_npz_array_is_read(tmp_path, layout, shape):
    prepared = prepare_run(validate_config(seq_job(sequences(tmp_path), tmp_path / "runs", layout)))
    assert prepared.plan.input_shape == shape


def test_a_sequence_model_runs_on_sequences_end_to_end_and_its_config_keeps_the_layout(tmp_path):
    """The transformer takes (L, D) sequences (one token a position); auto reads the array as a 6x4 image first,
    which its patches cannot cut, then as the sequences the model takes (and says so: layout sequence); the layout
    named runs the same."""
    transformer = {"name": "transformer", "hidden": [8, 16], "heads": 2, "depth": 1}
    path = sequences(tmp_path)
    assert prepare_run(validate_config(seq_job(path, tmp_path / "runs", model=transformer))).cfg.data.layout == "sequence"
    folder = tmp_path / "run"
    results = run_experiment(
        validate_config(seq_job(path, tmp_path / "runs", "sequence", transformer)),
        InProcessBackend(),
        folder,
        printer=QUIET,
        show_tables=False,
    )
    assert results["status"] == "succeeded" and 0.0 <= results["methods"]["average"]["accuracy"] <= 1.0
    assert yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))["data"]["layout"] == "sequence"
    again = resume(folder, InProcessBackend())  # the layout is part of the run's config: it resumes as it ran
    assert again["methods"]["average"]["accuracy"] == results["methods"]["average"]["accuracy"]


def test_earlier_run_folders_without_the_layout_key_keep_their_config(tmp_path):
    # config.yaml lists every default (data.layout: auto); a folder written before the key existed, without it, reads
    # back as the same config (the run's --resume compares it read back through the schema: tests/test_cache_keys.py)
    from rayfuse.method import resolved_config

    folder = tmp_path / "run"
    run_experiment(
        validate_config(seq_job(sequences(tmp_path), tmp_path / "runs")), InProcessBackend(), folder, printer=QUIET, show_tables=False
    )
    written = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    assert written["data"]["layout"] == "auto"
    earlier = {**written, "data": {k: v for k, v in written["data"].items() if k != "layout"}}
    assert resolved_config(validate_config(earlier)) == written


def test_arrays_from_python_follow_the_layout(tmp_path):
    import rayfuse

    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(90, 5, 3)).astype(np.float32), np.arange(90) % 3
    config = seq_job("unused.npz", tmp_path / "runs", "sequence")
    config["data"] = {"layout": "sequence"}
    result = rayfuse.run(config, dataset=(X, y), run_dir=tmp_path / "run", quiet=True)
    assert result.results["status"] == "succeeded"
    assert json.loads((tmp_path / "run" / "partition.json").read_text())["dataset"] == "arrays"


def _refused_layout(tmp_path: Path, capsys: Any, job: dict[str, Any], key: str = "data.layout") -> str:
    capsys.readouterr()
    line = refused_line(["run", write_job(tmp_path, job)], capsys)
    assert line.startswith(f"rayfuse: error: {key}: "), line
    assert not (tmp_path / "runs").exists()
    return line


@pytest.mark.parametrize("value", ["sequences", "Image", 3, ""], ids=["sequences", "Image", "number", "empty"])
def test_a_layout_that_is_none_of_the_three_is_one_line(tmp_path, capsys, value):
    line = _refused_layout(tmp_path, capsys, seq_job(sequences(tmp_path), tmp_path / "runs", value))
    assert "'auto', 'image' or 'sequence'" in line


def test_a_sequence_layout_of_a_table_is_one_line(tmp_path, capsys):
    X, y = blobs(0, n=90)
    np.savez(tmp_path / "table.npz", X=X, y=y)
    line = _refused_layout(tmp_path, capsys, seq_job(str(tmp_path / "table.npz"), tmp_path / "runs", "sequence"))
    assert "(N, L, D)" in line and "inputs of shape (4,)" in line


def test_a_sequence_layout_of_a_4d_array_is_one_line(tmp_path, capsys):
    line = _refused_layout(tmp_path, capsys, seq_job(sequences(tmp_path, (1, 6, 4)), tmp_path / "runs", "sequence"))
    assert "inputs of shape (1, 6, 4)" in line


def test_a_sequence_layout_of_a_bundled_image_dataset_is_one_line(tmp_path, capsys):
    job = seq_job("unused", tmp_path / "runs", "sequence")
    job["data"] = {"dataset": "digits", "layout": "sequence"}
    line = _refused_layout(tmp_path, capsys, job)
    assert "(N, L, D)" in line


def test_an_image_layout_of_a_table_is_one_line(tmp_path, capsys):
    X, y = blobs(0, n=90)
    np.savez(tmp_path / "table.npz", X=X, y=y)
    line = _refused_layout(tmp_path, capsys, seq_job(str(tmp_path / "table.npz"), tmp_path / "runs", "image"))
    assert "image inputs" in line


def test_a_layout_with_silos_is_one_line(tmp_path, capsys):
    job = silo_job(tmp_path)
    job["data"]["layout"] = "sequence"
    line = _refused_layout(tmp_path, capsys, job)
    assert "data.silos" in line
