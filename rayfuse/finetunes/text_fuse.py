"""``rayfuse fuse`` on Hugging Face classifiers with text data: the merges that read the models' outputs on the text.

::

    merge_method: regmean             # fisher | regmean | adamerging | distill
    base_model: base/                 # a Hugging Face folder; its tokenizer tokenises the text (else models.0's)
    models:
      - model: site_a/                # a Hugging Face folder (a full fine-tune) ...
      - model: site_b_adapter/        # ... or a PEFT LoRA adapter of base_model (folded into it)
    data: {path: public.jsonl, text: text, max_length: 64}   # .jsonl / .csv / .parquet (a column) or .txt (a line)
    output: merged/                   # a Hugging Face folder (with the base's config and tokenizer) or a .safetensors

The text is read and tokenised before anything runs (:mod:`rayfuse.data.text`: one line for a missing column, a file
that is not UTF-8, an empty text, a folder without a tokenizer, a ``max_length`` beyond the model's positions), each
model is checked against the base (tensor names and shapes, or an adapter's modules), then:

* ``fisher`` / ``regmean``: each model's statistics are computed on the text and the tensor-by-tensor merge of
  :mod:`rayfuse.finetunes.run` runs on them, as with ``statistics:`` files (:func:`text_statistics` computes the same
  arrays :func:`rayfuse.finetunes.statistics.write_statistics` writes). Fisher is unlabeled: the expectation over the
  model's own softmax, ``F = mean_x sum_c p(c|x) (d log p(c|x))^2`` (exact, one backward pass per class; no sampling),
  or with ``data.label`` the empirical Fisher at the labels. RegMean's Grams are the inputs of every ``nn.Linear`` at a
  text's tokens only (padded positions are masked out, the classifier's pooled input is one row a text), and for
  every embedding table the count of each row's use at those tokens (its diagonal Gram: each row merged by them).
* ``adamerging``: layer-wise AdaMerging (Yang et al., ICLR 2024): ``theta_l = theta_0,l + sum_k lambda_k,l tau_k,l``
  with one coefficient per task vector per tensor, started at ``lambda_init`` (0.3) and learned with Adam (lr 1e-3, 500
  steps of 16 texts) by minimising the mean entropy of the merged model's predictions on the unlabeled text, the
  coefficients clamped to [0, 1] where used, as [ADAMERGING : src/main_layer_wise_adamerging.py] does. There the
  encoder is merged and each task keeps its own frozen head; here the models share one label space and the classifier
  head is merged with the rest. With ``objective: ensemble`` the coefficients minimise instead the KL divergence of
  the merged model's predictions from the models' ensemble (their weighted mean probabilities, computed once on the
  text): an entropy minimum rewards confidence, and label-skewed models' merges are most confident where they are
  wrong; the ensemble is the distillation's target, here reached inside the span of the task vectors.
* ``distill``: the models' ensemble distilled into one student (the base's architecture, started from the models'
  average) on the unlabeled text (:func:`rayfuse.fusion.distill.student.distill_public`). Two texts' token ids cannot
  be averaged; ``mixup`` (0.5 by default) mixes half of each pass's texts with a second one in word-embedding space
  instead (MixKD, Liang et al., ICLR 2021: mixup for distillation from few texts), each model embedding both texts with
  its own table, and the teachers label each mix. On the text benchmark (docs/results/text/) it moved the student from
  0.539 to 0.548 over five seeds.

A LoRA adapter model is folded into the base (``W + s B A`` per module; the modules it trains in full, PEFT's
``modules_to_save`` such as a classifier head, replace the base's) and merged as the full model it gives.
Activation matching, REPAIR and the nonparametric merge are refused: they permute a layer's hidden units, which a
BERT-style model ties across every layer through its residual stream and splits per attention head. Never imports Ray.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, Field

from rayfuse.config import StrictSchema, validate_file_section
from rayfuse.errors import InputError
from rayfuse.finetunes.config import _resolve, merged_output

if TYPE_CHECKING:
    import torch

    from rayfuse.finetunes.config import FinetuneSpec
    from rayfuse.merging.schema import FuseFile

__all__ = [
    "TextMerge",
    "TEXT_MERGES",
    "TextFuseSpec",
    "AdaMergingParams",
    "TextDistillParams",
    "load_text_fuse_config",
    "run_text_fuse",
    "text_statistics",
    "expected_fisher",
    "prediction_entropy",
]


_T = TypeVar("_T")


class _Schema(StrictSchema):
    """A text merge's parameters."""


