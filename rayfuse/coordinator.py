"""The coordinator: runs methods' server loops against a federation.

:class:`Coordinator` is a plain class (``actors.CoordinatorActor`` wraps it as a named Ray actor on the driver's
node). It holds the server-side data roles (the global test set, the public sample), trains nothing itself except
the ``global`` oracle, and for each method builds a :class:`ServerContext`: the method's whole view of the world.
It receives clients' results as references and resolves them itself, so parameters never pass through the driver.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from rayfuse.client import (
    forget_client_state,
    get_local_update,
    has_client_state,
    join_silo_plan,
    report_silo,
    restore_local,
    set_local_params,
    train_local,
)
from rayfuse.config import ExperimentConfig, ModelConfig
from rayfuse.data.identity import data_files
from rayfuse.data.roles import (
    DataPlan,
    Normalization,
    Split,
    load_dataset_from_config,
    load_target_from_config,
    pooled_train,
    server_splits,
)
from rayfuse.data.silos import SiloPlan, check_schemas, combine_moments, server_split, wants_standardization
from rayfuse.errors import NonFiniteError, RunFailure
from rayfuse.evaluation import (
    CLIENT_PREFIX,
    FEDERATED_PREFIX,
    average_client_tables,
    evaluate_held_out,
    make_client_row,
    model_for_params,
    read_client_table,
)
from rayfuse.federation import Federation, Gathered, Update, step_name
from rayfuse.method import MethodResult, MethodSpec, Rejected, resolve_methods, resolved_config
from rayfuse.metrics import add_metric_sums, check_metric_sums, compute_metrics, majority_vote, metrics_event, metrics_from_sums
from rayfuse.models import build_model, check_params, model_with_params, params_layout, predict_proba, take_params
from rayfuse.models.registry import builds_on_meta
from rayfuse.rounds import RoundLoop
from rayfuse.seeding import derive_seed, make_rng
from rayfuse.store import (
    Checkpoint,
    LocalModelStore,
    RunStore,
    StepResultCache,
    local_model_key,
    note_data_files,
    step_result_key,
)
from rayfuse.updates.pipeline import UpdatePipeline

__all__ = ["Coordinator", "MethodServer", "MethodUpdates", "ServerData", "ServerModels", "ServerScoring"]

R = TypeVar("R")
S = TypeVar("S")


class ServerData:
    """``server.data`` (implements :class:`rayfuse.method.DataRoles`): the coordinator's server-side data roles and the
    run's data settings, as one method sees them."""

    def __init__(self, coordinator: Coordinator, spec: MethodSpec) -> None:
        self._coordinator = coordinator
        self._spec = spec
        cfg = coordinator.cfg
        self.data_cfg = cfg.data  # the dataset spec (a generator's true distribution for methods that score against it)
        self.evaluation: str = cfg.evaluation  # central | federated | both (rayfuse.evaluation)
        self.num_classes = coordinator.plan.num_classes
        self.input_shape = coordinator.plan.input_shape

    @property
    def num_clients(self) -> int:
        return self._coordinator.federation.num_clients

    @property
    def test(self) -> Split:
        """The global test set (evaluation only)."""
        return self._coordinator.server_data()[0]

    @property
    def public(self) -> Split:
        """The server's public sample (``data.public_size``; may be empty)."""
        return self._coordinator.server_data()[1]

    @property
    def dataset_meta(self) -> dict[str, Any]:
        """Facts a procedural dataset records about itself (e.g. the true GMM atoms): for evaluation only, like the
        test set; empty for other datasets."""
        if isinstance(self._coordinator.plan, SiloPlan):
            raise RunFailure(
                f"{self._spec.label}: asked for the dataset's own facts (dataset_meta); a silo run (data.silos) has no dataset"
            )
        return dict(self._coordinator._load_dataset().meta)

    @property
    def class_counts(self) -> np.ndarray:
        """The partition plan's class counts, ``(num_clients, num_classes)``: each client's training and held-out
        examples of each class together, as the partition manifest records them."""
        return np.asarray(self._coordinator.plan.counts)

    def pooled_train(self) -> Split:
        """Every client's training data pooled. Only oracle methods may ask: a federation cannot do this."""
        if not self._spec.tags.oracle:
            raise RunFailure(f"method {self._spec.method!r} asked for pooled client data; only oracle methods may")
        return self._coordinator.pooled_train()


