"""Issue 31, classes 5 (the Python API's part) and 6: every argument of the Python API is checked before the run folder
exists, and no input hangs (the DP noise search is bounded; the sweep seal opens only regular files it owns).

Each bad case is refused within a time limit (it runs in a thread the test waits on: a hang fails the test instead of
stalling the suite) with exit code 2 and one line on stderr naming the key or file (``rayfuse.cli.main``), or with an
:class:`InputError` of one line naming the argument (the Python API); nothing is written in the case's folder. The
valid-but-unusual inputs at the end must succeed.

Sub-classes: ``api`` (5: the Python API's arguments), ``dp`` (6: the noise search), ``seal`` (6: the sweep seal).
"""

from __future__ import annotations

import math
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch import nn

import rayfuse
from rayfuse import api as rayfuse_api
from rayfuse.cli import main
from rayfuse.method import Method, MethodParams, MethodResult, ServerContext
from tests.config.test_bad_inputs import ROOT, Files, _snapshot, call, isolated, refused_line, with_base  # noqa: F401  (isolated: a fixture)
from tests.test_damaged_state import sweep_folder, sweep_space

TIME_LIMIT_S = 120.0  # far above what any case takes (seconds): reached only by a hang


@dataclass(frozen=True)
class Case:
    """A bad input: ``make(files)`` returns a command line (a list) or a callable (the Python API); ``names`` is what
    the one line must name. ``sub`` is the sub-class; ``env`` the environment it runs in."""

    id: str
    make: Callable[[Files], Any]
    names: str
    sub: str
    env: dict[str, str] = field(default_factory=dict)


CASES: list[Case] = []


def case(sub: str, id: str, names: str, env: dict[str, str] | None = None) -> Callable[[Callable[[Files], Any]], Callable[[Files], Any]]:
    def add(make: Callable[[Files], Any]) -> Callable[[Files], Any]:
        CASES.append(Case(id, make, names, sub, env or {}))
        return make

    return add


def local_run(config: Any = None, **kwargs: Any) -> Callable[[], Any]:
    return call(rayfuse.run, with_base() if config is None else config, backend=kwargs.pop("backend", "local"), quiet=True, **kwargs)


def arrays(n: int = 60, d: int = 4) -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(0).normal(size=(n, d)).astype(np.float32), np.arange(n) % 3


