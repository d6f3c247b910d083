"""A local Hugging Face folder as the base of ``fedlora`` / ``fedmerge``.

The run's model must be the folder's architecture: ``model: {name: "hf:<folder>"}`` in a config, or the model factory
:func:`hf_model` (:mod:`rayfuse.models.hf`) for ``rayfuse.run(model=hf_model(folder), ...)``. It builds the class the
folder's ``config.json`` names (its ``architectures``, a sequence classifier such as ``BertForSequenceClassification``)
from the config alone, randomly initialised, and makes its ``forward`` take a batch of token ids (the rows of the
run's data, ``(N, L)``) and return the logits, keeping the class's state-dict names. The weights come from ``base:``
(by default the model's folder): :func:`read_hf_base` loads them with ``from_pretrained(folder,
local_files_only=True)``; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.errors import InputError
from rayfuse.io import read_json
from rayfuse.models.hf import HFModel, check_hf_folder, hf_model

__all__ = ["hf_model", "HFModel", "read_hf_base", "check_hf_folder"]


def read_hf_base(path: str | Path, reference: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
    """The weights of the Hugging Face folder ``path`` (``from_pretrained``, local files only) and the loaded model,
    checked against the run model's tensors ``reference`` (names and shapes). One line for a missing folder, one
    without ``config.json``, one ``from_pretrained`` cannot load, and tensors that are not the run model's."""
    from rayfuse.finetunes.lora import _load_base
    from rayfuse.models import get_params

    folder = check_hf_folder(path)
    read_json(folder / "config.json", f"a Hugging Face model config (JSON) in {folder / 'config.json'}", where="base")
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
            "build the run's model from the folder: model: {name: 'hf:<folder>'}, or rayfuse.run(model=hf_model(folder))",
        )
    for key, ref in reference.items():
        if tuple(params[key].shape) != tuple(ref.shape):
            raise InputError("base", f"tensor {key} of shape {tuple(ref.shape)}", f"shape {tuple(params[key].shape)} in {folder}")
    return {k: np.asarray(params[k]).astype(reference[k].dtype) for k in reference}, model
