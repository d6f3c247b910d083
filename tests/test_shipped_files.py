"""Every shipped job validates, and cluster.yaml passes Ray's own cluster-launcher schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayfuse.config import ExperimentConfig, load_config
from rayfuse.method import resolve_methods, resolved_config

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))


def test_there_are_jobs():
    assert {p.name for p in JOBS} >= {"quickstart.yaml", "digits_label_groups.yaml", "breast_cancer_iid.yaml"}


@pytest.mark.parametrize("path", JOBS, ids=[p.name for p in JOBS])
def test_every_job_validates(path):
    cfg = load_config(path)
    assert resolve_methods(cfg.methods)


def test_the_quickstart_is_the_config_default():
    # `rayfuse run` outside a checkout falls back to the schema defaults: they must be the same job.
    assert resolved_config(load_config(ROOT / "jobs" / "quickstart.yaml")) == resolved_config(ExperimentConfig())


def test_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    sites = {name: t for name, t in types.items() if name in t["resources"]}  # a worker type per site, named as its resource
    assert set(sites) == {"site_a", "site_b"} and all(t["resources"].get("GPU", 0) >= 1 for t in sites.values())
    for name, t in sites.items():  # its node stays up, mounts its own data and gives ray start SITE_DATA
        assert t["min_workers"] >= 1 and any(f"export SITE_DATA=/data/{name}" in c for c in t["worker_setup_commands"])
    assert any("pip install -e" in c for c in config["setup_commands"])
