"""A deployment across two sites, rehearsed on one machine: a real two-node Ray cluster whose nodes carry the
resources ``site_a`` / ``site_b`` and different ``SITE_DATA`` environments, and a silo config that pins each client
to its site (``federation.client_overrides``) and reads ``${SITE_DATA}/...`` there.

Each silo's file exists only under its own node's ``SITE_DATA``: a client placed on the other node would not find
it. The driver is a separate process (this test session may hold a Ray of its own) with a Python audit hook that
records every file it opens or lists under the sites' folders; it must record none. The cluster's processes are ended
by their pids (:class:`tests.integration.two_node.TwoNodeCluster`), never ``ray stop``.
"""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.integration.two_node import TwoNodeCluster

pytestmark = pytest.mark.ray
WAIT_S = 420  # an upper bound for the driver process, not a performance assertion

DRIVER = textwrap.dedent('''
    """The driver: `rayfuse run CONFIG --address ADDR`, with an audit hook recording what it opens under a folder."""
    import json
    import sys

    watched, report, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    opened = []

    def record(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and str(args[0]).startswith(watched):
            opened.append(str(args[0]))

    sys.addaudithook(record)
    from rayfuse.cli import main

    code = main(argv)
    with open(report, "w") as out:
        json.dump({"exit": code, "opened": opened}, out)
''')


def _silo(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = (rng.normal(size=(n, 4)) + y[:, None]).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, X=X, y=y)


def test_a_silo_run_across_two_sites_pins_each_client_to_its_node_and_the_driver_opens_no_silo(tmp_path):
    site_a, site_b = tmp_path / "site_a", tmp_path / "site_b"
    _silo(site_a / "clinic_a.npz", 60, seed=1)  # only on site A's "node" (its SITE_DATA)
    _silo(site_b / "clinic_b.npz", 90, seed=2)  # only on site B's
    namespace = f"sites-{uuid.uuid4().hex[:6]}"
    config = {
        "run": {"name": "sites", "seed": 0, "storage": str(tmp_path / "runs")},
        "data": {
            "silos": [{"dataset": "npz", "path": "${SITE_DATA}/clinic_a.npz"}, {"dataset": "npz", "path": "${SITE_DATA}/clinic_b.npz"}],
            "val_size": 0.2,
            "standardize": True,
        },
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 2, "shared_init": True},
        "federation": {
            "namespace": namespace,
            "startup_timeout_s": 300,
            "client_overrides": {0: {"resources": {"site_a": 1}}, 1: {"resources": {"site_b": 1}}},
        },
        "methods": {"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}},
    }
    (tmp_path / "silos.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "driver.py").write_text(DRIVER)
    run_dir, report = tmp_path / "runs" / "sites", tmp_path / "driver.json"

    cluster = TwoNodeCluster(
        cpus_per_node=1, resources=({"site_a": 1}, {"site_b": 1}), node_env=({"SITE_DATA": str(site_a)}, {"SITE_DATA": str(site_b)})
    )
    cluster.env.pop("SITE_DATA", None)  # the driver has no SITE_DATA: only the sites' nodes do
    cluster.start()
    try:
        out = cluster.run(
            "python",
            str(tmp_path / "driver.py"),
            str(tmp_path),
            str(report),
            "run",
            str(tmp_path / "silos.yaml"),
            "--address",
            cluster.address,
            "--out",
            str(run_dir),
            "--quiet",
            timeout=WAIT_S,
            cwd=tmp_path,
        )
        driver = json.loads(report.read_text()) if report.is_file() else {}
        assert out.returncode == 0 and driver.get("exit") == 0, (out.stdout + out.stderr)[-4000:]

        # the state API: where each client's actor ran, and which site's resource that node carries
        actors = cluster.run(
            "ray",
            "list",
            "actors",
            "--address",
            cluster.dashboard_url,
            "--filter",
            f"ray_namespace={namespace}",
            "--format",
            "json",
            "--detail",
            "--limit",
            "100",
        )
        nodes = cluster.run("ray", "list", "nodes", "--address", cluster.dashboard_url, "--format", "json", "--detail")
        assert actors.returncode == 0 and nodes.returncode == 0, (actors.stderr + nodes.stderr)[-2000:]
    finally:
        cluster.stop()

    # the hook saw the driver read its config; it read no silo: not the files, not the sites' folders
    assert str(tmp_path / "silos.yaml") in driver["opened"]
    assert [p for p in driver["opened"] if p.startswith((str(site_a), str(site_b)))] == []
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "succeeded" and results["run"]["backend"] == "ray"
    assert all(results["methods"][m]["accuracy"] is not None for m in ("average", "fedavg"))
    node_site = {n["node_id"]: next(r for r in ("site_a", "site_b") if r in n["resources_total"]) for n in json.loads(nodes.stdout)}
    by_name = {a["name"]: a for a in json.loads(actors.stdout)}
    placed = {i: node_site[by_name[f"{run_dir.name}/client-{i}"]["node_id"]] for i in (0, 1)}
    assert placed == {0: "site_a", 1: "site_b"}
    # each client read the file of its own node (sizes 60 and 90, less a fifth held out), reported in the silo manifest
    manifest = json.loads((run_dir / "partition.json").read_text())
    text = json.dumps(manifest)
    assert [c["size"] + c["held_out_size"] for c in manifest["clients"]] == [60, 90]
    assert str(tmp_path) not in text and "clinic_" not in text  # counts and hashes only: no paths
