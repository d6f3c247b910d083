"""The lock (requirements-lock.txt, what `make` and CI install) satisfies pyproject.toml's ranges, names every
dependency of every extra, and holds torch and torchvision at the Makefile's pins; `make lock` rewrites it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")  # tomli: the same parser before 3.11


def _locked() -> dict[str, list[tuple[Version, Marker | None]]]:
    """Each locked name -> its (version, marker) rows (a universal lock may hold one row per Python version)."""
    rows: dict[str, list[tuple[Version, Marker | None]]] = {}
    for line in (ROOT / "requirements-lock.txt").read_text().splitlines():
        if not line or line[0] in "# -":
            continue
        pin, _, marker = line.partition(";")
        name, _, version = pin.strip().partition("==")
        assert version, f"requirements-lock.txt: expected name==version rows, got {line!r}"
        rows.setdefault(canonicalize_name(name), []).append((Version(version), Marker(marker) if marker.strip() else None))
    return rows


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    reqs = [Requirement(r) for r in [*project["dependencies"], *(r for group in extras for r in group)]]
    return [r for r in reqs if canonicalize_name(r.name) != "rayfuse"]  # dev's rayfuse[test]: the project itself


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_every_dependency_of_every_extra_is_locked_within_its_range(python):
    locked = _locked()
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux", "platform_system": "Linux"}
    for req in _requirements():
        rows = [v for v, marker in locked.get(canonicalize_name(req.name), []) if marker is None or marker.evaluate(env)]
        assert len(rows) == 1, f"{req.name}: expected one locked version for Python {python}, got {rows}"
        assert req.specifier.contains(rows[0], prereleases=True), f"{req.name}: locked {rows[0]} is outside {req.specifier}"


def test_torch_and_torchvision_are_locked_at_the_makefiles_pins():
    pins = re.search(r"^TORCH_PINS \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pins, "Makefile: expected a TORCH_PINS line"
    locked = _locked()
    for pin in pins.group(1).split():
        name, _, version = pin.partition("==")
        assert [v for v, _ in locked[name]] == [Version(version)], name
