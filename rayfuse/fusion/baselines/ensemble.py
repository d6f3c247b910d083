"""``ensemble``: the local models kept side by side (K times the size of one model).

Two combinations are reported: the probability average ``p(y|x) = sum_k w_k p_k(y|x)`` (``accuracy``, ``nll``,
``entropy``, ``ece``) and the majority vote of the local predictions (``vote_accuracy``; ties go to the class with
the larger averaged probability).
"""

from __future__ import annotations

import numpy as np

from rayfuse.fusion.aggregate import normalize_weights
from rayfuse.method import Method, MethodParams, MethodResult, ServerContext, register_method


class EnsembleParams(MethodParams):
    weighted: bool = False  # weight each model's probabilities by its client's sample count


def majority_vote(probas: np.ndarray, weights: list[float]) -> np.ndarray:
    """Predicted classes by majority vote over ``probas`` ``(K, n, C)``; ties broken by the averaged probability."""
    K, n, C = probas.shape
    votes = np.zeros((n, C))
    np.add.at(votes, (np.arange(n)[None, :].repeat(K, 0), probas.argmax(axis=2)), 1.0)
    averaged = np.tensordot(weights, probas, axes=1)  # in [0, 1]: never outweighs one vote
    return (votes + 0.5 * averaged).argmax(axis=1)


@register_method
class Ensemble(Method):
    name = "ensemble"
    Params = EnsembleParams
    params: EnsembleParams
    summary = "the local models as an ensemble: probability average and majority vote"
    uses_local_models = True

    def run(self, server: ServerContext) -> MethodResult:
        updates = server.accept_updates(server.local_updates())
        probas = np.stack([server.predict_proba(u.params) for u in updates.values()])
        weights = normalize_weights([u.num_examples for u in updates.values()] if self.params.weighted else None, len(updates))
        metrics = server.evaluate_proba(np.tensordot(weights, probas, axes=1))
        metrics["vote_accuracy"] = float(np.mean(majority_vote(probas, weights) == server.test.y))
        server.log(1, metrics)
        return MethodResult(metrics, None, info={"clients": list(updates), "members": len(updates)})
