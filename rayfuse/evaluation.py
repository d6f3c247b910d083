"""Federated evaluation: each client scores a model on its own held-out split and sends sums and counts only.

``evaluation`` (a top-level config key) chooses where a method's models are scored:

* ``central`` -- on the coordinator's test set (the simulation's default; the numbers of earlier versions);
* ``federated`` -- by every client on its private held-out split (``data.val_size`` of its shard): the client step
  :func:`evaluate_held_out` returns :func:`rayfuse.metrics.metric_sums` (a count, the number correct, NLL and entropy
  sums, ECE bin counts and sums; never a per-sample value), the server adds them up and the metrics are the
  count-weighted aggregate over the clients (:func:`rayfuse.metrics.metrics_from_sums`). When the clients' held-out
  splits together are exactly a test set, the federated metrics equal the central metrics on that set, up to float
  rounding;
* ``both`` -- the central metrics under their names, the federated aggregate beside them with the prefix
  :data:`FEDERATED_PREFIX` (``federated_accuracy``, ``federated_nll``...).

The server side is :class:`rayfuse.coordinator.MethodServer` (``evaluate``, ``evaluate_ensemble``); the per-client
table of each federated evaluation is logged as ``val_<metric>`` rows with a client id (:data:`CLIENT_PREFIX`).

This module does not import torch at import time (the client worker imports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rayfuse.method import ClientContext, client_step
from rayfuse.metrics import METRIC_NAMES, majority_vote, metric_sums

__all__ = [
    "EVALUATIONS",
    "FEDERATED_PREFIX",
    "CLIENT_PREFIX",
    "evaluate_held_out",
    "model_for_params",
    "make_client_row",
    "read_client_table",
    "average_client_tables",
]

EVALUATIONS = ("central", "federated", "both")
FEDERATED_PREFIX = "federated_"  # evaluation: both -- the federated aggregate's keys
CLIENT_PREFIX = "val_"  # metrics.parquet rows of one client's held-out split (with its client id)


def model_for_params(params: dict[str, np.ndarray], model_cfg: Any, input_shape: Sequence[int], num_classes: int) -> Any:
    """A model of the configured architecture holding ``params``, whose widths may differ from the configuration's
    (GEMS' fused networks are narrower or wider, a nonparametric merge grows them): they are the sizes of the model's
    permutation groups in ``params`` (:func:`rayfuse.symmetry.resize_model`). Built without dropout (it is evaluated
    or tuned).

    Raises
    ------
    InputError
        ``params.<key>`` naming the first entry that is missing or whose shape no widths explain.
    """
    import torch

    from rayfuse.models import set_params
    from rayfuse.models.registry import build_model
    from rayfuse.symmetry import read_structure, resize_model

    cfg = model_cfg.model_copy(update={"dropout": 0.0}) if getattr(model_cfg, "dropout", 0) else model_cfg
    model = build_model(cfg, tuple(input_shape), num_classes, seed=0)
    state = model.state_dict()
    if set(params) == set(state) and all(np.shape(params[k]) == tuple(v.shape) for k, v in state.items()):
        return set_params(model, params)  # the configured widths
    structure = read_structure(model, torch.zeros((2, *input_shape)))
    return resize_model(model, structure, params)


@client_step("evaluate")
def evaluate_held_out(
    ctx: ClientContext,
    members: Sequence[dict[str, np.ndarray]],
    weights: Sequence[float] | None = None,
    *,
    vote: bool = False,
    models: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Score a model on this client's held-out split (``ctx.val``); return metric sums and counts only.

    ``members`` holds one parameter dict or several (an ensemble: its probabilities averaged with ``weights``, uniform
    when ``None``); ``models`` each member's model config (its architecture, the parameters at any widths of it: the
    server sends them, since members need not be of this client's model, ``federation.client_overrides``); ``None``:
    this client's own model (``ctx.model_cfg``) for every member. With ``vote`` the reply also counts the majority
    vote's hits (``vote_correct``). An empty held-out split replies with zero counts.
    """
    from rayfuse.models import predict_proba

    split = ctx.val
    configs = [ctx.model_cfg] * len(members) if models is None else list(models)
    if len(configs) != len(members):
        raise ValueError(f"evaluate: {len(members)} members and {len(configs)} model configs")
    if len(split) == 0:
        sums: dict[str, Any] = metric_sums(np.zeros((0, ctx.num_classes)), split.y)
    else:
        probas = [
            predict_proba(model_for_params(p, m, ctx.input_shape, ctx.num_classes), split.X, device=ctx.device)
            for p, m in zip(members, configs)
        ]
        w = list(weights) if weights is not None else [1.0 / len(probas)] * len(probas)
        stacked = np.stack(probas)
        proba = probas[0] if len(probas) == 1 else np.tensordot(w, stacked, axes=1)
        sums = metric_sums(proba, split.y)
    if vote:
        sums["vote_correct"] = float(np.sum(majority_vote(stacked, w) == split.y)) if len(split) else 0.0
    return sums


def make_client_row(client: int, sums: dict[str, Any]) -> dict[str, Any]:
    """One row of the per-client table: the client, its held-out count and its metrics (none for an empty split)."""
    from rayfuse.metrics import metrics_from_sums

    count = int(sums["count"])
    return {"client": int(client), "count": count, **(metrics_from_sums(sums) if count else {})}


def average_client_tables(tables: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several evaluations' per-client tables (``local``: one per local model) as one: per client, the mean of each
    metric over the evaluations (the count stays the client's held-out size)."""
    if len(tables) == 1:
        return [dict(row) for row in tables[0]]
    rows: dict[int, list[dict[str, Any]]] = {}
    for table in tables:
        for row in table:
            rows.setdefault(row["client"], []).append(row)
    merged = []
    for client in sorted(rows):
        same = rows[client]
        names = [k for k in same[0] if k not in ("client", "count") and all(k in r for r in same)]
        merged.append({"client": client, "count": same[0]["count"], **{k: float(np.mean([r[k] for r in same])) for k in names}})
    return merged


def read_client_table(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-client table of a method's last federated evaluation, read back from its history rows
    (``val_<metric>`` with a client id, at the last round that has them)."""
    rows = [r for r in history if r.get("client") is not None and str(r["metric"]).startswith(CLIENT_PREFIX)]
    if not rows:
        return []
    last = max(int(r["round"]) for r in rows)
    table: dict[int, dict[str, Any]] = {}
    for r in rows:
        if int(r["round"]) == last:
            name = str(r["metric"])[len(CLIENT_PREFIX) :]
            entry = table.setdefault(int(r["client"]), {"client": int(r["client"])})
            entry[name] = int(r["value"]) if name == "count" else float(r["value"])
    order = ["client", "count", *METRIC_NAMES]
    return [
        dict(sorted(entry.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
        for _, entry in sorted(table.items())
    ]
