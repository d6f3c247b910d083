"""read_structure: the layer chain, output layer, features and feature-map nodes and hidden groups of the registry and
torchvision models, read from their graphs; build_node_graph reproduces the models' own representations;
resize_model loads parameters of other widths and computes what a model built at those widths computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.models import build_model, get_params
from rayfuse.symmetry.structure import build_node_graph, read_structure, resize_model

DIGITS = (1, 8, 8)
X = torch.randn(3, *DIGITS, generator=torch.Generator().manual_seed(0))

# name, config fields, output layer, features node, feature map node, hidden layers' modules (first ones), hidden group sizes
CASES = [
    ("mlp", {"hidden": [16, 8]}, "layers.2", "dropout_1", None, ["layers.0", "layers.1"], [16, 8]),
    ("logreg", {}, "linear", "flatten", None, [], []),
    ("cnn", {"channels": [4, 8]}, "head", "dropout", "max_pool2d_1", ["convs.0", "convs.1"], [4, 8]),
    (
        "rescnn",
        {"channels": [4, 8]},
        "head",
        "dropout",
        "blocks_1_act_1",
        ["stem.conv", "blocks.0.conv1", "blocks.0.conv2", "blocks.1.conv1", "blocks.1.conv2", "blocks.1.shortcut.conv"],
        [4, 4, 8, 8],
    ),
    (
        "vgg",
        {"channels": [4, 8], "hidden": [16]},
        "head",
        "dropout",
        "max_pool2d_1",
        ["stages.0.conv", "stages.1.conv", "classifier.0"],
        [4, 8, 16],
    ),
    ("transformer", {"hidden": [8], "heads": 2, "depth": 1, "patch_size": 4}, "head", "getitem_1", None, ["embed"], [8]),
    ("torchvision:resnet18", {}, "fc", "flatten", "layer4_1_relu_1", ["conv1", "layer1.0.conv1"], None),
    ("torchvision:mobilenet_v3_small", {}, "classifier.3", "classifier_2", "features_12_2", ["features.0.0", "features.1.block.0.0"], None),
]


def build(name: str, **fields) -> nn.Module:
    return build_model(ModelConfig(name=name, **fields), DIGITS, 10, seed=0).eval()


@pytest.mark.parametrize(("name", "fields", "output", "features", "fmap", "hidden", "sizes"), CASES, ids=[c[0] for c in CASES])
def test_the_structure_of_each_model_is_read_from_its_graph(name, fields, output, features, fmap, hidden, sizes):
    model = build(name, **fields)
    structure = read_structure(model, torch.zeros(2, *DIGITS))
    assert structure.output_layer.module == output
    assert structure.output_layer.keys == (f"{output}.weight", f"{output}.bias")
    assert structure.output_layer.out_group is None  # the classes are fixed
    assert structure.features_node == features
    assert structure.feature_map_node == fmap
    assert [layer.module for layer in structure.hidden][: len(hidden)] == hidden
    assert structure.layers[-1] == structure.output_layer
    state = model.state_dict()
    assert all(k in state for layer in structure.layers for k in layer.keys)
    if sizes is not None:
        assert [g.size for g in structure.hidden_groups()] == sizes
    if structure.hidden:  # the output layer reads the units of a hidden layer's group
        assert structure.output_layer.in_group in [g.name for g in structure.hidden_groups()]


def own_representation(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the models' hand-written code exposes: the last feature map, or the features the classifier reads."""
    if hasattr(model, "feature_map"):  # cnn
        return model.feature_map(x)
    name = type(model).__name__
    if name in ("MLP", "TransformerClassifier"):
        return model.features(x)
    module = {"ResCNN": "blocks", "VGG": "stages", "ResNet": "layer4", "MobileNetV3": "features"}[name]
    captured = []
    handle = getattr(model, module).register_forward_hook(lambda _m, _i, out: captured.append(out))
    if name == "VGG":  # its stages are a ModuleList: the last stage, activated and pooled as VGG.features does
        handle.remove()
        handle = model.stages[-1].register_forward_hook(lambda _m, _i, out: captured.append(nn.functional.max_pool2d(model.act(out), 2)))
    model(x)
    handle.remove()
    return captured[-1]


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "logreg"], ids=[c[0] for c in CASES if c[0] != "logreg"])
def test_the_node_graph_returns_the_models_own_representation_and_logits(case):
    name, fields = case[0], case[1]
    model = build(name, **fields)
    structure = read_structure(model, torch.zeros(2, *DIGITS), spec=False)
    with torch.no_grad():
        rep, logits = build_node_graph(structure, [structure.representation_node, structure.output_layer.node])(X)
        assert torch.equal(logits, model(X))
        assert torch.equal(rep, own_representation(model, X))


