"""The ``rayfuse`` command line.

::

    rayfuse run [CONFIG] [--set KEY=VALUE]... [--out DIR] [--address ADDR] [--resume RUN_DIR] [--local]
    rayfuse list [methods|datasets|partitioners|models]
    rayfuse validate [CONFIG] [--set KEY=VALUE]...
    rayfuse split CONFIG --out DIR [--set KEY=VALUE]...
    rayfuse fuse CONFIG [OUT]
    rayfuse tune SPACE [--samples N] [--address ADDR] [--storage DIR] [--resume] [--set KEY=VALUE]...
    rayfuse symmetry ARCHITECTURE [--input-shape C,H,W] [--vocab N] [--dataset NAME] [--args JSON] [--json] [--strict]

With no CONFIG, ``rayfuse run`` runs ``jobs/quickstart.yaml`` (or, outside a checkout, the same job built into the
config defaults). Exit codes: 0 success, 2 bad input (one line naming the key path, expected and given value),
1 the run failed, 130 interrupted (Ctrl-C), 143 stopped by SIGTERM (both print the ``--resume`` hint).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayfuse.errors import InputError, RunFailure
from rayfuse.version import __version__

__all__ = ["main", "build_parser", "default_job"]


def default_job() -> Path | None:
    """``jobs/quickstart.yaml`` from the working directory or the source checkout; ``None`` if neither exists."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        candidate = base / "jobs" / "quickstart.yaml"
        if candidate.is_file():
            return candidate
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayfuse", description="Federated model fusion on Ray.")
    parser.add_argument("--version", action="version", version=f"rayfuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (default: jobs/quickstart.yaml)")
    run.add_argument("config", nargs="?", help="experiment YAML (default: jobs/quickstart.yaml)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. partition.num_clients=10")
    run.add_argument("--out", metavar="DIR", help="run folder (default: <run.storage>/<run.name>-<time>-<id>)")
    run.add_argument(
        "--address", metavar="ADDR", help="Ray cluster to attach to (default: RAY_ADDRESS, a job's cluster, or a new local Ray)"
    )
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted or failed run from its checkpoints")
    run.add_argument("--local", action="store_true", help="in-process clients instead of Ray actors (debugging)")
    run.add_argument("--quiet", action="store_true", help="print only the final table")
    run.add_argument("--verbose", action="store_true", help="print every event")
    run.set_defaults(func=_cmd_run)

    lst = sub.add_parser("list", help="list methods, datasets, partitioners, models and rayfuse fuse's merges")
    lst.add_argument("what", nargs="?", choices=["methods", "datasets", "partitioners", "models", "merges"], help="only this kind")
    lst.set_defaults(func=_cmd_list)

    val = sub.add_parser("validate", help="validate a config and print it resolved (every default filled in)")
    val.add_argument("config", nargs="?")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    val.set_defaults(func=_cmd_validate)

    spl = sub.add_parser("split", help="write a simulation's client shards as silo files plus a silo config that reproduces it (rehearsal)")
    spl.add_argument("config", help="simulation config YAML (data.dataset + partition)")
    spl.add_argument("--out", metavar="DIR", required=True, help="a new or empty folder for the files and silos.yaml")
    spl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key first")
    spl.set_defaults(func=_cmd_split)

    fus = sub.add_parser("fuse", help="fuse checkpoints trained elsewhere (mergekit-style YAML; methods that need no client data)")
    fus.add_argument("config", help="fuse config YAML: merge_method, models, parameters, output")
    fus.add_argument("out", nargs="?", help="output .safetensors (overrides output:)")
    fus.add_argument(
        "--max-shard-size",
        type=int,
        metavar="BYTES",
        help="an output above this size is a folder of model-0000k-of-0000n.safetensors shards and their index "
        "(overrides max_shard_size:; default 2 GiB)",
    )
    fus.set_defaults(func=_cmd_fuse)

    tun = sub.add_parser("tune", help="a Ray Tune sweep from tune_spaces/<space>.yaml (one trial = one federation)")
    tun.add_argument("space", help="sweep space YAML (see tune_spaces/README.md)")
    tun.add_argument("--samples", type=int, metavar="N", help="samples of the random domains (overrides num_samples)")
    tun.add_argument(
        "--address", metavar="ADDR", help="Ray cluster to attach to (default: RAY_ADDRESS, a job's cluster, or a new local Ray)"
    )
    tun.add_argument("--storage", metavar="DIR", help="Tune storage path (default: the space's storage, else <run.storage>/tune)")
    tun.add_argument("--resume", action="store_true", help="continue an interrupted sweep (Tuner.restore)")
    tun.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key of the base job")
    tun.add_argument("--check", action="store_true", help="validate the space and print the trials' grid; start nothing")
    tun.set_defaults(func=_cmd_tune)

    sym = sub.add_parser("symmetry", help="derive and print a model's permutation groups (the weight axes that share one permutation)")
    sym.add_argument("architecture", help="a registry model (rescnn, mlp...), torchvision:<name> or module:Class")
    sym.add_argument("--input-shape", metavar="C,H,W", help="one sample's shape (default: the dataset's)")
    sym.add_argument(
        "--vocab",
        metavar="N",
        help="the model takes token ids (Hugging Face models): feed random integer ids in "
        "[0, N) of --input-shape (e.g. --input-shape 16 --vocab 30522) instead of floats",
    )
    sym.add_argument("--dataset", default="digits", help="gives the default input shape and the number of classes (default: digits)")
    sym.add_argument("--args", metavar="JSON", help="model arguments: ModelConfig fields for a registry model, keyword arguments otherwise")
    sym.add_argument("--json", action="store_true", help="print the spec as JSON")
    sym.add_argument(
        "--strict", action="store_true", help="refuse (exit 2) when a derived group fails the invariance check, instead of listing it fixed"
    )
    sym.set_defaults(func=_cmd_symmetry)
    return parser


