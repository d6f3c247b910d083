"""``aligned``: fuse the clients' models after aligning their hidden units, for any model the run builds.

One shot (``rounds: 1``):

1. every client trains its local model (shared by all methods of the run);
2. the server derives the model's permutation spec from its graph (:func:`rayfuse.symmetry.derive_spec`);
3. **alignment** puts every local model in one frame:

   - ``weight``: git-re-basin weight matching, N-way by MergeMany (each model aligned to the barycenter of the
     others, repeated until no permutation changes); data-free, the server alone; the per-model solves of a sweep
     fan out through the federation's ``parallel_map``;
   - ``activation``: each sweep the server broadcasts the current reference model; every client runs it and its own
     model on its own data and returns, per permutation group, the ``d x d`` cross-correlation sums of the two
     models' units (:class:`rayfuse.alignment.GroupStats`), never activations or data; the server solves the
     assignments (through ``parallel_map``) and the reference becomes the average of the aligned models;

4. **merge** of the aligned models: ``average`` (sample-weighted; ``aggregator`` replaces it by a robust rule of
   :mod:`rayfuse.updates.robust`, optionally clipping each aligned model's distance to the global model first: the
   run's initial model in the one-shot fusion, the broadcast model in later rounds; ``federation.attacks`` replace the
   attacking clients' models before alignment, relative to the same model), ``fisher`` (each client's diagonal Fisher of its
   aligned model on its data), ``regmean`` (each client's input Gram matrices of its aligned model's linear and
   convolution layers; closed form per layer), ``nonparametric`` (PFNM-style: a unit whose match quality is below
   ``new_unit_threshold`` becomes a new global unit, the global width capped at ``max_width`` x the model's; the
   global model is wider than the clients', and later rounds train it at its widths);
5. **repair** (``repair: true``): the fused model's BatchNorm statistics re-estimated by the clients on their data and
   combined by count; and REPAIR's rescaling of the hidden layers no BatchNorm follows (one shot): each client sends
   its aligned model's channel means and variances, the targets are their weighted averages, each client sends the
   fused model's channel statistics with the layers reset to the targets, and the server folds the rescaling into the
   layers' weights and biases.

Multi-round (``rounds: R > 1``, FedMA-style): after the one-shot fusion, each round every client trains
``local_epochs`` from the global model, the server aligns each update to the global model (weight matching: one
model onto a fixed target), merges, and repairs.

What leaves a client: its local model's parameters and sample count (as for ``average``), the group statistics
(sums over its samples), diagonal Fishers or Gram matrices (sums over its samples) and BatchNorm means and variances
with counts. Nothing per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from pydantic import Field

from rayfuse.errors import InputError
from rayfuse.fusion import references
from rayfuse.method import (
    ClientContext,
    Method,
    MethodCase,
    MethodParams,
    MethodResult,
    MethodTags,
    RunSetup,
    ServerContext,
    Update,
    client_step,
    register_method,
)
from rayfuse.updates.pipeline import combine_models
from rayfuse.updates.settings import OneShotUpdates

__all__ = ["AlignmentSettings", "AlignedParams", "Aligned", "batchnorm", "derive_run_spec", "read_batchnorm_reply"]


class AlignmentSettings(MethodParams):
    """How models are aligned and merged: shared by the ``aligned`` method and ``rayfuse fuse``'s matching."""

    merge: Literal["average", "fisher", "regmean", "nonparametric"] = Field(
        "average",
        description="how the aligned models are combined (fisher, regmean: statistics of the data; nonparametric: "
        "units that match nothing become new global units, PFNM-style)",
    )
    new_unit_threshold: float = Field(
        0.5,
        ge=-1,
        le=1,
        description="nonparametric: a unit whose match quality (activation "
        "correlation, or weight cosine) is below this becomes a new global unit",
    )
    max_width: float = Field(2.0, ge=1, le=64, description="nonparametric: a group's global width is at most this factor of its width")
    sweeps: int = Field(3, ge=1, description="activation matching: reference-solve-average sweeps")
    max_sweeps: int = Field(20, ge=1, description="weight matching: MergeMany sweeps over the models")
    inner_sweeps: int = Field(100, ge=1, description="weight matching: coordinate-descent sweeps over the groups per model")
    batch_size: int = Field(256, ge=1, description="batch size of the passes over the data")
    regmean_alpha: float = Field(0.9, ge=0, le=1, description="regmean: weight of the Gram's off-diagonal part")
    repair_passes: int = Field(
        3, ge=1, le=64, description="repair: REPAIR's measure-and-fold passes (pass p makes the first p layers exact)"
    )


