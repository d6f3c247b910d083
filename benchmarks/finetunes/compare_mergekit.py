"""rayfuse's fine-tune merges against mergekit's on the same Hugging Face folders: equal tensors, wall time, peak RSS.

A Llama-style model is built from a config (random weights, nothing downloaded), saved as a sharded folder, and
``--models`` perturbed copies stand for its fine-tunes. Each merge (linear, task_arithmetic, ties, slerp, and
mergekit's others that :mod:`rayfuse.finetunes.mergekit_set` computes: breadcrumbs, breadcrumbs_ties, della,
della_linear, sce, model_stock, karcher, multislerp, nuslerp, nearswap) runs twice from the same YAML, each in a
subprocess of its own (the spectral ``tsv_m``, ``iso_c``, ``iso_cts`` and ``wudi``, which mergekit lacks, run in rayfuse
alone: their time and memory against the bound): mergekit (``mergekit-yaml``, with the Python of ``benchmarks/.mergekit-venv``) and
``rayfuse fuse``. Reported: the largest absolute difference between the two outputs' tensors (float32), and each
run's wall time and peak memory: ``wait4``'s ``ru_maxrss`` (the high-water mark of the largest process among the run
and the children it waited for) and the whole process tree's resident size, summed over its processes every 20 ms
(psutil). rayfuse's merge is also set against its memory bound: its peak less what a process importing what
``rayfuse fuse`` imports holds, over ``max(models + 2, peak) x`` the largest tensor in float32 (``models`` counting the
base; ``peak`` the tensors the merge's registry entry declares it holds at once: ``TensorMerge.peak``).
DARE is left out: the two draw their random masks from different generators. DELLA draws too: for ``della`` and
``della_linear`` the difference is no equality check; the row gives instead the ratio of the merged task vectors'
L1 norms (rayfuse's over mergekit's, over all tensors), which the same drop rates put near 1.

The YAML keep breadcrumbs' ``gamma`` at or above one entry of
the smallest tensor: below (mergekit's default 0.01 on a tensor under 100 entries) mergekit drops the whole task
vector, rayfuse no outlier (``rayfuse/finetunes/mergekit_set.py``). mergekit orders the models of ``sce`` and
``multislerp`` as a Python set does (its order changes with the hash seed of each run), rayfuse as listed: their sums
then differ in the last bits (up to ~6e-8 here); in mergekit's order they are equal to the bit.

Set-up (mergekit in its own environment, sharing this one's torch and transformers; commit ``a6e4028`` of
arcee-ai/mergekit, the one rayfuse's merges follow: the PyPI release 0.1.5 computes ``linear`` in another order and
``slerp`` row by row, so its outputs differ from rayfuse's by up to ~1e-7)::

    python -m venv benchmarks/.mergekit-venv
    python -c "import site; print(site.getsitepackages()[0])" > \\
        benchmarks/.mergekit-venv/lib/python3.11/site-packages/rayfuse-main-venv.pth
    benchmarks/.mergekit-venv/bin/pip install --no-deps <a checkout of arcee-ai/mergekit at a6e4028> && \\
        benchmarks/.mergekit-venv/bin/pip install immutables==0.21 "pydantic~=2.10.6"

Usage::

    python benchmarks/finetunes/compare_mergekit.py [--hidden 64 --layers 2] [--models 3] [--threads 2]
    # the issue's ~1 GB Llama-style model (1.06 GiB in float32, vocabulary 32000, 3 layers)
    python benchmarks/finetunes/compare_mergekit.py --hidden 2048 --intermediate 5632 --vocab 32000 --layers 3 \
        --methods linear task_arithmetic ties slerp
    # the memory bound alone (rayfuse only), at 8 fine-tunes
    python benchmarks/finetunes/compare_mergekit.py --models 8 --rayfuse-only --methods linear task_arithmetic ties

    python benchmarks/finetunes/compare_mergekit.py --quick   # hidden 32, 1 layer, 2 fine-tunes, linear and ties

Writes ``benchmarks/results/finetunes/compare_mergekit.json`` (``--quick`` or ``--out DIR``: to that folder, with the
models) and prints a markdown table. Without mergekit's environment only rayfuse's merges run (a line says so; also
``--rayfuse-only``), and each output is checked: every tensor of the base is there, finite.
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


def build(work: Path, hidden: int, layers: int, models: int, vocab: int = 1024, intermediate: int | None = None) -> None:
    """The base and its perturbed copies as sharded folders."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
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
        # mergekit's other merges (rayfuse.finetunes.mergekit_set: MERGEKIT_SET below)
        "breadcrumbs": {
            "merge_method": "breadcrumbs",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"lambda": 0.9},
            "models": [
                {
                    "model": m,
                    "parameters": {"weight": 0.5 + 0.25 * i, "density": [{"filter": "mlp", "value": 0.4}, {"value": 0.7}], "gamma": 0.05},
                }
                for i, m in enumerate(fts)
            ],
        },
        "breadcrumbs_ties": {
            "merge_method": "breadcrumbs_ties",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"normalize": True, "rescale": True, "density": 0.5, "gamma": 0.1},
            "models": [{"model": m, "parameters": {"weight": 1.0 + 0.5 * i}} for i, m in enumerate(fts)],
        },
        "della": {
            "merge_method": "della",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"density": 0.5, "epsilon": 0.2},
            "models": [{"model": m, "parameters": {"weight": 1.0}} for m in fts],
        },
        "della_linear": {
            "merge_method": "della_linear",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"density": 0.6, "epsilon": 0.15, "lambda": 0.8},
            "models": [{"model": m, "parameters": {"weight": 0.5 + 0.25 * i}} for i, m in enumerate(fts)],
        },
        "sce": {
            "merge_method": "sce",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"select_topk": 0.5},
            "models": [{"model": m} for m in fts],
        },
        "model_stock": {"merge_method": "model_stock", "base_model": base, "dtype": "float32", "models": [{"model": m} for m in fts]},
        "karcher": {"merge_method": "karcher", "base_model": base, "dtype": "float32", "models": [{"model": m} for m in fts]},
        "multislerp": {
            "merge_method": "multislerp",
            "base_model": base,
            "dtype": "float32",
            "models": [{"model": m, "parameters": {"weight": float(i + 1)}} for i, m in enumerate(fts)],
        },
        "nuslerp": {
            "merge_method": "nuslerp",
            "base_model": base,
            "dtype": "float32",
            "models": [{"model": fts[0], "parameters": {"weight": 1.0}}, {"model": fts[-1], "parameters": {"weight": 2.0}}],
        },
        "nearswap": {
            "merge_method": "nearswap",
            "base_model": base,
            "dtype": "float32",
            "parameters": {"t": 0.008},
            "models": [{"model": fts[0]}],
        },
        # the spectral merges mergekit lacks (rayfuse.finetunes.spectral: SPECTRAL below): rayfuse's run alone
        **{
            name: {
                "merge_method": name,
                "base_model": base,
                "dtype": "float32",
                "parameters": {"lambda": 0.5},
                "models": [{"model": m} for m in fts],
            }
            for name in ("tsv_m", "iso_c", "iso_cts", "wudi")
        },
    }


