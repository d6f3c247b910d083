"""Helpers shared by the benchmark scripts: interleaved timing, plain-text tables, result files, machine facts.

The scripts run as ``python benchmarks/<script>.py``, so this module is imported from the script's own folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "RESULTS_DIR",
    "add_quick_arguments",
    "check_finite",
    "interleaved_times",
    "machine_info",
    "median",
    "memory_bytes",
    "out_dir",
    "print_table",
    "quick_run",
    "wait_for_quiet",
    "write_results",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def interleaved_times(fns: Mapping[str, Callable[[], Any]], repeats: int, *, warmup: int = 1) -> dict[str, list[float]]:
    """Wall times of each function, measured in interleaved passes.

    Every pass runs every function once, so slow drifts of the machine (other processes, thermal state) affect all
    of them alike and ratios taken within one pass stay fair.

    Parameters
    ----------
    fns : mapping of name to zero-argument callable
    repeats : int
        Timed passes.
    warmup : int
        Untimed passes first (page faults, caches, lazy imports).

    Returns
    -------
    dict of name to list of seconds, one per timed pass
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """Wait (at most ``timeout_s``) until the 1-minute load average is below ``max_load``; return the load then.

    Other work on a small machine distorts timings; results record the load each measurement started at.
    """
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5.0)
    return os.getloadavg()[0]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bytes() -> tuple[int, int]:
    """``(total, available)`` bytes of RAM, from ``/proc/meminfo``."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"], fields["MemAvailable"]


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPUs, memory, library versions and the date."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(memory_bytes()[0] / 2**30, 1),
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine makes timings noisy
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]], title: str | None = None) -> None:
    """Print ``rows`` as an aligned plain-text table; ``columns`` is ``[(key, header), ...]``."""
    header = [h for _, h in columns]
    body = [[_cell(row.get(key, "")) for key, _ in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in body:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def write_results(name: str, payload: Mapping[str, Any], folder: Path | None = None) -> Path:
    """Write ``payload`` to ``<folder>/<name>.json`` (default ``benchmarks/results/``) and return the path."""
    folder = RESULTS_DIR if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


def add_quick_arguments(parser: argparse.ArgumentParser, cell: str, *, quick: bool = True, out: bool = True) -> None:
    """The options every benchmark shares for its smoke run: ``--quick`` (one small cell, ``cell``, in seconds, through
    the same code as the full run) and ``--out`` (where the results go; see ``out_dir``).

    ``quick=False`` / ``out=False`` leave out an option the script already defines.
    """
    if quick:
        parser.add_argument("--quick", action="store_true", help=f"one small cell ({cell}), in seconds; results go to --out")
    if out:
        parser.add_argument(
            "--out",
            type=Path,
            default=None,
            help="folder for the results (default: the full run's place; with --quick a new temporary folder)",
        )


def out_dir(out: Path | None, quick: bool, default: Path | None = None) -> Path:
    """The folder a run writes to: ``out`` if given; for a quick run without it a new temporary folder, so a smoke run
    never writes over the results of a full run (or the committed tables under ``docs/results/``); else ``default``
    (``RESULTS_DIR`` when not given, read at the call)."""
    if out is not None:
        out = Path(out)
    elif quick:
        out = Path(tempfile.mkdtemp(prefix="rayfuse-bench-quick-"))
    else:
        out = RESULTS_DIR if default is None else default
    out.mkdir(parents=True, exist_ok=True)
    return out


def check_finite(payload: Any, where: str = "results") -> int:
    """Raise ``ValueError`` if any number in ``payload`` (nested dicts, lists, numpy scalars) is NaN or infinite; return
    how many numbers were checked. Booleans and ``None`` are not numbers here."""
    if isinstance(payload, Mapping):
        return sum(check_finite(v, f"{where}.{k}") for k, v in payload.items())
    if isinstance(payload, (list, tuple)):
        return sum(check_finite(v, f"{where}[{i}]") for i, v in enumerate(payload))
    if isinstance(payload, np.ndarray):
        return sum(check_finite(v, f"{where}[{i}]") for i, v in enumerate(payload.tolist()))
    if isinstance(payload, (bool, np.bool_)) or payload is None:
        return 0
    if isinstance(payload, (int, float, np.integer, np.floating)):
        if not math.isfinite(float(payload)):
            raise ValueError(f"{where}: {payload} is not a finite number")
        return 1
    return 0


def quick_run(job: str | Path, methods: Mapping[str, Mapping[str, Any]], out: Path, updates: Mapping[str, Any] | None = None) -> Path:
    """Run a small version of a shipped job in this process (``backend: local``) and return its finished run folder.

    For the ``--quick`` mode of the scripts that report on a finished run: ``job`` is the YAML file, ``methods`` the
    entries kept (label to the job's entry's keys to override, e.g. ``{"fedavg": {"rounds": 2}}``), ``updates`` more
    dotted keys (``{"partition.num_clients": 3}``). The run folder is ``<out>/run-<job name>``.
    """
    import yaml

    import rayfuse

    config = yaml.safe_load(Path(job).read_text())
    missing = [label for label in methods if label not in config.get("methods", {})]
    if missing:
        raise KeyError(f"{job}: no methods {missing} (has {sorted(config.get('methods', {}))})")
    config["methods"] = {label: {**(config["methods"][label] or {}), **changes} for label, changes in methods.items()}
    for dotted, value in (updates or {}).items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    run_dir = Path(out) / f"run-{Path(job).stem}"
    rayfuse.run(config, backend="local", run_dir=run_dir, quiet=True)
    return run_dir
