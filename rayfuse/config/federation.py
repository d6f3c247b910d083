"""The ``federation`` section: how the run is run (backend, resources, failure policy) and what is injected into it
(faults, attacks)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from rayfuse.config.base import StrictModel
from rayfuse.config.model import ModelConfig
from rayfuse.errors import key_error

__all__ = [
    "ResourcesConfig",
    "ClientOverride",
    "other_model_clients",
    "FaultSpec",
    "AttackSpec",
    "SecureAggregationConfig",
    "FederationConfig",
]


class ResourcesConfig(StrictModel):
    num_cpus: float | Literal["auto"] = Field(
        "auto", description="CPUs reserved per actor; 'auto': Ray's actor default (1 to place it, 0 while it runs)"
    )
    num_gpus: float = Field(0.0, ge=0, description="a fraction of a GPU per actor; torch work runs on it when > 0")
    memory: int | None = Field(None, ge=0, description="bytes of memory to reserve")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources, e.g. {silo_a: 1}")

    @field_validator("num_cpus")
    @classmethod
    def _non_negative(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and value < 0:
            raise ValueError("a number >= 0 or 'auto'")
        return value


class ClientOverride(ResourcesConfig):
    """``federation.client_overrides.<i>``: what client ``i`` does not share with the others. The resource keys it
    sets replace those of ``federation.clients`` for that client's actor; ``model`` gives the client its own model
    (a section with the schema of the top-level ``model:``), which it trains, keeps and sends instead of the run's.
    Only the keys given are dumped, so a written config reads back with the same overrides."""

    model: ModelConfig | None = Field(
        None,
        description="this client's own model (the schema of the top-level model:); "
        "default: the run's model. Only methods that need the clients' predictions alone "
        "(local, ensemble, global) accept clients of different models",
    )

    @property
    def resource_keys(self) -> list[str]:
        """The resource keys this override sets (those replacing ``federation.clients``' for its client)."""
        return sorted(k for k in self.model_fields_set if k != "model")

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Kept: the keys given are what the override is (resource_keys reads model_fields_set), so a dump with every
        # default filled in would read back as an override of every resource
        data = handler(self)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k in self.model_fields_set}
        return data


def other_model_clients(models: Sequence[ModelConfig]) -> list[int]:
    """The clients (indices of ``models``, each client's model in client order) whose model is not client 0's."""
    return [i for i, model in enumerate(models) if i > 0 and model != models[0]]


class FaultSpec(StrictModel):
    """An injected fault, for testing failure policies on a real run (chaos testing)."""

    client: int = Field(ge=0, description="the client whose step fails (a client id)")
    step: str = Field(min_length=1, description="client step name, e.g. fedavg.fit or train_local")
    call: int = Field(1, ge=1, description="the n-th call of that step on that client (per actor life)")
    mode: Literal["raise", "exit", "nan", "nan_metrics", "hang"] = Field(
        "raise",
        description="raise an error, exit the process, NaN every float in the result, NaN the reported metrics (a NaN loss), or hang",
    )
    seconds: float = Field(3600.0, gt=0, description="hang: how long to sleep")


class AttackSpec(StrictModel):
    """An attack on one client's model updates, to measure robust aggregation against (``rayfuse.updates.attacks``).

    Applied by the server's update pipeline (``server.updates``) to the client's parameter update wherever it combines
    parameter updates (the FedAvg family, ``average``, ``aligned``, ``finetune``'s average base), before clipping, DP
    and the aggregation rule: a simulation of a compromised client, recorded as an ``attack`` event. Refused before
    start for a method that fuses posteriors, statistics or predictions (``MethodTags.fuses``). Never applied unless
    configured.
    """

    client: int = Field(ge=0, description="the compromised client (a client id; one attack per client)")
    kind: Literal["sign_flip", "scale", "gaussian", "little_is_enough"] = Field(
        description="sign_flip (w_ref - (w - w_ref)), scale (w_ref + scale (w - w_ref)), gaussian (w_ref + N(0, std^2)), "
        "little_is_enough (the colluders send mean - z std of the honest updates, Baruch et al. 2019)"
    )
    rounds: list[int] | Literal["all"] = Field("all", description="the rounds attacked (one-shot methods: round 1), or all")
    scale: float | None = Field(None, description="scale: the factor s (default 10)")
    std: float | None = Field(None, gt=0, description="gaussian: the noise's standard deviation (default 1)")
    z: float | None = Field(
        None,
        gt=0,
        description="little_is_enough: the number of standard deviations (default: the paper's z_max for the round's n and colluders)",
    )

    @field_validator("rounds", mode="before")
    @classmethod
    def _positive_rounds(cls, value: Any) -> Any:
        # before the union's own validation, so a bad value is one line naming the key, not one line per union member
        if value == "all":
            return value
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError("a non-empty list of rounds (>= 1) or 'all'")
        for r in value:
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError("a list of rounds >= 1 (integers) or 'all'")
        return list(value)

    @model_validator(mode="after")
    def _own_keys(self) -> AttackSpec:
        own = {"scale": "scale", "std": "gaussian", "z": "little_is_enough"}
        for key, kind in own.items():
            if getattr(self, key) is not None and self.kind != kind:
                raise key_error(key, f"{key} only with kind {kind} (kind is {self.kind}), got {getattr(self, key)}")
        return self

    def attacks_round(self, round: int) -> bool:
        """Whether this attack applies to ``round``."""
        return self.rounds == "all" or round in self.rounds


