"""derive_spec: random permutations drawn from a derived spec leave every model's outputs unchanged; the group counts
of the small models, hand-counted; fixed inputs, outputs and unknown ops with their reasons; untraceable models; the
``rayfuse symmetry`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from rayfuse.cli import main
from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.models import build_model, train_model
from rayfuse.symmetry import PermutationSpec, derive_spec, trace_model

DIGITS = (1, 8, 8)


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter and BatchNorm statistic random (zero-initialised heads, unit running variances and zero cls
    tokens would hide a wrong permutation), in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model.eval()


def assert_invariant(model: nn.Module, x: torch.Tensor, spec: PermutationSpec, *, seed: int = 0, atol: float = 1e-5) -> None:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(x)
        rng = np.random.default_rng(seed)
        perms = spec.random(rng)
        while all(np.array_equal(p, np.arange(len(p))) for p in perms.values()):  # small groups: draw until one moves
            perms = spec.random(rng)
        permuted = spec.apply_torch(state, perms)
        assert any(not torch.equal(permuted[k], state[k]) for k in spec.keys())
        model.load_state_dict(permuted)
        after = model(x)
    model.load_state_dict(state)
    # float32 sums taken in another order differ by a fraction of the largest output, not of each output: random
    # weights through resnet18's 18 layers give outputs near 3e5, and one of them moved by 49 (1.8e-4 of it) on one CI
    # CPU. A wrong permutation moves the outputs by their own size, so 1e-3 of the largest still catches it.
    scale = float(before.abs().max())
    torch.testing.assert_close(after, before, atol=max(atol, 1e-3 * scale), rtol=1e-4)


def registry(name: str, shape: tuple[int, ...] = DIGITS, **fields) -> nn.Module:
    return randomize(build_model(ModelConfig(name=name, **fields), shape, 10, seed=0))


def tiny_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=10
    )


# name, model factory, input shape, groups (hand-counted; None: not counted)
CASES = [
    # one group per hidden layer
    ("mlp", lambda: registry("mlp", hidden=[8, 6]), DIGITS, 2),
    # one per conv
    ("cnn", lambda: registry("cnn", channels=[4, 6]), DIGITS, 2),
    # stem + block 0's identity stream, block 0's conv1, block 1's conv1, block 1's stream (conv2 + 1x1 shortcut)
    ("rescnn", lambda: registry("rescnn", channels=[4, 6]), DIGITS, 4),
    ("rescnn-3", lambda: registry("rescnn", channels=[4, 4, 6]), DIGITS, 5),
    # two convs, one hidden Linear (reading 6 channel blocks of 2x2)
    ("vgg", lambda: registry("vgg", channels=[4, 6], hidden=[8]), DIGITS, 3),
    # the residual stream, then per layer: heads, Q/K head dims, V/out head dims, feed-forward
    ("transformer", lambda: registry("transformer", hidden=[8, 12], heads=2, depth=2), DIGITS, 1 + 2 * 4),
    ("transformer-flat", lambda: registry("transformer", shape=(10,), hidden=[8], heads=2, depth=1), (10,), 1 + 4),
    # stem/layer1 stream, layer2-4 streams, two conv1 per stage
    ("resnet18", lambda: randomize(torchvision.models.resnet18(num_classes=10)), (3, 16, 16), 4 + 8),
    ("mobilenet_v3_small", lambda: randomize(torchvision.models.mobilenet_v3_small(num_classes=10)), (3, 32, 32), None),
    # conv_proj stream, per layer: heads, Q/K dims, V/out dims, MLP hidden
    ("vit", lambda: randomize(tiny_vit()), (3, 16, 16), 1 + 2 * 4),
]


@pytest.mark.parametrize("factory, shape, groups", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_random_permutations_from_the_derived_spec_leave_the_outputs_unchanged(factory, shape, groups):
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(3, *shape)
    spec = derive_spec(model, x)
    if groups is not None:
        assert len(spec.groups) == groups, spec.describe()
    assert_invariant(model, x, spec)
    assert_invariant(model, x, spec, seed=1)
    # the output axes are fixed, never permuted
    head = [k for k in model.state_dict() if k.endswith(".weight")][-1]
    assert (head, 0) in {(f.key, f.dim) for f in spec.fixed}
    assert all(not (a.key == head and a.dim == 0) for g in spec.groups for a in g.axes)
    # probes name nodes of the traced graph, or (hooks) submodules the graph keeps whole, on axes that exist
    graph = {n.name for n in trace_model(model).graph.nodes}
    modules = dict(model.named_modules())
    for g in spec.groups:
        for p in g.probes:
            assert p.node in (modules if p.hook else graph), (g.name, p.node, p.hook)
    # a spec survives JSON
    assert PermutationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_the_model_input_is_fixed_and_probes_read_the_post_activation_units():
    model = registry("mlp", shape=(5,), hidden=[8, 6])
    spec = derive_spec(model, torch.randn(4, 5))
    assert {(f.key, f.dim): f.reason for f in spec.fixed}[("layers.0.weight", 1)] == "model input (x)"
    assert [g.name for g in spec.groups] == ["layers.0", "layers.1"]
    first = spec.group("layers.0")
    assert {(a.key, a.dim) for a in first.axes} == {("layers.0.weight", 0), ("layers.0.bias", 0), ("layers.1.weight", 1)}
    assert [p.node for p in first.probes] == ["activation"]
    # activation matching runs the traced graph and reads the probe's node
    gm = trace_model(model)
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            seen[n.name] = out = super().run_node(n)
            return out

    x = torch.randn(4, 5)
    torch.testing.assert_close(Recorder(gm).run(x), model(x))
    assert seen["activation"].shape == (4, 8)


def test_vgg_flatten_reads_channel_blocks_and_attention_packs_qkv():
    vgg = derive_spec(registry("vgg", channels=[4, 6], hidden=[8]), torch.randn(2, *DIGITS))
    assert AxisRefLike("classifier.0.weight", 1, inner=4) in axes_of(vgg.group("stages.1.conv"))
    spec = derive_spec(registry("transformer", hidden=[8, 12], heads=2, depth=1), torch.randn(2, *DIGITS))
    heads = axes_of(spec.group("layers.0.self_attn.heads"))
    qk = axes_of(spec.group("layers.0.self_attn.qk_dims"))
    vo = axes_of(spec.group("layers.0.self_attn.vo_dims"))
    w = "layers.0.self_attn.in_proj_weight"
    assert {AxisRefLike(w, 0, 0, 1, 4), AxisRefLike(w, 0, 8, 1, 4), AxisRefLike(w, 0, 16, 1, 4)} <= heads
    assert {AxisRefLike(w, 0, 0, 2, 1), AxisRefLike(w, 0, 8, 2, 1)} <= qk and AxisRefLike(w, 0, 16, 2, 1) not in qk
    assert {AxisRefLike(w, 0, 16, 2, 1), AxisRefLike("layers.0.self_attn.out_proj.weight", 1, 0, 2, 1)} <= vo
    stream = axes_of(spec.group("embed"))
    assert {AxisRefLike("cls_token", 2), AxisRefLike("pos_embedding", 2), AxisRefLike(w, 1), AxisRefLike("norm.weight", 0)} <= stream


def AxisRefLike(key, dim, start=0, outer=1, inner=1):  # noqa: N802 - reads like the dataclass it compares with
    return (key, dim, start, outer, inner)


def axes_of(group):
    return {(a.key, a.dim, a.start, a.outer, a.inner) for a in group.axes}


class Blocks(nn.Module):
    """A squeeze-excitation product, concatenation on the unit axis, a depthwise conv with two filters per channel,
    GroupNorm, a grouped conv, reductions (and a cumsum, an op the tracer does not know)."""

    def __init__(self, *, unknown: bool = False) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 3, 3, padding=1)
        self.se = nn.Conv2d(3, 2, 1)
        self.se2 = nn.Conv2d(2, 3, 1)
        self.b = nn.Conv2d(4, 4, 1)
        self.dw = nn.Conv2d(7, 14, 3, padding=1, groups=7)
        self.gn = nn.GroupNorm(1, 14)
        self.grouped = nn.Conv2d(4, 6, 1, groups=2)
        self.head = nn.Linear(20, 3)
        self.unknown = unknown

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = h * torch.sigmoid(self.se2(torch.relu(self.se(h.mean((2, 3), keepdim=True)))))
        h = torch.cat([h, torch.relu(self.b(x))], dim=1)
        h = self.gn(self.dw(h))
        if self.unknown:
            h = torch.cumsum(h, dim=1)
        return self.head(torch.cat([h.amax(dim=(2, 3)), self.grouped(x).mean((2, 3))], dim=1))


def test_concatenation_depthwise_squeeze_excitation_and_grouped_convs():
    model = randomize(Blocks())
    x = torch.randn(3, 4, 6, 6)
    spec = derive_spec(model, x)
    assert sorted(spec.names) == ["a", "b", "se"]
    assert axes_of(spec.group("a")) >= {AxisRefLike("se.weight", 1), AxisRefLike("se2.weight", 0), AxisRefLike("dw.weight", 0, 0, 1, 2)}
    assert axes_of(spec.group("b")) >= {
        AxisRefLike("dw.weight", 0, 6, 1, 2),
        AxisRefLike("gn.weight", 0, 6, 1, 2),
        AxisRefLike("head.weight", 1, 6, 1, 2),
    }
    fixed = {(f.key, f.dim): f.reason for f in spec.fixed}
    assert fixed[("grouped.weight", 0)] == "grouped: grouped convolution grouped (2 groups of 2 channels)"
    assert fixed[("a.weight", 1)] == "model input (x)"
    assert_invariant(model, x, spec)


def test_an_unknown_op_leaves_its_units_fixed_and_says_why():
    model = randomize(Blocks(unknown=True))
    x = torch.randn(2, 4, 6, 6)
    spec = derive_spec(model, x)
    fixed = {(f.key, f.dim): f.reason for f in spec.fixed}
    assert fixed[("b.weight", 0)] == "cumsum: torch.cumsum is not known to commute with a permutation of these units"
    assert fixed[("a.weight", 0)] == fixed[("b.weight", 0)]
    # a segment of an axis: the reason says which units
    assert {f.reason for f in spec.fixed if f.key == "dw.weight"} == {
        f"{fixed[('a.weight', 0)]} (units from 0: 1 x 3 x 2)",
        f"{fixed[('a.weight', 0)]} (units from 6: 1 x 4 x 2)",
    }
    assert spec.names == ["se"]
    assert_invariant(model, x, spec)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return self.gate(x)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def test_a_model_fx_cannot_trace_gives_one_line():
    # torch.export is tried next (its error follows, naming the data-dependent branch)
    with pytest.raises(
        InputError,
        match=r"^architecture: expected a model torch.fx can trace or torch.export can export, got 'gate "
        r"\(Gate\), forward line \d+'; torch.fx: TraceError: symbolically traced variables cannot be "
        r"used as inputs to control flow; torch.export: \w+: [^\n]+$",
    ):
        derive_spec(Branchy(), torch.randn(2, 4))
    with pytest.raises(InputError, match=r"^input: expected an example batch the model accepts, got 'shape \(2, 5\)'; RuntimeError"):
        derive_spec(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), torch.randn(2, 5))


class Tied(nn.Module):
    """A module called twice and a parameter used directly: both calls share one permutation."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.attn = nn.MultiheadAttention(6, 3, kdim=5, vdim=4)
        self.k = nn.Linear(6, 5)
        self.v = nn.Linear(6, 4)
        self.shared = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.ones(6))
        self.head = nn.Linear(6, 2)

    def forward(self, tokens):
        h = self.embed(tokens).transpose(0, 1)  # (L, N, E): batch second
        h = self.shared(torch.relu(self.shared(h))) * self.scale
        out, _ = self.attn(h, self.k(h), self.v(h))
        return self.head((out + h).mean(0))


