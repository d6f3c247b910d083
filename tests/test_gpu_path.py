"""The GPU path, checked on the CPU: where a device is chosen, what reaches Ray's actor options, the refusal of a GPU
no node has, the coordinator's cost matrices computed with torch on a device against the numpy ones, and a client
that keeps its model and data on its device between steps while returning the same payload."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from rayfuse.alignment import GroupStats, activation_matching, apply_alignment
from rayfuse.alignment.activation import solve_activation_perms_many, unit_similarity
from rayfuse.devices import assigned_device, is_cuda, to_device, to_numpy
from rayfuse.errors import InputError
from tests.alignment.test_alignment import CASES, local_collect, random_model

ROOT = Path(__file__).resolve().parents[1]


# -- one place chooses the device ---------------------------------------------------------------------------------


def test_a_process_runs_on_cuda_0_only_when_it_was_given_a_gpu_torch_can_use():
    assert assigned_device([]) == "cpu"
    assert assigned_device([], cuda_available=True) == "cpu"
    assert assigned_device(["3"], cuda_available=True) == "cuda:0"  # Ray's CUDA_VISIBLE_DEVICES makes GPU 3 device 0
    assert assigned_device([0, 1], cuda_available=True) == "cuda:0"
    assert assigned_device(["0"], cuda_available=False) == "cpu"  # a CPU-only torch build: the same work, on the CPU
    assert is_cuda("cuda:0") and is_cuda(torch.device("cuda", 1)) and not is_cuda("cpu") and not is_cuda(None)


def test_to_device_shares_cpu_arrays_and_to_numpy_copies():
    X = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = to_device(X, "cpu")
    assert t.data_ptr() == X.ctypes.data  # on the CPU the array is shared, not copied
    assert to_device(t, "cpu") is t  # a tensor already there is used as it is
    out = to_numpy(t)
    out[0, 0] = 99.0
    assert X[0, 0] == 0.0 and isinstance(out, np.ndarray)


# -- fractional and per-client GPUs reach Ray's actor options ------------------------------------------------------


def test_fractional_and_per_client_gpus_reach_the_actor_options(make_config):
    from actors.backend import actor_options, client_bundles, gpu_requests, merged_resources

    cfg = make_config(
        federation={
            "clients": {"num_gpus": 0.25},
            "client_overrides": {1: {"num_gpus": 1}, 3: {"num_gpus": 0, "num_cpus": 2}},
            "coordinator": {"num_gpus": 0.5},
        }
    )
    options = [actor_options(merged_resources(cfg, i)) for i in range(4)]
    assert options[0] == {"num_gpus": 0.25}
    assert options[1] == {"num_gpus": 1.0}
    assert options[2] == {"num_gpus": 0.25}
    assert options[3] == {"num_cpus": 2.0}  # an override's 0 GPUs replaces the clients' 0.25
    assert actor_options(cfg.federation.coordinator) == {"num_gpus": 0.5}
    assert [b.get("GPU", 0.0) for b in client_bundles(cfg)] == [0.25, 1.0, 0.25, 0.0]
    assert gpu_requests(cfg) == [
        ("federation.clients", 0.25),
        ("federation.client_overrides.1", 1.0),
        ("federation.clients", 0.25),
        ("federation.coordinator", 0.5),
    ]


def test_a_gpu_no_node_has_is_refused_in_one_line_before_any_actor(make_config):
    from actors.backend import check_node_gpus, check_node_resources

    cpu_only = [{"CPU": 4.0, "memory": 1e9}, {"CPU": 8.0}]
    cfg = make_config(federation={"clients": {"num_gpus": 0.25}})
    with pytest.raises(InputError) as info:
        check_node_resources(cfg, cpu_only)
    assert str(info.value).startswith("federation.clients.num_gpus: expected a Ray node with GPUs (this cluster has none), got 0.25")
    assert "\n" not in str(info.value)
    check_node_gpus(cfg, [*cpu_only, {"CPU": 4.0, "GPU": 1.0}])  # four clients at 0.25 fit one GPU

    big = make_config(federation={"client_overrides": {2: {"num_gpus": 2}}})
    with pytest.raises(
        InputError, match=r"^federation\.client_overrides\.2\.num_gpus: expected at most the 1 GPUs of this cluster's largest node, got 2"
    ):
        check_node_gpus(big, [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}])  # an actor runs on one node
    coordinator = make_config(federation={"coordinator": {"num_gpus": 1}})
    with pytest.raises(InputError, match=r"^federation\.coordinator\.num_gpus: expected a Ray node with GPUs"):
        check_node_gpus(coordinator, cpu_only)
    check_node_gpus(make_config(), cpu_only)  # no GPU asked: nothing to refuse


def test_the_local_ray_refuses_gpus_this_machine_does_not_have(make_config, monkeypatch):
    import actors.backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(actors.backend.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(actors.backend, "_live_local_cluster", lambda: False)
    monkeypatch.setattr(actors.backend, "_local_gpus", lambda: 0)
    cfg = make_config(federation={"client_overrides": {1: {"num_gpus": 0.5}}})
    with pytest.raises(InputError, match=r"^federation\.client_overrides\.1\.num_gpus: expected at most the 0 GPU of the local Ray"):
        actors.backend.check_local_resources(cfg)


_FRACTIONAL = textwrap.dedent(
    """
    import os, ray
    from actors.backend import actor_options
    from actors.client import _assigned_device
    from rayfuse.config import ResourcesConfig

    @ray.remote
    class Probe:
        def report(self):
            return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES"), _assigned_device()

    # a node declaring one GPU (no hardware needed): Ray hands out quarters of it as it would a real one
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    quarter = actor_options(ResourcesConfig(num_gpus=0.25, num_cpus=0))
    probes = [Probe.options(**quarter).remote() for _ in range(4)]
    plain = Probe.options(**actor_options(ResourcesConfig(num_cpus=0))).remote()
    for ids, visible, device in ray.get([p.report.remote() for p in probes]):
        print("quarter", ",".join(ids), visible, device)
    ids, visible, device = ray.get(plain.report.remote())
    print("plain", ",".join(ids) or "-", visible or "-", device)
    ray.shutdown()
    """
)


@pytest.mark.ray
def test_four_client_actors_share_one_gpu_in_quarters_on_a_real_local_ray(tmp_path):
    """Four actors with ``num_gpus: 0.25`` are placed together on a node with one GPU; each is given that GPU (Ray sets
    ``CUDA_VISIBLE_DEVICES``) and chooses ``cuda:0`` where torch sees CUDA (the CPU here: this torch has none); an
    actor without GPUs is given none."""
    result = subprocess.run(
        [sys.executable, "-c", _FRACTIONAL], cwd=ROOT, capture_output=True, text=True, timeout=240, env={**_env(), "PYTHONPATH": str(ROOT)}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith(("quarter", "plain"))]
    expected_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert lines[:4] == [["quarter", "0", "0", expected_device]] * 4
    assert lines[4] == ["plain", "-", "-", "cpu"]


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


# -- the coordinator's cost matrices with torch on its device -------------------------------------------------------


def _random_stats(rng: np.random.Generator, size: int, rows: int = 50) -> GroupStats:
    a = rng.normal(size=(rows, size))
    b = a[:, rng.permutation(size)] * rng.uniform(0.5, 2.0, size) + 0.3 * rng.normal(size=(rows, size))
    a[:, 0] = 1.5  # a constant unit: correlation 0 (the guarded division)
    return GroupStats(float(rows), a.sum(0), b.sum(0), (a * a).sum(0), (b * b).sum(0), a.T @ b)


def test_torch_correlations_on_a_device_equal_the_numpy_ones():
    rng = np.random.default_rng(0)
    for size in (1, 7, 64):
        stats = _random_stats(rng, size)
        numpy_corr = stats.correlation()
        torch_corr = stats.correlation("cpu")
        assert torch_corr.shape == (size, size) and torch_corr.dtype == np.float64 and np.isfinite(torch_corr).all()
        np.testing.assert_allclose(torch_corr, numpy_corr, rtol=0, atol=1e-12)
        assert not torch_corr[0].any()  # the constant unit correlates with nothing, on either path
    empty = GroupStats(0.0, np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3), np.zeros((3, 3)))
    assert np.array_equal(empty.correlation("cpu"), empty.correlation())


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_weight_similarities_on_a_device_equal_the_numpy_ones(case):
    build, make_spec, _ = CASES[case]
    spec = make_spec()
    a, b = random_model(build, 5), random_model(build, 6)
    for group in spec.groups:
        numpy_sim = unit_similarity(a, b, group)
        torch_sim = unit_similarity(a, b, group, device="cpu")
        assert torch_sim.shape == (group.size, group.size) and np.isfinite(torch_sim).all()
        np.testing.assert_allclose(torch_sim, numpy_sim, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_activation_matching_with_its_cost_matrices_on_a_device_gives_the_cpu_paths_result(case):
    build, make_spec, shape = CASES[case]
    spec = make_spec()
    models = [random_model(build, 10 + k) for k in range(3)]  # unrelated models: the costs, not a plant, decide
    X = np.random.default_rng(4).normal(size=(48, *shape)).astype(np.float32)
    collect = local_collect(build, spec, models, X, traced=case == "cnn")
    on_numpy = activation_matching(models, spec, collect, sweeps=2)
    on_device = activation_matching(models, spec, collect, sweeps=2, device="cpu")
    for a, b in zip(on_numpy.perms, on_device.perms):
        assert all(np.array_equal(a[g], b[g]) for g in spec.names)
    np.testing.assert_allclose(on_device.objective, on_numpy.objective, rtol=0, atol=1e-12)
    for qa, qb in zip(on_numpy.quality, on_device.quality):
        assert set(qa) == set(qb)
        for name in qa:
            np.testing.assert_allclose(qb[name], qa[name], rtol=0, atol=1e-12)
    for x, y in zip(apply_alignment(models, spec, on_numpy), apply_alignment(models, spec, on_device)):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    stats = collect(models[0])
    assert solve_activation_perms_many(stats, device="cpu")[1].keys() == solve_activation_perms_many(stats)[1].keys()


# -- a client keeps its model and data on its device between steps -----------------------------------------------


def _client(cfg, i: int = 0):
    from rayfuse.client import Client
    from rayfuse.runner import prepare_run

    plan = prepare_run(cfg).plan
    return Client(i, plan.for_client(i), data_cfg=cfg.data, model_cfg=cfg.model, train_cfg=cfg.train, seed=cfg.run.seed)


def _fit(client, params, round: int, **extra):
    from rayfuse.fusion.fedavg.algorithm import fit

    kwargs = dict(label="fedavg", round=round, epochs=1, lr=0.01, batch_size=32, optimizer="adam", momentum=0.0, weight_decay=0.0)
    return client.run(fit, params, **{**kwargs, **extra})


def _fit_building_the_model(client, params, round: int, *, mu: float = 0.0, eval_loss: bool = False):
    """``fedavg.fit`` as it was before clients kept their model: a model built for the step, the split's arrays."""
    from rayfuse.federation import Update
    from rayfuse.models import compute_loss, get_params, set_params, train_model

    ctx = client.ctx
    model = set_params(ctx.build_model(seed=0), params)
    stats = train_model(
        model,
        ctx.train.X,
        ctx.train.y,
        epochs=1,
        batch_size=32,
        lr=0.01,
        optimizer="adam",
        momentum=0.0,
        weight_decay=0.0,
        proximal_mu=mu,
        seed=ctx.step_seed("fedavg", round),
        device=ctx.device,
    )
    metrics = {"train_loss": stats.loss}
    if eval_loss:
        metrics["eval_loss"] = compute_loss(model, ctx.train.X, ctx.train.y, device=ctx.device)
    return Update(get_params(model), ctx.num_examples, metrics)