# mergekit has none of these: their rows give rayfuse's time and memory against its bound, no equality
SPECTRAL = ("tsv_m", "iso_c", "iso_cts", "wudi")


MERGEKIT_SET = (
    "breadcrumbs",
    "breadcrumbs_ties",
    "della",
    "della_linear",
    "sce",
    "model_stock",
    "karcher",
    "multislerp",
    "nuslerp",
    "nearswap",
)


def peak_of(name: str, models: int) -> float:
    """The tensors of the largest one's size a merge declares it holds at once (its registry entry's ``peak``)."""
    from rayfuse.merging import get_merge

    merge = get_merge(name).tensor
    return merge.peak(models) if merge is not None else models + 2.0


RANDOM = ("della", "della_linear")


def _tree_rss(pid: int) -> int:
    """The resident size of ``pid`` and all its descendants, summed (bytes; 0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str, int]:
    """Run ``cmd``; return its wall time, peak RSS (bytes, ``ru_maxrss``: the largest of the process and the children it
    waited for), stderr's tail and the process tree's summed RSS at its largest (sampled every 20 ms)."""
    import threading

    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        tree = [0]
        running = threading.Event()
        running.set()

        def sample() -> None:
            while running.is_set():
                tree[0] = max(tree[0], _tree_rss(proc.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        running.clear()
        sampler.join()
        err.seek(0)
        tail = err.read().decode(errors="replace")[-1500:]
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[0]} failed: {tail}")
    return wall, usage.ru_maxrss * 1024, tail, tree[0]


def import_rss(env: dict[str, str]) -> int:
    """The peak RSS of a process that imports what ``rayfuse fuse`` imports and merges nothing (bytes): the registry
    filled, and transformers with the Llama model's module, which the merge imports to check that the base's
    ``config.json`` describes the merged tensors before it copies it (``rayfuse.finetunes.hf.check_config_describes``,
    on the meta device: ~220 MiB of RSS, the same whatever the model's size)."""
    code = (
        "import rayfuse.cli, rayfuse.merging, rayfuse.finetunes.run, safetensors, torch, yaml; "
        "import transformers.models.llama.modeling_llama"
    )
    return timed([sys.executable, "-c", code], env)[1]


def largest_tensor(folder: Path) -> tuple[str, int]:
    """The base's largest tensor: its name and its size in float32 (bytes), from the shards' headers."""
    from rayfuse.finetunes.hf import ModelSource

    source = ModelSource(folder, str(folder))
    name = max(source.tensors, key=lambda n: source.tensors[n].nbytes // torch_itemsize(source.tensors[n].dtype))
    info = source.tensors[name]
    return name, info.nbytes // torch_itemsize(info.dtype) * 4


def torch_itemsize(dtype: str) -> int:
    import torch

    return int(getattr(torch, dtype).itemsize)


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
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=None, help="the MLP's width (default: 2 x hidden)")
    parser.add_argument("--models", type=int, default=None, help="default 3; --quick 2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="*", default=None, help="default all; --quick linear ties")
    parser.add_argument("--rayfuse-only", action="store_true", help="run rayfuse alone (its memory bound; no mergekit, no equality)")
    parser.add_argument("--work", type=Path, default=None, help="a folder for the models (default: a temporary one, removed)")
    parser.add_argument("--out", type=Path, default=None, help="a folder for the JSON (and, with --quick, the models)")
    parser.add_argument(
        "--quick", action="store_true", help="hidden 32, 1 layer, 2 fine-tunes, linear and ties; to --out or a temporary folder"
    )
    parser.add_argument("--build", type=Path, default=None, help=argparse.SUPPRESS)  # the subprocess that builds the models
    args = parser.parse_args()
    quick = {"hidden": 32, "layers": 1, "models": 2, "methods": ["linear", "ties"]}
    full = {"hidden": 64, "layers": 2, "models": 3, "methods": ["linear", "task_arithmetic", "ties", "slerp", *MERGEKIT_SET, *SPECTRAL]}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.build is not None:
        build(args.build, args.hidden, args.layers, args.models, args.vocab, args.intermediate)
        return
    results = RESULTS
    if args.quick or args.out is not None:
        args.out = Path(args.out or tempfile.mkdtemp(prefix="rayfuse-bench-quick-"))
        args.work = args.work or args.out / "models"
        results = args.out / "compare_mergekit.json"
    if not args.rayfuse_only and not MERGEKIT.exists():
        print(f"mergekit not run: it is not installed in {MERGEKIT.parent.parent} (see this script's docstring); rayfuse's merges only")
        args.rayfuse_only = True
    import yaml

    work = args.work or Path(tempfile.mkdtemp(prefix="rayfuse-mergekit-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the models are built in a subprocess and compared after every run: this process stays small while it spawns the
    # runs (a child's ru_maxrss starts from its parent's resident size at the fork)
    if not (work / f"ft{args.models - 1}").is_dir():
        subprocess.run(
            [sys.executable, __file__, "--build", str(work), "--hidden", str(args.hidden), "--layers", str(args.layers)]
            + ["--models", str(args.models), "--vocab", str(args.vocab)]
            + (["--intermediate", str(args.intermediate)] if args.intermediate else []),
            check=True,
            env=env,
        )
    size = sum(f.stat().st_size for f in (work / "base").glob("*.safetensors"))
    largest_name, largest = largest_tensor(work / "base")
    baseline = import_rss(env)
    runs = {}
    for name, config in configs(work, args.models).items():
        if name not in args.methods:
            continue
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        for out in ("mk", "rf"):
            shutil.rmtree(work / f"{name}-{out}", ignore_errors=True)
        mk: tuple[float, int, str, int] = (float("nan"), 0, "", 0)
        if not args.rayfuse_only and name not in SPECTRAL:
            mk = timed([str(MERGEKIT), str(path), str(work / f"{name}-mk"), "--out-shard-size", "2B", "--no-copy-tokenizer"], env)
        rf_config = work / f"{name}-rf.yaml"
        rf_config.write_text(yaml.safe_dump({**config, "threads": args.threads}))
        rf = timed([sys.executable, "-m", "rayfuse", "fuse", str(rf_config), str(work / f"{name}-rf")], env)
        runs[name] = (mk, rf, len(config["models"]) + (1 if "base_model" in config and name != "slerp" else 0))
        # the times and peaks as soon as they are known (the tensors are compared at the end, so that this process stays
        # small while it spawns the runs)
        print(
            json.dumps({"method": name, "mergekit_s": mk[0], "rayfuse_s": rf[0], "mergekit_rss": mk[1], "rayfuse_rss": rf[1]}), flush=True
        )
    import torch  # after the runs (this process stays small while it spawns them)

    rows = []
    for name, (mk, rf, models) in runs.items():
        row: dict[str, Any] = {"method": name, "models_read": models}
        out_tensors, base_tensors = tensors(work / f"{name}-rf"), tensors(work / "base")
        lost = sorted(set(base_tensors) - set(out_tensors))
        nonfinite = sorted(k for k, t in out_tensors.items() if not bool(t.float().isfinite().all()))
        if lost or nonfinite:
            sys.exit(f"{name}: rayfuse's output lacks {lost[:5]} or has non-finite tensors {nonfinite[:5]}")
        del out_tensors, base_tensors
        if not args.rayfuse_only and name not in SPECTRAL:
            a, b = tensors(work / f"{name}-mk"), tensors(work / f"{name}-rf")
            missing = sorted(set(a) ^ set(b))
            row.update(
                tensors=len(a),
                names_differ=missing[:5],
                equal_tensors=sum(bool(torch.equal(a[k], b[k])) for k in a if k in b),
                max_abs_diff=max(float((a[k].float() - b[k].float()).abs().max()) for k in a if k in b),
            )
            if name in RANDOM:  # the merged task vectors' L1 norms, rayfuse's over mergekit's: the drop rates' check
                origin = tensors(work / "base")
                mk_l1 = sum(float((a[k].float() - origin[k].float()).abs().sum()) for k in a if k in b)
                row.update(random=True, l1_ratio=sum(float((b[k].float() - origin[k].float()).abs().sum()) for k in a if k in b) / mk_l1)
                del origin
            del a, b
        bound = max(models + 2, peak_of(name, models)) * largest  # the runner's budget (rayfuse.finetunes.run)
        if not args.rayfuse_only and name not in SPECTRAL:
            row.update(mergekit_s=mk[0], speedup=mk[0] / rf[0], mergekit_rss_mib=mk[1] / 2**20, mergekit_tree_rss_mib=mk[3] / 2**20)
        row.update(
            rayfuse_s=rf[0],
            rayfuse_rss_mib=rf[1] / 2**20,
            rayfuse_tree_rss_mib=rf[3] / 2**20,
            rayfuse_merge_mib=(rf[1] - baseline) / 2**20,
            bound_mib=None if bound is None else bound / 2**20,
            merge_over_bound=None if bound is None else (rf[1] - baseline) / bound,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        for out in ("mk", "rf"):
            shutil.rmtree(work / f"{name}-{out}", ignore_errors=True)
    load = os.getloadavg()
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "hidden": args.hidden,
                "layers": args.layers,
                "vocab": args.vocab,
                "intermediate": args.intermediate or 2 * args.hidden,
                "models": args.models,
                "threads": args.threads,
                "base_mib": size / 2**20,
                "largest_tensor": largest_name,
                "largest_f32_mib": largest / 2**20,
                "import_rss_mib": baseline / 2**20,
                "cpus": os.cpu_count(),
                "loadavg_at_end": load,
                "mergekit": not args.rayfuse_only,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(
        f"\nLlama-style, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, {size / 2**20:.1f} MiB per model, "
        f"{args.models} fine-tunes, largest tensor {largest_name} ({largest / 2**20:.0f} MiB in float32), rayfuse threads "
        f"{args.threads}, {os.cpu_count()} CPUs, imports {baseline / 2**20:.0f} MiB, load average at the end {load[0]:.1f}\n"
    )
    print(
        "| merge | max abs difference | mergekit s | rayfuse s | speed-up | mergekit peak RSS MiB | rayfuse peak RSS MiB "
        "| rayfuse merge MiB (peak - imports) | bound max(models + 2, peak) x largest MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        diff = f"{r.get('max_abs_diff', float('nan')):.3g}"
        if r.get("random"):
            diff += f" (random draws; L1 ratio {r['l1_ratio']:.4f})"
        method = r["method"]
        bound_cell = "n/a" if r["bound_mib"] is None else f"{r['bound_mib']:.0f}"
        print(
            f"| {method} | {diff} | {r.get('mergekit_s', float('nan')):.1f} | "
            f"{r['rayfuse_s']:.1f} | {r.get('speedup', float('nan')):.2f}x | {r.get('mergekit_rss_mib', float('nan')):.0f} | "
            f"{r['rayfuse_rss_mib']:.0f} | {r['rayfuse_merge_mib']:.0f} | {bound_cell} |"
        )
    print(f"wrote {results}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
