"""A local Hugging Face folder as the run's model: ``model: {name: "hf:<folder>"}`` in a config, or
``rayfuse.run(model=hf_model(folder))`` from Python; both build the same model.

:class:`HFModel` builds the class the folder's ``config.json`` names (its ``architectures``: a sequence classifier such
as ``BertForSequenceClassification``) from the config alone, randomly initialised, and makes its ``forward`` take a
batch of token ids (the rows of the run's data, ``(N, L)``) and return the logits, keeping the class's state-dict
names. Its weights are the base of ``fedlora`` / ``fedmerge`` (their ``base:``, by default this folder), read with
``from_pretrained(folder, local_files_only=True)``; nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError

__all__ = [
    "HF_PREFIX",
    "HFModel",
    "absolute_hf_name",
    "check_hf_folder",
    "check_model_data",
    "check_token_ids",
    "hf_factory",
    "hf_folder_of",
    "hf_model",
    "quiet_transformers",
]

#: ``model.name`` of a Hugging Face folder: ``hf:<folder>``
HF_PREFIX = "hf:"

_TOKEN_CLASSES: dict[type, type] = {}


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' log at error level and its progress bars off while rayfuse builds, loads or saves a model, restored
    after: its load report (missing / unexpected keys, 20 lines) and "Loading weights" bars would print before
    rayfuse's own one-line refusal or summary, which says what matters. ``TRANSFORMERS_VERBOSITY`` set in the
    environment (``rayfuse run --verbose`` sets ``warning``, transformers' default, where it is unset) leaves them as the
    user asked."""
    if os.environ.get("TRANSFORMERS_VERBOSITY"):
        yield
        return
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def hf_folder_of(name: str) -> str | None:
    """The folder of a model name ``hf:<folder>``; ``None`` for any other name."""
    return name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else None


def absolute_hf_name(value: str) -> str:
    """``hf:<folder>`` with the folder made absolute (relative to the working directory, as every other path of a run
    config is), so the clients' processes, started elsewhere, read the same folder. Only its form is checked here: the
    folder itself is checked when the model is built (before any client starts)."""
    folder = hf_folder_of(value)
    if folder is None:
        return value
    if not folder.strip() or any(c in folder for c in "\0\n\r"):
        raise ValueError("hf:<folder>, a local Hugging Face folder (config.json and its weights)")
    return HF_PREFIX + os.path.abspath(os.path.expanduser(folder))


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
    """The folder's config and the transformers class its ``architectures`` names (without one: the sequence-classifier
    class of its ``model_type``). One line for a config transformers cannot read and a class it does not have."""
    import transformers

    try:
        with quiet_transformers():
            config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers' many errors for an unreadable config: one line
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise InputError(where, f"a Hugging Face config in {folder / 'config.json'}", f"{type(exc).__name__}: {first}") from None
    names = getattr(config, "architectures", None) or []
    if not names:
        return config, transformers.AutoModelForSequenceClassification
    cls = getattr(transformers, names[0], None) if isinstance(names[0], str) else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise InputError(
            where,
            f"an architecture transformers {transformers.__version__} can build (config.json architectures)",
            f"{names[0]!r} in {folder}",
        )
    return config, cls


def _under_vmap(x: Any) -> bool:
    """Whether ``x`` is batched by ``torch.func.vmap`` at any of the functorch levels wrapping it."""
    import torch

    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(x):
        if functorch.is_batchedtensor(x):
            return True
        x = functorch.get_unwrapped(x)
    return False


def _ids(config: Any, x: Any) -> Any:
    """Token-id rows (float, -1 at a padded position: rayfuse.data.text.PAD) as the long ids a model embeds, a padded
    position given the config's pad token (0 without one)."""
    pad = getattr(config, "pad_token_id", None)
    return x.masked_fill(x < 0, float(pad if isinstance(pad, int) and pad >= 0 else 0)).long()


def _token_ids_forward(model: Any) -> Any:
    """``model`` with a ``forward(x)`` taking token ids and returning the logits: its class swapped for a subclass that
    only changes ``forward``, so its parameters and state-dict names stay the class's."""
    base_cls = type(model)
    sub = _TOKEN_CLASSES.get(base_cls)
    if sub is None:

        def forward(self: Any, x: Any) -> Any:
            # the run's data are float arrays; token ids are whole numbers stored exactly in them, a padded position
            # of a text is -1 (rayfuse.data.text.PAD): the attention mask. Under vmap (Fisher's per-sample gradients)
            # transformers' mask code cannot be traced; there the rows carry no padding (diagonal_fisher loops over
            # padded ones) and no mask is passed
            if _under_vmap(x):
                out = base_cls.forward(self, input_ids=x.long())
            elif x.dim() == 3:
                # (B, 3, L): two texts' ids and a ratio (distillation's text mixup, transfer.mix_texts): the ratio's mix
                # of the two texts' word embeddings (position and type embeddings are the model's own, added inside),
                # attending where either text has a token
                first, second, lam = x[:, 0], x[:, 1], x[:, 2, :1, None]
                table = self.get_input_embeddings()
                embeds = lam * table(_ids(self.config, first)) + (1 - lam) * table(_ids(self.config, second))
                out = base_cls.forward(self, inputs_embeds=embeds, attention_mask=((first >= 0) | (second >= 0)).long())
            else:
                out = base_cls.forward(self, input_ids=_ids(self.config, x), attention_mask=(x >= 0).long())
            return out.logits if hasattr(out, "logits") else out[0]

        # masks_padding: its forward masks padded positions with transformers' attention mask, which vmap cannot
        # trace (rayfuse.alignment.merge.diagonal_fisher loops over padded samples instead)
        sub = type(f"TokenIds{base_cls.__name__}", (base_cls,), {"forward": forward, "masks_padding": True})
        _TOKEN_CLASSES[base_cls] = sub
    model.__class__ = sub
    return model


