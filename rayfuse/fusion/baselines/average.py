"""``average``: naive parameter averaging of the local models (one shot, no alignment).

``w = sum_k (n_k / n) w_k`` (or uniform weights). With independently trained networks this ignores the
permutation symmetry of hidden units, which is exactly what matching-based fusion (PFNM, KL-fusion, GEMS) fixes;
with ``train.shared_init`` the local models start from one initialisation, the friendliest case for averaging.

``aggregator`` replaces the average by a robust rule (:mod:`rayfuse.fusion.robust`); its ``clip_norm`` clips each
local model's distance to the run's initial model (the clients' common start with ``train.shared_init``). The default,
``mean``, is the average above.
"""

from __future__ import annotations

from pydantic import Field

from rayfuse.fusion.robust import AggregatorSettings, aggregate_updates, check_aggregator
from rayfuse.method import Method, MethodParams, MethodResult, RunSetup, ServerContext, register_method


class AverageParams(MethodParams):
    weighted: bool = True  # weight each client by its number of training samples
    aggregator: AggregatorSettings = Field(default_factory=AggregatorSettings, description="how the local models are combined: "
                                           "mean, median, trimmed_mean, krum, bulyan, geometric_median; clip_norm clips first")


@register_method
class Average(Method):
    name = "average"
    aliases = ("naive-average",)
    Params = AverageParams
    params: AverageParams
    summary = "one-shot parameter average of the local models (sample-weighted)"
    uses_local_models = True

    @classmethod
    def check(cls, params: MethodParams, setup: RunSetup) -> None:
        """The aggregator's precondition on the number of clients."""
        assert isinstance(params, AverageParams)
        check_aggregator(params.aggregator, setup.num_clients, what="clients")

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        start = server.initial_params() if p.aggregator.clip_norm is not None else None
        params, updates = aggregate_updates(server, server.local_updates(), p.aggregator, start=start, weighted=p.weighted)
        metrics = server.evaluate(params)
        server.log(1, metrics)
        return MethodResult(metrics, params, info={"clients": list(updates)})
