"""Sweep spaces: the YAML files of ``tune_spaces/``, loaded and validated before any cluster work.

A space names a base job, the config keys to vary and a Tune domain for each; ``rayfuse tune`` (``actors.tune``)
turns it into a Ray Tune ``Tuner`` where one trial is one whole federation. Everything here is plain data and
validation (no Ray), so a bad space fails with one line (exit 2) before Ray starts::

    base: jobs/gems_digits_mlp.yaml      # the job each trial runs (relative to the working dir or the checkout)
    methods: [gems]                      # optional: only these method labels of the base job run in a trial
    set:                                 # optional: fixed overrides, as --set
      methods.gems.public_samples: [200]
    space:                               # dotted config keys of the base job -> a Tune domain
      methods.gems.epsilon: {grid: [0.3, 0.4, 0.5]}
      methods.gems.m_epsilon: {choice: [30, 50, 70]}
      methods.gems.hidden_epsilon: {uniform: [0.5, 1.5]}
    metric: fused/gems/accuracy          # fused/<method label>/<metric>, reported by every trial
    mode: max
    num_samples: 1                       # samples of the random domains (x every grid point); --samples N
    scheduler: {type: asha, max_t: 20, grace_period: 2}   # optional: ASHA over the rounds of a multi-round method
    max_failures: 1                      # Tune's FailureConfig: retries of a failed trial (it resumes its run folder)

Domains (Ray Tune's): ``grid`` and ``choice`` take a list; ``uniform`` / ``loguniform`` / ``randint`` /
``lograndint`` take ``[low, high]``; ``quniform`` / ``qloguniform`` / ``qrandint`` / ``qlograndint`` take
``[low, high, q]``; ``randn`` takes ``[mean, sd]`` and ``qrandn`` ``[mean, sd, q]``. A swept key must be a key of the
base job's resolved config (``rayfuse validate JOB`` prints them), and every value a domain can produce at its ends
(each listed value, ``low`` and ``high``) must pass the config's validation.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from rayfuse.config import (
    ExperimentConfig,
    StrictSchema,
    apply_overrides,
    parse_overrides,
    pydantic_input_error,
    read_config_file,
    validate_config,
)
from rayfuse.errors import InputError, suggest
from rayfuse.method import resolve_methods
from rayfuse.runner import prepare_run

__all__ = ["Domain", "SchedulerSpec", "SweepSpec", "load_space", "DOMAINS", "resolve_job_path"]

# name -> number of arguments (None: a non-empty list of values)
DOMAINS: dict[str, int | None] = {
    "grid": None,
    "choice": None,
    "uniform": 2,
    "loguniform": 2,
    "randint": 2,
    "lograndint": 2,
    "randn": 2,
    "quniform": 3,
    "qloguniform": 3,
    "qrandint": 3,
    "qlograndint": 3,
    "qrandn": 3,
}
_INTEGER = {"randint", "lograndint", "qrandint", "qlograndint"}
_LOG = {"loguniform", "qloguniform", "lograndint", "qlograndint"}
# Mappings whose keys are free (a swept key may go below them without being in the resolved config).
_FREE_FORM = (("data", "options"), ("federation", "ray_init"))


@dataclass(frozen=True)
class Domain:
    """One Tune domain: ``kind`` (a key of :data:`DOMAINS`) and its arguments (or values)."""

    kind: str
    args: tuple[Any, ...]

    @property
    def is_grid(self) -> bool:
        return self.kind == "grid"

    def probe_values(self) -> list[Any]:
        """The values checked against the config: every listed value, or the ends of a range."""
        if DOMAINS[self.kind] is None:
            return list(self.args)
        if self.kind in ("randn", "qrandn"):
            return [self.args[0]]
        low, high = self.args[0], self.args[1]
        if self.kind in _INTEGER:
            return [int(low), int(high) - 1 if self.kind in ("randint", "lograndint") else int(high)]  # randint's high is exclusive
        return [float(low), float(high)]

    def to_yaml(self) -> dict[str, Any]:
        return {self.kind: list(self.args)}


@dataclass(frozen=True)
class SchedulerSpec:
    type: str
    time_attr: str = "round"
    max_t: int = 10
    grace_period: int = 1
    reduction_factor: float = 2.0


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep space (see the module docstring)."""

    name: str
    path: Path
    base_path: Path
    base: dict[str, Any]  # the base job's data with ``set`` applied and ``methods`` filtered
    space: dict[str, Domain]
    metric: str
    mode: str
    num_samples: int
    scheduler: SchedulerSpec | None
    max_failures: int
    max_concurrent_trials: int | None
    storage: str | None
    placement_strategy: str
    methods: list[str] = field(default_factory=list)

    @property
    def grid_size(self) -> int:
        return math.prod(len(d.args) for d in self.space.values() if d.is_grid)

    @property
    def num_trials(self) -> int:
        return self.grid_size * self.num_samples

    def trial_data(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """The base job's data with one trial's sampled values set (plain data, not yet validated)."""
        return apply_overrides(self.base, [(key.split("."), value) for key, value in sample.items()])

    def trial_config(self, sample: Mapping[str, Any]) -> ExperimentConfig:
        cfg = validate_config(self.trial_data(sample))
        resolve_methods(cfg.methods)
        return cfg


class _SweepSchema(StrictSchema):
    """A sweep file's schema (:class:`rayfuse.config.StrictSchema`)."""


class _SchedulerFile(_SweepSchema):
    type: Literal["asha", "fifo"] = "asha"
    time_attr: str = Field("round", min_length=1, description="the reported counter ASHA compares trials at")
    max_t: int | None = Field(None, ge=1, description="default: the rounds of the sweep's multi-round method")
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2.0, gt=1)