def test_a_client_keeps_its_model_and_data_between_steps_and_returns_the_same_payload(make_config):
    from rayfuse.models import build_model, get_params

    cfg = make_config(model={"name": "mlp", "hidden": [16], "dropout": 0.2})  # dropout: the forked RNG must match too
    kept = _client(cfg)
    start = get_params(build_model(cfg.model, kept.ctx.input_shape, kept.ctx.num_classes, seed=1))
    first = _fit(kept, start, 1, eval_loss=True)
    model, (X, y) = kept.ctx._work_models["work"], kept.ctx.device_split()
    second = _fit(kept, first.params, 2, mu=0.1)
    third = _fit(kept, start, 3)
    assert kept.ctx._work_models["work"] is model  # built and moved to the device once
    assert kept.ctx.device_split()[0] is X and kept.ctx.device_split()[1] is y  # the split copied there once
    _fit(kept, start, 4)
    # the kept model holds no gradients between steps (train_model drops them before the parameters are copied out:
    # one model's worth of memory less while the client waits), and loading the next step's parameters keeps it so
    assert all(p.grad is None for p in model.parameters())
    kept.ctx.work_model(start)
    assert all(p.grad is None for p in model.parameters())
    # the same steps as every step ran before (a model built from the config, the split's arrays): the same bytes back
    replies = [first, second, third]
    fresh = [
        _fit_building_the_model(_client(cfg), start, 1, eval_loss=True),
        _fit_building_the_model(_client(cfg), first.params, 2, mu=0.1),
        _fit_building_the_model(_client(cfg), start, 3),
    ]
    for a, b in zip(replies, fresh):
        assert a.num_examples == b.num_examples
        assert set(a.params) == set(b.params)
        for key in a.params:
            assert isinstance(a.params[key], np.ndarray) and np.isfinite(a.params[key]).all()
            assert np.array_equal(a.params[key], b.params[key]), key
        assert {k: v for k, v in a.metrics.items() if "seconds" not in k} == {k: v for k, v in b.metrics.items() if "seconds" not in k}
    # nothing returned is tied to the kept model: changing it changes no payload
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(np.array_equal(third.params[k], fresh[2].params[k]) for k in third.params)


