"""``rayfuse fuse``: fusing checkpoints trained elsewhere (safetensors / torch weights-only), bad input first."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from rayfuse.cli import main
from rayfuse.errors import InputError
from rayfuse.io import load_params, save_params
from rayfuse.merging import load_fuse_config, run_fuse


def model(seed, hidden=4):
    rng = np.random.default_rng(seed)
    return {
        "0.weight": rng.normal(size=(hidden, 3)).astype(np.float32),
        "0.bias": rng.normal(size=hidden).astype(np.float32),
        "1.weight": rng.normal(size=(2, hidden)).astype(np.float32),
        "bn.num_batches_tracked": np.array(seed + 1, np.int64),
    }


@pytest.fixture
def files(tmp_path):
    a, b, c = model(0), model(1), model(2)
    save_params(tmp_path / "a.safetensors", a)
    save_params(tmp_path / "b.safetensors", b)
    torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in c.items()}, tmp_path / "c.pt")
    return tmp_path, [a, b, c]


def write(tmp_path, **fields):
    config = {
        "merge_method": "average",
        "models": [{"model": "a.safetensors"}, {"model": "b.safetensors"}, {"model": "c.pt"}],
        "output": "fused.safetensors",
        **fields,
    }
    path = tmp_path / "fuse.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_average_of_safetensors_and_torch_files_is_the_tensorwise_mean(files):
    tmp_path, models = files
    summary = run_fuse(load_fuse_config(write(tmp_path)))
    fused = load_params(tmp_path / "fused.safetensors")
    assert summary["models"] == 3 and set(fused) == set(models[0])
    for key in ("0.weight", "0.bias", "1.weight"):
        np.testing.assert_allclose(fused[key], np.mean([m[key] for m in models], axis=0), rtol=1e-5, atol=1e-7)
        assert fused[key].dtype == np.float32


def test_weighted_average_follows_the_weights_and_fusing_copies_of_one_model_returns_it(files):
    tmp_path, models = files
    weighted = [{"model": "a.safetensors", "parameters": {"weight": 3}}, {"model": "b.safetensors", "parameters": {"weight": 1}}]
    run_fuse(load_fuse_config(write(tmp_path, merge_method="linear", models=weighted, dtype="float64")))
    fused = load_params(tmp_path / "fused.safetensors")
    np.testing.assert_allclose(fused["0.weight"], 0.75 * models[0]["0.weight"] + 0.25 * models[1]["0.weight"], rtol=1e-6)
    assert fused["0.weight"].dtype == np.float64
    same = [{"model": "a.safetensors"}, {"model": "a.safetensors"}]
    run_fuse(load_fuse_config(write(tmp_path, models=same), tmp_path / "same.safetensors"))
    assert all(np.array_equal(v, models[0][k]) for k, v in load_params(tmp_path / "same.safetensors").items())


def test_the_cli_fuses_and_reports(files, capsys):
    tmp_path, _ = files
    assert main(["fuse", str(write(tmp_path)), str(tmp_path / "out.safetensors")]) == 0
    assert "average of 3 models, 4 tensors" in capsys.readouterr().out
    assert (tmp_path / "out.safetensors").is_file()


def bad_shape(tmp_path):
    save_params(tmp_path / "wide.safetensors", model(5, hidden=6))
    return {"models": [{"model": "a.safetensors"}, {"model": "wide.safetensors"}]}


def bad_keys(tmp_path):
    m = model(5)
    m["extra.weight"] = np.zeros(2, np.float32)
    save_params(tmp_path / "extra.safetensors", m)
    return {"models": [{"model": "a.safetensors"}, {"model": "extra.safetensors"}]}


def pickle_file(tmp_path):
    torch.save({"w": torch.zeros(2), "code": len}, tmp_path / "evil.pt")  # a global: refused by weights_only
    return {"models": [{"model": "a.safetensors"}, {"model": "evil.pt"}]}


def nan_file(tmp_path):
    m = model(5)
    m["0.bias"][0] = np.nan
    save_params(tmp_path / "nan.safetensors", m)
    return {"models": [{"model": "a.safetensors"}, {"model": "nan.safetensors"}]}


BAD = [
    (
        "mismatched shapes",
        bad_shape,
        r"models\.1\.model \(wide\.safetensors\): 0\.bias: expected shape \(4,\) as in the base model \(a\.safetensors\), got \(6,\)",
    ),
    (
        "mismatched names",
        bad_keys,
        r"models\.1\.model \(extra\.safetensors\): extra\.weight: expected only the tensors the base model \(a\.safetensors\) holds",
    ),
    ("pickled objects", pickle_file, r"evil\.pt: expected a PyTorch state_dict loadable with weights_only=True"),
    ("NaN values", nan_file, r"models\.1\.model \(nan\.safetensors\): 0\.bias: expected finite values"),
    ("unknown method", lambda t: {"merge_method": "avrage"}, r"merge_method: expected a merge in .*did you mean 'average'"),
    ("method needing data", lambda t: {"merge_method": "fedavg"}, r"merge_method: .*run in a federation"),
    (
        "missing weight",
        lambda t: {"merge_method": "weighted_average"},
        r"models\.0\.parameters\.weight: expected this model's weight for weighted_average",
    ),
    (
        "weight on average",
        lambda t: {"models": [{"model": "a.safetensors", "parameters": {"weight": 2}}]},
        r"models\.0\.parameters\.weight: expected no per-model parameters with average",
    ),
    ("typo in a key", lambda t: {"ouput": "x.safetensors"}, r"ouput: expected a known key.*did you mean 'output'"),
    (
        "missing file",
        lambda t: {"models": [{"model": "nope.safetensors"}]},
        r"models\.0\.model: expected an existing Hugging Face folder or model file",
    ),
    ("existing output", lambda t: {"output": "a.safetensors"}, r"output: expected a path that does not exist yet"),
    ("no models", lambda t: {"models": []}, r"models: expected"),
]


@pytest.mark.parametrize("make, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_fails_with_one_line_before_writing(files, make, match):
    tmp_path, _ = files
    with pytest.raises(InputError, match=match):
        run_fuse(load_fuse_config(write(tmp_path, **make(tmp_path))))
    assert not (tmp_path / "fused.safetensors").exists()


def test_kl_neurons_matches_permuted_hidden_units_and_rejects_other_architectures(tmp_path):
    # Model b is model a with its hidden units shuffled: averaging blurs them, KL-fusion of the neurons undoes the
    # permutation and returns a's network (up to the order of the units).
    rng = np.random.default_rng(0)
    a = {
        "layers.0.weight": rng.normal(size=(6, 4)).astype(np.float32) * 3,
        "layers.0.bias": rng.normal(size=6).astype(np.float32),
        "layers.1.weight": rng.normal(size=(3, 6)).astype(np.float32),
        "layers.1.bias": rng.normal(size=3).astype(np.float32),
    }
    perm = rng.permutation(6)
    b = {
        "layers.0.weight": a["layers.0.weight"][perm],
        "layers.0.bias": a["layers.0.bias"][perm],
        "layers.1.weight": a["layers.1.weight"][:, perm],
        "layers.1.bias": a["layers.1.bias"],
    }
    save_params(tmp_path / "a.safetensors", a)
    save_params(tmp_path / "b.safetensors", b)
    config = {
        "merge_method": "kl_neurons",
        "models": [{"model": "a.safetensors"}, {"model": "b.safetensors"}],
        "parameters": {"lam": 1.0},
        "output": "kl.safetensors",
    }
    (tmp_path / "kl.yaml").write_text(yaml.safe_dump(config))
    run_fuse(load_fuse_config(tmp_path / "kl.yaml"))
    fused = load_params(tmp_path / "kl.safetensors")
    assert fused["layers.0.weight"].shape == (6, 4) and fused["layers.1.weight"].shape == (3, 6)
    order = [int(np.argmin(np.abs(fused["layers.0.weight"] - row).sum(1))) for row in a["layers.0.weight"]]
    np.testing.assert_allclose(fused["layers.0.weight"][order], a["layers.0.weight"], atol=1e-5)
    np.testing.assert_allclose(fused["layers.1.weight"][:, order], a["layers.1.weight"], atol=1e-5)
    # a checkpoint that is not a one-hidden-layer MLP
    save_params(tmp_path / "c.safetensors", {"0.weight": np.ones((2, 2), np.float32)})
    save_params(tmp_path / "d.safetensors", {"0.weight": np.ones((2, 2), np.float32)})
    config.update(models=[{"model": "c.safetensors"}, {"model": "d.safetensors"}], output="bad.safetensors")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(InputError, match="merge_method: expected kl_neurons on one-hidden-layer MLPs"):
        run_fuse(load_fuse_config(tmp_path / "bad.yaml"))


ARCH = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden=4, classes=2):
        super().__init__()
        self.fc1 = nn.Linear(3, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
"""


