"""Issue 19's corpus of bad inputs: every case is refused with exit code 2 (``InputError`` from the Python API), one
line on stderr naming the key path, file or tensor, no traceback, and nothing written where the case ran.

The cases run in-process (``rayfuse.cli.main`` with ``capsys``, or the API), with the working directory in the test's
own folder, which is compared file by file before and after. A few run as real subprocesses to show the exit code and
the absence of a traceback end to end, including an unreachable cluster address refused well within the
subprocess's time limit.

Classes (issue 19's numbering): 3 cluster addresses, 5 where outputs go, 6 user data files, 7 config files and
values, 8 checkpoints for ``rayfuse fuse``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import rayfuse
from rayfuse.cli import main
from rayfuse.errors import InputError

ROOT = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "run": {"name": "bad", "seed": 0},
    "data": {"dataset": "digits"},
    "partition": {"method": "iid", "num_clients": 2},
    "model": {"name": "mlp", "hidden": [8]},
    "train": {"epochs": 1},
    "methods": {"average": {}},
}

BOMB = (
    "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]) + "\n"
)


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Files:
    """The files of one case, written on demand into the case's folder (relative names: the working directory)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def text(self, name: str, text: str) -> str:
        (self.root / name).write_text(text, encoding="utf-8")
        return name

    def raw(self, name: str, data: bytes) -> str:
        (self.root / name).write_bytes(data)
        return name

    def yaml(self, name: str, data: Any) -> str:
        return self.text(name, yaml.safe_dump(data, sort_keys=False))

    def job(self, name: str = "job.yaml", **sections: Any) -> str:
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
        for key, value in sections.items():
            data[key] = (
                {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) and key != "methods" else value
            )
        return self.yaml(name, data)

    def a_file(self) -> str:
        return self.text("a-file", "not a folder\n")

    def readonly(self) -> str:
        """A folder in which nothing can be created (chmod for a user; /sys, which refuses even root, for root)."""
        if os.geteuid() != 0:
            folder = self.root / "read-only"
            folder.mkdir(exist_ok=True)
            folder.chmod(0o555)
            return str(folder)
        if not Path("/sys").is_dir() or os.access("/sys", os.W_OK) and _can_create("/sys"):
            pytest.skip("no read-only folder to test with as root")
        return "/sys"

    def npz(self, name: str = "data.npz", **arrays: Any) -> str:
        """``X`` (60 x 4) and ``y`` (3 classes), with the arrays given replacing them (``None``: left out)."""
        content = {"X": np.random.default_rng(0).normal(size=(60, 4)).astype(np.float32), "y": np.arange(60) % 3}
        for key, value in arrays.items():
            if value is None:
                content.pop(key, None)
            else:
                content[key] = value
        np.savez(self.root / name, **content)
        return name

    def parquet(self, name: str = "data.parquet", **columns: Any) -> str:
        import pandas as pd

        rng = np.random.default_rng(0)
        frame = {"a": rng.normal(size=60), "b": rng.normal(size=60), "y": np.arange(60) % 3}
        frame.update(columns)
        pd.DataFrame({k: v for k, v in frame.items() if v is not None}).to_parquet(self.root / name)
        return name

    def space(self, name: str = "space.yaml", base: str | None = None, **fields: Any) -> str:
        data = {
            "base": str(self.root / (base or self.job())),
            "space": {"train.lr": {"grid": [0.01]}},
            "metric": "fused/average/accuracy",
            "mode": "max",
            **fields,
        }
        return self.yaml(name, data)

    def params(self, name: str, params: dict[str, Any], as_torch: bool = False) -> str:
        if as_torch:
            import torch

            torch.save(params, self.root / name)
        else:
            from safetensors.torch import save_file

            save_file(params, str(self.root / name))
        return name

    def models(self, dtype: str = "float32") -> list[str]:
        import torch

        gen = torch.Generator().manual_seed(0)
        names = []
        for i in range(2):
            tensors = {
                "weight": torch.randn(4, 3, generator=gen).to(getattr(torch, dtype)),
                "bias": torch.randn(4, generator=gen).to(getattr(torch, dtype)),
            }
            names.append(self.params(f"m{i}.safetensors", tensors))
        return names

    def fuse(self, models: list[str] | None = None, name: str = "fuse.yaml", **fields: Any) -> str:
        data = {
            "merge_method": "average",
            "models": [{"model": m} for m in (models or self.models())],
            "output": "fused.safetensors",
            **fields,
        }
        return self.yaml(name, data)


def _can_create(folder: str) -> bool:
    try:
        os.rmdir(__import__("tempfile").mkdtemp(dir=folder))
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Case:
    """A bad input: ``make(files)`` returns the command line (a list) or, for the Python API, a callable; ``names`` is
    what the one line must name (a key path, a file, a tensor)."""

    id: str
    make: Callable[[Files], Any]
    names: str
    cls: int
    env: dict[str, str] = field(default_factory=dict)


CASES: list[Case] = []


def case(cls: int, id: str, names: str, env: dict[str, str] | None = None) -> Callable[[Callable[[Files], Any]], Callable[[Files], Any]]:
    def add(make: Callable[[Files], Any]) -> Callable[[Files], Any]:
        CASES.append(Case(id, make, names, cls, env or {}))
        return make

    return add


def run_cli(*args: str) -> Callable[[Files], list[str]]:
    """``rayfuse run JOB ARGS...`` on the tiny base job."""
    return lambda f: ["run", f.job(), *args]


def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """``function(*args, **kwargs)`` to call later: the arguments (and the files they write) are made now."""
    return lambda: function(*args, **kwargs)


