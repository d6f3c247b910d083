"""``distill``: the teachers' batched evaluation, the distillation loops' invariants, the method end to end in-process,
what a predictions-only client sends, and the refusals before start."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.fusion.distill.algorithm import input_moments, predict, signal, vjp
from rayfuse.fusion.distill.student import DistillSettings, distill_public, distill_synthetic, teacher_signal
from rayfuse.fusion.distill.teachers import Teachers, combine_teachers, teacher_weights
from rayfuse.io import load_params
from rayfuse.method import METHODS
from rayfuse.models import build_model, get_params, train_model
from rayfuse.runner import prepare_run

PUBLIC = {
    "data": {"dataset": "digits", "public_size": 200},
    "model": {"name": "mlp", "hidden": [32]},
    "partition": {"method": "dirichlet", "num_clients": 3, "alpha": 0.5},
    "train": {"epochs": 8, "shared_init": False},
}
QUICK = {"steps": 120, "epochs": 3}


def _cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _with_running_stats(model: nn.Module) -> nn.Module:
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(32, 1, 4, 4) * 2 + 1)
    return model.eval()


def test_teacher_weights_are_per_class_shares():
    counts = np.array([[10, 0, 5], [30, 0, 5]])
    classes = teacher_weights("classes", counts)
    np.testing.assert_allclose(classes.sum(0), 1.0, rtol=1e-6)
    np.testing.assert_allclose(classes[:, 0], [0.25, 0.75], atol=1e-4)
    np.testing.assert_allclose(classes[:, 1], [0.5, 0.5])  # a class no client holds: uniform, not 0 / 0
    np.testing.assert_allclose(teacher_weights("samples", counts)[:, 2], [15 / 50, 35 / 50], rtol=1e-6)
    np.testing.assert_allclose(teacher_weights("uniform", counts), 0.5)


def test_batched_teachers_equal_the_loop_across_architectures():
    models = [_with_running_stats(m) for m in (_cnn(0), _mlp(1), _cnn(2), _mlp(3), _cnn(4))]
    batched = Teachers([copy.deepcopy(m) for m in models], batched=True)
    loop = Teachers([copy.deepcopy(m) for m in models], batched=False)
    assert [g.batched for g in batched.groups] == [True, True] and len(batched.groups) == 2
    x = torch.randn(16, 1, 4, 4, requires_grad=True)
    (lb, gb), (ll, gl) = batched.forward(x, with_bn=True), loop.forward(x, with_bn=True)
    torch.testing.assert_close(lb, ll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, gl, rtol=1e-5, atol=1e-5)
    assert (gb > 0).all()  # every teacher has BatchNorm: a random batch does not match its statistics
    (grad_b,) = torch.autograd.grad(lb.sum() + gb.sum(), x)
    (grad_l,) = torch.autograd.grad(ll.sum() + gl.sum(), x)
    torch.testing.assert_close(grad_b, grad_l, rtol=1e-4, atol=1e-5)
    for i, model in enumerate(models):  # member i's logits are model i's, in the given order
        torch.testing.assert_close(lb[i], model(x), rtol=1e-5, atol=1e-5)


def test_teachers_leave_a_model_that_is_not_theirs_without_hooks_or_frozen_weights():
    model = _with_running_stats(_cnn(0))
    teachers = Teachers([model], batched=False, freeze=False)
    teachers.forward(torch.randn(8, 1, 4, 4), with_bn=True)
    assert all(p.requires_grad for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())


def test_combining_identical_members_returns_their_logits():
    logits = torch.randn(1, 5, 3).expand(4, 5, 3)
    weights = torch.as_tensor(teacher_weights("classes", np.array([[3, 1, 0], [1, 1, 0], [0, 5, 2], [2, 2, 2]])))
    torch.testing.assert_close(combine_teachers(logits, weights, "logits"), logits[0])
    torch.testing.assert_close(torch.softmax(combine_teachers(logits, weights, "probabilities"), 1), torch.softmax(logits[0], 1))
    torch.testing.assert_close(torch.softmax(combine_teachers(logits, weights, "geometric"), 1), torch.softmax(logits[0], 1))


def test_the_geometric_ensemble_is_the_weighted_mean_of_log_probabilities_and_blind_to_a_members_offset():
    from rayfuse.fusion.distill.teachers import ensemble_of_sum, ensemble_term

    member = torch.randn(3, 6, 4, dtype=torch.float64) * torch.tensor([1.0, 5.0, 20.0], dtype=torch.float64)[:, None, None]
    weights = torch.as_tensor(teacher_weights("classes", np.array([[3, 1, 0, 2], [1, 1, 4, 0], [0, 5, 2, 2]])), dtype=torch.float64)
    expected = (weights[:, None, :] * torch.log_softmax(member, 2)).sum(0)
    torch.testing.assert_close(combine_teachers(member, weights, "geometric"), expected)
    shifted = member + torch.tensor([100.0, -7.0, 3.0], dtype=torch.float64)[:, None, None]  # one constant a member
    torch.testing.assert_close(combine_teachers(shifted, weights, "geometric"), expected)
    total = sum(ensemble_term(member[k].numpy(), weights[k].numpy(), "geometric") for k in range(3))  # secure sums' terms
    np.testing.assert_allclose(ensemble_of_sum(total, "geometric"), expected.numpy(), rtol=1e-6, atol=1e-6)


def test_the_energy_ensemble_adds_each_members_standardised_energy_and_ignores_its_scale():
    from rayfuse.fusion.distill.teachers import ensemble_of_sum, ensemble_term

    member = torch.randn(3, 50, 4, dtype=torch.float64)
    weights = torch.as_tensor(teacher_weights("classes", np.array([[3, 1, 0, 2], [1, 1, 4, 0], [0, 5, 2, 2]])), dtype=torch.float64)
    energy = torch.logsumexp(member, 2)
    standard = (energy - energy.mean(1, keepdim=True)) / energy.std(1, unbiased=False, keepdim=True)
    expected = (weights[:, None, :] * (torch.log_softmax(member, 2) + standard[:, :, None])).sum(0)
    torch.testing.assert_close(combine_teachers(member, weights, "energy"), expected)
    shifted = member + torch.tensor([100.0, -7.0, 3.0], dtype=torch.float64)[:, None, None]  # one constant a member
    torch.testing.assert_close(combine_teachers(shifted, weights, "energy"), expected)
    total = sum(ensemble_term(member[k].numpy(), weights[k].numpy(), "energy") for k in range(3))  # each client's term
    np.testing.assert_allclose(ensemble_of_sum(total, "energy"), expected.numpy(), rtol=1e-6, atol=1e-6)
    # a member that finds one input far more familiar than the rest raises that input's classes it holds
    familiar = member.clone()
    familiar[0, 7] *= 6.0
    weights_one = torch.as_tensor(teacher_weights("uniform", np.ones((3, 4))), dtype=torch.float64)
    gap = combine_teachers(familiar, weights_one, "energy") - combine_teachers(familiar, weights_one, "geometric")
    assert int(gap.mean(1).argmax()) == 7


def test_the_prior_gap_is_the_total_variation_of_the_top_1_histogram_from_the_class_frequencies():
    from rayfuse.fusion.distill.teachers import prior_gap

    logits = torch.eye(3)[[0, 0, 1, 2]]  # top-1 classes 0, 0, 1, 2: histogram (0.5, 0.25, 0.25)
    assert prior_gap(logits, np.array([2, 1, 1])) == 0.0
    assert prior_gap(logits, np.array([1, 1, 2])) == pytest.approx(0.25)  # (|0.5-0.25| + 0 + |0.25-0.5|) / 2
    assert prior_gap(logits, np.array([0, 0, 7])) == pytest.approx(0.75)


def _ensembles(skew: float, scale: float = 4.0) -> dict[str, torch.Tensor]:
    """A class-weighted ensemble that labels ``skew`` of 100 inputs class 0 and the rest class 1, and a plain mean that
    labels them half and half (the clients' pooled counts are half and half); logits of ``scale`` (4: confident, 0.98 on
    the top class: the target is not sharpened)."""
    k = round(100 * skew)
    return {"energy": scale * torch.eye(2)[[0] * k + [1] * (100 - k)], "probabilities": scale * torch.eye(2)[[0, 1] * 50]}


SHARED = np.array([[30, 20], [20, 30]] * 5)  # 10 clients, each holding both classes; pooled half and half


@pytest.mark.parametrize("skew,picked", [(0.9, "mean of probabilities"), (0.51, "energy"), (0.5, "energy")])
def test_auto_keeps_the_energy_ensemble_unless_the_plain_mean_labels_the_inputs_nearer_the_class_counts(skew, picked):
    from rayfuse.fusion.distill.student import check_target

    ensembles, asked = _ensembles(skew), []

    def ensemble_of(how: str, w: np.ndarray) -> torch.Tensor:
        asked.append((how, np.asarray(w).tolist()))
        return ensembles[how]

    weights = teacher_weights("classes", SHARED)
    settings, chosen_weights, record = check_target(ensemble_of, weights, SHARED, DistillSettings(combine="energy", temperature=1.0))
    assert asked == [("energy", weights.tolist()), ("probabilities", np.full((10, 2), 0.1, dtype=np.float32).tolist())]
    assert record["chosen"] == picked and record["prior_gap"] == pytest.approx({"energy": skew - 0.5, "mean of probabilities": 0.0})
    if picked == "energy":  # within the margin (0.01 of total variation) the default stays, as it was
        assert settings == DistillSettings(combine="energy", temperature=1.0) and chosen_weights is weights
    else:
        assert (settings.combine, settings.temperature, record["weighting"]) == ("probabilities", 1.0, "uniform")
        np.testing.assert_array_equal(chosen_weights, np.full((10, 2), 0.1, dtype=np.float32))
    given = check_target(ensemble_of, weights, SHARED, DistillSettings(combine="energy", temperature=1.0), temperature=3.0)[0]
    assert given.temperature == (3.0 if picked != "energy" else 1.0)  # a temperature set is the mean's too


@pytest.mark.parametrize("skew", [0.9, 0.5])
def test_a_flat_target_is_sharpened_until_its_entropy_is_at_most_three_quarters_of_log_c(skew):
    from rayfuse.fusion.distill.student import check_target
    from rayfuse.fusion.distill.teachers import MAX_ENTROPY, flat_temperature

    ensembles = _ensembles(skew, scale=0.2)  # 0.55 on the top class: entropy 0.99 of log 2
    weights = teacher_weights("classes", SHARED)
    settings, _, record = check_target(lambda how, w: ensembles[how], weights, SHARED, DistillSettings(combine="energy", temperature=1.0))
    chosen = ensembles["probabilities" if skew == 0.9 else "energy"]
    p = torch.softmax(chosen / settings.temperature, 1)
    entropy = float(-(p * p.log()).sum(1).mean() / np.log(2))
    assert 0.05 < settings.temperature < 1.0 and record["temperature"] == settings.temperature
    assert MAX_ENTROPY - 0.01 < entropy <= MAX_ENTROPY  # the largest temperature that sharpens it enough (3 decimals)
    assert record["entropy"] == pytest.approx(0.993, abs=1e-3)
    assert settings.temperature == flat_temperature(chosen)
    # a temperature set is kept, flat or not; a confident target keeps temperature 1
    given = check_target(
        lambda how, w: ensembles[how], weights, SHARED, DistillSettings(combine="energy", temperature=1.0), temperature=2.0
    )
    assert given[0].temperature == (2.0 if skew == 0.9 else 1.0) and "entropy" not in given[2]
    sharp = _ensembles(skew)
    assert (
        check_target(lambda how, w: sharp[how], weights, SHARED, DistillSettings(combine="energy", temperature=1.0))[0].temperature == 1.0
    )


@pytest.mark.parametrize(
    "counts",
    [
        np.eye(10, dtype=int) * 40,  # 10 clients, one class each (label-disjoint)
        np.array([[30, 20], [20, 30]] * 3),  # 6 clients sharing both classes: fewer than 10
    ],
    ids=["one-owner-a-class", "few-clients"],
)
def test_with_few_clients_or_one_owner_a_class_the_check_asks_nothing_and_keeps_the_class_weights(counts):
    from rayfuse.fusion.distill.student import check_target
    from rayfuse.fusion.distill.teachers import class_holders

    weights = teacher_weights("classes", counts)

    def ensemble_of(how: str, w: np.ndarray) -> torch.Tensor:
        raise AssertionError("no ensemble is asked for")

    settings = DistillSettings(combine="energy", temperature=1.0)
    got, got_weights, record = check_target(ensemble_of, weights, counts, settings)
    assert got == settings and got_weights is weights
    assert record["chosen"] == "energy" and "prior_gap" not in record
    assert (record["clients"], record["class_holders"]) == (len(counts), class_holders(counts))
    assert record["clients"] < 10 or record["class_holders"] < 1.5


def test_auto_target_scores_the_teachers_ensembles_on_the_public_inputs_as_they_are(trained_digits_mlp):
    from rayfuse.fusion.distill.student import auto_target
    from rayfuse.fusion.distill.teachers import prior_gap

    model, X = trained_digits_mlp
    members = [copy.deepcopy(model), _fresh_mlp(1).eval()]  # Teachers freezes its models: the fixture stays as it is
    teachers = Teachers(members, batched=False)
    members = members * 5  # ten teachers, two models
    teachers = Teachers(members, batched=False)
    counts = np.array([[50] * 10, [30] * 10] * 5)
    weights = teacher_weights("classes", counts)
    settings = DistillSettings(combine="energy", temperature=1.0)
    _, _, record = auto_target(teachers, X[:300], weights, counts, settings)
    logits = teachers.predict(torch.as_tensor(X[:300]))
    expected = prior_gap(combine_teachers(logits, torch.as_tensor(weights), "energy"), counts.sum(0))
    assert record["prior_gap"]["energy"] == expected
    mean = prior_gap(combine_teachers(logits, torch.full((10, 10), 0.1), "probabilities"), counts.sum(0))
    assert record["prior_gap"]["mean of probabilities"] == mean


@pytest.fixture(scope="module")
def trained_digits_mlp():
    from rayfuse.data.datasets import load_dataset

    data = load_dataset("digits")
    X, y = data.X, data.y
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    train_model(model, X[:1200], y[:1200], epochs=10, batch_size=32, lr=5e-3, seed=0)
    return model.eval(), X


def _fresh_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_distilling_copies_of_one_model_gives_a_student_that_agrees_with_it(trained_digits_mlp):
    model, X = trained_digits_mlp
    teachers = Teachers([copy.deepcopy(model) for _ in range(3)])
    student = _fresh_mlp(1)
    history = distill_public(student, teachers, X[1200:1500], np.full((3, 10), 1 / 3, np.float32), DistillSettings(steps=400, epochs=4))
    with torch.no_grad():
        held_out = torch.as_tensor(X[1500:])
        agree = float((student(held_out).argmax(1) == model(held_out).argmax(1)).float().mean())
    assert agree > 0.9, agree
    assert history[-1]["loss"] < history[0]["loss"]  # the loss decreases on a fixed seed
    assert [row["epoch"] for row in history] == [1.0, 2.0, 3.0, 4.0]


def test_the_public_loop_is_reproducible_and_the_same_through_predictions_only(trained_digits_mlp):
    model, X = trained_digits_mlp

    class PredictionsOnly:  # the teachers seen the way the clients serve them: logits on the bank, nothing else
        num_teachers = 2

        def predict(self, bank):
            return torch.stack([model(bank).detach(), model(bank).detach()])

    weights = np.full((2, 10), 0.5, np.float32)
    settings = DistillSettings(steps=60, epochs=2, seed=7)
    students = [_fresh_mlp(3) for _ in range(3)]
    distill_public(students[0], Teachers([copy.deepcopy(model), copy.deepcopy(model)]), X[:300], weights, settings)
    distill_public(students[1], Teachers([copy.deepcopy(model), copy.deepcopy(model)]), X[:300], weights, settings)
    distill_public(students[2], PredictionsOnly(), X[:300], weights, settings)
    a, b, c = (get_params(s) for s in students)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
        np.testing.assert_allclose(a[key], c[key], rtol=1e-5, atol=1e-6)


def test_holdout_returns_the_student_of_the_pass_with_the_best_held_out_fidelity(trained_digits_mlp, monkeypatch):
    import rayfuse.fusion.distill.student as loops

    model, X = trained_digits_mlp
    teachers = Teachers([copy.deepcopy(model), copy.deepcopy(model)])
    weights = np.full((2, 10), 0.5, np.float32)
    scores = iter([(0.5, 1.0), (0.9, 0.4), (0.9, 0.3), (0.7, 0.2), (0.6, 0.1)])  # the start, then passes 1-4
    seen: list[int] = []
    monkeypatch.setattr(loops, "fidelity", lambda student, X, target: (seen.append(len(X)), next(scores))[1])
    states: dict[int, dict[str, np.ndarray]] = {}
    student = _fresh_mlp(3)
    history = distill_public(
        student,
        teachers,
        X[:200],
        weights,
        DistillSettings(steps=80, epochs=4, seed=1, holdout=0.25),
        log=lambda epoch, row: states.__setitem__(epoch, get_params(student)),
    )
    assert seen == [50] * 5  # a quarter of the inputs held out, scored at the start and after each pass
    assert [row["epoch"] for row in history] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [row["chosen"] for row in history] == [0.0, 0.0, 1.0, 0.0, 0.0]  # agreement first, then the lower KL
    for key, value in get_params(student).items():
        np.testing.assert_array_equal(value, states[2][key])  # the pass-2 student, not the last one
    # patience: two passes without a better score stop the loop
    scores = iter([(0.5, 1.0), (0.9, 0.4), (0.8, 0.3), (0.7, 0.2), (0.95, 0.1)])
    history = distill_public(_fresh_mlp(3), teachers, X[:200], weights, DistillSettings(steps=80, epochs=4, holdout=0.25, patience=2))
    assert [row["epoch"] for row in history] == [0.0, 1.0, 2.0, 3.0]


def test_holdout_on_real_scores_keeps_a_student_at_least_as_faithful_as_its_start(trained_digits_mlp):
    from rayfuse.fusion.distill.student import fidelity

    model, X = trained_digits_mlp
    teachers = Teachers([copy.deepcopy(model) for _ in range(2)])
    weights = np.full((2, 10), 0.5, np.float32)
    history = distill_public(_fresh_mlp(4), teachers, X[:300], weights, DistillSettings(steps=120, epochs=3, holdout=0.2))
    chosen = [row for row in history if row["chosen"]]
    assert len(chosen) == 1 and chosen[0]["holdout_agreement"] >= history[0]["holdout_agreement"]
    assert max(row["holdout_agreement"] for row in history) == chosen[0]["holdout_agreement"]
    student = _fresh_mlp(0)
    target = combine_teachers(teachers.predict(torch.as_tensor(X[:50])), torch.as_tensor(weights))
    agree, kl = fidelity(student, torch.as_tensor(X[:50]), target)
    assert 0.0 <= agree <= 1.0 and kl > 0


def test_data_free_distillation_runs_exact_and_from_client_signals(trained_digits_mlp):
    model, X = trained_digits_mlp
    weights = np.full((2, 10), 0.5, np.float32)
    settings = DistillSettings(
        steps=40, epochs=2, generator_steps=2, student_steps=10, synthetic_batch=32, seed=1, reweight=True, hardness=1.0
    )
    moments = (X.mean(0), X.std(0))

    class FromClients:
        num_teachers = 2

        def predict(self, bank):  # not used by the synthetic loop
            raise AssertionError("the synthetic loop asks for signals, not predictions")

        def signal(self, batches, labels, W, settings):
            replies = [teacher_signal(model, batches, labels, W[k], num_teachers=2, settings=settings) for k in range(2)]
            return torch.stack([r[0] for r in replies]), sum(r[1] for r in replies)

    for teachers in (Teachers([copy.deepcopy(model), copy.deepcopy(model)]), FromClients()):
        student = _fresh_mlp(2)
        history, scales = distill_synthetic(student, teachers, (1, 8, 8), weights, settings, label_prior=np.ones(10), moments=moments)
        assert len(history) == 2 and all(np.isfinite(row["loss"]) and np.isfinite(row["generator_loss"]) for row in history)
        assert scales.shape == (2,) and ((scales >= 0) & (scales <= 1)).all()
        assert all(np.isfinite(v).all() for v in get_params(student).values())


def _batchnorm_cnn(X: np.ndarray, seed: int) -> torch.nn.Module:
    """A small CNN with BatchNorm whose running statistics are the inputs' (a few passes in train mode), in eval."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 64, 10)
    )
    with torch.no_grad():
        for _ in range(3):
            net(torch.as_tensor(X[:128]))
    return net.eval()


