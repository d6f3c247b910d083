"""``RayBackend``: runs a rayfuse experiment on Ray.

* Ray: reuses an initialised Ray; otherwise ``ray.init(address)`` with ``federation.address`` / ``RAY_ADDRESS``
  (inside ``ray job submit`` the job's cluster), or starts a local Ray with ``federation.ray_init``, bound to the
  loopback interface (:func:`loopback_node`). It disconnects at the end and never stops a cluster it did not start
  (``ray.shutdown()`` only stops a Ray this process started).
* Clients: one named ``ClientActor`` per client (``<run>/client-<i>`` in ``federation.namespace``) with its own
  resources (``federation.clients``, overridden per client by ``federation.client_overrides``), ``max_restarts``
  and no automatic task retries (the failure policy decides). With ``federation.clients_per_actor = k > 1`` (a
  simulation mode) each actor hosts k consecutive clients and is named ``<run>/clients-<i>-<j>``.
* Coordinator: a named ``CoordinatorActor`` (``<run>/coordinator``) pinned to the driver's node, given the client
  handles. The driver only calls it and polls its events; parameters never travel through the driver.
* Objects given from Python (``rayfuse.run(model=..., methods=...)``) travel to the actors by value: classes and
  functions of ``__main__`` always do (cloudpickle); those of the modules named in ``pickle_by_value`` (a script's or a
  test's own module, which a worker might not import) are registered for by-value pickling while the actors start.
* Gang scheduling (a Ray Tune trial, ``actors.tune``): given a placement group, the coordinator goes into bundle 0
  (the trial's own bundle, on the driver's node) and client actor ``k`` into bundle ``k + 1``, with the bundle's CPUs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.client import ClientActor, actor_name
from actors.coordinator import CoordinatorActor
from rayfuse.config import ExperimentConfig, ResourcesConfig
from rayfuse.data.roles import DataPlan
from rayfuse.errors import InputError, RunFailure
from rayfuse.method import MethodSpec
from rayfuse.runner import Backend, EventSink

__all__ = ["RayBackend", "actor_options", "client_bundles", "merged_resources", "pickled_by_value", "trial_bundles"]

POLL_S = 0.25


def recorded_local_address() -> str | None:
    """The address ``ray.init()`` without one attaches to (``RAY_ADDRESS``, else the last ``ray start`` on this
    machine); ``None`` when there is none (``ray.init()`` then starts a new local Ray) or Ray's lookup is not there."""
    try:
        from ray._private.services import get_ray_address_from_environment  # Ray's own lookup (not a public API)

        # Ray annotates addr as str; None (no address given) is what its own ray.init passes
        return get_ray_address_from_environment(None, None) or None  # type: ignore[arg-type]
    except Exception:  # another Ray version: let ray.init() decide
        return None


@contextlib.contextmanager
def loopback_node(enabled: bool = True) -> Iterator[None]:
    """Within the block, a Ray that ``ray.init`` starts takes 127.0.0.1 as its node address, so its processes (GCS,
    raylet and object manager, workers, dashboard agent, metrics export, runtime-env agent, autoscaler monitor) listen
    on the loopback interface only.

    This is Ray's own single-machine mode (the one it uses on Windows and macOS, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
    = 0): ``ray.init`` has no argument for it (it turns ``_node_ip_address="127.0.0.1"`` into the machine's address).
    Only for a Ray this process starts: a driver attaching to a running cluster must keep the cluster's address.
    Another Ray version without that switch: the block runs unchanged.
    """
    try:
        from ray._private import ray_constants  # not a public API
    except ImportError:
        enabled = False
    if not enabled or not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def stale_local_address() -> str | None:
    """The address ``ray.init()`` would attach to (the last ``ray start`` on this machine) if that cluster is gone.

    Ray keeps that address in a file and, without an address, attaches to it; when the cluster died without
    ``ray stop`` the file stays behind and ``ray.init()`` retries the dead address forever. Returns ``None`` when
    there is no such address or it answers.
    """
    address = recorded_local_address()
    if not address:
        return None
    host, _, port = str(address).rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return None
    except (OSError, ValueError):
        return address