@pytest.fixture
def arch_files(tmp_path, monkeypatch):
    """Checkpoints of a user's class ``mynets:Net`` defined in a module in the working directory, and a data sample."""
    (tmp_path / "mynets.py").write_text(ARCH)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for i in range(2):
        torch.manual_seed(i)
        exec(compile(ARCH, "mynets", "exec"), ns := {})
        save_params(tmp_path / f"n{i}.safetensors", {k: v.numpy() for k, v in ns["Net"]().state_dict().items()})
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "sample.npz", X=rng.normal(size=(20, 3)).astype(np.float32), y=rng.integers(0, 2, 20))
    return tmp_path


def write_arch(tmp_path, **fields):
    """A fuse config over n0 / n1 of ``mynets:Net``; a field given as None is left out of the file."""
    config = {
        "merge_method": "average",
        "architecture": "mynets:Net",
        "output": "fused.safetensors",
        "models": [{"model": "n0.safetensors"}, {"model": "n1.safetensors"}],
        **fields,
    }
    config = {k: v for k, v in config.items() if v is not None}
    path = tmp_path / "fuse.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_architecture_from_the_working_directory_checks_the_checkpoints_and_the_data(arch_files):
    summary = run_fuse(load_fuse_config(write_arch(arch_files, data={"path": "sample.npz"})))
    assert summary["tensors"] == 4 and (arch_files / "fused.safetensors").is_file()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"architecture": "nosuchmodule:Net"}, r"fuse\.yaml: architecture: expected an importable module 'nosuchmodule'"),
        ({"architecture": "mynets:Missing"}, r"fuse\.yaml: architecture: expected a name defined in mynets, got 'Missing'"),
        ({"architecture": "mynets"}, r"fuse\.yaml: architecture: expected \"module:Class\""),
        (
            {"architecture_args": {"width": 3}},
            r"fuse\.yaml: architecture_args: expected keyword arguments mynets:Net accepts, got \"TypeError",
        ),
        ({"architecture_args": {"hidden": 5}}, r"n0\.safetensors: fc1\.weight: expected shape \(5, 3\) \(mynets:Net\), got \(4, 3\)"),
        ({"data": {"path": "bad.npz"}}, r"fuse\.yaml: data\.path: expected inputs the model takes, got 'arrays of shape \(5,\)"),
        (
            {"architecture": None, "input_shape": [3]},
            r"fuse\.yaml: architecture: expected the class that input_shape is for \(merge_method average reads it with one\)",
        ),
    ],
)
def test_an_architecture_that_does_not_fit_is_one_line_before_anything_is_written(arch_files, fields, message):
    np.savez(arch_files / "bad.npz", X=np.zeros((4, 5), np.float32), y=np.array([0, 1, 0, 1]))
    path = write_arch(arch_files, **fields)
    with pytest.raises(InputError, match="^(.*/)?" + message):
        run_fuse(load_fuse_config(path))
    assert not (arch_files / "fused.safetensors").exists()


