"""The merges of ``rayfuse fuse`` that read whole checkpoints of one architecture in memory: the averages of checkpoints
of a class (``architecture:``), KL-fusion of neurons, weight and activation matching, and distillation.

Each is a :class:`Fuser` (parameter schemas and ``fuse(params_list, per_model, params, inputs) -> params``), registered
by :mod:`rayfuse.merging.registry`; :mod:`rayfuse.merging.run` checks the checkpoints against the architecture, loads
the data the merge needs and writes what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
from pydantic import BaseModel, Field

from rayfuse.config import StrictSchema
from rayfuse.errors import InputError, RunFailure
from rayfuse.fusion.aligned.algorithm import AlignmentSettings, derive_run_spec
from rayfuse.fusion.distill.algorithm import DistillOptions
from rayfuse.merging.output import retie, tied_names
from rayfuse.updates.aggregate import weighted_average

__all__ = [
    "Fuser",
    "FuseInputs",
    "AlignParams",
    "AVERAGE",
    "WEIGHTED_AVERAGE",
    "KL_NEURONS",
    "WEIGHT_MATCHING",
    "ACTIVATION_MATCHING",
    "DISTILL",
]


class _FuseSchema(StrictSchema):
    """A fuse file's schema (:class:`rayfuse.config.StrictSchema`)."""


class WeightedAverageParams(_FuseSchema):
    normalize: bool = Field(True, description="divide by the sum of the weights (False: a plain weighted sum)")


class ModelWeight(_FuseSchema):
    weight: float = Field(gt=0, description="this model's weight (e.g. its number of training samples)")


class NoParams(_FuseSchema):
    """No parameters."""


@dataclass(frozen=True)
class FuseInputs:
    """What a fuser gets besides the checkpoints: the architecture built (eval mode, ``None`` when the file names none)
    and the sample from ``data:`` (``X`` as the model takes it, ``y`` labels; ``None`` without data). ``example`` is a
    batch of two inputs to trace the architecture with (from the data, or zeros of ``input_shape``). ``models``: each
    checkpoint's architecture, built (a fuser that takes models of different architectures; else empty); ``same``:
    whether checkpoint ``i`` has the file's architecture; ``log``: where a long fusion reports its progress (one line)."""

    model: Any = None
    X: np.ndarray | None = None
    y: np.ndarray | None = None
    example: np.ndarray | None = None
    models: tuple[Any, ...] = ()
    same: tuple[bool, ...] = ()
    log: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Fuser:
    """A fusion method for checkpoints: parameter schemas and ``fuse(params_list, per_model, params, inputs) -> params``.

    ``needs(params)``: what the fuse file must give besides the models for these parameters, as
    ``{"architecture" | "data" | "input_shape": why}``. ``heterogeneous``: the models may have architectures of their
    own (each model entry's ``architecture``), each checkpoint then checked against its own; ``labels``: whether the
    method reads the data's labels (``False``: an ``.npz`` of inputs only is enough); ``data``: whether it reads a
    ``data:`` sample always ("required"), with some parameters ("optional": ``needs`` says which) or never ("none"),
    for the table of merges."""

    name: str
    summary: str
    fuse: Callable[[list[dict[str, np.ndarray]], list[BaseModel], BaseModel, FuseInputs], dict[str, np.ndarray]]
    Params: type[BaseModel] = NoParams
    ModelParams: type[BaseModel] = NoParams
    aliases: tuple[str, ...] = ()
    needs: Callable[[BaseModel], dict[str, str]] = lambda params: {}
    heterogeneous: bool = False
    labels: bool = True
    data: Literal["none", "optional", "required"] = "none"


def _average(params: list[dict[str, np.ndarray]], per_model: list[BaseModel], _: BaseModel, inputs: FuseInputs) -> dict[str, np.ndarray]:
    return weighted_average(params)


