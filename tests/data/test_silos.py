"""Silos (rayfuse.data.silos, data.silos in rayfuse.config): each client's own data read on its own node.

Files are written to tmp_path: npz, parquet, csv, a tiny folder of generated PNGs; a bundled dataset for rehearsal.
Bad input is one InputError line naming data.silos.<i>... and the path as written.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from rayfuse.cli import main
from rayfuse.config import dump_config, validate_config
from rayfuse.data.silos import (
    check_schemas,
    combine_moments,
    expand_path,
    feature_moments,
    load_server_set,
    load_silo,
    silo_manifest,
    silo_schema,
)
from rayfuse.errors import InputError
from rayfuse.method import resolved_config
from rayfuse.runner import prepare_run


def _tabular(n: int = 60, features: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = rng.normal(size=(n, features)) + y[:, None]
    return X.astype(np.float32), y


def _write_npz(path, n: int = 60, features: int = 4, seed: int = 0):
    X, y = _tabular(n, features, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, X=X, y=y)
    return X, y


def _mkdir(folder):
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _write_images(folder, sizes: dict[str, list[tuple[int, int]]]) -> None:
    """One class folder per key; one generated PNG (width, height) per size, each class its own colour."""
    for c, (cls, dims) in enumerate(sorted(sizes.items())):
        (folder / cls).mkdir(parents=True, exist_ok=True)
        for i, (w, h) in enumerate(dims):
            pixels = np.full((h, w, 3), (60 * c + 10, 20 * i, 200 - 50 * c), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / cls / f"img{i}.png")


# ---------------------------------------------------------------------------------------------------------------
# Formats


def test_npz_silo_keeps_a_stratified_seeded_held_out_split(tmp_path):
    X, y = _write_npz(tmp_path / "a.npz")
    train, held = load_silo({"dataset": "npz", "path": str(tmp_path / "a.npz"), "val_size": 0.2}, client=0, seed=7)
    assert (len(train.y), len(held.y)) == (48, 12)
    assert np.bincount(held.y).tolist() == [4, 4, 4]  # 20 % of each class
    assert train.class_names == held.class_names == ("0", "1", "2")
    together = np.concatenate([train.X, held.X])
    assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, X.tolist()))  # a split: nothing lost, nothing repeated
    again_train, again_held = load_silo({"dataset": "npz", "path": str(tmp_path / "a.npz"), "val_size": 0.2}, client=0, seed=7)
    assert np.array_equal(again_held.X, held.X) and np.array_equal(again_train.y, train.y)
    _, other_client = load_silo({"dataset": "npz", "path": str(tmp_path / "a.npz"), "val_size": 0.2}, client=1, seed=7)
    assert not np.array_equal(other_client.X, held.X)


def test_parquet_silo_reads_its_label_column_and_text_labels(tmp_path):
    X, y = _tabular()
    names = np.array(["benign", "malignant", "unclear"])[y]
    table = pa.table({"f0": X[:, 0], "f1": X[:, 1], "site": ["a"] * len(y), "diagnosis": names})
    pq.write_table(table, tmp_path / "train.parquet")
    train, held = load_silo(
        {"dataset": "parquet", "path": str(tmp_path / "train.parquet"), "label": "diagnosis", "val_size": 0.1}, client=2
    )
    assert train.input_shape == (2,)  # the text column is not a feature
    assert train.class_names == ("benign", "malignant", "unclear")
    assert len(train.y) + len(held.y) == 60 and np.bincount(held.y, minlength=3).tolist() == [2, 2, 2]


def test_csv_silo_with_a_delimiter_option(tmp_path):
    X, y = _tabular(n=30, features=2)
    rows = ["a;b;label", *(f"{a};{b};{c}" for (a, b), c in zip(X.tolist(), y.tolist(), strict=True))]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    train, held = load_silo(
        {"dataset": "csv", "path": str(tmp_path / "train.csv"), "label": "label", "options": {"delimiter": ";"}, "val_size": 0.2}, client=0
    )
    assert train.input_shape == (2,) and len(train.y) + len(held.y) == 30
    assert np.allclose(np.sort(np.concatenate([train.X, held.X])[:, 0]), np.sort(X[:, 0]), atol=1e-6)


def test_imagefolder_silo_reads_class_folders_resized_rgb_or_grey(tmp_path):
    _write_images(tmp_path / "images", {"cat": [(8, 6), (5, 5), (7, 9)], "dog": [(6, 6), (10, 4), (6, 8)]})
    spec = {"dataset": "imagefolder", "path": str(tmp_path / "images"), "image_size": [4, 5], "val_size": 0.34}
    train, held = load_silo(spec, client=0)
    assert train.input_shape == (3, 4, 5) and train.class_names == ("cat", "dog")
    assert len(held.y) == 2 and sorted(held.y.tolist()) == [0, 1]
    assert 0.0 <= train.X.min() and train.X.max() <= 1.0
    grey, _ = load_silo({**spec, "grayscale": True}, client=0)
    assert grey.input_shape == (1, 4, 5)


def test_imagefolder_without_image_size_needs_images_of_one_size(tmp_path):
    _write_images(tmp_path / "same", {"a": [(4, 4), (4, 4)], "b": [(4, 4), (4, 4)]})
    train, held = load_silo({"dataset": "imagefolder", "path": str(tmp_path / "same"), "val_size": 0.5}, client=0)
    assert train.input_shape == (3, 4, 4) and len(train.y) == len(held.y) == 2
    _write_images(tmp_path / "mixed", {"a": [(4, 4), (5, 4)], "b": [(4, 4)]})
    with pytest.raises(InputError, match=r"^data\.silos\.3\.image_size: expected \[H, W\]"):
        load_silo({"dataset": "imagefolder", "path": str(tmp_path / "mixed"), "val_size": 0.5}, client=3)


def test_bundled_dataset_silo_for_rehearsal():
    train, held = load_silo({"dataset": "iris", "val_size": 0.2}, client=0)
    assert train.input_shape == (4,) and (len(train.y), len(held.y)) == (120, 30)
    synthetic, _ = load_silo(
        {"dataset": "synthetic", "options": {"n_samples": 40, "n_features": 3, "n_informative": 2}, "val_size": 0.25}, client=1
    )
    assert synthetic.input_shape == (3,) and len(synthetic.y) == 30


def test_test_path_is_the_held_out_split_with_the_silos_label_values(tmp_path):
    X, y = _tabular()
    names = np.array(["a", "b", "c"])
    pq.write_table(pa.table({"f0": X[:, 0], "label": names[y]}), tmp_path / "train.parquet")
    # the test file holds only classes b and c: its labels keep the silo's values, not 0..1 of its own
    keep = y > 0
    pq.write_table(pa.table({"f0": X[keep, 0], "label": names[y[keep]]}), tmp_path / "test.parquet")
    spec = {"dataset": "parquet", "path": str(tmp_path / "train.parquet"), "label": "label", "test_path": str(tmp_path / "test.parquet")}
    train, held = load_silo(spec, client=0)
    assert len(train.y) == 60 and held.class_names == ("a", "b", "c")
    assert np.array_equal(held.y, y[keep])
    pq.write_table(pa.table({"f0": X[:, 0], "label": np.array(["a", "b", "z"])[y]}), tmp_path / "other.parquet")
    with pytest.raises(InputError, match=r"^data\.silos\.0\.test_path: expected labels among .*got 'z'"):
        load_silo({**spec, "test_path": str(tmp_path / "other.parquet")}, client=0)


def test_server_set_loads_whole(tmp_path):
    _write_npz(tmp_path / "test.npz", n=30)
    test = load_server_set({"dataset": "npz", "path": "${SERVER}/test.npz"}, key="data.test", env={"SERVER": str(tmp_path)})
    assert len(test.y) == 30


# ---------------------------------------------------------------------------------------------------------------
# ${VAR} expansion on the client's node


def test_site_data_expands_with_the_given_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SITE_DATA", raising=False)
    _write_npz(tmp_path / "site_a" / "train.npz", seed=1)
    _write_npz(tmp_path / "site_b" / "train.npz", n=90, seed=2)
    spec = {"dataset": "npz", "path": "${SITE_DATA}/train.npz", "val_size": 0.1}
    a, _ = load_silo(spec, client=0, env={"SITE_DATA": str(tmp_path / "site_a")})
    b, _ = load_silo(spec, client=1, env={"SITE_DATA": str(tmp_path / "site_b")})
    assert (len(a.y), len(b.y)) == (54, 81)  # one config, each node's own file
    assert expand_path("${A}/x/${B}.npz", {"A": "/data", "B": "train"}) == "/data/x/train.npz"
    assert expand_path("/data/$HOME/~/x", {}) == "/data/$HOME/~/x"  # only ${NAME} expands


def test_unset_variable_names_the_client_and_the_path_as_written(monkeypatch):
    monkeypatch.delenv("SITE_DATA", raising=False)
    with pytest.raises(InputError) as info:
        load_silo({"dataset": "npz", "path": "${SITE_DATA}/train.npz", "val_size": 0.1}, client=1, env={"OTHER": "x"})
    message = str(info.value)
    assert "\n" not in message and message.startswith("data.silos.1.path: expected ${SITE_DATA} set in the environment of client 1's node")
    assert "got '${SITE_DATA}/train.npz'" in message


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line each, naming data.silos.<i>... and the path as written


def test_missing_file_on_the_node(tmp_path):
    with pytest.raises(InputError) as info:
        load_silo(
            {"dataset": "parquet", "path": "${SITE_DATA}/gone.parquet", "label": "y", "val_size": 0.1},
            client=2,
            env={"SITE_DATA": str(tmp_path)},
        )
    message = str(info.value)
    assert message.startswith("data.silos.2.path: expected an existing parquet file on client 2's node, got '${SITE_DATA}/gone.parquet'")
    assert "\n" not in message


@pytest.mark.parametrize("files", [{}, {"a": ["notes.txt"], "b": []}])
def test_imagefolder_with_no_images(tmp_path, files):
    folder = tmp_path / "images"
    folder.mkdir()
    for cls, names in files.items():
        (folder / cls).mkdir()
        for name in names:
            (folder / cls / name).write_text("not an image")
    with pytest.raises(InputError, match=r"^data\.silos\.0\.path: expected class folders holding images .*got '\$\{D\}/images'"):
        load_silo({"dataset": "imagefolder", "path": "${D}/images", "val_size": 0.5}, client=0, env={"D": str(tmp_path)})


def test_imagefolder_with_an_empty_class_folder(tmp_path):
    _write_images(tmp_path / "images", {"a": [(4, 4), (4, 4)]})
    (tmp_path / "images" / "b").mkdir()
    with pytest.raises(InputError, match=r"^data\.silos\.1\.path: expected images .* in every class folder, got \"none in 'b'"):
        load_silo({"dataset": "imagefolder", "path": str(tmp_path / "images"), "val_size": 0.5}, client=1)


def test_table_without_the_label_column(tmp_path):
    X, y = _tabular(n=20, features=2)
    pq.write_table(pa.table({"f0": X[:, 0], "f1": X[:, 1], "y": y}), tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("f0,f1,y\n" + "".join(f"{a},{b},{c}\n" for (a, b), c in zip(X.tolist(), y.tolist(), strict=True)))
    for fmt in ("parquet", "csv"):
        with pytest.raises(InputError, match=rf"^data\.silos\.1\.label: expected a column of t\.{fmt} \(f0, f1, y\), got 'diagnosis'$"):
            load_silo({"dataset": fmt, "path": str(tmp_path / f"t.{fmt}"), "label": "diagnosis", "val_size": 0.1}, client=1)


def test_unreadable_file_names_the_path_as_written(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip archive")
    with pytest.raises(InputError) as info:
        load_silo({"dataset": "npz", "path": "${S}/bad.npz", "val_size": 0.1}, client=0, env={"S": str(tmp_path)})
    assert str(info.value).startswith("data.silos.0.path: expected a readable .npz archive without pickled objects (at '${S}/bad.npz')")


def test_mismatched_shapes_and_label_sets_name_the_silo_that_differs(tmp_path):
    schemas = []
    for i, (features, labels) in enumerate([(4, 3), (4, 3), (5, 3)]):
        X, y = _tabular(features=features, seed=i)
        np.savez(tmp_path / f"{i}.npz", X=X, y=y % labels)
        schemas.append(silo_schema(*load_silo({"dataset": "npz", "path": str(tmp_path / f"{i}.npz"), "val_size": 0.1}, client=i)))
    check_schemas(schemas[:2])
    with pytest.raises(InputError, match=r"^data\.silos\.2: expected the input shape of data\.silos\.0 \[4\], got \[5\]"):
        check_schemas(schemas)
    X, y = _tabular(seed=5)
    np.savez(tmp_path / "two.npz", X=X, y=np.array(["x", "y"])[y % 2])
    two = silo_schema(*load_silo({"dataset": "npz", "path": str(tmp_path / "two.npz"), "val_size": 0.1}, client=1))
    with pytest.raises(
        InputError, match=r"^data\.silos\.1: expected the label values of data\.silos\.0 \['0', '1', '2'\], got \['x', 'y'\]"
    ):
        check_schemas([schemas[0], two])


def test_a_silo_too_small_for_a_held_out_split(tmp_path):
    np.savez(tmp_path / "s.npz", X=np.zeros((2, 3)), y=np.array([0, 1]))
    with pytest.raises(InputError, match=r"^data\.silos\.0\.val_size: expected a held-out split of at least one sample"):
        load_silo({"dataset": "npz", "path": str(tmp_path / "s.npz"), "val_size": 0.1}, client=0)


# ---------------------------------------------------------------------------------------------------------------
# Schema, manifest, federated standardisation


def test_schema_and_manifest_hold_counts_and_hashes_but_no_rows_or_paths(tmp_path):
    _write_npz(tmp_path / "site" / "a.npz")
    _write_npz(tmp_path / "site" / "b.npz", n=90, seed=3)
    schemas = [
        silo_schema(*load_silo({"dataset": "npz", "path": str(tmp_path / "site" / f"{n}.npz"), "val_size": 0.1}, client=i))
        for i, n in enumerate("ab")
    ]
    assert schemas[0]["input_shape"] == [4] and schemas[0]["dtype"] == "float32" and schemas[0]["labels"] == ["0", "1", "2"]
    assert (schemas[0]["size"], schemas[0]["held_out_size"], schemas[0]["class_counts"]) == (54, 6, [18, 18, 18])
    manifest = silo_manifest(schemas)
    assert [c["size"] for c in manifest["clients"]] == [54, 81]
    assert manifest["clients"][0]["content_hash"] != manifest["clients"][1]["content_hash"]
    text = json.dumps(manifest)
    assert str(tmp_path) not in text and "a.npz" not in text
    again = silo_schema(*load_silo({"dataset": "npz", "path": str(tmp_path / "site" / "a.npz"), "val_size": 0.1}, client=0))
    assert again["content_hash"] == schemas[0]["content_hash"]


def test_combined_moments_equal_the_pooled_mean_and_scale():
    rng = np.random.default_rng(0)
    X = (rng.normal(size=(300, 5)) * [1, 2, 3, 4, 0] + 10).astype(np.float32)  # the last feature is constant
    mean, scale = combine_moments([feature_moments(part) for part in np.split(X, [40, 200])])
    assert mean.shape == scale.shape == (1, 5) and mean.dtype == np.float32
    assert np.allclose(mean, X.astype(np.float64).mean(axis=0, keepdims=True), atol=1e-5)
    std = X.astype(np.float64).std(axis=0)
    assert np.allclose(scale[0, :4], std[:4], rtol=1e-5) and scale[0, 4] == 1.0
    images = rng.random((10, 1, 3, 3))
    count, total, squares = feature_moments(images)
    assert count == 10 and total.shape == squares.shape == (1, 3, 3)
    with pytest.raises(InputError, match=r"^data\.silos\.1: expected feature moments shaped like data\.silos\.0's"):
        combine_moments([feature_moments(X), feature_moments(X[:, :3])])


# ---------------------------------------------------------------------------------------------------------------
# The config schema (no file access) and the engine's refusal


SILO_CONFIG = {
    "data": {
        "silos": [
            {"dataset": "parquet", "path": "${SITE_DATA}/site_a/train.parquet", "label": "diagnosis"},
            {"dataset": "npz", "path": "${SITE_DATA}/site_b/train.npz", "test_path": "${SITE_DATA}/site_b/test.npz"},
            {"dataset": "imagefolder", "path": "${SITE_DATA}/site_c/images", "image_size": [64, 64], "grayscale": True},
        ],
        "test": {"dataset": "parquet", "path": "${SERVER_DATA}/test.parquet"},
        "val_size": 0.2,
    },
    "federation": {"client_overrides": {2: {"resources": {"site_c": 1}}}},
}


def test_silo_config_validates_without_files_and_derives_the_client_count(monkeypatch):
    monkeypatch.delenv("SITE_DATA", raising=False)
    cfg = validate_config(SILO_CONFIG)  # SITE_DATA is unset and no file exists: only the paths' form is checked
    assert cfg.partition.num_clients == 3 and cfg.evaluation == "federated"
    assert [s.val_size for s in cfg.data.silos] == [0.2, None, 0.2]  # data.val_size is the silos' default
    text = dump_config(resolved_config(cfg))
    dumped = yaml.safe_load(text)
    assert dumped["partition"] == {"num_clients": 3} and "dataset" not in dumped["data"]
    assert dump_config(resolved_config(validate_config(dumped))) == text  # the resolved config validates again
    assert validate_config({**SILO_CONFIG, "evaluation": "both"}).evaluation == "both"


def test_simulation_configs_dump_without_silo_keys():
    dumped = resolved_config(validate_config({}))
    assert dumped["evaluation"] == "central" and not {"silos", "test", "public"} & set(dumped["data"])
    assert validate_config({}).evaluation == "central"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": {"dataset": "digits"}}, r"^data\.dataset: expected no data\.dataset with data\.silos"),
        ({"partition": {"method": "iid"}}, r"^partition\.method: expected no partition key but num_clients with data\.silos"),
        ({"partition": {"num_clients": 4}}, r"^partition\.num_clients: expected len\(data\.silos\) \(3\) or unset, got 4"),
        ({"evaluation": "central", "data": {"test": None}}, r"^evaluation: expected federated when data\.silos comes without data\.test"),
        ({"data": {"silos": []}}, r"^data\.silos: expected at least one silo"),
        (
            {"data": {"silos": [{"dataset": "parqet", "path": "/x"}]}},
            r"^data\.silos\.0\.dataset: expected a format in .*did you mean 'parquet'",
        ),
        ({"data": {"silos": [{"dataset": "npz"}]}}, r"^data\.silos\.0\.path: expected the npz file"),
        (
            {"data": {"silos": [{"dataset": "iris", "path": "/x"}]}},
            r"^data\.silos\.0\.path: expected no path for the bundled dataset 'iris'",
        ),
        ({"data": {"silos": [{"dataset": "imagefolder", "path": "/x", "label": "y"}]}}, r"^data\.silos\.0\.label: expected no label"),
        ({"data": {"silos": [{"dataset": "csv", "path": "/x", "grayscale": True}]}}, r"^data\.silos\.0\.grayscale: expected no grayscale"),
        ({"data": {"silos": [{"dataset": "npz", "path": "${SITE DATA}/x"}]}}, r"^data\.silos\.0\.path: expected a path whose variables"),
        (
            {"data": {"silos": [{"dataset": "npz", "path": "/x", "val_size": 0.1, "test_path": "/y"}]}},
            r"^data\.silos\.0\.val_size: expected val_size or test_path, not both",
        ),
        ({"data": {"silos": [{"dataset": "npz", "path": "/x", "val_size": 0}]}}, r"^data\.silos\.0\.val_size: expected a fraction > 0"),
        (
            {"data": {"silos": [{"dataset": "npz", "path": "/x", "pth": "/y"}]}},
            r"^data\.silos\.0\.pth: expected a known key.*did you mean 'path'",
        ),
        (
            {"data": {"silos": [{"dataset": "synthetic", "options": {"n_sample": 3}}]}},
            r"^data\.silos\.0\.options\.n_sample: expected options",
        ),
        ({"data": {"silos": None, "dataset": "iris"}}, r"^data\.test: expected data\.test only with data\.silos"),
        (
            {"data": {"silos": None, "test": None, "dataset": "iris", "classes": [0, 1, 2]}},
            r"^data\.classes: expected data\.classes only with data\.silos",
        ),
        ({"data": {"classes": [0, 1, "1"]}}, r"^data\.classes: expected distinct label values, got '1' twice"),
        ({"data": {"classes": ["only"]}}, r"^data\.classes: expected at least 2 label values"),
    ],
)
def test_bad_silo_configs_are_one_line_naming_the_key(change, message):
    data = json.loads(json.dumps(SILO_CONFIG))
    for section, values in change.items():
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            data[section] = {k: v for k, v in {**data[section], **values}.items() if v is not None}
        else:
            data[section] = values
    with pytest.raises(InputError, match=message) as info:
        validate_config(data)
    assert "\n" not in str(info.value)


def test_the_driver_reads_no_silo_and_silos_that_differ_stop_the_run_before_training(tmp_path, monkeypatch, capsys):
    # every silo file exists where the config points; the driver's own checks (prepare_run) open none of them
    sites, server = tmp_path / "sites", _mkdir(tmp_path / "server")
    pq.write_table(pa.table({"f0": [float(i) for i in range(10)], "diagnosis": ["a", "b"] * 5}), _mkdir(sites / "site_a") / "train.parquet")
    _write_npz(sites / "site_b" / "train.npz")
    _write_npz(sites / "site_b" / "test.npz")
    _write_images(sites / "site_c" / "images", {"a": [(4, 4)] * 5, "b": [(4, 4)] * 5})
    pq.write_table(pa.table({"f0": [0.0, 1.0], "y": ["a", "b"]}), server / "test.parquet")
    monkeypatch.setenv("SITE_DATA", str(sites))
    monkeypatch.setenv("SERVER_DATA", str(server))
    config = tmp_path / "silos.yaml"
    config.write_text(yaml.safe_dump({**SILO_CONFIG, "run": {"storage": str(tmp_path / "runs")}, "federation": {"backend": "local"}}))
    opened: list[str] = []
    watching = [True]

    def record(event: str, args: tuple) -> None:
        if watching[0] and event in ("open", "os.listdir", "os.scandir") and args and str(args[0]).startswith(str(sites)):
            opened.append(str(args[0]))

    sys.addaudithook(record)  # a hook cannot be removed: it stops recording when the test ends
    try:
        prepare_run(validate_config(SILO_CONFIG))
        by_the_driver = list(opened)
        load_silo(validate_config(SILO_CONFIG).data.silos[1], client=1)  # the control: a client's read is recorded
    finally:
        watching[0] = False
    assert by_the_driver == [] and any(path.endswith("train.npz") for path in opened)
    # in-process, the clients read their silos and report; silo 1 differs from silo 0: one line, exit 2, nothing written
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfuse: error: data.silos.1: expected the input shape of data.silos.0 [1]") and "\n" not in err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------------------
# data.classes: the task's label values declared, so silos may each hold some of them (label skew)


def test_without_data_classes_a_silo_lacking_a_label_differs_and_the_hint_names_data_classes(tmp_path):
    X, y = _tabular(n=60)
    np.savez(tmp_path / "full.npz", X=X, y=y)
    np.savez(tmp_path / "skew.npz", X=X[y > 0], y=y[y > 0])  # labels 1 and 2 only: renumbered 0, 1 as its own file reads them
    skew, _ = load_silo({"dataset": "npz", "path": str(tmp_path / "skew.npz"), "val_size": 0.1}, client=1)
    assert skew.class_names == ("1", "2") and set(skew.y.tolist()) == {0, 1}
    schemas = [
        silo_schema(*load_silo({"dataset": "npz", "path": str(tmp_path / f), "val_size": 0.1}, client=i))
        for i, f in enumerate(["full.npz", "skew.npz"])
    ]
    with pytest.raises(
        InputError,
        match=r"^data\.silos\.1: expected the label values of data\.silos\.0 .*got \['1', '2'\]"
        r"; .*data\.classes, the task's label values in label order",
    ):
        check_schemas(schemas)


def test_declared_classes_number_each_silos_labels_by_their_place_and_count_every_class(tmp_path):
    X, y = _tabular(n=60)
    np.savez(tmp_path / "full.npz", X=X, y=y)
    np.savez(tmp_path / "skew.npz", X=X[y > 0], y=y[y > 0])
    np.savez(tmp_path / "one.npz", X=X[y == 2], y=y[y == 2])  # a site holding one class only
    classes = ("0", "1", "2")
    schemas = []
    for i, name in enumerate(["full.npz", "skew.npz", "one.npz"]):
        train, held = load_silo({"dataset": "npz", "path": str(tmp_path / name), "val_size": 0.2}, client=i, classes=classes)
        assert train.class_names == classes and train.num_classes == 3
        schemas.append(silo_schema(train, held))
    skew_train, _ = load_silo({"dataset": "npz", "path": str(tmp_path / "skew.npz"), "val_size": 0.2}, client=1, classes=classes)
    assert set(skew_train.y.tolist()) == {1, 2}  # the file's own values, not renumbered
    check_schemas(schemas)
    assert [s["labels"] for s in schemas] == [list(classes)] * 3
    assert schemas[1]["class_counts"][0] == schemas[1]["held_out_class_counts"][0] == 0
    assert schemas[2]["class_counts"] == [0, 0, 16] and schemas[2]["held_out_class_counts"] == [0, 0, 4]
    assert silo_manifest(schemas)["labels"] == list(classes)


def test_declared_text_classes_map_tables_test_paths_and_server_sets(tmp_path):
    X, y = _tabular(n=60)
    names = np.array(["benign", "malignant", "unclear"])
    pq.write_table(pa.table({"f0": X[y < 2, 0], "dx": names[y[y < 2]]}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"f0": X[y == 2, 0], "dx": names[y[y == 2]]}), tmp_path / "test.parquet")  # labels the training lacks
    classes = ("unclear", "benign", "malignant")  # label order as declared, not sorted
    spec = {"dataset": "parquet", "path": str(tmp_path / "train.parquet"), "label": "dx", "test_path": str(tmp_path / "test.parquet")}
    train, held = load_silo(spec, client=0, classes=classes)
    assert np.array_equal(train.y, np.where(y[y < 2] == 0, 1, 2)) and set(held.y.tolist()) == {0}
    assert (
        load_server_set(
            {"dataset": "parquet", "path": str(tmp_path / "test.parquet"), "label": "dx"}, key="data.test", classes=classes
        ).y.tolist()
        == [0] * 20
    )


@pytest.mark.parametrize("field", ["path", "test_path"])
def test_a_label_not_declared_names_the_silo_and_the_value(tmp_path, field):
    X, y = _tabular(n=60)
    np.savez(tmp_path / "good.npz", X=X, y=y)
    np.savez(tmp_path / "bad.npz", X=X, y=y + 5)  # labels 5, 6, 7
    spec = {"dataset": "npz", "path": str(tmp_path / "good.npz"), "test_path": str(tmp_path / "good.npz")}
    spec[field] = str(tmp_path / "bad.npz")
    with pytest.raises(
        InputError,
        match=rf"^data\.silos\.3\.{field}: expected labels among data\.classes \['0', '1', '2'\] in "
        rf"'.*bad\.npz', got '5'",
    ) as info:
        load_silo(spec, client=3, classes=("0", "1", "2"))
    assert "\n" not in str(info.value)
    with pytest.raises(InputError, match=r"^data\.test\.path: expected labels among data\.classes"):
        load_server_set({"dataset": "npz", "path": str(tmp_path / "bad.npz")}, key="data.test", classes=("0", "1", "2"))


def test_silo_configs_with_data_classes_validate_and_dump():
    cfg = validate_config({**SILO_CONFIG, "data": {**SILO_CONFIG["data"], "classes": [0, 1, "unclear"]}})
    assert cfg.data.classes == [0, 1, "unclear"] and cfg.data.class_names == ("0", "1", "unclear")
    assert (
        cfg.data.model_dump()["classes"] == [0, 1, "unclear"]
        and validate_config({**SILO_CONFIG, "data": cfg.data.model_dump()}).data == cfg.data
    )
    assert validate_config(SILO_CONFIG).data.model_dump()["classes"] is None  # undeclared
