"""FedSA: saliency, transferability and selection, the translator, distillation payloads, duplicate counting, the
methods end to end (in-process and once on Ray), and bad input."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch

from rayfuse.client import Client, forget_client_state, has_client_state
from rayfuse.config import ModelConfig, validate_config
from rayfuse.data.roles import load_dataset_from_config, make_plan
from rayfuse.errors import InputError
from rayfuse.fusion.fedsa.algorithm import TRANSLATORS, compute_teacher_saliency, distill_student
from rayfuse.fusion.fedsa.kd import (
    Translator,
    adapt_to_target,
    average_students,
    build_translator,
    compute_saliency,
    compute_transferability,
    distill_features,
    draw_weights,
    find_head,
    hidden_representation,
    representation_shape,
    select_teachers,
    selection_probabilities,
)
from rayfuse.method import METHODS, resolve_methods
from rayfuse.models import build_model, get_params
from rayfuse.models.registry import MLP
from rayfuse.runner import prepare_run

CNN = {"name": "cnn", "channels": [8, 16]}
SMALL = {"name": "cnn", "channels": [4, 8]}


def teacher_job(**extra):
    """Four digit teachers (two clean class subsets, one with random labels, one on permuted pixels) and a 10 %
    labelled target set on the server."""
    base = {
        "data": {"dataset": "digits", "public_size": 0.1, "val_size": 0.0},
        "partition": {
            "method": "labels",
            "num_clients": 4,
            "groups": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]],
            "corrupt": {2: "shuffle_labels", 3: "permute_pixels"},
        },
        "model": CNN,
        "train": {"epochs": 3},
    }
    for key, value in extra.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) and key != "methods" else value
    return base


FAST = {
    "method": "fedsa",
    "student": SMALL,
    "rounds": 2,
    "select_every": 1,
    "k": 2,
    "local_epochs": 1,
    "target_epochs": 2,
    "adapt_epochs": 2,
    "evaluate_every": 1,
}


# -- saliency and transferability ----------------------------------------------------------------------------------


def test_input_gradient_saliency_is_zero_where_the_representation_ignores_the_input():
    torch.manual_seed(0)
    model = MLP(64, [16], 10)
    with torch.no_grad():
        model.layers[0].weight[:, :5] = 0.0  # the hidden layer never reads pixels 0..4
    X = np.random.default_rng(0).random((6, 1, 8, 8)).astype(np.float32)
    maps = compute_saliency(model, X, kind="grad")
    assert maps.shape == (6, 64) and maps.dtype == np.float32
    assert np.all(maps[:, :5] == 0) and np.all(maps >= 0) and maps[:, 5:].sum() > 0
    # eq. 1 by hand for one image: |d sum(relu(W x + b)) / dx|
    x = torch.as_tensor(X[:1]).requires_grad_(True)
    (grad,) = torch.autograd.grad(hidden_representation(model, x).sum(), x)
    np.testing.assert_allclose(maps[0], grad.abs().flatten().numpy(), rtol=1e-6)


def test_gradcam_maps_are_normalised_images_of_the_input_size():
    model = build_model(ModelConfig(**CNN), (1, 8, 8), 10, seed=0)
    X = np.random.default_rng(1).random((5, 1, 8, 8)).astype(np.float32)
    maps = compute_saliency(model, X, kind="gradcam")
    assert maps.shape == (5, 64) and maps.min() >= 0 and maps.max() <= 1
    with pytest.raises(InputError, match="saliency"):
        compute_saliency(MLP(64, [8], 10), X, kind="gradcam")


def test_probabilities_sum_to_one_and_favour_the_teacher_whose_saliency_matches_the_targets():
    rng = np.random.default_rng(0)
    target = rng.random((20, 64))
    teachers = [rng.random((20, 64)), target + 0.01 * rng.random((20, 64)), rng.random((20, 64)) ** 4]
    for similarity in ("per_image", "mean_map"):
        sims, Q = compute_transferability(target, teachers, similarity=similarity)
        for normalize in (True, False):
            p = selection_probabilities(Q, normalize=normalize)
            assert p.sum() == pytest.approx(1.0) and np.all(p > 0)
            assert int(np.argmax(p)) == 1 and int(np.argmax(sims)) == 1
        assert sims[1] == pytest.approx(1.0, abs=1e-3)  # its maps are (almost) the target's
    # eq. 2 by hand (per image): d = M / sum_j (0.5 + 0.5 cos), Q = 1 / d
    cos = np.sum(target * teachers[0], 1) / np.linalg.norm(target, axis=1) / np.linalg.norm(teachers[0], axis=1)
    _, Q = compute_transferability(target, teachers[:1])
    assert Q[0] == pytest.approx(1.0 / (20 / np.sum(0.5 + 0.5 * cos)))
    # eq. 3 as written is a softmax of Q; the code's min-max normalisation maps Q onto [0, 1] first
    np.testing.assert_allclose(
        selection_probabilities(np.array([0.2, 0.4]), normalize=False), np.exp([0.2, 0.4]) / np.exp([0.2, 0.4]).sum()
    )
    np.testing.assert_allclose(selection_probabilities(np.array([0.2, 0.4])), np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum())
    np.testing.assert_allclose(selection_probabilities(np.array([0.3, 0.3, 0.3])), 1 / 3)


def test_a_teacher_identical_to_the_target_model_gets_the_largest_probability():
    target = build_model(ModelConfig(**CNN), (1, 8, 8), 10, seed=0)
    others = [build_model(ModelConfig(**CNN), (1, 8, 8), 10, seed=s) for s in (1, 2, 3)]
    X = load_dataset_from_config(validate_config({}).data).X[:30]
    maps = [compute_saliency(m, X) for m in [others[0], copy.deepcopy(target), others[1], others[2]]]
    sims, Q = compute_transferability(compute_saliency(target, X), maps)
    assert sims[1] == pytest.approx(1.0) and int(np.argmax(selection_probabilities(Q))) == 1


def test_sampling_with_replacement_is_reproducible_by_seed_and_repeats_teachers():
    p = np.array([0.05, 0.7, 0.1, 0.15])
    Q = np.log(p)
    draws = [select_teachers("saliency", p, Q, 3, np.random.default_rng(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    many = [tuple(select_teachers("saliency", p, Q, 3, np.random.default_rng(s))) for s in range(50)]
    assert len(set(many)) > 1  # the seed matters
    assert any(len(set(d)) < 3 for d in many)  # with replacement: a teacher drawn twice
    counts = np.bincount(np.concatenate(many), minlength=4)
    assert counts.argmax() == 1
    assert select_teachers("top_k", p, Q, 2, np.random.default_rng(0)) == [1, 3]
    assert select_teachers("least_k", p, Q, 2, np.random.default_rng(0)) == [0, 2]
    assert select_teachers("all", p, Q, 2, np.random.default_rng(0)) == [0, 1, 2, 3]
    assert len(select_teachers("random", p, Q, 5, np.random.default_rng(0))) == 5


# -- aggregation ---------------------------------------------------------------------------------------------------


def test_averaging_counts_a_teacher_drawn_twice_twice():
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(4, np.int64)}
    b = {"w": np.array([4.0, 8.0], np.float32), "n": np.array(1, np.int64)}
    draws = [0, 0, 1]
    weights = draw_weights(draws, np.array([0.5, 0.5]), "uniform")
    assert weights == pytest.approx([1 / 3] * 3)
    out = average_students([a, a, b], weights)
    np.testing.assert_allclose(out["w"], (2 * a["w"] + b["w"]) / 3, rtol=1e-6)
    assert out["n"] == 3 and out["n"].dtype == np.int64
    # positive / negative weighting follows the selection probabilities
    p = np.array([0.75, 0.25])
    assert draw_weights([0, 1], p, "positive") == pytest.approx([0.75, 0.25])
    assert draw_weights([0, 1], p, "negative") == pytest.approx([0.25, 0.75])


# -- translator and distillation -------------------------------------------------------------------------------------


BRIDGEABLE = [
    (s, t)
    for s in [(1, 2, 2), (7, 2, 2), (32, 2, 2), (64, 2, 2), (5, 4, 4), (12,), (3, 4, 4)]
    for t in [(16, 2, 2), (64, 2, 2), (24,)]
    if not (len(s) == 1 and len(t) == 3)
]  # vector -> map: the bad-input test


@pytest.mark.parametrize(("student_shape", "teacher_shape"), BRIDGEABLE)
def test_translator_maps_any_student_width_onto_the_teachers(student_shape, teacher_shape):
    translator = build_translator(student_shape, teacher_shape, seed=0)
    out = translator(torch.randn(3, *student_shape))
    assert tuple(out.shape) == (3, *teacher_shape)
    convs = [m for m in translator.modules() if isinstance(m, torch.nn.Conv2d)]
    if len(teacher_shape) == 3:  # three 1x1 convolutions Cs -> Cs -> Ct -> Ct (the code's translator, ft_k = 1)
        assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [
            (student_shape[0], student_shape[0], (1, 1)),
            (student_shape[0], teacher_shape[0], (1, 1)),
            (teacher_shape[0], teacher_shape[0], (1, 1)),
        ]


@pytest.mark.parametrize(("student_shape", "teacher_shape"), [((12,), (16, 2, 2)), ((8, 2, 2), (8, 4, 4)), ((8, 3, 3), (8, 2, 2))])
def test_shapes_no_translator_can_bridge_are_an_input_error(student_shape, teacher_shape):
    with pytest.raises(InputError, match=r"^methods\.x\.student: expected a student representation"):
        build_translator(student_shape, teacher_shape, path="methods.x.student")


def test_feature_distillation_lowers_the_hint_loss_and_leaves_the_head_alone():
    rng = np.random.default_rng(0)
    X = rng.random((64, 1, 8, 8)).astype(np.float32)
    teacher = build_model(ModelConfig(**CNN), (1, 8, 8), 10, seed=1)
    with torch.no_grad():
        features = hidden_representation(teacher.eval(), torch.as_tensor(X))
    student = build_model(ModelConfig(**SMALL), (1, 8, 8), 10, seed=2)
    head_before = copy.deepcopy(find_head(student).state_dict())
    translator = build_translator(representation_shape(student, (1, 8, 8)), tuple(features.shape[1:]), seed=0)
    first = distill_features(copy.deepcopy(student), copy.deepcopy(translator), X, features, epochs=1, lr=0.01, batch_size=16, seed=0)
    last = distill_features(student, translator, X, features, epochs=10, lr=0.01, batch_size=16, seed=0)
    assert last < first
    assert all(torch.equal(v, find_head(student).state_dict()[k]) for k, v in head_before.items())


def test_head_adaptation_trains_only_the_head_and_whole_adaptation_trains_everything():
    rng = np.random.default_rng(0)
    X, y = rng.random((40, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 40)
    model = build_model(ModelConfig(**SMALL), (1, 8, 8), 10, seed=0)
    before = get_params(model)
    head = get_params(adapt_to_target(model, X, y, mode="head", epochs=3, lr=0.01, batch_size=16, seed=0))
    whole = get_params(adapt_to_target(model, X, y, mode="whole", epochs=3, lr=0.01, batch_size=16, seed=0))
    assert all(np.array_equal(head[k], before[k]) for k in before if not k.startswith("head."))
    assert not np.array_equal(head["head.weight"], before["head.weight"])
    assert not np.array_equal(whole["convs.0.weight"], before["convs.0.weight"])
    assert np.array_equal(get_params(model)["head.weight"], before["head.weight"])  # adaptation works on a copy


def test_a_torchvision_student_is_bridged_to_a_small_cnn_teacher():
    student = build_model(ModelConfig(name="torchvision:resnet18"), (1, 8, 8), 10, seed=0)
    shape = representation_shape(student, (1, 8, 8))
    assert shape == (512, 1, 1)
    with pytest.raises(InputError):  # a 1x1 map cannot become the CNN's 2x2 map
        build_translator(shape, (16, 2, 2))
    teacher_vector = representation_shape(build_model(ModelConfig(name="mlp", hidden=[32]), (1, 8, 8), 10, seed=0), (1, 8, 8))
    assert tuple(build_translator(shape, teacher_vector)(torch.randn(2, *shape)).shape) == (2, 32)


class TinyConvNet(torch.nn.Module):
    """A model FedSA knows nothing about: conv-ReLU twice, adaptive max pool, flatten, a classifier of two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 6, 3, stride=2, padding=1), torch.nn.ReLU()
        )
        self.pool = torch.nn.AdaptiveMaxPool2d(1)
        self.classify = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.pool(self.body(x)).flatten(1))


