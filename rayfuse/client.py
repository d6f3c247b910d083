"""A client: one data owner with its private shard and its local model.

:class:`Client` is a plain class. Tests and ``federation.backend: local`` use it directly; ``actors.ClientActor``
wraps it as a long-lived Ray actor (``ray.remote`` applied where it is created, as Ray's own code does), so the same
code runs in both. The constructor loads the client's own shard from its :class:`rayfuse.data.ClientPlan`; a
restarted Ray actor re-runs the constructor and so reloads the same shard deterministically.

Client steps receive the :class:`ClientContext`: the private train / val splits, the model and training settings,
the lazily trained local model (trained once per run and reused by every method) and a ``state`` dict where a
method may keep per-client state between calls. :meth:`Client.run` refuses a result that carries the client's inputs
or labels (:class:`rayfuse.guard.RawDataGuard`: an accident guard, not a defence against a method written to leak;
method code is trusted).

This module does not import torch at import time: a client that only moves parameters (benchmarks) stays light.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.data.roles import ClientPlan, Split, client_splits, load_dataset_from_config
from rayfuse.data.silos import SiloClientPlan, feature_moments, load_silo_splits, silo_schema
from rayfuse.federation import ClientDied, Update, client_step, map_arrays, step_name
from rayfuse.guard import RawDataGuard
from rayfuse.memory import LARGE_MODEL_BYTES
from rayfuse.seeding import derive_seed

__all__ = [
    "Client",
    "ClientContext",
    "ClientStateStore",
    "has_client_state",
    "forget_client_state",
    "PrivacyError",
    "release_kept_models",
    "train_local",
    "restore_local",
    "get_local_update",
    "set_local_params",
    "describe",
    "report_silo",
    "join_silo_plan",
]


class PrivacyError(RuntimeError):
    """A client step tried to return the client's raw data (found by the accident guard, :mod:`rayfuse.guard`)."""


class InjectedFault(RuntimeError):
    """Raised by a ``federation.faults`` entry with ``mode: raise``."""


# ClientContext.work_model's models, by (thread, slot, device, architecture): one per process and architecture
_KEPT_MODELS: dict[tuple[Any, ...], Any] = {}


def release_kept_models() -> None:
    """Forget the models :meth:`ClientContext.work_model` keeps in this process (a run in a process that outlives it,
    ``federation.backend: local``, ends; a Ray actor's process ends with its run)."""
    _KEPT_MODELS.clear()


