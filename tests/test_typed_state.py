"""One way to keep round state: the FedAvg family's typed round states (FedAvg, FedOpt, FedRef) round-trip bit for bit
through a round checkpoint; fedadam and fedref resumed after an interruption end exactly as an uninterrupted run; the
EP-GAN oracle, now on the round loop, resumes after its last block of epochs; a checkpoint of an older layout is
refused on resume with one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from rayfuse.errors import InputError
from rayfuse.federation import Update
from rayfuse.fusion.fedavg.algorithm import FedAvg, FedAvgState
from rayfuse.fusion.fedavg.fedopt import FedAdam, FedOptState, FedYogi
from rayfuse.fusion.fedref.algorithm import FedRef, FedRefState
from rayfuse.io import load_params
from rayfuse.rounds import decode_state, encode_state
from rayfuse.store import Checkpointer
from tests.helpers import prepared_coordinator


@pytest.fixture
def coordinator(make_config, tmp_path):
    """A coordinator over in-process clients for a tiny config (``folder`` names its run folder)."""

    def build(folder="run", **sections):
        return prepared_coordinator(make_config(**sections), tmp_path / folder)

    return build


def same_bits(a, b) -> bool:
    """Equal dtype, shape and bytes (NaN included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def same_state(a, b) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict) and x and all(isinstance(v, (np.ndarray, np.generic)) for v in x.values()):  # 0-d: a numpy scalar
            assert x.keys() == y.keys() and all(same_bits(x[k], y[k]) for k in x), f.name
        elif isinstance(x, list) and x:
            assert len(x) == len(y) and all(p.keys() == q.keys() and all(same_bits(p[k], q[k]) for k in p) for p, q in zip(x, y)), f.name
        elif isinstance(x, float):
            assert isinstance(y, float) and same_bits(x, y), f.name
        else:
            assert x == y, f.name


def through_a_checkpoint(state, template, tmp_path):
    """``state`` written as a round checkpoint (a safetensors file and latest.json) and read back on ``template``."""
    params, arrays, meta = encode_state(state)
    folder = tmp_path / "checkpoint"
    folder.mkdir(exist_ok=True)
    Checkpointer(folder).save(3, params, arrays, meta)
    saved = Checkpointer(folder).load()
    assert saved is not None and saved.round == 3
    return decode_state(template, saved.params, saved.state, saved.meta)


def model(rng, dtype=np.float32):
    return {"w": rng.normal(size=(3, 2)).astype(dtype), "b": rng.normal(size=4).astype(dtype), "n": np.array(7, np.int64)}


def losses(rng):
    return {i: Update({}, 10, {"train_loss": float(v)}) for i, v in enumerate(rng.uniform(0.1, 2.0, size=3))}


def drive(method, steps, seed=0):
    rng = np.random.default_rng(seed)
    state = method.initial_state(model(rng))
    for r in range(1, steps + 1):
        state.params = method.server_update(None, state, model(rng), losses(rng), r)
    return state


# ---------------------------------------------------------------------------------------------------------------
# Bit for bit through a checkpoint


def test_fedavg_state_round_trips_bit_for_bit(tmp_path):
    state = FedAvgState(model(np.random.default_rng(1)))  # central DP's clip norm is the round loop's, not the method's
    back = through_a_checkpoint(state, FedAvg().initial_state({}), tmp_path)
    same_state(state, back)


