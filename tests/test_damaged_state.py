"""Hardening of the state rayfuse reads back (issue 19): damaged checkpoints and run-folder files on ``--resume``, two
runs into one folder, SIGTERM, and sweep folders not written by this user's rayfuse.

Every damaged checkpoint is detected: the resumed run falls back to the previous round (or runs the method again)
with a ``warning`` event and ends with the uninterrupted run's numbers. A run folder's own description of the run
(``config.yaml``, ``partition.json``) damaged is one line naming the file (exit 2), never a traceback.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from rayfuse.cli import main
from rayfuse.config import parse_overrides, validate_config
from rayfuse.errors import InputError, RunFailure
from rayfuse.io import load_params
from rayfuse.models import params_equal
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, load_run_config, run_experiment
from tests.conftest import TINY, merge

QUIET = Printer(enabled=False)
METHODS = {"average": {}, "fedavg": {"rounds": 5, "local_epochs": 1}}
#: round 4 of fedavg fails (policy fail): the run stops after checkpointing rounds 1-3 (round 2 kept beside round 3)
CRASH = {"on_client_failure": "fail", "faults": [{"client": 3, "step": "fedavg.fit", "call": 4, "mode": "raise"}]}
RESUME_SETS = ["federation.faults=[]", "federation.on_client_failure=retry"]


def run(cfg, run_dir, **kwargs):
    return run_experiment(cfg, InProcessBackend(), run_dir, printer=QUIET, show_tables=False, **kwargs)


def config(storage: Path, **sections):
    data = merge(TINY, {"methods": METHODS, **sections})
    data["run"]["storage"] = str(storage)
    return validate_config(data)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run and a run interrupted after round 3 of fedavg (average finished), shared read-only."""
    root = tmp_path_factory.mktemp("hardening")
    straight = run(config(root), root / "straight")
    with pytest.raises(RunFailure):
        run(config(root, federation=CRASH), root / "interrupted")
    return {"root": root, "straight": straight, "straight_dir": root / "straight", "interrupted": root / "interrupted"}


