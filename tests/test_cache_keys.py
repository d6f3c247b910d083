"""The local model's cache key is an explicit, versioned projection of what the model depends on
(rayfuse.store.local_model_inputs), not a hash of the config sections' dumps: a field a section gains later leaves every
cached local model's key alone, a setting of training changes it."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import Field

from rayfuse import store
from rayfuse.config import DataConfig, DPSGDConfig, ModelConfig, PartitionConfig, SiloSpec, TrainConfig, dump_config, validate_config
from rayfuse.method import resolved_config
from rayfuse.store import local_model_inputs, local_model_key, step_result_key


def _plan(cfg, client=0):
    from rayfuse.data.roles import load_dataset_from_config, make_plan

    return make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed).for_client(client)


@pytest.fixture()
def keyed(make_config):
    cfg = make_config()
    return cfg, resolved_config(cfg), _plan(cfg)


class _TrainWithANewKnob(TrainConfig):
    """``train`` as a later version might have it: one more field, whose default keeps today's training."""

    warmup_epochs: int = Field(0, ge=0)


class _ModelWithANewKnob(ModelConfig):
    norm: str | None = None


def test_a_new_defaulted_train_field_leaves_the_key_alone(keyed) -> None:
    cfg, config, plan = keyed
    key = local_model_key(config, plan)[0]
    later = _TrainWithANewKnob(**cfg.train.model_dump())
    dumped = later.model_dump(mode="json")
    assert dumped["warmup_epochs"] == 0  # the dump has the new field...
    assert local_model_key({**config, "train": dumped}, plan)[0] == key  # ...the key does not
    later_model = _ModelWithANewKnob(**cfg.model.model_dump()).model_dump(mode="json")
    assert local_model_key({**config, "model": later_model}, plan)[0] == key
    assert local_model_key({**config, "data": {**config["data"], "new_data_knob": 1}}, plan)[0] == key


@pytest.mark.parametrize(
    "section, change",
    [
        ("train", {"lr": 0.01}),
        ("train", {"epochs": 7}),
        ("train", {"optimizer": "sgd"}),
        ("train", {"dp": {"noise_multiplier": 1.0}}),
        ("model", {"hidden": [8]}),
        ("data", {"val_size": 0.2}),
    ],
)
def test_a_setting_of_training_changes_the_key(keyed, section, change) -> None:
    cfg, config, plan = keyed
    changed = {**config, section: {**config[section], **change}}
    if section == "train" and "dp" in change:
        changed["train"]["dp"] = DPSGDConfig(**change["dp"]).model_dump(mode="json")
    assert local_model_key(changed, plan)[0] != local_model_key(config, plan)[0]


def test_the_key_names_its_version(keyed, monkeypatch) -> None:
    _, config, plan = keyed
    key, inputs = local_model_key(config, plan)
    assert inputs["version"] == store.KEY_VERSION
    json.dumps(inputs)  # written as key.json
    monkeypatch.setattr(store, "KEY_VERSION", store.KEY_VERSION + 1)
    assert local_model_key(config, plan)[0] != key
    assert step_result_key(config, "p", "fit", (), {})[1]["version"] == store.KEY_VERSION


def test_the_key_covers_named_fields_only(keyed) -> None:
    _, config, plan = keyed
    inputs = local_model_inputs(config, plan)
    assert set(inputs["train"]) == set(store.TRAIN_KEY_FIELDS)
    assert set(inputs["model"]) == set(store.MODEL_KEY_FIELDS)
    assert set(inputs["data"]) <= set(store.DATA_KEY_FIELDS)


# Every field a section has today is placed: keyed (it changes what is trained), or listed here as not keyed with the
# reason. A new field fails this test until it is placed, so no field enters or leaves the key unnoticed.
NOT_KEYED = {
    # the server's sets: local training never reads them (they are in a step result's key, run_inputs)
    "data": {"target", "test", "public"},
}


