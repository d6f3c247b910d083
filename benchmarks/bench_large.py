"""A round of a model of several GB on this machine's local Ray, and the peak memory of every process it uses.

One run of ``rayfuse.run`` on Ray: an MLP on digits of ``--layers`` hidden layers ``h`` wide (so ``--params`` sets
the model's size from its config: 625 M float32 parameters = 2.5 GB), ``--clients`` clients through ``average`` (local
models trained once, kept on the clients' own storage with ``run.model_cache``, averaged) and ``fedavg`` (``--rounds``
rounds), with round checkpoints, then a resume from the fedavg checkpoint (its finished state removed, so the method
reloads its last round checkpoint and writes its model again), then ``rayfuse fuse`` (``average``) of the clients'
local models the run checkpointed. Model files above ``--shard-size`` are written as shards (``run.max_shard_size``).

Local training is capped by the config: one epoch of SGD (no momentum: no optimizer state) with batches of
``--batch-size`` (on digits' ~360 samples per client of 4, one step per round at the default 512).

Peak memory: a sampler thread in the driver reads ``/proc/<pid>/status`` of the driver and of every process the
driver's Ray started (its descendants: the raylet, which holds the object store, the GCS, the coordinator actor, the
client actors) every 50 ms: ``VmHWM`` (the kernel's peak resident set, whatever it was resident as) and the peaks of
its parts seen by sampling: ``RssAnon`` (the process's own memory), ``RssShmem`` (shared memory: Ray's object store
pages mapped into the process) and ``RssFile`` (file pages: memory-mapped model files, dropped by the kernel under
pressure). The fuse runs as a subprocess (``python -m rayfuse fuse``), sampled the same way.

    python benchmarks/bench_large.py                       # 4 clients x 2.5 GB (needs ~16 GiB free memory)
    python benchmarks/bench_large.py --quick               # 4 clients x ~25 MB, seconds
    python benchmarks/bench_large.py --params 250e6 --clients 4 --clients-per-actor 2

Results: ``benchmarks/results/large_<clients>x<GB>gb_<methods>.json`` (``--quick``: ``large_quick.json`` under ``--out``, a temporary folder by default).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _common import add_quick_arguments, machine_info, out_dir, print_table, write_results  # noqa: E402

GiB = 2**30
DIGITS = (64, 10)  # digits: 64 inputs, 10 classes


def width_for(params: float, layers: int = 2) -> int:
    """The hidden width ``h`` of an MLP 64 -> h (x ``layers``) -> 10 with about ``params`` parameters."""
    inputs, classes = DIGITS
    a, b, c = float(layers - 1), float(inputs + layers + classes + (layers - 1)), float(classes) - params
    if a == 0:
        return max(1, int(-c / b))
    return max(1, int((-b + math.sqrt(b * b - 4 * a * min(c, -1.0))) / (2 * a)))


def mlp_shapes(h: int, layers: int = 2) -> dict[str, tuple[int, ...]]:
    """The ``state_dict`` shapes of the registry's ``mlp`` with ``layers`` hidden layers ``h`` wide, on digits."""
    inputs, classes = DIGITS
    widths = [inputs] + [h] * layers + [classes]
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        shapes[f"layers.{i}.weight"], shapes[f"layers.{i}.bias"] = (n_out, n_in), (n_out,)
    return shapes


def mlp_params(h: int, layers: int = 2) -> int:
    return sum(math.prod(shape) for shape in mlp_shapes(h, layers).values())


def model_fields(h: int, layers: int) -> dict[str, int]:
    """The model's size as the results report it: parameters, bytes (float32), width, depth, largest tensor."""
    count = mlp_params(h, layers)
    largest = 4 * max(math.prod(shape) for shape in mlp_shapes(h, layers).values())
    return {"params": count, "model_bytes": 4 * count, "hidden": h, "layers": layers, "largest_tensor_bytes": largest}