class TinyNet(nn.Module):
    def __init__(self, input_shape: tuple[int, ...] = (4,), num_classes: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(int(np.prod(input_shape)), num_classes)

    def forward(self, x: Any) -> Any:
        return self.fc(x.flatten(1))


# ---------------------------------------------------------------------------------------------------------------
# 5 (api). The Python API's arguments

case("api", "api-fuse-none", "config")(lambda f: call(rayfuse.fuse, None))
case("api", "api-fuse-number", "config")(lambda f: call(rayfuse.fuse, 42))
case("api", "api-fuse-empty-path", "config")(lambda f: call(rayfuse.fuse, "  "))
case("api", "api-fuse-out-not-a-path", "out")(lambda f: call(rayfuse.fuse, f.fuse(), out=3))
case("api", "api-fuse-progress-not-callable", "progress")(lambda f: call(rayfuse.fuse, f.fuse(), progress="yes"))
case("api", "api-fuse-checkpoints-none", "config")(lambda f: call(rayfuse_api.fuse_checkpoints, None))
case("api", "api-run-overrides-one-string", "overrides")(lambda f: local_run(overrides="train.epochs=2"))
case("api", "api-run-overrides-not-strings", "overrides")(lambda f: local_run(overrides=[("train.epochs", 2)]))
case("api", "api-run-run-dir-a-number", "run_dir")(lambda f: local_run(run_dir=5))
case("api", "api-run-backend-a-list", "backend")(lambda f: local_run(backend=["local"]))
case("api", "api-run-verbose-not-a-bool", "verbose")(lambda f: local_run(verbose="yes"))
case("api", "api-resume-none", "run_dir")(lambda f: call(rayfuse.resume, None))
case("api", "api-resume-overrides-one-string", "overrides")(
    lambda f: call(rayfuse.resume, str(f.root), overrides="federation.backend=local")
)
case("api", "api-config-a-number", "config")(lambda f: local_run(7))

# ragged and pandas data
case("api", "api-ragged-features", "dataset[0] (X)")(lambda f: local_run(dataset=([[1.0, 2.0], [3.0]] * 30, np.arange(60) % 3)))
case("api", "api-ragged-labels", "dataset[1] (y)")(lambda f: local_run(dataset=(arrays()[0], [[0], [1, 2]] * 30)))


def _frame(**extra: Any) -> Any:
    import pandas as pd

    X, y = arrays()
    return pd.DataFrame({**{f"f{i}": X[:, i] for i in range(X.shape[1])}, "y": y, **extra})


case("api", "api-dataframe-alone", "dataset: expected (X, y) arrays")(lambda f: local_run(dataset=_frame()))
case("api", "api-dataframe-text-column", "column 'city'")(
    lambda f: local_run(dataset=(_frame(city=["a", "b", "c"] * 20).drop(columns="y"), _frame()["y"]))
)
case("api", "api-dataframe-two-label-columns", "dataset[1] (y): expected one label column")(
    lambda f: local_run(dataset=(_frame().drop(columns="y"), _frame()[["y", "f0"]]))
)


class Pairs:
    """A map-style torch-like dataset of ``n`` pairs whose ``__getitem__`` raises at ``fail`` (``None``: never) and
    whose ``__len__`` raises with ``bad_len``."""

    def __init__(self, n: int = 60, fail: int | None = None, bad_len: bool = False, shapes: bool = False) -> None:
        self.X, self.y = arrays(n)
        self.fail, self.bad_len, self.shapes = fail, bad_len, shapes

    def __len__(self) -> int:
        if self.bad_len:
            raise RuntimeError("the index file is gone")
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        if i == self.fail:
            raise OSError(f"cannot read sample {i}")
        x = self.X[i] if not (self.shapes and i == 3) else self.X[i][:2]
        return x, int(self.y[i])


case("api", "api-dataset-getitem-raises", "dataset[0]: expected an (x, y) pair, got '__getitem__ raised OSError")(
    lambda f: local_run(dataset=Pairs(fail=0))
)
case("api", "api-dataset-getitem-raises-later", "dataset[17]")(lambda f: local_run(dataset=Pairs(fail=17)))
case("api", "api-dataset-len-raises", "dataset: expected a torch Dataset whose len() works")(
    lambda f: local_run(dataset=Pairs(bad_len=True))
)
case("api", "api-dataset-samples-of-two-shapes", "dataset: expected samples of one shape")(lambda f: local_run(dataset=Pairs(shapes=True)))

# arguments a config would ignore
_SILOS = {"silos": [{"dataset": "npz", "path": "a.npz"}, {"dataset": "npz", "path": "b.npz"}]}
case("api", "api-arrays-with-silos", "dataset: expected no dataset argument with a silo config")(
    lambda f: local_run({**with_base(evaluation="federated"), "data": _SILOS, "partition": {"num_clients": 2}}, dataset=arrays())
)
case("api", "api-arrays-with-data-path", "data.path")(
    lambda f: local_run(with_base(data={"dataset": "npz", "path": f.npz()}), dataset=arrays())
)
case("api", "api-arrays-with-data-features", "data.features")(
    lambda f: local_run(with_base(data={"dataset": "npz", "path": f.npz(), "features": "X"}), dataset=arrays())
)


# methods given as objects
class NoRun(Method):
    """A method whose author forgot the server loop."""


class DictParams(Method):
    Params = dict  # type: ignore[assignment]

    def run(self, server: ServerContext) -> MethodResult:
        return MethodResult(metrics={})


@dataclass
class _DataclassParams:
    k: int = 1


class DataclassParams(Method):
    Params = _DataclassParams  # type: ignore[assignment]

    def run(self, server: ServerContext) -> MethodResult:
        return MethodResult(metrics={})


class Fine(Method):
    class Params(MethodParams):
        k: int = 1

    def run(self, server: ServerContext) -> MethodResult:
        return MethodResult(metrics={})


def _instance_with_dict_params() -> Fine:
    instance = Fine()
    instance.params = {"k": 2}  # type: ignore[assignment]
    return instance


case("api", "api-method-without-run", "methods['mine']: expected a Method subclass that defines run")(
    lambda f: local_run(methods={"mine": NoRun})
)
case("api", "api-method-params-a-dict", "methods['mine'].Params: expected a params model")(
    lambda f: local_run(methods={"mine": DictParams})
)
case("api", "api-method-params-a-dataclass", "methods['mine'].Params")(lambda f: local_run(methods={"mine": DataclassParams}))
case("api", "api-method-instance-params-a-dict", "methods['mine'].params")(
    lambda f: local_run(methods={"mine": _instance_with_dict_params()})
)

# a model factory that returns one shared instance: refused, the same on both backends (before Ray is reached)
_SHARED = TinyNet((1, 8, 8), 10)  # digits: 8x8 images, 10 classes
_LAYER = nn.Linear(64, 10)
case("api", "api-factory-shared-instance", "model: expected a factory that builds a new nn.Module on every call")(
    lambda f: local_run(model=lambda: _SHARED)
)
case("api", "api-factory-shared-instance-on-ray", "model: expected a factory that builds a new nn.Module")(
    lambda f: local_run(model=lambda: _SHARED, backend="ray")
)
case("api", "api-factory-shared-layer", "models sharing tensors")(lambda f: local_run(model=lambda: nn.Sequential(nn.Flatten(), _LAYER)))
case("api", "api-factory-shared-default", "model: expected a factory that builds a new nn.Module")(
    lambda f: local_run(model={"default": lambda: _SHARED})
)
case("api", "api-factory-shared-for-one-client", "model: expected a factory that builds a new nn.Module")(
    lambda f: local_run(model={1: lambda shape, classes: _SHARED})
)
case(
    "api",
    "api-model-an-instance",
    "model: expected a model factory (the class, or a function returning a new nn.Module), not a model instance",
)(lambda f: local_run(model=_SHARED))
case("api", "api-model-an-instance-for-a-client", "model[0]: expected a model factory")(lambda f: local_run(model={0: _SHARED}))


# rayfuse_api.symmetry / build_architecture (rayfuse symmetry's Python form)
case("api", "api-symmetry-architecture-none", "architecture")(lambda f: call(rayfuse_api.symmetry, None))
case("api", "api-symmetry-args-a-list", "args: expected a mapping")(lambda f: call(rayfuse_api.symmetry, "mlp", args=[4]))
case("api", "api-symmetry-input-shape-text", "input_shape")(lambda f: call(rayfuse_api.symmetry, "mlp", input_shape="1,8,8"))
case("api", "api-symmetry-input-shape-zero", "input_shape")(lambda f: call(rayfuse_api.symmetry, "mlp", input_shape=(0,)))
case("api", "api-symmetry-input-shape-booleans", "input_shape")(lambda f: call(rayfuse_api.symmetry, "mlp", input_shape=[True, True]))
case("api", "api-symmetry-input-shape-fractional", "input_shape")(lambda f: call(rayfuse_api.build_architecture, "mlp", input_shape=[2.5]))
case("api", "api-symmetry-input-shape-huge", "input_shape: expected at most 16,777,216 values per sample")(
    lambda f: call(rayfuse_api.symmetry, "torchvision:resnet18", input_shape=(3, 40000, 40000))
)
case("api", "symmetry-input-shape-huge", "--input-shape: expected at most")(
    lambda f: ["symmetry", "torchvision:resnet18", "--input-shape", "3,40000,40000"]
)
case("api", "api-symmetry-unknown-dataset", "dataset: expected a dataset in")(lambda f: call(rayfuse_api.symmetry, "mlp", dataset="nope"))


# ---------------------------------------------------------------------------------------------------------------
# 6 (dp). The noise search for a target epsilon: bounded, unreachable targets refused before any client trains


def run_job(f: Files, *sets: str, command: str = "run") -> list[str]:
    args = [command, f.job()]
    for s in sets:
        args += ["--set", s]
    return args


_LOCAL = "methods={local: {}}"
for _target in ("1.0e300", "1.0e-300", "1.0e-9"):
    case("dp", f"run-dp-sgd-target-{_target}", "train.dp.target_epsilon")(
        lambda f, t=_target: run_job(f, _LOCAL, f"train.dp={{target_epsilon: {t}}}")
    )
    case("dp", f"run-upload-dp-target-{_target}", "methods.average.dp.target_epsilon")(
        lambda f, t=_target: run_job(f, f"methods.average.dp={{clip_norm: 1.0, target_epsilon: {t}}}")
    )
    case("dp", f"run-central-dp-target-{_target}", "methods.fedavg.dp.target_epsilon")(
        lambda f, t=_target: run_job(f, f"methods={{fedavg: {{rounds: 2, dp: {{clip_norm: 1.0, sample_rate: 0.5, target_epsilon: {t}}}}}}}")
    )
for _target in (".inf", ".nan"):
    case("dp", f"run-dp-sgd-target-{_target[1:]}", "train.dp.target_epsilon")(
        lambda f, t=_target: run_job(f, _LOCAL, f"train.dp={{target_epsilon: {t}}}")
    )
    case("dp", f"run-upload-dp-target-{_target[1:]}", "methods.average.dp.target_epsilon")(
        lambda f, t=_target: run_job(f, f"methods.average.dp={{clip_norm: 1.0, target_epsilon: {t}}}")
    )
case("dp", "validate-dp-sgd-target-1e300", "train.dp.target_epsilon")(
    lambda f: run_job(f, _LOCAL, "train.dp={target_epsilon: 1.0e300}", command="validate")
)
case("dp", "validate-upload-dp-prv-above-its-reach", "methods.average.dp.target_epsilon: expected an epsilon a noise multiplier reaches")(
    lambda f: run_job(f, "methods.average.dp={clip_norm: 1.0, target_epsilon: 1000.0, accountant: prv}", command="validate")
)
case("dp", "validate-dp-sgd-prv-1e300", "train.dp.target_epsilon")(
    lambda f: run_job(f, _LOCAL, "train.dp={target_epsilon: 1.0e300, accountant: prv}", command="validate")
)
case("dp", "tune-check-dp-sgd-target-1e300", "train.dp.target_epsilon")(
    lambda f: [
        "tune",
        f.space(base=f.job(methods={"local": {}}, train={"epochs": 1, "dp": {"target_epsilon": 1e300}}), metric="fused/local/accuracy"),
        "--check",
    ]
)
case("dp", "api-dp-sgd-target-1e300", "train.dp.target_epsilon")(
    lambda f: local_run(with_base(methods={"local": {}}, train={"epochs": 1, "dp": {"target_epsilon": 1e300}}))
)
case("dp", "api-upload-dp-target-1e-300", "methods.average.dp.target_epsilon")(
    lambda f: local_run(with_base(methods={"average": {"dp": {"clip_norm": 1.0, "target_epsilon": 1e-300}}}))
)


# GEMS' radius search (a bisection of [0, r_max] down to tol): a tol below r_max's float spacing never ended
case("dp", "run-gems-tol-below-float-spacing", "methods.gems.tol")(lambda f: run_job(f, "methods={gems: {tol: 1.0e-20}}"))
case("dp", "validate-gems-neuron-tol-tiny", "methods.gems.neuron_tol")(
    lambda f: run_job(f, "methods={gems: {neuron_tol: 1.0e-9, r_max: 1.0e6}}", command="validate")
)


# ---------------------------------------------------------------------------------------------------------------
# 6 (seal). rayfuse tune --resume: only regular files it owns are opened; a symlinked folder meets the folder's rules


def _sealed(f: Files) -> Path:
    """A sealed sweep folder under the case's folder (``RAYFUSE_HOME`` is the case's ``me``); returns it."""
    from rayfuse.sweep_seal import seal_sweep

    _, experiment = sweep_space(f.root)
    sweep_folder(experiment, f.root / "marker")
    seal_sweep(experiment)
    return experiment


def _tune_resume(f: Files) -> list[str]:
    return ["tune", str(f.root / "space.yaml"), "--resume"]


def seal_case(id: str, names: str) -> Callable[[Callable[[Files, Path], None]], Callable[[Files, Path], None]]:
    def add(plant: Callable[[Files, Path], None]) -> Callable[[Files, Path], None]:
        def make(f: Files) -> list[str]:
            experiment = _sealed(f)
            plant(f, experiment)
            return _tune_resume(f)

        case("seal", id, names)(make)
        return plant

    return add


def _key(f: Files) -> Path:
    return f.root / "me" / "sweep.key"


def _replace_by_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


@seal_case("seal-fifo-in-sweep-folder", "error.pkl: expected a regular file, a folder or a symbolic link")
def _fifo_added(f: Files, experiment: Path) -> None:
    os.mkfifo(experiment / "trial_0" / "error.pkl", 0o600)


@seal_case("seal-fifo-replaces-a-state-file", "result.json: expected a regular file")
def _fifo_replaces(f: Files, experiment: Path) -> None:
    _replace_by_fifo(experiment / "trial_0" / "result.json")


@seal_case("seal-fifo-as-tuner-pkl", "tuner.pkl: expected a regular file")
def _fifo_pickle(f: Files, experiment: Path) -> None:
    _replace_by_fifo(experiment / "tuner.pkl")


@seal_case("seal-fifo-as-the-seal", "rayfuse-seal.json: expected a regular file")
def _fifo_seal(f: Files, experiment: Path) -> None:
    _replace_by_fifo(experiment / "rayfuse-seal.json")


@seal_case("seal-fifo-as-the-key", "sweep.key: expected a key file of yours")
def _fifo_key(f: Files, experiment: Path) -> None:
    _replace_by_fifo(_key(f))


@seal_case("seal-key-a-link-to-a-fifo", "sweep.key: expected a key file of yours")
def _key_link(f: Files, experiment: Path) -> None:
    os.mkfifo(f.root / "pipe", 0o600)
    _key(f).unlink()
    _key(f).symlink_to(f.root / "pipe")


@seal_case("seal-socket-in-sweep-folder", "sock: expected a regular file, a folder or a symbolic link")
def _socket(f: Files, experiment: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.path.relpath(experiment / "sock"))  # relative: a socket's path is limited to ~108 bytes


@seal_case("seal-experiment-a-link-to-a-world-writable-folder", "elsewhere: expected a sweep file only you can write")
def _linked_experiment(f: Files, experiment: Path) -> None:
    target = f.root / "elsewhere"
    experiment.rename(target)
    target.chmod(0o777)
    experiment.symlink_to(target)


@seal_case("seal-experiment-a-link-below-a-world-writable-folder", "open: expected a folder only you can write above")
def _linked_below_open(f: Files, experiment: Path) -> None:
    shared = f.root / "open"
    shared.mkdir()
    target = shared / "sweep"
    experiment.rename(target)
    shared.chmod(0o777)
    experiment.symlink_to(target)


@seal_case("seal-trial-a-link-to-a-world-writable-folder", "planted-trial: expected a sweep file only you can write")
def _linked_trial(f: Files, experiment: Path) -> None:
    from rayfuse.sweep_seal import seal_sweep

    target = f.root / "planted-trial"
    target.mkdir(mode=0o700)
    (target / "result.json").write_text("{}\n")
    (experiment / "trial_1").symlink_to(target)
    seal_sweep(experiment)  # sealed with the link: its target is still checked
    target.chmod(0o777)


@seal_case("seal-storage-a-link-to-a-world-writable-folder", "real-storage: expected a sweep storage folder only you can write")
def _linked_storage(f: Files, experiment: Path) -> None:
    storage = experiment.parent
    storage.rename(f.root / "real-storage")
    storage.symlink_to(f.root / "real-storage")
    (f.root / "real-storage").chmod(0o777)


@seal_case("seal-fifo-sealed-while-the-sweep-ran", "fifo: expected a regular file, a folder or a symbolic link")
def _sealed_fifo(f: Files, experiment: Path) -> None:
    from rayfuse.sweep_seal import seal_sweep

    os.mkfifo(experiment / "fifo", 0o600)
    seal_sweep(experiment)  # listed by its kind, never opened


# ---------------------------------------------------------------------------------------------------------------
# The checks every case passes


def _release_fifos(root: Path) -> None:
    """Open every FIFO under ``root`` for writing and close it: a reader blocked on one (a failed case) returns."""
    for path in root.rglob("*"):
        try:
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        except OSError:
            continue


def within_limit(function: Callable[[], Any], root: Path) -> Any:
    """``function()`` in a thread that must end within ``TIME_LIMIT_S``: a hang fails the test (and the FIFOs a hung
    reader waits on are released so that the thread ends)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIME_LIMIT_S)
    if thread.is_alive():
        _release_fifos(root)
        thread.join(10)
        pytest.fail(f"the case did not end within {TIME_LIMIT_S:g} s: it hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.fixture
def case_dir(isolated):  # noqa: F811  (the fixture imported above)
    """The case's folder as the working directory, Ray seen as not started (``tests.config.test_bad_inputs``' ``isolated``)."""
    return isolated


@pytest.fixture
def no_ray(case_dir, monkeypatch):
    """The case's folder, Ray never started or joined: a case refused later than it should be fails loudly."""
    import actors.backend
    import actors.tune

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Ray was reached: the bad input was not refused before")

    monkeypatch.setattr(actors.tune, "_connect", refuse)
    monkeypatch.setattr(actors.backend.RayBackend, "start", refuse)
    monkeypatch.setenv("RAYFUSE_HOME", str(case_dir / "me"))
    return case_dir


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line_in_bounded_time_and_leaves_nothing_behind(bad: Case, no_ray: Path, capsys, monkeypatch) -> None:
    files = Files(no_ray)
    for key, value in bad.env.items():
        monkeypatch.setenv(key, value)
    command = bad.make(files)
    capsys.readouterr()
    before = _snapshot(no_ray)
    line = refused_line(command, capsys, lambda run: within_limit(run, no_ray))
    assert bad.names in line, line
    assert _snapshot(no_ray) == before
    assert not (no_ray / "marker").exists()  # a planted pickle never ran


