"""Partitioners (rayfuse.data.partition): each keeps its promise on class counts, is deterministic in the seed, never
gives an index twice, covers what it should, and rejects impossible requests with an InputError naming the key."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from rayfuse.data.partition import PARTITIONERS, class_counts, partition
from rayfuse.errors import InputError

# Unequal classes (label c has 60 + 10 c samples: 60, 70, ..., 150; 1050 in all), shuffled so that index order says
# nothing about the label.
SIZES = np.arange(60, 160, 10)
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(10), SIZES))
N, C = len(LABELS), 10

# id: (method, num_clients, params)
CASES = {
    "iid": ("iid", 7, {}),
    "homo": ("homo", 7, {}),
    "dirichlet": ("dirichlet", 6, {"alpha": 0.5, "balance": True, "min_size": 10}),
    "dirichlet-unbalanced": ("dirichlet", 6, {"alpha": 0.5, "balance": False, "min_size": 10}),
    "hetero-dir": ("hetero-dir", 6, {"alpha": 0.3}),
    "labels": ("labels", 5, {"groups": [[0, 1], [1, 2], [3], [4, 5, 6], [1]]}),  # 7, 8, 9 unassigned
    "pathological": ("pathological", 8, {"classes_per_client": 3}),
    "shards": ("shards", 5, {"shards_per_client": 3, "shard_size": 40}),
    "shards-default-size": ("shards", 5, {"shards_per_client": 2}),
}


def split(case: str, seed: int | np.random.Generator = 0, labels: np.ndarray = LABELS) -> list[np.ndarray]:
    method, num_clients, params = CASES[case]
    return partition(labels, num_clients, method, seed=seed, **params)


def assigned_labels(case: str) -> set[int]:
    """Labels a partitioner is expected to hand out (labels / pathological leave the others out)."""
    method, num_clients, params = CASES[case]
    if method == "labels":
        return {label for group in params["groups"] for label in group}
    return set(range(C))


# ---------------------------------------------------------------------------------------------------------------
# Invariants every partitioner keeps


@pytest.mark.parametrize("case", CASES)
def test_parts_are_sorted_int64_one_per_client_and_nonempty(case):
    parts = split(case)
    assert len(parts) == CASES[case][1]
    for part in parts:
        assert part.dtype == np.int64
        assert len(part) > 0
        assert np.all(np.diff(part) > 0), "indices sorted, no repeats inside a client"
        assert part.min() >= 0 and part.max() < N


@pytest.mark.parametrize("case", CASES)
def test_no_index_is_given_to_two_clients(case):
    everything = np.concatenate(split(case))
    assert len(np.unique(everything)) == len(everything)


@pytest.mark.parametrize("case", CASES)
def test_same_seed_gives_identical_indices(case):
    first, second = split(case, seed=7), split(case, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("case", CASES)
def test_different_seed_gives_different_indices(case):
    first, second = split(case, seed=7), split(case, seed=8)
    assert any(not np.array_equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("case", CASES)
def test_generator_seed_is_the_same_as_its_integer_seed(case):
    from_int, from_rng = split(case, seed=11), split(case, seed=np.random.default_rng(11))
    assert all(np.array_equal(a, b) for a, b in zip(from_int, from_rng))


@pytest.mark.parametrize("case", ["iid", "homo", "dirichlet", "dirichlet-unbalanced", "hetero-dir", "shards-default-size"])
def test_partitioners_that_use_the_whole_pool_cover_every_index(case):
    # shards-default-size: 1050 samples / (5 clients * 2 shards) = 105 per shard exactly.
    assert np.array_equal(np.sort(np.concatenate(split(case))), np.arange(N))


@pytest.mark.parametrize("case", ["labels", "pathological"])
def test_label_partitioners_leave_out_only_unassigned_labels(case):
    parts = split(case)
    used = np.sort(np.concatenate(parts))
    held = {int(label) for part in parts for label in np.unique(LABELS[part])}
    if case == "labels":
        assert held == assigned_labels(case)
    expected = np.flatnonzero(np.isin(LABELS, sorted(held)))
    assert np.array_equal(used, expected)


@pytest.mark.parametrize(("alias", "canonical"), [("homo", "iid"), ("hetero-dir", "dirichlet")])
def test_alias_gives_the_same_split_as_its_canonical_name(alias, canonical):
    assert PARTITIONERS.canonical(alias) == canonical
    a = partition(LABELS, 6, alias, seed=3)
    b = partition(LABELS, 6, canonical, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------------------------
# What each partitioner promises


def test_iid_client_sizes_differ_by_at_most_one():
    sizes = [len(p) for p in split("iid")]
    assert sum(sizes) == N
    assert max(sizes) - min(sizes) <= 1  # 1050 / 7 = 150 exactly
    assert sizes == [150] * 7


def test_labels_counts_match_the_hand_computed_table():
    # groups [[0, 1], [1, 2], [3], [4, 5, 6], [1]]: label 1 (70 samples) is shared by clients 0, 1, 4 -> 24, 23, 23
    # (np.array_split gives the extra sample to the first holder); every other label has a single holder.
    expected = np.zeros((5, C), dtype=int)
    expected[0, [0, 1]] = [60, 24]
    expected[1, [1, 2]] = [23, 80]
    expected[2, 3] = 90
    expected[3, [4, 5, 6]] = [100, 110, 120]
    expected[4, 1] = 23
    counts = class_counts(LABELS, split("labels"), C)
    assert np.array_equal(counts, expected)


def test_labels_client_holds_only_its_groups_labels_and_shared_labels_split_evenly():
    groups = [[0, 1, 2], [2, 3], [2, 3, 4], [5], [0, 9]]
    parts = partition(LABELS, 5, "labels", seed=1, groups=groups)
    counts = class_counts(LABELS, parts, C)
    for i, group in enumerate(groups):
        assert set(np.flatnonzero(counts[i])) == set(group)
    for label in range(C):
        holders = [i for i, g in enumerate(groups) if label in g]
        if holders:
            shares = counts[holders, label]
            assert shares.sum() == SIZES[label]
            assert shares.max() - shares.min() <= 1
        else:
            assert counts[:, label].sum() == 0


@pytest.mark.parametrize("classes_per_client", [1, 2, 3, 10])
def test_pathological_each_client_has_exactly_k_classes_the_first_being_i_mod_C(classes_per_client):
    parts = partition(LABELS, 12, "pathological", seed=5, classes_per_client=classes_per_client)
    counts = class_counts(LABELS, parts, C)
    for i in range(12):
        assert np.count_nonzero(counts[i]) == classes_per_client
        assert counts[i, i % C] > 0
    for label in range(C):
        holders = np.flatnonzero(counts[:, label])
        if len(holders):
            shares = counts[holders, label]
            assert shares.sum() == SIZES[label]  # a held class is given out whole
            assert shares.max() - shares.min() <= 1  # and split evenly among its holders


def test_shards_each_client_gets_shards_per_client_shards_of_shard_size():
    parts = split("shards")  # 5 clients x 3 shards x 40 samples
    assert [len(p) for p in parts] == [120] * 5
    assert len(np.concatenate(parts)) == 600  # the other 450 samples are not dealt out


def test_shards_of_pure_classes_give_counts_in_multiples_of_the_shard_size():
    # 10 classes x 60 samples, shard size 30: the label-sorted pool cuts into 20 single-class shards, 2 per client.
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 60))
    parts = partition(labels, 10, "shards", seed=4, shards_per_client=2, shard_size=30)
    counts = class_counts(labels, parts, 10)
    assert np.array_equal(counts.sum(axis=1), np.full(10, 60))
    assert set(np.unique(counts)) <= {0, 30, 60}
    assert np.all(np.count_nonzero(counts, axis=1) <= 2)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(600))


@pytest.mark.parametrize("min_size", [1, 10, 60, 150])
def test_dirichlet_every_client_reaches_min_size(min_size):
    parts = partition(LABELS, 6, "dirichlet", seed=2, alpha=0.5, min_size=min_size)
    assert min(len(p) for p in parts) >= min_size


def test_dirichlet_small_alpha_is_label_skewed_and_large_alpha_is_near_iid():
    def skew(alpha: float) -> float:
        counts = class_counts(LABELS, partition(LABELS, 5, "dirichlet", seed=0, alpha=alpha, min_size=1), C)
        share = counts / counts.sum(axis=1, keepdims=True)
        return float(np.abs(share - SIZES / N).sum(axis=1).mean())  # mean L1 distance to the pool's class mix

    assert skew(0.1) > 0.8
    assert skew(1000.0) < 0.1


# ---------------------------------------------------------------------------------------------------------------
# The PFNM balancing rule

# 50 classes of 20 samples, 10 clients: N/J = 100. Under the rule a client takes part in a class only while it holds
# fewer than N/J samples, so it ends with fewer than N/J + 20 (one class). Without it, a small alpha gives each class
# to about one client, and the unluckiest client collects 7-9 classes (140-180 samples).
SKEWED = np.random.default_rng(9).permutation(np.repeat(np.arange(50), 20))
BOUND = len(SKEWED) / 10 + 20


@pytest.mark.parametrize("seed", range(12))
def test_balancing_rule_caps_clients_at_n_over_j_plus_one_class(seed):
    # Seeds 9 and 11 caught a rounding leak: truncating the normalised cumsum gave a full last client one more sample.
    parts = partition(SKEWED, 10, "dirichlet", seed=seed, alpha=0.1, balance=True, min_size=1)
    assert max(len(p) for p in parts) < BOUND
    assert sum(len(p) for p in parts) == len(SKEWED)


@pytest.mark.parametrize("seed", range(12))
def test_without_balancing_the_same_draw_exceeds_the_cap(seed):
    # Both variants consume the random stream identically (the rule only masks proportions; its underflow fallback
    # never triggers at alpha = 0.1), so this is the same Dirichlet draw as above, and the cap is what the rule adds.
    parts = partition(SKEWED, 10, "dirichlet", seed=seed, alpha=0.1, balance=False, min_size=1)
    assert max(len(p) for p in parts) > BOUND


@pytest.mark.parametrize("alpha", [0.001, 0.01])
def test_balancing_with_tiny_alpha_stays_finite_and_keeps_the_cap(alpha):
    # With alpha << 1 every open client's share can underflow to 0; the split must still be a valid, capped partition
    # (the old code divided 0 by 0 and gave the whole class to the last client, full or not).
    for seed in range(10):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            parts = partition(SKEWED, 10, "dirichlet", seed=seed, alpha=alpha, balance=True, min_size=1)
        assert max(len(p) for p in parts) < BOUND
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(SKEWED)))


# ---------------------------------------------------------------------------------------------------------------
# class_counts


def test_class_counts_rows_are_per_client_bincounts():
    parts = split("dirichlet")
    counts = class_counts(LABELS, parts, C)
    assert counts.shape == (6, C)
    assert np.array_equal(counts.sum(axis=1), [len(p) for p in parts])
    assert np.array_equal(counts.sum(axis=0), SIZES)  # dirichlet uses every sample
    assert np.array_equal(counts[2], np.bincount(LABELS[parts[2]], minlength=C))


def test_class_counts_of_no_clients_is_an_empty_table():
    assert class_counts(LABELS, [], C).shape == (0, C)


# ---------------------------------------------------------------------------------------------------------------
# Impossible requests: one table, each an InputError naming the key

TINY = np.array([0, 0, 1, 1, 2, 2, 0, 1, 2, 0])  # 10 samples, 3 classes


@pytest.mark.parametrize(
    ("labels", "num_clients", "method", "params", "match"),
    [
        pytest.param(TINY, 11, "iid", {}, r"partition\.num_clients: .*at most the pool size \(10\)", id="more-clients-than-samples"),
        pytest.param(TINY, 11, "dirichlet", {}, r"partition\.num_clients", id="more-clients-than-samples-dirichlet"),
        pytest.param(
            TINY, 3, "dirichlet", {"min_size": 4}, r"partition\.min_size: .*pool size / num_clients \(3\)", id="min-size-too-large"
        ),
        pytest.param(
            LABELS,
            10,
            "dirichlet",
            {"alpha": 0.01, "min_size": 100, "max_attempts": 3},
            r"partition\.min_size: .*within 3 Dirichlet draws.*raise partition\.alpha",
            id="min-size-unreachable",
        ),
        pytest.param(
            TINY,
            2,
            "shards",
            {"shards_per_client": 2, "shard_size": 3},
            r"partition\.shard_size: .*10 samples for 4 shards",
            id="shard-size-too-large",
        ),
        pytest.param(TINY, 3, "shards", {"shards_per_client": 4}, r"partition\.shards_per_client", id="too-many-shards"),
        pytest.param(
            TINY,
            2,
            "pathological",
            {"classes_per_client": 4},
            r"partition\.classes_per_client: .*number of classes \(3\)",
            id="classes-per-client-too-large",
        ),
        pytest.param(
            TINY, 2, "labels", {"groups": [[0]]}, r"partition\.groups: .*one label list per client \(2\)", id="wrong-number-of-groups"
        ),
        pytest.param(
            TINY, 2, "labels", {"groups": [[0], [1, 3]]}, r"partition\.groups\[1\]\[1\]: .*a label in 0\.\.2", id="group-label-too-large"
        ),
        pytest.param(TINY, 2, "labels", {"groups": [[-1], [1]]}, r"partition\.groups\[0\]\[0\]", id="group-label-negative"),
        pytest.param(
            TINY[TINY != 1], 2, "labels", {"groups": [[1], [0, 2]]}, r"partition: .*client 0 got none", id="group-of-absent-label"
        ),
        pytest.param(TINY, 2, "dirichlett", {}, r"partition\.method: .*dirichlet", id="unknown-method"),
    ],
)
def test_impossible_requests_raise_input_error_naming_the_key(labels, num_clients, method, params, match):
    with pytest.raises(InputError, match=match) as info:
        partition(labels, num_clients, method, seed=0, **params)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# subsets: overlapping random subsets (FedRef's MNIST setting)


def test_subsets_draw_each_client_a_fraction_in_range_and_may_overlap():
    parts = partition(LABELS, 10, "subsets", seed=3, subset_fraction=(0.4, 0.9))
    sizes = np.array([len(p) for p in parts])
    assert len(parts) == 10 and np.all(sizes >= round(0.4 * N)) and np.all(sizes <= round(0.9 * N))
    assert len(np.unique(sizes)) > 1, "fractions are drawn per client"
    for part in parts:
        assert part.dtype == np.int64 and np.all(np.diff(part) > 0)
    assert len(np.intersect1d(parts[0], parts[1])) > 0, "40-90 % subsets of one pool overlap"
    again = partition(LABELS, 10, "subsets", seed=3, subset_fraction=(0.4, 0.9))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_subsets_plan_pools_shared_samples_once(make_config):
    from rayfuse.data.roles import load_dataset_from_config, make_plan, pooled_train

    cfg = make_config(partition={"method": "subsets", "num_clients": 6, "subset_fraction": [0.5, 0.7]})
    dataset = load_dataset_from_config(cfg.data)
    plan = make_plan(dataset, cfg.data, cfg.partition, cfg.run.seed)
    union = np.unique(np.concatenate(plan.client_train))
    assert len(pooled_train(dataset, plan).y) == len(union)
    assert plan.unassigned == len(
        np.setdiff1d(
            np.setdiff1d(np.arange(len(dataset.y)), np.concatenate([plan.test, plan.public])),
            np.concatenate([*plan.client_train, *plan.client_val]),
        )
    )


@pytest.mark.parametrize("bad", [[0.0, 0.5], [0.6, 0.5], [0.5, 1.2]])
def test_subsets_fraction_range_is_validated(make_config, bad):
    with pytest.raises(InputError, match=r"partition\.subset_fraction"):
        make_config(partition={"method": "subsets", "subset_fraction": bad})