class SecureAggregationConfig(StrictModel):
    """``federation.secure_aggregation``: SecAgg+ (Bell et al. 2020) on every round whose server needs only a sum; the
    server learns the sum of a round's cohort and nothing else about any one client. ``true`` takes every default."""

    num_neighbours: int | Literal["auto"] = Field(
        "auto",
        description="k, each client's neighbours in SecAgg+'s graph (its masks and shares go to them); auto: every other "
        "client up to 16 clients (plain SecAgg), else 4 ceil(log2 N) (the paper's O(log N))",
    )
    reconstruction_threshold: int | Literal["auto"] = Field(
        "auto",
        description="t, the shares of a client's secrets needed to unmask (a majority of k + 1); a round survives "
        "k + 1 - t dropped neighbours of any client; auto: the smallest majority of k + 1",
    )
    clipping_range: float = Field(
        8.0, gt=0, description="c: each entry of a model update a client sends is clipped to [-c, c] (fedmerge's sums set their own ranges)"
    )
    quantization_range: int = Field(
        2**22, ge=2, description="levels across [-c, c]: the step is 2c / quantization_range, each client's entry off by half a step"
    )
    distributed_dp: bool = Field(
        False,
        description="central DP's noise added by the clients instead of the server: each adds its share of discrete "
        "Gaussian noise to its encoded update, calibrated so that any reconstruction_threshold of them add the noise "
        "the accountant counts, so the server never holds the noiseless sum (methods entries with dp and fixed "
        "clipping; the others run secure without noise)",
    )

    @field_validator("num_neighbours", "reconstruction_threshold")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if not isinstance(value, str) and value < 1:
            raise ValueError("an integer >= 1 or 'auto'")
        return value


_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
_PORT = r"(?:6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})"
_RAY_ADDRESS = re.compile(rf"auto|local|ray://{_HOST}(?::{_PORT})?|{_HOST}:{_PORT}")


