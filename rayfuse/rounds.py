"""Rounds, resume and state that clients keep across rounds: the bookkeeping a multi-round method does not write.

This module sits below the method contract (``rayfuse.method`` re-exports what methods use) and imports nothing of
the project's but ``rayfuse.errors``; the engine (``rayfuse.coordinator.MethodServer.rounds``) builds the loop.

* A method declares its server state between rounds as a dataclass (a *round state*): ``params`` (the model
  checkpointed as the round's parameters), arrays, dicts of arrays, lists of dicts of arrays, floats and plain
  JSON values, and :class:`ClientRounds` for state its clients keep. :func:`encode_state` / :func:`decode_state`
  write it into a round checkpoint and read it back, exactly (arrays bit for bit, floats as float64 arrays).
  Fields made with :func:`transient` are not checkpointed (caches a resumed run recomputes).
* :class:`RoundLoop` runs the rounds: resume from the last round checkpoint (or restart from the first round, with a
  ``warning`` event, when clients lost the state they keep), evaluation every ``evaluate_every`` rounds and after the
  last, the history rows, the progress events, a checkpoint after each round, and, once the method is done, telling
  the clients to forget their kept state.
* :class:`KeptState` is "clients keep X across rounds": on the client, :meth:`KeptState.take` (the state of the round
  the server expects: from memory, else from the client's own storage) and :meth:`KeptState.keep` (in memory and in
  the client's storage); on the server, :meth:`KeptState.rounds`, a :class:`ClientRounds` field of the round state.
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from rayfuse.errors import InputError

__all__ = ["ClientRounds", "KeptState", "RoundLoop", "decode_state", "encode_state", "transient"]

S = TypeVar("S")
T = TypeVar("T")

#: meta keys the loop owns (a round state's fields may not use them)
RESERVED = ("store", "metrics", "history", "state_arrays")
_TRANSIENT = "rayfuse.transient"


def transient(default: Any = None) -> Any:
    """A round-state field that is not checkpointed (a resumed run starts it at ``default`` again)."""
    return dataclasses.field(default=default, metadata={_TRANSIENT: True}, compare=False)


def _arrays(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, np.ndarray) for v in value.values())


def encode_state(state: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """A round state as a checkpoint: ``(params, arrays, meta)``.

    ``params`` is the ``params`` field. Arrays, dicts of arrays (``<field>/<key>``), non-empty lists of dicts of
    arrays (``<field>/<i>/<key>``) and floats (0-d float64) go to ``arrays``, their kinds to ``meta["state_arrays"]``;
    :class:`ClientRounds` become ``[[client, round], ...]``; every other value is stored in ``meta`` as it is (JSON).
    """
    if not dataclasses.is_dataclass(state) or isinstance(state, type):
        raise TypeError(f"a round state is a dataclass instance, got {type(state).__name__}")
    params: dict[str, np.ndarray] = {}
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for f in dataclasses.fields(state):
        if f.metadata.get(_TRANSIENT):
            continue
        name, value = f.name, getattr(state, f.name)
        if name in RESERVED:
            raise TypeError(f"{type(state).__name__}.{name}: the name is the round loop's ({', '.join(RESERVED)})")
        if name == "params":
            params = dict(value)
        elif isinstance(value, ClientRounds):
            meta[name] = value.pairs()
        elif isinstance(value, np.ndarray):
            arrays[name], kinds[name] = value, "array"
        elif isinstance(value, (float, np.floating)) and not isinstance(value, bool):
            arrays[name], kinds[name] = np.asarray(value, dtype=np.float64), "float"
        elif _arrays(value):
            arrays.update({f"{name}/{k}": v for k, v in value.items()})
            kinds[name] = "dict"
        elif isinstance(value, (list, tuple)) and value and all(_arrays(v) for v in value):
            for i, item in enumerate(value):
                arrays.update({f"{name}/{i}/{k}": v for k, v in item.items()})
            kinds[name] = "list"
        else:
            meta[name] = value
    meta["state_arrays"] = kinds
    return params, arrays, meta


def _prefixed(arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays under ``prefix``, the prefix removed (copies: loaded checkpoints may be read-only)."""
    return {k[len(prefix) :]: np.array(v) for k, v in arrays.items() if k.startswith(prefix)}


