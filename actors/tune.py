"""``rayfuse tune``: a Ray Tune sweep where one trial is one whole federation.

* The space (``rayfuse.sweep.SweepSpec``, validated before Ray starts) becomes Tune's ``param_space``: one flat entry
  per dotted config key, with Tune's domain objects.
* Each trial is gang-scheduled with a ``PlacementGroupFactory``: a bundle for the trial's driver and the coordinator,
  one per client actor, one for the coordinator's server-side tasks (``actors.backend.trial_bundles``, computed
  from the trial's own config, so a sweep over the number of clients gets the right group per trial). The trial
  runs the job with :class:`actors.backend.RayBackend` inside that group.
* Reports (``tune.report``): every round of a multi-round method (``round``, ``fused/<label>/<metric>``) so ASHA can
  stop a trial early, then a final report with every stage: ``time/<stage>`` seconds, ``local/trained`` (clients
  trained by this trial; 0 when the local models came from the cache), ``local/cache_hit``, and
  ``fused/<label>/<metric>`` for every method.
* Local models: every trial sets ``run.model_cache`` to ``<storage>/model-cache``, where each client keeps its trained
  local model under a content key (data, its split, model, train config, seed), so a sweep over fusion-only knobs
  trains the clients once.
* Fault tolerance: ``FailureConfig(max_failures)`` retries a failed trial, which resumes its own run folder
  (``<storage>/<name>/runs/<trial id>``) like ``rayfuse run --resume``; ``rayfuse tune SPACE --resume`` restores an
  interrupted sweep with ``Tuner.restore``, once :func:`rayfuse.sweep_seal.verify_sweep` has checked that this
  user's rayfuse sealed the folder as it is (Tune unpickles its state) and that no one else can write it.
* Results: ``<storage>/<name>/results.parquet`` (Tune's result table) and ``best.yaml`` (the best trial's config,
  ready for ``rayfuse run``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import tune

from actors.backend import RayBackend, trial_bundles
from rayfuse.config import apply_overrides, validate_config
from rayfuse.errors import InputError, RunFailure
from rayfuse.method import resolved_config
from rayfuse.metrics import metric_row
from rayfuse.runner import Backend, run_experiment
from rayfuse.sweep import Domain, SweepSpec
from rayfuse.sweep_seal import PINNED, check_sweep_folder, sealing, verify_sweep

__all__ = ["run_sweep", "run_trial", "to_tune_domain", "param_space", "sweep_paths"]


def to_tune_domain(domain: Domain) -> Any:
    """The Tune search-space object of a validated :class:`rayfuse.sweep.Domain`."""
    if domain.kind == "grid":
        return tune.grid_search(list(domain.args))
    if domain.kind == "choice":
        return tune.choice(list(domain.args))
    return getattr(tune, domain.kind)(*domain.args)


def param_space(spec: SweepSpec) -> dict[str, Any]:
    return {key: to_tune_domain(domain) for key, domain in spec.space.items()}


def sweep_paths(spec: SweepSpec, storage: str | Path | None = None) -> dict[str, Path]:
    """Where a sweep lives: Tune's storage path, the experiment folder, run folders, the model cache, outputs."""
    base_storage = Path((spec.base.get("run") or {}).get("storage", "runs")) / "tune"
    root = Path(storage or spec.storage or base_storage).resolve()
    experiment = root / spec.name
    return {
        "storage": root,
        "experiment": experiment,
        "runs": experiment / "runs",
        "cache": root / "model-cache",
        "results": experiment / "results.parquet",
        "best": experiment / "best.yaml",
    }


class _TrialReporter:
    """The run's event printer inside a trial: collects stage timings and local-model facts, reports rounds."""

    enabled = False

    def __init__(self, metric: str, report: Callable[[dict[str, Any]], None]) -> None:
        self.metric = metric
        self.report = report
        self.values: dict[str, Any] = {"local/trained": 0, "local/cache_hit": 0}
        self.round: int | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "stage_end" and "seconds" in event:
            self.values[f"time/{event['stage']}"] = event["seconds"]
        elif kind == "client_trained":
            self.values["local/trained"] += 1
        elif kind == "local_models_restored":
            self.values["local/cache_hit"] = int(event.get("source") == "cache")
        elif (row := metric_row(event)) is not None and row.client is None:
            # the metrics channel (unrounded), never the progress events' display values: ASHA compares trials on
            # the numbers the method logged
            label = row.method
            self.round = row.round
            for name, value in row.values.items():
                self.values[f"fused/{label}/{name}"] = value
            if self.metric in self.values and self.metric.startswith(f"fused/{label}/"):
                self.report({**self.values, "round": self.round, "stage": label})


