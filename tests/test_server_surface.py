"""The server surface a method sees (``ServerContext``, rayfuse/method.py): a few typed services and the method's own
seeds, logging and rounds; the round loop's internals stay on the loop (``rounds.LoopServer``). The coordinator's
``MethodServer`` and its service objects implement every protocol, and no method reads a loop internal."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from rayfuse import method as method_module
from rayfuse import rounds as rounds_module
from rayfuse.coordinator import MethodServer, MethodUpdates, ServerData, ServerModels, ServerScoring
from tests.updates.test_update_pipeline import build_coordinator, server_for

ROOT = Path(__file__).resolve().parents[1]

#: the round loop's internals: on ``rounds.LoopServer`` (MethodServer implements it), never on ``ServerContext``
LOOP_INTERNALS = {
    "resume",
    "history",
    "checkpoint",
    "model_cache",
    "resume_checkpoint",
    "save_checkpoint",
    "clients_missing_state",
    "forget_client_state",
}


def protocol_members(module: Any, name: str) -> dict[str, str]:
    """The members of the class ``name`` in ``module``'s source, as ast reads them: annotated attributes ("attribute"),
    properties ("property") and methods ("method")."""
    tree = ast.parse(inspect.getsource(module))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    members: dict[str, str] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[node.target.id] = "attribute"
        elif isinstance(node, ast.FunctionDef):
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            members[node.name] = "property" if is_property else "method"
    return members


def test_server_context_is_small_and_holds_the_five_services() -> None:
    members = protocol_members(method_module, "ServerContext")
    assert len(members) <= 16, sorted(members)
    assert set(members) == {
        "label",
        "method",
        "params",
        "events",
        "seed",
        "step_seed",
        "rng",
        "log",
        "progress",
        "rounds",
        "federation",
        "updates",
        "data",
        "models",
        "scoring",
    }
    assert not LOOP_INTERNALS & set(members)
    for service in ("federation", "updates", "data", "models", "scoring"):
        assert members[service] == "property"  # read-only: a method cannot swap a service


@pytest.mark.parametrize(
    "protocol, expected",
    [
        (
            "DataRoles",
            {
                "test",
                "public",
                "pooled_train",
                "dataset_meta",
                "class_counts",
                "num_classes",
                "input_shape",
                "num_clients",
                "data_cfg",
                "evaluation",
            },
        ),
        ("ModelService", {"model_cfg", "train_cfg", "device", "build_model", "client_model", "build_client_model", "initial_params"}),
        ("Scoring", {"evaluate", "evaluate_ensemble", "predict_proba", "evaluate_proba"}),
        (
            "UpdateService",
            {
                "collect",
                "collect_round",
                "accept",
                "receive",
                "combine",
                "local_models",
                "info",
                "accept_replies",
                "reject",
                "local_updates",
                "run_cached",
                "secure",  # federation.secure_aggregation, and the one way a method sums its clients' replies under it
                "secure_sum",
            },
        ),
    ],
)
def test_each_service_has_its_members(protocol: str, expected: set[str]) -> None:
    assert set(protocol_members(method_module, protocol)) == expected


def _same_signature(protocol_fn: Any, implementation: Any) -> None:
    """The implementation takes the protocol's parameters by the same names, kinds and defaults."""
    want = [(p.name, p.kind, p.default) for p in inspect.signature(protocol_fn).parameters.values() if p.name != "self"]
    got = [(p.name, p.kind, p.default) for p in inspect.signature(implementation).parameters.values() if p.name != "self"]
    assert got == want, (protocol_fn.__qualname__, got, want)


@pytest.fixture
def server(make_config: Any, tmp_path: Path) -> MethodServer:
    coord = build_coordinator(make_config, tmp_path, methods={"fedavg": {"rounds": 1}})
    return server_for(coord, "fedavg")


@pytest.mark.parametrize(
    "protocol, attribute, implementation",
    [
        ("ServerContext", None, MethodServer),
        ("DataRoles", "data", ServerData),
        ("ModelService", "models", ServerModels),
        ("Scoring", "scoring", ServerScoring),
        ("UpdateService", "updates", MethodUpdates),
    ],
)
def test_method_server_implements_each_protocol(server: MethodServer, protocol: str, attribute: str | None, implementation: type) -> None:
    obj = server if attribute is None else getattr(server, attribute)
    assert type(obj) is implementation
    proto_cls = getattr(method_module, protocol)
    for name, kind in protocol_members(method_module, protocol).items():
        assert hasattr(obj, name), f"{implementation.__name__} lacks {protocol}.{name}"
        if kind == "method":
            assert callable(getattr(obj, name))
            _same_signature(getattr(proto_cls, name), getattr(implementation, name))
        elif kind == "property" and name not in ("federation", "updates", "data", "models", "scoring"):
            assert not callable(getattr(obj, name)), f"{implementation.__name__}.{name} is a method, not a value"


def test_method_server_keeps_the_loop_internals(server: MethodServer) -> None:
    """The round loop still finds its internals on the method's server (``rounds.LoopServer``)."""
    loop = protocol_members(rounds_module, "LoopServer")
    assert LOOP_INTERNALS <= set(loop)
    for name, kind in loop.items():
        assert hasattr(server, name), name
        if kind == "method":
            _same_signature(getattr(rounds_module.LoopServer, name), getattr(MethodServer, name))
    assert server.resume is False and server.history == []


def test_services_see_the_run(server: MethodServer) -> None:
    """The services answer from the run's config and plan (what MethodServer answered itself before)."""
    coord = server._coordinator
    assert server.data.num_clients == coord.federation.num_clients == len(server.data.class_counts)
    assert server.data.num_classes == coord.plan.num_classes and server.data.input_shape == coord.plan.input_shape
    assert server.data.evaluation == coord.cfg.evaluation and server.data.data_cfg == coord.cfg.data
    assert server.models.model_cfg == coord.cfg.model and server.models.client_model(0) == coord.cfg.client_model(0)
    assert server.models.train_cfg == coord.cfg.train and server.models.device == coord.device
    assert len(server.data.test) > 0
    sampled = server.updates.sample_clients(0.5, 3)
    assert sampled == server.updates.sample_clients(0.5, 3) and len(sampled) == -(-coord.federation.num_clients // 2)


def _fusion_sources() -> list[Path]:
    return sorted((ROOT / "rayfuse" / "fusion").rglob("*.py"))


def test_no_method_reads_a_loop_internal_or_a_member_server_context_lacks() -> None:
    """Every ``server.<member>`` in rayfuse/fusion is a ServerContext member: no loop internal, no member that moved to a
    service."""
    allowed = set(protocol_members(method_module, "ServerContext"))
    read: dict[str, set[str]] = {}
    for path in _fusion_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "server":
                read.setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    assert read, "no server.<member> read in rayfuse/fusion: the scan reads nothing"
    assert {"federation", "updates", "data", "models", "scoring"} <= set(read)
    unknown = {name: sorted(files) for name, files in read.items() if name not in allowed}
    assert not unknown
    internals = {name: sorted(files) for name, files in read.items() if name in LOOP_INTERNALS}
    assert not internals
