"""Run an experiment end to end: validate, split the data, start the federation, run the methods, report.

The runner is backend-agnostic. A :class:`Backend` starts the clients and the coordinator and forwards calls to the
coordinator: :class:`InProcessBackend` (here, no Ray) or ``actors.RayBackend`` (Ray actors). ``rayfuse.run`` (the
Python API, under the CLI) picks one.

Order of work (each a timed stage in ``results.json``):

1. ``partition`` -- load the dataset in the driver (labels only matter here), check the model fits the data, split
   into roles and partition the pool; write ``config.yaml`` and ``partition.json``. Bad input stops here (exit 2),
   before any cluster work.
2. ``startup`` -- start the clients (each loads its own shard) and the coordinator.
3. ``local_training`` -- when a method needs local models: each client trains its local model once (or reads the
   copy it keeps under ``run.model_cache``; on ``--resume``, the run folder's copy when its own is gone). The client
   is the one owner of its model: the coordinator keeps no copy, asks the clients for the parameters each time a
   method fuses them, checkpoints each in the run folder once, and gives that copy back to a client that lost its
   model (a restarted process) instead of having it train again.
4. one stage per method -- the coordinator runs the method's server loop.
5. ``report`` -- ``metrics.parquet``, ``comparison.png``, the MLflow sink with ``tracking.mlflow``
   (:mod:`rayfuse.tracking`), then ``results.json`` (status, metrics, timings, events; with ``evaluation: federated``
   or ``both``, each method's per-client table, ``client_metrics``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import secrets
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from rayfuse.config import ExperimentConfig, dump_config, validate_config
from rayfuse.data.identity import changed_files, content_data, data_files
from rayfuse.data.roles import DataPlan, load_dataset_from_config, load_target_from_config, make_plan
from rayfuse.errors import InputError, RunFailure
from rayfuse.io import atomic_write_json, atomic_write_text
from rayfuse.method import MethodSpec, RunSetup, resolve_methods, resolved_config, with_public_default
from rayfuse.metrics import METRICS_EVENT
from rayfuse.prestart import StartFacts, check_before_start, check_local_dp
from rayfuse.report import Printer, format_client_summary, format_partition, format_table, plot_comparison, write_metrics_parquet
from rayfuse.store import RunStore, claim_run_folder
from rayfuse.tracking import check_tracking, log_to_mlflow
from rayfuse.version import __version__

if TYPE_CHECKING:
    from rayfuse.coordinator import Coordinator
    from rayfuse.data.silos import SiloPlan

__all__ = [
    "Backend",
    "InProcessBackend",
    "PreparedRun",
    "prepare_run",
    "finish_silo_run",
    "check_local_dp",
    "check_client_models_fit",
    "run_experiment",
    "new_run_dir",
    "check_new_folder",
    "load_run_config",
]

EventSink = Callable[[dict[str, Any]], None]


class Backend(Protocol):
    """What the runner needs of a backend: start and stop the clients and the coordinator, and the coordinator's
    calls, typed, each relaying the coordinator's events to ``on_event`` while it runs. :class:`InProcessBackend`
    and ``actors.RayBackend`` implement it (subclassing it for :meth:`info` and :meth:`check_start`)."""

    name: str

    @abstractmethod
    def start(
        self,
        cfg: ExperimentConfig,
        plan: DataPlan,
        run_dir: Path,
        *,
        on_event: EventSink,
        start_time: float,
        specs: list[MethodSpec] | None = None,
    ) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def survey_silos(self) -> SiloPlan:
        """``Coordinator.survey_silos``: the clients of a silo run report their silos; the completed plan."""

    @abstractmethod
    def prepare_local_models(self, resume: bool = False) -> dict[str, Any]:
        """``Coordinator.prepare_local_models``: each client trains its local model once (or restores it)."""

    @abstractmethod
    def run_method(self, label: str, resume: bool = False) -> dict[str, Any]:
        """``Coordinator.run_method``: the method's server loop; its summary."""

    def info(self) -> dict[str, Any]:
        return {"backend": self.name}

    def check_start(self, cfg: ExperimentConfig) -> None:
        """Raise :class:`InputError` for what this backend can tell cannot start, before the run folder is written
        (an unreachable cluster address, more CPUs than the local Ray will have). Nothing to check by default."""
        return None


