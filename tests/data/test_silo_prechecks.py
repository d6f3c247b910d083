"""A silo run's checks before its survey: what the driver cannot know yet (the silos' input shape, label count and
sizes) is ``None`` in the :class:`rayfuse.method.RunSetup`, every method's ``check`` skips it, and the checks run once
before the survey and once after it with the surveyed values (no comparison of two stand-in probes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayfuse.config import validate_config
from rayfuse.errors import InputError
from rayfuse.method import METHODS, RunSetup
from rayfuse.runner import prepare_run
from tests.test_silo_methods import _server_sets
from tests.test_silo_runs import _job, _run

ROOT = Path(__file__).resolve().parents[2]
NOT_KNOWN = ("input_shape", "num_classes", "train_sizes", "val_sizes")


def test_before_the_survey_the_unknown_fields_are_none(tmp_path) -> None:
    prepared = prepare_run(validate_config(_job(tmp_path, {"aligned": {}, "gems": {}})))
    assert all(getattr(prepared.setup, name) is None for name in NOT_KNOWN)
    assert prepared.setup.num_clients == 3 and prepared.setup.public_size == 0


@pytest.mark.parametrize("name", sorted(METHODS.names()))
def test_every_method_check_skips_what_is_not_known(tmp_path, name) -> None:
    """Each registered method's check on a setup whose data fields are None: it passes or refuses with one InputError
    (never a TypeError from a None it did not skip)."""
    cfg = validate_config(_job(tmp_path, {"local": {}}))
    setup = RunSetup(
        model=cfg.model,
        train=cfg.train,
        data=cfg.data,
        num_clients=3,
        input_shape=None,
        num_classes=None,
        train_sizes=None,
        val_sizes=None,
        public_size=10,
        test_size=10,
    )
    cls = METHODS.get(name)
    try:
        cls.check(cls.Params(), setup)
    except InputError:
        pass  # a refusal that does not depend on the data (the model family, a dataset the method needs...)


def test_the_second_pass_decides_with_the_surveyed_values(tmp_path) -> None:
    # more local components than a silo holds training points: not known before the survey (the first pass lets it
    # through), refused once the clients reported their sizes, before any client trains
    methods = {"kl": {"application": "gmm", "n_components": 500, "n_init": 1, "vi_max_iter": 5}}
    job = {**_job(tmp_path, methods, **_server_sets(tmp_path)), "evaluation": "central"}
    prepared = prepare_run(validate_config(job))
    assert prepared.setup.train_sizes is None
    with pytest.raises(InputError) as info:
        _run(tmp_path, job)
    assert info.value.path == "methods.kl.n_components"
    assert "smallest client's number of training points (41)" in info.value.expected
    assert not (tmp_path / "runs" / "r" / "results.json").exists()


def test_no_two_probe_comparison_remains() -> None:
    text = (ROOT / "rayfuse" / "runner.py").read_text(encoding="utf-8")
    assert "_check_before_survey" not in text and "probe" not in text
