"""Run a fine-tune merge: check every model's headers against the base, then stream tensor by tensor.

Before anything is written, every model's tensor names, shapes and dtypes are read from the file headers (no values)
and checked against the base's, and every parameter is evaluated for every tensor. Then a thread pool merges the
tensors: a worker reads one model's tensor at a time (upcast to float32, checked finite) into the streaming merges of
:mod:`rayfuse.finetunes.taskvec`, casts the result to the output dtype, checks it finite there and writes it at its
place in its shard. One tensor's merge holds a fixed number of tensors of its size in float32
(:func:`~rayfuse.finetunes.taskvec.peak_tensors`: 2 to 3.5 for the averages and task arithmetic, about 6 for TIES),
and the pool admits a tensor only while the merges in flight fit in a budget of ``max(models + 2, that number)`` times
the largest tensor (``models`` counting the base), so the peak memory of the merge stays within
``(models + 2) x`` the largest float32 tensor (``6.5 x`` for TIES with fewer than 5 models), whatever the thread count
and the models' total size, and small tensors are merged ``threads`` at a time. On any refusal the temporary output is
removed: nothing is left at the output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from rayfuse.errors import InputError
from rayfuse.finetunes.config import FinetuneSpec, evaluate, layer_positions
from rayfuse.finetunes.hf import TORCH_DTYPES, ModelSource, ShardedWriter, check_config_describes, copy_model_files
from rayfuse.finetunes.taskvec import linear_stream
from rayfuse.finetunes.tensor_merge import TensorMerge
from rayfuse.memory import return_freed_memory

__all__ = ["run_finetune", "check_against_base", "all_finite"]


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
    or a Gram ``(w, w)`` of a 2-d or 4-d weight with ``w`` its fan-in, or an embedding table's row counts ``(rows,)``
    (its diagonal Gram: :func:`rayfuse.alignment.merge_regmean`)."""
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
                if len(shape) == 2 and len(info.shape) == 1:  # an embedding's row counts
                    expected = (shape[0],)
            if info.shape != expected:
                what = "the tensor" if method == "fisher" else "its rows" if len(expected) == 1 else "its fan-in squared"
                raise InputError(f"{own.where}: {name}", f"shape {expected} ({what})", info.shape)
            first = stats[0].tensors[name].shape
            if info.shape != first:  # a Gram and row counts are both allowed for a 2-d weight, not a mix of the two
                raise InputError(f"{own.where}: {name}", f"the shape of models.0's statistic {first}", info.shape)