def test_the_node_graph_shares_the_models_parameters_and_modes():
    model = build("cnn", channels=[4, 8], dropout=0.5)
    structure = read_structure(model, torch.zeros(2, *DIGITS), spec=False)
    (logits,) = build_node_graph(structure, [structure.output_layer.node])(X)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.train()  # dropout active in the graph too: two passes differ
    graph = build_node_graph(structure, [structure.output_layer.node])
    assert not torch.equal(graph(X)[0], graph(X)[0])
    (fmap,) = build_node_graph(structure, [structure.feature_map_node])(X)
    assert fmap.shape == (3, 8, 2, 2)


RESIZE = [
    ("mlp", {"hidden": [16, 8]}, {"hidden": [5, 11]}),
    ("cnn", {"channels": [4, 8]}, {"channels": [6, 3]}),
    ("rescnn", {"channels": [4, 8]}, {"channels": [3, 5]}),
    ("vgg", {"channels": [4, 8], "hidden": [16]}, {"channels": [2, 6], "hidden": [7]}),
    (
        "transformer",
        {"hidden": [8, 16], "heads": 2, "depth": 1, "patch_size": 4},
        {"hidden": [12, 10], "heads": 2, "depth": 1, "patch_size": 4},
    ),
]


@pytest.mark.parametrize(("name", "fields", "other"), RESIZE, ids=[c[0] for c in RESIZE])
def test_a_model_resized_to_other_widths_computes_what_a_model_built_at_them_computes(name, fields, other):
    target = build_model(ModelConfig(name=name, **other), DIGITS, 10, seed=1).eval()
    with torch.no_grad():
        for p in target.parameters():  # nothing zero-initialised
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    template = build(name, **fields)
    structure = read_structure(template, torch.zeros(2, *DIGITS))
    params = get_params(target)
    assert any(params[k].shape != v.shape for k, v in template.state_dict().items())
    resized = resize_model(template, structure, params)
    with torch.no_grad():
        torch.testing.assert_close(resized(X), target(X))
    sizes = structure.group_sizes({k: v.shape for k, v in params.items()})
    assert sizes[structure.hidden_groups()[0].name] == (other.get("channels") or other["hidden"])[0]


def test_resizing_refuses_widths_no_group_explains():
    template = build("mlp", hidden=[16, 8])
    structure = read_structure(template, torch.zeros(2, *DIGITS))
    params = get_params(build("mlp", hidden=[16, 8]))
    with pytest.raises(InputError, match=r"^params\.layers\.0\.weight: expected shape \(16, 64\)"):
        resize_model(build("mlp", hidden=[16, 8]), structure, {**params, "layers.0.weight": np.zeros((16, 63), np.float32)})
    with pytest.raises(InputError, match=r"^params\.layers\.1\.weight: expected axis 1 of 16"):  # layer 0 writes 16 units
        resize_model(build("mlp", hidden=[16, 8]), structure, {**params, "layers.1.weight": np.zeros((8, 15), np.float32)})
    with pytest.raises(InputError, match=r"^params\.layers\.2\.bias: expected an entry"):
        resize_model(build("mlp", hidden=[16, 8]), structure, {k: v for k, v in params.items() if k != "layers.2.bias"})


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_a_model_without_one_output_layer_is_an_input_error():
    with pytest.raises(InputError, match=r"^architecture: expected a model whose output comes from one last Linear.*a, b"):
        read_structure(TwoHeads(), torch.zeros(2, 4))
    with pytest.raises(InputError, match=r"^input: expected an example batch of two samples"):
        read_structure(nn.Linear(4, 2), torch.zeros(1, 4))


def test_a_custom_sequential_cnn_has_its_last_conv_map():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3)
    )
    structure = read_structure(model, torch.zeros(2, *DIGITS))
    assert structure.feature_map_node == "_3" and structure.shapes["_3"] == (2, 6, 6, 6)
    assert structure.output_layer.module == "6" and [g.size for g in structure.hidden_groups()] == [4, 6]