def test_the_table_covers_each_sub_class() -> None:
    counts = {sub: sum(1 for c in CASES if c.sub == sub) for sub in ("api", "dp", "seal")}
    assert counts["api"] >= 25 and counts["dp"] >= 10 and counts["seal"] >= 10, counts
    assert len({c.id for c in CASES}) == len(CASES)


def test_a_fifo_key_does_not_hang_a_real_rayfuse_process(tmp_path, monkeypatch) -> None:
    """End to end: ``rayfuse tune --resume`` with a FIFO as the key, in a real process under a time limit."""
    from rayfuse.sweep_seal import seal_sweep

    monkeypatch.setenv("RAYFUSE_HOME", str(tmp_path / "me"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    space, experiment = sweep_space(tmp_path)
    sweep_folder(experiment, tmp_path / "marker")
    seal_sweep(experiment)
    _replace_by_fifo(tmp_path / "me" / "sweep.key")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "rayfuse", "tune", str(space), "--resume"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIME_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        _release_fifos(tmp_path)
        pytest.fail("rayfuse tune --resume hangs on a FIFO key")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "sweep.key: expected a key file of yours" in lines[0] and "FIFO" in lines[0], proc.stderr
    assert not (tmp_path / "marker").exists()


# ---------------------------------------------------------------------------------------------------------------
# Valid but unusual: these must succeed


def _quick(run_dir: Path, **kwargs: Any) -> Any:
    config = with_base(train={"epochs": 1}, methods={"average": {}})
    return rayfuse.run(config, backend="local", quiet=True, run_dir=run_dir, **kwargs)


def test_pandas_features_and_labels_are_read_as_their_values(case_dir) -> None:
    frame = _frame()
    result = _quick(case_dir / "a", dataset=(frame.drop(columns="y"), frame["y"]))
    by_arrays = _quick(case_dir / "b", dataset=(frame.drop(columns="y").to_numpy(), frame["y"].to_numpy()))
    assert result.metrics.loc["average", "accuracy"] == by_arrays.metrics.loc["average", "accuracy"]
    assert result.input_shape == (4,)


def test_bfloat16_tensors_and_a_pandas_nullable_column_are_accepted(case_dir) -> None:
    import pandas as pd
    import torch

    X, y = arrays()
    assert _quick(case_dir / "a", dataset=(torch.tensor(X).to(torch.bfloat16), torch.tensor(y))).input_shape == (4,)
    frame = pd.DataFrame({"a": pd.array(np.arange(60) % 7, dtype="Int64"), "b": X[:, 0]})
    assert _quick(case_dir / "b", dataset=(frame, pd.Series(y))).input_shape == (2,)


def test_a_factory_building_a_new_model_each_call_runs_and_a_params_model_method_passes(case_dir) -> None:
    from rayfuse.api import _check_method_object

    result = _quick(case_dir / "a", model=lambda shape, classes: TinyNet(shape, classes), dataset=arrays())
    assert result.model("average").fc.in_features == 4
    _check_method_object(Fine, "methods['fine']")  # a Method with run and a MethodParams: accepted
    _check_method_object(Fine(), "methods['fine']")


_TABLE: Any = None


class WithSharedTable(nn.Module):
    """A model whose instances share one constant lookup table (a non-persistent buffer): never written, so allowed."""

    def __init__(self) -> None:
        import torch

        global _TABLE
        super().__init__()
        if _TABLE is None:
            _TABLE = torch.ones(64)
        self.register_buffer("table", _TABLE, persistent=False)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: Any) -> Any:
        return self.fc(x.flatten(1) * self.table)


def test_a_factory_whose_models_share_only_a_constant_table_runs(case_dir) -> None:
    config = with_base(train={"epochs": 1}, methods={"average": {}})
    result = rayfuse.run(config, model=WithSharedTable, backend="local", quiet=True, run_dir=case_dir / "run")
    assert "average" in result.models


def test_the_default_quickstart_arrays_replace_data_dataset(case_dir) -> None:
    config = with_base(data={"dataset": "digits"}, train={"epochs": 1})  # the config's data.dataset is what arrays replace
    assert rayfuse.run(config, dataset=arrays(), backend="local", quiet=True, run_dir=case_dir / "run").input_shape == (4,)


@pytest.mark.parametrize(
    "target, delta, rate, steps, accountant",
    [
        (2.0, 1e-5, 0.1, 40, "rdp"),
        (0.5, 1e-5, 1.0, 1, "rdp"),
        (8.0, 1e-4, 0.05, 300, "rdp"),
        (1e4, 1e-5, 1.0, 1, "rdp"),
        (0.5, 1e-5, 1.0, 1, "prv"),
        (90.0, 1e-5, 1.0, 1, "prv"),
    ],
)
def test_the_bounded_search_finds_opacus_noise_for_every_reachable_target(target, delta, rate, steps, accountant) -> None:
    from opacus.accountants.utils import get_noise_multiplier

    from rayfuse.updates.accountant import compute_epsilon, noise_multiplier_for

    z = noise_multiplier_for(target, delta, rate, steps, accountant)
    assert z == get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=rate, steps=steps, accountant=accountant)
    assert compute_epsilon(z, rate, steps, delta, accountant) <= target