def _run_trial(config: dict[str, Any], *, base: dict[str, Any], name: str, runs: str, cache: str, metric: str) -> None:
    """One Tune trial: :func:`run_trial` on Ray in the trial's placement group, reporting to Tune."""
    backend = RayBackend(placement_group=ray.util.get_current_placement_group())
    trial_id = tune.get_context().get_trial_id()
    run_trial(config, trial_id=trial_id, backend=backend, report=tune.report, base=base, name=name, runs=runs, cache=cache, metric=metric)


def run_trial(
    config: dict[str, Any],
    *,
    trial_id: str,
    backend: Backend,
    report: Callable[[dict[str, Any]], None],
    base: dict[str, Any],
    name: str,
    runs: str,
    cache: str,
    metric: str,
) -> None:
    """The base job with one trial's values, run as a federation on ``backend`` in the run folder
    ``<runs>/<trial_id>`` (resumed where an earlier attempt of the trial left one: Tune's retry) with the sweep's model
    cache; ``report`` gets every round of the metric's method and a final report (``stage: done``)."""
    data = apply_overrides(base, [(key.split("."), value) for key, value in config.items()])
    run = data.setdefault("run", {})
    run.update(name=f"{name}-{trial_id}", storage=runs, model_cache=cache)
    data.setdefault("federation", {})["backend"] = "ray"
    cfg = validate_config(data)
    run_dir = Path(runs) / trial_id
    resume = (run_dir / "config.yaml").is_file() and (run_dir / "partition.json").is_file()  # a retry of this trial
    reporter = _TrialReporter(metric, report)
    results = run_experiment(cfg, backend, run_dir, resume=resume, printer=reporter, show_tables=False)
    final = dict(reporter.values)
    for stage, seconds in results["timings"].items():
        final[f"time/{stage}"] = seconds
    for label, entry in results["methods"].items():
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("seconds",):
                final[f"fused/{label}/{key}"] = value
    if reporter.round is not None:
        final["round"] = reporter.round
    final["resumed"] = int(resume)
    report({**final, "stage": "done"})


def _connect(spec: SweepSpec, address: str | None) -> bool:
    """Attach to ``address`` / ``RAY_ADDRESS`` / a job's cluster, or start a local Ray; True if we connected."""
    if ray.is_initialized():
        return False
    data = apply_overrides(spec.base, [(["federation", "address"], address)] if address else [])
    backend = RayBackend()
    backend._connect(validate_config(data))
    return True


def _check_fits(bundles: list[dict[str, float]], address: str | None) -> None:
    """On a Ray rayfuse started itself (no autoscaler), a trial whose group can never be placed is bad input."""
    if address or os.environ.get("RAY_ADDRESS"):
        return
    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    for key, value in need.items():
        if value > total.get(key, 0.0) + 1e-9:
            raise InputError(
                "federation",
                f"a trial that fits this Ray ({total.get(key, 0.0):g} {key}; a trial needs "
                f"{value:g} for {len(bundles) - 2} client actors + driver + tasks)",
                bundles,
                "give clients fewer CPUs (set: {federation.clients.num_cpus: 0.5}) or use a bigger cluster",
            )


def _scalar_table(frame: Any) -> Any:
    """Tune's result table with object columns as text (Parquet needs one type per column)."""
    frame = frame.copy()
    for column in frame.columns:
        if frame[column].dtype == object:
            frame[column] = frame[column].map(lambda v: None if v is None else str(v))
    return frame


