"""``tuned``: a model fine-tuned on the server's public sample (the baselines of Section 4.4 of GEMS [1]).

GEMS reports its fused model fine-tuned on a small public sample, and applies the same fine-tuning to the baselines:

* ``base: local`` -- each client's local model fine-tuned (mean +- std over clients);
* ``base: average`` -- the parameter average of the local models fine-tuned;
* ``base: raw`` -- a fresh model trained on the public sample alone.

Fine-tuning follows the reference code [GEMS: utils/model_utils.py ``fine_tune``, utils/dnn3.py,
utils/logit_ellipsoid.py]: Adam, batch 32, 5 epochs, with the optimiser each model was compiled with there:

* the fused GEMS model and the average: lr 0.01 (``create_logit`` / ``create_dnn2``); networks: only the last layer
  (``create_dnn2`` freezes layer 0; GEMS tunes the softmax layer on the fused features);
* each local model: lr 1e-3 and every layer (the local models keep ``learn_logit`` / ``learn_dnn2``'s
  ``optimizer='adam'``, Keras's default lr, with nothing frozen);
* raw: a fresh model trained with lr 1e-3 (``learn_logit`` / ``learn_dnn2``, ``optimizer='adam'``) for 5 epochs
  (logreg) or ``global_epochs`` = 50 (networks), every epoch. The reference also trains its raw network with dropout
  0.5 and ``EarlyStopping(monitor='acc', patience=3)`` on the training accuracy (``learn_dnn2``), which stops it
  after a few epochs on a small sample; ``raw_dropout: 0.5`` and ``raw_early_stop: 3`` reproduce that protocol
  (the jobs run it as a second entry, ``raw-reference``, beside the fully trained raw model).

The last layer is the output layer of the model's ``torch.fx`` graph and a model of other widths than the
configuration's (GEMS' fused networks) is rebuilt from its permutation groups' sizes (:mod:`rayfuse.symmetry`), so
any registry model can be tuned, not only logreg and MLP. ``tune_lr`` and ``last_layer_only`` override these
defaults. ``tune_solver: lbfgs`` fits a network's last layer to convergence instead of the 5 Adam epochs
(``fit_last_layer``; a departure from the reference, offered beside it).
The reference draws the sample from the pooled validation data; here it is the coordinator's public sample
(``data.public_size``, drawn stratified from the training pool before partitioning). ``public_samples`` takes a
subset of it (uniformly, seeded), or a list of sizes for the fine-tuning curve of Figures 3-4
(``info.tuning_curve``; the final metrics are those of the largest size).

[1] N. Guha, V. Smith. Model Aggregation via Good-Enough Model Spaces. arXiv:1805.07782 (2019).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import nn

from rayfuse.data.roles import Split
from rayfuse.errors import InputError, NonFiniteError
from rayfuse.evaluation import model_for_params
from rayfuse.fusion import references
from rayfuse.method import Method, MethodCase, MethodParams, MethodResult, MethodTags, RunSetup, ServerContext, register_method
from rayfuse.models import get_params, train_model
from rayfuse.models.registry import build_model
from rayfuse.symmetry import ModelStructure, build_node_graph, read_structure
from rayfuse.updates.settings import AggregatorUpdates, WeightedUpdates

__all__ = [
    "FinetuneParams",
    "Finetune",
    "model_for_params",
    "evaluate_params",
    "fine_tune",
    "fit_last_layer",
    "check_tune_solver",
    "check_public_samples",
    "public_subsets",
    "TuneSettings",
]


def evaluate_params(server: ServerContext, params: dict[str, np.ndarray]) -> dict[str, float]:
    """Metrics of a parameter dict of the configured architecture and any widths (``server.scoring.evaluate`` with
    ``resized=True``: central, federated or both, as the run's ``evaluation`` says)."""
    if not all(np.isfinite(v).all() for v in params.values()):
        raise NonFiniteError(f"{server.label}: the model to evaluate has NaN or Inf values")
    return server.scoring.evaluate(params, resized=True)


class TuneSettings(MethodParams):
    """Fine-tuning on the public sample (shared by ``tuned`` and ``gems``)."""

    public_samples: int | list[int] | None = Field(
        None, description="public examples to tune on (default: the whole data.public_size sample); a list gives the fine-tuning curve"
    )
    tune_epochs: int = Field(5, ge=1, description="fine-tuning epochs (reference: 5)")
    tune_lr: float = Field(0.01, gt=0, description="Adam learning rate (reference: 0.01)")
    tune_batch_size: int = Field(32, ge=1, description="fine-tuning batch size (tune_solver adam)")
    tune_trials: int = Field(1, ge=1, description="draws of the public subset per size (the paper: 5); metrics are averaged")
    last_layer_only: bool = Field(True, description="networks: tune only the last layer (the reference); logreg has one layer")
    tune_solver: Literal["adam", "lbfgs"] = Field(
        "adam",
        description="adam: tune_epochs of Adam (the reference); lbfgs: networks' "
        "last layer fitted to convergence on the frozen features (a convex problem)",
    )
    tune_l2: float = Field(
        1.0,
        ge=0,
        description="tune_solver lbfgs: L2 penalty on the last layer's weights, as scikit-learn's 1 / C "
        "(mean cross-entropy + tune_l2 |W|^2 / (2 n))",
    )

    @field_validator("public_samples")
    @classmethod
    def _positive_sizes(cls, value: int | list[int] | None) -> int | list[int] | None:
        sizes = [value] if isinstance(value, int) else (value or [])
        if isinstance(value, list) and not value:
            raise ValueError("a non-empty list of sizes")
        if any(s < 1 for s in sizes):
            raise ValueError(f"public sample sizes >= 1, got {value}")
        return value


def check_tune_solver(settings: TuneSettings, model_cfg: Any, *, base: str | None = None) -> None:
    """``tune_solver: lbfgs`` refits a network's last layer; refuse it where that is not what would be tuned.

    ``settings`` must have ``last_layer_only`` resolved (``FinetuneParams.resolved()``). The error's path is relative
    to the method's entry (``tune_solver``), as :meth:`rayfuse.method.Method.check` expects.
    """
    if settings.tune_solver == "adam":
        return
    key = "tune_solver"
    if model_cfg.name != "mlp" or not model_cfg.hidden:
        # for a model with one layer a converged convex fit forgets the model it started from (every base would tie)
        raise InputError(
            key,
            "adam for a model without hidden layers (lbfgs fits a network's last layer on its features)",
            f"lbfgs with model {model_cfg.name}",
        )
    if base == "raw":
        raise InputError(key, "adam with base: raw (a fresh network has no features to fit a last layer on)", "lbfgs")
    if not settings.last_layer_only:
        raise InputError(key, "adam when every layer is tuned (lbfgs fits the last layer alone: last_layer_only: true)", "lbfgs")


def _output_layer(model: nn.Module, input_shape: Sequence[int]) -> tuple[ModelStructure, nn.Module]:
    """The model's structure and its output layer, found in its graph."""
    structure = read_structure(model, torch.zeros((2, *input_shape)), spec=False)
    return structure, model.get_submodule(structure.output_layer.module)


def fit_last_layer(model: nn.Module, X: np.ndarray, y: np.ndarray, *, l2: float, device: str = "cpu", max_iter: int = 500) -> None:
    """Fit ``model``'s last layer to convergence on its frozen features: softmax regression by full-batch L-BFGS.

    The last layer is the output layer of the model's graph (a Linear) and its features what that layer reads
    (:func:`rayfuse.symmetry.read_structure`). The objective, mean cross-entropy + ``l2`` |W|^2 / (2 n)
    (scikit-learn's ``LogisticRegression`` with C = 1 / l2; the bias is not penalised), is strictly convex for
    ``l2 > 0``, so the result does not depend on where the layer started, only on the features below it. The solve
    runs in float64: with features that leave a direction nearly flat (a dead unit) a float32 line search stalls on
    loss changes below float32 resolution, up to 1e-3 away from the optimum and at a point that depends on the start.
    """
    structure, head = _output_layer(model, X.shape[1:])
    if not isinstance(head, nn.Linear) or head.bias is None:
        raise InputError("model", "a model whose output layer is a Linear with a bias (tune_solver lbfgs)", type(head).__name__)
    model.to(device).eval()
    features = build_node_graph(structure, [structure.features_node])
    with torch.no_grad():
        feats = features(torch.as_tensor(X, dtype=torch.float32, device=device))[0].double()
    target = torch.as_tensor(y, dtype=torch.long, device=device)
    weight = head.weight.detach().double().requires_grad_(True)
    bias = head.bias.detach().double().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    )
    scale = l2 / (2.0 * len(y))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(nn.functional.linear(feats, weight, bias), target) + scale * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise NonFiniteError("fine-tuning (tune_solver lbfgs): the last layer has NaN or Inf values")
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    model.cpu()