class ClientContext:
    """What a client step sees: this client's private data, settings and local model."""

    def __init__(
        self,
        client_id: int,
        plan: ClientPlan,
        train: Split,
        val: Split,
        *,
        data_cfg: Any,
        model_cfg: Any,
        train_cfg: Any,
        seed: int,
        device: str,
        local_cache: str | None = None,
        faults: Sequence[Any] = (),
    ) -> None:
        self.client_id = client_id
        self.plan: ClientPlan | SiloClientPlan = plan  # SiloClientPlan: data.silos
        self.train = train
        self.val = val
        self.data_cfg = data_cfg
        self.faults = [f for f in faults if f.client == client_id]  # part of the local model's key (see local_model_key)
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        self.seed = seed
        self.device = device
        self.num_classes = plan.num_classes
        self.input_shape = plan.input_shape
        self.state: dict[str, Any] = {}
        self._local_model: Any = None
        self._local_on_disk: str | None = None  # a large local model kept only in local_cache: its key (local_model)
        self._local_mapped: tuple[dict[str, np.ndarray], dict[str, float]] | None = None  # its file, mapped and checked once
        self.local_stats: dict[str, float] = {}
        self.local_cache = local_cache
        self.labels: tuple[str, ...] = ()  # data.silos: the silo's label values, in label order
        # Kept on the device between steps (work_model, device_split): built or copied there once, not every step
        self._work_models: dict[str, Any] = {}  # the kept models this client last used (shared: _KEPT_MODELS)
        self._device_splits: dict[str, tuple[Split, Any, Any]] = {}
        self.secure_sessions: dict[str, Any] = {}  # federation.secure_aggregation: each open round's SecAgg+ state
        self.silo_dtype = ""  # data.silos: the dtype the silo's file stores its inputs in (the survey compares it)

    @property
    def num_examples(self) -> int:
        return len(self.train)

    def step_seed(self, *tags: object) -> int:
        """A seed for this client and ``tags`` (e.g. method label and round), stable across processes."""
        return derive_seed(self.seed, "client", self.client_id, *tags)

    @property
    def init_seed(self) -> int:
        """Seed of the local model's initialisation: shared by all clients when ``train.shared_init``."""
        return derive_seed(self.seed, "init") if self.train_cfg.shared_init else self.step_seed("init")

    def build_model(self, seed: int | None = None) -> Any:
        from rayfuse.models import build_model

        return build_model(self.model_cfg, self.input_shape, self.num_classes, seed=seed)

    def work_model(self, params: dict[str, np.ndarray], *, slot: str = "work") -> Any:
        """A model of this client's architecture holding ``params``, on :attr:`device`: built and moved there on the
        first call, then kept between steps (one per ``slot``) and only loaded with the new ``params`` (a copy into
        its device tensors). What a step returns goes back to the CPU (``get_params``); the model stays here.

        The model is kept per process, thread and architecture, not per client: the clients one actor hosts
        (``federation.clients_per_actor``) run their steps one after another in its thread and share one kept model,
        so an actor keeps one model's memory however many clients it hosts, as when each step built its own. A step
        has the model to itself while it runs. Raises ``ValueError`` when ``params`` do not fit the architecture (as
        :func:`rayfuse.models.set_params`)."""
        import json
        import threading

        from rayfuse.models import restore_taken, set_params

        arch = json.dumps(self.model_cfg.model_dump(mode="json"), sort_keys=True)
        factory = id(getattr(self.model_cfg, "custom_factory", None))  # a notebook's class: its object, not only its name
        key = (threading.get_ident(), slot, str(self.device), arch, factory, tuple(self.input_shape), int(self.num_classes))
        model = _KEPT_MODELS.get(key)
        if model is None:
            alive = {t.ident for t in threading.enumerate()}
            for stale in [k for k in _KEPT_MODELS if k[0] not in alive]:  # kept by threads that have ended
                del _KEPT_MODELS[stale]
            model = self.build_model(seed=0).to(self.device)
            _KEPT_MODELS[key] = model
        self._work_models[slot] = model
        restore_taken(model)  # the last step gave its parameters' memory to its reply (take_params)
        for p in model.parameters():
            p.grad = None  # the last step's gradients: nothing of one step reaches the next
        return set_params(model, params)

    def take_params(self, model: Any) -> dict[str, np.ndarray]:
        """The parameters of ``model`` (this step's :meth:`work_model`, which the step is done with) for its reply,
        without a copy where the model can give its memory away (on the CPU; :func:`rayfuse.models.take_params`): the
        next :meth:`work_model` call gives the kept model new memory. On a GPU the parameters are copied to the CPU
        and the model stays on the device."""
        from rayfuse.models import take_params

        return take_params(model)

    def device_split(self, name: str = "train") -> tuple[Any, Any]:
        """This client's ``train`` or ``val`` split as ``(X, y)`` tensors on :attr:`device`, copied there once and
        kept between steps (again only if the split is replaced: the silo survey's standardisation). On the CPU they
        share the split's arrays (no copy). They never leave the client."""
        from rayfuse.devices import to_device

        split = self.train if name == "train" else self.val
        kept = self._device_splits.get(name)
        if kept is None or kept[0] is not split:
            kept = (split, to_device(split.X, self.device), to_device(split.y, self.device))
            self._device_splits[name] = kept
        return kept[1], kept[2]

    @property
    def has_local_model(self) -> bool:
        return self._local_model is not None or self._local_on_disk is not None

    def local_model(self) -> Any:
        """The client's local model, trained on its train split the first time it is asked for.

        With ``local_cache`` (``run.model_cache``), the client owns its trained model: it keeps it in
        ``<local_cache>/local-models/<key>/`` (:class:`rayfuse.store.LocalModelStore`) under its content key
        (:meth:`local_model_key`), and a later run of the same client (a Tune trial over fusion-only knobs, a resumed
        run) reads it instead of training. Written and read by the client's own process, under the key's lock
        (concurrent trials train once): methods whose local models must not leave the client (FedSA's teachers) keep
        them on the client's side, with ``run.model_cache`` on storage the client owns.
        """
        if self._local_model is None and self._local_on_disk is not None:
            return self._read_local_model()
        if self._local_model is None:
            store = self.local_model_store()
            if store is None:
                self._local_model = self._train_local_model()
                return self._local_model
            key, inputs = self.local_model_key()
            with store.lock(key):
                if not self.restore_local_model():
                    self._local_model = self._train_local_model()
                    store.save(key, inputs, _params_view(self._local_model), self.local_stats)
                    if _model_bytes(self._local_model) >= LARGE_MODEL_BYTES:
                        # a large model is kept on the client's own storage only, and read from it when asked for:
                        # k hosted clients do not hold k models of several GB between the methods that use them
                        model, self._local_model, self._local_on_disk = self._local_model, None, key
                        return model
            if self._local_model is None:  # restored onto the client's storage only (large)
                return self._read_local_model()
        return self._local_model

    def local_params(self) -> dict[str, np.ndarray]:
        """The local model's parameters (what one-shot methods fuse): a copy of the model in memory, or, for a large
        model kept on the client's own storage, read-only arrays over a memory map of its file (no copy)."""
        from rayfuse.models import get_params

        if self._local_model is None and self._local_on_disk is None:
            model = self.local_model()  # trained (or restored) now
            if self._local_on_disk is None:
                return get_params(model)
            del model
        if self._local_model is None:
            return self._kept_on_disk()[0]
        return get_params(self._local_model)

    def _kept_on_disk(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The large local model's parameters (memory-mapped) and statistics, read and checked (SHA-256) once per
        process: the map costs file pages, not memory of the process's own."""
        if self._local_mapped is not None:
            return self._local_mapped
        store = self.local_model_store()
        kept = None if store is None or self._local_on_disk is None else store.load(self._local_on_disk, mapped=True)
        if kept is None:  # removed or damaged since (the store discards a damaged entry): trained again, deterministically
            self._local_on_disk = None
            self.local_model()
            assert store is not None and self._local_on_disk is not None
            kept = store.load(self._local_on_disk, mapped=True)
            assert kept is not None
        self._local_mapped = kept
        return kept

    def _read_local_model(self) -> Any:
        """A model holding the local model kept on the client's storage (a copy of its file in memory of its own, no
        initialisation), on :attr:`device`; nothing of it is kept here after the caller is done with it."""
        from rayfuse.models import model_with_params
        from rayfuse.models.registry import builds_on_meta

        params = {k: np.array(v) for k, v in self._kept_on_disk()[0].items()}  # writable: the caller may change it
        model = model_with_params(lambda: self.build_model(seed=self.init_seed), params, meta=builds_on_meta(self.model_cfg))
        return model.to(self.device).eval()

    def local_model_store(self) -> Any:
        """Where this client keeps its trained local model (a :class:`rayfuse.store.LocalModelStore`); ``None`` without
        ``local_cache``."""
        from rayfuse.store import LocalModelStore

        return LocalModelStore(self.local_cache) if self.local_cache else None

    def local_model_key(self) -> tuple[str, dict[str, Any]]:
        """The content key of this client's local model (:func:`rayfuse.store.local_model_key`, the same key the
        coordinator computes from the run's config) and its inputs."""
        from rayfuse.store import local_model_key

        config = {
            "data": self.data_cfg.model_dump(mode="json"),
            "model": self.model_cfg.model_dump(mode="json"),
            "train": self.train_cfg.model_dump(mode="json"),
            "run": {"seed": self.seed},
            "federation": {"faults": [f.model_dump(mode="json") for f in self.faults]},
        }
        return local_model_key(config, self.plan)

    def restore_local_model(self) -> bool:
        """Install the local model this client kept (``local_cache``) without training; ``False`` when it keeps none.
        A model already in memory counts as restored."""
        if self._local_model is not None or self._local_on_disk is not None:
            return True
        store = self.local_model_store()
        kept = None if store is None else store.load(self.local_model_key()[0], mapped=True)
        if kept is None:
            return False
        from rayfuse.models import set_params

        params, stats = kept
        self.local_stats = {**stats, "cached": 1.0}
        if sum(np.asarray(v).nbytes for v in params.values()) >= LARGE_MODEL_BYTES:
            self._local_on_disk = self.local_model_key()[0]  # large: read from the client's storage when asked for
            self._local_mapped = kept  # checked just now: not read again for the upload
            return True
        self._local_model = set_params(self.build_model(seed=self.init_seed), params)
        return True

    def _train_local_model(self) -> Any:
        from rayfuse.models import train_model

        model = self.build_model(seed=self.init_seed)
        cfg = self.train_cfg
        if cfg.dp is not None:  # local DP-SGD (train.dp): Opacus' loop, the epsilon spent joins the reported statistics
            from rayfuse.models.privacy import train_model_dp

            dp = cfg.dp
            stats, privacy = train_model_dp(
                model,
                self.train.X,
                self.train.y,
                epochs=cfg.epochs,
                batch_size=cfg.batch_size,
                lr=cfg.lr,
                optimizer=cfg.optimizer,
                momentum=cfg.momentum,
                weight_decay=cfg.weight_decay,
                noise_multiplier=dp.noise_multiplier,
                target_epsilon=dp.target_epsilon,
                max_grad_norm=dp.max_grad_norm,
                delta=dp.delta,
                accountant=dp.accountant,
                seed=self.step_seed("local-train"),
                device=self.device,
            )
            self.local_stats = {"train_loss": stats.loss, "train_seconds": stats.seconds, "steps": float(stats.steps), **privacy}
            return model
        stats = train_model(
            model,
            *self.device_split(),
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            optimizer=cfg.optimizer,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            seed=self.step_seed("local-train"),
            device=self.device,
        )
        self.local_stats = {"train_loss": stats.loss, "train_seconds": stats.seconds, "steps": float(stats.steps)}
        return model

    def set_local_model(self, model: Any) -> None:
        self._local_model = model
        self._local_on_disk = self._local_mapped = None

    def state_store(self, kind: str, store: str) -> ClientStateStore:
        """This client's private state of one method run on storage it owns (see :class:`ClientStateStore`)."""
        return ClientStateStore(self, kind, store)


class ClientStateStore:
    """A client's private state of one method run, kept on storage the client owns, for ``rayfuse run --resume``.

    The folder is ``<run.model_cache>/client-state/client-<id>/<kind>/<store>/`` (:attr:`folder`; ``None`` without
    ``run.model_cache``: the client then keeps nothing). ``kind`` names what is kept (``fedsa-translators``,
    ``epgan-state``); ``store`` is a random alphanumeric id the server draws once per method run and records in its
    checkpoint. Files are ``<name>-<round:05d>.safetensors`` (arrays only: never pickle); the server's checkpoint
    records, per client, the round its state belongs to, never the state. Written and read by the client's own process:
    what a client keeps here (optimiser moments, random generators, a teacher's translator) never travels.

    Each file is written atomically (a staging file renamed into place), and :meth:`save` and :meth:`forget` hold the
    store's lock (``<store>.lock`` beside the folder, :func:`rayfuse.cas.key_lock`): two processes of one client (a
    restarted actor and the one it replaces) never prune or delete under each other.
    """

    def __init__(self, ctx: ClientContext, kind: str, store: str) -> None:
        if not store.isalnum():
            raise ValueError(f"a client state store id is alphanumeric, got {store!r}")
        if not kind or not kind.replace("-", "").isalnum():
            raise ValueError(f"a client state kind is alphanumeric with dashes, got {kind!r}")
        self.folder: Path | None = (
            Path(ctx.local_cache) / "client-state" / f"client-{ctx.client_id}" / kind / store if ctx.local_cache else None
        )

    def _lock(self) -> contextlib.AbstractContextManager[Any]:
        from rayfuse.cas import key_lock

        assert self.folder is not None
        return key_lock(self.folder.with_name(f"{self.folder.name}.lock"))

    def file(self, name: str, round: int) -> Path | None:
        """Where the state ``name`` after ``round`` is kept (``None`` without storage)."""
        return None if self.folder is None else self.folder / f"{name}-{round:05d}.safetensors"

    def has(self, name: str, round: int) -> bool:
        path = self.file(name, round)
        return path is not None and path.is_file()

    def load(self, name: str, round: int) -> dict[str, np.ndarray] | None:
        """The arrays of ``name`` after ``round``; ``None`` without storage; :class:`FileNotFoundError` if not kept."""
        from rayfuse.io import load_params

        path = self.file(name, round)
        if path is None:
            return None
        if not path.is_file():
            raise FileNotFoundError(f"client state {path.name} not in {path.parent}")
        return load_params(path)

    def save(
        self, name: str, round: int, arrays: dict[str, np.ndarray], *, keep: int | None = None, metadata: dict[str, str] | None = None
    ) -> Path | None:
        """Write ``name`` after ``round`` (nothing without storage) and delete its older rounds, except ``keep``: the
        round this one started from, which the server's checkpoint may still name if the run stops before the server
        records ``round``."""
        from rayfuse.io import save_params

        path = self.file(name, round)
        if path is None:
            return None
        kept = {path.name, *([self.file(name, keep).name] if keep is not None and keep != round else [])}  # type: ignore[union-attr]
        with self._lock():
            save_params(path, arrays, {"name": name, "round": str(round), **(metadata or {})})
            for old in path.parent.glob(f"{name}-*.safetensors"):
                if old.name not in kept and old.name[len(name) + 1 : -len(".safetensors")].isdigit():
                    old.unlink(missing_ok=True)
        return path

    def forget(self) -> int:
        """Delete the whole store (the method run is finished); the number of state files deleted."""
        import shutil

        if self.folder is None or not self.folder.is_dir():
            return 0
        with self._lock():
            count = len(list(self.folder.glob("*.safetensors")))
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.with_name(f"{self.folder.name}.lock").unlink(missing_ok=True)  # the store is done: no one waits on it
        return count


@client_step("client_state.has")
def has_client_state(ctx: ClientContext, *, kind: str, store: str, name: str, round: int) -> bool:
    """Whether this client still keeps ``name`` after ``round`` in its :class:`ClientStateStore` ``kind`` / ``store``
    (what a resumed method asks before continuing mid-method; see ``MethodServer.clients_missing_state``, the round loop's)."""
    return ctx.state_store(kind, store).has(name, round)


@client_step("client_state.forget")
def forget_client_state(ctx: ClientContext, *, kind: str, store: str) -> int:
    """Delete this client's :class:`ClientStateStore` ``kind`` / ``store`` (its method run is finished, or restarts);
    the number of state files deleted."""
    return ctx.state_store(kind, store).forget()


class Client:
    """One data owner. ``run(step, ...)`` executes a client step against this client's context.

    Parameters
    ----------
    client_id : int
    plan : ClientPlan
        This client's indices (and nothing about the other clients).
    data_cfg, model_cfg, train_cfg : config sections
        ``model_cfg`` is this client's model: its ``federation.client_overrides.<i>.model``, else the run's ``model``
        (:meth:`rayfuse.config.ExperimentConfig.client_model`).
    seed : int
        The run seed.
    device : str
        ``"cpu"`` or ``"cuda:<i>"``.
    faults : sequence of FaultSpec
        Injected faults for this client (testing failure policies on real runs).
    restarted : bool
        True when this object replaces a crashed one (a restarted actor): ``exit`` faults do not fire again.
    die : callable, optional
        What an ``exit`` fault does; the Ray actor passes ``os._exit``; in-process it raises :class:`ClientDied`.
    dataset : Dataset, optional
        The already loaded dataset (an actor hosting several clients loads it once); loaded from ``data_cfg`` if not.
    local_cache : str, optional
        ``run.model_cache``: where this client keeps its trained local model for later runs (see
        :meth:`ClientContext.local_model`).
    """

    def __init__(
        self,
        client_id: int,
        plan: ClientPlan,
        *,
        data_cfg: Any,
        model_cfg: Any,
        train_cfg: Any,
        seed: int,
        device: str = "cpu",
        faults: Sequence[Any] = (),
        restarted: bool = False,
        die: Callable[[], None] | None = None,
        dataset: Any = None,
        local_cache: str | None = None,
    ) -> None:
        labels: tuple[str, ...] = ()
        silo_dtype = ""
        if isinstance(plan, SiloClientPlan):  # data.silos: this client's own silo, read here, on its own node
            train, val, labels, silo_dtype = load_silo_splits(plan)
            if not plan.num_classes:  # before the silo survey: the client's own facts (the survey checks they agree)
                plan = replace(plan, num_classes=len(labels), input_shape=tuple(int(d) for d in train.X.shape[1:]))
            elif plan.normalization is not None:
                train, val = Split(plan.normalization.apply(train.X), train.y), Split(plan.normalization.apply(val.X), val.y)
        else:
            if dataset is None:  # several clients in one process (clients_per_actor > 1) share one loaded dataset
                dataset = load_dataset_from_config(data_cfg)
            train, val = client_splits(dataset, plan)
            del dataset  # keep only this client's shard in memory
        self.ctx = ClientContext(
            client_id,
            plan,
            train,
            val,
            data_cfg=data_cfg,
            model_cfg=model_cfg,
            train_cfg=train_cfg,
            seed=seed,
            device=device,
            local_cache=local_cache,
            faults=faults,
        )
        self.ctx.labels = labels if isinstance(plan, SiloClientPlan) else ()
        self.ctx.silo_dtype = silo_dtype
        self.faults = [f for f in faults if f.client == client_id]
        self.restarted = restarted
        self._die = die
        self._calls: Counter[str] = Counter()
        self._guard: RawDataGuard | None = None
        self._guarded: tuple[int, int] = (0, 0)

    @property
    def client_id(self) -> int:
        return self.ctx.client_id

    def run(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``step(ctx, *args, **kwargs)``; apply injected faults; refuse to return raw data."""
        name = step_name(step)
        self._calls[name] += 1
        fault = next((f for f in self.faults if f.step == name and f.call == self._calls[name]), None)
        if fault is not None and fault.mode == "raise":
            raise InjectedFault(f"injected fault: client {self.client_id}, step {name}, call {self._calls[name]}")
        if fault is not None and fault.mode == "exit" and not self.restarted:
            if self._die is not None:
                self._die()
            raise ClientDied(f"injected crash: client {self.client_id}, step {name}, call {self._calls[name]}")
        if fault is not None and fault.mode == "hang":
            time.sleep(fault.seconds)
        result = step(self.ctx, *args, **kwargs)
        if fault is not None and fault.mode == "nan":
            result = _poison(result)
        if fault is not None and fault.mode == "nan_metrics" and hasattr(result, "metrics"):
            result.metrics = {k: float("nan") for k in result.metrics}
        self._check_no_raw_data(result)
        return result

    def _check_no_raw_data(self, result: Any) -> None:
        """Refuse a result that carries this client's inputs or labels (:class:`rayfuse.guard.RawDataGuard`, an
        accident guard: method code is trusted). The private rows are hashed once, on the first call."""
        ctx = self.ctx
        if self._guard is None or self._guarded != (id(ctx.train), id(ctx.val)):  # (a silo's splits are standardised once)
            self._guard = RawDataGuard([ctx.train.X, ctx.val.X], [ctx.train.y, ctx.val.y])
            self._guarded = (id(ctx.train), id(ctx.val))
        found = self._guard.find(result)
        if found is not None:
            raise PrivacyError(f"client {self.client_id}: a client step tried to return its raw data: {found}")

    def ping(self) -> dict[str, Any]:
        return {"client": self.client_id, "pid": os.getpid(), "device": self.ctx.device, "restarted": self.restarted}


def _model_bytes(model: Any) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _params_view(model: Any) -> dict[str, np.ndarray]:
    """The model's ``state_dict`` as numpy arrays over its own memory where it is on the CPU (copied from a GPU): to
    write it out, not to keep (the model changes them if it trains again)."""
    return {k: t.detach().cpu().numpy() for k, t in model.state_dict().items()}


def _poison(obj: Any) -> Any:
    """Replace every float array in ``obj`` by NaNs (fault mode ``nan``)."""
    return map_arrays(obj, lambda a: np.full_like(a, np.nan) if a.dtype.kind == "f" else a)


# -----------------------------------------------------------------------------------------------------------------
# Engine steps every run uses


@client_step("train_local")
def train_local(ctx: ClientContext, report: bool = True) -> dict[str, float]:
    """Train the local model (once per client life) and report its cost; no parameters travel. ``report=False``
    (``federation.secure_aggregation``): the count and whether it was read from the client's own copy only, no loss
    or time of this client's (a statistic of its data the server is not to hold one client's of)."""
    ctx.local_model()
    if not report:
        return {"num_examples": float(ctx.num_examples), **({"cached": 1.0} if ctx.local_stats.get("cached") == 1.0 else {})}
    return {"num_examples": float(ctx.num_examples), **ctx.local_stats}


@client_step("restore_local")
def restore_local(ctx: ClientContext) -> dict[str, float] | None:
    """Install the local model this client kept in its own storage (``run.model_cache``) without training, and report
    its statistics; ``None`` when it keeps none (``rayfuse run --resume`` then falls back to the run folder)."""
    if not ctx.restore_local_model():
        return None
    return {"num_examples": float(ctx.num_examples), **ctx.local_stats}


@client_step("get_local_params")
def get_local_update(ctx: ClientContext, train: bool = True) -> Update | None:
    """The local model's parameters (what one-shot fusion methods fuse). With ``train=False``, ``None`` when the
    client holds no trained model (a restarted process) and keeps no copy of its own (``run.model_cache``): the
    coordinator then gives it back the run folder's copy instead of having it train again."""
    if not train and not ctx.restore_local_model():
        return None
    params = ctx.local_params()  # trained here if it was not yet (its statistics with it)
    return Update(params, ctx.num_examples, dict(ctx.local_stats))


