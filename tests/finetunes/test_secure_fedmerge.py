"""``fedmerge`` under ``federation.secure_aggregation`` (issue 44): every merge from two secure sums of the terms each
client weighs on its side (:class:`rayfuse.updates.secure.ScaledSum`), so the coordinator receives keys, ciphertexts,
shares and masked ring vectors only, never a client's task vector or statistic; the fused model is the plain run's
within the bound the run records; a client that drops is left out of both merges alike. In-process runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rayfuse
from rayfuse.finetunes.statistics import merge_sums, merge_task_vectors, term_shapes, weighted_terms
from rayfuse.testing import BASE, merge
from rayfuse.updates.secure import BANDS, Masked, ScaledSum, level_bits, ring_bits

SECURE = {"federation": {"secure_aggregation": True}}


def _cfg(**params):
    entry = {"method": "fedmerge", "local_epochs": 1, "target_modules": [".*"], "r": 2, **params}
    return merge(BASE, {"methods": {"fm": entry}})


def _run(tmp_path, name, cfg):
    return rayfuse.run(cfg, run_dir=tmp_path / name, quiet=True)


def _assert_within(plain, secure, bound):
    """Each fused entry within ``bound`` of the plain one, plus the float32 rounding of the fused model."""
    for key, value in plain.items():
        p, s = value.astype(np.float64), secure[key].astype(np.float64)
        assert (np.abs(p - s) <= bound + np.spacing(np.abs(value).astype(np.float32))).all(), key


def _loss(result):
    return float(result.history.query("method == 'fm' and metric == 'train_loss'")["value"].iloc[-1])


@pytest.mark.parametrize(
    "params",
    [
        {"merge": "fisher"},
        {"merge": "regmean"},
        {"merge": "regmean", "regmean_alpha": 1.0, "weighted": False},
        {"merge": "average"},
        {"merge": "fisher", "finetune": "lora"},
        {"merge": "regmean", "finetune": "lora"},
    ],
    ids=["fisher", "regmean", "regmean-exact-unweighted", "average", "lora-fisher", "lora-regmean"],
)
def test_a_secure_fedmerge_gives_the_plain_fused_model_within_its_recorded_bound(tmp_path, params):
    plain = _run(tmp_path, "plain", _cfg(**params))
    secure = _run(tmp_path, "secure", merge(_cfg(**params), SECURE))
    record = secure.results["methods"]["fm"]["info"]["secure_aggregation"]
    assert record["sums"] == 2 and record["dropped"] == 0 and record["clipped_entries"] == 0
    assert record["modulus_bits"] == 64 and record["level_bits"] == level_bits(4) == 60
    # the bound on the merged update: float64's rounding, amplified by the Fisher floor's ratio or the Gram's conditioning
    assert 0 <= record["error_bound"] < 1e-8
    _assert_within(plain.models["fm"], secure.models["fm"], record["error_bound"])
    assert abs(_loss(plain) - _loss(secure)) <= 1e-12  # the count-weighted loss, summed at 2^-60 of the largest
    assert secure.results["methods"]["fm"]["info"]["weights"] == plain.results["methods"]["fm"]["info"]["weights"]


def test_the_coordinator_receives_no_task_vector_no_statistic_and_no_loss_of_any_one_client(tmp_path, received_replies):
    received = received_replies
    run = _run(tmp_path, "secure", merge(_cfg(merge="regmean"), SECURE))
    names = [name for name, _, _ in received]
    # two secure sums over the 4 clients (the bands, then the terms); nothing else reaches the coordinator
    assert names.count("secagg.masked") == 8 and set(names) == {"secagg.setup", "secagg.share_keys", "secagg.masked", "secagg.unmask"}
    assert run.results["methods"]["fm"]["info"]["secure_aggregation"]["modulus_bits"] == 64  # the terms' sum's ring
    masked = 0
    for name, client, value in received:
        if name == "secagg.masked":
            assert isinstance(value, Masked) and value.masked.dtype == np.uint64
            assert {f.name for f in dataclasses.fields(value)} == {"masked", "num_examples"}
            # the bands' sum (one level per band and key, and the clipped count) in its ring, then the terms' in 64 bits
            bits = ring_bits(4, value.masked.size - 1) if masked < 4 else 64
            masked += 1
            u = value.masked.astype(np.float64) / 2.0**bits  # uniform on the ring whatever the terms
            assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
        else:  # public keys, ciphertexts and Shamir shares: bytes only
            leaves = value.values() if isinstance(value, dict) else value
            assert all(isinstance(leaf, bytes) for leaf in leaves), (name, client)


def _faults(*faults):
    return {"federation": {"on_client_failure": "drop", "faults": [dict(client=c, step=s, call=n) for c, s, n in faults]}}


@pytest.mark.parametrize(
    "fault, without",
    [(("secagg.masked", 1), True), (("secagg.masked", 2), True), (("secagg.unmask", 2), False)],
    ids=["drops-in-the-scale-sum", "drops-in-the-terms-sum", "drops-after-sending-its-terms"],
)
def test_a_dropped_client_gives_the_plain_merge_without_it(tmp_path, fault, without):
    # 4 clients, threshold 3: one may drop. Dropped before its terms' masked vector: the merge of the other 3; after
    # sending it (while unmasking): it is in the sum, the merge of all 4
    cfg = _cfg(merge="fisher")
    plain = _run(tmp_path, "plain", merge(cfg, _faults((1, "fedmerge.fit", 1))) if without else cfg)
    secure = _run(tmp_path, "secure", merge(merge(cfg, SECURE), _faults((1, *fault))))
    info = secure.results["methods"]["fm"]["info"]
    assert info["clients"] == ([0, 2, 3] if without else [0, 1, 2, 3]) == plain.results["methods"]["fm"]["info"]["clients"]
    assert info["secure_aggregation"]["dropped"] == (1 if without else 0)
    _assert_within(plain.models["fm"], secure.models["fm"], info["secure_aggregation"]["error_bound"])


def _sites(rng, n=3):
    """Sites' task vectors and statistics of wildly different scales (a Fisher near 1e-12, a Gram near 1e6)."""
    shapes = {"a.weight": (3, 5), "a.bias": (3,)}
    deltas = [{k: rng.normal(0, 0.1, s) for k, s in shapes.items()} for _ in range(n)]
    fishers = [{k: rng.random(s) ** 4 * 10.0 ** rng.integers(-12, 2) for k, s in shapes.items()} for _ in range(n)]
    grams = [{"a.weight": (lambda x: x.T @ x)(rng.normal(0, 300, (20, 5)))} for _ in range(n)]
    return shapes, deltas, fishers, grams