class ServerModels:
    """``server.models`` (implements :class:`rayfuse.method.ModelService`): the run's model and a client's own, the
    training settings, the device and the shared seeded initialisation."""

    def __init__(self, coordinator: Coordinator) -> None:
        cfg = coordinator.cfg
        self._cfg = cfg
        self._seed = cfg.run.seed
        self.model_cfg = cfg.model  # the run's model (the server's); a client's own: client_model(client)
        self.train_cfg = cfg.train
        self.device = coordinator.device
        self._input_shape = coordinator.plan.input_shape
        self._num_classes = coordinator.plan.num_classes

    def build_model(self, seed: int | None = None) -> Any:
        return build_model(self.model_cfg, self._input_shape, self._num_classes, seed=seed)

    def client_model(self, client: int) -> ModelConfig:
        """Client ``client``'s model: its ``federation.client_overrides.<i>.model``, else the run's (``model_cfg``)."""
        return self._cfg.client_model(client)

    def build_client_model(self, client: int, seed: int | None = None) -> Any:
        """A model of client ``client``'s architecture (:meth:`client_model`)."""
        return build_model(self.client_model(client), self._input_shape, self._num_classes, seed=seed)

    def initial_params(self) -> dict[str, np.ndarray]:
        """The shared seeded initialisation (the same as the clients' local models when ``train.shared_init``)."""
        return take_params(self.build_model(seed=derive_seed(self._seed, "init")))  # the built model's own memory: no copy


class ServerScoring:
    """``server.scoring`` (implements :class:`rayfuse.method.Scoring`): evaluation on the server's test set, the
    clients' held-out splits, or both (``evaluation``). It keeps the per-client tables of the federated evaluations
    not yet logged (``tables``), which the method's next logged row records (:meth:`MethodServer.log`)."""

    def __init__(
        self, coordinator: Coordinator, label: str, data: ServerData, models: ServerModels, federation: Federation, updates: UpdatePipeline
    ) -> None:
        self._coordinator = coordinator
        self._label = label
        self._data = data
        self._models = models
        self._federation = federation
        self._updates = updates
        self.tables: list[list[dict[str, Any]]] = []  # per-client tables of the federated evaluations not yet logged

    def predict_proba(self, params: dict[str, np.ndarray], X: np.ndarray | None = None) -> np.ndarray:
        return self._predict(params, self._models.model_cfg, X)

    def _predict(self, params: dict[str, np.ndarray], model_cfg: ModelConfig, X: np.ndarray | None = None) -> np.ndarray:
        """The class probabilities of ``params`` built into ``model_cfg`` on ``X`` (default: the server's test set)."""
        # params' own memory, no second copy of the model (of several GB, possibly) nor its random initialisation
        model = model_with_params(
            lambda: build_model(model_cfg, self._data.input_shape, self._data.num_classes), params, meta=builds_on_meta(model_cfg)
        )
        return predict_proba(model, self._data.test.X if X is None else X, device=self._models.device)

    def evaluate_proba(self, proba: np.ndarray) -> dict[str, float]:
        """The metrics of ``proba`` predicted on the server's test set. Refused with ``evaluation: federated`` (the
        run's metrics are the clients': a method scores through :meth:`evaluate` / :meth:`evaluate_ensemble`)."""
        if self._data.evaluation == "federated":
            raise RunFailure(
                f"{self._label}: scores predictions on the server's test set (evaluate_proba), which evaluation: federated "
                "does not use; score through evaluate / evaluate_ensemble, or tag the method federated_evaluation=False"
            )
        return compute_metrics(proba, self._data.test.y)

    def evaluate(self, params: dict[str, np.ndarray], *, resized: bool = False, model: ModelConfig | None = None) -> dict[str, float]:
        """Accuracy, NLL, entropy and ECE of ``params`` built into ``model`` (default: the run's model; a client's own
        is ``server.models.client_model``): on the global test set, the clients' held-out splits, or both
        (``evaluation``; see :meth:`evaluate_ensemble`). ``resized``: that architecture at other widths (a fused model
        whose permutation groups grew or shrank; only NaN / Inf are checked then)."""
        model_cfg = self._models.model_cfg if model is None else model
        if resized:
            if not all(np.isfinite(v).all() for v in params.values() if v.dtype.kind == "f"):
                raise NonFiniteError(f"{self._label}: the model to evaluate has NaN or Inf values")
        else:
            problem = check_params(params, self._coordinator.reference_for(model_cfg))
            if problem:
                raise NonFiniteError(f"{self._label}: the model to evaluate is invalid: {problem}")

        def central() -> dict[str, float]:
            if resized:
                built = model_for_params(params, model_cfg, self._data.input_shape, self._data.num_classes)
                return self.evaluate_proba(predict_proba(built, self._data.test.X, device=self._models.device))
            return self.evaluate_proba(self._predict(params, model_cfg))

        return self._evaluate_where(central, [params], None, [model_cfg])

    def evaluate_ensemble(
        self, members: Sequence[dict[str, np.ndarray]], weights: Sequence[float], *, models: Sequence[ModelConfig] | None = None
    ) -> dict[str, float]:
        """The metrics of the ensemble of ``members`` (probabilities averaged with ``weights``) and the accuracy of
        its majority vote (``vote_accuracy``), where ``evaluation`` says: federated, every client receives the members'
        parameters (and their model configs) and scores them on its held-out split. ``models``: each member's
        architecture (members of clients with models of their own: ``[server.models.client_model(c) for c in
        clients]``); default: the run's model for every member."""
        configs = [self._models.model_cfg] * len(members) if models is None else list(models)
        if len(configs) != len(members):
            raise ValueError(f"{self._label}: evaluate_ensemble got {len(members)} members and {len(configs)} models")

        def central() -> dict[str, float]:
            probas = np.stack([self._predict(p, m) for p, m in zip(members, configs)])
            metrics = self.evaluate_proba(np.tensordot(weights, probas, axes=1))
            metrics["vote_accuracy"] = float(np.mean(majority_vote(probas, list(weights)) == self._data.test.y))
            return metrics

        return self._evaluate_where(central, list(members), [float(w) for w in weights], configs, vote=True)

    def _evaluate_where(
        self,
        central: Callable[[], dict[str, float]],
        members: list[dict[str, np.ndarray]],
        weights: list[float] | None,
        models: list[ModelConfig],
        *,
        vote: bool = False,
    ) -> dict[str, float]:
        """The one dispatch of ``evaluation``: central metrics, the federated aggregate, or both (the federated ones
        prefixed ``federated_``)."""
        evaluation = self._data.evaluation
        if evaluation == "central":
            return central()
        metrics = central() if evaluation == "both" else {}
        federated = self._evaluate_federated(members, weights, models, vote=vote)
        if evaluation == "federated":
            return federated
        return {**metrics, **{FEDERATED_PREFIX + k: v for k, v in federated.items()}}

    def _evaluate_federated(
        self, members: list[dict[str, np.ndarray]], weights: list[float] | None, models: list[ModelConfig], *, vote: bool
    ) -> dict[str, float]:
        """Every client scores ``members``, each built into its model config of ``models``, on its held-out split and
        replies with sums and counts; the metrics of the summed sums (count-weighted over the clients). A malformed
        reply is rejected (``update_rejected``); the per-client table is logged with the method's next row."""
        fed = self._federation
        gathered = fed.run(evaluate_held_out, fed.put(members), weights, vote=vote, models=models)
        extra = ("vote_correct",) if vote else ()

        def read(client: int, reply: Any) -> dict[str, Any]:
            problem = check_metric_sums(reply, extra=extra)
            if problem is not None:
                raise Rejected(f"evaluation reply: {problem}")
            return dict(reply)

        need = min(fed.policy.min_clients, len(gathered.results) + len(gathered.failures))
        kept = self._updates.accept_replies(gathered, read, need=need, what="evaluation replies")
        total = add_metric_sums([kept[c] for c in sorted(kept)])
        if float(total["count"]) <= 0:
            raise RunFailure(f"{self._label}: federated evaluation: the held-out splits of clients {sorted(kept)} are empty")
        self.tables.append([make_client_row(c, kept[c]) for c in sorted(kept)])
        return metrics_from_sums(total)


