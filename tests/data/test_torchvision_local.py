"""torchvision datasets load from a local folder (data.root) without downloading anything."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from rayfuse.data import load_dataset
from rayfuse.errors import InputError


def write_idx(path, array: np.ndarray) -> None:
    """Write an IDX file (the MNIST format): magic 0x0000080<ndim>, big-endian dims, unsigned bytes."""
    header = struct.pack(">I", 0x0800 + array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_root(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 60), ("t10k", 20)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, size=(n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    return tmp_path


def test_mnist_loads_from_a_local_folder_with_its_own_test_split(mnist_root):
    ds = load_dataset("mnist", root=str(mnist_root))
    assert ds.X.shape == (60, 1, 28, 28) and ds.X.dtype == np.float32
    assert 0.0 <= ds.X.min() and ds.X.max() <= 1.0
    assert ds.has_test_split and ds.X_test.shape == (20, 1, 28, 28)
    assert ds.num_classes == 10 and ds.y[:12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_a_run_on_local_mnist_uses_the_official_test_split(mnist_root, make_config, tmp_path):
    from rayfuse.data.roles import make_plan

    cfg = make_config(data={"dataset": "mnist", "root": str(mnist_root)}, partition={"method": "iid", "num_clients": 3})
    plan = make_plan(load_dataset("mnist", root=str(mnist_root)), cfg.data, cfg.partition, 0)
    assert plan.test_source == "predefined" and len(plan.test) == 20
    assert sum(len(t) + len(v) for t, v in zip(plan.client_train, plan.client_val)) == 60


def test_missing_files_say_where_to_put_them(tmp_path):
    with pytest.raises(InputError, match=r"data\.root: expected .*MNIST/raw/ with train-images-idx3-ubyte") as info:
        load_dataset("mnist", root=str(tmp_path))
    assert "download=True) on a machine with internet" in str(info.value)
    with pytest.raises(InputError, match="data.root"):
        load_dataset("cifar10", root=None)
