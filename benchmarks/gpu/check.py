"""The GPU path, measured: one table of four checks, each run in a process of its own (its peak memory is its own).

1. **quickstart**: ``jobs/quickstart.yaml`` on a local Ray with GPU clients, ``federation.clients.num_gpus: 0.25``
   (4 clients: four quarters fill one GPU; the coordinator stays on the CPU). ``result``: the methods' accuracies
   and the device the clients report (``cuda:0`` when Ray gave them the GPU and torch sees it).
2. **aligned**: N-way weight matching (git re-basin's MergeMany, ``rayfuse.alignment.weight_matching``) of 8 permuted,
   noisy copies of one resnet18 and the merge, cost matrices on the device against the CPU path (the same call with
   ``device=None``) side by side. ``result``: whether both found the same permutations, and the largest difference
   between the two merged models.
3. **distill**: one-shot distillation (``distill_public``) of 8 teachers into a student on the device, against the
   same run on the CPU. ``result``: the student's agreement with the teachers' ensemble on each.
4. **fedavg round**: two rounds of FedAvg on a model of about 1 GB (an MLP with two 16384-wide hidden layers) with 2
   in-process clients on the device (``fedavg.fit``: the clients keep the model and their data on the device between
   rounds) and the sample-weighted average; ``time``: round 1 (the clients build their model) and round 2 (they reuse
   it), peak GPU memory (``torch.cuda.max_memory_allocated``) and the process's peak RSS.

``--cpu``: the same checks and the same table on the CPU, with small sizes (resnet18 becomes the quickstart MLP, the
1 GB model a 4.5 MB one), in one to two minutes on 2 cores: what CI runs so that the script keeps working where no GPU is.

Usage (repository root)::

    benchmarks/gpu/check.sh            # a machine with a CUDA GPU: under 8 minutes
    benchmarks/gpu/check.sh --cpu      # anywhere

Writes ``benchmarks/results/gpu_check.json`` (or ``gpu_check_cpu.json``; ``--out``: another file).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from _common import machine_info, print_table, write_results  # noqa: E402

PARTS = ("quickstart", "aligned", "distill", "fedavg")
COLUMNS = [
    ("check", "check"),
    ("device", "device"),
    ("size", "size"),
    ("seconds", "time (s)"),
    ("cpu_seconds", "CPU path (s)"),
    ("speedup", "CPU/device"),
    ("result", "result"),
    ("gpu_mib", "peak GPU MiB"),
    ("rss_mib", "peak RSS MiB"),
]


def _device(cpu: bool) -> str:
    return "cpu" if cpu else "cuda:0"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _gpu_peak_mib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    _sync(device)
    started = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - started, out


def _finite(params: dict[str, Any]) -> bool:
    import numpy as np

    return all(np.isfinite(v).all() for v in params.values() if v.dtype.kind == "f")


# -- 1. the quickstart with GPU clients --------------------------------------------------------------------------------


def _find(tree: Any, key: str) -> Any:
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def part_quickstart(cpu: bool) -> dict[str, Any]:
    import yaml

    import rayfuse

    cfg = yaml.safe_load((ROOT / "jobs" / "quickstart.yaml").read_text())
    cfg["partition"]["num_clients"] = 4  # 4 x 0.25: one GPU
    cfg["federation"]["clients"] = {"num_gpus": 0.0 if cpu else 0.25}
    if cpu:  # small: one epoch and three methods (the clients' steps, the coordinator's alignment; distill has its row)
        cfg["train"]["epochs"] = 1
        cfg["methods"] = {"local": {}, "aligned": {}, "fedavg": {"rounds": 2, "local_epochs": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        cfg["run"]["storage"] = str(Path(tmp) / "runs")
        started = time.perf_counter()
        result = rayfuse.run(cfg, backend="ray", quiet=True)
        seconds = time.perf_counter() - started
        devices = _find(result.results, "client_devices") or []
        acc = result.metrics["accuracy"]
    for label, value in acc.items():
        if not 0.0 <= float(value) <= 1.0:
            raise RuntimeError(f"quickstart: {label} accuracy {value} out of [0, 1]")
    shown = "accuracy " + ", ".join(f"{label} {float(acc[label]):.3f}" for label in ("aligned", "distill", "fedavg") if label in acc)
    return {
        "check": "quickstart, GPU clients",
        "device": "clients " + ("/".join(devices) or "?"),
        "size": f"4 clients, num_gpus {cfg['federation']['clients']['num_gpus']:g}",
        "seconds": seconds,
        "result": shown,
        "rss_mib": None,  # the clients and the coordinator are Ray actors: other processes
    }


# -- 2. aligned fusion: cost matrices on the device against the CPU path ---------------------------------------------


def _copies(cpu: bool, n: int) -> tuple[list[dict[str, Any]], Any, str]:
    import numpy as np
    import torch

    from rayfuse.config.model import ModelConfig
    from rayfuse.models import build_model, get_params
    from rayfuse.symmetry import derive_spec

    if cpu:
        cfg, shape, what = ModelConfig(name="mlp", hidden=[64, 64]), (64,), "mlp 64-64"
    else:
        cfg, shape, what = ModelConfig(name="torchvision:resnet18"), (3, 32, 32), "resnet18"
    model = build_model(cfg, shape, 10, seed=0)
    base = get_params(model)
    spec = derive_spec(model, torch.zeros((2, *shape)))
    rng = np.random.default_rng(0)
    models = []
    for i in range(n):
        permuted = base if i == 0 else spec.apply(base, spec.random(rng))
        noisy = {
            k: (v + 0.01 * float(v.std()) * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" and v.size > 1 else v
            for k, v in permuted.items()
        }
        models.append(noisy)
    return models, spec, what


def part_aligned(cpu: bool) -> dict[str, Any]:
    import numpy as np
    import torch

    from rayfuse.alignment import apply_alignment, merge_average, weight_matching
    from rayfuse.matching import thread_map

    device = _device(cpu)
    models, spec, what = _copies(cpu, 8)

    def fuse(on: str | None) -> tuple[Any, dict[str, Any]]:
        alignment = weight_matching(models, spec, seed=0, executor=thread_map, device=on)
        return alignment, merge_average(apply_alignment(models, spec, alignment))

    warm = models
    models = models[:2]  # warm-up on two models, both paths (CUDA's context and kernels, torch's threads, lazy imports)
    fuse(None)
    fuse(device)
    models = warm
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    cpu_seconds, (cpu_alignment, cpu_merged) = _timed(lambda: fuse(None), "cpu")
    seconds, (alignment, merged) = _timed(lambda: fuse(device), device)
    same = all(np.array_equal(a[g], b[g]) for a, b in zip(alignment.perms, cpu_alignment.perms) for g in spec.names)
    diff = max(float(np.max(np.abs(merged[k].astype(np.float64) - cpu_merged[k]))) for k in merged if merged[k].dtype.kind == "f")
    if not (_finite(merged) and _finite(cpu_merged)):
        raise RuntimeError("aligned: non-finite merged parameters")
    return {
        "check": "aligned, weight matching + merge",
        "device": device,
        "size": f"8 x {what}",
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "result": f"{'same' if same else 'DIFFERENT'} permutations, max |diff| {diff:.1e}, {alignment.sweeps} sweeps",
        "gpu_mib": _gpu_peak_mib(device),
        "rss_mib": _peak_rss_mib(),
    }


# -- 3. distillation ---------------------------------------------------------------------------------------------------


def part_distill(cpu: bool) -> dict[str, Any]:
    import numpy as np
    import torch

    from rayfuse.config.model import ModelConfig
    from rayfuse.data import load_dataset
    from rayfuse.devices import is_cuda
    from rayfuse.fusion.distill.algorithm import DistillParams
    from rayfuse.fusion.distill.student import distill_public
    from rayfuse.fusion.distill.teachers import Teachers
    from rayfuse.models import build_model

    device = _device(cpu)
    k, steps = (3, 30) if cpu else (8, 2000)  # 2000: distill's default steps
    cfg = ModelConfig(name="mlp", hidden=[64, 64]) if cpu else ModelConfig(name="cnn")
    digits = load_dataset("digits")
    X = digits.X[:300].astype(np.float32)
    shape = tuple(X.shape[1:])
    weights = np.full((k, digits.num_classes), 1.0 / k, np.float32)
    settings = DistillParams(steps=steps, epochs=2).settings(0)

    def run(on: str, settings: Any = settings) -> float:
        teachers = Teachers([build_model(cfg, shape, digits.num_classes, seed=i).to(on) for i in range(k)], batched=is_cuda(on), device=on)
        student = build_model(cfg, shape, digits.num_classes, seed=99)
        history = distill_public(student, teachers, X, weights, settings, device=on)
        if not history or not all(np.isfinite(v) for v in history[-1].values()):
            raise RuntimeError(f"distill on {on}: no finite history")
        return float(history[-1]["agreement"])

    for on in {device, "cpu"}:  # warm-up, a few steps on each (CUDA's context and kernels, lazy imports)
        run(on, DistillParams(steps=4, epochs=1).settings(0))
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    seconds, agreement = _timed(lambda: run(device), device)
    cpu_seconds, cpu_agreement = _timed(lambda: run("cpu"), "cpu")
    return {
        "check": "distill, public transfer",
        "device": device,
        "size": f"{k} teachers ({cfg.name}), {steps} steps",
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "result": f"agreement {agreement:.3f} (CPU {cpu_agreement:.3f})",
        "gpu_mib": _gpu_peak_mib(device),
        "rss_mib": _peak_rss_mib(),
    }


# -- 4. a FedAvg round of a 1 GB model ----------------------------------------------------------------------------------


def part_fedavg(cpu: bool) -> dict[str, Any]:
    import numpy as np
    import torch

    from rayfuse.client import Client
    from rayfuse.config import validate_config
    from rayfuse.fusion.fedavg.algorithm import fit
    from rayfuse.models import build_model, get_params
    from rayfuse.runner import prepare_run
    from rayfuse.updates.aggregate import weighted_average

    device = _device(cpu)
    hidden = [1024, 1024] if cpu else [16384, 16384]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate_config(
            {
                "run": {"name": "gpu-check", "seed": 0, "storage": str(Path(tmp) / "runs")},
                "data": {"dataset": "digits"},
                "partition": {"method": "iid", "num_clients": 2},
                "model": {"name": "mlp", "hidden": hidden},
                "federation": {"backend": "local"},
                "methods": {"fedavg": {"rounds": 2, "local_epochs": 1}},
            }
        )
        plan = prepare_run(cfg).plan
    clients = [
        Client(i, plan.for_client(i), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=0, device=device) for i in range(2)
    ]
    ctx = clients[0].ctx
    params = get_params(build_model(cfg.model, ctx.input_shape, ctx.num_classes, seed=0))
    keys = set(params)
    size_gb = sum(v.nbytes for v in params.values()) / 1e9
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for round in (1, 2):
        started = time.perf_counter()
        updates = [
            c.run(
                fit, params, label="fedavg", round=round, epochs=1, lr=1e-3, batch_size=256, optimizer="sgd", momentum=0.0, weight_decay=0.0
            )
            for c in clients
        ]
        params = weighted_average([u.params for u in updates], [float(u.num_examples) for u in updates])
        times.append(time.perf_counter() - started)
        del updates
    if not _finite(params) or set(params) != keys:
        raise RuntimeError("fedavg: the averaged model is not finite or lost keys")
    assert all(isinstance(v, np.ndarray) for v in params.values())
    return {
        "check": "fedavg, 2 rounds, 2 clients",
        "device": device,
        "size": f"mlp {hidden[0]}x2, {size_gb:.3f} GB",
        "seconds": times[1],
        "result": f"round 1 {times[0]:.2f} s (builds), round 2 {times[1]:.2f} s (kept on device)",
        "gpu_mib": _gpu_peak_mib(device),
        "rss_mib": _peak_rss_mib(),
    }


# -- the driver ----------------------------------------------------------------------------------------------------------


def run_part(name: str, cpu: bool, timeout: float) -> dict[str, Any]:
    """Run one check in a fresh process (``--part``), its row read from the last line of its output."""
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, *(["--cpu"] if cpu else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"check": name, "result": f"FAILED: over {timeout:g} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"check": name, "result": f"FAILED: {tail[:160]}"}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the same checks on the CPU, small sizes (one to two minutes on 2 cores)")
    parser.add_argument("--part", choices=PARTS, help="run one check and print its row as JSON (the driver's own call)")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="the checks to run (default: all four)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each check may take")
    parser.add_argument("--out", type=Path, help="where to write the JSON (default: benchmarks/results/gpu_check[_cpu].json)")
    args = parser.parse_args()
    if args.part:
        row = {"quickstart": part_quickstart, "aligned": part_aligned, "distill": part_distill, "fedavg": part_fedavg}[args.part](args.cpu)
        print(json.dumps(row, default=float))
        return 0
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks/gpu/check.py: no CUDA GPU visible to torch here; run with --cpu for the CPU check", file=sys.stderr)
            return 2
    started = time.perf_counter()
    info = machine_info()
    rows = []
    for name in args.only:
        row = run_part(name, args.cpu, args.timeout)
        if row.get("cpu_seconds") and row.get("seconds"):
            row["speedup"] = float(row["cpu_seconds"]) / float(row["seconds"])
        rows.append(row)
        print(f"  {name}: done at {time.perf_counter() - started:.0f} s", flush=True)
    mode = "CPU (--cpu, small sizes)" if args.cpu else "GPU"
    shown = [{key: "-" if row.get(key) is None else row[key] for key, _ in COLUMNS} for row in rows]
    print_table(shown, COLUMNS, f"GPU path check, {mode}; {info.get('cpus')} CPUs, load {info.get('load_avg_1m'):.2f} at start")
    total = time.perf_counter() - started
    print(f"total {total:.0f} s")
    payload = {"machine": info, "mode": mode, "rows": rows, "seconds": total}
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=2, default=float) + "\n")
        path = args.out
    else:
        path = write_results("gpu_check_cpu" if args.cpu else "gpu_check", payload)
    print(f"wrote {path}")
    return 0 if all(not str(r.get("result", "")).startswith("FAILED") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
