"""What FedRef and FedOpt cost, as ratios against FedAvg / FedProx measured in the same process.

1. Client compute per round (the issue's "clients pay nothing extra"): one client's local round (E epochs of SGD on
   its shard of jobs/fedref_digits.yaml) as FedAvg / FedRef run it, as FedProx (mu = 0.5) runs it, and as the FedRef
   authors' clients run it (plus a forward pass over the training data to report the loss: ``client_loss: eval``).
2. Server cost per round: the sample-weighted average of K client models alone (FedAvg), then plus FedRef's step
   (queue, reference model, eq. 12) and plus FedAdam's step, for a small CNN and for a ~2.5M-parameter MLP.

    python benchmarks/bench_fedref.py [--repeats 15] [--out DIR]
    python benchmarks/bench_fedref.py --quick   # one local epoch, the small CNN's server round, 2 passes

Writes benchmarks/results/bench_fedref.json (``--out``; ``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import add_quick_arguments, interleaved_times, machine_info, median, out_dir, print_table, write_results  # noqa: E402


def client_compute(repeats: int, epochs: int = 4) -> list[dict]:
    import torch

    from rayfuse.config import load_config
    from rayfuse.data.roles import client_splits, load_dataset_from_config, make_plan
    from rayfuse.models import build_model, compute_loss, get_params, set_params, train_model

    torch.set_num_threads(1)  # what a Ray actor with one CPU gets (OMP_NUM_THREADS=1)
    cfg = load_config("jobs/fedref_digits.yaml")
    dataset = load_dataset_from_config(cfg.data)
    plan = make_plan(dataset, cfg.data, cfg.partition, cfg.run.seed)
    train, _ = client_splits(dataset, plan.for_client(0))
    start = get_params(build_model(cfg.model, plan.input_shape, plan.num_classes, seed=1))
    args = dict(epochs=epochs, batch_size=cfg.train.batch_size, lr=cfg.train.lr, optimizer="sgd", seed=0)

    def local_round(mu: float = 0.0, eval_loss: bool = False):
        def go():
            model = set_params(build_model(cfg.model, plan.input_shape, plan.num_classes, seed=0), start)
            train_model(model, train.X, train.y, proximal_mu=mu, **args)
            if eval_loss:
                compute_loss(model, train.X, train.y)

        return go

    fns = {
        "fedavg / fedref": local_round(),
        "fedprox (mu 0.5)": local_round(mu=0.5),
        "fedref, client_loss eval": local_round(eval_loss=True),
    }
    times = interleaved_times(fns, repeats, warmup=min(2, repeats))
    prox = median(times["fedprox (mu 0.5)"])
    base = median(times["fedavg / fedref"])
    return [
        {
            "client round": name,
            "samples": len(train.y),
            "median ms": 1e3 * median(t),
            "vs fedavg": median(t) / base,
            "vs fedprox": median(t) / prox,
        }
        for name, t in times.items()
    ]


def server_cost(repeats: int, clients: int = 10, quick: bool = False) -> list[dict]:
    from rayfuse.config import ModelConfig
    from rayfuse.federation import Update
    from rayfuse.fusion.fedavg.fedopt import FedAdam
    from rayfuse.fusion.fedref.algorithm import FedRef
    from rayfuse.models import build_model, get_params
    from rayfuse.updates.aggregate import weighted_average

    rows = []
    models_timed = [
        ("cnn [16, 32] (digits)", ModelConfig(name="cnn", channels=[16, 32]), (1, 8, 8)),
        ("mlp [1024, 1024] (784 in)", ModelConfig(name="mlp", hidden=[1024, 1024]), (784,)),
    ]
    for name, model_cfg, shape in models_timed[:1] if quick else models_timed:
        base = get_params(build_model(model_cfg, shape, 10, seed=0))
        size = sum(a.size for a in base.values())
        rng = np.random.default_rng(0)
        models = [{k: (a + 0.01 * rng.standard_normal(a.shape)).astype(a.dtype) for k, a in base.items()} for _ in range(clients)]
        weights = list(rng.integers(300, 900, size=clients))
        updates = {i: Update({}, int(w), {"train_loss": 0.5}) for i, w in enumerate(weights)}
        fedref = FedRef(FedRef.Params.model_validate({"p": 5, "lam": 0.01, "lr": 0.05}))
        fedadam = FedAdam(FedAdam.Params.model_validate({}))
        ref_state, adam_state = fedref.initial_state(base), fedadam.initial_state(base)  # the broadcast model stays base
        for r in range(1, 8):  # past round p + 1: every timed call below runs the fine-tuning step
            fedref.server_update(None, ref_state, weighted_average(models, weights), updates, r)
            fedadam.server_update(None, adam_state, weighted_average(models, weights), updates, r)
        state = {"round": 8}

        def average():
            weighted_average(models, weights)

        def with_fedref():
            state["round"] += 1
            fedref.server_update(None, ref_state, weighted_average(models, weights), updates, state["round"])

        def with_fedadam():
            fedadam.server_update(None, adam_state, weighted_average(models, weights), updates, 1)

        times = interleaved_times(
            {"fedavg (average)": average, "fedref (average + step)": with_fedref, "fedadam (average + step)": with_fedadam},
            repeats,
            warmup=1,
        )
        ref = median(times["fedavg (average)"])
        rows += [
            {"model": name, "params": size, "server round": k, "median ms": 1e3 * median(t), "vs average": median(t) / ref}
            for k, t in times.items()
        ]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="timed passes (default 15; --quick 2)")
    add_quick_arguments(parser, "one local epoch, the small CNN's server round")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 2 if args.quick else 15
    epochs = 1 if args.quick else 4
    clients = client_compute(args.repeats, epochs)
    print_table(
        clients,
        [
            ("client round", "client round"),
            ("samples", "samples"),
            ("median ms", "median ms"),
            ("vs fedavg", "x fedavg"),
            ("vs fedprox", "x fedprox"),
        ],
        title=f"client compute per round (one client, E = {epochs})",
    )
    server = server_cost(args.repeats, quick=args.quick)
    print_table(
        server,
        [
            ("model", "model"),
            ("params", "params"),
            ("server round", "server round"),
            ("median ms", "median ms"),
            ("vs average", "x average"),
        ],
        title="server cost per round (10 clients)",
    )
    payload = {
        "machine": machine_info(),
        "repeats": args.repeats,
        "epochs": epochs,
        "quick": args.quick,
        "client": clients,
        "server": server,
    }
    path = write_results("bench_fedref", payload, out_dir(args.out, args.quick))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
