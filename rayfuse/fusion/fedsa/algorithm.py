"""``fedsa``: Federated Selective Aggregation for knowledge amalgamation (Xie et al. 2022) [1], and its baselines.

N teachers, each a model pre-trained on its own private task and data, each held by its own client: the client's
local model (trained once per run on the client's private shard, which ``partition.corrupt`` may corrupt) is its
teacher. Neither the teacher's weights nor its data leave the client. The server owns a small labelled target set
for a new task (the public sample, ``data.public_size``: 1 / 5 / 10 % of the training pool) and the target model (the
student; ``student`` may differ from the teachers' architecture). Algorithm 1 of [1]::

    train the weak target model theta_0 on D_T
    for t = 0 .. T-1:
        if t % E_g == 0:                                     # knowledge selection (eq. 1-3)
            teachers' saliency maps on the probe set D_T     # client step ``fedsa.saliency``: only maps come back
            target model's maps; d_n = M / sim_n; Q_n = 1 / d_n; p = softmax(Q)
            S = K draws from p WITH replacement
        for n in S (in parallel):                            # selective aggregation (eq. 4)
            theta^t_n = theta^t distilled from teacher n's last feature map through a translator, on n's
                        unlabelled private data                # client step ``fedsa.distill``
        theta^{t+1} = (1/K) sum_{n in S} theta^t_n             # eq. 5: a teacher drawn twice counts twice
    target task adaptation on D_T (the head; the whole network with ``adapt: whole``)

The global student travels once per round (one ``put``) to the selected teachers' clients; a client drawn ``c`` times
trains ``c`` local students (``copies``). Each teacher's translator stays with its client across rounds and is never
averaged (with ``run.model_cache`` the client also writes it to its own storage each round, so ``--resume`` can
continue mid-method: see :meth:`FedSA._resume`). Teachers' saliency maps are computed once per method (teachers and
probe set are fixed); the target model's maps are recomputed at every selection, after a short re-training of its
head on D_T (the paper trains the weak target model before each selection; the code once -- ``retrain_head``).

Table 2's ablations are parameters: ``selection`` (``saliency`` = FedSA, ``fixed`` = FedSA's first draw kept,
``top_k``, ``least_k``, ``random``, ``all`` = FedAvg+: every teacher, unweighted) and ``weighting`` (``uniform``,
``positive``, ``negative``). The baselines ``scratch`` (the target set alone) and ``transfer`` (fine-tune each
teacher on the target set: needs the teachers' weights, so it is marked as an oracle) are registered here too.

[1] D. Xie, R. Yu, G. Fang, J. Song, Z. Feng, X. Wang, L. Sun, M. Song. Federated Selective Aggregation for Knowledge
    Amalgamation. arXiv:2207.13309 (2022). Code: [KAMAL : examples/knowledge_amalgamation/FedSA/]. Paper/code choices:
    ``docs/methods/fedsa.md``.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import Field

from rayfuse.config import ModelConfig
from rayfuse.data.roles import Split
from rayfuse.errors import InputError, NonFiniteError, RunFailure
from rayfuse.fusion import references
from rayfuse.fusion.fedsa.kd import (
    adapt_to_target,
    average_students,
    build_translator,
    compute_saliency,
    compute_transferability,
    distill_features,
    draw_weights,
    find_head,
    hidden_representation,
    representation_shape,
    select_teachers,
    selection_probabilities,
)
from rayfuse.method import ClientContext, Method, MethodParams, MethodResult, RunSetup, ServerContext, client_step, register_method
from rayfuse.seeding import derive_seed, make_rng

__all__ = ["FedSA", "FedSAParams", "Scratch", "Transfer", "TargetParams", "check_student", "check_target_set",
           "compute_teacher_saliency", "distill_student"]


# -----------------------------------------------------------------------------------------------------------------
# Client side: everything that touches a teacher runs here, and returns maps, students and numbers only


@client_step("fedsa.saliency")
def compute_teacher_saliency(ctx: ClientContext, probe_X: np.ndarray, *, kind: str) -> dict[str, Any]:
    """The teacher's saliency maps on the server's probe images (eq. 1 of [1]): ``maps`` ``(M, D)`` float32."""
    started = time.perf_counter()
    teacher = ctx.local_model()  # pre-trained once on this client's private task, reused by every method of the run
    maps = compute_saliency(teacher, np.asarray(probe_X), kind=kind, device=ctx.device)  # type: ignore[arg-type]
    return {"maps": maps, "seconds": time.perf_counter() - started}


def _teacher_features(ctx: ClientContext) -> Any:
    """The teacher's representation of its private training inputs (fixed for the run: computed once, kept here)."""
    import torch

    cached = ctx.state.get("fedsa.teacher_features")
    if cached is None:
        teacher = ctx.local_model()
        teacher.eval()
        X = torch.as_tensor(np.ascontiguousarray(ctx.train.X), device=ctx.device)
        with torch.no_grad():
            cached = torch.cat([hidden_representation(teacher, X[i:i + 1024]) for i in range(0, len(X), 1024)]).cpu()
        ctx.state["fedsa.teacher_features"] = cached
    return cached


