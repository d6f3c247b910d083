"""Clients of different architectures (``federation.client_overrides.<i>.model``, ``rayfuse.run(model={...})``): the
methods that need only each client's predictions run, each client's model in its own architecture; every method that
averages or matches weights is refused before anything starts."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import rayfuse
from rayfuse.cli import main
from rayfuse.config import validate_config
from rayfuse.data.roles import client_splits, load_dataset_from_config, server_splits
from rayfuse.errors import InputError
from rayfuse.io import load_params
from rayfuse.method import Method, MethodParams, MethodResult, MethodTags, Update, client_step
from rayfuse.metrics import compute_metrics
from rayfuse.models import build_model, get_params, predict_proba, set_params
from rayfuse.runner import prepare_run

# Three clients, three architectures: client 0 an mlp, client 1 a cnn, client 2 (not overridden) the run's rescnn.
HETERO: dict = {
    "run": {"name": "hetero", "seed": 0},
    "data": {"dataset": "digits"},
    "partition": {"method": "iid", "num_clients": 3},
    "model": {"name": "rescnn", "channels": [8, 16]},
    "train": {"epochs": 2},
    "federation": {
        "backend": "local",
        "client_overrides": {0: {"model": {"name": "mlp", "hidden": [32]}}, 1: {"model": {"name": "cnn", "channels": [8, 16]}}},
    },
    "methods": {"local": {}, "ensemble": {}},
}
NAMES = ["mlp", "cnn", "rescnn"]


def config(tmp_path, **sections):
    data = {**HETERO, "run": {**HETERO["run"], "storage": str(tmp_path / "runs")}, **sections}
    return validate_config(data)


def layout(params: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(np.shape(v)) for k, v in params.items()}


def test_the_config_gives_each_client_its_model(tmp_path):
    cfg = config(tmp_path)
    assert [m.name for m in cfg.client_models()] == NAMES
    assert cfg.client_model(2) is cfg.model and cfg.heterogeneous_clients
    assert not validate_config({**HETERO, "federation": {}}).heterogeneous_clients
    # an override repeating the run's model is not another architecture
    same = {"federation": {"client_overrides": {1: {"model": HETERO["model"]}}}}
    assert not validate_config({**HETERO, **same}).heterogeneous_clients


def test_local_and_ensemble_score_each_client_in_its_own_architecture(tmp_path):
    cache = tmp_path / "cache"
    cfg = config(tmp_path, run={"name": "hetero", "seed": 0, "model_cache": str(cache)}, evaluation="both")
    result = rayfuse.run(cfg, run_dir=tmp_path / "a", quiet=True)
    assert result.results["status"] == "succeeded"

    # each client's trained local model has its own architecture's parameter layout
    prepared = prepare_run(cfg)
    plan = prepared.plan
    shape, classes = tuple(plan.input_shape), plan.num_classes
    params = {c: load_params(result.run_dir / "checkpoints" / "local" / f"client-{c}.safetensors") for c in range(3)}
    for c in range(3):
        assert layout(params[c]) == layout(get_params(build_model(cfg.client_model(c), shape, classes, seed=0)))
    assert len({tuple(sorted(layout(params[c]).items())) for c in range(3)}) == 3  # three layouts

    # the per-client `local` metrics are those of each client's model, built in its own architecture: on the server's
    # test set and (federated) on the clients' held-out splits together
    dataset = load_dataset_from_config(cfg.data)
    test, _ = server_splits(dataset, plan)
    vals = [client_splits(dataset, plan.for_client(c))[1] for c in range(3)]
    held_out_X, held_out_y = np.concatenate([v.X for v in vals]), np.concatenate([v.y for v in vals])
    models = {c: set_params(build_model(cfg.client_model(c), shape, classes), params[c]) for c in range(3)}
    per_client = {row["client"]: row for row in result.results["methods"]["local"]["info"]["per_client"]}
    assert sorted(per_client) == [0, 1, 2]
    for c in range(3):
        central = compute_metrics(predict_proba(models[c], test.X), test.y)
        federated = compute_metrics(predict_proba(models[c], held_out_X), held_out_y)
        assert per_client[c]["accuracy"] == pytest.approx(central["accuracy"])
        assert per_client[c]["nll"] == pytest.approx(central["nll"], rel=1e-5)
        assert per_client[c]["federated_accuracy"] == pytest.approx(federated["accuracy"])

    # the ensemble averages the three architectures' probabilities (uniform weights)
    ensemble = result.results["methods"]["ensemble"]
    proba = np.mean([predict_proba(models[c], test.X) for c in range(3)], axis=0)
    held_out = np.mean([predict_proba(models[c], held_out_X) for c in range(3)], axis=0)
    assert ensemble["accuracy"] == pytest.approx(compute_metrics(proba, test.y)["accuracy"])
    assert ensemble["federated_accuracy"] == pytest.approx(compute_metrics(held_out, held_out_y)["accuracy"])

    # the header names the clients' models
    assert prepared.describe_models().startswith("model rescnn (")
    assert "client 0 mlp" in prepared.describe_models() and "client 1 cnn" in prepared.describe_models()


def test_the_local_model_cache_keys_each_client_by_its_own_model(tmp_path):
    from rayfuse.client import Client

    cache = tmp_path / "cache"
    cfg = config(tmp_path, run={"name": "hetero", "seed": 0, "model_cache": str(cache)}, methods={"local": {}})
    first = rayfuse.run(cfg, run_dir=tmp_path / "a", quiet=True).results
    assert sum(e["kind"] == "client_trained" for e in first["events"]) == 3
    keys = next(e["keys"] for e in first["events"] if e["kind"] == "local_models_cached")  # the coordinator's keys
    assert len(set(keys.values())) == 3
    plan = prepare_run(cfg).plan
    for c in range(3):  # each entry is keyed by its client's model, and the client computes the coordinator's key
        recorded = json.loads((cache / "local-models" / keys[str(c)] / "key.json").read_text())
        assert recorded["client"] == c and recorded["model"]["name"] == NAMES[c]
        client = Client(
            c,
            plan.for_client(c),
            data_cfg=cfg.data,
            model_cfg=cfg.client_model(c),
            train_cfg=cfg.train,
            seed=cfg.run.seed,
            local_cache=str(cache),
        )
        assert client.ctx.local_model_key()[0] == keys[str(c)]
    # the same clients with the run's model for everyone: other keys for clients 0 and 1, the same for client 2
    homogeneous = config(
        tmp_path, run={"name": "hetero", "seed": 0, "model_cache": str(cache)}, methods={"local": {}}, federation={"backend": "local"}
    )
    again = rayfuse.run(homogeneous, run_dir=tmp_path / "b", quiet=True).results
    assert sorted(e["client"] for e in again["events"] if e["kind"] == "client_trained") == [0, 1]
    # a second run of the heterogeneous clients restores every client's model instead of retraining
    second = rayfuse.run(
        config(tmp_path, run={"name": "other", "seed": 0, "model_cache": str(cache)}, methods={"local": {}, "ensemble": {}}),
        run_dir=tmp_path / "c",
        quiet=True,
    ).results
    assert not any(e["kind"] == "client_trained" for e in second["events"])
    assert [(e["source"], e["clients"]) for e in second["events"] if e["kind"] == "local_models_restored"] == [("cache", [0, 1, 2])]
    assert second["methods"]["local"]["accuracy"] == first["methods"]["local"]["accuracy"]


@pytest.mark.parametrize("method", ["average", "aligned", "fedavg"])
def test_methods_that_combine_weights_are_refused_before_anything_starts(tmp_path, capsys, method):
    cfg = config(tmp_path, methods={"local": {}, method: {}})
    with pytest.raises(InputError) as raised:
        prepare_run(cfg)
    assert raised.value.path == "federation.client_overrides"
    assert str(raised.value).startswith(f"federation.client_overrides: expected clients of one architecture for method {method!r}")
    assert "got clients 1, 2 with models other than client 0's" in str(raised.value)
    # the command line: exit 2, one line, no run folder
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump({**HETERO, "run": {"name": "x", "storage": str(tmp_path / "runs")}, "methods": {"local": {}, method: {}}})
    )
    capsys.readouterr()
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "federation.client_overrides: expected clients of one architecture" in err
    assert not (tmp_path / "runs").exists()


def test_clients_of_one_other_architecture_than_the_servers_are_refused_for_weight_methods(tmp_path):
    everyone = {"client_overrides": {c: {"model": {"name": "mlp", "hidden": [8]}} for c in range(3)}}
    with pytest.raises(
        InputError,
        match=r"^federation\.client_overrides: expected clients of the run's architecture \(model: rescnn\) "
        r"for method 'fedavg'.*got every client with model mlp",
    ):
        prepare_run(config(tmp_path, federation=everyone, methods={"fedavg": {}}))


@pytest.mark.parametrize(
    ("override", "path"),
    [
        pytest.param(
            {"name": "transformer", "patch_size": 3},
            r"federation\.client_overrides\.1\.model\.patch_size: expected a divisor",
            id="does-not-fit-the-data",
        ),
        pytest.param(
            {"name": "custom"},
            r"federation\.client_overrides\.1\.model\.name: expected a model a config file can build",
            id="custom-in-a-config-file",
        ),
        pytest.param(
            {"name": "mlp", "hidden": [10**9, 10**9]},
            r"federation\.client_overrides\.1\.model\.hidden: expected a model that fits in memory",
            id="too-large",
        ),
    ],
)
def test_a_client_model_is_checked_against_the_data_like_the_runs(tmp_path, override, path):
    with pytest.raises(InputError, match="^" + path):
        prepare_run(config(tmp_path, federation={"client_overrides": {1: {"model": override}}}))


def test_train_dp_checks_every_clients_model(tmp_path):
    dp = {"epochs": 1, "dp": {"noise_multiplier": 1.0}}
    overrides = {"client_overrides": {1: {"model": {"name": "rescnn"}}}}
    with pytest.raises(
        InputError, match=r"^train\.dp: .*client 1's model 'rescnn' \(federation\.client_overrides\.1\.model\) has stem\.bn"
    ):
        prepare_run(config(tmp_path, model={"name": "mlp", "hidden": [8]}, train=dp, federation=overrides, methods={"local": {}}))


def test_an_unknown_model_name_in_an_override_is_one_line_naming_its_key(tmp_path):
    with pytest.raises(InputError, match=r"^federation\.client_overrides\.1\.model\.name: expected a model in .*did you mean 'cnn'\?$"):
        config(tmp_path, federation={"client_overrides": {1: {"model": {"name": "cnnn"}}}})


def test_a_model_only_override_works_with_packed_actors_and_round_trips(tmp_path):
    from rayfuse.config import dump_config, load_config
    from rayfuse.method import resolved_config

    cfg = config(tmp_path, federation={"clients_per_actor": 2, "client_overrides": HETERO["federation"]["client_overrides"]})
    assert cfg.federation.client_resources(0) == cfg.federation.clients
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(resolved_config(cfg)))
    dumped = yaml.safe_load(path.read_text())["federation"]["client_overrides"]
    assert set(dumped["0"]) == {"model"}  # only the keys given: it reads back as a model-only override
    assert load_config(path).client_models() == cfg.client_models()
    with pytest.raises(
        InputError,
        match=r"^federation\.clients_per_actor: expected 1 when federation\.client_overrides gives clients "
        r"their own resources",
    ):
        config(tmp_path, federation={"clients_per_actor": 2, "client_overrides": {0: {"num_gpus": 0.5, "model": {"name": "cnn"}}}})


# ---------------------------------------------------------------------------------------------------------------
# rayfuse.run(model={client: factory, ..., "default": factory})


class Wide(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.wide = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 24), nn.ReLU(), nn.Linear(24, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x)


class Narrow(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.narrow = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 6), nn.Tanh(), nn.Linear(6, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.narrow(x)


def linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes))


FACTORIES = {0: Wide, 1: Narrow, "default": linear}
PREFIX = {0: "wide.", 1: "narrow.", 2: "1."}  # each factory's parameter names (client 2 takes the default)


@client_step("test_heterogeneous.probe")
def probe(ctx) -> Update:
    """The client's trained local model, and whether this process imported the test module (it should not need to)."""
    return Update(
        get_params(ctx.local_model()), ctx.num_examples, {"imported": float("tests.fusion.test_heterogeneous_clients" in sys.modules)}
    )


