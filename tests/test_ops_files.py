"""The shipped operations files: the runtime environment for clusters without rayfuse."""

from __future__ import annotations

from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_runtime_env_is_valid_for_ray_and_installs_every_dependency_but_ray():
    from ray.runtime_env import RuntimeEnv

    data = yaml.safe_load((ROOT / "docs" / "runtime_env.yaml").read_text())
    RuntimeEnv(**data)  # Ray's own validation of the keys
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(data["pip"]) == sorted(d for d in deps if not d.startswith("ray"))