TRANSLATORS = "fedsa-translators"  # the kind of client state (:class:`rayfuse.client.ClientStateStore`) FedSA keeps


def _held_translator(ctx: ClientContext, label: str, translator_round: int | None, store: str | None,
                     build: Callable[[], Any]) -> Any:
    """The translator this round starts from: the one the server expects (``translator_round``: the round of this
    client's last distillation for ``label``; 0: none yet), from memory, else from the client's own store.

    ``translator_round=None`` (callers that do not track it): the one in memory, or a new one. Without a store
    (no ``run.model_cache``) a translator missing from memory (a restarted client) is rebuilt as new.
    """
    from rayfuse.models import set_params

    held = ctx.state.get(("fedsa.translator", label))
    if translator_round is None:
        return held
    if translator_round == 0:
        return None
    if held is not None and ctx.state.get(("fedsa.translator_round", label)) == translator_round:
        return held
    kept = ctx.state_store(TRANSLATORS, store) if store else None
    if kept is None or kept.folder is None:
        return held
    if not kept.has(label, translator_round):
        raise FileNotFoundError(f"client {ctx.client_id}: no translator of {label!r} after round {translator_round} in {kept.folder}")
    return set_params(build(), kept.load(label, translator_round))


@client_step("fedsa.distill")
def distill_student(ctx: ClientContext, student_params: dict[str, np.ndarray], *, label: str, round: int, copies: int,
                    student_cfg: Any, epochs: int, lr: float, batch_size: int, optimizer: str = "adam",
                    weight_decay: float = 0.0, translator_round: int | None = None, store: str | None = None) -> dict[str, Any]:
    """SelectiveKA(n, theta^t) of Algorithm 1: ``copies`` local students distilled from this client's teacher.

    Each copy starts from the broadcast student and from this client's translator for ``label`` (created on first
    use, then kept here across rounds; the first copy's trained translator is kept), and learns the teacher's
    feature map on the client's unlabelled private inputs (eq. 4). Returns the students' parameters, the KD losses
    and the number of private examples used -- never the teacher's parameters, the translator or the data.

    With ``store`` (and ``run.model_cache`` on the client) the kept translator is also written to the client's own
    storage after each round, so a resumed run's new client continues from it (``translator_round``: the round the
    server's checkpoint says this client last distilled in; see :func:`_held_translator`).
    """
    from rayfuse.models import build_model, get_params, set_params

    started = time.perf_counter()
    features = _teacher_features(ctx)
    key = ("fedsa.translator", label)
    students, losses = [], []
    translator = None
    for c in range(copies):
        student = set_params(build_model(student_cfg, ctx.input_shape, ctx.num_classes, seed=0), student_params)
        if c == 0:
            def build(student: Any = student) -> Any:
                shape = representation_shape(student, ctx.input_shape)
                return build_translator(shape, tuple(features.shape[1:]), seed=ctx.step_seed(label, "translator"))

            translator = _held_translator(ctx, label, translator_round, store, build)
            if translator is None:
                translator = build()
        assert translator is not None  # held or built at c == 0
        local_translator = copy.deepcopy(translator)
        losses.append(distill_features(student, local_translator, ctx.train.X, features, epochs=epochs, lr=lr,
                                       batch_size=batch_size, optimizer=optimizer, weight_decay=weight_decay,
                                       seed=ctx.step_seed(label, round, c), device=ctx.device))
        students.append(get_params(student))
        if c == 0:
            ctx.state[key] = local_translator.cpu()
            ctx.state[("fedsa.translator_round", label)] = round
    if store and ctx.local_cache:
        _keep_translator(ctx, store, label, round, translator_round)
    return {"students": students, "kd_loss": losses, "num_examples": ctx.num_examples, "seconds": time.perf_counter() - started}


