"""SecAgg+ (rayfuse.updates.secagg): the decoded sum, dropouts up to the threshold, malformed shares named, the
server's view independent of any one input, and the settings' refusals. Small vectors, no Ray."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from scipy import stats

from rayfuse.errors import InputError, NonFiniteError, SecAggFailure
from rayfuse.updates.secagg import (
    PRIME,
    SecAggClient,
    SecAggParams,
    SecAggServer,
    flatten,
    neighbours,
    secure_sum,
    unflatten,
)


def _vectors(n: int, form: str, seed: int = 0, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    if form == "dict":
        return {i: {"w": scale * rng.normal(size=(3, 4)), "b": scale * rng.normal(size=5)} for i in range(n)}
    return {i: scale * rng.normal(size=17) for i in range(n)}


def _plain(vectors: dict, ids, params: SecAggParams, weights=None) -> np.ndarray:
    c = params.clipping_range
    rows = [np.clip(flatten(vectors[i])[0], -c, c) * (1.0 if weights is None else weights[i]) for i in ids]
    return np.sum(rows, axis=0)


def _run(vectors, params, seed=3, routed_tamper=None, unmask_tamper=None):
    """The stages driven by hand, with hooks that alter what a client receives (stage 3) or the server (stage 4)."""
    ids = sorted(vectors)
    server = SecAggServer(params, ids, seed)
    clients = {cid: SecAggClient(cid, params, seed) for cid in ids}
    setup = server.setup_message()
    keys = server.receive_public_keys({cid: c.stage_setup(*setup) for cid, c in clients.items()})
    routed = server.receive_shares({cid: clients[cid].stage_share_keys(msg) for cid, msg in keys.items()})
    if routed_tamper:
        routed_tamper(routed)
    masked = {cid: clients[cid].stage_collect_masked(msg, vectors[cid]) for cid, msg in routed.items()}
    survivors, dropped = server.receive_masked(masked)
    responses = {cid: clients[cid].stage_unmask(survivors, dropped) for cid in survivors}
    if unmask_tamper:
        unmask_tamper(responses)
    return server.receive_unmask(responses)


# -- the decoded sum ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, k, form",
    [
        (3, 2, "flat"),  # complete graph
        (3, 1, "dict"),  # sparse (odd k, odd N: degrees k or k+1)
        (5, 4, "dict"),
        (5, 2, "flat"),
        (10, 9, "flat"),
        (10, 3, "dict"),
        (10, 4, "flat"),
    ],
)
def test_decoded_sum_is_the_plain_sum_within_the_quantisation_bound(n, k, form):
    params = SecAggParams(n, k, (k + 1) // 2 + 1, clipping_range=2.5)
    vectors = _vectors(n, form, scale=1.5)  # some entries beyond the clipping range
    result = secure_sum(vectors, params, seed=7)
    total = flatten(result.total)[0]
    assert isinstance(result.total, dict) == (form == "dict")
    assert result.contributors == tuple(range(n))
    assert result.error_bound == pytest.approx(n * params.delta / 2)
    assert np.max(np.abs(total - _plain(vectors, range(n), params))) <= result.error_bound


@pytest.mark.parametrize("n, k", [(3, 2), (5, 2), (10, 9), (10, 4)])
def test_weighted_mean_is_recovered_from_the_weighted_sum_and_the_weight_entry(n, k):
    # weights w / max_weight on the quantisation grid, so the rounded weights are the weights themselves
    params = SecAggParams(n, k, (k + 1) // 2 + 1, clipping_range=4.0, quantization_range=2**20, max_weight=16.0)
    vectors = _vectors(n, "dict")
    weights = {i: float(i + 1) for i in range(n)}
    result = secure_sum(vectors, params, weights=weights, seed=2)
    assert result.weight == pytest.approx(sum(weights.values()), abs=1e-9)
    want = _plain(vectors, range(n), params, weights) / sum(weights.values())
    assert np.max(np.abs(flatten(result.mean())[0] - want)) <= result.error_bound / result.weight


def test_flatten_orders_keys_and_unflatten_undoes_it():
    arrays = {"z": np.arange(6.0).reshape(2, 3), "a": np.array([7.0])}
    flat, layout = flatten(arrays)
    assert flat.tolist() == [7.0, 0, 1, 2, 3, 4, 5]
    back = unflatten(flat, layout)
    assert list(back) == ["a", "z"] and np.array_equal(back["z"], arrays["z"])


# -- dropouts -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, k, t, absent, before, after",
    [
        (5, 4, 3, [], [1], []),  # shared keys, then dropped: its pairwise masks rebuilt from its mask key
        (5, 4, 3, [], [], [1, 3]),  # sent the masked input, then dropped: its self mask rebuilt
        (5, 4, 3, [2], [], []),  # never answered setup
        (5, 4, 3, [], [0], [4]),  # one of each: 3 holders of every secret left
        (10, 9, 6, [9], [0], [2, 3]),  # 6 of 10 left
        (10, 4, 3, [], [0], [5]),
    ],
)
def test_dropouts_up_to_the_threshold_sum_the_survivors_inputs(n, k, t, absent, before, after):
    params = SecAggParams(n, k, t)
    vectors = _vectors(n, "flat")
    result = secure_sum(vectors, params, absent=absent, dropped_before=before, dropped_after=after, seed=5)
    summed = [i for i in range(n) if i not in absent and i not in before]
    assert result.contributors == tuple(summed)
    assert np.max(np.abs(result.total - _plain(vectors, summed, params))) <= result.error_bound


@pytest.mark.parametrize(
    "n, k, t, absent, before, after",
    [
        (5, 4, 3, [], [], [1, 3, 4]),  # 2 of 5 holders left for every secret
        (5, 4, 3, [], [0, 1], [2]),
        (5, 4, 3, [0], [1], [2]),
        (5, 4, 3, [0], [1, 2], []),  # 2 masked vectors: too few to unmask without exposing one
        (10, 9, 6, [], [0, 1, 2], [3, 4]),  # 5 of 10 left
    ],
)
def test_one_drop_beyond_the_threshold_raises_naming_it(n, k, t, absent, before, after):
    params = SecAggParams(n, k, t)
    with pytest.raises(SecAggFailure) as info:
        secure_sum(_vectors(n, "flat"), params, absent=absent, dropped_before=before, dropped_after=after, seed=5)
    message = str(info.value)
    assert f"reconstruction_threshold {t}" in message and "\n" not in message
    assert info.value.client is None


def test_too_few_live_neighbours_at_share_keys_raises():
    params = SecAggParams(5, 4, 5)
    with pytest.raises(SecAggFailure, match="fewer than reconstruction_threshold - 1 = 4"):
        secure_sum(_vectors(5, "flat"), params, absent=[0], seed=1)


# -- malformed messages name their sender ---------------------------------------------------------------------------


def _flip(blob: bytes) -> bytes:
    return blob[:20] + bytes([blob[20] ^ 1]) + blob[21:]


def _routed(change):
    """A stage-3 tamper: client 1's share for client 0 replaced by ``change(routed, blob)``."""

    def tamper(routed):
        routed[0][1] = change(routed, routed[0][1])

    return tamper


