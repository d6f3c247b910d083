"""Issue 31, class 4: state is identified by content, not by names and sizes.

A run folder's state (``--resume``), the clients' local models and step results under ``run.model_cache`` (which every
Tune sweep shares) are tied to the content of the data they were computed on (``rayfuse.data.identity``: the SHA-256
of ``data.path``, ``data.target.path``, ``data.test.path``, ``data.public.path``; a silo by its survey hash) and to the
config they belong to. A data file regenerated in place (same labels, same size, other values) is detected and
recomputed with one warning line naming it, never mixed with what was computed from the old file; a renamed, copied or
merely touched file with the same bytes is the same data (the cache hits, the run resumes); a run folder given
another run's config is refused in one line (exit 2) before anything is written.

Every run here is in-process (``federation.backend: local``), on a small ``npz`` file written to the test's folder.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from rayfuse.cli import main
from rayfuse.config import validate_config
from rayfuse.data import identity
from rayfuse.errors import InputError
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, load_run_config, run_experiment
from tests.config.test_bad_inputs import refused_line

QUIET = Printer(enabled=False)
CLIENTS = 3
METHODS = {"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}}


def blobs(seed: int, n: int = 240, labels_seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``n`` examples of 3 classes in 6 features; ``seed`` draws the values, the labels are fixed unless
    ``labels_seed`` shuffles them."""
    y = np.arange(n) % 3
    if labels_seed is not None:
        y = np.random.default_rng(labels_seed).permutation(y)
    X = np.random.default_rng(seed).normal(size=(n, 6)) + 2.0 * np.eye(3, 6)[y]
    return X.astype(np.float32), y.astype(np.int64)


def write_npz(path: Path, seed: int = 0, labels_seed: int | None = None) -> Path:
    X, y = blobs(seed, labels_seed=labels_seed)
    with open(path, "wb") as handle:  # in place: the same inode, the bytes rewritten
        np.savez(handle, X=X, y=y)
    return path


def job(path: Path | str, *, cache: Path | None = None, **sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "run": {"name": "content", "seed": 0, **({"model_cache": str(cache)} if cache else {})},
        "data": {"dataset": "npz", "path": str(path)},
        "partition": {"method": "dirichlet", "num_clients": CLIENTS, "alpha": 1.0},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 1, "batch_size": 32, "shared_init": True},
        "federation": {"backend": "local"},
        "methods": METHODS,
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key != "methods" else value
    return data


def run(config: dict[str, Any], folder: Path, *, resume: bool = False) -> dict[str, Any]:
    return run_experiment(validate_config(config), InProcessBackend(), folder, resume=resume, printer=QUIET, show_tables=False)


def resume_folder(folder: Path) -> dict[str, Any]:
    return run_experiment(load_run_config(folder), InProcessBackend(), folder, resume=True, printer=QUIET, show_tables=False)


def kinds(results: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in results["events"]]


def warnings(results: dict[str, Any]) -> list[str]:
    return [e["message"] for e in results["events"] if e["kind"] == "warning"]


def loaded_from_state(results: dict[str, Any]) -> list[str]:
    return [e["method"] for e in results["events"] if e["kind"] == "info" and "loaded from state/" in e.get("message", "")]


def numbers(results: dict[str, Any]) -> dict[str, tuple[float, float]]:
    return {label: (m["accuracy"], m["nll"]) for label, m in results["methods"].items()}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


# -- ways to change (or not) a data file between two uses -------------------------------------------------------------


def regenerate(path: Path) -> Path:
    """The same labels and size, other values: what a data pipeline rerun with another seed writes in place."""
    size = path.stat().st_size
    write_npz(path, seed=1)
    assert path.stat().st_size == size
    return path


def change_one_value(path: Path) -> Path:
    """One feature value of one example changed, nothing else (same size, same labels)."""
    with np.load(path) as arrays:
        X, y = arrays["X"].copy(), arrays["y"]
    X[7, 2] += 0.5
    size = path.stat().st_size
    with open(path, "wb") as handle:
        np.savez(handle, X=X, y=y)
    assert path.stat().st_size == size
    return path


def shuffle_labels(path: Path) -> Path:
    write_npz(path, seed=0, labels_seed=5)
    return path


def touch(path: Path) -> Path:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    return path


def rewrite_same_bytes(path: Path) -> Path:
    """The same bytes in a new file renamed over the old one (a new inode and mtime)."""
    data = path.read_bytes()
    fresh = path.with_name(path.name + ".tmp")
    fresh.write_bytes(data)
    os.replace(fresh, path)
    return path


def rename(path: Path) -> Path:
    target = path.with_name("renamed-" + path.name)
    path.rename(target)
    return target


