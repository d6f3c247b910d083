"""``local``: each client's own model, evaluated on the global test set (each, and mean +- std).

The baseline every fusion paper reports: what a data owner gets without federating. Each client's model is scored in
its own architecture (``federation.client_overrides.<i>.model``, else the run's ``model``).
"""

from __future__ import annotations

import numpy as np

from rayfuse.method import Method, MethodCase, MethodParams, MethodResult, MethodTags, ServerContext, register_method


@register_method
class Local(Method[MethodParams, None]):
    name = "local"
    summary = "each client's local model on the global test set (each, and mean +- std)"
    tags = MethodTags(
        fuses="nothing",
        uses_local_models=True,
        local_model_only=True,  # train.dp (local DP-SGD) covers what it releases
        heterogeneous_clients=True,  # each client's model is scored in its own architecture
    )
    test_case = MethodCase(fused=None)

    def run(self, server: ServerContext) -> MethodResult:
        updates = server.updates.accept(server.updates.local_updates())
        per_client = []
        for client, update in updates.items():
            metrics = server.scoring.evaluate(update.params, model=server.models.client_model(client))  # in the client's own architecture
            server.log(0, metrics, client=client)
            per_client.append({"client": client, "num_examples": update.num_examples, **metrics})
        names = [k for k in per_client[0] if k not in ("client", "num_examples")]
        mean = {k: float(np.mean([row[k] for row in per_client])) for k in names}
        std = {f"{k}_std": float(np.std([row[k] for row in per_client])) for k in names}
        server.log(0, mean)
        return MethodResult({**mean, **std}, info={"per_client": per_client})
