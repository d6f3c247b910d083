"""Every benchmark entry script under ``benchmarks/`` has a quick mode, and each quick mode runs on the current engine.

A benchmark that no check runs rots: a refactor broke ``bench_round.py`` and ``compare_flower.py`` once and nothing
noticed. ``benchmarks/quick.txt`` lists one quick command per entry script (``benchmarks/run_all.sh --quick`` runs
the same list); this module finds every entry script (a ``.py`` with a ``__main__`` block, or a ``.sh``), fails for one
that the list lacks (so a new benchmark must add its quick mode), and runs each listed command in a process of its
own, as a person would from the repository root (a shell script or one that starts a local Ray as a subprocess, the
others forked from a process that has done their common imports once: 2 minutes instead of 3 for those, and run on
two threads beside the ones that start Ray): exit status 0, no traceback, and the results it wrote under ``{out}`` hold
the expected keys and only finite numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
QUICK_LIST = BENCHMARKS / "quick.txt"
MAIN_BLOCK = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)

# Files under benchmarks/ that are not benchmarks of their own, each with why (a new one must be added here on purpose).
NOT_ENTRY_SCRIPTS = {
    "benchmarks/_common.py": "helpers shared by the scripts",
    "benchmarks/_steps.py": "the round benchmark's client step, importable by Ray workers",
    "benchmarks/aligned/arch.py": "the aligned benchmark's models, imported by both virtualenvs",
    "benchmarks/aligned/rebasin_runner.py": "rebasin's side of aligned/accuracy.py and aligned/speed.py, in rebasin's virtualenv",
    "benchmarks/flower_round.py": "Flower's side of compare_flower.py, in Flower's virtualenv",
    "benchmarks/flower_robust.py": "Flower's side of compare_flower_robust.py, in Flower's virtualenv",
    "benchmarks/run_all.sh": "runs benchmarks/quick.txt itself (--quick)",
    "benchmarks/gpu/check.py": "the GPU check's driver, run by benchmarks/gpu/check.sh",
}

# What each quick run that writes under {out} must write: a JSON file there and the top-level keys it holds.
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "benchmarks/bench_aggregate.py": ("bench_aggregate.json", {"machine", "rows", "targets", "chunk_sweep"}),
    "benchmarks/bench_epgan.py": ("bench_epgan.json", {"machine", "toy", "server_product"}),
    "benchmarks/bench_fedref.py": ("bench_fedref.json", {"machine", "client", "server"}),
    "benchmarks/bench_gems.py": ("bench_gems.json", {"machine", "convex", "neurons", "kmeans"}),
    "benchmarks/bench_kl.py": ("kl_bench.json", {"machine", "throughput", "overhead", "exact_vs_relaxed", "summary"}),
    "benchmarks/kl_report.py": ("sweeps.json", {"rows", "methods", "seeds"}),
    "benchmarks/gems_report.py": ("raw.json", {"logreg-K2-seed0", "mlp-K2-seed0"}),
    "benchmarks/epgan_report.py": ("report.json", {"epgan-toy-s0"}),
    "benchmarks/fedref_report.py": ("report.json", {"fedref-digits"}),
    "benchmarks/fedsa_report.py": ("report.json", {"run-fedsa_digits"}),
    "benchmarks/compare_flower.py": ("compare_flower.json", {"machine", "rayfuse", "flower", "comparison"}),
    "benchmarks/compare_flower_robust.py": ("compare_flower_robust.json", {"machine", "rows", "weighted_average_s"}),
    "benchmarks/robust/aggregator_cost.py": ("cost.json", {"command", "payloads"}),
    "benchmarks/robust/accuracy.py": ("robust_accuracy.json", {"machine", "rows"}),
    "benchmarks/robust/dp_epsilon.py": ("dp_epsilon.json", {"machine", "summary"}),
    "benchmarks/secagg_cost.py": ("secagg_cost.json", {"machine", "rows"}),
    "benchmarks/secure_round.py": ("secure_round.json", {"machine", "rows"}),
    "benchmarks/aligned/train.py": ("train.json", {"cell", "baselines"}),
    "benchmarks/aligned/accuracy.py": ("aligned_accuracy_quick.json", {"machine", "rows"}),
    "benchmarks/aligned/width.py": ("aligned_width.json", {"machine", "rows"}),
    "benchmarks/aligned/speed.py": ("aligned_speed.json", {"machine", "rows", "spec_check"}),
    "benchmarks/distill/accuracy.py": ("distill_accuracy_quick.json", {"machine", "rows"}),
    "benchmarks/distill/speed.py": ("distill_speed.json", {"machine", "batched", "teachers", "bank", "ray"}),
    "benchmarks/distill/privacy.py": ("distill_privacy.json", {"machine", "rows"}),
    "benchmarks/distill/newcomer.py": ("distill_newcomer.json", {"meta", "variants", "rows"}),
    "benchmarks/distill/many.py": ("distill_many.json", {"machine", "params", "rows"}),
    "benchmarks/distill/target_check.py": ("distill_target_check.json", {"machine", "cells", "rows"}),
    "benchmarks/finetunes/compare_mergekit.py": ("compare_mergekit.json", {"rows", "mergekit"}),
    "benchmarks/finetunes/lora_exactness.py": ("lora_exactness.json", {"rows"}),
    "benchmarks/finetunes/accuracy.py": ("finetunes_accuracy.json", {"summary", "runs", "meta"}),
    "benchmarks/text/accuracy.py": ("text_accuracy.json", {"summary", "runs", "meta", "targets"}),
    "benchmarks/gpu/check.sh": ("gpu_check.json", {"machine", "mode", "rows"}),
    "benchmarks/bench_round.py": ("bench_round.json", {"machine", "rows", "cells"}),
    "benchmarks/bench_large.py": ("large_quick.json", {"machine", "result"}),
}

# Quick runs that start a local Ray of their own (in the subprocess): marked like the other tests that need Ray.
STARTS_RAY = {
    "benchmarks/bench_kl.py",
    "benchmarks/compare_flower.py",  # run elsewhere, on the session's Ray
    "benchmarks/aligned/speed.py",
    "benchmarks/distill/speed.py",
    "benchmarks/bench_round.py",
    "benchmarks/bench_large.py",  # run elsewhere, on the session's Ray
}


def quick_lines() -> list[tuple[str, list[str]]]:
    """``(script, arguments)`` of each command in ``benchmarks/quick.txt``."""
    lines = []
    for line in QUICK_LIST.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            script, *args = shlex.split(line)
            lines.append((script, args))
    return lines


def entry_scripts() -> set[str]:
    """Every benchmark script a person runs: a ``.sh``, or a ``.py`` with a ``__main__`` block (virtualenvs and results,
    ignored by git, left out)."""
    found = set()
    for path in BENCHMARKS.rglob("*"):
        rel = path.relative_to(ROOT)
        if not path.is_file() or any(part.startswith(".") or part == "results" for part in rel.parts[1:]):
            continue
        if path.suffix == ".sh" or (path.suffix == ".py" and MAIN_BLOCK.search(path.read_text(encoding="utf-8"))):
            found.add(rel.as_posix())
    return found


def finite_numbers(payload: Any, where: str = "") -> int:
    """How many numbers ``payload`` holds; fails on NaN or infinity (``json`` reads both)."""
    if isinstance(payload, dict):
        return sum(finite_numbers(v, f"{where}.{k}") for k, v in payload.items())
    if isinstance(payload, list):
        return sum(finite_numbers(v, f"{where}[{i}]") for i, v in enumerate(payload))
    if isinstance(payload, (int, float)) and not isinstance(payload, bool):
        assert math.isfinite(payload), f"{where} = {payload}"
        return 1
    return 0


def test_every_entry_script_has_a_quick_line_and_every_line_a_script():
    listed = [script for script, _ in quick_lines()]
    assert len(listed) == len(set(listed)), "one line per script"
    missing = entry_scripts() - set(NOT_ENTRY_SCRIPTS) - set(listed)
    assert not missing, f"benchmark scripts without a quick line in benchmarks/quick.txt: {sorted(missing)}"
    unknown = [s for s in listed if not (ROOT / s).exists()]
    assert not unknown, f"quick.txt names scripts that do not exist: {unknown}"
    gone = [s for s in NOT_ENTRY_SCRIPTS if not (ROOT / s).exists()]
    assert not gone, f"NOT_ENTRY_SCRIPTS names files that are gone: {gone}"
    # every line that writes under {out} says what it writes, and only those lines do
    assert {s for s, args in quick_lines() if any("{out}" in a for a in args)} == set(EXPECTED)


def test_run_all_quick_reads_the_same_list():
    text = (BENCHMARKS / "run_all.sh").read_text()
    assert "quick.txt" in text and "--quick" in text


# Entry scripts whose quick mode a test of their own runs, with the same arguments and more checks: listed in quick.txt
# (run_all.sh runs them), not run a second time here.
RUN_ELSEWHERE = {
    "benchmarks/finetunes/accuracy.py": "tests/finetunes/test_accuracy_bench.py::test_quick_run_writes_a_complete_finite_table",
    "benchmarks/gpu/check.sh": "tests/test_gpu_path.py::test_the_gpu_check_runs_on_the_cpu_and_prints_its_table",
    "benchmarks/compare_flower.py": "tests/test_benchmarks_run.py::test_compare_flower_runs_without_flower_and_says_so_in_one_line",
    "benchmarks/bench_large.py": "tests/integration/test_large_model.py::test_the_quick_line_runs_resumes_and_fuses_through_shard_folders",
}


def _params() -> list[Any]:
    params = []
    for script, args in quick_lines():
        if script in RUN_ELSEWHERE:
            continue
        marks = [pytest.mark.ray] if script in STARTS_RAY else []
        params.append(pytest.param(script, args, id=script.removeprefix("benchmarks/"), marks=marks))
    return params


# What every quick run imports before its own code: loaded once in the fork server's process (below), not again per run.
PRELOAD = ["numpy", "scipy", "sklearn", "torch", "matplotlib.pyplot", "rayfuse.api", "rayfuse.runner", "rayfuse.finetunes.run"]


def _run_script(script: str, argv: list[str], stdout: str, stderr: str) -> None:
    """A benchmark script as ``python script argv...`` would run it, in a process forked from the fork server (the
    imports above done once): the repository as the working directory and on ``sys.path``, output to two files, the
    script's exit status as this process's."""
    import runpy
    import traceback

    os.chdir(ROOT)
    os.environ.setdefault("MPLBACKEND", "Agg")
    for fd, name in ((1, stdout), (2, stderr)):
        handle = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = [script, *argv]
    sys.path[:0] = [str(ROOT / Path(script).parent), str(ROOT)]  # the script's folder first, as python puts it
    code = 0
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@pytest.fixture(scope="module")
def forkserver() -> Any:
    """A multiprocessing fork server with the quick runs' common imports loaded: each Python quick run that starts no
    Ray is a fork of it, a fresh process as far as the script can tell, without paying ~4 s of imports each time (the
    scripts that start a local Ray of their own, and the shell scripts, still run as subprocesses)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _run_forked(context: Any, script: str, argv: list[str], folder: Path) -> tuple[int, str, str]:
    stdout, stderr = folder / "stdout.txt", folder / "stderr.txt"
    process = context.Process(target=_run_script, args=(script, argv, str(stdout), str(stderr)))
    process.start()
    process.join(timeout=900)
    if process.is_alive():
        process.kill()
        process.join()
    return int(process.exitcode if process.exitcode is not None else -9), stdout.read_text(), stderr.read_text()


