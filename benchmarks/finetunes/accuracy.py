"""Accuracy of fine-tune merges: sites fine-tune one small pretrained transformer on label-skewed subtasks.

The setting (issue 28's accuracy benchmark), all built here, offline:

* **Model**: a 2-layer ``BertForSequenceClassification`` (hidden 64, 4 heads, intermediate 128) built from a config
  with random weights: a real Hugging Face transformer, saved and read as Hugging Face folders, small enough to
  train on 2 CPU cores.
* **Task**: scikit-learn's bundled 8x8 digits as token sequences: each 2x2 patch of pixels, each pixel quantised to 3
  levels (0-3, 4-11, 12-16), is one of 81 tokens; a sequence is a class token (CLS) and the 16 patches (row-major). The
  test set (the union of the tasks: every class) is a stratified 30 % of the images.
* **Base ("pretrained")**: the model trained on a small stratified sample of the rest (every class) for a few epochs:
  a weak foundation model that knows every class a little.
* **Sites**: 4 sites fine-tune the base on label-skewed subtasks of the remaining pool (site 0 sees classes
  0-3, site 1 2-6, site 2 5-8, site 3 8, 9, 0, 1; a class held by two sites is split between them), with
  ``rayfuse.data.partition``'s ``labels`` partitioner; each site holds 20 % of its part out as validation data.
  Each fine-tune is saved as a Hugging Face folder; the **pooled** fine-tune (every site's training data in one
  place, the oracle no federation has) from the same base, same epochs.
* **Merges** through the real ``rayfuse.fuse`` path (the same as ``rayfuse fuse merge.yaml``) on those folders:
  ``average``, ``task_arithmetic`` / ``ties`` / ``dare_linear`` / ``dare_ties``, the spectral ``tsv_m`` / ``iso_c`` /
  ``iso_cts`` / ``wudi`` and mergekit's ``breadcrumbs`` / ``della`` over a small ``lambda`` sweep (each site counted
  once), ``model_stock``, ``sce``, ``karcher`` and ``multislerp`` once, ``fisher`` and ``regmean`` with each site's
  statistics computed on its own data by the functions the clients use
  (``rayfuse.alignment.diagonal_fisher``, ``rayfuse.alignment.input_grams``) and written as ``.safetensors``, weights
  the sites' sample counts.
* **LoRA**: each site trains a PEFT LoRA adapter (rank 4 on every attention, MLP, pooler and classifier
  ``nn.Linear``) of the base on its data, saved with ``save_pretrained``; ``merge_method: lora`` with ``combine:
  average_factors | stack | svd`` (rank 4) folds the combined update into the base (``output_kind: merged``).
* **Federated LoRA**: ``fedlora`` (``combine: ffa | stack | svd | average_factors``; one shot: 1 round of the sites'
  epochs, and 5 rounds splitting the same epochs) through ``rayfuse.run`` with in-process clients (``backend:
  local``); its model is the same Bert, wrapped to take the token ids as the run's features (a model factory), its
  ``base:`` the pretrained base's tensors. The run splits its own clients' data from the same pool with the same
  label groups, minus the run's own 5 % test split (unused here): every model is scored here on the one test set.

Every number is the accuracy on the whole test set (all 10 classes). ``lambda`` is swept and reported per value; the
"best" of a method is the best value on the test set itself (an optimistic choice, which a consortium without
labelled test data of every class cannot make; the sweep shows how much it matters). The merge the sites themselves
would choose, the one scoring best on the union of their validation data (each site scores a candidate on its own
held-out data and only the accuracy leaves it), is reported beside it.

Usage (repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/finetunes/accuracy.py [--seeds 0 1 2] [--quick]

Writes ``benchmarks/results/finetunes_accuracy.json`` and ``docs/results/finetunes/accuracy.md`` (``--quick``: a tiny
run, under a minute, written under ``--out-dir`` only when given; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ((0, 1, 2, 3), (2, 3, 4, 5, 6), (5, 6, 7, 8), (8, 9, 0, 1))
CLS = 81  # the class token (CLS); the 81 patch tokens are 0..80
SEQ = 17
LORA_TARGETS = ["query", "key", "value", "dense", "classifier"]
FED_COMBINES = ("ffa", "stack", "svd", "average_factors")
NOTES = """
## Reading it (the run recorded here: seeds 0, 1, 2)