def decode_state(template: S, params: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> S:
    """The round state :func:`encode_state` wrote, on ``template`` (an instance of the state's class: transient
    fields and fields the checkpoint lacks keep its values; :class:`ClientRounds` keep their kind)."""
    kinds = meta.get("state_arrays", {})
    values: dict[str, Any] = {}
    for f in dataclasses.fields(template):  # type: ignore[arg-type]
        if f.metadata.get(_TRANSIENT):
            continue
        name, mine = f.name, getattr(template, f.name)
        kind = kinds.get(name)
        if name == "params":
            # the checkpoint's arrays were just read into memory of their own: taken as they are (a model of several GB
            # is not copied a second time); read-only ones (a memory map) are copied, the state is the method's to change
            values[name] = {k: v if isinstance(v, np.ndarray) and v.flags.writeable else np.array(v) for k, v in params.items()}
        elif kind == "array":
            values[name] = np.array(arrays[name])
        elif kind == "float":
            values[name] = float(arrays[name])
        elif kind == "dict":
            values[name] = _prefixed(arrays, f"{name}/")
        elif kind == "list":
            items = _prefixed(arrays, f"{name}/")
            count = 1 + max(int(k.split("/", 1)[0]) for k in items)
            values[name] = [_prefixed(items, f"{i}/") for i in range(count)]
        elif isinstance(mine, ClientRounds):
            values[name] = mine.restored(meta.get(name, []))
        elif name in meta:
            value = copy.deepcopy(meta[name])
            values[name] = tuple(value) if isinstance(mine, tuple) and isinstance(value, list) else value
    return dataclasses.replace(template, **values)  # type: ignore[type-var]


# -----------------------------------------------------------------------------------------------------------------
# State clients keep across rounds


class ClientRounds(dict):
    """The server's record of state its clients keep: client id -> the round that client's kept state is of.

    A field of the round state (made with :meth:`KeptState.rounds`); checkpointed as ``[[client, round], ...]``.
    :attr:`store` is where the clients keep it (the :class:`RoundLoop` sets it: an id drawn once per method run with
    ``run.model_cache``, else ``None``); a client step takes ``self.get(client)`` and ``self.store``.
    """

    def __init__(self, kept: KeptState, rounds: Mapping[int, int] | None = None, store: str | None = None) -> None:
        super().__init__({int(c): int(r) for c, r in (rounds or {}).items()})
        self.kept = kept
        self.store = store

    def pairs(self) -> list[list[int]]:
        return sorted([int(c), int(r)] for c, r in self.items())

    def restored(self, pairs: list[list[int]]) -> ClientRounds:
        return ClientRounds(self.kept, {int(c): int(r) for c, r in pairs}, self.store)

    def moved(self, clients: Any, round: int) -> None:
        """``clients`` kept their state of ``round`` (every client that came back: its state moved on)."""
        self.update({int(c): int(round) for c in clients})

    def __deepcopy__(self, memo: dict) -> ClientRounds:
        return ClientRounds(self.kept, dict(self), self.store)

    def __reduce__(self) -> Any:
        return ClientRounds, (self.kept, dict(self), self.store)


@dataclasses.dataclass(frozen=True)
class KeptState:
    """Something each client keeps across rounds (a translator, an optimiser's state), never sent to the server.

    ``kind`` names it in the client's own storage (``<run.model_cache>/client-state/client-<id>/<kind>/<store>/``,
    ``rayfuse.client.ClientStateStore``; letters, digits and dashes); ``what`` says it in events ("translators"),
    ``item`` in errors ("translator"; default: ``what``); ``unit`` names a round ("turn"). ``key`` is where the client
    holds it in memory (``ctx.state``): a format string with ``{name}``, else ``(key or kind, name)``. On the client, :meth:`take` and :meth:`keep`; on
    the server, a :meth:`rounds` field of the round state: the :class:`RoundLoop` checks on resume that the clients
    still hold it and tells them to forget it when the method is done.
    """

    kind: str
    what: str
    item: str = ""
    unit: str = "round"
    key: str = ""

    def rounds(self) -> ClientRounds:
        """A round-state field recording which round each client's kept state is of (none yet: empty)."""
        return ClientRounds(self)

    def _keys(self, name: str) -> tuple[Any, Any]:
        if "{name}" in self.key:
            key = self.key.format(name=name)
            return key, f"{key}/round"
        return (self.key or self.kind, name), (self.key or self.kind, name, "round")

    def take(
        self,
        ctx: Any,
        name: str,
        round: int | None,
        store: str | None,
        *,
        fresh: Callable[[], T],
        load: Callable[[dict[str, np.ndarray]], T],
    ) -> T:
        """On the client: the state ``name`` of ``round`` (``None``: none yet, ``fresh()``), the server's expectation.

        From memory when it holds that round's state (of this ``store``), else from the client's own storage
        (``load(arrays)``; :class:`FileNotFoundError` when it is not kept there: never silently a fresh one). Without
        storage (no ``store`` or no ``run.model_cache``) whatever memory holds, else ``fresh()``.
        """
        value_key, round_key = self._keys(name)
        held = ctx.state.get(value_key)
        if round is None:
            return fresh()
        if held is not None and ctx.state.get(round_key) == (store, round):
            return held
        kept = ctx.state_store(self.kind, store) if store else None
        if kept is None or kept.folder is None:
            return held if held is not None else fresh()
        if not kept.has(name, round):
            raise FileNotFoundError(
                f"client {ctx.client_id}: no {self.item or self.what} of {name!r} after {self.unit} {round} in {kept.folder}"
            )
        return load(kept.load(name, round) or {})

    def hold(self, ctx: Any, name: str, value: Any) -> None:
        """On the client: ``value`` is being changed (no round's state until :meth:`keep`)."""
        value_key, round_key = self._keys(name)
        ctx.state[value_key] = value
        ctx.state[round_key] = None

    def keep(
        self,
        ctx: Any,
        name: str,
        value: Any,
        round: int,
        store: str | None,
        *,
        previous: int | None,
        arrays: Callable[[Any], dict[str, np.ndarray]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """On the client: ``value`` is the state ``name`` of ``round``: kept in memory and, with ``store`` (and
        ``run.model_cache``), written to the client's own storage, keeping ``previous`` too (the round this one started
        from: the server's checkpoint still names it if the run stops before the server records ``round``)."""
        value_key, round_key = self._keys(name)
        ctx.state[value_key] = value
        ctx.state[round_key] = (store, round)
        if store:
            ctx.state_store(self.kind, store).save(name, round, arrays(value), keep=previous, metadata=metadata)


# -----------------------------------------------------------------------------------------------------------------
# The round loop


class RoundUpdates(Protocol):
    """What :class:`RoundLoop` uses of the update pipeline (:class:`rayfuse.updates.pipeline.UpdatePipeline`): each
    round's cohort, and the state it carries from round to round (central DP's adaptive clip norm), which the loop
    checkpoints beside the method's round state and restores on ``--resume``."""

    def cohort(self, round: int) -> list[int]: ...

    def state(self) -> dict[str, float]: ...

    def load_state(self, state: Mapping[str, float]) -> None: ...


class LoopServer(Protocol):
    """What :class:`RoundLoop` uses of the method's server (``rayfuse.coordinator.MethodServer`` implements it)."""

    label: str
    events: Any

    @property
    def updates(self) -> RoundUpdates: ...

    resume: bool
    model_cache: str | None
    checkpoint: Any
    history: list[dict[str, Any]]

    def resume_checkpoint(self) -> Any: ...

    def save_checkpoint(
        self, round: int, params: dict[str, np.ndarray], state: dict[str, np.ndarray] | None = None, meta: dict[str, Any] | None = None
    ) -> None: ...

    def clients_missing_state(self, kind: str, store: str, rounds: dict[int, int]) -> list[int]: ...

    def forget_client_state(self, kind: str, store: str) -> None: ...

    def log(self, round: int, metrics: dict[str, float], client: int | None = None) -> None: ...

    def progress(self, message: str, **fields: Any) -> None: ...


def _check_layout(template: Any, meta: Mapping[str, Any], label: str) -> None:
    """Refuse a round checkpoint holding arrays of fields the round state does not have (decoding it would silently
    start those fields afresh), or one the round loop did not write. The older layouts: the FedAvg family's before its
    typed round states (FedOpt's moments, FedRef's queue as string-prefixed ``server/...`` arrays of one ``server``
    field), and EP-GAN's oracle's own loop. They are refused with one line, not read: converting them would keep a
    second decoder for layouts only interrupted runs of an older version hold, and a run started again without
    ``--resume`` gives the same numbers."""
    retry = "resume it with the rayfuse that wrote it, or run it again without --resume"
    if "state_arrays" not in meta:  # written without the round loop: epgan-oracle's own loop, before it used this one
        raise InputError(
            f"checkpoints/{label}",
            f"a round checkpoint of {type(template).__name__}'s fields, not epgan-oracle's older "
            "layout (the 'state/...' arrays of its own loop)",
            "a checkpoint the round loop did not write",
            retry,
        )
    unknown = sorted(set(meta["state_arrays"]) - {f.name for f in dataclasses.fields(template)})
    if unknown:
        old = (
            ", not the FedAvg family's older layout (server state as string-prefixed 'server/...' arrays)" if unknown == ["server"] else ""
        )
        raise InputError(
            f"checkpoints/{label}",
            f"a round checkpoint of {type(template).__name__}'s fields{old}",
            f"arrays of field {', '.join(map(repr, unknown))}",
            retry,
        )


class RoundLoop(Generic[S]):
    """Rounds ``first .. last`` of a method over a typed round state; iterate it for the round numbers to run.

    Built by ``server.rounds(state, last=...)``; :attr:`state` is the fresh ``state``, or the one of the last round
    checkpoint on ``--resume`` (:attr:`resumed`). The body of each round changes :attr:`state` in place and ends with
    :meth:`log` (the round's numbers); the loop then evaluates (``evaluate(round)`` every ``evaluate_every`` rounds
    and after the last; :attr:`metrics` holds the last result), records the history row, emits the progress event
    and saves the round checkpoint. Once the rounds are done the clients forget the state they kept.

    Clients keep state across rounds when the round state has :class:`ClientRounds` fields: their storage is
    :attr:`store` (an id drawn once per method run, with ``run.model_cache``; else ``None``). A resumed run continues
    mid-method only if every client still holds its state of the checkpointed round; otherwise it restarts from
    ``first`` with a ``warning`` event (the same result, later). ``on_resume(state)`` runs after a mid-method resume
    (checks that the world is still the interrupted run's). ``unit`` names a round in events ("turn"). With ``step``
    only every ``step``-th round runs, and the last (``step, 2 step, ..., last`` from ``first`` 1): a round then stands
    for a block of units (EP-GAN's oracle: ``local_epochs`` epochs a block, its rounds numbered by epochs done).
    """

    def __init__(
        self,
        server: LoopServer,
        state: S,
        *,
        last: int,
        first: int = 1,
        evaluate: Callable[[int], Mapping[str, float]] | None = None,
        evaluate_every: int = 1,
        unit: str = "round",
        quiet: tuple[str, ...] = (),
        on_resume: Callable[[S], None] | None = None,
        step: int = 1,
    ) -> None:
        encode_state(state)  # a bad state fails now, not after the first round
        self.server = server
        self.first, self.last, self.step = int(first), int(last), max(int(step), 1)
        self.evaluate, self.evaluate_every = evaluate, max(int(evaluate_every), 1)
        self.unit, self.quiet = unit, tuple(quiet)
        self.kept = [value for value in vars(state).values() if isinstance(value, ClientRounds)]
        self.state: S = state
        self.metrics: dict[str, float] = {}
        self.store: str | None = uuid.uuid4().hex if self.kept and server.model_cache else None
        self.start = self.first
        self.resumed = False
        self._row: dict[str, float] | None = None
        checkpoint = self._restore()
        if checkpoint is not None:
            _check_layout(state, checkpoint.meta, server.label)
            self.resumed = True
            self.start = checkpoint.round + 1
            self.state = decode_state(state, checkpoint.params, checkpoint.state, checkpoint.meta)
            self.metrics = dict(checkpoint.meta.get("metrics", {}))
            self.store = checkpoint.meta.get("store") or self.store
            if checkpoint.meta.get("pipeline"):  # the update pipeline's carried state (central DP's clip norm)
                server.updates.load_state(checkpoint.meta["pipeline"])
        for value in vars(self.state).values():
            if isinstance(value, ClientRounds):
                value.store = self.store
        if self.resumed and not self.finished and on_resume is not None:
            on_resume(self.state)

    @property
    def finished(self) -> bool:
        """Every round is done (a resumed run's last checkpoint was of the last round)."""
        return self.start > self.last

    def _restore(self) -> Any:
        """The round checkpoint to continue from, or ``None`` (a fresh start from ``first``)."""
        server = self.server
        if not server.resume:
            return None
        saved = server.checkpoint.load() if self.kept else None
        if saved is not None and saved.round < self.last:  # the clients must still hold what the checkpoint names
            store, problem = saved.meta.get("store"), None
            what = " and ".join(sorted({k.kept.what for k in self.kept}))
            if not server.model_cache or not store:
                problem = f"the clients keep their {what} across runs only with run.model_cache"
            else:
                for kept in self.kept:
                    rounds = kept.restored(saved.meta.get(self._field(kept), []))
                    missing = server.clients_missing_state(kept.kept.kind, store, dict(rounds))
                    if missing:
                        problem = f"clients {missing} no longer hold their {kept.kept.what}"
                        break
                if problem is not None:
                    self._forget(store)  # the others' are of no use now
            if problem is not None:
                server.events.emit("warning", f"restarting from {self.unit} 0: {problem}", method=server.label)  # from scratch
                return None
        checkpoint = server.resume_checkpoint()
        if checkpoint is not None and checkpoint.round < self.last and self.kept:
            what = " and ".join(sorted({k.kept.what for k in self.kept}))
            clients = sorted({int(c) for k in self.kept for c, _ in checkpoint.meta.get(self._field(k), [])})
            server.events.emit(
                "info",
                f"{len(clients)} clients continue from the {what} they kept themselves",
                method=server.label,
                round=checkpoint.round,
                clients=clients,
            )
        return checkpoint

    def _field(self, kept: ClientRounds) -> str:
        return next(name for name, value in vars(self.state).items() if value is kept)

    def _forget(self, store: str | None) -> None:
        if store is not None:
            for kind in dict.fromkeys(k.kept.kind for k in self.kept):
                self.server.forget_client_state(kind, store)

    def log(self, row: Mapping[str, float]) -> None:
        """End the round's body with its numbers (evaluation results are added by the loop)."""
        self._row = dict(row)

    def due(self, round: int) -> bool:
        """Whether ``round`` is evaluated: every ``evaluate_every`` rounds and the last."""
        return round % self.evaluate_every == 0 or round == self.last

    def cohorts(self) -> Iterator[tuple[int, list[int]]]:
        """The rounds with the clients each one trains, drawn by the framework (``server.updates.cohort``): under
        central DP the accountant's Poisson sample (possibly none: the round is noise alone), else ``ceil(fraction N)``
        clients with the entry's ``fraction``, else every client. A method with ``MethodTags.cohort`` iterates this
        (``for rnd, cohort in rounds.cohorts():``) and trains exactly ``cohort``; DP's plan and state are the loop's."""
        updates: RoundUpdates = self.server.updates
        for rnd in self:
            yield rnd, updates.cohort(rnd)

    def __iter__(self) -> Iterator[int]:
        server = self.server
        for rnd in range(self.start, self.last + 1):
            if (rnd - self.first + 1) % self.step and rnd != self.last:
                continue
            self._row = None
            yield rnd
            row = self._row
            if row is None:
                raise RuntimeError(f"{server.label}: {self.unit} {rnd} ended without rounds.log(row)")
            if self.evaluate is not None and self.due(rnd):
                self.metrics = dict(self.evaluate(rnd))
                row.update(self.metrics)
            server.log(rnd, row)
            shown = (
                {k: round(v, 4) for k, v in row.items() if not k.startswith(self.quiet)}
                if self.quiet
                else {k: round(v, 4) for k, v in row.items()}
            )
            server.progress(
                f"{self.unit} {rnd}/{self.last}",
                round=rnd,
                rounds=self.last,
                **({"clients": int(row["clients"])} if "clients" in row else {}),
                metrics=shown,
            )
            params, arrays, meta = encode_state(self.state)
            carried = dict(server.updates.state())
            meta = {**meta, "metrics": self.metrics, "store": self.store, **({"pipeline": carried} if carried else {})}
            server.save_checkpoint(rnd, params, arrays, meta)
        self._forget(self.store)  # the method is done: the clients may delete what they kept
