"""The update layer's settings of a method entry, declared once here and taken by every method whose tags name them
(``MethodTags.updates``): the aggregation rule (``aggregator``), differential privacy (``dp``: central DP-FedAvg for a
method whose rounds train the framework's cohort, the clients' one-shot upload DP otherwise), the fraction of clients
of a round (``fraction``) and sample-count weights (``weighted``).

A method's ``Params`` inherits the fields it takes (``class FedAvgParams(CohortUpdates, ...)``) instead of re-declaring
them. An entry gives them at its top level (``fedavg: {aggregator: {name: median}}``, the spelling of every release so
far) or grouped under ``updates:`` (``fedavg: {updates: {aggregator: {name: median}}}``): both are read the same way
(:func:`rayfuse.method.resolve_methods` moves the block's keys up; a key given both ways, or one the method does not
take, is refused in one line naming ``methods.<label>.updates.<key>``).
"""

from __future__ import annotations

from pydantic import Field

from rayfuse.method import MethodParams
from rayfuse.updates.central_dp import CentralDPSettings
from rayfuse.updates.privacy import UploadDP
from rayfuse.updates.robust import AggregatorSettings

__all__ = ["AggregatorUpdates", "CentralDPUpdates", "CohortUpdates", "OneShotUpdates", "UploadDPUpdates", "WeightedUpdates"]


class WeightedUpdates(MethodParams):
    """``weighted``: the clients' models weighted by their training-set sizes."""

    weighted: bool = Field(True, description="update layer: weight each client by its number of training samples (false: a plain mean)")


class AggregatorUpdates(MethodParams):
    """``aggregator``: how the clients' models are combined."""

    aggregator: AggregatorSettings = Field(
        default_factory=AggregatorSettings,
        description="update layer: how the clients' models are combined: mean, median, trimmed_mean, krum, bulyan, "
        "geometric_median; clip_norm clips each update first",
    )


class UploadDPUpdates(MethodParams):
    """``dp`` of a one-shot method: each client clips and noises its upload."""

    dp: UploadDP | None = Field(
        None,
        description="update layer: each client clips its upload to clip_norm and adds N(0, (z clip_norm)^2) before it "
        "leaves: {clip_norm, noise_multiplier | target_epsilon, delta, accountant}; null: no DP",
    )


class CentralDPUpdates(MethodParams):
    """``dp`` of a method whose rounds train the framework's cohort: central DP-FedAvg."""

    dp: CentralDPSettings | None = Field(
        None,
        description="update layer: central DP-FedAvg (McMahan et al. 2018): noise_multiplier or target_epsilon, "
        "clip_norm, adaptive, sample_rate, delta, accountant, stop_at_epsilon; null: no DP",
    )


class CohortUpdates(WeightedUpdates, AggregatorUpdates, CentralDPUpdates):
    """Every update setting of a method whose rounds train the framework's cohort (the FedAvg family, FedLoRA)."""

    fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="update layer: fraction of clients sampled per round (Flower's fraction_train; dp samples by its sample_rate)",
    )


class OneShotUpdates(WeightedUpdates, AggregatorUpdates, UploadDPUpdates):
    """Every update setting of a one-shot method that combines the clients' models (average, aligned)."""