@pytest.mark.parametrize("cls", [FedAdam, FedYogi])
def test_fedopt_state_round_trips_bit_for_bit(cls, tmp_path):
    method = cls(cls.Params.model_validate({"bias_correction": cls is FedAdam}))
    state = drive(method, 3)
    assert isinstance(state, FedOptState) and state.steps == 3 and set(state.m) == {"w", "b"}  # float keys only
    back = through_a_checkpoint(state, method.initial_state({}), tmp_path)
    same_state(state, back)
    # the restored moments continue exactly: one more step from each gives the same model
    rng = np.random.default_rng(9)
    averaged = model(rng)
    a = method.server_update(None, state, {k: v.copy() for k, v in averaged.items()}, {}, 4)
    b = method.server_update(None, back, {k: v.copy() for k, v in averaged.items()}, {}, 4)
    assert all(same_bits(a[k], b[k]) for k in a)


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_fedref_state_round_trips_bit_for_bit(steps, tmp_path):
    method = FedRef(FedRef.Params.model_validate({"p": 3, "lam": 0.1, "lr": 0.05}))
    state = drive(method, steps)
    assert isinstance(state, FedRefState) and len(state.queue) == min(steps, 3) and state.seen == steps
    assert (state.theta2_prev is None) == (steps <= 3)
    back = through_a_checkpoint(state, method.initial_state({}), tmp_path)
    same_state(state, back)
    rng = np.random.default_rng(9)
    averaged, reported = model(rng), losses(rng)
    a = method.server_update(None, state, averaged, reported, steps + 1)
    b = method.server_update(None, back, averaged, reported, steps + 1)
    assert all(same_bits(a[k], b[k]) for k in a)
    same_state(state, back)  # the queues' running sums moved on identically


def test_a_fresh_fedref_state_with_a_nan_loss_round_trips(tmp_path):
    state = FedRef().initial_state(model(np.random.default_rng(2)))
    assert np.isnan(state.loss_prev)
    same_state(state, through_a_checkpoint(state, FedRef().initial_state({}), tmp_path))


# ---------------------------------------------------------------------------------------------------------------
# Resume after an interruption equals the uninterrupted run


class Stop(Exception):
    pass


@pytest.mark.parametrize("method,extra", [("fedadam", {"bias_correction": True}), ("fedref", {"p": 2, "lam": 0.05})])
def test_resume_after_an_interrupted_server_step_equals_the_uninterrupted_run(coordinator, monkeypatch, method, extra):
    methods = {method: {"rounds": 5, "local_epochs": 1, **extra}}
    straight_coord = coordinator("straight", methods=methods)
    straight = straight_coord.run_method(method)
    cls = type(straight_coord.specs[0].build())
    update, calls = cls.server_update, []

    def stop_in_round_4(self, *args, **kwargs):  # as if the server were killed during round 4's step
        calls.append(1)
        if len(calls) == 4:
            raise Stop
        return update(self, *args, **kwargs)

    monkeypatch.setattr(cls, "server_update", stop_in_round_4)
    with pytest.raises(Stop):
        coordinator("interrupted", methods=methods).run_method(method)
    monkeypatch.setattr(cls, "server_update", update)
    coord = coordinator("interrupted", methods=methods)
    resumed = coord.run_method(method, resume=True)
    assert any(e["kind"] == "resumed" and e["round"] == 3 for e in coord.events.since(0))
    assert resumed["metrics"] == straight["metrics"]
    deterministic = [r for r in straight["history"] if r["metric"] != "client_seconds"]
    assert [r for r in resumed["history"] if r["metric"] != "client_seconds"] == deterministic
    a = load_params(straight_coord.store.root / straight["model_file"])
    b = load_params(coord.store.root / resumed["model_file"])
    assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    # the last round checkpoints hold the same state, bit for bit
    last_a, last_b = straight_coord.store.checkpointer(method).load(), coord.store.checkpointer(method).load()
    assert last_a.round == last_b.round == 5 and last_a.state.keys() == last_b.state.keys()
    assert all(same_bits(last_a.state[k], last_b.state[k]) for k in last_a.state)


# ---------------------------------------------------------------------------------------------------------------
# The EP-GAN oracle on the round loop

TOY = {
    "data": {"dataset": "gaussians4", "options": {"n_per_mode": 120}, "val_size": 0.0},
    "partition": {"method": "labels", "num_clients": 4, "groups": [[0], [1], [2], [3]]},
}
ORACLE = {
    "oracle": {
        "method": "epgan-oracle",
        "backbone": "ep-probgan",
        "epochs": 5,
        "local_epochs": 2,
        "batch_size": 32,
        "grid": 20,
        "eval_samples": 200,
    }
}


