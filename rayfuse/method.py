"""The method contract: what a fusion method is, what it may see, and how it is checked before a run starts.

This module sits below the engine. A method imports from here (and from the math: ``rayfuse.data``,
``rayfuse.models``, ``rayfuse.matching``...), never from ``rayfuse.coordinator``, ``rayfuse.client`` or
``rayfuse.runner``; the engine implements the protocols declared here.

A method is a :class:`Method` subclass with frozen, validated :class:`MethodParams` and two hooks:

* :meth:`Method.check` compares the method's parameters with the rest of the run (a cheap :class:`RunSetup`: the
  model config, the data roles and their sizes, the number of clients). ``rayfuse validate``, ``rayfuse tune --check``
  and ``rayfuse run`` call it before any actor starts, so a mismatch costs one line and exit 2.
* :meth:`Method.run` is the server loop, written against :class:`ServerContext`.

Client steps are plain functions ``step(ctx: ClientContext, *args, **kwargs)`` named with :func:`client_step`; the
server runs them on the clients through ``server.federation``.

Methods register with :func:`register_method` and are found by name (``METHODS``); a :class:`Method` subclass or
instance passed as an object (``rayfuse.run(..., methods={"mine": MyMethod})``) works as well.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar, cast

import numpy as np
from pydantic import ConfigDict, ValidationError

from rayfuse.config import (
    CONFIG_SECTIONS,
    QUICKSTART_PUBLIC_SIZE,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    StrictSchema,
    TrainConfig,
    pydantic_input_error,
)
from rayfuse.errors import InputError
from rayfuse.registry import Registry
from rayfuse.rounds import ClientRounds, KeptState, RoundLoop, transient

if TYPE_CHECKING:
    from rayfuse.data.roles import DataPlan, Split

__all__ = [
    "METHODS",
    "ClientContext",
    "ClientError",
    "ClientRounds",
    "DataRoles",
    "FederationView",
    "Gathered",
    "KeptState",
    "Method",
    "MethodCase",
    "MethodParams",
    "MethodResult",
    "MethodSpec",
    "MethodTags",
    "ModelService",
    "Reference",
    "Rejected",
    "RoundLoop",
    "RunSetup",
    "Scoring",
    "ServerContext",
    "Update",
    "UpdateService",
    "Aggregate",
    "Fuses",
    "check_methods",
    "client_step",
    "dp_refusal",
    "dp_options",
    "dp_options_text",
    "method_name",
    "update_setting",
    "where_given",
    "register_method",
    "resolve_methods",
    "resolved_config",
    "step_name",
    "transient",
]

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")
#: a method's parameters (its ``Params``) and round state, the two arguments of the generic :class:`Method`
P = TypeVar("P", bound="MethodParams")
RS = TypeVar("RS")


# ---------------------------------------------------------------------------------------------------------------
# What travels between clients and the server


def client_step(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Name a client step (``"fedavg.fit"``); the name appears in events and fault specs."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        fn.__rayfuse_step__ = name  # type: ignore[attr-defined]
        return fn

    return decorate


def step_name(step: Callable[..., Any]) -> str:
    """The name given with :func:`client_step`, else the function's module and qualified name."""
    return getattr(step, "__rayfuse_step__", None) or f"{getattr(step, '__module__', '?')}.{getattr(step, '__qualname__', repr(step))}"


@dataclass
class Update:
    """What a client sends back after local work: parameters, its sample count and scalar metrics.

    ``num_examples`` is the client's training-set size (``ctx.num_examples``): the update pipeline
    (:class:`UpdateService`) rejects an update whose count differs from the one the partition plan gives that client."""

    params: dict[str, np.ndarray]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


class Rejected(ValueError):
    """Raised by a reader given to :meth:`UpdateService.accept_replies`: the reply is not used (its message is the
    reason recorded in the ``update_rejected`` event)."""


@dataclass(frozen=True)
class ClientError:
    """A client call that failed: ``kind`` is "error" (the step raised), "died" (the process died) or "timeout"."""

    client: int
    kind: str
    message: str
    step: str = ""
    attempt: int = 0


@dataclass
class Gathered(Generic[T]):
    """Results of one gather: ``results`` by client id (in client order) and the clients that failed."""

    results: dict[int, T]
    failures: list[ClientError] = field(default_factory=list)

    @property
    def clients(self) -> list[int]:
        return list(self.results)

    def values(self) -> list[T]:
        return list(self.results.values())


@dataclass(frozen=True)
class Folded:
    """The reply of a client whose result its process folded, with the other clients it hosts, into the reply of
    client ``into`` (:meth:`FederationView.map_reduced`): the client returned, its contribution travels in that reply."""

    into: int


@dataclass
class Aggregate:
    """What :meth:`UpdateService.collect` makes of a round's replies: the combined model ``params``, the ``updates``
    it combined (by client id, as the attacks left them) and the round's numbers of the pipeline (``metrics``: central
    DP's ``dp_clip_norm``, ``dp_sampled``, ``dp_epsilon``...; empty without DP)."""

    params: dict[str, np.ndarray]
    updates: dict[int, Update]
    metrics: dict[str, float] = field(default_factory=dict)


#: What a method combines of its clients (``MethodTags.fuses``): the update pipeline's attacks, robust rules and DP act on
#: ``parameters`` only; ``adapter factors``: low-rank factors combined by their products, not averaged (FedLoRA's stack and
#: flora); ``task vectors``: fine-tunes' differences from a base, combined by the method itself; ``nothing``: the method
#: combines no client upload (local models scored one by one, oracles).
Fuses = Literal["parameters", "posteriors", "statistics", "predictions", "adapter factors", "task vectors", "nothing"]
FUSES: tuple[str, ...] = typing.get_args(Fuses)