class InProcessBackend(Backend):
    """Clients and coordinator as plain objects in this process (``federation.backend: local``; unit tests).

    Each client step and each coordinator call runs with the torch thread count its Ray actor would have
    (:func:`~rayfuse.federation.actor_threads`), so a local rehearsal gives a Ray run's numbers to the last bit.
    """

    name = "local"

    def __init__(self) -> None:
        self.coordinator: Coordinator | None = None
        self.federation: Any = None
        self._coordinator_threads: int | None = None

    def start(
        self,
        cfg: ExperimentConfig,
        plan: DataPlan,
        run_dir: Path,
        *,
        on_event: EventSink,
        start_time: float,
        specs: list[MethodSpec] | None = None,
    ) -> None:
        from rayfuse.client import Client
        from rayfuse.coordinator import Coordinator
        from rayfuse.federation import EventLog, FailurePolicy, InProcessFederation, actor_threads

        events = EventLog(start=start_time)
        events.listeners.append(on_event)
        fed_cfg = cfg.federation

        def make_client(client_id: int, restarted: bool) -> Client:
            # as a Ray actor is (re)built: from the plan it started with; the federation gives a restarted client what
            # the run installed since (a silo plan completed by the survey: Federation.install)
            return Client(
                client_id,
                plan.for_client(client_id),
                data_cfg=cfg.data,
                model_cfg=cfg.client_model(client_id),
                train_cfg=cfg.train,
                seed=cfg.run.seed,
                faults=fed_cfg.faults,
                restarted=restarted,
                local_cache=cfg.run.model_cache,
            )

        def client_threads(client_id: int) -> int | None:
            return actor_threads(fed_cfg.client_resources(client_id).num_cpus)

        self.federation = InProcessFederation(
            make_client,
            plan.num_clients,
            FailurePolicy.from_config(fed_cfg),
            events,
            max_restarts=fed_cfg.max_restarts,
            threads=client_threads,
            clients_per_process=fed_cfg.clients_per_actor,  # per_actor partial sums fold the same groups as on Ray
        )
        self._coordinator_threads = actor_threads(fed_cfg.coordinator.num_cpus)
        self.coordinator = Coordinator(cfg, plan, str(run_dir), self.federation, specs=specs)

    def _running(self) -> Coordinator:
        if self.coordinator is None:
            raise RuntimeError("the backend is not started")
        return self.coordinator

    def survey_silos(self) -> SiloPlan:
        from rayfuse.federation import torch_threads

        with torch_threads(self._coordinator_threads):
            return self._running().survey_silos()

    def prepare_local_models(self, resume: bool = False) -> dict[str, Any]:
        from rayfuse.federation import torch_threads

        with torch_threads(self._coordinator_threads):
            return self._running().prepare_local_models(resume)

    def run_method(self, label: str, resume: bool = False) -> dict[str, Any]:
        from rayfuse.federation import torch_threads

        with torch_threads(self._coordinator_threads):
            return self._running().run_method(label, resume)

    def stop(self) -> None:
        from rayfuse.client import release_kept_models

        self.coordinator = None
        self.federation = None
        release_kept_models()  # the clients' kept models (ClientContext.work_model): this process outlives the run


@dataclass(frozen=True)
class PreparedRun:
    """A run checked and planned, nothing started: the config, the resolved methods, the data plan, the
    :class:`RunSetup` every method's ``check`` accepted, the model's parameter count and each client's (``()`` when
    not known: a silo run before its survey)."""

    cfg: ExperimentConfig
    specs: list[MethodSpec]
    plan: DataPlan
    setup: RunSetup
    num_params: int
    client_params: tuple[int, ...] = ()

    def resolved(self) -> dict[str, Any]:
        return resolved_config(self.cfg, self.specs)

    def describe_models(self) -> str:
        """The header's words for the models: ``model mlp (N parameters)``, and the clients' models when some client has
        one of its own (``federation.client_overrides.<i>.model``)."""
        cfg = self.cfg
        text = f"model {cfg.model.name} ({self.num_params:,} parameters)"
        if not cfg.heterogeneous_clients or not self.client_params:
            return text
        groups: list[tuple[Any, int, list[int]]] = []  # (model, parameters, clients), in order of first client
        for client, (model, count) in enumerate(zip(cfg.client_models(), self.client_params)):
            group = next((g for g in groups if g[0] == model), None)
            if group is None:
                groups.append((model, count, [client]))
            else:
                group[2].append(client)
        clients = "; ".join(f"{_client_ranges(members)} {_model_name(model)} ({count:,})" for model, count, members in groups)
        return f"{text}; client models: {clients}"


def _model_name(model: Any) -> str:
    return f"custom {model.factory}" if model.name == "custom" and model.factory else str(model.name)