def test_dp_sgd_takes_make_private_with_epsilons_noise() -> None:
    from opacus.accountants.utils import get_noise_multiplier

    from rayfuse.models.privacy import dp_sgd_noise_multiplier

    for batches, epochs in ((3, 2), (7, 5), (1, 1)):
        expected = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-4, sample_rate=1 / batches, epochs=epochs, accountant="rdp")
        assert dp_sgd_noise_multiplier(2.0, 1e-4, batches, epochs) == expected


@pytest.mark.parametrize("target", [1e300, 1e-300, math.inf, math.nan, -1.0])
def test_the_search_ends_quickly_on_any_target(target) -> None:
    import time

    from rayfuse.updates.accountant import UnreachableEpsilon, noise_multiplier_for

    started = time.perf_counter()
    for accountant in ("rdp", "prv"):
        with pytest.raises(UnreachableEpsilon):
            within_limit(lambda: noise_multiplier_for(target, 1e-5, 0.01, 2000, accountant), Path("."))
    assert time.perf_counter() - started < TIME_LIMIT_S


def test_a_large_reachable_target_validates(case_dir, capsys) -> None:
    assert main(["validate", Files(case_dir).job(methods={"average": {"dp": {"clip_norm": 1.0, "target_epsilon": 1e4}}})]) == 0


