"""Run a fine-tune merge: check every model's headers against the base, then stream tensor by tensor.

Before anything is written, every model's tensor names, shapes and dtypes are read from the file headers (no values)
and checked against the base's, and every parameter is evaluated for every tensor. Then a thread pool merges the
tensors, a bounded number at a time: a worker loads one tensor of each model (memory-mapped), upcasts them to float32,
merges, casts to the output dtype, checks the result finite there and writes it at its place in its shard. Peak
memory is then about ``threads * (models + 2)`` times the largest tensor, not the models' total size. On any refusal
the temporary output is removed: nothing is left at the output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, cast

import torch

from rayfuse.errors import InputError
from rayfuse.finetunes.config import FinetuneSpec, evaluate, layer_positions
from rayfuse.finetunes.hf import TORCH_DTYPES, ModelSource, ShardedWriter, copy_model_files
from rayfuse.finetunes.taskvec import TASK_VECTOR_METHODS, Rescale, linear, slerp, task_vector_merge

__all__ = ["run_finetune", "check_against_base"]

# mergekit's defaults for what a file leaves out (mergekit/merge_methods/registry.py, linear.py)
_DEFAULTS = {"weight": 1.0, "density": 1.0, "lambda": 1.0}


def check_against_base(base: ModelSource, others: list[ModelSource]) -> None:
    """Every model holds the base's tensors, with the base's shapes, float where the base's are float (one line naming
    the tensor and both shapes)."""
    for model in others:
        for name, info in base.tensors.items():
            own = model.tensors.get(name)
            if own is None:
                raise InputError(
                    f"{model.where}: {name}",
                    f"the tensor {name} that the base model ({base.path.name}) holds",
                    "missing",
                    "a fine-tune of another architecture cannot be merged tensor by tensor",
                )
            if own.shape != info.shape:
                raise InputError(
                    f"{model.where}: {name}",
                    f"shape {info.shape} as in the base model ({base.path.name})",
                    own.shape,
                    "a fine-tune must keep the base's shapes",
                )
            if ("float" in own.dtype) != ("float" in info.dtype):
                raise InputError(f"{model.where}: {name}", f"a {info.dtype} tensor as in the base model", own.dtype)
        extra = [n for n in model.tensors if n not in base.tensors]
        if extra:
            raise InputError(
                f"{model.where}: {extra[0]}",
                f"only the tensors the base model ({base.path.name}) holds",
                f"{len(extra)} more (e.g. {extra[0]})",
                "a head added in fine-tuning has no base to merge against",
            )


def check_statistics(method: str, reference: ModelSource, stats: list[ModelSource]) -> None:
    """Each model's statistics cover the same tensors, each one of the models': a diagonal Fisher of the tensor's shape,
    or a Gram ``(w, w)`` of a 2-d or 4-d weight with ``w`` its fan-in."""
    keys = set(stats[0].tensors)
    for own in stats:
        if set(own.tensors) != keys:
            name = sorted(set(own.tensors) ^ keys)[0]
            raise InputError(
                f"{own.where}: {name}",
                f"the tensors of models.0's statistics ({len(keys)})",
                "a different set",
                "every model gives statistics for the same tensors",
            )
        for name, info in own.tensors.items():
            if name not in reference.tensors:
                raise InputError(f"{own.where}: {name}", "statistics of a tensor the models hold", "no such tensor in the models")
            shape = reference.tensors[name].shape
            if method == "fisher":
                expected = shape
            else:
                if len(shape) not in (2, 4):
                    raise InputError(f"{own.where}: {name}", "a Gram of a 2-d (Linear) or 4-d (Conv2d) weight", shape)
                width = 1
                for d in shape[1:]:
                    width *= d
                expected = (width, width)
            if info.shape != expected:
                raise InputError(
                    f"{own.where}: {name}", f"shape {expected} ({'the tensor' if method == 'fisher' else 'its fan-in squared'})", info.shape
                )


def _seed(seed: int, model: int, name: str) -> int:
    """A random drop's seed for one model's tensor: independent of the order the threads take the tensors in."""
    digest = hashlib.sha256(f"{seed}:{model}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _tensor_params(spec: FinetuneSpec, name: str, t: float) -> list[dict[str, Any]]:
    """Each model's weight and density for tensor ``name``: its own value, else the global one, else the default."""
    out = []
    for own in spec.model_params:
        values: dict[str, Any] = {}
        for key in ("weight", "density"):
            value = evaluate(name, own[key], t) if key in own else None
            if value is None and key in spec.params:
                value = evaluate(name, spec.params[key], t)
            values[key] = _DEFAULTS[key] if value is None else float(value)
        out.append(values)
    return out