@pytest.mark.parametrize(
    ("model", "shape", "head"),
    [
        (lambda: TinyConvNet(), (6, 4, 4), "classify.2"),
        (lambda: build_model(ModelConfig(name="rescnn", channels=[4, 8]), (1, 8, 8), 10, seed=0), (8, 4, 4), "head"),
        (lambda: build_model(ModelConfig(name="vgg", channels=[4, 8], hidden=[16]), (1, 8, 8), 10, seed=0), (8, 2, 2), "head"),
        (
            lambda: build_model(ModelConfig(name="transformer", hidden=[8], heads=2, depth=1, patch_size=4), (1, 8, 8), 10, seed=0),
            (8,),
            "head",
        ),
    ],
    ids=["custom", "rescnn", "vgg", "transformer"],
)
def test_the_representation_of_any_traceable_model_is_read_from_its_graph(model, shape, head):
    model = model().eval()
    x = torch.randn(3, 1, 8, 8)
    assert representation_shape(model, (1, 8, 8)) == shape  # the last map before pooling / flatten, else the head's input
    assert find_head(model) is model.get_submodule(head)
    if isinstance(model, TinyConvNet):
        with torch.no_grad():
            assert torch.equal(hidden_representation(model, x), model.body(x))
    (grad,) = torch.autograd.grad(hidden_representation(model, x.requires_grad_(True)).sum(), x)
    assert grad.abs().sum() > 0