class AlignedParams(AlignmentSettings, OneShotUpdates):
    alignment: Literal["weight", "activation"] = Field(
        "activation", description="weight: data-free weight matching; activation: matching on the clients' activation statistics"
    )
    repair: bool = Field(
        True,
        description="re-estimate the fused model's BatchNorm statistics on the clients' data, and rescale "
        "the hidden layers no BatchNorm follows to the aligned models' statistics (REPAIR)",
    )
    rounds: int = Field(1, ge=1, description="1: one shot; more: align, merge and repair after each round of local training")
    local_epochs: int = Field(1, ge=1, description="local epochs per round after the first")
    samples: int | None = Field(2048, ge=1, description="training samples per client the statistics use (None: all)")
    spec: dict[str, Any] | None = Field(
        None, description="an explicit permutation spec (PermutationSpec.to_dict form) instead of the derived one"
    )
    evaluate_every: int = Field(1, ge=1, description="evaluate the fused model every this many rounds (and after the last)")


def derive_run_spec(
    model: Any,
    input_shape: tuple[int, ...],
    explicit: dict[str, Any] | None = None,
    *,
    where: str = "model.name",
    spec_where: str = "spec",
    example: Any = None,
) -> Any:
    """The permutation spec of ``model`` (derived from its graph on a zero batch), or the explicit one checked
    against its tensors, for overlapping groups and, given an input shape, by the invariance check (a group whose
    permutation changes the model's output is refused). Errors name ``where`` (the model) or ``spec_where`` (the
    explicit spec). ``example``: a batch to use instead of the zeros (token ids for a model that takes them)."""
    import torch

    from rayfuse.symmetry import PermutationSpec, derive_spec
    from rayfuse.symmetry.invariance import check_spec

    if explicit is not None:
        spec = PermutationSpec.from_dict(explicit, where=spec_where)
        try:
            batch = example if example is not None else torch.zeros((2, *input_shape)) if input_shape else None
            return check_spec(model, spec, batch, where=spec_where)
        except InputError as exc:
            raise exc.at(where if exc.path == "input" else exc.path) from None
    try:
        return derive_spec(model, example if example is not None else torch.zeros((2, *input_shape)))
    except InputError as exc:
        raise exc.at(where if exc.path == "architecture" else exc.path) from None


# ---------------------------------------------------------------------------------------------------------------
# Client steps: each returns sums over the client's samples, never the samples


def _sample(ctx: ClientContext, samples: int | None, label: str) -> tuple[np.ndarray, np.ndarray]:
    X, y = ctx.train.X, ctx.train.y
    if samples is not None and len(X) > samples:
        idx = np.sort(np.random.default_rng(ctx.step_seed(label, "stats")).choice(len(X), samples, replace=False))
        X, y = X[idx], y[idx]
    return X, y


def _model_for(ctx: ClientContext, params: dict[str, np.ndarray], *, keep: bool = False) -> Any:
    """This run's architecture holding ``params``, whose widths may differ from the configuration's (a nonparametric
    merge grows groups). ``keep``: at the configured widths, the model the client keeps on its device between steps
    (:meth:`~rayfuse.client.ClientContext.work_model`; for training, which leaves nothing of the model's set-up changed)."""
    import torch

    from rayfuse.models import set_params
    from rayfuse.symmetry import read_structure, resize_model

    model = ctx.build_model(seed=0)
    state = model.state_dict()
    if all(k in params and np.shape(params[k]) == tuple(v.shape) for k, v in state.items()):
        return ctx.work_model(params) if keep else set_params(model, params)
    return resize_model(model, read_structure(model, torch.zeros((2, *ctx.input_shape))), params)


