"""The pre-start rules are one ordered table (``rayfuse.prestart.PRE_START_RULES``): a simulation runs it once, a silo
run twice (before its survey, with what only the silos know ``None``, and after it), every rule in the same order, so
the two paths cannot drift apart."""

from __future__ import annotations

from typing import Any

import pytest

import rayfuse.prestart as prestart
from rayfuse.config import validate_config
from rayfuse.errors import InputError
from rayfuse.runner import prepare_run
from tests.test_silo_runs import _job as silo_job
from tests.test_silo_runs import _run as silo_run


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[str, bool]]:
    """Each rule the runs below call: ``(name, whether the model's size was known)``."""
    calls: list[tuple[str, bool]] = []

    def recording(rule: Any) -> Any:
        def run(facts: prestart.StartFacts) -> None:
            calls.append((rule.__name__, facts.num_params is not None))
            rule(facts)

        return run

    monkeypatch.setattr(prestart, "PRE_START_RULES", tuple(recording(r) for r in prestart.PRE_START_RULES))
    return calls


NAMES = [rule.__name__ for rule in prestart.PRE_START_RULES]


def test_the_table_has_one_rule_per_concern_in_its_order():
    assert len(NAMES) == len(set(NAMES)) >= 10
    # the data's and the clients' models' impossibilities first, each method's own check, then evaluation and DP
    assert NAMES.index("refuse_public_labels_without_labels") < NAMES.index("methods_own_checks")
    assert NAMES.index("methods_own_checks") < NAMES.index("refuse_federated_evaluation_without_scores")
    assert NAMES[-2:] == ["coordinator_memory", "local_dp_sgd"]


def test_a_simulation_runs_every_rule_once_in_order(make_config, recorded):
    prepare_run(make_config())
    assert recorded == [(name, True) for name in NAMES]


def test_a_silo_run_runs_the_same_rules_before_and_after_its_survey(tmp_path, recorded):
    results = silo_run(tmp_path, silo_job(tmp_path, {"fedavg": {"rounds": 1, "local_epochs": 1}, "average": {}}))
    assert results["status"] == "succeeded"
    assert recorded == [(name, False) for name in NAMES] + [(name, True) for name in NAMES]


def test_a_rule_of_the_table_refuses_a_silo_run_before_any_client_trains(tmp_path):
    # the update pipeline's rule (a robust rule's precondition on 3 clients) is refused on the first pass, before the
    # survey: the silos are never opened
    job = silo_job(tmp_path, {"krum": {"method": "fedavg", "rounds": 1, "aggregator": {"name": "krum", "f": 2}}})
    with pytest.raises(InputError) as raised:
        prepare_run(validate_config(job))
    assert raised.value.path.startswith("methods.krum.aggregator") and "\n" not in str(raised.value)
