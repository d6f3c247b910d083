"""Experiment tracking: the MLflow sink (``tracking: {mlflow: {uri, experiment}}``).

At the end of a run (its report stage, in the driver) the run is logged to MLflow: one run named after the run folder
in the experiment (``tracking.mlflow.experiment``, default ``run.name``) with the run's config, ``comparison.png`` and
``results``-level parameters, and under it one nested run per method with

* the method's parameters (``methods.<label>`` of the resolved config, nested keys dotted),
* its metric rows from the metrics channel (:mod:`rayfuse.metrics`: the rows ``server.log`` sent as ``metrics``
  events, unrounded, which the method's history keeps across a ``--resume`` too; ``metrics.parquet`` holds the same),
  each at ``step=round``; a client's own row as ``client/<id>/<metric>``; the final metrics as ``final/<metric>``,
* its fused model file (``models/<label>...``) and the plots as artifacts.

Without ``tracking.mlflow.uri`` the store is the run folder's ``mlruns/`` (MLflow's local file store: every run keeps
its own record beside its results; ``mlflow ui --backend-store-uri <run>/mlruns`` shows it). A resumed run replaces
what an earlier attempt of the same run folder logged (its runs are deleted first), so the record matches
``results.json``.

``tracking.mlflow.uri`` is checked before anything starts (:func:`check_tracking`): a folder (or ``file:`` URI) rayfuse
can create or write to, a scheme MLflow stores runs at, and for ``http(s)://`` a server that answers a TCP connect
within :data:`PROBE_TIMEOUT_S` (a run of hours whose record would be lost at its end is refused in seconds instead).
A failure to log at the end (a server gone down meanwhile) is a ``warning`` event, the run's results being in its
folder already; it costs seconds, not MLflow's default retries of about 4 minutes: the server is probed again first,
and rayfuse's own requests retry once with a 10 s timeout (:data:`HTTP_SETTINGS`, unless set in the environment).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rayfuse.config import ExperimentConfig, MlflowConfig
from rayfuse.errors import InputError, suggest
from rayfuse.io import check_writable_folder

__all__ = ["check_tracking", "check_mlflow_uri", "mlflow_uri", "log_to_mlflow", "RUN_TAG", "PROBE_TIMEOUT_S", "HTTP_SETTINGS"]

#: the tag naming the run folder (a hash of its absolute path) on every MLflow run rayfuse logs for it
RUN_TAG = "rayfuse.run_folder"
_INSTALL = "pip install 'rayfuse[mlflow]' (or pip install mlflow-skinny)"
_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_PARAM_BATCH = 100  # and of params
_KEY = "tracking.mlflow.uri"
#: seconds a tracking server has to accept a TCP connection, before start and again before logging
PROBE_TIMEOUT_S = 3.0
#: MLflow's HTTP settings for rayfuse's own requests (MLflow's defaults: 7 retries with backoff, 120 s timeout, about 4
#: minutes against a dead server); a value set in the environment wins
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
#: the keywords MLflow takes as a whole URI
_KEYWORDS = ("databricks", "databricks-uc", "uc")
# a URI's scheme; one letter is a Windows drive, as MLflow reads it
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def check_tracking(cfg: ExperimentConfig) -> None:
    """Before anything starts: a sink the config asks for must be importable (:class:`InputError` at
    ``tracking.mlflow`` naming the install command), and its URI usable (:func:`check_mlflow_uri`)."""
    settings = cfg.tracking.mlflow
    if settings is None:
        return
    if importlib.util.find_spec("mlflow") is None:
        raise InputError(
            "tracking.mlflow",
            "MLflow installed (the MLflow sink logs each method to it)",
            "no module named mlflow",
            f"install it: {_INSTALL}; or drop tracking.mlflow",
        )
    if settings.uri is not None:
        check_mlflow_uri(settings.uri)


def check_mlflow_uri(uri: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """``tracking.mlflow.uri`` before start: a folder or ``file:`` URI rayfuse can create or write to (not a file, nor
    below one), another scheme one MLflow stores runs at, and an ``http(s)://`` server that accepts a TCP connection
    within ``timeout_s`` (unless a proxy carries the requests: the proxy decides). Raises :class:`InputError` at
    ``tracking.mlflow.uri``."""
    if not uri.strip():
        raise InputError(_KEY, "a folder, a file: URI or an http(s):// tracking server", uri, "leave uri out for the run folder's mlruns/")
    scheme = _scheme(uri)
    if scheme in (None, "file"):
        check_writable_folder(_local_path(uri), key=_KEY)
        return
    supported = _supported_schemes()
    if scheme not in supported:
        where = ", ".join(f"{s}:" for s in supported)
        hint = suggest(scheme, supported).strip(" ()")
        raise InputError(
            _KEY, f"a folder or a URI MLflow stores runs at ({where})", uri, hint or f"a folder whose name holds a colon: ./{uri}"
        )
    if scheme in ("http", "https"):
        problem = _unreachable(uri, timeout_s)
        if problem:
            raise InputError(_KEY, f"an MLflow tracking server answering within {timeout_s:g} s", uri, problem)


def mlflow_uri(settings: MlflowConfig, run_dir: str | Path) -> str:
    """The tracking URI of ``settings`` for the run in ``run_dir``: a plain folder as a ``file:`` URI (a relative
    one from the working directory), the run folder's ``mlruns/`` when none is given."""
    uri = settings.uri
    if uri is None:
        return (Path(run_dir) / "mlruns").resolve().as_uri()
    if _scheme(uri) is not None:
        return uri
    return Path(uri).expanduser().resolve().as_uri()


