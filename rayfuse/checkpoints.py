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
anything is fused. Methods register in :data:`FUSERS` with :func:`register_fuser`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from rayfuse.config import StrictSchema, pydantic_input_error
from rayfuse.errors import InputError, RunFailure, suggest
from rayfuse.fusion.aggregate import weighted_average
from rayfuse.fusion.aligned.algorithm import AlignmentSettings, derive_run_spec
from rayfuse.fusion.distill.algorithm import DistillOptions
from rayfuse.io import TORCH_ONLY_FLOATS, check_writable_folder, read_checkpoint, save_params, save_params_cast

__all__ = ["FuseSpec", "Fuser", "FuseInputs", "FUSERS", "register_fuser", "load_fuse_config", "load_fuse_inputs", "fuse_models", "run_fuse",
           "check_floats", "fused_dtype"]


class _FuseSchema(StrictSchema):
    """A fuse file's schema (:class:`rayfuse.config.StrictSchema`)."""


class _Model(_FuseSchema):
    model: str = Field(min_length=1, description="a .safetensors / .pt / .pth / .bin file (relative to the config file)")
    parameters: dict[str, Any] = Field(default_factory=dict, description="per-model parameters (weight: ...)")
    architecture: str | None = Field(None, min_length=3, description='this model\'s class when it is not the file\'s architecture '
                                     '(methods that fuse models of different architectures: distill)')
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
        None, min_length=1, description="one input's shape, to trace the architecture when no data is given (e.g. [3, 32, 32])")
    data: _Data | None = Field(None, description="a sample the methods that need data run on (activation matching, repair)")
    dtype: Literal["bfloat16", "float16", "float32", "float64"] | None = Field(
        None, description="the fused model's float dtype (default: the inputs', when they share one)")
    output: str | None = Field(None, min_length=1)


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


def _weighted(params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs) -> dict[str, np.ndarray]:
    weights = [m.weight for m in per_model]  # type: ignore[attr-defined]
    fused = weighted_average(params, weights)
    if not method.normalize:  # type: ignore[attr-defined]
        scale = float(sum(weights))
        fused = {k: (v * scale).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in fused.items()}
    return fused


register_fuser(Fuser("average", "uniform parameter average, tensor by tensor (no alignment)", _average))
register_fuser(Fuser("weighted_average", "w = sum_k a_k w_k / sum_k a_k with each model's weight a_k (mergekit's linear)",
                     _weighted, WeightedAverageParams, ModelWeight, aliases=("linear",)))


class KLNeuronParams(_FuseSchema):
    lam: float = Field(1.0, ge=0, description="lambda of KL-fusion's eq. 9, relative to the std of the KL costs (jobs/kl_bnn_digits.yaml: 1)")
    variance: float = Field(0.01, gt=0, description="the variance given to every weight of a point-estimate checkpoint")
    solver: Literal["exact", "relaxed"] = "exact"
    seed: int = 0


_MLP1 = ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")


def _kl_neurons(params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs) -> dict[str, np.ndarray]:
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
    return {"layers.0.weight": np.ascontiguousarray(m[:, :d_in], dtype=dtype), "layers.0.bias": np.ascontiguousarray(m[:, d_in], dtype=dtype),
            "layers.1.weight": np.ascontiguousarray(m[:, d_in + 1:].T, dtype=dtype),
            "layers.1.bias": np.mean([p["layers.1.bias"] for p in params], axis=0).astype(dtype)}


register_fuser(Fuser("kl_neurons", "KL-fusion of one-hidden-layer MLPs' neurons: matched across models, width inferred (Claici et al. 2020)",
                     _kl_neurons, KLNeuronParams, aliases=("kl",)))