class AdaMergingParams(_Schema):
    lambda_init: float = Field(0.3, ge=0, le=1, description="every coefficient's start (task arithmetic's lambda)")
    steps: int = Field(500, ge=0, le=1_000_000, description="Adam steps on the prediction entropy (the paper's 500)")
    lr: float = Field(1e-3, gt=0, le=10, description="Adam's learning rate (the paper's 1e-3)")
    batch_size: int = Field(16, ge=1, description="texts a step")
    clamp: bool = Field(True, description="the coefficients used clamped to [0, 1] (the paper's code)")
    objective: Literal["entropy", "ensemble"] = Field(
        "entropy",
        description="what the coefficients minimise on the unlabeled text: the merged model's prediction entropy "
        "(the paper's), or its KL divergence from the models' ensemble (their weighted mean probabilities)",
    )
    seed: int = Field(0, description="the batches' draw")


class TextDistillParams(_Schema):
    steps: int = Field(200, ge=1, le=10_000_000, description="student optimisation steps")
    epochs: int = Field(4, ge=1, le=100_000, description="passes (one ensemble call and progress line each)")
    batch_size: int = Field(16, ge=2, description="student batch size")
    lr: float = Field(5e-5, gt=0, le=10, description="student learning rate (Adam, cosine schedule)")
    temperature: float = Field(4.0, gt=0, le=100, description="distillation temperature T")
    combine: Literal["logits", "probabilities", "geometric", "energy"] = Field(
        "logits",
        description="the ensemble: weighted logits (FedDF), probabilities, geometric (the mean of log-probabilities) or "
        "energy (geometric plus each model's standardised energy)",
    )
    weighting: Literal["uniform", "weights", "classes"] | None = Field(
        None,
        description="teacher weights: uniform, each model's weight, or per class each model's share of the class in the "
        "models' class_counts (the federated distill's default); default: classes where the models give class_counts, "
        "else uniform",
    )
    init: Literal["average", "base"] = Field("average", description="the student's start: the models' weighted average, or the base_model")
    word_dropout: float = Field(
        0.0, ge=0, lt=1, description="each epoch's texts: each token but the first and last dropped with this probability (word dropout)"
    )
    mixup: float = Field(
        0.5,
        ge=0,
        le=1,
        description="each epoch's texts: this share mixed with a second text at a U(0, 1) ratio of their word embeddings "
        "(MixKD's mixup for distillation from few texts; the teachers label each mix; 0: off)",
    )
    holdout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="this share of the texts held out; the student kept is the pass (or the start) with the best "
        "fidelity to the ensemble on them (top-1 agreement, then KL); 0: the last pass",
    )
    patience: int = Field(0, ge=0, description="holdout: stop after this many passes in a row without a better fidelity (0: every pass)")
    seed: int = 0


class TextWeight(_Schema):
    weight: float = Field(1.0, gt=0, description="this model's weight (e.g. its site's number of samples)")