def _operational_overrides(args: argparse.Namespace) -> list[str]:
    extra = []
    if getattr(args, "address", None):
        extra.append(f"federation.address={args.address}")
    if getattr(args, "local", False):
        extra.append("federation.backend=local")
    return extra


def _cmd_run(args: argparse.Namespace) -> int:
    from rayfuse.api import resume, run
    from rayfuse.io import check_writable_folder
    from rayfuse.runner import check_new_folder

    sets = list(args.set) + _operational_overrides(args)
    if args.verbose:  # transformers' own warnings and bars too (rayfuse.models.hf.quiet_transformers leaves them)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    if args.resume:
        if args.config:
            raise InputError("CONFIG", "no config file with --resume (the run's own config.yaml is used)", args.config)
        if args.out:
            raise InputError("--out", "no --out with --resume (the run continues in its own folder)", args.out)
        resume(args.resume, overrides=sets, quiet=args.quiet, verbose=args.verbose)
        return 0
    if args.out:
        check_new_folder(args.out, key="--out")
        check_writable_folder(args.out, key="--out")
    run(args.config or default_job(), run_dir=args.out, overrides=sets, quiet=args.quiet, verbose=args.verbose)
    return 0


def _cmd_fuse(args: argparse.Namespace) -> int:
    from rayfuse.api import fuse_checkpoints

    summary = fuse_checkpoints(
        args.config, args.out, progress=lambda line: print(f"rayfuse fuse: {line}", flush=True), max_shard_size=args.max_shard_size
    )
    print(
        f"rayfuse fuse: {summary['method']} of {summary['models']} models, {summary['tensors']} tensors "
        f"({summary['parameters']:,} parameters) -> {summary['output']}"
    )
    if summary.get("resized"):  # a nonparametric merge grew groups: the architecture must be built at these widths
        key, (was, now) = next(iter(summary["resized"].items()))
        print(
            f"rayfuse fuse: the fused model is wider than its inputs: {len(summary['resized'])} tensors resized (e.g. {key} "
            f"{was} -> {now}); load it in one call with rayfuse.load_fused(architecture, {summary['output']!r})"
        )
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from rayfuse.sweep import load_space

    spec = load_space(args.space, samples=args.samples, overrides=args.set)  # every check before Ray starts
    domains = ", ".join(f"{k} {d.to_yaml()}" for k, d in spec.space.items())
    print(
        f"rayfuse tune: {spec.name}: base {spec.base_path}, methods {spec.methods}, {spec.num_trials} trials "
        f"({spec.grid_size} grid points x {spec.num_samples} samples); {domains}; {spec.metric} ({spec.mode})",
        flush=True,
    )
    if args.check:
        return 0
    from actors.tune import run_sweep

    summary = run_sweep(spec, address=args.address, resume=args.resume, storage=args.storage)
    for row in summary["table"]:
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if summary["errors"]:
        print(f"rayfuse tune: {len(summary['errors'])} trial(s) failed: {summary['errors'][0]}", file=sys.stderr)
    best = summary["best"]
    print(f"best: {spec.metric} = {best['metric']:.4f} with {best['config']}\nresults: {summary['results']}\nbest config: {best['file']}")
    return 0