class AlignParams(AlignmentSettings):
    repair: bool = Field(False, description="re-estimate the fused model's BatchNorm statistics on the data, and rescale the hidden "
                         "layers no BatchNorm follows to the aligned models' statistics on it (REPAIR)")
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
    import json

    explicit = None
    if method.spec is not None:
        try:
            explicit = json.loads(Path(method.spec).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, nested past the parser
            raise InputError("parameters.spec", "a readable JSON permutation spec", f"{type(exc).__name__}: {exc}") from None
    if inputs.example is None:
        raise InputError("input_shape", "one input's shape (e.g. [3, 32, 32]) or data, to trace the architecture"
                         + (" and check parameters.spec on it" if explicit is not None else ""))
    shape = tuple(inputs.example.shape[1:]) if inputs.example is not None else ()
    return derive_run_spec(inputs.model, shape, explicit, where="architecture", spec_where="parameters.spec")


def _aligned(kind: str) -> Callable[[list[dict[str, np.ndarray]], list[BaseModel], BaseModel, FuseInputs], dict[str, np.ndarray]]:
    def fuse(params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs) -> dict[str, np.ndarray]:
        from rayfuse.alignment import activation_matching, merge_average, merge_fisher, merge_regmean, weight_matching
        from rayfuse.matching import thread_map

        p = cast(AlignParams, method)
        spec = _spec_for(inputs, p)
        X, y = inputs.X, inputs.y  # present whenever the parameters need data (Fuser.needs, checked at load)
        weights = [cast(OptionalWeight, m).weight for m in per_model]
        if kind == "weight_matching":
            alignment = weight_matching(params, spec, weights=weights, max_sweeps=p.max_sweeps, inner_sweeps=p.inner_sweeps,
                                        seed=p.seed, executor=thread_map)
        else:
            alignment = activation_matching(params, spec, _LocalCorrelations(inputs, params, spec, p.batch_size), weights=weights,
                                            sweeps=p.sweeps, executor=thread_map)
        aligned = [spec.apply(m, pk) for m, pk in zip(params, alignment.perms)]
        plan = None
        if p.merge == "average":
            fused = merge_average(aligned, weights)
        elif p.merge == "nonparametric":
            from rayfuse.alignment import fuse_nonparametric, resolve_cost_keys, width_roles

            fused, plan = fuse_nonparametric(aligned, spec, width_roles(inputs.model, spec), quality=alignment.quality, weights=weights,
                                             threshold=p.new_unit_threshold, max_width=p.max_width, keys=resolve_cost_keys(spec, None))
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


def _rescale(inputs: FuseInputs, spec: Any, aligned: list[dict[str, np.ndarray]], fused: dict[str, np.ndarray], weights: list[float],
             plan: Any, p: AlignParams) -> dict[str, np.ndarray]:
    """REPAIR's rescaling of the layers no BatchNorm follows, on the fuse file's data (every model sees the same data)."""
    from rayfuse.alignment import apply_repair, repair_targets, repair_units, unit_statistics

    units = repair_units(inputs.model, spec)
    if not units:
        return fused
    X = _given(inputs.X)
    own = [unit_statistics(_with(inputs.model, a), X, units, batch_size=p.batch_size) for a in aligned]
    targets = repair_targets(own, units, weights, index=plan.index if plan is not None else None,
                             widths=plan.widths if plan is not None else None)
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

    import torch

    clone = copy.deepcopy(model)
    state = clone.state_dict()
    if example is not None and any(np.shape(params[k]) != tuple(v.shape) for k, v in state.items() if k in params):
        from rayfuse.symmetry import resize_with_spec

        return resize_with_spec(clone, spec, params, example.shape).eval()
    clone.load_state_dict({k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in params.items()})
    return clone.eval()


class _LocalCorrelations:
    """Activation statistics of every model against the reference, computed here on the fuse file's data (in a
    federation each client computes its own on its data)."""

    def __init__(self, inputs: FuseInputs, models: list[dict[str, np.ndarray]], spec: Any, batch_size: int) -> None:
        from rayfuse.symmetry import trace_model

        self.inputs, self.spec, self.batch_size = inputs, spec, batch_size
        self.own = [_with(inputs.model, m) for m in models]
        self.graph = trace_model(inputs.model)  # the architecture's graph: each model runs it with its own weights

    def __call__(self, reference: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        from rayfuse.alignment import collect_correlations

        ref = _with(self.inputs.model, reference)
        return [collect_correlations(ref, own, self.spec, self.graph, self.graph, _given(self.inputs.X), batch_size=self.batch_size)
                for own in self.own]


register_fuser(Fuser("weight_matching", "git re-basin weight matching, N-way (MergeMany), then a merge; any architecture, data-free",
                     _aligned("weight_matching"), AlignParams, OptionalWeight, needs=_align_needs("weight_matching")))
register_fuser(Fuser("activation_matching", "units matched by their activations on the given data, N-way, then a merge; any architecture",
                     _aligned("activation_matching"), AlignParams, OptionalWeight, needs=_align_needs("activation_matching")))


class DistillFuseParams(DistillOptions):
    """``merge_method: distill``'s parameters: the ``distill`` method's loop parameters, and the choices a fuse file makes
    without a federation."""

    transfer: Literal["public", "synthetic"] | None = Field(None, description="public: the data file's inputs (labels never read); "
                                                            "synthetic: data-free. Default: public with data, synthetic without")
    init: Literal["aligned", "average", "random"] = Field("aligned", description="the student's start: the aligned merge or the "
                                                          "average of the models of the student's architecture, or random")
    alignment: Literal["activation", "weight"] | None = Field(None, description="init: aligned: activation matching on the data, or "
                                                              "weight matching (default: activation with data, weight without)")
    merge: Literal["average", "nonparametric"] = Field("average", description="init: aligned: the aligned merge (nonparametric: "
                                                       "units that match nothing widen the student)")
    weighting: Literal["uniform", "weights"] = Field("uniform", description="teacher weights: uniform, or each model's weight")
    combine: Literal["auto", "logits", "probabilities"] = Field(
        "probabilities", description="the ensemble: weighted probabilities (the default here: without the clients' class counts, "
        "a model's logits for classes it never saw would count as much as its others), logits, or auto (logits when every "
        "model has the file's architecture)")
    seed: int = 0


def _distill_needs(params: BaseModel) -> dict[str, str]:
    p = cast(DistillFuseParams, params)
    out = {"architecture": "distill (the student's class; each model's unless its entry names its own)",
           "input_shape": "distill without data (the generator's output shape)"}
    if p.transfer == "public":
        out["data"] = "transfer: public (its inputs are the transfer set)"
    return out


def _distill(params: list[dict[str, np.ndarray]], per_model: list[BaseModel], method: BaseModel, inputs: FuseInputs) -> dict[str, np.ndarray]:
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


def _distill_start(params: list[dict[str, np.ndarray]], per_model: list[BaseModel], p: DistillFuseParams, inputs: FuseInputs,
                   same: list[bool]) -> Any:
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


register_fuser(Fuser("distill", "the models' ensemble distilled into one student: on the data's inputs (labels unread) or "
                     "data-free; models of different architectures", _distill, DistillFuseParams, OptionalWeight,
                     needs=_distill_needs, heterogeneous=True, labels=False))


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


_Schema = TypeVar("_Schema", bound=BaseModel)


def _validate(schema: type[_Schema], data: Mapping[str, Any], file: Path, prefix: str = "") -> _Schema:
    try:
        return schema.model_validate(dict(data))
    except ValidationError as exc:
        err = pydantic_input_error(exc, prefix=prefix, model=schema)
        raise InputError(f"{file}: {err.path}", err.expected, err.got, err.hint) from None


def load_fuse_config(config: str | Path | Mapping[str, Any], output: str | Path | None = None) -> FuseSpec:
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
    spec = _validate(_FuseFile, raw, path)
    name = _ALIASES.get(spec.merge_method, spec.merge_method)
    if name not in FUSERS:
        names = sorted([*FUSERS, *_ALIASES])
        raise InputError(f"{path}: merge_method", f"a fuse method in {{{', '.join(names)}}}", spec.merge_method,
                         suggest(spec.merge_method, names).strip(" ()") or "methods that need client data run in a federation (rayfuse run)")
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
            raise InputError(f"{path}: models.{i}.architecture", f"no architecture of its own with merge_method {fuser.name} (it fuses "
                             "models of one architecture, the file's architecture:)", entry.architecture,
                             "models of different architectures fuse with merge_method: distill")
        own.append(None if entry.architecture is None else (entry.architecture, dict(entry.architecture_args)))
        file = Path(entry.model)
        if not file.is_absolute() and not file.is_file():
            file = path.parent / file
        if not file.is_file():
            raise InputError(f"{path}: models.{i}.model", "an existing model file", entry.model)
        if file.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
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
    if out.exists():
        raise InputError(f"{path}: output", "a file that does not exist yet (nothing is overwritten)", str(out))
    check_writable_folder(out.parent, key=f"{path}: output")
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
    if spec.architecture is None and (spec.architecture_args or spec.input_shape):
        raise InputError(f"{path}: architecture", "the class that architecture_args / input_shape are for", "none")
    return FuseSpec(fuser, files, per_model, params, spec.dtype, out, spec.architecture, dict(spec.architecture_args),
                    tuple(spec.input_shape) if spec.input_shape else None, data,
                    (spec.data.features, spec.data.label) if spec.data else ("X", "y"), path, tuple(own))


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
                raise InputError(f"{file}: {key}", f"shape {tuple(ref.shape)} as in {files[0].name}", tuple(params[key].shape),
                                 "models of different architectures cannot be fused tensor by tensor")
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
    built = [model if arch is None else build_architecture(arch[0], arch[1], where=f"{prefix}models.{i}.architecture",
                                                           args_where=f"{prefix}models.{i}.architecture_args")
             for i, arch in enumerate(own)]
    for i, (params, file, arch) in enumerate(zip(models, spec.files, own)):
        check_checkpoint_fits(built[i], params, where=file, ref=spec.architecture if arch is None else arch[0])
    X = y = None
    if spec.data is not None:
        if spec.method.labels:
            from rayfuse.data.datasets import load_dataset

            dataset = load_dataset("npz", path=str(spec.data), features=spec.data_arrays[0], label=spec.data_arrays[1])
            X, y = dataset.X, dataset.y
        else:
            from rayfuse.data.datasets import read_unlabeled_npz

            X = read_unlabeled_npz(spec.data, spec.data_arrays[0], where=f"{prefix}data.path")
        example = X[:2]
        where = f"{prefix}data.path"
    elif spec.input_shape is not None:
        example = np.zeros((2, *spec.input_shape), dtype=np.float32)
        where = f"{prefix}input_shape"
    else:
        example = None
    if example is not None:
        outputs = check_inputs_fit(model, example, where=where)
        for i, (arch, teacher) in enumerate(zip(own, built)):
            if arch is not None:
                check_inputs_fit(teacher, example, where=f"{where} (models.{i}.architecture {arch[0]})", num_outputs=int(outputs[1]))
    heterogeneous = spec.method.heterogeneous
    return FuseInputs(model, X, y, example, tuple(built) if heterogeneous else (), tuple(arch is None for arch in own) if heterogeneous else (),
                      log)


def check_floats(models: Sequence[Mapping[str, np.ndarray]], files: Sequence[Path]) -> None:
    """A model to fuse holds at least one floating-point tensor (an integer-only model has nothing to average)."""
    for params, file in zip(models, files):
        if not params:
            raise InputError(str(file), "a model with at least one tensor", "an empty checkpoint")
        if not any(v.dtype.kind == "f" for v in params.values()):
            name, value = next(iter(params.items()))
            raise InputError(f"{file}: {name}", "a model with floating-point tensors to fuse",
                             f"integer tensors only ({value.dtype})")


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
    models = [{k: v.astype(common) if v.dtype.kind == "f" else v for k, v in m.items()} for m in models]
    fused = spec.method.fuse(models, spec.model_params, spec.params, inputs or FuseInputs())
    if spec.dtype is not None and spec.dtype not in TORCH_ONLY_FLOATS:
        fused = {k: v.astype(spec.dtype) if v.dtype.kind == "f" else v for k, v in fused.items()}
    return fused


def run_fuse(spec: FuseSpec, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load, check, fuse and write; return a summary (tensors, parameters, output).

    Checkpoints in ``bfloat16`` / ``float16`` are fused in float32 and written back in the inputs' dtype (or the fuse
    file's ``dtype:``)."""
    loaded = [read_checkpoint(file) for file in spec.files]
    models = [params for params, _ in loaded]
    check_floats(models, spec.files)
    if not spec.method.heterogeneous:
        check_compatible(models, spec.files)
    else:  # each against its own architecture (load_fuse_inputs), and finite
        for params, file in zip(models, spec.files):
            check_compatible([params], [file])
    inputs = load_fuse_inputs(spec, models, log)
    fused = fuse_models(spec, models, inputs)
    output = Path(spec.output) if spec.output is not None else Path("fused.safetensors")  # load_fuse_config always sets it
    metadata = {"method": spec.method.name, "models": ",".join(f.name for f in spec.files)}
    dtype = fused_dtype([dtypes for _, dtypes in loaded], spec.dtype)
    if dtype is None:
        save_params(output, fused, metadata)
    else:
        save_params_cast(output, fused, dtype, metadata)
    reference = {k: tuple(v.shape) for k, v in inputs.model.state_dict().items()} if inputs.model is not None else \
        {k: tuple(np.shape(v)) for k, v in models[0].items()}
    resized = {k: (reference[k], tuple(np.shape(v))) for k, v in fused.items() if k in reference and reference[k] != tuple(np.shape(v))}
    return {"method": spec.method.name, "models": len(models), "tensors": len(fused),
            "parameters": int(sum(v.size for v in fused.values())), "output": str(spec.output), "resized": resized}
