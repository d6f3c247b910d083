"""``fedlora``: clients fine-tune LoRA adapters of one shared base on their own data; the server combines them.

The base is the run's model (``model:``), initialised from the run's shared init or read from ``base:`` (a
safetensors / PyTorch state dict of that model, or a Hugging Face folder; by default the folder of a
``model.name: hf:<folder>``; nothing is downloaded). Each client wraps the base's ``nn.Linear``
layers that ``target_modules`` names with ``W x + s B A x`` (``A``: r x in, ``B``: out x r, ``s = alpha / r``),
trains only the factors (the base frozen) for ``local_epochs`` from the round's global adapter, and returns only the
adapter tensors (``<module>.lora_A``, ``<module>.lora_B``) and its sample count. Per round the server combines
(``combine``):

* ``ffa`` (FFA-LoRA [FFALORA]): ``A`` frozen at its seeded init and shared, only ``B`` trained and sent; the update
  ``s B A`` is linear in ``B``, so averaging the ``B_i`` through the update pipeline (``server.updates.collect``) is
  the exact average of the updates, and the pipeline's attacks, robust rules and central DP act on the ``B`` updates.
* ``stack`` (FLoRA [FLORA]): the exact ``D = sum_i w_i s B_i A_i`` (evaluated and returned), re-factored to rank
  ``r`` by SVD for the next round: the re-factoring is the inexact step.
* ``svd``: the best rank-``r`` approximation of ``D`` (Eckart-Young), evaluated and sent as is.
* ``average_factors``: ``(sum_i w_i s B_i)(sum_i w_i A_i)``, the inexact baseline.

The combination math is :func:`rayfuse.finetunes.lora.combine_module`'s. Only ``ffa`` combines parameters the
update pipeline can act on; the others refuse attacks, robust rules and ``dp`` before start (``Params.fuses``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from rayfuse.errors import InputError
from rayfuse.finetunes.lora import combine_module
from rayfuse.method import (
    ClientContext,
    Gathered,
    Method,
    MethodCase,
    MethodResult,
    MethodTags,
    Reference,
    RunSetup,
    ServerContext,
    Update,
    client_step,
    register_method,
)
from rayfuse.updates.settings import CohortUpdates

__all__ = ["FedLora", "FedLoraParams", "FedLoraState", "fit", "combine_round", "lora_targets", "merged_params", "FFALORA"]

FFALORA = Reference(
    "FFALORA",
    "Sun, Li, Li, Ding. Improving LoRA in Privacy-preserving Federated Learning. ICLR 2024",
    "https://arxiv.org/abs/2403.12313",
)

Combine = Literal["ffa", "stack", "svd", "average_factors"]


class FedLoraParams(CohortUpdates):
    rounds: int = Field(5, ge=1, description="communication rounds (1: one shot)")
    local_epochs: int = Field(1, ge=1, description="epochs of local adapter training per round")
    r: int = Field(4, ge=1, description="LoRA rank of each adapter")
    alpha: float = Field(8.0, gt=0, description="LoRA alpha: the update is (alpha / r) B A")
    target_modules: list[str] | None = Field(
        None, description="nn.Linear modules to adapt, by name or regex (full match); default: every Linear but the last"
    )
    combine: Combine = Field(
        "ffa",
        description="ffa (A frozen and shared, B averaged by the update pipeline: exact), stack (exact sum, "
        "re-factored to rank r by SVD for the next round), svd (best rank-r approximation), average_factors "
        "(averages A and B separately: inexact baseline)",
    )
    base: str | None = Field(
        None,
        description="a safetensors / PyTorch state dict of the run's model, or a Hugging Face folder (config.json and its "
        "weights, read with from_pretrained: nothing downloaded; the run's model: hf:<folder>); "
        "default: the folder of model.name hf:<folder>, else the run's shared init",
    )
    lr: float | None = Field(None, gt=0, description="default: train.lr")
    batch_size: int | None = Field(None, ge=1, description="default: train.batch_size")
    evaluate_every: int = Field(1, ge=1, description="evaluate base + merged update every this many rounds (and after the last)")


# ---------------------------------------------------------------------------------------------------------------
# Targets, the wrapper, the merged model


def lora_targets(model: Any, patterns: list[str] | None, where: str = "target_modules") -> list[str]:
    """The names of ``model``'s ``nn.Linear`` modules to adapt: those a pattern names (exactly or as a full-match
    regex), or every Linear but the last. A pattern that matches no Linear, or no pattern at all (an empty list adapts
    nothing), is an :class:`InputError`."""
    from torch import nn

    if patterns is not None and not patterns:
        raise InputError(
            where, "at least one module name or pattern (an empty list matches nothing)", [], "leave it out for every Linear but the last"
        )
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if patterns is None:
        if len(linears) < 2:
            raise InputError(where, "a model with at least two nn.Linear layers (the last is not adapted)", f"{len(linears)} Linear")
        return linears[:-1]
    chosen: list[str] = []
    for i, pattern in enumerate(patterns):
        try:
            hits = [n for n in linears if n == pattern or re.fullmatch(pattern, n)]
        except re.error as exc:
            raise InputError(f"{where}.{i}", "a module name or a regular expression", f"{pattern!r} ({exc})") from None
        if not hits:
            shown = ", ".join(linears[:8]) + (f", ... ({len(linears)} in all)" if len(linears) > 8 else "")
            raise InputError(f"{where}.{i}", f"a pattern matching an nn.Linear of the model ({shown})", pattern)
        chosen += [n for n in hits if n not in chosen]
    return [n for n in linears if n in chosen]  # the model's order


def _wrap(
    model: Any, targets: list[str], A: dict[str, np.ndarray], B: dict[str, np.ndarray], scale: float, train_A: bool
) -> dict[str, Any]:
    """Freeze ``model`` and replace each target Linear by ``W x + scale B A x``; returns the wrappers by module name."""
    import torch
    from torch import nn

    class LoraLinear(nn.Module):
        def __init__(self, base: nn.Linear, a: np.ndarray, b: np.ndarray) -> None:
            super().__init__()
            self.base = base
            self.lora_A = nn.Parameter(torch.tensor(a, dtype=base.weight.dtype), requires_grad=train_A)
            self.lora_B = nn.Parameter(torch.tensor(b, dtype=base.weight.dtype))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + scale * ((x @ self.lora_A.T) @ self.lora_B.T)

    for p in model.parameters():
        p.requires_grad_(False)
    wrappers: dict[str, Any] = {}
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrappers[name] = LoraLinear(getattr(parent, child), A[f"{name}.lora_A"], B[f"{name}.lora_B"])
        setattr(parent, child, wrappers[name])
    return wrappers


def merged_params(base: dict[str, np.ndarray], delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The base with each target's combined update (``delta[module]``, out x in, scaling included) added to its weight."""
    out = dict(base)
    for module, d in delta.items():
        key = f"{module}.weight"
        out[key] = (base[key].astype(np.float64) + d).astype(base[key].dtype)
    return out


