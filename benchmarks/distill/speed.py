"""Speed of distillation: the teachers batched against a loop, the bank against per-step teacher calls, and the
predictions-only mode on a local Ray against the parameter upload.

Three measurements, each against a reference run side by side in the same process:

1. **Batched teachers** (``Teachers(batched=True)``: each architecture's members stacked and one ``vmap``-ed
   ``functional_call``) against a loop over the teachers (``batched=False``): the teachers' own work (a bank's
   predictions; a generator step's forward and backward), and the time of a fixed number of student steps of public
   distillation (``distill_public``) and of data-free distillation (``distill_synthetic``, where every generator step
   runs the teachers forward and backward), for K = 2, 5, 10 teachers.
2. **The bank** (rayfuse: the teachers predict once per epoch on the epoch's whole bank, in chunks) against FedDF's
   per-step evaluation (every student step runs the K teachers on its batch in a Python loop), public transfer.
3. **Predictions only on Ray**: ``rayfuse.run`` of one config on a local Ray with ``distill`` twice, ``teachers:
   parameters`` and ``teachers: clients`` (one call per client per epoch), the methods' wall times from the run.

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/speed.py [--teachers 2 5 10] [--archs cnn rescnn] [--device cuda]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/speed.py --ray      # the predictions-only measurement only
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/speed.py --quick    # mlp, K = 2, one pass; a small run on Ray

Writes ``docs/results/distill/speed.md`` and ``benchmarks/results/distill_speed.json`` (``--quick`` or ``--out DIR``:
both to that folder; ``--quick``'s run on Ray: 3 clients trained 2 epochs, 100 student steps).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "aligned"))
sys.path.insert(0, str(HERE.parent))
from _common import add_quick_arguments, machine_info, out_dir, write_results  # noqa: E402
from arch import build_arch  # noqa: E402

from rayfuse.fusion.distill.algorithm import DistillParams  # noqa: E402
from rayfuse.fusion.distill.student import distill_public, distill_synthetic  # noqa: E402
from rayfuse.fusion.distill.teachers import Teachers, combine_teachers, distillation_loss  # noqa: E402

OUT = HERE.parents[1] / "docs" / "results" / "distill" / "speed.md"
KWARGS = {"mlp": {"hidden": 64}, "cnn": {"width": 16}, "rescnn": {"width": 16}}


def spec_of(arch: str) -> dict[str, Any]:
    return {"arch": arch, "kwargs": KWARGS[arch], "input_shape": [1, 8, 8], "num_classes": 10}


def teachers_of(arch: str, k: int, device: str) -> list[torch.nn.Module]:
    return [build_arch(spec_of(arch), seed=i).to(device).eval() for i in range(k)]


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def batched_vs_loop(arch: str, k: int, device: str, repeats: int) -> dict[str, Any]:
    """Seconds of public and data-free distillation with the teachers batched and in a loop (best of ``repeats``)."""
    X = np.random.default_rng(0).random((300, 1, 8, 8), dtype=np.float32)
    weights = np.full((k, 10), 1.0 / k, np.float32)
    public = DistillParams(steps=200, epochs=2).settings(0)
    free = DistillParams(steps=60, epochs=1, generator_steps=10, student_steps=20).settings(0, transfer="synthetic")
    row: dict[str, Any] = {"arch": arch, "teachers": k, "device": device}
    for mode in ("batched", "loop"):
        for what, run in (
            ("public", lambda t: distill_public(build_arch(spec_of(arch), seed=99), t, X, weights, public, device=device)),
            ("synthetic", lambda t: distill_synthetic(build_arch(spec_of(arch), seed=99), t, (1, 8, 8), weights, free, device=device)),
        ):
            seconds = min(
                timed(lambda: run(Teachers(teachers_of(arch, k, device), batched=mode == "batched", device=device))) for _ in range(repeats)
            )
            row[f"{what}_{mode}_s"] = round(seconds, 3)
    for what in ("public", "synthetic"):
        row[f"{what}_loop_over_batched"] = round(row[f"{what}_loop_s"] / row[f"{what}_batched_s"], 2)
    return row


def teachers_alone(arch: str, k: int, device: str, repeats: int) -> dict[str, Any]:
    """The teachers' own work, batched against the loop: a bank's predictions (12,800 inputs, chunks of 256) and one
    generator step's forward and backward through them (128 inputs, BatchNorm statistics included)."""
    X = torch.rand((12800, 1, 8, 8), generator=torch.Generator().manual_seed(0)).to(device)
    row: dict[str, Any] = {"arch": arch, "teachers": k, "device": device}
    for mode in ("batched", "loop"):
        teachers = Teachers(teachers_of(arch, k, device), batched=mode == "batched", device=device)

        def step() -> None:
            x = X[:128].clone().requires_grad_(True)
            logits, gaps = teachers.forward(x, with_bn=True)
            (logits.sum() + gaps.sum()).backward()

        row[f"predict_{mode}_s"] = round(min(timed(lambda: teachers.predict(X)) for _ in range(repeats)), 4)
        row[f"step_{mode}_s"] = round(min(timed(lambda: [step() for _ in range(20)]) for _ in range(repeats)) / 20, 5)
    row["predict_loop_over_batched"] = round(row["predict_loop_s"] / row["predict_batched_s"], 2)
    row["step_loop_over_batched"] = round(row["step_loop_s"] / row["step_batched_s"], 2)
    return row


