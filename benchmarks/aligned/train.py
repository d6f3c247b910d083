"""Client models of the aligned-fusion benchmark: train K clients on one split, cache their checkpoints, evaluate the
baselines.

A *cell* is one (architecture, dataset, partition, K clients, shared or independent initialisation, seed). The
split is rayfuse's own (``rayfuse.data.make_plan`` on the config :func:`cell_config` returns), so ``rayfuse.run``
on that config (FedAvg in ``accuracy.py``) sees exactly the same clients, test set and public slice. Each client
trains ``train.epochs`` epochs of Adam from its initialisation: one seeded init shared by all clients
(``shared``), or one per client (``independent``).

Checkpoints go to ``benchmarks/results/aligned/checkpoints/<cell key>/`` (ignored by git): ``client_<i>.safetensors``
(``rayfuse.io.save_params``), ``arch.json`` (the arch spec, read by ``rebasin_runner.py``) and ``cell.json``. A cell
whose folder is complete is read back instead of retrained.

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/aligned/train.py --arch rescnn --dataset digits \
        --partition dirichlet0.5 --clients 3 --init independent --seed 0

prints the cell's baselines (each local model, best local, ensemble, naive average with and without BatchNorm
re-estimation on the public slice). ``--out DIR`` puts the checkpoints under ``DIR`` instead of the cache and writes
the baselines to ``DIR/train.json``; ``--quick`` trains the default cell for 2 epochs, afresh, into ``--out`` or a new
temporary folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rayfuse.config import build_config
from rayfuse.data import client_splits, load_dataset, make_plan, server_splits
from rayfuse.data.roles import Split
from rayfuse.io import atomic_write_json, load_params, save_params
from rayfuse.models import get_params, predict_proba, set_params, train_model
from rayfuse.seeding import derive_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from _common import add_quick_arguments, machine_info, out_dir, write_results  # noqa: E402
from arch import build_arch, example_input, write_arch_spec  # noqa: E402

__all__ = [
    "ARCH_KWARGS",
    "CACHE_DIR",
    "WIDTH_KWARG",
    "Cell",
    "PARTITIONS",
    "TrainedCell",
    "accuracy_of",
    "arch_spec",
    "average_params",
    "build_model",
    "cell_config",
    "ensemble_accuracy",
    "evaluate_baselines",
    "partition_section",
    "reestimate_batchnorm",
    "train_cell",
]

CACHE_DIR = Path(__file__).resolve().parents[1] / "results" / "aligned" / "checkpoints"
PARTITIONS = ("iid", "dirichlet0.5", "label-disjoint")
INITS = ("shared", "independent")
# Tiny widths: one cell (K=3, one architecture, one seed) trains in seconds on one core.
ARCH_KWARGS: dict[str, dict[str, dict[str, Any]]] = {
    "digits": {
        "mlp": {"hidden": 64},
        "cnn": {"width": 16},
        "rescnn": {"width": 16},
        "transformer": {"dim": 32, "heads": 4, "layers": 2, "patch": 2},
        "resnet18": {},
    },
    "mnist5k": {
        "mlp": {"hidden": 128},
        "cnn": {"width": 16},
        "rescnn": {"width": 16},
        "transformer": {"dim": 32, "heads": 4, "layers": 2, "patch": 4},
        "resnet18": {},
    },
}
# The keyword that sets each architecture's width (hidden units, channels, embedding dimension): Cell.model_width.
WIDTH_KWARG = {"mlp": "hidden", "cnn": "width", "rescnn": "width", "transformer": "dim"}
EPOCHS = 20
PUBLIC_SIZE = 100  # the server's public slice (samples): BatchNorm re-estimation, and tracing


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid."""

    arch: str
    dataset: str
    partition: str  # one of PARTITIONS
    num_clients: int
    init: str  # "shared" or "independent"
    seed: int
    epochs: int = EPOCHS
    model_width: int | None = None  # the architecture's width (WIDTH_KWARG); None: ARCH_KWARGS's
    public_size: int | None = None  # the server's public slice (samples); None: PUBLIC_SIZE

    def fields(self) -> dict[str, Any]:
        """The cell as plain data; ``model_width`` and ``public_size`` only when they are set (so the grid's rows and folder
        names stay as they were before cells had them)."""
        out = asdict(self)
        for key in ("model_width", "public_size"):
            if out[key] is None:
                del out[key]
        return out

    def key(self) -> str:
        """A readable, unique folder name."""
        digest = hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:8]
        width = f"-w{self.model_width}" if self.model_width is not None else ""
        width += f"-p{self.public_size}" if self.public_size is not None else ""
        return f"{self.arch}{width}-{self.dataset}-{self.partition}-k{self.num_clients}-{self.init}-s{self.seed}-{digest}"


