"""The fine-tune merges stream: their peak memory follows the largest tensor, not the models' total size nor their
number, and the in-place streaming forms compute mergekit's stacked formulas to the bit.

The peak is measured in a fresh process (VmHWM, reset with ``/proc/self/clear_refs`` before each merge) on models
written here: many small tensors against one large tensor among few small ones, and 3 against 8 fine-tunes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from rayfuse.finetunes.config import TASK_VECTOR_METHODS, TaskVectorMethod
from rayfuse.finetunes.run import all_finite
from rayfuse.finetunes.taskvec import linear, linear_stream, slerp, slerp_owned, task_vector_merge, task_vector_merge_stream

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def _stacked(
    base: torch.Tensor,
    tuned: Sequence[torch.Tensor],
    weights: Sequence[float],
    densities: Sequence[float],
    method: TaskVectorMethod,
    normalize: bool,
    lam: float,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """mergekit's general task arithmetic written out as it computes it: every task vector trimmed (argsort and a 0/1
    mask, or a Bernoulli mask, rescaled to its L1 norm for DARE), stacked, weighted, the sign elected from the stack's
    sum, then the masked sum over the stack."""
    deltas = []
    for i, (x, density) in enumerate(zip(tuned, densities)):
        delta = x - base
        if method.sparsify == "magnitude" and density < 1:
            k = int(density * delta.numel())
            mask = torch.zeros_like(delta)
            mask.view(-1)[torch.argsort(delta.abs().view(-1).float(), descending=True)[:k]] = 1
            delta = delta * mask
        elif method.sparsify == "random" and density < 1:
            assert generators is not None
            mask = torch.bernoulli(torch.full_like(delta, density), generator=generators[i])
            before = delta.abs().sum()
            delta = delta * mask
            after = delta.abs().sum()
            if not (before < 1e-7 or after < 1e-7):
                delta = delta * (before / after)
        deltas.append(delta)
    stack = torch.stack(deltas, dim=0)
    w = torch.tensor(list(weights), dtype=stack.dtype)
    while w.dim() < stack.dim():
        w = w.unsqueeze(-1)
    weighted = stack * w
    if method.consensus:
        sign = weighted.sign()
        majority = (weighted.sum(dim=0) >= 0).to(weighted.dtype) * 2 - 1
        mask = sign == majority
        mixed = (weighted * mask).sum(dim=0)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = weighted.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    if lam != 1:
        mixed = mixed * lam
    return base + mixed


def _ties_inputs(models: int, n: int = 20_000, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A base and ``models`` fine-tunes whose task vectors are rounded to a coarse grid: many exact ties in magnitude,
    so that the trim's boundary falls inside a run of equal entries (where only argsort's own order decides)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(40, n // 40, generator=g)
    tuned = [base + (torch.randn(base.shape, generator=g) * 64).round() / 2048 for _ in range(models)]
    return base, tuned


@pytest.mark.parametrize("models", [3, 8])
@pytest.mark.parametrize("name", ["task_arithmetic", "ties", "dare_linear", "dare_ties"])
def test_the_streaming_merge_is_the_stacked_formula_to_the_bit(name: str, models: int) -> None:
    base, tuned = _ties_inputs(models)
    method = TASK_VECTOR_METHODS[name]
    weights = [0.5 + 0.25 * i for i in range(models)]
    densities = [0.3 + 0.05 * i for i in range(models)]
    seeds = [11 + i for i in range(models)]
    rescale = "l1" if method.rescale else None
    expected = _stacked(base, tuned, weights, densities, method, method.normalize, 0.8, [torch.Generator().manual_seed(s) for s in seeds])
    loads: list[int] = []

    def loader(i: int, x: torch.Tensor):  # type: ignore[no-untyped-def]
        def load() -> torch.Tensor:
            loads.append(i)
            return x.clone()

        return load

    got = task_vector_merge_stream(
        loader(-1, base),
        [loader(i, x) for i, x in enumerate(tuned)],
        weights,
        densities,
        method,
        normalize=method.normalize,
        lam=0.8,
        rescale=rescale,
        generators=[torch.Generator().manual_seed(s) for s in seeds],
    )
    assert got.shape == base.shape and torch.isfinite(got).all()
    assert torch.equal(got, expected), float((got - expected).abs().max())
    # the out-of-place form (copies of the inputs) is the same, and leaves its inputs as they were
    before = [x.clone() for x in tuned]
    again = task_vector_merge(
        base,
        tuned,
        weights,
        densities,
        method,
        normalize=method.normalize,
        lam=0.8,
        rescale=rescale,
        generators=[torch.Generator().manual_seed(s) for s in seeds],
    )
    assert torch.equal(again, expected)
    assert all(torch.equal(a, b) for a, b in zip(before, tuned))
    if method.consensus:  # each model read once per pass (trim, sign election, masked sum), never all held at once
        assert sorted(i for i in loads if i >= 0) == sorted(list(range(models)) * 3)
    else:
        assert loads == [-1, *range(models)]


@pytest.mark.parametrize("kind", ["continuous", "zeros-at-the-cut", "ties-at-the-cut"])
def test_the_trim_by_selection_keeps_argsorts_top_k_and_sorts_only_to_break_a_tie(kind: str, monkeypatch) -> None:
    """TIES's trim finds the k-th largest magnitude by selection; it sorts (as mergekit does) only where nonzero
    magnitudes tie across the cut."""
    import rayfuse.finetunes.taskvec as taskvec

    g = torch.Generator().manual_seed(3)
    delta = torch.randn(5000, generator=g)
    if kind == "zeros-at-the-cut":
        delta[torch.randperm(5000, generator=g)[:3000]] = 0.0  # 40 % nonzero, 60 % kept: the cut is at 0
    elif kind == "ties-at-the-cut":
        delta = (delta * 4).round() / 4  # a coarse grid: runs of equal magnitudes
    density = 0.6 if kind == "zeros-at-the-cut" else 0.3
    k = int(density * delta.numel())
    mask = torch.zeros_like(delta)
    mask[torch.argsort(delta.abs().float(), descending=True)[:k]] = 1  # mergekit's trim
    expected = delta * mask
    sorted_calls: list[int] = []
    sort = taskvec._magnitude_sorted_
    monkeypatch.setattr(taskvec, "_magnitude_sorted_", lambda *a: (sorted_calls.append(1), sort(*a))[1])
    got = taskvec.sparsify_magnitude(delta, density)
    assert torch.equal(got, expected)
    assert bool(sorted_calls) == (kind == "ties-at-the-cut")


def test_linear_and_slerp_in_place_equal_their_formulas() -> None:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(64, 33, generator=g) for _ in range(8)]
    weights = [1.0 + i for i in range(8)]
    stack = torch.stack(xs)
    w = torch.tensor(weights).reshape(-1, 1, 1)
    expected = (w * stack).sum(dim=0) / w.sum(dim=0)
    assert torch.equal(linear_stream([lambda x=x: x.clone() for x in xs], weights), expected)  # type: ignore[misc]
    assert torch.equal(linear(xs, weights), expected)
    for t, far in ((0.3, False), (0.7, True)):
        a, b = xs[0], (torch.randn(64, 33, generator=g) if far else xs[0] + 1e-4)
        assert torch.equal(slerp_owned(t, a.clone(), b.clone()), slerp(t, a, b))


def test_torch_primitives_the_streaming_relies_on() -> None:
    """In-place sort gives argsort's permutation (ties included), bernoulli_ into its probabilities draws
    torch.bernoulli's mask, and a sum over the models' axis adds them one by one from zero (below 16 models)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(300_000, generator=g) * 64).round()  # many ties
    values, order = x.abs(), torch.empty(x.numel(), dtype=torch.long)
    torch.sort(values, descending=True, out=(values, order))
    assert torch.equal(order, torch.argsort(x.abs(), descending=True))
    p = torch.full((100_000,), 0.3)
    expected = torch.bernoulli(p, generator=torch.Generator().manual_seed(9))
    assert torch.equal(p.bernoulli_(p, generator=torch.Generator().manual_seed(9)), expected)
    for models in (3, 8, 15):
        stack = torch.randn(models, 100_000, generator=g) * torch.rand(models, 1, generator=g) * 100
        running = torch.zeros(100_000)
        for row in stack:
            running.add_(row)
        assert torch.equal(running, stack.sum(dim=0))