def bank_vs_per_step(arch: str, k: int, device: str, steps: int = 200, batch: int = 64) -> dict[str, Any]:
    """Public distillation, ``steps`` steps: rayfuse's bank (one teacher pass per epoch, chunks of 256) against FedDF's
    per-step loop over the teachers on each batch; the same augmentation-free inputs and student updates."""
    X = torch.rand((steps * batch, 1, 8, 8), generator=torch.Generator().manual_seed(0)).to(device)
    weights = torch.full((k, 10), 1.0 / k, device=device)
    models = teachers_of(arch, k, device)

    def per_step() -> None:
        student = build_arch(spec_of(arch), seed=99).to(device)
        opt = torch.optim.Adam(student.parameters(), lr=3e-3)
        for i in range(steps):
            xb = X[i * batch : (i + 1) * batch]
            with torch.no_grad():
                target = combine_teachers(torch.stack([m(xb) for m in models]), weights)
            loss = distillation_loss(student(xb), target, 4.0)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def banked() -> None:
        student = build_arch(spec_of(arch), seed=99).to(device)
        opt = torch.optim.Adam(student.parameters(), lr=3e-3)
        target = combine_teachers(Teachers(models, batched=False, device=device).predict(X), weights)
        for i in range(steps):
            loss = distillation_loss(student(X[i * batch : (i + 1) * batch]), target[i * batch : (i + 1) * batch], 4.0)
            opt.zero_grad()
            loss.backward()
            opt.step()

    per_step_s, banked_s = min(timed(per_step) for _ in range(2)), min(timed(banked) for _ in range(2))
    return {
        "arch": arch,
        "teachers": k,
        "per_step_s": round(per_step_s, 3),
        "bank_s": round(banked_s, 3),
        "per_step_over_bank": round(per_step_s / banked_s, 2),
    }


def predictions_only_on_ray(clients: int = 5, *, quick: bool = False) -> dict[str, Any]:
    """``distill`` with the parameters uploaded and with predictions only, on a local Ray (one run, both methods);
    ``quick``: 3 clients trained 2 epochs, 100 student steps."""
    if quick:
        clients = 3
    import rayfuse

    config = {
        "run": {"name": "distill-speed", "seed": 0},
        "data": {"dataset": "digits", "public_size": 300},
        "partition": {"method": "dirichlet", "num_clients": clients, "alpha": 0.5},
        "model": {"name": "mlp", "hidden": [64, 64]},
        "train": {"epochs": 2 if quick else 20},
        "federation": {"backend": "ray", "ray_init": {"num_cpus": 2, "include_dashboard": False}},
        "methods": {
            "parameters": {"method": "distill", "init": "random", **({"steps": 100} if quick else {})},
            "clients": {"method": "distill", "init": "random", "teachers": "clients", **({"steps": 100} if quick else {})},
        },
    }
    with tempfile.TemporaryDirectory(prefix="distill-speed-") as tmp, contextlib.redirect_stdout(io.StringIO()):
        result = rayfuse.run(config, run_dir=Path(tmp) / "run", quiet=True)
    methods = result.results["methods"]
    row = {
        label: {"seconds": float(methods[label]["seconds"]), "accuracy": float(result.metrics.loc[label, "accuracy"])}
        for label in ("parameters", "clients")
    }
    return {"num_clients": clients, **row, "clients_over_parameters": round(row["clients"]["seconds"] / row["parameters"]["seconds"], 2)}


