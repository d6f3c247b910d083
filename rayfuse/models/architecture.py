"""A model class named by a string: ``module:Class`` (importable from the working directory or ``PYTHONPATH``) or
``torchvision:<name>``, built with keyword arguments. ``rayfuse fuse`` and ``rayfuse symmetry`` take architectures
this way; checkpoints are then checked against the built model tensor by tensor.

Importing ``module:Class`` runs that module's code, as ``python -c "import module"`` would: name only code you trust.
Checkpoints themselves are never unpickled (safetensors, or ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from rayfuse.errors import InputError

__all__ = ["resolve_architecture", "build_architecture", "check_checkpoint_fits", "check_inputs_fit"]


def resolve_architecture(ref: str, *, where: str = "architecture") -> Any:
    """The callable ``ref`` names: ``torchvision:<name>`` (built with ``weights=None``: nothing is downloaded) or
    ``module:Class`` / ``module:function`` / ``package.module:Outer.Inner``. Raises :class:`InputError`."""
    if not isinstance(ref, str) or ":" not in ref:
        raise InputError(where, '"module:Class" (importable) or "torchvision:<name>"', ref)
    module_name, _, attr = ref.partition(":")
    if module_name == "torchvision":
        from rayfuse.models.registry import torchvision_model_names

        names = torchvision_model_names()
        if attr not in names:
            from rayfuse.errors import suggest

            raise InputError(where, "a torchvision model name (torchvision.models.list_models())", attr, suggest(attr, names).strip(" ()"))
        import torchvision.models as tvm

        def build(**kwargs: Any) -> nn.Module:
            return tvm.get_model(attr, weights=None, **kwargs)

        build.__qualname__ = f"torchvision:{attr}"
        return build
    if not module_name or not attr:
        raise InputError(where, '"module:Class" with both parts', ref)
    cwd = os.getcwd()
    if cwd not in sys.path:  # as `python -m` does: a module beside the config / in the working directory imports
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own code failing: one line, not its traceback
        raise InputError(where, f"an importable module {module_name!r} (from the working directory or PYTHONPATH)",
                         f"{type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InputError(where, f"a name defined in {module_name}", attr)
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputError(where, "a class or function building an nn.Module", type(obj).__name__)
    return obj


def build_architecture(ref: str, args: Mapping[str, Any] | None = None, *, where: str = "architecture",
                       args_where: str | None = None) -> nn.Module:
    """``resolve_architecture(ref)(**args)``, in eval mode; the result must be an ``nn.Module``. Errors name ``where``
    (the reference) and ``args_where`` (the arguments; default ``<where>_args``)."""
    factory = resolve_architecture(ref, where=where)
    try:
        model = factory(**dict(args or {}))
    except Exception as exc:  # the user's constructor: one line naming it
        raise InputError(args_where or f"{where}_args", f"keyword arguments {ref} accepts",
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}") from None
    if not isinstance(model, nn.Module):
        raise InputError(where, "a class or function returning a torch.nn.Module", type(model).__name__)
    return model.eval()


def check_checkpoint_fits(model: nn.Module, params: Mapping[str, np.ndarray], *, where: str | Path, ref: str = "the architecture") -> None:
    """Every tensor of the architecture's state dict is in ``params`` with its shape, and nothing else is: one line
    naming the first tensor that differs (expected and found shapes)."""
    state = model.state_dict()
    for key, tensor in state.items():
        if key not in params:
            raise InputError(f"{where}: {key}", f"a tensor of shape {tuple(tensor.shape)} ({ref})", "missing")
        if tuple(params[key].shape) != tuple(tensor.shape):
            raise InputError(f"{where}: {key}", f"shape {tuple(tensor.shape)} ({ref})", tuple(params[key].shape))
    extra = [k for k in params if k not in state]
    if extra:
        raise InputError(f"{where}: {extra[0]}", f"only the tensors of {ref}", f"{len(extra)} more, e.g. {extra[0]!r}")


def check_inputs_fit(model: nn.Module, X: np.ndarray, *, where: str, num_outputs: int | None = None) -> Sequence[int]:
    """One forward pass of ``X[:2]``: the data's inputs must be what the model takes. Returns the output shape."""
    import torch

    try:
        with torch.no_grad():
            out = model(torch.as_tensor(np.ascontiguousarray(X[:2])))
    except Exception as exc:
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise InputError(where, "inputs the model takes", f"arrays of shape {tuple(X.shape[1:])} per sample ({first})") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        raise InputError(where, "a model returning (batch, classes) logits", getattr(out, "shape", type(out).__name__))
    if num_outputs is not None and out.shape[1] != num_outputs:
        raise InputError(where, f"{num_outputs} outputs per sample", tuple(out.shape[1:]))
    return tuple(out.shape)
