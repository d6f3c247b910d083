"""The ``tracking`` section: experiment-tracking sinks fed by the run's metrics channel (:mod:`rayfuse.tracking`)."""

from __future__ import annotations

from pydantic import Field

from rayfuse.config.base import StrictModel

__all__ = ["MlflowConfig", "TrackingConfig"]


class MlflowConfig(StrictModel):
    """``tracking.mlflow``: log each method of the run to MLflow (``rayfuse.tracking``; needs ``pip install 'rayfuse[mlflow]'``)."""

    uri: str | None = Field(
        None,
        description="MLflow tracking URI: a folder (relative to the working directory), file:..., "
        "http(s)://... of a tracking server. Default: the run folder's mlruns/ (a local file store)",
    )
    experiment: str | None = Field(None, min_length=1, description="MLflow experiment name. Default: run.name")


class TrackingConfig(StrictModel):
    """``tracking``: experiment-tracking sinks fed by the run's metrics channel. Where results are also sent, not what
    is computed: no part of a run folder's state or of a cache key."""

    mlflow: MlflowConfig | None = Field(
        None,
        description="log each method as an MLflow run (params, per-round metrics, "
        "the fused model and the plots), nested under one run of the experiment; "
        "{} for the defaults",
    )
