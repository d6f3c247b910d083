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
continue mid-method: :data:`KEPT_TRANSLATORS`). Teachers' saliency maps are computed once per method (teachers and
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
from collections import Counter
from dataclasses import dataclass, field
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
from rayfuse.method import (
    ClientContext,
    ClientRounds,
    KeptState,
    Method,
    MethodCase,
    MethodParams,
    MethodResult,
    MethodTags,
    Rejected,
    RunSetup,
    ServerContext,
    client_step,
    register_method,
    transient,
)
from rayfuse.seeding import derive_seed, make_rng

__all__ = [
    "FedSA",
    "FedSAParams",
    "Scratch",
    "Transfer",
    "TargetParams",
    "check_student",
    "check_target_set",
    "compute_teacher_saliency",
    "distill_student",
]


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
            cached = torch.cat([hidden_representation(teacher, X[i : i + 1024]) for i in range(0, len(X), 1024)]).cpu()
        ctx.state["fedsa.teacher_features"] = cached
    return cached


TRANSLATORS = "fedsa-translators"  # the kind of client state (:class:`rayfuse.client.ClientStateStore`) FedSA keeps
#: each teacher's translator, kept by its client across rounds (and in its own storage with ``run.model_cache``)
KEPT_TRANSLATORS = KeptState(TRANSLATORS, "translators", item="translator", key="fedsa.translator")


@client_step("fedsa.distill")
def distill_student(
    ctx: ClientContext,
    student_params: dict[str, np.ndarray],
    *,
    label: str,
    round: int,
    copies: int,
    student_cfg: Any,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: str = "adam",
    weight_decay: float = 0.0,
    translator_round: int = 0,
    store: str | None = None,
) -> dict[str, Any]:
    """SelectiveKA(n, theta^t) of Algorithm 1: ``copies`` local students distilled from this client's teacher.

    Each copy starts from the broadcast student and from this client's translator for ``label`` (created on first
    use, then kept here across rounds; the first copy's trained translator is kept), and learns the teacher's
    feature map on the client's unlabelled private inputs (eq. 4). Returns the students' parameters, the KD losses
    and the number of private examples used -- never the teacher's parameters, the translator or the data.

    ``translator_round``: the round the server's checkpoint says this client last distilled in (0: none yet, a new
    translator). With ``store`` (and ``run.model_cache`` on the client) the kept translator is also written to the
    client's own storage after each round, so a resumed run's new client continues from it (:data:`KEPT_TRANSLATORS`).
    """
    from rayfuse.models import build_model, get_params, set_params

    started = time.perf_counter()
    features = _teacher_features(ctx)
    students, losses = [], []
    translator = None
    for c in range(copies):
        student = set_params(build_model(student_cfg, ctx.input_shape, ctx.num_classes, seed=0), student_params)
        if c == 0:

            def build(student: Any = student) -> Any:
                shape = representation_shape(student, ctx.input_shape)
                return build_translator(shape, tuple(features.shape[1:]), seed=ctx.step_seed(label, "translator"))

            translator = KEPT_TRANSLATORS.take(
                ctx, label, translator_round or None, store, fresh=build, load=lambda arrays: set_params(build(), arrays)
            )
        assert translator is not None  # taken (kept or fresh) at c == 0
        local_translator = copy.deepcopy(translator)
        losses.append(
            distill_features(
                student,
                local_translator,
                ctx.train.X,
                features,
                epochs=epochs,
                lr=lr,
                batch_size=batch_size,
                optimizer=optimizer,
                weight_decay=weight_decay,
                seed=ctx.step_seed(label, round, c),
                device=ctx.device,
            )
        )
        students.append(get_params(student))
        if c == 0:
            KEPT_TRANSLATORS.keep(
                ctx,
                label,
                local_translator.cpu(),
                round,
                store,
                previous=translator_round or None,
                arrays=get_params,
                metadata={"label": label},
            )
    return {"students": students, "kd_loss": losses, "num_examples": ctx.num_examples, "seconds": time.perf_counter() - started}


# -----------------------------------------------------------------------------------------------------------------
# Parameters