def _cmd_symmetry(args: argparse.Namespace) -> int:
    import json

    from rayfuse.api import symmetry
    from rayfuse.data.tokens import MAX_VOCAB

    shape = None
    if args.input_shape is not None:
        try:
            shape = tuple(int(s) for s in args.input_shape.split(","))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:
            raise InputError("--input-shape", "comma-separated positive integers such as 1,8,8", args.input_shape)
    vocab = None
    if args.vocab is not None:
        try:
            vocab = int(args.vocab)
        except ValueError:
            vocab = 0
        if not 1 <= vocab <= MAX_VOCAB:
            raise InputError(
                "--vocab", f"the number of token ids the model takes: a whole number in [1, {MAX_VOCAB}] such as 30522", args.vocab
            )
        if shape is None and args.dataset == "digits":  # another --dataset gives the ids' shape (tokens: its length)
            raise InputError(
                "--input-shape",
                "the token ids' shape with --vocab, such as 16 for sequences of 16 tokens (the dataset's shape is an image's)",
            )
    kwargs = None
    if args.args is not None:
        try:
            kwargs = json.loads(args.args)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested deeper than the parser recurses
            kwargs = None
        if not isinstance(kwargs, dict):
            raise InputError("--args", "a JSON object such as '{\"num_classes\": 10}'", args.args)
    try:
        spec = symmetry(args.architecture, input_shape=shape, dataset=args.dataset, args=kwargs, strict=args.strict, vocab=vocab)
    except InputError as exc:  # the API's keyword arguments, said as this command's flags
        flag = {"dataset": "--dataset", "input_shape": "--input-shape", "vocab": "--vocab", "args": "--args"}.get(exc.path)
        raise exc.at(flag) if flag else exc from None
    print(json.dumps(spec.to_dict(), indent=1) if args.json else spec.describe())
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from rayfuse.config import dump_config, load_config
    from rayfuse.runner import prepare_run

    prepared = prepare_run(load_config(args.config or default_job(), args.set))  # every check before anything starts
    print(dump_config(prepared.resolved()), end="")
    return 0