@dataclass
class TrainedCell:
    """A cell's trained clients, with what the methods need to fuse and evaluate them."""

    cell: Cell
    spec: dict[str, Any]  # arch spec (arch.py)
    config: dict[str, Any]  # rayfuse config of the same split (rayfuse.run)
    clients: list[dict[str, np.ndarray]]  # each client's trained parameters (state dict, numpy)
    num_examples: list[int]
    test: Split
    public: Split
    folder: Path  # checkpoint folder (client_<i>.safetensors, arch.json)
    train_seconds: float
    train_sets: list[Split]  # each client's training split (the data its model was trained on; client-side statistics)


def partition_section(partition: str, num_clients: int, num_classes: int = 10) -> dict[str, Any]:
    """The rayfuse ``partition`` config section of a benchmark partition name.

    ``label-disjoint`` gives each client a contiguous, disjoint block of the labels.
    """
    if partition == "iid":
        return {"method": "iid", "num_clients": num_clients}
    if partition == "dirichlet0.5":
        return {"method": "dirichlet", "alpha": 0.5, "num_clients": num_clients}
    if partition == "label-disjoint":
        groups = [block.tolist() for block in np.array_split(np.arange(num_classes), num_clients)]
        return {"method": "labels", "groups": groups, "num_clients": num_clients}
    raise ValueError(f"partition: expected one of {PARTITIONS}, got {partition!r}")


def cell_config(cell: Cell) -> dict[str, Any]:
    """The rayfuse config (plain data) whose split, seed and local training are the cell's."""
    return {
        "run": {"name": "aligned-bench", "seed": cell.seed},
        "data": {"dataset": cell.dataset, "public_size": PUBLIC_SIZE if cell.public_size is None else cell.public_size},
        "partition": partition_section(cell.partition, cell.num_clients),
        "train": {"epochs": cell.epochs, "batch_size": 32, "optimizer": "adam", "lr": 5e-3, "shared_init": cell.init == "shared"},
    }


def arch_spec(arch: str, dataset: str, input_shape: Sequence[int], num_classes: int, width: int | None = None) -> dict[str, Any]:
    """The arch spec of ``arch`` sized for ``dataset`` (``width``: its :data:`WIDTH_KWARG` instead of ARCH_KWARGS's)."""
    kwargs = dict(ARCH_KWARGS[dataset][arch])
    if width is not None:
        if arch not in WIDTH_KWARG:
            raise ValueError(f"width: {arch} has no width setting (those that have: {sorted(WIDTH_KWARG)})")
        kwargs[WIDTH_KWARG[arch]] = int(width)
    return {"arch": arch, "kwargs": kwargs, "input_shape": [int(d) for d in input_shape], "num_classes": int(num_classes)}


def build_model(spec: Mapping[str, Any], params: Mapping[str, np.ndarray] | None = None, *, seed: int = 0) -> nn.Module:
    """The spec's model (with ``params`` loaded when given, at their widths: a nonparametric merge grows groups), in eval
    mode."""
    model = build_arch(spec, seed=seed)
    if params is not None:
        state = model.state_dict()
        if all(np.shape(params[k]) == tuple(v.shape) for k, v in state.items()):
            set_params(model, params)
        else:
            from rayfuse.symmetry import read_structure, resize_model

            resize_model(model, read_structure(model, example_input(spec)), params)
    return model.eval()


def _init_seed(cell: Cell, client: int) -> int:
    return derive_seed(cell.seed, "init") if cell.init == "shared" else derive_seed(cell.seed, "init", client)


def train_cell(cell: Cell, cache_dir: Path = CACHE_DIR, *, retrain: bool = False) -> TrainedCell:
    """Train (or read back from ``cache_dir``) the cell's client models.

    Parameters
    ----------
    cell : Cell
    cache_dir : Path
        Receives ``<cell.key()>/client_<i>.safetensors``, ``arch.json`` and ``cell.json``.
    retrain : bool
        Train even when the cache holds the cell.

    Returns
    -------
    TrainedCell
    """
    config = cell_config(cell)
    cfg = build_config(config)
    dataset = load_dataset(cell.dataset)
    plan = make_plan(dataset, cfg.data, cfg.partition, cfg.run.seed)
    test, public = server_splits(dataset, plan)
    spec = arch_spec(cell.arch, cell.dataset, dataset.input_shape, dataset.num_classes, cell.model_width)
    folder = cache_dir / cell.key()
    files = [folder / f"client_{i}.safetensors" for i in range(cell.num_clients)]
    meta_file = folder / "cell.json"
    sizes = [plan.num_examples(i) for i in range(cell.num_clients)]
    train_sets = [client_splits(dataset, plan.for_client(i))[0] for i in range(cell.num_clients)]
    if not retrain and meta_file.is_file() and all(f.is_file() for f in files):
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("split_hash") == plan.digest():
            clients = [load_params(f) for f in files]
            return TrainedCell(cell, spec, config, clients, sizes, test, public, folder, float(meta["train_seconds"]), train_sets)
    folder.mkdir(parents=True, exist_ok=True)
    clients = []
    started = time.perf_counter()
    with _torch_threads(1):
        for i, train in enumerate(train_sets):
            model = build_arch(spec, seed=_init_seed(cell, i))
            train_model(
                model,
                train.X,
                train.y,
                epochs=cfg.train.epochs,
                batch_size=cfg.train.batch_size,
                lr=cfg.train.lr,
                optimizer=cfg.train.optimizer,
                seed=derive_seed(cell.seed, "local-train", i),
            )
            params = get_params(model)
            save_params(files[i], params, {"cell": cell.key(), "client": str(i)})
            clients.append(params)
    seconds = time.perf_counter() - started
    write_arch_spec(folder / "arch.json", spec)
    atomic_write_json(
        meta_file,
        {
            "cell": cell.fields(),
            "spec": spec,
            "config": config,
            "split_hash": plan.digest(),
            "num_examples": sizes,
            "train_seconds": seconds,
        },
    )
    return TrainedCell(cell, spec, config, clients, sizes, test, public, folder, seconds, train_sets)


