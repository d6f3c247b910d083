"""``average``: naive parameter averaging of the local models (one shot, no alignment).

``w = sum_k (n_k / n) w_k`` (or uniform weights). With independently trained networks this ignores the
permutation symmetry of hidden units, which is exactly what matching-based fusion (PFNM, KL-fusion, GEMS) fixes;
with ``train.shared_init`` the local models start from one initialisation, the friendliest case for averaging.
"""

from __future__ import annotations

from rayfuse.method import Method, MethodParams, MethodResult, ServerContext, register_method


class AverageParams(MethodParams):
    weighted: bool = True  # weight each client by its number of training samples


@register_method
class Average(Method):
    name = "average"
    aliases = ("naive-average",)
    Params = AverageParams
    params: AverageParams
    summary = "one-shot parameter average of the local models (sample-weighted)"
    uses_local_models = True

    def run(self, server: ServerContext) -> MethodResult:
        params, updates = server.average_updates(server.local_updates(), weighted=self.params.weighted)
        metrics = server.evaluate(params)
        server.log(1, metrics)
        return MethodResult(metrics, params, info={"clients": list(updates)})