def _client_ranges(clients: Sequence[int]) -> str:
    """``client 3``, ``clients 0-2, 5``."""
    parts: list[str] = []
    start = prev = clients[0]
    for c in [*clients[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return f"client{'s' if len(clients) > 1 else ''} {', '.join(parts)}"


def check_client_models_fit(cfg: ExperimentConfig, input_shape: tuple[int, ...], num_classes: int, num_params: int) -> tuple[int, ...]:
    """Each client's model against the data, as :func:`rayfuse.models.registry.check_model_fits` checks the run's
    ``model`` (whose parameter count, ``num_params``, the caller found): each client's parameter count. A client's own
    model (``federation.client_overrides.<i>.model``) that does not fit raises :class:`InputError` at
    ``federation.client_overrides.<i>.model...``."""
    from rayfuse.models.registry import check_model_fits

    check_fresh_models(cfg, input_shape, num_classes)
    counts: list[int] = []
    checked: list[tuple[Any, int]] = [(cfg.model, num_params)]
    for client, model in enumerate(cfg.client_models()):
        known = next((n for m, n in checked if m == model), None)
        if known is None:
            try:
                known = check_model_fits(model, input_shape, num_classes)
            except InputError as exc:
                where = f"federation.client_overrides.{client}."
                raise exc.at(where + exc.path if exc.path.split(".", 1)[0] == "model" else where + "model") from None
            checked.append((model, known))
        counts.append(known)
    return tuple(counts)


def check_fresh_models(cfg: ExperimentConfig, input_shape: tuple[int, ...], num_classes: int) -> None:
    """A model factory given from Python (``rayfuse.run(model=...)``) must build a new model on every call. One that
    returns one shared instance, or models sharing a parameter or persistent buffer, would have every client train (and the server
    overwrite) the same tensors in one process: refused, on every backend alike, before anything starts. It is not
    copied instead: every build is seeded (each client its own initialisation unless ``train.shared_init``), which
    copies of one instance would silently ignore."""
    from rayfuse.models.registry import call_model_factory

    seen: list[Any] = []
    for model in (cfg.model, *cfg.client_models()):
        factory = model.custom_factory
        if factory is None or any(factory is f for f in seen):
            continue
        seen.append(factory)
        name = model.factory or "model"
        first, second = (call_model_factory(factory, input_shape, num_classes, where=name) for _ in range(2))
        # the tensors a run trains and loads (parameters, persistent buffers); a constant non-persistent buffer (a
        # shared lookup table) is never written, so sharing it is harmless
        tensors = {id(t) for t in first.state_dict(keep_vars=True).values()}
        if first is second or any(id(t) in tensors for t in second.state_dict(keep_vars=True).values()):
            shared = "the same instance" if first is second else "models sharing tensors"
            raise InputError(
                "model",
                "a factory that builds a new nn.Module on every call (each client trains its own)",
                name,
                f"it returned {shared} twice: construct the module inside it (model=Net, or lambda: Net())",
            )


def prepare_run(cfg: ExperimentConfig, *, methods: Mapping[str, Any] | None = None) -> PreparedRun:
    """Every check that needs no actor: the methods' parameters, the model against the data, the data split, and
    each method's :meth:`~rayfuse.method.Method.check` against the run. Raises :class:`InputError`.

    ``rayfuse validate``, ``rayfuse tune --check`` and ``rayfuse run`` all call this before anything starts. The
    dataset is loaded here in the driver (its labels decide the split; bundled datasets load in well under a second).
    """
    from rayfuse.models.hf import check_model_data
    from rayfuse.models.registry import check_model_fits

    specs = resolve_methods(cfg.methods, methods)
    cfg = with_public_default(cfg, specs)  # the quickstart's public sample only where a method reads one
    cfg = _text_run(cfg)  # text data: the model, and the tokenizer and max_length every reader of a text source uses
    check_tracking(cfg)  # a sink the config asks for (tracking.mlflow) must be installed
    if cfg.data.is_silos:
        return _prepare_silo_run(cfg, specs)
    dataset = load_dataset_from_config(cfg.data)
    try:
        num_params = check_model_fits(cfg.model, dataset.input_shape, dataset.num_classes)
    except InputError as exc:
        cfg, dataset, num_params = _as_sequences(cfg, dataset, exc)
    check_model_data(cfg.model, dataset.X, dataset.X_test)  # a Hugging Face model's data: token ids below its vocab_size
    client_params = check_client_models_fit(cfg, tuple(dataset.input_shape), dataset.num_classes, num_params)
    target = load_target_from_config(cfg.data)
    plan = make_plan(dataset, cfg.data, cfg.partition, cfg.run.seed, target=target)
    setup = RunSetup.from_plan(cfg, plan)
    check_before_start(StartFacts(cfg, specs, setup, num_params, tuple(client_params)))
    return PreparedRun(cfg, specs, plan, setup, num_params, client_params)


def _text_run(cfg: ExperimentConfig) -> ExperimentConfig:
    """A run of text data: its model is a Hugging Face classifier (its forward masks the -1 padding; ``hf:<folder>``, or
    :func:`rayfuse.models.hf.hf_model` given from Python), and the copy it runs with states its tokenizer and
    ``max_length`` (:meth:`ExperimentConfig.with_text_encoding`), the tokenizer read here, before any site tokenises.
    ``cfg`` itself for other data."""
    from rayfuse.data.text import text_tokenizer
    from rayfuse.models.hf import hf_factory

    if not cfg.data.uses_text:
        return cfg
    if hf_factory(cfg.model) is None:
        raise InputError(
            "model.name",
            "a Hugging Face classifier for text data (hf:<folder>, or rayfuse.models.hf.hf_model(folder) from Python)",
            cfg.model.factory or cfg.model.name,
        )
    cfg = cfg.with_text_encoding()
    assert cfg.data.tokenizer is not None  # ExperimentConfig.with_text_encoding
    text_tokenizer(cfg.data.tokenizer)  # a folder without a tokenizer (or one transformers cannot read): refused here
    return cfg


def _as_sequences(cfg: ExperimentConfig, dataset: Any, refusal: InputError) -> tuple[ExperimentConfig, Any, int]:
    """The data read as sequences when the model refused it as images: with ``data.layout: auto`` a 3-d array
    ``(N, A, B)`` is read as grey images ``(N, 1, A, B)``; a model that takes ``(A, B)`` (a Conv1d's channels and
    length, a sequence model's steps and features) and not the image runs with ``data.layout: sequence``, which the
    run's config then says. Else ``refusal``, naming that setting where it could apply. Returns ``(cfg, dataset,
    number of parameters)``."""
    from rayfuse.data.datasets import arrays_digest
    from rayfuse.models.registry import check_model_fits

    if cfg.data.layout != "auto" or not dataset.grey_axis_added:
        raise refusal
    data = cfg.data.model_copy(update={"layout": "sequence"})
    if cfg.data.arrays is not None:  # arrays from Python: the same values, as given
        stored = dataclasses.replace(
            dataset, X=dataset.X[:, 0], X_test=None if dataset.X_test is None else dataset.X_test[:, 0], grey_axis_added=False
        )
        data = data.with_arrays(stored, arrays_digest(stored))
    sequences = load_dataset_from_config(data)
    try:
        num_params = check_model_fits(cfg.model, sequences.input_shape, sequences.num_classes)
    except InputError:
        hint = f"data.layout: sequence reads the (N, {', '.join(map(str, sequences.input_shape))}) array as it is, not as grey images"
        raise InputError(refusal.path, refusal.expected, refusal.got, f"{refusal.hint}; {hint}" if refusal.hint else hint) from None
    return cfg.model_copy(update={"data": data}), sequences, num_params


def _prepare_silo_run(cfg: ExperimentConfig, specs: list[MethodSpec]) -> PreparedRun:
    """A silo config before its clients report: nothing of the silos is read here (the driver cannot). The checks that
    need the data (the model against the input shape, each method against the run) follow the silo survey
    (:func:`finish_silo_run`); the server's own sets (``data.test``, ``data.public``) are read here, on the server's
    node, for their sizes; a method that needs a public sample without ``data.public`` (or a test set without
    ``data.test``) is refused now, and so is every run the methods' tags refuse (:func:`rayfuse.prestart.check_tags`:
    a method that needs the whole dataset, reads the public sample's labels when ``data.public`` has none, or scores
    on the server's data in its own way with ``evaluation`` federated or both...)."""
    from rayfuse.data.silos import make_silo_plan, server_set_size, text_encoding

    sizes = {
        key: 0
        if getattr(cfg.data, key) is None
        else server_set_size(getattr(cfg.data, key), key=f"data.{key}", classes=cfg.data.class_names, text=text_encoding(cfg.data))
        for key in ("test", "public")
    }
    plan = make_silo_plan(cfg, test_size=sizes["test"], public_size=sizes["public"])
    # what is knowable before any client starts: the silos' shapes, label counts and sizes are not (None in the setup,
    # and every check skips what is None); the checks run again with them once the clients report (finish_silo_run)
    setup = RunSetup(
        model=cfg.model,
        train=cfg.train,
        data=cfg.data,
        num_clients=plan.num_clients,
        input_shape=None,
        num_classes=None,
        train_sizes=None,
        val_sizes=None,
        public_size=sizes["public"],
        test_size=sizes["test"],
        seed=cfg.run.seed,
        model_cache=cfg.run.model_cache,
        evaluation=str(cfg.evaluation),
        client_models=cfg.client_models(),
        public_labeled=plan.public_labeled,
    )
    # the same table as a simulation's, what is not known yet None (each rule skips it); again after the survey
    check_before_start(StartFacts(cfg, specs, setup, None, None))
    return PreparedRun(cfg, specs, plan, setup, 0)  # type: ignore[arg-type]


def finish_silo_run(prepared: PreparedRun, plan: Any) -> PreparedRun:
    """The checks of :func:`prepare_run` that a silo config can make only once its clients reported (``plan``, the
    surveyed :class:`rayfuse.data.silos.SiloPlan`): the model against the silos' input shape and label count, each
    method against the run, the coordinator's memory for what each method gathers. Raises :class:`InputError`;
    nothing has trained yet."""
    from rayfuse.models.registry import check_model_fits

    cfg, specs = prepared.cfg, prepared.specs
    num_params = check_model_fits(cfg.model, plan.input_shape, plan.num_classes)
    client_params = check_client_models_fit(cfg, tuple(plan.input_shape), plan.num_classes, num_params)
    setup = RunSetup.from_plan(cfg, plan)
    check_before_start(StartFacts(cfg, specs, setup, num_params, tuple(client_params)))  # the table again, all known
    return PreparedRun(cfg, specs, plan, setup, num_params, client_params)


def new_run_dir(cfg: ExperimentConfig, out: str | Path | None = None, *, key: str = "--out") -> Path:
    """The folder for a new run: ``out`` if given (must be new or empty), else ``<run.storage>/<name>-<time>-<id>``.

    ``key`` names ``out`` in the error (``--out`` on the command line, ``run_dir`` in ``rayfuse.run``).
    """
    if out is not None:
        return check_new_folder(out, key=key)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.storage) / f"{cfg.run.name}-{stamp}-{secrets.token_hex(2)}"


def check_new_folder(out: str | Path, *, key: str = "--out") -> Path:
    """``out`` as a path if it is a new or an empty folder; else :class:`InputError` at ``key``."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        hint = "pick another folder, or continue that run with --resume" if key == "--out" else "pick another folder"
        raise InputError(key, "a new or empty folder", str(path), hint)
    return path


def _check_config_hash(store: RunStore) -> None:
    """``config.yaml`` against the SHA-256 ``partition.json`` records for it (runs of older versions record none). A
    damaged ``partition.json`` is left to the partition check, which names it."""
    try:
        recorded = json.loads(store.partition_file.read_text(encoding="utf-8")).get("config_sha256")
        found = hashlib.sha256(store.config_file.read_bytes()).hexdigest()
    except (OSError, ValueError, RecursionError, AttributeError):
        return
    if isinstance(recorded, str) and recorded != found:
        raise InputError(
            str(store.config_file),
            "the run's resolved config as rayfuse wrote it",
            "a file whose SHA-256 differs from the one partition.json records (truncated or edited)",
            "restore it from results.json's config, or start a new run",
        )


def load_run_config(run_dir: str | Path, overrides: Sequence[tuple[list[str], Any]] = ()) -> ExperimentConfig:
    """The config of an earlier run (for ``--resume``); only ``federation.*`` keys may be overridden."""
    from rayfuse.config import apply_overrides

    store = RunStore(run_dir)
    if not store.config_file.is_file():
        raise InputError("--resume", "a run folder with config.yaml", str(run_dir))
    for parts, _ in overrides:
        if parts[0] != "federation":
            raise InputError(
                "--set " + ".".join(parts),
                "only federation.* keys when resuming (the experiment itself is fixed)",
                "a change to the experiment",
            )
    try:
        data = yaml.safe_load(store.config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise InputError(
            str(store.config_file),
            "the run's resolved config (UTF-8 YAML)",
            f"a damaged file ({type(exc).__name__})",
            "restore it from results.json's config, or start a new run",
        ) from None
    if not isinstance(data, dict):
        raise InputError(
            str(store.config_file),
            "the run's resolved config (a YAML mapping)",
            f"a damaged file ({type(data).__name__})",
            "restore it from results.json's config, or start a new run",
        )
    try:
        cfg = validate_config(apply_overrides(data, list(overrides)))
    except InputError as exc:
        if any(exc.path.startswith(".".join(parts)) for parts, _ in overrides):
            raise  # the error is in an override (--set), not in the file
        raise exc.at(f"{store.config_file}: {exc.path}") from None
    _check_config_hash(store)  # a valid config that is not the one written (cut at a line end, edited)
    # the run's model, then the clients' own (federation.client_overrides.<i>.model): a model given from Python is a
    # factory no config file holds
    models = [
        ("model", cfg.model),
        *(
            (f"federation.client_overrides.{c}.model", o.model)
            for c, o in sorted(cfg.federation.client_overrides.items())
            if o.model is not None
        ),
    ]
    custom = next((f"{key}.name: custom ({model.factory})" for key, model in models if model.name == "custom"), None)
    if custom is not None or cfg.data.dataset == "arrays":
        given = custom or "data.dataset: arrays"
        raise InputError(
            "--resume",
            "a run whose model and data a config file describes",
            given,
            "a run given a Python model or arrays (rayfuse.run) cannot be resumed from the command line",
        )
    return cfg


def run_experiment(
    cfg: ExperimentConfig | PreparedRun,
    backend: Backend,
    run_dir: str | Path,
    *,
    resume: bool = False,
    printer: Callable[[dict[str, Any]], None] | None = None,
    show_tables: bool = True,
) -> dict[str, Any]:
    """Run ``cfg`` (or a run already prepared by :func:`prepare_run`) on ``backend``; write the run folder; return
    the content of ``results.json``.

    Raises :class:`InputError` for bad input (before any client starts) and :class:`RunFailure` when the run cannot
    go on (after writing ``results.json`` with ``status: failed`` and the methods that finished).

    The stages, each a function: :func:`_check_before_start` (the checks, the silo survey), then inside the folder's
    claim :func:`_write_run_folder` (config, manifest, identity) and :func:`_print_header`, :func:`_run_stages`
    (:func:`_start_federation`, :func:`_local_models`, :func:`_run_method` for each method) and :func:`_report`.
    """
    run = _Run(run_dir, printer or Printer(), show_tables, resume)
    # 1. partition (driver side; nothing has started yet, bad input exits with code 2 here)
    t0 = time.perf_counter()
    prepared = cfg if isinstance(cfg, PreparedRun) else prepare_run(cfg)
    run.resolved = prepared.resolved()
    backend.check_start(prepared.cfg)  # before the run folder is written
    prepared, files, changed = _check_before_start(run, prepared, backend)
    with claim_run_folder(run.dir, resume=resume):  # released at the end; a second run of this folder is refused
        resume_state = _write_run_folder(run, prepared, files, changed)
        run.timings["partition"] = round(time.perf_counter() - t0, 3)
        _print_header(run, prepared)
        run.emit("stage_end", stage="partition", seconds=run.timings["partition"])
        summaries, error, backend_info = _run_stages(run, prepared, backend, resume_state)
        return _report(run, prepared, summaries, error, backend_info)


class _Run:
    """One :func:`run_experiment` call's bookkeeping: the run folder, the events ``results.json`` keeps, the stage
    timings, the printer."""

    def __init__(self, run_dir: str | Path, printer: Callable[[dict[str, Any]], None], show_tables: bool, resume: bool) -> None:
        self.start = time.time()
        self.started_at = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        self.printer = printer
        self.show_tables = show_tables
        self.resume = resume
        self.dir = Path(run_dir)
        self.store = RunStore(self.dir)
        self.events: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}
        self.resolved: dict[str, Any] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") != METRICS_EVENT:  # the metrics channel's rows are metrics.parquet's, not results.json's events
            self.events.append(event)
        self.printer(event)

    def emit(self, kind: str, message: str = "", **fields: Any) -> None:
        self.on_event({"t": round(time.time() - self.start, 3), "kind": kind, **({"message": message} if message else {}), **fields})

    def say(self, text: str, always: bool = False) -> None:
        if self.show_tables and (always or getattr(self.printer, "enabled", True)):
            stream = getattr(self.printer, "stream", None)
            print(text, file=stream, flush=True)


def _check_before_start(run: _Run, prepared: PreparedRun, backend: Backend) -> tuple[PreparedRun, dict[str, Any], list[Any]]:
    """Before the run folder is claimed: on ``--resume``, the folder's config, data files and split against this run;
    a silo run's survey (its clients start first: only they read their silos). Returns the run (a silo run's plan
    completed by the survey), its data files by content and the data files / silos changed since the folder's state."""
    store, plan = run.store, prepared.plan
    # the files the run's data comes from, by content (rayfuse.data.identity): recorded in identity.json; on --resume,
    # another config than the folder's is refused and a file regenerated since its state was written is recomputed
    files = data_files(run.resolved["data"])
    changed = _check_resume_state(store, run.resolved, files) if run.resume else []
    # the folder's partition manifest is read before anything starts (a missing or damaged one is refused here)
    manifest = _read_manifest(store) if run.resume else None
    if prepared.cfg.data.is_silos:  # the clients start first: only they read their silos; their reports complete the plan
        try:
            backend.start(prepared.cfg, plan, run.dir, on_event=run.on_event, start_time=run.start, specs=prepared.specs)
            prepared = finish_silo_run(prepared, backend.survey_silos())
            plan = prepared.plan
            if manifest is not None:
                # a silo regenerated in place: its client reported another content hash than the folder records (the
                # run is computed again); a split that differs otherwise is refused here, after the survey (only the
                # clients can read their silos) and before any client trains, and the started actors are stopped
                changed += _changed_silos(manifest, plan)
                _check_same_split(store, manifest, plan, changed, files)
        except BaseException:
            backend.stop()
            raise
    elif manifest is not None:
        _check_same_split(store, manifest, plan, changed, files)
    return prepared, files, changed