class _torch_threads:
    """Context manager: run torch on ``n`` threads, then restore the previous count."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *_: object) -> None:
        torch.set_num_threads(self.before)


def accuracy_of(spec: Mapping[str, Any], params: Mapping[str, np.ndarray], split: Split) -> float:
    """Test accuracy of the spec's model with ``params``."""
    return float((predict_proba(build_model(spec, params), split.X).argmax(1) == split.y).mean())


def ensemble_accuracy(spec: Mapping[str, Any], clients: Sequence[Mapping[str, np.ndarray]], split: Split) -> float:
    """Accuracy of the ensemble: the mean of the clients' softmax outputs."""
    probs = np.mean([predict_proba(build_model(spec, p), split.X) for p in clients], axis=0)
    return float((probs.argmax(1) == split.y).mean())


def average_params(clients: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None = None) -> dict[str, np.ndarray]:
    """Weighted mean of floating-point entries (uniform when ``weights`` is None); integer buffers from the first client."""
    w = np.full(len(clients), 1.0 / len(clients)) if weights is None else np.asarray(weights, float) / float(np.sum(weights))
    out = {}
    for key, value in clients[0].items():
        if np.issubdtype(value.dtype, np.floating):
            out[key] = sum(wi * np.asarray(c[key], np.float64) for wi, c in zip(w, clients)).astype(value.dtype)
        else:
            out[key] = np.array(value, copy=True)
    return out


@torch.no_grad()
def reestimate_batchnorm(
    spec: Mapping[str, Any], params: Mapping[str, np.ndarray], X: np.ndarray, *, batch_size: int = 50
) -> dict[str, np.ndarray]:
    """``params`` with every BatchNorm's running statistics re-estimated on ``X`` (cumulative average over batches of
    ``batch_size``, the model in train mode, no gradient); unchanged for a model without BatchNorm."""
    model = build_model(spec, params)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return dict(params)
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average: every batch counts equally
    model.train()
    for start in range(0, len(X), batch_size):
        batch = X[start : start + batch_size]
        if len(batch) > 1:
            model(torch.as_tensor(np.ascontiguousarray(batch)))
    return get_params(model)


def evaluate_baselines(trained: TrainedCell) -> dict[str, float]:
    """Each local model's test accuracy, the best local, the ensemble, and the naive (sample-weighted) average with
    and without BatchNorm re-estimation on the public slice."""
    spec, test = trained.spec, trained.test
    out = {f"local_{i}": accuracy_of(spec, p, test) for i, p in enumerate(trained.clients)}
    out["best_local"] = max(out.values())
    out["ensemble"] = ensemble_accuracy(spec, trained.clients, test)
    average = average_params(trained.clients, trained.num_examples)
    out["naive_average"] = accuracy_of(spec, average, test)
    out["naive_average_bn"] = accuracy_of(spec, reestimate_batchnorm(spec, average, trained.public.X), test)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="rescnn", choices=sorted(ARCH_KWARGS["digits"]))
    parser.add_argument("--dataset", default="digits", choices=sorted(ARCH_KWARGS))
    parser.add_argument("--partition", default="dirichlet0.5", choices=PARTITIONS)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--init", default="independent", choices=INITS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=None, help=f"local epochs (default {EPOCHS}; --quick 2)")
    parser.add_argument("--retrain", action="store_true", help="ignore the cache")
    add_quick_arguments(parser, "the default cell, 2 epochs, trained afresh")
    args = parser.parse_args()
    if args.epochs is None:
        args.epochs = 2 if args.quick else EPOCHS
    out = out_dir(args.out, args.quick) if args.out is not None or args.quick else None
    cell = Cell(args.arch, args.dataset, args.partition, args.clients, args.init, args.seed, args.epochs)
    trained = train_cell(cell, CACHE_DIR if out is None else out / "checkpoints", retrain=args.retrain)
    print(f"{cell.key()}: trained in {trained.train_seconds:.1f} s, checkpoints in {trained.folder}")
    baselines = evaluate_baselines(trained)
    for name, value in baselines.items():
        print(f"  {name:18s} {value:.4f}")
    if out is not None:
        payload = {"machine": machine_info(), "cell": cell.key(), "train_seconds": trained.train_seconds, "baselines": baselines}
        print(f"wrote {write_results('train', payload, out)}")


if __name__ == "__main__":
    main()
