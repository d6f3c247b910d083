"""``rayfuse.testing`` on a method of one's own: a plug-in (a class in this file, not in the registry) runs the
contract's checks with ``check_method``; a method that breaks the contract fails them with a message saying where."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from pydantic import Field

from rayfuse.errors import InputError
from rayfuse.fusion.fedavg.algorithm import fit
from rayfuse.method import METHODS, Method, MethodCase, MethodParams, MethodResult, MethodTags, RunSetup, ServerContext
from rayfuse.testing import CHECKS, check_method, check_refusal, check_resumes
from rayfuse.updates.central_dp import CentralDPSettings
from rayfuse.updates.robust import AggregatorSettings


class MomentumParams(MethodParams):
    rounds: int = Field(3, ge=1)
    momentum: float = 0.5
    aggregator: AggregatorSettings = Field(default_factory=AggregatorSettings)
    dp: CentralDPSettings | None = None


@dataclass
class MomentumState:
    params: dict[str, np.ndarray]
    velocity: dict[str, np.ndarray]


class ServerMomentum(Method[MomentumParams, MomentumState]):
    """FedAvg with server momentum, a robust rule and central DP through the update pipeline (no DP code of its own)."""

    name = "server_momentum"
    Params = MomentumParams
    tags = MethodTags(multi_round=True, cohort=True, updates=frozenset({"dp", "aggregator"}))
    test_case = MethodCase({"rounds": 2}, step="fedavg.fit")

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        start = server.models.initial_params()
        rounds = server.rounds(
            MomentumState(start, {k: np.zeros_like(v) for k, v in start.items()}),
            last=p.rounds,
            evaluate=lambda rnd: server.scoring.evaluate(rounds.state.params),
        )
        state = rounds.state
        train = server.models.train_cfg
        for rnd, cohort in rounds.cohorts():
            step = dict(label=server.label, round=rnd, epochs=1, lr=train.lr, batch_size=train.batch_size, optimizer=train.optimizer)
            gathered = server.federation.run(
                fit, server.federation.put(state.params), clients=cohort, momentum=0.0, weight_decay=0.0, **step
            )
            result = server.updates.collect(gathered, state.params, rnd)
            self.step(state, result.params)
            rounds.log({"clients": float(len(cohort)), **result.metrics})
        return MethodResult(rounds.metrics, state.params)

    def step(self, state: MomentumState, aggregate: dict[str, np.ndarray]) -> None:
        for k, v in aggregate.items():
            state.velocity[k] = self.params.momentum * state.velocity[k] + (v - state.params[k])
            state.params[k] = (state.params[k] + state.velocity[k]).astype(v.dtype)


def test_a_plug_in_method_passes_the_contract(tmp_path):
    assert "server_momentum" not in METHODS  # a plug-in: passed as an object, never registered
    check_method(ServerMomentum, tmp_path=tmp_path)
    assert "server_momentum" not in METHODS


class VelocityOnTheMethod(ServerMomentum):
    """Broken: keeps the velocity on the method object, outside the round state the loop checkpoints, so a resumed
    run starts its momentum from zero."""

    velocity: dict[str, np.ndarray] | None = None

    def step(self, state: MomentumState, aggregate: dict[str, np.ndarray]) -> None:
        if self.velocity is None:
            self.velocity = {k: np.zeros_like(v) for k, v in aggregate.items()}
        for k, v in aggregate.items():
            self.velocity[k] = self.params.momentum * self.velocity[k] + (v - state.params[k])
            state.params[k] = (state.params[k] + self.velocity[k]).astype(v.dtype)


def test_a_method_whose_resume_is_not_bit_exact_fails_the_resume_check(tmp_path):
    with pytest.raises(AssertionError, match=r"^server_momentum: the resumed run's result differs from the uninterrupted run's, \w"):
        check_resumes(VelocityOnTheMethod, tmp_path=tmp_path)


class RefusesFederatedEvaluation(ServerMomentum):
    """Broken: its tags say it scores through the server's evaluate (``federated_evaluation``), its check refuses
    federated evaluation all the same."""

    @classmethod
    def check(cls, params: MomentumParams, setup: RunSetup) -> None:
        if setup.evaluation != "central":
            raise InputError("evaluation", "central", setup.evaluation)


class NoCase(ServerMomentum):
    test_case = None


@pytest.mark.parametrize(
    ("method", "run", "message"),
    [
        (
            RefusesFederatedEvaluation,
            lambda cls, tmp: check_refusal(cls, "federated-evaluation", tmp_path=tmp),
            r"^server_momentum, federated-evaluation: refused although its tags allow it: evaluation: expected central",
        ),
        (
            NoCase,
            lambda cls, tmp: check_method(cls, tmp_path=tmp),
            r"^method 'server_momentum' \(tests\.test_testing\.NoCase\) declares no test case: set test_case = MethodCase",
        ),
        (
            ServerMomentum,
            lambda cls, tmp: check_refusal(cls, "no-such-rule", tmp_path=tmp),
            None,
        ),
    ],
    ids=["refused-where-its-tags-allow", "no-test-case", "unknown-rule"],
)
def test_a_method_breaking_the_contract_fails_with_a_message_saying_where(tmp_path, method, run, message):
    if message is None:  # a caller's mistake, not the method's
        with pytest.raises(ValueError, match=r"^rule: expected one of attacks, client-models, "):
            run(method, tmp_path)
        return
    with pytest.raises(AssertionError, match=message):
        run(method, tmp_path)


def test_check_method_refuses_an_unknown_check():
    with pytest.raises(ValueError, match=r"^checks: expected names among runs, resumes, refusals, got 'speed'"):
        check_method(ServerMomentum, checks=("runs", "speed"))
    assert CHECKS == ("runs", "resumes", "refusals")
