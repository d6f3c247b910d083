"""The update pipeline: the one path from a round's client replies to an aggregate, owned by the framework.

A method asks ``server.updates.collect(gathered, reference, round)`` for the round's aggregate; the pipeline runs,
in order (after Flower's DP strategy wrappers, which wrap the aggregation rather than live in each strategy, and
pfl-research's backend postprocessors, which clip and noise between the clients' statistics and their aggregation):

1. **validate** (:meth:`UpdatePipeline.accept`): each reply is an :class:`~rayfuse.method.Update` with the reference's
   keys, shapes and dtypes, finite values and metrics, and the client's planned sample count; a bad one is recorded
   (``update_rejected``) and never used; fewer than ``federation.min_clients`` valid updates stop the run;
2. **simulated attacks** (``federation.attacks``, :mod:`rayfuse.updates.attacks`): the attacking clients' updates replaced by
   their attacks', relative to the model the clients started from; each recorded as an ``attack`` event;
3. **clipping and central DP noise**: ``aggregator.clip_norm`` clips each update, or, with central DP-FedAvg
   (:class:`~rayfuse.updates.central_dp.CentralDPSettings`), the clipped updates' sum is noised and divided by the
   expected number of clients (:func:`~rayfuse.updates.central_dp.apply_dp_round`);
4. **the aggregation rule** (``aggregator.name``, :func:`rayfuse.updates.robust.aggregate`): mean, median, trimmed
   mean, Krum, Bulyan, geometric median.

The pipeline is configured once per method entry: ``federation.attacks`` from the run, ``aggregator`` and ``dp`` from
the entry's parameters (:func:`pipeline_settings`, the one place that reads them), and it is checked once, before
anything starts (:func:`check_update_pipeline`, run by the runner's pre-start checks): a method that fuses something
the pipeline cannot act on (``MethodTags.fuses``: posteriors, statistics, predictions) is refused with attacks, a robust
rule or DP, in one line naming the key. The one-shot DP upload (:class:`~rayfuse.updates.privacy.UploadDP`) is the
pipeline's too, on the client's side: :meth:`UpdatePipeline.local_models` gathers the clipped, noised uploads instead
of the raw local models.

Nothing here imports Ray: the coordinator builds one pipeline per method run (``server.updates``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from rayfuse.config import AttackSpec
from rayfuse.errors import InputError, RunFailure
from rayfuse.memory import available_memory
from rayfuse.method import (
    Aggregate,
    Gathered,
    MethodSpec,
    Rejected,
    RunSetup,
    ServerContext,
    Update,
    dp_options_text,
    update_setting,
)
from rayfuse.updates.accountant import compute_epsilon
from rayfuse.updates.aggregate import weighted_average
from rayfuse.updates.attacks import apply_attacks
from rayfuse.updates.central_dp import CentralDPSettings, DPPlan, apply_dp_round, describe_plan, noise_dp_round, plan_dp, sample_poisson
from rayfuse.updates.privacy import UploadDP, check_upload_dp, gather_dp_uploads
from rayfuse.updates.robust import AggregatorSettings, aggregate, check_aggregator, check_enough_updates
from rayfuse.updates.secure import SumEncoding, neighbourhood, secure_round
from rayfuse.updates.streaming import Fold, NodeFold, RoundFold, RunningSum, update_problem

__all__ = [
    "UpdatePipeline",
    "check_aggregation",
    "check_round_memory",
    "check_update_pipeline",
    "clients_per_round",
    "combine_models",
    "folds_rounds",
    "is_sum",
    "local_model_copies",
    "pipeline_settings",
    "round_memory",
]

Params = dict[str, np.ndarray]
R = TypeVar("R")
DPSettings = CentralDPSettings | UploadDP


def pipeline_settings(spec: MethodSpec) -> tuple[AggregatorSettings, DPSettings | None]:
    """The pipeline's settings in a method's entry: its ``aggregator`` (default: the plain mean) and its ``dp`` (central
    DP-FedAvg or the one-shot upload; ``None``: no DP), where its tags take them. The one place that reads them: they
    stay method keys, so a run can compare rules and budgets side by side (``krum: {method: fedavg, aggregator: ...}``
    beside ``fedavg``)."""
    aggregator = update_setting(spec, "aggregator")
    dp = update_setting(spec, "dp")
    return (
        aggregator if isinstance(aggregator, AggregatorSettings) else AggregatorSettings(),
        dp if isinstance(dp, (CentralDPSettings, UploadDP)) else None,
    )


def is_sum(aggregator: AggregatorSettings, dp: DPSettings | None) -> bool:
    """Whether a rule is a sum of per-client terms (the plain or weighted mean, the mean with ``clip_norm``, central
    DP's clipped sum): the one test of whether a round can be folded reply by reply, or in partial sums where the
    clients are (:meth:`UpdatePipeline.round_mode`), and of what the pre-start checks assume of it
    (:func:`check_aggregation`, :func:`round_memory`)."""
    return isinstance(dp, CentralDPSettings) or aggregator.name == "mean"


def folds_rounds(spec: MethodSpec) -> bool:
    """Whether a method entry's rounds can be folded into sums: its class sends them through
    ``server.updates.collect_round`` (``MethodTags.streams_rounds``, the FedAvg family) and its rule :func:`is_sum`."""
    return spec.tags.streams_rounds and is_sum(*pipeline_settings(spec))


def clients_per_round(num_clients: int, fraction: float) -> int:
    """How many clients :meth:`UpdatePipeline.sample_clients` samples each round: ``ceil(fraction * N)``, at least 1."""
    return min(num_clients, max(1, int(np.ceil(fraction * num_clients))))


# ---------------------------------------------------------------------------------------------------------------
# Before anything starts


def check_update_pipeline(specs: Sequence[MethodSpec], setup: RunSetup, attacks: Sequence[AttackSpec]) -> None:
    """Refuse, before any client trains, what the update pipeline cannot do for each method entry (one line naming the
    key; raises :class:`InputError`):

    * ``federation.attacks``, a robust ``aggregator`` (or ``clip_norm``) or ``dp`` for a method that fuses posteriors,
      statistics or predictions (``MethodTags.fuses``): they act on parameter updates. Methods that combine no client
      upload (``fuses = "nothing"``: ``local``, oracles) run as references beside attacked ones;
    * the rule's precondition on the number of models it combines (``ceil(fraction N)`` per round with ``fraction``,
      else every client);
    * central DP-FedAvg where its guarantee would not hold: a robust rule or a second clipping, ``fraction`` or sample
      weights, and the DP plan itself (:func:`~rayfuse.updates.central_dp.plan_dp`); the one-shot upload's delta and target epsilon
      (:func:`~rayfuse.updates.privacy.check_upload_dp`).
    """
    for spec in specs:
        where = f"methods.{spec.label}"
        fused = spec.tags.fuses
        aggregator, dp = pipeline_settings(spec)
        if fused != "parameters":
            if attacks and fused != "nothing":
                count = f"{len(attacks)} attack{'s' if len(attacks) > 1 else ''} on clients {sorted(a.client for a in attacks)}"
                raise InputError(
                    "federation.attacks",
                    f"no attacks with method {spec.method!r} ({where} fuses {fused}; attacks act on parameter updates)",
                    count,
                    "drop the attacks or that method (attacks apply where the update pipeline combines parameter "
                    f"updates: {_parameter_fusers()}, with their default parameters)",
                )
            if not aggregator.is_plain_mean:
                raise InputError(
                    f"{where}.aggregator",
                    f"the default mean for method {spec.method!r} (it fuses {fused}; a robust rule and clip_norm act on parameter updates)",
                    aggregator.name if aggregator.name != "mean" else "clip_norm",
                )
            if dp is not None:
                raise InputError(
                    f"{where}.dp",
                    f"no dp for method {spec.method!r} (it fuses {fused}; dp acts on parameter updates)",
                    "a dp section",
                    f"methods.<label>.dp is {dp_options_text()}",
                )
            continue
        if isinstance(dp, CentralDPSettings) and not spec.tags.cohort:
            raise InputError(
                f"{where}.dp",
                f"no central dp for method {spec.method!r} (DP-FedAvg's noise and accountant assume each round trains "
                "the cohort the round loop draws, which this method does not declare: MethodTags.cohort)",
                "a dp section",
                "a method whose rounds train exactly the cohort of rounds.cohorts() declares "
                "tags = MethodTags(cohort=True) (docs/writing-a-method.md)",
            )
        try:
            if isinstance(dp, CentralDPSettings):
                _check_central_dp(spec, aggregator, dp, setup.num_clients)
            elif (fraction := update_setting(spec, "fraction")) is not None:  # a per-round sample (the FedAvg family)
                check_aggregator(
                    aggregator, clients_per_round(setup.num_clients, float(fraction)), where="aggregator", what="clients per round"
                )
            else:
                check_aggregator(aggregator, setup.num_clients, where="aggregator", what="clients")
            if isinstance(dp, UploadDP):
                check_upload_dp(dp, setup)
        except InputError as exc:
            raise exc.at(f"{where}.{exc.path}") from None


def _parameter_fusers() -> str:
    """The registered methods whose default entry fuses parameters (``MethodTags.fuses``), for a refusal's hint."""
    from rayfuse.method import METHODS

    return ", ".join(sorted(name for name, cls in METHODS.items() if cls.tags.fuses == "parameters"))


