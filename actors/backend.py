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
from rayfuse.data.silos import SiloPlan
from rayfuse.errors import InputError, RunFailure
from rayfuse.interrupts import reinstall_sigterm
from rayfuse.method import MethodSpec
from rayfuse.runner import Backend, EventSink

__all__ = [
    "RayBackend",
    "actor_options",
    "check_local_resources",
    "check_node_resources",
    "check_node_gpus",
    "gpu_requests",
    "check_reachable_address",
    "split_address",
    "client_bundles",
    "merged_resources",
    "pickled_by_value",
    "pinned_resources",
    "trial_bundles",
]

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


PROBE_TIMEOUT_S = 3.0


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` or ``ray://host[:port]`` address (Ray Client's default port 10001);
    ``None`` for anything else (``auto``, ``local``, a form this check does not know)."""
    rest = address[len("ray://") :] if address.startswith("ray://") else address
    rest = rest.split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep:
        host, port = (rest, "10001") if address.startswith("ray://") else ("", "")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def check_reachable_address(address: str | None, *, key: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse, before Ray starts, a cluster address nothing answers at: a TCP connect to it must succeed within
    ``timeout_s`` (``ray.init`` would otherwise wait forever). ``auto`` must find a running Ray on this machine.
    ``None`` and ``local`` (start a new local Ray) pass. Raises :class:`InputError` at ``key``."""
    if not address or address == "local":
        return
    if address == "auto":
        try:
            from ray._private.services import get_ray_address_from_environment  # Ray's own lookup (not a public API)

            found = get_ray_address_from_environment("auto", None)
        except ConnectionError:
            raise InputError(
                key,
                "a running Ray to attach to ('auto' looks for one on this machine)",
                address,
                "none is running: start one (ray start --head) or leave the address unset for a new local Ray",
            ) from None
        except Exception:  # another Ray version: let ray.init() decide
            return
        if not found or found == "auto":
            return
        address = str(found)
    parts = split_address(address)
    if parts is None:
        raise InputError(key, "a Ray address: host:port, ray://host:port, auto or local", address)
    host, port = parts
    expected = f"a Ray cluster answering at {host}:{port} within {timeout_s:g} s"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else (getattr(exc, "strerror", None) or type(exc).__name__)
        raise InputError(key, expected, address, reason.lower()) from None
    if address.startswith("ray://") or os.environ.get("RAY_USE_TLS", "0").lower() not in ("0", "false", ""):
        return  # Ray Client's server, or a TLS cluster: the TCP answer is all this check asks
    problem = _ask_gcs(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}", timeout_s)
    if problem:
        raise InputError(key, expected, address, problem)


def _ask_gcs(target: str, timeout_s: float) -> str | None:
    """Ask the Ray GCS at ``target`` for its cluster id: ``None`` if a Ray GCS answers (with the id, or asking for the
    cluster's token), else why not. A port that accepts connections is not enough: a proxy or another server answers
    TCP too, and ``ray.init`` would then retry for a long time."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # Ray's own protocol (not a public API)
    except ImportError:
        return None
    channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
    try:
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # generated protobuf code
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return None  # a Ray GCS asking for the cluster's token: ray.init brings it
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return "no Ray cluster answers there"
        return "something answers there, but not a Ray cluster (its GCS)"
    finally:
        channel.close()
    return None


def _live_local_cluster() -> bool:
    """Whether ``ray.init()`` with no address would attach to a running ``ray start`` cluster of this machine."""
    try:
        from ray._private.services import get_ray_address_from_environment

        address = get_ray_address_from_environment(None, None)  # type: ignore[arg-type]
    except Exception:
        return True  # unknown: do not judge the resources
    return bool(address) and stale_local_address() is None


def _local_gpus() -> int | None:
    """GPUs a new local Ray would see (Ray's own detection, ``CUDA_VISIBLE_DEVICES`` honoured); ``None`` if unknown."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        if manager is None:
            return None
        count = int(manager.get_current_node_num_accelerators())
        visible = manager.get_current_process_visible_accelerator_ids()
    except Exception:
        return None
    return count if visible is None else min(count, len(visible))


def _local_cpus() -> float:
    try:
        from ray._private.utils import get_num_cpus  # container limits honoured, as ray.init does

        return float(get_num_cpus())
    except Exception:
        return float(os.cpu_count() or 1)


def check_local_resources(cfg: ExperimentConfig) -> None:
    """Before Ray starts: on the local Ray this run will start itself (no address, no ``RAY_ADDRESS``, no Ray
    initialised or running here), refuse CPUs, GPUs or custom resources that the actors can never get: one actor asking
    more than the node has, or the actors together (they hold what they ask for as long as they live) asking more.

    The node has ``federation.ray_init``'s ``num_cpus`` / ``num_gpus`` / ``resources`` if given, else what Ray
    detects on this machine. Raises :class:`InputError` naming the key."""
    fed = cfg.federation
    if fed.address or os.environ.get("RAY_ADDRESS") or ray.is_initialized() or _live_local_cluster():
        return
    init = fed.ray_init
    have = {"CPU": float(init["num_cpus"]) if isinstance(init.get("num_cpus"), (int, float)) else _local_cpus()}
    gpus = float(init["num_gpus"]) if isinstance(init.get("num_gpus"), (int, float)) else _local_gpus()
    if gpus is not None:
        have["GPU"] = float(gpus)
    custom: dict[str, Any] = init["resources"] if isinstance(init.get("resources"), dict) else {}
    n, per_actor = cfg.partition.num_clients, fed.clients_per_actor
    actors = [
        (
            f"federation.client_overrides.{first}" if _sets_resources(cfg, first) else "federation.clients",
            actor_options(fed.client_resources(first)),
        )
        for first in range(0, n, per_actor)
    ]
    actors.append(("federation.coordinator", actor_options(fed.coordinator)))
    where = "the local Ray this run starts (federation.ray_init, else this machine)"
    totals: dict[str, float] = {}
    for key, options in actors:
        needs = {
            "CPU": float(options.get("num_cpus", 0.0)),
            "GPU": float(options.get("num_gpus", 0.0)),
            **{name: float(v) for name, v in (options.get("resources") or {}).items()},
        }
        for name, need in needs.items():
            totals[name] = totals.get(name, 0.0) + need
            field = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(name, f"resources.{name}")
            available = have.get(name) if name in ("CPU", "GPU") else float(custom.get(name, 0.0))
            if available is not None and need > available + 1e-9:
                raise InputError(f"{key}.{field}", f"at most the {available:g} {name} of {where}", need)
    for name, total in totals.items():
        available = have.get(name) if name in ("CPU", "GPU") else float(custom.get(name, 0.0))
        if available is not None and total > available + 1e-9:
            field = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(name, f"resources.{name}")
            raise InputError(
                f"federation.clients.{field}",
                f"client actors and coordinator asking at most the {available:g} {name} "
                f"of {where} in all (each holds its share while it lives)",
                f"{total:g} in all for {len(actors) - 1} client actors and the coordinator",
                "ask less per client, or host several clients per actor (federation.clients_per_actor)",
            )


def _sets_resources(cfg: ExperimentConfig, client: int) -> bool:
    """Whether ``federation.client_overrides.<client>`` sets resource keys (an override may give the client only a
    model of its own)."""
    override = cfg.federation.client_overrides.get(client)
    return override is not None and bool(override.resource_keys)


def pinned_resources(cfg: ExperimentConfig) -> dict[int, dict[str, float]]:
    """Each client's custom Ray resources (``federation.clients.resources``, replaced per client by
    ``federation.client_overrides.<i>.resources``: the way to pin a client, and so its silo, to its site's node);
    clients asking for none are left out."""
    fed = cfg.federation
    asked = {i: {k: float(v) for k, v in fed.client_resources(i).resources.items() if v} for i in range(cfg.partition.num_clients)}
    return {i: r for i, r in asked.items() if r}


def check_node_resources(cfg: ExperimentConfig, nodes: Sequence[dict[str, float]]) -> None:
    """Refuse a client whose custom resources no single node offers: ``nodes`` holds each live node's total resources
    (``ray.nodes()``'s ``Resources``), looked at per node (an actor runs on one node; the cluster's sum would let
    ``{site_a: 1, site_b: 1}`` pass on two nodes that each offer one). Raises :class:`InputError` naming the client's key
    and the resource: an actor asking for it would wait, unplaced, until ``federation.startup_timeout_s``.

    The nodes are those alive when the run starts: on an autoscaling cluster keep each site's worker type at
    ``min_workers: 1`` (as ``cluster.yaml`` does), since a site's node holds that site's data."""
    fed = cfg.federation
    check_node_gpus(cfg, nodes)
    offered = sorted(
        {name for node in nodes for name in node if name not in _BUILTIN_RESOURCES and not name.startswith(("node:", "accelerator_type:"))}
    )
    for client, needs in pinned_resources(cfg).items():
        if any(all(node.get(name, 0.0) + 1e-9 >= need for name, need in needs.items()) for node in nodes):
            continue
        override = fed.client_overrides.get(client)
        key = (
            f"federation.client_overrides.{client}"
            if override is not None and "resources" in override.model_fields_set
            else "federation.clients"
        )
        missing = next((name for name, need in needs.items() if not any(node.get(name, 0.0) + 1e-9 >= need for node in nodes)), None)
        if missing is not None:
            raise InputError(
                f"{key}.resources.{missing}",
                f"a Ray node offering {missing} for client {client} (the nodes offer {offered or 'no custom resources'})",
                needs[missing],
                f"start that site's node with: ray start --address ... --resources '{{\"{missing}\": 1}}'",
            )
        raise InputError(
            f"{key}.resources",
            f"one Ray node offering all of client {client}'s resources together (the nodes offer {offered})",
            needs,
            "a client runs on one node",
        )


def gpu_requests(cfg: ExperimentConfig) -> list[tuple[str, float]]:
    """The GPUs each actor of the run asks for, with the key that asks (``federation.client_overrides.<i>`` for a client
    whose override sets its resources, else ``federation.clients``; ``federation.coordinator``); actors asking none
    are left out."""
    fed = cfg.federation
    asks = [
        (
            f"federation.client_overrides.{first}" if _sets_resources(cfg, first) else "federation.clients",
            fed.client_resources(first).num_gpus,
        )
        for first in range(0, cfg.partition.num_clients, fed.clients_per_actor)
    ]
    asks.append(("federation.coordinator", fed.coordinator.num_gpus))
    return [(key, float(need)) for key, need in asks if need]


def check_node_gpus(cfg: ExperimentConfig, nodes: Sequence[dict[str, float]]) -> None:
    """Refuse an actor asking for more GPUs than any one live node offers (an actor runs on one node), above all a GPU
    asked for on a cluster that has none: such an actor would wait, unplaced, until ``federation.startup_timeout_s``.
    Raises :class:`InputError` naming the key. As for custom resources, the nodes are those alive when the run starts:
    on an autoscaling cluster keep a GPU worker type at ``min_workers: 1``."""
    most = max((float(node.get("GPU", 0.0)) for node in nodes), default=0.0)
    for key, need in gpu_requests(cfg):
        if need > most + 1e-9:
            where = (
                "a Ray node with GPUs (this cluster has none)" if most == 0 else f"at most the {most:g} GPUs of this cluster's largest node"
            )
            raise InputError(f"{key}.num_gpus", where, need, "start a node with GPUs (ray start --num-gpus N), or ask for num_gpus: 0")


# resources Ray gives nodes itself (with node:<ip> and accelerator_type:<kind>); the custom ones are the user's (ray start --resources)
_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "TPU", "memory", "object_store_memory"})


def live_node_resources() -> list[dict[str, float]]:
    """The total resources of each live node of the connected Ray."""
    return [dict(node.get("Resources") or {}) for node in ray.nodes() if node.get("Alive")]


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

    def check_start(self, cfg: ExperimentConfig) -> None:
        """Before anything is written or started: the cluster address answers (``federation.address``, else
        ``RAY_ADDRESS``) and, on a local Ray this run starts, the actors' resources fit it."""
        if self._placement_group is not None:
            return  # a trial's placement group is reserved already: its bundles hold the resources
        if ray.is_initialized():  # an initialised Ray is reused as it is: its nodes must offer the pinned clients' resources
            check_node_resources(cfg, live_node_resources())
            return
        if cfg.federation.address:
            check_reachable_address(cfg.federation.address, key="federation.address")
        elif os.environ.get("RAY_ADDRESS"):
            env = os.environ["RAY_ADDRESS"]
            if env == "auto" or split_address(env) is not None:  # another form: ray.init reads it as it does
                check_reachable_address(env, key="RAY_ADDRESS")
        check_local_resources(cfg)
        if pinned_resources(cfg) or gpu_requests(cfg):
            # Clients pinned to sites (custom resources), or actors asking for GPUs: connect now and look at the nodes, so
            # that a site or a GPU with no node is one line here, before the run folder is written, not a wait of
            # startup_timeout_s for an unplaceable actor.
            self._connect(cfg)
            try:
                check_node_resources(cfg, live_node_resources())
            except InputError:
                self.stop()
                raise

    def _connect(self, cfg: ExperimentConfig) -> None:
        fed = cfg.federation
        if ray.is_initialized():
            return
        address = fed.address or os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"namespace": fed.namespace, "log_to_driver": True}
        if address:
            if fed.address or address == "auto" or split_address(address) is not None:
                check_reachable_address(address, key="federation.address" if fed.address else "RAY_ADDRESS")
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
        reinstall_sigterm()  # ray.init replaced rayfuse's SIGTERM handler (which stops the run like Ctrl-C) with its own

    def _check_feasible(self, cfg: ExperimentConfig, requests: list[dict[str, Any]]) -> None:
        """On a Ray that rayfuse started itself (no autoscaler), refuse requests the node cannot ever satisfy."""
        if cfg.federation.address or os.environ.get("RAY_ADDRESS") or self._placement_group is not None:
            return  # a real cluster may autoscale; a placement group is already reserved: wait (startup_timeout_s) instead of refusing
        total = ray.cluster_resources()
        for i, req in enumerate(requests):
            key = f"federation.client_overrides.{i}" if _sets_resources(cfg, i) else "federation.clients"
            for name, need in [("num_cpus", req.get("num_cpus", 0)), ("num_gpus", req.get("num_gpus", 0))]:
                have = total.get("CPU" if name == "num_cpus" else "GPU", 0.0)
                if need > have:
                    raise InputError(f"{key}.{name}", f"at most the {have:g} {'CPUs' if name == 'num_cpus' else 'GPUs'} this Ray has", need)
            for name, need in (req.get("resources") or {}).items():
                if need > total.get(name, 0.0):
                    have_names = sorted(k for k in total if not k.startswith("node:"))
                    raise InputError(f"{key}.resources.{name}", f"a resource this Ray has (it has {have_names})", need)

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
        self._on_event = on_event
        self._connect(cfg)
        with pickled_by_value(self._by_value):  # the actors' arguments are pickled when they are created
            self._start_actors(cfg, plan, run_dir, start_time, specs)

    def _start_actors(
        self, cfg: ExperimentConfig, plan: DataPlan, run_dir: Path, start_time: float, specs: list[MethodSpec] | None
    ) -> None:
        fed = cfg.federation
        run = Path(run_dir).name
        requests = [actor_options(merged_resources(cfg, i)) for i in range(plan.num_clients)]
        if self._placement_group is None:
            check_node_resources(cfg, live_node_resources())  # before any actor: a site without a node fails now, in one line
        self._check_feasible(cfg, requests)
        client_cls = ray.remote(ClientActor)
        per_actor = fed.clients_per_actor
        groups = [list(range(first, min(first + per_actor, plan.num_clients))) for first in range(0, plan.num_clients, per_actor)]
        self._actor_names = []
        pg = self._placement_group
        bundles = client_bundles(cfg) if pg is not None else []
        for k, members in enumerate(groups):
            name = actor_name(run, members)
            options = dict(requests[members[0]])  # one client per actor, or no per-client resources (validated)
            if pg is not None:
                options["num_cpus"] = bundles[k].get("CPU", 0.0)
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k + 1)
            handle = client_cls.options(
                name=name,
                namespace=fed.namespace,
                max_restarts=fed.max_restarts,
                max_task_retries=0,
                **options,
            ).remote(
                [(i, plan.for_client(i)) for i in members],
                data_cfg=cfg.data,
                model_cfg=cfg.model,
                train_cfg=cfg.train,
                seed=cfg.run.seed,
                faults=fed.faults,
                local_cache=cfg.run.model_cache,
                client_models={i: cfg.client_model(i) for i in members if cfg.client_model(i) is not cfg.model},
            )
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
        self.coordinator = (
            ray.remote(CoordinatorActor)
            .options(
                name=f"{run}/coordinator",
                namespace=fed.namespace,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=placement,
                # in a trial the coordinator shares bundle 0 with the trial's driver, which holds its resources
                **(actor_options(fed.coordinator) if pg is None else {"num_cpus": 0}),
            )
            .remote(cfg, plan, str(Path(run_dir).resolve()), self.clients, start_time, specs)
        )
        try:
            pings = ray.get(
                [c.ping.remote() for c in self._client_actors] + [self.coordinator.ready.remote()], timeout=fed.startup_timeout_s
            )
        except GetTimeoutError:
            raise RunFailure(
                f"the actors did not start within {fed.startup_timeout_s:g} s (federation.startup_timeout_s); "
                f"requested per client {requests[0] or 'Ray defaults'}, cluster has {ray.cluster_resources()}"
            ) from None
        except (RayTaskError, RayActorError) as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (InputError, RunFailure)):
                raise cause from None
            raise RunFailure(f"an actor failed to start: {cause or exc}") from None
        nodes = sorted({p["node_id"] for p in pings})
        self._info = {
            "backend": "ray",
            "ray_version": ray.__version__,
            "namespace": fed.namespace,
            "actors": self._actor_names + [f"{run}/coordinator"],
            "nodes": len(nodes),
            "client_devices": sorted({d for p in pings[:-1] for d in p.get("devices", [])}),  # cpu, cuda:0 (num_gpus > 0)
            "cluster_resources": {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")},
        }
        for note in self._notes:
            self._on_event({"t": round(time.time() - start_time, 3), "kind": "info", "message": note})
        hosted = "" if per_actor == 1 else f" hosting {plan.num_clients} clients ({per_actor} per actor)"
        self._on_event(
            {
                "t": round(time.time() - start_time, 3),
                "kind": "info",
                "message": f"{len(groups)} client actors{hosted} and the coordinator up on {len(nodes)} node(s) "
                f"(namespace {fed.namespace!r}, names {self._actor_names[0]}..., {run}/coordinator)",
            }
        )

    def _drain(self) -> None:
        try:
            events = ray.get(self.coordinator.events_since.remote(self._seen), timeout=30)
        except (RayActorError, GetTimeoutError):
            return
        self._seen += len(events)
        for event in events:
            self._on_event(event)

    # -- the coordinator's calls (rayfuse.runner.Backend), each forwarded to the coordinator actor ----------------------

    def survey_silos(self) -> SiloPlan:
        plan: SiloPlan = self._call("survey_silos")
        return plan

    def prepare_local_models(self, resume: bool = False) -> dict[str, Any]:
        done: dict[str, Any] = self._call("prepare_local_models", resume)
        return done

    def run_method(self, label: str, resume: bool = False) -> dict[str, Any]:
        summary: dict[str, Any] = self._call("run_method", label, resume)
        return summary

    def _call(self, name: str, *args: Any) -> Any:
        """``CoordinatorActor.<name>(*args)``, relaying the coordinator's events while it runs; an :class:`InputError`
        or :class:`RunFailure` raised there is raised here, anything else becomes a :class:`RunFailure`."""
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
