"""What EP costs per local epoch: EP-ProbGAN (and Mixture-EP-ProbGAN, EP-BGAN) against ProbGAN, WGAN-GP as a floor.

The paper reports 4.3 s per epoch for ProbGAN and 5.9 s for EP-ProbGAN (CIFAR-10, DCGAN backbone, V100): EP costs
1.37x. Here: one client's local epoch on its shard of jobs/epgan_toy.yaml (2000 points, batch 128, the toy MLPs),
single-threaded as a Ray actor with one CPU runs it, measured in interleaved passes; the EP step of a turn (f_bar,
cavity, tilted moments, damped update over every generator parameter) is timed separately, as is the server's product
of 4 factors. Also a wider network (hidden 512, z 64, 64-dimensional data: the size of a digits MLP-GAN) where the
EP term's per-parameter work weighs more.

    python benchmarks/bench_epgan.py [--repeats 7] [--out DIR]
    python benchmarks/bench_epgan.py --quick    # the toy network on 500 points and the small product, one pass

Writes benchmarks/results/bench_epgan.json (``--out``; ``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import add_quick_arguments, interleaved_times, machine_info, median, out_dir, print_table, write_results  # noqa: E402

VARIANTS = [("wgan", 1), ("probgan", 1), ("ep-bgan", 1), ("ep-probgan", 1), ("ep-probgan", 4)]


def _trainer(backbone: str, components: int, data_dim: int, latent: int, hidden: int, X: np.ndarray):
    from rayfuse.fusion.epgan.algorithm import initial_ep_prior
    from rayfuse.fusion.epgan.nets import GANSettings, GANTrainer

    trainer = GANTrainer(GANSettings(backbone=backbone, components=components, data_dim=data_dim, latent_dim=latent, hidden=hidden), seed=0)
    prior = None
    if trainer.settings.uses_ep:
        prior = initial_ep_prior(trainer, components, 1.0, 0.05, np.random.default_rng(0))
        trainer.update_ep(X, *prior, damping=0.5)
    return trainer, prior


def per_epoch(X: np.ndarray, latent: int, hidden: int, repeats: int) -> list[dict]:
    fns, ep_fns, trainers = {}, {}, {}
    for backbone, J in VARIANTS:
        name = backbone + (f" J={J}" if J > 1 else "")
        trainer, prior = _trainer(backbone, J, X.shape[1], latent, hidden, X)
        trainers[name] = trainer
        fns[name] = lambda t=trainer: t.train_epoch(X)
        if prior is not None:
            ep_fns[name] = lambda t=trainer, p=prior: t.update_ep(X, *p, damping=0.5)
    times = interleaved_times(fns, repeats, warmup=1)
    ep_times = interleaved_times(ep_fns, repeats, warmup=1) if ep_fns else {}
    base = median(times["probgan"])
    rows = []
    for name, t in times.items():
        params = sum(p.numel() for p in trainers[name].G.parameters())
        row = {"backbone": name, "G params": params, "epoch ms": 1e3 * median(t), "vs probgan": median(t) / base}
        if name in ep_times:
            row["EP step ms"] = 1e3 * median(ep_times[name])
        rows.append(row)
    return rows


def server_product(repeats: int, hidden: int, latent: int, data_dim: int, clients: int = 4, components: int = 4) -> dict:
    from rayfuse.fusion.epgan.algorithm import combine_factors
    from rayfuse.fusion.epgan.nets import GANSettings, GANTrainer

    trainer = GANTrainer(
        GANSettings(backbone="ep-probgan", components=components, data_dim=data_dim, latent_dim=latent, hidden=hidden), seed=0
    )
    rng = np.random.default_rng(0)
    shapes = trainer.prior_shapes()
    factors = [
        (
            {k: rng.normal(size=(components,) + s) for k, s in shapes.items()},
            {k: rng.uniform(0.1, 1.0, size=(components,) + s) for k, s in shapes.items()},
        )
        for _ in range(clients)
    ]
    times = interleaved_times({"product": lambda: combine_factors(factors)}, repeats, warmup=1)
    return {
        "hidden": hidden,
        "components": components,
        "clients": clients,
        "prior elements": int(sum(np.prod((components,) + s) for s in shapes.values())),
        "product ms": 1e3 * median(times["product"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=None, help="timed passes (default 7; --quick 1)")
    add_quick_arguments(parser, "the toy network on 500 points, the small server product")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 7
    import torch

    torch.set_num_threads(1)  # what a Ray actor with one CPU gets (OMP_NUM_THREADS=1)
    from rayfuse.data.datasets import load_dataset

    toy = load_dataset("gaussians4", options={"n_per_mode": 2000}).X[:2000]
    wide = np.random.default_rng(0).random((1000, 64)).astype(np.float32)
    results = {"machine": machine_info(), "repeats": args.repeats}
    columns = [
        ("backbone", "backbone"),
        ("G params", "G params"),
        ("epoch ms", "epoch ms"),
        ("vs probgan", "x ProbGAN"),
        ("EP step ms", "EP step (per turn) ms"),
    ]
    networks = [("toy", toy, 2, 32), ("wide", wide, 64, 512)]
    if args.quick:  # the same per-epoch and EP-step code on one small network
        networks = [("toy", toy[:500], 2, 32)]
    for key, X, latent, hidden in networks:
        rows = per_epoch(X, latent, hidden, args.repeats)
        results[key] = rows
        print_table(
            rows,
            columns,
            title=f"{key}: one local epoch ({len(X)} points, batch 128, hidden {hidden}); the paper: EP-ProbGAN 1.37x ProbGAN",
        )
    results["server_product"] = [server_product(args.repeats, 32, 2, 2)]
    if not args.quick:
        results["server_product"].append(server_product(args.repeats, 512, 64, 64))
    print_table(results["server_product"], [(k, k) for k in results["server_product"][0]], title="server: product of 4 clients' factors")
    results["quick"] = args.quick
    path = write_results("bench_epgan", results, out_dir(args.out, args.quick))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