def test_the_clients_of_one_process_share_one_kept_model_per_architecture(make_config):
    """Hosting k clients in one actor keeps one model, not k (their steps run one after another in its thread)."""
    from rayfuse.models import build_model, get_params

    cfg = make_config(model={"name": "mlp", "hidden": [12]})
    a, b = _client(cfg, 0), _client(cfg, 1)
    start = get_params(build_model(cfg.model, a.ctx.input_shape, a.ctx.num_classes, seed=3))
    ra, rb = _fit(a, start, 1), _fit(b, start, 1)
    assert a.ctx._work_models["work"] is b.ctx._work_models["work"]
    assert not all(np.array_equal(ra.params[k], rb.params[k]) for k in ra.params)  # each trained on its own data
    assert all(np.array_equal(rb.params[k], _fit_building_the_model(_client(cfg, 1), start, 1).params[k]) for k in rb.params)
    other = _client(make_config(model={"name": "mlp", "hidden": [10]}), 0)
    _fit(other, get_params(build_model(other.ctx.model_cfg, other.ctx.input_shape, other.ctx.num_classes, seed=3)), 1)
    assert other.ctx._work_models["work"] is not a.ctx._work_models["work"]  # another architecture: its own
    from rayfuse.client import release_kept_models

    kept = a.ctx._work_models["work"]
    release_kept_models()  # a local run ends: its process forgets the kept models
    assert a.ctx.work_model(start) is not kept


