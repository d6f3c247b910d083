"""Dataset registry (rayfuse.data.datasets): bundled and generated datasets load offline with the promised shapes and
dtypes; user files (npz, parquet) load; every bad input is an InputError naming the data.* key."""

from __future__ import annotations

import numpy as np
import pytest

from rayfuse.data.datasets import DATASETS, Dataset, load_dataset
from rayfuse.errors import InputError

# ---------------------------------------------------------------------------------------------------------------
# Bundled scikit-learn datasets


@pytest.mark.parametrize(
    ("name", "shape", "class_counts"),
    [
        ("digits", (1797, 1, 8, 8), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]),
        ("breast_cancer", (569, 30), [212, 357]),
        ("wine", (178, 13), [59, 71, 48]),
        ("iris", (150, 4), [50, 50, 50]),
        ("mnist5k", (5000, 1, 28, 28), [500] * 10),
    ],
)
def test_bundled_dataset_has_float32_inputs_int64_labels_and_known_class_counts(name, shape, class_counts):
    ds = load_dataset(name)
    assert ds.X.dtype == np.float32 and ds.y.dtype == np.int64
    assert ds.X.shape == shape and ds.input_shape == shape[1:]
    assert ds.num_classes == len(class_counts) == len(ds.class_names)
    assert np.bincount(ds.y).tolist() == class_counts
    assert not ds.has_test_split


def test_digits_are_single_channel_8x8_images_scaled_to_unit_interval():
    ds = load_dataset("digits")
    assert ds.X.min() == 0.0 and ds.X.max() == 1.0  # raw pixels 0..16 divided by 16
    assert ds.class_names == tuple(str(i) for i in range(10))


def test_mnist5k_is_mnist_scaled_to_unit_interval_and_loads_under_its_alias():
    ds = load_dataset("mnist_5k")
    assert ds.name == "mnist5k" and ds.X.min() == 0.0 and ds.X.max() == 1.0  # raw pixels 0..255 divided by 255
    # an MNIST image: dark border, ink in the middle (about 19 % of the pixels on average)
    assert ds.X[:, :, :2, :].mean() < 0.01 and 0.1 < (ds.X > 0).mean() < 0.3
    assert DATASETS.get("mnist5k").standardize is False


@pytest.mark.parametrize("name", ["digits", "breast_cancer", "wine", "iris", "synthetic"])
def test_loading_twice_gives_identical_arrays(name):
    a, b = load_dataset(name), load_dataset(name)
    assert np.array_equal(a.X, b.X) and np.array_equal(a.y, b.y)


def test_tabular_datasets_default_to_standardisation_and_images_do_not():
    assert DATASETS.get("digits").standardize is False
    assert all(DATASETS.get(name).standardize for name in ("breast_cancer", "wine", "iris", "synthetic", "parquet"))


# ---------------------------------------------------------------------------------------------------------------
# The synthetic generator


def test_synthetic_defaults():
    ds = load_dataset("synthetic")
    assert ds.X.shape == (2000, 20) and ds.num_classes == 4
    assert np.bincount(ds.y).tolist() == [500] * 4  # balanced classes


def test_synthetic_respects_its_options():
    ds = load_dataset("synthetic", options={"n_samples": 90, "n_features": 5, "n_classes": 3, "n_informative": 2, "random_state": 4})
    assert ds.X.shape == (90, 5) and ds.X.dtype == np.float32 and ds.y.dtype == np.int64
    assert ds.num_classes == 3 and np.bincount(ds.y).tolist() == [30, 30, 30]


def test_synthetic_random_state_changes_the_draw():
    a = load_dataset("synthetic", options={"n_samples": 50, "random_state": 1})
    b = load_dataset("synthetic", options={"n_samples": 50, "random_state": 2})
    assert not np.array_equal(a.X, b.X)


