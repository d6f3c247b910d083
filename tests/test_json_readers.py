"""The JSON a user can touch (a sweep's seal, a PEFT adapter's or a Hugging Face folder's config.json, a fused file's
metadata, a run's partition manifest) is read through one reader, :func:`rayfuse.io.parse_json`: text that is not
JSON, bytes that are not UTF-8 and nesting deeper than json's parser recurses (a ``RecursionError``, which is no
``ValueError``) are one line naming the file, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rayfuse.errors import InputError

DEEP = "[" * 100_000


def _adapter(tmp_path: Path, text: str) -> Callable[[], Any]:
    from rayfuse.finetunes.lora import _read_config

    (tmp_path / "adapter_config.json").write_text(text)
    return lambda: _read_config(tmp_path, "models.0.model")


def _hf_base(tmp_path: Path, text: str) -> Callable[[], Any]:
    from rayfuse.fusion.lora.hf import read_hf_base

    (tmp_path / "config.json").write_text(text)
    return lambda: read_hf_base(tmp_path, {})


def _hf_architectures(tmp_path: Path, text: str) -> Callable[[], Any]:
    from rayfuse.finetunes.lora import _load_base

    (tmp_path / "config.json").write_text(text)
    return lambda: _load_base(tmp_path)


def _fused(key: str) -> Callable[[Path, str], Callable[[], Any]]:
    def make(tmp_path: Path, text: str) -> Callable[[], Any]:
        from safetensors.numpy import save_file

        from rayfuse.merging import load_fused

        file = tmp_path / "fused.safetensors"
        # a Linear(3, 2) widened to 4 outputs: its shape and spec are read only for a file whose widths grew
        meta = {"rayfuse.architecture": "torch.nn:Linear", "rayfuse.architecture_args": '{"in_features": 3, "out_features": 2}', key: text}
        save_file({"weight": np.zeros((4, 3), np.float32), "bias": np.zeros(4, np.float32)}, str(file), metadata=meta)
        return lambda: load_fused("torch.nn:Linear", file)

    return make


def _parsed(tmp_path: Path, text: str) -> Callable[[], Any]:
    from rayfuse.io import read_json

    (tmp_path / "any.json").write_text(text)
    return lambda: read_json(tmp_path / "any.json", "a JSON file")


READERS = [
    ("adapter-config", _adapter, "adapter_config.json: expected a JSON object (a PEFT LoraConfig)"),
    ("hf-base-config", _hf_base, "base: expected a Hugging Face model config (JSON)"),
    ("hf-architectures", _hf_architectures, "config.json: expected a Hugging Face model config (JSON)"),
    ("fused-architecture-args", _fused("rayfuse.architecture_args"), "metadata rayfuse.architecture_args: expected a JSON object"),
    ("fused-input-shape", _fused("rayfuse.input_shape"), "metadata rayfuse.input_shape: expected a JSON list of integers"),
    ("fused-spec", _fused("rayfuse.spec"), "metadata rayfuse.spec: expected a JSON permutation spec"),
    ("read-json", _parsed, "any.json: expected a JSON file"),
]
CONTENTS = [("nested-too-deep", DEEP, "RecursionError"), ("not-json", "{'a': 1", "JSONDecodeError")]


@pytest.mark.parametrize(("content", "why"), [c[1:] for c in CONTENTS], ids=[c[0] for c in CONTENTS])
@pytest.mark.parametrize(("make", "words"), [r[1:] for r in READERS], ids=[r[0] for r in READERS])
def test_damaged_json_a_user_can_touch_is_one_line_naming_the_file(tmp_path, make, words, content, why):
    read = make(tmp_path, content)
    with pytest.raises(InputError) as raised:
        read()
    line = str(raised.value)
    assert words in line and f"a damaged file ({why})" in line and "\n" not in line, line


def test_bytes_that_are_not_utf8_are_a_damaged_file():
    from rayfuse.io import parse_json

    with pytest.raises(InputError, match=r"^x\.json: expected JSON, got 'a damaged file \(UnicodeDecodeError\)'$"):
        parse_json(b'{"a": "\xff"}', "x.json", "JSON")