def check_aggregation(specs: Sequence[MethodSpec], federation: Any) -> None:
    """Refuse an explicit ``federation.aggregation: per_actor`` or ``per_node`` that no round could use (one line;
    raises :class:`InputError`), by the test :meth:`UpdatePipeline.round_mode` applies to each round
    (:func:`folds_rounds`): with ``federation.attacks`` (an attacked round needs each client's update), with an entry
    of the FedAvg family whose rule is not a sum (a robust ``aggregator``: its rounds would gather), or when no
    configured entry folds rounds at all (one-shot methods, other multi-round ones); ``per_node`` also on the
    in-process backend (it has no nodes). Unset, the mode falls back per round instead (an ``aggregation`` event says
    so)."""
    mode = federation.aggregation
    if mode not in ("per_actor", "per_node"):
        return
    if mode == "per_node" and federation.backend == "local":
        raise InputError(
            "federation.aggregation",
            "flat, per_actor or unset with the in-process backend (per_node folds on each node of a Ray cluster)",
            "per_node",
        )
    if federation.attacks:
        raise InputError(
            "federation.aggregation",
            "flat or unset with federation.attacks (an attacked round needs each client's update, not a partial sum)",
            mode,
        )
    for spec in specs:  # a round of this entry would gather every update (UpdatePipeline.round_mode)
        if spec.tags.streams_rounds and not folds_rounds(spec):
            raise InputError(
                "federation.aggregation",
                f"flat or unset with methods.{spec.label}.aggregator {pipeline_settings(spec)[0].name!r} ({mode} "
                "partial sums need a rule that is a sum: mean, mean with clip_norm, central DP)",
                mode,
            )
    if not any(folds_rounds(spec) for spec in specs):
        from rayfuse.method import METHODS

        streaming = sorted(name for name, cls in METHODS.items() if cls.tags.streams_rounds)
        raise InputError(
            "federation.aggregation",
            f"flat or unset when no configured method folds rounds of updates into sums ({mode} serves "
            f"{', '.join(streaming)}), not with {', '.join(spec.label for spec in specs)}",
            mode,
        )


def check_secure_aggregation(specs: Sequence[MethodSpec], setup: RunSetup, federation: Any) -> None:
    """``federation.secure_aggregation`` where it cannot hold, in one line: a method whose server needs more than a sum
    (its tags' ``sums``), an aggregation rule that is not a sum (median, Krum...: every update at once), simulated
    attacks (the server never holds an update to attack), a round of fewer than 2 clients (a sum of one is that
    client's update) or SecAgg+ settings the cohort cannot meet (a threshold outside its neighbourhood's majorities)."""
    from rayfuse.method import METHODS
    from rayfuse.updates.secure import secure_params

    config = federation.secure_aggregation
    if config is None:
        return
    if federation.attacks:
        raise InputError(
            "federation.attacks",
            "no simulated attacks with federation.secure_aggregation (the server never holds one client's update to attack)",
            [attack.kind for attack in federation.attacks],
            "drop federation.attacks or federation.secure_aggregation",
        )
    if setup.evaluation != "central":  # each client's held-out scores would reach the server in the clear
        raise InputError(
            "evaluation",
            "central with federation.secure_aggregation (federated evaluation sends each client's held-out scores in the clear)",
            setup.evaluation,
            "score on the server's test set, or run federated evaluation without secure aggregation",
        )
    summing = ", ".join(name for name, cls in METHODS.items() if cls.tags.sums)
    if config.distributed_dp and not any(isinstance(pipeline_settings(s)[1], CentralDPSettings) for s in specs):
        raise InputError(
            "federation.secure_aggregation.distributed_dp",
            "a methods entry with dp (central DP-FedAvg: the clients add its noise)",
            True,
            "give an entry dp: {noise_multiplier, clip_norm, sample_rate}, or drop distributed_dp",
        )
    for spec in specs:
        if not spec.tags.sums:
            raise InputError(
                f"methods.{spec.label}",
                f"methods whose server needs only a sum of the clients' updates with federation.secure_aggregation ({summing})",
                spec.method,
                f"its server reads more than the sum of the clients' uploads (each client's {spec.tags.fuses}, or its "
                "metrics); run it without federation.secure_aggregation",
            )
        aggregator, dp = pipeline_settings(spec)
        if not is_sum(aggregator, dp):
            raise InputError(
                f"methods.{spec.label}.aggregator",
                "an aggregator that is a sum with federation.secure_aggregation (mean, with or without clip_norm)",
                aggregator.name,
                f"{aggregator.name} needs every client's update at once, which secure aggregation never reveals",
            )
        if config.distributed_dp and isinstance(dp, CentralDPSettings) and dp.adaptive is not None:
            raise InputError(
                f"methods.{spec.label}.dp.adaptive",
                "fixed clipping with federation.secure_aggregation.distributed_dp (adaptive clipping's noised count is the server's)",
                "adaptive clipping",
                "drop dp.adaptive or distributed_dp",
            )
        cohort = clients_per_round(setup.num_clients, float(update_setting(spec, "fraction", 1.0)))
        if setup.num_clients < 2 and not isinstance(dp, CentralDPSettings):  # no fraction gives a sum of 2
            raise InputError(
                "partition.num_clients",
                "at least 2 clients with federation.secure_aggregation (a sum of one is that client's reply)",
                setup.num_clients,
            )
        if cohort < 2 and not isinstance(dp, CentralDPSettings):
            raise InputError(
                f"methods.{spec.label}.fraction",
                "a fraction whose rounds train at least 2 clients with federation.secure_aggregation (a sum of one is that client's update)",
                update_setting(spec, "fraction", 1.0),
            )
        if cohort >= 2:  # the counts weigh the metrics (and the models, where weighted)
            max_count = max(setup.train_sizes) if setup.train_sizes else 1
            secure_params(config, cohort, SumEncoding.level_bound(config.quantization_range, max_count, 1))