def test_gaussians4_is_epgans_toy_set():
    from rayfuse.data.datasets import gaussians4_mixture

    ds = load_dataset("gaussians4", options={"n_per_mode": 3000, "random_state": 3})
    centres, variances = gaussians4_mixture(random_state=3)
    assert ds.X.shape == (12000, 2) and ds.num_classes == 4 and not ds.has_test_split
    assert ((variances >= 0.3) & (variances <= 0.5)).all()
    for k in range(4):  # one isotropic Gaussian per label, at (+-3, +-3) with the drawn variance
        points = ds.X[ds.y == k]
        np.testing.assert_allclose(points.mean(0), centres[k], atol=0.05)
        np.testing.assert_allclose(points.var(0), [variances[k]] * 2, rtol=0.1)


@pytest.mark.parametrize(
    "options,key",
    [
        ({"n_per_mode": 1}, "n_per_mode"),
        ({"var_low": -1.0}, "var_low"),
        ({"var_low": 0.5, "var_high": 0.3}, "var_high"),
        ({"n_points": 5}, "n_points"),
    ],
)
def test_gaussians4_bad_options_name_the_key(options, key):
    with pytest.raises(InputError, match=rf"data\.options\.{key}"):
        load_dataset("gaussians4", options=options)


def centre_spread(class_sep: float) -> tuple[float, float]:
    """Spread of the class means over the informative (first 3) and the noise (last 3) dimensions."""
    ds = load_dataset("synthetic", options={"n_samples": 4000, "n_features": 6, "n_informative": 3, "class_sep": class_sep})
    means = np.stack([ds.X[ds.y == c].mean(axis=0) for c in range(4)])
    return float(means[:, :3].std(axis=0).mean()), float(means[:, 3:].std(axis=0).mean())


def test_synthetic_noise_dimensions_carry_no_class_signal():
    informative, noise = centre_spread(5.0)
    assert informative > 1.0  # centres ~ N(0, 5^2)
    assert noise < 0.1  # the mean of 1000 unit normals per class


def test_synthetic_class_sep_scales_the_class_centres():
    far, _ = centre_spread(5.0)
    near, _ = centre_spread(0.5)
    assert far == pytest.approx(10 * near, rel=0.1)  # same random_state: the same centres, scaled


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"n_samples": 5}, "n_samples"),
        ({"n_samples": 10.5}, "n_samples"),
        ({"n_samples": True}, "n_samples"),
        ({"n_features": 0}, "n_features"),
        ({"n_classes": 1}, "n_classes"),
        ({"n_informative": 0}, "n_informative"),
        ({"n_features": 3, "n_informative": 4}, "n_informative"),
        ({"random_state": -1}, "random_state"),
        ({"class_sep": 0}, "class_sep"),
        ({"class_sep": "far"}, "class_sep"),
        ({"n_sample": 100}, "n_sample"),  # an unknown option
    ],
)
def test_bad_synthetic_options_name_the_option(options, key):
    with pytest.raises(InputError, match=rf"^data\.options\.{key}: "):
        load_dataset("synthetic", options=options)


def test_unknown_option_of_a_dataset_without_options_is_rejected():
    with pytest.raises(InputError, match=r"^data\.options\.scale: expected no options for dataset 'digits'"):
        load_dataset("digits", options={"scale": 2})


def test_unknown_dataset_names_data_dataset_and_suggests():
    with pytest.raises(InputError, match=r"^data\.dataset: .*did you mean 'digits'"):
        load_dataset("digit")


# ---------------------------------------------------------------------------------------------------------------
# torchvision datasets from a local folder (nothing downloads)


def test_torchvision_dataset_without_root_says_where_to_put_the_files():
    with pytest.raises(InputError, match=r"^data\.root: .*MNIST/raw") as info:
        load_dataset("mnist")
    assert "train-images-idx3-ubyte" in str(info.value)