# ---------------------------------------------------------------------------------------------------------------
# Per-process peak memory


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _label(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    first = raw[0].decode(errors="replace")
    if first.startswith("ray::"):
        return first[len("ray::") :].split(".")[0].split(" ")[0] or "ray-worker"
    joined = " ".join(part.decode(errors="replace") for part in raw if part)
    for name in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if name in joined:
            return name
    if "rayfuse" in joined and " fuse " in f" {joined} ":
        return "fuse"
    return Path(first).name or str(pid)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


@dataclass
class Peak:
    pid: int
    label: str
    hwm: int = 0
    anon: int = 0
    shmem: int = 0
    file: int = 0
    labels: set[str] = field(default_factory=set)

    def row(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "process": self.label,
            "vmhwm_bytes": self.hwm,
            "peak_anon_bytes": self.anon,
            "peak_shmem_bytes": self.shmem,
            "peak_file_bytes": self.file,
        }


def available_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak(pid: int | None = None) -> None:
    """Reset a process's ``VmHWM`` to its current resident set (``/proc/<pid>/clear_refs``), for a per-phase peak."""
    try:
        Path(f"/proc/{os.getpid() if pid is None else pid}/clear_refs").write_text("5")
    except OSError:
        pass  # not allowed here (another user's process, no procfs): the peak is then the process's lifetime peak


class MemorySampler:
    """Samples ``/proc/<pid>/status`` of ``root`` and all its descendants every ``interval`` seconds (a thread).

    With ``floor``: when the machine's available memory falls below ``floor`` bytes, the descendants that are Ray
    actors (this run's own, by pid) are killed, so the run fails instead of the machine swapping or the kernel's OOM
    killer choosing a process of someone else; :attr:`aborted` then says so.
    """

    def __init__(self, root: int | None = None, interval: float = 0.05, floor: int = 0) -> None:
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.floor = floor
        self.aborted = ""
        self.lowest_available = available_bytes()
        self.peaks: dict[int, Peak] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        tree = _children()
        todo, pids = [self.root], []
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo.extend(tree.get(pid, []))
        for pid in pids:
            status = _status(pid)
            if not status:
                continue
            label = "driver" if pid == self.root else _label(pid)
            peak = self.peaks.setdefault(pid, Peak(pid, label))
            if "Actor" in label or (label and label != "IDLE" and "Actor" not in peak.label):
                peak.label = label  # a worker becomes an actor once it is given one (its title says which)
            peak.labels.add(label)
            peak.hwm = max(peak.hwm, status.get("VmHWM", 0))
            peak.anon = max(peak.anon, status.get("RssAnon", 0))
            peak.shmem = max(peak.shmem, status.get("RssShmem", 0))
            peak.file = max(peak.file, status.get("RssFile", 0))
        available = available_bytes()
        self.lowest_available = min(self.lowest_available, available)
        if self.floor and available < self.floor and not self.aborted:
            self.aborted = f"available memory {available / GiB:.1f} GiB < {self.floor / GiB:.1f} GiB: the run's actors were stopped"
            import signal

            for pid, peak in self.peaks.items():
                if pid != self.root and "Actor" in peak.label:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass

    def rows(self, min_bytes: int = 50 * 2**20) -> list[dict[str, Any]]:
        """The processes that peaked above ``min_bytes`` (Ray's many small helpers left out), largest first."""
        rows = [p.row() for p in self.peaks.values() if p.hwm >= min_bytes]
        return sorted(rows, key=lambda r: -r["vmhwm_bytes"])


# ---------------------------------------------------------------------------------------------------------------
# The run


def large_config(
    *,
    params: float,
    clients: int,
    rounds: int,
    per_actor: int,
    store_bytes: int,
    shard_size: int,
    batch_size: int,
    storage: Path,
    cpus: int,
    methods: tuple[str, ...] = ("average", "fedavg"),
    layers: int = 2,
) -> dict[str, Any]:
    h = width_for(params, layers)
    return {
        # run.model_cache: each client keeps its trained local model on its own storage, and one of at least 256 MiB
        # only there (read back memory-mapped when a method asks), not in its actor's memory between methods
        "run": {
            "name": "large",
            "seed": 0,
            "storage": str(storage),
            "max_shard_size": int(shard_size),
            "model_cache": str(storage / "cache"),
        },
        "data": {"dataset": "digits"},
        "partition": {"num_clients": clients, "method": "iid"},
        "model": {"name": "mlp", "hidden": [h] * layers},
        # one epoch of plain SGD: params + grads while training, no optimizer state; batch_size caps the steps
        "train": {"epochs": 1, "batch_size": batch_size, "optimizer": "sgd", "lr": 1e-3},
        "federation": {
            "backend": "ray",
            "clients_per_actor": per_actor,
            "ray_init": {"num_cpus": cpus, "object_store_memory": int(store_bytes), "include_dashboard": False},
        },
        "methods": {
            name: spec
            for name, spec in {"average": {}, "fedavg": {"rounds": rounds, "local_epochs": 1, "evaluate_every": rounds}}.items()
            if name in methods
        },
    }


def _fuse(files: list[Path], out: Path, shard_size: int, folder: Path) -> dict[str, Any]:
    """``rayfuse fuse`` (average) of ``files`` in a subprocess; its wall time and sampled peak memory."""
    import yaml

    config = folder / "fuse.yaml"
    config.write_text(yaml.safe_dump({"merge_method": "average", "models": [{"model": str(f)} for f in files], "output": str(out)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "rayfuse", "fuse", str(config), "--max-shard-size", str(shard_size)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sampler = MemorySampler(process.pid)
    with sampler:
        output, _ = process.communicate()
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"rayfuse fuse failed ({process.returncode}): {output.strip()[-500:]}")
    peak = sampler.peaks.get(process.pid)
    return {"seconds": round(seconds, 2), "process": (peak.row() if peak else {}) | {"process": "fuse"}, "output": output.strip()}


def _sharded(path: Path) -> int:
    """Shards of a model file (1: a single file)."""
    return len(list(path.glob("model-*-of-*.safetensors"))) if path.is_dir() else 1


def run_large(
    *,
    params: float,
    clients: int = 4,
    rounds: int = 1,
    per_actor: int = 4,
    store_bytes: int = 4 * GiB,
    shard_size: int = 2 * GiB,
    batch_size: int = 512,
    cpus: int = 2,
    storage: Path | None = None,
    keep: bool = False,
    methods: tuple[str, ...] = ("average", "fedavg"),
    floor: int = 0,
    layers: int = 2,
) -> dict[str, Any]:
    """Run, resume and fuse at one size; return the timings, the files' layout, the checks and each process's peaks.

    On a Ray this process already started (a test's session Ray) ``ray_init`` is not applied: the run attaches to it.
    """
    import numpy as np

    import rayfuse
    from rayfuse.io import load_params, params_sha256, params_size
    from rayfuse.store import RunStore

    own = storage is None
    storage = Path(tempfile.mkdtemp(prefix="rayfuse-large-")) if storage is None else Path(storage)
    config = large_config(
        params=params,
        clients=clients,
        rounds=rounds,
        per_actor=per_actor,
        store_bytes=store_bytes,
        shard_size=shard_size,
        batch_size=batch_size,
        storage=storage,
        cpus=cpus,
        methods=methods,
        layers=layers,
    )
    h = int(config["model"]["hidden"][0])
    out: dict[str, Any] = {
        **model_fields(h, layers),
        "clients": clients,
        "clients_per_actor": per_actor,
        "rounds": rounds,
        "object_store_bytes": store_bytes,
        "max_shard_size": shard_size,
        "methods": list(methods),
        "available_before": available_bytes(),
    }
    try:
        run_dir = storage / "run"
        reset_peak()
        with MemorySampler(floor=floor) as sampler:
            started = time.perf_counter()
            try:
                result = rayfuse.run(config, run_dir=run_dir, quiet=True)
            except Exception:
                if sampler.aborted:
                    raise RuntimeError(sampler.aborted) from None
                raise
            out["run_seconds"] = round(time.perf_counter() - started, 2)
        out["run_processes"] = sampler.rows()
        out["run_lowest_available"] = sampler.lowest_available
        store = RunStore(run_dir)
        files = {
            **{label: store.model_file(label) for label in methods},
            **{f"local-{c}": store.local_model_file(c) for c in range(clients) if "average" in methods},
        }
        checkpoint = run_dir / "checkpoints" / "fedavg" / f"round-{rounds:05d}.safetensors"
        out["files"] = {
            name: {"bytes": params_size(path), "shards": _sharded(path)} for name, path in {**files, "checkpoint": checkpoint}.items()
        }
        out["metrics"] = {label: {k: float(v) for k, v in row.items()} for label, row in result.metrics.to_dict(orient="index").items()}
        fedavg = load_params(files["fedavg"])
        out["fedavg_finite"] = bool(all(np.isfinite(v).all() for v in fedavg.values()))
        out["fedavg_shapes_ok"] = {k: v.shape for k, v in fedavg.items()} == mlp_shapes(h, layers)
        del fedavg, result

        if "fedavg" in methods:
            # resume from the round checkpoint: the finished method's record goes, its model is written again from it
            (run_dir / "state" / "fedavg.json").unlink()
            before = params_sha256(files["fedavg"])
            store.model_file("fedavg").rename(storage / "fedavg-before.safetensors")
            reset_peak()
            with MemorySampler(floor=floor) as sampler:
                started = time.perf_counter()
                rayfuse.resume(run_dir, quiet=True)
                out["resume_seconds"] = round(time.perf_counter() - started, 2)
            out["resume_processes"] = sampler.rows()
            out["resume_same_model"] = params_sha256(files["fedavg"]) == before  # the same bytes: the same model

        # the fuse's inputs: the clients' local models the run checkpointed (average), else copies of the fedavg model
        locals_ = [files[f"local-{c}"] for c in range(clients)] if "average" in methods else []
        if not locals_:
            for c in range(clients):
                locals_.append(storage / f"copy-{c}.safetensors")
                shutil.copytree(files["fedavg"], locals_[-1]) if files["fedavg"].is_dir() else shutil.copy(files["fedavg"], locals_[-1])
        out["fuse"] = _fuse(locals_, storage / "fused.safetensors", shard_size, storage)
        fused = load_params(storage / "fused.safetensors")
        first = load_params(locals_[0])
        out["fuse_finite"] = bool(all(np.isfinite(v).all() for v in fused.values()))
        out["fuse_shapes_ok"] = bool({k: v.shape for k, v in fused.items()} == {k: v.shape for k, v in first.items()})
        out["fused_bytes"] = params_size(storage / "fused.safetensors")
        out["fused_shards"] = _sharded(storage / "fused.safetensors")
        del fused, first
    finally:
        if own and not keep:
            shutil.rmtree(storage, ignore_errors=True)
    return out


def files_only(
    *, params: float, clients: int = 4, shard_size: int = 2 * GiB, storage: Path | None = None, layers: int = 2
) -> dict[str, Any]:
    """The file side alone, at a size whose Ray round this machine cannot hold: ``clients`` models of the MLP's shapes
    (seeded normal values) written with ``save_params``, a round checkpoint written and read back
    (``Checkpointer``, what a resume reads), then ``rayfuse fuse`` (average) of the models. Peaks of this process per
    phase (``VmHWM`` reset between phases) and of the fuse subprocess."""
    import numpy as np

    from rayfuse.io import load_params, params_size, save_params
    from rayfuse.store import Checkpointer

    own = storage is None
    storage = Path(tempfile.mkdtemp(prefix="rayfuse-large-files-")) if storage is None else Path(storage)
    h = width_for(params, layers)
    shapes = mlp_shapes(h, layers)
    out: dict[str, Any] = {**model_fields(h, layers), "clients": clients, "max_shard_size": shard_size}
    phases: dict[str, dict[str, Any]] = {}

    def phase(name: str, started: float, sampler: MemorySampler) -> None:
        peak = sampler.peaks[os.getpid()].row()
        phases[name] = {"seconds": round(time.perf_counter() - started, 2), **{k: v for k, v in peak.items() if k != "pid"}}

    try:
        files = [storage / f"model-{c}.safetensors" for c in range(clients)]
        reset_peak()
        with MemorySampler(interval=0.02) as sampler:
            started = time.perf_counter()
            for c, file in enumerate(files):
                rng = np.random.default_rng(c)
                model = {k: rng.standard_normal(shape, dtype=np.float32) * 0.01 for k, shape in shapes.items()}
                save_params(file, model, {"client": str(c)}, max_shard_size=shard_size)
                del model
        phase("write models", started, sampler)
        out["model_files"] = {"bytes": params_size(files[0]), "shards": _sharded(files[0])}
        model = load_params(files[0])
        checkpoints = Checkpointer(storage / "checkpoints", max_shard_size=shard_size)
        reset_peak()
        with MemorySampler(interval=0.02) as sampler:
            started = time.perf_counter()
            checkpoints.save(1, model, {"round_count": np.array(1.0)}, {"note": "bench"})
        phase("write checkpoint (model in memory)", started, sampler)
        del model
        reset_peak()
        with MemorySampler(interval=0.02) as sampler:
            started = time.perf_counter()
            loaded = checkpoints.load()
        phase("read checkpoint (resume)", started, sampler)
        assert loaded is not None
        out["checkpoint"] = {"round": loaded.round, "bytes": params_size(storage / "checkpoints" / "round-00001.safetensors")}
        out["checkpoint"]["shards"] = _sharded(storage / "checkpoints" / "round-00001.safetensors")
        out["checkpoint_finite"] = bool(all(np.isfinite(v).all() for v in loaded.params.values()))
        del loaded
        out["fuse"] = _fuse(files, storage / "fused.safetensors", shard_size, storage)
        out["fused_bytes"] = params_size(storage / "fused.safetensors")
        out["fused_shards"] = _sharded(storage / "fused.safetensors")
        fused = load_params(storage / "fused.safetensors")
        out["fuse_finite"] = bool(all(np.isfinite(v).all() for v in fused.values()))
        out["fuse_shapes_ok"] = {k: v.shape for k, v in fused.items()} == shapes
        del fused
        out["phases"] = phases
    finally:
        if own:
            shutil.rmtree(storage, ignore_errors=True)
    return out


def report(out: dict[str, Any]) -> None:
    model = out["model_bytes"]
    rows = []
    for phase in ("run", "resume"):
        for row in out.get(f"{phase}_processes", []):
            rows.append(
                {
                    "phase": phase,
                    "process": f"{row['process']} ({row['pid']})",
                    "VmHWM GB": row["vmhwm_bytes"] / 1e9,
                    "x model": row["vmhwm_bytes"] / model,
                    "anon GB": row["peak_anon_bytes"] / 1e9,
                    "shm GB": row["peak_shmem_bytes"] / 1e9,
                    "file GB": row["peak_file_bytes"] / 1e9,
                }
            )
    fuse = out["fuse"]["process"]
    rows.append(
        {
            "phase": "fuse",
            "process": "rayfuse fuse",
            "VmHWM GB": fuse["vmhwm_bytes"] / 1e9,
            "x model": fuse["vmhwm_bytes"] / model,
            "anon GB": fuse["peak_anon_bytes"] / 1e9,
            "shm GB": fuse["peak_shmem_bytes"] / 1e9,
            "file GB": fuse["peak_file_bytes"] / 1e9,
        }
    )
    cols = [(c, c) for c in ("phase", "process", "VmHWM GB", "x model", "anon GB", "shm GB", "file GB")]
    print_table(
        rows,
        cols,
        title=f"{out['clients']} clients x {model / 1e9:.2f} GB ({out['params']:,} parameters), {out['clients_per_actor']} per actor: "
        f"run {out['run_seconds']} s, resume {out.get('resume_seconds')} s, fuse {out['fuse']['seconds']} s",
    )
    print(json.dumps({k: out.get(k) for k in ("files", "resume_same_model", "fedavg_finite", "fuse_finite", "fuse_shapes_ok")}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=625e6, help="model parameters (float32; default 625e6 = 2.5 GB)")
    parser.add_argument(
        "--layers",
        type=int,
        default=6,
        help="hidden layers of the MLP (default 6: the largest tensor is a fifth of the model, so training, which steps "
        "each tensor inside the backward pass at this size, holds about one tensor's gradient)",
    )
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--clients-per-actor", type=int, default=4, help="clients hosted by one actor process (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="fedavg rounds")
    parser.add_argument("--batch-size", type=int, default=512, help="local batch size (caps the local steps: ~360 samples per client)")
    parser.add_argument("--object-store-gb", type=float, default=None, help="Ray object store (default: 2.2 x the model, at least 1 GB)")
    parser.add_argument("--shard-size", type=float, default=float(2 * GiB), help="run.max_shard_size and fuse's, bytes (default 2 GiB)")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--storage", help="folder for the run and the fused file (default: a temporary folder, deleted after)")
    add_quick_arguments(parser, "a ~25 MB model with 8 MB shards")
    parser.add_argument("--methods", default="average,fedavg", help="average,fedavg (default) or one of them")
    parser.add_argument("--files-only", action="store_true", help="no Ray round: write the models, a checkpoint and read it, fuse")
    parser.add_argument(
        "--min-available-gb", type=float, default=2.0, help="stop the run's actors when the machine's available memory falls below this"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.params, args.shard_size = 6.25e6, float(8 * 2**20)
    model = 4 * mlp_params(width_for(args.params, args.layers), args.layers)
    store = int(args.object_store_gb * 1e9) if args.object_store_gb else max(int(2.2 * model), 10**9)
    load = os.getloadavg()
    print(f"model {model / 1e9:.2f} GB, object store {store / 1e9:.2f} GB, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    if args.files_only:
        out = files_only(
            params=args.params,
            clients=args.clients,
            shard_size=int(args.shard_size),
            storage=Path(args.storage) if args.storage else None,
            layers=args.layers,
        )
        out["load_before"], out["load_after"] = list(load), list(os.getloadavg())
        rows = [{"phase": k, **v} for k, v in out["phases"].items()] + [{"phase": "rayfuse fuse (subprocess)", **out["fuse"]["process"]}]
        for row in rows:
            row.update({f"{k} GB": row[f"{k}_bytes"] / 1e9 for k in ("vmhwm", "peak_anon", "peak_file")})
            row["x model"] = row["vmhwm_bytes"] / out["model_bytes"]
        cols = [(c, c) for c in ("phase", "seconds", "vmhwm GB", "x model", "peak_anon GB", "peak_file GB")]
        print_table(
            rows, cols, title=f"files of {out['model_bytes'] / 1e9:.2f} GB, {out['clients']} models; fuse {out['fuse']['seconds']} s"
        )
        name = "large_files_quick" if args.quick else f"large_files_{args.clients}x{model / 1e9:.1f}gb"
        print(f"results: {write_results(name, {'machine': machine_info(), 'result': out}, out_dir(args.out, args.quick))}")
        return 0 if out["checkpoint_finite"] and out["fuse_finite"] and out["fuse_shapes_ok"] else 1
    out = run_large(
        params=args.params,
        clients=args.clients,
        rounds=args.rounds,
        per_actor=args.clients_per_actor,
        store_bytes=store,
        shard_size=int(args.shard_size),
        batch_size=args.batch_size,
        cpus=args.cpus,
        storage=Path(args.storage) if args.storage else None,
        methods=tuple(m for m in ("average", "fedavg") if m in args.methods.split(",")),
        floor=int(args.min_available_gb * GiB),
        layers=args.layers,
    )
    out["load_before"] = list(load)
    out["load_after"] = list(os.getloadavg())
    report(out)
    name = "large_quick" if args.quick else f"large_{args.clients}x{model / 1e9:.1f}gb_{'_'.join(out['methods'])}"
    path = write_results(name, {"machine": machine_info(), "result": out}, out_dir(args.out, args.quick))
    print(f"results: {path}")
    checks = ("resume_same_model", "fedavg_finite", "fuse_finite", "fuse_shapes_ok")
    return 0 if all(out.get(c, True) for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