def _unmask(change):
    """A stage-4 tamper: client 2's share of client 0's secret replaced by ``change(share)``."""

    def tamper(responses):
        responses[2][0] = change(responses[2][0])

    return tamper


@pytest.mark.parametrize(
    "routed_tamper, unmask_tamper, client",
    [
        (_routed(lambda r, b: _flip(b)), None, 1),  # wrong bytes: AES-GCM authentication fails
        (_routed(lambda r, b: b[:-5]), None, 1),  # wrong length
        (_routed(lambda r, b: r[3][1]), None, 1),  # client 1's share meant for client 3
        (None, _unmask(lambda s: s[:-1]), 2),  # wrong length at unmask
        (None, _unmask(lambda s: ((int.from_bytes(s, "big") + 1) % PRIME).to_bytes(66, "big")), 2),  # inconsistent
        (None, _unmask(lambda s: (PRIME + 1).to_bytes(66, "big")), 2),  # outside the field
    ],
)
def test_a_malformed_share_names_its_sender(routed_tamper, unmask_tamper, client):
    params = SecAggParams(5, 4, 3)  # 5 holders, 3 needed: a lying holder is found by leaving each out
    with pytest.raises(SecAggFailure) as info:
        _run(_vectors(5, "flat"), params, routed_tamper=routed_tamper, unmask_tamper=unmask_tamper)
    assert info.value.client == client and f"client {client}" in str(info.value) and "\n" not in str(info.value)


def test_a_share_of_a_secret_the_sender_does_not_hold_names_it():
    params = SecAggParams(6, 2, 2)
    graph = neighbours(range(6), 2, SecAggServer(params, range(6), 3).graph_seed)
    stranger = next(o for o in range(6) if o != 0 and o not in graph[0])

    def tamper(responses):
        responses[0][stranger] = (1).to_bytes(66, "big")

    with pytest.raises(SecAggFailure) as info:
        _run(_vectors(6, "flat"), params, unmask_tamper=tamper)
    assert info.value.client == 0


def test_a_client_refuses_to_reveal_both_secrets_of_one_client():
    params = SecAggParams(3, 2, 2)
    client = SecAggClient(0, params, 1)
    with pytest.raises(SecAggFailure, match="both secrets of clients \\[1\\]"):
        client.stage_unmask([0, 1], [1])


def test_a_client_refuses_to_unmask_fewer_than_the_threshold():
    params = SecAggParams(5, 4, 3)
    with pytest.raises(SecAggFailure, match="asked to unmask 2 clients, fewer than reconstruction_threshold 3"):
        SecAggClient(0, params, 1).stage_unmask([0, 1], [2, 3, 4])


def test_secagg_failure_pickles_with_its_client():
    error = pickle.loads(pickle.dumps(SecAggFailure("secure aggregation: x", client=4)))
    assert error.client == 4 and str(error) == "secure aggregation: x"