@client_step("fedlora.fit")
def fit(
    ctx: ClientContext,
    base: dict[str, np.ndarray],
    adapter: dict[str, np.ndarray],
    *,
    label: str,
    round: int,
    targets: list[str],
    scale: float,
    train_A: bool,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: Literal["adam", "sgd"],
    momentum: float,
    weight_decay: float,
) -> Update:
    """Local adapter training from the round's global adapter, the base frozen. Returns the adapter tensors only
    (``lora_B``; ``lora_A`` too when A is trained) and the sample count."""
    from rayfuse.models import set_params, train_model

    model = set_params(ctx.build_model(seed=0), base)
    # Buffers (BatchNorm's running statistics) of the frozen base still move in training mode, as under PEFT; they stay
    # on the client, so the server scores base + update with the base's buffers (the most faithful reading of "only
    # adapter tensors leave a client").
    wrappers = _wrap(model, targets, adapter, adapter, scale, train_A)
    stats = train_model(
        model,
        ctx.train.X,
        ctx.train.y,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        seed=ctx.step_seed(label, round),
        device=ctx.device,
    )
    out: dict[str, np.ndarray] = {}
    for name, w in wrappers.items():
        if train_A:
            out[f"{name}.lora_A"] = w.lora_A.detach().cpu().numpy().copy()
        out[f"{name}.lora_B"] = w.lora_B.detach().cpu().numpy().copy()
    return Update(out, ctx.num_examples, {"train_loss": stats.loss, "train_seconds": stats.seconds})


# ---------------------------------------------------------------------------------------------------------------
# The server's combination