#: The update layer's settings a method entry may take (``MethodTags.updates``): its aggregation rule (``aggregator``),
#: differential privacy (``dp``: central DP-FedAvg for a method with ``cohort``, else the clients' one-shot upload DP),
#: the fraction of clients of a round (``fraction``) and sample-count weights (``weighted``).
UPDATE_KEYS: tuple[str, ...] = ("aggregator", "dp", "fraction", "weighted")


# ---------------------------------------------------------------------------------------------------------------
# What a method sees


class FederationView(Protocol):
    """The federation as a method uses it (``rayfuse.federation.Federation`` implements it)."""

    policy: Any

    @property
    def client_ids(self) -> list[int]: ...

    @property
    def num_clients(self) -> int: ...

    def put(self, obj: Any) -> Any: ...

    def get(self, ref: Any) -> Any: ...

    def map(self, step: Callable[..., Any], *args: Any, clients: Iterable[int] | None = None, **kwargs: Any) -> list[Any]: ...

    def gather(self, calls: Sequence[Any]) -> Gathered[Any]: ...

    def map_reduced(
        self,
        step: Callable[..., Any],
        *args: Any,
        reducer: Any,
        clients: Iterable[int] | None = None,
        node_reducer: Any = None,
        **kwargs: Any,
    ) -> list[Any]: ...

    def client_nodes(self) -> Mapping[int, str] | None: ...

    def stream(self, calls: Sequence[Any]) -> Any: ...  # a rayfuse.federation.ReplyStream

    def run(self, step: Callable[..., Any], *args: Any, clients: Iterable[int] | None = None, **kwargs: Any) -> Gathered[Any]: ...

    def parallel_map(self, fn: Callable[[Any], T], items: Sequence[Any], *, chunk_size: int | None = None) -> list[T]: ...


class ClientContext(Protocol):
    """What a client step sees of its client (``rayfuse.client.ClientContext`` implements it): its own data, its
    model config (``model_cfg``: the client's own, ``federation.client_overrides.<i>.model``, else the run's), its
    trained local model, a private ``state`` dict kept across calls, and seeds."""

    client_id: int
    train: Split
    val: Split
    model_cfg: Any
    train_cfg: Any
    device: str
    state: dict[Any, Any]
    local_cache: str | None

    @property
    def num_examples(self) -> int: ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def num_classes(self) -> int: ...

    @property
    def init_seed(self) -> int: ...

    def step_seed(self, *tags: object) -> int: ...

    def build_model(self, seed: int | None = None) -> Any: ...

    def local_model(self) -> Any: ...

    def local_params(self) -> dict[str, np.ndarray]: ...

    def work_model(self, params: dict[str, np.ndarray], *, slot: str = "work") -> Any: ...

    def take_params(self, model: Any) -> dict[str, np.ndarray]: ...

    def device_split(self, name: str = "train") -> tuple[Any, Any]: ...

    def state_store(self, kind: str, store: str) -> Any: ...


class UpdateService(Protocol):
    """The update pipeline (``server.updates``; :class:`rayfuse.updates.pipeline.UpdatePipeline` implements it, with
    ``run_cached`` from the coordinator's ``MethodUpdates``, its subclass that holds the engine's store): the one path
    from a round's client replies to an aggregate, owned by the framework, configured once from the run
    (``federation.attacks``) and the method's entry (its ``aggregator`` and ``dp`` keys). Its stages, in order:

    1. **validate**: each reply is an :class:`Update` with the reference's keys and shapes, finite values and metrics,
       and the client's planned sample count; a bad one is recorded (``update_rejected``) and never used;
    2. **attacks**: the attacking clients' updates replaced by their attacks' (``federation.attacks``; ``attack`` events);
    3. **clipping and central DP noise**: ``aggregator.clip_norm``, or DP-FedAvg's clipping and noised sum (``dp``);
    4. **the aggregation rule**: ``aggregator.name`` (mean, median, trimmed mean, Krum, Bulyan, geometric median).

    :meth:`collect` runs all four on gathered replies; :meth:`collect_round` runs a whole averaging round (broadcast,
    client step, all four stages), folding each reply into a running sum as it arrives where the rule is a sum
    (``federation.streaming``). :meth:`accept` is stage 1 alone, for methods that read their clients' models
    without combining them; :meth:`receive` stages 1-2 and :meth:`combine` stages 3-4, for a method that transforms
    the received models before they are combined (``aligned`` aligns them). :meth:`local_models` gives every client's
    trained local model, or with the one-shot upload DP their clipped and noised uploads; :meth:`info` is the
    pipeline's record (central DP's plan and epsilon, the upload's epsilons), which the framework writes into
    ``results.json`` whether or not the method reads it.

    The round itself is the framework's, not the method's: the round loop (``server.rounds(...)``,
    :class:`rayfuse.rounds.RoundLoop`) plans central DP before round 1, hands each round its cohort
    (``for rnd, cohort in rounds.cohorts():``: the accountant's Poisson sample under DP, ``ceil(fraction N)`` clients
    otherwise) and checkpoints the pipeline's own state (the adaptive clip norm) beside the method's round state.

    The reply path that is not a parameter update lives here too, as the one way a method receives what its clients
    send: :meth:`accept_replies` (each reply through the method's reader; one the reader refuses is recorded by
    :meth:`reject` as an ``update_rejected`` event, never used), :meth:`local_updates` (every client's trained local
    model, gathered once per run and shared by the methods) and :meth:`run_cached` (a client step's replies, cached
    across runs under ``run.model_cache``). The last two are here rather than on the transport (``server.federation``)
    because they are not transport: both are replies the framework keeps for the method (across methods, across
    runs), as it keeps the rejection record, while the federation only sends calls and gathers what comes back.

    Under ``federation.secure_aggregation`` (:attr:`secure` set), :meth:`collect_round` runs each round under SecAgg+,
    and :meth:`secure_sum` is the one way any other method whose tags say ``sums`` receives what its clients send: a
    client step's replies, each encoded on its client (:class:`rayfuse.updates.secure.ArraySum`...), of which the
    server unmasks the sum alone (:class:`rayfuse.updates.secure.SecureSum`).
    """

    def collect(
        self,
        gathered: Gathered[Any],
        reference: dict[str, np.ndarray] | None = None,
        round: int = 1,
        *,
        start: Mapping[str, np.ndarray] | None = None,
        weighted: bool = True,
    ) -> Aggregate: ...

    def collect_round(
        self,
        step: Callable[..., Any],
        reference: dict[str, np.ndarray],
        clients: Sequence[int],
        round: int,
        *,
        weighted: bool = True,
        step_kwargs: Mapping[str, Any] | None = None,
    ) -> Aggregate: ...

    def accept(
        self,
        gathered: Gathered[Any],
        reference: dict[str, np.ndarray] | None = None,
        *,
        check: Callable[[int, Update], str | None] | None = None,
    ) -> dict[int, Update]: ...

    def receive(
        self,
        gathered: Gathered[Any],
        reference: dict[str, np.ndarray] | None = None,
        round: int = 1,
        *,
        start: Mapping[str, np.ndarray] | None = None,
    ) -> dict[int, Update]: ...

    def combine(
        self, models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None, *, start: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]: ...

    def local_models(self) -> Gathered[Update]: ...

    def info(self) -> dict[str, Any]: ...

    # the reply path that is not a parameter update
    def accept_replies(
        self, gathered: Gathered[Any], read: Callable[[int, Any], R], *, need: int = 1, what: str = "client replies"
    ) -> dict[int, R]: ...

    def reject(self, client: int, reason: str) -> None: ...

    def local_updates(self) -> Gathered[Update]: ...

    def run_cached(self, step: Any, *args: Any, **kwargs: Any) -> Gathered[Any]: ...

    # secure aggregation (federation.secure_aggregation; None: off): a sum the server unmasks, never one client's reply
    secure: Any

    def secure_sum(
        self,
        step: Callable[..., Any],
        args: Sequence[Any],
        encoding: Any,
        *,
        clients: Sequence[int] | None = None,
        step_kwargs: Mapping[str, Any] | None = None,
        what: str = "sum",
    ) -> Any: ...