def fine_tune(
    params: dict[str, np.ndarray],
    X: np.ndarray,
    y: np.ndarray,
    *,
    model_cfg: Any,
    num_classes: int,
    epochs: int,
    lr: float,
    batch_size: int,
    last_layer_only: bool,
    seed: int,
    device: str = "cpu",
    solver: str = "adam",
    l2: float = 1.0,
) -> dict[str, np.ndarray]:
    """``params`` after ``epochs`` of Adam on ``(X, y)``; with ``last_layer_only`` only the output layer moves (the
    output layer of the model's graph; a model without hidden layers has only that one).

    ``solver="lbfgs"`` (a network, last layer only) fits the last layer to convergence instead (``fit_last_layer``).
    """
    model = model_for_params(params, model_cfg, X.shape[1:], num_classes)
    structure, head = _output_layer(model, X.shape[1:])
    if solver == "lbfgs":
        if not (last_layer_only and structure.hidden):
            raise ValueError("solver lbfgs fits the last layer of a network with hidden layers (last_layer_only)")
        fit_last_layer(model, X, y, l2=l2, device=device)  # deterministic: no seed to draw from
        return get_params(model)
    if last_layer_only and structure.hidden:
        tuned = {id(p) for p in head.parameters()}
        for p in model.parameters():
            if id(p) not in tuned:
                p.requires_grad_(False)
    train_model(model, X, y, epochs=epochs, batch_size=batch_size, lr=lr, optimizer="adam", seed=seed, device=device)
    return get_params(model)


