"""The whole experiment config (:class:`ExperimentConfig`): the ``run`` section, the other sections, ``methods`` and
``evaluation``, and the checks across sections."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from rayfuse.config.base import StrictModel
from rayfuse.config.data import DataConfig, PartitionConfig
from rayfuse.config.federation import FederationConfig
from rayfuse.config.model import ModelConfig
from rayfuse.config.tracking import TrackingConfig
from rayfuse.config.train import TrainConfig
from rayfuse.errors import key_error
from rayfuse.io import DEFAULT_MAX_SHARD_SIZE

__all__ = [
    "DEFAULT_METHODS",
    "DEFAULT_PUBLIC_READERS",
    "QUICKSTART_PUBLIC_SIZE",
    "default_methods",
    "RunConfig",
    "CONFIG_SECTIONS",
    "ExperimentConfig",
]

# The quickstart's methods (jobs/quickstart.yaml spells out the same job; a test keeps the two equal).
DEFAULT_METHODS: dict[str, dict[str, Any]] = {
    "local": {},
    "average": {},
    "ensemble": {},
    "aligned": {},
    "aligned-wide": {"method": "aligned", "merge": "nonparametric"},
    "distill": {},
    "distill-free": {"method": "distill", "transfer": "synthetic"},
    "distill-rounds": {"method": "distill", "rounds": 3},
    "fedavg": {},
    "global": {},
}
# The quickstart's public sample: a config without a data section is the quickstart's data, as one without methods is
# the quickstart's methods (an empty data section, or one that names its own keys, has no public sample by default).
# It is drawn only when a configured method reads a public sample (rayfuse.method.with_public_default): a run of
# methods that read none keeps every sample for the clients, and a dataset smaller than it is not refused for it.
QUICKSTART_PUBLIC_SIZE = 300
# The quickstart's methods that read the server's public sample (distill with transfer: public; a test keeps this equal
# to their tags, rayfuse.method.reads_public_sample): not among the default methods where the data gives none.
DEFAULT_PUBLIC_READERS = frozenset({"distill", "distill-rounds"})


def default_methods(section: Any) -> dict[str, dict[str, Any]]:
    """The methods of a config without a methods section, given its data section as written (``None``: none, the
    quickstart's data, whose public sample is drawn for them): the quickstart's, less the oracle with ``data.silos`` (no
    process may pool the silos) and less :data:`DEFAULT_PUBLIC_READERS` where the data gives no public sample (a data
    section without ``public_size``, or ``public_size: 0``; ``data.silos`` without ``data.public``)."""

    def key(name: str, default: Any = None) -> Any:
        return section.get(name, default) if isinstance(section, Mapping) else getattr(section, name, default)

    skip: set[str] = set()
    if section is not None:
        silos = key("silos")
        if isinstance(silos, list) and silos:
            skip = {"global"} | (set() if key("public") is not None else DEFAULT_PUBLIC_READERS)
        else:
            size = key("public_size", 0)  # None: the quickstart's sample; a value of another type: its own error
            if isinstance(size, (int, float)) and not isinstance(size, bool) and size == 0:
                skip = set(DEFAULT_PUBLIC_READERS)
    return {k: v for k, v in copy.deepcopy(DEFAULT_METHODS).items() if k not in skip}


class RunConfig(StrictModel):
    name: str = Field(
        "quickstart", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="run name; the run folder is <storage>/<name>-<time>"
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="the one seed every other seed derives from")
    storage: str = Field("runs", min_length=1, description="folder that receives run folders")
    model_cache: str | None = Field(
        None,
        min_length=1,
        description="storage the clients own: each keeps its trained local model there "
        "under a content key, so runs (and Tune trials) with the same data, partition, model, train "
        "config and seed reuse it instead of retraining, and --resume reads it; null: the clients keep nothing",
    )
    max_shard_size: int = Field(
        DEFAULT_MAX_SHARD_SIZE,
        ge=1,
        description="bytes: a model file the run writes (fused models, round checkpoints, checkpoints/local) above "
        "this size is a folder of model-0000k-of-0000n.safetensors shards of at most this size and their "
        "model.safetensors.index.json, read back wherever a file is (default 2 GiB)",
    )


# The top-level sections: an error path starting with one of these is absolute (``Method.check``'s convention).
CONFIG_SECTIONS = ("run", "data", "partition", "model", "train", "federation", "methods", "evaluation", "tracking")


class ExperimentConfig(StrictModel):
    run: RunConfig = Field(default_factory=RunConfig, description="the run's name, seed, storage folder and local-model cache")
    data: DataConfig = Field(
        default_factory=lambda: DataConfig(public_size=None),
        description="the data; without this section, the quickstart's (digits, and a public sample of 300 when a "
        "configured method reads one)",
    )
    partition: PartitionConfig = Field(
        default_factory=PartitionConfig,
        description="how a simulation's dataset is split among the clients (with data.silos: num_clients only, len(data.silos))",
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="the model architecture of every client (unless its "
        "federation.client_overrides.<i>.model says otherwise) and of the server",
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="how each client trains its local model (and the pooled "
        "oracle its model); methods with local rounds take their defaults from here",
    )
    federation: FederationConfig = Field(
        default_factory=FederationConfig,
        description="how the clients run: backend, Ray cluster, failure policy, resources, injected faults and simulated attacks",
    )
    methods: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: copy.deepcopy(DEFAULT_METHODS),
        description="the fusion methods to run, in order: label -> parameters (each method's are listed below)",
    )
    evaluation: Literal["federated", "central", "both"] = Field(
        "central",
        description="where models are scored: central (the server's test set), federated (each client on its own "
        "held-out split, data.val_size; sums and counts only, aggregated count-weighted) or both (federated under federated_<metric>). "
        "Default: federated with data.silos, central without",
    )
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(), description="experiment-tracking sinks (MLflow)")

    @model_validator(mode="before")
    @classmethod
    def _default_methods(cls, data: Any) -> Any:
        # Without a methods section, the quickstart's methods that the data section can run (default_methods).
        if isinstance(data, Mapping) and data.get("methods") is None and data.get("data") is not None:
            data = {**data, "methods": default_methods(data["data"])}
        return data

    @model_validator(mode="before")
    @classmethod
    def _silo_clients(cls, data: Any) -> Any:
        # With data.silos there is one client per silo and no partitioner: partition.num_clients is len(data.silos).
        if not isinstance(data, Mapping):
            return data
        section = data.get("data")
        silos = section.get("silos") if isinstance(section, Mapping) else getattr(section, "silos", None)
        if not isinstance(silos, list) or not silos:
            return data  # a simulation, or data.silos' own error
        n = len(silos)
        partition = data.get("partition")
        if partition is None:
            partition = {}
        elif isinstance(partition, BaseModel):
            partition = partition.model_dump(exclude_unset=True)
        if not isinstance(partition, Mapping):
            return data  # the partition section's own error
        for key, value in partition.items():
            if key != "num_clients":
                raise key_error(
                    ("partition", key), f"no partition key but num_clients with data.silos (each silo is one client's data), got {value!r}"
                )
        if "num_clients" in partition and partition["num_clients"] != n:
            raise key_error(("partition", "num_clients"), f"len(data.silos) ({n}) or unset, got {partition['num_clients']!r}")
        # and the server holds no test set unless data.test is given: evaluation defaults to federated
        return {**data, "partition": {"num_clients": n}, "evaluation": data.get("evaluation", "federated")}

    @field_validator("methods", mode="before")
    @classmethod
    def _methods_list_form(cls, value: Any) -> Any:
        # ``methods: [local, fedavg]`` is shorthand for ``methods: {local: {}, fedavg: {}}``.
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, str) for v in value):
                raise ValueError("a list of method names or a mapping of labels to parameters")
            return {name: {} for name in value}
        if isinstance(value, Mapping):
            return {str(k): ({} if v is None else v) for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> ExperimentConfig:
        n = self.partition.num_clients
        if not self.methods:
            raise key_error("methods", "at least one method, got none")
        if self.federation.min_clients > n:
            raise key_error(("federation", "min_clients"), f"at most partition.num_clients ({n}), got {self.federation.min_clients}")
        if self.federation.clients_per_actor > 1 and any(o.resource_keys for o in self.federation.client_overrides.values()):
            # (an override that gives a client only its own model is fine: clients of one actor share its resources only)
            raise key_error(
                ("federation", "clients_per_actor"),
                f"1 when federation.client_overrides gives clients their own resources, got {self.federation.clients_per_actor}",
            )
        for client in self.federation.client_overrides:
            if not 0 <= client < n:
                raise key_error(("federation", "client_overrides", client), f"a client id in 0..{n - 1}, got {client}")
        for i, fault in enumerate(self.federation.faults):
            if fault.client >= n:
                raise key_error(("federation", "faults", i, "client"), f"a client id in 0..{n - 1}, got {fault.client}")
        seen: set[int] = set()
        for i, attack in enumerate(self.federation.attacks):
            if attack.client >= n:
                raise key_error(("federation", "attacks", i, "client"), f"a client id in 0..{n - 1}, got {attack.client}")
            if attack.client in seen:
                raise key_error(("federation", "attacks", i, "client"), f"one attack per client, got client {attack.client} twice")
            seen.add(attack.client)
        return self

    def client_model(self, client_id: int) -> ModelConfig:
        """Client ``client_id``'s model: its ``federation.client_overrides.<i>.model``, else the run's ``model``."""
        override = self.federation.client_overrides.get(client_id)
        return override.model if override is not None and override.model is not None else self.model

    def client_models(self) -> tuple[ModelConfig, ...]:
        """Every client's model, in client order (``range(partition.num_clients)``)."""
        return tuple(self.client_model(i) for i in range(self.partition.num_clients))

    @property
    def heterogeneous_clients(self) -> bool:
        """Whether some client's model is not the run's ``model`` (``federation.client_overrides.<i>.model``): clients of
        several architectures, or clients of one architecture other than the server's."""
        return any(model != self.model for model in self.client_models())

    @model_validator(mode="after")
    def _text_encoding(self) -> ExperimentConfig:
        # Text data take a Hugging Face classifier: a model named here that is not one is refused (a factory given from
        # Python, or no model named, is checked before start: rayfuse.runner), and so is data.max_length beyond the
        # model folder's positions; with_text_encoding fills in the defaults
        if not self.data.uses_text:
            return self
        from rayfuse.data.text import model_positions
        from rayfuse.models.hf import hf_folder_of

        folder = hf_folder_of(self.model.name)
        if folder is None and self.model.name != "custom" and "name" in self.model.model_fields_set:
            raise key_error(
                ("model", "name"), f"a Hugging Face classifier hf:<folder> for text data (token-id rows), got {self.model.name!r}"
            )
        positions = model_positions(folder) if folder is not None else None
        if self.data.max_length is not None and positions is not None and self.data.max_length > positions:
            raise key_error(
                ("data", "max_length"), f"at most the model's max_position_embeddings ({positions}) in {folder}, got {self.data.max_length}"
            )
        return self

    def with_text_encoding(self) -> ExperimentConfig:
        """A copy whose text data section states its tokenizer and ``max_length`` (``data.tokenizer``: default the
        model's folder, ``hf:<folder>`` or :func:`rayfuse.models.hf.hf_model`'s; ``data.max_length``: default
        min(128, the model's ``max_position_embeddings``), at most that), so every process that reads a text source
        holds them and the run's config.yaml records them; ``self`` where the data are not texts. Raises
        :class:`InputError` when no tokenizer is named and the model has no folder, or for a ``max_length`` beyond
        the positions of a model given from Python."""
        if not self.data.uses_text:
            return self
        from rayfuse.data.text import DEFAULT_MAX_LENGTH, model_positions
        from rayfuse.errors import InputError
        from rayfuse.models.hf import hf_factory

        factory = hf_factory(self.model)
        folder = None if factory is None else factory.folder
        tokenizer = self.data.tokenizer or folder
        if tokenizer is None:
            raise InputError("data.tokenizer", "the Hugging Face folder whose tokenizer reads the texts (the model names no folder)", None)
        positions = model_positions(folder) if folder is not None else None
        max_length = self.data.max_length or min(DEFAULT_MAX_LENGTH, positions or DEFAULT_MAX_LENGTH)
        if positions is not None and max_length > positions:
            raise InputError("data.max_length", f"at most the model's max_position_embeddings ({positions}) in {folder}", max_length)
        if (tokenizer, max_length) == (self.data.tokenizer, self.data.max_length):
            return self
        data = self.data.model_copy(update={"tokenizer": tokenizer, "max_length": max_length})
        return self.model_copy(update={"data": data})

    @model_validator(mode="after")
    def _evaluation(self) -> ExperimentConfig:
        if self.data.is_silos and self.evaluation != "federated" and self.data.test is None:
            raise key_error(
                "evaluation", f"federated when data.silos comes without data.test (the server holds no test set), got {self.evaluation!r}"
            )
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Kept: a silo config's partition is its client count only (_silo_clients refuses any other partition key with
        # data.silos), so its dump validates again
        data = handler(self)
        if self.data.is_silos and isinstance(data.get("partition"), dict):
            data["partition"] = {k: v for k, v in data["partition"].items() if k == "num_clients"}
        return data