def combine_round(
    updates: list[dict[str, np.ndarray]],
    weights: list[float],
    targets: list[str],
    scale: float,
    combine: str,
    r: int,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """``stack`` / ``svd`` / ``average_factors`` of the clients' adapters (each ``<module>.lora_A`` / ``lora_B``, used
    with scaling ``scale``) with weights ``w_i`` (summing to 1). Returns the combined update per module (out x in,
    scaling included: what the merged model adds to the base), the next round's global adapter (rank ``r``, in the
    clients' convention: ``scale B A``) and the relative error of that adapter against the exact ``D``."""
    delta: dict[str, np.ndarray] = {}
    adapter: dict[str, np.ndarray] = {}
    err2 = norm2 = 0.0
    scales = [scale] * len(updates)
    for m in targets:
        Bs = [u[f"{m}.lora_B"].astype(np.float64) for u in updates]
        As = [u[f"{m}.lora_A"].astype(np.float64) for u in updates]
        dtype = updates[0][f"{m}.lora_A"].dtype
        merge = combine_module(Bs, As, weights, scales, combine, rank=r if combine == "svd" else None)
        delta[m] = merge.B @ merge.A  # stack: exactly sum_i w_i s B_i A_i
        nxt = combine_module(Bs, As, weights, scales, "svd", rank=r) if combine == "stack" else merge
        adapter[f"{m}.lora_A"] = nxt.A.astype(dtype)
        adapter[f"{m}.lora_B"] = (nxt.B / scale).astype(dtype)
        err2 += nxt.error**2
        norm2 += merge.norm**2
    return delta, adapter, math.sqrt(err2 / norm2) if norm2 > 0 else 0.0


@dataclass
class FedLoraState:
    """The global adapter (``adapter``: every ``lora_A`` and ``lora_B``, used with scaling ``alpha / r``), the last
    round's combined update per module (``delta``: what the merged model adds to the base)."""

    adapter: dict[str, np.ndarray]
    delta: dict[str, np.ndarray]


def base_of(base: str | None, model_cfg: Any) -> str | None:
    """``base:`` as given, else the folder of a Hugging Face model (``model.name: hf:<folder>``, or ``hf_model(folder)``
    from Python): its weights are the pretrained base; ``None`` (the run's shared init) for any other model."""
    if base is not None:
        return base
    from rayfuse.models.hf import hf_factory

    factory = hf_factory(model_cfg)
    return None if factory is None else factory.folder


def _read_base(
    path: str, reference: dict[str, np.ndarray], targets: list[str] | None = None, where: str = "target_modules"
) -> dict[str, np.ndarray]:
    """``base:`` read and checked against the run model's keys and shapes: a file with :func:`rayfuse.io.read_checkpoint`,
    a Hugging Face folder with ``from_pretrained`` (:func:`rayfuse.fusion.lora.hf.read_hf_base`; ``targets``, the
    ``target_modules`` patterns, must then name ``nn.Linear`` modules of the model it loads)."""
    from rayfuse.io import read_checkpoint

    if Path(path).is_dir():
        from rayfuse.fusion.lora.hf import read_hf_base

        params, model = read_hf_base(path, reference)
        try:
            lora_targets(model, targets, where)
        except InputError as exc:
            raise InputError(exc.path, exc.expected.replace("of the model", f"of the base in {path}"), exc.got) from None
        return params
    if not Path(path).is_file():
        raise InputError(
            "base", "an existing safetensors / PyTorch state dict of the run's model, or a Hugging Face folder", f"no such file: {path}"
        )
    try:
        params, _ = read_checkpoint(path)
    except InputError as exc:
        raise exc.at("base") from None
    missing, extra = sorted(set(reference) - set(params)), sorted(set(params) - set(reference))
    if missing or extra:
        raise InputError("base", "the run model's tensors", f"missing {missing[:3]}, unexpected {extra[:3]} in {path}")
    for key, ref in reference.items():
        if tuple(params[key].shape) != tuple(ref.shape):
            raise InputError("base", f"tensor {key} of shape {tuple(ref.shape)}", f"shape {tuple(params[key].shape)} in {path}")
    return {k: np.asarray(params[k]).astype(reference[k].dtype) for k in reference}


def check_base_and_targets(setup: RunSetup, base: str | None, target_modules: Any, r: int | None) -> None:
    """Before start (``fedlora`` / ``fedmerge``): the base folder's refusals (first: they name the folder), target
    modules that exist in the run's model, and a rank ``r`` (``None``: no adapter) no larger than the smallest side of a
    target's weight."""
    from rayfuse.models import build_model, get_params

    assert setup.input_shape is not None and setup.num_classes is not None
    model = build_model(setup.model, setup.input_shape, setup.num_classes, seed=0)
    folder = base_of(base, setup.model)
    if folder is not None:
        _read_base(folder, get_params(model), target_modules)
    targets = lora_targets(model, target_modules)
    if r is not None:
        modules = dict(model.named_modules())
        smallest = min(min(modules[t].weight.shape) for t in targets)
        if r > smallest:
            raise InputError("r", f"at most {smallest} (the smallest side of a target's weight)", r)


def model_targets_and_base(
    server: ServerContext, base: str | None, target_modules: Any
) -> tuple[Any, list[str], dict[str, np.ndarray], str | None]:
    """The run's model, its target modules, the base's parameters (the folder's, else the run's initial model) and the
    base folder (``None``: the run's initial model)."""
    from rayfuse.models import get_params

    model = server.models.build_model(seed=0)
    targets = lora_targets(model, target_modules)
    folder = base_of(base, server.models.model_cfg)
    params = _read_base(folder, get_params(model), target_modules) if folder is not None else server.models.initial_params()
    return model, targets, params, folder


@register_method
class FedLora(Method[FedLoraParams, FedLoraState]):
    name = "fedlora"
    Params = FedLoraParams
    summary = "federated LoRA of one shared base: FFA-LoRA (exact, through the update pipeline), stack, svd or average_factors"
    reference = FFALORA
    tags = MethodTags(multi_round=True, cohort=True, updates=frozenset({"aggregator", "dp", "fraction", "weighted"}))
    test_case = MethodCase({"rounds": 2, "local_epochs": 1, "r": 2}, step="fedlora.fit")

    @classmethod
    def tags_for(cls, params: FedLoraParams | None = None) -> MethodTags:
        """What the update pipeline sees: ``ffa``'s B matrices are parameters it averages; the other combines multiply
        factors (not a parameter average), so attacks, robust rules and DP do not act on them."""
        if params is not None and params.combine != "ffa":
            return replace(cls.tags, fuses="adapter factors")
        return cls.tags

    @classmethod
    def check(cls, params: FedLoraParams, setup: RunSetup) -> None:
        if setup.input_shape is None or setup.num_classes is None:
            return  # a silo run's first check: the model's shape is not known yet
        check_base_and_targets(setup, params.base, params.target_modules, params.r)

    def run(self, server: ServerContext) -> MethodResult:

        p = self.params
        train = server.models.train_cfg
        fed = server.federation
        pipeline = server.updates
        model, targets, base, base_path = model_targets_and_base(server, p.base, p.target_modules)
        scale = p.alpha / p.r
        modules = dict(model.named_modules())
        rng = server.rng("fedlora-A")
        start: dict[str, np.ndarray] = {}
        for t in targets:
            out_f, in_f = modules[t].weight.shape
            dtype = base[f"{t}.weight"].dtype
            # PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0 (the adapter starts at the base)
            start[f"{t}.lora_A"] = rng.uniform(-1 / math.sqrt(in_f), 1 / math.sqrt(in_f), size=(p.r, in_f)).astype(dtype)
            start[f"{t}.lora_B"] = np.zeros((out_f, p.r), dtype=dtype)
        ffa = p.combine == "ffa"
        rounds = server.rounds(  # plans central DP, checkpoints the pipeline's state, hands each round its cohort
            FedLoraState(start, {}),
            last=p.rounds,
            evaluate=lambda rnd: server.scoring.evaluate(merged_params(base, rounds.state.delta)),
            evaluate_every=p.evaluate_every,
        )
        state = rounds.state
        base_ref = fed.put(base)
        step_args = dict(
            label=server.label,
            targets=targets,
            scale=scale,
            train_A=not ffa,
            epochs=p.local_epochs,
            lr=p.lr or train.lr,
            batch_size=p.batch_size or train.batch_size,
            optimizer=train.optimizer,
            momentum=train.momentum,
            weight_decay=train.weight_decay,
        )
        for rnd, clients in rounds.cohorts():
            gathered = fed.run(fit, base_ref, fed.put(state.adapter), clients=clients, round=rnd, **step_args) if clients else Gathered({})
            extra: dict[str, float] = {}
            if ffa:
                b_now = {k: v for k, v in state.adapter.items() if k.endswith(".lora_B")}
                result = pipeline.collect(gathered, b_now, rnd, weighted=p.weighted)
                updates, extra = result.updates, dict(result.metrics)
                state.adapter = {**state.adapter, **result.params}
                state.delta = {t: scale * (state.adapter[f"{t}.lora_B"].astype(np.float64) @ state.adapter[f"{t}.lora_A"]) for t in targets}
            else:
                updates = pipeline.accept(gathered, state.adapter)
                if updates:
                    counts = np.array([u.num_examples for u in updates.values()], dtype=float)
                    w = counts / counts.sum() if p.weighted else np.full(len(counts), 1.0 / len(counts))
                    state.delta, state.adapter, error = combine_round(
                        [u.params for u in updates.values()], [float(x) for x in w], targets, scale, p.combine, p.r
                    )
                    extra["adapter_error"] = error
            losses = np.array([u.metrics.get("train_loss", np.nan) for u in updates.values()])
            counts = np.array([u.num_examples for u in updates.values()], dtype=float)
            rounds.log(
                {
                    "train_loss": float(np.sum(losses * counts) / counts.sum()) if updates else float("nan"),
                    "clients": float(len(updates)),
                    **extra,
                }
            )
        info: dict[str, object] = {
            "rounds": rounds.last,
            "combine": p.combine,
            "r": p.r,
            "targets": targets,
            "exact": p.combine in ("ffa", "stack"),
            "base": base_path or "shared init",
        }  # the pipeline's record (central DP's plan and epsilon) is added by the framework
        return MethodResult(rounds.metrics, merged_params(base, state.delta), info=info)
