"""``rayfuse fuse``: fuse checkpoints trained elsewhere, with no federation and no client data (mergekit-style YAML).

::

    merge_method: weighted_average      # average | weighted_average (alias linear)
    models:
      - model: hospital_a.safetensors
        parameters: {weight: 3}         # weighted_average: each model's weight (e.g. its sample count)
      - model: hospital_b.pt            # torch.load(weights_only=True): a state_dict of tensors
        parameters: {weight: 1}
    parameters: {normalize: true}       # the method's own parameters
    dtype: float32                      # optional: the output's float dtype (default: the inputs')
    output: fused.safetensors

``rayfuse fuse CONFIG [OUT]`` checks everything first -- the file's keys, each method's parameters, every model file
readable, and every model holding the same tensor names and shapes as the first -- and fails with one line (exit 2)
before it fuses anything. Model files are read with ``safetensors`` or ``torch.load(weights_only=True)`` only.

Aligned fusion of any architecture (``weight_matching``, ``activation_matching``) takes the models' class and, where
its parameters need it, a data sample::

    merge_method: activation_matching
    architecture: mypkg.models:ResNetTiny    # or torchvision:<name>
    architecture_args: {num_classes: 10}
    data: {path: sample.npz}                 # arrays X (as the model takes them) and y
    parameters: {merge: average, repair: true}

Every checkpoint is checked against the architecture tensor by tensor, and the data against the model, before
anything is fused; tensors the architecture ties must hold one value (a file that keeps one name of a tied tensor gets
it under every name). What leaves is checked like what enters (:func:`check_fused`): every float tensor finite in the
dtype it is written in, tied tensors one value; only then is the file written (a temporary file renamed). The output's
metadata records the architecture, its arguments, the input shape and, for a model whose groups grew, the permutation
spec and each group's width, from which :func:`load_fused` builds the model in one call. Methods register in
:data:`FUSERS` with :func:`register_fuser`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from rayfuse.config import StrictSchema, pydantic_input_error
from rayfuse.errors import InputError, NonFiniteError, RunFailure, suggest
from rayfuse.finetunes.config import FinetuneSpec, is_finetune, load_finetune_config
from rayfuse.finetunes.lora import LoraSpec, load_lora_config, run_lora
from rayfuse.fusion.aggregate import weighted_average
from rayfuse.fusion.aligned.algorithm import AlignmentSettings, derive_run_spec
from rayfuse.fusion.distill.algorithm import DistillOptions
from rayfuse.io import (
    DEFAULT_MAX_SHARD_SIZE,
    TORCH_ONLY_FLOATS,
    check_new_output,
    params_exist,
    parse_json,
    read_checkpoint,
    read_params_metadata,
    save_params,
    save_params_cast,
)

__all__ = [
    "FuseSpec",
    "Fuser",
    "FuseInputs",
    "FUSERS",
    "register_fuser",
    "load_fuse_config",
    "load_fuse_inputs",
    "fuse_models",
    "run_fuse",
    "check_floats",
    "fused_dtype",
    "tied_names",
    "check_ties",
    "check_fused",
    "load_fused",
]


class _FuseSchema(StrictSchema):
    """A fuse file's schema (:class:`rayfuse.config.StrictSchema`)."""


class _Model(_FuseSchema):
    model: str = Field(min_length=1, description="a .safetensors / .pt / .pth / .bin file (relative to the config file)")
    parameters: dict[str, Any] = Field(default_factory=dict, description="per-model parameters (weight: ...)")
    architecture: str | None = Field(
        None,
        min_length=3,
        description="this model's class when it is not the file's architecture "
        "(methods that fuse models of different architectures: distill)",
    )
    architecture_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for this model's architecture")


class _Data(_FuseSchema):
    path: str = Field(min_length=1, description="an .npz file (relative to the config file) with the inputs as the model takes them")
    features: str = Field("X", min_length=1, description="the inputs' array name")
    label: str = Field("y", min_length=1, description="the labels' array name (methods that read no labels ignore it: distill)")


class _FuseFile(_FuseSchema):
    merge_method: str = Field(min_length=1)
    models: list[_Model] = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)
    architecture: str | None = Field(None, min_length=3, description='"module:Class" or "torchvision:<name>": the models\' class')
    architecture_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the architecture")
    input_shape: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, min_length=1, description="one input's shape, to trace the architecture when no data is given (e.g. [3, 32, 32])"
    )
    data: _Data | None = Field(None, description="a sample the methods that need data run on (activation matching, repair)")
    vocab: int | None = Field(
        None,
        ge=1,
        description="the models take token ids in [0, vocab) (Hugging Face models): input_shape "
        "is then the ids' shape (e.g. [16]) and the example batch random ids; data: X must hold such ids",
    )
    dtype: Literal["bfloat16", "float16", "float32", "float64"] | None = Field(
        None, description="the fused model's float dtype (default: the inputs', when they share one)"
    )
    output: str | None = Field(None, min_length=1)
    max_shard_size: int = Field(
        DEFAULT_MAX_SHARD_SIZE,
        ge=1,
        description="bytes: an output above this size is a folder at output: of model-0000k-of-0000n.safetensors "
        "shards and their model.safetensors.index.json (default 2 GiB; rayfuse fuse --max-shard-size)",
    )


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
    method reads the data's labels (``False``: an ``.npz`` of inputs only is enough)."""

    name: str
    summary: str
    fuse: Callable[[list[dict[str, np.ndarray]], list[BaseModel], BaseModel, FuseInputs], dict[str, np.ndarray]]
    Params: type[BaseModel] = NoParams
    ModelParams: type[BaseModel] = NoParams
    aliases: tuple[str, ...] = ()
    needs: Callable[[BaseModel], dict[str, str]] = lambda params: {}
    heterogeneous: bool = False
    labels: bool = True


