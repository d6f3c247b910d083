"""The common contract every registered method passes (``rayfuse.method.METHODS``), the way scikit-learn's
``check_estimator`` runs every estimator through the same checks: :mod:`rayfuse.testing`'s checks, parametrised over
the registry, each method on the tiny case its class declares (``test_case``). Each method, in-process:

1. runs on a tiny config (:func:`rayfuse.testing.check_runs`);
2. resumes bit-exact after an interruption (:func:`rayfuse.testing.check_resumes`);
3. is refused where its tags say so, before anything starts, and not refused where they allow it
   (:func:`rayfuse.testing.check_refusal`, one test per rule of :data:`rayfuse.testing.RULES`).

A method registered without a ``test_case`` fails every check here with a message naming the attribute.
"""

from __future__ import annotations

import pytest

from rayfuse import testing
from rayfuse.method import METHODS, Method, MethodTags

NAMES = sorted(METHODS.names())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> testing.Runs:
    """Each method's uninterrupted run, made once for the module and shared by the first two checks."""
    return testing.Runs(tmp_path_factory.mktemp("contract"))


def _refusals() -> list[tuple[str, str]]:
    """(method, rule) for every rule that applies to a method with a case (one without fails the other checks)."""
    return [(n, r) for n in NAMES if METHODS.get(n).test_case is not None for r in testing.refusal_rules(METHODS.get(n))]


def test_every_registered_method_declares_a_test_case():
    assert NAMES, "no method registered"
    for name in NAMES:
        testing.case_of(METHODS.get(name))


@pytest.mark.parametrize("name", NAMES)
def test_runs_on_a_tiny_config(runs, name):
    testing.check_runs(METHODS.get(name), runs=runs)


@pytest.mark.parametrize("name", NAMES)
def test_resumes_bit_exact_after_an_interruption(runs, tmp_path, name):
    testing.check_resumes(METHODS.get(name), runs=runs, tmp_path=tmp_path)


@pytest.mark.parametrize(("name", "rule"), _refusals())
def test_refused_where_its_capabilities_say_so(tmp_path, name, rule):
    testing.check_refusal(METHODS.get(name), rule, tmp_path=tmp_path)


def test_the_contract_covers_both_sides_of_every_refusal():
    """Each refusal rule meets at least one registered method it refuses and one it lets through (else the check proves
    nothing)."""
    for rule in testing.RULES:
        outcomes = {testing.is_refused(METHODS.get(n), rule) for n, r in _refusals() if r == rule}
        assert outcomes == {True, False}, rule


def test_a_method_without_a_test_case_fails_the_contract_naming_the_attribute():
    class Uncased(Method):
        tags = MethodTags()

        def run(self, server):
            raise AssertionError("never run")

    with pytest.raises(AssertionError, match=r"method 'Uncased' .* declares no test case: set test_case = MethodCase\(\.\.\.\)"):
        testing.check_method(Uncased)
