"""Issue 31, class 2: what leaves ``rayfuse fuse`` is checked like what enters it.

* A fused model with a NaN or Inf (a weighted sum that overflows, values a narrower output dtype cannot hold) is
  refused in one line naming the output file and the tensor, and nothing is written.
* Tied parameters (one tensor under two names, a module registered twice) must hold one value in every input, and
  hold one value in the output; a module applied several times fuses, and REPAIR leaves it (and tied layers) as merged
  with the reason, one line each.
* ``rayfuse.load_fused(architecture, path)`` builds the architecture at the widths a nonparametric merge wrote and
  loads the tensors, tied tensors kept as one.

The refusals run through the bad-input harness of ``tests/config/test_bad_inputs.py`` (exit 2, one line on stderr naming the
key / file / tensor, no traceback, nothing written); the cases that must succeed follow.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import rayfuse
from rayfuse.cli import main
from rayfuse.io import load_params, save_params
from rayfuse.merging import check_fused, load_fused, tied_names
from tests.config.test_bad_inputs import Files, _snapshot, call, refused_line

NETS = '''
import torch
from torch import nn


class TiedMLP(nn.Module):
    """Two hidden layers sharing one weight (their biases their own)."""

    def __init__(self, d=4, h=6, c=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.hid = nn.Linear(h, h)
        self.hid2 = nn.Linear(h, h)
        self.hid2.weight = self.hid.weight
        self.out = nn.Linear(h, c)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        x = torch.relu(self.hid(x))
        return self.out(torch.relu(self.hid2(x)))


class Twice(nn.Module):
    """One hidden layer applied twice."""

    def __init__(self, d=4, h=6, c=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.hid = nn.Linear(h, h)
        self.out = nn.Linear(h, c)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        x = torch.relu(self.hid(x))
        return self.out(torch.relu(self.hid(x)))


class Registered(nn.Module):
    """One module registered under two names (a and b), applied once under each."""

    def __init__(self, d=4, h=6, c=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.a = nn.Linear(h, h)
        self.b = self.a
        self.out = nn.Linear(h, c)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


class TwiceBN(nn.Module):
    """One BatchNorm applied after two layers."""

    def __init__(self, d=4, h=6, c=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.hid = nn.Linear(h, h)
        self.bn = nn.BatchNorm1d(h)
        self.out = nn.Linear(h, c)

    def forward(self, x):
        x = torch.relu(self.bn(self.inp(x)))
        return self.out(torch.relu(self.bn(self.hid(x))))


class TiedLM(nn.Module):
    """A tied embedding and decoder (token ids given as floats)."""

    def __init__(self, v=5, d=6):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.fc = nn.Linear(d, d)
        self.dec = nn.Linear(d, v, bias=False)
        self.dec.weight = self.emb.weight

    def forward(self, x):
        return self.dec(torch.relu(self.fc(self.emb(x.long()).mean(1))))


def twice(h=6):
    return Twice(h=h)


class TwiceImage(nn.Module):
    """Twice on 8 x 8 images (digits)."""

    def __init__(self, h=8, c=10):
        super().__init__()
        self.inp = nn.Linear(64, h)
        self.hid = nn.Linear(h, h)
        self.out = nn.Linear(h, c)

    def forward(self, x):
        x = torch.relu(self.inp(x.flatten(1)))
        x = torch.relu(self.hid(x))
        return self.out(torch.relu(self.hid(x)))


class Layers(nn.Module):
    """A one-hidden-layer MLP with kl_neurons' tensor names."""

    def __init__(self, d=4, h=6, c=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, h), nn.Linear(h, c)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))
