"""Central DP with a method written from docs/writing-a-method.md: refused before start unless the method declares that
its rounds train the framework's cohort (``MethodTags.cohort``), and then every round's trained clients are the ones
the accountant sampled; a method that trains others stops at that round, and one that never planned DP is planned by
the round loop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from pydantic import Field

import rayfuse
from rayfuse.errors import InputError, RunFailure
from rayfuse.fusion.fedavg.algorithm import fit
from rayfuse.method import Method, MethodParams, MethodResult, MethodTags, ServerContext
from rayfuse.updates.central_dp import CentralDPSettings
from tests.conftest import TINY, merge


class MomentumParams(MethodParams):
    rounds: int = Field(3, ge=1)
    momentum: float = 0.5
    dp: CentralDPSettings | None = None
    wrong: str = ""  # a wrong method: "every_client" trains every client whatever the sample drew; "no_sample" never samples


@dataclass
class MomentumState:
    params: dict[str, np.ndarray]
    velocity: dict[str, np.ndarray]


TRAINED: dict[int, list[int]] = {}


class ServerMomentum(Method[MomentumParams, MomentumState]):
    """FedAvg with server momentum, as a contributor writes it from the guide (no DP code of its own)."""

    name = "server_momentum"
    Params = MomentumParams

    tags = MethodTags(multi_round=True, updates=frozenset({"dp"}))

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        start = server.models.initial_params()
        rounds = server.rounds(MomentumState(start, {k: np.zeros_like(v) for k, v in start.items()}), last=p.rounds)
        state = rounds.state
        train = server.models.train_cfg
        # the framework's cohort, or (the wrong methods) every client, or rounds that never ask for their cohort
        for rnd, cohort in rounds.cohorts() if p.wrong != "no_sample" else ((r, []) for r in rounds):
            clients = server.federation.client_ids if p.wrong else cohort
            TRAINED[rnd] = sorted(int(c) for c in clients)
            step = dict(label=server.label, round=rnd, epochs=1, lr=train.lr, batch_size=train.batch_size, optimizer=train.optimizer)
            gathered = server.federation.run(
                fit, server.federation.put(state.params), clients=list(clients), momentum=0.0, weight_decay=0.0, **step
            )
            result = server.updates.collect(gathered, state.params, rnd)
            for k, v in result.params.items():
                if v.dtype.kind == "f":
                    state.velocity[k] = p.momentum * state.velocity[k] + (v - state.params[k])
                    state.params[k] = (state.params[k] + state.velocity[k]).astype(v.dtype)
            rounds.log({"clients": float(len(clients)), **result.metrics})
        return MethodResult(rounds.metrics, state.params)


class ServerMomentumCohort(ServerMomentum):
    tags = MethodTags(multi_round=True, cohort=True, updates=frozenset({"dp"}))


class ServerMomentumUndeclared(ServerMomentum):
    """Declares a ``dp`` field but not in its tags: the framework would never read it."""

    tags = MethodTags(multi_round=True, cohort=True)


DP = {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.5}


def _config(tmp_path, **params) -> dict:
    return merge(
        TINY,
        {
            "run": {"storage": str(tmp_path / "runs")},
            "partition": {"method": "iid", "num_clients": 6},
            "methods": {"momentum": {"dp": DP, **params}},
        },
    )


def test_central_dp_for_a_method_that_does_not_declare_the_cohort_is_refused_before_start(tmp_path) -> None:
    with pytest.raises(InputError) as raised:
        rayfuse.run(_config(tmp_path), methods={"momentum": ServerMomentum}, backend="local", quiet=True)
    line = str(raised.value)
    assert line.startswith("methods.momentum.dp: expected no central dp for method") and "MethodTags.cohort" in line and "\n" not in line
    assert not (tmp_path / "runs").exists()


def test_a_method_declaring_the_cohort_trains_exactly_the_clients_the_accountant_sampled(tmp_path) -> None:
    TRAINED.clear()
    result = rayfuse.run(_config(tmp_path), methods={"momentum": ServerMomentumCohort}, backend="local", quiet=True)
    table = result.history.query("method == 'momentum'")
    sampled = table[table.metric == "dp_sampled"].set_index("round")["value"]
    assert sorted(TRAINED) == [1, 2, 3] == sorted(sampled.index)
    for rnd, clients in TRAINED.items():
        assert len(clients) == sampled[rnd]  # the accountant's sample is what trained, round by round
    assert any(len(c) < 6 for c in TRAINED.values())  # Poisson at 0.5: not every client every round
    assert 0 < result.results["methods"]["momentum"]["epsilon"] < float("inf")


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        ("every_client", r"central DP round 1: clients \[.*\] trained but were not sampled \(the accountant drew \["),
        ("no_sample", r"central DP round 1: no clients were sampled for it"),
    ],
)
def test_a_method_declaring_the_cohort_that_trains_other_clients_stops_at_that_round(tmp_path, wrong, message) -> None:
    with pytest.raises(RunFailure, match=message):
        rayfuse.run(_config(tmp_path, wrong=wrong), methods={"momentum": ServerMomentumCohort}, backend="local", quiet=True)


def test_a_dp_field_the_tags_do_not_declare_is_refused_before_start_in_one_line(tmp_path) -> None:
    with pytest.raises(InputError) as raised:
        rayfuse.run(_config(tmp_path), methods={"momentum": ServerMomentumUndeclared}, backend="local", quiet=True)
    line = str(raised.value)
    assert line.startswith("methods.momentum: expected the update layer's settings declared in the method's tags") and "\n" not in line
    assert line.endswith("got 'dp'")
    assert not (tmp_path / "runs").exists()