def _global(spec: FinetuneSpec, key: str, name: str, t: float) -> float | None:
    if key not in spec.params:
        return None
    value = evaluate(name, spec.params[key], t)
    return None if value is None else float(value)


def run_finetune(spec: FinetuneSpec, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Check, merge and write; return a summary (method, models, tensors, parameters, output)."""
    prefix = f"{spec.config}: "
    base = ModelSource(spec.base, f"{prefix}base_model") if spec.base is not None else None
    models = [ModelSource(file, f"{prefix}models.{i}.model ({file.name})") for i, file in enumerate(spec.models)]
    reference = base if base is not None else models[0]
    check_against_base(reference, [m for m in models if m is not reference])
    stats = [ModelSource(file, f"{prefix}models.{i}.statistics ({file.name})") for i, file in enumerate(spec.statistics)]
    if stats:
        check_statistics(spec.method, reference, stats)
    names = list(reference.tensors)
    positions = layer_positions(names)
    method = spec.method
    tv = TASK_VECTOR_METHODS.get(method)
    normalize = bool(spec.params.get("normalize", tv.normalize if tv is not None else True))
    rescale_key = spec.params.get("rescale", tv.rescale if tv is not None else False)
    rescale = cast(Rescale, "l1" if rescale_key is True else None if rescale_key is False else rescale_key)
    plans: dict[str, dict[str, Any]] = {}
    for name in names:  # every parameter for every tensor, before anything is written
        t = positions[name]
        plan: dict[str, Any] = {"models": _tensor_params(spec, name, t)}
        if method == "slerp":
            value = _global(spec, "t", name, t)
            if value is None:
                raise InputError(
                    f"{prefix}parameters.t",
                    f"a value for every tensor (no filter matches {name})",
                    hint="end the list with a {value: ...} for the rest",
                )
            plan["t"] = value
        lam = _global(spec, "lambda", name, t)
        plan["lambda"] = 1.0 if lam is None else lam
        plans[name] = plan
    out_dtype = {n: (spec.dtype if spec.dtype is not None and "float" in i.dtype else i.dtype) for n, i in reference.tensors.items()}
    sources = [m.path for m in models] + ([spec.base] if spec.base is not None else [])
    metadata = {"method": method, "models": ",".join(p.name for p in sources)}
    writer = ShardedWriter(spec.output, {n: (reference.tensors[n].shape, out_dtype[n]) for n in names}, spec.max_shard_size, metadata)

    def merge_one(name: str) -> int:
        stored = reference.get(name)
        if not stored.is_floating_point():  # integer buffers (ids, counters) are the base's
            writer.write(name, stored.contiguous())
            return int(stored.numel())
        compute = torch.float64 if stored.dtype == torch.float64 else torch.float32
        tuned = []
        for model in [reference, *[m for m in models if m is not reference]]:
            x = (stored if model is reference else model.get(name)).to(compute)
            if not torch.isfinite(x).all():
                raise InputError(f"{model.where}: {name}", "finite values", "NaN or Inf")
            tuned.append(x)
        plan = plans[name]
        weights = [p["weight"] for p in plan["models"]]
        if method == "slerp":
            merged = slerp(plan["t"], tuned[0], tuned[1])
        elif tv is not None:
            generators = [torch.Generator().manual_seed(_seed(spec.seed, i, name)) for i in range(len(models))]
            merged = task_vector_merge(
                tuned[0],
                tuned[1:],
                weights,
                [p["density"] for p in plan["models"]],
                tv,
                normalize=normalize,
                lam=plan["lambda"],
                rescale=rescale,
                generators=generators,
            )
        elif stats and name in stats[0].tensors:  # fisher / regmean: rayfuse.alignment's merges, one tensor at a time
            merged = _data_aware(spec, name, tuned if base is None else tuned[1:], stats, weights, None if base is None else tuned[0])
        else:  # linear / weighted_average / average, and the tensors without statistics: the models themselves
            own = tuned if base is None else tuned[1:]
            merged = linear(own, [1.0] * len(own) if method == "average" else weights, normalize=method == "average" or normalize)
        out = merged.to(TORCH_DTYPES[out_dtype[name]])
        if not torch.isfinite(out).all():
            raise InputError(
                f"{spec.output}: {name}",
                f"finite values in the merged model ({out_dtype[name]})",
                f"NaN or Inf after {method}",
                "the inputs are finite: the weights or lambda scale them past the range (or write dtype: float32); nothing was written",
            )
        writer.write(name, out)
        return int(out.numel())

    total = 0
    try:
        with ThreadPoolExecutor(max_workers=spec.threads) as pool:
            pending: set[Future[int]] = set()
            for k, name in enumerate(names):
                if len(pending) >= spec.threads:  # a bounded window: at most `threads` tensors in memory at once
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    total += sum(f.result() for f in done)
                pending.add(pool.submit(merge_one, name))
                if log is not None and (k + 1) % 100 == 0:
                    log(f"{method}: {k + 1}/{len(names)} tensors")
            done, _ = wait(pending)
            total += sum(f.result() for f in done)
        folder = spec.base if spec.base is not None and spec.base.is_dir() else next((m for m in spec.models if m.is_dir()), None)
        writer.commit(copy_model_files(folder) if not writer.single else [])
    except BaseException:
        writer.abort()
        raise
    return {
        "method": method,
        "models": len(models) + (1 if base is not None else 0),
        "tensors": len(names),
        "parameters": total,
        "output": str(spec.output),
        "resized": {},
        "shards": len(writer.shards),
    }


def _data_aware(
    spec: FinetuneSpec, name: str, own: list[torch.Tensor], stats: list[ModelSource], weights: list[float], base: torch.Tensor | None = None
) -> torch.Tensor:
    """Fisher-weighted averaging or RegMean of one tensor (:func:`rayfuse.finetunes.statistics.merge_task_vectors`:
    :func:`rayfuse.alignment.merge_fisher` / :func:`~rayfuse.alignment.merge_regmean`, the merges aligned fusion and
    the federated ``fedmerge`` use), from each model's statistics file. With a ``base``, the task vectors ``x_i - base``
    are merged and the base added: the same as merging the models where the statistics determine the result, and the
    base's value where they do not (a RegMean Gram singular along inputs no site's data excites keeps the base there,
    where the least-squares merge of the models would zero it)."""
    from rayfuse.finetunes.statistics import merge_task_vectors

    origin = base.double().numpy() if base is not None else None
    values = [{name: x.double().numpy() - (origin if origin is not None else 0.0)} for x in own]
    given = []
    for source in stats:
        s = source.get(name).double()
        if not torch.isfinite(s).all() or (spec.method == "fisher" and (s < 0).any()):
            raise InputError(
                f"{source.where}: {name}",
                "finite" + (" non-negative" if spec.method == "fisher" else "") + " statistics",
                "negative or non-finite entries",
            )
        given.append({name: s.numpy()})
    merged = merge_task_vectors(
        values, given, weights, "fisher" if spec.method == "fisher" else "regmean", regmean_alpha=float(spec.params.get("alpha", 0.9))
    )[name]
    if origin is not None:
        merged = origin + merged
    return torch.from_numpy(merged).to(own[0].dtype)