def _weighted(
    params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs
) -> dict[str, np.ndarray]:
    weights = [m.weight for m in per_model]  # type: ignore[attr-defined]
    fused = weighted_average(params, weights)
    if not method.normalize:  # type: ignore[attr-defined]
        scale = float(sum(weights))
        with np.errstate(over="ignore"):  # an overflow is refused, naming the tensor, before anything is written (check_fused)
            fused = {k: (v * scale).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in fused.items()}
    return fused


AVERAGE = Fuser("average", "uniform parameter average, tensor by tensor (no alignment)", _average)
WEIGHTED_AVERAGE = Fuser(
    "weighted_average",
    "w = sum_k a_k w_k / sum_k a_k with each model's weight a_k (mergekit's linear)",
    _weighted,
    WeightedAverageParams,
    ModelWeight,
    aliases=("linear",),
)


class KLNeuronParams(_FuseSchema):
    lam: float = Field(
        1.0, ge=0, description="lambda of KL-fusion's eq. 9, relative to the std of the KL costs (jobs/kl_bnn_digits.yaml: 1)"
    )
    variance: float = Field(0.01, gt=0, description="the variance given to every weight of a point-estimate checkpoint")
    solver: Literal["exact", "relaxed"] = "exact"
    seed: int = 0


_MLP1 = ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")


def _kl_neurons(
    params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs
) -> dict[str, np.ndarray]:
    """KL-fusion of the hidden neurons of one-hidden-layer MLPs (Claici et al. 2020, the BNN application).

    Every hidden neuron ``[w_in | b | w_out]`` of every model is a diagonal Gaussian (mean: the checkpoint's values;
    variance: ``variance``, as the checkpoints are point estimates); eq. (9) matches them across models, infers the
    fused width and returns the barycenters; the output bias is averaged. The neurons of the models need not be in the
    same order (the matching finds the permutation).
    """
    from rayfuse.expfam import DiagGaussian
    from rayfuse.fusion.kl.fusion import fuse_heterogeneous

    keys = sorted(params[0])
    if sorted(_MLP1) != keys:
        raise InputError("merge_method", "kl_neurons on one-hidden-layer MLPs (tensors " + ", ".join(_MLP1) + ")", keys[:6])
    d_in = params[0]["layers.0.weight"].shape[1]
    neurons = []
    for i, p in enumerate(params):
        mean = np.concatenate([p["layers.0.weight"], p["layers.0.bias"][:, None], p["layers.1.weight"].T], axis=1).astype(np.float64)
        neurons.append(DiagGaussian(mean, np.full_like(mean, method.variance), where=f"models[{i}] neurons"))  # type: ignore[attr-defined]
    result = fuse_heterogeneous(neurons, lam=method.lam, solver=method.solver, random_state=method.seed)  # type: ignore[attr-defined]
    m = result.globals.means()  # the DiagGaussian's mean
    dtype = params[0]["layers.0.weight"].dtype
    return {
        "layers.0.weight": np.ascontiguousarray(m[:, :d_in], dtype=dtype),
        "layers.0.bias": np.ascontiguousarray(m[:, d_in], dtype=dtype),
        "layers.1.weight": np.ascontiguousarray(m[:, d_in + 1 :].T, dtype=dtype),
        "layers.1.bias": np.mean([p["layers.1.bias"] for p in params], axis=0).astype(dtype),
    }


KL_NEURONS = Fuser(
    "kl_neurons",
    "KL-fusion of one-hidden-layer MLPs' neurons: matched across models, width inferred (Claici et al. 2020)",
    _kl_neurons,
    KLNeuronParams,
    aliases=("kl",),
)


class AlignParams(AlignmentSettings):
    repair: bool = Field(
        False,
        description="re-estimate the fused model's BatchNorm statistics on the data, and rescale the hidden "
        "layers no BatchNorm follows to the aligned models' statistics on it (REPAIR)",
    )
    seed: int = 0
    spec: str | None = Field(None, min_length=1, description="a JSON permutation spec (rayfuse symmetry --json) instead of the derived one")


class OptionalWeight(_FuseSchema):
    weight: float = Field(1.0, gt=0, description="this model's weight in the merge (e.g. its number of training samples)")


