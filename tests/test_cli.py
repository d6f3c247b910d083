"""The command line: exit codes, one-line errors, list / validate, a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayfuse.cli import default_job, main

ROOT = Path(__file__).resolve().parents[1]


def rayfuse(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayfuse", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_list_shows_every_registry(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for word in (
        "methods:",
        "fedavg",
        "fedprox",
        "global",
        "datasets:",
        "digits",
        "mnist",
        "parquet",
        "partitioners:",
        "dirichlet",
        "hetero-dir",
        "models:",
        "cnn",
        "torchvision:<name>",
    ):
        assert word in out


def test_list_one_kind(capsys):
    assert main(["list", "partitioners"]) == 0
    out = capsys.readouterr().out
    assert "shards" in out and "methods:" not in out


def test_validate_prints_the_resolved_config(capsys):
    assert main(["validate", str(ROOT / "jobs" / "quickstart.yaml"), "--set", "methods.fedavg.rounds=3"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["methods"]["fedavg"]["rounds"] == 3
    assert resolved["methods"]["fedavg"]["fraction"] == 1.0  # defaults filled in


def test_default_job_is_the_quickstart():
    assert default_job() == ROOT / "jobs" / "quickstart.yaml"


@pytest.mark.parametrize(
    "args, key",
    [
        (["run", "--set", "partition.alpha=-1"], "partition.alpha"),
        (["run", "--set", "methods.fedavg.roundz=3"], "methods.fedavg.roundz"),
        (["run", "--set", "data.dataset=digitz"], "data.dataset"),
        (["run", "no-such-file.yaml"], "no-such-file.yaml"),
        (["run", "--set", "nonsense"], "--set"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(args, key):
    result = rayfuse(*args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rayfuse: error: ") and key in lines[0]
    assert "Traceback" not in result.stderr


def test_a_local_run_from_the_command_line(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "partition": {"num_clients": 3},
                "model": {"hidden": [8]},
                "train": {"epochs": 2},
                "methods": {"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}},
            }
        )
    )
    out = tmp_path / "run"
    result = rayfuse("run", str(config), "--local", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "average" in result.stdout and "fedavg" in result.stdout and "accuracy" in result.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "succeeded" and results["run"]["backend"] == "local"


def test_a_failed_run_exits_1(tmp_path):
    out = tmp_path / "run"
    result = rayfuse(
        "run",
        "--local",
        "--out",
        str(out),
        "--set",
        "methods=[fedavg]",
        "--set",
        "methods.fedavg.rounds=1",
        "--set",
        "federation.on_client_failure=fail",
        "--set",
        "partition.num_clients=2",
        "--set",
        "train.epochs=1",
        "--set",
        "federation.faults=[{client: 1, step: fedavg.fit, mode: raise}]",
    )
    assert result.returncode == 1
    assert "rayfuse: run failed: client 1 failed in step fedavg.fit" in result.stderr
    assert json.loads((out / "results.json").read_text())["status"] == "failed"


def test_resume_rejects_a_config_argument(tmp_path):
    result = rayfuse("run", "jobs/quickstart.yaml", "--resume", str(tmp_path))
    assert result.returncode == 2 and "--resume" in result.stderr