def _write_run_folder(run: _Run, prepared: PreparedRun, files: dict[str, Any], changed: list[Any]) -> bool:
    """Inside the folder's claim: drop state computed from data that changed since (with a warning per file), then
    write ``config.yaml``, ``partition.json`` and ``identity.json``. Returns whether the folder's state is resumed."""
    store = run.store
    fresh = bool(changed)  # state computed from other data: none of it is read, and it is removed (inside the claim)
    for key, path, before, now in changed:
        run.emit(
            "warning",
            f"{key} ({path}): content changed since the run folder's state was computed (SHA-256 {before[:12]} -> "
            f"{now[:12]}); every method and local model is computed again, nothing of the old state is kept",
        )
    if fresh:
        _discard_state(store)
    config_text = dump_config(run.resolved)
    atomic_write_text(store.config_file, config_text)
    # the config's hash beside the split's: a resume can tell a damaged config.yaml that still parses (a cut at a line end)
    atomic_write_json(
        store.partition_file, {**prepared.plan.manifest(), "config_sha256": hashlib.sha256(config_text.encode("utf-8")).hexdigest()}
    )
    atomic_write_json(store.root / IDENTITY_FILE, {"format": 1, "config": _state_digest(run.resolved), "data_files": files})
    return run.resume and not fresh