def write_markdown(payload: dict[str, Any], path: Path = OUT) -> Path:
    info = payload["machine"]
    lines = [
        "# Distillation: speed",
        "",
        f"{info['cpus']} CPUs, {info.get('cpu_model', '')}, torch {torch.__version__}; produced by `benchmarks/distill/speed.py` "
        "(best of repeated runs; seconds).",
        "",
    ]
    if payload.get("batched"):
        lines += [
            "## Teachers batched (`vmap`) against a loop over the teachers",
            "",
            "Public: 200 student steps (2 epochs, 300 inputs); synthetic: 60 student steps and 30 generator steps (every "
            "generator step runs the teachers forward and backward).",
            "",
            "| arch | K | device | public batched | public loop | loop / batched | synthetic batched | synthetic loop | loop / batched |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['arch']} | {r['teachers']} | {r['device']} | {r['public_batched_s']} | {r['public_loop_s']} | "
            f"{r['public_loop_over_batched']} | {r['synthetic_batched_s']} | {r['synthetic_loop_s']} | {r['synthetic_loop_over_batched']} |"
            for r in payload["batched"]
        ]
    if payload.get("teachers"):
        lines += [
            "",
            "## The teachers alone",
            "",
            "A bank's predictions (12,800 inputs in chunks of 256, no gradient) and one generator step through the teachers "
            "(128 inputs, forward with the BatchNorm statistics and backward to the inputs), batched against the loop.",
            "",
            "| arch | K | predict batched | predict loop | loop / batched | step batched | step loop | loop / batched |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['arch']} | {r['teachers']} | {r['predict_batched_s']} | {r['predict_loop_s']} | {r['predict_loop_over_batched']} | "
            f"{r['step_batched_s']} | {r['step_loop_s']} | {r['step_loop_over_batched']} |"
            for r in payload["teachers"]
        ]
    if payload.get("bank"):
        lines += [
            "",
            "## The bank against per-step teacher calls (FedDF's loop)",
            "",
            "Public transfer, 200 steps of 64: rayfuse evaluates the teachers once on the epoch's bank; the reference runs the "
            "K teachers on each step's batch.",
            "",
            "| arch | K | per step | bank | per step / bank |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['arch']} | {r['teachers']} | {r['per_step_s']} | {r['bank_s']} | {r['per_step_over_bank']} |" for r in payload["bank"]
        ]
    if payload.get("ray"):
        r = payload["ray"]
        lines += [
            "",
            "## Predictions only, on a local Ray",
            "",
            f"`rayfuse.run` on a local Ray, {r['num_clients']} clients, mlp on digits, 300 public inputs, 2000 student steps, 10 "
            "epochs: the method's wall time with the local models uploaded (`teachers: parameters`) and with one call per "
            "client per epoch (`teachers: clients`).",
            "",
            "| teachers | seconds | accuracy |",
            "|---|---|---|",
            f"| parameters | {r['parameters']['seconds']:.2f} | {r['parameters']['accuracy']:.4f} |",
            f"| clients | {r['clients']['seconds']:.2f} | {r['clients']['accuracy']:.4f} |",
            "",
            f"Predictions only takes {r['clients_over_parameters']}x the parameter upload's time. The upload's time includes "
            "fetching the clients' local models (once per run) and evaluating the teachers on the coordinator; with "
            "predictions only the clients evaluate their own models in parallel and return logits only. The two methods' "
            "seeds derive from their labels, so their transfer banks (and accuracies) differ; `tests/fusion/distill/test_distill.py` "
            "checks that with one seed the two students are equal.",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teachers", nargs="+", type=int, default=None, help="K (default 2 5 10; --quick 2)")
    parser.add_argument("--archs", nargs="+", default=None, choices=sorted(KWARGS), help="default mlp cnn rescnn; --quick mlp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=None, help="default 2; --quick 1")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ray", action="store_true", help="only the predictions-only measurement on a local Ray")
    parser.add_argument("--no-ray", action="store_true", help="skip the measurement on Ray")
    parser.add_argument("--render", action="store_true", help="only write the markdown from benchmarks/results/distill_speed.json")
    add_quick_arguments(parser, "mlp, K = 2, one pass, and a small predictions-only run on Ray")
    args = parser.parse_args()
    for key, full, quick in (("teachers", [2, 5, 10], [2]), ("archs", ["mlp", "cnn", "rescnn"], ["mlp"]), ("repeats", 2, 1)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    raw_dir = None if args.out is None and not args.quick else out_dir(args.out, args.quick)
    markdown = OUT if raw_dir is None else raw_dir / "speed.md"
    torch.set_num_threads(args.threads)
    if args.render:
        import json

        raw = (raw_dir or HERE.parent / "results") / "distill_speed.json"
        print(f"wrote {write_markdown(json.loads(raw.read_text(encoding='utf-8')), markdown)}")
        return
    payload: dict[str, Any] = {"machine": machine_info(), "batched": [], "teachers": [], "bank": []}
    if not args.ray:
        for arch in args.archs:
            for k in args.teachers:
                payload["teachers"].append(teachers_alone(arch, k, args.device, args.repeats))
                print(payload["teachers"][-1], flush=True)
                payload["batched"].append(batched_vs_loop(arch, k, args.device, args.repeats))
                print(payload["batched"][-1], flush=True)
            payload["bank"].append(bank_vs_per_step(arch, max(args.teachers), args.device))
            print(payload["bank"][-1], flush=True)
    if not args.no_ray:
        payload["ray"] = predictions_only_on_ray(quick=args.quick)
        print(payload["ray"], flush=True)
    print(f"wrote {write_markdown(payload, markdown)}\nwrote {write_results('distill_speed', payload, raw_dir)}")


if __name__ == "__main__":
    main()