def merged_resources(cfg: ExperimentConfig, client_id: int) -> ResourcesConfig:
    return cfg.federation.client_resources(client_id)


def actor_options(resources: ResourcesConfig) -> dict[str, Any]:
    """``.options(...)`` keywords for an actor with these resources (``auto`` CPUs: Ray's actor default)."""
    options: dict[str, Any] = {}
    if resources.num_cpus != "auto":
        options["num_cpus"] = float(resources.num_cpus)
    if resources.num_gpus:
        options["num_gpus"] = float(resources.num_gpus)
    if resources.memory:
        options["memory"] = int(resources.memory)
    if resources.resources:
        options["resources"] = dict(resources.resources)
    return options


def client_bundles(cfg: ExperimentConfig) -> list[dict[str, float]]:
    """One placement-group bundle per client actor (``auto`` CPUs: 1), in actor order.

    A trial's placement group is ``[{"CPU": 1}]`` (the trial's driver and the coordinator) + these bundles + one
    bundle of ``federation.task_cpus`` for the coordinator's server-side tasks (:func:`trial_bundles`).
    """
    n, per_actor = cfg.partition.num_clients, cfg.federation.clients_per_actor
    bundles = []
    for first in range(0, n, per_actor):
        options = actor_options(merged_resources(cfg, first))
        bundle = {"CPU": float(options.get("num_cpus", 1.0))}
        if options.get("num_gpus"):
            bundle["GPU"] = float(options["num_gpus"])
        if options.get("memory"):
            bundle["memory"] = float(options["memory"])
        bundle.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
        bundles.append({k: v for k, v in bundle.items() if v})
    return bundles


def trial_bundles(cfg: ExperimentConfig) -> list[dict[str, float]]:
    """The bundles of one gang-scheduled federation: driver + coordinator, one per client actor, server tasks."""
    return [{"CPU": 1.0}, *client_bundles(cfg), {"CPU": float(cfg.federation.task_cpus)}]


@contextlib.contextmanager
def pickled_by_value(modules: Sequence[str]) -> Iterator[None]:
    """Within the block, Ray pickles the classes and functions of ``modules`` by value instead of by reference.

    A class defined in a script's or a test's module then reaches actors whose ``sys.path`` cannot import that module.
    Re-pickled in the actor (the coordinator sending a method's client step on), such objects stay by value: their
    module is not imported there. Modules registered already stay registered.
    """
    from ray import cloudpickle

    added = []
    for name in modules:
        module = sys.modules.get(name)
        if module is None or name == "__main__" or name in cloudpickle.list_registry_pickle_by_value():
            continue
        cloudpickle.register_pickle_by_value(module)
        added.append(module)
    try:
        yield
    finally:
        for module in added:
            cloudpickle.unregister_pickle_by_value(module)