class Probe(Method[MethodParams, None]):
    """Each client's local model, accepted against its own model's layout and scored in its own architecture."""

    tags = MethodTags(uses_local_models=True, heterogeneous_clients=True)

    def run(self, server) -> MethodResult:
        updates = server.updates.accept(server.federation.run(probe))
        metrics = {
            f"accuracy_{c}": server.scoring.evaluate(u.params, model=server.models.client_model(c))["accuracy"] for c, u in updates.items()
        }
        layouts = {str(c): sorted(u.params) for c, u in updates.items()}
        imported = max(u.metrics["imported"] for u in updates.values())
        return MethodResult(metrics, info={"layouts": layouts, "imported": imported, "clients": sorted(updates)})


def _check_factories_run(result, clients: int) -> None:
    assert result.results["status"] == "succeeded"
    info = result.results["methods"]["probe"]["info"]
    assert info["clients"] == list(range(clients))
    for c in range(clients):
        assert all(k.startswith(PREFIX[c]) for k in info["layouts"][str(c)]), info["layouts"][str(c)]
        assert 0 <= result.metrics.loc["probe", f"accuracy_{c}"] <= 1
    recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert recorded["model"]["factory"] == "tests.fusion.test_heterogeneous_clients.linear"
    assert {k: v["model"]["factory"] for k, v in recorded["federation"]["client_overrides"].items()} == {
        "0": "tests.fusion.test_heterogeneous_clients.Wide",
        "1": "tests.fusion.test_heterogeneous_clients.Narrow",
    }