class DataRoles(Protocol):
    """The server's data roles (``server.data``): the global test set (evaluation only), the server's public sample,
    the pooled clients' data (oracles only), the dataset's own facts, the partition plan's class counts, and the run's
    data settings. ``evaluation`` is where :class:`Scoring` scores (``central``, ``federated`` or ``both``).
    ``class_counts`` is the partition plan's ``(num_clients, num_classes)`` class counts (train and held-out, as the
    partition manifest records them)."""

    data_cfg: DataConfig
    evaluation: str
    num_classes: int
    input_shape: tuple[int, ...]

    @property
    def num_clients(self) -> int: ...

    @property
    def test(self) -> Split: ...

    @property
    def public(self) -> Split: ...

    @property
    def dataset_meta(self) -> dict[str, Any]: ...

    @property
    def class_counts(self) -> np.ndarray: ...

    def pooled_train(self) -> Split: ...


class ModelService(Protocol):
    """The run's models (``server.models``): ``model_cfg`` is the run's model (the server's, and every client's without a
    model of its own); a client's own model is :meth:`client_model` (``federation.client_overrides.<i>.model``; only
    methods with ``MethodTags.heterogeneous_clients`` run when the clients' models differ); the training settings, the
    device, and the shared seeded initialisation (:meth:`initial_params`)."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    device: str

    def build_model(self, seed: int | None = None) -> Any: ...

    def client_model(self, client: int) -> ModelConfig: ...

    def build_client_model(self, client: int, seed: int | None = None) -> Any: ...

    def initial_params(self) -> dict[str, np.ndarray]: ...


class Scoring(Protocol):
    """Evaluation (``server.scoring``): :meth:`evaluate` and :meth:`evaluate_ensemble` score on the server's test set,
    on the clients' held-out splits, or both, as the run's ``evaluation`` says; :meth:`predict_proba` and
    :meth:`evaluate_proba` are the server's test set only."""

    def evaluate(self, params: dict[str, np.ndarray], *, resized: bool = False, model: ModelConfig | None = None) -> dict[str, float]: ...

    def evaluate_ensemble(
        self, members: Sequence[dict[str, np.ndarray]], weights: Sequence[float], *, models: Sequence[ModelConfig] | None = None
    ) -> dict[str, float]: ...

    def predict_proba(self, params: dict[str, np.ndarray], X: np.ndarray | None = None) -> np.ndarray: ...

    def evaluate_proba(self, proba: np.ndarray) -> dict[str, float]: ...


class ServerContext(Protocol):
    """A method's whole view of the run (the coordinator implements it): five typed services and the method's own
    identity, randomness, logging and rounds.

    * ``federation`` (:class:`FederationView`): the transport, client steps sent and gathered;
    * ``updates`` (:class:`UpdateService`): the update pipeline (validation, attacks, clipping and DP, the aggregation
      rule) and the reply path under it (:meth:`UpdateService.accept_replies`: a reply the reader refuses is recorded as
      an ``update_rejected`` event, never used);
    * ``data`` (:class:`DataRoles`): the server-side data roles (``test``, ``public``) and the run's data settings;
    * ``models`` (:class:`ModelService`): the run's model, a client's own, the training settings, the initialisation;
    * ``scoring`` (:class:`Scoring`): evaluation, where the run's ``evaluation`` says.

    :meth:`rounds` (a :class:`RoundLoop` over a typed round state) owns resume, evaluation cadence, history, progress,
    round checkpoints and state that clients keep across rounds (:class:`KeptState`); those internals stay on the loop
    (``rayfuse.rounds.LoopServer``), not here. ``events`` is the run's event log (a method may record an event of its
    own: ``server.events.emit(kind, message, method=server.label, ...)``).
    """

    label: str
    method: str
    params: MethodParams
    events: Any
    seed: int

    @property
    def federation(self) -> FederationView: ...  # read-only: the coordinator's concrete Federation implements the view

    @property
    def updates(self) -> UpdateService: ...  # read-only: the coordinator's MethodUpdates (an UpdatePipeline)

    @property
    def data(self) -> DataRoles: ...

    @property
    def models(self) -> ModelService: ...

    @property
    def scoring(self) -> Scoring: ...

    def step_seed(self, *tags: object) -> int: ...

    def rng(self, *tags: object) -> np.random.Generator: ...

    def log(self, round: int, metrics: dict[str, float], client: int | None = None) -> None: ...

    def progress(self, message: str, **fields: Any) -> None: ...

    def rounds(
        self,
        state: S,
        *,
        last: int,
        first: int = 1,
        evaluate: Callable[[int], Mapping[str, float]] | None = None,
        evaluate_every: int = 1,
        unit: str = "round",
        quiet: tuple[str, ...] = (),
        on_resume: Callable[[S], None] | None = None,
        step: int = 1,
    ) -> RoundLoop[S]: ...