def test_weight_and_activation_matching_undo_a_permutation_of_a_users_model(arch_files):
    from rayfuse.symmetry import derive_spec

    a = load_params(arch_files / "n0.safetensors")
    exec(compile(ARCH, "mynets", "exec"), ns := {})
    spec = derive_spec(ns["Net"]().eval(), torch.zeros(2, 3))
    assert [g.size for g in spec.groups] == [4]
    save_params(arch_files / "n1.safetensors", spec.apply(a, {spec.groups[0].name: np.array([2, 0, 3, 1])}))
    for method, extra in (("weight_matching", {"input_shape": [3]}), ("activation_matching", {"data": {"path": "sample.npz"}})):
        out = arch_files / f"{method}.safetensors"
        run_fuse(load_fuse_config(write_arch(arch_files, merge_method=method, **extra), out))
        fused = load_params(out)
        for key, value in a.items():
            np.testing.assert_allclose(fused[key], value, rtol=1e-6, atol=1e-7, err_msg=f"{method}: {key}")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"merge_method": "activation_matching"},
            r"fuse\.yaml: data: expected a sample \(data: \{path: sample\.npz\} with arrays X and y\) "
            r"for activation_matching",
        ),
        ({"merge_method": "weight_matching", "architecture": None}, r"fuse\.yaml: architecture: expected the models' class"),
        (
            {"merge_method": "weight_matching", "parameters": {"merge": "fisher"}},
            r"fuse\.yaml: data: expected a sample .* for merge: fisher",
        ),
        ({"merge_method": "weight_matching"}, r"input_shape: expected one input's shape"),
    ],
)
def test_matching_without_what_it_needs_is_one_line(arch_files, fields, message):
    path = write_arch(arch_files, **fields)
    with pytest.raises(InputError, match="^(.*/)?" + message):
        run_fuse(load_fuse_config(path))
    assert not (arch_files / "fused.safetensors").exists()