def run_sweep(
    spec: SweepSpec, *, address: str | None = None, resume: bool = False, storage: str | Path | None = None, verbose: int = 1
) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) the sweep; write the result table and the best config; return a summary."""
    paths = sweep_paths(spec, storage)
    exists = tune.Tuner.can_restore(str(paths["experiment"]))
    if resume and not exists:
        raise InputError("--resume", "a sweep folder to continue", str(paths["experiment"]), "run without --resume to start it")
    if exists and not resume:
        raise InputError(
            "sweep",
            "a new sweep name or --resume",
            f"{paths['experiment']} exists",
            "continue it with --resume, or set name: in the space / --storage elsewhere",
        )
    # Tuner.restore unpickles the folder's state: only a folder this user's rayfuse sealed, that no one else can write
    pinned = verify_sweep(paths["experiment"], paths["storage"]) if resume else {}
    check_sweep_folder(paths["storage"], paths["experiment"])
    first = spec.trial_config({k: d.probe_values()[0] for k, d in spec.space.items()})
    started = _connect(spec, address)
    try:
        _check_fits(trial_bundles(first), address)
        trainable = tune.with_parameters(
            _run_trial, base=spec.base, name=spec.name, runs=str(paths["runs"]), cache=str(paths["cache"]), metric=spec.metric
        )

        def resources(config: dict[str, Any]) -> tune.PlacementGroupFactory:
            return tune.PlacementGroupFactory(trial_bundles(spec.trial_config(config)), strategy=spec.placement_strategy)

        trainable = tune.with_resources(trainable, resources)
        if resume:
            tuner = tune.Tuner.restore(str(paths["experiment"]), trainable=trainable, resume_errored=True)
        else:
            scheduler = None
            if spec.scheduler is not None:
                from ray.tune.schedulers import ASHAScheduler

                scheduler = ASHAScheduler(
                    time_attr=spec.scheduler.time_attr,
                    max_t=spec.scheduler.max_t,
                    grace_period=spec.scheduler.grace_period,
                    reduction_factor=spec.scheduler.reduction_factor,
                    stop_last_trials=False,
                )  # a trial reaching max_t finishes its run and reports
            tuner = tune.Tuner(
                trainable,
                param_space=param_space(spec),
                tune_config=tune.TuneConfig(
                    metric=spec.metric,
                    mode=spec.mode,
                    num_samples=spec.num_samples,
                    scheduler=scheduler,
                    max_concurrent_trials=spec.max_concurrent_trials,
                ),
                run_config=tune.RunConfig(
                    name=spec.name,
                    storage_path=str(paths["storage"]),
                    verbose=verbose,
                    failure_config=tune.FailureConfig(max_failures=spec.max_failures),
                ),
            )
        with sealing(paths["experiment"], pinned={k: v for k, v in pinned.items() if k in PINNED}):  # what --resume verifies
            grid = tuner.fit()
    finally:
        if started and ray.is_initialized():
            ray.shutdown()  # disconnects; stops the Ray only if this process started it
    return _write_outputs(spec, grid, paths)


def _write_outputs(spec: SweepSpec, grid: Any, paths: dict[str, Path]) -> dict[str, Any]:
    from rayfuse.io import atomic_write_text

    frame = grid.get_dataframe()
    paths["experiment"].mkdir(parents=True, exist_ok=True)
    tmp = paths["results"].with_suffix(".parquet.tmp")
    _scalar_table(frame).to_parquet(tmp, index=False)
    os.replace(tmp, paths["results"])
    errors = [str(r.error).splitlines()[0] for r in grid if r.error is not None]
    summary: dict[str, Any] = {
        "experiment": str(paths["experiment"]),
        "results": str(paths["results"]),
        "trials": len(grid),
        "errors": errors,
        "best": None,
    }
    scored = [
        r for r in grid if r.metrics and isinstance(r.metrics.get(spec.metric), (int, float)) and math.isfinite(r.metrics[spec.metric])
    ]
    if scored:
        best = grid.get_best_result(metric=spec.metric, mode=spec.mode, scope="last")
        cfg = spec.trial_config(best.config)
        data = resolved_config(cfg)
        data["run"]["name"] = f"{spec.name}-best"
        header = (
            f"# Best trial of sweep {spec.name!r} ({spec.path}): {spec.metric} = {best.metrics[spec.metric]:.6g} ({spec.mode})\n"
            f"# swept values: {yaml.safe_dump(best.config, default_flow_style=True).strip()}\n"
            f"# rayfuse run {paths['best']}\n"
        )
        atomic_write_text(paths["best"], header + yaml.safe_dump(data, sort_keys=False))
        summary["best"] = {"config": best.config, "metric": best.metrics[spec.metric], "file": str(paths["best"])}
    summary["table"] = [
        {
            "trial": r.metrics.get("trial_id"),
            **r.config,
            spec.metric: r.metrics.get(spec.metric),
            "local/trained": r.metrics.get("local/trained"),
            "error": r.error is not None,
        }
        for r in grid
    ]
    if not scored:
        raise RunFailure(f"no trial reported {spec.metric} ({len(errors)} failed: {errors[:1]}); see {paths['experiment']}")
    return summary