def _align_needs(kind: str) -> Callable[[BaseModel], dict[str, str]]:
    def needs(params: BaseModel) -> dict[str, str]:
        p = cast(AlignParams, params)
        out = {"architecture": f"{kind} (its permutation groups come from the model's graph)"}
        if kind == "activation_matching":
            out["data"] = "activation_matching (the models' activations on it are matched)"
        elif p.merge in ("fisher", "regmean") or p.repair:
            out["data"] = f"merge: {p.merge}" if p.merge in ("fisher", "regmean") else "repair: true"
        if p.spec is not None and "data" not in out:  # the explicit spec is run through the invariance check on the model
            out["input_shape"] = "parameters.spec (its groups are checked on the model: an input's shape, or data)"
        return out

    return needs


def _spec_for(inputs: FuseInputs, method: AlignParams) -> Any:
    from rayfuse.symmetry.spec import read_spec_json

    explicit = None
    if method.spec is not None:
        try:
            explicit = read_spec_json(method.spec)
        except InputError as exc:  # name the key as well as the file
            raise exc.at(f"parameters.spec: {exc.path}") from None
    if inputs.example is None:
        raise InputError(
            "input_shape",
            "one input's shape (e.g. [3, 32, 32]) or data, to trace the architecture"
            + (" and check parameters.spec on it" if explicit is not None else ""),
        )
    shape = tuple(inputs.example.shape[1:]) if inputs.example is not None else ()
    import torch

    # token ids (vocab) are analysed on the example batch itself; float inputs on zeros of its shape, as before
    ids = torch.as_tensor(inputs.example) if np.issubdtype(np.asarray(inputs.example).dtype, np.integer) else None
    return derive_run_spec(inputs.model, shape, explicit, where="architecture", spec_where="parameters.spec", example=ids)


def _check_weight_matching_only(kind: str, p: AlignParams, inputs: FuseInputs) -> None:
    """A model ``torch.fx`` cannot trace (Hugging Face) is aligned by weight matching with merge average, fisher or
    regmean only, refused otherwise before any work: activation matching's probes and REPAIR's layers are read from the
    torch.fx graph (:func:`rayfuse.symmetry.trace_structure`), and a nonparametric merge widens modules whose sizes
    such models also keep in their config (a widened attention would reshape with the old sizes)."""
    from rayfuse.symmetry import trace_structure

    if kind == "activation_matching":
        trace_structure(inputs.model, "merge_method: activation_matching", where="merge_method")
    if p.repair:
        trace_structure(inputs.model, "repair: true", where="parameters.repair")
    if p.merge == "nonparametric":
        trace_structure(inputs.model, "merge: nonparametric (widening)", where="parameters.merge")
    if p.merge in ("fisher", "regmean") and inputs.X is not None and np.issubdtype(inputs.X.dtype, np.integer):
        raise InputError("parameters.merge", "merge: average with token ids (vocab): fisher and regmean run on float inputs", p.merge)