def test_a_mapping_of_model_factories_gives_clients_their_own_models(tmp_path):
    base = {k: v for k, v in HETERO.items() if k not in ("federation", "methods", "model")}
    result = rayfuse.run(
        {**base, "federation": {"backend": "local"}},
        model=FACTORIES,
        methods={"probe": Probe, "ensemble": "ensemble"},
        run_dir=tmp_path / "run",
        quiet=True,
    )
    _check_factories_run(result, 3)
    assert 0 < result.metrics.loc["ensemble", "accuracy"] <= 1


@pytest.mark.parametrize(
    ("model", "match"),
    [
        pytest.param(
            {3: Wide},
            r"^model\[3\]: expected a client id in 0\.\.2 \(partition\.num_clients is 3\) or 'default', got 3",
            id="id-out-of-range",
        ),
        pytest.param({"defualt": Wide}, r"^model\['defualt'\]: expected a client id in 0\.\.2", id="misspelt-default"),
        pytest.param({"0": Wide}, r"^model\['0'\]: expected a client id", id="id-as-text"),
        pytest.param({0: 42}, r"^model\[0\]: expected a callable returning an nn\.Module", id="not-callable"),
        pytest.param({"default": "mlp"}, r"^model\['default'\]: expected a callable", id="default-not-callable"),
        pytest.param({}, r"^model: expected a model factory, or a mapping", id="empty"),
    ],
)
def test_a_bad_model_mapping_is_one_line_naming_its_key(tmp_path, model, match):
    with pytest.raises(InputError, match=match):
        rayfuse.run({**HETERO, "federation": {"backend": "local"}}, model=model, run_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.ray
def test_on_ray_client_model_factories_reach_packed_actors_by_value(ray_session, tmp_path):
    base = {k: v for k, v in HETERO.items() if k not in ("federation", "methods", "model")}
    # three clients on two actors (clients 0 and 1 share one): model-only overrides are allowed with packed actors
    cfg = {**base, "train": {"epochs": 1}, "federation": {"backend": "ray", "clients_per_actor": 2}}
    result = rayfuse.run(cfg, model=FACTORIES, methods={"probe": Probe}, run_dir=tmp_path / "run", quiet=True)
    _check_factories_run(result, 3)
    assert result.results["run"]["backend"] == "ray"
    # the factories and the client step travelled by value: no client imported this module to unpickle them
    assert result.results["methods"]["probe"]["info"]["imported"] == 0.0


def test_a_run_given_client_model_factories_cannot_be_resumed_from_the_command_line(tmp_path):
    from rayfuse.api import resume

    base = {k: v for k, v in HETERO.items() if k not in ("federation", "methods", "model")}
    result = rayfuse.run(
        {**base, "train": {"epochs": 1}, "federation": {"backend": "local"}},
        model={1: Narrow},
        methods={"local": "local"},
        run_dir=tmp_path / "run",
        quiet=True,
    )
    with pytest.raises(InputError, match=r"^--resume: .*federation\.client_overrides\.1\.model\.name: custom \(tests\..*cannot be resumed"):
        resume(result.run_dir)