def _own_aligned(ctx: ClientContext, spec: Any, perms: dict[str, np.ndarray] | None) -> Any:
    from rayfuse.models import get_params, set_params

    own = ctx.local_model()
    if perms is None:
        return own
    return set_params(ctx.build_model(seed=0), spec.apply(get_params(own), perms))


@client_step("aligned.correlations")
def correlations(
    ctx: ClientContext, reference: dict[str, np.ndarray], spec: Any, *, label: str, samples: int | None, batch_size: int
) -> dict[str, dict[str, np.ndarray]]:
    """Per permutation group, the cross-correlation sums of the reference model's units and this client's local
    model's units over its training data (counts, sums, sums of squares, the ``d x d`` cross sums)."""
    from rayfuse.alignment import collect_correlations
    from rayfuse.models import set_params
    from rayfuse.symmetry import trace_model

    ref_model = set_params(ctx.build_model(seed=0), reference).eval()
    own = ctx.local_model().eval()
    if "aligned.graph" not in ctx.state:  # the architecture's graph, traced once: each model runs it with its own weights
        ctx.state["aligned.graph"] = trace_model(own)
    graph = ctx.state["aligned.graph"]
    X, _ = _sample(ctx, samples, label)
    stats = collect_correlations(ref_model, own, spec, graph, graph, X, batch_size=batch_size, device=ctx.device)
    return {name: s.to_arrays() for name, s in stats.items()}


@client_step("aligned.fisher")
def fisher(ctx: ClientContext, spec: Any, perms: dict[str, np.ndarray], *, label: str, samples: int | None, batch_size: int) -> Update:
    """The diagonal Fisher of this client's aligned model on its data (a parameter-shaped dict) and the count."""
    from rayfuse.alignment import diagonal_fisher

    X, y = _sample(ctx, samples, label)
    return Update(diagonal_fisher(_own_aligned(ctx, spec, perms), X, y, batch_size=batch_size, device=ctx.device), len(X))


@client_step("aligned.grams")
def grams(ctx: ClientContext, spec: Any, perms: dict[str, np.ndarray], *, label: str, samples: int | None, batch_size: int) -> Update:
    """The input Gram matrices of this client's aligned model's linear and convolution layers, and the count."""
    from rayfuse.alignment import input_grams

    X, _ = _sample(ctx, samples, label)
    gram, count = input_grams(_own_aligned(ctx, spec, perms), X, batch_size=batch_size, device=ctx.device)
    return Update(gram, int(count))


@client_step("aligned.batchnorm")
def batchnorm(
    ctx: ClientContext, fused: dict[str, np.ndarray], *, label: str, samples: int | None, batch_size: int, model_cfg: Any = None
) -> dict[str, Any]:
    """The fused model's BatchNorm input statistics (count, mean, variance per layer) on this client's data; the model
    is built in ``model_cfg``'s architecture when given (a distilled student's, which need not be this client's)."""
    from rayfuse.alignment import batchnorm_statistics
    from rayfuse.evaluation import model_for_params

    X, _ = _sample(ctx, samples, label)
    model = _model_for(ctx, fused) if model_cfg is None else model_for_params(fused, model_cfg, ctx.input_shape, ctx.num_classes)
    stats = batchnorm_statistics(model, X, batch_size=batch_size, device=ctx.device)
    return {name: {"count": np.asarray(float(c)), "mean": np.asarray(m), "var": np.asarray(v)} for name, (c, m, v) in stats.items()}