def _aligned(kind: str) -> Callable[[list[dict[str, np.ndarray]], list[BaseModel], BaseModel, FuseInputs], dict[str, np.ndarray]]:
    def fuse(
        params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs
    ) -> dict[str, np.ndarray]:
        from rayfuse.alignment import activation_matching, merge_average, merge_fisher, merge_regmean, weight_matching
        from rayfuse.matching import thread_map

        p = cast(AlignParams, method)
        _check_weight_matching_only(kind, p, inputs)
        spec = _spec_for(inputs, p)
        X, y = inputs.X, inputs.y  # present whenever the parameters need data (Fuser.needs, checked at load)
        weights = [cast(OptionalWeight, m).weight for m in per_model]
        if kind == "weight_matching":
            alignment = weight_matching(
                params, spec, weights=weights, max_sweeps=p.max_sweeps, inner_sweeps=p.inner_sweeps, seed=p.seed, executor=thread_map
            )
        else:
            alignment = activation_matching(
                params, spec, _LocalCorrelations(inputs, params, spec, p.batch_size), weights=weights, sweeps=p.sweeps, executor=thread_map
            )
        aligned = [spec.apply(m, pk) for m, pk in zip(params, alignment.perms)]
        plan = None
        if p.merge == "average":
            fused = merge_average(aligned, weights)
        elif p.merge == "nonparametric":
            from rayfuse.alignment import fuse_nonparametric, resolve_cost_keys, width_roles

            fused, plan = fuse_nonparametric(
                aligned,
                spec,
                width_roles(inputs.model, spec),
                quality=alignment.quality,
                weights=weights,
                threshold=p.new_unit_threshold,
                max_width=p.max_width,
                keys=resolve_cost_keys(spec, None),
            )
        elif p.merge == "fisher":
            from rayfuse.alignment import diagonal_fisher

            fishers = [diagonal_fisher(_with(inputs.model, a), _given(X), _given(y), batch_size=p.batch_size) for a in aligned]
            fused = merge_fisher(aligned, fishers, weights)
        else:
            from rayfuse.alignment import input_grams

            grams = [input_grams(_with(inputs.model, a), _given(X), batch_size=p.batch_size)[0] for a in aligned]
            fused = merge_regmean(aligned, grams, weights, alpha=p.regmean_alpha)
        if p.repair:
            from rayfuse.alignment import apply_batchnorm, batchnorm_statistics, combine_batchnorm

            if any(k.endswith("running_mean") for k in fused):
                stats = batchnorm_statistics(_with(inputs.model, fused, spec, inputs.example), _given(X), batch_size=p.batch_size)
                fused = apply_batchnorm(fused, combine_batchnorm([stats]))
            fused = _rescale(inputs, spec, aligned, fused, weights, plan, p)
        return fused

    return fuse


def _rescale(
    inputs: FuseInputs,
    spec: Any,
    aligned: list[dict[str, np.ndarray]],
    fused: dict[str, np.ndarray],
    weights: list[float],
    plan: Any,
    p: AlignParams,
) -> dict[str, np.ndarray]:
    """REPAIR's rescaling of the layers no BatchNorm follows, on the fuse file's data (every model sees the same data)."""
    from rayfuse.alignment import apply_repair, repair_targets, repair_units, unit_statistics

    skipped: dict[str, str] = {}
    units = repair_units(inputs.model, spec, skipped=skipped)
    for name, why in skipped.items():
        if inputs.log is not None:
            inputs.log(f"repair: {name} left as merged: {why}")
    if not units:
        return fused
    X = _given(inputs.X)
    own = [unit_statistics(_with(inputs.model, a), X, units, batch_size=p.batch_size) for a in aligned]
    targets = repair_targets(
        own, units, weights, index=plan.index if plan is not None else None, widths=plan.widths if plan is not None else None
    )
    for _ in range(min(len(units), p.repair_passes)):
        merged = unit_statistics(_with(inputs.model, fused, spec, inputs.example), X, units, batch_size=p.batch_size)
        fused = apply_repair(fused, units, repair_targets([merged], units, [1.0]), targets)
    return fused


def _given(array: np.ndarray | None) -> np.ndarray:
    if array is None:  # Fuser.needs makes the fuse file give data for every parameter that uses it
        raise InputError("data", "a sample (data: {path: sample.npz}) for this method's parameters")
    return array


def _with(model: Any, params: Mapping[str, np.ndarray], spec: Any = None, example: np.ndarray | None = None) -> Any:
    """A copy of the architecture holding ``params`` (at their widths, given its spec and an example batch: a
    nonparametric merge grows groups)."""
    import copy

    from rayfuse.models.params import tensors_over

    clone = copy.deepcopy(model)
    state = clone.state_dict()
    if example is not None and any(np.shape(params[k]) != tuple(v.shape) for k, v in state.items() if k in params):
        from rayfuse.symmetry import resize_with_spec

        ties = tied_names(clone)
        return retie(resize_with_spec(clone, spec, params, example.shape), ties).eval()
    clone.load_state_dict(tensors_over(params))
    return clone.eval()