def test_torchvision_dataset_with_empty_root_names_data_root_and_downloads_nothing(tmp_path):
    pytest.importorskip("torchvision")
    with pytest.raises(InputError, match=r"^data\.root: .*MNIST/raw/ with train-images-idx3-ubyte") as info:
        load_dataset("mnist", root=str(tmp_path))
    assert str(tmp_path) in str(info.value)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no download started, not even a folder


def test_torchvision_alias_resolves_to_the_snake_case_name():
    assert DATASETS.canonical("FashionMNIST") == "fashion_mnist"
    with pytest.raises(InputError, match=r"^data\.root: .*FashionMNIST/raw"):
        load_dataset("FashionMNIST")


# ---------------------------------------------------------------------------------------------------------------
# User files: npz


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_npz_with_integer_labels_loads(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 4))
    y = np.arange(30) % 3
    ds = load_dataset("npz", path=write_npz(tmp_path / "toy.npz", X=X, y=y))
    assert ds.name == "toy"
    assert ds.X.dtype == np.float32 and ds.y.dtype == np.int64
    assert np.allclose(ds.X, X.astype(np.float32)) and np.array_equal(ds.y, y)
    assert ds.num_classes == 3


def test_npz_string_labels_are_mapped_to_sorted_integer_classes(tmp_path):
    labels = np.array(["dog", "cat", "emu", "cat", "dog", "emu"])
    ds = load_dataset("npz", path=write_npz(tmp_path / "pets.npz", X=np.zeros((6, 2)), y=labels))
    assert ds.class_names == ("cat", "dog", "emu")
    assert ds.y.tolist() == [1, 0, 2, 0, 1, 2]


def test_npz_custom_keys_via_features_and_label(tmp_path):
    path = write_npz(tmp_path / "keys.npz", inputs=np.ones((4, 3)), target=np.array([0, 1, 0, 1]))
    ds = load_dataset("npz", path=path, features="inputs", label="target")
    assert ds.X.shape == (4, 3) and ds.y.tolist() == [0, 1, 0, 1]


def test_npz_grey_images_get_a_channel_axis_and_colour_images_keep_theirs(tmp_path):
    y = np.array([0, 1, 0, 1])
    grey = load_dataset("npz", path=write_npz(tmp_path / "grey.npz", X=np.zeros((4, 8, 8), np.uint8), y=y))
    colour = load_dataset("npz", path=write_npz(tmp_path / "colour.npz", X=np.zeros((4, 3, 5, 5)), y=y))
    assert grey.input_shape == (1, 8, 8) and grey.X.dtype == np.float32
    assert colour.input_shape == (3, 5, 5)


def test_npz_integer_labels_keep_their_values_even_with_a_gap(tmp_path):
    # Labels {0, 2, 5}: class ids are kept (6 classes), so a file with a class missing still lines up with the others.
    ds = load_dataset("npz", path=write_npz(tmp_path / "gap.npz", X=np.zeros((3, 1)), y=np.array([0, 2, 5])))
    assert ds.num_classes == 6 and ds.y.tolist() == [0, 2, 5]


def test_npz_large_or_negative_integer_labels_are_remapped(tmp_path):
    ds = load_dataset("npz", path=write_npz(tmp_path / "big.npz", X=np.zeros((3, 1)), y=np.array([100, -1, 100])))
    assert ds.num_classes == 2 and ds.y.tolist() == [1, 0, 1] and ds.class_names == ("-1", "100")