def test_the_python_api_fuses_from_a_dict_with_paths_from_the_working_directory(arch_files):
    import rayfuse

    out = rayfuse.fuse(
        {
            "merge_method": "weight_matching",
            "architecture": "mynets:Net",
            "input_shape": [3],
            "models": [{"model": "n0.safetensors"}, {"model": "n1.safetensors"}],
            "output": "api.safetensors",
        }
    )
    assert out == arch_files / "api.safetensors" or out.resolve() == (arch_files / "api.safetensors").resolve()
    assert set(load_params(out)) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    with pytest.raises(InputError, match=r"^<fuse config>: models\.1\.model: expected an existing Hugging Face folder or model file"):
        rayfuse.fuse(
            {"merge_method": "average", "models": [{"model": "n0.safetensors"}, {"model": "nope.safetensors"}], "output": "x.safetensors"}
        )


def test_a_nonparametric_merge_writes_the_wider_model_whose_outputs_average_the_inputs_logits(arch_files):
    from rayfuse.symmetry import derive_spec, resize_with_spec

    params = [load_params(arch_files / f"n{i}.safetensors") for i in range(2)]
    for method, extra in (("weight_matching", {"input_shape": [3]}), ("activation_matching", {"data": {"path": "sample.npz"}})):
        out = arch_files / f"{method}-np.safetensors"
        parameters = {"merge": "nonparametric", "new_unit_threshold": 1.0, "max_width": 2.0}
        summary = run_fuse(load_fuse_config(write_arch(arch_files, merge_method=method, parameters=parameters, **extra), out))
        assert summary["resized"] == {"fc1.weight": ((4, 3), (8, 3)), "fc1.bias": ((4,), (8,)), "fc2.weight": ((2, 4), (2, 8))}
        fused = load_params(out)
        assert fused["fc1.weight"].shape == (8, 3) and fused["fc2.weight"].shape == (2, 8)
        exec(compile(ARCH, "mynets", "exec"), ns := {})
        net = ns["Net"]().eval()
        wide = resize_with_spec(ns["Net"]().eval(), derive_spec(net, torch.zeros(2, 3)), fused, (2, 3))
        x = torch.randn(5, 3)
        with torch.no_grad():
            expected = sum(0.5 * _load(ns["Net"](), p)(x) for p in params)
            torch.testing.assert_close(wide(x), expected, atol=1e-5, rtol=1e-5)


