"""``fedmerge``: clients fine-tune one shared base on their own data and compute their statistics there; the server
merges the task vectors Fisher- or RegMean-weighted.

One shot. Each client starts from the base (``base:``: a state dict or a Hugging Face folder; by default the folder of
a ``model.name: hf:<folder>``, else the run's shared init), fine-tunes the ``nn.Linear`` layers ``target_modules``
names (``finetune: full``: their weights and biases, every other parameter frozen; ``finetune: lora``: LoRA adapters
on them, ``W x + s B A x``, the base frozen) for ``local_epochs`` on its training split, and then computes on that
split, with the update folded into the model, the statistic the merge needs, with the functions aligned fusion's
clients use: the diagonal Fisher of the fine-tuned tensors (``merge: fisher``) or the input Gram matrices of the
fine-tuned Linear weights (``merge: regmean``).

A client returns its task vector (``full``: ``x_i - base`` of the fine-tuned tensors) or its adapter factors
(``lora``: ``A_i``, ``B_i``), its statistics and its sample count; never a sample or an activation. The server forms
each client's update of a weight (``full``: the task vector; ``lora``: the product ``s B_i A_i``) and merges them with
:func:`rayfuse.finetunes.statistics.merge_task_vectors` (``rayfuse fuse``'s ``fisher`` / ``regmean``), weighted by the
sample counts; the fused model is the base plus the merged update. ``merge: average`` is the statistics-free reference
(the weighted average of the updates: for adapters, of the products, which is exact where averaging the factors is not).

With ``export:`` (a folder that does not exist yet) each client also writes, into that folder on its own machine,
its fine-tuned model (``client-<id>.safetensors``) and its statistics (``client-<id>.<merge>.safetensors``), and the
server the base (``base.safetensors``): the files ``rayfuse fuse``'s ``fisher`` / ``regmean`` read (with
``base_model:``), so the offline merge of those files gives the federated one.

Under ``federation.secure_aggregation`` the server receives no client's update or statistic: each merge is a function
of sums over the clients (:func:`rayfuse.finetunes.statistics.merge_sums`), and each client forms its share of them
(weighted by its count, or 1: ``w d``; Fisher: ``w F``, ``w F d``; RegMean: ``w G'``, ``w d G'``) after fine-tuning
(:func:`secure_scales`), sends in a first secure sum only the power-of-two band of each term's largest entry, and in a
second (:func:`secure_terms`) the terms at the fixed-point step the bands set (:class:`rayfuse.updates.secure.ScaledSum`:
about 2^-60 of the cohort's largest entry of each term). The merged update is the plain merge's of the same clients
within ``info.secure_aggregation.error_bound``, computed from the sums.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from rayfuse.errors import SecAggFailure
from rayfuse.fusion.references import REGMEAN
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

if TYPE_CHECKING:
    from rayfuse.updates.secure import ScaledSum

__all__ = ["FedMerge", "FedMergeParams", "fit", "payload_keys", "client_update", "secure_scales", "secure_terms"]


# prefixes of a reply's keys: the update's tensors, then the statistics
UPDATE, LORA_A, LORA_B, FISHER, GRAM = "delta/", "lora_A/", "lora_B/", "fisher/", "gram/"
LOSS = "metric/train_loss"  # a secure sum's term: the count times the training loss
SECURE_STATE = "fedmerge.secure"  # a client's terms between its two secure sums (its state's key, with the label)


class FedMergeParams(MethodParams):
    merge: Literal["fisher", "regmean", "average"] = Field(
        "fisher",
        description="fisher (Fisher-weighted average of the updates, the clients' diagonal Fishers), regmean (RegMean "
        "with the clients' input Gram matrices) or average (the weighted average of the updates: no statistics)",
    )
    finetune: Literal["full", "lora"] = Field(
        "full", description="what a client trains: full (the target layers' weights and biases) or lora (adapters on them)"
    )
    target_modules: list[str] | None = Field(
        None, description="nn.Linear modules fine-tuned, by name or regex (full match); default: every Linear but the last"
    )
    local_epochs: int = Field(3, ge=1, description="epochs of local fine-tuning")
    r: int = Field(4, ge=1, description="finetune: lora: the adapters' rank")
    alpha: float = Field(8.0, gt=0, description="finetune: lora: the update is (alpha / r) B A")
    base: str | None = Field(
        None,
        description="a safetensors / PyTorch state dict of the run's model, or a Hugging Face folder (config.json and "
        "its weights, read with from_pretrained: nothing downloaded); default: the folder of model.name hf:<folder>, else "
        "the run's shared init",
    )
    lr: float | None = Field(None, gt=0, description="default: train.lr")
    batch_size: int | None = Field(None, ge=1, description="default: train.batch_size")
    samples: int | None = Field(None, ge=1, description="statistics on at most this many of a client's training samples; default: all")
    stats_batch_size: int = Field(256, ge=1, description="batch size of the statistics' passes")
    regmean_alpha: float = Field(0.9, ge=0, le=1, description="regmean: the share of the Grams' off-diagonal kept (1: exact least squares)")
    weighted: bool = Field(True, description="weight clients by their sample counts")
    export: str | None = Field(
        None,
        description="a new folder (nothing is overwritten) where each client writes its fine-tuned model and its statistics (client-<id>.safetensors, "
        "client-<id>.<merge>.safetensors): the files rayfuse fuse's fisher / regmean read",
    )


def payload_keys(
    base: dict[str, np.ndarray], targets: list[str], finetune: str, merge: str, r: int, update_dtype: Any = None
) -> dict[str, np.ndarray]:
    """The keys, shapes and dtypes of a client's reply (zeros): what the server accepts and nothing else."""
    out: dict[str, np.ndarray] = {}
    tuned = _tuned_keys(base, targets, finetune)
    for t in targets:
        w = base[f"{t}.weight"]
        dtype = update_dtype or w.dtype
        if finetune == "lora":
            out[f"{LORA_A}{t}"] = np.zeros((r, w.shape[1]), dtype=dtype)
            out[f"{LORA_B}{t}"] = np.zeros((w.shape[0], r), dtype=dtype)
    if finetune == "full":
        out.update({f"{UPDATE}{k}": np.zeros(base[k].shape, dtype=update_dtype or base[k].dtype) for k in tuned})
    if merge == "fisher":
        out.update({f"{FISHER}{k}": np.zeros(base[k].shape, dtype=np.float64) for k in tuned})
    elif merge == "regmean":
        for t in targets:
            width = base[f"{t}.weight"].shape[1]
            out[f"{GRAM}{t}.weight"] = np.zeros((width, width), dtype=np.float64)
    return out