def _keep_translator(ctx: ClientContext, store: str, label: str, round: int, previous: int | None) -> None:
    """Write the kept translator for ``round``; keep the file this round started from too (the server's checkpoint
    may still name it if the run stops before the server records this round), drop older ones."""
    from rayfuse.models import get_params

    ctx.state_store(TRANSLATORS, store).save(label, round, get_params(ctx.state[("fedsa.translator", label)]),
                                             keep=previous or None, metadata={"label": label})


# -----------------------------------------------------------------------------------------------------------------
# Parameters


class TargetParams(MethodParams):
    """Training on the server's labelled target set (shared by ``fedsa``, ``scratch`` and ``transfer``)."""

    target_epochs: int = Field(100, ge=0, description="epochs training the weak target model on D_T before the rounds (code: 10 "
                               "epochs of Adam 0.1 on a ResNet; a 1 % target set of digits is 1-2 batches an epoch)")
    target_lr: float = Field(0.01, gt=0, description="Adam lr on D_T (code: 0.1 with a ResNet; too large for the small CNN here)")
    target_weight_decay: float = Field(1e-4, ge=0, description="weight decay on D_T (code: 1e-4)")
    target_batch_size: int = Field(64, ge=1)
    adapt: Literal["head", "whole"] = Field("head", description="target task adaptation: the head (paper) or the whole network (code)")
    adapt_epochs: int = Field(100, ge=1, description="adaptation epochs on D_T (code: 30 on CIFAR; more here, the target sets are tiny)")
    adapt_lr: float = Field(0.01, gt=0, description="Adam lr of the adaptation")


class StudentParams(TargetParams):
    student: ModelConfig | None = Field(None, description="the target model (student) architecture; default: the teachers' (model)")


class FedSAParams(StudentParams):
    rounds: int = Field(50, ge=1, le=1_000_000, description="T communication rounds (code: 50)")
    select_every: int = Field(10, ge=1, description="E_g: re-select the teachers every this many rounds (code: 10)")
    k: int = Field(3, ge=1, description="K draws per selection (paper: 3 of 10; code: 2)")
    selection: Literal["saliency", "random", "fixed", "top_k", "least_k", "all"] = Field(
        "saliency", description="saliency (FedSA), fixed (FedSA's first draw kept), top_k, least_k, random, all (FedAvg+)")
    weighting: Literal["uniform", "positive", "negative"] = Field("uniform", description="aggregation weights of the draws (Table 2)")
    saliency: Literal["grad", "gradcam"] = Field("grad", description="input gradients of the representation (paper) or Grad-CAM (code)")
    similarity: Literal["per_image", "mean_map"] = Field("per_image", description="per-image cosines (code) or the averaged maps' cosine (eq. 2)")
    normalize: bool = Field(True, description="min-max normalise Q before the softmax (code; eq. 3 as written: false)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of eq. 3 (1: the paper)")
    retrain_head: bool = Field(True, description="re-train the target model's head on D_T before each re-selection (paper)")
    local_epochs: int = Field(10, ge=1, description="E: passes over a teacher's private data per local student (code: 10)")
    lr: float = Field(0.01, gt=0, description="lr of the local distillation (code: Adam 0.1, which diverges on the small CNN here)")
    batch_size: int = Field(64, ge=1, description="local distillation batch (code: 64)")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="local optimiser (code: Adam; Algorithm 1: SGD)")
    weight_decay: float = Field(0.0, ge=0)
    evaluate_every: int = Field(10, ge=1, description="adapt a copy and evaluate every this many rounds (code: 10) and after the last")