def round_memory(spec: MethodSpec, federation: Any, num_clients: int, model_bytes: int) -> tuple[int, str]:
    """The coordinator's memory bound for one method entry's aggregation (bytes) and what sets it.

    Streamed (a FedAvg-family round whose rule is a sum, with ``federation.streaming`` and no attacks): the global
    model, the running sum and the reply in hand, 3 x the model (central DP sums in float64: 4 x). Gathered: the K
    replies of a round (K = ``ceil(fraction N)``, every client for a one-shot method), the global model and the rule's
    output, plus the rule's working memory: K clipped copies with ``clip_norm``, one more model for the geometric
    median's iterate (the other rules work chunk by chunk)."""
    aggregator, dp = pipeline_settings(spec)
    central = isinstance(dp, CentralDPSettings)
    if folds_rounds(spec) and federation.streaming and not federation.attacks:
        return (4 if central else 3) * model_bytes, "streamed"
    fraction = update_setting(spec, "fraction")
    k = clients_per_round(num_clients, float(fraction)) if fraction is not None else num_clients
    copies = k + 2 + (k if aggregator.clip_norm is not None or central else 0) + (1 if aggregator.name == "geometric_median" else 0)
    return copies * model_bytes, f"gathered: {k} updates"


def local_model_copies(spec: MethodSpec) -> int:
    """How many copies of every client's local model a method entry holds on the coordinator at once: none where it
    gathers none (not ``MethodTags.uses_local_models``, or distill's ``teachers: clients``: predictions only), two for
    distill's ``teachers: parameters`` (the uploads, and the teacher models built from them for the whole
    distillation), else one (the uploads; a member is built one at a time where it is evaluated)."""
    tags = spec.tags
    return tags.local_model_copies if tags.uses_local_models else 0


def check_round_memory(
    specs: Sequence[MethodSpec],
    federation: Any,
    num_clients: int,
    num_params: int,
    *,
    client_params: Sequence[int] = (),
    available: int | None = None,
) -> None:
    """Refuse, before anything starts, a method entry whose aggregation (:func:`round_memory`), or whose gathering of
    every client's local model (:func:`local_model_copies`: distill's teachers, an ensemble's members...), would not fit
    the coordinator's memory: ``federation.coordinator.memory`` when set, else this machine's available memory (the
    coordinator runs on the driver's node). ``client_params``: each client's parameter count (its own model's, with
    ``federation.client_overrides.<i>.model``); default ``num_params`` each. Raises :class:`InputError` naming the key
    that makes it gather."""
    from rayfuse.data.datasets import format_bytes

    # float32: the models are torch modules in their default dtype; num_params is their parameter count
    model_bytes = 4 * int(num_params)
    local_bytes = 4 * int(sum(client_params)) if client_params else num_clients * model_bytes
    if federation.coordinator.memory is not None:
        limit, source = int(federation.coordinator.memory), "federation.coordinator.memory"
    else:
        free = available if available is not None else available_memory()
        if free is None:  # not known here: nothing to hold the run to
            return
        limit, source = free, "the available memory"
    for spec in specs:
        copies = local_model_copies(spec)
        if spec.tags.fuses == "parameters":  # one layout: every client's model is the run's
            bound, what = round_memory(spec, federation, num_clients, model_bytes)
            expected = (
                f"an aggregation within the coordinator's memory ({source}: {format_bytes(limit)}; a "
                f"{format_bytes(model_bytes)} model, its updates, the result and the rule's working memory)"
            )
        elif copies:  # every client's local model, each of its own size, the result and one more
            bound = copies * local_bytes + 2 * model_bytes
            what = f"gathered: {num_clients} local models, {format_bytes(local_bytes)}"
            twice = "; held twice: the uploads and the teachers built from them" if copies == 2 else ""
            expected = f"every client's local model within the coordinator's memory ({source}: {format_bytes(limit)}{twice})"
        else:
            continue
        if bound <= limit:
            continue
        aggregator, _ = pipeline_settings(spec)
        if copies == 2:
            key, hint = f"methods.{spec.label}.teachers", "teachers: clients keeps each local model on its client (predictions only)"
        elif spec.tags.streams_rounds and not federation.streaming:
            key, hint = "federation.streaming", "set federation.streaming: true (the rule is a sum)"
        elif spec.tags.streams_rounds and federation.attacks:
            key, hint = "federation.attacks", "attacked rounds gather every update: drop the attacks or use fewer clients"
        elif not aggregator.is_plain_mean:
            key, hint = f"methods.{spec.label}.aggregator", "a rule that is a sum (mean) streams, or give the coordinator more memory"
        else:
            key, hint = f"methods.{spec.label}", "this method gathers every client's model: fewer clients or a smaller model"
        raise InputError(key, expected, f"{format_bytes(bound)} ({what})", hint)