def _print_header(run: _Run, prepared: PreparedRun) -> None:
    """The run's first lines: where it goes, the data and models, the partition's table."""
    cfg, plan = prepared.cfg, prepared.plan
    run.say(f"rayfuse {__version__}: run {cfg.run.name!r} -> {run.dir}{'  (resumed)' if run.resume else ''}")
    target_note = f" (target task: {plan.target}, {len(plan.public)} public / {len(plan.test)} test)" if plan.target else ""
    run.say(
        f"data: {plan.dataset}{target_note}, {plan.num_classes} classes, input {plan.input_shape}; {prepared.describe_models()}; "
        f"partition {plan.partition['method']} into {plan.num_clients} clients (hash {plan.digest()[:12]})"
    )
    if plan.num_clients <= 32:
        run.say(format_partition(plan.counts, plan.class_names, [len(v) for v in plan.client_val]))


def _run_stages(
    run: _Run, prepared: PreparedRun, backend: Backend, resume_state: bool
) -> tuple[dict[str, dict[str, Any]], str | None, dict[str, Any]]:
    """Start the federation, the local models, each method; the backend is stopped at the end, whatever happened.
    Returns the methods' summaries, the error of a run that failed (``None``: it succeeded) and the backend's info."""
    summaries: dict[str, dict[str, Any]] = {}
    error: str | None = None
    try:
        _start_federation(run, prepared, backend)
        specs = prepared.specs
        finished = {s.label: run.store.load_method_state(s.label, warn=_warner(run.emit, s.label)) for s in specs} if resume_state else {}
        _local_models(run, [s for s in specs if finished.get(s.label) is None], backend, resume_state)
        for spec in specs:
            saved = finished.get(spec.label)
            if saved is not None:
                summaries[spec.label] = saved
                run.emit("info", f"{spec.label}: finished in the original run; loaded from state/", method=spec.label)
                continue
            summaries[spec.label] = _run_method(run, spec, backend, resume_state)
    except RunFailure as exc:
        error = str(exc)
        run.emit("run_failed", str(exc))
    finally:
        backend_info = backend.info()
        backend.stop()
    return summaries, error, backend_info


