"""``fedavg`` and ``fedprox``: multi-round federated averaging.

FedAvg (McMahan et al. 2017): each round the server broadcasts the global model ``w_t`` (one ``put``), each
sampled client runs ``local_epochs`` of local training from it and returns ``(w_t^k, n_k)``, and the server sets::

    w_{t+1} = sum_k (n_k / n) w_t^k                                     (eq. 1; uniform weights if weighted=False)

FedProx (Li et al. 2020) adds the proximal term to each client's objective, ``F_k(w) + (mu/2) ||w - w_t||^2``
(eq. 2), and aggregates the same way.

``dp`` makes the round central DP-FedAvg (McMahan et al. 2018; :mod:`rayfuse.fusion.central_dp`): Poisson client
sampling with ``dp.sample_rate``, each update clipped to ``dp.clip_norm`` (fixed or adaptive, Andrew et al. 2021),
Gaussian noise on the sum, divided by the expected number of clients; the server update (FedOpt's adaptive step)
then acts on the noised model. Opacus' accountant gives the epsilon spent after each round (``dp_epsilon``), and
``dp.stop_at_epsilon`` ends the run before the round that would exceed it.

``aggregator`` replaces eq. 1's average by a robust rule (:mod:`rayfuse.fusion.robust`: median, trimmed mean, Krum,
Bulyan, geometric median) and optionally clips each update ``w_t^k - w_t`` to a norm first; its precondition on the
number of clients per round (``ceil(fraction * N)``) is checked before any client trains. The default, ``mean``, is
eq. 1 exactly.

Subclasses change the server update by overriding :meth:`FedAvg.server_update` (FedOpt, FedRef) and keep extra
server state as typed fields of a :class:`FedAvgState` subclass (:meth:`FedAvg.initial_state`; FedOpt's moments,
FedRef's queue), checkpointed bit for bit by the round loop (``server.rounds``), which owns resume, evaluation
cadence, history and round checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

import numpy as np
from pydantic import Field

from rayfuse.accountant import compute_epsilon
from rayfuse.errors import InputError
from rayfuse.fusion import references
from rayfuse.fusion.central_dp import CentralDPSettings, DPPlan, apply_dp_round, describe_plan, plan_dp, sample_poisson
from rayfuse.fusion.robust import AggregatorSettings, aggregate_updates, check_aggregator
from rayfuse.method import (
    ClientContext,
    Method,
    MethodParams,
    MethodResult,
    MethodTags,
    RunSetup,
    ServerContext,
    Update,
    client_step,
    dp_refusal,
    register_method,
)

__all__ = ["FedAvg", "FedProx", "FedAvgParams", "FedProxParams", "FedAvgState", "fit", "check_dp_params"]

@client_step("fedavg.fit")
def fit(ctx: ClientContext, global_params: dict[str, np.ndarray], *, label: str, round: int, epochs: int, lr: float,
        batch_size: int, optimizer: Literal["adam", "sgd"], momentum: float, weight_decay: float, mu: float = 0.0,
        eval_loss: bool = False) -> Update:
    """Local training from the broadcast global model; returns the new parameters, the sample count and the loss.

    ``train_loss`` is the mean data loss over the last local epoch (free: computed while training). With ``eval_loss``
    the client also evaluates the trained model on its whole training split (``eval_loss``; one extra forward pass,
    what the FedRef authors' clients report) and times it separately (``eval_seconds``).
    """
    import time

    from rayfuse.models import compute_loss, get_params, set_params, train_model

    model = set_params(ctx.build_model(seed=0), global_params)
    stats = train_model(model, ctx.train.X, ctx.train.y, epochs=epochs, batch_size=batch_size, lr=lr, optimizer=optimizer,
                        momentum=momentum, weight_decay=weight_decay, proximal_mu=mu, seed=ctx.step_seed(label, round),
                        device=ctx.device)
    metrics = {"train_loss": stats.loss, "train_seconds": stats.seconds}
    if eval_loss:
        started = time.perf_counter()
        metrics["eval_loss"] = compute_loss(model, ctx.train.X, ctx.train.y, device=ctx.device)
        metrics["eval_seconds"] = time.perf_counter() - started
    return Update(get_params(model), ctx.num_examples, metrics)


class FedAvgParams(MethodParams):
    rounds: int = Field(20, ge=1, le=1_000_000)
    local_epochs: int = Field(2, ge=0, description="epochs of local training per round (0: clients return the model unchanged)")
    lr: float | None = Field(None, gt=0, description="default: train.lr")
    batch_size: int | None = Field(None, ge=1, description="default: train.batch_size")
    optimizer: Literal["adam", "sgd"] | None = Field(None, description="default: train.optimizer")
    fraction: float = Field(1.0, gt=0, le=1, description="fraction of clients sampled per round (Flower's fraction_train)")
    weighted: bool = Field(True, description="weight clients by their sample counts")
    evaluate_every: int = Field(1, ge=1, description="evaluate the global model every this many rounds (and after the last)")
    aggregator: AggregatorSettings = Field(default_factory=AggregatorSettings, description="how the clients' models are "
                                           "combined: mean (eq. 1), median, trimmed_mean, krum, bulyan, geometric_median; "
                                           "clip_norm clips each update first")
    dp: CentralDPSettings | None = Field(None, description="central DP-FedAvg (McMahan et al. 2018): noise_multiplier or "
                                         "target_epsilon, clip_norm, adaptive, sample_rate, delta, accountant, stop_at_epsilon; "
                                         "null: no DP")


def clients_per_round(num_clients: int, fraction: float) -> int:
    """How many clients :meth:`ServerContext.sample_clients` samples each round: ``ceil(fraction * N)``, at least 1."""
    return min(num_clients, max(1, int(np.ceil(fraction * num_clients))))


class FedProxParams(FedAvgParams):
    mu: float = Field(0.01, ge=0, description="proximal coefficient (Li et al. 2020)")


@dataclass
class FedAvgState:
    """FedAvg's server state between rounds: the global model. Subclasses add typed fields (FedOpt's moments, FedRef's
    queue); every field round-trips bit for bit through the round checkpoint (:func:`rayfuse.rounds.encode_state`)."""

    params: dict[str, np.ndarray]
    dp: dict[str, float] = field(default_factory=dict)  # DP-FedAvg: the clip norm of the next round (adaptive clipping moves it)


FP = TypeVar("FP", bound=FedAvgParams)
FS = TypeVar("FS", bound=FedAvgState)


@register_method
class FedAvg(Method[FP, FS]):
    name = "fedavg"
    Params = FedAvgParams
    summary = "federated averaging over rounds (McMahan et al. 2017), sample-weighted"
    reference = references.FEDAVG
    tags = MethodTags(multi_round=True)

    @property
    def mu(self) -> float:
        return 0.0

    @classmethod
    def check(cls, params: FP, setup: RunSetup) -> None:
        """The aggregator's precondition on the clients sampled per round; with ``dp``, what DP-FedAvg needs."""
        if params.dp is not None:
            check_dp_params(cls, params, setup.num_clients)
            return
        check_aggregator(params.aggregator, clients_per_round(setup.num_clients, params.fraction))

    # -- hooks for subclasses ------------------------------------------------------------------------------------

    def initial_state(self, params: dict[str, np.ndarray]) -> FS:
        """The round state before round 1 from the initial global model (subclasses with more state return theirs)."""
        return cast(FS, FedAvgState(params))

    def server_update(self, server: ServerContext, state: FS, averaged: dict[str, np.ndarray], updates: dict[int, Update],
                      round: int) -> dict[str, np.ndarray]:
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
        train = server.train_cfg
        fed = server.federation
        dp = p.dp
        plan = plan_dp(dp, server.num_clients, p.rounds) if dp is not None else None
        last = plan.rounds if plan is not None else p.rounds
        start = self.initial_state(server.initial_params())
        if dp is not None:
            start.dp = {"clip_norm": dp.clip_norm}
        rounds = server.rounds(start, last=last, evaluate=lambda rnd: server.evaluate(rounds.state.params),
                               evaluate_every=p.evaluate_every)
        state = rounds.state
        step_args = dict(label=server.label, epochs=p.local_epochs, lr=p.lr or train.lr, batch_size=p.batch_size or train.batch_size,
                         optimizer=p.optimizer or train.optimizer, momentum=train.momentum, weight_decay=train.weight_decay,
                         **self.client_args())
        for rnd in rounds:
            extra: dict[str, float] = {}
            if plan is not None:
                averaged, updates, extra = self._dp_round(server, state, plan, rnd, step_args)
            else:
                clients = server.sample_clients(p.fraction, rnd)
                gathered = fed.run(fit, fed.put(state.params), clients=clients, round=rnd, **step_args)
                averaged, updates = aggregate_updates(server, gathered, p.aggregator, reference=state.params, weighted=p.weighted,
                                                      round=rnd)
                del gathered
            state.params = self.server_update(server, state, averaged, updates, rnd)
            losses = np.array([u.metrics.get("train_loss", np.nan) for u in updates.values()])
            counts = np.array([u.num_examples for u in updates.values()], dtype=float)
            # Client compute of the round: seconds of local work per client (training plus any extra evaluation).
            work = [u.metrics.get("train_seconds", np.nan) + u.metrics.get("eval_seconds", 0.0) for u in updates.values()]
            del averaged  # release this round's objects before the next round arrives
            loss = float(np.sum(losses * counts) / counts.sum()) if updates else float("nan")
            rounds.log({"train_loss": loss, "clients": float(len(updates)), "client_seconds": float(np.mean(work)) if work else 0.0,
                        **extra, **self.round_metrics()})
        info: dict[str, object] = {"rounds": last, "mu": self.mu}
        if plan is not None and dp is not None:
            info["dp"] = describe_plan(dp, plan)
        return MethodResult(rounds.metrics, state.params, info=info)

    def _dp_round(self, server: ServerContext, state: FS, plan: DPPlan, rnd: int,
                  step_args: dict[str, object]) -> tuple[dict[str, np.ndarray], dict[int, Update], dict[str, float]]:
        """One DP-FedAvg round: Poisson-sampled clients train, their updates are clipped, summed and noised
        (:func:`rayfuse.fusion.central_dp.apply_dp_round`); returns the noised model, the updates and the round's DP
        numbers (the clip norm, the epsilon spent so far)."""
        dp = self.params.dp
        assert dp is not None
        fed = server.federation
        clients = sample_poisson(server.rng("dp-sample", rnd), fed.client_ids, dp.sample_rate)
        updates: dict[int, Update] = {}
        if clients:  # no client sampled: the round is noise alone, as the accountant assumes
            gathered = fed.run(fit, fed.put(state.params), clients=clients, round=rnd, **step_args)
            updates = server.accept_updates(gathered, state.params)
            del gathered
            if server.list_attackers(rnd):
                updates = server.attack_updates(updates, state.params, rnd)
        ids = sorted(updates)
        done = apply_dp_round([updates[c].params for c in ids], state.params, dp, plan, float(state.dp["clip_norm"]),
                              server.rng("dp-noise", rnd))
        state.dp = {"clip_norm": done.clip_norm}
        epsilon = compute_epsilon(plan.noise_multiplier, dp.sample_rate, rnd, dp.delta, dp.accountant)
        return done.params, {c: updates[c] for c in ids}, {**done.metrics, "dp_sampled": float(len(clients)), "dp_epsilon": epsilon}