def public_subsets(
    public: Split, sizes: int | list[int] | None, trials: int, rng: np.random.Generator, *, key: str
) -> list[tuple[int, list[np.ndarray]]]:
    """For each size, ``trials`` uniform index draws from the public sample (``key`` names the parameter in errors)."""
    n = len(public)
    wanted = check_public_samples(sizes, n, key=key)
    return [(s, [rng.choice(n, size=s, replace=False) for _ in range(trials)]) for s in wanted]


def check_public_samples(sizes: int | list[int] | None, public_size: int, *, key: str = "public_samples") -> list[int]:
    """The public sample sizes to tune on (sorted), or an :class:`InputError` when the public sample is empty or
    smaller than a size asked for (``key`` names the parameter)."""
    if public_size == 0:
        raise InputError("data.public_size", f"a public sample (> 0) for fine-tuning ({key})", 0, "set data.public_size, e.g. 200")
    wanted = [public_size] if sizes is None else ([sizes] if isinstance(sizes, int) else sorted(set(sizes)))
    if max(wanted) > public_size:
        raise InputError(key, f"at most the public sample's size ({public_size}, data.public_size)", max(wanted))
    return wanted


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def tuning_curve(
    server: ServerContext,
    params: dict[str, np.ndarray] | None,
    settings: TuneSettings,
    *,
    key: str,
    raw_epochs: int | None = None,
    raw_dropout: float = 0.0,
    raw_early_stop: int = 0,
) -> tuple[dict[str, float], list[dict[str, float]], dict[str, np.ndarray]]:
    """Fine-tune ``params`` (``None``: a fresh model trained for ``raw_epochs``) at each public size.

    Returns the metrics at the largest size (averaged over trials), the curve, and the last tuned parameters.
    """
    public = server.data.public
    curve: list[dict[str, float]] = []
    last: dict[str, np.ndarray] = {}
    metrics: dict[str, float] = {}
    for size, draws in public_subsets(public, settings.public_samples, settings.tune_trials, server.rng("tune"), key=key):
        rows = []
        for trial, idx in enumerate(draws):
            seed = server.step_seed("tune", size, trial)
            if params is None:
                model_cfg = server.models.model_cfg.model_copy(update={"dropout": raw_dropout}) if raw_dropout else server.models.model_cfg
                model = build_model(model_cfg, server.data.input_shape, server.data.num_classes, seed=seed)
                train_model(
                    model,
                    public.X[idx],
                    public.y[idx],
                    epochs=raw_epochs or settings.tune_epochs,
                    batch_size=settings.tune_batch_size,
                    lr=settings.tune_lr,
                    seed=seed,
                    device=server.models.device,
                    early_stop_patience=raw_early_stop,
                )
                last = get_params(model)
            else:
                last = fine_tune(
                    params,
                    public.X[idx],
                    public.y[idx],
                    model_cfg=server.models.model_cfg,
                    num_classes=server.data.num_classes,
                    epochs=settings.tune_epochs,
                    lr=settings.tune_lr,
                    batch_size=settings.tune_batch_size,
                    last_layer_only=settings.last_layer_only,
                    seed=seed,
                    device=server.models.device,
                    solver=settings.tune_solver,
                    l2=settings.tune_l2,
                )
            rows.append(evaluate_params(server, last))
        metrics = _mean_metrics(rows)
        curve.append({"public_samples": float(size), **metrics})
    return metrics, curve, last


