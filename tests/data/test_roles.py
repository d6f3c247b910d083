"""Data roles and the partition manifest (rayfuse.data.roles), and the seeds they derive from (rayfuse.seeding)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rayfuse.config import DataConfig, PartitionConfig
from rayfuse.data.datasets import Dataset, load_dataset
from rayfuse.data.partition import class_counts
from rayfuse.data.roles import ClientPlan, client_splits, make_plan, pooled_train, server_splits
from rayfuse.errors import InputError
from rayfuse.seeding import derive_seed, make_rng


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


@pytest.fixture(scope="module")
def wine() -> Dataset:
    return load_dataset("wine")


def plan_for(dataset, seed=0, *, data=None, partition=None):
    return make_plan(dataset, DataConfig(**(data or {})), PartitionConfig(**(partition or {})), seed)


ROLE_CASES = {
    "dirichlet": {"partition": {"method": "dirichlet", "num_clients": 5}},
    "dirichlet+public": {"data": {"public_size": 0.1}, "partition": {"method": "hetero-dir", "num_clients": 4, "alpha": 0.3}},
    "labels-with-unassigned": {
        "data": {"public_size": 50},
        "partition": {"method": "labels", "num_clients": 3, "groups": [[0, 1], [2, 3], [1, 4, 5]]},
    },
    "pathological": {"partition": {"method": "pathological", "num_clients": 4, "classes_per_client": 2}},
    "shards-partial": {"partition": {"method": "shards", "num_clients": 4, "shards_per_client": 2, "shard_size": 100}},
}


def roles(plan) -> dict[str, np.ndarray]:
    out = {"test": plan.test, "public": plan.public}
    for i in range(plan.num_clients):
        out[f"train{i}"] = plan.client_train[i]
        out[f"val{i}"] = plan.client_val[i]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Roles are disjoint and cover the dataset


@pytest.mark.parametrize("case", ROLE_CASES)
def test_roles_are_disjoint_and_cover_the_dataset_minus_unassigned(digits, case):
    plan = plan_for(digits, **ROLE_CASES[case])
    everything = np.concatenate(list(roles(plan).values()))
    assert len(np.unique(everything)) == len(everything), "an index in two roles"
    assert len(everything) + plan.unassigned == len(digits.y)
    assert everything.min() >= 0 and everything.max() < len(digits.y)


def test_labels_partition_leaves_exactly_the_unassigned_labels_out(digits):
    plan = plan_for(digits, **ROLE_CASES["labels-with-unassigned"])  # labels 6..9 are nobody's
    left_out = np.setdiff1d(np.arange(len(digits.y)), np.concatenate(list(roles(plan).values())))
    assert len(left_out) == plan.unassigned > 0
    assert set(np.unique(digits.y[left_out]).tolist()) == {6, 7, 8, 9}
    assert plan.counts[:, 6:].sum() == 0


def test_test_split_is_stratified(digits):
    plan = plan_for(digits, data={"test_size": 0.25})
    assert len(plan.test) == round(0.25 * len(digits.y))
    per_class = np.bincount(digits.y[plan.test], minlength=10)
    expected = 0.25 * np.bincount(digits.y)
    assert np.all(np.abs(per_class - expected) <= 1)
    assert plan.test_source == "split"


def test_public_size_as_a_fraction_of_the_training_pool(digits):
    plan = plan_for(digits, data={"public_size": 0.2})
    pool = len(digits.y) - len(plan.test)
    assert len(plan.public) == round(0.2 * pool)
    per_class = np.bincount(digits.y[plan.public], minlength=10)
    assert per_class.min() >= 0.2 * pool / 10 - 3  # stratified: every class is there in about equal numbers


def test_public_size_as_a_count(digits):
    assert len(plan_for(digits, data={"public_size": 37}).public) == 37


def test_public_sample_is_empty_by_default(digits):
    plan = plan_for(digits)
    assert len(plan.public) == 0 and plan.public.dtype == np.int64


@pytest.mark.parametrize("val_size", [0.0, 0.1, 0.3])
def test_each_client_keeps_val_size_of_its_shard_for_validation(digits, val_size):
    plan = plan_for(digits, data={"val_size": val_size})
    for train, val in zip(plan.client_train, plan.client_val):
        shard = len(train) + len(val)
        expected = 0 if val_size == 0 else min(max(round(val_size * shard), 1), shard - 1)
        assert len(val) == expected
        assert len(np.intersect1d(train, val)) == 0


def test_tiny_shard_still_gets_one_validation_sample_and_one_training_sample():
    y = np.array([0, 1] * 10, dtype=np.int64)
    ds = Dataset("tiny", np.zeros((20, 2), np.float32), y, 2, ("a", "b"))
    plan = plan_for(ds, data={"dataset": "synthetic", "test_size": 0.5, "val_size": 0.01}, partition={"method": "iid", "num_clients": 5})
    assert [len(v) for v in plan.client_val] == [1] * 5  # round(0.01 * 2) = 0, raised to one
    assert [len(t) for t in plan.client_train] == [1] * 5


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"test_size": 0.0001}, r"^data\.test_size: "),  # rounds to an empty test set
        ({"public_size": 5000}, r"^data\.public_size: expected fewer samples than the training pool \(1438\)"),
        ({"public_size": 0.9999}, r"^data\.public_size: "),
    ],
)
def test_impossible_role_sizes_raise_input_error(digits, data, match):
    with pytest.raises(InputError, match=match):
        plan_for(digits, data=data)


# ---------------------------------------------------------------------------------------------------------------
# Determinism and the manifest


def test_plan_digest_is_stable_for_the_same_seed_and_changes_with_the_seed(digits):
    a, b, c = plan_for(digits, seed=3), plan_for(digits, seed=3), plan_for(digits, seed=4)
    assert a.digest() == b.digest()
    assert all(np.array_equal(x, y) for x, y in zip(roles(a).values(), roles(b).values()))
    assert a.digest() != c.digest()
    assert len(a.digest()) == 64


def test_plan_digest_changes_when_any_index_moves(digits):
    plan = plan_for(digits)
    moved = dataclasses.replace(plan, client_val=(plan.client_val[0][:-1], *plan.client_val[1:]))
    assert moved.digest() != plan.digest()


def test_manifest_is_json_and_its_class_counts_match_the_indices(digits):
    plan = plan_for(digits, **ROLE_CASES["dirichlet+public"])
    manifest = json.loads(json.dumps(plan.manifest()))
    assert manifest["hash"] == plan.digest()
    assert manifest["seed"] == 0 and manifest["dataset"] == "digits" and manifest["num_classes"] == 10
    assert manifest["partition"] == {"method": "dirichlet", "num_clients": 4, "alpha": 0.3, "balance": True, "min_size": 10}
    assert manifest["test_indices"] == plan.test.tolist()
    assert manifest["roles"]["public"]["indices"] == plan.public.tolist()
    assert len(manifest["clients"]) == 4
    for i, client in enumerate(manifest["clients"]):
        assert sum(client["class_counts"]) == client["num_train"] + client["num_val"]
        indices = np.array(client["train"] + client["val"])
        assert client["class_counts"] == np.bincount(digits.y[indices], minlength=10).tolist()
        assert client["train"] == plan.client_train[i].tolist()


def test_plan_counts_are_train_plus_val_class_counts(digits):
    plan = plan_for(digits)
    shards = [np.concatenate([t, v]) for t, v in zip(plan.client_train, plan.client_val)]
    assert np.array_equal(plan.counts, class_counts(digits.y, shards, 10))
    assert plan.num_examples(2) == len(plan.client_train[2])


# ---------------------------------------------------------------------------------------------------------------
# Standardisation comes from the training pool only


def test_standardisation_statistics_exclude_the_test_set(wine):
    plan = plan_for(wine, data={"dataset": "wine", "public_size": 10})  # wine standardises by default
    assert plan.normalization is not None
    not_test = np.setdiff1d(np.arange(len(wine.y)), plan.test)
    np.testing.assert_allclose(plan.normalization.mean[0], wine.X[not_test].mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(plan.normalization.std[0], wine.X[not_test].std(axis=0), rtol=1e-5)
    # and the test set would have changed them: the check above is not vacuous
    assert not np.allclose(plan.normalization.mean[0], wine.X.mean(axis=0), rtol=1e-5)


def test_standardisation_ignores_a_predefined_test_split():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3)).astype(np.float32)
    y = np.arange(40, dtype=np.int64) % 2
    ds = Dataset("shifted", X, y, 2, ("a", "b"), X_test=X[:10] + 100.0, y_test=y[:10])
    plan = plan_for(ds, data={"dataset": "synthetic", "standardize": True}, partition={"method": "iid", "num_clients": 2})
    assert plan.test_source == "predefined" and np.array_equal(plan.test, np.arange(10))
    np.testing.assert_allclose(plan.normalization.mean[0], X.mean(axis=0), rtol=1e-5, atol=1e-6)
    test, _ = server_splits(ds, plan)
    np.testing.assert_allclose(test.X, (X[:10] + 100.0 - plan.normalization.mean) / plan.normalization.std, rtol=1e-5)
    assert test.X.mean() > 10  # the test split is shifted, and normalised with the training pool's statistics


def test_constant_feature_gets_unit_std():
    X = np.zeros((30, 2), np.float32)
    X[:, 1] = np.arange(30)
    ds = Dataset("const", X, np.arange(30, dtype=np.int64) % 3, 3, ("a", "b", "c"))
    plan = plan_for(ds, data={"dataset": "synthetic", "standardize": True}, partition={"method": "iid", "num_clients": 2})
    assert plan.normalization.std[0, 0] == 1.0
    train, _ = client_splits(ds, plan.for_client(0))
    assert np.isfinite(train.X).all()


def test_digits_are_not_standardised_by_default(digits):
    assert plan_for(digits).normalization is None
    assert plan_for(digits, data={"standardize": True}).normalization.mean.shape == (1, 1, 8, 8)


# ---------------------------------------------------------------------------------------------------------------
# What a client and the server receive


def test_for_client_exposes_only_that_clients_indices(digits):
    plan = plan_for(digits)
    client = plan.for_client(3)
    assert {f.name for f in dataclasses.fields(ClientPlan)} == {
        "client_id",
        "train",
        "val",
        "normalization",
        "num_classes",
        "input_shape",
        "corruption",
        "corruption_seed",
    }
    assert client.client_id == 3 and client.num_classes == 10 and client.input_shape == (1, 8, 8)
    assert np.array_equal(client.train, plan.client_train[3]) and np.array_equal(client.val, plan.client_val[3])
    others = np.concatenate([plan.test, *plan.client_train[:3], *plan.client_val[:3], *plan.client_train[4:], *plan.client_val[4:]])
    assert len(np.intersect1d(np.concatenate([client.train, client.val]), others)) == 0


def test_client_splits_hold_the_clients_rows(digits):
    plan = plan_for(digits)
    train, val = client_splits(digits, plan.for_client(1))
    assert np.array_equal(train.y, digits.y[plan.client_train[1]]) and np.array_equal(train.X, digits.X[plan.client_train[1]])
    assert len(val) == len(plan.client_val[1])
    assert train.X.dtype == np.float32 and train.y.dtype == np.int64 and train.X.flags.c_contiguous


def test_server_splits_and_pooled_train(digits):
    plan = plan_for(digits, data={"public_size": 20})
    test, public = server_splits(digits, plan)
    assert np.array_equal(test.y, digits.y[plan.test]) and len(public) == 20
    pooled = pooled_train(digits, plan)
    assert len(pooled) == sum(len(t) for t in plan.client_train)
    assert np.array_equal(pooled.y, digits.y[np.sort(np.concatenate(plan.client_train))])


def test_corrupted_clients_load_corrupted_shards_and_the_others_clean_ones(digits):
    plan = plan_for(
        digits, partition={"method": "iid", "num_clients": 4, "corrupt": {1: "shuffle_labels", 2: "noise", 3: "permute_pixels"}}
    )
    clean = plan_for(digits, partition={"method": "iid", "num_clients": 4})
    assert plan.client_train[1].tolist() == clean.client_train[1].tolist()  # the same indices, only the content changes
    splits = {i: client_splits(digits, plan.for_client(i))[0] for i in range(4)}
    rows = {i: digits.X[plan.client_train[i]] for i in range(4)}
    labels = {i: digits.y[plan.client_train[i]] for i in range(4)}
    assert np.array_equal(splits[0].X, rows[0]) and np.array_equal(splits[0].y, labels[0])
    # random labels: the same label multiset, mostly on other samples; inputs untouched
    assert np.array_equal(np.sort(splits[1].y), np.sort(labels[1])) and np.mean(splits[1].y != labels[1]) > 0.5
    assert np.array_equal(splits[1].X, rows[1])
    # noise: twice the inputs' std
    assert np.std(splits[2].X - rows[2]) == pytest.approx(2 * rows[2].std(), rel=0.05)
    # permuted pixels: one permutation for every sample, the same in train and val
    order = make_rng(plan.for_client(3).corruption_seed, "pixels").permutation(64)
    assert np.array_equal(splits[3].X.reshape(-1, 64), rows[3].reshape(-1, 64)[:, order]) and not np.array_equal(splits[3].X, rows[3])
    val = client_splits(digits, plan.for_client(3))[1]
    assert np.array_equal(val.X.reshape(-1, 64), digits.X[plan.client_val[3]].reshape(-1, 64)[:, order])
    # deterministic (a restarted actor reloads the same corrupted shard), recorded in the manifest, part of the hash
    assert np.array_equal(client_splits(digits, plan.for_client(2))[0].X, splits[2].X)
    assert [c.get("corrupt") for c in plan.manifest()["clients"]] == [None, "shuffle_labels", "noise", "permute_pixels"]
    assert plan.digest() != clean.digest()


def test_corrupting_an_unknown_client_is_rejected():
    with pytest.raises(InputError, match=r"^partition\.corrupt\.7: expected a client id in 0\.\.3"):
        from rayfuse.config import validate_config

        validate_config({"partition": {"num_clients": 4, "corrupt": {7: "noise"}}})


# ---------------------------------------------------------------------------------------------------------------
# rayfuse.seeding (tested here, next to make_plan, its main user)


def test_derive_seed_has_a_fixed_value():
    # Hard-coded: a change here silently changes every split and initialisation of every past run.
    assert derive_seed(0, "partition") == 157664031
    assert derive_seed(42, "client", 3) == 3036409404


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((0, "partition"), (0, "test-split")),
        ((0, "partition"), (1, "partition")),
        ((0, "client", 1), (0, "client", 2)),
        ((0, "a", "b"), (0, "b", "a")),
        ((0, 1), (0, "1")),
        ((0,), (0, "x")),
    ],
)
def test_derive_seed_differs_by_seed_tags_and_tag_order(a, b):
    assert derive_seed(*a) != derive_seed(*b)


def test_derive_seed_is_a_32_bit_int_and_numpy_ints_equal_python_ints():
    seed = derive_seed(7, np.int64(3), "fedavg")
    assert isinstance(seed, int) and 0 <= seed < 2**32
    assert seed == derive_seed(7, 3, "fedavg")


def test_derive_seed_is_the_same_in_another_process():
    # str hashes are salted per process; derive_seed must not be. Force a different salt in the child.
    code = "from rayfuse.seeding import derive_seed; print(derive_seed(42, 'client', 3), derive_seed(5, 'round', 'x'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert [int(v) for v in out] == [derive_seed(42, "client", 3), derive_seed(5, "round", "x")]


def test_make_rng_streams_repeat_for_the_same_tags():
    assert np.array_equal(make_rng(1, "a").integers(1 << 30, size=5), make_rng(1, "a").integers(1 << 30, size=5))
    assert not np.array_equal(make_rng(1, "a").integers(1 << 30, size=5), make_rng(1, "b").integers(1 << 30, size=5))


# ---------------------------------------------------------------------------------------------------------------
# data.target: a new task for the server (its public sample and the test set), the clients keep data.dataset


def test_a_target_dataset_supplies_the_test_set_and_public_sample_and_the_clients_share_all_of_the_source():
    from rayfuse.data.roles import load_target_from_config

    data = DataConfig(dataset="mnist5k", public_size=0.05, target={"dataset": "digits", "resize": [20, 20], "pad": 4})
    source, target = load_dataset("mnist5k"), load_target_from_config(data)
    # digits 8x8 resized to 20x20 and padded into MNIST's 28x28 frame: ink in the middle, a blank border
    assert target.input_shape == (1, 28, 28) and target.X[:, :, :4, :].max() == 0 and target.X.max() > 0.9
    plan = make_plan(source, data, PartitionConfig(method="iid", num_clients=3), 0, target=target)
    assert plan.target == "digits" and plan.dataset == "mnist5k"
    assert np.array_equal(np.sort(np.concatenate(plan.client_train + plan.client_val)), np.arange(len(source.y)))
    assert len(plan.test) == round(0.2 * len(target.y)) and len(plan.public) == round(0.05 * (len(target.y) - len(plan.test)))
    assert not set(plan.test) & set(plan.public)
    test, public = server_splits(target, plan)
    assert np.array_equal(test.X, target.X[plan.test]) and np.array_equal(public.y, target.y[plan.public])
    manifest = plan.manifest()
    assert manifest["target"] == "digits" and manifest["roles"]["public"]["dataset"] == "digits"
    # the same split without a target has another hash: a resume cannot mix the two
    assert (
        plan.digest()
        != make_plan(source, DataConfig(dataset="mnist5k", public_size=0.05), PartitionConfig(method="iid", num_clients=3), 0).digest()
    )


def test_a_target_of_another_shape_or_class_count_is_refused(digits):
    from rayfuse.data.roles import load_target_from_config

    unsized = DataConfig(dataset="mnist5k", target={"dataset": "digits"})
    with pytest.raises(
        InputError, match=r"data\.target: expected inputs shaped like data\.dataset's \(1, 28, 28\).*got 'digits \(1, 8, 8\)'"
    ):
        make_plan(load_dataset("mnist5k"), unsized, PartitionConfig(), 0, target=load_target_from_config(unsized))
    four = DataConfig(dataset="synthetic", options={"n_features": 13, "n_classes": 4, "n_informative": 4}, target={"dataset": "wine"})
    source = load_dataset("synthetic", options=four.options)
    with pytest.raises(InputError, match=r"data\.target\.dataset: expected as many classes as data\.dataset \(4\), got 'wine with 3'"):
        make_plan(source, four, PartitionConfig(), 0, target=load_dataset("wine"))
    with pytest.raises(InputError, match=r"data\.target\.resize: expected an image dataset"):
        load_target_from_config(DataConfig(dataset="digits", target={"dataset": "wine", "resize": [8, 8]}))