class MethodUpdates(UpdatePipeline):
    """``server.updates``: the update pipeline (:class:`rayfuse.updates.pipeline.UpdatePipeline`) with the engine's
    step-result cache (:meth:`run_cached`), which needs the coordinator's store; together they implement
    :class:`rayfuse.method.UpdateService`."""

    def __init__(self, server: MethodServer, coordinator: Coordinator, spec: MethodSpec) -> None:
        super().__init__(
            server,
            spec,
            coordinator.cfg.federation.attacks,
            planned_examples=coordinator.plan.num_examples,
            reference_of=coordinator.reference_params,
            local_updates=coordinator.local_updates,
            streaming=coordinator.cfg.federation.streaming,
            aggregation=coordinator.cfg.federation.aggregation,
            clients_per_actor=coordinator.cfg.federation.clients_per_actor,
            secure=coordinator.cfg.federation.secure_aggregation,
        )
        self._coordinator = coordinator
        self._method_server = server

    def run_cached(self, step: Any, *args: Any, **kwargs: Any) -> Gathered[Any]:
        """``server.federation.run(step, *args, **kwargs)``, cached across runs when ``run.model_cache`` is set.

        For deterministic client steps that summarise a client's data (a local posterior fit): the results of every
        client are stored under a key of the data, split, model, training settings, seed, the step and its arguments,
        and runs that share the key (the trials of a Tune sweep over fusion-only knobs) compute them once. Without
        ``run.model_cache``, or when a client failed, this is plain ``federation.run``.
        """
        coordinator = self._coordinator
        root = coordinator.cfg.run.model_cache
        if not root:
            return self._method_server.federation.run(step, *args, **kwargs)
        name = step_name(step)
        coordinator.note_cache_files()
        key, inputs = step_result_key(coordinator.resolved_config(), coordinator.plan.digest(), name, args, kwargs)
        cache = StepResultCache(root, key, inputs)
        clients = self._method_server.federation.client_ids
        with cache.lock():
            saved = cache.load(clients)
            if saved is not None:
                self._method_server.events.emit(
                    "step_results_restored",
                    f"{name}: {len(saved)} clients' results from the model cache ({key})",
                    method=self._method_server.label,
                    key=key,
                )
                return Gathered(saved)
            gathered = self._method_server.federation.run(step, *args, **kwargs)
            if sorted(gathered.results) == sorted(clients) and not gathered.failures and cache.save(gathered.results):
                self._method_server.events.emit(
                    "step_results_cached",
                    f"{name}: {len(clients)} clients' results -> {cache.folder}",
                    method=self._method_server.label,
                    key=key,
                )
            return gathered