@pytest.mark.parametrize(
    ("arrays", "kwargs", "match"),
    [
        pytest.param(
            {"X": np.zeros((3, 2)), "y": [0, 1, 0]},
            {"features": "inputs"},
            r"^data\.features: .*\(X, y\), got 'inputs'",
            id="missing-feature-key",
        ),
        pytest.param({"X": np.zeros((3, 2)), "y": [0, 1, 0]}, {"label": "target"}, r"^data\.label: .*got 'target'", id="missing-label-key"),
        pytest.param(
            {"X": np.array([["a", "b"]] * 3), "y": [0, 1, 0]}, {}, r"^data\.features: expected a numeric array", id="non-numeric-features"
        ),
        pytest.param(
            {"X": np.zeros((3, 2)), "y": [0, 1, 0]}, {"features": ["X"]}, r"^data\.features: expected one array name", id="feature-list"
        ),
        pytest.param({"X": np.zeros((3, 2)), "y": [1, 1, 1]}, {}, r"^data\.label: expected at least 2 distinct labels", id="single-class"),
        pytest.param({"X": np.zeros((3, 2)), "y": [0, 1]}, {}, r"as many labels as samples", id="length-mismatch"),
        pytest.param({"X": np.array([[0.0], [np.nan], [1.0]]), "y": [0, 1, 0]}, {}, r"finite feature values", id="nan-features"),
    ],
)
def test_bad_npz_raises_input_error_naming_the_key(tmp_path, arrays, kwargs, match):
    path = write_npz(tmp_path / "bad.npz", **{k: np.asarray(v) for k, v in arrays.items()})
    with pytest.raises(InputError, match=match):
        load_dataset("npz", path=path, **kwargs)


def test_npz_with_pickled_objects_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, X=np.array([{"a": 1}, {"b": 2}], dtype=object), y=np.array([0, 1]))
    with pytest.raises(InputError, match=r"without pickled objects"):
        load_dataset("npz", path=str(path))


@pytest.mark.parametrize("name", ["npz", "parquet"])
def test_missing_user_file_names_data_path(tmp_path, name):
    missing = str(tmp_path / f"nope.{name}")
    with pytest.raises(InputError, match=r"^data\.path: expected an existing") as info:
        load_dataset(name, path=missing)
    assert missing in str(info.value)
    with pytest.raises(InputError, match=r"^data\.path: "):
        load_dataset(name, path=None)


def test_unreadable_npz_names_the_file(tmp_path):
    path = tmp_path / "broken.npz"
    path.write_bytes(b"this is not a zip archive")
    with pytest.raises(InputError, match=r"broken\.npz: expected a readable \.npz archive"):
        load_dataset("npz", path=str(path))


# ---------------------------------------------------------------------------------------------------------------
# User files: parquet


@pytest.fixture
def parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def write(columns: dict, name: str = "table.parquet") -> str:
        path = tmp_path / name
        pq.write_table(pa.table(columns), path)
        return str(path)

    return write


def test_parquet_uses_every_other_numeric_column_by_default(parquet_file):
    path = parquet_file({"a": [1.0, 2.0, 3.0, 4.0], "b": [1, 2, 3, 4], "note": ["w", "x", "y", "z"], "y": [0, 1, 1, 0]})
    ds = load_dataset("parquet", path=path)
    assert ds.name == "table"
    assert ds.X.shape == (4, 2) and ds.X.dtype == np.float32  # the string column is left out
    assert ds.X[:, 1].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert ds.y.tolist() == [0, 1, 1, 0] and ds.y.dtype == np.int64


def test_parquet_string_label_column_maps_to_ints(parquet_file):
    path = parquet_file({"f": [0.1, 0.2, 0.3], "species": ["setosa", "virginica", "setosa"]})
    ds = load_dataset("parquet", path=path, label="species")
    assert ds.class_names == ("setosa", "virginica") and ds.y.tolist() == [0, 1, 0]


def test_parquet_explicit_feature_columns(parquet_file):
    path = parquet_file({"a": [1.0, 2.0], "b": [3.0, 4.0], "c": [5.0, 6.0], "y": [0, 1]})
    assert load_dataset("parquet", path=path, features=["c", "a"]).X.tolist() == [[5.0, 1.0], [6.0, 2.0]]
    assert load_dataset("parquet", path=path, features="b").X.tolist() == [[3.0], [4.0]]