def _forked(script: str) -> bool:
    return script.endswith(".py") and script not in STARTS_RAY


@pytest.fixture(scope="module")
def background(forkserver: Any, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """The forked quick runs of this session, started at once, two at a time, on threads of their own: they run while
    the quick runs that start a Ray of their own (mostly waiting on Ray's processes) run in the foreground, so the
    module takes about the longer of the two sequences instead of their sum (203 s on this 2-core AMD EPYC; 246 s with
    one forked run at a time). ``script -> (future, folder, out)``; only the runs the session selected are started.
    Under pytest-xdist none (``make test`` runs this module in its one-process part): each worker would collect and
    start every line; each runs the lines it is given instead, in turn."""
    from concurrent.futures import ThreadPoolExecutor

    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects every line: started here, each would run twice
        yield {}
        return
    selected = {
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_quick_mode_runs_and_writes_finite_results" and hasattr(item, "callspec")
    }
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="quick-forked")
    started: dict[str, tuple[Any, Path, Path]] = {}
    for script, args in quick_lines():
        if script in RUN_ELSEWHERE or not _forked(script) or script not in selected:
            continue
        folder = tmp_path_factory.mktemp("quick-" + Path(script).stem)
        out = folder / "out"
        out.mkdir()
        argv = [a.replace("{out}", str(out)) for a in args]
        started[script] = (pool.submit(_run_forked, forkserver, script, argv, folder), folder, out)
    yield started
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize(("script", "args"), _params())
def test_quick_mode_runs_and_writes_finite_results(script: str, args: list[str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    started = request.getfixturevalue("background")  # whichever test comes first starts the forked runs
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.replace("{out}", str(out)) for a in args]
    if _forked(script) and script in started:
        future, _, out = started[script]  # run in the background, into a folder of its own
        command = [sys.executable, script, *[a.replace("{out}", str(out)) for a in args]]
        code, stdout, stderr = future.result()
    elif _forked(script):
        command = [sys.executable, script, *argv]
        code, stdout, stderr = _run_forked(request.getfixturevalue("forkserver"), script, argv, tmp_path)
    else:
        command = [*(["bash"] if script.endswith(".sh") else [sys.executable]), script, *argv]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        env.setdefault("MPLBACKEND", "Agg")
        env["PYTHON"] = sys.executable  # the interpreter a .sh script runs its Python with (benchmarks/gpu/check.sh reads it)
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    output = stdout + stderr
    assert code == 0, f"{' '.join(command)} exited with {code}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    assert stdout.strip(), "a quick run prints its result"
    if script in EXPECTED:
        name, keys = EXPECTED[script]
        path = out / name
        assert path.is_file(), f"{script} wrote {sorted(p.name for p in out.iterdir())}, not {name}"
        payload = json.loads(path.read_text())
        assert keys <= set(payload), f"{name} lacks {sorted(keys - set(payload))}"
        assert finite_numbers(payload, name) > 0, f"{name} holds no numbers"
        for other in out.glob("*.json"):  # whatever else it wrote as JSON: finite too
            finite_numbers(json.loads(other.read_text()), other.name)


def test_the_quick_modes_run_elsewhere_are_listed_and_their_tests_exist() -> None:
    listed = {script for script, _ in quick_lines()}
    for script, test in RUN_ELSEWHERE.items():
        file, name = test.split("::")
        assert script in listed and f"def {name}(" in (ROOT / file).read_text(), (script, test)