def test_the_kept_split_follows_a_replaced_split(make_config):
    from rayfuse.data.roles import Split

    client = _client(make_config())
    X, _ = client.ctx.device_split()
    assert X.data_ptr() == client.ctx.train.X.ctypes.data  # on the CPU: the split's own memory
    client.ctx.train = Split(client.ctx.train.X * 2.0, client.ctx.train.y)  # the silo survey's standardisation replaces it
    X2, _ = client.ctx.device_split()
    assert X2 is not X and torch.equal(X2, X * 2.0)
    assert client.ctx.device_split("val")[0].shape[0] == len(client.ctx.val)


def test_aligned_rounds_after_the_one_shot_keep_the_model_and_return_the_same_payload(make_config):
    from rayfuse.fusion.aligned.algorithm import fit
    from rayfuse.models import build_model, get_params, set_params, train_model

    cfg = make_config()
    kept = _client(cfg, 1)
    start = get_params(build_model(cfg.model, kept.ctx.input_shape, kept.ctx.num_classes, seed=2))
    a = kept.run(fit, start, label="aligned", round=2, epochs=1)
    b = kept.run(fit, a.params, label="aligned", round=3, epochs=1)
    assert kept.ctx._work_models["work"] is not None and b.params.keys() == start.keys()
    # as before: a model built for each step, trained on the split's arrays
    ctx = _client(cfg, 1).ctx
    reference = start
    for round in (2, 3):
        model = set_params(ctx.build_model(seed=0), reference)
        train_model(
            model,
            ctx.train.X,
            ctx.train.y,
            epochs=1,
            batch_size=ctx.train_cfg.batch_size,
            lr=ctx.train_cfg.lr,
            optimizer=ctx.train_cfg.optimizer,
            momentum=ctx.train_cfg.momentum,
            weight_decay=ctx.train_cfg.weight_decay,
            seed=ctx.step_seed("aligned", round),
            device=ctx.device,
        )
        reference = get_params(model)
    assert all(np.array_equal(b.params[k], reference[k]) for k in b.params)
    assert np.isfinite(b.metrics["train_loss"]) and a.params.keys() == b.params.keys()