class TextDistillWeight(TextWeight):
    class_counts: list[Annotated[float, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="distill: the model's training samples per class, in the model's label order (its site's label "
        "histogram: counts only); each class's logit is then the ensemble of the models that held it",
    )


@dataclass(frozen=True)
class TextMerge:
    """A merge's form on Hugging Face folders with text: its parameters (``None``: the tensor merge's own, with the
    statistics computed from the text), whether it needs a ``base_model`` and whether it reads ``data.label``."""

    name: str
    summary: str
    Params: type[BaseModel] | None = None
    ModelParams: type[BaseModel] = TextWeight
    base: Literal["required", "optional"] = "optional"
    labels: bool = False


TEXT_MERGES: dict[str, TextMerge] = {
    "fisher": TextMerge("fisher", "Fisher merging, each model's diagonal Fisher computed on the text", labels=True),
    "regmean": TextMerge("regmean", "RegMean, each Linear's input Grams computed on the text's tokens"),
    "adamerging": TextMerge(
        "adamerging",
        "layer-wise AdaMerging: one coefficient per task vector per tensor, learned by minimising the merged model's "
        "prediction entropy on unlabeled text (Yang et al. 2024), or with objective: ensemble its KL divergence from "
        "the models' ensemble",
        AdaMergingParams,
        base="required",
    ),
    "distill": TextMerge(
        "distill", "the models' ensemble distilled into one student on unlabeled text", TextDistillParams, TextDistillWeight
    ),
}

_NO_ALIGNMENT = (
    "activation matching, REPAIR and the nonparametric merge permute a layer's hidden units, which a BERT-style model "
    "ties across all its layers (every layer adds to one residual stream) and splits per attention head"
)


@dataclass(frozen=True)
class TextFuseSpec:
    """A validated fuse file on Hugging Face folders with text: the texts already tokenised (``X``: token-id rows,
    -1 padded), ``y`` their labels where read; ``finetune``: the tensor merge (fisher / regmean) its statistics are
    added to. ``adapters[i]``: whether model ``i`` is a LoRA adapter of ``base``."""

    method: str
    base: Path | None
    models: tuple[Path, ...]
    adapters: tuple[bool, ...]
    weights: tuple[float, ...]
    params: BaseModel | None
    X: np.ndarray
    y: np.ndarray | None
    dtype: str | None
    output: Path
    max_shard_size: int
    config: Path
    tokenizer_folder: Path
    finetune: FinetuneSpec | None = None
    class_counts: tuple[tuple[float, ...], ...] | None = None  # distill: each model's training samples per class


def _refuse_method(method: Any, path: Path) -> InputError:
    """The one line for a merge (a :class:`rayfuse.merging.registry.MergeMethod`: the registry imports this module, so
    it is not imported here) that has no text form."""
    names = ", ".join(TEXT_MERGES)
    if method.fuser is not None and method.name.endswith("matching") or method.name == "kl_neurons":
        hint = f"{_NO_ALIGNMENT}; fuse BERT-style models with {names}"
    elif method.fuser is not None or method.adapters:
        hint = f"{method.name} takes no text; drop data.text"
    else:
        hint = f"{method.name} is data-free: drop data:, or use {names}"
    return InputError(f"{path}: merge_method", f"a merge that reads text data ({names})", method.name, hint)


def load_text_fuse_config(file: FuseFile, path: Path, method: Any, output: str | Path | None = None) -> TextFuseSpec:
    """Validate a fuse file whose ``data:`` is text, read and tokenise the text and check every model against the
    base: everything a merge could refuse, before anything runs or is written."""
    from rayfuse.finetunes.hf import ModelSource, parse_size

    merge = method.text
    if merge is None:
        raise _refuse_method(method, path)
    name = merge.name
    if file.data is None or file.data.text is None:
        raise InputError(f"{path}: data", f"unlabeled text for {name} (data: {{path: texts.jsonl, text: <column>}})", "none")
    data = file.data
    if "features" in data.model_fields_set:
        raise InputError(f"{path}: data.features", "no features with data.text (the text column is the input)", data.features)
    if data.label is not None and not merge.labels:
        raise InputError(f"{path}: data.label", f"no label with merge_method {name} (it reads unlabeled text)", data.label)
    base = _resolve(file.base_model, path) if file.base_model is not None else None
    if base is None and merge.base == "required":
        raise InputError(
            f"{path}: base_model", f"the model the others are fine-tunes of, for {name} (its task vectors are differences from it)"
        )
    if base is not None:
        _hf_folder(base, f"{path}: base_model", file.base_model or "")
    models, adapters = [], []
    for i, entry in enumerate(file.models):
        model = _resolve(entry.model, path)
        where = f"{path}: models.{i}.model"
        is_adapter = model.is_dir() and (model / "adapter_config.json").is_file()
        if is_adapter and base is None:
            raise InputError(f"{path}: base_model", "the base model the LoRA adapters were trained on", "none", f"models.{i} is an adapter")
        if not is_adapter:
            _hf_folder(model, where, entry.model)
        if base is not None and not is_adapter and model.resolve() == base.resolve() and merge.base == "required":
            continue  # mergekit lists the base among the models too; its task vector is zero (as the tensor merges skip it)
        models.append(model)
        adapters.append(is_adapter)
    if not models:
        raise InputError(f"{path}: models", "at least one model besides the base_model", "only the base_model")
    reference_folder = base if base is not None else models[0]
    reference = ModelSource(reference_folder, f"{path}: {'base_model' if base is not None else 'models.0.model'}")
    _check_models(path, reference, [m for m, a in zip(models, adapters) if not a], [m for m, a in zip(models, adapters) if a], file)
    X, y = _read_text(path, data, reference_folder, "base_model" if base is not None else "models.0.model", merge)
    if merge.Params is not None:  # the tensor merges' streaming keys; these merges run in memory and seed themselves
        for key in ("threads", "seed"):
            if getattr(file, key) is not None:
                raise InputError(
                    f"{path}: {key}",
                    f"no {key} with merge_method {name} on text (it runs the models in memory)",
                    getattr(file, key),
                    "parameters.seed seeds it" if key == "seed" else "",
                )
    params = validate_file_section(merge.Params, file.parameters, path, "parameters") if merge.Params is not None else None
    holdout = float(getattr(params, "holdout", 0.0))
    from rayfuse.fusion.distill.student import held_out

    if holdout > 0 and len(X) - held_out(len(X), holdout) < 2:
        raise InputError(f"{path}: parameters.holdout", f"a share that leaves at least 2 of the {len(X)} texts to train on", holdout)
    weights, counts = [], []
    for i, entry in enumerate(file.models):
        own = (
            validate_file_section(merge.ModelParams, entry.parameters, path, f"models.{i}.parameters") if merge.Params is not None else None
        )
        weights.append(float(getattr(own, "weight", 1.0)) if own is not None else 1.0)
        counts.append(getattr(own, "class_counts", None))
    class_counts = _class_counts(path, counts, params, reference_folder) if name == "distill" else None
    finetune = None
    if merge.Params is None:  # fisher / regmean: the tensor merge's parameters, statistics computed from the text
        from rayfuse.finetunes.config import load_finetune_config

        assert method.tensor is not None
        finetune = load_finetune_config(file.model_copy(update={"data": None}), path, method.tensor, output, computed_statistics=True)
        out = finetune.output
    else:
        out = merged_output(file, path, output)
    shard = file.max_shard_size if file.max_shard_size is not None else "2GB"
    return TextFuseSpec(
        name,
        base,
        tuple(models),
        tuple(adapters),
        tuple(_kept_weights(file, base, path, weights, merge)),
        params,
        X,
        y,
        file.out_dtype or file.dtype,
        out,
        parse_size(shard, f"{path}: max_shard_size"),
        path,
        reference_folder,
        finetune,
        None if class_counts is None else tuple(_kept_weights(file, base, path, class_counts, merge)),
    )


def _class_counts(path: Path, counts: list[list[float] | None], params: Any, folder: Path) -> list[tuple[float, ...]] | None:
    """The models' class counts, checked against the distillation's ``weighting`` and the models' number of labels:
    given on every model or on none, as many as the models' labels, each model with a sample."""
    given = [i for i, c in enumerate(counts) if c is not None]
    weighting = params.weighting
    if given and len(given) < len(counts):
        i = next(i for i, c in enumerate(counts) if c is None)
        raise InputError(
            f"{path}: models.{i}.parameters.class_counts", f"class counts on every model or on none (models.{given[0]} has them)"
        )
    if weighting == "classes" and not given:
        raise InputError(
            f"{path}: parameters.weighting",
            "uniform or weights (classes needs each model's class_counts)",
            "classes",
            "give models.<i>.parameters.class_counts: its site's training samples per class",
        )
    if given and weighting in ("uniform", "weights"):
        raise InputError(
            f"{path}: models.{given[0]}.parameters.class_counts",
            f"no class counts with weighting: {weighting} (they would go unread)",
            counts[given[0]],
            "drop weighting (classes is the default with class counts)",
        )
    if not given:
        return None
    import transformers

    from rayfuse.models.hf import quiet_transformers

    with quiet_transformers():
        labels = int(transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True).num_labels)
    given_counts = [c for c in counts if c is not None]  # every model's, checked above
    for i, c in enumerate(given_counts):
        if len(c) != labels:
            raise InputError(f"{path}: models.{i}.parameters.class_counts", f"{labels} counts (the models' num_labels)", c)
        if not sum(c) > 0:
            raise InputError(f"{path}: models.{i}.parameters.class_counts", "at least one sample", c)
    return [tuple(float(v) for v in c) for c in given_counts]


