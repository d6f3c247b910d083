"""Model files past ``max_shard_size``: shard folders written atomically and read back wherever a file is read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from rayfuse import io as rio
from rayfuse.errors import InputError
from rayfuse.io import SHARD_INDEX, load_params, params_exist, params_sha256, read_checkpoint, save_params, save_params_cast
from rayfuse.store import Checkpointer, LocalModelStore

ROOT = Path(__file__).resolve().parents[1]


def mixed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layers.0.weight": rng.standard_normal((40, 16)).astype(np.float32),
        "layers.0.bias": rng.standard_normal(40).astype(np.float32),
        "steps": np.array(7, dtype=np.int64),  # 0-d stays 0-d
        "scale": np.array([0.5, 1.5]),  # float64
        "half": rng.standard_normal((3, 5)).astype(np.float16),
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 4), np.float32),
    }


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)


def test_sharded_round_trip_is_bit_exact_from_the_folder_and_from_its_index(tmp_path):
    params = mixed()
    path = save_params(tmp_path / "m.safetensors", params, {"round": 3}, max_shard_size=200)
    assert path.is_dir()
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / SHARD_INDEX).read_text())
    for shard in set(index["weight_map"].values()):  # at most 200 bytes of tensors, or one larger tensor alone
        names = [k for k, v in index["weight_map"].items() if v == shard]
        assert len(names) == 1 or sum(params[k].nbytes for k in names) <= 200
    assert set(index["weight_map"]) == set(params) and index["metadata"]["round"] == "3"
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in params.values())
    assert same(load_params(path), params)
    assert same(load_params(path / SHARD_INDEX), params)
    assert rio.read_params_metadata(path) == {"round": "3"}
    assert rio.params_size(path) > sum(v.nbytes for v in params.values())


def test_a_single_file_is_byte_identical_to_the_safetensors_writer(tmp_path):
    from safetensors.numpy import save

    params = mixed()
    path = save_params(tmp_path / "m.safetensors", params, {"method": "fedavg"})
    assert path.is_file()
    assert path.read_bytes() == save(params, metadata={"method": "fedavg"})
    assert same(load_params(path), params)


def test_a_small_threshold_shards_a_small_model_and_a_large_one_keeps_one_file(tmp_path):
    params = mixed()
    assert save_params(tmp_path / "a.safetensors", params, max_shard_size=10**9).is_file()
    assert save_params(tmp_path / "b.safetensors", params, max_shard_size=64).is_dir()
    big = {"w": np.ones(100, np.float32)}  # one tensor larger than a shard: a shard of its own
    folder = save_params(tmp_path / "c.safetensors", {**big, "b": np.ones(3, np.float32)}, max_shard_size=100)
    weight_map = json.loads((folder / SHARD_INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) == 2 and weight_map["w"] != weight_map["b"]


def test_an_index_naming_a_missing_shard_is_refused_in_one_line(tmp_path):
    path = save_params(tmp_path / "m.safetensors", mixed(), max_shard_size=200)
    (path / "model-00002-of-00003.safetensors").unlink(missing_ok=True)
    missing = sorted(path.glob("model-*.safetensors"))
    if len(missing) == 3:  # the plan cut another number of shards: remove the second, whatever its name
        missing[1].unlink()
    for reader in (load_params, read_checkpoint, rio.params_sha256):
        with pytest.raises(InputError, match="an index whose shards all exist, got 'missing shard model-00002-of") as err:
            reader(path)
        assert "\n" not in str(err.value)


def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path):
    path = save_params(tmp_path / "m.safetensors", mixed(), max_shard_size=200)
    index = json.loads((path / SHARD_INDEX).read_text())
    index["weight_map"]["layers.0.bias"] = "../elsewhere.safetensors"
    (path / SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(InputError, match="shard file names in the index's folder"):
        load_params(path)


def test_a_crash_while_writing_shards_leaves_the_old_file_and_no_staging(tmp_path, monkeypatch):
    path = save_params(tmp_path / "m.safetensors", {"w": np.zeros(4, np.float32)})
    before = path.read_bytes()
    real = rio._write_file
    calls = []

    def crash(target, tensors, metadata):
        calls.append(target)
        if len(calls) == 2:
            raise OSError("disk full")
        real(target, tensors, metadata)

    monkeypatch.setattr(rio, "_write_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_params(path, mixed(), max_shard_size=200)
    assert path.is_file() and path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # the staging folder is gone


def test_a_shard_folder_replaces_a_file_and_a_file_a_shard_folder(tmp_path):
    params = mixed()
    path = tmp_path / "m.safetensors"
    save_params(path, params)
    save_params(path, params, max_shard_size=200)
    assert path.is_dir() and same(load_params(path), params)
    save_params(path, params, max_shard_size=200)  # a folder replacing a folder
    assert same(load_params(path), params)
    save_params(path, params)
    assert path.is_file() and same(load_params(path), params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_the_sha256_of_a_shard_folder_changes_with_any_shard(tmp_path):
    path = save_params(tmp_path / "m.safetensors", mixed(), max_shard_size=200)
    digest = params_sha256(path)
    shard = next(iter(sorted(path.glob("model-*.safetensors"))))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert params_sha256(path) != digest


def test_cast_outputs_shard_and_read_back_in_their_dtype(tmp_path):
    params = {"w": np.linspace(-1, 1, 60, dtype=np.float32).reshape(6, 10), "n": np.arange(3)}
    for dtype in ("bfloat16", "float16"):
        path = save_params_cast(tmp_path / f"{dtype}.safetensors", params, dtype, {"k": "v"}, max_shard_size=64)
        assert path.is_dir()
        back, dtypes = read_checkpoint(path)
        assert dtypes["w"] == dtype and dtypes["n"] == "int64"
        np.testing.assert_allclose(back["w"], params["w"], atol=1e-2)
        np.testing.assert_array_equal(back["n"], params["n"])


def test_mapped_reading_gives_read_only_views_equal_to_copies(tmp_path):
    params = mixed()
    for path in (save_params(tmp_path / "one.safetensors", params), save_params(tmp_path / "many.safetensors", params, max_shard_size=200)):
        mapped, dtypes = read_checkpoint(path, mapped=True)
        copied, _ = read_checkpoint(path)
        assert same(mapped, params) and same(copied, params)
        assert not mapped["layers.0.weight"].flags.writeable and copied["layers.0.weight"].flags.writeable
        assert dtypes["half"] == "float16"


def test_round_checkpoints_shard_and_resume_reads_them_back(tmp_path):
    checkpoints = Checkpointer(tmp_path / "fedavg", max_shard_size=200)
    params = mixed()
    for rnd in (1, 2, 3):
        state = {"momentum": np.full(5, float(rnd))}
        file = checkpoints.save(rnd, {k: v + rnd if v.dtype.kind == "f" else v for k, v in params.items()}, state, {"round": rnd})
        assert file.is_dir()
    assert sorted(p.name for p in (tmp_path / "fedavg").glob("round-*")) == ["round-00002.safetensors", "round-00003.safetensors"]
    loaded = checkpoints.load()
    assert loaded is not None and loaded.round == 3
    assert same(loaded.params, {k: v + 3 if v.dtype.kind == "f" else v for k, v in params.items()})
    np.testing.assert_array_equal(loaded.state["momentum"], np.full(5, 3.0))
    # a damaged shard of the newest round: the previous round's checkpoint, said in one line
    shard = sorted((tmp_path / "fedavg" / "round-00003.safetensors").glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    warnings: list[str] = []
    loaded = Checkpointer(tmp_path / "fedavg", max_shard_size=200).load(warnings.append)
    assert loaded is not None and loaded.round == 2
    assert len(warnings) == 1 and "round-00003.safetensors: damaged" in warnings[0]


def test_the_local_model_cache_keeps_a_sharded_model(tmp_path):
    store = LocalModelStore(tmp_path, max_shard_size=200)
    params = mixed()
    assert store.save("k" * 64, {"what": "test"}, params, {"loss": 0.5})
    folder = store.entry("k" * 64).folder / "params.safetensors"
    assert folder.is_dir() and params_exist(folder)
    kept = LocalModelStore(tmp_path).load("k" * 64)
    assert kept is not None and same(kept[0], params) and kept[1] == {"loss": 0.5}


RUN = {
    "run": {"name": "shards", "seed": 0},
    "partition": {"num_clients": 2},
    "model": {"name": "mlp", "hidden": [32]},
    "train": {"epochs": 1},
    "data": {"dataset": "digits"},
    "methods": {"average": {}, "fedavg": {"rounds": 2, "local_epochs": 1}},
}


def test_a_run_with_a_small_threshold_writes_shard_folders_and_resumes_from_them(tmp_path):
    import rayfuse

    config = {**RUN, "run": {**RUN["run"], "max_shard_size": 4096, "storage": str(tmp_path)}}
    folder = tmp_path / "run"
    result = rayfuse.run(config, backend="local", run_dir=folder, quiet=True)
    for path in (folder / "models" / "fedavg.safetensors", folder / "checkpoints" / "local" / "client-0.safetensors"):
        assert path.is_dir() and (path / SHARD_INDEX).is_file(), path
    assert (folder / "checkpoints" / "fedavg" / "round-00002.safetensors").is_dir()
    first = {k: np.array(v) for k, v in result.models["fedavg"].items()}
    assert all(np.isfinite(v).all() for v in first.values())
    # the method's finished record and model gone: resume continues from its sharded round checkpoint
    (folder / "state" / "fedavg.json").unlink()
    rio.remove_params(folder / "models" / "fedavg.safetensors")
    resumed = rayfuse.resume(folder, quiet=True)
    assert same(resumed.models["fedavg"], first)
    assert resumed.results["status"] == "succeeded"
    assert {"kind": "resumed", "method": "fedavg", "round": 2}.items() <= next(
        e for e in resumed.results["events"] if e["kind"] == "resumed"
    ).items()


def test_rayfuse_fuse_reads_shard_folders_and_shards_its_output(tmp_path):
    rng = np.random.default_rng(1)
    models = [{"w": rng.standard_normal((20, 10)).astype(np.float32), "b": rng.standard_normal(20).astype(np.float32)} for _ in range(3)]
    save_params(tmp_path / "a.safetensors", models[0], max_shard_size=100)
    save_params(tmp_path / "b.safetensors", models[1])
    save_params(tmp_path / "c.safetensors", models[2], max_shard_size=100)
    config = {
        "merge_method": "average",
        "models": [{"model": "a.safetensors"}, {"model": "b.safetensors"}, {"model": f"c.safetensors/{SHARD_INDEX}"}],
        "output": "fused.safetensors",
    }
    (tmp_path / "fuse.yaml").write_text(yaml.safe_dump(config))
    cli = [sys.executable, "-m", "rayfuse", "fuse", str(tmp_path / "fuse.yaml")]
    done = subprocess.run([*cli, "--max-shard-size", "200"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    fused = load_params(tmp_path / "fused.safetensors")
    assert (tmp_path / "fused.safetensors").is_dir()
    for key in ("w", "b"):
        np.testing.assert_allclose(fused[key], sum(m[key] for m in models) / 3, rtol=1e-6, atol=1e-6)
    # a missing shard of an input: exit 2, one line, nothing written
    next(iter(sorted((tmp_path / "a.safetensors").glob("model-*.safetensors")))).unlink()
    done = subprocess.run([*cli, str(tmp_path / "other.safetensors")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.startswith("rayfuse: error: ") and done.stderr.count("\n") == 1
    assert "got 'model-00001-of-" in done.stderr and "copy the missing shard" in done.stderr
    assert not (tmp_path / "other.safetensors").exists()


def test_a_bad_max_shard_size_is_refused_before_anything_runs(tmp_path):
    import rayfuse

    with pytest.raises(InputError, match="run.max_shard_size"):
        rayfuse.run({**RUN, "run": {**RUN["run"], "max_shard_size": 0}}, backend="local", run_dir=tmp_path / "r", quiet=True)
    assert not (tmp_path / "r").exists()
    with pytest.raises(InputError, match="max_shard_size: expected a positive number of bytes"):
        from rayfuse.api import fuse_checkpoints

        fuse_checkpoints({"merge_method": "average", "models": [{"model": "x"}]}, max_shard_size=0)
