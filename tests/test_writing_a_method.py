"""The code of docs/writing-a-method.md, run as written: the contract example, the run, the page's own tests, the method
with central DP and a robust rule, and the method checks on both of the page's methods."""

from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-method.md"


@pytest.fixture(scope="module")
def page(tmp_path_factory, request):
    """The page's Python blocks executed in order in one module (as a reader pasting them into a file would)."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 5, "the page's five code blocks: the contract, running it, a test, a method with DP, the checks"
    module = types.ModuleType("writing_a_method_page")
    sys.modules[module.__name__] = module  # dataclasses and pydantic look the module up by name
    request.addfinalizer(lambda: sys.modules.pop(module.__name__, None))
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp_path_factory.mktemp("page"))  # the run's folder lands under runs/ here, not in the checkout
    request.addfinalizer(mp.undo)
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), module.__dict__)
    return module.__dict__


def test_the_pages_method_runs_and_fuses(page):
    result = page["result"]
    robust = result.metrics.loc["robust"]
    assert 0.0 < robust["accuracy"] <= 1.0
    curve = result.history.query("method == 'robust' and metric == 'accuracy'")
    assert list(curve["round"]) == [1, 2]  # evaluated after each round
    assert curve["value"].iloc[-1] == robust["accuracy"]  # the last round's model is the result
    assert result.model("robust").state_dict().keys() == result.model("average").state_dict().keys()  # a loadable torch model
    assert result.run_dir.is_dir()


def test_the_pages_dp_and_robust_method_runs_through_the_update_pipeline(page):
    result = page["private"]
    private = result.results["methods"]["private"]
    assert 0 < private["epsilon"] < float("inf")  # the accountant's, with no DP code in the method
    rows = result.history.query("method == 'private'")
    assert list(rows[rows.metric == "dp_sampled"]["round"]) == [1, 2]
    assert 0.0 < result.metrics.loc["robust"]["accuracy"] <= 1.0


def test_the_pages_own_tests_pass(page, tmp_path):
    tests = {name: fn for name, fn in page.items() if name.startswith("test_")}
    assert sorted(tests) == [
        "test_median_of_identical_models_is_the_model",
        "test_median_passes_the_method_checks",
        "test_median_refuses_two_clients_before_anything_starts",
        "test_server_momentum_passes_the_method_checks",
    ]
    for name, fn in tests.items():
        fn(**({"tmp_path": tmp_path / name} if "tmp_path" in inspect.signature(fn).parameters else {}))