@pytest.mark.parametrize("merge_", ["fisher", "regmean", "average"])
def test_the_merge_from_sums_is_the_merge_and_its_bound_holds_for_any_error_within_the_sums_bounds(merge_):
    rng = np.random.default_rng(3)
    shapes, deltas, fishers, grams = _sites(rng)
    stats = {"fisher": fishers, "regmean": grams, "average": None}[merge_]
    counts = [40, 25, 35]
    terms = [weighted_terms(d, s, c, merge_, regmean_alpha=0.8) for d, s, c in zip(deltas, stats or [None] * 3, counts)]
    keys = term_shapes(shapes, list(stats[0]) if stats else [], merge_)
    assert all(set(t) == set(keys) for t in terms)
    exact = {k: sum(t[k] for t in terms) for k in keys}
    want = merge_task_vectors(deltas, stats, [c / 100 for c in counts], merge_, regmean_alpha=0.8)
    merged, bounds = merge_sums(exact, 100, shapes, merge_, {})
    for k in shapes:
        np.testing.assert_allclose(merged[k], want[k], rtol=1e-9, atol=1e-12)
    # each sum off by up to 1e-7 of its largest entry, at random: the merge moves, within the bound it states
    errors = {k: 1e-7 * float(np.max(np.abs(v))) for k, v in exact.items()}
    for trial in range(20):
        noisy = {k: v + rng.uniform(-1, 1, np.shape(v)) * errors[k] for k, v in exact.items()}
        merged, bounds = merge_sums(noisy, 100, shapes, merge_, errors)
        for k in shapes:
            assert np.abs(merged[k] - want[k]).max() <= bounds[k] * (1 + 1e-9) + 1e-15, (k, trial)
    assert all(0 < b < 1e-3 for b in bounds.values())  # not vacuous at that error


def test_a_scaled_sum_takes_each_keys_range_from_the_highest_band_and_leaves_out_keys_all_zero():
    rng = np.random.default_rng(1)
    scaled = ScaledSum((("huge", (4,)), ("tiny", (3, 2)), ("zero", (2,)), ("beyond", ())))
    replies = [
        {"huge": rng.normal(0, 1e6, 4), "tiny": rng.random((3, 2)) * 1e-30, "zero": np.zeros(2), "beyond": np.asarray(1.0)}
        for _ in range(5)
    ]
    replies[2]["beyond"] = np.asarray(2.0 ** BANDS[1] * 3)  # beyond the last band: clipped in the sum, and counted
    bands = sum(scaled.bands_encoding.encode(scaled.bands(r), (), 1) for r in replies)
    counts, _ = scaled.bands_encoding.decode(bands)
    assert counts["bands"].sum(axis=1).tolist() == [5, 5, 5, 5] and counts["bands"][2, 0] == 5  # one band a client a key
    encoding = scaled.arrays(counts["bands"], 5)
    assert [k for k, _, _, _ in encoding.keys] == ["huge", "tiny", "beyond"]  # zero in every client: not summed
    levels = sum(encoding.encode({k: r[k] for k, _, _, _ in encoding.keys}, (), 1) for r in replies)
    sums, clipped = scaled.decode(encoding, levels)
    assert clipped == 1 and np.array_equal(sums["zero"], np.zeros(2))
    errors = encoding.error_bounds(5)
    for key in ("huge", "tiny"):
        largest = max(float(np.abs(r[key]).max()) for r in replies)
        step = next(step for k, _, step, _ in encoding.keys if k == key)
        assert largest / 2 ** level_bits(5) < step <= 2 * largest / 2 ** level_bits(5)  # about 2^-60 of the largest
        exact = sum(r[key] for r in replies)
        # at 2^-60 of the largest entry, the sum's own float64 rounding is as large as the fixed point's
        assert (np.abs(sums[key] - exact) <= errors[key] + 4 * np.spacing(np.abs(exact))).all()