# -- client steps: what comes back ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_client():
    cfg = validate_config(teacher_job(train={"epochs": 2}))
    plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)
    client = Client(0, plan.for_client(0), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=0)
    return client, plan


def _arrays(obj, out):
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _arrays(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _arrays(v, out)
    return out


def test_returned_payloads_hold_no_teacher_weights_and_no_private_data(teacher_client):
    client, plan = teacher_client
    student_cfg = ModelConfig(**CNN)  # the same architecture as the teacher: equal shapes, so values are compared
    student = build_model(student_cfg, (1, 8, 8), 10, seed=5)
    probe = np.random.default_rng(0).random((12, 1, 8, 8)).astype(np.float32)
    maps = client.run(compute_teacher_saliency, probe, kind="grad")
    out = client.run(
        distill_student, get_params(student), label="fedsa", round=1, copies=2, student_cfg=student_cfg, epochs=1, lr=1e-3, batch_size=32
    )
    teacher = get_params(client.ctx.local_model())
    private = [client.ctx.train.X, client.ctx.train.y]
    assert set(maps) == {"maps", "seconds"} and maps["maps"].shape == (12, 64)
    assert set(out) == {"students", "kd_loss", "num_examples", "seconds"} and len(out["students"]) == 2
    assert all(set(s) == set(get_params(student)) for s in out["students"])
    returned = _arrays(maps, []) + _arrays(out, [])
    for arr in returned:
        for secret in list(teacher.values()) + private:
            assert not (arr.shape == secret.shape and np.allclose(arr, secret)), "a teacher tensor or private data came back"
            assert not np.may_share_memory(arr, secret)
    # nor any flattened piece of them
    flat_secrets = np.concatenate([v.ravel() for v in teacher.values()] + [private[0].ravel()])
    for arr in returned:
        if arr.size >= 16 and arr.dtype.kind == "f":
            assert not np.isin(arr.ravel()[:16], flat_secrets).all()
    # the two copies differ (their own batch order) and the translator stayed with the client
    assert not np.array_equal(out["students"][0]["convs.0.weight"], out["students"][1]["convs.0.weight"])
    assert isinstance(client.ctx.state[("fedsa.translator", "fedsa")], Translator)


# -- methods end to end ----------------------------------------------------------------------------------------------


def test_fedsa_and_its_baselines_run_end_to_end(coordinator):
    methods = {
        "fedsa": FAST,
        "fedavg+": {**FAST, "selection": "all"},
        "topk-pos": {**FAST, "selection": "top_k", "weighting": "positive"},
        "scratch": {"student": SMALL, "target_epochs": 2},
        "transfer": {"adapt_epochs": 2},
    }
    coord = coordinator(**teacher_job(methods=methods))
    out = {label: coord.run_method(label) for label in methods}
    for label, summary in out.items():
        assert 0 <= summary["metrics"]["accuracy"] <= 1 and all(np.isfinite(v) for v in summary["metrics"].values()), label
    fedsa = out["fedsa"]["info"]
    assert [s["round"] for s in fedsa["selections"]] == [1, 2] and all(len(s["draws"]) == 2 for s in fedsa["selections"])
    assert all(sum(s["p"]) == pytest.approx(1.0, abs=1e-5) for s in fedsa["selections"])
    rows = {(r["round"], r["metric"]): r["value"] for r in out["fedsa"]["history"]}
    assert sum(rows[(1, f"selected_{c}")] for c in range(4)) == 2 and (2, "accuracy") in rows
    assert all(s["draws"] == [0, 1, 2, 3] for s in out["fedavg+"]["info"]["selections"])
    assert out["transfer"]["oracle"] and len(out["transfer"]["info"]["per_teacher"]) == 4
    assert not out["fedsa"]["oracle"]
    # the same saliency similarities whatever the selection rule (same weak target model, same teachers)
    assert out["fedsa"]["info"]["selections"][0]["similarity"] == out["topk-pos"]["info"]["selections"][0]["similarity"]
    # scratch is FedSA's weak target model: the same accuracy as a FedSA run's start (one seed for both)
    assert out["fedsa"]["info"]["target_size"] == out["scratch"]["info"]["target_size"] > 0


def test_gradcam_selection_runs(coordinator):
    coord = coordinator(**teacher_job(methods={"fedsa": {**FAST, "rounds": 1, "saliency": "gradcam", "student": CNN}}))
    summary = coord.run_method("fedsa")
    assert summary["info"]["saliency"] == "gradcam" and len(summary["info"]["selections"][0]["similarity"]) == 4


@pytest.mark.parametrize(
    ("teachers", "student"),
    [
        (CNN, {"name": "cnn", "channels": [4, 8, 8]}),  # deeper and narrower than the teachers
        ({"name": "mlp", "hidden": [32, 16]}, {"name": "mlp", "hidden": [8]}),  # vectors: a linear translator
        ({"name": "mlp", "hidden": [32]}, {"name": "torchvision:resnet18"}),  # a torchvision map pooled onto MLP vectors
        ({"name": "vgg", "channels": [4, 8], "hidden": [16]}, {"name": "rescnn", "channels": [4, 8]}),  # maps found in the graphs
    ],
    ids=["deeper-cnn", "mlp", "resnet18-from-mlp", "rescnn-from-vgg"],
)
def test_heterogeneous_students_are_distilled(coordinator, teachers, student):
    methods = {"fedsa": {**FAST, "rounds": 1, "k": 1, "student": student, "target_epochs": 1, "adapt_epochs": 1}}
    coord = coordinator(**teacher_job(model=teachers, methods=methods))
    summary = coord.run_method("fedsa")
    assert np.isfinite(summary["metrics"]["accuracy"]) and summary["info"]["student"]["name"] == student["name"]


# -- resume ------------------------------------------------------------------------------------------------------------


RESUMABLE = {**FAST, "rounds": 4, "select_every": 2, "evaluate_every": 2}  # selections at rounds 1 and 3


def _run(cfg, run_dir, **kwargs):
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    return run_experiment(cfg, InProcessBackend(), run_dir, printer=Printer(enabled=False), show_tables=False, **kwargs)


def _resume(run_dir):
    from rayfuse.config import parse_overrides
    from rayfuse.runner import load_run_config

    # the fault that interrupted the run is removed (only federation.* keys may change on resume)
    from tests.conftest import scramble_global_rngs

    cfg = load_run_config(run_dir, parse_overrides(["federation.faults=[]", "federation.on_client_failure=retry"]))
    scramble_global_rngs()  # a real resume is a new process: nothing may depend on the old one's global random state
    return _run(cfg, run_dir, resume=True)


def _fault_in_round(selections, rnd):
    """A fault that fails the distillation of round ``rnd`` and nothing before: (client, its fedsa.distill call)."""

    def draws(r):
        return next(s["draws"] for s in reversed(selections) if s["round"] <= r)

    client = min(draws(rnd))
    return {"client": client, "step": "fedsa.distill", "call": sum(client in draws(r) for r in range(1, rnd + 1)), "mode": "raise"}


def _rounds_run(results, label="fedsa"):
    return [e["round"] for e in results["events"] if e["kind"] == "progress" and e.get("method") == label and "rounds" in e]


@pytest.fixture(scope="module")
def straight_fedsa(tmp_path_factory):
    """One uninterrupted FedSA run (its clients keep their state in their own model cache)."""
    from tests.conftest import TINY, merge

    root = tmp_path_factory.mktemp("fedsa-resume")

    def config(name, **extra):
        job = merge(TINY, teacher_job(methods={"fedsa": RESUMABLE}, run={"storage": str(root), "model_cache": str(root / f"cache-{name}")}))
        return validate_config(merge(job, extra))

    results = _run(config("straight"), root / "straight")
    return config, root, results


def test_an_interrupted_fedsa_run_resumes_mid_method_with_the_same_result(straight_fedsa):
    from rayfuse.errors import RunFailure
    from rayfuse.io import load_params
    from rayfuse.models import params_equal

    config, root, straight = straight_fedsa
    selections = straight["methods"]["fedsa"]["info"]["selections"]
    assert [s["round"] for s in selections] == [1, 3]
    run_dir = root / "interrupted"
    # Round 2 fails: the run stops after checkpointing round 1. Round 2 distils from round 1's teachers again, so
    # their clients' translators (trained in round 1, kept by the clients) must come back; round 3 selects anew.
    fault = _fault_in_round(selections, 2)
    with pytest.raises(RunFailure):
        _run(config("interrupted", federation={"on_client_failure": "fail", "faults": [fault]}), run_dir)
    assert json.loads((run_dir / "checkpoints" / "fedsa" / "latest.json").read_text())["round"] == 1

    resumed = _resume(run_dir)
    assert resumed["status"] == "succeeded"
    assert [e["round"] for e in resumed["events"] if e["kind"] == "resumed" and e.get("method") == "fedsa"] == [1]
    assert not [e for e in resumed["events"] if e["kind"] == "warning"]
    assert _rounds_run(resumed) == [2, 3, 4]  # round 1 is not redone
    # the same selections (probabilities, similarities, draws) and the same final model as the uninterrupted run
    assert resumed["methods"]["fedsa"]["info"]["selections"] == selections
    assert resumed["methods"]["fedsa"]["accuracy"] == straight["methods"]["fedsa"]["accuracy"]
    assert params_equal(
        load_params(run_dir / "models" / "fedsa.safetensors"), load_params(root / "straight" / "models" / "fedsa.safetensors")
    )
    history = json.loads((run_dir / "state" / "fedsa.json").read_text())["history"]
    assert history == json.loads((root / "straight" / "state" / "fedsa.json").read_text())["history"]
    assert [r["round"] for r in history if r["metric"] == "accuracy"] == [2, 4]
    # the translators the clients kept for the resume are deleted once the method is done
    assert not list((root / "cache-interrupted").glob("client-state/*/fedsa-translators/*/*"))


def test_a_resumed_fedsa_run_does_not_redo_finished_rounds(straight_fedsa):
    config, root, straight = straight_fedsa
    run_dir = root / "finished"
    first = _run(config("finished"), run_dir)
    assert _rounds_run(first) == [1, 2, 3, 4]
    (run_dir / "state" / "fedsa.json").unlink()  # as if the run stopped after FedSA's last round checkpoint
    resumed = _resume(run_dir)
    assert [e["round"] for e in resumed["events"] if e["kind"] == "resumed"] == [4]
    assert _rounds_run(resumed) == []
    assert not [e for e in resumed["events"] if e["kind"] == "progress" and "draws" in e]  # no selection either
    assert resumed["methods"]["fedsa"]["accuracy"] == straight["methods"]["fedsa"]["accuracy"]
    assert resumed["methods"]["fedsa"]["info"]["selections"] == straight["methods"]["fedsa"]["info"]["selections"]


def test_without_client_storage_fedsa_restarts_from_round_0_with_the_same_result(straight_fedsa):
    from rayfuse.errors import RunFailure

    config, root, straight = straight_fedsa
    run_dir = root / "no-cache"
    fault = _fault_in_round(straight["methods"]["fedsa"]["info"]["selections"], 2)
    with pytest.raises(RunFailure):
        _run(config("x", run={"model_cache": None}, federation={"on_client_failure": "fail", "faults": [fault]}), run_dir)
    resumed = _resume(run_dir)
    warnings = [e["message"] for e in resumed["events"] if e["kind"] == "warning"]
    assert len(warnings) == 1 and "restarting from round 0" in warnings[0] and "run.model_cache" in warnings[0]
    assert _rounds_run(resumed) == [1, 2, 3, 4]
    assert resumed["methods"]["fedsa"]["accuracy"] == straight["methods"]["fedsa"]["accuracy"]


def test_a_lost_translator_restarts_fedsa_from_round_0(straight_fedsa):
    import shutil

    from rayfuse.errors import RunFailure

    config, root, straight = straight_fedsa
    run_dir = root / "lost"
    fault = _fault_in_round(straight["methods"]["fedsa"]["info"]["selections"], 2)
    with pytest.raises(RunFailure):
        _run(config("lost", federation={"on_client_failure": "fail", "faults": [fault]}), run_dir)
    shutil.rmtree(root / "cache-lost" / "client-state")  # the clients lost their storage
    resumed = _resume(run_dir)
    assert any(e["kind"] == "warning" and "no longer hold their translators" in e["message"] for e in resumed["events"])
    assert _rounds_run(resumed) == [1, 2, 3, 4]
    assert resumed["methods"]["fedsa"]["accuracy"] == straight["methods"]["fedsa"]["accuracy"]


def test_an_ablation_label_resumes_with_its_draws(straight_fedsa):
    """``fixed`` (FedSA's first draw kept, never re-selected): the resumed rounds use the checkpointed draws."""
    from rayfuse.errors import RunFailure

    config, root, _ = straight_fedsa
    methods = {"fixed": {**RESUMABLE, "selection": "fixed", "rounds": 3}}
    straight = _run(config("fixed-straight", methods=methods), root / "fixed-straight")
    selections = straight["methods"]["fixed"]["info"]["selections"]
    assert [s["round"] for s in selections] == [1]
    fault = _fault_in_round(selections, 3)
    run_dir = root / "fixed"
    with pytest.raises(RunFailure):
        _run(config("fixed", methods=methods, federation={"on_client_failure": "fail", "faults": [fault]}), run_dir)
    resumed = _resume(run_dir)
    assert [e["round"] for e in resumed["events"] if e["kind"] == "resumed"] == [2]
    assert _rounds_run(resumed, "fixed") == [3]
    assert resumed["methods"]["fixed"]["info"]["selections"] == selections
    assert resumed["methods"]["fixed"]["accuracy"] == straight["methods"]["fixed"]["accuracy"]


def test_a_new_client_continues_from_the_translator_its_predecessor_stored(teacher_client, tmp_path):
    client, plan = teacher_client
    cfg = validate_config(teacher_job(train={"epochs": 2}))

    def new_client():
        return Client(0, plan.for_client(0), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=0, local_cache=str(tmp_path))

    student_cfg = ModelConfig(**SMALL)
    params = get_params(build_model(student_cfg, (1, 8, 8), 10, seed=3))
    args = dict(label="fedsa", copies=1, student_cfg=student_cfg, epochs=1, lr=1e-3, batch_size=32, store="abc123")
    first = new_client()
    first.run(distill_student, params, round=1, translator_round=0, **args)
    first.run(distill_student, params, round=3, translator_round=1, **args)
    kept = tmp_path / "client-state" / "client-0" / "fedsa-translators" / "abc123"
    assert sorted(f.name for f in kept.iterdir()) == ["fedsa-00001.safetensors", "fedsa-00003.safetensors"]
    straight = first.run(distill_student, params, round=4, translator_round=3, **args)
    assert sorted(f.name for f in kept.iterdir()) == ["fedsa-00003.safetensors", "fedsa-00004.safetensors"]
    # a new client (a resumed run's) continues from round 3's translator: the same student as the first client's round 4
    again = new_client()
    assert again.run(has_client_state, kind=TRANSLATORS, name="fedsa", round=3, store="abc123") and not again.run(
        has_client_state, kind=TRANSLATORS, name="fedsa", round=1, store="abc123"
    )
    resumed = again.run(distill_student, params, round=4, translator_round=3, **args)
    assert all(np.array_equal(straight["students"][0][k], resumed["students"][0][k]) for k in params)
    with pytest.raises(FileNotFoundError, match="no translator of 'fedsa' after round 2"):  # never silently a new one
        new_client().run(distill_student, params, round=4, translator_round=2, **args)
    # starting from a new translator instead gives another student: the stored one matters
    fresh = new_client().run(distill_student, params, round=4, translator_round=0, **args)
    assert not all(np.array_equal(straight["students"][0][k], fresh["students"][0][k]) for k in params)
    files = len(list(kept.iterdir()))
    assert files > 0 and new_client().run(forget_client_state, kind=TRANSLATORS, store="abc123") == files and not kept.exists()


def test_teachers_retrained_by_new_clients_are_identical(teacher_client):
    """Without a model cache a resumed run's new clients retrain their teachers: from the run seed, bit for bit."""
    client, plan = teacher_client
    cfg = validate_config(teacher_job(train={"epochs": 2}))
    again = Client(0, plan.for_client(0), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=0)
    a, b = get_params(client.ctx.local_model()), get_params(again.ctx.local_model())
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_resumed_run_refuses_other_teachers(straight_fedsa, monkeypatch):
    import rayfuse.fusion.fedsa.algorithm as fedsa_module
    from rayfuse.errors import RunFailure

    config, root, straight = straight_fedsa
    run_dir = root / "other-teachers"
    fault = _fault_in_round(straight["methods"]["fedsa"]["info"]["selections"], 2)
    with pytest.raises(RunFailure):
        _run(config("other", federation={"on_client_failure": "fail", "faults": [fault]}), run_dir)
    original = fedsa_module.FedSA._teacher_maps

    def other_teachers(self, server, target):
        return {c: m * 1.5 if c == 1 else m for c, m in original(self, server, target).items()}

    monkeypatch.setattr(fedsa_module.FedSA, "_teacher_maps", other_teachers)
    with pytest.raises(RunFailure, match="teacher 1 is not the interrupted run's teacher"):
        _resume(run_dir)


BAD = [
    pytest.param(
        {"methods": {"fedsa": {**FAST, "k": 5}}}, r"^methods\.fedsa\.k: expected at most the number of teachers \(4", id="k-too-large"
    ),
    pytest.param(
        {"data": {"public_size": 0}, "methods": {"fedsa": FAST}},
        r"^data\.public_size: expected a labelled target set",
        id="empty-target-set",
    ),
    pytest.param({"data": {"public_size": 0}, "methods": {"scratch": {}}}, r"^data\.public_size: ", id="scratch-empty-target-set"),
    pytest.param(
        {"methods": {"fedsa": {**FAST, "student": {"name": "mlp", "hidden": [16]}}}},
        r"^methods\.fedsa\.student: expected a student representation a translator can map",
        id="vector-student-map-teacher",
    ),
    pytest.param(
        {"methods": {"fedsa": {**FAST, "student": {"name": "logreg"}}}},
        r"^methods\.fedsa\.student: expected a model with a hidden",
        id="student-without-hidden-layer",
    ),
    pytest.param(
        {"model": {"name": "logreg"}, "methods": {"fedsa": {**FAST, "student": None}}},
        r"^model\.name: expected a model with a hidden",
        id="teacher-without-hidden-layer",
    ),
    pytest.param(
        {"model": {"name": "mlp", "hidden": [16]}, "methods": {"fedsa": {**FAST, "student": None, "saliency": "gradcam"}}},
        r"^methods\.fedsa\.saliency: expected grad",
        id="gradcam-without-feature-map",
    ),
]


@pytest.mark.parametrize(("extra", "match"), BAD)
def test_bad_input_is_a_one_line_input_error(make_config, extra, match):
    cfg = make_config(**teacher_job(**extra))
    with pytest.raises(InputError, match=match) as info:
        prepare_run(cfg)  # before any client starts
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        ({"selection": "best"}, "methods.fedsa.selection"),
        ({"k": 0}, "methods.fedsa.k"),
        ({"student": {"name": "cnn", "channels": [0]}}, "methods.fedsa.student.channels"),
        ({"temperature": 0}, "methods.fedsa.temperature"),
    ],
)
def test_bad_parameters_are_rejected_by_the_config(entry, path):
    with pytest.raises(InputError, match="^" + re.escape(path) + ": expected"):
        resolve_methods(validate_config({"methods": {"fedsa": entry}}).methods)


