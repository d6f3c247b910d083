"""A local Hugging Face folder as the base of ``fedlora`` / ``fedmerge``.

The run's model must be the folder's architecture: :func:`hf_model` is the model factory for
``rayfuse.run(model=hf_model(folder), ...)``. It builds the class the folder's ``config.json`` names (its
``architectures``, a sequence classifier such as ``BertForSequenceClassification``) from the config alone, randomly
initialised, and makes its ``forward`` take a batch of token ids (the rows of the run's data, ``(N, L)``) and return the
logits, keeping the class's state-dict names. The weights come from ``base: folder``: :func:`read_hf_base` loads them
with ``from_pretrained(folder, local_files_only=True)``; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError

__all__ = ["hf_model", "HFModel", "read_hf_base", "check_hf_folder"]

_TOKEN_CLASSES: dict[type, type] = {}


def check_hf_folder(path: str | Path, where: str = "base") -> Path:
    """An existing folder with a ``config.json``, else one line naming ``where``."""
    folder = Path(path)
    if not folder.exists():
        raise InputError(where, "an existing Hugging Face folder (config.json and its weights)", f"no such folder: {folder}")
    if not folder.is_dir():
        raise InputError(where, "a Hugging Face folder (config.json and its weights)", f"a file: {folder}")
    if not (folder / "config.json").is_file():
        raise InputError(where, "a Hugging Face folder with its config.json", f"no config.json in {folder}")
    return folder


def _architecture(folder: Path, where: str) -> tuple[Any, Any]:
    """The folder's config and the transformers class its ``architectures`` names (``AutoModel`` without one)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers' many errors for an unreadable config: one line
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise InputError(where, f"a Hugging Face config in {folder / 'config.json'}", f"{type(exc).__name__}: {first}") from None
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names and isinstance(names[0], str) else None
    return config, cls if cls is not None and hasattr(cls, "from_pretrained") else transformers.AutoModel


def _token_ids_forward(model: Any) -> Any:
    """``model`` with a ``forward(x)`` taking token ids and returning the logits: its class swapped for a subclass that
    only changes ``forward``, so its parameters and state-dict names stay the class's."""
    base_cls = type(model)
    sub = _TOKEN_CLASSES.get(base_cls)
    if sub is None:

        def forward(self: Any, x: Any) -> Any:
            # the run's data are float arrays; token ids are whole numbers stored exactly in them
            out = base_cls.forward(self, input_ids=x.long())
            return out.logits if hasattr(out, "logits") else out[0]

        sub = type(f"TokenIds{base_cls.__name__}", (base_cls,), {"forward": forward})
        _TOKEN_CLASSES[base_cls] = sub
    model.__class__ = sub
    return model


class HFModel:
    """The model factory of a Hugging Face folder (see :func:`hf_model`); picklable (it holds the path only)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = str(check_hf_folder(folder, where="model"))
        self.__qualname__ = f"hf_model({self.folder})"

    def __call__(self, input_shape: tuple[int, ...], num_classes: int) -> Any:
        config, cls = _architecture(Path(self.folder), "model")
        labels = getattr(config, "num_labels", None)
        if labels is not None and labels != num_classes:
            raise InputError("model", f"a classifier of the data's {num_classes} classes", f"num_labels {labels} in {self.folder}")
        if len(input_shape) != 1:
            raise InputError("model", "token-id rows (N, L) as the data of a Hugging Face sequence model", f"inputs of shape {input_shape}")
        return _token_ids_forward(cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config))


def hf_model(folder: str | Path) -> HFModel:
    """The model factory for ``rayfuse.run(model=hf_model(folder))``: the folder's architecture (from its
    ``config.json``, no weights read), taking token-id rows and returning logits; refused in one line when the folder
    does not exist or has no ``config.json``."""
    return HFModel(folder)


def read_hf_base(path: str | Path, reference: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
    """The weights of the Hugging Face folder ``path`` (``from_pretrained``, local files only) and the loaded model,
    checked against the run model's tensors ``reference`` (names and shapes). One line for a missing folder, one
    without ``config.json``, one ``from_pretrained`` cannot load, and tensors that are not the run model's."""
    from rayfuse.finetunes.lora import _load_base
    from rayfuse.models import get_params

    folder = check_hf_folder(path)
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            "base", f"a Hugging Face model config (JSON) in {folder / 'config.json'}", f"unreadable ({type(exc).__name__})"
        ) from None
    try:
        model = _load_base(folder)
    except InputError as exc:
        raise exc.at("base") from None
    params = get_params(model)
    missing, extra = sorted(set(reference) - set(params)), sorted(set(params) - set(reference))
    if missing or extra:
        raise InputError(
            "base",
            "the run model's tensors",
            f"missing {missing[:3]}, unexpected {extra[:3]} in {folder}",
            "build the run's model from the folder: rayfuse.run(model=rayfuse.fusion.lora.hf_model(folder))",
        )
    for key, ref in reference.items():
        if tuple(params[key].shape) != tuple(ref.shape):
            raise InputError("base", f"tensor {key} of shape {tuple(ref.shape)}", f"shape {tuple(params[key].shape)} in {folder}")
    return {k: np.asarray(params[k]).astype(reference[k].dtype) for k in reference}, model