def _scheme(uri: str) -> str | None:
    """The scheme of ``uri`` (lower case; a keyword MLflow takes whole is its own), ``None`` for a folder."""
    if uri in _KEYWORDS:
        return uri
    found = _SCHEME.match(uri)
    return found.group(1).lower() if found else None


def _local_path(uri: str) -> Path:
    """The folder of a plain folder or ``file:`` URI (as :func:`mlflow_uri` reads it)."""
    if _scheme(uri) is None:
        return Path(uri).expanduser()
    return Path(urllib.request.url2pathname(urllib.parse.urlsplit(uri).path))


def _supported_schemes() -> list[str]:
    """The schemes this MLflow stores runs at (its registry: plugins and installed database drivers included)."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry  # not a public API

        found = sorted(s for s in getattr(_tracking_store_registry, "_registry", {}) if s)
    except Exception:
        found = []
    return found or ["file", "http", "https", *_KEYWORDS]


def _unreachable(uri: str, timeout_s: float) -> str | None:
    """Why nothing answers at an ``http(s)://`` URI (a TCP connect within ``timeout_s``), else ``None``."""
    parts = urllib.parse.urlsplit(uri)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        return "not a port"
    if not host:
        return "no host"
    if urllib.request.getproxies().get(parts.scheme.lower()) and not urllib.request.proxy_bypass(host):
        return None  # requests go through the proxy, which may reach what this machine cannot
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        return reason.lower()