@pytest.mark.ray
def test_fedsa_on_ray_equals_the_in_process_run(ray_session, make_config, tmp_path):
    from actors.backend import RayBackend
    from rayfuse.io import load_params
    from rayfuse.models import params_equal
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    methods = {"fedsa": {**FAST, "rounds": 2}}
    job = teacher_job(methods=methods)
    job["federation"] = {"clients_per_actor": 2}
    on_ray = run_experiment(
        make_config(**{**job, "federation": {**job["federation"], "backend": "ray"}}),
        RayBackend(),
        tmp_path / "ray",
        printer=Printer(enabled=False),
        show_tables=False,
    )
    # Ray's actors run torch on one thread; the in-process run must too for bit-equal convolutions (the sums of a
    # multi-threaded conv backward are ordered differently).
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = run_experiment(
            make_config(**job), InProcessBackend(), tmp_path / "local", printer=Printer(enabled=False), show_tables=False
        )
    finally:
        torch.set_num_threads(threads)
    assert on_ray["status"] == "succeeded" and on_ray["run"]["backend"] == "ray"
    assert on_ray["methods"]["fedsa"]["accuracy"] == local["methods"]["fedsa"]["accuracy"]
    assert params_equal(
        load_params(tmp_path / "ray" / "models" / "fedsa.safetensors"), load_params(tmp_path / "local" / "models" / "fedsa.safetensors")
    )


