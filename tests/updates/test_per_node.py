"""Per-node partial sums (``federation.aggregation: per_node``, rayfuse/updates/streaming.py ``NodeFold``): each
process folds its clients (``RoundFold``), then one fold per node folds that node's partial sums, and the
coordinator folds one partial sum per node. In-process, the federation's test-only ``processes_per_node`` groups
processes into simulated nodes and folds them exactly as a node's aggregator actor does on Ray (the same
``reduce_replies`` and ``NodeFold``); the aggregate equals the gathered (flat) one within float rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rayfuse.coordinator import Coordinator
from rayfuse.errors import InputError
from rayfuse.federation import Folded, reduce_replies
from rayfuse.method import Update, resolve_methods
from rayfuse.updates.pipeline import check_aggregation
from rayfuse.updates.streaming import NodeFold, PartialSum, RoundFold
from tests.updates.test_streaming import DP, METHODS, _Ctx, assert_close, coordinator, modes, one_round, synthetic_update


def nodes(make_config, tmp_path: Path, *, per_process: int, per_node: int, **kwargs: Any) -> Coordinator:
    """``coordinator`` of test_streaming, with its processes grouped ``per_node`` to a simulated node."""
    coord = coordinator(make_config, tmp_path, per_process=per_process, **kwargs)
    coord.federation._per_node = per_node  # type: ignore[attr-defined]
    return coord


LAYOUTS = {"2 nodes of 2 one-client processes": (1, 2), "1 node of 2 two-client processes": (2, 2), "4 nodes": (1, 1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(METHODS))
def test_per_node_sums_equal_the_gathered_aggregate(make_config, tmp_path, name, layout):
    per_process, per_node = LAYOUTS[layout]
    method = METHODS[name]
    weighted = method.get("weighted", True)
    gathered, _, _ = one_round(coordinator(make_config, tmp_path, method=method), streaming=False, weighted=weighted)
    coord = nodes(make_config, tmp_path, per_process=per_process, per_node=per_node, method=method)
    folded, _, coord = one_round(coord, streaming=True, aggregation="per_node", weighted=weighted)
    assert modes(coord) == ["per_node"]
    assert coord.arrived == ["PartialSum"] * (4 // (per_process * per_node))  # one partial sum per node
    assert assert_close(folded.params, gathered.params) < 1e-6
    assert list(folded.updates) == list(gathered.updates) == [0, 1, 2, 3]
    assert all(folded.updates[c].params == {} for c in folded.updates)
    assert [u.num_examples for u in folded.updates.values()] == [u.num_examples for u in gathered.updates.values()]
    assert [u.metrics for u in folded.updates.values()] == [u.metrics for u in gathered.updates.values()]


@pytest.mark.parametrize("adaptive", [False, True])
def test_central_dp_per_node_equals_the_gathered_round_with_the_same_noise_seed(make_config, tmp_path, adaptive):
    dp = {**DP, **({"adaptive": {"target_quantile": 0.5, "lr": 0.2, "count_stddev": 1.0}} if adaptive else {})}
    method = {"dp": dp, "weighted": False}
    gathered, gp, _ = one_round(coordinator(make_config, tmp_path, method=method), streaming=False, weighted=False)
    coord = nodes(make_config, tmp_path, per_process=1, per_node=2, method=method)
    folded, fp, coord = one_round(coord, streaming=True, aggregation="per_node", weighted=False)
    assert coord.arrived == ["PartialSum"] * 2  # clipped per client where it trained, summed per node, noised once here
    assert assert_close(folded.params, gathered.params) < 1e-6
    assert folded.metrics == gathered.metrics  # dp_clip_norm, the noised unclipped fraction, epsilon
    assert fp.state() == gp.state()  # adaptive clipping's next C
    assert np.isfinite(gathered.metrics["dp_epsilon"])


def test_unset_aggregation_picks_per_node_when_the_clients_span_several_nodes(make_config, tmp_path):
    result, pipeline, coord = one_round(nodes(make_config, tmp_path, per_process=1, per_node=2, method={}), streaming=True)
    assert modes(coord) == ["per_node"] and coord.arrived == ["PartialSum"] * 2
    assert pipeline.info()["aggregation"] == {"mode": "per_node"}
    _, _, single = one_round(nodes(make_config, tmp_path, per_process=2, per_node=2, method={}), streaming=True)
    assert modes(single) == ["per_actor"]  # one node: per_node would add a hop and save no transfer
    _, pipeline, flat = one_round(coordinator(make_config, tmp_path, method={}), streaming=True, aggregation="per_node")
    assert modes(flat) == ["flat"]  # a federation without nodes folds flat, and says why
    assert "no nodes" in pipeline.info()["aggregation"]["reason"]
    assert all(np.isfinite(v).all() for v in result.params.values())


def test_a_rejected_reply_and_a_failed_client_are_handled_per_client_on_a_node(make_config, tmp_path):
    drop = {"on_client_failure": "drop"}
    coord = nodes(make_config, tmp_path, per_process=1, per_node=2, policy=drop, method={})
    result, _, coord = one_round(coord, streaming=True, aggregation="per_node", bad=(2,), fail=(1,))
    assert list(result.updates) == [0, 3]
    assert [e["client"] for e in coord.events.since(0) if e["kind"] == "client_dropped"] == [1]
    rejected = [(e["client"], e["message"]) for e in coord.events.since(0) if e["kind"] == "update_rejected"]
    assert [c for c, _ in rejected] == [2] and "NaN" in rejected[0][1]
    reference = coord.reference_params()
    expected = {
        k: (sum(coord.plan.num_examples(c) * synthetic_update(_Ctx(coord, c), reference, seed=7).params[k] for c in (0, 3)))
        / sum(coord.plan.num_examples(c) for c in (0, 3))
        for k in reference
    }
    for key, value in result.params.items():
        np.testing.assert_allclose(value, expected[key].astype(value.dtype), rtol=2e-6, atol=2e-7)


def test_node_fold_rejects_a_bad_partial_sum_and_keeps_failures_and_markers_per_client():
    reference = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    planned = {0: 5, 1: 7, 2: 4, 3: 6}
    fold = RoundFold("mean", True, planned, None)

    def update(c: int, value: float) -> Update:
        return Update({k: np.full(v.shape, value, np.float32) for k, v in reference.items()}, planned[c], {"loss": float(c)})

    good = fold.reduce(iter([(0, update(0, 1.0), (reference,)), (1, update(1, 3.0), (reference,))]))
    bad = PartialSum({"w": np.full((3, 2), np.nan, np.float32), "b": np.zeros(2, np.float32)}, 4.0, {2: (4, {})})
    outcomes = [
        (0, True, good, (reference,)),
        (1, True, Folded(0), (reference,)),
        (2, True, bad, (reference,)),
        (3, False, ("died", "ActorDiedError: gone"), (reference,)),
    ]
    out = reduce_replies(NodeFold(fold), outcomes)
    assert out[1] == (True, Folded(0)) and out[2] == (True, Folded(0)) and out[3] == (False, ("died", "ActorDiedError: gone"))
    ok, node = out[0]
    assert ok and isinstance(node, PartialSum)
    assert set(node.clients) == {0, 1} and node.weight == 12.0
    assert "NaN" in node.rejected[2]
    np.testing.assert_allclose(node.total["w"], 5 * 1.0 + 7 * 3.0)


def test_an_explicit_per_node_that_cannot_fold_is_refused_in_one_line(make_config):
    krum = make_config(
        federation={"backend": "ray", "aggregation": "per_node"},
        methods={"fl": {"method": "fedavg", "aggregator": {"name": "krum", "f": 0}}},
    )
    with pytest.raises(InputError, match=r"^federation\.aggregation: expected flat or unset with methods\.fl\.aggregator 'krum'"):
        check_aggregation(resolve_methods(krum.methods), krum.federation)
    local = make_config(federation={"backend": "local", "aggregation": "per_node"}, methods={"fl": {"method": "fedavg"}})
    with pytest.raises(InputError, match=r"^federation\.aggregation: expected flat, per_actor or unset with the in-process"):
        check_aggregation(resolve_methods(local.methods), local.federation)
    attack = {"client": 0, "kind": "sign_flip"}
    attacked = make_config(
        federation={"backend": "ray", "aggregation": "per_node", "attacks": [attack]}, methods={"fl": {"method": "fedavg"}}
    )
    with pytest.raises(InputError, match=r"^federation\.aggregation: expected flat or unset with federation\.attacks"):
        check_aggregation(resolve_methods(attacked.methods), attacked.federation)
    with pytest.raises(Exception, match="per_node only with streaming: true"):
        make_config(federation={"backend": "ray", "aggregation": "per_node", "streaming": False})