def interrupted_copy(runs, tmp_path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(runs["interrupted"], folder)
    return folder


def resume(folder: Path) -> dict:
    return run(load_run_config(folder, parse_overrides(RESUME_SETS)), folder, resume=True)


def warnings(results: dict) -> list[str]:
    return [e["message"] for e in results["events"] if e["kind"] == "warning"]


def assert_same_numbers(resumed: dict, runs: dict, folder: Path) -> None:
    straight = runs["straight"]
    assert resumed["status"] == "succeeded"
    for label in ("average", "fedavg"):
        assert resumed["methods"][label]["accuracy"] == straight["methods"][label]["accuracy"], label
        assert resumed["methods"][label]["nll"] == straight["methods"][label]["nll"], label
        assert params_equal(
            load_params(folder / "models" / f"{label}.safetensors"), load_params(runs["straight_dir"] / "models" / f"{label}.safetensors")
        ), label


# -- ways to damage a file ------------------------------------------------------------------------------------------


def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def zero(file: Path) -> None:
    file.write_bytes(bytes(file.stat().st_size))


def flip_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x10  # in the tensor payload (the header is at the start): still a valid safetensors file
    file.write_bytes(bytes(data))


def delete(file: Path) -> None:
    file.unlink()


def garbage(file: Path) -> None:
    file.write_bytes(b"\x00{not json \xff")


DAMAGE: dict[str, Callable[[Path], None]] = {"truncated": truncate, "zeroed": zero, "bit-flipped": flip_bit, "deleted": delete}


# -- round checkpoints --------------------------------------------------------------------------------------------


def test_the_commit_record_holds_each_files_sha256_and_the_previous_round(runs):
    from rayfuse.store import sha256_file

    folder = runs["interrupted"] / "checkpoints" / "fedavg"
    record = json.loads((folder / "latest.json").read_text())
    assert record["round"] == 3 and record["previous"]["round"] == 2
    assert sorted(p.name for p in folder.glob("round-*.safetensors")) == ["round-00002.safetensors", "round-00003.safetensors"]
    assert record["sha256"] == sha256_file(folder / record["file"])
    assert record["previous"]["sha256"] == sha256_file(folder / record["previous"]["file"])


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_round_and_ends_equal(runs, tmp_path, damage):
    folder = interrupted_copy(runs, tmp_path)
    DAMAGE[damage](folder / "checkpoints" / "fedavg" / "round-00003.safetensors")
    resumed = resume(folder)
    said = warnings(resumed)
    assert len(said) == 1 and "round-00003.safetensors" in said[0] and "continuing from round 2" in said[0], said
    assert [e["round"] for e in resumed["events"] if e["kind"] == "resumed"] == [2]
    assert_same_numbers(resumed, runs, folder)


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
def test_both_kept_rounds_damaged_restarts_the_method_and_ends_equal(runs, tmp_path, damage):
    folder = interrupted_copy(runs, tmp_path)
    for file in (folder / "checkpoints" / "fedavg").glob("round-*.safetensors"):
        DAMAGE[damage](file)
    resumed = resume(folder)
    said = warnings(resumed)
    assert len(said) == 1 and "restarting the method from its first round" in said[0], said
    assert not any(e["kind"] == "resumed" for e in resumed["events"])
    assert_same_numbers(resumed, runs, folder)


@pytest.mark.parametrize(
    "damage",
    [garbage, lambda f: f.write_text("[1, 2]"), lambda f: f.write_text('{"round": "x"}')],
    ids=["not-json", "not-an-object", "no-file"],
)
def test_a_damaged_latest_json_restarts_the_method_and_ends_equal(runs, tmp_path, damage):
    folder = interrupted_copy(runs, tmp_path)
    damage(folder / "checkpoints" / "fedavg" / "latest.json")
    resumed = resume(folder)
    said = warnings(resumed)
    assert len(said) == 1 and "latest.json" in said[0] and "first round" in said[0], said
    assert_same_numbers(resumed, runs, folder)


def test_a_fallback_keeps_a_previous_round_for_the_next_resume(tmp_path):
    import numpy as np

    from rayfuse.store import Checkpointer

    ckpt = Checkpointer(tmp_path)
    for rnd in (1, 2, 3):
        ckpt.save(rnd, {"w": np.full(3, rnd, dtype=np.float32)}, meta={"r": rnd})
    truncate(tmp_path / "round-00003.safetensors")
    said: list[str] = []
    assert ckpt.load(said.append).round == 2 and len(said) == 1
    ckpt.save(3, {"w": np.full(3, 3, dtype=np.float32)})  # round 3 again, from round 2: round 2 stays the previous one
    assert json.loads((tmp_path / "latest.json").read_text())["previous"]["round"] == 2
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-00002.safetensors", "round-00003.safetensors"]
    assert ckpt.load().round == 3


# -- finished methods and local models ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "file, damage, expect",
    [
        ("state/average.json", garbage, "average.json: damaged"),
        ("state/average.json", lambda f: f.write_text('{"label": "average"}'), "average.json: damaged"),
        ("models/average.safetensors", flip_bit, "average.safetensors: damaged"),
        ("models/average.safetensors", delete, "average.safetensors: missing"),
    ],
)
def test_a_damaged_finished_method_runs_again_and_ends_equal(runs, tmp_path, file, damage, expect):
    folder = interrupted_copy(runs, tmp_path)
    damage(folder / file)
    resumed = resume(folder)
    said = warnings(resumed)
    assert len(said) == 1 and expect in said[0] and "running average again" in said[0], said
    assert_same_numbers(resumed, runs, folder)


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "zeroed"])
def test_a_damaged_local_model_checkpoint_is_retrained_and_ends_equal(runs, tmp_path, damage):
    folder = interrupted_copy(runs, tmp_path)
    (folder / "state" / "average.json").unlink()  # as if the run stopped before `average`: it needs the local models
    DAMAGE[damage](folder / "checkpoints" / "local" / "client-1.safetensors")
    resumed = resume(folder)
    said = warnings(resumed)
    assert len(said) == 1 and "client-1.safetensors: damaged" in said[0] and "client 1 trains" in said[0], said
    assert [e["client"] for e in resumed["events"] if e["kind"] == "client_trained"] == [1]
    assert_same_numbers(resumed, runs, folder)


