"""The layering rule: the core never imports Ray (ARCHITECTURE.md, "Layering")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE_MODULES = [
    "rayfuse", "rayfuse.config", "rayfuse.data", "rayfuse.models", "rayfuse.fusion", "rayfuse.metrics", "rayfuse.federation",
    "rayfuse.client", "rayfuse.coordinator", "rayfuse.runner", "rayfuse.report", "rayfuse.store", "rayfuse.io", "rayfuse.cli",
    "rayfuse.sweep", "rayfuse.checkpoints", "rayfuse.api",
]


def test_importing_the_core_does_not_import_ray():
    code = (
        "import importlib, sys\n"
        f"for name in {CORE_MODULES!r}: importlib.import_module(name)\n"
        "from rayfuse.fusion import METHODS; METHODS.names()\n"  # imports every method module
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the core imported: {result.stdout.strip()}"


def test_no_core_source_file_imports_ray():
    offenders = []
    for path in (ROOT / "rayfuse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "ray" or n.startswith("ray.") or n == "actors" or n.startswith("actors.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    # the entry points -- the CLI and the Python API under it -- are the places allowed to reach up into the Ray layer
    # (rayfuse.cli -> rayfuse.api -> actors -> core), inside the function that starts a run on Ray
    entry_points = ("rayfuse/cli.py", "rayfuse/api.py")
    assert [o for o in offenders if not o.startswith(entry_points)] == []


def test_client_workers_stay_free_of_torch():
    code = "import sys, actors.client, rayfuse.client; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
