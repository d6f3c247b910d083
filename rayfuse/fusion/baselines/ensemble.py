"""``ensemble``: the local models kept side by side (K times the size of one model).

Two combinations are reported: the probability average ``p(y|x) = sum_k w_k p_k(y|x)`` (``accuracy``, ``nll``,
``entropy``, ``ece``) and the majority vote of the local predictions (``vote_accuracy``; ties go to the class with
the larger averaged probability).

With ``evaluation: federated`` every client receives the local models' parameters and scores the ensemble on its own
held-out split (``server.scoring.evaluate_ensemble``). The members may be of different architectures (clients with
their own ``federation.client_overrides.<i>.model``): each is built in its client's model.
"""

from __future__ import annotations

from pydantic import Field

from rayfuse.method import Method, MethodCase, MethodParams, MethodResult, MethodTags, ServerContext, register_method
from rayfuse.metrics import majority_vote
from rayfuse.updates.aggregate import normalize_weights

__all__ = ["Ensemble", "EnsembleParams", "majority_vote"]


class EnsembleParams(MethodParams):
    weighted: bool = Field(
        False,
        description="weight each member's probabilities by its client's number of training samples in "
        "the probability average (the vote counts each member once)",
    )


@register_method
class Ensemble(Method[EnsembleParams, None]):
    name = "ensemble"
    Params = EnsembleParams
    summary = "the local models as an ensemble: probability average and majority vote"
    tags = MethodTags(
        fuses="predictions",
        uses_local_models=True,
        local_model_only=True,  # train.dp (local DP-SGD) covers what it releases
        heterogeneous_clients=True,  # the members' probabilities are averaged, each member in its own architecture
    )
    test_case = MethodCase(fused=None)

    def run(self, server: ServerContext) -> MethodResult:
        updates = server.updates.accept(server.updates.local_updates())
        weights = normalize_weights([u.num_examples for u in updates.values()] if self.params.weighted else None, len(updates))
        metrics = server.scoring.evaluate_ensemble(
            [u.params for u in updates.values()], weights, models=[server.models.client_model(c) for c in updates]
        )  # each member in its own architecture
        server.log(1, metrics)
        return MethodResult(metrics, None, info={"clients": list(updates), "members": len(updates)})