def test_a_damaged_model_cache_entry_is_discarded_and_retrained(tmp_path):
    cache = tmp_path / "cache"
    first = run(config(tmp_path, run={"model_cache": str(cache)}, methods={"average": {}}), tmp_path / "a")
    entry = sorted((cache / "local-models").glob("*/params.safetensors"))[0]
    flip_bit(entry)
    again = run(config(tmp_path, run={"model_cache": str(cache)}, methods={"average": {}}), tmp_path / "b")
    assert len([e for e in again["events"] if e["kind"] == "client_trained"]) == 1  # the others read their copies
    assert again["methods"]["average"]["accuracy"] == first["methods"]["average"]["accuracy"]
    assert entry.is_file()  # republished, intact
    third = run(config(tmp_path, run={"model_cache": str(cache)}, methods={"average": {}}), tmp_path / "c")
    assert not any(e["kind"] == "client_trained" for e in third["events"])


# -- the run folder's own description: one line naming the file ------------------------------------------------------


def not_a_mapping(file: Path) -> None:
    file.write_text("- just\n- a list\n")


def bad_value(file: Path) -> None:
    data = yaml.safe_load(file.read_text())
    data["partition"]["alpha"] = -1
    file.write_text(yaml.safe_dump(data))


def no_hash(file: Path) -> None:
    data = json.loads(file.read_text())
    del data["hash"]
    file.write_text(json.dumps(data))


RUN_FOLDER_CORPUS = [
    ("config.yaml", garbage, "config.yaml: expected the run's resolved config"),
    ("config.yaml", truncate, "config.yaml"),
    ("config.yaml", not_a_mapping, "config.yaml: expected the run's resolved config (a YAML mapping)"),
    ("config.yaml", bad_value, "config.yaml: partition.alpha"),
    ("config.yaml", lambda f: f.write_bytes(b"\xff\xfe run: {}"), "config.yaml: expected"),
    (
        "config.yaml",
        lambda f: f.write_text("".join(f.read_text().splitlines(True)[:-3])),  # still a valid config: defaults fill in
        "config.yaml: expected the run's resolved config as rayfuse wrote it",
    ),
    ("partition.json", garbage, "partition.json: expected the run's partition manifest"),
    ("partition.json", truncate, "partition.json: expected the run's partition manifest"),
    ("partition.json", no_hash, "partition.json: expected the run's partition manifest"),
    ("partition.json", lambda f: f.write_text('{"hash": 7}'), "partition.json: expected"),
    ("partition.json", lambda f: f.write_text("[" * 100_000), "partition.json: expected the run's partition manifest"),  # RecursionError
    ("identity.json", lambda f: f.write_text("{" * 100_000), "identity.json: expected"),
]