def api_run(config: Callable[[Files], Any], **kwargs: Any) -> Callable[[Files], Callable[[], Any]]:
    return lambda f: call(rayfuse.run, config(f), **kwargs)


def with_base(**sections: Any) -> dict[str, Any]:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(data.get(key), dict) and key != "methods" else value
    return data


# ---------------------------------------------------------------------------------------------------------------
# 3. Cluster addresses: malformed ones refused by the schema, unreachable ones by a probe before Ray starts

for _i, _address in enumerate(["not-an-address", "http://head:8265", "head:99999", ":6379", "head:", "ray//head:10001"]):
    case(3, f"run-address-malformed-{_i}", "federation.address")(run_cli("--address", _address))
case(3, "validate-address-malformed", "federation.address")(lambda f: ["validate", f.job(), "--set", "federation.address=not-an-address"])
case(3, "validate-address-port-0", "federation.address")(lambda f: ["validate", f.job(), "--set", "federation.address=head:0"])
case(3, "tune-check-address-malformed", "federation.address")(
    lambda f: ["tune", f.space(), "--check", "--set", "federation.address=no address"]
)
case(3, "run-address-closed-port", "federation.address")(lambda f: ["run", f.job(), "--address", f"127.0.0.1:{closed_port()}"])
case(3, "run-set-address-closed-port", "federation.address")(
    lambda f: ["run", f.job(), "--set", f"federation.address=127.0.0.1:{closed_port()}"]
)
case(3, "run-ray-client-closed-port", "federation.address")(lambda f: ["run", f.job(), "--address", f"ray://127.0.0.1:{closed_port()}"])
case(3, "run-config-address-closed-port", "federation.address")(
    lambda f: ["run", f.job(federation={"address": f"127.0.0.1:{closed_port()}"})]
)
case(3, "run-ray-address-env-closed-port", "RAY_ADDRESS", env={"RAY_ADDRESS": "127.0.0.1:{port}"})(run_cli())
case(3, "tune-address-closed-port", "federation.address")(lambda f: ["tune", f.space(), "--address", f"127.0.0.1:{closed_port()}"])
case(3, "api-address-closed-port", "federation.address")(api_run(lambda f: with_base(federation={"address": f"127.0.0.1:{closed_port()}"})))
case(3, "api-address-malformed", "federation.address")(api_run(lambda f: with_base(federation={"address": "nowhere"})))
case(3, "resume-address-malformed", "federation.address")(
    lambda f: ["run", "--resume", str(_run_folder(f)), "--set", "federation.address=not-an-address"]
)


def _run_folder(f: Files) -> Path:
    """A finished-looking run folder (its config.yaml only) to hand to --resume."""
    folder = f.root / "old-run"
    folder.mkdir(exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(BASE))
    return folder


# ---------------------------------------------------------------------------------------------------------------
# 5. Where outputs go: checked writable before anything starts (before the data loads)