def _seed(seed: int, model: int, name: str) -> int:
    """A random drop's seed for one model's tensor: independent of the order the threads take the tensors in."""
    digest = hashlib.sha256(f"{seed}:{model}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _tensor_params(spec: FinetuneSpec, merge: TensorMerge, name: str, t: float) -> list[dict[str, Any]]:
    """Each model's parameters for tensor ``name``: its own value, else the global one, else the merge's default."""
    out = []
    for own in spec.model_params:
        values: dict[str, Any] = {}
        for key, default in merge.per_model.items():
            value = evaluate(name, own[key], t) if key in own else None
            if value is None and key in spec.params:
                value = evaluate(name, spec.params[key], t)
            values[key] = default if value is None else float(value)
        out.append(values)
    return out


def _globals(spec: FinetuneSpec, merge: TensorMerge, name: str, t: float) -> dict[str, Any]:
    """The global parameters for tensor ``name``: numbers evaluated there (gradients, filters), the others as given,
    the merge's defaults for the rest. A required one that no filter gives for this tensor is refused."""
    out: dict[str, Any] = {}
    for key, default in merge.globals.items():
        given = spec.params.get(key)
        value = given if isinstance(given, bool | str) or key in merge.choices else evaluate(name, given, t) if given is not None else None
        if value is None and default is None:
            raise InputError(
                f"{spec.config}: parameters.{key}",
                f"a value for every tensor (no filter matches {name})",
                hint="end the list with a {value: ...} for the rest",
            )
        out[key] = default if value is None else value if isinstance(value, bool | str) else float(value)
    return out


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry is finite, without ``torch.isfinite(x).all()``'s work space (its magnitude copy and boolean
    masks: nearly 2 tensors of ``x``'s size at once): a finite sum proves it (NaN and Inf carry into the sum); only
    when the sum is not finite (a NaN, an Inf, or an overflow of finite entries) are the entries looked at, a million at
    a time."""
    if bool(torch.isfinite(x.sum())):
        return True
    return all(bool(torch.isfinite(part).all()) for part in x.reshape(-1).split(1 << 20))


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
    if not any("float" in info.dtype for info in reference.tensors.values()):
        first = names[0]
        raise InputError(
            f"{reference.where}: {first}",
            "a model with floating-point tensors to fuse",
            f"integer tensors only ({reference.tensors[first].dtype})",
        )
    positions = layer_positions(names)
    method = spec.method
    merge = spec.merge
    if merge is None:
        raise ValueError(f"{method}: a FinetuneSpec made by rayfuse.merging.load_fuse_config (it names its merge)")
    plans = _plans(spec, merge, names, positions)
    out_dtype = _output_dtypes(spec, reference, models, base is None)
    sources = [m.path for m in models] + ([spec.base] if spec.base is not None else [])
    metadata = {"method": method, "models": ",".join(p.name for p in sources)}
    # the folder whose config.json (and tokenizer) the output copies: its model must be the merged tensors'
    folder = spec.base if spec.base is not None and spec.base.is_dir() else next((m for m in spec.models if m.is_dir()), None)
    extra = copy_model_files(folder) if spec.output.suffix != ".safetensors" else []
    if folder is not None and folder / "config.json" in extra:
        check_config_describes(folder, reference.tensors)

    order = [reference, *[m for m in models if m is not reference]]  # the reference first, as the merges take them
    elements = {n: TORCH_DTYPES[i.dtype].itemsize for n, i in reference.tensors.items()}

    def compute_dtype(name: str) -> torch.dtype:
        return torch.float64 if reference.tensors[name].dtype == "float64" else torch.float32

    factor = merge.peak(len(order))

    def cost(name: str) -> float:
        """The bytes one tensor's merge holds at its peak (a copy of the base's for an integer buffer)."""
        info = reference.tensors[name]
        if "float" not in info.dtype:
            return float(info.nbytes)
        return factor * (info.nbytes // elements[name]) * compute_dtype(name).itemsize

    def loader(model: ModelSource, name: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            x = model.get(name)  # a tensor of its own, read from the file
            if x.dtype != dtype:
                x = x.to(dtype)
            if not all_finite(x):
                raise InputError(f"{model.where}: {name}", "finite values", "NaN or Inf")
            return x

        return load

    def computed(name: str, dtype: torch.dtype) -> torch.Tensor:
        per_model, globals_ = plans[name]
        loaders = [loader(m, name, dtype) for m in order]
        own = loaders if base is None else loaders[1:]
        if merge.statistics is not None and name in stats[0].tensors:  # fisher / regmean, from each model's statistic
            statistics = [_statistic(spec, source, name) for source in stats]
            return merge.fn(loaders[0]() if base is not None else None, [load() for load in own], per_model, globals_, statistics)
        if merge.statistics is not None:  # a tensor no statistic covers: the weighted average of the models themselves
            return linear_stream(own, [p["weight"] for p in per_model], normalize=True)
        generators = [torch.Generator().manual_seed(_seed(spec.seed, i, name)) for i in range(len(models))]
        return merge.merge(loaders[0] if base is not None else None, own, per_model, globals_, generators)

    def merge_one(name: str) -> int:
        if "float" not in reference.tensors[name].dtype:  # integer buffers (ids, counters) are the base's
            stored = reference.get(name)
            writer.write(name, stored)
            return int(stored.numel())
        merged = computed(name, compute_dtype(name))
        if merged.dtype == torch.float32 and not all_finite(merged):
            # finite inputs whose float32 sums overflowed (values near the end of float32's range): computed again in
            # float64, which holds them (twice this tensor's memory, for this tensor only); the output dtype decides
            del merged
            merged = computed(name, torch.float64)
        out = merged.to(TORCH_DTYPES[out_dtype[name]])
        del merged
        if not all_finite(out):
            raise InputError(
                f"{spec.output}: {name}",
                f"finite values in the merged model ({out_dtype[name]})",
                f"NaN or Inf after {method}",
                "the inputs are finite: the weights or lambda scale them past the range (or write dtype: float32); nothing was written",
            )
        writer.write(name, out)
        return int(out.numel())

    return_freed_memory()  # merges allocate and free tensor-sized temporaries: give them back
    costs = {name: cost(name) for name in names}
    # the merges in flight share a budget of (models + 2) x the largest tensor (or the largest tensor's own merge, where
    # that is more): small tensors go `threads` at a time, the largest alone where two would not fit
    budget = max(costs.values(), default=0) * max(1.0, (len(order) + 2) / factor)
    _check_memory(reference, costs, budget, method, factor)
    writer = ShardedWriter(spec.output, {n: (reference.tensors[n].shape, out_dtype[n]) for n in names}, spec.max_shard_size, metadata)
    try:
        total = _pool(names, merge_one, costs, budget, spec.threads, lambda k: log(f"{method}: {k}/{len(names)} tensors") if log else None)
        writer.commit(extra)
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


def _plans(
    spec: FinetuneSpec, merge: TensorMerge, names: list[str], positions: dict[str, float]
) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Every parameter for every tensor (each model's, the global ones), before anything is written; a rule between
    them the merge states (``TensorMerge.check``) broken for some tensor is refused there, naming the key."""
    plans = {name: (_tensor_params(spec, merge, name, positions[name]), _globals(spec, merge, name, positions[name])) for name in names}
    if merge.check is not None:
        for name, (per_model, globals_) in plans.items():
            broken = merge.check(per_model, globals_)
            if broken is not None:
                key, expected, got = broken
                raise InputError(f"{spec.config}: {key}", expected, got, f"at tensor {name}")
    return plans


