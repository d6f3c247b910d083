"""Secure aggregation over the engine (``federation.secure_aggregation``): a FedAvg-family round under SecAgg+ gives
the plain round's model within half a quantisation step, the coordinator receives only keys, ciphertexts, masked ring
vectors and shares (never an update or a metric of one client), dropped clients are recovered while enough remain,
one more is a clean failure that resumes, and what cannot be summed is refused before start. In-process runs (the
same steps run on Ray actors: tests/integration/test_ray_backend.py runs one there)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

import rayfuse
from rayfuse.errors import InputError, RunFailure
from rayfuse.testing import BASE, merge
from rayfuse.updates.secure import METRIC_STEP, NOISE_TAIL, ArraySum, Masked, discrete_gaussian

ONE_ROUND = merge(BASE, {"methods": {"fedavg": {"rounds": 1, "local_epochs": 1}}})
SECURE = {"federation": {"secure_aggregation": True}}
ROOT = Path(__file__).resolve().parents[2]
STEP = 2 * 8.0 / 2**22  # the default clipping range's quantisation step


def _run(tmp_path, name, cfg, **kwargs):
    return rayfuse.run(cfg, run_dir=tmp_path / name, quiet=True, **kwargs)


def _gap(a, b):
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


@pytest.mark.parametrize(
    "entry",
    [
        {"rounds": 1, "local_epochs": 1},
        {"rounds": 1, "local_epochs": 1, "weighted": False},
        {"rounds": 1, "local_epochs": 1, "aggregator": {"name": "mean", "clip_norm": 0.5}},
        {"method": "fedadam", "rounds": 1, "local_epochs": 1},
    ],
    ids=["weighted", "unweighted", "clip_norm", "fedadam"],
)
def test_a_secure_round_gives_the_plain_rounds_model_within_half_a_step(tmp_path, entry):
    cfg = merge(BASE, {"methods": {"m": {"method": "fedavg", **entry}}})
    plain = _run(tmp_path, "plain", cfg)
    secure = _run(tmp_path, "secure", merge(cfg, SECURE))
    info = secure.results["methods"]["m"]["info"]
    assert info["aggregation"] == {"mode": "secure", "partial_sums": "flat"}
    record = info["secure_aggregation"]
    assert record["error_bound"] == pytest.approx(STEP / 2) and record["clipped_entries"] == 0 and record["dropped"] == 0
    # fedadam's server step divides by sqrt(v) ~ |mean change|: its model moves by lr per entry either way, so its
    # gap is bounded by the step's effect on the change, not the step itself; the means' gap is checked on the others
    bound = STEP / 2 + 1e-6 if "method" not in entry else 2e-3
    assert _gap(plain.models["m"], secure.models["m"]) <= bound
    # the round's loss is the cohort's weighted mean, summed securely at a step of 2^-10
    loss = lambda r: float(r.history.query("method == 'm' and metric == 'train_loss'")["value"].iloc[-1])  # noqa: E731
    assert abs(loss(plain) - loss(secure)) <= METRIC_STEP


def test_masked_vectors_added_where_several_clients_are_hosted_give_the_same_model(tmp_path):
    # two clients per process: each adds its clients' masked vectors in the ring and sends one partial sum, whose
    # masks cancel only in the coordinator's total
    flat = _run(tmp_path, "flat", merge(ONE_ROUND, SECURE))
    packed = _run(tmp_path, "packed", merge(ONE_ROUND, {"federation": {"secure_aggregation": True, "clients_per_actor": 2}}))
    assert packed.results["methods"]["fedavg"]["info"]["aggregation"] == {"mode": "secure", "partial_sums": "per_actor"}
    for key, value in flat.models["fedavg"].items():
        assert np.array_equal(value, packed.models["fedavg"][key]), key  # the decoded sum is exact either way


def test_central_dp_noises_the_secure_sum_as_it_noises_the_plain_one(tmp_path):
    dp = {"noise_multiplier": 0.5, "clip_norm": 1.0, "sample_rate": 1.0, "delta": 1e-3}
    cfg = merge(BASE, {"methods": {"dp": {"method": "fedavg", "rounds": 1, "local_epochs": 1, "dp": dp}}})
    plain = _run(tmp_path, "plain", cfg)
    secure = _run(tmp_path, "secure", merge(cfg, SECURE))
    # the same clipped sum (within 4 clients x half a step) and the same seeded noise, divided by the expected count
    assert _gap(plain.models["dp"], secure.models["dp"]) <= 4 * STEP / 2 + 1e-6
    assert secure.results["methods"]["dp"]["info"]["dp"]["epsilon"] == plain.results["methods"]["dp"]["info"]["dp"]["epsilon"]


def test_distributed_dp_has_the_clients_add_the_noise_the_accountant_counts(tmp_path):
    # 4 clients, threshold 3: each adds discrete Gaussian noise of std z Delta / sqrt(3) (in levels), so the 4 add
    # z Delta sqrt(4/3): two runs' models differ by noise alone, of std sqrt(2 x 4 / 3) z Delta / expected clients
    dp = {"noise_multiplier": 0.5, "clip_norm": 1.0, "sample_rate": 1.0, "delta": 1e-3}
    cfg = merge(BASE, {"methods": {"dp": {"method": "fedavg", "rounds": 1, "local_epochs": 1, "dp": dp}}})
    secure = merge(cfg, {"federation": {"secure_aggregation": {"distributed_dp": True}}})
    runs = [_run(tmp_path, f"run{i}", secure) for i in range(2)]
    info = runs[0].results["methods"]["dp"]["info"]
    assert (
        info["dp"]["noise"].startswith("distributed")
        and info["dp"]["epsilon"] == _run(tmp_path, "central", cfg).results["methods"]["dp"]["info"]["dp"]["epsilon"]
    )
    delta = info["secure_aggregation"]["distributed_dp"]["sensitivity"]
    assert 1.0 < delta < 1.001  # the clip norm plus the rounding's half step per entry
    gaps = np.concatenate(
        [
            (runs[0].models["dp"][k].astype(np.float64) - runs[1].models["dp"][k]).ravel()
            for k in runs[0].models["dp"]
            if k.endswith("weight")
        ]
    )
    expected = np.sqrt(2 * 4 / 3) * 0.5 * delta / 4
    assert 0.9 * expected < gaps.std() < 1.1 * expected  # about a thousand weights: the estimate is within a few %


def test_the_discrete_gaussian_sampler_has_the_asked_spread_and_a_bounded_tail():
    rng = np.random.default_rng(0)
    for sigma in (0.8, 3.5, 1000.0):
        draws = discrete_gaussian(sigma, 200_000, rng)
        assert draws.dtype == np.int64 and np.abs(draws).max() <= NOISE_TAIL * sigma
        assert abs(draws.mean()) < 5 * sigma / np.sqrt(draws.size) and 0.98 < draws.std() / sigma < 1.02


def test_the_coordinator_receives_no_update_and_no_metric_of_any_one_client(tmp_path, received_replies):
    received = received_replies
    run = _run(tmp_path, "secure", merge(ONE_ROUND, SECURE))
    stages = [name for name, _, _ in received if name.startswith("secagg.")]
    assert stages.count("secagg.masked") == 4 and set(stages) == {"secagg.setup", "secagg.share_keys", "secagg.masked", "secagg.unmask"}
    bits = run.results["methods"]["fedavg"]["info"]["secure_aggregation"]["modulus_bits"]
    for name, client, value in received:
        if not name.startswith("secagg."):
            continue
        if name == "secagg.masked":
            assert isinstance(value, Masked) and value.masked.dtype == np.uint64
            assert {f.name for f in dataclasses.fields(value)} == {"masked", "num_examples"}  # no metrics travel
            # uniform on the ring whatever the update: the masked entries' mean is half the ring within 5 sigma
            u = value.masked.astype(np.float64) / 2.0**bits
            assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
        else:  # public keys, ciphertexts and Shamir shares: bytes only, no array of numbers
            leaves = value.values() if isinstance(value, dict) else value
            assert all(isinstance(leaf, bytes) for leaf in leaves), (name, client)


def _faults(*faults):
    return {"federation": {"on_client_failure": "drop", "faults": [dict(client=c, step=s, call=1) for c, s in faults]}}


def test_a_client_that_drops_before_or_after_sending_its_masked_update_is_recovered(tmp_path):
    # 4 clients: 3 neighbours each, threshold 3 of 4: one client may drop
    secure = merge(ONE_ROUND, SECURE)
    without_1 = _run(tmp_path, "plain_without_1", merge(ONE_ROUND, _faults((1, "fedavg.fit"))))
    before = _run(tmp_path, "before", merge(secure, _faults((1, "secagg.masked"))))
    assert _gap(without_1.models["fedavg"], before.models["fedavg"]) <= STEP / 2 + 1e-6
    assert before.results["methods"]["fedavg"]["info"]["secure_aggregation"]["dropped"] == 1
    # a client that sent its masked update and dropped before unmasking is in the sum: the run with every client
    everyone = _run(tmp_path, "plain", ONE_ROUND)
    after = _run(tmp_path, "after", merge(secure, _faults((2, "secagg.unmask"))))
    assert _gap(everyone.models["fedavg"], after.models["fedavg"]) <= STEP / 2 + 1e-6


def test_one_drop_too_many_fails_the_round_cleanly_and_the_run_resumes_to_the_same_model(tmp_path):
    cfg = merge(BASE, {"methods": {"fedavg": {"rounds": 2, "local_epochs": 1}}, **SECURE})
    whole = _run(tmp_path, "whole", cfg)
    faults = {"federation": {"on_client_failure": "drop", "faults": [dict(client=c, step="secagg.masked", call=2) for c in (0, 3)]}}
    with pytest.raises(RunFailure, match="fewer than reconstruction_threshold 3"):
        _run(tmp_path, "cut", merge(cfg, faults))
    resumed = rayfuse.resume(tmp_path / "cut", overrides=["federation.faults=[]"], quiet=True)
    for key, value in whole.models["fedavg"].items():
        assert np.array_equal(value, resumed.models["fedavg"][key]), key  # the decoded sum is exact: bit for bit


REFUSED = [
    ({"methods": {"m": {"method": "fedavg", "rounds": 1, "aggregator": {"name": "median"}}}}, "methods.m.aggregator", "'median'"),
    ({"methods": {"e": {"method": "ensemble"}}}, "methods.e", "'ensemble'"),
    ({"methods": {"a": {"method": "aligned"}}}, "methods.a", "'aligned'"),
    ({"methods": {"g": {"method": "gems"}}}, "methods.g", "'gems'"),
    ({"methods": {"r": {"method": "fedref", "rounds": 1}}}, "methods.r", "'fedref'"),  # its server reads each client's loss
    ({"methods": {"f": {"method": "fedavg", "rounds": 1}}, "evaluation": "federated"}, "evaluation", "'federated'"),
    # distill sums with teachers: clients (tests/fusion/distill/test_secure_distill.py); parameters are each model
    ({"methods": {"d": {"method": "distill", "teachers": "parameters"}}, "data": {"public_size": 0.1}}, "methods.d", "'distill'"),
    (
        {"methods": {"d": {"method": "distill", "teachers": "clients", "init": "random", "transfer": "synthetic", "reweight": True}}},
        "methods.d",
        "'distill'",
    ),
    (
        {"methods": {"f": {"method": "fedavg", "rounds": 1}}, "federation": {"attacks": [{"client": 0, "kind": "sign_flip"}]}},
        "federation.attacks",
        "['sign_flip']",
    ),
    ({"methods": {"f": {"method": "fedavg", "rounds": 1, "fraction": 0.25}}}, "methods.f.fraction", "0.25"),
    (
        {"methods": {"f": {"method": "fedavg", "rounds": 1}}, "federation": {"secure_aggregation": {"distributed_dp": True}}},
        "federation.secure_aggregation.distributed_dp",
        "True",
    ),
    (
        {
            "methods": {
                "f": {
                    "method": "fedavg",
                    "rounds": 1,
                    "dp": {"noise_multiplier": 0.3, "clip_norm": 1.0, "sample_rate": 1.0, "delta": 1e-3, "adaptive": {}},
                }
            },
            "federation": {"secure_aggregation": {"distributed_dp": True}},
        },
        "methods.f.dp.adaptive",
        "'adaptive clipping'",
    ),
    (
        {"methods": {"f": {"method": "fedavg", "rounds": 1}}, "federation": {"secure_aggregation": {"reconstruction_threshold": 1}}},
        "federation.secure_aggregation.reconstruction_threshold",
        "1",
    ),
    # a sum of one client is that client's reply, whatever the method: fedmerge has no fraction to name
    ({"methods": {"fm": {"method": "fedmerge"}}, "partition": {"method": "iid", "num_clients": 1}}, "partition.num_clients", "1"),
    ({"methods": {"f": {"method": "fedavg", "rounds": 1}}, "partition": {"method": "iid", "num_clients": 1}}, "partition.num_clients", "1"),
    (
        {"methods": {"fm": {"method": "fedmerge"}}, "federation": {"attacks": [{"client": 0, "kind": "sign_flip"}]}},
        "federation.attacks",
        "'1 attack on clients [0]'",
    ),
]


def _kl_job() -> dict:
    job = yaml.safe_load((ROOT / "jobs" / "kl_gmm.yaml").read_text())
    return merge({k: v for k, v in job.items() if k != "methods"}, {"methods": {"k": {"method": "kl"}}})


@pytest.mark.parametrize("sections, path, got", [*REFUSED, (None, "methods.k", "'kl'")], ids=[r[1] + ":" + r[2] for r in REFUSED] + ["kl"])
def test_what_secure_aggregation_cannot_sum_is_refused_before_start_in_one_line(tmp_path, sections, path, got):
    cfg = merge(merge(BASE, SECURE), sections) if sections is not None else merge(_kl_job(), SECURE)
    with pytest.raises(InputError) as info:
        _run(tmp_path, "refused", cfg)
    message = str(info.value)
    assert message.startswith(f"{path}: expected ") and f"got {got}" in message and "\n" not in message
    assert not (tmp_path / "refused").exists()


def test_an_array_sum_encodes_each_key_at_its_own_step_and_counts_what_it_clipped():
    encoding = ArraySum((("logits", (2, 3), 2.0**-12, 64.0), ("grad", (4,), 2.0**-20, 1.0)))
    rng = np.random.default_rng(0)
    replies = [{"logits": rng.normal(0, 10, (2, 3)), "grad": rng.normal(0, 0.3, 4)} for _ in range(5)]
    replies[0]["grad"][0] = 3.0  # beyond its range: clipped to 1 and counted
    levels = sum(encoding.encode(r, (), 1) for r in replies)
    sums, clipped = encoding.decode(levels)
    assert clipped == 1 and encoding.max_level >= 64 * 2**12
    exact_logits = sum(r["logits"] for r in replies)
    exact_grad = sum(np.clip(r["grad"], -1, 1) for r in replies)
    assert np.abs(sums["logits"] - exact_logits).max() <= 5 * 2.0**-12 / 2
    assert np.abs(sums["grad"] - exact_grad).max() <= 5 * 2.0**-20 / 2
    for bad, why in [({"logits": np.zeros((2, 3))}, "expected a dict of"), ({**replies[1], "grad": np.full(4, np.nan)}, "non-finite")]:
        with pytest.raises(ValueError, match=why):
            encoding.encode(bad, (), 1)


def test_masked_vectors_folded_per_process_then_per_node_unmask_to_the_same_sum():
    # the reducers an actor hosting two clients and a node's aggregator run (rayfuse.federation.reduce_replies): the
    # partial sums of masked vectors still hide each client, and the server unmasks the total from them
    from rayfuse.federation import reduce_replies
    from rayfuse.updates.secagg import SecAggClient, SecAggParams, SecAggServer
    from rayfuse.updates.secure import MaskedFold, MaskedSum

    params = SecAggParams(num_clients=4, num_neighbours=3, reconstruction_threshold=3, modulus_bits=40)
    server = SecAggServer(params, [0, 1, 2, 3], seed=1)
    clients = {c: SecAggClient(c, params, seed=b"s") for c in range(4)}
    keys = server.receive_public_keys({c: clients[c].stage_setup(*server.setup_message()) for c in range(4)})
    routed = server.receive_shares({c: clients[c].stage_share_keys(keys[c]) for c in range(4)})
    levels = {c: np.arange(10, dtype=np.int64) * (c + 1) - 7 for c in range(4)}
    replies = {c: Masked(clients[c].stage_collect_masked_levels(routed[c], levels[c]), 5) for c in range(4)}
    fold = MaskedFold(params.modulus_bits)
    per_process = [reduce_replies(fold, [(c, True, replies[c], ()) for c in pair]) for pair in ([0, 1], [2, 3])]
    partials = [out[0][1] for out in per_process]  # the first call of each process carries the folded value
    assert all(isinstance(p, MaskedSum) for p in partials) and [sorted(p.counts) for p in partials] == [[0, 1], [2, 3]]
    node = reduce_replies(fold, [(0, True, partials[0], ()), (2, True, partials[1], ())])[0][1]
    assert sorted(node.counts) == [0, 1, 2, 3]
    survivors, dropped = server.receive_masked_sums({(0, 1, 2, 3): node.masked})
    responses = {c: clients[c].stage_unmask(survivors, dropped) for c in survivors}
    assert np.array_equal(server.unmask_levels(responses), sum(levels.values()))