# ---------------------------------------------------------------------------------------------------------------
# What a run looks like before it starts


@dataclass(frozen=True)
class RunSetup:
    """A cheap description of a run, for :meth:`Method.check`: no data arrays, no models, nothing started.

    ``train_sizes`` / ``val_sizes`` are each client's private split sizes; ``public_size`` and ``test_size`` the
    server's public (or target) sample and test set; ``target`` the server's new task (``data.target``) if any.
    ``client_models`` holds each client's model in client order (``federation.client_overrides.<i>.model``, else
    ``model``); empty means every client's model is ``model`` (:meth:`client_model` reads it either way).
    ``public_labeled`` is false when the server's public sample has no labels (a silo config's ``data.public`` with
    ``labels: false``; its labels are then ``-1``, unknown): methods tagged ``public_labels`` are refused.

    ``input_shape``, ``num_classes``, ``train_sizes`` and ``val_sizes`` are ``None`` while they are not known: a silo
    run (``data.silos``) is checked before its clients report what their silos hold, and again after. A check skips
    what is ``None`` (the second pass decides it).
    """

    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    num_clients: int
    input_shape: tuple[int, ...] | None
    num_classes: int | None
    train_sizes: tuple[int, ...] | None
    val_sizes: tuple[int, ...] | None
    public_size: int
    test_size: int
    target: str | None = None
    seed: int = 0
    model_cache: str | None = None
    evaluation: str = "central"
    client_models: tuple[ModelConfig, ...] = ()
    public_labeled: bool = True

    @classmethod
    def from_plan(cls, cfg: ExperimentConfig, plan: DataPlan) -> RunSetup:
        return cls(
            model=cfg.model,
            train=cfg.train,
            data=cfg.data,
            num_clients=plan.num_clients,
            input_shape=tuple(plan.input_shape),
            num_classes=plan.num_classes,
            train_sizes=tuple(len(t) for t in plan.client_train),
            val_sizes=tuple(len(v) for v in plan.client_val),
            public_size=int(len(plan.public)),
            test_size=int(len(plan.test)),
            target=plan.target,
            seed=cfg.run.seed,
            model_cache=cfg.run.model_cache,
            evaluation=cfg.evaluation,
            client_models=tuple(cfg.client_model(i) for i in range(plan.num_clients)),
            public_labeled=plan.public_labeled,
        )

    def client_model(self, client: int) -> ModelConfig:
        """Client ``client``'s model (``model`` when ``client_models`` is empty)."""
        return self.client_models[client] if self.client_models else self.model

    @property
    def heterogeneous_clients(self) -> bool:
        """Whether some client's model is not ``model`` (clients of several architectures, or of another than the
        server's)."""
        return any(m != self.model for m in self.client_models)


# ---------------------------------------------------------------------------------------------------------------
# Methods


class MethodParams(StrictSchema):
    """A method's parameters (:class:`rayfuse.config.StrictSchema`: unknown keys are errors, values frozen, floats
    finite, ``rounds: true`` refused, not read as 1), defaults validated too."""

    model_config = ConfigDict(validate_default=True)


@dataclass
class MethodResult:
    """What a method's server loop returns.

    ``metrics`` are the final metrics (on the global test set); ``params`` the fused model, saved as
    ``models/<label>.safetensors`` when given; ``info`` anything else worth recording (per-client numbers, notes).
    Per-round metrics are logged through :meth:`ServerContext.log` as the loop runs.
    """

    metrics: dict[str, float]
    params: dict[str, np.ndarray] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reference:
    """A method's paper: ``key`` is the tag used in comments (``[KLF]``), resolved in ``docs/references.md``."""

    key: str
    title: str
    url: str


