"""The layering rules: the core never imports Ray; no import cycles; methods see the contract, not the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE_MODULES = [
    "rayfuse",
    "rayfuse.config",
    "rayfuse.data",
    "rayfuse.models",
    "rayfuse.fusion",
    "rayfuse.updates",
    "rayfuse.metrics",
    "rayfuse.federation",
    "rayfuse.client",
    "rayfuse.coordinator",
    "rayfuse.runner",
    "rayfuse.report",
    "rayfuse.store",
    "rayfuse.io",
    "rayfuse.cli",
    "rayfuse.sweep",
    "rayfuse.merging",
    "rayfuse.api",
    "rayfuse.method",
    "rayfuse.testing",
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
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
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


# -- the import graph ------------------------------------------------------------------------------------------------


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports: every import statement counts (module level, inside functions, under
    ``TYPE_CHECKING``); ``from a.b import c`` counts ``a.b`` (and ``a.b.c`` when that is a module)."""
    files = {}
    for root in ("rayfuse", "actors"):
        for path in (ROOT / root).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = _import_graph()
    graph["rayfuse.method"].add("rayfuse.coordinator")  # what fusion/base.py once did through TYPE_CHECKING
    assert any({"rayfuse.method", "rayfuse.coordinator"} <= set(c) for c in _cycles(graph))


def test_methods_import_only_the_contract_not_the_engine():
    engine = {"rayfuse.coordinator", "rayfuse.client", "rayfuse.runner", "rayfuse.federation", "rayfuse.cli", "rayfuse.sweep"}
    graph = _import_graph()
    offenders = {m: sorted(graph[m] & engine) for m in graph if m.startswith("rayfuse.fusion") and graph[m] & engine}
    assert offenders == {}


def test_the_contract_sits_below_the_engine_and_the_schema_below_the_contract():
    graph = _import_graph()
    assert (
        graph["rayfuse.method"] & {"rayfuse.coordinator", "rayfuse.client", "rayfuse.runner", "rayfuse.federation", "rayfuse.fusion"}
        == set()
    )
    assert not any(m == "rayfuse.method" or m.startswith("rayfuse.fusion") for m in graph["rayfuse.config"])


def test_the_update_layer_sits_between_the_contract_and_the_methods_and_fusion_holds_only_methods():
    """``rayfuse.updates`` (the pipeline, streaming folds, robust rules, DP, attacks) imports the contract and the maths,
    never a method or the engine; the contract never imports it; ``rayfuse/fusion/`` holds method packages only (and the
    citations they share)."""
    graph = _import_graph()
    engine = {"rayfuse.coordinator", "rayfuse.client", "rayfuse.runner", "rayfuse.federation", "rayfuse.cli", "rayfuse.sweep"}
    updates = [m for m in graph if m == "rayfuse.updates" or m.startswith("rayfuse.updates.")]
    assert len(updates) >= 8
    offenders = {m: sorted(t for t in graph[m] if t in engine or t.startswith("rayfuse.fusion")) for m in updates}
    assert {m: t for m, t in offenders.items() if t} == {}
    assert not any(t.startswith("rayfuse.updates") for t in graph["rayfuse.method"])
    fusion = ROOT / "rayfuse" / "fusion"
    modules = {p.name for p in fusion.iterdir() if p.suffix == ".py"}
    assert modules == {"__init__.py", "references.py"}, "framework code in the methods' folder"
    packages = sorted(p.name for p in fusion.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    from rayfuse.fusion import METHODS

    homes = {METHODS.get(name).__module__.split(".")[2] for name in METHODS.names()}
    assert set(packages) <= homes, f"a package under rayfuse/fusion/ registers no method: {sorted(set(packages) - homes)}"