class MethodServer:
    """The coordinator's implementation of :class:`rayfuse.method.ServerContext` (a method's view of the run: five
    services, :class:`ServerData`, :class:`ServerModels`, :class:`ServerScoring`, :class:`MethodUpdates` and the
    federation) and of :class:`rayfuse.rounds.LoopServer` (the round loop's internals: resume, history, checkpoints,
    state the clients keep)."""

    def __init__(self, coordinator: Coordinator, spec: MethodSpec, *, resume: bool) -> None:
        self._coordinator = coordinator
        self.label = spec.label
        self.method = spec.method
        self.params = spec.params
        self.method_cls = spec.method_cls
        self.federation: Federation = coordinator.federation
        self.events = coordinator.events
        cfg = coordinator.cfg
        self.seed = cfg.run.seed
        self.data = ServerData(coordinator, spec)
        self.models = ServerModels(coordinator)
        # ``run.model_cache``: storage the clients own, where they keep state for later runs (their trained local
        # models; FedSA's translators, so that ``--resume`` continues mid-method); ``None``: the clients keep nothing
        self.model_cache = cfg.run.model_cache
        self.checkpoint = coordinator.store.checkpointer(spec.label)
        self.resume = resume
        self.history: list[dict[str, Any]] = []
        # the update pipeline: validation, attacks, clipping and DP, the aggregation rule (configured once, here)
        self.updates = MethodUpdates(self, coordinator, spec)
        self.scoring = ServerScoring(coordinator, spec.label, self.data, self.models, self.federation, self.updates)

    def clients_missing_state(self, kind: str, store: str, rounds: dict[int, int]) -> list[int]:
        """The clients of ``rounds`` (client -> round) that cannot give back their private state ``kind`` of that round,
        kept under this method's label in their own ``store`` (``rayfuse.client.ClientStateStore``): gone from the
        federation, failing, or without the file. A resumed method continues mid-method only when this is empty."""
        fed = self.federation
        calls = [
            call
            for client in sorted(rounds)
            if client in fed.client_ids
            for call in fed.map(has_client_state, clients=[client], kind=kind, store=store, name=self.label, round=rounds[client])
        ]
        try:
            gathered = fed.gather(calls) if calls else None
        except RunFailure:
            gathered = None
        held = set() if gathered is None else {client for client, ok in gathered.results.items() if ok is True}
        return sorted(client for client in rounds if client not in held)

    def forget_client_state(self, kind: str, store: str) -> None:
        """Let every client delete its private state ``kind`` of ``store`` (the method is done, or restarts). A failure
        leaves files in the clients' caches, not a failed method: a ``warning`` event."""
        try:
            self.federation.run(forget_client_state, kind=kind, store=store)
        except RunFailure as exc:
            self.events.emit("warning", f"client state {kind} not deleted: {exc}", method=self.label)

    def step_seed(self, *tags: object) -> int:
        return derive_seed(self.seed, "server", self.label, *tags)

    def rng(self, *tags: object) -> np.random.Generator:
        return make_rng(self.seed, "server", self.label, *tags)

    # -- logging and checkpoints ------------------------------------------------------------------------------

    def log(self, round: int, metrics: dict[str, float], client: int | None = None) -> None:
        """Record ``metrics`` at ``round`` (rows of ``metrics.parquet``) and send them on the metrics channel (one
        ``metrics`` event, :func:`rayfuse.metrics.metrics_event`). A row of the method as a whole (``client``
        ``None``) also records the per-client tables of the federated evaluations since the last one
        (:meth:`log_client_table`)."""
        self._record(int(round), {name: float(value) for name, value in metrics.items()}, client)
        if client is None:
            self.log_client_table(round)

    def _record(self, round: int, values: dict[str, float], client: int | None) -> None:
        """One metric row: the method's history (``metrics.parquet``) and a ``metrics`` event, the same values at full
        precision (the ``progress`` events the screen prints round them)."""
        for name, value in values.items():
            self.history.append({"round": round, "metric": name, "value": value, "client": client})
        if values:
            kind, message, fields = metrics_event(self.label, round, values, client)
            self.events.emit(kind, message, **fields)

    def log_client_table(self, round: int) -> None:
        """Record the per-client tables of the federated evaluations not yet logged at ``round``: ``val_<metric>`` rows
        with the client's id (``val_count``: its held-out size); several evaluations (``local``: one per model) are
        averaged per client."""
        if not self.scoring.tables:
            return
        table = average_client_tables(self.scoring.tables)
        self.scoring.tables = []
        for row in table:
            self._record(int(round), {CLIENT_PREFIX + name: float(value) for name, value in row.items() if name != "client"}, row["client"])

    def collect_client_table(self) -> list[dict[str, Any]]:
        """The per-client table of the method's last federated evaluation (empty with ``evaluation: central``)."""
        if self.scoring.tables:
            self.log_client_table(max((int(r["round"]) for r in self.history), default=0))
        return read_client_table(self.history)

    def progress(self, message: str, **fields: Any) -> None:
        self.events.emit("progress", message, method=self.label, **fields)

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
    ) -> RoundLoop[S]:
        """The rounds ``first .. last`` of this method over its typed round ``state`` (:class:`rayfuse.rounds.RoundLoop`:
        resume, evaluation cadence, history, progress, round checkpoints with the update pipeline's own state, state
        the clients keep). Central DP is planned here, before round 1 (the pipeline's ``rounds``): ``last`` is then the
        last round its budget affords; each round's cohort is the pipeline's (:meth:`RoundLoop.cohorts`)."""
        return RoundLoop(
            self,
            state,
            last=self.updates.rounds(last),
            first=first,
            evaluate=evaluate,
            evaluate_every=evaluate_every,
            unit=unit,
            quiet=quiet,
            on_resume=on_resume,
            step=step,
        )

    def resume_checkpoint(self) -> Checkpoint | None:
        """The last round checkpoint of this method when resuming (``None`` on a fresh run)."""
        if not self.resume:
            return None
        checkpoint = self.checkpoint.load(warn=lambda message: self.events.emit("warning", message, method=self.label))
        if checkpoint is not None:
            self.history = list(checkpoint.meta.get("history", []))
            self.events.emit("resumed", f"from round {checkpoint.round}", method=self.label, round=checkpoint.round)
        return checkpoint

    def save_checkpoint(
        self, round: int, params: dict[str, np.ndarray], state: dict[str, np.ndarray] | None = None, meta: dict[str, Any] | None = None
    ) -> None:
        self.checkpoint.save(round, params, state, {**(meta or {}), "history": self.history})