def copy_elsewhere(path: Path) -> Path:
    folder = path.parent / "elsewhere"
    folder.mkdir()
    return Path(shutil.copy2(path, folder / "other-name.npz"))


def rename_and_regenerate(path: Path) -> Path:
    return regenerate(rename(path))


# -- the chaos tests ------------------------------------------------------------------------------------------------------


def test_a_file_regenerated_in_place_between_a_run_and_its_resume_is_recomputed_with_a_warning(tmp_path):
    data = write_npz(tmp_path / "data.npz")
    folder = tmp_path / "run"
    original = run(job(data), folder)
    regenerate(data)
    # what the run would have computed from the new file, in a folder of its own
    expected = run(job(data), tmp_path / "reference")
    assert numbers(expected) != numbers(original)  # the change matters: mixing would show

    resumed = resume_folder(folder)
    said = warnings(resumed)
    assert len(said) == 1 and said[0].startswith(f"data.path ({data}): content changed"), said
    assert "\n" not in said[0]
    assert loaded_from_state(resumed) == []  # nothing of the old state is read
    assert kinds(resumed).count("client_trained") == CLIENTS
    assert numbers(resumed) == numbers(expected)
    # the folder now describes the new content: a second resume reads its state back, without a warning
    again = resume_folder(folder)
    assert warnings(again) == [] and sorted(loaded_from_state(again)) == sorted(METHODS)
    assert numbers(again) == numbers(expected)


def test_an_interrupted_run_whose_file_was_regenerated_restarts_from_nothing_rather_than_its_checkpoints(tmp_path):
    """The run stops in fedavg's second round (a fault; average finished, fedavg's round 1 checkpointed, the local
    models in checkpoints/local); the file is regenerated; the resume keeps none of it."""
    from rayfuse.config import parse_overrides
    from rayfuse.errors import RunFailure

    data = write_npz(tmp_path / "data.npz")
    folder = tmp_path / "run"
    crash = {"on_client_failure": "fail", "faults": [{"client": 2, "step": "fedavg.fit", "call": 2, "mode": "raise"}]}
    with pytest.raises(RunFailure):
        run(job(data, federation=crash), folder)
    assert (folder / "state" / "average.json").is_file() and (folder / "checkpoints" / "fedavg" / "latest.json").is_file()
    regenerate(data)
    expected = run(job(data), tmp_path / "reference")

    cfg = load_run_config(folder, parse_overrides(["federation.faults=[]"]))
    resumed = run_experiment(cfg, InProcessBackend(), folder, resume=True, printer=QUIET, show_tables=False)
    said = warnings(resumed)
    assert len(said) == 1 and said[0].startswith(f"data.path ({data}): content changed"), said
    assert "resumed" not in kinds(resumed) and loaded_from_state(resumed) == []
    assert [e["source"] for e in resumed["events"] if e["kind"] == "local_models_restored"] == []
    assert numbers(resumed) == numbers(expected)


def test_a_file_regenerated_in_place_between_two_runs_sharing_a_model_cache_is_recomputed_with_a_warning(tmp_path):
    data, cache = write_npz(tmp_path / "data.npz"), tmp_path / "cache"
    first = run(job(data, cache=cache), tmp_path / "a")
    assert kinds(first).count("client_trained") == CLIENTS and warnings(first) == []
    regenerate(data)
    expected = run(job(data), tmp_path / "reference")  # no cache: computed from the new file

    second = run(job(data, cache=cache), tmp_path / "b")
    said = warnings(second)
    assert len(said) == 1 and said[0].startswith(f"data.path ({data}): content changed since a run sharing the model cache"), said
    assert "local_models_restored" not in kinds(second)  # no local model of the old file is read
    assert kinds(second).count("client_trained") == CLIENTS
    assert numbers(second) == numbers(expected)
    # both contents now have their own entries: a third run on the new file reads its models, silently
    third = run(job(data, cache=cache), tmp_path / "c")
    assert "client_trained" not in kinds(third) and warnings(third) == []
    assert numbers(third) == numbers(expected)


def test_step_results_in_the_model_cache_are_keyed_by_content(tmp_path):
    """A method whose clients' step results are cached (KL-fusion's local posterior fits) computes them again for a
    regenerated file and reads them back for a renamed one."""
    from rayfuse.store import step_result_key

    data = write_npz(tmp_path / "data.npz")
    cfg = validate_config(job(data))
    from rayfuse.method import resolved_config

    key = step_result_key(resolved_config(cfg), "p", "fit", (), {})[0]
    moved = rename(data)
    assert step_result_key(resolved_config(validate_config(job(moved))), "p", "fit", (), {})[0] == key
    regenerate(moved)
    assert step_result_key(resolved_config(validate_config(job(moved))), "p", "fit", (), {})[0] != key