def _cmd_split(args: argparse.Namespace) -> int:
    from rayfuse.config import load_config
    from rayfuse.data.split import split_simulation
    from rayfuse.method import resolve_methods, with_public_default

    cfg = load_config(args.config, args.set)
    written = split_simulation(with_public_default(cfg, resolve_methods(cfg.methods)), args.out)
    print(
        f"rayfuse split: {args.config} -> {written.parent} (one folder per client: train.npz, held_out.npz; server/); "
        f"run it with: rayfuse run {written}"
    )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from rayfuse.data.datasets import DATASETS
    from rayfuse.data.partition import PARTITIONERS
    from rayfuse.method import METHODS
    from rayfuse.models.registry import MODELS

    sections = []
    if args.what in (None, "methods"):
        rows = []
        for name, cls in METHODS.items():
            params = ", ".join(f"{k}={f.default!r}" for k, f in cls.Params.model_fields.items())
            aliases = f" (aliases: {', '.join(cls.aliases)})" if cls.aliases else ""
            paper = f"\n  {'':<10} paper: [{r.key}] {r.title}, {r.url}" if (r := cls.reference) else ""
            rows.append(f"  {name:<10} {cls.summary}{aliases}\n  {'':<10} params: {params or '-'}{paper}")
        sections.append("methods:\n" + "\n".join(rows))
    if args.what in (None, "datasets"):
        rows = [f"  {name:<14} [{info.source}] {info.description}" for name, info in DATASETS.items()]
        sections.append("datasets:\n" + "\n".join(rows))
    if args.what in (None, "partitioners"):
        docs = {
            "iid": "random near-equal split (alias homo)",
            "dirichlet": "per-class Dir(alpha) proportions, PFNM balancing, min_size (alias hetero-dir)",
            "labels": "explicit label groups per client (partition.groups)",
            "pathological": "classes_per_client classes per client (flwr-datasets)",
            "shards": "sorted-by-label shards dealt at random (McMahan et al.)",
        }
        rows = [f"  {name:<13} {docs.get(name, '')}" for name in PARTITIONERS.names()]
        sections.append("partitioners:\n" + "\n".join(rows))
    if args.what in (None, "models"):
        rows = [f"  {name:<13} {info.description}" for name, info in MODELS.items()]
        rows.append(
            f"  {'torchvision:<name>':<13} any torchvision classification model, e.g. torchvision:resnet18 (image data; no pretrained weights)"
        )
        rows.append(
            f"  {'hf:<folder>':<13} a local Hugging Face sequence classifier (token-id data, e.g. dataset tokens; nothing downloaded)"
        )
        sections.append("models:\n" + "\n".join(rows))
    if args.what in (None, "merges"):
        from rayfuse.merging import MERGES

        rows = []
        for name, merge in MERGES.items():
            aliases = f" (aliases: {', '.join(merge.aliases)})" if merge.aliases else ""
            rows.append(
                f"  {name:<19} {merge.summary}{aliases}\n  {'':<19} reads: {merge.inputs}; base: {merge.base}; params: {merge.parameters_text}"
            )
        sections.append("merges (rayfuse fuse):\n" + "\n".join(rows))
    print("\n\n".join(sections))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from rayfuse.interrupts import as_interrupted, sigterm_as_interrupt

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with sigterm_as_interrupt():  # SIGTERM (ray job stop, schedulers, containers) stops a run like Ctrl-C
            return int(args.func(args) or 0)
    except InputError as exc:
        print(f"rayfuse: error: {exc}", file=sys.stderr)
        return 2
    except RunFailure as exc:
        print(f"rayfuse: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        interrupted = as_interrupted(exc)
        print(f"\nrayfuse: interrupted ({signal_name(interrupted.signum)}); {_resume_hint(args, interrupted)}", file=sys.stderr)
        return interrupted.exit_code


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    import signal

    return signal.Signals(signum).name


def _resume_hint(args: argparse.Namespace, interrupted: Any) -> str:
    if args.command == "tune":
        storage = f" --storage {args.storage}" if args.storage else ""
        return f"continue with: rayfuse tune {args.space}{storage} --resume"
    if args.command != "run":
        return "nothing to continue"
    if interrupted.run_dir is not None:
        return f"continue with: rayfuse run --resume {interrupted.run_dir}"
    return "the run stopped before writing its folder; nothing to resume"


if __name__ == "__main__":
    raise SystemExit(main())
