"""The round loop (``server.rounds``), typed round state, state clients keep across rounds, and the rejection path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from rayfuse.client import Client
from rayfuse.coordinator import Coordinator, MethodServer
from rayfuse.data.roles import load_dataset_from_config, make_plan
from rayfuse.errors import RunFailure
from rayfuse.federation import EventLog, FailurePolicy, InProcessFederation
from rayfuse.method import (
    ClientContext,
    ClientRounds,
    Gathered,
    KeptState,
    Method,
    MethodParams,
    MethodResult,
    MethodSpec,
    MethodTags,
    Rejected,
    ServerContext,
    client_step,
    transient,
)
from rayfuse.rounds import decode_state, encode_state

# -- a small stateful method: each client keeps a running sum across rounds, the server a seeded noise and the total --

SUMS = KeptState("test-sums", "running sums", item="running sum")


@client_step("test.accumulate")
def accumulate(ctx: ClientContext, value: float, *, label: str, round: int, held: int | None, store: str | None) -> np.ndarray:
    total = SUMS.take(ctx, label, held, store, fresh=lambda: np.zeros(3), load=lambda arrays: arrays["total"])
    total = total + value * (ctx.client_id + 1) + np.random.default_rng(ctx.step_seed(label, round)).normal(size=3)
    SUMS.keep(ctx, label, total, round, store, previous=held, arrays=lambda t: {"total": t})
    return total


class CountingParams(MethodParams):
    rounds: int = 5


@dataclass
class CountingState:
    params: dict[str, np.ndarray]
    noise: float = 0.0
    noises: list[float] = field(default_factory=list)
    held: ClientRounds = field(default_factory=SUMS.rounds)
    scratch: Any = transient()


class Counting(Method[CountingParams, CountingState]):
    name = "counting"
    Params = CountingParams
    tags = MethodTags(multi_round=True)
    fail_at: int | None = None  # a round that raises (an interrupted run)

    def run(self, server: ServerContext) -> MethodResult:
        fed = server.federation
        rounds = server.rounds(
            CountingState({"sum": np.zeros(3)}),
            last=self.params.rounds,
            evaluate_every=2,
            evaluate=lambda rnd: {"norm": float(np.linalg.norm(state.params["sum"]))},
        )
        state = rounds.state
        for rnd in rounds:
            if rnd == self.fail_at:
                raise RunFailure("interrupted")
            gathered = fed.gather(
                [
                    call
                    for client in fed.client_ids
                    for call in fed.map(
                        accumulate,
                        float(rnd),
                        clients=[client],
                        label=server.label,
                        round=rnd,
                        held=state.held.get(client),
                        store=state.held.store,
                    )
                ]
            )
            state.held.moved(gathered.results, rnd)
            totals = server.updates.accept_replies(gathered, lambda client, total: np.asarray(total))
            state.params = {"sum": np.sum(list(totals.values()), axis=0)}
            state.noise = float(server.rng("noise", rnd).normal())
            state.noises.append(state.noise)
            rounds.log({"clients": float(len(totals)), "noise": state.noise})
        return MethodResult(rounds.metrics, state.params, info={"noises": state.noises})


def _coordinator(make_config, run_dir, cache, fail_at=None):
    cfg = make_config(run={"model_cache": cache}, methods={"fedavg": {}})
    plan = make_plan(load_dataset_from_config(cfg.data), cfg.data, cfg.partition, cfg.run.seed)

    def factory(i, restarted):
        return Client(
            i,
            plan.for_client(i),
            data_cfg=cfg.data,
            model_cfg=cfg.model,
            train_cfg=cfg.train,
            seed=cfg.run.seed,
            restarted=restarted,
            local_cache=cfg.run.model_cache,
        )

    fed = InProcessFederation(factory, plan.num_clients, FailurePolicy.from_config(cfg.federation), EventLog())
    method = type("CountingRun", (Counting,), {"fail_at": fail_at})
    return Coordinator(cfg, plan, str(run_dir), fed, specs=[MethodSpec("count", "counting", method, CountingParams())])


def _interrupted(make_config, tmp_path, cache):
    coord = _coordinator(make_config, tmp_path / "interrupted", cache, fail_at=4)
    with pytest.raises(RunFailure, match="interrupted"):
        coord.run_method("count")
    return _coordinator(make_config, tmp_path / "interrupted", cache)  # new clients: a new process


def _stored(cache):
    return sorted(str(f.relative_to(cache)) for f in cache.glob("client-state/*/test-sums/*/*"))


def _progress(coord):
    return [e["round"] for e in coord.events.since(0) if e["kind"] == "progress"]


def test_a_resumed_loop_equals_the_uninterrupted_one_with_the_state_its_clients_kept(make_config, tmp_path):
    straight = _coordinator(make_config, tmp_path / "straight", None).run_method("count")
    cache = tmp_path / "cache"
    resumed_coord = _interrupted(make_config, tmp_path, str(cache))
    # each client keeps its sum of round 3 and of round 2, the one round 3 started from (nothing older)
    assert sorted({name[-19:] for name in _stored(cache)}) == ["count-00002.safetensors"[-19:], "count-00003.safetensors"[-19:]]
    assert len(_stored(cache)) == 8
    resumed = resumed_coord.run_method("count", resume=True)
    events = resumed_coord.events.since(0)
    assert [e["round"] for e in events if e["kind"] == "resumed"] == [3]
    assert any(e["kind"] == "info" and e["message"] == "4 clients continue from the running sums they kept themselves" for e in events)
    assert not [e for e in events if e["kind"] == "warning"]
    assert _progress(resumed_coord) == [4, 5]  # rounds 1-3 are not redone
    assert resumed["metrics"] == straight["metrics"] and resumed["info"] == straight["info"]
    assert resumed["history"] == straight["history"]
    assert [r["round"] for r in straight["history"] if r["metric"] == "norm"] == [2, 4, 5]  # every 2 rounds and the last
    assert _stored(cache) == []  # the clients forget what they kept once the method is done


def test_a_client_that_lost_its_state_restarts_the_loop_from_scratch_with_a_warning(make_config, tmp_path):
    straight = _coordinator(make_config, tmp_path / "straight", None).run_method("count")
    cache = tmp_path / "cache"
    resumed_coord = _interrupted(make_config, tmp_path, str(cache))
    next((cache / "client-state" / "client-2").rglob("count-00003.safetensors")).unlink()  # client 2 lost round 3
    resumed = resumed_coord.run_method("count", resume=True)
    warnings = [e["message"] for e in resumed_coord.events.since(0) if e["kind"] == "warning"]
    assert warnings == ["restarting from round 0: clients [2] no longer hold their running sums"]
    assert _progress(resumed_coord) == [1, 2, 3, 4, 5]
    assert resumed["metrics"] == straight["metrics"] and resumed["history"] == straight["history"]
    assert _stored(cache) == []  # the old store's leftovers and the new start's sums


def test_without_client_storage_the_loop_restarts_with_a_warning(make_config, tmp_path):
    straight = _coordinator(make_config, tmp_path / "straight", None).run_method("count")
    resumed_coord = _interrupted(make_config, tmp_path, None)
    resumed = resumed_coord.run_method("count", resume=True)
    warnings = [e["message"] for e in resumed_coord.events.since(0) if e["kind"] == "warning"]
    assert len(warnings) == 1 and "run.model_cache" in warnings[0]
    assert resumed["metrics"] == straight["metrics"] and resumed["history"] == straight["history"]


def test_a_typed_round_state_round_trips_through_a_checkpoint():
    kept = KeptState("k", "things")

    @dataclass
    class State:
        params: dict[str, np.ndarray]
        moments: dict[str, np.ndarray] = field(default_factory=dict)
        queue: list[dict[str, np.ndarray]] = field(default_factory=list)
        probs: np.ndarray | None = None
        loss: float = float("nan")
        steps: int = 0
        records: list[dict[str, Any]] = field(default_factory=list)
        pair: tuple[int, int] = (0, 0)
        rounds: ClientRounds = field(default_factory=kept.rounds)
        cache: Any = transient("not saved")

    rng = np.random.default_rng(0)
    state = State(
        {"w": rng.normal(size=(2, 3)).astype(np.float32), "n": np.array(7, np.int64)},
        moments={"w/m": rng.normal(size=(2, 3))},
        queue=[{"a/b": np.arange(3.0)}, {"a/b": np.ones(3)}],
        probs=np.array([0.25, 0.75]),
        loss=float(np.float64(1) / 3),
        steps=4,
        records=[{"round": 1, "p": [0.1]}],
        pair=(2, 3),
        cache="in memory only",
    )
    state.rounds.moved([3, 1], 2)
    params, arrays, meta = encode_state(state)
    assert set(params) == {"w", "n"} and "cache" not in meta
    assert set(arrays) == {"moments/w/m", "queue/0/a/b", "queue/1/a/b", "probs", "loss"}
    assert meta["rounds"] == [[1, 2], [3, 2]]
    back = decode_state(State({}), params, arrays, meta)
    assert back.params.keys() == state.params.keys()
    for k in params:
        assert np.array_equal(back.params[k], state.params[k]), k
        assert back.params[k].dtype == state.params[k].dtype, k
    assert np.array_equal(back.moments["w/m"], state.moments["w/m"]) and back.moments["w/m"].flags.writeable
    assert [q["a/b"].tolist() for q in back.queue] == [[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]
    assert np.array_equal(back.probs, state.probs) and back.loss == state.loss and back.steps == 4
    assert back.records == state.records and back.pair == (2, 3)
    assert isinstance(back.rounds, ClientRounds) and dict(back.rounds) == {1: 2, 3: 2} and back.rounds.kept is kept
    assert back.cache == "not saved"
    nan = decode_state(State({}), *encode_state(State({})))
    assert np.isnan(nan.loss) and nan.probs is None


def test_a_round_state_may_not_use_the_loops_names():
    @dataclass
    class State:
        params: dict[str, np.ndarray]
        metrics: dict[str, float] = field(default_factory=dict)

    with pytest.raises(TypeError, match="metrics"):
        encode_state(State({}))


def test_rejected_replies_are_recorded_once_and_never_used(make_config, tmp_path):
    coord = _coordinator(make_config, tmp_path / "run", None)
    server = MethodServer(coord, coord.specs[0], resume=False)

    def read(client: int, value: float) -> float:
        if not np.isfinite(value):
            raise Rejected(f"non-finite value {value}")
        return value

    kept = server.updates.accept_replies(Gathered({0: 1.0, 1: float("nan"), 2: 3.0}), read)
    assert kept == {0: 1.0, 2: 3.0}
    rejected = [e for e in coord.events.since(0) if e["kind"] == "update_rejected"]
    assert [(e["client"], e["message"]) for e in rejected] == [(1, "non-finite value nan")]
    with pytest.raises(RunFailure, match="1 valid client replies, need 2"):
        server.updates.accept_replies(Gathered({0: 1.0, 1: float("inf")}), read, need=2)