def _tuned_keys(base: dict[str, np.ndarray], targets: list[str], finetune: str) -> list[str]:
    """The tensors a client's update changes: the targets' weights (and, fully fine-tuned, their biases)."""
    keys = []
    for t in targets:
        keys.append(f"{t}.weight")
        if finetune == "full" and f"{t}.bias" in base:
            keys.append(f"{t}.bias")
    return keys


@client_step("fedmerge.fit")
def fit(ctx: ClientContext, base: dict[str, np.ndarray], adapter: dict[str, np.ndarray] | None, **kwargs: Any) -> Update:
    """Fine-tune the base on this client's training split, compute the merge's statistic on it (the update folded into
    the model), and return the update (task vector or adapter factors), the statistic and the sample count
    (``kwargs``: :func:`_finetune`'s)."""
    out, metrics = _finetune(ctx, base, adapter, **kwargs)
    return Update(out, ctx.num_examples, metrics)


def _finetune(
    ctx: ClientContext,
    base: dict[str, np.ndarray],
    adapter: dict[str, np.ndarray] | None,
    *,
    label: str,
    targets: list[str],
    finetune: str,
    merge: str,
    scale: float,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: Literal["adam", "sgd"],
    momentum: float,
    weight_decay: float,
    samples: int | None,
    stats_batch_size: int,
    export: str | None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """A client's fine-tune and statistics (the export written where asked): its reply's arrays (:func:`payload_keys`)
    and its metrics."""
    from rayfuse.finetunes.statistics import STATISTIC_OF, compute_statistics, write_statistics
    from rayfuse.fusion.lora.algorithm import _wrap, merged_params
    from rayfuse.models import get_params, set_params, train_model

    model = set_params(ctx.build_model(seed=0), base)
    tuned = _tuned_keys(base, targets, finetune)
    wrappers: dict[str, Any] = {}
    if finetune == "lora":
        assert adapter is not None
        wrappers = _wrap(model, targets, adapter, adapter, scale, True)
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(name in tuned)
    stats = train_model(
        model,
        ctx.train.X,
        ctx.train.y,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        seed=ctx.step_seed(label, "finetune"),
        device=ctx.device,
    )
    out: dict[str, np.ndarray] = {}
    if finetune == "lora":
        delta = {}
        for t, w in wrappers.items():
            a, b = w.lora_A.detach().cpu().numpy().copy(), w.lora_B.detach().cpu().numpy().copy()
            out[f"{LORA_A}{t}"], out[f"{LORA_B}{t}"] = a, b
            delta[t] = scale * (b.astype(np.float64) @ a.astype(np.float64))
        own = merged_params(base, delta)  # the base with this client's update folded in: the model it fine-tuned
    else:
        trained = get_params(model)
        # the base with this client's fine-tuned tensors: its buffers (BatchNorm's running statistics, moved in training
        # mode) stay the base's, as under fedlora, so the exported model is exactly what the server merges
        own = {**base, **{k: trained[k] for k in tuned}}
        for k in tuned:
            out[f"{UPDATE}{k}"] = (own[k].astype(np.float64) - base[k].astype(np.float64)).astype(base[k].dtype)
    X, y = ctx.train.X, ctx.train.y
    if samples is not None and len(X) > samples:  # a seeded subset of the client's own split
        idx = np.sort(np.random.default_rng(ctx.step_seed(label, "stats")).choice(len(X), samples, replace=False))
        X, y = X[idx], y[idx]
    statistic = STATISTIC_OF.get(merge)
    found: dict[str, np.ndarray] = {}
    if statistic is not None:  # on the fine-tuned model, its update folded in (what the merge combines)
        folded = set_params(ctx.build_model(seed=0), own)
        found = compute_statistics(folded, X, y, statistic, tuned, batch_size=stats_batch_size, device=ctx.device)
        out.update({f"{FISHER if statistic == 'fisher' else GRAM}{k}": v for k, v in found.items()})
    if export is not None:
        folder = Path(export)
        folder.mkdir(parents=True, exist_ok=True)
        from rayfuse.io import save_params

        save_params(folder / f"client-{ctx.client_id}.safetensors", own, {"rayfuse.base_update": finetune})
        if statistic is not None:
            write_statistics(folder / f"client-{ctx.client_id}.{merge}.safetensors", found, statistic, len(X))
    return out, {"train_loss": stats.loss, "train_seconds": stats.seconds}


@client_step("fedmerge.scales")
def secure_scales(
    ctx: ClientContext,
    base: dict[str, np.ndarray],
    adapter: dict[str, np.ndarray] | None,
    *,
    scaled: ScaledSum,
    weighted: bool,
    regmean_alpha: float,
    **kwargs: Any,
) -> dict[str, np.ndarray]:
    """Under secure aggregation, the first of a client's two sums: its fine-tune and statistics (as :func:`fit`), its
    share of the merge's sums formed here (:func:`~rayfuse.finetunes.statistics.weighted_terms`, weighted by its count
    or 1; its count times its training loss) and kept in its process for :func:`secure_terms`; it sends the
    power-of-two band of each term's largest entry (:meth:`ScaledSum.bands`)."""
    from rayfuse.finetunes.statistics import weighted_terms

    out, metrics = _finetune(ctx, base, adapter, **kwargs)
    merge = kwargs["merge"]
    prefix = FISHER if merge == "fisher" else GRAM
    stats = {k.removeprefix(prefix): v for k, v in out.items() if k.startswith(prefix)} if merge != "average" else None
    delta = client_update(out, kwargs["targets"], kwargs["finetune"], kwargs["scale"])
    terms = weighted_terms(delta, stats, float(ctx.num_examples) if weighted else 1.0, merge, regmean_alpha=regmean_alpha)
    terms[LOSS] = np.asarray(ctx.num_examples * float(metrics["train_loss"]))
    if set(terms) != {k for k, _ in scaled.keys}:
        raise ValueError(f"fedmerge: this client's terms {sorted(set(terms) ^ {k for k, _ in scaled.keys})[:3]} are not the server's")
    ctx.state[(SECURE_STATE, kwargs["label"])] = terms
    return scaled.bands(terms)


@client_step("fedmerge.terms")
def secure_terms(ctx: ClientContext, keys: list[str], *, label: str) -> dict[str, np.ndarray]:
    """The second sum: the terms :func:`secure_scales` kept, those the server sums (the others are zero in every
    client, or not needed)."""
    terms = ctx.state.pop((SECURE_STATE, label), None)
    if terms is None:  # a process that restarted between the sums lost them: this client leaves the second
        raise SecAggFailure(f"fedmerge: client {ctx.client_id} holds no terms of {label!r} (its process restarted?)")
    return {k: terms[k] for k in keys}


@register_method
class FedMerge(Method[FedMergeParams, None]):
    name = "fedmerge"
    Params = FedMergeParams
    summary = (
        "clients fine-tune one shared base (full or LoRA) and compute Fisher / RegMean statistics; the server merges the updates with them"
    )
    reference = REGMEAN
    # the server weighs the updates by statistics (not a parameter average): attacks, robust rules and DP do not apply;
    # every merge is a function of sums over the clients, so it runs under secure aggregation (two secure sums)
    tags = MethodTags(fuses="statistics", sums=True)
    test_case = MethodCase({"local_epochs": 1}, step="fedmerge.fit")

    @classmethod
    def tags_for(cls, params: FedMergeParams | None = None) -> MethodTags:
        """What the server combines: updates weighted by the clients' statistics; ``average``'s plain mean of the task
        vectors is combined here too, not by the update pipeline, so its attacks, robust rules and DP do not act on it."""
        if params is not None and params.merge == "average":
            return replace(cls.tags, fuses="task vectors")
        return cls.tags

    @classmethod
    def check(cls, params: FedMergeParams, setup: RunSetup) -> None:
        if setup.input_shape is None or setup.num_classes is None:
            return  # a silo run's first check: the model's shape is not known yet
        from rayfuse.fusion.lora.algorithm import check_base_and_targets

        check_base_and_targets(setup, params.base, params.target_modules, params.r if params.finetune == "lora" else None)
        if params.export is not None:  # as rayfuse fuse's output: a new folder, so no earlier run's files mix in
            from rayfuse.io import check_new_output

            check_new_output(params.export, key="export", what="a folder")

    def run(self, server: ServerContext) -> MethodResult:
        from rayfuse.fusion.lora.algorithm import model_targets_and_base

        p = self.params
        train = server.models.train_cfg
        model, targets, base, base_path = model_targets_and_base(server, p.base, p.target_modules)
        scale = p.alpha / p.r
        adapter: dict[str, np.ndarray] | None = None
        if p.finetune == "lora":
            rng = server.rng("fedmerge-A")
            adapter = {}
            for t in targets:
                out_f, in_f = base[f"{t}.weight"].shape
                dtype = base[f"{t}.weight"].dtype
                # PEFT's init: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0 (each client starts at the base)
                adapter[f"{t}.lora_A"] = rng.uniform(-1 / math.sqrt(in_f), 1 / math.sqrt(in_f), size=(p.r, in_f)).astype(dtype)
                adapter[f"{t}.lora_B"] = np.zeros((out_f, p.r), dtype=dtype)
        if p.export is not None:  # the base beside the clients' files: the base_model of the offline merge
            from rayfuse.io import save_params

            Path(p.export).mkdir(parents=True, exist_ok=True)
            save_params(Path(p.export) / "base.safetensors", base)
        kwargs: dict[str, Any] = dict(
            label=server.label,
            targets=targets,
            finetune=p.finetune,
            merge=p.merge,
            scale=scale,
            epochs=p.local_epochs,
            lr=p.lr or train.lr,
            batch_size=p.batch_size or train.batch_size,
            optimizer=train.optimizer,
            momentum=train.momentum,
            weight_decay=train.weight_decay,
            samples=p.samples,
            stats_batch_size=p.stats_batch_size,
            export=p.export,
        )
        secure: dict[str, object] = {}
        if server.updates.secure is not None:
            merged, kept, loss = self._merge_sums(server, base, adapter, kwargs, secure)
        else:
            merged, kept, loss = self._merge_replies(server, base, adapter, kwargs)
        weights = _weights(kept.values(), p.weighted)
        fused = dict(base)
        for k, d in merged.items():
            fused[k] = (base[k].astype(np.float64) + d).astype(base[k].dtype)
        metrics = server.scoring.evaluate(fused)
        server.log(1, {"train_loss": loss, "clients": float(len(kept))})
        info: dict[str, object] = {
            "merge": p.merge,
            "finetune": p.finetune,
            "targets": targets,
            "clients": list(kept),
            "weights": weights,
            "base": base_path or "shared init",
            "export": p.export,
        }
        if secure:  # the pipeline's record of the secure sums, with the merge's error
            info["secure_aggregation"] = {**server.updates.info().get("secure_aggregation", {}), **secure}
        return MethodResult(metrics, fused, info=info)

    def _merge_replies(
        self, server: ServerContext, base: dict[str, np.ndarray], adapter: dict[str, np.ndarray] | None, kwargs: dict[str, Any]
    ) -> tuple[dict[str, np.ndarray], dict[int, int], float]:
        """The merge from every client's reply (:func:`fit`): the merged update, the clients merged with their counts,
        and their count-weighted training loss."""
        from rayfuse.finetunes.statistics import merge_task_vectors

        p, fed = self.params, server.federation
        gathered = fed.run(fit, fed.put(base), adapter, clients=fed.client_ids, **kwargs)
        updates = server.updates.accept(gathered, payload_keys(base, kwargs["targets"], p.finetune, p.merge, p.r))
        weights = _weights([u.num_examples for u in updates.values()], p.weighted)
        deltas, stats = [], []
        for u in updates.values():
            deltas.append(client_update(u.params, kwargs["targets"], p.finetune, kwargs["scale"]))
            prefix = FISHER if p.merge == "fisher" else GRAM
            stats.append({k.removeprefix(prefix): v for k, v in u.params.items() if k.startswith(prefix)})
        merged = merge_task_vectors(deltas, stats if p.merge != "average" else None, weights, p.merge, regmean_alpha=p.regmean_alpha)
        losses = np.array([u.metrics.get("train_loss", np.nan) for u in updates.values()])
        counts = np.array([u.num_examples for u in updates.values()], dtype=float)
        return merged, {c: int(u.num_examples) for c, u in updates.items()}, float(np.sum(losses * counts) / counts.sum())

    def _merge_sums(
        self,
        server: ServerContext,
        base: dict[str, np.ndarray],
        adapter: dict[str, np.ndarray] | None,
        kwargs: dict[str, Any],
        record: dict[str, object],
    ) -> tuple[dict[str, np.ndarray], dict[int, int], float]:
        """The merge from secure sums (``federation.secure_aggregation``): :func:`secure_scales`, then
        :func:`secure_terms` (:class:`~rayfuse.updates.secure.ScaledSum`'s two sums), then
        :func:`~rayfuse.finetunes.statistics.merge_sums`. As :meth:`_merge_replies`, with ``record`` filled: the
        levels' bits, the entries clipped (none, but beyond ``2^256``) and the bound on the merged update's gap from
        the plain merge of the same clients."""
        from rayfuse.finetunes.statistics import merge_sums, term_shapes, terms_needed
        from rayfuse.updates.secure import BANDS, ArraySum, ScaledSum, level_bits

        p, updates = self.params, server.updates
        payload = payload_keys(base, kwargs["targets"], p.finetune, p.merge, p.r)
        shapes = {k: v.shape for k, v in client_update(payload, kwargs["targets"], p.finetune, kwargs["scale"]).items()}
        prefix = FISHER if p.merge == "fisher" else GRAM
        stat_keys = [k.removeprefix(prefix) for k in payload if k.startswith(prefix)]
        terms = {**term_shapes(shapes, stat_keys, p.merge), LOSS: ()}
        scaled = ScaledSum(tuple(sorted(terms.items())))
        extra = {"scaled": scaled, "weighted": p.weighted, "regmean_alpha": p.regmean_alpha}
        first = updates.secure_sum(secure_scales, (base, adapter), scaled.bands_encoding, step_kwargs={**kwargs, **extra}, what="scales")
        bands, _ = scaled.bands_encoding.decode(first.levels)
        found = scaled.arrays(bands["bands"], len(first.contributors))
        needed = set(terms_needed([k for k, _, _, _ in found.keys]))
        encoding = ArraySum(tuple(entry for entry in found.keys if entry[0] in needed))
        kept, levels = dict(first.contributors), None
        if encoding.keys:  # else every client's every term is zero: so are the sums
            done = updates.secure_sum(
                secure_terms,
                ([k for k, _, _, _ in encoding.keys],),
                encoding,
                clients=sorted(kept),
                step_kwargs={"label": server.label},
                what="sums",
            )
            kept, levels = dict(done.contributors), done.levels
        sums, clipped = scaled.decode(encoding, levels)
        if clipped:
            server.events.emit(
                "secure_aggregation",
                f"{clipped} entries of the clients' terms were beyond 2^{BANDS[1]} and clipped in the sum",
                method=server.label,
                clipped_entries=clipped,
            )
        total = sum(kept.values()) if p.weighted else len(kept)
        merged, bounds = merge_sums(sums, total, shapes, p.merge, encoding.error_bounds(len(kept)))
        worst = max(bounds.values(), default=0.0)
        if not math.isfinite(worst):
            unbounded = sorted(k for k, b in bounds.items() if not math.isfinite(b))
            server.events.emit(
                "secure_aggregation",
                f"the sums' resolution bounds no gap of RegMean's solve of {', '.join(unbounded)}: the summed Gram is "
                "singular within the sums' error",
                method=server.label,
            )
        record.update(
            level_bits=level_bits(len(first.contributors)), error_bound=worst if math.isfinite(worst) else None, clipped_entries=clipped
        )
        return merged, kept, float(sums[LOSS]) / sum(kept.values())


def _weights(counts: Any, weighted: bool) -> list[float]:
    """The clients' weights in the merge: their sample counts normalised (``weighted``), else equal."""
    c = np.array(list(counts), dtype=float)
    return [float(w) for w in (c / c.sum() if weighted else np.full(len(c), 1.0 / len(c)))]


def client_update(params: dict[str, np.ndarray], targets: list[str], finetune: str, scale: float) -> dict[str, np.ndarray]:
    """A client's update of each fine-tuned tensor from its reply: the task vector, or the adapter's ``s B A``."""
    if finetune == "lora":
        return {
            f"{t}.weight": scale * (params[f"{LORA_B}{t}"].astype(np.float64) @ params[f"{LORA_A}{t}"].astype(np.float64)) for t in targets
        }
    return {k.removeprefix(UPDATE): v.astype(np.float64) for k, v in params.items() if k.startswith(UPDATE)}