# -- the case table -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "cache": two runs sharing run.model_cache; "resume": a run, then its --resume
    change: Callable[[Path], Path]  # the data file between the two; returns the path the second use names
    expect: str  # "hit" / "miss-warned" / "miss-new-file" (cache); "resumed" / "recomputed" / "refused" (resume)
    config: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # the resumed run's config, from the original's
    names: str = ""  # what the refusal names


def _set(section: str, **values: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda config: {**config, section: {**config[section], **values}}


CASES = [
    Case("cache-regenerated-in-place", "cache", regenerate, "miss-warned"),
    Case("cache-one-value-changed-same-size", "cache", change_one_value, "miss-warned"),
    Case("cache-labels-reshuffled-same-size", "cache", shuffle_labels, "miss-warned"),
    Case("cache-renamed-identical", "cache", rename, "hit"),
    Case("cache-copied-elsewhere-identical", "cache", copy_elsewhere, "hit"),
    Case("cache-touched-mtime-only", "cache", touch, "hit"),
    Case("cache-same-bytes-new-inode", "cache", rewrite_same_bytes, "hit"),
    Case("cache-renamed-and-regenerated", "cache", rename_and_regenerate, "miss-new-file"),
    Case("resume-regenerated-in-place", "resume", regenerate, "recomputed"),
    Case("resume-one-value-changed-same-size", "resume", change_one_value, "recomputed"),
    Case("resume-labels-reshuffled-same-size", "resume", shuffle_labels, "recomputed"),
    Case("resume-touched-mtime-only", "resume", touch, "resumed"),
    Case("resume-same-bytes-new-inode", "resume", rewrite_same_bytes, "resumed"),
    Case("resume-renamed-identical", "resume", rename, "resumed"),
    Case(
        "resume-other-name-storage-and-federation",
        "resume",
        lambda p: p,
        "resumed",
        config=lambda c: _set("federation", max_restarts=3)(_set("run", name="renamed-run", storage="elsewhere")(c)),
    ),
    Case(
        "resume-another-config-method-rounds",
        "resume",
        lambda p: p,
        "refused",
        config=lambda c: {**c, "methods": {**METHODS, "fedavg": {"rounds": 3, "local_epochs": 1}}},
        names="methods.fedavg.rounds",
    ),
    Case(
        "resume-another-config-method-set",
        "resume",
        lambda p: p,
        "refused",
        config=lambda c: {**c, "methods": {"average": {}}},
        names="methods.fedavg",
    ),
    Case("resume-another-config-epochs", "resume", lambda p: p, "refused", config=_set("train", epochs=2), names="train.epochs"),
    Case("resume-another-config-seed", "resume", lambda p: p, "refused", config=_set("run", seed=1), names="run.seed"),
    Case("resume-another-config-data-setting", "resume", lambda p: p, "refused", config=_set("data", val_size=0.2), names="data.val_size"),
    Case("resume-another-config-partition", "resume", lambda p: p, "refused", config=_set("partition", alpha=0.5), names="partition.alpha"),
    Case("resume-another-config-and-renamed-file", "resume", rename, "refused", config=_set("model", hidden=[4]), names="model.hidden"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_state_follows_the_datas_content_and_its_config(case: Case, tmp_path: Path) -> None:
    identity.clear_digest_cache()  # each case as a fresh process would see it
    data = write_npz(tmp_path / "data.npz")
    cache = tmp_path / "cache" if case.kind == "cache" else None
    first = run(job(data, cache=cache), tmp_path / "first")
    now = case.change(data)
    if case.kind == "cache":
        second = run(job(now, cache=cache), tmp_path / "second")
        said = warnings(second)
        if case.expect == "hit":
            assert said == [] and "client_trained" not in kinds(second)
            assert [e["source"] for e in second["events"] if e["kind"] == "local_models_restored"] == ["cache"]
            assert numbers(second) == numbers(first)
            return
        assert kinds(second).count("client_trained") == CLIENTS and "local_models_restored" not in kinds(second)
        assert numbers(second) == numbers(run(job(now), tmp_path / "reference"))
        if case.expect == "miss-warned":
            assert len(said) == 1 and said[0].startswith(f"data.path ({now}): content changed"), said
        else:  # another file (a new name) with new content: nothing was computed from it, nothing to warn about
            assert case.expect == "miss-new-file" and said == []
        return

    folder = tmp_path / "first"
    config = job(now)
    if case.config is not None:
        config = case.config(config)
    if case.expect == "refused":
        before = snapshot(folder)
        with pytest.raises(InputError) as raised:
            run(config, folder, resume=True)
        line = str(raised.value)
        assert raised.value.path == "--resume" and case.names in line and "\n" not in line, line
        assert snapshot(folder) == before  # nothing written, nothing removed
        return
    resumed = run(config, folder, resume=True)
    said = warnings(resumed)
    if case.expect == "resumed":
        assert said == [] and sorted(loaded_from_state(resumed)) == sorted(METHODS)
        assert numbers(resumed) == numbers(first)
        return
    assert case.expect == "recomputed"
    assert len(said) == 1 and said[0].startswith(f"data.path ({now}): content changed since the run folder's state"), said
    assert loaded_from_state(resumed) == [] and kinds(resumed).count("client_trained") == CLIENTS
    assert numbers(resumed) == numbers(run(job(now), tmp_path / "reference"))


def test_the_case_table_covers_both_stores_and_every_outcome() -> None:
    assert len(CASES) >= 15 and len({c.id for c in CASES}) == len(CASES)
    outcomes = {(c.kind, c.expect) for c in CASES}
    assert outcomes == {
        ("cache", "hit"),
        ("cache", "miss-warned"),
        ("cache", "miss-new-file"),
        ("resume", "resumed"),
        ("resume", "recomputed"),
        ("resume", "refused"),
    }


# -- the command line: another run's config in a folder, a damaged record ------------------------------------------------


def _two_runs(tmp_path: Path) -> tuple[Path, Path]:
    data = write_npz(tmp_path / "data.npz")
    run(job(data), tmp_path / "a")
    run(job(data, train={"epochs": 2}), tmp_path / "b")
    return tmp_path / "a", tmp_path / "b"


def _refused_in_one_line(args: list[str], folder: Path, names: str, capsys) -> None:
    capsys.readouterr()
    before = snapshot(folder)
    line = refused_line(args, capsys)
    assert names in line, line
    assert snapshot(folder) == before


def test_a_folder_given_another_runs_config_is_refused_on_the_command_line(tmp_path, capsys):
    """config.yaml and partition.json of run b copied into run a's folder (a's state stays): --resume would continue
    b's experiment from a's finished methods; identity.json, written with a's state, tells them apart."""
    a, b = _two_runs(tmp_path)
    for name in ("config.yaml", "partition.json"):
        shutil.copy2(b / name, a / name)
    _refused_in_one_line(["run", "--resume", str(a)], a, "identity.json", capsys)


@pytest.mark.parametrize(
    "damage",
    [lambda f: f.write_text("{not json"), lambda f: f.write_text("[1]"), lambda f: f.write_text('{"config": 3, "data_files": {}}')],
    ids=["not-json", "not-an-object", "config-not-a-string"],
)
def test_a_damaged_identity_record_is_one_line(tmp_path, capsys, damage):
    a, _ = _two_runs(tmp_path)
    damage(a / "identity.json")
    _refused_in_one_line(["run", "--resume", str(a)], a, "identity.json", capsys)


def test_the_command_line_resume_says_which_file_changed(tmp_path, capsys):
    data = write_npz(tmp_path / "data.npz")
    folder = tmp_path / "run"
    run(job(data), folder)
    regenerate(data)
    capsys.readouterr()
    assert main(["run", "--resume", str(folder)]) == 0
    out, err = capsys.readouterr()
    changed = [line for line in (out + err).splitlines() if "content changed" in line]
    assert len(changed) == 1 and "data.path" in changed[0] and str(data) in changed[0], out + err
    assert "Traceback" not in out + err
    assert json.loads((folder / "identity.json").read_text())["data_files"]["data.path"]["sha256"] == identity.file_digest(data)


def test_a_folder_of_an_earlier_version_without_identity_json_still_resumes(tmp_path):
    """A run folder written before identity.json existed: its config.yaml is compared, its data cannot be."""
    data = write_npz(tmp_path / "data.npz")
    folder = tmp_path / "run"
    first = run(job(data), folder)
    (folder / "identity.json").unlink()
    resumed = resume_folder(folder)
    assert warnings(resumed) == [] and sorted(loaded_from_state(resumed)) == sorted(METHODS)
    assert numbers(resumed) == numbers(first)
    with pytest.raises(InputError, match="train.epochs"):
        run(job(data, train={"epochs": 2}), folder, resume=True)


# -- silo configs: the server's sets (data.test, data.public) and the silos themselves -------------------------------------


def _silo_job(tmp_path: Path) -> dict[str, Any]:
    silos = []
    for i in range(2):
        silo = tmp_path / f"site{i}.npz"
        X, y = blobs(10 + i, n=60)
        np.savez(silo, X=X, y=y)
        silos.append({"dataset": "npz", "path": str(silo)})
    for name in ("test", "public"):
        X, y = blobs(20, n=45)
        np.savez(tmp_path / f"{name}.npz", X=X, y=y)
    return {
        "run": {"name": "silo", "seed": 0},
        "evaluation": "central",
        "data": {
            "silos": silos,
            "test": {"dataset": "npz", "path": str(tmp_path / "test.npz")},
            "public": {"dataset": "npz", "path": str(tmp_path / "public.npz")},
        },
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 1, "batch_size": 16, "shared_init": True},
        "federation": {"backend": "local"},
        "methods": {"average": {}},
    }


@pytest.mark.parametrize(
    "name,key",
    [("test.npz", "data.test.path"), ("public.npz", "data.public.path"), ("site1.npz", "data.silos.1.path")],
    ids=["test", "public", "silo"],
)
def test_a_silo_runs_files_regenerated_in_place_are_recomputed_on_resume(tmp_path, name, key):
    config = _silo_job(tmp_path)
    folder = tmp_path / "run"
    run(config, folder)
    file = tmp_path / name
    with np.load(file) as arrays:
        X, y = arrays["X"] + 0.25, arrays["y"]
    with open(file, "wb") as handle:
        np.savez(handle, X=X, y=y)
    resumed = run(config, folder, resume=True)
    said = warnings(resumed)
    assert len(said) == 1 and said[0].startswith(f"{key} (") and name in said[0] and "content changed" in said[0], said
    assert loaded_from_state(resumed) == []
    assert numbers(resumed) == numbers(run(config, tmp_path / "reference"))


def test_a_silo_runs_unchanged_files_resume(tmp_path):
    config = _silo_job(tmp_path)
    folder = tmp_path / "run"
    first = run(config, folder)
    touch(tmp_path / "test.npz")
    resumed = run(config, folder, resume=True)
    assert warnings(resumed) == [] and loaded_from_state(resumed) == ["average"]
    assert numbers(resumed) == numbers(first)


# -- the digests themselves -------------------------------------------------------------------------------------------------


def test_a_file_is_hashed_once_per_process_while_its_stat_is_unchanged(tmp_path, monkeypatch):
    identity.clear_digest_cache()
    file = write_npz(tmp_path / "data.npz")
    reads: list[str] = []
    real = open

    def counting_open(path, *args, **kwargs):
        reads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(identity, "open", counting_open, raising=False)
    first = identity.file_digest(file)
    assert identity.file_digest(file) == first and identity.file_digest(tmp_path / "." / "data.npz") == first
    assert len(reads) == 1
    touch(file)
    assert identity.file_digest(file) == first and len(reads) == 2  # the mtime moved: read again, same content
    regenerate(file)
    assert identity.file_digest(file) != first and len(reads) == 3


def test_a_folders_digest_covers_its_files_names_and_content(tmp_path):
    folder = tmp_path / "images"
    for label in ("cat", "dog"):
        (folder / label).mkdir(parents=True)
        (folder / label / "0.png").write_bytes(label.encode() * 10)
    digest = identity.file_digest(folder)
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    assert identity.file_digest(copy) == digest  # another name, the same content
    (copy / "dog").rename(copy / "wolf")  # a class folder renamed: another label
    assert identity.file_digest(copy) != digest
    assert identity.file_digest(tmp_path / "missing") is None


def test_the_local_model_key_ignores_the_servers_sets_and_the_files_names(tmp_path):
    """A client's local model is trained on its own data only: data.target (the server's task) does not enter its key;
    data.path enters by content."""
    from rayfuse.data.identity import content_data

    data = write_npz(tmp_path / "data.npz")
    section = validate_config(job(data)).model_dump(mode="json")["data"]
    keyed = content_data(section, local=True)
    assert keyed["path"] == {"sha256": identity.file_digest(data)} and "target" not in keyed
    moved = rename(data)
    assert content_data({**section, "path": str(moved)}, local=True) == keyed
    assert yaml.safe_dump(content_data(section, unnamed=True))  # plain data
    # the server's task file does enter what the run folder's state and the step results are keyed by
    target = write_npz(tmp_path / "target.npz", seed=3)
    with_target = {**section, "path": str(moved), "target": {"dataset": "npz", "path": str(target)}}
    assert sorted(identity.data_files(with_target)) == ["data.path", "data.target.path"]
    assert content_data(with_target)["target"]["path"] == {"sha256": identity.file_digest(target)}
    assert "target" not in content_data(with_target, local=True)