def test_the_epgan_oracle_resumes_after_its_last_block_of_epochs(coordinator, monkeypatch):
    straight_coord = coordinator("straight", **TOY, methods=ORACLE)
    straight = straight_coord.run_method("oracle")
    # blocks of 2 epochs and the last: rounds are epochs done (2, 4, 5), each evaluated and checkpointed
    assert sorted({r["round"] for r in straight["history"]}) == [2, 4, 5]
    assert [e["message"] for e in straight_coord.events.since(0) if e["kind"] == "progress"] == ["epoch 2/5", "epoch 4/5", "epoch 5/5"]
    from rayfuse.fusion.epgan import nets

    train, calls = nets.GANTrainer.train, []

    def stop_in_the_last_block(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise Stop
        return train(self, *args, **kwargs)

    monkeypatch.setattr(nets.GANTrainer, "train", stop_in_the_last_block)
    with pytest.raises(Stop):
        coordinator("interrupted", **TOY, methods=ORACLE).run_method("oracle")
    assert [c[1] for c in calls] == [2, 2, 1]  # epochs per block
    monkeypatch.setattr(nets.GANTrainer, "train", train)
    coord = coordinator("interrupted", **TOY, methods=ORACLE)
    resumed = coord.run_method("oracle", resume=True)
    assert any(e["kind"] == "resumed" and e["round"] == 4 for e in coord.events.since(0))
    assert [e["message"] for e in coord.events.since(0) if e["kind"] == "progress"] == ["epoch 5/5"]
    assert resumed["metrics"] == straight["metrics"]
    a = load_params(straight_coord.store.root / straight["model_file"])
    b = load_params(coord.store.root / resumed["model_file"])
    assert all(same_bits(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------------------
# Older checkpoint layouts: refused on resume, one line


def _old_checkpoint(coord, label, round, params, state, meta):
    coord.store.checkpointer(label).save(round, params, state, meta)


def test_a_fedadam_checkpoint_of_the_string_prefixed_layout_is_refused_on_resume(coordinator):
    methods = {"fedadam": {"rounds": 3, "local_epochs": 1}}
    coord = coordinator(methods=methods)
    params = coord.reference_params()
    old = {f"server/m/{k}": np.zeros_like(v) for k, v in params.items()}
    old["server/steps"] = np.array(1, np.int64)
    _old_checkpoint(coord, "fedadam", 1, params, old, {"dp": {}, "state_arrays": {"server": "dict"}, "metrics": {}, "store": None})
    with pytest.raises(InputError) as raised:
        coordinator(methods=methods).run_method("fedadam", resume=True)
    message = str(raised.value)
    assert raised.value.path == "checkpoints/fedadam" and "\n" not in message
    assert message.startswith(
        "checkpoints/fedadam: expected a round checkpoint of FedOptState's fields, not the FedAvg family's "
        "older layout (server state as string-prefixed 'server/...' arrays), got "
    )


def test_an_epgan_oracle_checkpoint_of_its_own_loop_is_refused_on_resume(coordinator):
    coord = coordinator(**TOY, methods=ORACLE)
    _old_checkpoint(coord, "oracle", 2, {"g": np.zeros(2, np.float32)}, {"state/step": np.array(3)}, {"metrics": {}, "losses": {}})
    with pytest.raises(InputError) as raised:
        coordinator(**TOY, methods=ORACLE).run_method("oracle", resume=True)
    assert raised.value.path == "checkpoints/oracle" and "epgan-oracle's older layout" in str(raised.value)


def test_a_fedavg_checkpoint_records_the_typed_fields_only(coordinator):
    methods = {"fedadam": {"rounds": 2, "local_epochs": 1}}
    coord = coordinator(methods=methods)
    coord.run_method("fedadam")
    record = json.loads((coord.store.root / "checkpoints" / "fedadam" / "latest.json").read_text())
    assert record["meta"]["state_arrays"] == {"m": "dict", "v": "dict"} and record["meta"]["steps"] == 2
    saved = coord.store.checkpointer("fedadam").load()
    assert not [k for k in saved.state if k.startswith("server/")]
