"""Issue 31, class 7: the silo layer does what it promises.

Two tables. ``REFUSED``: bad silo inputs, each refused by ``rayfuse run`` (or ``validate``) with exit 2, one line
naming the key (and the files), no traceback, nothing written where the case ran (the harness of
``tests/config/test_bad_inputs.py``). ``ACCEPTED``: valid but unusual inputs that must be read as they mean: Excel-style csv
(byte-order mark, ``;`` sniffed, CRLF, decimal commas, UTF-16), 16-bit images at their full range, float label values
declared in ``data.classes``, csv silos without ``data.standardize``, ``(N, L, D)`` sequence data for
``rayfuse fuse``, silos whose dtypes differ in width only. Everything runs in-process (``federation.backend: local``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from rayfuse.cli import main
from rayfuse.data.datasets import csv_dialect
from rayfuse.data.silos import check_schemas, dtype_kind, load_silo, silo_schema
from tests.config.test_bad_inputs import Files, _snapshot, isolated, refused_line  # noqa: F401  (isolated: the fixture the harness uses)

# ---------------------------------------------------------------------------------------------------------------
# Files of a silo config


def _blobs(n: int = 40, seed: int = 0, classes: int = 2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    return (rng.normal(size=(n, 3)) + 2.0 * y[:, None]).astype(np.float32), y


def npz_silo(f: Files, name: str, X: Any = None, y: Any = None, **spec: Any) -> dict[str, Any]:
    X0, y0 = _blobs(seed=len(name))
    np.savez(f.root / name, X=X0 if X is None else X, y=y0 if y is None else y)
    return {"dataset": "npz", "path": name, "val_size": 0.25, **spec}


def csv_silo(f: Files, name: str, text: str | bytes, **spec: Any) -> dict[str, Any]:
    if isinstance(text, bytes):
        f.raw(name, text)
    else:
        (f.root / name).write_bytes(text.encode())
    return {"dataset": "csv", "path": name, "val_size": 0.25, **spec}


def parquet_silo(f: Files, name: str, integers: bool = False) -> dict[str, Any]:
    X, y = _blobs(seed=len(name))
    columns = {k: (np.round(X[:, j] * 10).astype(np.int32) if integers else X[:, j].astype(np.float64)) for j, k in enumerate("abc")}
    f.parquet(name, **columns, y=y)
    return {"dataset": "parquet", "path": name, "val_size": 0.25}


def table_text(n: int = 40, *, sep: str = ",", decimal: str = ".", newline: str = "\n", seed: int = 0, integers: bool = False) -> str:
    X, y = _blobs(n, seed)
    rows = [sep.join(["a", "b", "c", "y"])]
    for row, label in zip(X, y):
        values = [str(int(round(v * 10))) if integers else f"{v:.3f}".replace(".", decimal) for v in row]
        rows.append(sep.join([*values, str(label)]))
    return newline.join(rows) + newline


def images(
    f: Files, folder: str, *, dtype: str = "uint8", mode_suffix: str = "png", size: int = 6, per_class: int = 3, scale: int = 1
) -> dict[str, Any]:
    """Class folders ``a`` and ``b`` of grey images of ``dtype`` (values ``scale * (0..)``)."""
    for c, cls in enumerate(("a", "b")):
        (f.root / folder / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = ((np.arange(size * size).reshape(size, size) + 7 * i + 20 * c) * scale).astype(dtype)
            Image.fromarray(pixels).save(f.root / folder / cls / f"img{i}.{mode_suffix}")
    return {"dataset": "imagefolder", "path": folder, "val_size": 0.5, "grayscale": True}


def job(f: Files, silos: list[dict[str, Any]], name: str = "job.yaml", methods: dict[str, Any] | None = None, **data: Any) -> str:
    return f.yaml(
        name,
        {
            "run": {"name": "silo", "seed": 0, "storage": "runs"},
            "data": {"silos": silos, **data},
            "model": {"name": "mlp", "hidden": [8]},
            "train": {"epochs": 1, "batch_size": 16, "shared_init": True},
            "federation": {"backend": "local"},
            "methods": methods or {"average": {}},
        },
    )


def tiny_job(f: Files, methods: dict[str, Any]) -> str:
    return f.yaml(
        "job.yaml",
        {
            "run": {"name": "dp", "seed": 0, "storage": "runs"},
            "data": {"dataset": "digits"},
            "partition": {"method": "iid", "num_clients": 4},
            "model": {"name": "mlp", "hidden": [8]},
            "train": {"epochs": 1, "shared_init": True},
            "federation": {"backend": "local"},
            "methods": methods,
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# Refused: exit 2, one line naming every string of ``names``, no traceback, nothing written


@dataclass(frozen=True)
class Refused:
    id: str
    sub: str  # the sub-class of class 7 the case belongs to
    make: Callable[[Files], list[str]]
    names: tuple[str, ...]


REFUSED: list[Refused] = []


def refused(sub: str, id: str, *names: str) -> Callable[[Callable[[Files], list[str]]], Callable[[Files], list[str]]]:
    def add(make: Callable[[Files], list[str]]) -> Callable[[Files], list[str]]:
        REFUSED.append(Refused(id, sub, make, names))
        return make

    return add


# -- dtype: the files' own dtypes compared, by kind

refused("dtype", "uint8-silo-beside-float-silo", "data.silos.1", "float32", "s0.npz", "uint8", "s1.npz")(
    lambda f: ["run", job(f, [npz_silo(f, "s0.npz"), npz_silo(f, "s1.npz", X=np.arange(120).reshape(40, 3).astype(np.uint8))])]
)
refused("dtype", "float-silo-beside-int64-silo", "data.silos.1", "int64", "float64")(
    lambda f: [
        "run",
        job(f, [npz_silo(f, "s0.npz", X=np.arange(120).reshape(40, 3)), npz_silo(f, "s1.npz", X=np.linspace(0, 1, 120).reshape(40, 3))]),
    ]
)
refused("dtype", "integer-parquet-beside-float-parquet", "data.silos.2", "int32", "float64", "s2.parquet")(
    lambda f: ["run", job(f, [parquet_silo(f, "s0.parquet"), parquet_silo(f, "s1.parquet"), parquet_silo(f, "s2.parquet", integers=True)])]
)
refused("dtype", "int8-silo-beside-float16-silo", "data.silos.1", "int8", "float16")(
    lambda f: [
        "run",
        job(
            f,
            [
                npz_silo(f, "s0.npz", X=np.ones((40, 3), np.float16) + np.arange(40)[:, None].astype(np.float16)),
                npz_silo(f, "s1.npz", X=np.arange(120).reshape(40, 3).astype(np.int8)),
            ],
        ),
    ]
)
refused("dtype", "integer-csv-beside-float-csv", "data.silos.1", "int64", "float64", "s1.csv")(
    lambda f: ["run", job(f, [csv_silo(f, "s0.csv", table_text()), csv_silo(f, "s1.csv", table_text(integers=True))])]
)
refused("dtype", "uint8-npz-beside-images", "data.silos.1", "uint8 pixels", "uint8")(
    lambda f: [
        "run",
        job(
            f,
            [
                images(f, "site0"),
                npz_silo(f, "s1.npz", X=np.arange(6 * 6 * 12).reshape(12, 1, 6, 6).astype(np.uint8), y=np.arange(12) % 2, val_size=0.5),
            ],
        ),
    ]
)
refused("dtype", "test-path-of-another-kind", "data.silos.0.test_path", "uint8", "held.npz")(
    lambda f: [
        "run",
        job(
            f,
            [
                {
                    "dataset": "npz",
                    "path": npz_silo(f, "s0.npz")["path"],
                    "test_path": npz_silo(f, "held.npz", X=np.arange(120).reshape(40, 3).astype(np.uint8))["path"],
                },
                npz_silo(f, "s1.npz"),
            ],
        ),
    ]
)
refused("dtype", "data-test-of-another-kind", "data.test.path", "uint8", "test.npz")(
    lambda f: [
        "run",
        job(
            f,
            [npz_silo(f, "s0.npz"), npz_silo(f, "s1.npz")],
            test={"dataset": "npz", "path": npz_silo(f, "test.npz", X=np.arange(120).reshape(40, 3).astype(np.uint8))["path"]},
        ),
    ]
)
refused("dtype", "data-public-of-another-kind", "data.public.path", "int64", "public.npz")(
    lambda f: [
        "run",
        job(
            f,
            [npz_silo(f, "s0.npz"), npz_silo(f, "s1.npz")],
            methods={"transfer": {"target_epochs": 1}},
            public={"dataset": "npz", "path": npz_silo(f, "public.npz", X=np.arange(120).reshape(40, 3))["path"]},
            test={"dataset": "npz", "path": npz_silo(f, "test.npz")["path"]},
        ),
        "--set",
        "evaluation=central",
    ]
)

# -- images: pixels without a fixed range

refused("images", "32-bit-integer-tiff", "data.silos.0.path", "mode I")(
    lambda f: ["run", job(f, [images(f, "site0", dtype="int32", mode_suffix="tif", scale=100000), images(f, "site1")])]
)
refused("images", "float-tiff", "data.silos.1.path", "mode F")(
    lambda f: ["run", job(f, [images(f, "site0"), images(f, "site1", dtype="float32", mode_suffix="tif")])]
)

# -- csv: what a spreadsheet writes, and an explicit delimiter that does not fit

refused("csv", "explicit-delimiter-wins-over-sniffing", "data.silos.0.label", "a;b;c;y")(
    lambda f: [
        "run",
        job(
            f,
            [csv_silo(f, "s0.csv", table_text(sep=";"), label="y", options={"delimiter": ","}), csv_silo(f, "s1.csv", table_text(sep=";"))],
        ),
    ]
)
refused("csv", "semicolon-csv-with-a-text-feature", "data.silos.1.features")(
    lambda f: [
        "run",
        job(
            f,
            [
                csv_silo(f, "s0.csv", table_text(sep=";")),
                csv_silo(f, "s1.csv", "a;b;y\r\n" + "".join(f"{i},5;n{i};{i % 2}\r\n" for i in range(20)), features=["a", "b"]),
            ],
        ),
    ]
)
refused("csv", "empty-csv", "data.silos.1.path")(
    lambda f: ["run", job(f, [csv_silo(f, "s0.csv", table_text()), csv_silo(f, "s1.csv", b"\xef\xbb\xbf")])]
)

# -- label values: float classes matched by value, never rounded

refused("classes", "float-label-not-declared", "data.silos.1.path", "'2.5'")(
    lambda f: [
        "run",
        job(f, [npz_silo(f, "s0.npz", y=np.arange(40) % 2 + 0.5), npz_silo(f, "s1.npz", y=np.arange(40) % 3 + 0.5)], classes=[0.5, 1.5]),
    ]
)
refused("classes", "integral-float-label-against-half-classes", "data.silos.0.path", "got '0.0'")(
    lambda f: ["run", job(f, [npz_silo(f, "s0.npz", y=(np.arange(40) % 2).astype(np.float64)), npz_silo(f, "s1.npz")], classes=[0.5, 1.5])]
)
refused("classes", "float-label-not-rounded-to-a-declared-int", "data.silos.1.path", "'1.5'")(
    lambda f: ["run", job(f, [npz_silo(f, "s0.npz"), npz_silo(f, "s1.npz", y=np.where(np.arange(40) % 2 == 0, 0.0, 1.5))], classes=[0, 1])]
)
refused("classes", "declared-classes-equal-by-value", "data.classes", "1.0")(
    lambda f: [
        "run",
        job(f, [npz_silo(f, "s0.npz", y=np.arange(40) % 2 + 1), npz_silo(f, "s1.npz", y=np.arange(40) % 2 + 1)], classes=["1", "1.0", "2"]),
    ]
)
refused("classes", "data-test-float-label-not-among-the-silos", "data.test", "'2.5'")(
    lambda f: [
        "run",
        job(
            f,
            [npz_silo(f, "s0.npz", y=np.arange(40) % 2 + 0.5), npz_silo(f, "s1.npz", y=np.arange(40) % 2 + 0.5)],
            test={"dataset": "npz", "path": npz_silo(f, "test.npz", y=np.arange(40) % 3 + 0.5)["path"]},
            methods={"average": {}},
        ),
    ]
)

# -- upload DP: noise_multiplier 0 is refused by the schema, before anything runs

refused("dp", "aligned-upload-dp-zero-noise", "methods.aligned.dp.noise_multiplier", "greater than 0")(
    lambda f: ["run", tiny_job(f, {"aligned": {"alignment": "weight", "repair": False, "dp": {"clip_norm": 1.0, "noise_multiplier": 0}}})]
)
refused("dp", "average-upload-dp-zero-noise", "methods.average.dp.noise_multiplier")(
    lambda f: ["run", tiny_job(f, {"average": {"dp": {"clip_norm": 1.0, "noise_multiplier": 0.0}}})]
)
refused("dp", "validate-upload-dp-zero-noise", "methods.average.dp.noise_multiplier")(
    lambda f: ["validate", tiny_job(f, {"average": {"dp": {"clip_norm": 1.0, "noise_multiplier": 0}}})]
)
refused("dp", "aligned-upload-dp-negative-noise", "methods.aligned.dp.noise_multiplier")(
    lambda f: ["run", tiny_job(f, {"aligned": {"alignment": "weight", "repair": False, "dp": {"clip_norm": 1.0, "noise_multiplier": -1}}})]
)
refused("dp", "dp-sgd-zero-noise", "train.dp.noise_multiplier", "greater than 0")(
    lambda f: ["run", tiny_job(f, {"local": {}}), "--set", "train.dp={noise_multiplier: 0, max_grad_norm: 1.0}"]
)


@pytest.mark.parametrize("bad", REFUSED, ids=[c.id for c in REFUSED])
def test_a_bad_silo_input_is_one_line_and_exit_2_with_nothing_written(bad: Refused, isolated: Path, capsys) -> None:  # noqa: F811
    files = Files(isolated)
    command = bad.make(files)
    capsys.readouterr()
    before = _snapshot(isolated)
    line = refused_line(command, capsys)
    for name in bad.names:
        assert name in line, (name, line)
    assert _snapshot(isolated) == before


# ---------------------------------------------------------------------------------------------------------------
# Accepted: valid but unusual inputs, read as they mean


@dataclass(frozen=True)
class Accepted:
    id: str
    sub: str
    check: Callable[[Files], None]


ACCEPTED: list[Accepted] = []


def accepted(sub: str, id: str) -> Callable[[Callable[[Files], None]], Callable[[Files], None]]:
    def add(check: Callable[[Files], None]) -> Callable[[Files], None]:
        ACCEPTED.append(Accepted(id, sub, check))
        return check

    return add


def _read(f: Files, spec: dict[str, Any], client: int = 0, classes: tuple[str, ...] | None = None):
    train, held = load_silo({**spec, "path": str(f.root / spec["path"])}, client=client, classes=classes)
    return train, held


def _whole_csv(f: Files, spec: dict[str, Any]) -> np.ndarray:
    """The csv silo's features, training and held-out rows together, in file order (by the first column's values)."""
    train, held = _read(f, spec)
    X = np.concatenate([train.X, held.X])
    return X[np.argsort(X[:, 0])]


def _expected_csv() -> np.ndarray:
    X, _ = _blobs()
    X = np.round(X.astype(np.float64), 3).astype(np.float32)
    return X[np.argsort(X[:, 0])]


@accepted("csv", "byte-order-mark")
def _bom(f: Files) -> None:
    spec = csv_silo(f, "bom.csv", b"\xef\xbb\xbf" + table_text().encode(), features=["a", "b"])
    train, _ = _read(f, spec)  # the first column is found by its name: "a", not "\ufeffa"
    assert train.X.shape[1] == 2 and train.class_names == ("0", "1")
    np.testing.assert_allclose(np.sort(_whole_csv(f, spec)[:, 0]), np.sort(_expected_csv()[:, 0]), atol=1e-6)


@accepted("csv", "semicolon-sniffed")
def _semicolon(f: Files) -> None:
    np.testing.assert_allclose(_whole_csv(f, csv_silo(f, "s.csv", table_text(sep=";"))), _expected_csv(), atol=1e-6)


@accepted("csv", "crlf-line-ends")
def _crlf(f: Files) -> None:
    np.testing.assert_allclose(_whole_csv(f, csv_silo(f, "s.csv", table_text(newline="\r\n"))), _expected_csv(), atol=1e-6)


@accepted("csv", "excel-bom-semicolon-crlf-decimal-comma")
def _excel(f: Files) -> None:
    text = b"\xef\xbb\xbf" + table_text(sep=";", decimal=",", newline="\r\n").encode()
    spec = csv_silo(f, "excel.csv", text)
    assert csv_dialect(f.root / "excel.csv").delimiter == ";" and csv_dialect(f.root / "excel.csv").decimal_point == ","
    np.testing.assert_allclose(_whole_csv(f, spec), _expected_csv(), atol=1e-6)
    train, _ = _read(f, spec)
    assert train.class_names == ("0", "1")


@accepted("csv", "excel-sep-line")
def _sep_line(f: Files) -> None:
    spec = csv_silo(f, "sep.csv", "sep=;\r\n" + table_text(sep=";", decimal=",", newline="\r\n"))
    np.testing.assert_allclose(_whole_csv(f, spec), _expected_csv(), atol=1e-6)


@accepted("csv", "tab-separated-utf16")
def _utf16(f: Files) -> None:
    spec = csv_silo(f, "unicode.csv", table_text(sep="\t", newline="\r\n").encode("utf-16"))
    np.testing.assert_allclose(_whole_csv(f, spec), _expected_csv(), atol=1e-6)


@accepted("csv", "semicolon-with-decimal-points-keeps-them")
def _semicolon_points(f: Files) -> None:
    assert csv_dialect(Path(f.root / csv_silo(f, "s.csv", table_text(sep=";"))["path"])).decimal_point == "."


@accepted("csv", "unlabeled-public-excel-csv")
def _unlabeled_excel(f: Files) -> None:
    from rayfuse.data.silos import load_server_inputs

    csv_silo(f, "public.csv", b"\xef\xbb\xbf" + table_text(sep=";", decimal=",", newline="\r\n").encode())
    X = load_server_inputs(
        {"dataset": "csv", "path": str(f.root / "public.csv"), "features": ["a", "b", "c"], "labels": False}, key="data.public"
    )
    np.testing.assert_allclose(X[np.argsort(X[:, 0])], _expected_csv(), atol=1e-6)


@accepted("csv", "csv-silos-run-without-standardize")
def _csv_runs(f: Files) -> None:
    silos = [csv_silo(f, "s0.csv", table_text(sep=";", decimal=",", newline="\r\n")), csv_silo(f, "s1.csv", table_text(seed=1))]
    assert main(["run", job(f, silos), "--out", "run"]) == 0
    manifest = (f.root / "run" / "partition.json").read_text()
    assert '"source": "federated' in manifest  # standardised by default, as parquet tables are


@accepted("images", "16-bit-png-keeps-its-range")
def _png16(f: Files) -> None:
    train, held = _read(f, images(f, "site", dtype="uint16", scale=900))
    X = np.concatenate([train.X, held.X])
    assert X.max() > 0.5 and X.max() <= 1.0  # (8-bit clipping would leave 255 / 255 = 1 everywhere above 255)
    values = np.unique(np.round(X * 65535))
    assert np.all(values % 900 == 0) and len(values) > 30
    assert train.stored_dtype == "uint16 pixels"


@accepted("images", "16-bit-tiff-resized-at-full-range")
def _tiff16(f: Files) -> None:
    spec = {**images(f, "site", dtype="uint16", mode_suffix="tif", scale=900), "image_size": [3, 3]}
    train, _ = _read(f, spec)
    assert train.input_shape == (1, 3, 3) and 0.3 < train.X.max() <= 1.0 and len(np.unique(train.X)) > 4


@accepted("images", "16-bit-grey-read-as-rgb")
def _rgb16(f: Files) -> None:
    spec = {**images(f, "site", dtype="uint16", scale=900), "grayscale": None}
    train, _ = _read(f, spec)
    assert train.input_shape == (3, 6, 6) and train.X.max() > 0.5
    assert np.array_equal(train.X[:, 0], train.X[:, 1]) and np.array_equal(train.X[:, 1], train.X[:, 2])


@accepted("images", "8-and-16-bit-silos-pool")
def _pool_depths(f: Files) -> None:
    a = _read(f, images(f, "site0"))
    b = _read(f, images(f, "site1", dtype="uint16", scale=256), client=1)
    check_schemas([silo_schema(*a), silo_schema(*b)])  # both scaled to [0, 1] by their own range
    assert abs(float(a[0].X.max()) - float(b[0].X.max())) < 0.01


@accepted("dtype", "int32-and-int64-silos-pool")
def _widths(f: Files) -> None:
    a = _read(f, npz_silo(f, "a.npz", X=np.arange(120).reshape(40, 3).astype(np.int32)))
    b = _read(f, npz_silo(f, "b.npz", X=np.arange(120).reshape(40, 3).astype(np.int64)), client=1)
    check_schemas([silo_schema(*a), silo_schema(*b)])
    assert silo_schema(*a)["dtype"] == "int32" and dtype_kind("uint16") == dtype_kind("int64") == "integer"


@accepted("dtype", "float64-test-set-beside-float32-silos")
def _test_width(f: Files) -> None:
    test = {"dataset": "npz", "path": npz_silo(f, "test.npz", X=_blobs(seed=9)[0].astype(np.float64))["path"]}
    assert (
        main(["run", job(f, [npz_silo(f, "s0.npz"), npz_silo(f, "s1.npz")], test=test), "--out", "run", "--set", "evaluation=central"]) == 0
    )
    assert json.loads((f.root / "run" / "partition.json").read_text())["roles"]["test"]["size"] == 40


@accepted("classes", "half-integer-float-classes")
def _half(f: Files) -> None:
    y = np.arange(40) % 2 + 0.5
    train, held = _read(f, npz_silo(f, "a.npz", y=y), classes=("0.5", "1.5"))
    X, _ = _blobs(seed=len("a.npz"))
    assert train.class_names == ("0.5", "1.5")
    # each row's label is the position of its value: 0.5 -> 0, 1.5 -> 1 (the blobs' second class sits at +2)
    for split in (train, held):
        rows = [int(np.flatnonzero(np.all(X == x, axis=1))[0]) for x in split.X]
        assert np.array_equal(split.y, (y[rows] - 0.5).astype(np.int64))


@accepted("classes", "float-labels-match-declared-ints-by-value")
def _by_value(f: Files) -> None:
    train, _ = _read(f, npz_silo(f, "a.npz", y=(np.arange(40) % 2 + 1).astype(np.float64)), classes=("1", "2", "3"))
    assert train.class_names == ("1", "2", "3") and set(np.unique(train.y)) == {0, 1}


@accepted("classes", "float-classes-run-end-to-end")
def _float_run(f: Files) -> None:
    silos = [npz_silo(f, "s0.npz", y=np.arange(40) % 2 + 0.5), npz_silo(f, "s1.npz", y=np.arange(40) % 3 * 0.5 + 0.5)]
    assert main(["run", job(f, silos, classes=[0.5, 1.0, 1.5]), "--out", "run"]) == 0
    manifest = json.loads((f.root / "run" / "partition.json").read_text())
    assert manifest["labels"] == ["0.5", "1.0", "1.5"] and manifest["clients"][0]["class_counts"][1] == 0


class SequenceNet(nn.Module):
    """A model of ``(N, L, D)`` sequences: a per-step projection, a mean over the steps, a classifier."""

    def __init__(self, dim: int = 5, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.step = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.step(x)).mean(dim=1))


def _sequence_fuse(f: Files, method: str, with_labels: bool) -> None:
    from safetensors.torch import save_file

    for i in range(2):
        torch.manual_seed(i)
        save_file(SequenceNet().state_dict(), str(f.root / f"m{i}.safetensors"))
    arrays = {"X": np.random.default_rng(0).normal(size=(12, 4, 5)).astype(np.float32)}
    if with_labels:
        arrays["y"] = np.arange(12) % 3
    np.savez(f.root / "seq.npz", **arrays)
    spec = {
        "merge_method": method,
        "architecture": f"{__name__}:SequenceNet",
        "models": [{"model": "m0.safetensors"}, {"model": "m1.safetensors"}],
        "data": {"path": "seq.npz"},
        "output": "fused.safetensors",
    }
    if method == "distill":
        spec["parameters"] = {"epochs": 1, "steps": 20, "batch_size": 8, "transfer": "public", "init": "average"}
    assert main(["fuse", f.yaml("fuse.yaml", spec)]) == 0
    assert (f.root / "fused.safetensors").is_file()


@accepted("sequences", "fuse-average-on-n-l-d-data")
def _seq_average(f: Files) -> None:
    _sequence_fuse(f, "average", with_labels=True)


@accepted("sequences", "fuse-activation-matching-on-n-l-d-data")
def _seq_activation(f: Files) -> None:
    _sequence_fuse(f, "activation_matching", with_labels=True)


@accepted("sequences", "fuse-distill-on-unlabeled-n-l-d-data")
def _seq_distill(f: Files) -> None:
    _sequence_fuse(f, "distill", with_labels=False)


@pytest.mark.parametrize("case", ACCEPTED, ids=[c.id for c in ACCEPTED])
def test_a_valid_but_unusual_silo_input_is_read_as_it_means(case: Accepted, isolated: Path, capsys) -> None:  # noqa: F811
    case.check(Files(isolated))
    assert "Traceback" not in capsys.readouterr().err


def test_the_tables_cover_every_promise_of_class_7() -> None:
    subs = {c.sub for c in REFUSED} | {c.sub for c in ACCEPTED}
    assert subs == {"dtype", "images", "csv", "classes", "dp", "sequences"}, subs
    assert len(REFUSED) + len(ACCEPTED) >= 20
    assert len({c.id for c in REFUSED} | {c.id for c in ACCEPTED}) == len(REFUSED) + len(ACCEPTED)
