"""Under ``on_client_failure: drop``, Ray's restart of a crashed client actor is recorded, as under ``retry``."""

from __future__ import annotations

import pytest

from tests.integration.test_ray import ray_run

pytestmark = pytest.mark.ray


# its twin: tests/integration/test_ray.py::test_a_failing_client_does_not_fail_the_clients_sharing_its_actor (a crash
# under drop on Ray: the restart recorded after the drop, no retry)
@pytest.mark.slow
def test_a_crashed_client_dropped_under_drop_is_restarted_and_the_restart_recorded(ray_session, make_config, tmp_path):
    methods = {"fedavg": {"rounds": 2, "local_epochs": 1}}
    crash = {"backend": "ray", "on_client_failure": "drop", "faults": [{"client": 1, "step": "fedavg.fit", "call": 1, "mode": "exit"}]}
    results = ray_run(make_config(methods=methods, federation=crash), tmp_path / "drop")
    assert results["status"] == "succeeded"
    kinds = [(e["kind"], e.get("client")) for e in results["events"]]
    assert ("client_dropped", 1) in kinds and ("client_restarted", 1) in kinds
    assert kinds.index(("client_dropped", 1)) < kinds.index(("client_restarted", 1))
    assert ("client_retry", 1) not in kinds