class _LocalCorrelations:
    """Activation statistics of every model against the reference, computed here on the fuse file's data (in a
    federation each client computes its own on its data)."""

    def __init__(self, inputs: FuseInputs, models: list[dict[str, np.ndarray]], spec: Any, batch_size: int) -> None:
        from rayfuse.symmetry import trace_structure

        self.inputs, self.spec, self.batch_size = inputs, spec, batch_size
        self.own = [_with(inputs.model, m) for m in models]
        # the architecture's graph: each model runs it with its own weights
        self.graph = trace_structure(inputs.model, "merge_method: activation_matching", where="merge_method")

    def __call__(self, reference: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        from rayfuse.alignment import collect_correlations

        ref = _with(self.inputs.model, reference)
        return [
            collect_correlations(ref, own, self.spec, self.graph, self.graph, _given(self.inputs.X), batch_size=self.batch_size)
            for own in self.own
        ]


WEIGHT_MATCHING = Fuser(
    "weight_matching",
    "git re-basin weight matching, N-way (MergeMany), then a merge; any architecture, data-free",
    _aligned("weight_matching"),
    AlignParams,
    OptionalWeight,
    needs=_align_needs("weight_matching"),
    data="optional",
)
ACTIVATION_MATCHING = Fuser(
    "activation_matching",
    "units matched by their activations on the given data, N-way, then a merge; any architecture",
    _aligned("activation_matching"),
    AlignParams,
    OptionalWeight,
    needs=_align_needs("activation_matching"),
    data="required",
)


class DistillFuseParams(DistillOptions):
    """``merge_method: distill``'s parameters: the ``distill`` method's loop parameters, and the choices a fuse file makes
    without a federation."""

    transfer: Literal["public", "synthetic"] | None = Field(
        None,
        description="public: the data file's inputs (labels never read); "
        "synthetic: data-free. Default: public with data, synthetic without",
    )
    init: Literal["aligned", "average", "random"] = Field(
        "aligned",
        description="the student's start: the aligned merge or the average of the models of the student's architecture, or random",
    )
    alignment: Literal["activation", "weight"] | None = Field(
        None,
        description="init: aligned: activation matching on the data, or weight matching (default: activation with data, weight without)",
    )
    merge: Literal["average", "nonparametric"] = Field(
        "average", description="init: aligned: the aligned merge (nonparametric: units that match nothing widen the student)"
    )
    weighting: Literal["uniform", "weights"] = Field("uniform", description="teacher weights: uniform, or each model's weight")
    combine: Literal["auto", "logits", "probabilities", "geometric", "energy"] = Field(
        "probabilities",
        description="the ensemble: weighted probabilities (the default here: without the clients' class counts, "
        "a model's logits for classes it never saw would count as much as its others), logits, geometric (the weighted "
        "mean of log-probabilities), energy (geometric plus each model's standardised energy), or auto (energy with data; without, "
        "logits when every model has the file's architecture, else probabilities; the distill method's check of its target "
        "against the clients' class counts needs counts a fuse file does not have)",
    )
    seed: int = 0


def _distill_needs(params: BaseModel) -> dict[str, str]:
    p = cast(DistillFuseParams, params)
    out = {"architecture": "distill (the student's class; each model's unless its entry names its own)"}
    # the data gives the inputs' shape: input_shape is named only where no parameter needs data, so a file lacking both
    # is refused once, at the key that makes it run
    if p.transfer == "public":
        out["data"] = "transfer: public (its inputs are the transfer set)"
    elif p.init == "aligned" and p.alignment == "activation":
        out["data"] = "alignment: activation (the models' activations on it are matched for the student's start)"
    else:
        out["input_shape"] = "distill without data (the generator's output shape)"
    return out


def _distill(
    params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs
) -> dict[str, np.ndarray]:
    """Distil the checkpoints' ensemble into one student of the file's architecture (``rayfuse.fusion.distill``): on the
    data file's inputs (public transfer), or data-free."""
    import torch

    from rayfuse.fusion.distill.student import distill_public, distill_synthetic, held_out
    from rayfuse.fusion.distill.teachers import Teachers, teacher_weights
    from rayfuse.models import get_params

    p = cast(DistillFuseParams, method)
    transfer = p.transfer or ("public" if inputs.X is not None else "synthetic")
    if p.holdout > 0 and transfer == "synthetic":
        raise InputError("parameters.holdout", "0 without data (a held-out share of the data file's inputs)", p.holdout)
    if p.holdout > 0 and transfer == "public":
        n = len(_given(inputs.X))
        if n - held_out(n, p.holdout) < 2:
            raise InputError("parameters.holdout", f"a share that leaves at least 2 of the data file's {n} inputs to train on", p.holdout)
    teachers_built = list(inputs.models) or [inputs.model for _ in params]
    same = list(inputs.same) or [True] * len(params)
    teachers = Teachers([_with(model, m) for model, m in zip(teachers_built, params)], batched=p.batched == "vmap")
    weights_k = np.array([cast(OptionalWeight, m).weight for m in per_model], dtype=np.float64) if p.weighting == "weights" else None
    num_classes = int(teachers.predict(torch.as_tensor(np.asarray(inputs.example, np.float32))).shape[-1])
    counts = np.ones((len(params), num_classes)) if weights_k is None else np.repeat(weights_k[:, None], num_classes, axis=1)
    weights = teacher_weights("samples" if weights_k is not None else "uniform", counts)
    student = _distill_start(params, per_model, p, inputs, same)
    settings = p.settings(p.seed, one_architecture=all(same), transfer=transfer)

    def log(epoch: int, row: dict[str, float]) -> None:
        if inputs.log is not None:
            inputs.log(f"distill: epoch {epoch}/{p.epochs}: loss {row['loss']:.4f}, agreement with the ensemble {row['agreement']:.3f}")

    try:
        if transfer == "public":
            distill_public(student, teachers, _given(inputs.X), weights, settings, log=log)
        else:
            shape = tuple(np.shape(_given(inputs.example))[1:])
            distill_synthetic(student, teachers, shape, weights, settings, log=log)
    except FloatingPointError as exc:
        raise RunFailure(f"distill: {exc}") from None
    return get_params(student)


def _distill_start(
    params: list[dict[str, np.ndarray]], per_model: list[BaseModel], p: DistillFuseParams, inputs: FuseInputs, same: list[bool]
) -> Any:
    """The student: the file's architecture, started from the aligned merge or the average of the checkpoints of that
    architecture, or at random (also when no checkpoint has it)."""
    import copy

    import torch

    ids = [i for i, s in enumerate(same) if s]
    if p.init == "random" or not ids:
        student = copy.deepcopy(inputs.model)
        with torch.random.fork_rng():
            torch.manual_seed(p.seed)
            for module in student.modules():
                if hasattr(module, "reset_parameters") and module is not student:
                    module.reset_parameters()
        return student.train()
    if p.init == "average" or len(ids) == 1:
        start = weighted_average([params[i] for i in ids], [cast(OptionalWeight, per_model[i]).weight for i in ids])
        return _with(inputs.model, start).train()
    alignment = p.alignment or ("activation" if inputs.X is not None else "weight")
    aligned_params = AlignParams(merge=p.merge, seed=p.seed, repair=False)
    start = _aligned(f"{alignment}_matching")([params[i] for i in ids], [per_model[i] for i in ids], aligned_params, inputs)
    return _with(inputs.model, start, _spec_for(inputs, aligned_params), inputs.example).train()


DISTILL = Fuser(
    "distill",
    "the models' ensemble distilled into one student: on the data's inputs (labels unread) or data-free; models of different architectures",
    _distill,
    DistillFuseParams,
    OptionalWeight,
    needs=_distill_needs,
    data="optional",
    heterogeneous=True,
    labels=False,
)