def _start_federation(run: _Run, prepared: PreparedRun, backend: Backend) -> None:
    """2. ``startup``: the clients and the coordinator (a silo run's started for its survey already)."""
    t0 = time.perf_counter()
    if not prepared.cfg.data.is_silos:
        backend.start(prepared.cfg, prepared.plan, run.dir, on_event=run.on_event, start_time=run.start, specs=prepared.specs)
    run.timings["startup"] = round(time.perf_counter() - t0, 3)
    run.emit("stage_end", stage="startup", seconds=run.timings["startup"])


def _local_models(run: _Run, pending: Sequence[MethodSpec], backend: Backend, resume_state: bool) -> None:
    """3. ``local_training``, when a method still to run needs local models."""
    if any(s.tags.uses_local_models for s in pending):
        t0 = time.perf_counter()
        backend.prepare_local_models(resume_state)
        run.timings["local_training"] = round(time.perf_counter() - t0, 3)


def _run_method(run: _Run, spec: MethodSpec, backend: Backend, resume_state: bool) -> dict[str, Any]:
    """4. one method's server loop on the coordinator: its summary."""
    t0 = time.perf_counter()
    summary = backend.run_method(spec.label, resume_state)
    run.timings[f"method/{spec.label}"] = round(time.perf_counter() - t0, 3)
    return summary