# The reference's optimiser per baseline (see the module docstring): (lr, last layer only).
_BASE_DEFAULTS = {"average": (0.01, True), "local": (1e-3, False), "raw": (1e-3, False)}


class FinetuneParams(TuneSettings, WeightedUpdates, AggregatorUpdates):
    base: Literal["local", "average", "raw"] = Field(
        "average", description="what to fine-tune: each local model, their average, or a fresh model"
    )
    # None until resolved() fills in the per-base default; only resolved params reach the TuneSettings functions
    tune_lr: float | None = Field(
        None, gt=0, description="Adam learning rate (default: the reference's per base: average 0.01, local / raw 1e-3)"
    )  # type: ignore[assignment]
    last_layer_only: bool | None = Field(
        None, description="networks: tune only the last layer (default: the reference's per base: average yes, local no)"
    )  # type: ignore[assignment]
    raw_epochs: int | None = Field(
        None, ge=1, description="base raw: training epochs (default: 5 for logreg, 50 for networks, as the reference)"
    )
    raw_dropout: float = Field(
        0.0, ge=0, lt=1, description="base raw, networks: dropout after each hidden layer (the reference's learn_dnn2: 0.5)"
    )
    raw_early_stop: int = Field(
        0, ge=0, description="base raw: stop once the training accuracy has not improved for this many epochs (0: off; the reference: 3)"
    )

    def resolved(self) -> FinetuneParams:
        """These parameters with ``tune_lr`` / ``last_layer_only`` filled in from the reference's per-base defaults."""
        lr, last_only = _BASE_DEFAULTS[self.base]
        return self.model_copy(
            update={"tune_lr": self.tune_lr or lr, "last_layer_only": last_only if self.last_layer_only is None else self.last_layer_only}
        )