def _check_central_dp(spec: MethodSpec, aggregator: AggregatorSettings, dp: CentralDPSettings, num_clients: int) -> None:
    """DP-FedAvg's conditions (paths relative to the entry): its noise is calibrated to the sensitivity ``C`` of a sum
    of updates clipped once, each weighing 1, the clients sampled by ``dp.sample_rate`` (a method whose server step reads
    more of each client than its update, ``MethodTags.no_dp``, is refused before this by
    :func:`rayfuse.prestart.check_tags`)."""
    params = spec.params
    if not aggregator.is_plain_mean:
        raise InputError(
            "aggregator",
            "mean without clip_norm with dp (DP-FedAvg clips each update to dp.clip_norm and noises "
            "their sum; a robust rule is not a sum, so the noise would not match its sensitivity)",
            aggregator.model_dump(),
        )
    fraction = update_setting(spec, "fraction", 1.0)
    if "fraction" in params.model_fields_set and fraction != 1.0:
        raise InputError("fraction", "1.0 (unset) with dp (dp.sample_rate samples each client independently)", fraction)
    weighted = update_setting(spec, "weighted", False)
    if "weighted" in params.model_fields_set and weighted:
        raise InputError(
            "weighted",
            "false (unset) with dp (DP-FedAvg weights every client 1: a sample-count weight would be private and unbounded)",
            weighted,
        )
    rounds = params.model_dump(include={"rounds"})["rounds"]  # a method with cohort declares its rounds (checked at resolve)
    plan_dp(dp, num_clients, int(rounds))


def combine_models(
    models: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | None,
    aggregator: AggregatorSettings,
    *,
    start: Mapping[str, np.ndarray] | None,
    initial: Callable[[], Params],
    label: str,
) -> Params:
    """The pipeline's stages 3-4 (clipping, the rule) on models already received: :meth:`UpdatePipeline.combine`, and
    the same for a method that runs ``aligned``'s merge inside its own run (``distill``'s ``init: aligned``, with the
    aligned settings' own ``aggregator``). ``start``: the model clipping measures from (default ``initial()``, the run's
    initial model). Raises :class:`RunFailure` when the rule's precondition excludes ``len(models)``."""
    if aggregator.is_plain_mean:
        return weighted_average(models, weights)
    check_enough_updates(aggregator, len(models), label)
    origin = start if start is not None or aggregator.clip_norm is None else initial()
    return aggregate(models, weights, aggregator, reference=origin)


# ---------------------------------------------------------------------------------------------------------------
# The pipeline


