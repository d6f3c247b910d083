"""Shared fixtures: small experiment configs and one real local Ray per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from rayfuse.config import ExperimentConfig, validate_config
from rayfuse.method import resolve_methods
from rayfuse.testing import BASE, merge, scramble_global_rngs  # noqa: F401  (tests import both from here)

#: the contract checks' tiny run (rayfuse.testing.BASE) with 3 local epochs and a method of each family
TINY: dict[str, Any] = merge(
    BASE,
    {
        "train": {"epochs": 3},
        "methods": {
            "local": {},
            "average": {},
            "ensemble": {},
            "fedavg": {"rounds": 3, "local_epochs": 1},
            "global": {"epochs": 3},
        },
    },
)


@pytest.fixture(autouse=True, scope="session")
def rayfuse_home(tmp_path_factory):
    """A ``RAYFUSE_HOME`` of the session's own (the sweep key, ``rayfuse.sweep_seal``): tests and the processes they
    start never write into the user's home."""
    import os

    home = tmp_path_factory.mktemp("rayfuse-home")
    previous = os.environ.get("RAYFUSE_HOME")
    os.environ["RAYFUSE_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("RAYFUSE_HOME", None)
    else:
        os.environ["RAYFUSE_HOME"] = previous


@pytest.fixture
def make_config(tmp_path):
    """``make_config(partition={...}, methods={...})`` -> a validated tiny ExperimentConfig stored under tmp_path (its
    ``methods`` entries resolved against the registry too, so bad method parameters raise here)."""

    def make(**sections: Any) -> ExperimentConfig:
        data = merge(TINY, sections)
        data.setdefault("run", {})["storage"] = str(tmp_path / "runs")
        cfg = validate_config(data)
        resolve_methods(cfg.methods)
        return cfg

    return make


@pytest.fixture
def received_replies(monkeypatch) -> list[tuple[str, int, object]]:
    """Every reply the coordinator's federation gathers while the test runs, as ``(step name, client, value)``: what
    the server receives (the secure aggregation tests check that it holds no one client's update, statistic or
    prediction)."""
    from rayfuse.federation import Federation

    received: list[tuple[str, int, object]] = []
    gather = Federation.gather

    def recording(self, calls):
        gathered = gather(self, calls)
        received.extend((calls[0].name if calls else "", c, v) for c, v in gathered.results.items())
        return gathered

    monkeypatch.setattr(Federation, "gather", recording)
    return received


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray for the whole session (starting Ray costs seconds; never per test)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        # address="local": a fresh instance even when another Ray runs on this machine (ray.init() would attach to it)
        ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="rayfuse-tests", log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


#: test files whose tests start Ray processes of their own (``ray start``, a ``rayfuse`` command that starts or attaches
#: to a local Ray, Tune) or look at the machine's Ray processes, without a ``ray`` marker of their own; and the
#: benchmarks' quick lines, whose lines that start no Ray run in the background beside those that do (measured: 143 s
#: on 2 xdist workers alone, against the module's 203 s in all with the 4 Ray lines' 150 s). Files whose tests refuse
#: before any Ray starts (the bad-input corpus, the damaged run folders, the sweep spaces) run on the workers.
RAY_FILES = frozenset(
    {
        "test_benchmarks_quick.py",
        "test_benchmarks_run.py",
        "test_cli.py",
        "test_gpu_path.py",
        "test_pinning.py",
        "test_sweep_trials.py",
    }
)


def _starts_ray(item: pytest.Item) -> bool:
    return "ray_session" in getattr(item, "fixturenames", ()) or item.path.name in RAY_FILES or item.path.parent.name == "integration"


@pytest.fixture(autouse=True)
def _no_ray_on_the_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """On a pytest-xdist worker (``make test``'s part without Ray) a test that started Ray in its process fails, naming
    what to do: two workers' Rays would share the machine and meet each other's processes."""
    yield
    if not os.environ.get("PYTEST_XDIST_WORKER") or request.node.get_closest_marker("ray") is not None:
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(
            "this test started Ray: mark it pytest.mark.ray (or use the ray_session fixture) so that make test runs it in its one-process part"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that starts Ray (the session's Ray, a ``rayfuse`` process, a ``ray start`` cluster) gets the ``ray``
    marker before ``-m`` selects: ``make test`` runs the others on 2 pytest-xdist workers, then these in one process,
    so that two Rays never share the machine and a process never attaches to another test's cluster.

    Tests marked ``slow`` (minutes of a 2-core machine, or many GB) run only with ``RAYFUSE_SLOW=1``; each names the
    fast twin that runs in every suite."""
    for item in items:
        if item.get_closest_marker("ray") is None and _starts_ray(item):
            item.add_marker(pytest.mark.ray)
    if os.environ.get("RAYFUSE_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: RAYFUSE_SLOW=1 runs it (a fast twin runs in every suite)")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)