# -----------------------------------------------------------------------------------------------------------------
# Server helpers


def check_target_set(public_size: int) -> None:
    """Refuse an empty target set (the server's public sample, ``data.public_size``)."""
    if public_size == 0:
        raise InputError("data.public_size", "a labelled target set on the server (> 0; e.g. 0.01, 0.05 or 0.1 of the pool)", 0,
                         "FedSA's target set is the server's public sample")


def check_student(params: StudentParams, setup: RunSetup) -> Any:
    """The student (target model) built from its config on the CPU, or an :class:`InputError` at ``student.*`` when
    it does not fit the data (the teachers' ``model`` is checked by the run itself)."""
    from rayfuse.models import build_model
    from rayfuse.models.registry import check_model_fits

    if params.student is not None:
        try:
            check_model_fits(params.student, setup.input_shape, setup.num_classes)
        except InputError as exc:
            rest = exc.path.split(".", 1)[1] if exc.path.startswith("model.") else ""
            raise exc.at(f"student.{rest}" if rest else "student") from None
    cfg = params.student if params.student is not None else setup.model
    return build_model(cfg, setup.input_shape, setup.num_classes, seed=0)


def check_head(model: Any, path: str) -> None:
    """Refuse a model without a linear classifier to adapt to the target task (``path``: its config key)."""
    try:
        find_head(model)
    except InputError as exc:
        raise exc.at(path) from None


def _target_set(server: ServerContext) -> Split:
    target = server.public
    check_target_set(len(target))
    return target


def _student_config(server: ServerContext, params: StudentParams) -> ModelConfig:
    return params.student if params.student is not None else server.model_cfg


def _build_student(server: ServerContext, cfg: ModelConfig) -> Any:
    from rayfuse.models import build_model

    # One seed for every method of the run: scratch, FedSA and its ablations start from the same weak target model.
    return build_model(cfg, server.input_shape, server.num_classes, seed=derive_seed(server.seed, "fedsa", "student"))


def _train_weak_target(server: ServerContext, model: Any, target: Split, p: TargetParams) -> Any:
    """The weak target model: the whole network trained on D_T (the code's warm-up; Algorithm 1, line 4)."""
    from rayfuse.models import train_model

    train_model(model, target.X, target.y, epochs=p.target_epochs, batch_size=p.target_batch_size, lr=p.target_lr,
                optimizer="adam", weight_decay=p.target_weight_decay, seed=derive_seed(server.seed, "fedsa", "weak-target"),
                device=server.device)
    return model


def _adapt(server: ServerContext, model: Any, target: Split, p: TargetParams, tag: object) -> Any:
    return adapt_to_target(model, target.X, target.y, mode=p.adapt, epochs=p.adapt_epochs, lr=p.adapt_lr,
                           batch_size=p.target_batch_size, weight_decay=p.target_weight_decay,
                           seed=derive_seed(server.seed, "fedsa", "adapt", tag), device=server.device)


def _evaluate(server: ServerContext, model: Any) -> dict[str, float]:
    from rayfuse.models import predict_proba

    proba = predict_proba(model, server.test.X, device=server.device)
    if not np.isfinite(proba).all():
        raise NonFiniteError(f"{server.label}: the target model predicts NaN or Inf")
    return server.evaluate_proba(proba)


def _check_finite(params: dict[str, np.ndarray]) -> bool:
    return all(np.isfinite(v).all() for v in params.values() if v.dtype.kind == "f")


# -----------------------------------------------------------------------------------------------------------------
# Methods


@register_method
class Scratch(Method):
    name = "scratch"
    Params = StudentParams
    params: StudentParams
    summary = "the target model trained on the server's labelled target set alone (FedSA's Scratch baseline)"
    reference = references.FEDSA
    # The same network, initialisation and training as FedSA's weak target model (round 0), evaluated as it is.

    @classmethod
    def check(cls, params: MethodParams, setup: RunSetup) -> None:
        """A target set, and a student that fits the data."""
        check_target_set(setup.public_size)
        check_student(params, setup)  # type: ignore[arg-type]

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        target = _target_set(server)
        model = _train_weak_target(server, _build_student(server, _student_config(server, p)), target, p)
        from rayfuse.models import get_params

        metrics = _evaluate(server, model)  # trained end to end on D_T: no separate adaptation
        server.log(0, metrics)
        return MethodResult(metrics, get_params(model), info={"target_size": len(target)})


