"""``merge_method: lora``: PEFT LoRA adapters of one base model combined into one adapter, or folded into the base.

::

    merge_method: lora
    base_model: base/                 # a Hugging Face folder (config.json + model.safetensors or its sharded index)
    models:
      - model: site_a/                # a PEFT adapter folder: adapter_config.json + adapter_model.safetensors
        parameters: {weight: 3}       # this adapter's weight (e.g. its site's sample count; default 1)
      - model: site_b/
    parameters:
      combine: stack                  # stack | svd | average_factors
      rank: 8                         # svd only: the output's rank
      normalize: true                 # divide the weights by their sum (default)
    output_kind: adapter              # adapter: a PEFT adapter folder; merged: the base with the update folded in
    output: merged/

An adapter ``i`` holds, for each module ``m`` it targets, ``A_i`` (r_i x in) and ``B_i`` (out x r_i), and changes the
module's weight by ``s_i B_i A_i`` with ``s_i = lora_alpha / r_i`` (``lora_alpha / sqrt(r_i)`` with ``use_rslora``;
``rank_pattern`` / ``alpha_pattern`` override both per module, matched as PEFT matches them). The weighted update of
the adapters is ``D = sum_i w_i s_i B_i A_i``. ``combine``:

* ``stack`` ([FLORA : fed_utils/model_aggregation.py]): ``B = [w_1 s_1 B_1, ..., w_n s_n B_n]``, ``A = [A_1; ...; A_n]``,
  so ``B A = D`` exactly, at rank ``sum_i r_i`` (mixed ranks are HetLoRA's setting [HETLORA]: nothing needs them equal).
* ``svd``: the best rank-``rank`` approximation of ``D`` (Eckart-Young), from an SVD of ``D`` computed through thin QR
  factorisations of the stacked factors (never forming ``D``); its error is the tail of ``D``'s singular values. At
  the full stacked rank it is exact. As PEFT's ``add_weighted_adapter(combination_type="svd")``
  ([PEFT : src/peft/tuners/lora/model.py]).
* ``average_factors``: ``B = sum_i w_i s_i B_i``, ``A = sum_i w_i A_i``: the average of the factors Flower and
  FlowerTune send, which is not the average of the updates (``mean(B) mean(A) != mean(B A)``). It is kept as the
  inexact baseline it is: the output's metadata says ``exact: false`` and gives its error against ``D``; mixed ranks
  are refused (the factors cannot be averaged). When every adapter holds one frozen ``A`` (FFA-LoRA [FFALORA]) it
  is exact: ``sum_i w_i s B_i A = (sum_i w_i s B_i) A``.

The output adapter stores its factors with the scaling folded in: ``lora_alpha`` equals the rank, ``use_rslora`` is
off, so PEFT's scaling is 1 and ``PeftModel.from_pretrained(base, output)`` applies exactly ``B A``. The merged output
loads the base with the class its ``config.json`` names (``from_pretrained`` on the local folder, nothing downloaded),
adds ``B A`` to every target weight in float32 and writes the model with ``save_pretrained``.

Everything is checked before anything is written (one line, :class:`~rayfuse.errors.InputError`): each adapter's
config and factors, the ranks, every target module against the base's tensors and shapes; the output folder is
written under a temporary name and renamed when complete. This module never imports Ray.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from rayfuse.config import StrictSchema, validate_file_section
from rayfuse.errors import InputError, suggest
from rayfuse.io import check_new_output, read_checkpoint, read_json

if TYPE_CHECKING:
    from rayfuse.merging.schema import FuseFile

__all__ = [
    "LoraParams",
    "LoraSpec",
    "Adapter",
    "ModuleMerge",
    "read_adapter",
    "adapter_scaling",
    "combine_module",
    "combine_adapters",
    "load_lora_config",
    "run_lora",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "METADATA_FILE",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
METADATA_FILE = "rayfuse_lora.json"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<factor>A|B)\.weight$")


class _Schema(StrictSchema):
    """The ``merge_method: lora`` fuse file's schema."""


class LoraParams(_Schema):
    combine: Literal["stack", "svd", "average_factors"] = Field(
        "stack",
        description="stack: exact, rank = sum of ranks (FLoRA); svd: best approximation at `rank`; average_factors: the "
        "inexact mean of the A's and of the B's (Flower's baseline)",
    )
    rank: int | None = Field(None, ge=1, description="svd: the output's rank (at most each module's stacked rank)")
    normalize: bool = Field(True, description="divide the weights by their sum (False: the weighted sum of the updates)")