def _output_dtypes(spec: FinetuneSpec, reference: ModelSource, models: list[ModelSource], no_base: bool) -> dict[str, str]:
    """Each tensor's dtype in the output: the file's ``dtype:`` for float tensors, else the reference's (the base's); with
    no base, float32 where the models store a tensor in different float dtypes."""
    out = {n: (spec.dtype if spec.dtype is not None and "float" in i.dtype else i.dtype) for n, i in reference.tensors.items()}
    if spec.dtype is None and no_base:
        for n, info in reference.tensors.items():
            if "float" in info.dtype and len({m.tensors[n].dtype for m in models}) > 1:
                out[n] = "float32"
    return out


def _pool(
    names: list[str], merge_one: Callable[[str], int], costs: dict[str, float], budget: float, threads: int, progress: Callable[[int], None]
) -> int:
    """Merge every tensor on ``threads`` threads, admitting one while the merges in flight fit in ``budget`` bytes (the
    largest alone where two would not fit); ``progress(k)`` every 100 tensors. Returns the parameters written."""
    total = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        pending: dict[Future[int], float] = {}
        for k, name in enumerate(names):
            while pending and (len(pending) >= threads or sum(pending.values()) + costs[name] > budget):
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    del pending[f]
                    total += f.result()
            pending[pool.submit(merge_one, name)] = costs[name]
            if (k + 1) % 100 == 0:
                progress(k + 1)
        done, _ = wait(pending)
        total += sum(f.result() for f in done)
    return total


def _check_memory(reference: ModelSource, costs: dict[str, float], budget: float, method: str, factor: float) -> None:
    """Refuse, before anything is written, a merge whose tensors in flight would not fit in the memory available now
    (the PyTorch files, read whole, are in memory already): one line naming the largest tensor."""
    from rayfuse.models.registry import available_memory  # read when called (the memory bounds' one source)

    free = available_memory()
    if free is None or budget <= free or not costs:
        return
    largest = max(costs, key=lambda n: costs[n])
    raise InputError(
        f"{reference.where}: {largest}",
        f"a merge that fits in memory: {free / 2**30:.2f} GiB available",
        f"about {budget / 2**30:.2f} GiB in flight",
        f"{method} holds about {factor:g} x a tensor's size at once; the largest tensor sets the peak",
    )


def _statistic(spec: FinetuneSpec, source: ModelSource, name: str) -> torch.Tensor:
    """One model's statistic for tensor ``name``, checked: finite, and for a diagonal Fisher or an embedding's row
    counts non-negative."""
    s = source.get(name).double()
    nonneg = (spec.merge is not None and spec.merge.statistics == "fisher") or s.ndim == 1
    if not torch.isfinite(s).all() or (nonneg and (s < 0).any()):
        raise InputError(
            f"{source.where}: {name}", "finite" + (" non-negative" if nonneg else "") + " statistics", "negative or non-finite entries"
        )
    return s
