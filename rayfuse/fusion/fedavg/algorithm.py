"""``fedavg`` and ``fedprox``: multi-round federated averaging.

FedAvg (McMahan et al. 2017): each round the server broadcasts the global model ``w_t`` (one ``put``), each
sampled client runs ``local_epochs`` of local training from it and returns ``(w_t^k, n_k)``, and the server sets::

    w_{t+1} = sum_k (n_k / n) w_t^k                                     (eq. 1; uniform weights if weighted=False)

FedProx (Li et al. 2020) adds the proximal term to each client's objective, ``F_k(w) + (mu/2) ||w - w_t||^2``
(eq. 2), and aggregates the same way.

Each round's aggregate comes from the framework's update pipeline (``server.updates``,
:mod:`rayfuse.updates.pipeline`), which the ``aggregator`` and ``dp`` keys configure and ``federation.attacks`` feeds:
``aggregator`` replaces eq. 1's average by a robust rule (:mod:`rayfuse.updates.robust`: median, trimmed mean, Krum,
Bulyan, geometric median) and optionally clips each update ``w_t^k - w_t`` first (the default, ``mean``, is eq. 1
exactly); ``dp`` makes the round central DP-FedAvg (McMahan et al. 2018; :mod:`rayfuse.updates.central_dp`): Poisson
client sampling with ``dp.sample_rate``, each update clipped to ``dp.clip_norm`` (fixed or adaptive, Andrew et al.
2021), Gaussian noise on the sum, divided by the expected number of clients; the server update (FedOpt's adaptive
step) then acts on the noised model. Opacus' accountant gives the epsilon spent after each round (``dp_epsilon``),
and ``dp.stop_at_epsilon`` ends the run before the round that would exceed it. The pipeline's checks (the rule's
precondition on ``ceil(fraction * N)`` clients per round, what DP-FedAvg needs) run before any client trains.

Subclasses change the server update by overriding :meth:`FedAvg.server_update` (FedOpt, FedRef) and keep extra
server state as typed fields of a :class:`FedAvgState` subclass (:meth:`FedAvg.initial_state`; FedOpt's moments,
FedRef's queue), checkpointed bit for bit by the round loop (``server.rounds``), which owns resume, evaluation
cadence, history and round checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import numpy as np
from pydantic import Field

from rayfuse.fusion import references
from rayfuse.method import (
    ClientContext,
    Method,
    MethodCase,
    MethodResult,
    MethodTags,
    ServerContext,
    Update,
    client_step,
    register_method,
)
from rayfuse.updates.pipeline import clients_per_round
from rayfuse.updates.settings import CohortUpdates

__all__ = ["FedAvg", "FedProx", "FedAvgParams", "FedProxParams", "FedAvgState", "fit", "clients_per_round"]


@client_step("fedavg.fit")
def fit(
    ctx: ClientContext,
    global_params: dict[str, np.ndarray],
    *,
    label: str,
    round: int,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: Literal["adam", "sgd"],
    momentum: float,
    weight_decay: float,
    mu: float = 0.0,
    eval_loss: bool = False,
) -> Update:
    """Local training from the broadcast global model; returns the new parameters, the sample count and the loss.

    ``train_loss`` is the mean data loss over the last local epoch (free: computed while training). With ``eval_loss``
    the client also evaluates the trained model on its whole training split (``eval_loss``; one extra forward pass,
    what the FedRef authors' clients report) and times it separately (``eval_seconds``).
    """
    import time

    from rayfuse.models import compute_loss, train_model

    # the model and the training split stay on the client's device between rounds; only the parameters come back (CPU)
    model = ctx.work_model(global_params)
    X, y = ctx.device_split()
    stats = train_model(
        model,
        X,
        y,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        proximal_mu=mu,
        seed=ctx.step_seed(label, round),
        device=ctx.device,
    )
    metrics = {"train_loss": stats.loss, "train_seconds": stats.seconds}
    if eval_loss:
        started = time.perf_counter()
        metrics["eval_loss"] = compute_loss(model, X, y, device=ctx.device)
        metrics["eval_seconds"] = time.perf_counter() - started
    return Update(ctx.take_params(model), ctx.num_examples, metrics)  # the model's memory itself on the CPU: no second copy


class FedAvgParams(CohortUpdates):
    rounds: int = Field(20, ge=1, le=1_000_000, description="communication rounds (each: sample clients, local training, aggregate)")
    local_epochs: int = Field(2, ge=0, description="epochs of local training per round (0: clients return the model unchanged)")
    lr: float | None = Field(None, gt=0, description="default: train.lr")
    batch_size: int | None = Field(None, ge=1, description="default: train.batch_size")
    optimizer: Literal["adam", "sgd"] | None = Field(None, description="default: train.optimizer")
    evaluate_every: int = Field(1, ge=1, description="evaluate the global model every this many rounds (and after the last)")


class FedProxParams(FedAvgParams):
    mu: float = Field(0.01, ge=0, description="proximal coefficient (Li et al. 2020)")


@dataclass
class FedAvgState:
    """FedAvg's server state between rounds: the global model. Subclasses add typed fields (FedOpt's moments, FedRef's
    queue); every field round-trips bit for bit through the round checkpoint (:func:`rayfuse.rounds.encode_state`)."""

    params: dict[str, np.ndarray]


FP = TypeVar("FP", bound=FedAvgParams)
FS = TypeVar("FS", bound=FedAvgState)


@register_method
class FedAvg(Method[FP, FS]):
    name = "fedavg"
    Params = FedAvgParams
    summary = "federated averaging over rounds (McMahan et al. 2017), sample-weighted"
    reference = references.FEDAVG
    # its rounds go through server.updates.collect_round: streamed where the rule is a sum (the memory check)
    tags = MethodTags(
        multi_round=True, cohort=True, streams_rounds=True, sums=True, updates=frozenset({"aggregator", "dp", "fraction", "weighted"})
    )
    test_case = MethodCase({"rounds": 3, "local_epochs": 1}, step="fedavg.fit")  # its subclasses' too, unless they declare one

    @property
    def mu(self) -> float:
        return 0.0

    # -- hooks for subclasses ------------------------------------------------------------------------------------

    def initial_state(self, params: dict[str, np.ndarray]) -> FS:
        """The round state before round 1 from the initial global model (subclasses with more state return theirs)."""
        return cast(FS, FedAvgState(params))

    def server_update(
        self, server: ServerContext, state: FS, averaged: dict[str, np.ndarray], updates: dict[int, Update], round: int
    ) -> dict[str, np.ndarray]:
        """The new global model from this round's average of the accepted updates (FedAvg: the average itself).

        ``state`` is the round state (``state.params`` the model broadcast this round); a subclass updates its own
        fields of it in place. Server optimizers (FedOpt) step along the pseudo-gradient ``averaged - state.params``.
        """
        return averaged

    def round_metrics(self) -> dict[str, float]:
        """Extra per-round numbers to log after :meth:`server_update` (FedRef: whether it fine-tuned)."""
        return {}

    def client_args(self) -> dict[str, object]:
        """Extra keyword arguments of the client step :func:`fit` (FedProx: ``mu``; FedRef: ``eval_loss``)."""
        return {"mu": self.mu} if self.mu else {}

    # -- the server loop -------------------------------------------------------------------------------------------

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        train = server.models.train_cfg
        pipeline = server.updates  # validation, attacks, clipping / central DP, the aggregation rule
        # the loop plans central DP (stop_at_epsilon may afford fewer rounds), checkpoints the pipeline's state and hands
        # each round its cohort: the accountant's Poisson sample under DP, else ceil(fraction N) clients
        rounds = server.rounds(
            self.initial_state(server.models.initial_params()),
            last=p.rounds,
            evaluate=lambda rnd: server.scoring.evaluate(rounds.state.params),
            evaluate_every=p.evaluate_every,
        )
        state = rounds.state
        step_args = dict(
            label=server.label,
            epochs=p.local_epochs,
            lr=p.lr or train.lr,
            batch_size=p.batch_size or train.batch_size,
            optimizer=p.optimizer or train.optimizer,
            momentum=train.momentum,
            weight_decay=train.weight_decay,
            **self.client_args(),
        )
        for rnd, clients in rounds.cohorts():
            # broadcast, local training, the pipeline's four stages: each reply folded into a running sum as it arrives
            # where the rule is a sum (federation.streaming), else gathered; central DP may sample no client (noise alone)
            result = pipeline.collect_round(fit, state.params, clients, rnd, weighted=p.weighted, step_kwargs={"round": rnd, **step_args})
            updates, extra = result.updates, result.metrics
            state.params = self.server_update(server, state, result.params, updates, rnd)
            losses = np.array([u.metrics.get("train_loss", np.nan) for u in updates.values()])
            counts = np.array([u.num_examples for u in updates.values()], dtype=float)
            # Client compute of the round: seconds of local work per client (training plus any extra evaluation).
            work = [u.metrics.get("train_seconds", np.nan) + u.metrics.get("eval_seconds", 0.0) for u in updates.values()]
            del result  # release this round's objects before the next round arrives
            loss = float(np.sum(losses * counts) / counts.sum()) if updates else float("nan")
            rounds.log(
                {
                    "train_loss": loss,
                    "clients": float(len(updates)),
                    "client_seconds": float(np.mean(work)) if work else 0.0,
                    **extra,
                    **self.round_metrics(),
                }
            )
        info: dict[str, object] = {"rounds": rounds.last, "mu": self.mu}  # the pipeline's record is added by the framework
        return MethodResult(rounds.metrics, state.params, info=info)


@register_method
class FedProx(FedAvg[FedProxParams, FedAvgState]):
    name = "fedprox"
    Params = FedProxParams
    summary = "FedAvg with a proximal term mu/2 ||w - w_t||^2 on each client (Li et al. 2020)"
    reference = references.FEDPROX
    test_case = MethodCase({"rounds": 3, "local_epochs": 1, "mu": 0.1}, step="fedavg.fit")

    @property
    def mu(self) -> float:
        return float(self.params.mu)