def test_embedding_shared_modules_and_attention_with_other_key_and_value_widths():
    model = randomize(Tied())
    tokens = torch.randint(0, 7, (3, 5))
    spec = derive_spec(model, tokens)
    assert sorted(spec.names) == ["attn.heads", "attn.qk_dims", "attn.vo_dims", "embed", "k", "v"]
    assert AxisRefLike("scale", 0) in axes_of(spec.group("embed"))
    assert AxisRefLike("shared.weight", 0) in axes_of(spec.group("embed"))
    assert_invariant(model, tokens, spec)


def test_the_registry_models_train_on_digits():
    from rayfuse.data.datasets import load_dataset

    data = load_dataset("digits")
    X, y = data.X[:64], data.y[:64]
    for name, fields in (
        ("rescnn", {"channels": [4, 6]}),
        ("vgg", {"channels": [4, 6], "hidden": [8]}),
        ("transformer", {"hidden": [8, 12], "depth": 1}),
    ):
        model = build_model(ModelConfig(name=name, **fields), DIGITS, 10, seed=0)
        stats = train_model(model, X, y, epochs=2, batch_size=32, lr=1e-2)
        assert np.isfinite(stats.loss), name
    with pytest.raises(InputError, match=r"^model\.heads: expected a divisor of the model width 8"):
        build_model(ModelConfig(name="transformer", hidden=[8], heads=3), DIGITS, 10)