class _SpaceFile(_SweepSchema):
    base: str = Field(min_length=1, description="the job each trial runs")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="sweep name (default: the file's stem)")
    methods: list[str] | None = Field(None, min_length=1, description="method labels of the base job that a trial runs")
    set: dict[str, Any] = Field(default_factory=dict, description="fixed overrides of the base job (dotted keys)")
    space: dict[str, Any] = Field(min_length=1, description="dotted config keys -> Tune domains")
    metric: str = Field(min_length=1, description="fused/<method label>/<metric name>")
    mode: Literal["max", "min"] = "max"
    num_samples: int = Field(1, ge=1)
    scheduler: _SchedulerFile | None = None
    max_failures: int = Field(1, ge=-1, description="Tune FailureConfig.max_failures (-1: unlimited)")
    max_concurrent_trials: int | None = Field(None, ge=1)
    storage: str | None = Field(None, min_length=1, description="Tune storage path (default: <base run.storage>/tune)")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


def resolve_job_path(given: str, space_file: Path) -> Path:
    """``given`` as is (relative to the working directory), else relative to the space file or its checkout."""
    candidates = [Path(given), space_file.parent / given, space_file.parent.parent / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise InputError(f"{space_file}: base", "an existing job YAML (relative to the working directory or the checkout)", given)


def _parse_domain(where: str, raw: Any) -> Domain:
    forms = ", ".join(
        f"{{{k}: {'[values...]' if n is None else '[' + ', '.join(['low', 'high', 'q'][:n]) + ']'}}}" for k, n in DOMAINS.items()
    )
    if not isinstance(raw, Mapping) or len(raw) != 1:
        raise InputError(where, "one Tune domain, e.g. {grid: [0.1, 0.2]} or {loguniform: [1e-3, 1]}", raw)
    ((kind, args),) = raw.items()
    if kind not in DOMAINS:
        raise InputError(where, f"a Tune domain in {{{', '.join(DOMAINS)}}}", kind, suggest(kind, DOMAINS).strip(" ()"))
    arity = DOMAINS[kind]
    if not isinstance(args, list) or not args:
        raise InputError(
            f"{where}.{kind}",
            "a non-empty list of values" if arity is None else f"a list [{', '.join(['low', 'high', 'q'][:arity])}]",
            args,
        )
    if arity is None:
        return Domain(kind, tuple(args))
    names = ["low", "high", "q"] if not kind.endswith("randn") else ["mean", "sd", "q"]
    if len(args) != arity or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in args):
        raise InputError(f"{where}.{kind}", f"{arity} numbers [{', '.join(names[:arity])}]", args, f"e.g. {forms.split(', {')[0]}")
    if kind.endswith("randn"):
        if args[1] <= 0:
            raise InputError(f"{where}.{kind}", "sd > 0", args[1])
    else:
        low, high = args[0], args[1]
        if not low < high:
            raise InputError(f"{where}.{kind}", "low < high", args)
        if kind in _LOG and low <= 0:
            raise InputError(f"{where}.{kind}", "low > 0 for a log domain", low)
        if kind in _INTEGER and not all(float(a).is_integer() for a in (low, high)):
            raise InputError(f"{where}.{kind}", "whole numbers for an integer domain", args)
    if arity == 3 and args[2] <= 0:
        raise InputError(f"{where}.{kind}", "q > 0", args[2])
    return Domain(kind, tuple(args))


def _check_key(where: str, key: str, resolved: Mapping[str, Any]) -> None:
    parts = key.split(".")
    if not all(re.fullmatch(r"[A-Za-z0-9_@+-]+", p) for p in parts):
        raise InputError(where, "a dotted config key path such as methods.gems.epsilon", key)
    node: Any = resolved
    for i, part in enumerate(parts):
        if tuple(parts[:i]) in _FREE_FORM:
            return
        if not isinstance(node, Mapping) or part not in node:
            known = sorted(str(k) for k in node) if isinstance(node, Mapping) else []
            prefix = ".".join(parts[:i]) or "the config"
            hint = suggest(part, known).strip(" ()")
            expected = (
                f"a key of the base job's config; {prefix} has {{{', '.join(known)}}}"
                if known
                else f"a key of the base job's config ({prefix} is a value, not a section)"
            )
            raise InputError(where, expected, key, hint or "rayfuse validate <base job> prints every key")
        node = node[part]