def test_all_finite_checks_every_entry_even_when_the_sum_overflows() -> None:
    x = torch.ones(3_000_000)
    assert all_finite(x)
    x[2_500_000] = float("nan")
    assert not all_finite(x)
    big = torch.full((10,), 3e38)  # finite entries whose sum overflows
    assert all_finite(big)
    big[7] = float("-inf")
    assert not all_finite(big)


_MEASURE = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file

    root = Path(sys.argv[1])
    g = torch.Generator().manual_seed(0)

    def write(kind, models, tensors):
        folder = root / kind
        folder.mkdir(exist_ok=True)
        base = {name: torch.randn(shape, generator=g) for name, shape in tensors.items()}
        save_file(base, str(folder / "base.safetensors"))
        for k in range(models):
            save_file({n: v + 0.01 * torch.randn(v.shape, generator=g) for n, v in base.items()}, str(folder / f"ft{k}.safetensors"))

    small = {f"model.layers.{i}.w": (16, 1024) for i in range(512)}  # 512 tensors of 64 KiB: 32 MiB a model
    large = {"model.embed_tokens.weight": (4096, 1024), **{f"model.layers.{i}.w": (16, 1024) for i in range(64)}}  # 16 + 4 MiB
    write("small", 3, small)
    write("large", 8, large)

    # each merge in a fresh process: VmHWM less the resident size after the imports (an allocator's freed blocks from
    # an earlier merge in the same process would hide part of the next one's growth)
    code = (
        "import json, os, sys\\n"
        "import rayfuse, rayfuse.finetunes.run, rayfuse.merging\\n"  # everything the merge imports, before the measurement
        "folder, models, method, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]\\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\\n"
        "hwm = lambda: int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024\\n"
        "before = rss()\\n"
        "rayfuse.fuse({'merge_method': method, 'base_model': folder + '/base.safetensors', 'threads': 2, 'output': out,\\n"
        "              'max_shard_size': '50MB', 'models': [{'model': f'{folder}/ft{k}.safetensors',\\n"
        "              'parameters': {'weight': 0.5, 'density': 0.4}} for k in range(models)]})\\n"
        "print(json.dumps(hwm() - before))\\n"
    )
    grew = {}
    for kind, models, method in (("small", 3, "ties"), ("large", 3, "task_arithmetic"), ("large", 3, "ties"), ("large", 8, "ties")):
        out = root / f"out-{kind}-{models}-{method}"
        run = subprocess.run([sys.executable, "-c", code, str(root / kind), str(models), method, str(out)],
                             capture_output=True, text=True, check=True)
        grew[f"{kind}-{models}-{method}"] = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(grew))