def test_the_symmetry_command(capsys, tmp_path, monkeypatch):
    assert main(["symmetry", "rescnn"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 permutation groups") and "blocks.1.conv1  (channels, 32)" in out
    assert main(["symmetry", "torchvision:resnet18", "--input-shape", "3,16,16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["groups"]) == 12 and data["groups"][0]["name"] == "conv1"
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mynet.py").write_text(
        "from torch import nn\n\nclass Net(nn.Sequential):\n"
        "    def __init__(self, width=3):\n"
        "        super().__init__(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))\n"
    )
    assert main(["symmetry", "mynet:Net", "--args", '{"width": 5}']) == 0
    assert capsys.readouterr().out.startswith("1 permutation groups, 5 units")
    for argv, message in (
        (["symmetry", "rescn"], "architecture: expected a registry model"),
        (["symmetry", "nosuchmodule:Net"], "architecture: expected an importable module 'nosuchmodule'"),
        (["symmetry", "mynet:Net", "--args", "{"], "--args: expected a JSON object"),
        (["symmetry", "mlp", "--input-shape", "1,x"], "--input-shape: expected comma-separated"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"rayfuse: error: {message}") and err.count("\n") == 1, err


def test_feed_forward_units_inside_an_encoder_layer_are_observed_through_a_hook():
    from rayfuse.alignment import collect_correlations
    from rayfuse.symmetry import Probe

    model = registry("transformer", hidden=[8, 12], heads=2, depth=2).eval()
    x = torch.randn(6, *DIGITS)
    spec = derive_spec(model, x)
    # the graph keeps each nn.TransformerEncoderLayer whole: its feed-forward units are read at linear2's input (after
    # the activation), its output joins the residual stream's probes
    for i in range(2):
        assert [(p.node, p.hook) for p in spec.group(f"layers.{i}.linear1").probes] == [(f"layers.{i}.linear2", "input")]
        assert not spec.group(f"layers.{i}.self_attn.heads").probes
    enabled = torch.backends.mha.get_fastpath_enabled()
    X = np.random.default_rng(0).normal(size=(20, *DIGITS)).astype(np.float32)
    stats = collect_correlations(model, model, spec, trace_model(model), trace_model(model), X, batch_size=8)
    assert torch.backends.mha.get_fastpath_enabled() == enabled  # PyTorch's fused path is off only while collecting
    ff = stats["layers.0.linear1"]
    assert ff.size == 12 and ff.count == 20 * model.pos_embedding.shape[1]  # samples x tokens (cls + patches)
    corr = ff.correlation()
    varying = ff.sumsq_a / ff.count - (ff.sum_a / ff.count) ** 2 > 1e-9
    assert varying.any()
    np.testing.assert_allclose(np.diag(corr)[varying], 1.0, atol=1e-9)  # a model against itself
    # the hidden units after the ReLU: never negative
    assert (ff.sum_a >= 0).all()
    with pytest.raises(InputError, match=r"^probe layers\.0\.linear2\.hook: expected '', 'input' or 'output', got 'inside'"):
        Probe("layers.0.linear2", -1, hook="inside")
    bad = PermutationSpec.from_dict(
        {
            "groups": [
                {
                    "name": "ff",
                    "size": 12,
                    "axes": [{"key": "layers.0.linear1.weight", "dim": 0}],
                    "probes": [{"node": "layers.0.linear9", "dim": -1, "hook": "input"}],
                }
            ]
        }
    )
    with pytest.raises(InputError, match=r"^spec\.ff\.probes: expected a submodule of both models, got 'layers\.0\.linear9'"):
        collect_correlations(model, model, bad, trace_model(model), trace_model(model), X)