@pytest.mark.parametrize(
    ("columns", "kwargs", "match"),
    [
        pytest.param(
            {"a": [1.0, 2.0], "y": [0, 1]}, {"label": "target"}, r"^data\.label: .*\(a, y\), got 'target'", id="missing-label-column"
        ),
        pytest.param({"a": [1.0, 2.0], "y": [0, 1]}, {"features": ["a", "z"]}, r"^data\.features: .*got 'z'", id="missing-feature-column"),
        pytest.param(
            {"a": ["p", "q"], "y": [0, 1]},
            {"features": ["a"]},
            r"^data\.features: expected numeric columns",
            id="non-numeric-feature-column",
        ),
        pytest.param(
            {"a": ["p", "q"], "y": [0, 1]}, {}, r"^data\.features: expected at least one numeric feature column", id="no-numeric-column"
        ),
        pytest.param(
            {"a": [1.0, None], "y": [0, 1]}, {}, r"^data\.features: expected numeric columns without nulls.*'a'", id="null-feature"
        ),
    ],
)
def test_bad_parquet_raises_input_error_naming_the_key(parquet_file, columns, kwargs, match):
    with pytest.raises(InputError, match=match):
        load_dataset("parquet", path=parquet_file(columns), **kwargs)


def test_unreadable_parquet_names_the_file(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match=r"broken\.parquet: expected a readable parquet file"):
        load_dataset("parquet", path=str(path))


# ---------------------------------------------------------------------------------------------------------------
# The Dataset container checks what loaders return


def test_dataset_rejects_wrong_dtypes_and_out_of_range_labels():
    with pytest.raises(TypeError, match="float32 X and int64 y"):
        Dataset("d", np.zeros((2, 1)), np.zeros(2, np.int64), 2, ("a", "b"))
    with pytest.raises(InputError, match=r"labels in 0\.\.1"):
        Dataset("d", np.zeros((2, 1), np.float32), np.array([0, 2]), 2, ("a", "b"))


def test_dataset_test_split_is_checked_too():
    X = np.zeros((2, 1), np.float32)
    y = np.array([0, 1])
    with pytest.raises(InputError, match=r"data \(d \(test split\)\)"):
        Dataset("d", X, y, 2, ("a", "b"), X_test=X, y_test=np.array([0]))
    assert Dataset("d", X, y, 2, ("a", "b"), X_test=X, y_test=y).has_test_split


def test_mnist1d_is_generated_the_same_for_a_seed_balanced_standardised_with_a_test_split():
    from rayfuse.data.datasets import load_dataset

    data = load_dataset("mnist1d", options={"num_samples": 500, "seed": 3})
    again = load_dataset("mnist1d", options={"num_samples": 500, "seed": 3})
    other = load_dataset("mnist1d", options={"num_samples": 500, "seed": 4})
    assert data.X.shape == (400, 40, 1) and data.X_test is not None and data.X_test.shape == (100, 40, 1)
    np.testing.assert_array_equal(data.X, again.X)
    assert not np.array_equal(data.X, other.X)
    both = np.concatenate([data.X, data.X_test])
    assert abs(float(both.mean())) < 1e-3 and abs(float(both.std()) - 1) < 1e-3
    assert np.bincount(np.concatenate([data.y, data.y_test]), minlength=10).tolist() == [50] * 10
    means = np.stack([both[np.concatenate([data.y, data.y_test]) == c].mean(0)[:, 0] for c in range(10)])
    assert np.linalg.matrix_rank(means) == 10  # ten different mean signals: the templates survive the transforms


def test_bad_mnist1d_options_are_one_line():
    from rayfuse.data.datasets import load_dataset

    with pytest.raises(InputError, match=r"data.options.num_samples: expected an integer >= 20"):
        load_dataset("mnist1d", options={"num_samples": 5})
    with pytest.raises(InputError, match=r"data.options.test_fraction: expected a fraction in \(0, 1\)"):
        load_dataset("mnist1d", options={"test_fraction": 1.5})
