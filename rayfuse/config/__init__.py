"""The experiment config: one validated schema for the CLI, Ray Jobs and Ray Tune.

A config is YAML with the sections ``run``, ``data``, ``partition``, ``model``, ``train``, ``federation`` and
``methods``, and the key ``evaluation`` (central | federated | both: see :mod:`rayfuse.evaluation`). Every key has
a default; the defaults are the quickstart job (digits, 5 label-skewed clients, the baselines), so an empty file is a
valid config. Unknown keys, wrong types and impossible values are rejected before any cluster work starts, with one
line that names the key path, the expected value and what was given::

    partition.alpha: expected a number greater than 0, got -1.0

``--set a.b=c`` overrides any key; the value is parsed as YAML (``--set methods.fedavg.rounds=20``,
``--set model.hidden=[128,64]``).

``methods`` maps a label to the method's parameters. The label is the method's registered name, or any name with a
``method:`` key, so one method can run twice with different parameters::

    methods:
      fedavg: {rounds: 20}
      fedprox-strong: {method: fedprox, mu: 0.5}

The schema is split by section (:mod:`rayfuse.config.data` with ``partition``, :mod:`~rayfuse.config.model`,
:mod:`~rayfuse.config.train`, :mod:`~rayfuse.config.federation`, :mod:`~rayfuse.config.experiment` with ``run`` and the
checks across sections, on :mod:`~rayfuse.config.base`); :mod:`~rayfuse.config.errors` turns pydantic's errors into one
line and :mod:`~rayfuse.config.load` reads files and ``--set`` overrides. Every name is importable from
``rayfuse.config``.
"""

from __future__ import annotations

from rayfuse.config.base import StrictModel, StrictSchema, refuse_boolean_number
from rayfuse.config.data import (
    MAX_IMAGE_PIXELS,
    PATH_VARIABLE,
    SILO_FORMATS,
    DataConfig,
    DatasetSource,
    PartitionConfig,
    SiloSource,
    SiloSpec,
    TargetConfig,
    label_value,
    silo_source_kind,
)
from rayfuse.config.errors import pydantic_input_error, validate_file_section
from rayfuse.config.experiment import CONFIG_SECTIONS, DEFAULT_METHODS, QUICKSTART_PUBLIC_SIZE, ExperimentConfig, RunConfig
from rayfuse.config.federation import (
    AttackSpec,
    ClientOverride,
    FaultSpec,
    FederationConfig,
    ResourcesConfig,
    SecureAggregationConfig,
    other_model_clients,
)
from rayfuse.config.load import apply_overrides, build_config, dump_config, load_config, parse_overrides, read_config_file, validate_config
from rayfuse.config.model import ModelConfig
from rayfuse.config.tracking import MlflowConfig, TrackingConfig
from rayfuse.config.train import DPSGDConfig, TrainConfig

__all__ = [
    "ExperimentConfig",
    "TrackingConfig",
    "MlflowConfig",
    "RunConfig",
    "DataConfig",
    "SiloSource",
    "SiloSpec",
    "SILO_FORMATS",
    "PATH_VARIABLE",
    "silo_source_kind",
    "PartitionConfig",
    "ModelConfig",
    "TrainConfig",
    "DPSGDConfig",
    "FederationConfig",
    "ResourcesConfig",
    "SecureAggregationConfig",
    "ClientOverride",
    "other_model_clients",
    "FaultSpec",
    "AttackSpec",
    "CONFIG_SECTIONS",
    "pydantic_input_error",
    "validate_file_section",
    "refuse_boolean_number",
    "StrictSchema",
    "build_config",
    "load_config",
    "parse_overrides",
    "read_config_file",
    "apply_overrides",
    "validate_config",
    "dump_config",
    "DEFAULT_METHODS",
    "QUICKSTART_PUBLIC_SIZE",
    "StrictModel",
    "DatasetSource",
    "TargetConfig",
    "label_value",
    "MAX_IMAGE_PIXELS",
]