@pytest.mark.parametrize("file, damage, expect", RUN_FOLDER_CORPUS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(RUN_FOLDER_CORPUS)])
def test_a_damaged_run_description_is_one_line_naming_the_file(runs, tmp_path, capsys, file, damage, expect):
    folder = interrupted_copy(runs, tmp_path)
    damage(folder / file)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    with pytest.raises(InputError) as info:
        from rayfuse.api import resume as api_resume

        api_resume(folder, overrides=RESUME_SETS, quiet=True)
    assert expect in str(info.value) and "\n" not in str(info.value)
    assert main(["run", "--resume", str(folder), "--local", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rayfuse: error: ") and file in err[0], err
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # nothing written


# -- two runs into one folder ---------------------------------------------------------------------------------------


def test_a_claimed_folder_refuses_a_second_run_and_a_second_resume(runs, tmp_path, capsys):
    from rayfuse.api import resume as api_resume
    from rayfuse.store import claim_run_folder

    fresh = tmp_path / "fresh"
    with claim_run_folder(fresh):
        with pytest.raises(InputError, match=r"^.*fresh: expected a run folder no other rayfuse run is using, got 'claimed by process "):
            run(config(tmp_path), fresh)
    assert sorted(p.name for p in fresh.iterdir()) == [".rayfuse-claim"]  # the refused run wrote nothing

    folder = interrupted_copy(runs, tmp_path)
    with claim_run_folder(folder, resume=True):
        with pytest.raises(InputError, match="no other rayfuse run is using"):
            api_resume(folder, overrides=RESUME_SETS, quiet=True)
        assert main(["run", "--resume", str(folder), "--local", "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(folder) in err[0] and "claimed by process" in err[0], err
    assert resume(folder)["status"] == "succeeded"  # released: the folder can be resumed again


def test_a_new_run_refuses_a_folder_another_run_started_in(tmp_path):
    folder = tmp_path / "raced"
    folder.mkdir()
    (folder / "config.yaml").write_text("run: {name: other}\n")  # another run passed the empty-folder check first
    with pytest.raises(InputError, match="raced: expected a new or empty folder, got 'another run has started in it'"):
        run(config(tmp_path), folder)


def test_the_claim_of_a_killed_process_does_not_block(tmp_path):
    import signal
    import subprocess
    import sys

    from rayfuse.store import claim_run_folder

    folder = tmp_path / "run"
    code = (
        f"from rayfuse.store import claim_run_folder; c = claim_run_folder({str(folder)!r}); print('claimed', flush=True); "
        "import time; time.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        with pytest.raises(InputError, match=f"claimed by process {holder.pid} on "):
            claim_run_folder(folder, resume=True)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    with claim_run_folder(folder, resume=True) as claim:  # the dead process's claim is gone with it
        assert claim.folder == folder
    assert json.loads((folder / ".rayfuse-claim").read_text())["pid"] != holder.pid


# -- SIGTERM --------------------------------------------------------------------------------------------------------


def test_sigterm_stops_a_run_like_ctrl_c_and_resume_ends_equal(runs, tmp_path, capsys):
    """SIGTERM mid-run (fedavg hangs in round 4): exit 143 with the real folder in the hint; a second run or resume of
    the folder meanwhile is refused; ``--resume`` then ends with the uninterrupted run's numbers."""
    import os
    import selectors
    import signal
    import subprocess
    import sys

    hang = [{"client": 3, "step": "fedavg.fit", "call": 4, "mode": "hang", "seconds": 300}]
    data = merge(TINY, {"methods": METHODS, "federation": {"faults": hang}})
    data["run"]["storage"] = str(tmp_path / "runs")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayfuse", "run", str(job), "--local", "--out", str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        seen = []
        while not any("fedavg: round 3/5" in line for line in seen):  # the guard: a generous wait, not a timing check
            assert selector.select(timeout=240), f"no progress: {seen[-5:]}"
            line = proc.stdout.readline()
            assert line, f"the run ended early: {seen[-5:]}"
            seen.append(line)
        # the run hangs in round 4 now: a second run into its folder and a second resume are refused
        assert main(["run", "--resume", str(folder), "--local", "--quiet"]) == 2
        assert "claimed by process" in capsys.readouterr().err
        assert main(["run", str(job), "--local", "--quiet", "--out", str(folder)]) == 2
        assert "--out: expected a new or empty folder" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == f"rayfuse: interrupted (SIGTERM); continue with: rayfuse run --resume {folder}"
    assert "Traceback" not in stderr and not (folder / "results.json").exists()

    assert main(["run", "--resume", str(folder), "--local", "--quiet", "--set", "federation.faults=[]"]) == 0
    resumed = json.loads((folder / "results.json").read_text())
    assert any(e["kind"] == "resumed" for e in resumed["events"])
    assert_same_numbers(resumed, runs, folder)


def test_ctrl_c_names_the_real_folder_and_keeps_exit_130(tmp_path, capsys, monkeypatch):
    import signal

    import rayfuse.api
    import rayfuse.runner
    from rayfuse.interrupts import Interrupted

    def stopped(*args, **kwargs):
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.yaml").write_text("run: {}\n")  # the run had claimed and described its folder
        raise KeyboardInterrupt

    monkeypatch.setattr(rayfuse.runner, "run_experiment", stopped)
    prepared = rayfuse.runner.prepare_run(config(tmp_path))
    with pytest.raises(Interrupted) as info:
        rayfuse.api._execute(prepared, tmp_path / "run", resume=False, quiet=True, verbose=False, by_value=())
    assert info.value.run_dir == tmp_path / "run" and info.value.signum == signal.SIGINT and info.value.exit_code == 130

    def resume_stopped(*args, **kwargs):
        raise Interrupted(signal.SIGINT, tmp_path / "run")

    monkeypatch.setattr(rayfuse.api, "resume", resume_stopped)
    assert main(["run", "--resume", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == f"rayfuse: interrupted (SIGINT); continue with: rayfuse run --resume {tmp_path / 'run'}"


# -- sweep folders: Tuner.restore unpickles them ------------------------------------------------------------------------


class Planted:
    """A pickle that creates ``marker`` when it is loaded (what a planted ``tuner.pkl`` would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def sweep_space(tmp_path: Path) -> tuple[Path, Path]:
    """A valid space with its storage under ``tmp_path``; returns (space file, experiment folder)."""
    job = {
        "run": {"name": "tiny"},
        "partition": {"num_clients": 2},
        "model": {"hidden": [8]},
        "train": {"epochs": 1},
        "methods": {"average": {}, "fedprox": {"rounds": 2, "local_epochs": 1}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    space = {
        "base": "job.yaml",
        "name": "planted",
        "storage": str(tmp_path / "storage"),
        "space": {"methods.fedprox.mu": {"grid": [0.01, 0.1]}},
        "metric": "fused/fedprox/accuracy",
    }
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    return tmp_path / "space.yaml", tmp_path / "storage" / "planted"


def sweep_folder(experiment: Path, marker: Path) -> None:
    """What Tune leaves in an experiment folder, with a planted ``tuner.pkl``."""
    import pickle

    (experiment / "trial_0").mkdir(parents=True)
    (experiment / "tuner.pkl").write_bytes(pickle.dumps(Planted(marker)))
    (experiment / "experiment_state-2024-01-01_00-00-00.json").write_text('{"trial_data": []}')
    (experiment / "basic-variant-state-2024-01-01_00-00-00.json").write_text("{}")
    (experiment / "trial_0" / "result.json").write_text("{}\n")
    (experiment / "runs" / "t0").mkdir(parents=True)
    (experiment / "runs" / "t0" / "config.yaml").write_text("run: {}\n")


def with_other_key(experiment: Path, tmp_path: Path, monkeypatch) -> None:
    from rayfuse.sweep_seal import load_key, seal_sweep

    monkeypatch.setenv("RAYFUSE_HOME", str(tmp_path / "someone-else"))
    seal_sweep(experiment)
    monkeypatch.setenv("RAYFUSE_HOME", str(tmp_path / "me"))
    load_key(create=True)  # this user has a key of their own: the seal does not verify under it


def sealed_then(change: Callable[[Path], None]) -> Callable[[Path, Path, object], None]:
    def plant(experiment: Path, tmp_path: Path, monkeypatch) -> None:
        from rayfuse.sweep_seal import seal_sweep

        seal_sweep(experiment)
        change(experiment)

    return plant


def replace_pickle(experiment: Path) -> None:
    import pickle

    (experiment / "tuner.pkl").write_bytes(pickle.dumps(Planted(experiment.parent.parent / "marker")) + b" ")


def edit_seal(experiment: Path) -> None:
    seal = json.loads((experiment / "rayfuse-seal.json").read_text())
    seal["files"]["tuner.pkl"] = "0" * 64
    (experiment / "rayfuse-seal.json").write_text(json.dumps(seal))


SWEEP_CORPUS: dict[str, tuple[Callable[..., None], str]] = {
    "no-seal": (lambda e, t, m: None, "rayfuse-seal.json: expected the seal rayfuse writes while a sweep runs, got 'no such file'"),
    "another-users-key": (with_other_key, "rayfuse-seal.json: expected a seal made with your sweep key"),
    "seal-edited": (sealed_then(edit_seal), "rayfuse-seal.json: expected a seal made with your sweep key"),
    "seal-damaged": (sealed_then(lambda e: garbage(e / "rayfuse-seal.json")), "rayfuse-seal.json: expected a seal written by rayfuse"),
    "seal-nested-too-deep": (  # json.loads recurses: a RecursionError, not a ValueError
        sealed_then(lambda e: (e / "rayfuse-seal.json").write_text("[" * 100_000)),
        "rayfuse-seal.json: expected a seal written by rayfuse, got 'a damaged file (RecursionError)'",
    ),
    "tuner-pkl-replaced": (
        sealed_then(replace_pickle),
        "tuner.pkl: expected the file as this sweep's rayfuse sealed it, got 'a file changed",
    ),
    "error-pkl-added": (
        sealed_then(lambda e: (e / "trial_0" / "error.pkl").write_bytes(b"x")),
        "error.pkl: expected the file as this sweep's rayfuse sealed it, got 'a file added",
    ),
    "state-removed": (
        sealed_then(lambda e: (e / "trial_0" / "result.json").unlink()),
        "result.json: expected the file as this sweep's rayfuse sealed it, got 'a missing file'",
    ),
    "folder-world-writable": (sealed_then(lambda e: e.chmod(0o777)), "planted: expected a sweep file only you can write"),
    "file-world-writable": (sealed_then(lambda e: (e / "tuner.pkl").chmod(0o666)), "tuner.pkl: expected a sweep file only you can write"),
    "storage-world-writable": (sealed_then(lambda e: e.parent.chmod(0o777)), "storage: expected a sweep storage folder only you can write"),
    "key-readable-by-others": (
        sealed_then(lambda e: key_file_of_test().chmod(0o644)),
        "sweep.key: expected a key file of yours that only you can read",
    ),
    "key-missing": (sealed_then(lambda e: key_file_of_test().unlink()), "sweep.key: expected this user's sweep key"),
}


def key_file_of_test() -> Path:
    from rayfuse.sweep_seal import key_file

    return key_file()


@pytest.mark.parametrize("case", sorted(SWEEP_CORPUS))
def test_a_sweep_folder_not_sealed_by_this_users_rayfuse_is_refused_and_nothing_is_unpickled(tmp_path, monkeypatch, capsys, case):
    plant, expect = SWEEP_CORPUS[case]
    monkeypatch.setenv("RAYFUSE_HOME", str(tmp_path / "me"))
    space, experiment = sweep_space(tmp_path)
    marker = tmp_path / "marker"
    sweep_folder(experiment, marker)
    plant(experiment, tmp_path, monkeypatch)
    import actors.tune

    connected: list[str | None] = []
    monkeypatch.setattr(actors.tune, "_connect", lambda spec, address: connected.append(address) or False)
    assert main(["tune", str(space), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rayfuse: error: ") and expect in err[0], err
    assert not marker.exists()  # the planted pickle never ran
    assert not connected  # refused before rayfuse attached to or started a Ray (another test's session may hold one)


def test_a_sealed_folder_verifies_and_its_pinned_tuner_pkl_stays_pinned(tmp_path, monkeypatch):
    from rayfuse.sweep_seal import SEAL_FILE, sealing, verify_sweep

    monkeypatch.setenv("RAYFUSE_HOME", str(tmp_path / "me"))
    _, experiment = sweep_space(tmp_path)
    sweep_folder(experiment, tmp_path / "marker")
    with sealing(experiment, every=0.05) as pins:
        (experiment / "experiment_state-2024-01-01_00-00-00.json").write_text('{"trial_data": [1]}')  # Tune saves again
        replace_pickle(experiment)  # tuner.pkl is written once, at the start: a later change is never sealed
    sealed = json.loads((experiment / SEAL_FILE).read_text())
    assert sealed["files"]["tuner.pkl"] == pins["tuner.pkl"] and not any(k.startswith("runs/") for k in sealed["files"])
    assert oct((tmp_path / "me" / "sweep.key").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(InputError, match="tuner.pkl: expected the file as this sweep's rayfuse sealed it"):
        verify_sweep(experiment)
    import pickle

    (experiment / "tuner.pkl").write_bytes(pickle.dumps(Planted(tmp_path / "marker")))  # the one sealed
    assert verify_sweep(experiment) == sealed["files"]
    (experiment / "runs" / "t0" / "partition.json").write_text("{}")  # the trials' run folders are rayfuse's own
    assert verify_sweep(experiment) == sealed["files"]


def test_sigterm_raises_interrupted_and_a_plain_keyboard_interrupt_keeps_the_signal():
    """Ray's ``ray.get`` turns the interrupt into a plain KeyboardInterrupt of its own: the signal is not lost."""
    import os
    import signal

    from rayfuse.interrupts import Interrupted, as_interrupted, sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_interrupt():
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this (the main) thread before the next statement
        assert info.value.signum == signal.SIGTERM and info.value.exit_code == 143
        assert as_interrupted(KeyboardInterrupt()).exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before
    with sigterm_as_interrupt():
        assert as_interrupted(KeyboardInterrupt()).exit_code == 130  # Ctrl-C
