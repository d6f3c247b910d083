"""Pinning clients to their sites' nodes (``federation.client_overrides.<i>.resources``): a client whose custom
resources no node offers is refused in one line before any actor starts, instead of waiting out the startup timeout."""

from __future__ import annotations

import pytest

from rayfuse.errors import InputError
from rayfuse.report import Printer
from rayfuse.runner import prepare_run, run_experiment

SITE_NODES = [
    {"CPU": 4.0, "memory": 1e9, "node:10.0.0.1": 1.0, "accelerator_type:H100": 1.0, "site_a": 1.0},
    {"CPU": 4.0, "memory": 1e9, "node:10.0.0.2": 1.0, "site_b": 1.0, "GPU": 1.0},
]


def _pinned(make_config, overrides, **federation):
    return make_config(
        partition={"method": "iid", "num_clients": 3},
        methods={"average": {}},
        federation={"backend": "ray", "client_overrides": overrides, **federation},
    )


def test_each_client_finds_a_node_offering_its_resources(make_config):
    from actors.backend import check_node_resources, pinned_resources

    cfg = _pinned(make_config, {0: {"resources": {"site_a": 1}}, 1: {"resources": {"site_b": 0.5}}})
    assert pinned_resources(cfg) == {0: {"site_a": 1.0}, 1: {"site_b": 0.5}}
    check_node_resources(cfg, SITE_NODES)  # client 2 asks for nothing: any node


@pytest.mark.parametrize(
    ("overrides", "clients", "pattern"),
    [
        (
            {1: {"resources": {"site_c": 1}}},
            {},
            r"^federation\.client_overrides\.1\.resources\.site_c: expected a Ray node offering site_c for client 1 "
            r"\(the nodes offer \['site_a', 'site_b'\]\), got 1\.0; start that site's node with: ray start --address \.\.\. "
            r"--resources '\{\"site_c\": 1\}'$",
        ),
        (
            {0: {"resources": {"site_a": 2}}},
            {},
            r"^federation\.client_overrides\.0\.resources\.site_a: expected a Ray node offering site_a",
        ),
        # per node, not summed over the cluster: site_a and site_b live on different nodes
        (
            {2: {"resources": {"site_a": 1, "site_b": 1}}},
            {},
            r"^federation\.client_overrides\.2\.resources: expected one Ray node offering all of client 2's resources together",
        ),
        ({}, {"resources": {"site_x": 1}}, r"^federation\.clients\.resources\.site_x: expected a Ray node offering site_x for client 0"),
    ],
)
def test_a_resource_no_node_offers_is_one_line_naming_the_client(make_config, overrides, clients, pattern):
    from actors.backend import check_node_resources

    cfg = _pinned(make_config, overrides, **({"clients": clients} if clients else {}))
    with pytest.raises(InputError, match=pattern) as info:
        check_node_resources(cfg, SITE_NODES)
    assert "\n" not in str(info.value)


@pytest.mark.ray
def test_a_run_pinned_to_a_site_no_node_offers_stops_before_any_actor(ray_session, make_config, tmp_path):
    from actors.backend import RayBackend

    # a startup timeout far above the test's run time: the refusal is the node check, not the timeout
    cfg = _pinned(make_config, {1: {"resources": {"site_nowhere": 1}}}, startup_timeout_s=3600)
    before = {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)}
    with pytest.raises(
        InputError,
        match=r"^federation\.client_overrides\.1\.resources\.site_nowhere: expected a Ray node offering "
        r"site_nowhere for client 1 \(the nodes offer no custom resources\)",
    ):
        run_experiment(prepare_run(cfg), RayBackend(), tmp_path / "run", printer=Printer(enabled=False), show_tables=False)
    assert not (tmp_path / "run").exists()  # refused before the run folder is written
    after = {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)}
    assert after == before and ray_session.is_initialized()  # no actor started; the session's Ray untouched