class UpdatePipeline:
    """``server.updates`` (implements :class:`rayfuse.method.UpdateService`): one per method run.

    Parameters
    ----------
    server : ServerContext
        The method's server: its federation, events, seeded randomness and initial model.
    spec : MethodSpec
        The method entry (its ``aggregator`` and ``dp``, where its tags take them: :func:`pipeline_settings`).
    attacks : list of AttackSpec
        ``federation.attacks``.
    planned_examples : callable
        A client's training-set size in the partition plan (an update's count must be it).
    reference_of : callable
        A client's model layout (the run's model, or its own ``client_overrides`` model): what an update is checked
        against when the method gives no reference.
    local_updates : callable
        Every client's trained local model (the coordinator gathers them once per run and shares them by the methods).
    streaming : bool
        ``federation.streaming``: :meth:`collect_round` folds a sum-decomposable round reply by reply.
    aggregation : "flat", "per_actor", "per_node" or None
        ``federation.aggregation`` (``None``: chosen by :meth:`round_mode`).
    clients_per_actor : int
        ``federation.clients_per_actor``: per-actor partial sums need more than 1.
    secure : SecureAggregationConfig, optional
        ``federation.secure_aggregation``: :meth:`collect_round` sums the cohort's updates under SecAgg+
        (:mod:`rayfuse.updates.secure`), so the server never holds one client's update.

    It also holds the reply path that is not a parameter update (:meth:`accept_replies`, :meth:`reject`,
    :meth:`sample_clients`, :meth:`local_updates`); the coordinator's subclass adds ``run_cached`` (the step-result
    cache is the engine's store).
    """

    def __init__(
        self,
        server: ServerContext,
        spec: MethodSpec,
        attacks: Sequence[AttackSpec],
        *,
        planned_examples: Callable[[int], int],
        reference_of: Callable[[int], Params],
        local_updates: Callable[[], Gathered[Update]],
        streaming: bool = True,
        aggregation: Literal["flat", "per_actor", "per_node"] | None = None,
        clients_per_actor: int = 1,
        secure: Any = None,
    ) -> None:
        self._server = server
        self.secure = secure
        self._secure: dict[str, Any] = {}  # the secure rounds' record (info()["secure_aggregation"])
        self.streaming = streaming
        self.aggregation = aggregation
        self._per_actor = clients_per_actor
        self._rounds_collected = False  # collect_round ran: info() records the aggregation mode
        self._last_mode: str | None = None
        self._local_updates = local_updates
        self.aggregator, self.dp = pipeline_settings(spec)
        self.fraction = float(update_setting(spec, "fraction", 1.0))
        self.attacks = list(attacks)
        self._planned = planned_examples
        self._reference_of = reference_of
        self._plan: DPPlan | None = None  # central DP: the plan of the run (rounds())
        self._clip = self.dp.clip_norm if isinstance(self.dp, CentralDPSettings) else 0.0  # the next round's clip norm (adaptive)
        self._sampled = 0  # central DP: the clients the last cohort() drew
        self._cohort: tuple[int, frozenset[int]] | None = None  # central DP: (round, the clients cohort() drew for it)
        self._upload: dict[str, Any] | None = None  # the one-shot DP upload's record (local_models())

    # -- the round's clients --------------------------------------------------------------------------------------

    def rounds(self, planned: int) -> int:
        """The rounds the method runs of ``planned``: fewer with central DP's ``stop_at_epsilon`` (the accountant is
        deterministic, so the last affordable round is known before any client trains)."""
        if not isinstance(self.dp, CentralDPSettings):
            return planned
        if self._plan is None:  # planned once, by the round loop before round 1 (server.rounds)
            self._plan = plan_dp(self.dp, self._server.federation.num_clients, planned)
        return min(self._plan.rounds, planned)

    def cohort(self, round: int) -> list[int]:
        """The clients that train in ``round`` (the round loop's :meth:`~rayfuse.rounds.RoundLoop.cohorts` hands them to
        the method): DP-FedAvg's Poisson sample at ``dp.sample_rate`` (seeded by ``("dp-sample", round)``; possibly
        none), else ``ceil(fraction N)`` of them with the entry's ``fraction`` (:meth:`sample_clients`; every client at
        1, or where the method takes no ``fraction``)."""
        if isinstance(self.dp, CentralDPSettings):
            clients = sample_poisson(self._server.rng("dp-sample", round), self._server.federation.client_ids, self.dp.sample_rate)
            self._sampled = len(clients)
            self._cohort = (int(round), frozenset(int(c) for c in clients))
            return clients
        return self.sample_clients(self.fraction, round)

    def _check_cohort(self, clients: Sequence[int], round: int) -> None:
        """Central DP: the clients of ``round``'s replies are among those :meth:`cohort` drew for that round (its
        accountant's Poisson sample); anything else would spend privacy the reported epsilon does not count."""
        if self._cohort is None or self._cohort[0] != int(round):
            raise RunFailure(
                f"{self._server.label}: central DP round {round}: no clients were sampled for it; a method with dp trains "
                f"the cohort the round loop hands it (for rnd, cohort in rounds.cohorts(): the accountant's Poisson sample)"
            )
        extra = sorted(int(c) for c in clients if int(c) not in self._cohort[1])
        if extra:
            raise RunFailure(
                f"{self._server.label}: central DP round {round}: clients {extra} trained but were not sampled (the "
                f"accountant drew {sorted(self._cohort[1])}); nothing of the round was used"
            )

    def local_models(self) -> Gathered[Update]:
        """Every client's trained local model for a one-shot method; with the one-shot ``dp`` upload, each client's
        clipped and noised upload instead (the raw local models never leave the clients), recorded in :meth:`info`."""
        if isinstance(self.dp, UploadDP):
            uploads, self._upload = gather_dp_uploads(self._server, self.dp)
            return uploads
        return self.local_updates()

    # -- the reply path --------------------------------------------------------------------------------------------

    def local_updates(self) -> Gathered[Update]:
        """Every client's trained local model (gathered once per run and shared by all methods)."""
        return self._local_updates()

    def accept_replies(
        self, gathered: Gathered[Any], read: Callable[[int, Any], R], *, need: int = 1, what: str = "client replies"
    ) -> dict[int, R]:
        """The one rejection path: each client's reply through ``read(client, reply)``, which returns what is kept of
        it or raises :class:`rayfuse.method.Rejected` (or :class:`rayfuse.errors.InputError`) with the reason; a
        rejected reply is recorded (:meth:`reject`) and never used. Raises :class:`RunFailure` when fewer than
        ``need`` (at least 1) replies are kept."""
        kept: dict[int, R] = {}
        for client, reply in gathered.results.items():
            try:
                kept[client] = read(client, reply)
            except (Rejected, InputError) as exc:
                self.reject(client, str(exc))
        need = max(int(need), 1)
        if len(kept) < need:
            raise RunFailure(
                f"{self._server.label}: {len(kept)} valid {what}, need {need} (rejected {len(gathered.results) - len(kept)}, "
                f"failed {len(gathered.failures)}); see the update_rejected events"
            )
        return kept

    def reject(self, client: int, reason: str) -> None:
        """Record that ``client``'s reply was rejected (never used): an ``update_rejected`` event."""
        self._server.events.emit("update_rejected", reason, method=self._server.label, client=client)

    def sample_clients(self, fraction: float, round: int) -> list[int]:
        """A seeded sample of ``ceil(fraction * n)`` client ids for ``round`` (all of them when fraction is 1)."""
        ids = self._server.federation.client_ids
        k = max(1, int(np.ceil(fraction * len(ids))))
        if k >= len(ids):
            return list(ids)
        return sorted(int(c) for c in self._server.rng("sample", round).choice(ids, size=k, replace=False))

    # -- the stages -----------------------------------------------------------------------------------------------

    def accept(
        self,
        gathered: Gathered[Any],
        reference: dict[str, np.ndarray] | None = None,
        *,
        check: Callable[[int, Update], str | None] | None = None,
    ) -> dict[int, Update]:
        """Stage 1 alone: the valid updates by client id (see the module docstring); ``check(client, update)`` is the
        method's own reason against an update. For methods that read their clients' models without combining them."""
        return self._accept(gathered, reference, check=check)

    def receive(
        self,
        gathered: Gathered[Any],
        reference: dict[str, np.ndarray] | None = None,
        round: int = 1,
        *,
        start: Mapping[str, np.ndarray] | None = None,
    ) -> dict[int, Update]:
        """Stages 1-2: the valid updates, the attacking clients' replaced by their attacks' relative to ``start`` (the
        model the clients started from; default ``reference``, else the run's initial model). For a method that
        transforms the models before :meth:`combine` (``aligned`` aligns them: an attacker sends a bad model, which the
        server aligns like any other)."""
        updates = self._accept(gathered, reference)
        if self._attacked(round):
            origin = start if start is not None else reference if reference is not None else self._server.models.initial_params()
            updates = self._attack(updates, origin, round)
        return updates

    def combine(
        self, models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None, *, start: Mapping[str, np.ndarray] | None = None
    ) -> Params:
        """Stages 3-4 on received (and transformed) models: clipping against ``start`` (default: the run's initial
        model) and the aggregation rule. Central DP is :meth:`collect`'s alone (its noise is calibrated to the round's
        sum of updates)."""
        if isinstance(self.dp, CentralDPSettings):
            raise TypeError("central DP-FedAvg combines the round's updates in collect(), not combine()")
        return combine_models(
            models, weights, self.aggregator, start=start, initial=self._server.models.initial_params, label=self._server.label
        )

    def collect(
        self,
        gathered: Gathered[Any],
        reference: dict[str, np.ndarray] | None = None,
        round: int = 1,
        *,
        start: Mapping[str, np.ndarray] | None = None,
        weighted: bool = True,
    ) -> Aggregate:
        """The round's aggregate: every stage, in order.

        Parameters
        ----------
        gathered : Gathered
            The clients' replies (central DP: of the clients :meth:`cohort` drew; empty when it drew none).
        reference : dict of ndarray, optional
            The model the updates' keys and shapes are checked against (default: each client's model layout); the
            global model the clients started from, for clipping, attacks and DP, unless ``start`` is given.
        round : int
            The round (1 for one-shot methods): which attacks apply, and DP's noise seed ``("dp-noise", round)``.
        start : dict of ndarray, optional
            The model the clients started from, when not ``reference`` (one-shot methods: the run's initial model,
            which is also the default when clipping or an attack needs one).
        weighted : bool
            Weight the updates by their sample counts where the rule uses weights (central DP: every client weighs 1).

        Raises
        ------
        RunFailure
            Fewer valid updates than ``federation.min_clients``, or than the rule needs.
        """
        if isinstance(self.dp, CentralDPSettings):
            return self._collect_dp(gathered, reference, round)
        attacked = self._attacked(round)
        if self.aggregator.is_plain_mean and not attacked:
            # The plain mean checks each update's structure, averages, and scans only the *average* for NaN/Inf: with
            # positive weights a non-finite value anywhere makes the weighted sum non-finite, so a finite average proves
            # every input finite. If it is not, every update is scanned, the bad ones rejected, the rest averaged again.
            updates = self._accept(gathered, reference, check_values=False)
            averaged = _mean(updates, weighted)
            if not all(np.isfinite(v).all() for v in averaged.values() if v.dtype.kind == "f"):
                updates = self._accept(Gathered(dict(updates), gathered.failures), reference)
                averaged = _mean(updates, weighted)
            return Aggregate(averaged, updates)
        # A robust rule may never read a NaN (a finite result would prove nothing about its inputs): every value first.
        updates = self._accept(gathered, reference)
        ids = sorted(updates)
        check_enough_updates(self.aggregator, len(ids), self._server.label)
        origin = start if start is not None else reference
        if (self.aggregator.clip_norm is not None or attacked) and origin is None:
            origin = self._server.models.initial_params()
        if attacked:
            assert origin is not None
            updates = self._attack(updates, origin, round)
        models = [updates[c].params for c in ids]
        weights = [float(updates[c].num_examples) for c in ids] if weighted else None
        return Aggregate(aggregate(models, weights, self.aggregator, reference=origin), {c: updates[c] for c in ids})

    def _collect_dp(self, gathered: Gathered[Any], reference: dict[str, np.ndarray] | None, round: int) -> Aggregate:
        """Central DP-FedAvg's round: the sampled clients' valid (and attacked) updates clipped, summed and noised
        (:func:`~rayfuse.updates.central_dp.apply_dp_round`, seeded ``("dp-noise", round)``), with the round's DP numbers."""
        dp = self.dp
        assert isinstance(dp, CentralDPSettings)
        if reference is None:
            raise ValueError("central DP needs the global model the clients started from (reference)")
        if self._plan is None:
            raise RuntimeError("central DP needs its plan: the round loop (server.rounds) makes it before the first round")
        self._check_cohort([*gathered.results, *(f.client for f in gathered.failures)], round)
        updates: dict[int, Update] = {}
        if gathered.results or gathered.failures:  # no client sampled: the round is noise alone, as the accountant assumes
            updates = self._accept(gathered, reference)
            if self._attacked(round):
                updates = self._attack(updates, reference, round)
        ids = sorted(updates)
        done = apply_dp_round(
            [updates[c].params for c in ids], reference, dp, self._plan, float(self._clip), self._server.rng("dp-noise", round)
        )
        return self._dp_aggregate(done, {c: updates[c] for c in ids}, round)

    def _finish_dp(
        self,
        total: dict[str, np.ndarray],
        unclipped: int,
        reference: dict[str, np.ndarray],
        round: int,
        updates: dict[int, Update],
        *,
        noised: bool = False,
    ) -> Aggregate:
        """A streamed central DP round: the folded sum of clipped updates noised as :meth:`_collect_dp` noises it
        (the same seed, the same draws); ``noised``: the clients noised it (distributed DP), nothing is added."""
        dp = self.dp
        assert isinstance(dp, CentralDPSettings)
        if self._plan is None:
            raise RuntimeError("central DP needs its plan: the round loop (server.rounds) makes it before the first round")
        rng = self._server.rng("dp-noise", round)
        done = noise_dp_round(total, unclipped, reference, dp, self._plan, float(self._clip), rng, noised=noised)
        return self._dp_aggregate(done, updates, round)

    def _dp_aggregate(self, done: Any, updates: dict[int, Update], round: int) -> Aggregate:
        dp = self.dp
        assert isinstance(dp, CentralDPSettings) and self._plan is not None
        self._clip = done.clip_norm
        epsilon = compute_epsilon(self._plan.noise_multiplier, dp.sample_rate, round, dp.delta, dp.accountant)
        return Aggregate(done.params, updates, {**done.metrics, "dp_sampled": float(self._sampled), "dp_epsilon": epsilon})

    # -- streaming rounds -----------------------------------------------------------------------------------------

    def decomposes(self) -> bool:
        """Whether the method's rule is a sum of per-client terms (the plain or weighted mean, the mean with
        ``clip_norm``, central DP's clipped sum): the rounds it can fold reply by reply."""
        return is_sum(self.aggregator, self.dp)

    def round_mode(self, round: int) -> tuple[str, str | None]:
        """How :meth:`collect_round` aggregates ``round``: ``gathered`` (every reply first, then :meth:`collect`),
        ``flat`` (the coordinator folds each reply as it arrives), ``per_actor`` (each actor hosting several clients
        folds theirs and sends one partial sum) or ``per_node`` (each actor folds its clients, then an aggregator on
        each node folds that node's partial sums: one per node reaches the coordinator; chosen when unset and the
        clients span several nodes), with why it is not what the config asked for (``None``: it is)."""
        if self.secure is not None:
            return "secure", None  # SecAgg+: the server receives masked vectors; their sum is all it unmasks
        if not self.streaming:
            return "gathered", None
        if not self.decomposes():
            return "gathered", f"aggregator {self.aggregator.name!r} needs every update at once"
        if self._attacked(round):
            return "gathered", f"round {round} is attacked (federation.attacks): each client's update is needed"
        return self._placement()

    def _placement(self) -> tuple[str, str | None]:
        """Where a sum is folded (``flat``, ``per_actor`` or ``per_node``; a streamed round's mode and a secure round's
        partial sums of masked vectors), with why it is not what ``federation.aggregation`` asked for."""
        if self.aggregation == "flat":
            return "flat", None
        located = getattr(self._server.federation, "client_nodes", None)  # a stand-in federation may not locate clients
        nodes = located() if located is not None else None
        if self.aggregation == "per_node":
            if nodes is None:  # refused before start for the in-process backend; a federation without nodes folds flat
                return "flat", "this federation has no nodes (per_node needs Ray)"
            return "per_node", None
        if self.aggregation is None and nodes is not None and len(set(nodes.values())) > 1:
            return "per_node", None  # clients on several nodes: one partial sum per node crosses the network
        if self._per_actor < 2:
            return "flat", None
        return "per_actor", None

    def collect_round(
        self,
        step: Callable[..., Any],
        reference: dict[str, np.ndarray],
        clients: Sequence[int],
        round: int,
        *,
        weighted: bool = True,
        step_kwargs: Mapping[str, Any] | None = None,
    ) -> Aggregate:
        """A round of a method that averages its clients' models (the FedAvg family): broadcast ``reference`` (one
        ``put``), run ``step(ctx, reference_ref, **step_kwargs)`` on ``clients`` and aggregate their replies: what
        ``collect(federation.run(...), reference, round)`` gives, within float rounding, without holding every update
        at once where the rule is a sum (:meth:`round_mode`). The mode of each round is recorded: an ``aggregation``
        event when it changes, and ``info()["aggregation"]``.

        The returned ``updates`` of a streamed round carry each client's count and metrics, not its parameters (they
        were folded and dropped)."""
        fed = self._server.federation
        kwargs = dict(step_kwargs or {})
        mode, why = self.round_mode(round)
        self._record_mode(mode, why, round)
        if isinstance(self.dp, CentralDPSettings):
            self._check_cohort(clients, round)
        if not clients:  # central DP may sample no client: the round is noise alone, as its accountant assumes
            return self.collect(Gathered({}), reference, round, weighted=weighted)
        if mode == "secure":
            return self._collect_secure(step, reference, clients, round, weighted=weighted, step_kwargs=kwargs)
        ref = fed.put(reference)
        if mode == "gathered":
            gathered = fed.run(step, ref, clients=clients, **kwargs)
            del ref
            return self.collect(gathered, reference, round, weighted=weighted)
        dp = isinstance(self.dp, CentralDPSettings)
        fold = RoundFold(
            "dp" if dp else "mean",
            weighted and not dp,
            {int(c): int(self._planned(int(c))) for c in clients},
            float(self._clip) if dp else self.aggregator.clip_norm,
        )
        if mode == "per_node":
            calls = fed.map_reduced(step, ref, reducer=fold, node_reducer=NodeFold(fold), clients=clients, **kwargs)
        elif mode == "per_actor":
            calls = fed.map_reduced(step, ref, reducer=fold, clients=clients, **kwargs)
        else:
            calls = fed.map(step, ref, clients=clients, **kwargs)
        del ref
        stream = fed.stream(calls)
        del calls
        return self._collect_stream(stream, reference, round, fold)

    def _collect_stream(
        self,
        replies: Any,  # the federation's stream (rayfuse.federation.ReplyStream): (client, value) pairs, then .failures
        reference: dict[str, np.ndarray],
        round: int,
        fold: RoundFold,
    ) -> Aggregate:
        """Stages 1-4 folded reply by reply with the same :class:`~rayfuse.updates.streaming.Fold` an actor or a node
        runs: each reply validated as :meth:`accept` validates it (a rejected one is recorded and never folded),
        clipped where the rule clips, and added to the running sum; a partial sum from an actor is checked (its clients'
        counts, its total's layout and values) and added whole."""
        folded = Fold(fold, partials=True)
        for client, value in replies:
            folded.add(client, value, reference)
            del value
        for client, reason in folded.rejected.items():
            self.reject(client, reason)
        kept = {c: Update({}, n, metrics) for c, (n, metrics) in folded.clients.items()}
        received = len(folded.clients) + len(folded.rejected)
        total = folded.sum if folded.sum is not None else RunningSum(reference, fold.kind, fold.clip_norm)
        failed = replies.failures
        need = max(1, min(self._server.federation.policy.min_clients, received + len(failed)))
        if len(kept) < need:
            raise RunFailure(
                f"{self._server.label}: {len(kept)} valid client updates, need {need} (rejected {received - len(kept)}, "
                f"failed {len(failed)}); see the update_rejected events"
            )
        updates = {c: kept[c] for c in sorted(kept)}
        if fold.kind == "mean":
            return Aggregate(total.mean(), updates)
        return self._finish_dp(total.dp_total(), total.unclipped, reference, round, updates)

    def _collect_secure(
        self,
        step: Callable[..., Any],
        reference: dict[str, np.ndarray],
        clients: Sequence[int],
        round: int,
        *,
        weighted: bool,
        step_kwargs: Mapping[str, Any],
    ) -> Aggregate:
        """A round under secure aggregation (:func:`~rayfuse.updates.secure.secure_round`): each client validates,
        clips (where the rule or central DP clips) and encodes its own update and masks it; the server unmasks only the
        sum. The weighted mean (or central DP's noised sum) follows from the sum as on the other paths, within half a
        quantisation step per entry. The kept clients' records carry their planned counts and the cohort's mean metrics."""
        server = self._server
        dp = isinstance(self.dp, CentralDPSettings)
        if len(clients) < 2:  # a sum of one client is that client's update: never unmasked
            if not dp:
                raise RunFailure(f"{server.label}: secure aggregation: round {round} has {len(clients)} client; a sum needs at least 2")
            server.events.emit(
                "secure_aggregation",
                f"round {round}: the DP sample drew {len(clients)} client, too few to sum securely; the round is noise alone",
                method=server.label,
                round=round,
            )
            return self.collect(Gathered({}), reference, round, weighted=weighted)
        encoding = SumEncoding.of(
            reference,
            "dp" if dp else "mean",
            weighted,
            float(self._clip) if dp else self.aggregator.clip_norm,
            self.secure,
            max(int(self._planned(int(c))) for c in clients),
        )
        distributed = dp and bool(self.secure.distributed_dp)
        if distributed:
            assert self._plan is not None
            encoding = encoding.with_distributed_noise(self._plan.update_noise_multiplier, neighbourhood(self.secure, len(clients))[1])
        done = self.secure_sum(step, (reference,), encoding, clients=clients, step_kwargs=step_kwargs, what=f"round {round}")
        kept = done.contributors
        total, counts, metrics = encoding.decode(done.levels)
        expected = sum(kept.values()) if encoding.weighted else len(kept)
        if counts["weight"] != expected:  # each client encodes its own count: the sum must be the survivors' plan
            raise RunFailure(
                f"{server.label}: secure aggregation: round {round}'s sum has weight {counts['weight']}, not the "
                f"{len(kept)} contributors' {'planned counts' if encoding.weighted else 'number'} {expected}"
            )
        clipped = counts["clipped_entries"]
        if clipped:
            server.events.emit(
                "secure_aggregation",
                f"round {round}: {clipped} entries of the clients' updates were beyond clipping_range "
                f"{self.secure.clipping_range} and clipped (raise federation.secure_aggregation.clipping_range)",
                method=server.label,
                round=round,
                clipped_entries=clipped,
            )
        record = self._secure
        record.update(step=encoding.step, error_bound=encoding.error_bound)
        if distributed:  # each client's share of the noise, in the update's units, and the sensitivity it is for
            record.update(distributed_dp={"client_noise_std": encoding.noise_std * encoding.step, "sensitivity": encoding.sensitivity})
        record["clipped_entries"] = int(record.get("clipped_entries", 0)) + clipped
        updates = {c: Update({}, n, dict(metrics)) for c, n in kept.items()}
        if dp:
            return self._finish_dp(total, counts["unclipped"], reference, round, updates, noised=distributed)
        return Aggregate(encoding.mean(total, counts["weight"], reference), updates)

    def secure_sum(
        self,
        step: Callable[..., Any],
        args: Sequence[Any],
        encoding: Any,
        *,
        clients: Sequence[int] | None = None,
        step_kwargs: Mapping[str, Any] | None = None,
        what: str = "sum",
    ) -> Any:
        """``step(ctx, *args, **step_kwargs)`` on ``clients`` (default: every client) under SecAgg+
        (:func:`~rayfuse.updates.secure.secure_round`): each reply encoded on its client by ``encoding`` (an
        :class:`~rayfuse.updates.secure.Encoding`: :class:`~rayfuse.updates.secure.ArraySum` for a dict of arrays),
        masked, and only the sum unmasked; returns the :class:`~rayfuse.updates.secure.SecureSum` (its ``levels`` for
        ``encoding.decode``, the clients in it). A client that fails a stage is left out (the federation's failure
        policy); fewer than ``federation.min_clients`` in the sum, or fewer than the reconstruction threshold, fails the
        run. Recorded in :meth:`info` (``secure_aggregation``: the settings, the sums run, the clients dropped)."""
        server = self._server
        if self.secure is None:
            raise RuntimeError(f"{server.label}: secure_sum needs federation.secure_aggregation")
        clients = sorted(int(c) for c in (server.federation.client_ids if clients is None else clients))
        if len(clients) < 2:
            raise RunFailure(f"{server.label}: secure aggregation: {what} has {len(clients)} client; a sum needs at least 2")
        record = self._secure
        record["sums"] = int(record.get("sums", 0)) + 1
        done = secure_round(
            server.federation,
            step,
            args,
            clients,
            session=f"{server.label}/{what}/{record['sums']}",
            encoding=encoding,
            config=self.secure,
            planned=self._planned,
            step_kwargs=step_kwargs,
            partial_sums=self._placement()[0],  # type: ignore[arg-type]
        )
        kept = done.contributors
        need = max(1, min(server.federation.policy.min_clients, len(clients)))
        if len(kept) < need:
            raise RunFailure(f"{server.label}: {len(kept)} clients in the secure {what}, need {need} (federation.min_clients)")
        record.update(
            num_neighbours=done.params.num_neighbours,
            reconstruction_threshold=done.params.reconstruction_threshold,
            modulus_bits=done.params.modulus_bits,
        )
        record["dropped"] = int(record.get("dropped", 0)) + len(clients) - len(kept)
        return done

    def aggregation_record(self) -> dict[str, str]:
        """``info()["aggregation"]``: the mode of the rounds without an attack (and ``attacked_rounds: gathered`` when
        ``federation.attacks`` is set), with the reason where it is not what the config asked for. Fixed by the
        config, so a resumed run records what the uninterrupted one does."""
        unattacked = self.attacks
        self.attacks = []
        try:
            mode, why = self.round_mode(1)
        finally:
            self.attacks = unattacked
        record = {"mode": mode, **({"reason": why} if why else {})}
        return {**record, "attacked_rounds": "gathered"} if self.attacks and mode != "gathered" else record

    def _record_mode(self, mode: str, why: str | None, round: int) -> None:
        self._rounds_collected = True
        if mode != self._last_mode:
            message = f"round {round}: {mode}" + (f" ({why})" if why else "")
            self._server.events.emit("aggregation", message, method=self._server.label, round=round, mode=mode)
            self._last_mode = mode

    # -- state and records ----------------------------------------------------------------------------------------

    def state(self) -> dict[str, float]:
        """What the pipeline carries from round to round, for the method's round checkpoint: central DP's clip norm of
        the next round (adaptive clipping moves it); empty otherwise."""
        return {"clip_norm": float(self._clip)} if isinstance(self.dp, CentralDPSettings) else {}

    def load_state(self, state: Mapping[str, float]) -> None:
        """Restore what :meth:`state` gave (a resumed run continues with the checkpointed clip norm)."""
        if isinstance(self.dp, CentralDPSettings) and "clip_norm" in state:
            self._clip = float(state["clip_norm"])

    def info(self) -> dict[str, Any]:
        """The pipeline's record for ``results.json``: ``dp`` (central DP's plan and epsilon) or ``upload_dp`` (each
        client's epsilon of the one-shot upload); empty without DP."""
        record: dict[str, Any] = {"aggregation": self.aggregation_record()} if self._rounds_collected else {}
        if self._rounds_collected and self.secure is not None:  # where the masked vectors were added up
            record["aggregation"]["partial_sums"] = self._placement()[0]
        if self._secure:
            record["secure_aggregation"] = dict(self._secure)
        if isinstance(self.dp, CentralDPSettings) and self._plan is not None:
            noise = (
                "distributed: the clients' shares, under secure aggregation"
                if self.secure is not None and self.secure.distributed_dp
                else "server"
            )
            return {**record, "dp": {**describe_plan(self.dp, self._plan), "noise": noise}}
        if self._upload is not None:
            return {**record, "upload_dp": self._upload}
        return record

    # -- internals ------------------------------------------------------------------------------------------------

    def _attacked(self, round: int) -> bool:
        return any(a.attacks_round(round) for a in self.attacks)

    def _attack(self, updates: dict[int, Update], reference: Mapping[str, np.ndarray], round: int) -> dict[int, Update]:
        """``updates`` with the attacking clients' replaced by their attacks' (:func:`rayfuse.updates.attacks.apply_attacks`),
        each recorded as an ``attack`` event."""
        if not self.attacks:
            return updates
        server = self._server
        attacked, applied = apply_attacks(updates, reference, self.attacks, round=round, seed=server.seed)
        for attack in applied:
            server.events.emit(
                "attack",
                f"{attack.kind} on client {attack.client}'s update",
                method=server.label,
                client=attack.client,
                round=round,
                attack=attack.kind,
            )
        return attacked

    def _accept(
        self,
        gathered: Gathered[Any],
        reference: dict[str, np.ndarray] | None = None,
        *,
        check_values: bool = True,
        check: Callable[[int, Update], str | None] | None = None,
    ) -> dict[int, Update]:
        """Keep the valid updates; reject (and record) those with NaN/Inf, wrong keys or shapes, a sample count other
        than the client's training-set size in the partition plan (the weight of its update in an average: the
        coordinator knows it, so a client's word for it is checked, not trusted), and those ``check`` gives a reason
        against (:func:`~rayfuse.updates.streaming.update_problem`, which a streaming round applies to each reply as it
        arrives). ``check_values=False``: keys, shapes, dtypes, counts and metrics only, not every parameter value."""
        given = reference
        reference_of: Callable[[int], dict[str, np.ndarray]] = self._reference_of if given is None else lambda client: given
        planned = self._planned

        def read(client: int, update: Any) -> Update:
            reason = update_problem(update, lambda: planned(client), reference_of(client), check_finite=check_values)
            if reason is None and check is not None:
                reason = check(client, update)
            if reason is not None:
                raise Rejected(reason)
            return update

        need = min(self._server.federation.policy.min_clients, len(gathered.results) + len(gathered.failures))
        return self.accept_replies(gathered, read, need=need, what="client updates")


def _mean(updates: dict[int, Update], weighted: bool) -> Params:
    weights = [u.num_examples for u in updates.values()] if weighted else None
    return weighted_average([u.params for u in updates.values()], weights)