@dataclass(frozen=True)
class MethodTags:
    """What a method is and needs from the run, declared once per class (``tags = MethodTags(...)``; a subclass may
    ``dataclasses.replace`` its parent's). ``rayfuse.prestart.check_tags`` refuses, before anything starts, every run the tags say
    the method cannot do.

    ``fuses`` (:data:`Fuses`): what the server combines: ``"parameters"`` (the clients' weights, in one layout, through
    ``server.updates.collect``), ``"posteriors"`` (distributions over parameters), ``"statistics"`` (summaries other than
    weights: moments, balls, counts), ``"predictions"`` (the clients' outputs on some inputs) or ``"nothing"`` (no client
    upload is combined: baselines and oracles). The update pipeline's attacks, robust rules and DP act on parameter
    updates only, so a run asking for them with a method that fuses something else is refused before start; a method
    whose answer depends on its parameters gives it from :meth:`Method.tags_for`.
    ``needs_dataset``: it reads the run's whole dataset (the clients' data pooled, or the dataset's true parameters);
    refused with ``data.silos``, where no process holds a dataset. ``uses_local_models``: every client's trained local
    model is gathered. ``federated_evaluation``: its metrics come from :meth:`Scoring.evaluate` /
    :meth:`Scoring.evaluate_ensemble`, so ``evaluation: federated`` or ``both`` can score it on the clients'
    held-out splits; ``False``: a method scoring on the server's data in its own way, refused with those settings.
    ``oracle``: not feasible in a real federation (reported as an upper reference; may read the pooled data).
    ``multi_round``: it checkpoints each round, so ``--resume`` continues mid-method (and a sweep's ASHA counts its
    rounds). ``local_model_only``: it reads the clients' training data only through their trained local models, so
    local DP-SGD (``train.dp``) covers everything it releases; methods without it (and not oracles) are refused with
    ``train.dp``. ``heterogeneous_clients``: it needs only each client's predictions, never their weights in one
    layout, so it runs when the clients' models differ (``federation.client_overrides.<i>.model``; it builds each
    client's model with :meth:`ModelService.client_model`); methods without it are refused with such clients.
    ``public_labels``: it reads the labels of the server's public sample (``server.data.public.y``); refused when that
    sample has none (a silo config's ``data.public`` with ``labels: false``). ``public_sample``: it reads the inputs of
    the server's public sample; a config without a data section draws the quickstart's public sample only when a
    configured method reads one (``public_labels`` alone does not: EP-GAN reads a silo's ``data.public`` labels but no
    simulation's public sample). ``no_dp``: why a ``dp`` setting does not
    apply to it (empty: its own ``dp`` option, if it has one, applies); a ``dp`` entry is refused with this reason.
    ``cohort``: each of its rounds trains exactly the clients the round loop hands it (``for rnd, cohort in
    rounds.cohorts():``, the framework's cohort), the precondition of central DP-FedAvg, whose noise and accountant assume the clients that
    train are the ones it Poisson-samples: a central ``dp`` entry for a method without it is refused before start, and
    a round of a method with it that trains a client the sample did not draw stops the run.
    ``streams_rounds``: its rounds go through ``server.updates.collect_round`` (broadcast, train, fold), so a round whose
    rule is a sum is folded reply by reply (``federation.streaming``, ``federation.aggregation``).
    ``updates`` (:data:`UPDATE_KEYS`): the update layer's settings its entry takes, each a field of its ``Params``
    (``aggregator``, ``dp``, ``fraction``, ``weighted``); the framework reads these and no other field by name (a
    method with ``cohort`` also declares its ``rounds``, which central DP's plan reads before start).
    ``local_model_copies``: with ``uses_local_models``, how many copies of every client's local model the coordinator
    holds at once (the memory check): 1, the uploads; 2, the uploads and models built from them (distill's ``teachers:
    parameters``); 0, none gathered (distill's ``teachers: clients``: predictions only).
    ``sums``: its server needs only sums of what its clients send: each round's updates (it aggregates through
    ``server.updates.collect_round`` with a rule that is a sum), or any other reply, through
    ``server.updates.secure_sum`` where ``server.updates.secure`` is set (``fedmerge``'s statistics, ``distill``'s
    ensemble with ``teachers: clients``), so ``federation.secure_aggregation`` applies to it (SecAgg+: the server
    unmasks the cohort's sum and never one client's reply); methods without it are refused with that setting.

    The vocabulary is closed: ``fuses`` one of :data:`FUSES`, ``updates`` of :data:`UPDATE_KEYS`, the flags booleans
    (a ``TypeError`` or ``ValueError`` when the class is defined). Where an answer depends on the entry's parameters
    (``aligned``'s merge, ``distill``'s transfer), the method overrides :meth:`Method.tags_for`, after scikit-learn's
    ``__sklearn_tags__``.
    """

    fuses: Fuses = "parameters"
    needs_dataset: bool = False
    uses_local_models: bool = False
    federated_evaluation: bool = True
    oracle: bool = False
    multi_round: bool = False
    local_model_only: bool = False
    heterogeneous_clients: bool = False
    public_labels: bool = False
    public_sample: bool = False
    no_dp: str = ""
    cohort: bool = False
    streams_rounds: bool = False
    updates: frozenset[str] = frozenset()
    local_model_copies: int = 1
    sums: bool = False

    def __post_init__(self) -> None:
        if self.fuses not in FUSES:
            raise ValueError(f"MethodTags.fuses: expected one of {', '.join(FUSES)}, got {self.fuses!r}")
        if not isinstance(self.no_dp, str):
            raise TypeError(f"MethodTags.no_dp: expected a reason (a string), got {type(self.no_dp).__name__}")
        for flag in dataclasses.fields(self):
            value = getattr(self, flag.name)
            if flag.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"MethodTags.{flag.name}: expected true or false, got {value!r}")
        if not isinstance(self.local_model_copies, int) or isinstance(self.local_model_copies, bool) or self.local_model_copies < 0:
            raise TypeError(f"MethodTags.local_model_copies: expected a count (0, 1, 2...), got {self.local_model_copies!r}")
        updates = frozenset(self.updates)
        unknown = sorted(updates - set(UPDATE_KEYS))
        if unknown:
            raise ValueError(f"MethodTags.updates: expected keys among {', '.join(UPDATE_KEYS)}, got {', '.join(map(repr, unknown))}")
        object.__setattr__(self, "updates", updates)