# Slow (three FedSA runs on Ray, ~50 s on 2 cores): RAYFUSE_SLOW=1 runs it. Its fast twins, in every suite: the same
# interruption and resume in-process (test_an_interrupted_fedsa_run_resumes_mid_method_with_the_same_result) and FedSA
# on Ray equal to the in-process run (test_fedsa_on_ray_equals_the_in_process_run).
@pytest.mark.slow
def test_fedsa_interrupted_on_ray_resumes_with_the_translators_its_client_actors_kept(ray_session, straight_fedsa):
    """On Ray the client actors write their translators to their own storage: a run interrupted in round 2 and
    resumed with new actors ends where the uninterrupted run does."""
    from actors.backend import RayBackend
    from rayfuse.config import parse_overrides
    from rayfuse.errors import RunFailure
    from rayfuse.report import Printer
    from rayfuse.runner import load_run_config, run_experiment

    config, root, straight = straight_fedsa
    selections = straight["methods"]["fedsa"]["info"]["selections"]

    def on_ray(cfg, run_dir, **kwargs):
        return run_experiment(cfg, RayBackend(), run_dir, printer=Printer(enabled=False), show_tables=False, **kwargs)

    # the reference: the same run on Ray, uninterrupted (in-process runs differ from Ray's in the last float digits of
    # the saliency similarities: numpy's BLAS threads)
    ray_fed = {"backend": "ray", "clients_per_actor": 2}  # 2 actors of 2 clients each: fewer processes to start
    reference = on_ray(config("ray-reference", federation=ray_fed), root / "ray-reference")
    run_dir = root / "ray-interrupted"
    fault = _fault_in_round(selections, 2)
    with pytest.raises(RunFailure):
        on_ray(config("ray", federation={**ray_fed, "on_client_failure": "fail", "faults": [fault]}), run_dir)
    assert list((root / "cache-ray").glob("client-state/*/fedsa-translators/*/*.safetensors"))  # written by the actors
    resumed = on_ray(
        load_run_config(run_dir, parse_overrides(["federation.faults=[]", "federation.on_client_failure=retry"])), run_dir, resume=True
    )
    assert resumed["status"] == "succeeded" and resumed["run"]["backend"] == "ray"
    assert [e["round"] for e in resumed["events"] if e["kind"] == "resumed" and e.get("method") == "fedsa"] == [1]
    assert _rounds_run(resumed) == [2, 3, 4]
    assert resumed["methods"]["fedsa"]["info"]["selections"] == reference["methods"]["fedsa"]["info"]["selections"]
    assert resumed["methods"]["fedsa"]["accuracy"] == reference["methods"]["fedsa"]["accuracy"]
    assert not list((root / "cache-ray").glob("client-state/*/fedsa-translators/*/*"))


def test_the_fedsa_methods_tags_are_their_papers():
    """FedSA amalgamates selected teachers' features into a new-task student over rounds, scoring on the target task
    (central only); Transfer needs the teachers' weights (not federated: an oracle); Scratch trains on the target set
    alone."""
    tags = {name: METHODS.get(name).tags for name in ("fedsa", "scratch", "transfer")}
    assert tags["fedsa"].fuses == "statistics" and tags["fedsa"].multi_round and not tags["fedsa"].oracle
    assert tags["transfer"].oracle and not tags["transfer"].needs_dataset and not tags["scratch"].oracle
    for name, t in tags.items():
        assert not t.federated_evaluation and t.public_labels and not t.local_model_only and not t.heterogeneous_clients, name