class TargetParams(MethodParams):
    """Training on the server's labelled target set (shared by ``fedsa``, ``scratch`` and ``transfer``)."""

    target_epochs: int = Field(
        100,
        ge=0,
        description="epochs training the weak target model on D_T before the rounds (code: 10 "
        "epochs of Adam 0.1 on a ResNet; a 1 % target set of digits is 1-2 batches an epoch)",
    )
    target_lr: float = Field(0.01, gt=0, description="Adam lr on D_T (code: 0.1 with a ResNet; too large for the small CNN here)")
    target_weight_decay: float = Field(1e-4, ge=0, description="weight decay on D_T (code: 1e-4)")
    target_batch_size: int = Field(64, ge=1, description="batch size of every training on D_T (the weak target model, the adaptation)")
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
        "saliency", description="saliency (FedSA), fixed (FedSA's first draw kept), top_k, least_k, random, all (FedAvg+)"
    )
    weighting: Literal["uniform", "positive", "negative"] = Field("uniform", description="aggregation weights of the draws (Table 2)")
    saliency: Literal["grad", "gradcam"] = Field("grad", description="input gradients of the representation (paper) or Grad-CAM (code)")
    similarity: Literal["per_image", "mean_map"] = Field(
        "per_image", description="per-image cosines (code) or the averaged maps' cosine (eq. 2)"
    )
    normalize: bool = Field(True, description="min-max normalise Q before the softmax (code; eq. 3 as written: false)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of eq. 3 (1: the paper)")
    retrain_head: bool = Field(True, description="re-train the target model's head on D_T before each re-selection (paper)")
    local_epochs: int = Field(10, ge=1, description="E: passes over a teacher's private data per local student (code: 10)")
    lr: float = Field(0.01, gt=0, description="lr of the local distillation (code: Adam 0.1, which diverges on the small CNN here)")
    batch_size: int = Field(64, ge=1, description="local distillation batch (code: 64)")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="local optimiser (code: Adam; Algorithm 1: SGD)")
    weight_decay: float = Field(0.0, ge=0, description="weight decay of the local distillation")
    evaluate_every: int = Field(10, ge=1, description="adapt a copy and evaluate every this many rounds (code: 10) and after the last")


# -----------------------------------------------------------------------------------------------------------------
# Server helpers


def check_target_set(public_size: int) -> None:
    """Refuse an empty target set (the server's public sample, ``data.public_size``)."""
    if public_size == 0:
        raise InputError(
            "data.public_size",
            "a labelled target set on the server (> 0; e.g. 0.01, 0.05 or 0.1 of the pool)",
            0,
            "FedSA's target set is the server's public sample",
        )


def check_student(params: StudentParams, setup: RunSetup) -> Any:
    """The student (target model) built from its config on the CPU, or an :class:`InputError` at ``student.*`` when
    it does not fit the data (the teachers' ``model`` is checked by the run itself)."""
    from rayfuse.models import build_model
    from rayfuse.models.registry import check_model_fits

    if setup.input_shape is None or setup.num_classes is None:
        return None  # not known yet (a silo run before its survey): checked after it
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
    target = server.data.public
    check_target_set(len(target))
    return target


def _student_config(server: ServerContext, params: StudentParams) -> ModelConfig:
    return params.student if params.student is not None else server.models.model_cfg


def _build_student(server: ServerContext, cfg: ModelConfig) -> Any:
    from rayfuse.models import build_model

    # One seed for every method of the run: scratch, FedSA and its ablations start from the same weak target model.
    return build_model(cfg, server.data.input_shape, server.data.num_classes, seed=derive_seed(server.seed, "fedsa", "student"))


def _train_weak_target(server: ServerContext, model: Any, target: Split, p: TargetParams) -> Any:
    """The weak target model: the whole network trained on D_T (the code's warm-up; Algorithm 1, line 4)."""
    from rayfuse.models import train_model

    train_model(
        model,
        target.X,
        target.y,
        epochs=p.target_epochs,
        batch_size=p.target_batch_size,
        lr=p.target_lr,
        optimizer="adam",
        weight_decay=p.target_weight_decay,
        seed=derive_seed(server.seed, "fedsa", "weak-target"),
        device=server.models.device,
    )
    return model


def _adapt(server: ServerContext, model: Any, target: Split, p: TargetParams, tag: object) -> Any:
    return adapt_to_target(
        model,
        target.X,
        target.y,
        mode=p.adapt,
        epochs=p.adapt_epochs,
        lr=p.adapt_lr,
        batch_size=p.target_batch_size,
        weight_decay=p.target_weight_decay,
        seed=derive_seed(server.seed, "fedsa", "adapt", tag),
        device=server.models.device,
    )