@register_method
class Finetune(Method[FinetuneParams, None]):
    name = "finetune"
    aliases = ("tuned",)  # its name before 0.2 (it collides with Ray Tune in every sentence); old jobs still run
    Params = FinetuneParams
    summary = "a local / averaged / fresh (raw) model fine-tuned on the server's public sample (GEMS Section 4.4)"
    reference = references.GEMS
    tags = MethodTags(
        uses_local_models=True,
        public_sample=True,
        public_labels=True,  # trains on the public sample's labels
        updates=frozenset({"aggregator", "weighted"}),  # base: average combines the local models through the pipeline
    )
    test_case = MethodCase({"tune_epochs": 1}, {"data": {"public_size": 0.1}})

    @classmethod
    def tags_for(cls, params: FinetuneParams | None = None) -> MethodTags:
        """What the update pipeline sees: ``average`` combines the local models through it (attacks apply); ``local``
        and ``raw`` combine no client upload."""
        if params is not None and params.base != "average":
            return replace(cls.tags, fuses="nothing")
        return cls.tags

    @classmethod
    def check(cls, params: FinetuneParams, setup: RunSetup) -> None:
        """The public sample's size, the raw-only settings, the converged solver and raw dropout against the model."""
        p = params.resolved()
        check_public_samples(p.public_samples, setup.public_size)
        raw_only = {"raw_epochs": p.raw_epochs, "raw_dropout": p.raw_dropout, "raw_early_stop": p.raw_early_stop}
        for name, value in raw_only.items():
            if p.base != "raw" and value:
                raise InputError(name, "only with base: raw", f"{value} with base: {p.base}")
        check_tune_solver(p, setup.model, base=p.base)
        if p.raw_dropout and setup.model.name != "mlp":
            raise InputError(
                "raw_dropout", "an mlp model (dropout after its hidden layers)", f"{p.raw_dropout} with model {setup.model.name}"
            )

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params.resolved()
        key = f"methods.{self.label}.public_samples"
        if p.base == "raw":
            raw_epochs = p.raw_epochs or (5 if server.models.model_cfg.name == "logreg" else 50)
            metrics, curve, params = tuning_curve(
                server, None, p, key=key, raw_epochs=raw_epochs, raw_dropout=p.raw_dropout, raw_early_stop=p.raw_early_stop
            )
            server.log(0, metrics)
            return MethodResult(
                metrics,
                params,
                info={"base": "raw", "tuning_curve": curve, "epochs": raw_epochs, "dropout": p.raw_dropout, "early_stop": p.raw_early_stop},
            )
        if p.base == "average":
            start = server.models.initial_params() if p.aggregator.clip_norm is not None else None  # what clip_norm clips from
            # validated, attacked where configured, combined by the entry's aggregator (default: the weighted mean)
            result = server.updates.collect(server.updates.local_updates(), start=start, weighted=p.weighted)
            averaged, updates = result.params, result.updates
            metrics, curve, params = tuning_curve(server, averaged, p, key=key)
            server.log(0, metrics)
            return MethodResult(metrics, params, info={"base": "average", "tuning_curve": curve, "clients": list(updates)})
        updates = server.updates.accept(server.updates.local_updates())
        per_client, curves = [], []
        for client, update in updates.items():
            metrics, curve, _ = tuning_curve(server, update.params, p, key=key)
            server.log(0, metrics, client=client)
            per_client.append({"client": client, **metrics})
            curves.append(curve)
        names = [k for k in per_client[0] if k != "client"]
        mean = {k: float(np.mean([r[k] for r in per_client])) for k in names}
        std = {f"{k}_std": float(np.std([r[k] for r in per_client])) for k in names}
        curve = [{k: float(np.mean([c[i][k] for c in curves])) for k in curves[0][i]} for i in range(len(curves[0]))]
        server.log(0, mean)
        return MethodResult({**mean, **std}, info={"base": "local", "per_client": per_client, "tuning_curve": curve})