@pytest.mark.parametrize(
    "model, keyed_fields, section",
    [
        (TrainConfig, store.TRAIN_KEY_FIELDS, "train"),
        (DPSGDConfig, store.DP_KEY_FIELDS, "dp"),
        (ModelConfig, store.MODEL_KEY_FIELDS, "model"),
        (PartitionConfig, store.PARTITION_KEY_FIELDS, "partition"),
        (SiloSpec, (*store.SILO_KEY_FIELDS, "path", "test_path", "text"), "silo"),  # the paths: by the silo's content hash
        (DataConfig, (*store.DATA_KEY_FIELDS, *store.SILO_DATA_KEY_FIELDS, *store.TEXT_KEY_FIELDS), "data"),
    ],
)
def test_every_field_of_a_section_is_placed(model, keyed_fields, section) -> None:
    assert set(model.model_fields) == set(keyed_fields) | NOT_KEYED.get(section, set())


def test_a_dump_without_defaults_and_one_with_them_key_alike(keyed) -> None:
    # train.dp unset: absent from a hand-written section, null in a dump; one key
    _, config, plan = keyed
    without = {**config, "train": {k: v for k, v in config["train"].items() if k != "dp"}}
    assert config["train"]["dp"] is None
    assert local_model_key(without, plan)[0] == local_model_key(config, plan)[0]


def test_the_resolved_config_reads_back_the_same(make_config) -> None:
    # the dump lists every default (no hook hides one for old dumps) and validates again to the same config
    cfg = make_config()
    resolved = resolved_config(cfg)
    assert resolved["evaluation"] == "central" and resolved["train"]["dp"] is None and resolved["data"]["layout"] == "auto"
    again = validate_config(yaml.safe_load(dump_config(resolved)))
    assert resolved_config(again) == resolved


def test_a_silo_config_dump_reads_back_the_same(tmp_path) -> None:
    silos = [{"dataset": "npz", "path": str(tmp_path / f"s{i}.npz")} for i in range(2)]
    cfg = validate_config({"data": {"silos": silos}, "methods": ["local"]})
    resolved = resolved_config(cfg)
    assert resolved["partition"] == {"num_clients": 2}
    assert resolved["data"]["silos"][0]["labels"] is True
    assert resolved_config(validate_config(yaml.safe_load(dump_config(resolved)))) == resolved


def test_a_run_folder_whose_dump_left_defaults_out_still_resumes(make_config, tmp_path) -> None:
    """config.yaml as the version before wrote it (evaluation, train.dp, data.layout left out at their defaults), with
    identity.json and partition.json recording that text: read back, it is the same config, and --resume goes on;
    another config is still refused."""
    import hashlib

    from rayfuse.errors import InputError
    from rayfuse.report import Printer
    from rayfuse.runner import IDENTITY_FILE, InProcessBackend, _state_digest, load_run_config, run_experiment

    def run(cfg, resume=False):
        return run_experiment(cfg, InProcessBackend(), tmp_path / "run", resume=resume, printer=Printer(enabled=False), show_tables=False)

    first = run(make_config(methods={"average": {}}))
    folder = tmp_path / "run"
    old = yaml.safe_load((folder / "config.yaml").read_text())
    del old["evaluation"], old["train"]["dp"], old["data"]["layout"]
    text = dump_config(old)
    (folder / "config.yaml").write_text(text)
    identity = json.loads((folder / IDENTITY_FILE).read_text())
    (folder / IDENTITY_FILE).write_text(json.dumps({**identity, "config": _state_digest(old)}))
    manifest = json.loads((folder / "partition.json").read_text())
    (folder / "partition.json").write_text(json.dumps({**manifest, "config_sha256": hashlib.sha256(text.encode()).hexdigest()}))
    resumed = run(load_run_config(folder), resume=True)
    assert resumed["methods"]["average"]["accuracy"] == first["methods"]["average"]["accuracy"]
    assert [e["method"] for e in resumed["events"] if e["kind"] == "info" and "loaded from state/" in e.get("message", "")] == ["average"]
    with pytest.raises(InputError, match="train.lr"):
        run(make_config(methods={"average": {}}, train={"lr": 0.123}), resume=True)