@dataclass(frozen=True)
class MethodCase:
    """How to run a method tiny: what :mod:`rayfuse.testing`'s checks (:func:`rayfuse.testing.check_method`) run it
    with, declared on its class (``test_case = MethodCase(...)``; a subclass inherits its parent's or declares its own).

    ``params``: the method's entry, tiny (few rounds and epochs); ``sections``: config sections merged over
    :data:`rayfuse.testing.BASE` (a data or model section of its own). ``step``: the method's own client step
    (``@client_step``) the resume check interrupts, at its ``call``-th call on a client (default: the last, so at least
    one round is checkpointed, for a ``multi_round`` method; else the middle one); a method without a client step of
    its own is interrupted on the server instead: ``Interrupted`` (what SIGTERM raises) at the ``call``-th call of
    ``server_hook`` (a ``ServerContext`` method; default: ``log``, the server logging the method's metrics).
    ``fused``: the model its fused file loads into (``"model"``: the run's; a parameter's name such as ``"student"``:
    the model config that parameter holds; ``None``: a file of other tensors, checked finite only). ``variants``: the
    method's entry in the runs of some refusal checks (``"silos"``: the silo runs', on their 3 classes of 4 features;
    ``"method-dp"``: the run given a ``dp`` key; :data:`rayfuse.testing.RULES`). ``client_state``: its clients keep
    state across rounds (``KeptState``), which outlives their process only under ``run.model_cache``: each run gets a
    cache of its own, so a resume continues mid-method.
    ``checkpoints``: the interruption comes after a round checkpoint of the method (default: its tags'
    ``multi_round``).
    """

    params: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, Any] = field(default_factory=dict)
    step: str | None = None
    call: int | None = None
    server_hook: str = "log"
    fused: str | None = "model"
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    client_state: bool = False
    checkpoints: bool | None = None


class Method(ABC, Generic[P, RS]):
    """Base class of fusion methods and baselines, generic in the method's parameters ``P`` and its round state ``RS``
    (``None`` for a method without rounds): ``class Median(Method[MedianParams, MedianState])``. ``self.params`` and
    :meth:`check`'s ``params`` are then of type ``P`` with no re-declaration and no narrowing.

    Class attributes: ``name`` (the registry name), ``aliases``, ``Params`` (the :class:`MethodParams` subclass ``P``,
    with the paper's defaults: the one runtime record of it, as a ``ClassVar`` cannot hold a type variable),
    ``summary`` (one line for ``rayfuse list``), ``reference`` (the paper), ``tags`` (:class:`MethodTags`: what it
    fuses and what it needs from the run, checked before start by ``rayfuse.prestart.check_tags``), and ``test_case``
    (:class:`MethodCase`: how :func:`rayfuse.testing.check_method` runs it tiny; ``None``: the checks fail asking for one).
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    Params: ClassVar[type[MethodParams]] = MethodParams
    summary: ClassVar[str] = ""
    reference: ClassVar[Reference | None] = None
    tags: ClassVar[MethodTags] = MethodTags()
    test_case: ClassVar[MethodCase | None] = None

    params: P

    def __init__(self, params: P | None = None, label: str | None = None) -> None:
        self.params = cast(P, self.Params()) if params is None else params
        self.label = label or method_name(type(self))  # an unregistered subclass may have no name: its class name

    @classmethod
    def tags_for(cls, params: P | None = None) -> MethodTags:
        """The tags of an entry with ``params`` (``None``: the class's declaration, :attr:`tags`). A method whose
        answer depends on its parameters overrides this (``dataclasses.replace(cls.tags, fuses=...)``); the framework
        reads a method's capabilities here and nowhere else."""
        return cls.tags

    @classmethod
    def check(cls, params: P, setup: RunSetup) -> None:
        """Refuse (raise :class:`InputError`) a run this method cannot do, before anything starts.

        An error's path is either absolute (it starts with a config section: ``data.public_size``, ``model.name``)
        or relative to the method's entry (``k`` becomes ``methods.<label>.k``). The default accepts every run.
        """

    @abstractmethod
    def run(self, server: ServerContext) -> MethodResult:
        """The server loop."""


METHODS: Registry[type[Method]] = Registry("method")


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator adding a :class:`Method` subclass to the registry under ``cls.name``."""
    METHODS.register(cls.name, cls, aliases=cls.aliases)
    return cls


def _discover_methods() -> None:
    """Import every method package under ``rayfuse.fusion`` and the ``rayfuse.methods`` entry-point plug-ins.

    Discovery is by name (``importlib``), as for any plug-in: the contract does not depend on the methods; they
    depend on it.
    """
    package = importlib.import_module("rayfuse.fusion")
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")
    for entry in entry_points(group="rayfuse.methods"):  # third-party methods
        entry.load()


METHODS.add_loader(_discover_methods)


# ---------------------------------------------------------------------------------------------------------------
# Resolving ``methods:`` entries and checking them against the run


@dataclass(frozen=True)
class MethodSpec:
    """A resolved ``methods`` entry: its label, the method's registered name (or its class name for an
    unregistered class), the class, the validated parameters, and which update settings it grouped under ``updates:``
    (a refusal names the key where the entry gave it)."""

    label: str
    method: str
    method_cls: type[Method]
    params: MethodParams
    grouped: frozenset[str] = frozenset()  # the update settings the entry gave under ``updates:`` (refusals name them there)

    def build(self) -> Method:
        return self.method_cls(self.params, self.label)

    @property
    def tags(self) -> MethodTags:
        """The entry's tags (:meth:`Method.tags_for` of its parameters)."""
        return self.method_cls.tags_for(self.params)


_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]*")


def method_name(cls: type[Method]) -> str:
    """A method class's registered name, else its class name (an unregistered subclass may have none)."""
    name = getattr(cls, "name", None)
    return name if isinstance(name, str) and name else cls.__name__