def _data_need(config: Any) -> str:
    """What the run's data must be for the folder's model, in words."""
    vocab = getattr(config, "vocab_size", None)
    length = getattr(config, "max_position_embeddings", None)
    ids = f"whole numbers in 0..{vocab - 1}" if isinstance(vocab, int) else "whole numbers"
    rows = f"rows of at most {length} token ids" if isinstance(length, int) else "rows of token ids"
    return f"{rows} ({ids}), shape (N, L)"


class HFModel:
    """The model factory of a Hugging Face folder (see :func:`hf_model`); picklable (it holds the path only)."""

    def __init__(self, folder: str | Path, where: str = "model") -> None:
        self.where = where
        self.folder = str(check_hf_folder(folder, where=where))
        self.__qualname__ = f"hf_model({self.folder})"

    def __call__(self, input_shape: tuple[int, ...], num_classes: int) -> Any:
        config, cls = _architecture(Path(self.folder), self.where)
        if not cls.__name__.endswith("ForSequenceClassification"):
            raise InputError(
                self.where,
                "a sequence classifier (config.json architectures: a ...ForSequenceClassification class) giving one logit a class",
                f"{cls.__name__} in {self.folder}",
            )
        length = getattr(config, "max_position_embeddings", None)
        if len(input_shape) != 1 or (isinstance(length, int) and input_shape[0] > length):
            raise InputError(
                self.where,
                f"data the model in {self.folder} takes: {_data_need(config)}",
                f"inputs of shape {tuple(input_shape)}",
                "a token-sequence dataset: data.dataset: tokens",
            )
        labels = getattr(config, "num_labels", None)
        if labels is not None and labels != num_classes:
            raise InputError(self.where, f"a classifier of the data's {num_classes} classes", f"num_labels {labels} in {self.folder}")
        with quiet_transformers():
            return _token_ids_forward(cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config))


def hf_model(folder: str | Path) -> HFModel:
    """The model factory for ``rayfuse.run(model=hf_model(folder))``: the folder's architecture (from its
    ``config.json``, no weights read), taking token-id rows and returning logits; refused in one line when the folder
    does not exist or has no ``config.json``."""
    return HFModel(folder)


def check_token_ids(factory: HFModel, X: np.ndarray, where: str = "data") -> None:
    """The run's inputs ``X`` are token ids the folder's model takes (whole numbers below its ``vocab_size``), else
    one line saying what the data must be. The shape (rows no longer than its positions) is the builder's check."""
    import transformers

    with quiet_transformers():
        config = transformers.AutoConfig.from_pretrained(factory.folder, local_files_only=True)
    vocab = getattr(config, "vocab_size", None)
    if X.size == 0:
        return
    # -1 marks a text's padded positions (rayfuse.data.text.PAD)
    low, high = float(np.min(np.where(X == -1, 0, X))), float(np.max(X))
    whole = bool(np.all(np.floor(X) == X))
    if not whole or low < 0 or (isinstance(vocab, int) and high >= vocab):
        found = "values that are not whole numbers" if not whole else f"values in {low:g}..{high:g}"
        raise InputError(
            where,
            f"token ids the model in {factory.folder} takes: {_data_need(config)}",
            found,
            "a token-sequence dataset: data.dataset: tokens (data.options.vocab at most the model's vocab_size)",
        )


def hf_factory(model_cfg: Any) -> HFModel | None:
    """The Hugging Face factory a model config builds with (``hf:<folder>``, or ``hf_model(folder)`` given from Python);
    ``None`` for any other model."""
    folder = hf_folder_of(getattr(model_cfg, "name", ""))
    if folder is not None:
        return HFModel(folder, where="model.name")
    factory = getattr(model_cfg, "custom_factory", None)
    return factory if isinstance(factory, HFModel) else None


def check_model_data(model_cfg: Any, *arrays: np.ndarray | None) -> None:
    """A Hugging Face model's data (each of ``arrays``: the inputs, the test split's) are token ids it takes
    (:func:`check_token_ids`); nothing to check for any other model."""
    factory = hf_factory(model_cfg)
    if factory is not None:
        for X in arrays:
            if X is not None:
                check_token_ids(factory, X)