@pytest.mark.parametrize("kind", ["mlp", "cnn with BatchNorm"])
def test_data_free_from_client_gradients_is_the_exact_path(trained_digits_mlp, kind):
    """Two calls a generator step (the clients' logits, then their input gradients for the server's cotangents) give
    the gradient the exact path takes through the teachers: the same student, up to float rounding."""
    from rayfuse.fusion.distill.student import teacher_vjp

    model, X = trained_digits_mlp
    if kind == "mlp":
        other = copy.deepcopy(model)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.05 * torch.randn_like(p))
        members = [model, other]
    else:
        members = [_batchnorm_cnn(X, 0), _batchnorm_cnn(X, 1)]
    weights = np.array([[0.7] * 5 + [0.2] * 5, [0.3] * 5 + [0.8] * 5], np.float32)
    settings = DistillSettings(steps=30, epochs=2, generator_steps=3, student_steps=10, synthetic_batch=16, seed=2, hardness=1.0)
    moments = (X.mean(0), X.std(0))
    calls = {"predict": 0, "vjp": 0}

    class FromClients:
        num_teachers = 2

        def predict(self, batch):
            calls["predict"] += 1
            return torch.stack([m(batch).detach() for m in members])

        def vjp(self, batch, cotangents, settings):
            calls["vjp"] += 1
            replies = [teacher_vjp(m, batch, cotangents[k], num_teachers=2, settings=settings) for k, m in enumerate(members)]
            return sum(r[0] for r in replies), sum(r[1] for r in replies)

    students = []
    for teachers in (Teachers([copy.deepcopy(m) for m in members], batched=False), FromClients()):
        student = _fresh_mlp(2)
        history, _ = distill_synthetic(student, teachers, (1, 8, 8), weights, settings, label_prior=np.ones(10), moments=moments)
        students.append((get_params(student), history))
    assert calls == {"predict": 3 * 3, "vjp": 3 * 3}  # 3 rounds of 3 generator steps, two calls each
    (exact, exact_history), (clients, client_history) = students
    for key, value in exact.items():
        np.testing.assert_allclose(clients[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    for a, b in zip(exact_history, client_history):  # the generator's loss too, BatchNorm term included
        assert a["generator_loss"] == pytest.approx(b["generator_loss"], rel=1e-4, abs=1e-5)


def test_a_teachers_signal_is_the_gradient_of_its_term(trained_digits_mlp):
    model, _ = trained_digits_mlp
    X = torch.randn(2, 4, 1, 8, 8)
    y = torch.randint(0, 10, (2, 4))
    w = torch.linspace(0.1, 1.0, 10)
    settings = DistillSettings(bn_weight=0.0)
    logits, grad = teacher_signal(model, X, y, w, num_teachers=3, settings=settings)
    assert all(p.requires_grad for p in model.parameters())  # the client's model is left as it was
    x = X[1].clone().requires_grad_(True)
    z = model(x)
    (expected,) = torch.autograd.grad((w[y[1]] * torch.nn.functional.cross_entropy(z, y[1], reduction="none")).mean(), x)
    torch.testing.assert_close(grad[1], expected)
    torch.testing.assert_close(logits[1], z.detach())


# ---------------------------------------------------------------------------------------------------------------
# The method in a run


def test_distill_end_to_end_reaches_the_ensemble_and_reports_its_transfer(coordinator):
    methods = {"ensemble": {}, "distill": {"init": "random", **QUICK, "steps": 600}}
    coord = coordinator(methods=methods, **PUBLIC)
    ensemble = coord.run_method("ensemble")["metrics"]["accuracy"]
    summary = coord.run_method("distill")
    assert summary["metrics"]["accuracy"] > ensemble - 0.1, (summary["metrics"], ensemble)
    assert summary["info"]["transfer_note"] == "public sample (200)"
    assert summary["info"]["combine"] == "energy"  # combine: auto, public transfer
    # auto's check, recorded: three clients are too few to check
    target = summary["info"]["target"]
    assert target["chosen"] == "energy" and target["clients"] == 3 and "prior_gap" not in target
    assert summary["info"]["init"] == "random"
    fused = load_params(coord.store.root / summary["model_file"])
    assert set(fused) == set(coord.reference_params()) and all(np.isfinite(v).all() for v in fused.values())
    rows = [r for r in summary["history"] if r["metric"] == "agreement"]
    assert len(rows) == QUICK["epochs"]  # one per epoch


def test_predictions_only_equals_the_parameter_upload_on_the_same_inputs(coordinator, tmp_path):
    results = {}
    for teachers in ("parameters", "clients"):
        coord = coordinator(methods={"d": {"method": "distill", "init": "random", "teachers": teachers, **QUICK}}, **PUBLIC)
        results[teachers] = load_params(coord.store.root / coord.run_method("d")["model_file"])
    for key, value in results["parameters"].items():
        np.testing.assert_allclose(results["clients"][key], value, rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("init", ["aligned", "average"])
def test_the_student_starts_from_the_clients_merge(coordinator, init):
    coord = coordinator(methods={"d": {"method": "distill", "init": init, **QUICK}}, **PUBLIC)
    summary = coord.run_method("d")
    assert summary["info"]["init"].startswith(f"{init} ") and "of clients [0, 1, 2]" in summary["info"]["init"]
    assert "target" in summary["info"]


def test_where_the_clients_share_their_classes_the_run_checks_the_target_against_their_class_counts(coordinator):
    from rayfuse.fusion.distill.teachers import class_holders

    shared = {**PUBLIC, "partition": {"method": "iid", "num_clients": 10}, "train": {"epochs": 2, "shared_init": False}}
    coord = coordinator(methods={"d": {"method": "distill", "init": "random", **QUICK}}, **shared)
    target = coord.run_method("d")["info"]["target"]
    counts = np.asarray(coord.plan.counts)  # what the server's data.class_counts gives the method
    assert target["clients"] == 10 and target["class_holders"] == class_holders(counts) > 5
    assert set(target["prior_gap"]) == {"energy", "mean of probabilities"} and target["chosen"] in target["prior_gap"]
    assert all(0.0 <= gap <= 1.0 for gap in target["prior_gap"].values())


def test_a_combine_set_by_the_user_is_distilled_as_it_is_without_the_check(coordinator):
    coord = coordinator(methods={"d": {"method": "distill", "init": "random", "combine": "energy", **QUICK}}, **PUBLIC)
    assert "target" not in coord.run_method("d")["info"]


def test_data_free_in_a_run_with_client_signals(coordinator):
    settings = {
        "transfer": "synthetic",
        "init": "random",
        "steps": 40,
        "epochs": 2,
        "generator_steps": 2,
        "student_steps": 10,
        "synthetic_batch": 32,
    }
    coord = coordinator(
        methods={"exact": {"method": "distill", **settings}, "clients": {"method": "distill", "teachers": "clients", **settings}}, **PUBLIC
    )
    for label, note in (("exact", "synthetic (data-free)"), ("clients", "synthetic (data-free), predictions only")):
        summary = coord.run_method(label)
        assert summary["info"]["transfer_note"] == note
        assert np.isfinite(summary["metrics"]["accuracy"])


def test_a_predictions_only_reply_holds_predictions_on_the_transfer_inputs_only(coordinator):
    coord = coordinator(methods={"d": {"method": "distill", "teachers": "clients", "init": "random"}}, **PUBLIC)
    coord.prepare_local_models()
    fed = coord.federation
    X = np.random.default_rng(0).normal(size=(37, 1, 8, 8)).astype(np.float32)
    for client, reply in fed.run(predict, X).results.items():
        assert set(reply) == {"logits"} and reply["logits"].shape == (37, 10) and reply["logits"].dtype == np.float32
        ctx = fed.client(client).ctx
        own = get_params(ctx.local_model())
        assert not any(v.shape == reply["logits"].shape for v in own.values())  # no parameter rides along
        expected = ctx.local_model()(torch.as_tensor(X)).detach().numpy()
        np.testing.assert_allclose(reply["logits"], expected, rtol=1e-5, atol=1e-5)  # the model's outputs on the server's inputs
    batches = X[:32].reshape(2, 16, 1, 8, 8)
    labels = np.zeros((2, 16), dtype=np.int64)
    for reply in fed.gather(
        fed.map(signal, batches, labels, np.full(10, 1 / 3, np.float32), clients=[0], num_teachers=3, settings={})
    ).results.values():
        assert set(reply) == {"logits", "grad"} and reply["logits"].shape == (2, 16, 10) and reply["grad"].shape == batches.shape
    cotangent = np.random.default_rng(1).normal(size=(16, 10)).astype(np.float32)
    for reply in fed.gather(fed.map(vjp, X[:16], cotangent, clients=[0], num_teachers=3, settings={})).results.values():
        assert set(reply) == {"grad", "bn"} and reply["grad"].shape == X[:16].shape and reply["bn"].shape == (1,)
        ctx = fed.client(0).ctx
        x = torch.as_tensor(X[:16]).requires_grad_(True)
        (expected,) = torch.autograd.grad((ctx.local_model()(x) * torch.as_tensor(cotangent)).sum(), x)  # no BatchNorm here
        np.testing.assert_allclose(reply["grad"], expected.numpy(), rtol=1e-5, atol=1e-6)  # an input gradient, nothing else
    for reply in fed.run(input_moments).results.values():  # statistics: per-element sums and a count, never samples
        assert set(reply) == {"count", "sum", "sumsq"} and reply["sum"].shape == (1, 8, 8)


_FREE_CLIENTS = {"teachers": "clients", "init": "random", "transfer": "synthetic"}


@pytest.mark.parametrize(
    "section,entry,path",
    [
        ({"data": {"dataset": "digits", "public_size": 0}}, {"transfer": "public"}, "data.public_size"),
        ({}, {"teachers": "clients", "init": "aligned"}, "methods.d.init"),
        ({"train": {"dp": {"noise_multiplier": 1.0}}}, {"transfer": "synthetic"}, "methods.d.input_moments"),
        ({}, {"aligned": {"rounds": 3}}, "methods.d.aligned.rounds"),
        ({}, {"teachers": "clients", "init": "random", "repair": True}, "methods.d.repair"),
        ({}, {"student": {"name": "nope"}}, "methods.d.student.name"),
        ({}, {"steps": 0}, "methods.d.steps"),
        ({}, {"transfer": "synthetic", "holdout": 0.2}, "methods.d.holdout"),
        ({"data": {"dataset": "digits", "public_size": 3}}, {"holdout": 0.5}, "methods.d.holdout"),
        ({}, {"holdout": 1.0}, "methods.d.holdout"),
        ({}, {"transfer": "synthetic", "rounds": 2}, "methods.d.rounds"),
        ({"train": {"dp": {"noise_multiplier": 1.0}}}, {"rounds": 2}, "train.dp"),
        ({}, {"rounds": 0}, "methods.d.rounds"),
        ({}, {"transfer": "synthetic", "generator_calls": "step"}, "methods.d.generator_calls"),  # parameters uploaded
        ({}, {"teachers": "clients", "init": "random", "generator_calls": "round"}, "methods.d.generator_calls"),  # public
        ({"federation": {"secure_aggregation": True}}, {**_FREE_CLIENTS, "generator_calls": "step"}, "methods.d"),
    ],
)
def test_distill_refuses_before_start(make_config, section, entry, path):
    with pytest.raises(InputError) as info:  # the parameters' own checks (make_config resolves them), then the run's
        prepare_run(make_config(**{**PUBLIC, **section, "methods": {"d": {"method": "distill", **entry}}}))
    assert info.value.path == path, str(info.value)


def test_the_student_key_sets_the_students_architecture(coordinator):
    student = {"name": "mlp", "hidden": [24, 24]}
    coord = coordinator(methods={"d": {"method": "distill", "init": "random", "student": student, **QUICK}}, **PUBLIC)
    fused = load_params(coord.store.root / coord.run_method("d")["model_file"])
    expected = get_params(build_model(ModelConfig(**student), coord.plan.input_shape, coord.plan.num_classes, seed=0))
    assert {k: v.shape for k, v in fused.items()} == {k: v.shape for k, v in expected.items()}


HETERO = {
    "model": {"name": "rescnn", "channels": [8, 16]},
    "train": {"epochs": 4, "shared_init": False},
    "data": {"dataset": "digits", "public_size": 200},
    "partition": {"method": "dirichlet", "num_clients": 3, "alpha": 0.5},
    "federation": {
        "backend": "local",
        "client_overrides": {0: {"model": {"name": "mlp", "hidden": [32]}}, 1: {"model": {"name": "cnn", "channels": [8, 16]}}},
    },
}


@pytest.mark.parametrize("init", ["aligned", "random"])
def test_clients_of_three_architectures_distil_into_the_students(coordinator, init):
    coord = coordinator(methods={"d": {"method": "distill", "init": init, **QUICK}}, **HETERO)
    summary = coord.run_method("d")
    # one client (2) has the student's architecture (the run's rescnn): the aligned start is its merge alone
    assert summary["info"]["init"] == ("random" if init == "random" else "aligned merge of clients [2]")
    assert summary["info"]["combine"] == "energy"  # combine: auto with public transfer: each member's log-probabilities and energy
    fused = load_params(coord.store.root / summary["model_file"])
    assert {k: v.shape for k, v in fused.items()} == {k: v.shape for k, v in coord.reference_params(2).items()}
    assert np.isfinite(summary["metrics"]["accuracy"])


def test_repair_gives_the_student_the_clients_batchnorm_statistics(coordinator):
    coord = coordinator(methods={"d": {"method": "distill", "init": "random", "repair": True, **QUICK}}, **HETERO)
    summary = coord.run_method("d")
    assert summary["info"]["repaired"] is True
    fused = load_params(coord.store.root / summary["model_file"])
    # the statistics of the student's first BatchNorm input over the clients' data, pooled, not what training left
    plan = coord.plan
    X = np.concatenate([coord.federation.client(c).ctx.train.X for c in range(plan.num_clients)])
    from rayfuse.alignment import batchnorm_statistics
    from rayfuse.evaluation import model_for_params

    stats = batchnorm_statistics(model_for_params(fused, coord.cfg.model, plan.input_shape, plan.num_classes), X)
    name = next(iter(stats))
    np.testing.assert_allclose(fused[f"{name}.running_mean"], stats[name][1], rtol=1e-3, atol=1e-4)


def test_with_no_client_of_the_students_architecture_the_aligned_start_is_random(coordinator):
    student = {"name": "mlp", "hidden": [24]}
    coord = coordinator(
        methods={"d": {"method": "distill", "init": "aligned", "student": student, "teachers": "parameters", **QUICK}}, **HETERO
    )
    assert coord.run_method("d")["info"]["init"].startswith("random (no client has the student's architecture")


def test_a_nonparametric_aligned_start_keeps_its_width(coordinator):
    coord = coordinator(
        methods={"d": {"method": "distill", "init": "aligned", "aligned": {"merge": "nonparametric"}, **QUICK}},
        **{**PUBLIC, "train": {"epochs": 8, "shared_init": False}},
    )
    summary = coord.run_method("d")
    fused = load_params(coord.store.root / summary["model_file"])
    reference = coord.reference_params()
    assert summary["info"]["init"].startswith("aligned merge")
    assert fused["layers.0.weight"].shape[0] > reference["layers.0.weight"].shape[0]  # the merge grew the hidden layer
    assert np.isfinite(summary["metrics"]["accuracy"])


def test_predictions_of_dp_trained_clients_report_their_epsilon(coordinator):
    coord = coordinator(
        methods={"d": {"method": "distill", "init": "random", "teachers": "clients", **QUICK}},
        **{**PUBLIC, "train": {"epochs": 2, "dp": {"noise_multiplier": 1.0, "delta": 1e-4}}},
    )
    summary = coord.run_method("d")
    assert summary["metrics"]["dp_sgd_epsilon"] > 0  # post-processing of the DP-trained models: the run's guarantee


@pytest.mark.ray
def test_predictions_only_on_ray_equals_the_in_process_run(ray_session, make_config, tmp_path):
    from actors.backend import RayBackend
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    synthetic = {"transfer": "synthetic", "steps": 40, "epochs": 2, "generator_steps": 2, "student_steps": 10, "synthetic_batch": 32}
    methods = {
        "public": {"method": "distill", "teachers": "clients", "init": "random", **QUICK},
        "free": {"method": "distill", "teachers": "clients", "init": "random", **synthetic},
        # the few-round mode: the refined students stay in the client actors between the round's calls
        "rounds": {"method": "distill", "teachers": "clients", "init": "random", "steps": 60, "epochs": 2, "rounds": 2},
    }
    quiet = dict(printer=Printer(enabled=False), show_tables=False)
    on_ray = run_experiment(
        make_config(**{**PUBLIC, "federation": {"backend": "ray", "clients_per_actor": 3}}, methods=methods),
        RayBackend(),
        tmp_path / "ray",
        **quiet,
    )
    local = run_experiment(make_config(**PUBLIC, methods=methods), InProcessBackend(), tmp_path / "local", **quiet)
    assert on_ray["status"] == "succeeded"
    for label in methods:
        ray_model = load_params(tmp_path / "ray" / on_ray["methods"][label]["model_file"])
        local_model = load_params(tmp_path / "local" / local["methods"][label]["model_file"])
        for key, value in local_model.items():
            np.testing.assert_allclose(ray_model[key], value, rtol=1e-4, atol=1e-5, err_msg=f"{label}: {key}")


# -- the few-round mode (rounds > 1) ----------------------------------------------------------------------------------


LABEL_DISJOINT = {
    **PUBLIC,
    "partition": {"method": "labels", "num_clients": 3, "groups": [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]},
    "train": {"epochs": 20, "shared_init": False},
}


def test_a_refinement_anchored_to_the_student_keeps_the_classes_the_client_lacks(trained_digits_mlp):
    """One client's turn on its own two classes: without the anchor it forgets the other eight; with it, the student's
    answers on the public inputs of those classes survive, and its own classes improve or hold."""
    from rayfuse.data.datasets import load_dataset
    from rayfuse.fusion.distill.student import refine_student

    model, X = trained_digits_mlp
    y = load_dataset("digits").y
    own = np.isin(y, [0, 1])
    public, public_y = torch.as_tensor(X[1000:1300]), y[1000:1300]
    others = ~np.isin(public_y, [0, 1])

    def turn(anchor: float) -> tuple[float, nn.Module]:
        student = copy.deepcopy(model)
        mine = own[:1000]
        stats = refine_student(
            student,
            torch.as_tensor(X[:1000][mine]),
            torch.as_tensor(y[:1000][mine]),
            public,
            epochs=10,
            lr=5e-3,
            batch_size=32,
            anchor=anchor,
            seed=0,
        )
        assert np.isfinite(stats["train_loss"]) and stats["anchor_kl"] >= 0
        with torch.no_grad():
            kept = float((student(public[others]).argmax(1) == model(public[others]).argmax(1)).float().mean())
        return kept, student

    anchored, student = turn(1.0)
    free, _ = turn(0.0)
    assert anchored > 0.8 and free < 0.5, (anchored, free)  # the anchor is what keeps the classes the client lacks
    again = turn(1.0)[1]  # seeded: the same turn twice is the same model
    for a, b in zip(student.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_a_few_rounds_go_past_the_ensemble_on_label_disjoint_sites(coordinator):
    entry = {"method": "distill", "init": "random", "combine": "energy", "temperature": 1, **QUICK, "steps": 600, "rounds": 3}
    coord = coordinator(methods={"ensemble": {}, "d": entry}, **LABEL_DISJOINT)
    summary = coord.run_method("d")
    fused = load_params(coord.store.root / summary["model_file"])
    assert summary["info"]["rounds"] == 3 and all(np.isfinite(v).all() for v in fused.values())
    assert [r["round"] for r in summary["history"] if r["metric"] == "refine_loss"] == [2, 3]  # one row a round
    by_round = [r["value"] for r in summary["history"] if r["metric"] == "accuracy"]
    ensemble = coord.run_method("ensemble")["metrics"]["accuracy"]
    # measured here: ensemble 0.71, the rounds' students 0.73, 0.80, 0.82: each class has one owner, whose refinement
    # teaches the student what the ensemble's other members cannot
    assert len(by_round) == 3 and by_round[2] > by_round[0] + 0.03, by_round
    assert summary["metrics"]["accuracy"] > ensemble + 0.05, (summary["metrics"], ensemble)


def test_the_rounds_through_predictions_only_teach_the_student_of_the_parameter_upload(coordinator):
    fused = {}
    for teachers in ("parameters", "clients"):
        entry = {"method": "distill", "init": "random", "teachers": teachers, "steps": 60, "epochs": 2, "rounds": 2}
        coord = coordinator(methods={"d": entry}, **LABEL_DISJOINT)
        fused[teachers] = load_params(coord.store.root / coord.run_method("d")["model_file"])
    for key, value in fused["parameters"].items():  # the refined students stay on the clients, and teach the same
        np.testing.assert_allclose(fused["clients"][key], value, rtol=1e-4, atol=1e-5, err_msg=key)


def test_a_refinement_reply_with_teachers_clients_holds_counts_and_losses_only(coordinator):
    from rayfuse.fusion.distill.algorithm import REFINED, refine

    coord = coordinator(methods={"d": {"method": "distill", "teachers": "clients", "init": "random", "rounds": 2}}, **PUBLIC)
    coord.prepare_local_models()
    fed = coord.federation
    student = coord.reference_params()
    public = np.random.default_rng(0).normal(size=(20, 1, 8, 8)).astype(np.float32)
    kwargs = dict(label="d", round=2, student=ModelConfig(**PUBLIC["model"]), epochs=1, lr=1e-3, batch_size=32, anchor=1.0)
    for client, reply in fed.run(refine, student, public, upload=False, **kwargs).results.items():
        assert reply.params == {} and set(reply.metrics) == {"train_loss", "anchor_kl", "train_seconds"}
        assert fed.client(client).ctx.state[(REFINED, "d")][0] == 2  # the refined student stays on the client
        answer = fed.run(predict, public, refined=("d", 2), clients=[client]).results[client]
        assert answer["logits"].shape == (20, 10)
    with pytest.raises(Exception, match="holds no student refined in round 3"):
        fed.run(predict, public, refined=("d", 3), clients=[0]).results[0]


def test_the_few_round_mode_passes_the_method_contract_and_resumes_bit_exact(tmp_path):
    from rayfuse.method import MethodCase
    from rayfuse.testing import check_method

    case = MethodCase({"steps": 20, "epochs": 1, "rounds": 2, "init": "random"}, {"data": {"public_size": 0.1}}, step="distill.refine")
    check_method(METHODS.get("distill"), case=case, tmp_path=tmp_path)


@pytest.mark.parametrize(
    "given,one,transfer,expected",
    [
        ({}, True, "public", ("energy", 1.0)),
        ({}, False, "public", ("energy", 1.0)),
        ({}, True, "synthetic", ("logits", 4.0)),
        ({}, False, "synthetic", ("probabilities", 4.0)),
        ({"combine": "geometric"}, True, "synthetic", ("geometric", 1.0)),
        ({"combine": "logits"}, True, "public", ("logits", 4.0)),
        ({"temperature": 2.5}, True, "public", ("energy", 2.5)),
    ],
)
def test_auto_combines_by_energy_at_temperature_1_with_public_transfer_and_as_before_data_free(given, one, transfer, expected):
    from rayfuse.fusion.distill.algorithm import DistillOptions

    settings = DistillOptions(**given).settings(0, one_architecture=one, transfer=transfer)
    assert (settings.combine, settings.temperature) == expected


def test_distill_tags_are_its_papers():
    """Ensemble distillation reads the clients only through their local models' predictions: any architecture each,
    and local DP-SGD covers what it releases."""
    tags = METHODS.get("distill").tags
    assert tags.fuses == "predictions" and tags.local_model_only and tags.heterogeneous_clients and tags.uses_local_models
    assert not (tags.oracle or tags.multi_round or tags.needs_dataset)