@client_step("set_local_params")
def set_local_params(ctx: ClientContext, params: dict[str, np.ndarray], stats: dict[str, float] | None = None) -> int:
    """Install a checkpointed local model instead of retraining it (``rayfuse run --resume``)."""
    from rayfuse.models import set_params

    model = ctx.build_model(seed=ctx.init_seed)
    set_params(model, params)
    model.to(ctx.device)
    model.eval()
    ctx.set_local_model(model)
    ctx.local_stats = dict(stats or {})
    return ctx.num_examples


@client_step("describe")
def describe(ctx: ClientContext) -> dict[str, Any]:
    """Counts only: sizes, class counts, device."""
    return {
        "client": ctx.client_id,
        "num_train": len(ctx.train),
        "num_val": len(ctx.val),
        "class_counts": np.bincount(ctx.train.y, minlength=ctx.num_classes).tolist(),
        "device": ctx.device,
        "pid": os.getpid(),
    }


# -----------------------------------------------------------------------------------------------------------------
# The silo survey (data.silos): what a client tells the coordinator about its silo before any training


@client_step("report_silo")
def report_silo(ctx: ClientContext, *, moments: bool = False) -> dict[str, Any]:
    """This client's silo schema (:func:`rayfuse.data.silos.silo_schema`: input shape and dtype, label values, sizes,
    class counts, a content hash; no rows, no paths) and, with ``moments``, its standardisation statistics over both
    splits (:func:`rayfuse.data.silos.feature_moments`: a count, per-feature sums and sums of squares)."""
    from rayfuse.data.datasets import Dataset

    names = ctx.labels
    train = Dataset("silo", ctx.train.X, ctx.train.y, len(names), names, stored_dtype=ctx.silo_dtype)
    held_out = Dataset("silo-held-out", ctx.val.X, ctx.val.y, len(names), names, stored_dtype=ctx.silo_dtype)
    report: dict[str, Any] = {"schema": silo_schema(train, held_out)}
    if moments:
        n_train, sum_train, squares_train = feature_moments(ctx.train.X)
        n_val, sum_val, squares_val = feature_moments(ctx.val.X)
        report["moments"] = (n_train + n_val, sum_train + sum_val, squares_train + squares_val)
    return report


@client_step("join_silo_plan")
def join_silo_plan(ctx: ClientContext, plan: SiloClientPlan) -> int:
    """Install the run's completed silo plan (after the survey): its shared facts, and the federated standardisation,
    applied here to this client's splits. Returns the training size."""
    if plan.normalization is not None and ctx.plan.normalization is None:
        norm = plan.normalization
        ctx.train, ctx.val = Split(norm.apply(ctx.train.X), ctx.train.y), Split(norm.apply(ctx.val.X), ctx.val.y)
    ctx.plan = plan
    ctx.num_classes, ctx.input_shape = plan.num_classes, plan.input_shape
    return ctx.num_examples