* **Best merge above every single site: met**, on every seed and by a wide margin: ties at lambda 0.1 scores 0.631
  against the best site's 0.475, and the merge the sites would choose on their own validation data (fisher on seeds
  0 and 2, regmean on seed 1) 0.625. The sites fine-tuned on 4-5 classes forget the others (0.35-0.48 on all 10
  classes, below the base's 0.615), and a merge keeps the base's knowledge of every class. But the best merge is only
  0.016 above the base itself (the chosen one 0.010, and below the base on seed 0: 0.644 against 0.678), far below
  the pooled fine-tune (0.712): merging undoes the sites' forgetting but keeps little of what they learned. Task
  arithmetic and DARE fall fast with lambda (0.63 at 0.1, under 0.19 at 1.0: the sum of four task vectors, each
  pushing down, in the one shared 10-way head, the classes its site never saw); TIES's sign election and disjoint
  mean make it the least sensitive (0.348 at 1.0). Fisher (0.622) and RegMean (0.617) need no lambda, and the sites'
  validation data picks one of them on every seed. The task-arithmetic, TIES and DARE papers evaluate each task with
  its own head (or a zero-shot text head); one head shared by label-skewed sites, as here, is the hard case for them.
* **The 2024-26 spectral merges and mergekit's others** land beside TIES at lambda 0.1 (TSV-M 0.629, DELLA 0.630,
  Breadcrumbs 0.628, WUDI 0.626, Iso-CTS 0.623, Iso-C 0.621, against TIES's 0.631), none above it; their published
  gains (TSV-M, Iso-C/CTS, WUDI at 92-95 % of the individual fine-tunes on the 8-task CLIP benchmark, against TIES's
  80 %) come from tasks with a head each, which this setting lacks. TSV-M falls least as lambda grows (0.622 at 0.3,
  0.502 at 1.0 against TIES's 0.609 and 0.348): its per-layer low-rank, orthogonalised update is the smallest step.
  Model Stock (no lambda: its own interpolation towards the base) scores 0.612; SCE (0.414), Karcher (0.593) and
  multi-SLERP (0.378), which average the models' directions or weights rather than add a scaled task vector to the
  base, take the full step and lose what the base knew of the classes each site never saw.
* **Exact LoRA combination above `average_factors` in every cell: missed** in the one-shot cells, by 0.044-0.049
  (`stack`, `svd` of the sites' PEFT adapters) and by 0.013-0.030 (fedlora's one shot); after 5 fedlora rounds the
  exact combinations are level with it (+0.002 `stack`, +0.005 `svd`, within the seeds' spread of about 0.02). Not
  because the exact update is wrong (`stack`'s relative error is 0): the weighted average of label-skewed updates is
  itself a worse model than a smaller step from the base, as the lambda sweep shows for the full fine-tunes.
  `average_factors` takes a smaller step: the sites' adapters start from their own PEFT initialisations of `A`, so
  `mean(B) mean(A)` loses the cross terms (relative error 0.83 from the exact update) and its update has 0.45x the
  exact one's norm. The exact `stack` update shrunk to that norm (task_arithmetic of the one merged folder, lambda =
  the ratio of the norms) scores 0.620 against `average_factors`' 0.624: its lead is the size of its step, not its
  direction. In fedlora the clients share each round's `A`, so the gap is smaller one shot and gone after 5 rounds;
  FFA-LoRA (A frozen and shared, exact) is the best of the LoRA combinations (0.633 one shot, 0.628 after 5 rounds).
* The full run takes 95 s for 3 seeds on 2 cores with nothing else running (255 s at a load average of 15 to 26);
  `--quick` runs the whole pipeline on a tiny setting in 14 s of CPU time (about a minute
  of wall time at a load average of 11; its test's job).
"""
VALIDATION = 0.2  # of each site's part
SELECTED = "merge chosen on the sites' validation data"
SHRUNK = "LoRA one shot stack, shrunk to average_factors' update norm"


SPECTRAL = ("tsv_m", "iso_c", "iso_cts", "wudi")
# every merge of fine-tunes this benchmark runs (a row's first word)
MERGES = (
    "average",
    "task_arithmetic",
    "ties",
    "dare_linear",
    "dare_ties",
    *SPECTRAL,
    "breadcrumbs",
    "della",
    "model_stock",
    "sce",
    "karcher",
    "multislerp",
    "fisher",
    "regmean",
)


@dataclass(frozen=True)
class Setting:
    pretrain_size: int  # images the base is pretrained on (stratified)
    pretrain_epochs: int
    site_epochs: int  # full fine-tunes, the pooled one, LoRA adapters and fedlora (all rounds together)
    lr: float  # full fine-tunes
    lora_lr: float
    rank: int
    fed_rounds: int  # fedlora's multi-round cells (the one-shot cells are 1 round)
    lambdas: tuple[float, ...]
    density: float  # ties / dare
    batch_size: int = 32
    pool_fraction: float = 1.0  # of the fine-tuning pool (quick: a part of it)


FULL = Setting(
    pretrain_size=400,
    pretrain_epochs=20,
    site_epochs=5,
    lr=1e-3,
    lora_lr=3e-3,
    rank=4,
    fed_rounds=5,
    lambdas=(0.1, 0.3, 0.5, 0.7, 1.0),
    density=0.5,
)
QUICK = Setting(
    pretrain_size=100,
    pretrain_epochs=1,
    site_epochs=1,
    lr=1e-3,
    lora_lr=3e-3,
    rank=2,
    fed_rounds=2,
    lambdas=(0.5, 1.0),
    density=0.5,
    pool_fraction=0.3,
)


# ---------------------------------------------------------------------------------------------------------------
# Data and model


def tokens(images: np.ndarray) -> np.ndarray:
    """8x8 images of pixel counts 0..16 -> (N, 17) token ids: CLS and the 16 2x2 patches, 3 levels per pixel."""
    q = np.digitize(images, [4, 12])  # 0: 0-3, 1: 4-11, 2: 12-16
    patches = q.reshape(-1, 4, 2, 4, 2).transpose(0, 1, 3, 2, 4).reshape(-1, 16, 4)
    ids = (patches * np.array([27, 9, 3, 1])).sum(-1)
    return np.concatenate([np.full((len(images), 1), CLS), ids], axis=1).astype(np.int64)


def split(seed: int, setting: Setting) -> dict[str, Any]:
    """Test set (30 %, stratified), the base's pretraining sample, and the sites' parts of the remaining pool."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from rayfuse.data.partition import partition

    digits = load_digits()
    X, y = tokens(digits.images.astype(np.int64)), digits.target.astype(np.int64)
    X_rest, X_test, y_rest, y_test = train_test_split(X, y, test_size=0.3, stratify=y, random_state=seed)
    X_pre, X_pool, y_pre, y_pool = train_test_split(X_rest, y_rest, train_size=setting.pretrain_size, stratify=y_rest, random_state=seed)
    if setting.pool_fraction < 1:
        keep = np.random.default_rng(seed).permutation(len(y_pool))[: int(setting.pool_fraction * len(y_pool))]
        X_pool, y_pool = X_pool[np.sort(keep)], y_pool[np.sort(keep)]
    parts = partition(y_pool, len(GROUPS), "labels", seed=seed, groups=[list(g) for g in GROUPS])
    # each site keeps VALIDATION of its part aside (never trained on): the union of these is the data on which the
    # sites can score a candidate merge between them (only the accuracy leaves a site), to choose one without the test set
    rng = np.random.default_rng(seed)
    train_parts, val_parts = [], []
    for part in parts:
        shuffled = rng.permutation(part)
        k = max(1, int(round(VALIDATION * len(part))))
        val_parts.append(shuffled[:k])
        train_parts.append(np.sort(shuffled[k:]))
    order = np.concatenate(train_parts)  # the training pool, site by site
    starts = np.cumsum([0, *(len(t) for t in train_parts)])
    val = np.concatenate(val_parts)
    return {
        "test": (X_test, y_test),
        "pretrain": (X_pre, y_pre),
        "pool": (X_pool[order], y_pool[order]),
        "parts": [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])],
        "validation": (X_pool[val], y_pool[val]),
    }


def bert_config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=CLS + 1,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        type_vocab_size=1,
        num_labels=10,
        hidden_dropout_prob=0.0,  # deterministic training and merging (dropout would only add noise at this size)
        attention_probs_dropout_prob=0.0,
    )


class TokenBert(nn.Module):
    """A ``BertForSequenceClassification`` (``.net``) taking the token ids as a float feature matrix (what rayfuse's
    trainer, its Fisher / Gram functions and ``fedlora``'s clients feed a model)."""

    def __init__(self, net: Any = None) -> None:
        super().__init__()
        from transformers import BertForSequenceClassification

        self.net = net if net is not None else BertForSequenceClassification(bert_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=x.long()).logits


def new_model(seed: int) -> Any:
    torch.manual_seed(seed)
    return TokenBert()


def train(model: Any, X: np.ndarray, y: np.ndarray, setting: Setting, epochs: int, lr: float, seed: int) -> None:
    """rayfuse's trainer (Adam, the one ``fedlora``'s clients use), in place."""
    from rayfuse.models import train_model

    train_model(model, X.astype(np.float32), y, epochs=epochs, batch_size=setting.batch_size, lr=lr, optimizer="adam", seed=seed)


def accuracy(model: Any, X: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(X.astype(np.float32)))
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite logits")
    return float((logits.argmax(1).numpy() == y).mean())


def load_hf(folder: Path) -> TokenBert:
    """A Hugging Face folder loaded with ``from_pretrained`` (what a user of the merge does)."""
    from transformers import BertForSequenceClassification

    return TokenBert(BertForSequenceClassification.from_pretrained(str(folder)))


def hf_accuracy(folder: Path, X: np.ndarray, y: np.ndarray) -> float:
    return accuracy(load_hf(folder), X, y)


def update_norm(params: Any, base: Any) -> float:
    """``||params - base||_F`` over the floating tensors both hold (names with or without the wrapper's ``net.``)."""
    theirs = {k.removeprefix("net."): np.asarray(v, dtype=np.float64) for k, v in params.items()}
    ours = {k.removeprefix("net."): np.asarray(v, dtype=np.float64) for k, v in base.items()}
    total = sum(float(np.sum((theirs[k] - ours[k]) ** 2)) for k in ours if k in theirs and ours[k].dtype.kind == "f")
    return math.sqrt(total)


def strip(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The wrapper's ``net.`` prefix off: the Hugging Face folder's tensor names."""
    return {k.removeprefix("net."): np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()}


# ---------------------------------------------------------------------------------------------------------------
# One seed


def fuse(config: dict[str, Any]) -> Path:
    import rayfuse

    return rayfuse.fuse(config)


def run_seed(seed: int, setting: Setting, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    import copy

    from peft import LoraConfig, get_peft_model
    from safetensors.numpy import save_file

    from rayfuse.alignment import diagonal_fisher, input_grams
    from rayfuse.merging import get_merge
    from rayfuse.models import get_params

    data = split(seed, setting)
    X_test, y_test = data["test"]
    X_pool, y_pool = data["pool"]
    X_val, y_val = data["validation"]
    validation: dict[str, float] = {}  # the merges' accuracy on the union of the sites' validation data
    parts = data["parts"]
    counts = [len(p) for p in parts]
    acc: dict[str, float] = {}
    norms: dict[str, float] = {}  # ||merged - base||_F over every tensor: the size of the combined update
    errors: dict[str, float] = {}  # rayfuse_lora.json's relative error against sum_i w_i s B_i A_i
    t0 = time.perf_counter()

    base = new_model(seed)
    train(base, *data["pretrain"], setting, setting.pretrain_epochs, setting.lr, seed)
    base.net.save_pretrained(str(root / "base"))
    acc["base"] = accuracy(base, X_test, y_test)
    log(f"base {acc['base']:.3f} ({time.perf_counter() - t0:.0f} s)")

    # full fine-tunes, per site and pooled; each site's Fisher and Grams on its own data
    sites = []
    for i, part in enumerate(parts):
        model = copy.deepcopy(base)
        X_i, y_i = X_pool[part], y_pool[part]
        train(model, X_i, y_i, setting, setting.site_epochs, setting.lr, seed * 100 + i)
        folder = root / f"site{i}"
        model.net.save_pretrained(str(folder))
        acc[f"site {i}"] = accuracy(model, X_test, y_test)
        fisher = strip(diagonal_fisher(model, X_i.astype(np.float32), y_i))
        grams, _ = input_grams(model, X_i.astype(np.float32))
        save_file(fisher, str(root / f"site{i}-fisher.safetensors"))
        save_file(strip(grams), str(root / f"site{i}-grams.safetensors"))
        sites.append(folder)
    pooled = copy.deepcopy(base)
    train(pooled, X_pool, y_pool, setting, setting.site_epochs, setting.lr, seed * 100 + 99)
    acc["pooled fine-tune"] = accuracy(pooled, X_test, y_test)
    log(
        f"sites {[round(acc[f'site {i}'], 3) for i in range(len(parts))]}, pooled {acc['pooled fine-tune']:.3f} ({time.perf_counter() - t0:.0f} s)"
    )

    # merges through rayfuse.fuse
    def merge(name: str, method: str, parameters: dict[str, Any] | None = None, statistics: str | None = None) -> None:
        models: list[dict[str, Any]] = []
        for i, folder in enumerate(sites):
            entry: dict[str, Any] = {"model": str(folder), "parameters": {"weight": float(counts[i])}}
            if statistics is not None:
                entry["statistics"] = str(root / f"site{i}-{statistics}.safetensors")
            if statistics is None:  # every site counts once (the methods' published form); weights for the data-aware ones
                required = (get_merge(method).tensor.per_model or {}).get("weight", 0.0) is None  # type: ignore[union-attr]
                entry["parameters"] = {"weight": 1.0} if required else {}
            models.append(entry)
        out = root / "merged" / name.replace(" ", "_").replace("=", "").replace(".", "p")  # no suffix: a folder
        config: dict[str, Any] = {
            "merge_method": method,
            "base_model": str(root / "base"),
            "models": models,
            "output": str(out),
            "seed": seed,
        }
        if parameters:
            config["parameters"] = parameters
        merged = load_hf(fuse(config))
        acc[name] = accuracy(merged, X_test, y_test)
        validation[name] = accuracy(merged, X_val, y_val)

    merge("average", "average")
    for lam in setting.lambdas:
        merge(f"task_arithmetic lambda={lam}", "task_arithmetic", {"lambda": lam})
        merge(f"ties lambda={lam}", "ties", {"lambda": lam, "density": setting.density})
        merge(f"dare_linear lambda={lam}", "dare_linear", {"lambda": lam, "density": setting.density})
        merge(f"dare_ties lambda={lam}", "dare_ties", {"lambda": lam, "density": setting.density})
        for spectral in SPECTRAL:
            merge(f"{spectral} lambda={lam}", spectral, {"lambda": lam})
        merge(f"breadcrumbs lambda={lam}", "breadcrumbs", {"lambda": lam, "density": setting.density})
        merge(f"della lambda={lam}", "della", {"lambda": lam, "density": setting.density})
    for whole in ("model_stock", "sce", "karcher", "multislerp"):
        merge(whole, whole)
    merge("fisher", "fisher", statistics="fisher")
    merge("regmean", "regmean", {"alpha": 0.9}, statistics="grams")
    chosen = max(validation, key=validation.__getitem__)  # the first of equals, in the order above
    acc[SELECTED] = acc[chosen]
    log(f"merges done ({time.perf_counter() - t0:.0f} s)")

    # LoRA adapters per site (PEFT), combined by merge_method: lora
    def lora_model(seed_: int) -> Any:
        net = copy.deepcopy(base.net)
        config = LoraConfig(r=setting.rank, lora_alpha=2 * setting.rank, target_modules=LORA_TARGETS, lora_dropout=0.0, bias="none")
        torch.manual_seed(seed_)
        return TokenBert(get_peft_model(net, config))

    adapters = []
    for i, part in enumerate(parts):
        model = lora_model(seed * 100 + i)
        train(model, X_pool[part], y_pool[part], setting, setting.site_epochs, setting.lora_lr, seed * 100 + i)
        acc[f"LoRA site {i}"] = accuracy(model, X_test, y_test)
        model.net.save_pretrained(str(root / f"lora{i}"))
        adapters.append(root / f"lora{i}")
    model = lora_model(seed * 100 + 99)
    train(model, X_pool, y_pool, setting, setting.site_epochs, setting.lora_lr, seed * 100 + 99)
    acc["LoRA pooled"] = accuracy(model, X_test, y_test)
    base_params = base.net.state_dict()
    for combine in ("average_factors", "stack", "svd"):
        parameters: dict[str, Any] = {"combine": combine, **({"rank": setting.rank} if combine == "svd" else {})}
        config = {
            "merge_method": "lora",
            "base_model": str(root / "base"),
            "models": [{"model": str(a), "parameters": {"weight": float(c)}} for a, c in zip(adapters, counts)],
            "parameters": parameters,
            "output_kind": "merged",
            "output": str(root / "merged" / f"lora_{combine}"),
        }
        folder = fuse(config)
        merged = load_hf(folder)
        acc[f"LoRA one shot {combine}"] = accuracy(merged, X_test, y_test)
        norms[f"LoRA one shot {combine}"] = update_norm(merged.net.state_dict(), base_params)
        errors[f"LoRA one shot {combine}"] = float(json.loads((folder / "rayfuse_lora.json").read_text())["relative_error"])
    # the exact update shrunk to average_factors' norm, through task_arithmetic on the merged folder (one model:
    # base + lambda (stack - base)): is average_factors' lead its direction or only its smaller step?
    shrink = norms["LoRA one shot average_factors"] / norms["LoRA one shot stack"] if norms["LoRA one shot stack"] > 0 else 1.0
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(root / "base"),
        "models": [{"model": str(root / "merged" / "lora_stack")}],
        "parameters": {"lambda": shrink},
        "output": str(root / "merged" / "lora_stack_shrunk"),
    }
    acc[SHRUNK] = hf_accuracy(fuse(config), X_test, y_test)
    norms[SHRUNK] = shrink * norms["LoRA one shot stack"]
    log(f"LoRA done ({time.perf_counter() - t0:.0f} s)")

    # federated LoRA: fedlora through rayfuse.run, in-process clients
    base_file = root / "base-params.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in get_params(base).items()}, str(base_file))
    fed_acc, fed_norms = federated_lora(seed, setting, X_pool, y_pool, base_file, root, X_test, y_test)
    acc.update(fed_acc)
    norms.update(fed_norms)
    log(f"fedlora done ({time.perf_counter() - t0:.0f} s)")
    for key, value in acc.items():
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise RuntimeError(f"{key}: accuracy {value}")
    return {
        "seed": seed,
        "site_samples": counts,
        "accuracy": acc,
        "validation_accuracy": validation,
        "chosen_merge": chosen,
        "update_norm": norms,
        "lora_relative_error": errors,
        "seconds": time.perf_counter() - t0,
    }


def federated_lora(
    seed: int, setting: Setting, X_pool: np.ndarray, y_pool: np.ndarray, base_file: Path, root: Path, X_test: np.ndarray, y_test: np.ndarray
) -> tuple[dict[str, float], dict[str, float]]:
    """fedlora's eight cells: accuracy on the test set and the size of the final update, by cell name."""
    import rayfuse
    from rayfuse.models import set_params

    methods: dict[str, Any] = {}
    for combine in FED_COMBINES:
        for rounds in (1, setting.fed_rounds):
            methods[f"fedlora_{combine}_{rounds}"] = {
                "method": "fedlora",
                "combine": combine,
                "rounds": rounds,
                "local_epochs": max(1, setting.site_epochs // rounds),
                "r": setting.rank,
                "alpha": 2.0 * setting.rank,
                "lr": setting.lora_lr,
                "base": str(base_file),
                "target_modules": [".*\\.(query|key|value|dense|classifier)"],
                "evaluate_every": rounds,
            }
    config = {
        "run": {"name": f"ftacc-fedlora-s{seed}", "seed": seed},
        "data": {"test_size": 0.05},
        "partition": {"method": "labels", "num_clients": len(GROUPS), "groups": [list(g) for g in GROUPS]},
        "train": {"lr": setting.lora_lr, "batch_size": setting.batch_size, "optimizer": "adam"},
        "federation": {"backend": "local"},
        "methods": methods,
    }
    result = rayfuse.run(config, model=TokenBert, dataset=(X_pool.astype(np.float32), y_pool), run_dir=root / "fedlora", quiet=True)
    from safetensors.numpy import load_file

    base = load_file(str(base_file))
    out, norms = {}, {}
    for label in methods:
        prefix, rounds_text = label.rsplit("_", 1)
        combine, rounds = prefix.removeprefix("fedlora_"), int(rounds_text)
        name = f"fedlora {'one shot' if rounds == 1 else f'{rounds} rounds'} {combine}"
        out[name] = accuracy(set_params(TokenBert(), result.models[label]), X_test, y_test)
        norms[name] = update_norm(result.models[label], base)
    return out, norms


# ---------------------------------------------------------------------------------------------------------------
# Tables


def summarise(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    keys = list(rows[0]["accuracy"])
    return {k: (float(np.mean([r["accuracy"][k] for r in rows])), float(np.std([r["accuracy"][k] for r in rows]))) for k in keys}


def best(summary: dict[str, tuple[float, float]], prefix: str) -> tuple[str, float]:
    cells = {k: v[0] for k, v in summary.items() if k == prefix or k.startswith(prefix + " ")}
    key = max(cells, key=cells.__getitem__)
    return key, cells[key]


def targets(summary: dict[str, tuple[float, float]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two targets, on the seeds' means (and per seed)."""
    merges = [k for k in summary if k.split(" ")[0] in MERGES]
    best_merge = max(merges, key=lambda k: summary[k][0])
    site_keys = [k for k in summary if k.startswith("site ")]
    best_site = max(site_keys, key=lambda k: summary[k][0])
    lora_cells = []
    for kind in ("LoRA one shot", *(f"fedlora {r}" for r in ("one shot", f"{rows[0]['fed_rounds']} rounds"))):
        avg = summary[f"{kind} average_factors"][0]
        for exact in ("stack", "svd"):
            lora_cells.append({"cell": f"{kind} {exact}", "accuracy": summary[f"{kind} {exact}"][0], "average_factors": avg})
    return {
        "best_merge": best_merge,
        "best_merge_accuracy": summary[best_merge][0],
        "best_site": best_site,
        "best_site_accuracy": summary[best_site][0],
        "best_merge_above_every_site": summary[best_merge][0] > summary[best_site][0],
        "best_merge_above_every_site_per_seed": [
            max(r["accuracy"][k] for k in merges) > max(r["accuracy"][k] for k in site_keys) for r in rows
        ],
        "chosen_merges": [r["chosen_merge"] for r in rows],
        "chosen_merge_accuracy": summary[SELECTED][0],
        "chosen_merge_above_every_site_per_seed": [r["accuracy"][SELECTED] > max(r["accuracy"][k] for k in site_keys) for r in rows],
        "exact_lora_cells": lora_cells,
        "exact_lora_above_average_factors_in_every_cell": all(c["accuracy"] > c["average_factors"] for c in lora_cells),
    }


def fmt(mean: float, std: float, n: int) -> str:
    return f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"


def markdown(
    summary: dict[str, tuple[float, float]], rows: list[dict[str, Any]], goal: dict[str, Any], setting: Setting, meta: dict[str, Any]
) -> str:
    n = len(rows)
    lines = ["| model | test accuracy (all 10 classes) |", "|---|---|"]
    lines += [f"| {k} | {fmt(*v, n)} |" for k, v in summary.items()]
    cells = "\n".join(
        f"| {c['cell']} | {c['accuracy']:.3f} | {c['average_factors']:.3f} | {c['accuracy'] - c['average_factors']:+.3f} |"
        for c in goal["exact_lora_cells"]
    )
    return (
        "# Fine-tune merges: accuracy on label-skewed sites\n\n"
        f"Produced by `benchmarks/finetunes/accuracy.py` (seeds {[r['seed'] for r in rows]}; {meta['seconds']:.0f} s on "
        f"{meta['cpus']} CPUs, load average {meta['load_before']} before and {meta['load_after']} after). A 2-layer "
        "`BertForSequenceClassification` (hidden 64) built from a config, on scikit-learn's 8x8 digits as 17-token "
        f"sequences (a class token and 16 2x2-patch tokens); the base pretrained on {setting.pretrain_size} images "
        f"({setting.pretrain_epochs} epochs), 4 sites fine-tuning it on classes {[list(g) for g in GROUPS]} "
        f"({rows[0]['site_samples']} training images, {VALIDATION:.0%} more each held out; {setting.site_epochs} epochs, Adam lr {setting.lr}; LoRA rank "
        f"{setting.rank} lr {setting.lora_lr}), every merge through `rayfuse.fuse` and loaded with `from_pretrained`, "
        f"fedlora through `rayfuse.run` (in-process clients; one shot, and {setting.fed_rounds} rounds of "
        f"{max(1, setting.site_epochs // setting.fed_rounds)} epochs). Accuracy on the held-out 30 % (every class; "
        f"mean ± std over seeds). ties / dare: density {setting.density}; regmean alpha 0.9; fisher / regmean / LoRA "
        "weights: the sites' sample counts; the other merges count each site once. The script's docstring holds the "
        "details.\n\n" + "\n".join(lines) + "\n\n## The targets\n\n"
        f"* Best merge: **{goal['best_merge']}** at {goal['best_merge_accuracy']:.3f}; best single site: "
        f"{goal['best_site']} at {goal['best_site_accuracy']:.3f}: "
        + ("met" if goal["best_merge_above_every_site"] else f"missed by {goal['best_site_accuracy'] - goal['best_merge_accuracy']:.3f}")
        + f" (per seed: {goal['best_merge_above_every_site_per_seed']}). The lambda of the best merge is chosen on "
        "the test set, an optimistic choice; the merge the sites would choose on their own validation data (the one "
        f"scoring best on the union of their held-out {VALIDATION:.0%}) scores {goal['chosen_merge_accuracy']:.3f} "
        f"(chosen per seed: {', '.join(goal['chosen_merges'])}; above every site per seed: "
        f"{goal['chosen_merge_above_every_site_per_seed']}).\n"
        "* Exact LoRA combination against `average_factors`, cell by cell: "
        + ("met in every cell" if goal["exact_lora_above_average_factors_in_every_cell"] else "not met in every cell")
        + ".\n\n| cell | exact | average_factors | difference |\n|---|---|---|---|\n"
        + cells
        + "\n\n## The size of the combined LoRA updates\n\n`||merged - base||_F` over every tensor (mean over seeds), and for "
        "the one-shot combinations `rayfuse_lora.json`'s relative error against the exact `sum_i w_i s B_i A_i`:\n\n"
        "| cell | accuracy | update norm | relative error |\n|---|---|---|---|\n"
        + "\n".join(
            f"| {k} | {summary[k][0]:.3f} | {np.mean([r['update_norm'][k] for r in rows]):.3f} | "
            + (f"{np.mean([r['lora_relative_error'][k] for r in rows]):.3f}" if k in rows[0]["lora_relative_error"] else "")
            + " |"
            for k in rows[0]["update_norm"]
        )
        + "\n"
        + NOTES
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--quick", action="store_true", help="a tiny run (well under a minute) to check the pipeline; its numbers mean nothing"
    )
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where the JSON and the table go (default: the repository's, full runs only)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    parser.add_argument("--render", type=Path, default=None, help="rewrite the table from a saved JSON of this script (no training)")
    args = parser.parse_args(argv)
    if args.render is not None:
        return render(args.render, args.out_dir)

    torch.set_num_threads(args.threads)
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # torch.func.vmap (the Fisher's per-sample gradients) runs CPU attention through its slow fallback and says so
    warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented the batching rule")
    setting = QUICK if args.quick else FULL
    load_before = os.getloadavg()
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for seed in args.seeds:  # the files are rewritten after every seed, so a long run stopped early keeps its seeds
        with tempfile.TemporaryDirectory() as tmp:
            row = run_seed(seed, setting, Path(tmp), lambda line, s=seed: print(f"[seed {s}] {line}", flush=True))
        row["fed_rounds"] = setting.fed_rounds
        rows.append(row)
        report = write(rows, setting, args, start, load_before)
    return report


def render(json_path: Path, out_dir: Path | None) -> dict[str, Any]:
    """The markdown page again from a saved report (its runs, setting and machine notes), e.g. after the notes changed."""
    report = json.loads(json_path.read_text(encoding="utf-8"))
    setting = Setting(**{**report["setting"], "lambdas": tuple(report["setting"]["lambdas"])})
    rows = report["runs"]
    summary = summarise(rows)
    text = markdown(summary, rows, targets(summary, rows), setting, report["meta"])
    md_path = (out_dir or ROOT / "docs" / "results" / "finetunes") / "accuracy.md"
    md_path.write_text(text, encoding="utf-8")
    print(f"wrote {md_path}")
    return report


def write(
    rows: list[dict[str, Any]], setting: Setting, args: argparse.Namespace, start: float, load_before: tuple[float, ...]
) -> dict[str, Any]:
    summary = summarise(rows)
    goal = targets(summary, rows)
    meta = {
        "seconds": time.perf_counter() - start,
        "cpus": os.cpu_count(),
        "torch_threads": args.threads,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "quick": args.quick,
    }
    text = markdown(summary, rows, goal, setting, meta)
    print(text)
    report = {
        "setting": asdict(setting),
        "groups": [list(g) for g in GROUPS],
        "meta": meta,
        "summary": summary,
        "targets": goal,
        "runs": rows,
    }
    if args.out_dir is None and not args.quick:
        json_path, md_path = (
            ROOT / "benchmarks" / "results" / "finetunes_accuracy.json",
            ROOT / "docs" / "results" / "finetunes" / "accuracy.md",
        )
    elif args.out_dir is not None:
        json_path, md_path = args.out_dir / "finetunes_accuracy.json", args.out_dir / "accuracy.md"
    else:
        return report
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    md_path.write_text(text, encoding="utf-8")
    print(f"wrote {json_path} and {md_path}")
    return report


if __name__ == "__main__":
    main()