class Coordinator:
    """Runs the stages of a run and each method's server loop.

    Parameters
    ----------
    cfg : ExperimentConfig
    plan : DataPlan
    run_dir : str
        The run folder (checkpoints and model files are written here).
    federation : Federation
    specs : list of MethodSpec, optional
        The resolved ``methods`` entries (their classes may be objects given to ``rayfuse.run``); default: resolved
        from ``cfg.methods`` against the registry.
    device : str
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        plan: DataPlan,
        run_dir: str,
        federation: Federation,
        *,
        specs: list[MethodSpec] | None = None,
        device: str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.specs = resolve_methods(cfg.methods) if specs is None else list(specs)
        self._resolved: dict[str, Any] | None = None
        self.plan = plan
        self.store = RunStore(run_dir, max_shard_size=cfg.run.max_shard_size)
        self.federation = federation
        self.events = federation.events
        self.device = device
        self._dataset: Any = None
        self._server_data: tuple[Split, Split] | None = None
        self._ready: list[int] | None = None  # the clients holding their trained local model (prepare_local_models)
        # the clients whose local model the run folder holds (checkpoints/local: installed from there, or saved there
        # once fetched): the fallback of a client that lost its own (a restarted process); the clients own the models
        self._in_run_folder: set[int] = set()
        self._references: list[tuple[ModelConfig, dict[str, np.ndarray]]] = []  # reference_for's models, built once
        self._cache_files_noted = False  # note_cache_files ran (once a run)

    # -- lazily loaded server-side state ------------------------------------------------------------------------

    def _load_dataset(self) -> Any:
        if isinstance(self.plan, SiloPlan):
            raise RunFailure("the whole dataset: a silo run has none (each client reads its own silo, data.silos)")
        if self._dataset is None:
            self._dataset = load_dataset_from_config(self.cfg.data)
        return self._dataset

    def server_data(self) -> tuple[Split, Split]:
        if self._server_data is None and isinstance(self.plan, SiloPlan):
            self._server_data = (self._silo_server_split("test"), self._silo_server_split("public"))
        if self._server_data is None:
            source = load_target_from_config(self.cfg.data) if self.plan.target else self._load_dataset()
            assert source is not None  # plan.target is set only for a config with data.target
            self._server_data = server_splits(source, self.plan)
        return self._server_data

    def _silo_server_split(self, key: str) -> Split:
        """``data.test`` / ``data.public`` of a silo config, read here (the server's node); empty when not given."""
        spec = getattr(self.cfg.data, key)
        plan = self.plan
        if spec is None:
            return Split(np.zeros((0, *plan.input_shape), dtype=np.float32), np.zeros(0, dtype=np.int64))
        return server_split(
            spec,
            key=f"data.{key}",
            labels=plan.class_names,
            input_shape=plan.input_shape,
            normalization=plan.normalization,
            classes=self.cfg.data.class_names,
            dtype=str(plan.schemas[0]["dtype"]) if isinstance(plan, SiloPlan) and plan.schemas else None,
            text=plan.text if isinstance(plan, SiloPlan) else None,
        )

    def pooled_train(self) -> Split:
        if isinstance(self.plan, SiloPlan):
            raise RunFailure("the clients' pooled data: no process may read every silo (data.silos)")
        return pooled_train(self._load_dataset(), self.plan)

    def survey_silos(self) -> SiloPlan:
        """The silo survey (``data.silos``), before any training: every client reports its schema and counts (and, when
        the run standardises, its feature moments); the schemas must agree (:func:`rayfuse.data.silos.check_schemas`:
        an :class:`InputError` naming the silo that differs); the server combines the moments into the global mean
        and scale; every client installs the completed plan (and standardises its splits), which the federation keeps
        for a client process that restarts later (:meth:`rayfuse.federation.Federation.install`); the server's own sets
        are read and checked against the silos' input shape and label values (:func:`rayfuse.data.silos.server_split`:
        an :class:`InputError` at ``data.test`` / ``data.public``). Returns the completed plan."""
        plan = self.plan
        assert isinstance(plan, SiloPlan)
        fed = self.federation
        standardize = wants_standardization(self.cfg)
        gathered = fed.run(report_silo, moments=standardize)
        missing = sorted(set(fed.client_ids) - set(gathered.results))
        if missing:
            raise RunFailure(f"the silo survey: clients {missing} did not report their silo")
        reports = [gathered.results[c] for c in sorted(gathered.results)]
        schemas = [r["schema"] for r in reports]
        check_schemas(schemas, plan.silos)
        normalization = None
        if standardize:
            mean, scale = combine_moments([r["moments"] for r in reports])
            normalization = Normalization(mean, scale)
        plan = plan.with_schemas(schemas, normalization)
        joined = {c: plan.for_client(c) for c in fed.client_ids}
        fed.gather([call for c, client_plan in joined.items() for call in fed.map(join_silo_plan, client_plan, clients=[c])])
        fed.install(join_silo_plan, joined)  # a client process restarted later takes the completed plan back first
        self.plan = plan
        self._server_data = None
        self._references = []
        self.server_data()  # the server's own sets (data.test, data.public) checked against the silos before any training
        self.events.emit(
            "silos_surveyed",
            f"{plan.num_clients} silos agree: input {plan.input_shape}, {plan.num_classes} labels"
            + (", features standardised (federated)" if normalization is not None else ""),
            sizes=[plan.num_examples(c) for c in fed.client_ids],
        )
        return plan

    def reference_params(self, client: int | None = None) -> dict[str, np.ndarray]:
        """The parameter layout (keys, shapes) an update must match: of client ``client``'s model
        (``federation.client_overrides.<i>.model``, else the run's), or of the run's model (``client`` ``None``)."""
        return self.reference_for(self.cfg.model if client is None else self.cfg.client_model(client))

    def reference_for(self, model: ModelConfig) -> dict[str, np.ndarray]:
        """The parameter layout of ``model`` on this run's data (built once per model config)."""
        for known, params in self._references:
            if known == model:
                return params
        # keys, shapes and dtypes only: arrays that hold no memory (a model of several GB is described for free)
        params = params_layout(lambda: build_model(model, self.plan.input_shape, self.plan.num_classes, seed=0), meta=builds_on_meta(model))
        self._references.append((model, params))
        return params

    def local_model_key(self, client: int) -> str:
        """The content key of client ``client``'s local model (:func:`rayfuse.store.local_model_key`, from the run's
        resolved config with that client's own model): the key the client computes for its copy."""
        config = {**self.resolved_config(), "model": self.cfg.client_model(client).model_dump(mode="json")}
        return local_model_key(config, self.plan.for_client(client))[0]

    def note_cache_files(self) -> None:
        """Once a run, with ``run.model_cache``: record the content of the run's data files in the cache
        (:func:`rayfuse.store.note_data_files`; a silo by the content hash its client reported) and say, one ``warning``
        event a file, which changed since a run sharing the cache used them. Its entries are keyed by content
        (:func:`rayfuse.store.local_model_key`), so what was computed from the old content is computed again, not read."""
        root = self.cfg.run.model_cache
        if not root or self._cache_files_noted:
            return
        self._cache_files_noted = True
        files = data_files(self.resolved_config()["data"])
        if isinstance(self.plan, SiloPlan) and self.plan.schemas:
            # a silo is read on its client's node only: its path as written (per client) and the survey's content hash
            files.update(
                {
                    f"data.silos.{c}.path": {"path": f"client {c}: {silo.path}", "sha256": str(schema["content_hash"])}
                    for c, (silo, schema) in enumerate(zip(self.plan.silos, self.plan.schemas))
                }
            )
        for key, path, before, now in note_data_files(root, files):
            self.events.emit(
                "warning",
                f"{key} ({path}): content changed since a run sharing the model cache {root} used it "
                f"(SHA-256 {before[:12]} -> {now[:12]}); what was computed from it is computed again, not read",
            )

    def resolved_config(self) -> dict[str, Any]:
        """The run's resolved config (cache keys are computed from it)."""
        if self._resolved is None:
            self._resolved = resolved_config(self.cfg, self.specs)
        return self._resolved

    def events_since(self, index: int) -> list[dict[str, Any]]:
        return self.events.since(index)

    # -- stages ---------------------------------------------------------------------------------------------------

    def _stage(self, name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        self.events.emit("stage_start", stage=name)
        value = fn()
        self.events.emit("stage_end", stage=name, seconds=round(time.perf_counter() - started, 3))
        return value

    def prepare_local_models(self, resume: bool = False) -> dict[str, Any]:
        """Have every client hold its trained local model: trained once, or restored on resume; no parameters move."""
        return self._stage("local_training", lambda: self._prepare_local_models(resume))

    def _prepare_local_models(self, resume: bool) -> dict[str, Any]:
        """The clients own their local models (``run.model_cache``: each keeps its own copy under its content key,
        :func:`rayfuse.store.local_model_key`). A fresh run asks every client for its model (it reads its copy or
        trains and keeps one). A resumed run asks for the clients' copies first, installs the run folder's
        ``checkpoints/local`` for the clients without one (no ``run.model_cache``, or their storage is gone), and trains
        the rest. Runs sharing the keys (concurrent Tune trials) wait here while one of them trains."""
        fed = self.federation
        root = self.cfg.run.model_cache
        self.note_cache_files()
        keys = {c: self.local_model_key(c) for c in fed.client_ids} if root else {}
        with LocalModelStore(root).lock_run(keys.values()) if root else contextlib.nullcontext():
            kept: list[int] = []
            if resume and root:
                kept = sorted(c for c, stats in fed.run(restore_local).results.items() if stats is not None)
            from_run: list[int] = []
            if resume:
                saved = self.store.load_local_models(
                    [c for c in fed.client_ids if c not in kept], warn=lambda message: self.events.emit("warning", message)
                )
                calls = [
                    call
                    for client, (params, stats) in saved.items()
                    for call in fed.map(set_local_params, fed.put(params), stats, clients=[client])
                ]
                from_run = fed.gather(calls).clients if calls else []
            rest = [c for c in fed.client_ids if c not in kept and c not in from_run]
            trained: list[int] = []
            if rest:
                report = self.cfg.federation.secure_aggregation is None  # secure: no client's own loss or time
                for client, stats in fed.run(train_local, report=report, clients=rest).results.items():
                    if stats.get("cached") == 1.0:  # the client read the copy it kept
                        kept.append(client)
                        continue
                    trained.append(client)
                    spent = f", epsilon {stats['dp_epsilon']:.3g}" if "dp_epsilon" in stats else ""
                    self.events.emit(
                        "client_trained",
                        f"loss {stats['train_loss']:.4f}{spent}"
                        if "train_loss" in stats
                        else "trained (secure aggregation: no loss reported)",
                        client=client,
                        seconds=round(stats.get("train_seconds", 0.0), 3),
                        **({"dp_epsilon": stats["dp_epsilon"]} if "dp_epsilon" in stats else {}),
                    )
        kept.sort()
        if kept:
            self.events.emit(
                "local_models_restored", f"{len(kept)} local models from the clients' own copies ({root})", source="cache", clients=kept
            )
        if from_run:
            self.events.emit(
                "local_models_restored", f"{len(from_run)} local models from checkpoints/local", source="checkpoint", clients=from_run
            )
        if trained and root:
            self.events.emit(
                "local_models_cached",
                f"{len(trained)} local models kept by their clients in {LocalModelStore(root).root}",
                keys={str(c): keys[c] for c in trained},
            )
        # A client dropped while training stays out of every method of this run that uses local models.
        self._ready = sorted([*kept, *from_run, *trained])
        self._in_run_folder = set(from_run)
        return {"clients": self._ready, "restored": bool(kept or from_run)}

    def local_updates(self) -> Gathered[Update]:
        """The ready clients' local model parameters, for a method that fuses them, asked of the clients each time (the
        client is the one owner of its local model; the coordinator keeps no copy). A client that no longer holds its
        model (a restarted process, without a copy of its own under ``run.model_cache``) is given back the run folder's
        (``checkpoints/local``) and that is its answer; one the run folder does not hold either trains it again. Each
        fetched model missing from the run folder is checkpointed there (``--resume``'s fallback, and this one)."""
        if self._ready is None:  # a method needing local models ran without the local_training stage (tests)
            self._prepare_local_models(resume=False)
        fed = self.federation
        gathered = fed.run(get_local_update, clients=self._ready, train=False)
        results: dict[int, Update] = {c: u for c, u in gathered.results.items() if u is not None}
        failures = list(gathered.failures)
        lost = sorted(c for c, u in gathered.results.items() if u is None)
        if lost:
            saved = self.store.load_local_models(
                [c for c in lost if c in self._in_run_folder], warn=lambda message: self.events.emit("warning", message)
            )
            calls = [
                call
                for client, (params, stats) in saved.items()
                for call in fed.map(set_local_params, fed.put(params), stats, clients=[client])
            ]
            installed = fed.gather(calls) if calls else Gathered({}, [])
            for client, num_examples in installed.results.items():
                params, stats = saved[client]
                results[client] = Update(params, int(num_examples), dict(stats))
            failures += installed.failures
            if installed.results:
                self.events.emit(
                    "local_models_restored",
                    f"{len(installed.results)} local models from checkpoints/local (the clients had lost theirs)",
                    source="checkpoint",
                    clients=sorted(installed.results),
                )
            rest = [c for c in lost if c not in installed.results and c not in {f.client for f in installed.failures}]
            if rest:  # not in the run folder yet: the client trains it again (deterministic: the same model)
                again = fed.run(get_local_update, clients=rest)
                results.update(again.results)
                failures += again.failures
        self.store.save_local_models({c: u for c, u in results.items() if c not in self._in_run_folder})
        self._in_run_folder.update(results)
        return Gathered({c: results[c] for c in sorted(results)}, failures)

    def _add_local_privacy(self, result: MethodResult) -> None:
        """Record what local DP-SGD (``train.dp``) spent: each client's epsilon (``info.local_dp.epsilon``, as the
        client reported it: a statistic, not data) and the largest (``metrics.dp_sgd_epsilon``, the run's guarantee for any
        one example)."""
        dp = self.cfg.train.dp
        assert dp is not None
        stats = {c: u.metrics for c, u in self.local_updates().results.items()}
        epsilon = {str(c): float(m["dp_epsilon"]) for c, m in sorted(stats.items()) if "dp_epsilon" in m}
        if not epsilon:
            return
        result.info["local_dp"] = {
            "epsilon": epsilon,
            "delta": dp.delta,
            "accountant": dp.accountant,
            "max_grad_norm": dp.max_grad_norm,
            "noise_multiplier": {c: float(stats[int(c)].get("dp_noise_multiplier", float("nan"))) for c in epsilon},
        }
        result.metrics["dp_sgd_epsilon"] = max(epsilon.values())

    def run_method(self, label: str, resume: bool = False) -> dict[str, Any]:
        """Run the method entry ``label`` of the config; save its model and state; return its summary."""
        spec = next((s for s in self.specs if s.label == label), None)
        if spec is None:
            raise KeyError(f"no method labelled {label!r} in the config")
        # No check here: a run's methods were checked once, before anything started (rayfuse.runner.prepare_run; tests
        # prepare their coordinators the same way)
        server = MethodServer(self, spec, resume=resume)
        started = time.perf_counter()
        self.events.emit("method_start", method=label)
        result: MethodResult = spec.build().run(server)
        seconds = time.perf_counter() - started
        for key, value in server.updates.info().items():  # the pipeline's record (central DP's epsilon...), asked or not
            result.info.setdefault(key, value)
        if self.cfg.train.dp is not None and spec.tags.uses_local_models and not spec.tags.oracle:
            self._add_local_privacy(result)
        bad = {k: v for k, v in result.metrics.items() if not np.isfinite(v)}
        if bad:
            raise NonFiniteError(f"{label}: non-finite final metrics {bad}")
        model_file = None
        if result.params is not None:
            path = self.store.model_file(label)
            from rayfuse.io import params_sha256, save_params

            save_params(path, result.params, {"method": spec.method, "label": label}, max_shard_size=self.store.max_shard_size)
            model_file = str(path.relative_to(self.store.root))
            model_sha256 = params_sha256(path)
        summary = {
            "label": label,
            "method": spec.method,
            "metrics": {k: float(v) for k, v in result.metrics.items()},
            "evaluation": self.cfg.evaluation,
            **({"client_metrics": server.collect_client_table()} if self.cfg.evaluation != "central" else {}),
            "info": result.info,
            "oracle": spec.tags.oracle,
            "history": server.history,
            "seconds": round(seconds, 3),
            "model_file": model_file,
            **({"model_sha256": model_sha256} if model_file else {}),
        }
        self.store.save_method_state(label, summary)
        self.events.emit("method_done", method=label, seconds=round(seconds, 3), metrics=summary["metrics"])
        return summary
