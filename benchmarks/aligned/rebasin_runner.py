"""The peer tool: rebasin's git-re-basin (Ainsworth et al. 2023) on a folder of checkpoints, in its own virtualenv.

Run with the rebasin virtualenv's Python (it pins its own torch; see benchmarks/README.md, "Aligned fusion")::

    benchmarks/.venv-rebasin/bin/python benchmarks/aligned/rebasin_runner.py CHECKPOINTS ARCH.json OUT \
        [--modes mergemany pcd] [--input-shape 1 8 8] [--max-iterations 100] [--seed 0] [--threads 1]

* ``CHECKPOINTS``: a folder of state dicts, ``*.safetensors`` or ``*.pt`` (read in sorted name order), all of the
  architecture ``ARCH.json`` describes (an arch spec of ``arch.py``: ``{"arch", "kwargs", "input_shape",
  "num_classes"}``).
* ``--input-shape``: one sample's shape for tracing the model (default: the arch spec's ``input_shape``); rebasin
  traces the graph on a batch of two random inputs of that shape.
* ``mergemany``: ``rebasin.MergeMany(models, working_model, input).run(max_iterations, max_iterations_pcd)``, the
  N-way merge (each model permuted in turn onto the mean of the others until no permutation changes). Writes
  ``OUT/mergemany.safetensors``: rebasin's merged model's state dict as rebasin returns it (its parameters are the
  mean of the permuted models; rebasin copies BatchNorm running statistics from one model, so re-estimate them).
* ``pcd`` (two checkpoints only): ``rebasin.PermutationCoordinateDescent(model_a, model_b, input).rebasin()``
  permutes the second model onto the first. Writes ``OUT/pcd_aligned.safetensors`` (model b, permuted) and
  ``OUT/pcd.safetensors`` (the mean of model a and permuted model b: floating-point entries averaged, integer
  buffers from model a).

Writes ``OUT/result.json`` and prints it as the last line of stdout: per mode ``seconds`` (wall time of rebasin's
call, from building its objects to the merged model, excluding reading the checkpoints), ``ok`` and
``max_output_change`` (the largest change of a permuted model's outputs on the tracing input: a permutation that
keeps the function leaves it at rounding level; rebasin's permutations of ``nn.MultiheadAttention`` do not), or ``error``
(the exception rebasin raised, e.g. for an architecture it cannot trace); plus the versions and the thread count.
The exit status is 0 when the runner itself worked, whether or not rebasin handled the architecture.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arch import build_arch, read_arch_spec  # noqa: E402

MODES = ("mergemany", "pcd")


def list_checkpoints(folder: Path) -> list[Path]:
    """The state-dict files of ``folder`` (``*.safetensors``, ``*.pt``, ``*.pth``), sorted by name."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".pt", ".pth") and p.is_file())
    if not files:
        raise SystemExit(f"{folder}: no *.safetensors / *.pt checkpoints")
    return files


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a ``torch.save`` file."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def save_state_dict(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Write a state dict as ``.safetensors`` (contiguous copies)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(path))


def load_models(spec: dict[str, Any], files: list[Path]) -> list[nn.Module]:
    """One model of the arch spec per checkpoint, in eval mode."""
    models = []
    for path in files:
        model = build_arch(spec, seed=0)
        model.load_state_dict(load_state_dict(path))
        models.append(model.eval())
    return models


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Mean of floating-point entries; other entries (``num_batches_tracked``) from the first state."""
    out = {}
    for key, value in states[0].items():
        out[key] = torch.stack([s[key] for s in states]).mean(0) if value.is_floating_point() else value.clone()
    return out


@torch.no_grad()
def output_change(before: nn.Module, after: nn.Module, x: torch.Tensor) -> float:
    """Max absolute difference of two models' outputs on ``x`` (eval mode): 0 up to rounding when a permutation
    kept the function, as it must."""
    return float((before.eval()(x) - after.eval()(x)).abs().max())


def run_mergemany(models: list[nn.Module], spec: dict[str, Any], x: torch.Tensor, out: Path, max_iterations: int) -> dict[str, Any]:
    """rebasin's MergeMany on copies of ``models``; write its merged state dict."""
    from rebasin import MergeMany

    copies = [copy.deepcopy(m) for m in models]
    start = time.perf_counter()
    merger = MergeMany(models=copies, working_model=build_arch(spec, seed=0).eval(), input_data=x)
    merged = merger.run(max_iterations=max_iterations, max_iterations_pcd=max_iterations)
    seconds = time.perf_counter() - start
    save_state_dict(out / "mergemany.safetensors", merged.state_dict())
    change = max(output_change(m, c, x) for m, c in zip(models, copies))
    return {"seconds": seconds, "ok": True, "file": "mergemany.safetensors", "max_output_change": change}


def run_pcd(models: list[nn.Module], x: torch.Tensor, out: Path, max_iterations: int) -> dict[str, Any]:
    """rebasin's PermutationCoordinateDescent of model b onto model a; write b permuted and the mean of the two."""
    from rebasin import PermutationCoordinateDescent

    if len(models) != 2:
        return {"ok": False, "error": f"pcd takes two checkpoints, the folder has {len(models)}"}
    model_a, model_b = models[0], copy.deepcopy(models[1])
    start = time.perf_counter()
    pcd = PermutationCoordinateDescent(model_a=model_a, model_b=model_b, input_data_b=x)
    pcd.rebasin(max_iterations=max_iterations)
    seconds = time.perf_counter() - start
    save_state_dict(out / "pcd_aligned.safetensors", model_b.state_dict())
    save_state_dict(out / "pcd.safetensors", average_states([model_a.state_dict(), model_b.state_dict()]))
    return {
        "seconds": seconds,
        "ok": True,
        "file": "pcd.safetensors",
        "aligned_file": "pcd_aligned.safetensors",
        "max_output_change": output_change(models[1], model_b, x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", type=Path, help="folder of *.safetensors / *.pt state dicts")
    parser.add_argument("arch", type=Path, help="arch spec JSON (arch.py)")
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="pcd runs only for two checkpoints")
    parser.add_argument("--input-shape", type=int, nargs="+", default=None, help="one sample's shape (default: the arch spec's)")
    parser.add_argument("--max-iterations", type=int, default=100, help="MergeMany's and each PCD's iteration cap")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order in which MergeMany and PCD visit models and permutations")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    spec = read_arch_spec(args.arch)
    files = list_checkpoints(args.checkpoints)
    models = load_models(spec, files)
    shape = args.input_shape or spec["input_shape"]
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(args.seed))
    args.out.mkdir(parents=True, exist_ok=True)

    result: dict[str, Any] = {
        "rebasin": importlib.metadata.version("rebasin"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "num_models": len(models),
        "arch": spec,
        "checkpoints": [p.name for p in files],
    }
    modes = [m for m in args.modes if m != "pcd" or len(models) == 2]
    for mode in modes:
        torch.manual_seed(args.seed)
        try:
            if mode == "mergemany":
                result[mode] = run_mergemany(models, spec, x, args.out, args.max_iterations)
            else:
                result[mode] = run_pcd(models, x, args.out, args.max_iterations)
        except Exception as exc:  # rebasin cannot handle every architecture: recorded, not fatal
            result[mode] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}".strip()[:500],
                "traceback_tail": traceback.format_exc().strip().splitlines()[-3:],
            }
        run = result[mode]
        status = f"{run['seconds']:.3f} s, max output change {run['max_output_change']:.2e}" if run.get("ok") else f"failed: {run['error']}"
        print(f"rebasin {mode} on {len(models)} x {spec['arch']}: {status}", flush=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