# -- what the server sees -------------------------------------------------------------------------------------------


def _masked(transcript) -> dict:
    return {cid: msg for stage, cid, msg in transcript if stage == "collect_masked"}


def test_masked_vectors_differ_exactly_by_the_encoded_input_difference():
    params = SecAggParams(4, 3, 3, clipping_range=1.0, quantization_range=2**16)
    a = {i: np.zeros(50) for i in range(4)}
    b = {i: np.linspace(-1.0, 1.0, 50) * (i + 1) / 4 for i in range(4)}
    seen_a, seen_b = [], []
    secure_sum(a, params, seed=11, transcript=seen_a)
    secure_sum(b, params, seed=11, transcript=seen_b)
    ring = np.uint64(2**32 - 1)
    for cid, masked_b in _masked(seen_b).items():
        encoded = np.rint(np.clip(b[cid], -1, 1) / params.delta).astype(np.int64).view(np.uint64) & ring
        assert np.array_equal((masked_b - _masked(seen_a)[cid]) & ring, encoded)


def test_a_masked_vector_is_uniform_over_the_ring():
    params = SecAggParams(3, 2, 2)
    seen: list = []
    secure_sum({i: np.full(10_000, 3.0) for i in range(3)}, params, seed=4, transcript=seen)
    for masked in _masked(seen).values():
        counts = np.bincount((masked >> np.uint64(28)).astype(np.int64), minlength=16)  # the top 4 of 32 bits
        assert stats.chisquare(counts).pvalue > 1e-3
        assert stats.kstest(masked.astype(np.float64) / 2**32, "uniform").pvalue > 1e-3


def test_the_server_receives_only_keys_ciphertexts_masked_vectors_and_shares():
    params = SecAggParams(5, 2, 2)
    vectors = _vectors(5, "dict")
    seen: list = []
    secure_sum(vectors, params, seed=9, dropped_after=[4], transcript=seen)
    assert {stage for stage, _, _ in seen} == {"setup", "share_keys", "collect_masked", "unmask"}
    for stage, cid, msg in seen:
        pickle.dumps(msg)
        if stage == "setup":
            assert [len(k) for k in msg] == [32, 32]
        elif stage in ("share_keys", "unmask"):
            assert all(isinstance(v, bytes) for v in msg.values())
            assert {len(v) for v in msg.values()} == ({12 + 4 + 2 * 66 + 16} if stage == "share_keys" else {66})
        else:
            encoded = np.rint(flatten(vectors[cid])[0] / params.delta).astype(np.int64).view(np.uint64)
            assert msg.dtype == np.uint64 and np.mean(msg == (encoded & np.uint64(2**32 - 1))) < 0.05


# -- settings -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, path, expected",
    [
        ({"num_neighbours": 5}, "num_neighbours", "an integer in [1, 4]"),
        ({"num_neighbours": 0}, "num_neighbours", "an integer in [1, 4]"),
        ({"reconstruction_threshold": 6}, "reconstruction_threshold", "an integer in [3, 5]"),
        ({"reconstruction_threshold": 2}, "reconstruction_threshold", "an integer in [3, 5] (a majority"),
        ({"num_clients": 1, "num_neighbours": 1, "reconstruction_threshold": 1}, "num_clients", "at least 2"),
        ({"modulus_bits": 20}, "modulus_bits", "at least 25 bits for 5 clients"),
        ({"modulus_bits": 65}, "modulus_bits", "an integer in [1, 64]"),
        ({"quantization_range": 1}, "quantization_range", "an integer >= 2"),
        ({"clipping_range": 0.0}, "clipping_range", "a finite number > 0"),
        ({"clipping_range": float("inf")}, "clipping_range", "a finite number > 0"),
        ({"max_weight": -1.0}, "max_weight", "a finite number > 0"),
        ({"num_neighbours": 2.0}, "num_neighbours", "an integer"),
    ],
)
def test_bad_settings_raise_one_line_input_error(kwargs, path, expected):
    settings = {"num_clients": 5, "num_neighbours": 4, "reconstruction_threshold": 3, **kwargs}
    with pytest.raises(InputError) as info:
        SecAggParams(**settings)
    message = str(info.value)
    assert info.value.path == f"federation.secure_aggregation.{path}" and "\n" not in message
    assert message.startswith(f"federation.secure_aggregation.{path}: expected {expected}")


def test_a_non_finite_vector_is_refused_not_summed():
    vectors = _vectors(3, "flat")
    vectors[1][4] = np.nan
    with pytest.raises(NonFiniteError, match="client 1's vector holds NaN"):
        secure_sum(vectors, SecAggParams(3, 2, 2), seed=1)


def test_a_weight_above_max_weight_is_refused():
    params = SecAggParams(3, 2, 2, max_weight=2.0)
    with pytest.raises(InputError, match=r"^federation.secure_aggregation.max_weight: expected every client weight in \(0, 2.0\]"):
        secure_sum(_vectors(3, "flat"), params, weights={0: 1.0, 1: 3.0, 2: 1.0}, seed=1)