def _evaluate(server: ServerContext, model: Any) -> dict[str, float]:
    from rayfuse.models import predict_proba

    proba = predict_proba(model, server.data.test.X, device=server.models.device)
    if not np.isfinite(proba).all():
        raise NonFiniteError(f"{server.label}: the target model predicts NaN or Inf")
    return server.scoring.evaluate_proba(proba)


def _check_finite(params: dict[str, np.ndarray]) -> bool:
    return all(np.isfinite(v).all() for v in params.values() if v.dtype.kind == "f")


# -----------------------------------------------------------------------------------------------------------------
# Methods

#: the teacher-student methods' tiny runs (their ``test_case``, rayfuse.testing): digits with a public sample, a small
#: CNN, one epoch of each stage; on silo data (4 features) a vector student
_TINY_CNN: dict[str, Any] = {"name": "cnn", "channels": [4, 8]}
_TINY_TEACHERS: dict[str, Any] = {"data": {"dataset": "digits", "public_size": 0.1, "val_size": 0.0}, "model": _TINY_CNN}
_TINY_TARGET: dict[str, Any] = {"target_epochs": 1, "adapt_epochs": 1}
_TINY_SILO_STUDENT: dict[str, Any] = {"name": "mlp", "hidden": [8]}


@register_method
class Scratch(Method[StudentParams, None]):
    name = "scratch"
    tags = MethodTags(
        fuses="nothing",
        federated_evaluation=False,  # a target-task model scored on the server's target test set: evaluation central only
        public_sample=True,
        public_labels=True,  # trains on the target set's labels (the server's public sample)
    )
    test_case = MethodCase(
        {**_TINY_TARGET, "student": _TINY_CNN},
        _TINY_TEACHERS,
        fused="student",
        variants={"silos": {**_TINY_TARGET, "student": _TINY_SILO_STUDENT}},
    )
    Params = StudentParams
    summary = "the target model trained on the server's labelled target set alone (FedSA's Scratch baseline)"
    reference = references.FEDSA
    # The same network, initialisation and training as FedSA's weak target model (round 0), evaluated as it is.

    @classmethod
    def check(cls, params: StudentParams, setup: RunSetup) -> None:
        """A target set, and a student that fits the data."""
        check_target_set(setup.public_size)
        check_student(params, setup)

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
class Transfer(Method[TransferParams, None]):
    name = "transfer"
    tags = MethodTags(
        fuses="nothing",  # each teacher fine-tuned on its own: nothing combined
        federated_evaluation=False,  # a target-task model scored on the server's target test set: evaluation central only
        uses_local_models=True,
        oracle=True,  # the teachers' weights leave their clients: not possible in FedSA's setting
        public_sample=True,
        public_labels=True,  # fine-tunes each teacher on the target set's labels (the server's public sample)
    )
    test_case = MethodCase(_TINY_TARGET, _TINY_TEACHERS, fused=None)
    Params = TransferParams
    summary = "each teacher fine-tuned on the target set (needs the teachers' weights: not federated; FedSA's Transfer)"
    reference = references.FEDSA

    @classmethod
    def check(cls, params: TransferParams, setup: RunSetup) -> None:
        """A target set, and teachers with a classifier to adapt."""
        from rayfuse.models import build_model

        check_target_set(setup.public_size)
        if setup.input_shape is None or setup.num_classes is None:
            return  # not known yet (a silo run before its survey): checked after it
        check_head(build_model(setup.model, setup.input_shape, setup.num_classes, seed=0), "model.name")

    def run(self, server: ServerContext) -> MethodResult:
        from rayfuse.models import build_model, set_params

        p = self.params
        target = _target_set(server)
        rows = []
        for client, update in server.updates.accept(server.updates.local_updates()).items():
            teacher = set_params(build_model(server.models.model_cfg, server.data.input_shape, server.data.num_classes), update.params)
            probe = _evaluate(
                server,
                adapt_to_target(
                    teacher,
                    target.X,
                    target.y,
                    mode="head",
                    epochs=p.adapt_epochs,
                    lr=p.adapt_lr,
                    batch_size=p.target_batch_size,
                    seed=derive_seed(server.seed, "transfer", client),
                ),
            )
            tuned = _evaluate(
                server,
                adapt_to_target(
                    teacher,
                    target.X,
                    target.y,
                    mode="whole",
                    epochs=p.adapt_epochs,
                    lr=p.adapt_lr,
                    batch_size=p.target_batch_size,
                    weight_decay=p.target_weight_decay,
                    seed=derive_seed(server.seed, "transfer", client),
                ),
            )
            server.log(0, {"probe_accuracy": probe["accuracy"], "accuracy": tuned["accuracy"]}, client=client)
            rows.append(
                {
                    "client": client,
                    "probe_accuracy": probe["accuracy"],
                    "finetune_accuracy": tuned["accuracy"],
                    "finetune_nll": tuned["nll"],
                }
            )
        metrics = {
            "accuracy": float(np.mean([r["finetune_accuracy"] for r in rows])),
            "nll": float(np.mean([r["finetune_nll"] for r in rows])),
            "probe_accuracy": float(np.mean([r["probe_accuracy"] for r in rows])),
            "best_accuracy": float(np.max([r["finetune_accuracy"] for r in rows])),
            "best_probe_accuracy": float(np.max([r["probe_accuracy"] for r in rows])),
        }
        server.log(0, metrics)
        return MethodResult(metrics, info={"per_teacher": rows, "note": "needs the teachers' weights (model access)"})