# -- benchmarks/gpu/check.sh keeps running where there is no GPU ---------------------------------------------------


def test_the_gpu_check_runs_on_the_cpu_and_prints_its_table(tmp_path):
    """``check.sh --cpu`` on the in-process checks (aligned, distill, the FedAvg round; the quickstart check is a
    ``rayfuse.run`` on Ray, which ``make run`` and the Ray tests cover): each row finite and the paths in agreement."""
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), "--cpu", "--only", "aligned", "distill", "fedavg", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "GPU path check, CPU (--cpu, small sizes)" in done.stdout and "CPU/device" in done.stdout
    rows = {row["check"].split(",")[0]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"aligned", "distill", "fedavg"}
    for row in rows.values():
        assert row["device"] == "cpu" and np.isfinite(row["seconds"]) and row["seconds"] > 0 and row["rss_mib"] > 0
    assert rows["aligned"]["result"].startswith("same permutations, max |diff| 0.0e+00")  # the device path is the CPU path
    agreement = rows["distill"]["result"].split()
    assert agreement[1] == agreement[3].rstrip(")")  # distillation on the "device" (the CPU) equals the CPU run
    assert "kept on device" in rows["fedavg"]["result"]


def test_regmean_with_torch_on_a_device_equals_the_numpy_and_scipy_merge():
    from rayfuse.alignment import merge_regmean

    rng = np.random.default_rng(7)
    models = [{"fc.weight": rng.normal(size=(6, 5)).astype(np.float32), "fc.bias": rng.normal(size=6).astype(np.float32)} for _ in range(3)]
    inputs = [rng.normal(size=(40, 5)) for _ in models]
    grams = [{"fc.weight": x.T @ x} for x in inputs]
    for alpha in (0.0, 0.5, 1.0):
        on_cpu = merge_regmean(models, grams, [1.0, 2.0, 3.0], alpha=alpha)
        on_device = merge_regmean(models, grams, [1.0, 2.0, 3.0], alpha=alpha, device="cpu")
        assert on_device["fc.weight"].dtype == np.float32 and np.isfinite(on_device["fc.weight"]).all()
        np.testing.assert_allclose(on_device["fc.weight"], on_cpu["fc.weight"], rtol=1e-5, atol=1e-6)
        assert np.array_equal(on_device["fc.bias"], on_cpu["fc.bias"])  # no Gram: the weighted average on both paths
    singular = [{"fc.weight": np.outer(x[0], x[0])} for x in inputs]  # rank one: the least-squares fallback
    np.testing.assert_allclose(
        merge_regmean(models, singular, alpha=1.0, device="cpu")["fc.weight"],
        merge_regmean(models, singular, alpha=1.0)["fc.weight"],
        rtol=1e-4,
        atol=1e-5,
    )
    zero = [{"fc.weight": np.zeros((5, 5))} for _ in models]  # no data: the average
    assert np.array_equal(merge_regmean(models, zero, device="cpu")["fc.weight"], merge_regmean(models, zero)["fc.weight"])


def test_a_model_kept_by_a_thread_that_ended_is_forgotten(make_config):
    import threading

    from rayfuse.client import _KEPT_MODELS
    from rayfuse.models import build_model, get_params

    cfg = make_config(model={"name": "mlp", "hidden": [9]})
    client = _client(cfg)
    start = get_params(build_model(cfg.model, client.ctx.input_shape, client.ctx.num_classes, seed=0))
    worker = threading.Thread(target=lambda: client.ctx.work_model(start))
    worker.start()
    worker.join()
    ended = worker.ident
    assert any(k[0] == ended for k in _KEPT_MODELS)
    client.ctx.work_model(start)  # this thread builds its own: the ended thread's model goes
    assert not any(k[0] == ended for k in _KEPT_MODELS)
