"""Test helpers that go through the same preparation as a run.

The coordinator does not check a method again when it runs it (``Coordinator.run_method``): a run's checks are made
once, before anything starts, by :func:`rayfuse.runner.prepare_run`. A test that builds a coordinator itself prepares
it with :func:`prepared_coordinator`, so a config the run would refuse is refused here too, the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayfuse.client import Client
from rayfuse.config import ExperimentConfig
from rayfuse.coordinator import Coordinator
from rayfuse.federation import EventLog, FailurePolicy, InProcessFederation
from rayfuse.runner import PreparedRun, prepare_run


def prepared_coordinator(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    *,
    events: EventLog | None = None,
    client: Callable[[PreparedRun, int, bool], Client] | None = None,
) -> Coordinator:
    """A coordinator over in-process clients for ``cfg``, after :func:`rayfuse.runner.prepare_run` (the methods'
    parameters, the model against the data, the split, each method's ``check``: raises :class:`rayfuse.errors.InputError`
    where a run would, before any client exists). ``client(prepared, i, restarted)`` builds client ``i`` (default: the
    run's own client of ``i``: its plan, its model, the run's train config, seed, faults and model cache)."""
    prepared = prepare_run(cfg)
    plan = prepared.plan

    def default(prepared: PreparedRun, i: int, restarted: bool) -> Client:
        return Client(
            i,
            plan.for_client(i),
            data_cfg=cfg.data,
            model_cfg=cfg.client_model(i),
            train_cfg=cfg.train,
            seed=cfg.run.seed,
            faults=cfg.federation.faults,
            restarted=restarted,
            local_cache=cfg.run.model_cache,
        )

    make = client or default

    def factory(i: int, restarted: bool) -> Any:
        return make(prepared, i, restarted)

    fed = InProcessFederation(
        factory, plan.num_clients, FailurePolicy.from_config(cfg.federation), events if events is not None else EventLog()
    )
    return Coordinator(cfg, plan, str(run_dir), fed, specs=prepared.specs)


def recorded_run(cfg: Any, step: str, **run_kwargs: Any) -> tuple[Any, list[tuple[tuple[Any, ...], Any]]]:
    """``rayfuse.run(cfg, backend="local", **run_kwargs)`` recording each call of the client step named ``step`` (e.g.
    ``"fedlora.fit"``): its arguments and its reply, in call order."""
    import pytest

    import rayfuse
    import rayfuse.client as client_module
    from rayfuse.method import step_name

    calls: list[tuple[tuple[Any, ...], Any]] = []
    original = client_module.Client.run

    def recording(client: Any, called: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(client, called, *args, **kwargs)
        if step_name(called) == step:
            calls.append((args, reply))
        return reply

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(client_module.Client, "run", recording)
        result = rayfuse.run(cfg, backend="local", **run_kwargs)
    return result, calls