def _load(net, params):
    net.load_state_dict({k: torch.as_tensor(v) for k, v in params.items()})
    return net.eval()


def test_repair_in_rayfuse_fuse_rescales_the_hidden_layer_of_a_model_without_batchnorm(arch_files):
    outs = {}
    for repair in (False, True):
        out = arch_files / f"repair-{repair}.safetensors"
        run_fuse(
            load_fuse_config(
                write_arch(arch_files, merge_method="weight_matching", data={"path": "sample.npz"}, parameters={"repair": repair}), out
            )
        )
        outs[repair] = load_params(out)
    assert not np.allclose(outs[True]["fc1.bias"], outs[False]["fc1.bias"])
    np.testing.assert_array_equal(outs[True]["fc2.weight"], outs[False]["fc2.weight"])


def _torch_pair(tmp_path, dtype, suffixes=(".safetensors", ".safetensors")):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = [{"w": torch.randn(4, 3, generator=gen), "b": torch.randn(4, generator=gen)} for _ in range(2)]
    names = []
    for i, (params, suffix, kind) in enumerate(zip(tensors, suffixes, dtype if isinstance(dtype, tuple) else (dtype, dtype))):
        cast = {k: v.to(getattr(torch, kind)) for k, v in params.items()}
        name = f"m{i}{suffix}"
        if suffix == ".pt":
            torch.save(cast, tmp_path / name)
        else:
            save_file(cast, str(tmp_path / name))
        names.append((name, cast))
    return names


@pytest.mark.parametrize(
    "dtype, suffixes",
    [("bfloat16", (".safetensors", ".safetensors")), ("bfloat16", (".pt", ".safetensors")), ("float16", (".safetensors", ".pt"))],
)
def test_half_precision_checkpoints_fuse_in_float32_and_keep_their_dtype(tmp_path, dtype, suffixes):
    from safetensors.torch import load_file

    models = _torch_pair(tmp_path, dtype, suffixes)
    run_fuse(load_fuse_config(write(tmp_path, models=[{"model": name} for name, _ in models])))
    fused = load_file(str(tmp_path / "fused.safetensors"))
    for key in ("w", "b"):
        expected = ((models[0][1][key].float() + models[1][1][key].float()) / 2).to(getattr(torch, dtype))
        assert fused[key].dtype == getattr(torch, dtype)
        assert torch.equal(fused[key], expected)


def test_the_dtype_key_casts_the_output_and_mixed_half_dtypes_fuse_to_float32(tmp_path):
    from safetensors.torch import load_file

    models = _torch_pair(tmp_path, "float32")
    run_fuse(load_fuse_config(write(tmp_path, models=[{"model": name} for name, _ in models], dtype="bfloat16")))
    fused = load_file(str(tmp_path / "fused.safetensors"))
    assert fused["w"].dtype == torch.bfloat16
    assert torch.equal(fused["w"], ((models[0][1]["w"] + models[1][1]["w"]) / 2).to(torch.bfloat16))
    mixed = _torch_pair(tmp_path, ("bfloat16", "float16"), (".pt", ".pt"))
    run_fuse(load_fuse_config(write(tmp_path, models=[{"model": name} for name, _ in mixed]), tmp_path / "mixed.safetensors"))
    assert load_file(str(tmp_path / "mixed.safetensors"))["w"].dtype == torch.float32