@client_step("aligned.unit_stats")
def unit_stats(
    ctx: ClientContext, spec: Any, perms: dict[str, np.ndarray], units: list[Any], *, label: str, samples: int | None, batch_size: int
) -> dict[str, Any]:
    """REPAIR, first half: the output-channel statistics (count, mean, variance) of this client's aligned local model's
    layers ``units`` on its data."""
    from rayfuse.alignment import unit_statistics

    X, _ = _sample(ctx, samples, label)
    stats = unit_statistics(_own_aligned(ctx, spec, perms), X, units, batch_size=batch_size, device=ctx.device)
    return {name: {"count": np.asarray(float(c)), "mean": np.asarray(m), "var": np.asarray(v)} for name, (c, m, v) in stats.items()}


@client_step("aligned.repair_stats")
def repair_stats(
    ctx: ClientContext, fused: dict[str, np.ndarray], units: list[Any], *, label: str, samples: int | None, batch_size: int
) -> dict[str, Any]:
    """REPAIR, second half: the fused model's layer output statistics on this client's data."""
    from rayfuse.alignment import unit_statistics

    X, _ = _sample(ctx, samples, label)
    stats = unit_statistics(_model_for(ctx, fused), X, units, batch_size=batch_size, device=ctx.device)
    return {name: {"count": np.asarray(float(c)), "mean": np.asarray(m), "var": np.asarray(v)} for name, (c, m, v) in stats.items()}


@client_step("aligned.fit")
def fit(ctx: ClientContext, global_params: dict[str, np.ndarray], *, label: str, round: int, epochs: int) -> Update:
    """Local training from the global model (the rounds after the one-shot fusion)."""
    from rayfuse.models import get_params, train_model

    model = _model_for(ctx, global_params, keep=True)
    stats = train_model(
        model,
        *ctx.device_split(),
        epochs=epochs,
        batch_size=ctx.train_cfg.batch_size,
        lr=ctx.train_cfg.lr,
        optimizer=ctx.train_cfg.optimizer,
        momentum=ctx.train_cfg.momentum,
        weight_decay=ctx.train_cfg.weight_decay,
        seed=ctx.step_seed(label, round),
        device=ctx.device,
    )
    return Update(get_params(model), ctx.num_examples, {"train_loss": stats.loss})


# ---------------------------------------------------------------------------------------------------------------
# The server


@dataclass
class AlignedState:
    params: dict[str, np.ndarray]