@contextmanager
def _bounded_http() -> Iterator[None]:
    """:data:`HTTP_SETTINGS` in the environment (where not set) while rayfuse logs, restored after: MLflow reads them at
    each request."""
    added = [k for k in HTTP_SETTINGS if k not in os.environ]
    os.environ.update({k: HTTP_SETTINGS[k] for k in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def log_to_mlflow(
    settings: MlflowConfig,
    *,
    cfg: ExperimentConfig,
    run_dir: str | Path,
    resolved: Mapping[str, Any],
    summaries: Sequence[Mapping[str, Any]],
    warn: Callable[[str], None],
) -> dict[str, Any] | None:
    """Log the run in ``run_dir`` (its methods' ``summaries``, as ``results.json``'s methods come from) to MLflow.
    Returns ``{"uri", "experiment", "run_id", "methods": {label: run_id}}``, or ``None`` after a ``warn`` when logging
    failed."""
    run_dir = Path(run_dir).resolve()
    uri = mlflow_uri(settings, run_dir)
    experiment = settings.experiment or cfg.run.name
    if uri.startswith("file:"):
        # MLflow 3 keeps its local file store in maintenance mode and refuses it unless this is set; a run's own
        # mlruns/ folder is exactly the local, server-less record this sink is for
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        if _scheme(uri) in ("http", "https") and (problem := _unreachable(uri, PROBE_TIMEOUT_S)):
            raise ConnectionError(problem)  # gone since the run started: warn now, not after MLflow's retries
        with _bounded_http():
            return _log(uri, experiment, run_dir, resolved, summaries)
    except Exception as exc:  # a tracking server down, a store that refuses: the run's results stand without it
        warn(f"tracking.mlflow: not logged to {uri}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return None


def _log(uri: str, experiment: str, run_dir: Path, resolved: Mapping[str, Any], summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    folder = hashlib.sha256(str(run_dir).encode("utf-8")).hexdigest()[:16]
    for old in client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{folder}'"):
        client.delete_run(old.info.run_id)  # an earlier attempt of this run folder (before a --resume)
    tags = {RUN_TAG: folder, "rayfuse.run_dir": str(run_dir)}
    parent = client.create_run(experiment_id, run_name=run_dir.name, tags=tags)
    parent_id = parent.info.run_id
    run_params = {
        "dataset": (resolved.get("data") or {}).get("dataset"),
        "num_clients": (resolved.get("partition") or {}).get("num_clients"),
        "partition": (resolved.get("partition") or {}).get("method"),
        "model": (resolved.get("model") or {}).get("name"),
        "seed": (resolved.get("run") or {}).get("seed"),
        "methods": ",".join(s["label"] for s in summaries),
    }
    client.log_batch(parent_id, params=[Param(k, _text(v)) for k, v in run_params.items()])
    _log_files(client, parent_id, run_dir, ["config.yaml", "partition.json", "comparison.png"], "")
    methods: dict[str, str] = {}
    now = int(time.time() * 1000)
    for summary in summaries:
        label = str(summary["label"])
        child = client.create_run(
            experiment_id,
            run_name=label,
            tags={**tags, "mlflow.parentRunId": parent_id, "rayfuse.method": label, "rayfuse.method_name": str(summary.get("method"))},
        )
        run_id = child.info.run_id
        params = [Param(k, _text(v)) for k, v in _flatten((resolved.get("methods") or {}).get(label) or {}).items()]
        for i in range(0, len(params), _PARAM_BATCH):
            client.log_batch(run_id, params=params[i : i + _PARAM_BATCH])
        metrics = [
            Metric(_metric_key(row), float(row["value"]), now, int(row["round"]))
            for row in summary.get("history", [])
            if _finite(row.get("value"))
        ]
        last = max((int(r["round"]) for r in summary.get("history", [])), default=0)
        metrics += [Metric(f"final/{k}", float(v), now, last) for k, v in (summary.get("metrics") or {}).items() if _finite(v)]
        for i in range(0, len(metrics), _BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + _BATCH])
        files = [str(summary["model_file"])] if summary.get("model_file") else []
        _log_files(client, run_id, run_dir, files, "model")
        _log_files(client, run_id, run_dir, ["comparison.png"], "plots")
        client.set_tag(run_id, "rayfuse.seconds", _text(summary.get("seconds")))
        client.set_terminated(run_id)
        methods[label] = run_id
    client.set_terminated(parent_id)
    return {"uri": uri, "experiment": experiment, "run_id": parent_id, "methods": methods}


def _log_files(client: Any, run_id: str, run_dir: Path, names: Sequence[str], folder: str) -> None:
    for name in names:
        path = run_dir / name
        if path.is_file():
            client.log_artifact(run_id, str(path), folder or None)


def _metric_key(row: Mapping[str, Any]) -> str:
    """A history row's MLflow key: the metric's name, ``client/<id>/<name>`` for a client's own row."""
    client = row.get("client")
    return str(row["metric"]) if client is None else f"client/{int(client)}/{row['metric']}"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters as ``a.b`` keys (MLflow params are flat text)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _text(value: Any) -> str:
    """A param's value as MLflow stores it (text, at most 6000 characters): JSON for lists and mappings."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:6000]
