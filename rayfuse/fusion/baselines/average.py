"""``average``: naive parameter averaging of the local models (one shot, no alignment).

``w = sum_k (n_k / n) w_k`` (or uniform weights). With independently trained networks this ignores the
permutation symmetry of hidden units, which is exactly what matching-based fusion (PFNM, KL-fusion, GEMS) fixes;
with ``train.shared_init`` the local models start from one initialisation, the friendliest case for averaging.

The combination is the framework's update pipeline (``server.updates``, :mod:`rayfuse.updates.pipeline`):
``aggregator`` replaces the average by a robust rule (:mod:`rayfuse.updates.robust`); its ``clip_norm`` clips each
local model's distance to the run's initial model (the clients' common start with ``train.shared_init``). The
default, ``mean``, is the average above. ``federation.attacks`` replace the attacking clients' models (relative to the
same initial model) before the rule.

``dp`` makes each client clip and noise its upload on its own side before it leaves (:mod:`rayfuse.updates.privacy`):
the difference to the shared initialisation with ``train.shared_init``, else the parameters themselves; the server
averages the noised uploads and records each client's epsilon.
"""

from __future__ import annotations

from rayfuse.method import Method, MethodCase, MethodResult, MethodTags, ServerContext, register_method
from rayfuse.updates.settings import OneShotUpdates


class AverageParams(OneShotUpdates):
    """The update layer's settings only (:class:`~rayfuse.updates.settings.OneShotUpdates`: weighted, aggregator, dp)."""


@register_method
class Average(Method[AverageParams, None]):
    name = "average"
    aliases = ("naive-average",)
    Params = AverageParams
    summary = "one-shot parameter average of the local models (sample-weighted)"
    tags = MethodTags(
        uses_local_models=True,
        local_model_only=True,  # train.dp (local DP-SGD) covers what it releases
        updates=frozenset({"aggregator", "dp", "weighted"}),
    )
    test_case = MethodCase()

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        pipeline = server.updates
        start = server.models.initial_params() if p.aggregator.clip_norm is not None else None
        uploads = pipeline.local_models()  # with dp: the clients' clipped, noised uploads (the raw local models never leave them)
        result = pipeline.collect(uploads, start=start, weighted=p.weighted)
        metrics = server.scoring.evaluate(result.params)
        info = pipeline.info()
        if "upload_dp" in info:
            metrics["upload_epsilon"] = max(info["upload_dp"]["epsilon"].values())
        server.log(1, metrics)
        return MethodResult(metrics, result.params, info={"clients": list(result.updates), **info})