def test_a_sweep_folder_reached_through_a_link_of_ones_own_verifies(tmp_path, monkeypatch) -> None:
    from rayfuse.sweep_seal import seal_sweep, verify_sweep

    monkeypatch.setenv("RAYFUSE_HOME", str(tmp_path / "me"))
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    _, experiment = sweep_space(real)
    sweep_folder(experiment, tmp_path / "marker")
    for folder in (real, real / "storage", experiment):
        folder.chmod(0o700)
    linked_storage = tmp_path / "storage-link"
    linked_storage.symlink_to(real / "storage")
    sealed = seal_sweep(linked_storage / "planted")
    assert verify_sweep(linked_storage / "planted", linked_storage) == sealed
    assert not (tmp_path / "marker").exists()


def test_the_radius_search_ends_even_below_the_float_spacing() -> None:
    """Called directly (not through the checked parameters), a tol below r_max's spacing ends where no float is left."""
    from rayfuse.fusion.gems.balls import search_radii

    def passes(samples: Any, ids: Any) -> Any:
        return np.ones(samples.shape[:2], dtype=bool)  # every radius passes: the search climbs to r_max

    found = within_limit(
        lambda: search_radii(passes, np.zeros((2, 3)), num_samples=4, r_max=4000.0, tol=1e-20, rng=np.random.default_rng(0)), Path(".")
    )
    assert found.steps < 100 and np.allclose(found.radius, 4000.0)


def test_a_numpy_or_torch_shape_is_a_shape() -> None:
    import torch

    by_tuple = rayfuse_api.symmetry("mlp", input_shape=(64,))
    assert rayfuse_api.symmetry("mlp", input_shape=np.array([64])).to_dict() == by_tuple.to_dict()
    assert rayfuse_api.symmetry("mlp", input_shape=torch.Size([64])).to_dict() == by_tuple.to_dict()