""")


def test_the_peak_follows_the_largest_tensor_not_the_total_size_nor_the_number_of_models(tmp_path: Path) -> None:
    """Growth of the peak resident memory during each merge: 4 models of 512 small tensors (128 MiB in all) stay within
    a few MiB, 4 models holding one 16 MiB tensor (80 MiB in all) within ``(models + 2) x 16 MiB`` (TIES: its trim's
    6.5 x, at 4 models), and 9 such models (180 MiB) for TIES no higher than 4."""
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=500,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    grew = {k: v / MIB for k, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}
    # MiB: what a merge holds besides its largest tensors (measured 22-33: thread stacks, glibc's per-thread arenas
    # for the tensors under its 1 MiB mmap threshold, torch's and Python's small blocks)
    slack = 40
    largest = 16
    # many small tensors: a few MiB, although the inputs are more than the large case's
    assert grew["small-3-ties"] < slack, grew
    # one large tensor: at least a copy of it, at most the bound; task arithmetic holds the base, the sum and one model
    assert largest < grew["large-3-task_arithmetic"] <= 3.5 * largest + slack, grew
    assert max(largest, grew["small-3-ties"]) < grew["large-3-ties"] <= 6.5 * largest + slack, grew
    # more models do not raise TIES's peak (each model is read once per pass, the entries it keeps held as bits)
    assert largest < grew["large-8-ties"] <= min((8 + 1 + 2) * largest, grew["large-3-ties"]) + slack, grew
