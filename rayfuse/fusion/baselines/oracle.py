"""``global``: the infeasible oracle -- one model trained on every client's data pooled.

A real federation cannot do this (the data would have to leave the clients); papers report it as the upper
reference ("Global" in GEMS, "VI-oracle" in KL-fusion, "centralised" in EP-GAN). The coordinator loads the pooled
training splits itself; results are labelled ``oracle: true``.
"""

from __future__ import annotations

from pydantic import Field

from rayfuse.method import Method, MethodCase, MethodParams, MethodResult, MethodTags, ServerContext, register_method
from rayfuse.models import get_params, train_model


class GlobalParams(MethodParams):
    epochs: int | None = Field(None, ge=1, description="default: train.epochs")


@register_method
class GlobalOracle(Method[GlobalParams, None]):
    name = "global"
    tags = MethodTags(
        fuses="nothing",
        needs_dataset=True,  # reads the whole dataset (data.dataset): not with data.silos
        oracle=True,
        heterogeneous_clients=True,  # trains the run's own model (model:) on the pooled data: the clients' models play no part
    )
    test_case = MethodCase({"epochs": 2})
    aliases = ("centralized", "pooled")
    Params = GlobalParams
    summary = "ORACLE: one model trained on all clients' data pooled (infeasible in a federation)"

    def run(self, server: ServerContext) -> MethodResult:
        data = server.data.pooled_train()
        cfg = server.models.train_cfg
        model = server.models.build_model(seed=server.step_seed("init"))
        stats = train_model(
            model,
            data.X,
            data.y,
            epochs=self.params.epochs or cfg.epochs,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            optimizer=cfg.optimizer,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            seed=server.step_seed("train"),
            device=server.models.device,
        )
        params = get_params(model)
        metrics = server.scoring.evaluate(params)
        server.log(0, metrics)
        return MethodResult(
            metrics,
            params,
            info={
                "note": "trained on all clients' data pooled: infeasible in a federation, an upper reference",
                "num_examples": len(data),
                "train_loss": stats.loss,
                "train_seconds": round(stats.seconds, 3),
            },
        )