FUSERS: dict[str, Fuser] = {}
_ALIASES: dict[str, str] = {}


def register_fuser(fuser: Fuser) -> Fuser:
    FUSERS[fuser.name] = fuser
    for alias in fuser.aliases:
        _ALIASES[alias] = fuser.name
    return fuser


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


register_fuser(Fuser("average", "uniform parameter average, tensor by tensor (no alignment)", _average))
register_fuser(
    Fuser(
        "weighted_average",
        "w = sum_k a_k w_k / sum_k a_k with each model's weight a_k (mergekit's linear)",
        _weighted,
        WeightedAverageParams,
        ModelWeight,
        aliases=("linear",),
    )
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


register_fuser(
    Fuser(
        "kl_neurons",
        "KL-fusion of one-hidden-layer MLPs' neurons: matched across models, width inferred (Claici et al. 2020)",
        _kl_neurons,
        KLNeuronParams,
        aliases=("kl",),
    )
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


register_fuser(
    Fuser(
        "weight_matching",
        "git re-basin weight matching, N-way (MergeMany), then a merge; any architecture, data-free",
        _aligned("weight_matching"),
        AlignParams,
        OptionalWeight,
        needs=_align_needs("weight_matching"),
    )
)
register_fuser(
    Fuser(
        "activation_matching",
        "units matched by their activations on the given data, N-way, then a merge; any architecture",
        _aligned("activation_matching"),
        AlignParams,
        OptionalWeight,
        needs=_align_needs("activation_matching"),
    )
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
    combine: Literal["auto", "logits", "probabilities"] = Field(
        "probabilities",
        description="the ensemble: weighted probabilities (the default here: without the clients' class counts, "
        "a model's logits for classes it never saw would count as much as its others), logits, or auto (logits when every "
        "model has the file's architecture)",
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

    from rayfuse.fusion.distill.student import distill_public, distill_synthetic
    from rayfuse.fusion.distill.teachers import Teachers, teacher_weights
    from rayfuse.models import get_params

    p = cast(DistillFuseParams, method)
    transfer = p.transfer or ("public" if inputs.X is not None else "synthetic")
    teachers_built = list(inputs.models) or [inputs.model for _ in params]
    same = list(inputs.same) or [True] * len(params)
    teachers = Teachers([_with(model, m) for model, m in zip(teachers_built, params)], batched=p.batched == "vmap")
    weights_k = np.array([cast(OptionalWeight, m).weight for m in per_model], dtype=np.float64) if p.weighting == "weights" else None
    num_classes = int(teachers.predict(torch.as_tensor(np.asarray(inputs.example, np.float32))).shape[-1])
    counts = np.ones((len(params), num_classes)) if weights_k is None else np.repeat(weights_k[:, None], num_classes, axis=1)
    weights = teacher_weights("samples" if weights_k is not None else "uniform", counts)
    student = _distill_start(params, per_model, p, inputs, same)
    settings = p.settings(p.seed, one_architecture=all(same))

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


register_fuser(
    Fuser(
        "distill",
        "the models' ensemble distilled into one student: on the data's inputs (labels unread) or "
        "data-free; models of different architectures",
        _distill,
        DistillFuseParams,
        OptionalWeight,
        needs=_distill_needs,
        heterogeneous=True,
        labels=False,
    )
)


@dataclass(frozen=True)
class FuseSpec:
    """A validated fuse config."""

    method: Fuser
    files: list[Path]
    model_params: list[BaseModel]
    params: BaseModel
    dtype: str | None
    output: Path | None
    architecture: str | None = None
    architecture_args: Mapping[str, Any] | None = None
    input_shape: tuple[int, ...] | None = None
    data: Path | None = None
    data_arrays: tuple[str, str] = ("X", "y")
    config: Path | None = None
    model_architectures: tuple[tuple[str, Mapping[str, Any]] | None, ...] = ()
    vocab: int | None = None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE


_Schema = TypeVar("_Schema", bound=BaseModel)


def _validate(schema: type[_Schema], data: Mapping[str, Any], file: Path, prefix: str = "") -> _Schema:
    try:
        return schema.model_validate(dict(data))
    except ValidationError as exc:
        err = pydantic_input_error(exc, prefix=prefix, model=schema)
        raise InputError(f"{file}: {err.path}", err.expected, err.got, err.hint) from None


def load_fuse_config(
    config: str | Path | Mapping[str, Any], output: str | Path | None = None, max_shard_size: int | None = None
) -> FuseSpec | LoraSpec | FinetuneSpec:
    """Read and validate a fuse config, a YAML file or the same as a dict (its relative paths then from the working
    directory); files are checked to exist, not yet read."""
    if isinstance(config, Mapping):
        raw: Any = dict(config)
        path = Path("<fuse config>")  # names the errors; relative paths resolve from the working directory
    else:
        from rayfuse.safeyaml import read_yaml_file

        path = Path(config)
        raw = read_yaml_file(path, "fuse config YAML")
    if not isinstance(raw, Mapping):
        raise InputError(str(path), "a mapping (merge_method, models, output...)", type(raw).__name__)
    if raw.get("merge_method") == "lora":  # PEFT adapters, folders in and out (rayfuse.finetunes.lora); run_fuse runs it
        return load_lora_config(raw, path, output)
    if is_finetune(raw, path, output):  # fine-tunes of one base model (base_model:, Hugging Face folders): rayfuse.finetunes
        return load_finetune_config(raw, path, output)
    spec = _validate(_FuseFile, raw, path)
    name = _ALIASES.get(spec.merge_method, spec.merge_method)
    if name not in FUSERS:
        names = sorted([*FUSERS, *_ALIASES])
        raise InputError(
            f"{path}: merge_method",
            f"a fuse method in {{{', '.join(names)}}}",
            spec.merge_method,
            suggest(spec.merge_method, names).strip(" ()") or "methods that need client data run in a federation (rayfuse run)",
        )
    fuser = FUSERS[name]
    params = _validate(fuser.Params, spec.parameters, path, "parameters")
    if getattr(params, "spec", None):  # a spec file, relative to the config file like the models
        spec_file = Path(params.spec)  # type: ignore[attr-defined]
        if not spec_file.is_absolute() and not spec_file.is_file():
            spec_file = path.parent / spec_file
        if not spec_file.is_file():
            raise InputError(f"{path}: parameters.spec", "an existing JSON permutation spec (rayfuse symmetry ARCH --json)", params.spec)  # type: ignore[attr-defined]
        params = params.model_copy(update={"spec": str(spec_file)})
    files, per_model, own = [], [], []
    for i, entry in enumerate(spec.models):
        if entry.architecture is None and entry.architecture_args:
            raise InputError(f"{path}: models.{i}.architecture", "the class that this model's architecture_args are for", "none")
        if entry.architecture is not None and not fuser.heterogeneous:
            raise InputError(
                f"{path}: models.{i}.architecture",
                f"no architecture of its own with merge_method {fuser.name} (it fuses "
                "models of one architecture, the file's architecture:)",
                entry.architecture,
                "models of different architectures fuse with merge_method: distill",
            )
        own.append(None if entry.architecture is None else (entry.architecture, dict(entry.architecture_args)))
        file = Path(entry.model)
        if not file.is_absolute() and not file.is_file():
            file = path.parent / file
        if not params_exist(file):
            raise InputError(f"{path}: models.{i}.model", "an existing model file", entry.model)
        if file.is_dir() or file.name.endswith(".index.json"):  # shards (rayfuse.io.save_params): each must exist
            read_params_metadata(file)
        elif file.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
            raise InputError(f"{path}: models.{i}.model", "a .safetensors, .pt, .pth or .bin file", entry.model)
        files.append(file)
        per_model.append(_validate(fuser.ModelParams, entry.parameters, path, f"models.{i}.parameters"))
    out = Path(output) if output is not None else (Path(spec.output) if spec.output else None)
    if out is None:
        raise InputError(f"{path}: output", "the fused model's file (output: ... or rayfuse fuse CONFIG OUT)")
    if not out.is_absolute() and output is None:
        out = path.parent / out
    if out.suffix != ".safetensors":
        raise InputError(f"{path}: output", "a .safetensors file", str(out))
    check_new_output(out, key=f"{path}: output", what="a file")
    data = None
    if spec.data is not None:
        data = Path(spec.data.path)
        if not data.is_absolute() and not data.is_file():
            data = path.parent / data
        if not data.is_file() or data.suffix != ".npz":
            raise InputError(f"{path}: data.path", "an existing .npz file (arrays X and y)", spec.data.path)
    for need, why in fuser.needs(params).items():
        if need == "architecture" and spec.architecture is None:
            raise InputError(f"{path}: architecture", f'the models\' class ("module:Class" or "torchvision:<name>") for {why}')
        if need == "data" and spec.data is None:
            raise InputError(f"{path}: data", f"a sample (data: {{path: sample.npz}} with arrays X and y) for {why}")
        if need == "input_shape" and spec.data is None and spec.input_shape is None:
            raise InputError(f"{path}: input_shape", f"one input's shape (e.g. [1, 8, 8]) for {why}")
    if spec.vocab is not None and not name.endswith("matching") and name not in ("average", "weighted_average"):
        raise InputError(f"{path}: vocab", f"no vocab with merge_method {name} (token ids: weight_matching, or the averages)", spec.vocab)
    if spec.architecture is None and (spec.architecture_args or spec.input_shape):
        raise InputError(f"{path}: architecture", "the class that architecture_args / input_shape are for", "none")
    if spec.architecture is None and spec.vocab is not None:
        raise InputError(f"{path}: architecture", "the class that takes the token ids vocab is for", "none")
    return FuseSpec(
        fuser,
        files,
        per_model,
        params,
        spec.dtype,
        out,
        spec.architecture,
        dict(spec.architecture_args),
        tuple(spec.input_shape) if spec.input_shape else None,
        data,
        (spec.data.features, spec.data.label) if spec.data else ("X", "y"),
        path,
        tuple(own),
        spec.vocab,
        spec.max_shard_size if max_shard_size is None else max_shard_size,
    )


def check_compatible(models: Sequence[Mapping[str, np.ndarray]], files: Sequence[Path]) -> None:
    """Every model must hold the first model's tensor names and shapes (one line naming the first mismatch)."""
    reference = models[0]
    for params, file in zip(models[1:], files[1:]):
        missing = [k for k in reference if k not in params]
        extra = [k for k in params if k not in reference]
        if missing or extra:
            what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
            raise InputError(str(file), f"the tensor names of {files[0].name} ({len(reference)} tensors)", what)
        for key, ref in reference.items():
            if params[key].shape != ref.shape:
                raise InputError(
                    f"{file}: {key}",
                    f"shape {tuple(ref.shape)} as in {files[0].name}",
                    tuple(params[key].shape),
                    "models of different architectures cannot be fused tensor by tensor",
                )
            if (params[key].dtype.kind == "f") != (ref.dtype.kind == "f"):
                raise InputError(f"{file}: {key}", f"a {ref.dtype} tensor as in {files[0].name}", str(params[key].dtype))
        for key, value in params.items():
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise InputError(f"{file}: {key}", "finite values", "NaN or Inf")
    for key, value in reference.items():
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise InputError(f"{files[0]}: {key}", "finite values", "NaN or Inf")


def load_fuse_inputs(spec: FuseSpec, models: Sequence[Mapping[str, np.ndarray]], log: Callable[[str], None] | None = None) -> FuseInputs:
    """Build the architecture (and each model's own, for a method that takes several), check every checkpoint against
    its architecture, load the data and check each architecture takes it."""
    if spec.architecture is None:
        return FuseInputs(log=log)
    from rayfuse.models.architecture import build_architecture, check_checkpoint_fits, check_inputs_fit

    prefix = f"{spec.config}: " if spec.config else ""
    model = build_architecture(spec.architecture, spec.architecture_args, where=f"{prefix}architecture")
    own = spec.model_architectures or tuple(None for _ in models)
    built = [
        model
        if arch is None
        else build_architecture(
            arch[0], arch[1], where=f"{prefix}models.{i}.architecture", args_where=f"{prefix}models.{i}.architecture_args"
        )
        for i, arch in enumerate(own)
    ]
    for i, (params, file, arch) in enumerate(zip(models, spec.files, own)):
        ties = tied_names(built[i])
        fill_ties(cast(dict, params), ties)  # a file saved without the duplicate names (safetensors' save_model)
        check_checkpoint_fits(built[i], params, where=file, ref=spec.architecture if arch is None else arch[0])
        check_ties(params, ties, where=str(file))
    X = y = None
    if spec.data is not None:
        # X as stored, shaped as the model takes it: (N, L, D) sequences for a recurrent or attention model stay
        # (N, L, D) (a training set's (N, H, W) reads as grey images; a model's sample needs no such guess)
        if spec.method.labels:
            from rayfuse.data.datasets import read_data_file

            dataset = read_data_file(spec.data, features=spec.data_arrays[0], label=spec.data_arrays[1], kind="npz", as_stored=True)
            X, y = dataset.X, dataset.y
        else:
            from rayfuse.data.datasets import read_unlabeled_npz

            X = read_unlabeled_npz(spec.data, spec.data_arrays[0], where=f"{prefix}data.path", as_stored=True)
        if spec.vocab is not None:
            X = token_ids(X, spec.vocab, where=f"{prefix}data.path")
        example = X[:2]
        where = f"{prefix}data.path"
    elif spec.input_shape is not None and spec.vocab is not None:
        # random ids (seeded), not zeros: a batch of one repeated token would let the invariance check pass groups that
        # only such inputs leave unchanged
        example = np.random.default_rng(0).integers(0, spec.vocab, (2, *spec.input_shape), dtype=np.int64)
        where = f"{prefix}input_shape"
    elif spec.input_shape is not None:
        example = np.zeros((2, *spec.input_shape), dtype=np.float32)
        where = f"{prefix}input_shape"
    else:
        example = None
    if example is not None:
        try:
            outputs = check_inputs_fit(model, example, where=where)
        except InputError:
            rows = _embedding_rows(model) if spec.vocab is not None else None
            if rows is not None and spec.vocab is not None and spec.vocab > rows:
                raise InputError(
                    f"{prefix}vocab", f"at most the model's vocabulary ({rows} rows in its input embedding)", spec.vocab
                ) from None
            raise
        labels = np.asarray(y) if y is not None else None
        if labels is not None and labels.dtype.kind in "iu" and len(outputs) == 2 and labels.size:
            # class labels (a Fisher's log-likelihood reads the output at each label): within the model's outputs
            if labels.min() < 0 or labels.max() >= outputs[1]:
                raise InputError(
                    f"{prefix}data.path",
                    f"class labels in [0, {outputs[1]}) (the model's {outputs[1]} outputs)",
                    f"labels {int(labels.min())}..{int(labels.max())}",
                )
        for i, (arch, teacher) in enumerate(zip(own, built)):
            if arch is not None:
                check_inputs_fit(teacher, example, where=f"{where} (models.{i}.architecture {arch[0]})", num_outputs=int(outputs[1]))
    heterogeneous = spec.method.heterogeneous
    return FuseInputs(
        model, X, y, example, tuple(built) if heterogeneous else (), tuple(arch is None for arch in own) if heterogeneous else (), log
    )


def _embedding_rows(model: Any) -> int | None:
    """The number of token ids ``model`` embeds: its input embedding's rows (a Hugging Face model's
    ``get_input_embeddings()``, else its first ``nn.Embedding``); ``None`` without one."""
    import torch.nn as nn

    embedding = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(embedding.num_embeddings) if embedding is not None else None


def token_ids(X: np.ndarray, vocab: int, *, where: str) -> np.ndarray:
    """``X`` as int64 token ids (the fuse file's ``vocab``): whole numbers in ``[0, vocab)``, else one line naming
    ``where``. The data reader gives float32, which holds every id below 2**24 exactly; larger ids are refused, as
    float32 may already have rounded them."""
    values = np.asarray(X)
    if values.size and (not np.all(values == np.round(values)) or values.min() < 0 or values.max() >= min(vocab, 2**24)):
        bad = values[(values != np.round(values)) | (values < 0) | (values >= min(vocab, 2**24))].flat[0]
        raise InputError(where, f"token ids: whole numbers in [0, {vocab}) (vocab)", float(bad))
    return np.ascontiguousarray(values.astype(np.int64))


def check_floats(models: Sequence[Mapping[str, np.ndarray]], files: Sequence[Path]) -> None:
    """A model to fuse holds at least one floating-point tensor (an integer-only model has nothing to average)."""
    for params, file in zip(models, files):
        if not params:
            raise InputError(str(file), "a model with at least one tensor", "an empty checkpoint")
        if not any(v.dtype.kind == "f" for v in params.values()):
            name, value = next(iter(params.items()))
            raise InputError(f"{file}: {name}", "a model with floating-point tensors to fuse", f"integer tensors only ({value.dtype})")


def fused_dtype(stored: Sequence[Mapping[str, str]], given: str | None) -> str | None:
    """The dtype to write the fused float tensors in: ``given`` (the fuse file's ``dtype:``), else, when some input is
    stored in a dtype below float32 (``float16``, ``bfloat16``...), the inputs' float dtype when they share one and
    torch's promotion of them otherwise; ``None``: the dtype the fusion computed in (inputs of float32 / float64)."""
    if given is not None:
        return given
    floats = {d for s in stored for d in s.values() if "float" in d}
    if not floats or floats <= {"float32", "float64"}:
        return None
    if len(floats) == 1:
        return next(iter(floats))
    import functools

    import torch

    return str(functools.reduce(torch.promote_types, [getattr(torch, d) for d in sorted(floats)])).replace("torch.", "")


def fuse_models(spec: FuseSpec, models: list[dict[str, np.ndarray]], inputs: FuseInputs | None = None) -> dict[str, np.ndarray]:
    """Fuse already loaded, compatible models. Float tensors are fused in their common dtype, at least float32
    (float16 inputs are fused in float32; :func:`fused_dtype` says what to write them in)."""
    common = np.result_type(np.float32, *[v.dtype for m in models for v in m.values() if v.dtype.kind == "f"]) if models else np.float32
    models = [{k: v.astype(common, copy=False) if v.dtype.kind == "f" else v for k, v in m.items()} for m in models]
    # the fuse file's dtype: is applied when the model is written (run_fuse), after check_fused has seen the values in it
    return spec.method.fuse(models, spec.model_params, spec.params, inputs or FuseInputs())


def run_fuse(spec: FuseSpec | LoraSpec | FinetuneSpec, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load, check, fuse and write; return a summary (tensors, parameters, output).

    Checkpoints in ``bfloat16`` / ``float16`` are fused in float32 and written back in the inputs' dtype (or the fuse
    file's ``dtype:``). LoRA adapters (``merge_method: lora``) go to :func:`rayfuse.finetunes.lora.run_lora`."""
    if isinstance(spec, LoraSpec):
        return run_lora(spec, log)
    if isinstance(spec, FinetuneSpec):  # streamed tensor by tensor (rayfuse.finetunes.run)
        from rayfuse.finetunes.run import run_finetune

        return run_finetune(spec, log)
    loaded = [read_checkpoint(file, mapped=True) for file in spec.files]  # memory-mapped: pages, not copies
    models = [params for params, _ in loaded]
    check_floats(models, spec.files)
    # with an architecture, each checkpoint is checked against it first, which also gives every name of a tied tensor
    # its values: a file that keeps one name of it (safetensors' save_model) then fuses with files that keep both
    inputs = load_fuse_inputs(spec, models, log)
    if not spec.method.heterogeneous:
        check_compatible(models, spec.files)
    else:  # each against its own architecture (load_fuse_inputs), and finite
        for params, file in zip(models, spec.files):
            check_compatible([params], [file])
    try:
        fused = fuse_models(spec, models, inputs)
    except NonFiniteError as exc:  # finite inputs whose products overflow (a matching's costs): the largest names the cause
        raise _overflowed(spec, models, inputs, exc) from None
    output = Path(spec.output) if spec.output is not None else Path("fused.safetensors")  # load_fuse_config always sets it
    dtype = fused_dtype([dtypes for _, dtypes in loaded], spec.dtype)
    check_fused(fused, tied_names(inputs.model) if inputs.model is not None else [], dtype, where=str(output), method=spec.method.name)
    reference = (
        {k: tuple(v.shape) for k, v in inputs.model.state_dict().items()}
        if inputs.model is not None
        else {k: tuple(np.shape(v)) for k, v in models[0].items()}
    )
    resized = {k: (reference[k], tuple(np.shape(v))) for k, v in fused.items() if k in reference and reference[k] != tuple(np.shape(v))}
    metadata = {"method": spec.method.name, "models": ",".join(f.name for f in spec.files), **_fused_metadata(spec, inputs, fused, resized)}
    del loaded, models  # the inputs' maps: the output is written from the fused arrays alone
    # every check is done: the file (or shard folder, past max_shard_size) is staged and renamed, whole or not at all
    if dtype is None:
        save_params(output, fused, metadata, max_shard_size=spec.max_shard_size)
    else:
        save_params_cast(output, fused, dtype, metadata, max_shard_size=spec.max_shard_size)
    return {
        "method": spec.method.name,
        "models": len(spec.files),
        "tensors": len(fused),
        "parameters": int(sum(v.size for v in fused.values())),
        "output": str(spec.output),
        "resized": resized,
    }


# ---------------------------------------------------------------------------------------------------------------
# What leaves fuse: tied tensors, finite values, and a widened model loadable in one call

_META_ARCHITECTURE, _META_ARGS, _META_SHAPE, _META_SPEC, _META_WIDTHS = (
    "rayfuse.architecture",
    "rayfuse.architecture_args",
    "rayfuse.input_shape",
    "rayfuse.spec",
    "rayfuse.widths",
)


def tied_names(model: Any) -> list[tuple[str, ...]]:
    """The state-dict keys that name one tensor of ``model`` (tied parameters: an embedding shared with the decoder,
    one layer's weight assigned to another, a module registered under two names), one tuple per tensor held under
    several names, in state-dict order."""
    names: dict[int, list[str]] = {}
    for key, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(key)
    return [tuple(group) for group in names.values() if len(group) > 1]


def fill_ties(params: dict[str, np.ndarray], ties: Sequence[tuple[str, ...]]) -> None:
    """Give every name of a tied tensor its values where a file holds only some of the names (safetensors'
    ``save_model`` keeps one name per shared tensor)."""
    for group in ties:
        present = [k for k in group if k in params]
        if present:
            for key in group:
                params.setdefault(key, params[present[0]])


def check_ties(params: Mapping[str, np.ndarray], ties: Sequence[tuple[str, ...]], *, where: str, after: str = "") -> None:
    """Every name of a tied tensor holds the same values (one line naming the first that differs). ``after``: the
    method that produced ``params`` (a fused model), named in the message."""
    for group in ties:
        present = [k for k in group if k in params]
        for key in present[1:]:
            first, other = np.asarray(params[present[0]]), np.asarray(params[key])
            if first.shape != other.shape or not np.array_equal(first, other, equal_nan=True):
                if after:
                    raise InputError(
                        f"{where}: {key}",
                        f"the values of {present[0]} (the architecture ties them)",
                        f"different values after {after}",
                        "nothing was written; a spec must give tied tensors the same groups",
                    )
                raise InputError(
                    f"{where}: {key}",
                    f"the values of {present[0]} (the architecture ties them: one tensor under two names)",
                    "different values",
                    "a model of this architecture cannot hold two values there",
                )


def retie(model: Any, ties: Sequence[tuple[str, ...]]) -> Any:
    """Make every name of each group in ``ties`` hold one tensor again (the first name's), after a resize gave each
    module a tensor of its own. Returns ``model``."""
    for group in ties:
        tensor = _slot(model, group[0])
        for key in group[1:]:
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if attr in module._parameters:
                module._parameters[attr] = tensor
            else:
                module._buffers[attr] = tensor
    return model


def _slot(model: Any, key: str) -> Any:
    owner, _, attr = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def check_fused(fused: Mapping[str, np.ndarray], ties: Sequence[tuple[str, ...]], dtype: str | None, *, where: str, method: str) -> None:
    """What leaves ``fuse`` is checked like what enters it, before anything is written: every float tensor is finite
    in the dtype it is written in (``dtype``; ``None``: its own), and tied tensors (``ties``) hold one value. One line
    naming the output file and the first tensor that fails."""
    import torch

    # InputError (exit 2), not NonFiniteError (a run that failed, exit 1): the inputs were checked finite and these
    # fusions are deterministic, so a NaN or Inf here follows from the files and the fuse file's weights and dtype,
    # which the user changes; the hint says which
    for key, value in fused.items():
        if value.dtype.kind != "f":
            continue
        if not np.isfinite(value).all():
            raise InputError(
                f"{where}: {key}",
                "finite values in the fused model",
                f"NaN or Inf after {method}",
                "the inputs are finite, so the fusion overflowed (values near the float range, or weights that scale them "
                "past it); nothing was written",
            )
        if dtype is None or np.dtype(value.dtype).name == dtype:
            continue
        if dtype in TORCH_ONLY_FLOATS:
            finite = bool(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)).to(getattr(torch, dtype)).isfinite().all())
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                finite = bool(np.isfinite(value.astype(dtype)).all())
        if not finite:
            largest = float(np.abs(value).max())
            raise InputError(
                f"{where}: {key}",
                f"values that {dtype} can hold",
                f"{largest:.4g} (Inf once written as {dtype})",
                "write a wider dtype (dtype: float32); nothing was written",
            )
    check_ties(fused, ties, where=where, after=method)


def _overflowed(spec: FuseSpec, models: Sequence[Mapping[str, np.ndarray]], inputs: FuseInputs, exc: NonFiniteError) -> InputError:
    """The fusion of finite inputs met a NaN or Inf on the way (a matching's costs overflowed): one line naming the
    input with the largest magnitude, the checkpoint tensor or the data, whose values drive the overflow."""
    where, largest = "", -1.0
    for params, file in zip(models, spec.files):
        for key, value in params.items():
            if value.dtype.kind == "f" and value.size and float(np.abs(value).max()) > largest:
                where, largest = f"{file}: {key}", float(np.abs(value).max())
    if inputs.X is not None and np.asarray(inputs.X).dtype.kind == "f" and np.size(inputs.X):
        if float(np.abs(inputs.X).max()) > largest:
            where, largest = f"{spec.config}: data.path" if spec.config else "data.path", float(np.abs(inputs.X).max())
    return InputError(
        where,
        f"values {spec.method.name} can compute with (it met a NaN or Inf from these finite inputs)",
        f"{largest:.3g}",
        f"{exc}; nothing was written",
    )


def _fused_metadata(spec: FuseSpec, inputs: FuseInputs, fused: Mapping[str, np.ndarray], resized: Mapping[str, Any]) -> dict[str, str]:
    """What :func:`load_fused` needs besides the tensors: the architecture and its arguments, the input shape, and for
    a model whose groups grew (a nonparametric merge) the permutation spec at the architecture's widths and each
    group's width in the file."""
    import json

    out: dict[str, str] = {}
    if spec.architecture is not None:
        out[_META_ARCHITECTURE] = spec.architecture
        # a record for the reader: arguments JSON cannot hold (a Python API caller's objects) are written as repr
        out[_META_ARGS] = json.dumps(dict(spec.architecture_args or {}), sort_keys=True, default=repr)
    if inputs.example is not None:
        out[_META_SHAPE] = json.dumps([int(n) for n in np.shape(inputs.example)[1:]])
    if resized and inputs.model is not None and inputs.example is not None:
        from rayfuse.symmetry.structure import read_group_sizes

        run_spec = _spec_for(inputs, AlignParams(spec=getattr(spec.params, "spec", None)))
        template = {k: tuple(v.shape) for k, v in inputs.model.state_dict().items()}
        out[_META_SPEC] = json.dumps(run_spec.to_dict(), sort_keys=True)
        out[_META_WIDTHS] = json.dumps(read_group_sizes(run_spec, template, {k: np.shape(v) for k, v in fused.items()}), sort_keys=True)
    return out


def _read_fused(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A model file's tensors and (safetensors) metadata."""
    params, _ = read_checkpoint(path)
    if path.suffix != ".safetensors" and not path.is_dir() and not path.name.endswith(".index.json"):
        return dict(params), {}
    return dict(params), read_params_metadata(path)  # read_checkpoint has read it: the header is valid


def _build_for_load(architecture: Any, args: Mapping[str, Any] | None, meta: Mapping[str, str], where: str) -> Any:
    import copy

    from torch import nn

    if isinstance(architecture, str):
        from rayfuse.models.architecture import build_architecture

        if args is None and meta.get(_META_ARCHITECTURE) == architecture and _META_ARGS in meta:
            args = parse_json(meta[_META_ARGS], f"{where}: metadata {_META_ARGS}", "a JSON object")
        return build_architecture(architecture, args, where="architecture", args_where="args")
    if isinstance(architecture, nn.Module):  # an instance: a copy of it receives the tensors
        if args:
            raise InputError("args", "no arguments with a model instance (they are for a class or factory)", sorted(args))
        return copy.deepcopy(architecture).eval()
    if not callable(architecture):
        raise InputError(
            "architecture", '"module:Class", an nn.Module class or a function returning an nn.Module', type(architecture).__name__
        )
    name = getattr(architecture, "__qualname__", type(architecture).__name__)
    try:
        model = architecture(**dict(args or {}))
    except Exception as exc:  # the user's constructor: one line naming it
        raise InputError(
            "args", f"keyword arguments {name} accepts", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        ) from None
    if not isinstance(model, nn.Module):
        raise InputError("architecture", "a class or function returning a torch.nn.Module", type(model).__name__)
    return model.eval()


def load_fused(
    architecture: Any, path: str | Path, *, args: Mapping[str, Any] | None = None, input_shape: Sequence[int] | None = None
) -> Any:
    """The model a fused file holds, in one call: ``architecture`` built and loaded with the file's tensors, in eval mode.

    Parameters
    ----------
    architecture : str, nn.Module class, function or nn.Module
        ``"module:Class"`` / ``"torchvision:<name>"`` (as a fuse file's ``architecture:``), a class or a function that
        returns the model, or a model (copied).
    path : str or Path
        A ``.safetensors`` file written by ``rayfuse fuse`` (or any checkpoint of the architecture).
    args : mapping, optional
        Keyword arguments for the architecture; by default the fuse file's ``architecture_args`` recorded in the
        output when ``architecture`` is the reference it names.
    input_shape : sequence of int, optional
        One input's shape, for a file whose widths differ from the architecture's and that does not record its
        permutation spec (one not written by ``rayfuse fuse``): the spec is derived on it.

    A file whose groups grew (``merge: nonparametric``) records its spec and widths: the model is built at those
    widths (each layer's size attributes follow) and tied tensors stay one tensor. Raises :class:`InputError` (one
    line naming the file and tensor) for a file that does not fit the architecture.
    """

    import torch

    from rayfuse.models.architecture import check_checkpoint_fits
    from rayfuse.models.params import tensors_over

    file = Path(path)
    if not params_exist(file):
        raise InputError(str(path), "an existing model file (.safetensors, .pt, .pth, .bin)", "no such file")
    params, meta = _read_fused(file)
    model = _build_for_load(architecture, args, meta, str(file))
    ties = tied_names(model)
    fill_ties(params, ties)
    check_ties(params, ties, where=str(file))
    state = model.state_dict()
    if not any(k in params and tuple(np.shape(params[k])) != tuple(v.shape) for k, v in state.items()):
        check_checkpoint_fits(model, params, where=file, ref="the architecture")
        model.load_state_dict(tensors_over(params))
        return model.eval()
    from rayfuse.symmetry import PermutationSpec, derive_spec, resize_with_spec

    shape = tuple(int(n) for n in input_shape) if input_shape is not None else None
    if shape is None and _META_SHAPE in meta:
        listed = parse_json(meta[_META_SHAPE], f"{file}: metadata {_META_SHAPE}", "a JSON list of integers")
        try:
            shape = tuple(int(n) for n in listed)
        except (TypeError, ValueError):
            raise InputError(f"{file}: metadata {_META_SHAPE}", "a JSON list of integers", meta[_META_SHAPE][:40]) from None
    if _META_SPEC in meta:
        where_spec = f"{file}: metadata {_META_SPEC}"
        spec = PermutationSpec.from_dict(parse_json(meta[_META_SPEC], where_spec, "a JSON permutation spec"), where=where_spec)
        try:
            spec.check({k: tuple(v.shape) for k, v in state.items()}, where="spec")
        except InputError as exc:  # the architecture was built otherwise than the fuse file built it
            raise InputError(
                f"{file}: metadata {_META_SPEC}",
                f"the architecture as the fuse file built it ({exc.path.removeprefix('spec.')}: {exc.expected})",
                exc.got,
                "pass the fuse file's architecture_args as args=",
            ) from None
    elif shape is not None:
        spec = derive_spec(model, torch.zeros((2, *shape)))
    else:
        key = next(k for k, v in state.items() if k in params and tuple(np.shape(params[k])) != tuple(v.shape))
        raise InputError(
            f"{file}: {key}",
            f"shape {tuple(state[key].shape)} (the architecture's), or a file that records its widths (rayfuse fuse writes them)",
            tuple(np.shape(params[key])),
            "give input_shape= to derive the groups",
        )
    if shape is None:
        raise InputError(
            f"{file}: metadata {_META_SHAPE}", "one input's shape, to check the widened model runs", "none", "give input_shape="
        )
    return retie(resize_with_spec(model, spec, params, (2, *shape), where=str(file)), ties).eval()
