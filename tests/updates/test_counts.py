"""Client-reported sample counts are checked against the partition plan before they weigh an average."""

from __future__ import annotations

import numpy as np
import pytest

from rayfuse.coordinator import MethodServer
from rayfuse.federation import Gathered, Update, client_step
from rayfuse.method import resolve_methods
from rayfuse.updates.aggregate import weighted_average


@pytest.fixture
def server_and_updates(coordinator):
    coord = coordinator(methods={"average": {}})
    server = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False)
    ref = coord.reference_params()
    rng = np.random.default_rng(0)
    updates = {
        i: Update({k: rng.normal(size=v.shape).astype(v.dtype) for k, v in ref.items()}, coord.plan.num_examples(i))
        for i in range(coord.plan.num_clients)
    }
    return coord, server, updates


def rejections(coord):
    return {e["client"]: e["message"] for e in coord.events.since(0) if e["kind"] == "update_rejected"}


@pytest.mark.parametrize("reported", ["inflated", "deflated", "off by one", "numpy integer off by one"])
def test_a_count_other_than_the_planned_one_is_rejected_and_recorded(server_and_updates, reported):
    coord, server, updates = server_and_updates
    planned = coord.plan.num_examples(1)
    updates[1].num_examples = {
        "inflated": planned * 1000,
        "deflated": 1,
        "off by one": planned + 1,
        "numpy integer off by one": np.int64(planned - 1),
    }[reported]
    accepted = server.updates.accept(Gathered(updates))
    assert sorted(accepted) == [0, 2, 3]
    assert f"not the client's {planned} training examples" in rejections(coord)[1]


def test_planned_counts_pass(server_and_updates):
    coord, server, updates = server_and_updates
    updates[2].num_examples = np.int64(updates[2].num_examples)  # a numpy integer of the right value is fine
    assert sorted(server.updates.accept(Gathered(updates))) == [0, 1, 2, 3]
    assert not rejections(coord)


def test_an_inflated_count_never_weighs_the_average(server_and_updates):
    coord, server, updates = server_and_updates
    honest = {i: updates[i] for i in (0, 2, 3)}
    updates[1].num_examples = coord.plan.num_examples(1) * 50
    result = server.updates.collect(Gathered(updates))
    averaged, used = result.params, result.updates
    assert sorted(used) == [0, 2, 3]
    expected = weighted_average([u.params for u in honest.values()], [u.num_examples for u in honest.values()])
    for key in expected:
        np.testing.assert_array_equal(averaged[key], expected[key])


@client_step("test.counts.inflate")
def inflate(ctx):
    from rayfuse.models import get_params

    count = ctx.num_examples * (10 if ctx.client_id == 0 else 1)
    return Update(get_params(ctx.local_model()), count)


def test_a_client_step_that_overstates_its_count_is_left_out(coordinator):
    coord = coordinator(methods={"average": {}})
    server = MethodServer(coord, resolve_methods(coord.cfg.methods)[0], resume=False)
    accepted = server.updates.accept(coord.federation.run(inflate))
    assert 0 not in accepted and sorted(accepted) == [1, 2, 3]
    assert "training examples" in rejections(coord)[0]