def _kept_weights(file: FuseFile, base: Path | None, path: Path, weights: list[_T], merge: TextMerge) -> list[_T]:
    """The weights (or any per-model values) of the models kept (the base, listed among the models of a merge that
    requires it, dropped)."""
    if base is None or merge.base != "required":
        return weights
    return [w for entry, w in zip(file.models, weights) if _resolve(entry.model, path).resolve() != base.resolve()]


def _hf_folder(folder: Path, where: str, given: str) -> None:
    """A Hugging Face folder with its config.json and safetensors weights (the models run on the text)."""
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise InputError(
            where, "a Hugging Face folder (config.json and model.safetensors) or a PEFT LoRA adapter folder, to run on the text", given
        )


def _check_models(path: Path, reference: Any, full: Sequence[Path], adapters: Sequence[Path], file: FuseFile) -> None:
    """Every full model holds the reference's tensors and shapes; every adapter's modules are layers of the base."""
    from rayfuse.finetunes.hf import ModelSource
    from rayfuse.finetunes.lora import check_against_base as check_adapters
    from rayfuse.finetunes.lora import read_adapter
    from rayfuse.finetunes.run import check_against_base

    index = {str(_resolve(e.model, path)): i for i, e in enumerate(file.models)}
    sources = [ModelSource(m, f"{path}: models.{index.get(str(m), 0)}.model ({m.name})") for m in full]
    check_against_base(reference, [s for s in sources if s.path.resolve() != reference.path.resolve()])
    if adapters:
        wheres = [f"{path}: models.{index.get(str(a), 0)}.model" for a in adapters]
        read = [read_adapter(a, w, saved=True) for a, w in zip(adapters, wheres)]
        check_adapters(read, reference.path, wheres)
        for adapter, at in zip(read, wheres):  # a head trained in full (modules_to_save) replaces the base's
            for name, value in adapter.saved.items():
                info = reference.tensors.get(name)
                if info is None or tuple(info.shape) != tuple(value.shape):
                    raise InputError(
                        f"{at}: {name}",
                        f"a tensor of the base {reference.path} of shape {tuple(value.shape)} (modules_to_save)",
                        "no such tensor" if info is None else tuple(info.shape),
                        "the adapter was trained on another model",
                    )