@register_method
class FedSA(Method[FedSAParams, "FedSAState"]):
    name = "fedsa"
    tags = MethodTags(
        fuses="statistics",  # the teachers' saliency maps and students' features
        federated_evaluation=False,  # a target-task model scored on the server's target test set: evaluation central only
        public_sample=True,
        public_labels=True,  # the weak target model and the student train on the target set's labels (the server's public sample)
        multi_round=True,  # a checkpoint after each round; ``--resume`` continues mid-method (the round loop, :meth:`ServerContext.rounds`)
    )
    test_case = MethodCase(
        {
            **_TINY_TARGET,
            "student": _TINY_CNN,
            "rounds": 3,
            "select_every": 1,
            "k": 2,
            "selection": "all",
            "local_epochs": 1,
            "evaluate_every": 1,
        },
        _TINY_TEACHERS,
        step="fedsa.distill",
        fused="student",
        client_state=True,
        variants={"silos": {**_TINY_TARGET, "student": _TINY_SILO_STUDENT, "rounds": 1, "k": 2, "local_epochs": 1}},
    )
    Params = FedSAParams
    summary = "saliency-based teacher selection and selective feature amalgamation into a new-task student (Xie et al. 2022)"
    reference = references.FEDSA

    @classmethod
    def check(cls, params: FedSAParams, setup: RunSetup) -> None:
        """Bad input before any client works: the target set, K, and whether a translator can bridge the features.

        The teachers and the student may be any model ``torch.fx`` can trace whose output layer is a Linear after a
        hidden layer: the representation is read from its graph (the last feature map before global pooling or
        flatten, else the features the output layer reads; :func:`rayfuse.fusion.fedsa.kd.features_and_logits`)."""
        from rayfuse.models import build_model

        p = params
        check_target_set(setup.public_size)
        n = setup.num_clients
        if p.selection != "all" and p.k > n:
            raise InputError("k", f"at most the number of teachers ({n}, partition.num_clients)", p.k)
        if setup.input_shape is None or setup.num_classes is None:
            return  # not known yet (a silo run before its survey): checked after it
        student = check_student(p, setup)
        # Architectures only (public config): the server never sees a teacher's weights.
        teacher_shape = representation_shape(build_model(setup.model, setup.input_shape, setup.num_classes, seed=0), setup.input_shape)
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
        teachers = list(server.federation.client_ids)

        def evaluate(rnd: int) -> dict[str, float]:  # task adaptation on a copy (the code, every 10 rounds)
            adapted = _adapt(server, student, target, p, rnd)
            state.adapted = get_params(adapted)
            return _evaluate(server, adapted)

        rounds = server.rounds(
            FedSAState(get_params(student), teachers, np.full(len(teachers), 1.0 / len(teachers))),
            last=p.rounds,
            evaluate=evaluate,
            evaluate_every=p.evaluate_every,
            quiet=("p_", "selected_"),
            on_resume=lambda resumed: self._check_teachers(server, target, resumed),
        )
        state = rounds.state
        if rounds.resumed:
            set_params(student, state.params)
        else:
            student = _train_weak_target(server, student, target, p)
        reference = get_params(student)
        for rnd in rounds:
            t = rnd - 1
            if t % p.select_every == 0 and not (p.selection == "fixed" and t > 0):  # knowledge selection (eq. 1-3)
                if t > 0 and p.retrain_head:  # the paper trains the weak target model on D_T before each selection
                    student = adapt_to_target(
                        student,
                        target.X,
                        target.y,
                        mode="head",
                        epochs=p.target_epochs,
                        lr=p.target_lr,
                        batch_size=p.target_batch_size,
                        reset_head=False,
                        seed=derive_seed(server.seed, "fedsa", "reselect", t),
                        device=server.models.device,
                    )
                if state.teacher_maps is None:
                    state.teachers = [c for c in state.teachers if c in self._fetch_teachers(server, target, state)]
                target_maps = compute_saliency(student, target.X, kind=p.saliency, device=server.models.device)
                assert state.teacher_maps is not None  # fetched above (or restored on resume)
                sims, Q = compute_transferability(target_maps, [state.teacher_maps[c] for c in state.teachers], similarity=p.similarity)
                state.probs = selection_probabilities(Q, normalize=p.normalize, temperature=p.temperature)
                # One draw stream for every label of the run (common random numbers): ``fixed`` keeps exactly FedSA's first
                # draw, and the ablations differ from FedSA by their rule, not by their luck. Seeded by the round, so a
                # resumed run draws what the interrupted one would have.
                picked = select_teachers(p.selection, state.probs, Q, p.k, make_rng(server.seed, "fedsa", "select", t))
                state.draws = [state.teachers[i] for i in picked]
                state.weights = draw_weights(picked, state.probs, p.weighting)
                self._record_selection(server, state, rnd, sims)
            student, row = self._aggregate(server, student, student_cfg, state, rnd, reference)  # eq. 4-5
            state.params = get_params(student)
            counts = Counter(state.draws)
            row.update({f"selected_{c}": float(counts.get(c, 0)) for c in state.teachers})
            row.update({f"p_{c}": float(state.probs[i]) for i, c in enumerate(state.teachers)})
            rounds.log(row)
        # the last round is always evaluated: ``state.adapted`` / ``rounds.metrics`` are the final target model and its accuracy
        info = {
            "rounds": p.rounds,
            "k": p.k,
            "selection": p.selection,
            "weighting": p.weighting,
            "saliency": p.saliency,
            "teachers": state.teachers,
            "selections": state.selections,
            "target_size": len(target),
            "student": student_cfg.model_dump(mode="json"),
            "kd_seconds": round(state.kd_seconds, 3),
        }
        return MethodResult(rounds.metrics, state.adapted, info=info)

    # -- helpers of the rounds -------------------------------------------------------------------------------------

    @staticmethod
    def _record_selection(server: ServerContext, state: FedSAState, rnd: int, sims: np.ndarray) -> None:
        """A selection's record (``info.selections``) and its progress event."""
        span = sims.max() - sims.min()
        state.selections.append(
            {
                "round": rnd,
                "teachers": state.teachers,
                "draws": state.draws,
                "weights": [round(w, 6) for w in state.weights],
                "p": state.probs.round(6).tolist(),
                "similarity": sims.round(6).tolist(),
                "similarity_normalized": ((sims - sims.min()) / span if span > 0 else np.zeros_like(sims)).round(6).tolist(),
            }
        )
        server.progress(f"round {rnd}: selected teachers {state.draws}", round=rnd, draws=state.draws)

    def _fetch_teachers(self, server: ServerContext, target: Split, state: FedSAState) -> dict[int, np.ndarray]:
        """The teachers' saliency maps (fixed for the run: fetched once per method run), kept in ``state``."""
        state.teacher_maps = self._teacher_maps(server, target)
        state.teacher_saliency = {str(c): m.mean(axis=0) for c, m in state.teacher_maps.items()}
        return state.teacher_maps

    def _check_teachers(self, server: ServerContext, target: Split, state: FedSAState) -> None:
        """On resume: fetch the teachers' maps and refuse to continue with teachers other than the interrupted run's:
        their saliency maps (averaged over the probe set, checkpointed) must be the same, up to float noise (a resumed
        run may run on another backend)."""
        if not state.selections:
            return
        saved_maps = dict(state.teacher_saliency)
        maps = self._fetch_teachers(server, target, state)
        for client in state.teachers:
            saved = saved_maps.get(str(client))
            now = maps.get(client)
            if now is None:
                raise RunFailure(
                    f"{server.label}: teacher {client} returned no saliency maps on resume; it cannot be checked "
                    "against the interrupted run's teacher"
                )
            if (
                saved is None
                or saved.shape != now.shape[1:]
                or not np.allclose(now.mean(axis=0), saved, rtol=1e-4, atol=1e-6 * float(np.abs(saved).max(initial=0.0)))
            ):
                raise RunFailure(
                    f"{server.label}: teacher {client} is not the interrupted run's teacher (its saliency maps "
                    "differ); run the experiment again without --resume"
                )

    def _teacher_maps(self, server: ServerContext, target: Split) -> dict[int, np.ndarray]:
        fed = server.federation
        gathered = fed.run(compute_teacher_saliency, fed.put(target.X), kind=self.params.saliency)
        shape = server.data.input_shape
        expected = (len(target), int(np.prod(shape)) if self.params.saliency == "grad" else int(np.prod(shape[-2:])))

        def read(client: int, result: Any) -> np.ndarray:
            m = np.asarray(result.get("maps") if isinstance(result, dict) else None)
            if m.shape != expected or not np.isfinite(m).all():
                raise Rejected(f"saliency maps of shape {m.shape} or non-finite, expected {expected}")
            return m

        return server.updates.accept_replies(gathered, read, what="teachers' saliency maps")

    def _aggregate(
        self, server: ServerContext, student: Any, student_cfg: ModelConfig, state: FedSAState, rnd: int, reference: dict[str, np.ndarray]
    ) -> tuple[Any, dict[str, float]]:
        """One round of selective aggregation: one broadcast, local students from the drawn teachers, eq. 5.

        Returns the new student and the round's numbers; the clients that distilled moved their translators on.
        """
        from rayfuse.models import check_params, get_params, set_params

        p = self.params
        fed = server.federation
        started = time.perf_counter()
        broadcast = fed.put(get_params(student))
        counts = Counter(state.draws)
        calls = [
            call
            for client in sorted(counts)
            for call in fed.map(
                distill_student,
                broadcast,
                clients=[client],
                label=server.label,
                round=rnd,
                copies=counts[client],
                student_cfg=student_cfg,
                epochs=p.local_epochs,
                lr=p.lr,
                batch_size=p.batch_size,
                optimizer=p.optimizer,
                weight_decay=p.weight_decay,
                translator_round=state.translator_rounds.get(client, 0),
                store=state.translator_rounds.store,
            )
        ]
        gathered = fed.gather(calls)
        state.translator_rounds.moved(gathered.results, rnd)

        def read(client: int, result: Any) -> list[tuple[dict[str, np.ndarray], float, float]]:
            returned = result.get("students", []) if isinstance(result, dict) else []
            mine = [w for d, w in zip(state.draws, state.weights) if d == client]  # the weights of this teacher's draws
            if len(returned) != len(mine):
                raise Rejected(f"{len(returned)} students for {len(mine)} draws")
            losses = list(result.get("kd_loss", [np.nan] * len(mine)))
            for params, loss in zip(returned, losses):
                problem = check_params(params, reference) or (None if np.isfinite(loss) else f"non-finite KD loss {loss}")
                if problem is not None:
                    raise Rejected(problem)
            return list(zip(returned, mine, losses))

        kept = [
            draw for draws in server.updates.accept_replies(gathered, read, what="replies with local students").values() for draw in draws
        ]
        averaged = average_students([params for params, _, _ in kept], [w for _, w, _ in kept])
        if not _check_finite(averaged):
            raise NonFiniteError(f"{server.label}: round {rnd}: the averaged student has NaN or Inf values")
        set_params(student, averaged)
        state.kd_seconds += time.perf_counter() - started
        return student, {"kd_loss": float(np.mean([float(loss) for _, _, loss in kept])), "students": float(len(kept))}


@dataclass
class FedSAState:
    """FedSA's server state between rounds (checkpointed after each by the round loop).

    ``params``: the global student theta^t; ``teachers`` (the clients with valid saliency maps), ``probs`` (the last
    selection's p), ``draws`` and ``weights`` (its K draws); the selection records; the teachers' mean saliency maps
    (checked on resume); the last adapted target model; the clients' translators' rounds.
    """

    params: dict[str, np.ndarray]
    teachers: list[int]
    probs: np.ndarray
    draws: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    selections: list[dict[str, Any]] = field(default_factory=list)
    teacher_saliency: dict[str, np.ndarray] = field(default_factory=dict)
    adapted: dict[str, np.ndarray] | None = None
    kd_seconds: float = 0.0
    translator_rounds: ClientRounds = field(default_factory=KEPT_TRANSLATORS.rounds)
    teacher_maps: dict[int, np.ndarray] | None = transient()  # the teachers' maps on the probe set, fetched once