@register_method
class Aligned(Method[AlignedParams, AlignedState]):
    name = "aligned"
    aliases = ("match",)
    Params = AlignedParams
    summary = "aligned fusion of any model: units matched by weights or by the clients' activation statistics, then merged"
    reference = references.REBASIN
    tags = MethodTags(
        uses_local_models=True,
        multi_round=True,
        updates=frozenset({"aggregator", "dp", "weighted"}),
    )
    # a DP upload covers the clients' weights only: the entry given dp is one round aligned by weights, without repair
    test_case = MethodCase(
        {"rounds": 2, "samples": 256}, step="aligned.fit", variants={"method-dp": {"alignment": "weight", "repair": False}}
    )

    @classmethod
    def tags_for(cls, params: AlignedParams | None = None) -> MethodTags:
        """What the update pipeline sees of the clients: their models, aligned and then merged by the pipeline's rule
        (``average``) or matched into new units (``nonparametric``); with ``fisher`` or ``regmean`` the merge weighs
        them by statistics of the clients' data, which attacks, robust rules and DP do not act on."""
        if params is not None and params.merge in ("fisher", "regmean"):
            return replace(cls.tags, fuses="statistics")
        return cls.tags

    @classmethod
    def check(cls, params: AlignedParams, setup: RunSetup) -> None:
        from rayfuse.models import build_model

        if not params.aggregator.is_plain_mean and params.merge != "average":
            raise InputError(
                "aggregator",
                "the default mean with merge " + repr(params.merge) + " (a robust aggregator or clip_norm replaces merge: average only)",
                params.aggregator.name if params.aggregator.name != "mean" else "clip_norm",
            )
        if params.dp is not None:  # the rule's precondition and the upload's delta are the update pipeline's checks
            _check_dp_fits(params)
        if setup.input_shape is None or setup.num_classes is None:
            return  # not known yet (a silo run before its survey): checked after it
        model = build_model(setup.model, setup.input_shape, setup.num_classes, seed=0)
        derive_run_spec(model, setup.input_shape, params.spec)
        if params.alignment == "activation" or params.repair:  # both read the torch.fx graph: refused before any client trains
            from rayfuse.symmetry import trace_structure

            trace_structure(model, "alignment: activation" if params.alignment == "activation" else "repair: true", where="model.name")

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        spec = derive_run_spec(server.models.build_model(seed=0), server.data.input_shape, p.spec)
        grown = False  # a nonparametric merge made the global model wider than the configuration
        rounds = server.rounds(
            AlignedState(server.models.initial_params()),
            last=p.rounds,
            evaluate=lambda rnd: server.scoring.evaluate(rounds.state.params, resized=grown),
            evaluate_every=p.evaluate_every,
        )
        state = rounds.state
        info: dict[str, Any] = {}
        fed = server.federation
        pipeline = server.updates  # validation and attacks before alignment; clipping and the rule after it (merge: average)
        for rnd in rounds:
            if rnd == 1:  # one shot: the local models, aligned and merged
                # with dp: the clients' clipped, noised uploads (the raw local models never leave them)
                updates = pipeline.receive(pipeline.local_models(), None, rnd, start=server.models.initial_params())
                ids = sorted(updates)
                server.progress(
                    f"{server.label}: {len(spec.groups)} permutation groups, {len(spec.fixed)} fixed axes; aligning {len(ids)} models"
                )
                target = None
            else:  # FedMA-style: local training from the global model, each update aligned onto it, merged
                updates = pipeline.receive(
                    fed.run(fit, fed.put(state.params), label=server.label, round=rnd, epochs=p.local_epochs), state.params, rnd
                )
                ids = sorted(updates)
                target = state.params
            weights = [float(updates[c].num_examples) if p.weighted else 1.0 for c in ids]
            state.params, info = self._fuse(
                server, spec, [updates[c].params for c in ids], ids, weights, round=rnd, target=target, combine=pipeline.combine
            )
            if info.get("new_units"):  # the global model grew: later rounds align onto it at its widths
                grown = True
                spec = derive_run_spec(_server_model(server, state.params), server.data.input_shape)
            rounds.log({"clients": float(len(ids)), "units_moved": float(info["units_moved"])})
        info.update({"groups": len(spec.groups), "fixed_axes": len(spec.fixed), "rounds": p.rounds})
        metrics = rounds.metrics
        upload_dp = pipeline.info().get("upload_dp")  # with dp: each client's epsilon (round 1)
        if upload_dp is not None:
            info["upload_dp"] = upload_dp
            metrics = {**metrics, "upload_epsilon": max(upload_dp["epsilon"].values())}
        return MethodResult(metrics, state.params, info=info)

    def merge_local_models(self, server: ServerContext, updates: dict[int, Update]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The one-shot aligned merge of ``updates`` (local models by client id): alignment, merge and repair as the
        parameters say, the clients' statistics asked of those clients only. For methods that start from it
        (``distill``'s ``init: aligned``); returns the merged parameters (at grown widths with ``merge:
        nonparametric``) and the merge's information."""
        p = self.params
        spec = derive_run_spec(server.models.build_model(seed=0), server.data.input_shape, p.spec)
        ids = sorted(updates)
        weights = [float(updates[c].num_examples) if p.weighted else 1.0 for c in ids]

        def combine(models: Any, weights: Any, *, start: Any = None) -> dict[str, np.ndarray]:  # these settings' own aggregator
            return combine_models(models, weights, p.aggregator, start=start, initial=server.models.initial_params, label=server.label)

        return self._fuse(server, spec, [updates[c].params for c in ids], ids, weights, round=1, combine=combine)

    # -- one alignment + merge + repair ---------------------------------------------------------------------------

    def _fuse(
        self,
        server: ServerContext,
        spec: Any,
        models: list[dict[str, np.ndarray]],
        clients: list[int],
        weights: list[float],
        *,
        round: int,
        combine: Callable[..., dict[str, np.ndarray]],
        target: dict[str, np.ndarray] | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Align ``models``, merge them and repair; ``combine(aligned, weights, start=)`` is the update pipeline's
        clipping and robust rule (``merge: average`` with an ``aggregator`` other than the plain mean)."""
        from rayfuse.alignment import merge_average, merge_fisher, merge_regmean

        p = self.params
        perms, quality = self._align(server, spec, models, clients, weights, round=round, target=target)
        aligned = [spec.apply(m, pk) for m, pk in zip(models, perms)]
        info: dict[str, Any] = {
            "alignment": p.alignment,
            "merge": p.merge,
            "repair": p.repair,
            "units_moved": int(sum(int((pk[g] != np.arange(len(pk[g]))).sum()) for pk in perms for g in pk)),
        }
        if p.merge == "average" and not p.aggregator.is_plain_mean:  # the update pipeline's clipping and robust rule
            fused = combine(aligned, weights, start=target)
            info["aggregator"] = p.aggregator.name
        elif p.merge == "average" or (p.merge == "nonparametric" and target is not None):  # the global model's width is set in round 1
            # the alignment's own average (float64 accumulation), as before the pipeline: the same bytes
            fused = merge_average(aligned, weights)
        elif p.merge == "nonparametric":
            from rayfuse.alignment import fuse_nonparametric, resolve_cost_keys, width_roles

            roles = width_roles(server.models.build_model(seed=0), spec)
            fused, plan = fuse_nonparametric(
                aligned,
                spec,
                roles,
                quality=quality,
                weights=weights,
                threshold=p.new_unit_threshold,
                max_width=p.max_width,
                keys=resolve_cost_keys(spec, None),
            )
            info["widths"], info["plan"] = dict(plan.widths), plan
            info["new_units"] = int(sum(plan.new_units(spec).values()))
            info["fixed_width"] = dict(roles.fixed)
            server.progress(f"{server.label}: nonparametric merge: {info['new_units']} new units; widths {info['widths']}")
        else:
            step = fisher if p.merge == "fisher" else grams
            fed = server.federation
            spec_ref = fed.put(spec)  # one broadcast; each client gets its own permutations (a few integers per group)
            gathered = fed.gather(
                [
                    call
                    for c, pk in zip(clients, perms)
                    for call in fed.map(step, spec_ref, pk, label=server.label, samples=p.samples, batch_size=p.batch_size, clients=[c])
                ]
            )
            stats = server.updates.accept_replies(gathered, lambda c, u: _check_finite(u), need=1, what=f"{p.merge} statistics")
            kept = [i for i, c in enumerate(clients) if c in stats]  # a rejected client's model is left out of the merge
            merged, kept_weights = [aligned[i] for i in kept], [weights[i] for i in kept]
            if p.merge == "fisher":
                fused = merge_fisher(merged, [stats[clients[i]].params for i in kept], kept_weights)
            else:
                from rayfuse.devices import is_cuda

                # RegMean's products and solves on the coordinator's GPU when it has one
                device = server.models.device if is_cuda(server.models.device) else None
                fused = merge_regmean(merged, [stats[clients[i]].params for i in kept], kept_weights, alpha=p.regmean_alpha, device=device)
            info["merged_clients"] = [clients[i] for i in kept]
        if p.repair and any(k.endswith("running_mean") for k in fused):
            fused = self._repair(server, fused, clients)
            info["repaired"] = True
        if p.repair and target is None:  # REPAIR's rescaling of the layers no BatchNorm follows (one shot)
            fused, rescaled = self._rescale(server, spec, fused, clients, perms, weights, info.get("plan"))
            if rescaled:
                info["rescaled_layers"] = rescaled
        info.pop("plan", None)
        return fused, info

    def _align(
        self,
        server: ServerContext,
        spec: Any,
        models: list[dict[str, np.ndarray]],
        clients: list[int],
        weights: list[float],
        *,
        round: int,
        target: dict[str, np.ndarray] | None,
    ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]] | None]:
        """Every model's permutations onto the common frame, and (activation matching) each aligned unit's correlation
        with its reference unit."""
        from rayfuse.alignment import activation_matching, weight_matching
        from rayfuse.devices import is_cuda
        from rayfuse.matching import thread_map

        p = self.params
        fed = server.federation
        # Cost matrices are matrix products: on the coordinator's GPU when it has one (the solves then stay in its process,
        # threads), else on CPUs, fanned out as the federation's parallel_map (Ray tasks on a cluster).
        device = server.models.device if is_cuda(server.models.device) else None
        executor = fed.parallel_map if device is None else thread_map
        if target is not None:  # later rounds: every update onto the global model
            return executor(_MatchOnto(target, spec, p.inner_sweeps, server.step_seed("align", round), device), models), None
        if p.alignment == "weight":
            return weight_matching(
                models,
                spec,
                weights=weights,
                max_sweeps=p.max_sweeps,
                inner_sweeps=p.inner_sweeps,
                seed=server.step_seed("align", round),
                executor=executor,
                device=device,
            ).perms, None

        def collect(reference: dict[str, np.ndarray]) -> list[dict[str, Any]]:
            gathered = fed.run(
                correlations,
                fed.put(reference),
                fed.put(spec),
                label=server.label,
                samples=p.samples,
                batch_size=p.batch_size,
                clients=clients,
            )
            # a client whose statistics are rejected (recorded, never used) has its units matched by weights this sweep
            replies = server.updates.accept_replies(gathered, lambda c, r: _read_stats(r, spec), need=1, what="correlation statistics")
            return [replies.get(c, {}) for c in clients]

        alignment = activation_matching(models, spec, collect, weights=weights, sweeps=p.sweeps, executor=executor, device=device)
        return alignment.perms, alignment.quality

    def _repair(self, server: ServerContext, fused: dict[str, np.ndarray], clients: list[int]) -> dict[str, np.ndarray]:
        from rayfuse.alignment import apply_batchnorm, combine_batchnorm

        p = self.params
        fed = server.federation
        gathered = fed.run(batchnorm, fed.put(fused), label=server.label, samples=p.samples, batch_size=p.batch_size, clients=clients)
        stats = server.updates.accept_replies(gathered, lambda c, r: read_batchnorm_reply(r), need=1, what="BatchNorm statistics")
        return apply_batchnorm(fused, combine_batchnorm(list(stats.values())))

    def _rescale(
        self,
        server: ServerContext,
        spec: Any,
        fused: dict[str, np.ndarray],
        clients: list[int],
        perms: list[dict[str, np.ndarray]],
        weights: list[float],
        plan: Any,
    ) -> tuple[dict[str, np.ndarray], list[str]]:
        """REPAIR's rescaling (module docstring of :mod:`rayfuse.alignment.repair`): two client steps, statistics only."""
        from rayfuse.alignment import apply_repair, repair_targets, repair_units

        p = self.params
        skipped: dict[str, str] = {}
        units = repair_units(server.models.build_model(seed=0), spec, skipped=skipped)
        for name, why in skipped.items():  # a layer applied several times, or tied to another: one line each
            server.progress(f"{server.label}: repair: {name} left as merged: {why}")
        if not units:
            return fused, []
        fed = server.federation
        spec_ref, units_ref = fed.put(spec), fed.put(units)
        gathered = fed.gather(
            [
                call
                for c, pk in zip(clients, perms)
                for call in fed.map(
                    unit_stats, spec_ref, pk, units_ref, label=server.label, samples=p.samples, batch_size=p.batch_size, clients=[c]
                )
            ]
        )
        own = server.updates.accept_replies(gathered, lambda c, r: read_batchnorm_reply(r), need=1, what="REPAIR statistics")
        kept = [i for i, c in enumerate(clients) if c in own]
        index = [plan.index[i] for i in kept] if plan is not None else None
        targets = repair_targets(
            [own[clients[i]] for i in kept],
            units,
            [weights[i] for i in kept],
            index=index,
            widths=plan.widths if plan is not None else None,
        )
        for _ in range(min(len(units), p.repair_passes)):  # each fold changes the later layers' statistics: measure again
            gathered = fed.run(
                repair_stats,
                fed.put(fused),
                units_ref,
                label=server.label,
                samples=p.samples,
                batch_size=p.batch_size,
                clients=[clients[i] for i in kept],
            )
            merged = server.updates.accept_replies(gathered, lambda c, r: read_batchnorm_reply(r), need=1, what="REPAIR statistics")
            order = [i for i in kept if clients[i] in merged]
            fused = apply_repair(
                fused, units, repair_targets([merged[clients[i]] for i in order], units, [weights[i] for i in order]), targets
            )
        return fused, [u.module for u in units]


def _check_dp_fits(params: AlignedParams) -> None:
    """``dp`` covers the clients' uploaded weights only: refuse every setting that reads more of the clients (activation
    statistics, BatchNorm and REPAIR statistics, Fisher / Gram merges, further rounds of training)."""
    for key, ok, want in (
        ("alignment", params.alignment == "weight", "weight"),
        ("repair", not params.repair, "false"),
        ("rounds", params.rounds == 1, "1"),
        ("merge", params.merge in ("average", "nonparametric"), "average or nonparametric"),
    ):
        if not ok:
            raise InputError(
                key,
                f"{want} with dp (the DP upload covers the clients' weights only; this setting reads more of the clients' data)",
                getattr(params, key),
            )


def _server_model(server: ServerContext, params: dict[str, np.ndarray]) -> Any:
    """The run's architecture holding ``params`` at their widths (a nonparametric merge grows groups)."""
    from rayfuse.evaluation import model_for_params

    return model_for_params(params, server.models.model_cfg, server.data.input_shape, server.data.num_classes)


class _MatchOnto:
    """Weight matching of one model onto a fixed target (a picklable callable for ``parallel_map``)."""

    def __init__(self, target: dict[str, np.ndarray], spec: Any, sweeps: int, seed: int, device: str | None = None) -> None:
        self.target, self.spec, self.sweeps, self.seed, self.device = target, spec, sweeps, seed, device

    def __call__(self, model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from rayfuse.alignment import match_weights

        return match_weights(self.target, model, self.spec, max_sweeps=self.sweeps, seed=self.seed, device=self.device)[0]


def _check_finite(update: Update) -> Update:
    from rayfuse.method import Rejected

    for key, value in update.params.items():
        if not np.isfinite(value).all():
            raise Rejected(f"non-finite values in {key}")
    return update


def _read_stats(reply: Any, spec: Any) -> dict[str, Any]:
    from rayfuse.alignment import GroupStats
    from rayfuse.method import Rejected

    if not isinstance(reply, dict):
        raise Rejected(f"statistics as a dict of groups, got {type(reply).__name__}")
    out = {}
    for name, arrays in reply.items():
        size = spec.group(name).size
        stats = GroupStats.from_arrays(arrays)
        if stats.cross.shape != (size, size):
            raise Rejected(f"group {name}: a {size} x {size} cross matrix, got {stats.cross.shape}")
        if not all(np.isfinite(a).all() for a in arrays.values()):
            raise Rejected(f"group {name}: non-finite statistics")
        out[name] = stats
    return out


def read_batchnorm_reply(reply: Any) -> dict[str, tuple[float, np.ndarray, np.ndarray]]:
    """A client's BatchNorm (or REPAIR) statistics reply, checked: per layer a positive count, finite means and
    non-negative finite variances; else :class:`~rayfuse.method.Rejected`."""
    from rayfuse.method import Rejected

    out = {}
    for name, s in reply.items():
        count, mean, var = float(s["count"]), np.asarray(s["mean"]), np.asarray(s["var"])
        if not (np.isfinite(mean).all() and np.isfinite(var).all() and count > 0 and (var >= 0).all()):
            raise Rejected(f"BatchNorm {name}: non-finite or negative statistics")
        out[name] = (count, mean, var)
    return out
