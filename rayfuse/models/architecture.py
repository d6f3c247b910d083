"""A model class named by a string: ``module:Class`` (importable from the working directory or ``PYTHONPATH``) or
``torchvision:<name>``, built with keyword arguments. ``rayfuse fuse`` and ``rayfuse symmetry`` take architectures
this way; checkpoints are then checked against the built model tensor by tensor.

Importing ``module:Class`` runs that module's code, as ``python -c "import module"`` would: name only code you trust.
Nothing else runs from a config: the name must be an ``nn.Module`` subclass or a function of the user's own module,
checked before it is called (:func:`resolve_architecture`). Checkpoints themselves are never unpickled (safetensors,
or ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from rayfuse.errors import InputError

__all__ = ["resolve_architecture", "build_architecture", "check_checkpoint_fits", "check_inputs_fit"]


def resolve_architecture(ref: str, *, where: str = "architecture") -> Any:
    """The callable ``ref`` names: ``torchvision:<name>`` (built with ``weights=None``: nothing is downloaded) or
    ``module:Class`` / ``module:function`` / ``package.module:Outer.Inner``. Raises :class:`InputError`.

    No code of a config runs beyond importing the module it names: the name is looked up without running any
    attribute hook (``inspect.getattr_static``) and must be an ``nn.Module`` subclass or a function the module itself
    defines (its ``__module__`` is the module imported), checked before anything is called. A builtin (``os:system``),
    a name the module imported from elsewhere, a ``functools.partial`` or a callable instance is refused. The import
    runs with ``sys.argv`` as ``python -c "import module"`` has it; a module that exits at import (argparse on
    ``sys.argv``) or raises is one line naming it, and what it printed while failing is not shown."""
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
    module = _import_user_module(module_name, where)
    obj: Any = module
    for part in attr.split("."):
        try:
            # A module's own __getattr__ (PEP 562: lazy modules such as transformers') is part of importing it; on a
            # class nothing runs (no metaclass hook, no property).
            found = getattr(obj, part) if isinstance(obj, types.ModuleType) else inspect.getattr_static(obj, part)
        except AttributeError:
            raise InputError(where, f"a name defined in {module_name}", attr) from None
        except Exception as exc:  # a lazy module's import failing
            raise InputError(
                where,
                f"an importable name {attr!r} of {module_name}",
                f"the module raised at import: {type(exc).__name__}: {_first_line(str(exc))}",
            ) from None
        if isinstance(found, staticmethod):
            found = found.__func__
        elif isinstance(found, classmethod):  # bound to its class, as attribute access would (no user code runs)
            found = types.MethodType(found.__func__, obj)
        elif not isinstance(obj, types.ModuleType) and inspect.isfunction(found):
            raise InputError(where, f"an nn.Module subclass or a function defined in {module_name}", f"{ref} is an instance method")
        obj = found
    _check_builder(obj, module, ref, where)
    return obj


def _import_user_module(module_name: str, where: str) -> Any:
    """``importlib.import_module(module_name)``, from the working directory too (as ``python -m`` does), with
    ``sys.argv`` as ``python -c "import module"`` sets it; its failure, or its exit, as one :class:`InputError`."""
    cwd = os.getcwd()
    if cwd not in sys.path:  # as `python -m` does: a module beside the config / in the working directory imports
        sys.path.insert(0, cwd)
    if module_name in sys.modules:
        return sys.modules[module_name]
    argv = sys.argv
    printed_out, printed_err = io.StringIO(), io.StringIO()
    try:
        # A module that parses sys.argv at import would otherwise read rayfuse's own command line; it sees what it would
        # under `python -c "import module"`. What it prints is held back and passed on once the import succeeded.
        sys.argv = ["-c"]
        with contextlib.redirect_stdout(printed_out), contextlib.redirect_stderr(printed_err):
            module = importlib.import_module(module_name)
    except SystemExit as exc:  # argparse's error on a missing argument, or an explicit sys.exit(): not rayfuse's usage error
        said = _first_line(printed_err.getvalue(), last=True) or _first_line(printed_out.getvalue(), last=True)
        raise InputError(
            where,
            f"a module {module_name!r} that imports without exiting",
            f"the module exited at import (sys.exit({exc.code!r}))",
            f"it printed {said!r}" if said else "",
        ) from None
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise InputError(
                where, f"an importable module {module_name!r} (from the working directory or PYTHONPATH)", f"no module named {exc.name!r}"
            ) from None
        raise InputError(
            where,
            f"an importable module {module_name!r} (from the working directory or PYTHONPATH)",
            f"the module raised at import: ModuleNotFoundError: {_first_line(str(exc))}",
        ) from None
    except Exception as exc:  # the module's own code failing (any exception): one line, not its traceback
        raise InputError(
            where,
            f"an importable module {module_name!r} (from the working directory or PYTHONPATH)",
            f"the module raised at import: {type(exc).__name__}: {_first_line(str(exc))}",
        ) from None
    finally:
        sys.argv = argv
    for stream, text in ((sys.stdout, printed_out.getvalue()), (sys.stderr, printed_err.getvalue())):
        if text:
            stream.write(text)
    return module


def _check_builder(obj: Any, module: types.ModuleType, ref: str, where: str) -> None:
    """``obj`` may be called to build the model: an ``nn.Module`` subclass, or a Python function (or a classmethod /
    staticmethod of an ``nn.Module`` subclass) that ``module`` itself defines, ``module`` being the user's own: not the
    standard library, an installed package or rayfuse (``subprocess:run`` or ``rayfuse.io:atomic_write_text`` are
    defined where they are named, and would run a command or write a file)."""
    module_name = module.__name__
    expected = f"an nn.Module subclass or a function defined in {module_name}"
    if isinstance(obj, type):
        if not issubclass(obj, nn.Module):
            raise InputError(where, expected, f"the class {obj.__module__}.{obj.__qualname__}, not an nn.Module")
        return
    function = obj.__func__ if inspect.ismethod(obj) else obj
    if not inspect.isfunction(function):  # builtins (os:system), partials, callable instances, modules, values
        kind = "a builtin" if inspect.isbuiltin(function) else f"an object of type {type(obj).__name__}"
        raise InputError(where, expected, f"{ref} is {kind}, not a class or function of that module")
    if inspect.ismethod(obj) and not (isinstance(obj.__self__, type) and issubclass(obj.__self__, nn.Module)):
        owner = obj.__self__.__name__ if isinstance(obj.__self__, type) else type(obj.__self__).__name__
        raise InputError(where, expected, f"{ref} is a method of {owner}, not of an nn.Module")
    if function.__module__ != module_name:
        raise InputError(
            where,
            expected,
            f"{ref} is defined in {function.__module__}",
            f"name it where it is defined: {function.__module__}:{function.__qualname__}",
        )
    owner = _library_of(module)
    if owner:
        hint = (
            f"a torchvision model is named torchvision:{function.__name__}"
            if module_name.split(".")[0] == "torchvision"
            else "a function is called only from a module of yours (not the standard library, an installed package or rayfuse)"
        )
        raise InputError(where, "an nn.Module subclass, or a function of your own module", f"{ref} is a function of {owner}", hint)


def _library_of(module: types.ModuleType) -> str:
    """``"the standard library"``, ``"an installed package"`` or ``"rayfuse"`` when ``module`` is not the user's own
    (a module of theirs lies elsewhere: the working directory, ``PYTHONPATH``); ``""`` when it is."""
    import site
    import sysconfig

    top = module.__name__.split(".", 1)[0]
    if top in ("rayfuse", "actors"):
        return "rayfuse"
    if top in sys.stdlib_module_names:
        return "the standard library"
    file = getattr(module, "__file__", None)
    if not file:  # built into the interpreter, frozen, or a namespace package without files
        return "the interpreter"
    path = Path(file).resolve()
    paths = sysconfig.get_paths()
    places = {
        "the standard library": [paths["stdlib"], paths["platstdlib"]],
        "an installed package": [paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages()],
        "rayfuse": [str(Path(__file__).resolve().parents[1])],
    }
    for owner in ("an installed package", "rayfuse", "the standard library"):  # site-packages lies inside platstdlib
        if any(path.is_relative_to(Path(place).resolve()) for place in places[owner]):
            return owner
    return ""


def _first_line(text: str, limit: int = 120, *, last: bool = False) -> str:
    """The first (or last: argparse prints its usage, then the error) non-empty line of ``text``, shortened."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1 if last else 0][:limit] if lines else ""