class RayBackend(Backend):
    """Parameters
    ----------
    placement_group : PlacementGroup, optional
        Gang-schedule the run into this group: the coordinator in bundle 0, client actor ``k`` in bundle ``k + 1``
        (the bundles of :func:`client_bundles`). Used by Tune trials.
    pickle_by_value : sequence of str, optional
        Modules whose objects (a model factory, methods given as objects) are sent to the actors by value
        (:func:`pickled_by_value`); ``rayfuse.run`` names the modules of what it was given.
    """

    name = "ray"

    def __init__(self, placement_group: Any = None, pickle_by_value: Sequence[str] = ()) -> None:
        self._placement_group = placement_group
        self._by_value = tuple(pickle_by_value)
        self._owns_ray = False
        self.clients: dict[int, Any] = {}  # client id -> handle of the actor hosting it
        self._client_actors: list[Any] = []
        self._actor_names: list[str] = []
        self.coordinator: Any = None
        self._on_event: EventSink = lambda e: None
        self._seen = 0
        self._info: dict[str, Any] = {"backend": "ray"}
        self._notes: list[str] = []

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def _connect(self, cfg: ExperimentConfig) -> None:
        fed = cfg.federation
        if ray.is_initialized():
            return
        address = fed.address or os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"namespace": fed.namespace, "log_to_driver": True}
        if address:
            ray.init(address=address, **kwargs)
        else:
            stale = stale_local_address()
            if stale:
                kwargs["address"] = "local"
                self._notes.append(f"started a new local Ray: the last `ray start` cluster on this machine ({stale}) is gone")
            # a Ray this process starts listens on 127.0.0.1 only, unless ray_init names the node's address itself
            starts_new = bool(stale) or recorded_local_address() is None
            try:
                with loopback_node(starts_new and "_node_ip_address" not in fed.ray_init):
                    ray.init(**{**kwargs, **fed.ray_init})
            except ValueError as exc:
                # ray.init() attaches to a Ray already running on this machine (`ray start`), where arguments for a
                # new instance (num_cpus...) are refused: attach without them.
                if "existing cluster" not in str(exc):
                    raise
                ray.init(**kwargs)
                self._notes.append("attached to the Ray already running on this machine; federation.ray_init not applied")
        self._owns_ray = True  # we connected: we disconnect (which stops the local Ray only if we started it)

    def _check_feasible(self, cfg: ExperimentConfig, requests: list[dict[str, Any]]) -> None:
        """On a Ray that rayfuse started itself (no autoscaler), refuse requests the node cannot ever satisfy."""
        if cfg.federation.address or os.environ.get("RAY_ADDRESS") or self._placement_group is not None:
            return  # a real cluster may autoscale; a placement group is already reserved: wait (startup_timeout_s) instead of refusing
        total = ray.cluster_resources()
        for i, req in enumerate(requests):
            key = f"federation.client_overrides.{i}" if i in cfg.federation.client_overrides else "federation.clients"
            for name, need in [("num_cpus", req.get("num_cpus", 0)), ("num_gpus", req.get("num_gpus", 0))]:
                have = total.get("CPU" if name == "num_cpus" else "GPU", 0.0)
                if need > have:
                    raise InputError(f"{key}.{name}", f"at most the {have:g} {'CPUs' if name == 'num_cpus' else 'GPUs'} this Ray has", need)
            for name, need in (req.get("resources") or {}).items():
                if need > total.get(name, 0.0):
                    have_names = sorted(k for k in total if not k.startswith("node:"))
                    raise InputError(f"{key}.resources.{name}", f"a resource this Ray has (it has {have_names})", need)

    def start(self, cfg: ExperimentConfig, plan: DataPlan, run_dir: Path, *, on_event: EventSink, start_time: float,
              specs: list[MethodSpec] | None = None) -> None:
        self._on_event = on_event
        self._connect(cfg)
        with pickled_by_value(self._by_value):  # the actors' arguments are pickled when they are created
            self._start_actors(cfg, plan, run_dir, start_time, specs)

    def _start_actors(self, cfg: ExperimentConfig, plan: DataPlan, run_dir: Path, start_time: float,
                      specs: list[MethodSpec] | None) -> None:
        fed = cfg.federation
        run = Path(run_dir).name
        requests = [actor_options(merged_resources(cfg, i)) for i in range(plan.num_clients)]
        self._check_feasible(cfg, requests)
        client_cls = ray.remote(ClientActor)
        per_actor = fed.clients_per_actor
        groups = [list(range(first, min(first + per_actor, plan.num_clients))) for first in range(0, plan.num_clients, per_actor)]
        self._actor_names = []
        pg = self._placement_group
        bundles = client_bundles(cfg) if pg is not None else []
        for k, members in enumerate(groups):
            name = actor_name(run, members)
            options = dict(requests[members[0]])  # one client per actor, or no per-client overrides (validated)
            if pg is not None:
                options["num_cpus"] = bundles[k].get("CPU", 0.0)
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k + 1)
            handle = client_cls.options(
                name=name, namespace=fed.namespace, max_restarts=fed.max_restarts, max_task_retries=0, **options,
            ).remote([(i, plan.for_client(i)) for i in members], data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train,
                     seed=cfg.run.seed, faults=fed.faults, local_cache=cfg.run.model_cache)
            self._actor_names.append(name)
            for i in members:
                self.clients[i] = handle
        self._client_actors = [self.clients[members[0]] for members in groups]
        here = ray.get_runtime_context().get_node_id()
        placement: PlacementGroupSchedulingStrategy | NodeAffinitySchedulingStrategy
        if pg is not None:  # bundle 0 is the trial's own, on this node; the coordinator's fan-out tasks run in the group too
            placement = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
        else:
            placement = NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        self.coordinator = ray.remote(CoordinatorActor).options(
            name=f"{run}/coordinator", namespace=fed.namespace, max_concurrency=4, max_restarts=0,
            scheduling_strategy=placement,
            # in a trial the coordinator shares bundle 0 with the trial's driver, which holds its resources
            **(actor_options(fed.coordinator) if pg is None else {"num_cpus": 0}),
        ).remote(cfg, plan, str(Path(run_dir).resolve()), self.clients, start_time, specs)
        try:
            pings = ray.get([c.ping.remote() for c in self._client_actors] + [self.coordinator.ready.remote()],
                            timeout=fed.startup_timeout_s)
        except GetTimeoutError:
            raise RunFailure(f"the actors did not start within {fed.startup_timeout_s:g} s (federation.startup_timeout_s); "
                             f"requested per client {requests[0] or 'Ray defaults'}, cluster has {ray.cluster_resources()}") from None
        except (RayTaskError, RayActorError) as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (InputError, RunFailure)):
                raise cause from None
            raise RunFailure(f"an actor failed to start: {cause or exc}") from None
        nodes = sorted({p["node_id"] for p in pings})
        self._info = {"backend": "ray", "ray_version": ray.__version__, "namespace": fed.namespace,
                      "actors": self._actor_names + [f"{run}/coordinator"],
                      "nodes": len(nodes), "cluster_resources": {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}}
        for note in self._notes:
            self._on_event({"t": round(time.time() - start_time, 3), "kind": "info", "message": note})
        hosted = "" if per_actor == 1 else f" hosting {plan.num_clients} clients ({per_actor} per actor)"
        self._on_event({"t": round(time.time() - start_time, 3), "kind": "info",
                        "message": f"{len(groups)} client actors{hosted} and the coordinator up on {len(nodes)} node(s) "
                                   f"(namespace {fed.namespace!r}, names {self._actor_names[0]}..., {run}/coordinator)"})

    def _drain(self) -> None:
        try:
            events = ray.get(self.coordinator.events_since.remote(self._seen), timeout=30)
        except (RayActorError, GetTimeoutError):
            return
        self._seen += len(events)
        for event in events:
            self._on_event(event)

    def call(self, name: str, *args: Any) -> Any:
        ref = getattr(self.coordinator, name).remote(*args)
        while True:
            ready, _ = ray.wait([ref], timeout=POLL_S)
            self._drain()
            if ready:
                break
        try:
            return ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, (InputError, RunFailure)):
                raise cause from None
            print(str(exc), file=sys.stderr)  # an unexpected error: show the remote traceback once
            raise RunFailure(f"the coordinator failed in {name}: {type(cause).__name__}: {cause}") from None
        except RayActorError as exc:
            raise RunFailure(f"the coordinator actor died in {name}: {str(exc).splitlines()[0]}") from None

    def stop(self) -> None:
        for handle in [*self._client_actors, self.coordinator]:
            if handle is not None:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # already dead
                    pass
        self.clients, self._client_actors, self.coordinator = {}, [], None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    def info(self) -> dict[str, Any]:
        return dict(self._info)