def resolve_methods(methods: Mapping[str, Mapping[str, Any]], objects: Mapping[str, Any] | None = None) -> list[MethodSpec]:
    """Validate every ``methods`` entry against its method's parameter schema (raises :class:`InputError`).

    ``methods`` maps a label to the entry's parameters (``method:`` names the method; default: the label).
    ``objects`` maps labels to methods given as objects (``rayfuse.run(methods=...)``): a registered name, a
    :class:`Method` subclass, or an instance (its ``params`` and its class are used). A label in ``objects`` but not
    in ``methods`` runs with the method's default parameters.
    """
    objects = dict(objects or {})
    entries = {label: dict(raw) if isinstance(raw, Mapping) else raw for label, raw in methods.items()}
    for label in objects:
        entries.setdefault(label, {})
    specs = []
    for label, raw in entries.items():
        path = f"methods.{label}"
        if not _LABEL.fullmatch(label):
            raise InputError(path, "a label of letters, digits and _ . @ + -", label)
        if not isinstance(raw, Mapping):
            raise InputError(path, "a mapping of method parameters", raw)
        entry = dict(raw)
        given = objects.get(label)
        if isinstance(given, Method):
            if entry:
                raise InputError(path, "no parameters in the config for a method given as an instance (its params are used)", sorted(entry))
            _check_declared_tags(type(given), path)
            specs.append(MethodSpec(label, method_name(type(given)), type(given), given.params))
            continue
        if isinstance(given, type) and issubclass(given, Method):
            entry.pop("method", None)
            method_cls, name = given, method_name(given)
        elif given is None or isinstance(given, str):
            name = entry.pop("method", given or label)
            if not isinstance(name, str):
                raise InputError(f"{path}.method", "a registered method name", name)
            method_cls = METHODS.get(name, path=f"{path}.method" if "method" in raw else path)
            name = METHODS.canonical(name)
        else:
            raise InputError(path, "a method: a registered name, a Method subclass or a Method instance", type(given).__name__)
        _check_declared_tags(method_cls, path)
        grouped = _hoist_updates(entry, method_cls, name, path)
        if "dp" in entry and "dp" not in method_cls.Params.model_fields:  # no option to validate: the tags' refusal now
            raise dp_refusal(method_cls, name, f"{path}.updates.dp" if "dp" in grouped else f"{path}.dp", entry["dp"])
        try:
            params = method_cls.Params.model_validate(entry)
        except ValidationError as exc:
            raise where_given(pydantic_input_error(exc, prefix=path, model=method_cls.Params), label, grouped) from None
        specs.append(MethodSpec(label, name, method_cls, params, frozenset(grouped)))
    if not specs:
        raise InputError("methods", "at least one method", "none")
    return specs


def where_given(error: InputError, label: str, grouped: Iterable[str]) -> InputError:
    """``error`` at ``methods.<label>.updates.<key>...`` when that entry gave ``<key>`` in its ``updates:`` block
    (``grouped``), so a refusal names the key where the user wrote it; else ``error`` as it is."""
    prefix = f"methods.{label}."
    if not error.path.startswith(prefix):
        return error
    rest = error.path.removeprefix(prefix)
    return error.at(f"{prefix}updates.{rest}") if rest.split(".", 1)[0].split("[", 1)[0] in set(grouped) else error


def _hoist_updates(entry: dict[str, Any], method_cls: type[Method[Any, Any]], name: str, path: str) -> set[str]:
    """Move an entry's ``updates:`` block (the update layer's settings grouped: ``aggregator``, ``dp``, ``fraction``,
    ``weighted``) to the entry's top level, where the method's ``Params`` reads them as they have always been spelt;
    returns the keys moved. Refused in one line: a block that is not a mapping, a key the method's tags do not take
    (``MethodTags.updates``), a key given both in the block and at the top level."""
    if "updates" not in entry or "updates" in method_cls.Params.model_fields:
        return set()
    block = entry.pop("updates")
    takes = sorted(method_cls.tags.updates)
    if not isinstance(block, Mapping):
        raise InputError(f"{path}.updates", f"a mapping of the update layer's settings ({', '.join(UPDATE_KEYS)})", block)
    for key, value in block.items():
        if key not in takes:
            expected = (
                f"one of {', '.join(takes)} (the update settings method {name!r} takes)"
                if takes
                else f"no updates block for method {name!r} (it takes none of {', '.join(UPDATE_KEYS)}: its tags' updates are empty)"
            )
            raise InputError(f"{path}.updates.{key}" if takes else f"{path}.updates", expected, key)
        if key in entry:
            raise InputError(
                f"{path}.updates.{key}", f"{key} given once: under updates or at the entry's top level (the older spelling)", "both"
            )
        entry[key] = value
    return set(block)


#: the capability flags a method class set before :class:`MethodTags` held them
_FLAGS = (
    "uses_local_models",
    "oracle",
    "multi_round",
    "federated_evaluation",
    "local_model_only",
    "needs_dataset",
    "heterogeneous_clients",
    "public_labels",
    "no_dp",
    "cohort",
    "streams_rounds",
)


def _check_declared_tags(method_cls: type[Method[Any, Any]], path: str) -> None:
    """A method's capabilities are declared one way, in its tags: ``tags`` is a :class:`MethodTags` (and
    :meth:`Method.tags_for` gives one), no class of it sets a capability flag of its own (the old ``uses_local_models =
    True``, ``streams_rounds = True``), and its ``Params`` has no ``fuses`` or ``public_sample`` property (the old
    duck-typed answers): each would be silently ignored, and the run would go on without it. The update keys its tags
    name are fields of its ``Params``."""
    if not isinstance(method_cls.tags, MethodTags):
        raise InputError(path, "a method whose tags are a rayfuse.method.MethodTags", type(method_cls.tags).__name__)
    for klass in method_cls.__mro__:
        loose = [flag for flag in _FLAGS if flag in vars(klass)]
        if loose:
            raise InputError(
                path,
                f"capability flags in the method's tags (tags = MethodTags({loose[0]}=...)), not as class "
                f"attributes of {klass.__qualname__}",
                ", ".join(loose),
            )
    duck = [name for name in ("fuses", "public_sample") if isinstance(getattr(method_cls.Params, name, None), property)]
    if duck:
        raise InputError(
            path,
            f"parameter-dependent tags from the method's tags_for(params) (dataclasses.replace(cls.tags, {duck[0]}=...)), "
            f"not a property of {method_cls.Params.__qualname__}",
            ", ".join(duck),
        )
    undeclared = [key for key in ("aggregator", "dp") if key in method_cls.Params.model_fields and key not in method_cls.tags.updates]
    if undeclared:  # the update layer's settings by name: a field the framework would not read would silently do nothing
        raise InputError(
            path,
            f"the update layer's settings declared in the method's tags (tags = MethodTags(updates=frozenset({{{undeclared[0]!r}}})), "
            f"so the framework applies them), not a field of {method_cls.Params.__qualname__} it does not read",
            ", ".join(undeclared),
        )
    missing = sorted(key for key in method_cls.tags.updates if key not in method_cls.Params.model_fields)
    if method_cls.tags.cohort and "rounds" not in method_cls.Params.model_fields:
        missing.append("rounds")
    if missing:
        raise InputError(path, f"a field of {method_cls.Params.__qualname__} for each update key its tags name", ", ".join(missing))


