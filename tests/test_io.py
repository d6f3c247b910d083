"""Files (rayfuse.io): atomic writes never leave half a file, parameter files round-trip, nothing unpickles."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from rayfuse import io as rio
from rayfuse.errors import InputError
from rayfuse.io import atomic_write_bytes, atomic_write_json, atomic_write_text, load_params, save_params, to_jsonable


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------------------------
# Atomic writes


def test_atomic_write_bytes_writes_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "out.bin"
    assert atomic_write_bytes(target, b"\x00\x01payload") == target
    assert target.read_bytes() == b"\x00\x01payload"
    assert listing(tmp_path) == ["out.bin"]


def test_atomic_write_replaces_an_existing_file(tmp_path):
    target = tmp_path / "out.txt"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new ünïcode")
    assert target.read_text(encoding="utf-8") == "new ünïcode"
    assert listing(tmp_path) == ["out.txt"]


def test_atomic_write_creates_missing_folders(tmp_path):
    target = tmp_path / "a" / "b" / "c.json"
    atomic_write_json(target, {"x": 1})
    assert json.loads(target.read_text()) == {"x": 1}


@pytest.mark.parametrize("fail_at", ["replace", "fsync"])
def test_failed_write_keeps_the_old_file_and_removes_the_temp_file(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "results.json"
    atomic_write_text(target, "the old, complete file")

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(rio.os, fail_at, boom)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write_text(target, "the new file that never lands")
    monkeypatch.undo()
    assert target.read_text() == "the old, complete file"
    assert listing(tmp_path) == ["results.json"]


def test_interrupted_write_of_a_new_file_leaves_nothing(tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt  # BaseException: the temp file is still cleaned up

    monkeypatch.setattr(rio.os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(tmp_path / "new.bin", b"data")
    monkeypatch.undo()
    assert listing(tmp_path) == []


def test_atomic_write_json_converts_numpy_paths_and_nan(tmp_path):
    target = tmp_path / "r.json"
    atomic_write_json(target, {"acc": np.float32(0.5), "counts": np.array([1, 2]), "nan": float("nan"), "path": Path("a/b"), 3: (1, 2)})
    text = target.read_text()
    assert text.endswith("\n")
    assert json.loads(text) == {"acc": 0.5, "counts": [1, 2], "nan": None, "path": "a/b", "3": [1, 2]}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.int64(3), 3),
        (np.float64(0.25), 0.25),
        (np.bool_(True), True),
        (np.array([[1.5, np.inf]]), [[1.5, None]]),
        (float("-inf"), None),
        ((1, [2, (3,)]), [1, [2, [3]]]),
        ({1: {"a": np.nan}}, {"1": {"a": None}}),
        (Path("x/y.txt"), "x/y.txt"),
        ("text", "text"),
        (None, None),
    ],
)
def test_to_jsonable(value, expected):
    converted = to_jsonable(value)
    assert converted == expected
    json.dumps(converted, allow_nan=False)  # raises if anything non-JSON slipped through


# ---------------------------------------------------------------------------------------------------------------
# Parameter files

PARAMS = {
    "layers.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "layers.0.bias": np.array([-1.5, 0.0, 2.25], np.float32),
    "double": np.linspace(0, 1, 5),
    "bn.num_batches_tracked": np.array(42, np.int64),
    "empty": np.zeros((0, 3), np.float32),
}


def assert_same_params(loaded, expected):
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
        assert np.array_equal(loaded[key], value), key


def test_safetensors_round_trip_is_exact_including_0d_buffers(tmp_path):
    # np.ascontiguousarray used to turn the 0-d num_batches_tracked into shape (1,).
    path = save_params(tmp_path / "model.safetensors", PARAMS, metadata={"method": "fedavg", "round": 3})
    assert_same_params(load_params(path), PARAMS)
    assert listing(tmp_path) == ["model.safetensors"]


def test_safetensors_metadata_is_stored_as_strings(tmp_path):
    from safetensors import safe_open

    path = save_params(tmp_path / "m.safetensors", PARAMS, metadata={"round": 3})
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.metadata() == {"round": "3"}


def test_save_params_accepts_non_contiguous_arrays(tmp_path):
    transposed = {"w": np.arange(6, dtype=np.float32).reshape(2, 3).T}
    assert_same_params(load_params(save_params(tmp_path / "t.safetensors", transposed)), {"w": np.ascontiguousarray(transposed["w"])})


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_torch_state_dict_loads_as_numpy(tmp_path, suffix):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    path = tmp_path / f"model{suffix}"
    torch.save(model.state_dict(), path)
    expected = {k: v.numpy() for k, v in model.state_dict().items()}
    assert_same_params(load_params(path), expected)


def test_torch_checkpoint_with_a_state_dict_entry_loads(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {"w": torch.ones(2, 2)}, "epoch": 3}, path)
    assert_same_params(load_params(path), {"w": np.ones((2, 2), np.float32)})


def test_pickled_mapping_that_is_not_a_state_dict_is_rejected(tmp_path):
    path = tmp_path / "notes.pt"
    torch.save({"w": [1, 2, 3], "lr": 0.1}, path)
    with pytest.raises(InputError, match=r"notes\.pt: expected a mapping of tensor names to tensors, got 'dict'"):
        load_params(path)


def test_pickled_non_mapping_is_rejected(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.ones(1)], path)
    with pytest.raises(InputError, match=r"list\.pt: expected a mapping of tensor names to tensors, got 'list'"):
        load_params(path)


class _Payload:
    """An object whose unpickling would run code (creates a marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_untrusted_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"w": _Payload(str(marker))}, protocol=2))
    with pytest.raises(
        InputError, match=r"evil\.pt: expected a PyTorch state_dict loadable with weights_only=True, got 'unreadable \(UnpicklingError\)'"
    ):
        load_params(path)
    assert not marker.exists()


def test_missing_parameter_file(tmp_path):
    with pytest.raises(InputError, match=r"nope\.safetensors: expected an existing model file") as info:
        load_params(tmp_path / "nope.safetensors")
    assert "no such file" in str(info.value)


@pytest.mark.parametrize("name", ["garbage.safetensors", "garbage.pt"])
def test_corrupt_parameter_file(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(os.urandom(64))
    with pytest.raises(InputError, match=rf"{name.replace('.', '[.]')}: expected a (valid safetensors file|PyTorch state_dict)") as info:
        load_params(path)
    assert "\n" not in str(info.value)