def _read_text(path: Path, data: Any, folder: Path, folder_key: str, merge: TextMerge) -> tuple[np.ndarray, np.ndarray | None]:
    """The texts as token-id rows (the folder's tokenizer), and their labels as class ids where read."""
    import transformers

    from rayfuse.data.text import encode_texts, read_texts, text_tokenizer
    from rayfuse.models.hf import quiet_transformers

    file = _resolve(data.path, path)
    try:
        texts, labels = read_texts(file, text=data.text, label=data.label, key="data.path")
    except InputError as exc:  # its keys (data.path, data.text, data.label) in this file
        raise exc.at(f"{path}: {exc.path}") from None
    tokenizer = text_tokenizer(folder, key=f"{path}: {folder_key}")
    with quiet_transformers():
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    positions = getattr(config, "max_position_embeddings", None)
    length = data.max_length
    if length is None:
        longest = max(len(ids) for ids in tokenizer(list(texts), truncation=False)["input_ids"])
        length = max(2, min(longest, positions) if isinstance(positions, int) else longest)
    elif isinstance(positions, int) and length > positions:
        raise InputError(
            f"{path}: data.max_length", f"at most the model's {positions} positions (max_position_embeddings in {folder})", length
        )
    X = encode_texts(tokenizer, texts, length, key=f"{path}: data.max_length")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and X.size and float(X.max()) >= vocab:
        raise InputError(f"{path}: {folder_key}", f"a tokenizer whose ids the model embeds (below its vocab_size {vocab})", int(X.max()))
    y = None
    if labels is not None:
        classes = int(getattr(config, "num_labels", 0) or 0)
        bad = [v for v in labels if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v) or not 0 <= v < classes]
        if bad:
            raise InputError(f"{path}: data.label", f"class ids in [0, {classes}) (the model's num_labels)", bad[0])
        y = np.asarray([int(v) for v in labels], dtype=np.int64)
    return X, y


# -- the models ------------------------------------------------------------------------------------------------------


def _load(folder: Path) -> Any:
    """The folder's classifier, its weights loaded, taking token-id rows (-1 padded) and returning logits."""
    from rayfuse.finetunes.lora import _load_base
    from rayfuse.models.hf import _token_ids_forward

    return _token_ids_forward(_load_base(folder))