def update_setting(spec: MethodSpec, key: str, default: Any = None) -> Any:
    """The value of the update layer's setting ``key`` (:data:`~rayfuse.method.UPDATE_KEYS`) in a method entry, or
    ``default`` where the method's tags do not take it (``MethodTags.updates``): the framework reads these fields of
    an entry by their declared names and no other."""
    return getattr(spec.params, key) if key in spec.tags.updates else default


def resolved_config(cfg: ExperimentConfig, specs: Sequence[MethodSpec] | None = None) -> dict[str, Any]:
    """The config as plain data with every default filled in, the methods' parameters too (``config.yaml``)."""
    specs = resolve_methods(cfg.methods) if specs is None else specs
    data = with_public_default(cfg, specs).model_dump(mode="json")
    data["methods"] = {spec.label: {"method": spec.method, **_dumped_params(spec.params)} for spec in specs}
    return data


def _dumped_params(params: MethodParams) -> dict[str, Any]:
    # ``dp`` unset is left out, as ``train.dp`` is: the config of a run without differential privacy reads as it did
    # before the key existed
    data = params.model_dump(mode="json")
    if "dp" in data and data["dp"] is None:
        del data["dp"]
    return data


def check_methods(specs: Sequence[MethodSpec], setup: RunSetup) -> None:
    """Run every method's own :meth:`Method.check` on ``setup``; the first refusal is raised with its full key path.
    What the methods' tags refuse is the pre-start table's (``rayfuse.prestart``: the data rules, then this, then the others)."""
    for spec in specs:
        try:
            spec.method_cls.check(spec.params, setup)
        except InputError as exc:
            head = exc.path.split(".", 1)[0].split("[", 1)[0]
            if head in CONFIG_SECTIONS:
                raise
            raise exc.at(f"methods.{spec.label}.{exc.path}") from None


def reads_public_sample(method_cls: type[Method[Any, Any]], params: MethodParams | None = None) -> bool:
    """Whether the method reads the server's public sample: ``public_sample`` of its tags for ``params`` (distill: only
    with ``transfer: public``; gems: only with ``fine_tune``; epgan: a simulation's never)."""
    return method_cls.tags_for(params).public_sample


def with_public_default(cfg: ExperimentConfig, specs: Sequence[MethodSpec]) -> ExperimentConfig:
    """``cfg`` with the quickstart's public sample resolved: a config without a data section (``data.public_size``
    None) gets :data:`QUICKSTART_PUBLIC_SIZE` when one of ``specs`` reads a public sample, else none, so a default is
    drawn (and its size checked against the data) only where a method uses it; the data section keeps the labels of
    the methods it is drawn for, which a refusal of its size names (the config never states it)."""
    if cfg.data.public_size is not None:
        return cfg
    readers = tuple(s.label for s in specs if reads_public_sample(s.method_cls, s.params))
    data = cfg.data.with_public_default(QUICKSTART_PUBLIC_SIZE if readers else 0, readers)
    return cfg.model_copy(update={"data": data})


def dp_options() -> dict[str, list[str]]:
    """The registered methods whose ``dp`` key applies (a ``dp`` parameter, no ``MethodTags.no_dp``), by mechanism: the
    ``mechanism`` of the ``dp`` field's settings class (central DP-FedAvg, the clients' upload DP)."""
    options: dict[str, list[str]] = {}
    for name, cls in METHODS.items():
        field_ = cls.Params.model_fields.get("dp")
        if field_ is None or "dp" not in cls.tags.updates or cls.tags.no_dp:
            continue
        settings = [a for a in typing.get_args(field_.annotation) or (field_.annotation,) if a is not type(None)]
        mechanism = getattr(settings[0], "mechanism", None) if len(settings) == 1 else None
        options.setdefault(mechanism if isinstance(mechanism, str) else "a dp option of its own", []).append(name)
    return options


def dp_options_text() -> str:
    """:func:`dp_options` in one line: ``central DP-FedAvg on fedadagrad, ...; upload DP (...) on aligned, average``."""
    return "; ".join(f"{mechanism} on {', '.join(names)}" for mechanism, names in sorted(dp_options().items()))


def dp_refusal(
    method_cls: type[Method[Any, Any]], name: str, path: str, given: Any = "a dp section", params: MethodParams | None = None
) -> InputError:
    """The one line refusing ``dp`` at ``path`` (``methods.<label>.dp``) on a method whose tags say it does not apply
    (``MethodTags.no_dp``), that fuses what the update pipeline's DP does not act on (``MethodTags.fuses``), or that has
    no ``dp`` option; its hint lists the methods whose ``dp`` applies (:func:`dp_options`)."""
    tags = method_cls.tags_for(params)
    fused = tags.fuses  # what the update pipeline would have to noise (its dp acts on parameter updates only)
    if tags.no_dp:
        why = tags.no_dp
    elif fused not in ("parameters", "nothing"):
        why = f"it fuses {fused}; dp acts on parameter updates"
    else:
        why = "it has no differential-privacy option"
    return InputError(path, f"no dp for method {name!r} ({why})", given, f"methods.<label>.dp is {dp_options_text()}")