class TransferParams(TargetParams):
    pass


@register_method
class Transfer(Method):
    name = "transfer"
    Params = TransferParams
    params: TransferParams
    summary = "each teacher fine-tuned on the target set (needs the teachers' weights: not federated; FedSA's Transfer)"
    reference = references.FEDSA
    uses_local_models = True
    oracle = True  # the teachers' weights leave their clients: not possible in FedSA's setting

    @classmethod
    def check(cls, params: MethodParams, setup: RunSetup) -> None:
        """A target set, and teachers with a classifier to adapt."""
        from rayfuse.models import build_model

        check_target_set(setup.public_size)
        check_head(build_model(setup.model, setup.input_shape, setup.num_classes, seed=0), "model.name")

    def run(self, server: ServerContext) -> MethodResult:
        from rayfuse.models import build_model, set_params

        p = self.params
        target = _target_set(server)
        rows = []
        for client, update in server.accept_updates(server.local_updates()).items():
            teacher = set_params(build_model(server.model_cfg, server.input_shape, server.num_classes), update.params)
            probe = _evaluate(server, adapt_to_target(teacher, target.X, target.y, mode="head", epochs=p.adapt_epochs, lr=p.adapt_lr,
                                                      batch_size=p.target_batch_size, seed=derive_seed(server.seed, "transfer", client)))
            tuned = _evaluate(server, adapt_to_target(teacher, target.X, target.y, mode="whole", epochs=p.adapt_epochs, lr=p.adapt_lr,
                                                      batch_size=p.target_batch_size, weight_decay=p.target_weight_decay,
                                                      seed=derive_seed(server.seed, "transfer", client)))
            server.log(0, {"probe_accuracy": probe["accuracy"], "accuracy": tuned["accuracy"]}, client=client)
            rows.append({"client": client, "probe_accuracy": probe["accuracy"], "finetune_accuracy": tuned["accuracy"],
                         "finetune_nll": tuned["nll"]})
        metrics = {"accuracy": float(np.mean([r["finetune_accuracy"] for r in rows])),
                   "nll": float(np.mean([r["finetune_nll"] for r in rows])),
                   "probe_accuracy": float(np.mean([r["probe_accuracy"] for r in rows])),
                   "best_accuracy": float(np.max([r["finetune_accuracy"] for r in rows])),
                   "best_probe_accuracy": float(np.max([r["probe_accuracy"] for r in rows]))}
        server.log(0, metrics)
        return MethodResult(metrics, info={"per_teacher": rows, "note": "needs the teachers' weights (model access)"})