def check_dp_params(cls: type[FedAvg[Any, Any]], params: FedAvgParams, num_clients: int) -> None:
    """Refuse ``dp`` where DP-FedAvg's guarantee would not hold: a method whose server reads more of each client than
    its update (``no_dp``), a robust aggregator or a second clipping (the Gaussian mechanism's sensitivity is that of a
    sum of updates clipped once to ``dp.clip_norm``), ``fraction`` (``dp.sample_rate`` samples the clients) and sample
    weights (a client's weight would be its own private count); then the DP settings themselves (:func:`plan_dp`)."""
    dp = params.dp
    assert dp is not None
    if cls.tags.no_dp:  # rayfuse.method.check_tags refuses it before start; here for a direct check() call
        raise dp_refusal(cls, cls.name, "dp")
    if not params.aggregator.is_plain_mean:
        raise InputError("aggregator", "mean without clip_norm with dp (DP-FedAvg clips each update to dp.clip_norm and noises "
                         "their sum; a robust rule is not a sum, so the noise would not match its sensitivity)",
                         params.aggregator.model_dump())
    if "fraction" in params.model_fields_set and params.fraction != 1.0:
        raise InputError("fraction", "1.0 (unset) with dp (dp.sample_rate samples each client independently)", params.fraction)
    if "weighted" in params.model_fields_set and params.weighted:
        raise InputError("weighted", "false (unset) with dp (DP-FedAvg weights every client 1: a sample-count weight would be "
                         "private and unbounded)", params.weighted)
    plan_dp(dp, num_clients, params.rounds)


@register_method
class FedProx(FedAvg[FedProxParams, FedAvgState]):
    name = "fedprox"
    Params = FedProxParams
    summary = "FedAvg with a proximal term mu/2 ||w - w_t||^2 on each client (Li et al. 2020)"
    reference = references.FEDPROX

    @property
    def mu(self) -> float:
        return float(self.params.mu)