def build_architecture(
    ref: str, args: Mapping[str, Any] | None = None, *, where: str = "architecture", args_where: str | None = None
) -> nn.Module:
    """``resolve_architecture(ref)(**args)``, in eval mode; the result must be an ``nn.Module``. Errors name ``where``
    (the reference) and ``args_where`` (the arguments; default ``<where>_args``)."""
    factory = resolve_architecture(ref, where=where)
    try:
        model = factory(**dict(args or {}))
    except Exception as exc:  # the user's constructor: one line naming it
        raise InputError(
            args_where or f"{where}_args", f"keyword arguments {ref} accepts", f"{type(exc).__name__}: {_first_line(str(exc))}"
        ) from None
    except SystemExit as exc:  # a constructor that exits (argparse inside it) is the model's doing, not a rayfuse usage error
        raise InputError(where, "a class or function building a model without exiting", f"{ref} exited (sys.exit({exc.code!r}))") from None
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


def check_inputs_fit(
    model: nn.Module, X: np.ndarray, *, where: str, num_outputs: int | None = None, ref: str = "the model"
) -> Sequence[int]:
    """One forward pass of ``X[:2]``: the data's inputs must be what the model takes. Returns the output shape.

    The model must return ``(batch, classes)`` logits, as a tensor, or as the first element of a tuple / list (a model
    that also returns features or attention maps) or the ``logits`` of an output object (Hugging Face's
    ``ModelOutput``); in the last two cases a forward hook is added to ``model`` that returns the logits alone, so that
    every later call (matching, repair, distillation) sees what the check accepted. A forward that raises is one line
    saying so, with the exception's first line."""
    import torch

    shape = tuple(int(d) for d in X.shape[1:])
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(np.ascontiguousarray(X[:2])))
    except Exception as exc:  # the user's forward: any exception it raises
        first = _first_line(str(exc)) or "no message"
        raise InputError(
            where, f"inputs {ref} takes", f"arrays of shape {shape} per sample", f"the model's forward raised {type(exc).__name__}: {first}"
        ) from None
    logits = _logits(out)
    if logits is None:
        raise InputError(
            where, f"{ref} returning (batch, classes) logits: a tensor, the first element of a tuple, or .logits", _describe_output(out)
        )
    if logits is not out:
        model.register_forward_hook(_logits_hook)
    if logits.ndim != 2 or logits.shape[0] != min(2, len(X)):
        raise InputError(where, f"{ref} returning (batch, classes) logits", f"an output of shape {tuple(logits.shape)}")
    if num_outputs is not None and logits.shape[1] != num_outputs:
        raise InputError(where, f"{num_outputs} outputs per sample", tuple(logits.shape[1:]))
    return tuple(logits.shape)


def _logits(out: Any) -> Any:
    """The logits tensor of a model's output (see :func:`check_inputs_fit`), else ``None``."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def _logits_hook(module: nn.Module, args: Any, out: Any) -> Any:
    """A forward hook returning the logits of a tuple / ``ModelOutput`` result (a tensor passes as it is)."""
    logits = _logits(out)
    return out if logits is None else logits


def _describe_output(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} whose first element is {type(out[0]).__name__ if out else 'missing'}"
    return type(out).__name__
