"""rayfuse's fine-tune merges against mergekit's on the same Hugging Face folders: equal tensors, wall time, peak RSS.

A Llama-style model is built from a config (random weights, nothing downloaded), saved as a sharded folder, and
``--models`` perturbed copies stand for its fine-tunes. Each merge (linear, task_arithmetic, ties, slerp) runs twice
from the same YAML, each in a subprocess of its own: mergekit (``mergekit-yaml``, with the Python of
``benchmarks/.mergekit-venv``) and ``rayfuse fuse``. Reported: the largest absolute difference between the two
outputs' tensors (float32), and each run's wall time and peak RSS (``wait4``'s ``ru_maxrss`` of the process and the
children it waited for). DARE is left out: the two draw their random masks from different generators.

Set-up (mergekit in its own environment, sharing this one's torch and transformers)::

    python -m venv benchmarks/.mergekit-venv
    python -c "import site; print(site.getsitepackages()[0])" > \\
        benchmarks/.mergekit-venv/lib/python3.11/site-packages/rayfuse-main-venv.pth
    benchmarks/.mergekit-venv/bin/pip install --no-deps <a checkout of arcee-ai/mergekit> && \\
        benchmarks/.mergekit-venv/bin/pip install immutables==0.21 "pydantic~=2.10.6"

Usage::

    python benchmarks/finetunes/compare_mergekit.py [--hidden 64 --layers 2] [--models 3] [--threads 2]
    python benchmarks/finetunes/compare_mergekit.py --quick   # hidden 32, 1 layer, 2 fine-tunes, linear and ties

Writes ``benchmarks/results/finetunes/compare_mergekit.json`` (``--quick`` or ``--out DIR``: to that folder, with the
models) and prints a markdown table. Without mergekit's environment only rayfuse's merges run (a line says so), and
each output is checked: every tensor of the base is there, finite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MERGEKIT = ROOT / "benchmarks" / ".mergekit-venv" / "bin" / "mergekit-yaml"
RESULTS = ROOT / "benchmarks" / "results" / "finetunes" / "compare_mergekit.json"


def build(work: Path, hidden: int, layers: int, models: int) -> None:
    """The base and its perturbed copies as sharded folders."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 32),
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(work / "base", max_shard_size="50MB")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(models):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        model.save_pretrained(work / f"ft{i}", max_shard_size="50MB")
        model.load_state_dict(state)


def configs(work: Path, models: int) -> dict[str, dict[str, Any]]:
    base = str(work / "base")
    fts = [str(work / f"ft{i}") for i in range(models)]
    return {
        "linear": {
            "merge_method": "linear",
            "models": [{"model": m, "parameters": {"weight": float(i + 1)}} for i, m in enumerate(fts)],
            "dtype": "float32",
        },
        "task_arithmetic": {
            "merge_method": "task_arithmetic",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"lambda": 0.8},
            "models": [{"model": m, "parameters": {"weight": 0.5 + 0.25 * i}} for i, m in enumerate(fts)],
        },
        "ties": {
            "merge_method": "ties",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"normalize": True},
            "models": [
                {"model": m, "parameters": {"weight": 1.0, "density": [{"filter": "mlp", "value": 0.3}, {"value": 0.6}]}} for m in fts
            ],
        },
        "slerp": {
            "merge_method": "slerp",
            "base_model": base,
            "dtype": "float32",
            "models": [{"model": base}, {"model": fts[0]}],
            "parameters": {
                "t": [{"filter": "self_attn", "value": [0.0, 0.5, 1.0]}, {"filter": "mlp", "value": [1.0, 0.5, 0.0]}, {"value": 0.5}]
            },
        },
    }


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Run ``cmd``; return its wall time, peak RSS (bytes, the process and the children it waited for) and stderr's tail."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        err.seek(0)
        tail = err.read().decode(errors="replace")[-1500:]
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[0]} failed: {tail}")
    return wall, usage.ru_maxrss * 1024, tail