def _weights(spec: TextFuseSpec, i: int, base_state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Model ``i``'s full weights (a state dict): its folder's, or the base's with its adapter folded in."""
    import torch

    from rayfuse.finetunes.lora import read_adapter

    if not spec.adapters[i]:
        return {k: v.detach().clone() for k, v in _load(spec.models[i]).state_dict().items()}
    assert base_state is not None
    adapter = read_adapter(spec.models[i], saved=True)
    state = {k: v.detach().clone() for k, v in base_state.items()}
    for name, value in adapter.saved.items():  # modules_to_save: trained in full
        state[name] = torch.as_tensor(value).to(state[name].dtype)
    for module in adapter.A:
        delta = torch.from_numpy(adapter.delta(module))
        key = f"{module}.weight"
        state[key] = (state[key].to(torch.float64) + (delta.T if adapter.fan_in_fan_out else delta)).to(state[key].dtype)
    return state


def _with_state(model: Any, state: Mapping[str, torch.Tensor]) -> Any:
    import copy

    out = copy.deepcopy(model)
    out.load_state_dict(dict(state), strict=True)
    return out.eval()


def _batches(X: np.ndarray, size: int) -> list[torch.Tensor]:
    import torch

    return [torch.as_tensor(X[i : i + size]) for i in range(0, len(X), size)]


def expected_fisher(model: Any, X: np.ndarray, y: np.ndarray | None = None, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """The diagonal Fisher of ``model`` on token-id rows ``X`` (float64, per parameter): without labels the expectation
    over the model's own softmax, ``mean_x sum_c p(c|x) (d log p(c|x) / d theta)^2`` (one backward pass per class: no
    sampling noise), with labels ``y`` the empirical Fisher at them. One text at a time (its padding masked)."""
    import torch

    params = {k: p for k, p in model.named_parameters() if keys is None or k in keys}
    total = {k: torch.zeros(p.shape, dtype=torch.float64) for k, p in params.items()}
    model.eval()
    for n in range(len(X)):
        logp = torch.log_softmax(model(torch.as_tensor(X[n : n + 1])), dim=-1)[0]
        classes = [int(y[n])] if y is not None else range(logp.shape[0])
        probs = [1.0] if y is not None else logp.detach().exp().tolist()
        for c, p in zip(classes, probs):
            grads = torch.autograd.grad(logp[c], list(params.values()), retain_graph=True, allow_unused=True)
            for k, g in zip(params, grads):
                if g is not None:
                    total[k] += p * g.detach().to(torch.float64) ** 2
    return {k: (v / max(len(X), 1)).numpy() for k, v in total.items()}


def text_statistics(model: Any, X: np.ndarray, kind: Literal["fisher", "gram"], y: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A model's statistics on the text, as ``statistics:`` files hold them (:func:`~rayfuse.finetunes.statistics.write_statistics`)."""
    from rayfuse.alignment import masked_grams

    return expected_fisher(model, X, y) if kind == "fisher" else masked_grams(model, X)


def prediction_entropy(model: Any, X: np.ndarray, *, batch_size: int = 64) -> float:
    """The mean entropy (nats) of ``model``'s predictive distribution on token-id rows ``X``: AdaMerging's objective."""
    import torch

    model.eval()
    total = 0.0
    with torch.no_grad():
        for xb in _batches(X, batch_size):
            logp = torch.log_softmax(model(xb), dim=-1)
            total += float(-(logp.exp() * logp).sum(-1).sum())
    return total / max(len(X), 1)


# -- the merges ------------------------------------------------------------------------------------------------------


def _adamerging(
    template: Any,
    base: Mapping[str, torch.Tensor],
    models: Sequence[Mapping[str, torch.Tensor]],
    X: np.ndarray,
    p: AdaMergingParams,
    log: Any,
    weights: Sequence[float] | None = None,
) -> tuple[dict[str, torch.Tensor], float, float]:
    """Layer-wise AdaMerging: the merged weights, and the objective (the prediction entropy, or the KL divergence from
    the models' ensemble weighted by ``weights``) at the start and at the end, in nats."""
    import torch

    names = [k for k, v in template.named_parameters()]
    taus = {k: torch.stack([(m[k].to(torch.float32) - base[k].to(torch.float32)) for m in models]) for k in names}
    buffers = {k: v for k, v in template.named_buffers()}
    lambdas = torch.full((len(models), len(names)), float(p.lambda_init), requires_grad=True)
    opt = torch.optim.Adam([lambdas], lr=p.lr)
    generator = torch.Generator().manual_seed(p.seed)
    template.eval()
    for par in template.parameters():
        par.requires_grad_(False)

    def merged(raw: torch.Tensor) -> dict[str, torch.Tensor]:
        # clamped where used, the raw coefficient left as Adam moves it (AdaMerging's lambdas())
        lam = raw.clamp(0.0, 1.0) if p.clamp else raw
        return {k: base[k].to(torch.float32) + torch.tensordot(lam[:, j], taus[k], dims=1) for j, k in enumerate(names)}

    target: torch.Tensor | None = None  # objective: ensemble: the models' weighted mean log-probabilities on X
    if p.objective == "ensemble":
        w = torch.as_tensor(list(weights) if weights is not None else [1.0] * len(models), dtype=torch.float64)
        w = w / w.sum()
        with torch.no_grad():
            nets = [_with_state(template, m) for m in models]  # one copy a model, not one a batch
            probs = torch.stack([torch.cat([torch.softmax(net(xb).double(), -1) for xb in _batches(X, 64)]) for net in nets])
        target = torch.log(torch.tensordot(w, probs, dims=1).clamp_min(1e-30)).float()

    def objective(lam: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        logits = torch.func.functional_call(template, ({**merged(lam), **buffers},), (torch.as_tensor(X[idx]),))
        logp = torch.log_softmax(logits, dim=-1)
        if target is None:
            return -(logp.exp() * logp).sum(-1).mean()
        t = target[torch.as_tensor(idx)]
        return (t.exp() * (t - logp)).sum(-1).mean()

    chunks = [np.arange(i, min(i + 64, len(X))) for i in range(0, len(X), 64)]

    def mean_objective(lam: torch.Tensor) -> float:
        with torch.no_grad():
            return sum(float(objective(lam, rows)) * len(rows) for rows in chunks) / len(X)

    what = "entropy" if target is None else "KL from the ensemble"
    start = mean_objective(lambdas)
    for step in range(p.steps):
        idx = torch.randint(0, len(X), (min(p.batch_size, len(X)),), generator=generator)
        loss = objective(lambdas, idx.numpy())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None and (step + 1) % max(1, p.steps // 5) == 0:
            log(f"adamerging: step {step + 1}/{p.steps}: {what} {float(loss):.4f}")
    end = mean_objective(lambdas)
    with torch.no_grad():
        final = merged(lambdas.detach())
    return {**{k: v.detach() for k, v in base.items()}, **final}, start, end


def _weighted_average(
    base: Mapping[str, torch.Tensor], models: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """The models' weighted average (float64 sums), in each tensor's dtype; integer buffers the base's."""
    import torch

    total = float(sum(weights))
    out: dict[str, torch.Tensor] = {}
    for k, v in base.items():
        if not v.is_floating_point():
            out[k] = v
            continue
        acc = torch.zeros(v.shape, dtype=torch.float64)
        for wk, m in zip(weights, models):
            acc += wk * m[k].to(torch.float64)
        out[k] = (acc / total).to(v.dtype)
    return out


def _distill(
    template: Any,
    base: Mapping[str, torch.Tensor],
    models: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    X: np.ndarray,
    p: TextDistillParams,
    log: Any,
    class_counts: Sequence[Sequence[float]] | None = None,
) -> dict[str, torch.Tensor]:
    """The ensemble distilled into a student of the base's class on the text (no shifts; texts mixed in word-embedding
    space with ``mixup``, word dropout where asked)."""
    import dataclasses

    import torch

    from rayfuse.fusion.distill.algorithm import DistillOptions
    from rayfuse.fusion.distill.student import distill_public
    from rayfuse.fusion.distill.teachers import Teachers, teacher_weights

    teachers = Teachers([_with_state(template, m) for m in models], batched=False)
    if class_counts is not None:  # weighting: classes (the default with class counts; checked before anything ran)
        tw = teacher_weights("classes", np.asarray(class_counts, dtype=np.float64))
    else:
        classes = int(teachers.predict(torch.as_tensor(X[:1])).shape[-1])
        w = np.asarray(weights if p.weighting == "weights" else [1.0] * len(models), dtype=np.float64)
        tw = teacher_weights("samples" if p.weighting == "weights" else "uniform", np.repeat(w[:, None], classes, axis=1))
    start = _weighted_average(base, models, weights) if p.init == "average" else dict(base)
    student = _with_state(template, start).train()
    for par in student.parameters():
        par.requires_grad_(True)
    options = DistillOptions(
        combine=p.combine,
        temperature=p.temperature,
        steps=p.steps,
        epochs=p.epochs,
        batch_size=p.batch_size,
        lr=p.lr,
        shift=0,
        mixup=0.0,
        batched="loop",
    )

    def report(epoch: int, row: dict[str, float]) -> None:
        if log is not None:
            log(f"distill: epoch {epoch}/{p.epochs}: loss {row['loss']:.4f}, agreement with the ensemble {row['agreement']:.3f}")

    settings = dataclasses.replace(
        options.settings(p.seed), word_dropout=p.word_dropout, text_mixup=p.mixup, holdout=p.holdout, patience=p.patience
    )
    distill_public(student, teachers, X, tw, settings, log=report)
    return {k: v.detach() for k, v in student.state_dict().items()}


def _write(spec: TextFuseSpec, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[int, int, int]:
    """Write ``state`` with the reference folder's tensor names, shapes and dtypes (or ``dtype:``), its config and
    tokenizer beside it in a folder output; staged and renamed (nothing at the output on failure)."""
    from rayfuse.finetunes.hf import TORCH_DTYPES, ModelSource, ShardedWriter, check_config_describes, copy_model_files
    from rayfuse.finetunes.run import all_finite

    reference = ModelSource(spec.tokenizer_folder, str(spec.tokenizer_folder))
    plan = {
        n: (info.shape, spec.dtype if spec.dtype is not None and "float" in info.dtype else info.dtype)
        for n, info in reference.tensors.items()
    }
    extra = copy_model_files(spec.tokenizer_folder) if spec.output.suffix != ".safetensors" else []
    if extra:
        check_config_describes(spec.tokenizer_folder, reference.tensors)
    missing = [n for n, info in reference.tensors.items() if n not in state and "float" in info.dtype]
    if missing:  # a name the class's state_dict spells otherwise: never silently the base's values
        raise InputError(
            f"{spec.tokenizer_folder}: {missing[0]}",
            f"a tensor of the state_dict of the class its config.json names ({spec.method} computes those)",
            f"{len(missing)} tensors of the file not in it",
        )
    writer = ShardedWriter(spec.output, plan, spec.max_shard_size, metadata)
    total = 0
    try:
        for name, (shape, dtype) in plan.items():
            value = state[name] if name in state else reference.get(name)
            out = value.detach().to(TORCH_DTYPES[dtype]).reshape(shape).contiguous()
            if out.is_floating_point() and not all_finite(out):
                raise InputError(
                    f"{spec.output}: {name}",
                    f"finite values in the merged model ({dtype})",
                    f"NaN or Inf after {spec.method}",
                    "nothing was written",
                )
            writer.write(name, out)
            total += int(out.numel())
        writer.commit(extra)
    except BaseException:
        writer.abort()
        raise
    return len(plan), total, len(writer.shards)


def run_text_fuse(spec: TextFuseSpec, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the models on the text and merge (see the module's docstring); return the summary ``rayfuse fuse`` prints."""
    from rayfuse.models.hf import quiet_transformers

    with quiet_transformers():
        template = _load(spec.base if spec.base is not None else spec.models[0])
    base_state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    count = len(spec.models) + (1 if spec.base is not None else 0)
    if spec.finetune is not None:
        return _statistics_merge(spec, template, base_state, log) | {"models": count}
    with quiet_transformers():
        models = [_weights(spec, i, base_state) for i in range(len(spec.models))]
    extra: dict[str, Any] = {}
    if spec.method == "adamerging":
        assert isinstance(spec.params, AdaMergingParams)
        state, start, end = _adamerging(template, base_state, models, spec.X, spec.params, log, spec.weights)
        key = "entropy" if spec.params.objective == "entropy" else "kl_from_ensemble"
        extra = {key: (start, end)}
        if log is not None:
            log(f"adamerging: {key.replace('_', ' ')} {start:.4f} at lambda {spec.params.lambda_init} -> {end:.4f}")
    else:
        assert isinstance(spec.params, TextDistillParams)
        state = _distill(template, base_state, models, spec.weights, spec.X, spec.params, log, spec.class_counts)
    metadata = {"method": spec.method, "models": ",".join(p.name for p in (*spec.models, *([spec.base] if spec.base else [])))}
    tensors, parameters, shards = _write(spec, state, metadata)
    return {
        "method": spec.method,
        "models": count,
        "tensors": tensors,
        "parameters": parameters,
        "output": str(spec.output),
        "resized": {},
        "shards": shards,
        **extra,
    }


def _statistics_merge(spec: TextFuseSpec, template: Any, base_state: Mapping[str, torch.Tensor], log: Any) -> dict[str, Any]:
    """fisher / regmean: each model's statistics computed on the text into files beside the output (removed after),
    then the tensor-by-tensor merge of :func:`rayfuse.finetunes.run.run_finetune` on them; adapters folded into the
    base first, as ``.safetensors`` files there too."""
    from rayfuse.finetunes.run import run_finetune
    from rayfuse.finetunes.statistics import write_statistics
    from rayfuse.io import save_params
    from rayfuse.models.hf import quiet_transformers

    assert spec.finetune is not None
    kind: Literal["fisher", "gram"] = "fisher" if spec.method == "fisher" else "gram"
    spec.output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.output.name}.stats-", dir=spec.output.parent))
    try:
        stats, models = [], []
        for i, folder in enumerate(spec.models):
            with quiet_transformers():
                state = _weights(spec, i, base_state)
            model = _with_state(template, state)
            values = text_statistics(model, spec.X, kind, spec.y)
            stats.append(write_statistics(work / f"{i}.safetensors", values, kind, len(spec.X)))
            if spec.adapters[i]:  # folded into the base: a model file of its own for the streamed merge
                models.append(save_params(work / f"model{i}.safetensors", {k: v.detach().numpy() for k, v in state.items()}))
            else:
                models.append(folder)
            if log is not None:
                log(f"{spec.method}: statistics of model {i + 1}/{len(spec.models)} on {len(spec.X)} texts")
        finetune = dataclasses.replace(spec.finetune, models=tuple(Path(m) for m in models), statistics=tuple(Path(s) for s in stats))
        return run_finetune(finetune, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