case(5, "run-out-is-a-file", "--out")(lambda f: ["run", f.job(), "--out", f.a_file()])
case(5, "run-out-under-a-file", "--out")(lambda f: ["run", f.job(), "--out", f.a_file() + "/run"])
case(5, "run-out-read-only", "--out")(lambda f: ["run", f.job(), "--out", f.readonly() + "/rayfuse-run"])
case(5, "run-storage-is-a-file", "run.storage")(lambda f: ["run", f.job(), "--set", f"run.storage={f.a_file()}"])
case(5, "run-storage-under-a-file", "run.storage")(lambda f: ["run", f.job(), "--set", f"run.storage={f.a_file()}/runs"])
case(5, "run-storage-read-only", "run.storage")(lambda f: ["run", f.job(), "--set", f"run.storage={f.readonly()}/rayfuse-runs"])
case(5, "run-config-storage-is-a-file", "run.storage")(lambda f: ["run", f.job(run={"storage": f.a_file()})])
case(5, "run-model-cache-is-a-file", "run.model_cache")(lambda f: ["run", f.job(), "--set", f"run.model_cache={f.a_file()}"])
case(5, "run-model-cache-read-only", "run.model_cache")(lambda f: ["run", f.job(), "--set", f"run.model_cache={f.readonly()}/cache"])
case(5, "run-storage-checked-before-the-data-loads", "run.storage")(
    lambda f: ["run", f.job(data={"dataset": "npz", "path": "missing.npz"}), "--set", f"run.storage={f.a_file()}"]
)
case(5, "api-run-dir-under-a-file", "run_dir")(lambda f: call(rayfuse.run, with_base(), run_dir=f.a_file() + "/run"))
case(5, "api-run-dir-read-only", "run_dir")(lambda f: call(rayfuse.run, with_base(), run_dir=f.readonly() + "/rayfuse-run"))
case(5, "api-storage-is-a-file", "run.storage")(api_run(lambda f: with_base(run={"storage": f.a_file()})))
case(5, "fuse-output-under-a-file", "output")(lambda f: ["fuse", f.fuse(output=f.a_file() + "/fused.safetensors")])
case(5, "fuse-output-read-only", "output")(lambda f: ["fuse", f.fuse(output=f.readonly() + "/fused.safetensors")])
case(5, "fuse-out-argument-under-a-file", "output")(lambda f: ["fuse", f.fuse(), f.a_file() + "/x.safetensors"])
case(5, "api-fuse-out-read-only", "output")(lambda f: call(rayfuse.fuse, f.fuse(), out=f.readonly() + "/x.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# 6. User data files: one check for run, validate, tune --check, the Python API and rayfuse fuse's data


def _nan_labels(f: Files) -> str:
    return f.npz(y=np.where(np.arange(60) == 5, np.nan, np.arange(60) % 3))


def _inf_labels(f: Files) -> str:
    return f.npz(y=np.where(np.arange(60) == 7, np.inf, np.arange(60) % 3))


def _npy_as_npz(f: Files) -> str:
    np.save(f.root / "arr.npy", np.zeros((60, 4), np.float32))
    (f.root / "arr.npy").rename(f.root / "data.npz")
    return "data.npz"


def _nan_features(f: Files) -> str:
    X = np.ones((60, 4), np.float32)
    X[3, 1] = np.nan
    return f.npz(X=X)


def _inf_features(f: Files) -> str:
    X = np.ones((60, 4), np.float32)
    X[0, 0] = np.inf
    return f.npz(X=X)


def _pickled(f: Files) -> str:
    np.savez(f.root / "data.npz", X=np.zeros((60, 4)), y=np.array([{"a": 1}] * 60, dtype=object))
    return "data.npz"


def _parquet_null_labels(f: Files) -> str:
    import pandas as pd

    return f.parquet(y=pd.array([None if i == 3 else f"c{i % 3}" for i in range(60)], dtype=object))


def _parquet_nan_labels(f: Files) -> str:
    return f.parquet(y=np.where(np.arange(60) == 2, np.nan, np.arange(60) % 3))


def _parquet_null_feature(f: Files) -> str:
    import pandas as pd

    return f.parquet(a=pd.array([None if i == 4 else 1 for i in range(60)], dtype="Int64"))


DATA_FILES: dict[str, tuple[Callable[[Files], str], str, str]] = {
    # name: (writes the file, the dataset, what the line names)
    "nan-labels": (_nan_labels, "npz", "data.label"),
    "inf-labels": (_inf_labels, "npz", "data.label"),
    "npy-named-npz": (_npy_as_npz, "npz", "data.npz"),
    "empty-file": (lambda f: f.raw("data.npz", b""), "npz", "data.npz"),
    "empty-archive": (lambda f: f.npz(X=None, y=None), "npz", "data.npz"),
    "garbage-npz": (lambda f: f.raw("data.npz", b"PK\x03\x04 not a zip at all"), "npz", "data.npz"),
    "missing-label-array": (lambda f: f.npz(y=None, labels=np.arange(60) % 2), "npz", "data.label"),
    "missing-features-array": (lambda f: f.npz(X=None, features=np.zeros((60, 4))), "npz", "data.features"),
    "unequal-lengths": (lambda f: f.npz(y=np.arange(59) % 3), "npz", "data.label"),
    "nan-features": (_nan_features, "npz", "data.features"),
    "inf-features": (_inf_features, "npz", "data.features"),
    "one-class": (lambda f: f.npz(y=np.zeros(60, np.int64)), "npz", "data.label"),
    "pickled-labels": (_pickled, "npz", "data.npz"),
    "text-features": (lambda f: f.npz(X=np.array([["a"] * 4] * 60)), "npz", "data.features"),
    "one-dimensional-features": (lambda f: f.npz(X=np.zeros(60, np.float32)), "npz", "data.features"),
    "complex-features": (lambda f: f.npz(X=np.ones((60, 4), np.complex64)), "npz", "data.features"),
    "no-features": (lambda f: f.npz(X=np.zeros((60, 0), np.float32)), "npz", "data.features"),
    "folder-named-npz": (lambda f: ((f.root / "data.npz").mkdir(), "data.npz")[1], "npz", "data.path"),
    "missing-npz": (lambda f: "nowhere.npz", "npz", "data.path"),
    "parquet-null-labels": (_parquet_null_labels, "parquet", "data.label"),
    "parquet-nan-labels": (_parquet_nan_labels, "parquet", "data.label"),
    "parquet-null-feature": (_parquet_null_feature, "parquet", "data.features"),
    "parquet-no-label-column": (lambda f: f.parquet(y=None), "parquet", "data.label"),
    "parquet-garbage": (lambda f: f.raw("data.parquet", b"PAR1 garbage"), "parquet", "data.parquet"),
}

for _name, (_write, _kind, _names) in DATA_FILES.items():
    case(6, f"run-data-{_name}", _names)(lambda f, w=_write, k=_kind: ["run", f.job(data={"dataset": k, "path": w(f)})])
for _name in (
    "nan-labels",
    "npy-named-npz",
    "empty-file",
    "empty-archive",
    "unequal-lengths",
    "one-class",
    "pickled-labels",
    "parquet-null-labels",
    "parquet-nan-labels",
    "nan-features",
):
    _write, _kind, _names = DATA_FILES[_name]
    case(6, f"validate-data-{_name}", _names)(lambda f, w=_write, k=_kind: ["validate", f.job(data={"dataset": k, "path": w(f)})])
for _name in ("nan-labels", "npy-named-npz", "empty-file", "parquet-null-labels", "one-class", "inf-features"):
    _write, _kind, _names = DATA_FILES[_name]
    case(6, f"tune-check-data-{_name}", _names)(
        lambda f, w=_write, k=_kind: ["tune", f.space(base=f.job(data={"dataset": k, "path": w(f)})), "--check"]
    )
for _name in ("nan-labels", "npy-named-npz", "empty-file"):
    _write, _kind, _names = DATA_FILES[_name]
    case(6, f"fuse-data-{_name}", _names)(
        lambda f, w=_write: [
            "fuse",
            f.fuse(
                merge_method="activation_matching",
                architecture="torch.nn:Linear",
                architecture_args={"in_features": 3, "out_features": 4},
                data={"path": w(f)},
            ),
        ]
    )
case(6, "validate-data-options-unknown", "data.options.colour")(
    lambda f: ["validate", f.job(data={"dataset": "npz", "path": f.npz(), "options": {"colour": "red"}})]
)
case(6, "validate-synthetic-one-class", "data.options.n_classes")(
    lambda f: ["validate", f.job(data={"dataset": "synthetic", "options": {"n_classes": 1}})]
)
case(6, "validate-synthetic-boolean-count", "data.options.n_samples")(
    lambda f: ["validate", f.job(data={"dataset": "synthetic", "options": {"n_samples": True}})]
)
case(6, "tune-check-data-options-unknown", "data.options.colour")(
    lambda f: ["tune", f.space(base=f.job(data={"dataset": "digits", "options": {"colour": "red"}})), "--check"]
)
case(6, "api-nan-labels", "dataset")(
    lambda f: call(rayfuse.run, with_base(), dataset=(np.ones((60, 4)), np.where(np.arange(60) == 1, np.nan, np.arange(60) % 2)))
)
case(6, "api-null-labels", "dataset")(
    lambda f: call(rayfuse.run, with_base(), dataset=(np.ones((60, 4)), np.array([None] + ["a", "b"] * 29 + ["a"], dtype=object)))
)
case(6, "api-inf-features", "dataset")(lambda f: call(rayfuse.run, with_base(), dataset=(np.full((60, 4), np.inf), np.arange(60) % 2)))
case(6, "api-one-class", "dataset")(lambda f: call(rayfuse.run, with_base(), dataset=(np.ones((60, 4)), np.zeros(60))))
case(6, "api-mixed-label-kinds", "dataset")(
    lambda f: call(rayfuse.run, with_base(), dataset=(np.ones((60, 4)), np.array([1, "a"] * 30, dtype=object)))
)


# ---------------------------------------------------------------------------------------------------------------
# 7. Config files and values

LATIN1 = "run:\n  name: caf\xe9\n".encode("latin-1")
BAD_TEXTS: dict[str, tuple[Callable[[Files, str], str], str]] = {
    # name: (writes the file under the given name, what the line names: the file, or file + key path)
    "latin1": (lambda f, n: f.raw(n, LATIN1), ""),
    "utf16": (lambda f, n: f.raw(n, "run: {name: x}\n".encode("utf-16")), ""),
    "duplicate-top-key": (lambda f, n: f.text(n, "run: {name: a}\nmethods: [average]\nrun: {name: b}\n"), "run"),
    "duplicate-nested-key": (
        lambda f, n: f.text(n, "partition:\n  num_clients: 2\n  alpha: 0.5\n  num_clients: 3\n"),
        "partition.num_clients",
    ),
    "alias-bomb": (lambda f, n: f.text(n, BOMB), ""),
    "recursive-alias": (lambda f, n: f.text(n, "run: &r {name: x, again: *r}\n"), ""),
    "deep-nesting": (lambda f, n: f.text(n, "run: " + "[" * 3000 + "]" * 3000 + "\n"), ""),
    "two-documents": (lambda f, n: f.text(n, "run: {name: a}\n---\nrun: {name: b}\n"), ""),
}

for _name, (_write, _key) in BAD_TEXTS.items():
    case(7, f"run-config-{_name}", f"job.yaml: {_key}".rstrip(": "))(lambda f, w=_write: ["run", w(f, "job.yaml")])
    case(7, f"validate-config-{_name}", f"job.yaml: {_key}".rstrip(": "))(lambda f, w=_write: ["validate", w(f, "job.yaml")])
for _name in ("latin1", "duplicate-nested-key", "alias-bomb", "recursive-alias"):
    _write, _key = BAD_TEXTS[_name]
    case(7, f"tune-space-{_name}", "space.yaml")(lambda f, w=_write: ["tune", w(f, "space.yaml"), "--check"])
    case(7, f"fuse-config-{_name}", "fuse.yaml")(lambda f, w=_write: ["fuse", w(f, "fuse.yaml")])
    case(7, f"api-config-file-{_name}", "job.yaml")(lambda f, w=_write: call(rayfuse.run, w(f, "job.yaml")))
case(7, "tune-base-job-duplicate-key", "job.yaml: partition.num_clients")(
    lambda f: ["tune", f.space(base=BAD_TEXTS["duplicate-nested-key"][0](f, "job.yaml")), "--check"]
)
case(7, "fuse-duplicate-model-key", "fuse.yaml: models.0.model")(
    lambda f: [
        "fuse",
        f.text("fuse.yaml", "merge_method: average\nmodels:\n  - model: a.safetensors\n    model: b.safetensors\noutput: o.safetensors\n"),
    ]
)
case(7, "set-value-alias-bomb", "--set run.name")(lambda f: ["validate", f.job(), "--set", "run.name=[" + _flow_bomb() + "]"])


def _flow_bomb() -> str:
    """An alias bomb in YAML's flow style, for one --set value."""
    parts = ["&a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    return ", ".join(parts)


_BOOLEAN_INTS = [
    ("methods.fedavg.rounds", {"fedavg": {"rounds": True}}),
    ("methods.fedavg.local_epochs", {"fedavg": {"local_epochs": True}}),
    ("methods.fedavg.evaluate_every", {"fedavg": {"evaluate_every": False}}),
    ("methods.global.epochs", {"global": {"epochs": True}}),
]
for _key, _methods in _BOOLEAN_INTS:
    case(7, f"run-boolean-for-{_key}", _key)(lambda f, m=_methods: ["run", f.job(methods=m)])
case(7, "validate-boolean-for-train-epochs", "train.epochs")(lambda f: ["validate", f.job(), "--set", "train.epochs=true"])
case(7, "validate-boolean-method-int-set", "methods.fedavg.rounds")(
    lambda f: ["validate", f.job(methods={"fedavg": {}}), "--set", "methods.fedavg.rounds=yes"]
)
case(7, "api-boolean-method-int", "methods.fedavg.rounds")(api_run(lambda f: with_base(methods={"fedavg": {"rounds": True}})))
case(7, "fuse-boolean-weight", "models.0.parameters.weight")(lambda f: ["fuse", _weighted_fuse(f, True)])
case(7, "fuse-boolean-seed", "parameters.seed")(lambda f: ["fuse", f.fuse(merge_method="kl_neurons", parameters={"seed": True})])
case(7, "tune-boolean-samples", "num_samples")(lambda f: ["tune", f.space(num_samples=True), "--check"])

_NON_FINITE = [
    ("train.lr", ".inf"),
    ("train.lr", "inf"),
    ("train.lr", ".nan"),
    ("train.lr", "nan"),
    ("train.weight_decay", ".inf"),
    ("partition.alpha", ".inf"),
    ("federation.timeout_s", ".inf"),
    ("data.test_size", ".nan"),
    ("methods.fedavg.lr", ".inf"),
    ("methods.fedprox.mu", "nan"),
]
for _key, _value in _NON_FINITE:
    case(7, f"validate-non-finite-{_key}-{_value.replace('.', 'yaml-')}", _key)(
        lambda f, k=_key, v=_value: ["validate", f.job(methods={"fedavg": {}, "fedprox": {}}), "--set", f"{k}={v}"]
    )
case(7, "run-non-finite-lr-in-file", "train.lr")(lambda f: ["run", f.job(train={"lr": float("inf")})])
case(7, "api-non-finite-lr", "train.lr")(api_run(lambda f: with_base(train={"lr": float("nan")})))
case(7, "fuse-non-finite-weight", "models.0.parameters.weight")(lambda f: ["fuse", _weighted_fuse(f, float("inf"))])
case(7, "fuse-non-finite-kl-lambda", "parameters.lam")(
    lambda f: ["fuse", f.fuse(merge_method="kl_neurons", parameters={"lam": float("nan")})]
)
case(7, "tune-non-finite-reduction-factor", "scheduler.reduction_factor")(
    lambda f: ["tune", f.space(scheduler={"type": "fifo", "reduction_factor": float("inf")}), "--check"]
)
case(7, "symmetry-non-finite-dropout", "args.dropout")(lambda f: ["symmetry", "mlp", "--args", '{"dropout": NaN}'])

case(7, "run-model-too-large-hidden", "model.hidden")(lambda f: ["run", f.job(), "--set", "model.hidden=[100000000,100000000]"])
case(7, "validate-model-too-large-channels", "model.channels")(
    lambda f: ["validate", f.job(model={"name": "cnn", "channels": [1000000, 1000000]})]
)
case(7, "tune-check-model-too-large", "model.hidden")(lambda f: ["tune", f.space(base=f.job(model={"hidden": [10**9, 10**9]})), "--check"])
case(7, "symmetry-model-too-large", "args.hidden")(lambda f: ["symmetry", "mlp", "--args", '{"hidden": [100000000, 100000000]}'])
case(7, "api-model-too-large", "model.hidden")(api_run(lambda f: with_base(model={"hidden": [10**9, 10**9]})))

case(7, "run-more-cpus-than-the-machine", "federation.clients.num_cpus")(run_cli("--set", "federation.clients.num_cpus=100000"))
case(7, "run-more-gpus-than-ray-init", "federation.clients.num_gpus")(
    run_cli("--set", "federation.clients.num_gpus=1", "--set", "federation.ray_init.num_gpus=0")
)
case(7, "run-clients-together-more-cpus", "federation.clients.num_cpus")(
    run_cli("--set", "federation.clients.num_cpus=1", "--set", "federation.ray_init.num_cpus=1")
)
case(7, "run-coordinator-more-cpus", "federation.coordinator.num_cpus")(
    run_cli("--set", "federation.coordinator.num_cpus=9", "--set", "federation.ray_init.num_cpus=8")
)
case(7, "run-client-override-more-gpus", "federation.client_overrides.1.num_gpus")(
    run_cli("--set", "federation.client_overrides.1.num_gpus=4", "--set", "federation.ray_init.num_gpus=2")
)
# clients of different models (federation.client_overrides.<i>.model, rayfuse.run(model={...}))
_OTHER_MODEL = {"client_overrides": {1: {"model": {"name": "cnn", "channels": [4]}}}}
case(7, "run-client-override-unknown-model", "federation.client_overrides.1.model.name")(
    run_cli("--set", "federation.client_overrides.1.model.name=cnnn")
)
case(7, "validate-client-override-model-does-not-fit", "federation.client_overrides.1.model.patch_size")(
    lambda f: ["validate", f.job(federation={"client_overrides": {1: {"model": {"name": "transformer", "patch_size": 3}}}})]
)
case(7, "run-client-models-differ-for-average", "federation.client_overrides: expected clients of one architecture for method 'average'")(
    lambda f: ["run", f.job(federation=_OTHER_MODEL)]
)
case(7, "tune-check-client-models-differ", "federation.client_overrides: expected clients of one architecture")(
    lambda f: ["tune", f.space(base=f.job(federation=_OTHER_MODEL)), "--check"]
)
case(7, "api-model-mapping-bad-key", "model['defualt']")(lambda f: call(rayfuse.run, with_base(), model={"defualt": lambda: None}))
case(7, "api-model-mapping-client-out-of-range", "model[2]")(lambda f: call(rayfuse.run, with_base(), model={2: lambda: None}))
case(7, "run-custom-resource-missing", "federation.clients.resources.silo_a")(run_cli("--set", "federation.clients.resources.silo_a=1"))
case(7, "api-more-cpus", "federation.clients.num_cpus")(
    api_run(lambda f: with_base(federation={"clients": {"num_cpus": 4}, "ray_init": {"num_cpus": 2}}))
)

case(7, "symmetry-bad-input-shape", "--input-shape")(lambda f: ["symmetry", "mlp", "--input-shape", "a,b"])
case(7, "symmetry-args-not-json", "--args")(lambda f: ["symmetry", "mlp", "--args", "{hidden: [4]"])
case(7, "symmetry-unknown-architecture", "architecture")(lambda f: ["symmetry", "mlpp"])
case(7, "symmetry-boolean-width", "args.hidden")(lambda f: ["symmetry", "mlp", "--args", '{"hidden": [true]}'])

# differential privacy (issue 21): local DP-SGD (train.dp) and the one-shot DP upload (methods.average.dp)
_DPSGD = "{noise_multiplier: 1.0, delta: 1.0e-5}"
case(7, "run-dp-sgd-batchnorm-model", "stem.bn")(run_cli("--set", "model.name=rescnn", "--set", "train.dp=" + _DPSGD))
case(7, "validate-dp-sgd-batchnorm-model", "train.dp")(
    lambda f: ["validate", f.job(), "--set", "model.name=vgg", "--set", "train.dp=" + _DPSGD]
)
case(7, "run-dp-sgd-negative-noise", "train.dp.noise_multiplier")(run_cli("--set", "train.dp={noise_multiplier: -1.0}"))
case(7, "run-dp-sgd-negative-clip", "train.dp.max_grad_norm")(run_cli("--set", "train.dp={noise_multiplier: 1.0, max_grad_norm: -1.0}"))
case(7, "run-dp-sgd-delta-above-one-over-n", "train.dp.delta")(run_cli("--set", "train.dp={noise_multiplier: 1.0, delta: 0.01}"))
case(7, "run-dp-sgd-no-noise-given", "train.dp.noise_multiplier")(run_cli("--set", "train.dp={max_grad_norm: 1.0}"))
case(7, "run-dp-sgd-on-fedavg", "train.dp")(run_cli("--set", "methods={fedavg: {rounds: 1}}", "--set", "train.dp=" + _DPSGD))
case(7, "run-upload-dp-negative-clip", "methods.average.dp.clip_norm")(
    run_cli("--set", "methods.average.dp={clip_norm: -1.0, noise_multiplier: 1.0}")
)
case(7, "run-upload-dp-negative-noise", "methods.average.dp.noise_multiplier")(
    run_cli("--set", "methods.average.dp={clip_norm: 1.0, noise_multiplier: -0.5}")
)
case(7, "run-upload-dp-delta-above-one-over-clients", "methods.average.dp.delta")(
    run_cli("--set", "methods.average.dp={clip_norm: 1.0, noise_multiplier: 1.0, delta: 0.5}")
)
# Central DP-FedAvg (issue 21): refused by the schema or the method's check, before any client trains
_DP = {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.5}
_BAD_DP = [
    ("negative-noise", "methods.fedavg.dp.noise_multiplier", "fedavg", {}, {"noise_multiplier": -1.0}),
    ("zero-noise", "methods.fedavg.dp.noise_multiplier", "fedavg", {}, {"noise_multiplier": 0.0}),
    ("negative-clip-norm", "methods.fedavg.dp.clip_norm", "fedavg", {}, {"clip_norm": -0.5}),
    ("zero-clip-norm", "methods.fedprox.dp.clip_norm", "fedprox", {}, {"clip_norm": 0.0}),
    ("delta-not-below-1-over-n", "methods.fedavg.dp.delta", "fedavg", {}, {"delta": 0.5}),
    ("zero-sample-rate", "methods.fedadam.dp.sample_rate", "fedadam", {}, {"sample_rate": 0.0}),
    ("sample-rate-above-one", "methods.fedavg.dp.sample_rate", "fedavg", {}, {"sample_rate": 1.5}),
    ("zero-target-epsilon", "methods.fedavg.dp.target_epsilon", "fedavg", {}, {"noise_multiplier": None, "target_epsilon": 0.0}),
    ("noise-and-target", "methods.fedavg.dp.noise_multiplier", "fedavg", {}, {"target_epsilon": 1.0}),
    ("one-shot-method", "methods.ensemble.dp", "ensemble", {}, {}),
    ("fedref", "methods.fedref.dp", "fedref", {}, {}),
    ("robust-aggregator", "methods.fedavg.aggregator", "fedavg", {"aggregator": "median"}, {}),
    ("fraction", "methods.fedavg.fraction", "fedavg", {"fraction": 0.5}, {}),
    ("stop-before-one-round", "methods.fedavg.dp.stop_at_epsilon", "fedavg", {}, {"stop_at_epsilon": 0.001}),
]
for _id, _key, _method, _extra, _dp in _BAD_DP:
    case(7, f"run-dp-{_id}", _key)(lambda f, m=_method, e=_extra, d=_dp: ["run", f.job(methods={m: {**e, "dp": {**_DP, **d}}})])
case(7, "validate-dp-delta", "methods.fedavg.dp.delta")(lambda f: ["validate", f.job(methods={"fedavg": {"dp": {**_DP, "delta": 0.9}}})])
case(7, "api-dp-negative-clip-norm", "methods.fedavg.dp.clip_norm")(
    api_run(lambda f: with_base(methods={"fedavg": {"dp": {**_DP, "clip_norm": -1.0}}}))
)


def _weighted_fuse(f: Files, weight: Any) -> str:
    models = f.models()
    return f.yaml(
        "fuse.yaml",
        {
            "merge_method": "linear",
            "models": [{"model": m, "parameters": {"weight": weight}} for m in models],
            "output": "fused.safetensors",
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# 8. Checkpoints for rayfuse fuse


def _torch_models(f: Files, make: Callable[[], dict[str, Any]], suffix: str = ".pt") -> list[str]:
    names = [f"m{i}{suffix}" for i in range(2)]
    for name in names:
        f.params(name, make(), as_torch=suffix == ".pt")
    return names


def _sparse() -> dict[str, Any]:
    import torch

    return {"w": torch.eye(4).to_sparse(), "b": torch.zeros(4)}


def _integers() -> dict[str, Any]:
    import torch

    return {"steps": torch.arange(4), "mask": torch.ones(3, dtype=torch.int8)}


def _quantized() -> dict[str, Any]:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"w": torch.quantize_per_tensor(torch.ones(4, 3), 0.1, 0, torch.qint8), "b": torch.zeros(4)}


def _complex() -> dict[str, Any]:
    import torch

    return {"w": torch.ones(4, 3, dtype=torch.complex64)}


def _bf16_nan() -> dict[str, Any]:
    import torch

    return {"w": torch.full((4, 3), float("nan"), dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.bfloat16)}


case(8, "fuse-sparse-tensor", "m0.pt: w")(lambda f: ["fuse", f.fuse(models=_torch_models(f, _sparse))])
case(8, "fuse-sparse-csr-tensor", "m0.pt: w")(
    lambda f: ["fuse", f.fuse(models=_torch_models(f, lambda: {"w": __import__("torch").eye(4).to_sparse_csr()}))]
)
case(8, "fuse-integer-only-pt", "(m0.pt): steps: expected a model with floating-point tensors")(
    lambda f: ["fuse", f.fuse(models=_torch_models(f, _integers))]
)
case(8, "fuse-integer-only-safetensors", "(m0.safetensors): steps: expected a model with floating-point tensors")(
    lambda f: ["fuse", f.fuse(models=_torch_models(f, _integers, ".safetensors"))]
)
case(8, "fuse-quantized-tensor", "m0.pt: w")(lambda f: ["fuse", f.fuse(models=_torch_models(f, _quantized))])
case(8, "fuse-complex-tensor", "m0.safetensors: w")(lambda f: ["fuse", f.fuse(models=_torch_models(f, _complex, ".safetensors"))])
case(8, "fuse-empty-checkpoint", "m0.safetensors")(lambda f: ["fuse", f.fuse(models=_torch_models(f, dict, ".safetensors"))])
case(8, "fuse-bfloat16-nan", ".safetensors): w: expected finite values")(
    lambda f: ["fuse", f.fuse(models=_torch_models(f, _bf16_nan, ".safetensors"))]
)
case(8, "fuse-bfloat16-shape-mismatch", "(m1.safetensors): weight: expected shape (4, 3)")(
    lambda f: ["fuse", f.fuse(models=_mismatched_bf16(f))]
)
case(8, "fuse-dtype-not-a-float", "dtype")(lambda f: ["fuse", f.fuse(dtype="int8")])
case(8, "fuse-truncated-bfloat16", "m0.safetensors")(
    lambda f: ["fuse", f.fuse(models=[f.raw("m0.safetensors", (f.root / f.models("bfloat16")[0]).read_bytes()[:40]), "m1.safetensors"])]
)
case(8, "fuse-pickled-object-pt", "m0.pt")(lambda f: ["fuse", f.fuse(models=[_pickle_file(f), _pickle_file(f, "m1.pt")])])
case(8, "api-fuse-sparse", "m0.pt: w")(lambda f: call(rayfuse.fuse, f.fuse(models=_torch_models(f, _sparse))))
case(8, "api-fuse-integer-only", "(m0.pt): steps: expected a model with floating-point tensors")(
    lambda f: call(rayfuse.fuse, f.fuse(models=_torch_models(f, _integers)))
)


def _mismatched_bf16(f: Files) -> list[str]:
    import torch

    first = f.models("bfloat16")[0]
    return [
        first,
        f.params("m1.safetensors", {"weight": torch.ones(5, 3, dtype=torch.bfloat16), "bias": torch.ones(4, dtype=torch.bfloat16)}),
    ]


def _pickle_file(f: Files, name: str = "m0.pt") -> str:
    import torch

    torch.save({"w": torch.ones(2), "note": Files}, f.root / name)  # a class: weights_only=True refuses to load it
    return name


# ---------------------------------------------------------------------------------------------------------------
# The checks every case passes


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """The case's folder as the working directory; Ray seen as not started (a test session's Ray must not be reused:
    each case shows what a fresh ``rayfuse`` process does) and no ``ray start`` cluster of this machine attached to."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import actors.backend

    monkeypatch.setattr(actors.backend.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(actors.backend, "_live_local_cluster", lambda: False)
    return tmp_path


def refused_line(command: Any, capsys: Any, guard: Callable[[Callable[[], Any]], Any] = lambda run: run()) -> str:
    """Run a bad input's ``command`` (a callable: the Python API; else a command line for :func:`main`) under ``guard``
    and return the one line it was refused with: an :class:`InputError`, or exit 2 with one ``rayfuse: error:`` line on
    stderr and no traceback."""
    if callable(command):
        with pytest.raises(InputError) as raised:
            guard(command)
        line = str(raised.value)
    else:
        assert guard(lambda: main(command)) == 2
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("rayfuse: error: ")
        assert "Traceback" not in out + err
        line = lines[0]
    assert "\n" not in line
    return line


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line_and_leaves_nothing_behind(bad: Case, isolated: Path, capsys, monkeypatch) -> None:
    files = Files(isolated)
    for key, value in bad.env.items():
        monkeypatch.setenv(key, value.format(port=closed_port()))
    command = bad.make(files)
    capsys.readouterr()
    before = _snapshot(isolated)
    line = refused_line(command, capsys)
    assert bad.names in line, line
    assert _snapshot(isolated) == before


def test_the_corpus_covers_every_class_and_command() -> None:
    counts = {cls: sum(1 for c in CASES if c.cls == cls) for cls in (3, 5, 6, 7, 8)}
    assert all(n >= 10 for n in counts.values()), counts
    commands = {c.id.split("-")[0] for c in CASES}
    assert commands >= {"run", "validate", "tune", "fuse", "symmetry", "api", "resume"}, commands
    assert len(CASES) >= 130
    assert len({c.id for c in CASES}) == len(CASES)


# ---------------------------------------------------------------------------------------------------------------
# End to end, in real processes: the exit code, one line, no traceback


def _rayfuse(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "rayfuse", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("address", ["silent", "closed"])
def test_an_unreachable_address_is_refused_in_seconds_by_a_real_process(tmp_path, address) -> None:
    # A closed local port refuses at once; a silent one (a loopback listener that never accepts nor answers: the kernel
    # completes the TCP handshake, then nothing) leaves the probe's GCS question unanswered until its 3 s deadline, as
    # a host that routes nowhere would. Only loopback: the tests send nothing off this machine. The subprocess time
    # limit is the guard against ray.init's endless retries; it is generous because on a loaded 2-core CI machine the
    # imports alone took most of a 45 s limit once (the refusal printed, the exit late), while a retrying ray.init
    # never returns at all.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1] if address == "silent" else closed_port()
        job = Files(tmp_path).job()
        result = _rayfuse(["run", job, "--address", f"127.0.0.1:{port}", "--out", "out"], tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith("rayfuse: error: federation.address")
    ]
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["alias-bomb", "latin1", "duplicate-nested-key"])
def test_a_bad_config_file_exits_2_in_a_real_process(tmp_path, name) -> None:
    path = BAD_TEXTS[name][0](Files(tmp_path), "job.yaml")
    result = _rayfuse(["validate", path], tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("rayfuse: error: job.yaml")
    assert "Traceback" not in result.stderr


def test_bad_checkpoints_and_data_exit_2_in_a_real_process(tmp_path) -> None:
    f = Files(tmp_path)
    sparse = f.fuse(models=_torch_models(f, _sparse))
    result = _rayfuse(["fuse", sparse], tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [result.stderr.strip()] and "m0.pt: w" in result.stderr
    job = f.job(data={"dataset": "npz", "path": _nan_labels(f)})
    result = _rayfuse(["run", job, "--local"], tmp_path)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and "data.label" in result.stderr
    assert not (tmp_path / "runs").exists()


def _tensor(rng: np.random.Generator, *shape: int) -> Any:
    import torch

    return torch.from_numpy(rng.normal(size=shape).astype(np.float32))


def test_a_probe_on_a_node_the_model_lacks_is_one_line_in_a_real_process(tmp_path) -> None:
    # Activation matching loads the memory-mapped (read-only) checkpoints into the architecture before it checks the
    # spec's probes; PyTorch's warning about non-writable arrays (printed once per process, so only a fresh process
    # shows it) came before the one line.
    f = Files(tmp_path)
    layers = "torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)"
    f.text("m_probe.py", f"import torch\nclass M(torch.nn.Sequential):\n    def __init__(self):\n        super().__init__({layers})\n")
    rng = np.random.default_rng(0)
    models = [
        f.params(
            f"m{i}.safetensors",
            {"0.weight": _tensor(rng, 4, 3), "0.bias": _tensor(rng, 4), "2.weight": _tensor(rng, 2, 4), "2.bias": _tensor(rng, 2)},
        )
        for i in range(2)
    ]
    group = {
        "name": "P0",
        "size": 4,
        "axes": [{"key": "0.weight", "dim": 0}, {"key": "0.bias", "dim": 0}, {"key": "2.weight", "dim": 1}],
        "probes": [{"node": "nope", "dim": 1}],
    }
    f.text("spec.json", json.dumps({"groups": [group]}))
    data = f.npz(X=rng.normal(size=(60, 3)).astype(np.float32), y=np.arange(60) % 2)
    fuse = f.fuse(
        models=models, merge_method="activation_matching", architecture="m_probe:M", parameters={"spec": "spec.json"}, data={"path": data}
    )
    result = _rayfuse(["fuse", fuse], tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["rayfuse: error: spec.P0.probes: expected a node of both traced models, got 'nope'"], (
        result.stderr
    )
    assert not (tmp_path / "fused.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------
# Valid inputs are read as before


def test_every_shipped_yaml_file_reads_as_pyyaml_reads_it() -> None:
    from rayfuse.safeyaml import read_yaml_file

    files = sorted([*ROOT.glob("jobs/*.yaml"), *ROOT.glob("tune_spaces/*.yaml"), *ROOT.glob("examples/**/*.yaml")])
    assert files
    for path in files:
        assert read_yaml_file(path) == yaml.safe_load(path.read_text(encoding="utf-8")), path


def test_anchors_aliases_and_merge_keys_stay_valid() -> None:
    from rayfuse.safeyaml import parse_yaml

    text = "base: &b {lr: 0.1, epochs: 2}\nfast:\n  <<: *b\n  lr: 0.5\nboth: [*b, *b]\n"
    assert parse_yaml(text, "x.yaml") == yaml.safe_load(text)


def test_a_running_ray_answers_the_address_probe(ray_session) -> None:
    from actors.backend import check_reachable_address

    check_reachable_address(ray_session.get_runtime_context().gcs_address, key="federation.address")