def _default_name(path: Path) -> str:
    """The sweep's name from its file's stem, made a valid ``run.name`` start (its trials are ``<name>-<trial id>``)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem).lstrip("_.-")
    return name or "sweep"


def load_space(path: str | Path, *, samples: int | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SweepSpec:
    """Read and validate a sweep space; raise :class:`InputError` (one line) on the first problem.

    ``samples`` overrides ``num_samples`` (``--samples``); ``overrides`` are ``--set`` strings applied to the base
    job before the space's own ``set``.
    """
    from rayfuse.safeyaml import read_yaml_file

    path = Path(path)
    raw = read_yaml_file(path, "sweep space YAML file")
    if not isinstance(raw, Mapping):
        raise InputError(str(path), "a YAML mapping (base, space, metric...)", type(raw).__name__)
    try:
        spec = _SpaceFile.model_validate(dict(raw))
    except ValidationError as exc:
        err = pydantic_input_error(exc, model=_SpaceFile)
        raise InputError(f"{path}: {err.path}", err.expected, err.got, err.hint) from None

    base_path = resolve_job_path(spec.base, path)
    from rayfuse.config import load_config

    load_config(base_path, list(overrides))  # the base job itself must be valid (its own errors name its keys)
    data = read_config_file(base_path)
    parsed = parse_overrides(list(overrides))
    fixed = []
    for key, value in spec.set.items():
        if not all(re.fullmatch(r"[A-Za-z0-9_@+-]+", p) for p in key.split(".")):
            raise InputError(f"{path}: set", "dotted config key paths such as methods.gems.num_samples", key)
        fixed.append((key.split("."), value))
    data = apply_overrides(apply_overrides(data, parsed), fixed)
    if spec.methods is not None:
        methods = data.get("methods") or {}
        methods = {m: {} for m in methods} if isinstance(methods, list) else dict(methods)
        for label in spec.methods:
            if label not in methods:
                raise InputError(
                    f"{path}: methods",
                    f"method labels of the base job {{{', '.join(methods)}}}",
                    label,
                    suggest(label, methods).strip(" ()"),
                )
        data["methods"] = {label: methods[label] for label in spec.methods}
    try:
        base = prepare_run(validate_config(data))
    except InputError as exc:
        raise InputError(f"{path}: set {exc.path}", exc.expected, exc.got, exc.hint) from None
    resolved = base.resolved()
    data = copy.deepcopy(data)

    space: dict[str, Domain] = {}
    for key, raw_domain in spec.space.items():
        where = f"{path}: space.{key}"
        _check_key(where, key, resolved)
        domain = _parse_domain(where, raw_domain)
        for value in domain.probe_values():
            try:  # the schema, the methods' parameters and every method's check against the run (nothing starts)
                prepare_run(validate_config(apply_overrides(data, [(key.split("."), value)])))
            except InputError as exc:
                raise InputError(
                    where, f"values the config accepts ({exc.path}: {exc.expected})", value, f"domain {domain.to_yaml()}"
                ) from None
        space[key] = domain

    labels = [s.label for s in base.specs]
    match = re.fullmatch(r"fused/([^/]+)/([A-Za-z0-9_]+)", spec.metric)
    if not match or match.group(1) not in labels:
        raise InputError(
            f"{path}: metric",
            f"fused/<method label>/<metric> with a label in {{{', '.join(labels)}}}",
            spec.metric,
            "e.g. fused/" + labels[0] + "/accuracy",
        )

    scheduler = None
    if spec.scheduler is not None and spec.scheduler.type == "asha":
        multi = [s for s in base.specs if s.tags.multi_round]
        if len(multi) != 1 or multi[0].label != match.group(1):
            raise InputError(
                f"{path}: scheduler",
                "ASHA over exactly one multi-round method in a trial, the one the metric "
                "names (methods: [<label>], metric: fused/<label>/...)",
                f"multi-round methods {[s.label for s in multi]} and metric {spec.metric}",
            )
        max_t = spec.scheduler.max_t or int(getattr(multi[0].params, "rounds", 1))
        scheduler = SchedulerSpec("asha", spec.scheduler.time_attr, max_t, spec.scheduler.grace_period, spec.scheduler.reduction_factor)
    storage = spec.storage
    if storage is not None and "://" in storage:
        raise InputError(f"{path}: storage", "a local or shared-file-system folder (trials read the model cache there)", storage)
    num_samples = samples if samples is not None else spec.num_samples
    if num_samples < 1:
        raise InputError("--samples", "a number >= 1", num_samples)
    return SweepSpec(
        name=spec.name or _default_name(path),
        path=path,
        base_path=base_path,
        base=data,
        space=space,
        metric=spec.metric,
        mode=spec.mode,
        num_samples=num_samples,
        scheduler=scheduler,
        max_failures=spec.max_failures,
        max_concurrent_trials=spec.max_concurrent_trials,
        storage=storage,
        placement_strategy=spec.placement_strategy,
        methods=labels,
    )


def grid_points(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every combination of the grid domains (for display and tests)."""
    keys = [k for k, d in spec.space.items() if d.is_grid]
    return [dict(zip(keys, values)) for values in itertools.product(*(spec.space[k].args for k in keys))]