def _report(
    run: _Run, prepared: PreparedRun, summaries: dict[str, dict[str, Any]], error: str | None, backend_info: dict[str, Any]
) -> dict[str, Any]:
    """5. ``report``: ``metrics.parquet``, ``comparison.png``, the MLflow sink, ``results.json`` and the table.
    Raises :class:`RunFailure` after writing them when the run failed (``error``)."""
    cfg, plan, store = prepared.cfg, prepared.plan, run.store
    status = "succeeded" if error is None else "failed"
    t0 = time.perf_counter()
    methods = {label: _method_entry(s) for label, s in summaries.items()}
    if summaries:
        write_metrics_parquet(store.metrics_file, list(summaries.values()))
        plot_comparison(
            store.plot_file,
            methods,
            list(summaries.values()),
            title=f"{plan.dataset}, {plan.num_clients} clients",
            evaluation=cfg.evaluation,
        )
    tracked = None
    if cfg.tracking.mlflow is not None and summaries:  # after the files it logs (the models, comparison.png)
        tracked = log_to_mlflow(
            cfg.tracking.mlflow,
            cfg=cfg,
            run_dir=run.dir,
            resolved=run.resolved,
            summaries=list(summaries.values()),
            warn=lambda message: run.emit("warning", message),
        )
    timings = run.timings
    timings["report"] = round(time.perf_counter() - t0, 3)
    timings["total"] = round(time.time() - run.start, 3)
    results = {
        "status": status,
        "error": error,
        "rayfuse_version": __version__,
        "run": {
            "name": cfg.run.name,
            "dir": str(run.dir),
            "started_at": run.started_at,
            "finished_at": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "seconds": timings["total"],
            "resumed": run.resume,
            **backend_info,
        },
        "config": run.resolved,
        "evaluation": cfg.evaluation,
        "partition": {
            "hash": plan.digest(),
            "dataset": plan.dataset,
            **plan.partition,
            "num_train": [len(t) for t in plan.client_train],
            "num_val": [len(v) for v in plan.client_val],
            "class_counts": plan.counts.tolist(),
            "test_size": int(len(plan.test)),
            "public_size": int(len(plan.public)),
            "unassigned": plan.unassigned,
        },
        **({"attacks": [a.model_dump(mode="json", exclude_none=True) for a in cfg.federation.attacks]} if cfg.federation.attacks else {}),
        "methods": methods,
        **({"tracking": {"mlflow": tracked}} if cfg.tracking.mlflow is not None else {}),
        "timings": timings,
        "events": run.events,
        "files": {
            "config": "config.yaml",
            "partition": "partition.json",
            "metrics": "metrics.parquet" if summaries else None,
            "plot": "comparison.png" if summaries else None,
            "models": {label: s["model_file"] for label, s in summaries.items() if s.get("model_file")},
        },
    }
    atomic_write_json(store.results_file, results)
    if methods:
        run.say("\n" + format_table(methods), always=True)
        if cfg.evaluation != "central":
            run.say(format_client_summary(methods, cfg.evaluation), always=True)
    run.say(f"\nresults: {store.results_file}", always=True)
    if error is not None:
        raise RunFailure(error or "run failed")
    return results


#: the ``federation`` keys a run folder's state depends on: the clients' own models and the attacks change what is
#: computed; the rest is how the run is run (backend, resources, failure policy, injected faults: what ``--resume``
#: may change with --set)
_STATE_FEDERATION = ("client_overrides", "attacks")