def tensors(folder: Path) -> dict[str, Any]:
    from safetensors import safe_open

    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[key] = handle.get_tensor(key)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=None, help="default 64; --quick 32")
    parser.add_argument("--layers", type=int, default=None, help="default 2; --quick 1")
    parser.add_argument("--models", type=int, default=None, help="default 3; --quick 2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="*", default=None, help="default linear task_arithmetic ties slerp; --quick linear ties")
    parser.add_argument("--work", type=Path, default=None, help="a folder for the models (default: a temporary one, removed)")
    parser.add_argument("--build", type=Path, default=None, help=argparse.SUPPRESS)  # the subprocess that builds the models
    parser.add_argument("--quick", action="store_true", help="hidden 32, 1 layer, 2 fine-tunes, linear and ties; to --out")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results and the models (--quick: a temporary one)")
    args = parser.parse_args()
    quick = {"hidden": 32, "layers": 1, "models": 2, "methods": ["linear", "ties"]}
    full = {"hidden": 64, "layers": 2, "models": 3, "methods": ["linear", "task_arithmetic", "ties", "slerp"]}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.build is not None:
        build(args.build, args.hidden, args.layers, args.models)
        return
    results = RESULTS
    if args.quick or args.out is not None:
        args.out = Path(args.out or tempfile.mkdtemp(prefix="rayfuse-bench-quick-"))
        args.work = args.work or args.out / "models"
        results = args.out / "compare_mergekit.json"
    if not MERGEKIT.exists():
        print(f"mergekit not run: it is not installed in {MERGEKIT.parent.parent} (see this script's docstring); rayfuse's merges only")
    import yaml

    work = args.work or Path(tempfile.mkdtemp(prefix="rayfuse-mergekit-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the models are built in a subprocess and compared after every run: this process stays small while it spawns the
    # runs (a child's ru_maxrss starts from its parent's resident size at the fork)
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--build",
            str(work),
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
            "--models",
            str(args.models),
        ],
        check=True,
        env=env,
    )
    size = sum(f.stat().st_size for f in (work / "base").glob("*.safetensors"))
    runs = {}
    for name, config in configs(work, args.models).items():
        if name not in args.methods:
            continue
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        for out in ("mk", "rf"):
            shutil.rmtree(work / f"{name}-{out}", ignore_errors=True)
        mk_wall, mk_rss = float("nan"), 0
        if MERGEKIT.exists():
            mk_wall, mk_rss, _ = timed(
                [str(MERGEKIT), str(path), str(work / f"{name}-mk"), "--out-shard-size", "2B", "--no-copy-tokenizer"], env
            )
        rf_config = work / f"{name}-rf.yaml"
        rf_config.write_text(yaml.safe_dump({**config, "threads": args.threads}))
        rf_wall, rf_rss, _ = timed([sys.executable, "-m", "rayfuse", "fuse", str(rf_config), str(work / f"{name}-rf")], env)
        runs[name] = (mk_wall, mk_rss, rf_wall, rf_rss)
    rows = []
    for name, (mk_wall, mk_rss, rf_wall, rf_rss) in runs.items():
        b = tensors(work / f"{name}-rf")
        base = tensors(work / "base")
        lost = sorted(set(base) - set(b))
        nonfinite = sorted(k for k, t in b.items() if not bool(t.float().isfinite().all()))
        if lost or nonfinite:
            sys.exit(f"{name}: rayfuse's output lacks {lost[:5]} or has non-finite tensors {nonfinite[:5]}")
        row: dict[str, Any] = {"method": name, "tensors": len(b), "rayfuse_s": rf_wall, "rayfuse_rss_mib": rf_rss / 2**20}
        if MERGEKIT.exists():
            a = tensors(work / f"{name}-mk")
            row.update(
                names_differ=sorted(set(a) ^ set(b))[:5],
                max_abs_diff=max(float((a[k].float() - b[k].float()).abs().max()) for k in a if k in b),
                mergekit_s=mk_wall,
                mergekit_rss_mib=mk_rss / 2**20,
            )
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "hidden": args.hidden,
                "layers": args.layers,
                "models": args.models,
                "threads": args.threads,
                "base_mib": size / 2**20,
                "cpus": os.cpu_count(),
                "mergekit": MERGEKIT.exists(),
                "rows": rows,
            },
            indent=2,
        )
    )
    print(
        f"\nLlama-style, hidden {args.hidden}, {args.layers} layers, {size / 2**20:.1f} MiB per model, {args.models} fine-tunes, "
        f"rayfuse threads {args.threads}, {os.cpu_count()} CPUs\n"
    )
    print("| merge | tensors | max abs difference | mergekit s | rayfuse s | mergekit peak RSS MiB | rayfuse peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mk = f"{r['max_abs_diff']:.3g} | {r['mergekit_s']:.1f}" if "mergekit_s" in r else "(mergekit not run) | -"
        mk_rss = f"{r['mergekit_rss_mib']:.0f}" if "mergekit_rss_mib" in r else "-"
        print(f"| {r['method']} | {r['tensors']} | {mk} | {r['rayfuse_s']:.1f} | {mk_rss} | {r['rayfuse_rss_mib']:.0f} |")
    print(f"wrote {results}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
