"""Reading a config: a YAML file, ``--set`` overrides, validation into an :class:`ExperimentConfig`, and the dump
of a resolved config (``config.yaml``)."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rayfuse.config.errors import pydantic_input_error
from rayfuse.config.experiment import ExperimentConfig, default_methods
from rayfuse.errors import InputError

__all__ = ["parse_overrides", "apply_overrides", "validate_config", "load_config", "read_config_file", "build_config", "dump_config"]


def parse_overrides(pairs: Sequence[str]) -> list[tuple[list[str], Any]]:
    """Parse ``--set a.b=c`` strings into (key path, YAML value) pairs."""
    parsed = []
    for pair in pairs:
        if "=" not in pair:
            raise InputError("--set", "KEY=VALUE (e.g. partition.num_clients=10)", pair)
        key, _, raw = pair.partition("=")
        parts = key.strip().split(".")
        if not all(re.fullmatch(r"[A-Za-z0-9_@+-]+", p) for p in parts):
            raise InputError("--set", "a dotted key path such as methods.fedavg.rounds", key)
        value = _parse_override_value(raw, key.strip())
        parsed.append((parts, value))
    return parsed


def _parse_override_value(raw: str, key: str) -> Any:
    """A ``--set`` value parsed as YAML (bounded, see :mod:`rayfuse.safeyaml`); text that is not valid YAML stays text."""
    from rayfuse.safeyaml import parse_yaml

    if not raw.strip():
        return None
    try:
        return parse_yaml(raw, f"--set {key}")
    except InputError as exc:
        if exc.expected == "valid YAML":
            return raw
        raise


def apply_overrides(data: dict[str, Any], overrides: Sequence[tuple[list[str], Any]]) -> dict[str, Any]:
    """Return a copy of ``data`` with each (path, value) set, creating mappings on the way."""
    data = copy.deepcopy(data)
    for parts, value in overrides:
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if isinstance(child, list) and part == "methods":  # list shorthand: turn into a mapping first
                child = node[part] = {name: {} for name in child}
            if not isinstance(child, dict):
                raise InputError(".".join(parts[: i + 1]), "a mapping to set a key inside", child)
            node = child
        node[parts[-1]] = value
    return data


def validate_config(data: Mapping[str, Any] | None) -> ExperimentConfig:
    """Validate plain data into an :class:`ExperimentConfig` (the schema; ``methods`` entries are resolved against
    the method registry by :func:`rayfuse.method.resolve_methods`)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise InputError("config", "a mapping of sections (run, data, partition, model, train, federation, methods)", type(data).__name__)
    try:
        config = ExperimentConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise pydantic_input_error(exc) from None
    return config


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read a YAML config (or start from the defaults), apply ``--set`` overrides and validate."""
    return build_config({} if path is None else read_config_file(path), overrides)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping of sections in a YAML config file, not yet validated (raises :class:`InputError`)."""
    from rayfuse.safeyaml import read_yaml_file

    path = Path(path)
    data = read_yaml_file(path, "YAML config file") or {}
    if not isinstance(data, dict):
        raise InputError(str(path), "a YAML mapping of sections", type(data).__name__)
    return data


def build_config(data: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Apply ``--set`` overrides to a config given as plain data, and validate (``data`` is not modified)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise InputError("config", "a mapping of sections (run, data, partition, model, train, federation, methods)", type(data).__name__)
    data = dict(data)
    parsed = parse_overrides(overrides)
    if "methods" not in data and any(parts[0] == "methods" and len(parts) > 1 for parts, _ in parsed):
        # The empty config is the quickstart: `--set methods.fedavg.rounds=3` edits its methods (those its data
        # section, --set data.* included, can run), not replaces them.
        section = apply_overrides(data, [(parts, value) for parts, value in parsed if parts[0] == "data"]).get("data")
        data["methods"] = default_methods(section)
    return validate_config(apply_overrides(data, parsed))


def dump_config(resolved: Mapping[str, Any]) -> str:
    """YAML text of a resolved config (:func:`rayfuse.method.resolved_config`: every default filled in)."""
    return yaml.safe_dump(dict(resolved), sort_keys=False)