'''

MODULE = "fuse_out_nets"


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """The architectures above as an importable module (in a folder of its own, imported once: no bytecode is written
    into a case's folder)."""
    folder = tmp_path_factory.mktemp("nets")
    (folder / f"{MODULE}.py").write_text(NETS)
    sys.path.insert(0, str(folder))
    try:
        yield __import__(MODULE)
    finally:
        sys.path.remove(str(folder))


def _state(nets: Any, cls: str, seed: int, **args: Any) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return {k: v.detach().numpy().copy() for k, v in getattr(nets, cls)(**args).state_dict().items()}


def checkpoints(
    f: Files, cls: str, change: Callable[[int, dict[str, np.ndarray]], None] | None = None, n: int = 2, **args: Any
) -> list[str]:
    """``n`` checkpoints of ``fuse_out_nets:<cls>`` (seeds 0, 1...), ``change(i, params)`` applied before writing."""
    nets = sys.modules[MODULE]
    names = []
    for i in range(n):
        params = _state(nets, cls, i, **args)
        if change is not None:
            change(i, params)
        save_params(f.root / f"{cls.lower()}{i}.safetensors", params)
        names.append(f"{cls.lower()}{i}.safetensors")
    return names


def sample(f: Files, d: int = 4, n: int = 40) -> str:
    return f.npz("sample.npz", X=np.random.default_rng(0).normal(size=(n, d)).astype(np.float32), y=np.arange(n) % 3)


def arch_fuse(f: Files, cls: str, method: str = "average", models: list[str] | None = None, **fields: Any) -> str:
    return f.fuse(models=models or checkpoints(f, cls), merge_method=method, architecture=f"{MODULE}:{cls}", **fields)


# ---------------------------------------------------------------------------------------------------------------
# The refusals


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Files], Any]
    names: str
    sub: str


CASES: list[Case] = []


def case(sub: str, id: str, names: str) -> Callable[[Callable[[Files], Any]], Callable[[Files], Any]]:
    def add(make: Callable[[Files], Any]) -> Callable[[Files], Any]:
        CASES.append(Case(id, make, names, sub))
        return make

    return add


def _linear(f: Files, weight: float, models: list[str] | None = None, **fields: Any) -> str:
    names = models or [_filled(f, f"m{i}.safetensors", "float32", weight=10.0, bias=1.0) for i in range(2)]
    return f.yaml(
        "fuse.yaml",
        {
            "merge_method": "linear",
            "models": [{"model": m, "parameters": {"weight": weight}} for m in names],
            "parameters": {"normalize": False},
            "output": "fused.safetensors",
            **fields,
        },
    )


def _filled(f: Files, name: str, dtype: str, **values: float) -> str:
    tensors = {
        "weight": torch.full((4, 3), values.get("weight", 1.0), dtype=getattr(torch, dtype)),
        "bias": torch.full((4,), values.get("bias", 1.0), dtype=getattr(torch, dtype)),
    }
    return f.params(name, tensors)


# non-finite after the merge
case("non-finite", "fuse-weighted-sum-overflows", "fused.safetensors: weight")(lambda f: ["fuse", _linear(f, 1e38)])
case("non-finite", "fuse-weighted-sum-overflows-in-the-bias-only", "fused.safetensors: bias")(
    lambda f: ["fuse", _linear(f, 1e3, [_filled(f, f"b{i}.safetensors", "float32", weight=1.0, bias=3e35) for i in range(2)])]
)
case("non-finite", "fuse-weighted-sum-overflows-float64", "fused.safetensors: weight")(
    lambda f: [
        "fuse",
        _linear(
            f, 1e300, [f.params(f"d{i}.pt", {"weight": torch.full((2, 2), 1e10, dtype=torch.float64)}, as_torch=True) for i in range(2)]
        ),
    ]
)
case("non-finite", "fuse-float16-inputs-sum-past-float16", "fused.safetensors: weight")(
    lambda f: ["fuse", _linear(f, 1.0, [_filled(f, f"h{i}.safetensors", "float16", weight=40000.0) for i in range(2)])]
)
case("non-finite", "fuse-dtype-float16-too-narrow", "fused.safetensors: weight")(
    lambda f: ["fuse", f.fuse(models=[_filled(f, f"w{i}.safetensors", "float32", weight=1e5) for i in range(2)], dtype="float16")]
)
case("non-finite", "fuse-dtype-bfloat16-rounds-to-inf", "fused.safetensors: bias")(
    lambda f: ["fuse", f.fuse(models=[_filled(f, f"w{i}.safetensors", "float32", bias=3.4e38) for i in range(2)], dtype="bfloat16")]
)
case("non-finite", "fuse-out-argument-overflow", "x.safetensors: weight")(lambda f: ["fuse", _linear(f, 1e38), "x.safetensors"])
case("non-finite", "fuse-architecture-weighted-sum-overflows", "fused.safetensors: hid.weight")(
    lambda f: [
        "fuse",
        f.yaml(
            "fuse.yaml",
            {
                "merge_method": "linear",
                "architecture": f"{MODULE}:TiedMLP",
                "parameters": {"normalize": False},
                "models": [
                    {"model": m, "parameters": {"weight": 1e38}}
                    for m in checkpoints(
                        f,
                        "TiedMLP",
                        lambda i, p: p.update(
                            {"hid.weight": np.full((6, 6), 1e3, np.float32), "hid2.weight": np.full((6, 6), 1e3, np.float32)}
                        ),
                    )
                ],
                "output": "fused.safetensors",
            },
        ),
    ]
)
case("non-finite", "api-fuse-overflow", "fused.safetensors: weight")(lambda f: call(rayfuse.fuse, _linear(f, 1e38)))
case("non-finite", "api-fuse-dtype-too-narrow", "fused.safetensors: weight")(
    lambda f: call(
        rayfuse.fuse, f.fuse(models=[_filled(f, f"w{i}.safetensors", "float32", weight=-7e4) for i in range(2)], dtype="float16")
    )
)


def _huge(i: int, params: dict[str, np.ndarray]) -> None:
    for key in params:
        params[key] = params[key].astype(np.float64) * (1e200 if key != "hid.weight" else 1e205)


case("non-finite", "fuse-weight-matching-costs-overflow", ".safetensors: hid.weight")(
    lambda f: ["fuse", arch_fuse(f, "Twice", "weight_matching", models=checkpoints(f, "Twice", _huge), input_shape=[4])]
)
case("non-finite", "api-fuse-weight-matching-costs-overflow", ".safetensors: hid.weight")(
    lambda f: call(
        rayfuse.fuse,
        arch_fuse(
            f, "Twice", "weight_matching", models=checkpoints(f, "Twice", _huge), input_shape=[4], parameters={"merge": "nonparametric"}
        ),
    )
)
case("non-finite", "check-fused-nan", "out.safetensors: w")(
    lambda f: call(check_fused, {"w": np.array([1.0, np.nan], np.float32)}, [], None, where="out.safetensors", method="average")
)


# tied tensors: every input holds one value under each name, and so does the output
def _untie(i: int, params: dict[str, np.ndarray]) -> None:
    if i == 1:
        params["hid2.weight"] = params["hid2.weight"] + 1.0


case("tied", "fuse-tied-inputs-differ", "tiedmlp1.safetensors: hid2.weight")(
    lambda f: ["fuse", arch_fuse(f, "TiedMLP", models=checkpoints(f, "TiedMLP", _untie))]
)
case("tied", "fuse-tied-inputs-differ-weight-matching", "tiedmlp1.safetensors: hid2.weight")(
    lambda f: ["fuse", arch_fuse(f, "TiedMLP", "weight_matching", models=checkpoints(f, "TiedMLP", _untie), input_shape=[4])]
)
case("tied", "fuse-tied-inputs-differ-nonparametric", "tiedmlp1.safetensors: hid2.weight")(
    lambda f: [
        "fuse",
        arch_fuse(
            f,
            "TiedMLP",
            "activation_matching",
            models=checkpoints(f, "TiedMLP", _untie),
            data={"path": sample(f)},
            parameters={"merge": "nonparametric"},
        ),
    ]
)
case("tied", "fuse-registered-twice-differ", "registered0.safetensors: b.weight")(
    lambda f: [
        "fuse",
        arch_fuse(f, "Registered", models=checkpoints(f, "Registered", lambda i, p: p.update({"b.weight": p["b.weight"] * 2}))),
    ]
)
case("tied", "fuse-tied-embedding-differs", "tiedlm0.safetensors: dec.weight")(
    lambda f: ["fuse", arch_fuse(f, "TiedLM", models=checkpoints(f, "TiedLM", lambda i, p: p.update({"dec.weight": -p["dec.weight"]})))]
)
case("tied", "fuse-tied-pt-differ", "tiedmlp0.pt: hid2.weight")(
    lambda f: [
        "fuse",
        arch_fuse(
            f,
            "TiedMLP",
            models=[
                f.params(
                    f"tiedmlp{i}.pt",
                    {
                        k: torch.as_tensor(v + (1.0 if k == "hid2.weight" else 0.0))
                        for k, v in _state(sys.modules[MODULE], "TiedMLP", i).items()
                    },
                    as_torch=True,
                )
                for i in range(2)
            ],
        ),
    ]
)
case("tied", "api-fuse-tied-differ", "tiedmlp1.safetensors: hid2.weight")(
    lambda f: call(rayfuse.fuse, arch_fuse(f, "TiedMLP", models=checkpoints(f, "TiedMLP", _untie)))
)
case("tied", "check-fused-tie-broken", "out.safetensors: b")(
    lambda f: call(
        check_fused,
        {"a": np.ones(3, np.float32), "b": np.zeros(3, np.float32)},
        [("a", "b")],
        None,
        where="out.safetensors",
        method="weight_matching",
    )
)

# load_fused
case("load", "load-fused-no-such-file", "missing.safetensors")(lambda f: call(load_fused, f"{MODULE}:Twice", "missing.safetensors"))
case("load", "load-fused-not-an-architecture", "architecture")(lambda f: call(load_fused, 42, f.models()[0]))
case("load", "load-fused-factory-returns-no-module", "architecture")(lambda f: call(load_fused, lambda: "model", f.models()[0]))
case("load", "load-fused-bad-args", "args")(lambda f: call(load_fused, f"{MODULE}:Twice", checkpoints(f, "Twice")[0], args={"width": 3}))
case("load", "load-fused-args-with-an-instance", "args")(
    lambda f: call(load_fused, sys.modules[MODULE].Twice(), checkpoints(f, "Twice")[0], args={"h": 3})
)
case("load", "load-fused-other-architecture", "m0.safetensors: inp.weight")(lambda f: call(load_fused, f"{MODULE}:Twice", f.models()[0]))
case("load", "load-fused-wider-without-record", "twice0.safetensors: inp.weight")(
    lambda f: call(load_fused, f"{MODULE}:Twice", checkpoints(f, "Twice", h=8)[0])
)
case("load", "load-fused-tied-differ", "tiedmlp1.safetensors: hid2.weight")(
    lambda f: call(load_fused, f"{MODULE}:TiedMLP", checkpoints(f, "TiedMLP", _untie)[1])
)


def _widened(f: Files, **metadata: str) -> str:
    """A fused Twice widened to 12 units (every unit new), its metadata entries replaced by ``metadata``."""
    _fuse(f, arch_fuse(f, "Twice", "weight_matching", input_shape=[4], parameters={"merge": "nonparametric", "new_unit_threshold": 1.0}))
    from safetensors import safe_open

    with safe_open(str(f.root / "fused.safetensors"), framework="pt") as handle:
        meta = {**handle.metadata(), **metadata}
    params = load_params(f.root / "fused.safetensors")
    (f.root / "fused.safetensors").unlink()
    save_params(f.root / "wide.safetensors", params, meta)
    return "wide.safetensors"


case("load", "load-fused-damaged-spec-record", "wide.safetensors: metadata rayfuse.spec")(
    lambda f: call(load_fused, f"{MODULE}:Twice", _widened(f, **{"rayfuse.spec": "{not json"}))
)
case("load", "load-fused-damaged-shape-record", "wide.safetensors: metadata rayfuse.input_shape")(
    lambda f: call(load_fused, f"{MODULE}:Twice", _widened(f, **{"rayfuse.input_shape": '[4, "x"]'}))
)
case("load", "load-fused-other-base-width", "wide.safetensors")(lambda f: call(load_fused, f"{MODULE}:Twice", _widened(f), args={"h": 5}))
case("load", "api-load-fused-class-bad-args", "args")(
    lambda f: call(rayfuse.load_fused, sys.modules[MODULE].Twice, checkpoints(f, "Twice")[0], args={"depth": 2})
)


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_what_leaves_fuse_is_refused_in_one_line_and_nothing_is_written(bad: Case, nets, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    command = bad.make(Files(tmp_path))
    capsys.readouterr()
    before = _snapshot(tmp_path)
    line = refused_line(command, capsys)
    assert bad.names in line, line
    assert _snapshot(tmp_path) == before


def test_the_table_covers_each_sub_class() -> None:
    counts = {sub: sum(1 for c in CASES if c.sub == sub) for sub in ("non-finite", "tied", "load")}
    assert all(n >= 8 for n in counts.values()), counts
    assert len({c.id for c in CASES}) == len(CASES)


# ---------------------------------------------------------------------------------------------------------------
# What must succeed


def _fuse(f: Files, config: str, lines: list[str] | None = None) -> dict[str, Any]:
    from rayfuse.api import fuse_checkpoints

    return fuse_checkpoints(f.root / config, progress=None if lines is None else lines.append)


def _outputs(model: nn.Module, X: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(X)).numpy()


def _ensemble(nets: Any, cls: str, X: np.ndarray, **args: Any) -> np.ndarray:
    outs = []
    for i in range(2):
        torch.manual_seed(i)
        outs.append(_outputs(getattr(nets, cls)(**args).eval(), X))
    return np.mean(outs, axis=0)


@pytest.mark.parametrize(
    ("method", "fields"),
    [
        ("average", {}),
        ("weight_matching", {"input_shape": [4]}),
        ("activation_matching", {"data": "sample", "parameters": {"repair": True}}),
    ],
)
def test_tied_models_stay_tied(nets, tmp_path, monkeypatch, method, fields) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    fields = {**fields, **({"data": {"path": sample(f)}} if fields.get("data") else {})}
    lines: list[str] = []
    _fuse(f, arch_fuse(f, "TiedMLP", method, **fields), lines)
    fused = load_params(tmp_path / "fused.safetensors")
    np.testing.assert_array_equal(fused["hid.weight"], fused["hid2.weight"])
    model = load_fused(f"{MODULE}:TiedMLP", tmp_path / "fused.safetensors")
    assert model.hid.weight is model.hid2.weight
    if method == "activation_matching":  # REPAIR leaves the tied layers as merged, and says why
        assert any(line.startswith("repair: hid left as merged: its tensors are tied to hid2.weight") for line in lines), lines


def test_a_tied_embedding_and_decoder_stay_tied_and_keep_their_width(nets, tmp_path, monkeypatch) -> None:
    from rayfuse.alignment import width_roles
    from rayfuse.symmetry import derive_spec

    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    model = nets.TiedLM().eval()
    roles = width_roles(model, derive_spec(model, torch.zeros(2, 3)))
    assert any("emb.weight and dec.weight are one tensor (tied)" in why for why in roles.fixed.values()), roles.fixed
    summary = _fuse(
        f, arch_fuse(f, "TiedLM", "weight_matching", input_shape=[3], parameters={"merge": "nonparametric", "new_unit_threshold": 1.0})
    )
    fused = load_params(tmp_path / "fused.safetensors")
    np.testing.assert_array_equal(fused["emb.weight"], fused["dec.weight"])
    assert "emb.weight" not in summary["resized"]  # the tied group kept its width; fc's own units may grow
    loaded = load_fused(f"{MODULE}:TiedLM", tmp_path / "fused.safetensors")
    assert loaded.emb.weight is loaded.dec.weight


def test_a_file_saved_without_the_duplicate_name_fuses_and_writes_both(nets, tmp_path, monkeypatch) -> None:
    from safetensors.torch import save_model

    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    names = []
    for i in range(2):
        torch.manual_seed(i)
        save_model(nets.TiedMLP(), str(tmp_path / f"sm{i}.safetensors"))  # keeps one name of the shared weight
        names.append(f"sm{i}.safetensors")
    assert len(load_params(tmp_path / names[0])) == 7
    _fuse(f, arch_fuse(f, "TiedMLP", models=names))
    fused = load_params(tmp_path / "fused.safetensors")
    assert len(fused) == 8
    np.testing.assert_array_equal(fused["hid.weight"], fused["hid2.weight"])


def test_a_file_with_one_name_of_a_tied_tensor_fuses_with_one_that_has_both(nets, tmp_path, monkeypatch) -> None:
    from safetensors.torch import save_model

    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    torch.manual_seed(0)
    save_model(nets.TiedMLP(), str(tmp_path / "one.safetensors"))
    both = checkpoints(f, "TiedMLP")[1]
    _fuse(f, arch_fuse(f, "TiedMLP", "weight_matching", models=["one.safetensors", both], input_shape=[4]))
    fused = load_params(tmp_path / "fused.safetensors")
    np.testing.assert_array_equal(fused["hid.weight"], fused["hid2.weight"])


def test_tied_pt_files_with_shared_storage_fuse(nets, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    names = []
    for i in range(2):
        torch.manual_seed(i)
        torch.save(nets.TiedMLP().state_dict(), tmp_path / f"t{i}.pt")  # both names point at one storage
        names.append(f"t{i}.pt")
    _fuse(f, arch_fuse(f, "TiedMLP", models=names))
    fused = load_params(tmp_path / "fused.safetensors")
    np.testing.assert_array_equal(fused["hid.weight"], fused["hid2.weight"])


def test_a_module_applied_twice_fuses_with_repair_and_is_left_as_merged_with_the_reason(nets, tmp_path, monkeypatch) -> None:
    from rayfuse.alignment import repair_units
    from rayfuse.symmetry import derive_spec

    model = nets.Twice().eval()
    skipped: dict[str, str] = {}
    units = repair_units(model, derive_spec(model, torch.zeros(2, 4)), skipped=skipped)
    assert [u.module for u in units] == ["inp"]
    assert skipped == {"hid": "applied 2 times in forward (one rescaling cannot match each application's statistics)"}
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    lines: list[str] = []
    _fuse(f, arch_fuse(f, "Twice", "activation_matching", data={"path": sample(f)}, parameters={"repair": True}), lines)
    assert lines == ["repair: hid left as merged: applied 2 times in forward (one rescaling cannot match each application's statistics)"]
    X = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    assert np.isfinite(_outputs(load_fused(f"{MODULE}:Twice", tmp_path / "fused.safetensors"), X)).all()


def test_a_widened_module_applied_twice_fuses_with_repair_and_loads(nets, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    lines: list[str] = []
    summary = _fuse(
        f,
        arch_fuse(
            f,
            "Twice",
            "activation_matching",
            data={"path": sample(f)},
            parameters={"merge": "nonparametric", "new_unit_threshold": 1.0, "repair": True},
        ),
        lines,
    )
    assert summary["resized"]["hid.weight"] == ((6, 6), (12, 12))
    assert any(line.startswith("repair: hid left as merged: applied 2 times") for line in lines), lines
    model = load_fused(f"{MODULE}:Twice", tmp_path / "fused.safetensors")
    assert model.hid.weight.shape == (12, 12)
    X = np.random.default_rng(6).normal(size=(8, 4)).astype(np.float32)
    assert np.isfinite(_outputs(model, X)).all()


def test_the_federated_aligned_method_says_which_layers_repair_leaves_as_merged(nets, tmp_path, capsys) -> None:
    config = {
        "run": {"name": "twice", "seed": 0},
        "data": {"dataset": "digits"},
        "partition": {"method": "iid", "num_clients": 2},
        "train": {"epochs": 1},
        "methods": {"aligned": {"repair": True}},
    }
    result = rayfuse.run(config, model=lambda: nets.TwiceImage(), backend="local", run_dir=tmp_path / "run")
    out = capsys.readouterr().out
    assert "repair: hid left as merged: applied 2 times in forward" in out, out
    assert np.isfinite(result.models["aligned"]["hid.weight"]).all()


def test_identical_models_applied_twice_fuse_to_themselves_with_repair(nets, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    same = checkpoints(f, "Twice", lambda i, p: p.update(_state(nets, "Twice", 0)))
    _fuse(f, arch_fuse(f, "Twice", "activation_matching", models=same, data={"path": sample(f)}, parameters={"repair": True}))
    fused = load_params(tmp_path / "fused.safetensors")
    for key, value in _state(nets, "Twice", 0).items():
        np.testing.assert_allclose(fused[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_module_registered_twice_stays_one_module(nets, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    _fuse(f, arch_fuse(f, "Registered", "weight_matching", input_shape=[4]))
    fused = load_params(tmp_path / "fused.safetensors")
    np.testing.assert_array_equal(fused["a.weight"], fused["b.weight"])
    model = load_fused(f"{MODULE}:Registered", tmp_path / "fused.safetensors")
    assert model.a is model.b


def test_a_batchnorm_applied_twice_pools_both_applications(nets, tmp_path, monkeypatch) -> None:
    from rayfuse.alignment import batchnorm_statistics

    model = nets.TwiceBN().eval()
    X = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    stats = batchnorm_statistics(model, X)
    with torch.no_grad():
        first = model.inp(torch.as_tensor(X))
        a = (first - first.mean(0)) / torch.sqrt(first.var(0, unbiased=False) + model.bn.eps) * model.bn.weight + model.bn.bias
        second = model.hid(torch.relu(a))
    pooled = torch.cat([first, second]).double()
    count, mean, var = stats["bn"]
    assert count == 80
    np.testing.assert_allclose(mean, pooled.mean(0).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, pooled.var(0, unbiased=False).numpy(), rtol=1e-4, atol=1e-6)
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    _fuse(f, arch_fuse(f, "TwiceBN", "activation_matching", data={"path": sample(f)}, parameters={"repair": True}))
    assert np.isfinite(load_params(tmp_path / "fused.safetensors")["bn.running_var"]).all()


@pytest.mark.parametrize(
    ("cls", "method"), [("Twice", "weight_matching"), ("TiedMLP", "activation_matching"), ("Twice", "activation_matching")]
)
def test_load_fused_round_trips_a_widened_model_whose_outputs_are_the_fused_models(nets, tmp_path, monkeypatch, cls, method) -> None:
    # every unit new (each unit matches with a quality below 1), up to twice the width: the fused model is the two
    # models side by side, whose logits are the average of theirs
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    extra = {"input_shape": [4]} if method == "weight_matching" else {"data": {"path": sample(f)}}
    summary = _fuse(
        f, arch_fuse(f, cls, method, parameters={"merge": "nonparametric", "new_unit_threshold": 1.0, "max_width": 2.0}, **extra)
    )
    assert summary["resized"]["inp.weight"] == ((6, 4), (12, 4))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fused.safetensors"), framework="pt") as handle:
        meta = handle.metadata()
    assert set(json.loads(meta["rayfuse.widths"]).values()) == {12}
    model = rayfuse.load_fused(f"{MODULE}:{cls}", tmp_path / "fused.safetensors")
    assert model.inp.out_features == 12 and model.out.in_features == 12 and not model.training
    X = np.random.default_rng(2).normal(size=(16, 4)).astype(np.float32)
    np.testing.assert_allclose(_outputs(model, X), _ensemble(nets, cls, X), rtol=1e-4, atol=1e-5)
    from rayfuse.merging.fusers import _with
    from rayfuse.symmetry import PermutationSpec

    arch = getattr(nets, cls)().eval()
    spec = PermutationSpec.from_dict(json.loads(meta["rayfuse.spec"]))
    same = _with(arch, load_params(tmp_path / "fused.safetensors"), spec, np.zeros((2, 4), np.float32))
    np.testing.assert_allclose(_outputs(model, X), _outputs(same, X), rtol=1e-6, atol=1e-6)
    if cls == "TiedMLP":
        assert model.hid.weight is model.hid2.weight and model.hid.weight.shape == (12, 12)


def test_the_cli_says_how_to_load_a_widened_model(nets, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    config = arch_fuse(f, "Twice", "weight_matching", input_shape=[4], parameters={"merge": "nonparametric", "new_unit_threshold": 1.0})
    assert main(["fuse", config]) == 0
    out = capsys.readouterr().out
    assert "load it in one call with rayfuse.load_fused(architecture, 'fused.safetensors')" in out, out
    assert load_fused(f"{MODULE}:Twice", "fused.safetensors").hid.weight.shape == (12, 12)


def test_load_fused_takes_a_class_a_factory_or_a_model_and_the_recorded_arguments(nets, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    models = checkpoints(f, "Twice", h=5)
    _fuse(
        f,
        arch_fuse(
            f,
            "Twice",
            "weight_matching",
            models=models,
            input_shape=[4],
            architecture_args={"h": 5},
            parameters={"merge": "nonparametric", "new_unit_threshold": 1.0},
        ),
    )
    path = tmp_path / "fused.safetensors"
    X = np.random.default_rng(3).normal(size=(8, 4)).astype(np.float32)
    expected = _ensemble(nets, "Twice", X, h=5)
    for architecture, args in ((f"{MODULE}:Twice", None), (nets.Twice, {"h": 5}), (nets.twice, {"h": 5}), (nets.Twice(h=5), None)):
        model = load_fused(architecture, path, args=args)
        assert model.hid.in_features == 10
        np.testing.assert_allclose(_outputs(model, X), expected, rtol=1e-4, atol=1e-5)


def test_load_fused_derives_the_groups_of_a_wider_file_without_a_record(nets, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    wide = checkpoints(f, "Twice", h=9)[0]
    model = load_fused(f"{MODULE}:Twice", wide, input_shape=[4])
    torch.manual_seed(0)
    reference = nets.Twice(h=9).eval()
    X = np.random.default_rng(4).normal(size=(8, 4)).astype(np.float32)
    np.testing.assert_allclose(_outputs(model, X), _outputs(reference, X), rtol=1e-6)


def test_load_fused_loads_a_width_kl_neurons_inferred_given_the_input_shape(nets, tmp_path, monkeypatch) -> None:
    # kl_neurons reads no architecture, so its output records no spec: load_fused derives the groups on input_shape
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    summary = _fuse(f, f.fuse(models=checkpoints(f, "Layers", n=3), merge_method="kl_neurons", parameters={"lam": 0.0}))
    fused = load_params(tmp_path / "fused.safetensors")
    width = fused["layers.0.weight"].shape[0]
    assert width > 6 and summary["resized"]["layers.0.weight"] == ((6, 4), (width, 4))
    model = load_fused(f"{MODULE}:Layers", tmp_path / "fused.safetensors", input_shape=[4])
    assert model.layers[0].out_features == width and model.layers[1].in_features == width
    X = torch.as_tensor(np.random.default_rng(5).normal(size=(8, 4)).astype(np.float32))
    with torch.no_grad():
        hidden = torch.relu(X @ torch.as_tensor(fused["layers.0.weight"]).T + torch.as_tensor(fused["layers.0.bias"]))
        expected = hidden @ torch.as_tensor(fused["layers.1.weight"]).T + torch.as_tensor(fused["layers.1.bias"])
    np.testing.assert_allclose(_outputs(model, X.numpy()), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_load_fused_of_an_average_is_the_architecture_with_the_tensors(nets, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    _fuse(f, arch_fuse(f, "TiedLM"))
    fused = load_params(tmp_path / "fused.safetensors")
    model = load_fused(f"{MODULE}:TiedLM", tmp_path / "fused.safetensors")
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), fused[key])
    assert tied_names(model) == [("emb.weight", "dec.weight")]


@pytest.mark.parametrize(("dtype", "value"), [("float16", 6e4), ("bfloat16", 3e38), ("float64", 1e300)])
def test_values_the_output_dtype_holds_are_written(tmp_path, monkeypatch, dtype, value) -> None:
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    source = "float64" if dtype == "float64" else "float32"
    models = [f.params(f"v{i}.pt", {"weight": torch.full((2, 2), value, dtype=getattr(torch, source))}, as_torch=True) for i in range(2)]
    assert main(["fuse", f.fuse(models=models, dtype=dtype)]) == 0
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "fused.safetensors"))["weight"]
    assert str(written.dtype) == f"torch.{dtype}" and bool(written.isfinite().all())