@register_method
class FedSA(Method):
    name = "fedsa"
    Params = FedSAParams
    params: FedSAParams
    summary = "saliency-based teacher selection and selective feature amalgamation into a new-task student (Xie et al. 2022)"
    reference = references.FEDSA
    multi_round = True  # a checkpoint after each round; ``--resume`` continues mid-method (see :meth:`_resume`)

    @classmethod
    def check(cls, params: MethodParams, setup: RunSetup) -> None:
        """Bad input before any client works: the target set, K, and whether a translator can bridge the features."""
        from rayfuse.models import build_model

        p: FedSAParams = params  # type: ignore[assignment]
        check_target_set(setup.public_size)
        n = setup.num_clients
        if p.selection != "all" and p.k > n:
            raise InputError("k", f"at most the number of teachers ({n}, partition.num_clients)", p.k)
        student = check_student(p, setup)
        # Architectures only (public config): the server never sees a teacher's weights.
        teacher_shape = representation_shape(build_model(setup.model, setup.input_shape, setup.num_classes, seed=0),
                                             setup.input_shape)
        try:
            student_shape = representation_shape(student, setup.input_shape)
        except InputError as exc:
            raise InputError("student" if p.student is not None else exc.path, exc.expected, exc.got) from None
        build_translator(student_shape, teacher_shape, path="student")
        if p.saliency == "gradcam" and (len(teacher_shape) != 3 or len(student_shape) != 3):
            raise InputError("saliency", "grad for models without a convolutional feature map (Grad-CAM needs one)", "gradcam")
        check_head(student, "student" if p.student is not None else "model.name")

    def run(self, server: ServerContext) -> MethodResult:
        from rayfuse.models import get_params, set_params

        p = self.params
        target = _target_set(server)
        student_cfg = _student_config(server, p)
        student = _build_student(server, student_cfg)
        checkpoint = self._resume(server)
        # The server's state between rounds: everything a round reads that an earlier round wrote (checkpointed below).
        teachers = list(server.federation.client_ids)
        teacher_maps: dict[int, np.ndarray] | None = None
        selections: list[dict[str, Any]] = []
        draws: list[int] = []
        weights: list[float] = []
        probs = np.full(len(teachers), 1.0 / len(teachers))
        metrics: dict[str, float] = {}
        adapted: Any = None
        kd_seconds = 0.0
        # the round each client last distilled in (its translator's age); where the clients keep their translators
        translator_rounds: dict[int, int] = {}
        store = uuid.uuid4().hex if server.model_cache else None
        start = 0
        if checkpoint is None:
            student = _train_weak_target(server, student, target, p)
        else:
            meta, state = checkpoint.meta, checkpoint.state
            start = checkpoint.round
            set_params(student, checkpoint.params)
            teachers, draws, weights = list(meta["teachers"]), list(meta["draws"]), list(meta["weights"])
            selections, metrics, kd_seconds = list(meta["selections"]), dict(meta["metrics"]), float(meta["kd_seconds"])
            probs = np.asarray(state["probs"], dtype=np.float64)
            translator_rounds = {int(c): int(r) for c, r in meta["translator_rounds"]}
            store = meta["store"]
            if start < p.rounds and selections:
                teacher_maps = self._teacher_maps(server, target)
                self._check_teachers(server, teachers, teacher_maps, state)
            if start >= p.rounds:  # every round was done: the final adapted model is in the checkpoint
                adapted = set_params(_build_student(server, student_cfg),
                                     {k[len("adapted/"):]: v for k, v in state.items() if k.startswith("adapted/")})
        reference = get_params(student)
        for t in range(start, p.rounds):
            rnd = t + 1
            if t % p.select_every == 0 and not (p.selection == "fixed" and t > 0):
                if t > 0 and p.retrain_head:  # the paper trains the weak target model on D_T before each selection
                    student = adapt_to_target(student, target.X, target.y, mode="head", epochs=p.target_epochs, lr=p.target_lr,
                                              batch_size=p.target_batch_size, reset_head=False,
                                              seed=derive_seed(server.seed, "fedsa", "reselect", t), device=server.device)
                if teacher_maps is None:
                    teacher_maps = self._teacher_maps(server, target)
                    teachers = [c for c in teachers if c in teacher_maps]
                target_maps = compute_saliency(student, target.X, kind=p.saliency, device=server.device)
                sims, Q = compute_transferability(target_maps, [teacher_maps[c] for c in teachers], similarity=p.similarity)
                probs = selection_probabilities(Q, normalize=p.normalize, temperature=p.temperature)
                # One draw stream for every label of the run (common random numbers): ``fixed`` keeps exactly FedSA's first
                # draw, and the ablations differ from FedSA by their rule, not by their luck. Seeded by the round, so a
                # resumed run draws what the interrupted one would have.
                picked = select_teachers(p.selection, probs, Q, p.k, make_rng(server.seed, "fedsa", "select", t))
                draws = [teachers[i] for i in picked]
                weights = draw_weights(picked, probs, p.weighting)
                span = sims.max() - sims.min()
                selections.append({"round": rnd, "teachers": teachers, "draws": draws, "weights": [round(w, 6) for w in weights],
                                   "p": probs.round(6).tolist(), "similarity": sims.round(6).tolist(),
                                   "similarity_normalized": ((sims - sims.min()) / span if span > 0 else np.zeros_like(sims)).round(6).tolist()})
                server.progress(f"round {rnd}: selected teachers {draws}", round=rnd, draws=draws)
            student, row, distilled = self._aggregate(server, student, student_cfg, draws, weights, rnd, reference,
                                                      translator_rounds, store)
            translator_rounds.update({c: rnd for c in distilled})
            kd_seconds += row.pop("_seconds")
            counts = Counter(draws)
            row.update({f"selected_{c}": float(counts.get(c, 0)) for c in teachers})
            row.update({f"p_{c}": float(probs[i]) for i, c in enumerate(teachers)})
            if rnd % p.evaluate_every == 0 or rnd == p.rounds:
                adapted = _adapt(server, student, target, p, rnd)  # task adaptation on a copy (the code, every 10 rounds)
                metrics = _evaluate(server, adapted)
                row.update(metrics)
            server.log(rnd, row)
            server.progress(f"round {rnd}/{p.rounds}", round=rnd, rounds=p.rounds,
                            metrics={k: round(v, 4) for k, v in row.items() if not k.startswith(("p_", "selected_"))})
            state = {"probs": probs, **{f"teacher_saliency/{c}": m.mean(axis=0) for c, m in (teacher_maps or {}).items()}}
            if rnd == p.rounds:
                state.update({f"adapted/{k}": v for k, v in get_params(adapted).items()})
            server.save_checkpoint(rnd, get_params(student), state, {
                "teachers": [int(c) for c in teachers], "draws": [int(c) for c in draws], "weights": [float(w) for w in weights],
                "selections": selections, "metrics": metrics, "kd_seconds": kd_seconds, "store": store,
                "translator_rounds": sorted([int(c), int(r)] for c, r in translator_rounds.items()),
                "last_selection": selections[-1]["round"] if selections else None})
        if store is not None:
            server.forget_client_state(TRANSLATORS, store)  # the method is done: the clients may delete their translators
        # the last round is always evaluated: ``adapted`` / ``metrics`` are the final target model and its accuracy
        info = {"rounds": p.rounds, "k": p.k, "selection": p.selection, "weighting": p.weighting, "saliency": p.saliency,
                "teachers": teachers, "selections": selections, "target_size": len(target),
                "student": student_cfg.model_dump(mode="json"), "kd_seconds": round(kd_seconds, 3)}
        return MethodResult(metrics, get_params(adapted), info=info)

    # -- resume ----------------------------------------------------------------------------------------------------

    def _resume(self, server: ServerContext) -> Any:
        """The round checkpoint to continue from on ``--resume``, or ``None`` (a fresh start from round 0).

        Each teacher's translator lives on its client, across rounds: a resumed run can continue mid-method only when
        the clients kept theirs (``run.model_cache``, storage the clients own). Otherwise, and when a client lost its
        translator, the method starts again from round 0 (a ``warning`` event says why): the same result, later.
        """
        if not server.resume:
            return None
        if not server.model_cache:
            if server.checkpoint.load() is not None:
                server.events.emit("warning", "restarting from round 0: the teachers' translators stay on their clients, which "
                                   "keep them across runs only with run.model_cache", method=server.label)
            return None
        checkpoint = server.resume_checkpoint()
        if checkpoint is None or checkpoint.round >= self.params.rounds:
            return checkpoint
        rounds = {int(c): int(r) for c, r in checkpoint.meta["translator_rounds"]}
        missing = server.clients_missing_state(TRANSLATORS, checkpoint.meta["store"], rounds)
        if missing:
            server.events.emit("warning", f"restarting from round 0: clients {missing} no longer hold their translators",
                               method=server.label)
            server.history = []
            server.forget_client_state(TRANSLATORS, checkpoint.meta["store"])  # the others' are of no use now
            return None
        return checkpoint

    def _check_teachers(self, server: ServerContext, teachers: list[int], maps: dict[int, np.ndarray],
                        state: dict[str, np.ndarray]) -> None:
        """Refuse to continue with teachers other than the interrupted run's: their saliency maps (averaged over the
        probe set, checkpointed) must be the same, up to float noise (a resumed run may run on another backend)."""
        for client in teachers:
            saved = state.get(f"teacher_saliency/{client}")
            now = maps.get(client)
            if now is None:
                raise RunFailure(f"{server.label}: teacher {client} returned no saliency maps on resume; it cannot be checked "
                                 "against the interrupted run's teacher")
            if saved is None or saved.shape != now.shape[1:] or not np.allclose(
                    now.mean(axis=0), saved, rtol=1e-4, atol=1e-6 * float(np.abs(saved).max(initial=0.0))):
                raise RunFailure(f"{server.label}: teacher {client} is not the interrupted run's teacher (its saliency maps "
                                 "differ); run the experiment again without --resume")

    def _teacher_maps(self, server: ServerContext, target: Split) -> dict[int, np.ndarray]:
        fed = server.federation
        gathered = fed.run(compute_teacher_saliency, fed.put(target.X), kind=self.params.saliency)
        maps: dict[int, np.ndarray] = {}
        shape = server.input_shape
        expected = int(np.prod(shape)) if self.params.saliency == "grad" else int(np.prod(shape[-2:]))
        for client, result in gathered.results.items():
            m = np.asarray(result.get("maps") if isinstance(result, dict) else None)
            if m.shape != (len(target), expected) or not np.isfinite(m).all():
                server.events.emit("update_rejected", f"saliency maps of shape {m.shape} or non-finite, expected {(len(target), expected)}",
                                   method=server.label, client=client)
                continue
            maps[client] = m
        if not maps:
            raise RunFailure(f"{server.label}: no teacher returned valid saliency maps")
        return maps

    def _aggregate(self, server: ServerContext, student: Any, student_cfg: ModelConfig, draws: list[int], weights: list[float],
                   rnd: int, reference: dict[str, np.ndarray], translator_rounds: dict[int, int],
                   store: str | None) -> tuple[Any, dict[str, float], list[int]]:
        """One round of selective aggregation: one broadcast, local students from the drawn teachers, eq. 5.

        Returns the new student, the round's numbers and the clients that distilled (their translators moved on).
        """
        from rayfuse.models import check_params, get_params, set_params

        p = self.params
        fed = server.federation
        started = time.perf_counter()
        broadcast = fed.put(get_params(student))
        counts = Counter(draws)
        calls = [call for client in sorted(counts) for call in fed.map(
            distill_student, broadcast, clients=[client], label=server.label, round=rnd, copies=counts[client],
            student_cfg=student_cfg, epochs=p.local_epochs, lr=p.lr, batch_size=p.batch_size, optimizer=p.optimizer,
            weight_decay=p.weight_decay, translator_round=translator_rounds.get(client, 0), store=store)]
        gathered = fed.gather(calls)
        students, student_weights, losses = [], [], []
        for client, result in gathered.results.items():
            returned = result.get("students", []) if isinstance(result, dict) else []
            mine = [w for d, w in zip(draws, weights) if d == client]  # the weights of this teacher's draws
            if len(returned) != len(mine):
                server.events.emit("update_rejected", f"{len(returned)} students for {len(mine)} draws", method=server.label, client=client)
                continue
            for params, w, loss in zip(returned, mine, result.get("kd_loss", [np.nan] * len(mine))):
                problem = check_params(params, reference)
                if problem is None and not np.isfinite(loss):
                    problem = f"non-finite KD loss {loss}"
                if problem is not None:
                    server.events.emit("update_rejected", problem, method=server.label, client=client)
                    continue
                students.append(params)
                student_weights.append(w)
                losses.append(float(loss))
        if not students:
            raise RunFailure(f"{server.label}: round {rnd}: no valid local student came back (see the update_rejected events)")
        averaged = average_students(students, student_weights)
        if not _check_finite(averaged):
            raise NonFiniteError(f"{server.label}: round {rnd}: the averaged student has NaN or Inf values")
        set_params(student, averaged)
        return student, {"kd_loss": float(np.mean(losses)), "students": float(len(students)),
                         "_seconds": time.perf_counter() - started}, sorted(gathered.results)