def state_config(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a resolved config a run folder's state is computed from, as plain data: the config without where
    runs, caches and tracked results go (``run.storage``, ``run.model_cache``: the cache is keyed by content;
    ``tracking``), the run's name and the
    ``federation`` keys but :data:`_STATE_FEDERATION`, with data file names left out (:func:`rayfuse.data.identity.content_data`; their content is
    compared on its own, so a renamed copy of a file is the same data)."""
    out = {k: v for k, v in resolved.items() if k not in ("run", "federation", "tracking")}  # tracking: where results also go
    out["run"] = {k: v for k, v in dict(resolved.get("run") or {}).items() if k not in ("name", "storage", "model_cache")}
    federation = dict(resolved.get("federation") or {})
    out["federation"] = {k: federation.get(k) for k in _STATE_FEDERATION}
    if isinstance(resolved.get("data"), Mapping):
        out["data"] = content_data(resolved["data"], unnamed=True)
    return out


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """The key path of the first leaf where ``a`` and ``b`` (plain data) differ (``""``: the roots)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b or _canonical(a[key]) != _canonical(b[key]):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
    return path


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


#: ``<run>/identity.json``: what the folder's state was computed from (written with config.yaml, before any state):
#: ``config``, the SHA-256 of :func:`state_config`, and ``data_files``, the data files by content (:func:`data_files`)
IDENTITY_FILE = "identity.json"


def _state_digest(resolved: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(state_config(resolved)).encode("utf-8")).hexdigest()


def _check_resume_state(
    store: RunStore, resolved: Mapping[str, Any], files: Mapping[str, Mapping[str, str]]
) -> list[tuple[str, str, str, str]]:
    """On ``--resume``: refuse a config other than the one the folder's state was computed with (one line naming the
    first key that differs from the folder's ``config.yaml``, or naming ``identity.json`` when ``config.yaml`` itself
    was replaced by another run's). Resuming on another run's state would mix two experiments and starting over would
    overwrite that run's results, so a refusal is the safe choice. Returns the data files whose content changed since
    ``identity.json`` recorded them (the run is then computed again, with a warning for each). A folder written before
    ``identity.json`` existed is compared with its ``config.yaml`` only."""
    try:
        written = yaml.safe_load(store.config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        written = None  # no or a damaged config.yaml: load_run_config says so for the command line; nothing to compare
    hint = "resume a run with its own config.yaml (rayfuse run --resume RUN_DIR), or start a new run in a new folder"
    if isinstance(written, Mapping):
        before, now = state_config(_read_back(written)), state_config(resolved)
        if _canonical(before) != _canonical(now):
            raise InputError(
                "--resume",
                f"the config the run folder's state was computed with ({store.config_file})",
                f"another config (it differs at {_first_difference(before, now) or 'the config'})",
                hint,
            )
    file = store.root / IDENTITY_FILE
    try:
        identity = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []  # a folder of an earlier version: its config.yaml was compared above, its data cannot be
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the parser's depth
        raise InputError(
            str(file),
            "what the run folder's state was computed from (JSON)",
            f"a damaged file ({type(exc).__name__})",
            "the state cannot be matched to its config and data; start a new run",
        ) from None
    if (
        not isinstance(identity, Mapping)
        or not isinstance(identity.get("config"), str)
        or not isinstance(identity.get("data_files"), Mapping)
    ):
        raise InputError(
            str(file),
            "what the run folder's state was computed from (config, data_files)",
            "a damaged file",
            "the state cannot be matched to its config and data; start a new run",
        )
    # the state's config is config.yaml as written (a dump of an earlier version lists fewer defaults) and, read back,
    # the config resumed
    if identity["config"] not in (_state_digest(resolved), _state_digest(written) if isinstance(written, Mapping) else None):
        raise InputError(
            "--resume",
            f"the config the run folder's state was computed with ({file})",
            f"another config ({store.config_file.name} is not the config of the state beside it)",
            hint,
        )
    return changed_files(identity["data_files"], files)


def _read_back(written: Mapping[str, Any]) -> Mapping[str, Any]:
    """A run folder's ``config.yaml`` as this version resolves it (every default filled in), to compare with the config
    resumed: a folder written by an earlier version, whose dump left some defaults out, is the same config. As written
    when it does not validate (the comparison then names the first difference)."""
    try:
        return resolved_config(validate_config(dict(written)))
    except InputError:
        return written


def _read_manifest(store: RunStore) -> dict[str, Any]:
    """On ``--resume``: the run folder's ``partition.json`` (a JSON object with the split's ``hash``), read before any
    client starts. Raises :class:`InputError` when it is missing or damaged (the split cannot be checked)."""
    if not store.partition_file.is_file():
        raise InputError("--resume", "a run folder with partition.json", str(store.root))
    try:
        manifest = json.loads(store.partition_file.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        if not isinstance(manifest["hash"], str):
            raise ValueError("hash is not a string")
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise InputError(
            str(store.partition_file),
            "the run's partition manifest (JSON with its hash)",
            f"a damaged file ({type(exc).__name__})",
            "the split cannot be checked; start a new run",
        ) from None
    return manifest


def _check_same_split(
    store: RunStore, manifest: Mapping[str, Any], plan: Any, changed: Sequence[object], files: Mapping[str, Mapping[str, str]]
) -> None:
    """On ``--resume``: the split's hash against the one ``manifest`` (the folder's ``partition.json``) records. A
    changed data file (``changed``: the whole state is computed again) is not refused; a split that differs otherwise
    (a silo run whose folder records no content hash per silo, a split of other data) is: :class:`InputError`."""
    from rayfuse.data.silos import SiloPlan

    stored = manifest["hash"]
    if (
        stored != plan.digest()
        and not changed
        and files
        and (store.root / IDENTITY_FILE).is_file()
        and isinstance(manifest.get("dataset"), str)
        and isinstance(plan, DataPlan)
    ):
        # a data file renamed with its content unchanged (identity.json): the split's hash names the dataset by
        # its file's stem; the same split of the same content under the old name is the same split
        if replace(plan, dataset=manifest["dataset"]).digest() == stored:
            stored = plan.digest()
    if stored != plan.digest() and not changed:  # (a changed file: the whole state is computed again)
        hint = (
            "the silos' data differs from what the run folder's partition.json records, and it names no content hash per "
            "silo to tell which; start a new run"
            if isinstance(plan, SiloPlan)
            else "did the dataset files change?"
        )
        raise InputError("--resume", "the same data split as the original run", "a different partition hash", hint)


def _changed_silos(manifest: Mapping[str, Any], plan: Any) -> list[tuple[str, str, str, str]]:
    """The silos whose content hash (the survey's, :func:`rayfuse.data.silos.silo_schema`) differs from the one the
    run folder's ``partition.json`` (``manifest``) records: ``(key, where, before, now)`` each, like
    :func:`rayfuse.data.identity.changed_files`. A manifest without per-client records: none (the split check decides)."""
    try:
        clients = manifest["clients"]
        recorded = [c.get("content_hash") if isinstance(c, dict) else None for c in clients]
    except (KeyError, TypeError, AttributeError):
        return []
    out = []
    for i, (silo, schema) in enumerate(zip(plan.silos, plan.schemas)):
        before, now = (recorded[i] if i < len(recorded) else None), str(schema["content_hash"])
        if isinstance(before, str) and before != now:
            out.append((f"data.silos.{i}.path", f"client {i}: {silo.path}", before, now))
    return out


def _discard_state(store: RunStore) -> None:
    """Remove what a run folder holds that was computed from its data (finished methods, checkpoints, fused models,
    the report): none of it may be read with other data. ``config.yaml`` and ``partition.json`` are rewritten next."""
    import shutil

    for folder in ("state", "checkpoints", "models"):
        shutil.rmtree(store.root / folder, ignore_errors=True)
    for file in (store.results_file, store.metrics_file, store.plot_file):
        file.unlink(missing_ok=True)


def _warner(emit: Callable[..., None], label: str) -> Callable[[str], None]:
    """A ``warn`` callback emitting a ``warning`` event of method ``label``."""

    def warn(message: str) -> None:
        emit("warning", message, method=label)

    return warn


def _method_entry(summary: dict[str, Any]) -> dict[str, Any]:
    info = dict(summary.get("info") or {})
    entry: dict[str, Any] = {"method": summary["method"], **summary["metrics"], "oracle": bool(summary.get("oracle"))}
    if "rounds" in info:
        entry["rounds"] = info["rounds"]
    if "note" in info:
        entry["note"] = info["note"]
    if isinstance(info.get("dp"), dict) and "epsilon" in info["dp"]:  # central DP-FedAvg: the privacy spent in total
        entry["epsilon"], entry["delta"] = info["dp"]["epsilon"], info["dp"]["delta"]
        if "stopped" in info["dp"]:
            entry["note"] = "; ".join(n for n in (entry.get("note"), info["dp"]["stopped"]) if n)
    entry["seconds"] = summary.get("seconds")
    entry["model_file"] = summary.get("model_file")
    entry["evaluation"] = summary.get("evaluation", "central")  # which evaluation produced the metrics (rayfuse.evaluation)
    if "client_metrics" in summary:
        entry["client_metrics"] = summary["client_metrics"]  # the per-client table of the last federated evaluation
    entry["info"] = info
    return entry