class AdapterWeight(_Schema):
    weight: float = Field(1.0, gt=0, description="this adapter's weight (e.g. its site's number of training samples)")


@dataclass(frozen=True)
class LoraSpec:
    """A validated ``merge_method: lora`` fuse file: folders exist, nothing read yet."""

    adapters: list[Path]
    weights: list[float]
    params: LoraParams
    base_model: Path | None
    output_kind: str
    dtype: str | None
    output: Path
    config: Path
    where: list[str] = field(default_factory=list)  # each adapter's key path in the file (models.0.model ...)


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter, read and checked: per module (its name in the base, e.g. ``model.layers.0.self_attn.q_proj``)
    the factors as float64 arrays, the rank and the scaling PEFT applies."""

    folder: Path
    config: Mapping[str, Any]
    A: Mapping[str, np.ndarray]
    B: Mapping[str, np.ndarray]
    rank: Mapping[str, int]
    scaling: Mapping[str, float]
    dtypes: frozenset[str]
    # whole tensors of the modules the adapter trains in full (PEFT's modules_to_save: a classifier head), by their
    # name in the base; read only where asked (read_adapter(saved=True)), refused otherwise
    saved: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def fan_in_fan_out(self) -> bool:
        return bool(self.config.get("fan_in_fan_out", False))

    def delta(self, module: str) -> np.ndarray:
        """``s B A`` (out x in), the update to the module's weight (transposed for a ``fan_in_fan_out`` layer's)."""
        return self.scaling[module] * (self.B[module] @ self.A[module])


@dataclass(frozen=True)
class ModuleMerge:
    """One module's combined factors (scaling 1: the update is ``B @ A``), its stacked rank and the errors against the
    exact weighted update ``D``: ``norm`` is ``||D||_F``, ``error`` is ``||D - B A||_F``."""

    B: np.ndarray
    A: np.ndarray
    stacked_rank: int
    norm: float
    error: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``peft.utils.other.get_pattern_key``): the first key, in the
    mapping's order, that matches the end of the module's name at a dot boundary, as a regular expression."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return patterns[key]
        except re.error:  # PEFT would fail on it too: not a usable pattern
            continue
    return default


def adapter_scaling(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """The rank and the scaling PEFT gives ``module`` under an adapter's config: ``alpha / r``, or ``alpha / sqrt(r)``
    with ``use_rslora`` (PEFT's ``LoraLayer.update_layer``)."""
    r = int(_pattern_value(config.get("rank_pattern") or {}, module, config["r"]))
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"]))
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _read_config(folder: Path, where: str, saved: bool = False) -> dict[str, Any]:
    """The adapter's config, checked (``saved``: ``modules_to_save`` allowed, see :func:`read_adapter`)."""
    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        raise InputError(
            f"{where}: {file}",
            f"a PEFT adapter's {ADAPTER_CONFIG}",
            "no such file",
            "an adapter folder is what PeftModel.save_pretrained writes",
        )
    config = read_json(file, "a JSON object (a PEFT LoraConfig)")
    if not isinstance(config, dict):
        raise InputError(str(file), "a JSON object (a PEFT LoraConfig)", type(config).__name__)
    if config.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{file}: peft_type", "LORA (merge_method: lora combines LoRA adapters)", config.get("peft_type"))
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise InputError(f"{file}: {key}", "a positive number", value if key in config else "none")
    if config.get("use_dora"):
        # DoRA rescales each column of W + s B A by a learned magnitude: the update is not linear in B A, so no sum of
        # factors gives the average of the adapted weights
        raise InputError(f"{file}: use_dora", "false (DoRA's magnitude vector makes the update nonlinear in B A)", True)
    if config.get("modules_to_save") and not saved:
        raise InputError(
            f"{file}: modules_to_save",
            "none (only the LoRA factors are combined here; fully trained modules are a task-vector merge)",
            config["modules_to_save"],
        )
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise InputError(f"{file}: bias", '"none" (trained biases are not a low-rank update)', config.get("bias"))
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise InputError(f"{file}: {key}", "a mapping of module patterns to numbers", config[key])
    return config


def read_adapter(folder: str | Path, where: str = "", *, saved: bool = False) -> Adapter:
    """Read a PEFT LoRA adapter folder and check it: the config, every key a LoRA factor of a linear layer, each module's
    A (r x in) and B (out x r) agreeing with each other and with the config's rank, every value finite. One line
    (:class:`InputError`) naming the file, module or key otherwise. ``saved``: the whole tensors of the config's
    ``modules_to_save`` (a sequence classifier's head) are read into :attr:`Adapter.saved` instead of refused (a
    merge that folds the adapter into its base, :mod:`rayfuse.finetunes.text_fuse`, takes them)."""
    path = Path(folder)
    where = where or str(path)
    if not path.is_dir():
        raise InputError(where, "a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)", str(path))
    config = _read_config(path, where, saved)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file() and (path / "adapter_model.bin").is_file():
        weights = path / "adapter_model.bin"  # PeftModel.save_pretrained(safe_serialization=False)
    if not weights.is_file():
        raise InputError(f"{where}: {path / ADAPTER_WEIGHTS}", "the adapter's factors", "no such file")
    tensors, stored = read_checkpoint(weights)
    factors: dict[str, dict[str, np.ndarray]] = {"A": {}, "B": {}}
    whole: dict[str, np.ndarray] = {}
    kept = [str(m) for m in (config.get("modules_to_save") or [])] if saved else []
    for key, value in tensors.items():
        match = _KEY.match(key)
        name = key.removeprefix(_PREFIX)
        if (
            match is None
            and key.startswith(_PREFIX)
            and any(name.rsplit(".", 1)[0] == m or name.rsplit(".", 1)[0].endswith(f".{m}") for m in kept)
        ):
            if value.dtype.kind != "f" or not np.isfinite(value).all():
                raise InputError(f"{weights}: {key}", "finite floating-point values", "NaN, Inf or integers")
            whole[name] = np.asarray(value)
            continue
        if match is None:
            raise InputError(
                f"{weights}: {key}",
                f"LoRA factors of linear layers only ({_PREFIX}<module>.lora_A.weight / .lora_B.weight)",
                "another tensor",
                "embedding, convolution and DoRA adapters are not combined here",
            )
        if value.dtype.kind != "f":
            raise InputError(f"{weights}: {key}", "a floating-point tensor", str(value.dtype))
        if not np.isfinite(value).all():
            raise InputError(f"{weights}: {key}", "finite values", "NaN or Inf")
        factors[match["factor"]][match["module"]] = np.asarray(value, dtype=np.float64)
    if not factors["A"] and not factors["B"] and not whole:
        raise InputError(str(weights), "an adapter with at least one LoRA module", "no tensors")
    ranks, scalings = {}, {}
    for module in sorted(set(factors["A"]) | set(factors["B"])):
        if module not in factors["A"] or module not in factors["B"]:
            missing = "lora_A" if module not in factors["A"] else "lora_B"
            raise InputError(f"{weights}: {module}", "both lora_A and lora_B for every module", f"no {missing}")
        a, b = factors["A"][module], factors["B"][module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise InputError(
                f"{weights}: {module}",
                "lora_A (r x in) and lora_B (out x r) of one rank r",
                f"lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}",
            )
        r, scaling = adapter_scaling(config, module)
        if a.shape[0] != r:
            raise InputError(
                f"{weights}: {module}",
                f"rank {r} ({ADAPTER_CONFIG}'s r / rank_pattern)",
                a.shape[0],
                "the scaling alpha / r is read from the config, so the two must agree",
            )
        ranks[module], scalings[module] = r, scaling
    return Adapter(path, config, factors["A"], factors["B"], ranks, scalings, frozenset(stored.values()) or frozenset({"float32"}), whole)


# ---------------------------------------------------------------------------------------------------------------
# The combinations, one module at a time


def _fro(B: np.ndarray, A: np.ndarray) -> float:
    """``||B A||_F`` from the factors, without forming ``B A``: with thin QRs ``B = Q_B R_B`` and ``A^T = Q_A R_A``,
    ``||B A||_F = ||R_B R_A^T||_F`` (orthonormal columns keep the norm), as accurate as the factors (a Gram-matrix
    trace would lose half the digits to cancellation when ``B A`` is a small difference)."""
    if B.size == 0 or A.size == 0:
        return 0.0
    r_b, r_a = np.linalg.qr(B)[1], np.linalg.qr(A.T)[1]
    return float(np.linalg.norm(r_b @ r_a.T))


def combine_module(
    Bs: Sequence[np.ndarray],
    As: Sequence[np.ndarray],
    weights: Sequence[float],
    scalings: Sequence[float],
    combine: str,
    rank: int | None = None,
) -> ModuleMerge:
    """Combine one module's factors ``B_i`` (out x r_i), ``A_i`` (r_i x in) with weights ``w_i`` and the adapters'
    scalings ``s_i``: the exact update is ``D = sum_i w_i s_i B_i A_i``. Returns the factors (scaling 1), the stacked
    rank and the errors. ``rank`` (svd) is at most the stacked rank and the weight's smaller side (the caller checks)."""
    coefficients = [w * s for w, s in zip(weights, scalings)]
    B_s = np.concatenate([c * b for c, b in zip(coefficients, Bs)], axis=1)
    A_s = np.concatenate(list(As), axis=0)
    stacked = int(A_s.shape[0])
    norm = _fro(B_s, A_s)
    if combine == "stack":
        return ModuleMerge(B_s, A_s, stacked, norm, 0.0)
    if combine == "svd":
        # D = B_s A_s = Qb (Rb Ra^T) Qa^T with thin QRs of B_s and A_s^T: the SVD of the small middle matrix is D's
        Qb, Rb = np.linalg.qr(B_s)
        Qa, Ra = np.linalg.qr(A_s.T)
        U, S, Vt = np.linalg.svd(Rb @ Ra.T)
        keep = int(rank if rank is not None else len(S))
        root = np.sqrt(S[:keep])  # the singular values split evenly between the factors (PEFT puts them all in B: same product)
        B, A = (Qb @ U[:, :keep]) * root, root[:, None] * (Vt[:keep] @ Qa.T)
        return ModuleMerge(B, A, stacked, norm, float(math.sqrt(float(np.sum(S[keep:] ** 2)))))
    if combine == "average_factors":
        # (sum_i w_i s_i B_i)(sum_i w_i A_i): Flower's s mean(B) mean(A) when every adapter has the same scaling s (the
        # baseline's own setting); with different scalings each one goes with its B, the only place it can go
        B = np.sum([c * b for c, b in zip(coefficients, Bs)], axis=0)
        A = np.sum([w * a for w, a in zip(weights, As)], axis=0)
        error = _fro(np.concatenate([B_s, -B], axis=1), np.concatenate([A_s, A], axis=0))
        return ModuleMerge(B, A, stacked, norm, error)
    raise InputError("parameters.combine", "stack, svd or average_factors", combine)


@dataclass(frozen=True)
class Combined:
    """Every module's :class:`ModuleMerge`, and the whole update's relative error ``||D - BA||_F / ||D||_F``."""

    modules: Mapping[str, ModuleMerge]
    combine: str
    exact: bool

    @property
    def relative_error(self) -> float:
        total = math.sqrt(sum(m.norm**2 for m in self.modules.values()))
        return math.sqrt(sum(m.error**2 for m in self.modules.values())) / total if total > 0 else 0.0


def _rank_limit(adapters: Sequence[Adapter], module: str) -> tuple[int, list[int], tuple[int, int]]:
    present = [a for a in adapters if module in a.A]
    out, inp = present[0].B[module].shape[0], present[0].A[module].shape[1]
    ranks = [a.rank[module] for a in present]
    return min(sum(ranks), out, inp), ranks, (out, inp)


def combine_adapters(
    adapters: Sequence[Adapter],
    weights: Sequence[float],
    combine: str,
    rank: int | None = None,
    where: Sequence[str] = (),
    config: str = "",
) -> Combined:
    """Combine adapters (already checked one by one) module by module. The modules are the union of the adapters'
    target modules: an adapter that does not target a module left that weight at the base's value, so its update
    there is exactly zero, and the union with zero there is the faithful sum (refusing would forbid the common case of
    sites adapting different layers). Checks, one line each: the factors' sides agree across adapters, and the rank
    (svd: given, at most the largest stacked rank, a module of a smaller one kept whole at it; average_factors: one rank
    per module across the adapters). ``where``: each adapter's name in the messages; ``config``: the fuse file's."""
    where = list(where) or [str(a.folder) for a in adapters]
    at = f"{config}: " if config else ""
    modules = sorted({m for a in adapters for m in a.A})
    fans = {a.fan_in_fan_out for a in adapters}
    if len(fans) > 1:
        first = next(i for i, a in enumerate(adapters) if a.fan_in_fan_out != adapters[0].fan_in_fan_out)
        raise InputError(
            f"{where[first]}: {ADAPTER_CONFIG}: fan_in_fan_out",
            f"{adapters[0].fan_in_fan_out} as in {where[0]} (adapters of one base)",
            adapters[first].fan_in_fan_out,
        )
    if combine == "svd" and rank is None:
        raise InputError(
            f"{at}parameters.rank",
            "the output's rank for combine: svd (e.g. rank: 8)",
            "none",
            "combine: stack keeps every update exactly at the sum of the ranks",
        )
    if combine != "svd" and rank is not None:
        raise InputError(f"{at}parameters.rank", f"no rank with combine: {combine} (its rank follows from the adapters')", rank)
    for module in modules:
        present = [(i, a) for i, a in enumerate(adapters) if module in a.A]
        i0, a0 = present[0]
        for i, a in present[1:]:
            if a.A[module].shape[1] != a0.A[module].shape[1] or a.B[module].shape[0] != a0.B[module].shape[0]:
                raise InputError(
                    f"{where[i]}: {module}",
                    f"lora_B (out x r) and lora_A (r x in) of shape out x in "
                    f"{a0.B[module].shape[0]} x {a0.A[module].shape[1]} as in {where[i0]}",
                    f"{a.B[module].shape[0]} x {a.A[module].shape[1]}",
                    "adapters of one base",
                )
        if combine == "average_factors":
            ranks_by = {where[i]: a.rank[module] for i, a in present}
            if len(set(ranks_by.values())) > 1:
                named = ", ".join(f"{w} rank {r}" for w, r in ranks_by.items())
                raise InputError(
                    f"{at}parameters.combine",
                    "stack or svd for adapters of different ranks (average_factors averages the "
                    f"factors, which needs one rank; {module}: {named})",
                    "average_factors",
                )
    limits = {module: _rank_limit(adapters, module)[0] for module in modules}
    if combine == "svd" and rank is not None and rank > max(limits.values()):
        # above every module's stacked rank the cut keeps nothing more: refused. Below the largest one, a module that fewer
        # adapters target (a smaller stacked rank) keeps all its singular values, exact there, at its own rank
        module = max(modules, key=lambda m: limits[m])
        _, ranks, shape = _rank_limit(adapters, module)
        capped = f", capped by its weight {shape[0]} x {shape[1]}" if limits[module] < sum(ranks) else ""
        raise InputError(
            f"{at}parameters.rank",
            f"at most {limits[module]}, the stacked rank of {module} (its adapters' ranks {ranks} summed{capped})",
            rank,
        )
    out: dict[str, ModuleMerge] = {}
    for module in modules:
        if combine == "average_factors":
            # every adapter takes part, one that does not target the module with zero factors (its update there is zero)
            shape_b, shape_a = next((a.B[module].shape, a.A[module].shape) for a in adapters if module in a.A)
            Bs = [a.B[module] if module in a.B else np.zeros(shape_b) for a in adapters]
            As = [a.A[module] if module in a.A else np.zeros(shape_a) for a in adapters]
            out[module] = combine_module(Bs, As, weights, [a.scaling.get(module, 1.0) for a in adapters], combine)
        else:
            ids = [i for i, a in enumerate(adapters) if module in a.A]
            out[module] = combine_module(
                [adapters[i].B[module] for i in ids],
                [adapters[i].A[module] for i in ids],
                [weights[i] for i in ids],
                [adapters[i].scaling[module] for i in ids],
                combine,
                None if rank is None else min(rank, limits[module]),
            )
    # stack is exact; svd where the cut keeps every singular value the stacked factors can have; average_factors is not
    exact = combine == "stack" or (combine == "svd" and all(rank is not None and rank >= limits[m] for m in modules))
    return Combined(out, combine, exact)


# ---------------------------------------------------------------------------------------------------------------
# The fuse file, the base, the output


def _resolve(given: str, path: Path) -> Path:
    """A path of the fuse file: as given when it exists (or is absolute), else relative to the file's folder."""
    file = Path(given)
    return file if file.is_absolute() or file.exists() else path.parent / file


def load_lora_config(spec: FuseFile, path: Path, output: str | Path | None = None) -> LoraSpec:
    """Validate a ``merge_method: lora`` fuse file (``spec``, validated, read from ``path``; ``output`` overrides its
    ``output:``): the parameters, every adapter folder holding its ``adapter_config.json``, the base a Hugging Face
    folder, the output a folder that does not exist yet where one can be written. Nothing is read beyond that."""
    params = validate_file_section(LoraParams, spec.parameters, path, "parameters")
    output_kind = spec.output_kind or "adapter"
    adapters, where, weights = [], [], []
    for i, entry in enumerate(spec.models):
        folder = _resolve(entry.model, path)
        key = f"{path}: models.{i}.model"
        if not folder.is_dir():
            raise InputError(key, "a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)", entry.model)
        if not (folder / ADAPTER_CONFIG).is_file():
            raise InputError(
                f"{key}: {folder / ADAPTER_CONFIG}",
                f"a PEFT adapter's {ADAPTER_CONFIG}",
                "no such file",
                "an adapter folder is what PeftModel.save_pretrained writes",
            )
        adapters.append(folder)
        where.append(key)
        weights.append(validate_file_section(AdapterWeight, entry.parameters, path, f"models.{i}.parameters").weight)
    if params.normalize:
        weights = [w / sum(weights) for w in weights]
    base = None
    if spec.base_model is not None:
        base = _resolve(spec.base_model, path)
        if not base.is_dir() or not (base / "config.json").is_file():
            raise InputError(
                f"{path}: base_model", "a Hugging Face folder (config.json + model.safetensors or its sharded index)", spec.base_model
            )
    elif output_kind == "merged":
        raise InputError(f"{path}: base_model", "the base's Hugging Face folder for output_kind: merged (the update is folded into it)")
    out = Path(output) if output is not None else (Path(spec.output) if spec.output else None)
    if out is None:
        raise InputError(f"{path}: output", "the output folder (output: ... or rayfuse fuse CONFIG OUT)")
    if not out.is_absolute() and output is None:
        out = path.parent / out
    if out.suffix in (".safetensors", ".pt", ".pth", ".bin", ".json"):
        kind = "a PEFT adapter" if output_kind == "adapter" else "a Hugging Face model"
        raise InputError(f"{path}: output", f"a folder (merge_method: lora writes {kind} folder)", str(out))
    check_new_output(out, key=f"{path}: output", what="a folder")
    return LoraSpec(adapters, weights, params, base, output_kind, spec.out_dtype or spec.dtype, out, path, where)


def base_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a Hugging Face folder, from the safetensors headers only (``model.safetensors``,
    or the shards ``model.safetensors.index.json`` names): the reader the fine-tune merges use."""
    from rayfuse.finetunes.hf import ModelSource

    return {name: info.shape for name, info in ModelSource(folder, str(folder)).tensors.items()}


def check_against_base(adapters: Sequence[Adapter], base: Path, where: Sequence[str]) -> None:
    """Every target module is a layer of the base (its ``<module>.weight`` tensor), of the shape the factors give it
    (``out x in``, or ``in x out`` for a ``fan_in_fan_out`` layer): one line naming the module, or both shapes."""
    shapes = base_shapes(base)
    for adapter, at in zip(adapters, where):
        for module in sorted(adapter.A):
            key = f"{module}.weight"
            if key not in shapes:
                close = suggest(key, list(shapes)).strip(" ()")
                raise InputError(
                    f"{at}: {module}",
                    f"a module of the base {base} (a tensor {key})",
                    "no such module in the base",
                    close or "the adapter was trained on another model",
                )
            want = (adapter.B[module].shape[0], adapter.A[module].shape[1])
            if adapter.fan_in_fan_out:
                want = want[::-1]
            if tuple(shapes[key]) != tuple(want):
                raise InputError(
                    f"{base}: {key}",
                    f"shape {want} as the adapter {at} gives it (lora_B out x lora_A in)",
                    tuple(shapes[key]),
                    "the adapter was trained on another model",
                )


def _output_dtype(adapters: Sequence[Adapter], given: str | None) -> str:
    if given is not None:
        return given
    import functools

    import torch

    floats = sorted({d for a in adapters for d in a.dtypes if "float" in d} or {"float32"})
    return str(functools.reduce(torch.promote_types, [getattr(torch, d) for d in floats])).replace("torch.", "")


def _adapter_output(
    adapters: Sequence[Adapter], combined: Combined, base: Path | None, dtype: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The output adapter's tensors (torch, in ``dtype``) and ``adapter_config.json``: the first adapter's config with
    the modules, ranks and scalings of the result. The scaling is 1 everywhere (``lora_alpha`` = the rank, no rsLoRA),
    the factors holding it; modules whose rank differs from the commonest one are named in ``rank_pattern`` and
    ``alpha_pattern`` by their full names."""
    import torch

    tensors: dict[str, Any] = {}
    for module, merged in combined.modules.items():
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = torch.from_numpy(np.ascontiguousarray(merged.A)).to(getattr(torch, dtype))
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = torch.from_numpy(np.ascontiguousarray(merged.B)).to(getattr(torch, dtype))
    ranks = {m: merged.rank for m, merged in combined.modules.items()}
    values = sorted(ranks.values())
    r = max(set(values), key=lambda v: (values.count(v), -v))
    pattern = {m: k for m, k in ranks.items() if k != r}
    config = dict(adapters[0].config)
    config.update(
        {
            "r": r,
            "lora_alpha": r,
            "use_rslora": False,
            "rank_pattern": pattern,
            "alpha_pattern": dict(pattern),
            "target_modules": sorted(ranks),
            "layers_to_transform": None,
            "layers_pattern": None,
            "exclude_modules": None,
            "inference_mode": True,
        }
    )
    if base is not None:
        config["base_model_name_or_path"] = str(base)
    return tensors, config


def _load_base(base: Path) -> Any:
    """The base model: the class its ``config.json`` names (``architectures``), else ``AutoModel``, from the local
    folder (``local_files_only``: nothing is downloaded), quietly; a config that does not describe the folder's
    safetensors weights is refused first (``from_pretrained`` would fail, or reinitialise what they lack)."""
    import transformers

    from rayfuse.finetunes.hf import INDEX, SINGLE, ModelSource, check_config_describes
    from rayfuse.models.hf import quiet_transformers

    config = read_json(base / "config.json", "a Hugging Face model config (JSON)")
    if not isinstance(config, dict):
        raise InputError(f"{base / 'config.json'}", "a Hugging Face model config (a JSON object)", type(config).__name__)
    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names and isinstance(names[0], str) else None
    cls = cls if cls is not None and hasattr(cls, "from_pretrained") else transformers.AutoModel
    if (base / SINGLE).is_file() or (base / INDEX).is_file():
        check_config_describes(base, ModelSource(base, str(base)).tensors)
    try:
        with quiet_transformers():
            return cls.from_pretrained(str(base), local_files_only=True).eval()
    except Exception as exc:  # noqa: BLE001 - the library's many errors for a folder it cannot load: one line
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise InputError(
            str(base), f"a Hugging Face folder {cls.__name__}.from_pretrained loads", f"{type(exc).__name__}: {first}"
        ) from None


def _fold(model: Any, adapters: Sequence[Adapter], combined: Combined, base: Path, dtype: str | None) -> None:
    """Add every module's ``B A`` to its weight (computed in float32 or wider, written back in the weight's dtype)."""
    import torch

    fan_in_fan_out = adapters[0].fan_in_fan_out
    with torch.no_grad():
        for module, merged in combined.modules.items():
            try:
                weight = model.get_submodule(module).weight
            except AttributeError:
                raise InputError(f"{base}: {module}", "a layer with a weight in the model from_pretrained builds", "none") from None
            delta = torch.from_numpy(merged.B @ merged.A)
            delta = delta.T if fan_in_fan_out else delta
            work = torch.promote_types(weight.dtype, torch.float32)
            updated = weight.to(work) + delta.to(work)
            target = getattr(torch, dtype) if dtype is not None else weight.dtype
            if not bool(updated.to(target).isfinite().all()):
                raise InputError(
                    f"{base}: {module}.weight",
                    f"finite values after adding the update ({target})",
                    "NaN or Inf",
                    "the update overflows this dtype; nothing was written",
                )
            weight.copy_(updated.to(weight.dtype))
    if dtype is not None:
        model.to(getattr(torch, dtype))


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def run_lora(spec: LoraSpec, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Read and check every adapter (and the base), combine, and write the output folder whole or not at all; return
    ``rayfuse fuse``'s summary (with ``exact`` and ``relative_error``)."""
    where = spec.where or [str(a) for a in spec.adapters]
    adapters = [read_adapter(folder, at) for folder, at in zip(spec.adapters, where)]
    kinds = {a.config.get("task_type") for a in adapters}
    if spec.output_kind == "adapter" and len(kinds) > 1:
        first = next(i for i, a in enumerate(adapters) if a.config.get("task_type") != adapters[0].config.get("task_type"))
        raise InputError(
            f"{where[first]}: {ADAPTER_CONFIG}: task_type",
            f"{adapters[0].config.get('task_type')} as in {where[0]} (one output adapter has one task type)",
            adapters[first].config.get("task_type"),
        )
    if spec.base_model is not None:
        check_against_base(adapters, spec.base_model, where)
    p = spec.params
    combined = combine_adapters(adapters, spec.weights, p.combine, p.rank, where, str(spec.config))
    ranks = sorted({m.rank for m in combined.modules.values()})
    meta: dict[str, Any] = {
        "merge_method": "lora",
        "combine": p.combine,
        "exact": combined.exact,
        "relative_error": combined.relative_error,
        "output_kind": spec.output_kind,
        "weights": list(spec.weights),
        "models": [str(a) for a in spec.adapters],
        "ranks": ranks,
        "normalize": p.normalize,
        "modules": {
            m: {"rank": v.rank, "stacked_rank": v.stacked_rank, "relative_error": v.error / v.norm if v.norm > 0 else 0.0}
            for m, v in combined.modules.items()
        },
    }
    if p.combine == "average_factors":
        meta["note"] = "inexact: mean(B) mean(A) is not the mean of the updates B A; relative_error is its distance from it"
    if log is not None:
        log(
            f"lora: {p.combine} of {len(adapters)} adapters over {len(combined.modules)} modules, rank {'/'.join(map(str, ranks))}; "
            f"relative error {combined.relative_error:.3g} against sum w_i s_i B_i A_i ({'exact' if combined.exact else 'inexact'})"
        )
    if spec.output_kind == "adapter":
        dtype = _output_dtype(adapters, spec.dtype)
        tensors, config = _adapter_output(adapters, combined, spec.base_model, dtype)
        for key, value in tensors.items():
            if not bool(value.isfinite().all()):
                raise InputError(
                    f"{spec.output}: {key}",
                    f"finite values in {dtype}",
                    "NaN or Inf",
                    "write a wider dtype (dtype: float32); nothing was written",
                )
        meta["dtype"] = dtype
        # what writing the factors in dtype adds to the combination's error: ||B A - B' A'||_F / ||D||_F (B', A' as written)
        total = math.sqrt(sum(m.norm**2 for m in combined.modules.values()))
        cast = sum(
            _fro(
                np.concatenate([m.B, -tensors[f"{_PREFIX}{k}.lora_B.weight"].double().numpy()], axis=1),
                np.concatenate([m.A, tensors[f"{_PREFIX}{k}.lora_A.weight"].double().numpy()], axis=0),
            )
            ** 2
            for k, m in combined.modules.items()
        )
        meta["cast_relative_error"] = math.sqrt(cast) / total if total > 0 else 0.0
        count, parameters = len(tensors), int(sum(v.numel() for v in tensors.values()))

        def write(folder: Path) -> None:
            from safetensors.torch import save_file

            save_file(
                tensors,
                str(folder / ADAPTER_WEIGHTS),
                metadata={
                    "format": "pt",
                    "rayfuse.combine": p.combine,
                    "rayfuse.exact": str(combined.exact).lower(),
                    "rayfuse.relative_error": repr(combined.relative_error),
                },
            )
            (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    else:
        assert spec.base_model is not None  # load_lora_config requires it for output_kind: merged
        base = spec.base_model
        model = _load_base(base)
        _fold(model, adapters, combined, base, spec.dtype)
        state = model.state_dict()
        count, parameters = len(state), int(sum(v.numel() for v in state.values()))

        def write(folder: Path) -> None:
            from rayfuse.models.hf import quiet_transformers

            with quiet_transformers():  # its "Writing model shards" bars
                model.save_pretrained(str(folder))
            for name in _TOKENIZER_FILES:  # the base's tokenizer goes with it, as mergekit copies it
                if (base / name).is_file():
                    shutil.copy2(base / name, folder / name)

    out = spec.output
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.tmp"  # renamed to the output once whole
    try:
        tmp.mkdir()
        write(tmp)
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "method": f"lora ({p.combine})",
        "models": len(adapters),
        "tensors": count,
        "parameters": parameters,
        "output": str(out),
        "resized": {},
        "exact": combined.exact,
        "relative_error": combined.relative_error,
        "ranks": ranks,
    }
