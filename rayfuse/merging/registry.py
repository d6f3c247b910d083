"""Every merge ``rayfuse fuse`` runs, in one registry: its name, what it reads, what it needs, its parameters.

A :class:`MergeMethod` is one of three kinds of implementation, which decide what the fuse file's models are:

* ``tensors``: a :class:`~rayfuse.finetunes.tensor_merge.TensorMerge`, computed tensor by tensor and streamed from
  ``.safetensors`` files, Hugging Face folders, shard folders or PyTorch files into a file or a Hugging Face folder
  (the fine-tune merges, after mergekit, and the averages);
* ``checkpoints``: a :class:`~rayfuse.merging.fusers.Fuser`, which reads whole checkpoints of one class in memory with
  the ``architecture:`` they are checked against (and, where it needs one, a ``data:`` sample): aligned fusion,
  KL-fusion of neurons, distillation;
* ``adapters``: PEFT LoRA adapters of one base (:mod:`rayfuse.finetunes.lora`);
* ``text``: Hugging Face folders (and LoRA adapters of a base) run on a ``data:`` file of texts
  (:mod:`rayfuse.finetunes.text_fuse`): Fisher and RegMean with statistics rayfuse computes, AdaMerging, distillation.
  A file whose ``data:`` names a ``text`` column is routed here whatever its merge (one that reads no text is refused
  there, saying why).

A merge that has both a tensor form and a checkpoint form (the averages) runs the checkpoint form when the file
names an ``architecture:`` (the checkpoints are then checked against the class and the output records it for
:func:`rayfuse.load_fused`), the tensor form otherwise: what routes a file is the registered merge and the keys the
file sets, never the shape of its paths. :data:`MERGES` is filled from one static list (:func:`_static`) when this module is imported;
:func:`register_merge` adds a plug-in's. ``docs/methods/merges.md`` is generated from it (``rayfuse.docs_gen``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rayfuse.errors import InputError, suggest

if TYPE_CHECKING:
    from rayfuse.finetunes.tensor_merge import TensorMerge
    from rayfuse.finetunes.text_fuse import TextMerge
    from rayfuse.merging.fusers import Fuser
    from rayfuse.merging.schema import FuseFile

__all__ = ["MergeMethod", "MERGES", "register_merge", "get_merge", "merge_names", "Route"]

Route = Literal["tensors", "checkpoints", "adapters", "text"]


@dataclass(frozen=True)
class MergeMethod:
    """One registered merge: ``tensor`` (its tensor-by-tensor form), ``fuser`` (its form over whole checkpoints of a
    class), ``adapters`` (LoRA adapters) or ``text`` (its form on Hugging Face folders with text data); ``reference``
    the paper and code it follows; ``aliases`` other names."""

    name: str
    summary: str
    reference: str
    tensor: TensorMerge | None = None
    fuser: Fuser | None = None
    adapters: bool = False
    text: TextMerge | None = None
    aliases: tuple[str, ...] = ()
    exact: bool | None = None  # None: the tensor form's (deterministic unless it draws at random)

    def route(self, file: FuseFile) -> Route:
        """Which form reads ``file``: the adapters', or the checkpoint form where there is no tensor form or the file
        names the models' ``architecture:``, else the tensor form; the text form for a file with text data (or a merge
        that has no other form)."""
        if (file.data is not None and file.data.text is not None) or (self.text is not None and self.tensor is None and self.fuser is None):
            return "text"
        if self.adapters:
            return "adapters"
        if self.fuser is not None and (self.tensor is None or file.architecture is not None):
            return "checkpoints"
        return "tensors"

    # -- capabilities, for the docs' table and the checks

    @property
    def base(self) -> str:
        """Whether it needs a ``base_model:`` ("required"), may take one ("optional") or takes none ("none")."""
        if self.tensor is not None:
            return self.tensor.base
        if self.text is not None and self.fuser is None:
            return self.text.base
        return "optional" if self.adapters else "none"

    @property
    def inputs(self) -> str:
        forms = []
        if self.tensor is not None:
            forms.append("model files or Hugging Face folders")
        if self.fuser is not None:
            forms.append("checkpoints of an architecture" + (" (each its own)" if self.fuser.heterogeneous else ""))
        if self.adapters:
            forms.append("PEFT LoRA adapters")
        if self.text is not None:
            forms.append("Hugging Face folders or LoRA adapters with text (data: {path, text})")
        return "; ".join(forms)

    @property
    def data(self) -> str:
        if self.tensor is not None and self.tensor.statistics is not None:
            what = "diagonal Fisher" if self.tensor.statistics == "fisher" else "input Gram matrices"
            return f"each model's statistics ({what}), or text (data: {{path, text}}) rayfuse computes them on"
        if self.fuser is not None and self.fuser.data != "none":
            return "a sample (data:)" if self.fuser.data == "required" else "optional sample (data:)"
        if self.text is not None:
            return "unlabeled text (data: {path, text})"
        return "none"

    @property
    def deterministic(self) -> bool:
        if self.exact is not None:
            return self.exact
        return self.tensor.exact if self.tensor is not None else True

    def parameters(self) -> tuple[list[str], list[str]]:
        """The names of its global and per-model parameters (every form's)."""
        glob: list[str] = []
        own: list[str] = []
        if self.tensor is not None:
            glob += list(self.tensor.globals)
            own += list(self.tensor.per_model)
        if self.fuser is not None:
            glob += [k for k in self.fuser.Params.model_fields if k not in glob]
            own += [k for k in self.fuser.ModelParams.model_fields if k not in own]
        if self.adapters:
            from rayfuse.finetunes.lora import AdapterWeight, LoraParams

            glob += list(LoraParams.model_fields)
            own += list(AdapterWeight.model_fields)
        if self.text is not None and self.text.Params is not None:
            glob += [k for k in self.text.Params.model_fields if k not in glob]
            own += [k for k in self.text.ModelParams.model_fields if k not in own]
        return glob, own

    @property
    def parameters_text(self) -> str:
        """Its parameters in one line, as the table of merges and ``rayfuse list merges`` show them."""
        glob, own = self.parameters()
        return (", ".join(glob) or "-") + (f"; per model: {', '.join(own)}" if own else "")


def _tensor_entry(
    merge: TensorMerge, fuser: Fuser | None = None, aliases: Iterable[str] = (), text: TextMerge | None = None
) -> MergeMethod:
    return MergeMethod(merge.name, merge.summary, merge.reference, tensor=merge, fuser=fuser, text=text, aliases=(*merge.aliases, *aliases))


def _fuser_entry(fuser: Fuser, reference: str, exact: bool = True, text: TextMerge | None = None) -> MergeMethod:
    return MergeMethod(fuser.name, fuser.summary, reference, fuser=fuser, text=text, aliases=fuser.aliases, exact=exact)


def _static() -> list[MergeMethod]:
    """Every merge rayfuse ships, in the order the docs list them."""
    import rayfuse.merging.fusers as fusers
    from rayfuse.finetunes.mergekit_set import MERGES as MERGEKIT_SET
    from rayfuse.finetunes.merges import MERGES as BUILTIN
    from rayfuse.finetunes.spectral import MERGES as SPECTRAL
    from rayfuse.finetunes.text_fuse import TEXT_MERGES

    entries = [
        _tensor_entry(BUILTIN["average"], fusers.AVERAGE),
        _tensor_entry(BUILTIN["weighted_average"], fusers.WEIGHTED_AVERAGE),
        *(_tensor_entry(BUILTIN[name]) for name in ("task_arithmetic", "ties", "dare_linear", "dare_ties", "slerp")),
    ]
    entries += [_tensor_entry(merge) for merge in MERGEKIT_SET.values()]
    entries += [_tensor_entry(merge) for merge in SPECTRAL.values()]
    entries += [
        _tensor_entry(BUILTIN["fisher"], text=TEXT_MERGES["fisher"]),
        _tensor_entry(BUILTIN["regmean"], text=TEXT_MERGES["regmean"]),
        MergeMethod(
            "adamerging",
            TEXT_MERGES["adamerging"].summary,
            "ADAMERGING (EnnengYang/AdaMerging at cea1165)",
            text=TEXT_MERGES["adamerging"],
            exact=False,
        ),
        _fuser_entry(fusers.KL_NEURONS, "Claici et al., Model Fusion with Kullback-Leibler Divergence, ICML 2020"),
        _fuser_entry(fusers.WEIGHT_MATCHING, "Ainsworth et al., Git Re-Basin, ICLR 2023 (weight matching, MergeMany)"),
        _fuser_entry(
            fusers.ACTIVATION_MATCHING, "Ainsworth et al., Git Re-Basin, ICLR 2023; Singh & Jaggi, Model Fusion via Optimal Transport, 2020"
        ),
        _fuser_entry(
            fusers.DISTILL,
            "Lin et al., Ensemble Distillation for Robust Model Fusion (FedDF), NeurIPS 2020",
            exact=False,
            text=TEXT_MERGES["distill"],
        ),
        MergeMethod(
            "lora",
            "PEFT LoRA adapters of one base combined: stack (exact), svd (best at a rank) or average_factors; as an "
            "adapter or folded into the base",
            "Wang et al., FLoRA, NeurIPS 2024 (stacking); PEFT's adapter format",
            adapters=True,
        ),
    ]
    return entries


MERGES: dict[str, MergeMethod] = {}
_ALIASES: dict[str, str] = {}


def register_merge(method: MergeMethod) -> MergeMethod:
    """Add a merge (a plug-in's) to the registry: its name and aliases must be new."""
    for name in (method.name, *method.aliases):
        if name in MERGES or name in _ALIASES:
            raise ValueError(f"merge {name!r} is registered already")
    MERGES[method.name] = method
    for alias in method.aliases:
        _ALIASES[alias] = method.name
    return method


def merge_names() -> list[str]:
    """Every registered name and alias, sorted."""
    return sorted([*MERGES, *_ALIASES])


def get_merge(name: str, path: Path | str | None = None) -> MergeMethod:
    """The registered merge called ``name`` (or one of its aliases); one line naming ``merge_method`` otherwise."""
    key = MERGES.get(_ALIASES.get(name, name))
    if key is None:
        names = merge_names()
        prefix = f"{path}: " if path is not None else ""
        raise InputError(
            f"{prefix}merge_method",
            f"a merge in {{{', '.join(names)}}}",
            name,
            suggest(name, names).strip(" ()") or "methods that need client data run in a federation (rayfuse run)",
        )
    return key


for _method in _static():
    register_merge(_method)