class FederationConfig(StrictModel):
    backend: Literal["ray", "local"] = Field("ray", description="ray: Ray actors; local: in-process clients (debugging)")
    address: str | None = Field(None, description="Ray cluster address; default: RAY_ADDRESS, a running job's cluster, or a new local Ray")
    namespace: str = Field("rayfuse", min_length=1, description="Ray namespace of the run's named actors")
    timeout_s: float = Field(900.0, gt=0, description="how long a gather waits for the clients of one call")
    on_client_failure: Literal["retry", "drop", "fail"] = Field(
        "retry",
        description="a failed client call: retry (re-submit up to max_retries times, then fail the run), drop (leave "
        "the client out of that call; fail below min_clients) or fail (the first failure fails the run)",
    )
    max_retries: int = Field(2, ge=0, description="retry: re-submissions of a failed call before the run fails")
    min_clients: int = Field(1, ge=1, description="quorum: fewer surviving clients than this fails the run")
    max_restarts: int = Field(2, ge=-1, description="Ray restarts of a dead client actor (-1: unlimited)")
    clients: ResourcesConfig = Field(
        default_factory=ResourcesConfig, description="Ray resources of each client actor (client_overrides changes them per client)"
    )
    client_overrides: dict[int, ClientOverride] = Field(
        default_factory=dict,
        description="per-client resources and model by client id: {<i>: {num_gpus: 1, resources: {site_a: 1}, model: {name: cnn}}}",
    )
    coordinator: ResourcesConfig = Field(
        default_factory=lambda: ResourcesConfig(num_cpus=0),
        description="Ray resources of the coordinator actor (the server side of every method)",
    )
    clients_per_actor: int = Field(
        1,
        ge=1,
        description="simulation: clients hosted by one actor process. 1 (default): one named "
        "actor per client, the deployment model. More cuts Ray's per-call cost when many clients share few "
        "cores, as Flower's actor pool does; the clients of one actor share its process and resources",
    )
    streaming: bool = Field(
        True,
        description="fold each client's reply into a running sum as it arrives and drop it (rules that are a sum: "
        "mean, weighted mean, clip_norm, central DP), so the coordinator holds about 2-3 x the model whatever the "
        "number of clients; false: gather every reply first, then aggregate (the path robust rules and attacked "
        "rounds always take; for comparison)",
    )
    aggregation: Literal["flat", "per_actor", "per_node"] | None = Field(
        None,
        description="where a streaming round is summed: flat (every client's reply folded by the coordinator), "
        "per_actor (an actor hosting clients_per_actor > 1 clients validates, clips and sums theirs and sends one "
        "partial sum) or per_node (Ray only: each actor sends its partial sum to an aggregator actor on its own node, "
        "which folds them, so one partial sum per node crosses the network); unset: per_node when the clients span "
        "several nodes, else per_actor when clients_per_actor > 1, else flat (a rule that is not a sum, or an attacked "
        "round, gathers)",
    )
    task_cpus: float = Field(1.0, gt=0, description="CPUs each server-side fan-out task requests (parallel assignment solves...)")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for the actors to start (resources to appear)")
    ray_init: dict[str, Any] = Field(
        default_factory=dict, description="arguments for ray.init when rayfuse starts a local Ray (num_cpus, include_dashboard...)"
    )
    faults: list[FaultSpec] = Field(
        default_factory=list,
        description="faults injected into client steps, to test the failure policy on a real run: [{client, step, call, mode}]",
    )
    secure_aggregation: SecureAggregationConfig | None = Field(
        None,
        description="secure aggregation (SecAgg+): the server receives only sums of masked client uploads (the "
        "FedAvg family's weighted mean, fedmerge's statistics; methods whose server needs more are refused before start); "
        "true for the defaults, or its options: {num_neighbours, reconstruction_threshold, clipping_range, "
        "quantization_range}",
    )
    attacks: list[AttackSpec] = Field(
        default_factory=list,
        description="simulated attacks on clients' model updates, to measure "
        "robust aggregation against: applied by the update pipeline wherever it combines parameter "
        "updates (the FedAvg family, average, aligned, finetune's average base); refused before start "
        "for methods that fuse posteriors, statistics or predictions",
    )

    @field_validator("secure_aggregation", mode="before")
    @classmethod
    def _secure_switch(cls, value: Any) -> Any:
        # true: every default; false: off (as null)
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _aggregation_needs(self) -> FederationConfig:
        if self.aggregation == "per_actor" and self.clients_per_actor < 2:
            raise key_error(
                "aggregation",
                f"per_actor only with clients_per_actor > 1 (one partial sum per actor), got clients_per_actor {self.clients_per_actor}",
            )
        if self.aggregation in ("per_actor", "per_node") and not self.streaming:
            raise key_error(
                "aggregation",
                f"{self.aggregation} only with streaming: true (partial sums are folded as they arrive), got streaming: false",
            )
        return self

    @field_validator("address")
    @classmethod
    def _address_form(cls, value: str | None) -> str | None:
        # Whether anything answers there is checked when a run starts (actors.backend.check_reachable_address).
        if value is not None and not _RAY_ADDRESS.fullmatch(value):
            raise ValueError("a Ray address: host:port, ray://host:port, auto or local")
        return value

    def client_resources(self, client_id: int) -> ResourcesConfig:
        """Client ``client_id``'s resources: ``clients``, with the keys its ``client_overrides`` entry sets replaced."""
        override = self.client_overrides.get(client_id)
        if override is None or not override.resource_keys:
            return self.clients
        return self.clients.model_copy(update={k: getattr(override, k) for k in override.resource_keys})
