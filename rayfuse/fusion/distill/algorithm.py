"""``distill``: one-shot fusion by ensemble distillation. A student learns to match the clients' ensemble.

One shot:

1. every client trains its local model (shared by all methods of the run); clients may have different architectures
   (``federation.client_overrides.<i>.model``);
2. the student starts from ``init``: ``aligned`` (the ``aligned`` method's merge of the clients whose architecture is
   the student's, its nonparametric width included when ``aligned.merge: nonparametric``), ``average`` (their
   sample-weighted average) or ``random``; with no client of the student's architecture it starts at random;
3. the student is trained on the server to match the ensemble of the clients' models (per-class teacher weights by
   ``weighting``, logits averaged, temperature ``temperature``) on transfer inputs from ``transfer``:

   - ``public``: the server's unlabeled public sample (``data.public_size``, or ``data.public`` with silos; labels are
     never read), shifted and mixed up (FedDF [FEDDF]);
   - ``synthetic``: data-free. A generator trained against the ensemble (DENSE [DENSE]: cross-entropy on sampled labels,
     BatchNorm statistic matching, an adversarial term; Co-Boosting's [COBOOST] hard-sample weighting and ensemble
     re-weighting as options); its outputs carry the clients' pooled input mean and variance per element when
     ``input_moments`` (each client's count, sum and sum of squares of its inputs).

   ``teachers``: ``parameters`` (the clients' local models are uploaded, as for ``average``, and evaluated on the
   server) or ``clients`` (predictions only: the server sends each client the transfer inputs of a pass, one call per
   client per pass, and the client returns its model's logits on them and, for the generator, the gradient of its own
   term of the generator's objective with respect to those inputs; no parameter leaves a client).

What leaves a client, by mode (``docs/methods/distill.md``): ``parameters``: its local model (and, with ``init:
aligned``, the ``aligned`` method's statistics); ``clients``: its logits on the server's transfer inputs, and with
``transfer: synthetic`` the input gradients above; ``input_moments``: per-element count, sum and sum of squares of its
inputs. Never a sample, a label or an activation of its own data. Local DP-SGD (``train.dp``) covers the predictions
(post-processing of a DP-trained model), not the input moments, which are then refused. Under secure aggregation
(``federation.secure_aggregation``, ``teachers: clients``) each client masks its term of the ensemble (its logits or
probabilities times its row of the teacher weights), its gradient term and its moments, and the server unmasks only
their sums (:class:`_SecureTeachers`, :data:`SECURE_STEPS`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from pydantic import Field

from rayfuse.config import ModelConfig, StrictSchema
from rayfuse.errors import InputError, RunFailure
from rayfuse.fusion import references
from rayfuse.fusion.aligned.algorithm import AlignedParams
from rayfuse.memory import check_fits_memory
from rayfuse.method import (
    ClientContext,
    Method,
    MethodCase,
    MethodParams,
    MethodResult,
    MethodTags,
    Rejected,
    RunSetup,
    ServerContext,
    Update,
    client_step,
    register_method,
)

__all__ = ["Distill", "DistillOptions", "DistillParams", "checked_target", "predict", "signal", "input_moments", "transfer_note"]


class DistillOptions(StrictSchema):
    """How a student is distilled: the parameters the ``distill`` method and ``rayfuse fuse``'s ``merge_method: distill``
    share (the loops' :class:`~rayfuse.fusion.distill.student.DistillSettings`, less the seed)."""

    combine: Literal["auto", "logits", "probabilities", "geometric", "energy"] = Field(
        "auto",
        description="the ensemble: weighted logits (FedDF), weighted probabilities, geometric (the weighted mean of "
        "the teachers' log-probabilities: a product of experts, blind to the scale of each one's logits), or energy "
        "(geometric plus each teacher's energy, the log-sum-exp of its logits, standardised over the pass's inputs: "
        "how familiar each finds an input); auto: energy with public transfer (measured above the others on mixed, "
        "label-skewed and 1-D sites: docs/methods/distill.md), unless the plain mean of the teachers' probabilities "
        "(uniform weights, temperature 1 unless set) labels the public inputs nearer the clients' pooled class counts "
        "(the check, with 10 clients or more sharing their classes: its top-1 histogram's total variation from them "
        "lower by more than 0.01; info.target records it); data-free, logits when every teacher has one architecture, "
        "probabilities when they differ (their logits' scales differ: averaged, the most confident architecture's "
        "would decide)",
    )
    temperature: float | None = Field(
        None,
        gt=0,
        le=100,
        description="distillation temperature T; default: 1 with combine geometric or energy (log-probabilities are "
        "matched as they are), 4 with logits or probabilities; where combine auto's check runs, lowered below 1 when the "
        "target is flat (with many weak clients): until its mean entropy on the public inputs is 0.75 of log C "
        "(info.target records both)",
    )
    steps: int = Field(2000, ge=1, le=10_000_000, description="student optimisation steps")
    epochs: int = Field(
        10,
        ge=1,
        description="passes: one progress line and, with teachers: clients, one call per client each "
        "(public: a bank of steps / epochs * batch_size inputs; synthetic: steps / epochs student steps)",
    )
    batch_size: int = Field(64, ge=2, description="student batch size")
    lr: float = Field(3e-3, gt=0, le=10, description="student learning rate (Adam, cosine schedule)")
    shift: int = Field(1, ge=0, le=64, description="public: random shifts of up to this many pixels (images) or steps (sequences (L, D))")
    scale: float = Field(
        0.0, ge=0, lt=1, description="public: each transfer input's amplitude times U(1 - scale, 1 + scale); never token ids"
    )
    noise: float = Field(
        0.0, ge=0, le=10, description="public: Gaussian noise of this many standard deviations of each input element; never token ids"
    )
    mixup: float = Field(
        0.5,
        ge=0,
        le=1,
        description="public: fraction of transfer inputs mixed with a second one (ratio ~ U(0, 1)); never token ids (texts)",
    )
    holdout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="public: this share of the transfer inputs held out, unaugmented, one teacher call more; the student "
        "kept is the pass (or the start) with the best fidelity to the ensemble on them (top-1 agreement, then KL), so "
        "the steps are chosen on inputs it never trained on; 0: the last pass",
    )
    patience: int = Field(0, ge=0, description="holdout: stop after this many passes in a row without a better fidelity (0: every pass)")
    synthetic_batch: int = Field(128, ge=2, description="synthetic: inputs per generated batch")
    generator_steps: int = Field(5, ge=1, description="synthetic: generator steps per round")
    student_steps: int = Field(20, ge=1, description="synthetic: student steps per round")
    generator_lr: float = Field(1e-3, gt=0, le=10, description="synthetic: generator learning rate (Adam, betas 0.5, 0.999)")
    latent_dim: int = Field(256, ge=1, le=65536, description="synthetic: the generator's noise dimension")
    generator_width: int = Field(
        32,
        ge=1,
        le=4096,
        description="synthetic: the generator's channels (DENSE's is 64: four times the work of the default's widest convolutions)",
    )
    ce_weight: float = Field(1.0, ge=0, description="synthetic: weight of the ensemble's cross-entropy on the sampled labels")
    bn_weight: float = Field(1.0, ge=0, description="synthetic: weight of the teachers' BatchNorm statistic matching")
    adversarial_weight: float = Field(1.0, ge=0, description="synthetic: weight of the student-ensemble disagreement term")
    hardness: float = Field(0.0, ge=0, le=16, description="synthetic: Co-Boosting's hard-sample weighting (1 - p_y)^hardness; 0: DENSE")
    reweight: bool = Field(False, description="synthetic: Co-Boosting's re-weighting of the ensemble's members each round")
    reweight_lr: float = Field(0.01, gt=0, le=1, description="synthetic, reweight: the members' weights' step")
    bank_samples: int = Field(20000, ge=1, description="synthetic: past generated inputs kept for the student")
    batched: Literal["auto", "vmap", "loop"] = Field(
        "auto",
        description="teachers of one architecture evaluated in one vmapped call "
        "or a loop; auto: vmap on a GPU, the loop on the CPU (where it measures faster)",
    )

    def settings(self, seed: int, *, one_architecture: bool = True, transfer: str = "public") -> Any:
        """The loops' settings (:class:`~rayfuse.fusion.distill.student.DistillSettings`): every parameter of the same
        name, ``seed``, ``combine: auto`` resolved (energy with ``transfer: public``; data-free, logits when the teachers
        have ``one_architecture``, else probabilities) and the default temperature (1 for geometric and energy, else 4)."""
        import dataclasses

        from rayfuse.fusion.distill.student import DistillSettings

        # word dropout and text mixup: the text fuse's options (rayfuse.finetunes.text_fuse), left at their defaults here
        names = {f.name for f in dataclasses.fields(DistillSettings)} - {"seed", "combine", "temperature", "word_dropout", "text_mixup"}
        combine = self.combine
        if combine == "auto":
            combine = "energy" if transfer == "public" else ("logits" if one_architecture else "probabilities")
        temperature = self.temperature if self.temperature is not None else (1.0 if combine in ("geometric", "energy") else 4.0)
        return DistillSettings(**{name: getattr(self, name) for name in names}, seed=seed, combine=combine, temperature=temperature)


class DistillParams(DistillOptions, MethodParams):
    """The ``distill`` method's parameters (defaults: a first try on small models, about a minute on 2 CPU cores)."""

    transfer: Literal["public", "synthetic"] = Field(
        "public",
        description="public: the server's unlabeled public sample, "
        "augmented; synthetic: data-free, from a generator trained against the ensemble",
    )
    teachers: Literal["parameters", "clients"] = Field(
        "parameters",
        description="parameters: the local models are uploaded and "
        "evaluated on the server; clients: predictions only, no parameter leaves a client",
    )
    init: Literal["aligned", "average", "random"] = Field(
        "aligned",
        description="the student's start: the aligned merge (or "
        "the average) of the clients of its architecture, or a random initialisation",
    )
    student: ModelConfig | None = Field(None, description="the student's architecture (a model section); default: the run's model")
    aligned: AlignedParams = Field(
        default_factory=AlignedParams, description="init: aligned: the aligned method's settings (alignment, merge, repair...; one shot)"
    )
    weighting: Literal["uniform", "samples", "classes"] = Field(
        "classes", description="teacher weights: uniform, by sample count, or per class by each client's class counts"
    )
    input_moments: bool = Field(
        True,
        description="synthetic: the clients report their inputs' per-element count, sum and sum of "
        "squares, and generated inputs take the pooled mean and variance",
    )
    generator_calls: Literal["step", "round"] | None = Field(
        None,
        description="teachers: clients, transfer: synthetic: how the clients give the generator its gradient: step (two "
        "calls every generator step, their logits then their input gradients for the server's cotangents: the exact "
        "gradient, 2 x generator_steps calls a round) or round (one call a round, each client's own term of the "
        "objective at the round's inputs: fewer calls, an approximation); default: step, round under secure aggregation "
        "(which sees only the clients' sums)",
    )
    rounds: int = Field(
        1,
        ge=1,
        le=100,
        description="1: one shot. More: a few-round mode past the ensemble: after round 1's student, each round every "
        "client refines the student on its own data, anchored to it on the public inputs (refine_*, anchor), and the "
        "server distils the refined models into it again, from where it was; one student's upload per client a round "
        "(predictions only: none, the refined student stays on the client and answers the round's predictions)",
    )
    refine_epochs: int = Field(5, ge=1, le=10_000, description="rounds > 1: epochs of each client's refinement of the student")
    refine_lr: float = Field(1e-3, gt=0, le=10, description="rounds > 1: the refinement's learning rate (Adam)")
    refine_batch_size: int | None = Field(None, ge=1, description="rounds > 1: the refinement's batch size (default: train.batch_size)")
    anchor: float = Field(
        1.0,
        ge=0,
        le=1000,
        description="rounds > 1: weight of the refinement's KL to the broadcast student on the public inputs (0: the "
        "client's own labels alone, which a label-skewed client overfits: it forgets the classes it lacks)",
    )
    repair: bool = Field(
        False,
        description="re-estimate the distilled student's BatchNorm statistics on the clients' data (each "
        "client's per-channel counts, means and variances, pooled); off by default: the student's own statistics, "
        "learnt with its weights on the transfer inputs, measured better (docs/methods/distill.md)",
    )


# A batch's float32 copies besides its inputs: mixed and shifted inputs, the student's and the teachers' activations and
# their gradients (a small model's; a deep one holds more, so this refuses only settings no machine here could run).
BATCH_COPIES = 16


def check_distill_memory(params: DistillParams, setup: RunSetup) -> None:
    """Refuse, before start, a batch or a bank whose memory exceeds what the machine has: the inputs of the bank the
    student draws from (public: ``steps / epochs * batch_size``; synthetic: ``bank_samples``) and ``BATCH_COPIES``
    float32 copies of a batch, with every teacher's and the student's logits per input. Skipped while the input shape
    is not known (silos, before their survey)."""
    if setup.input_shape is None:
        return
    per_input = 4.0 * (math.prod(setup.input_shape) + (setup.num_classes or 1) * (setup.num_clients + 1))
    if params.transfer == "public":
        bank, key, batch = -(-params.steps // params.epochs) * params.batch_size, "batch_size", params.batch_size
    else:
        bank, batch = params.bank_samples, params.synthetic_batch
        key = "synthetic_batch" if batch * BATCH_COPIES >= bank else "bank_samples"
    given = getattr(params, key)
    check_fits_memory(key, given, per_input * (bank + batch * BATCH_COPIES), f"distillation's inputs at {key} {given}")


def check_nested_aligned(params: DistillParams, setup: RunSetup) -> None:
    """The ``aligned:`` block of ``init: aligned`` checked, before start, as the ``aligned`` entry it runs as
    (:meth:`Distill._start`): over the student's architecture (``student``, default the run's model) and the clients
    whose model it is, the method's own check (its spec, its graph) and the update pipeline's (an aggregator's
    precondition on that number of models). Errors at ``aligned.<key>`` below this entry, the student's at
    ``student.<key>``. No client of the student's architecture: the student starts at random, the block is unused."""
    from rayfuse.config import CONFIG_SECTIONS
    from rayfuse.fusion.aligned.algorithm import Aligned
    from rayfuse.method import MethodSpec
    from rayfuse.updates.pipeline import check_update_pipeline

    student = params.student or setup.model
    same = [c for c in range(setup.num_clients) if setup.client_model(c) == student]
    if not same:
        return
    merged = dataclasses.replace(
        setup,
        model=student,
        num_clients=len(same),
        client_models=(),
        train_sizes=None if setup.train_sizes is None else tuple(setup.train_sizes[c] for c in same),
        val_sizes=None if setup.val_sizes is None else tuple(setup.val_sizes[c] for c in same),
    )
    try:
        Aligned.check(params.aligned, merged)
        check_update_pipeline([MethodSpec("aligned", "aligned", Aligned, params.aligned)], merged, ())
    except InputError as exc:
        path = exc.path.removeprefix("methods.aligned.")
        section = path.split(".", 1)[0].split("[", 1)[0]
        if section == "model" and params.student is not None:  # the model it checked is the student
            raise exc.at("student" + path.removeprefix("model")) from None
        if section in CONFIG_SECTIONS:
            raise
        if len(same) == setup.num_clients:
            raise exc.at(f"aligned.{path}") from None
        whose = f"the aligned start merges the {len(same)} clients of the student's architecture, {same}"
        raise InputError(f"aligned.{path}", exc.expected, exc.got, f"{exc.hint}; {whose}" if exc.hint else whose) from None


def transfer_note(params: DistillParams, samples: int | None) -> str:
    """How the table's ``extra`` column names the transfer data: ``public sample (300)``, ``synthetic (data-free)``,
    and ``, predictions only`` with ``teachers: clients``."""
    text = f"public sample ({samples})" if params.transfer == "public" else "synthetic (data-free)"
    return text + (", predictions only" if params.teachers == "clients" else "")


# ---------------------------------------------------------------------------------------------------------------
# Client steps (teachers: clients): predictions and gradients on the server's inputs, never the client's data


#: where a client holds the student it refined this round (rounds > 1, predictions only): ``ctx.state[(REFINED, label)]``
#: is ``(round, model)``, replaced by the next round's
REFINED = "distill.refined"


def _refined_model(ctx: ClientContext, label: str, round: int) -> Any:
    held = ctx.state.get((REFINED, label))
    if held is None or held[0] != round:
        raise RuntimeError(
            f"client {ctx.client_id} holds no student refined in round {round} of {label} "
            f"({'none' if held is None else f'round {held[0]}'}): it restarted since its refinement"
        )
    return held[1]


@client_step("distill.predict")
def predict(ctx: ClientContext, X: np.ndarray, *, chunk_size: int = 256, refined: tuple[str, int] | None = None) -> dict[str, np.ndarray]:
    """This client's local model's logits ``(N, C)`` on the server's transfer inputs ``X`` (nothing else); with
    ``refined`` ``(label, round)`` the logits of the student it refined in that round (:func:`refine`) instead."""
    import torch

    from rayfuse.fusion.distill.teachers import Teachers

    model = ctx.local_model() if refined is None else _refined_model(ctx, *refined)
    teacher = Teachers([model], batched=False, device=ctx.device, chunk_size=chunk_size, freeze=False)
    with torch.no_grad():
        logits = teacher.predict(X)[0]
    return {"logits": logits.float().cpu().numpy()}


@client_step("distill.refine")
def refine(
    ctx: ClientContext,
    student_params: dict[str, np.ndarray],
    public: np.ndarray,
    *,
    label: str,
    round: int,
    student: ModelConfig,
    epochs: int,
    lr: float,
    batch_size: int,
    anchor: float,
    upload: bool,
) -> Update:
    """The few-round mode's client turn (``rounds > 1``): the broadcast student refined on this client's training split,
    anchored to itself on the public inputs ``public``
    (:func:`~rayfuse.fusion.distill.student.refine_student`). With ``upload`` its parameters come back; without
    (predictions only) they stay on the client for the round's :func:`predict` calls and the reply holds only the
    sample count and the losses. The student is built without dropout (:func:`rayfuse.evaluation.model_for_params`)."""
    import torch

    from rayfuse.evaluation import model_for_params
    from rayfuse.fusion.distill.student import refine_student
    from rayfuse.models import get_params

    model = model_for_params(dict(student_params), student, ctx.input_shape, ctx.num_classes)
    X, y = ctx.device_split()
    inputs = torch.as_tensor(np.array(public, dtype=np.float32, order="C"))  # a copy: a broadcast array is read-only
    stats = refine_student(
        model,
        X,
        y,
        inputs,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        anchor=anchor,
        seed=ctx.step_seed(label, "refine", round),
        device=ctx.device,
    )
    metrics = {"train_loss": stats["train_loss"], "anchor_kl": stats["anchor_kl"], "train_seconds": stats["seconds"]}
    if upload:
        return Update(get_params(model.cpu()), ctx.num_examples, metrics)
    ctx.state[(REFINED, label)] = (round, model)
    return Update({}, ctx.num_examples, metrics)


@client_step("distill.signal")
def signal(
    ctx: ClientContext, X: np.ndarray, labels: np.ndarray, class_weights: np.ndarray, *, num_teachers: int, settings: dict[str, Any]
) -> dict[str, np.ndarray]:
    """For the data-free generator: this client's logits ``(G, B, C)`` on the server's generated batches ``X``
    ``(G, B, ...)`` and the gradient ``(G, B, ...)`` of its own term of the generator's objective with respect to those
    inputs (:func:`rayfuse.fusion.distill.student.teacher_signal`)."""
    import torch

    from rayfuse.fusion.distill.student import DistillSettings, teacher_signal
    from rayfuse.fusion.distill.teachers import writable

    X, labels = writable(X), writable(labels)  # arrays read from Ray's object store are read-only
    logits, grad = teacher_signal(
        ctx.local_model().to(ctx.device),
        torch.as_tensor(X, device=ctx.device),
        torch.as_tensor(labels, device=ctx.device),
        torch.as_tensor(class_weights, dtype=torch.float32, device=ctx.device),
        num_teachers=num_teachers,
        settings=DistillSettings(**settings),
    )
    return {"logits": logits.float().cpu().numpy(), "grad": grad.float().cpu().numpy()}


@client_step("distill.vjp")
def vjp(ctx: ClientContext, X: np.ndarray, cotangent: np.ndarray, *, num_teachers: int, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """For the data-free generator's step: the gradient at the server's generated inputs ``X`` ``(B, ...)`` of this
    client's logits against the server's cotangent ``(B, C)`` for them, plus its BatchNorm term, and that term's value
    (:func:`rayfuse.fusion.distill.student.teacher_vjp`): the input gradients only, as :func:`signal`'s."""
    import torch

    from rayfuse.fusion.distill.student import DistillSettings, teacher_vjp
    from rayfuse.fusion.distill.teachers import writable

    X, cotangent = writable(X), writable(cotangent)  # arrays read from Ray's object store are read-only
    grad, bn = teacher_vjp(
        ctx.local_model().to(ctx.device),
        torch.as_tensor(X, device=ctx.device),
        torch.as_tensor(cotangent, dtype=torch.float32, device=ctx.device),
        num_teachers=num_teachers,
        settings=DistillSettings(**settings),
    )
    return {"grad": grad.float().cpu().numpy(), "bn": np.asarray([bn], dtype=np.float32)}


@client_step("distill.input_moments")
def input_moments(ctx: ClientContext) -> dict[str, np.ndarray]:
    """The count, per-element sum and sum of squares of this client's training inputs (the statistics a silo run
    standardises with)."""
    from rayfuse.data.silos import feature_moments

    count, total, squares = feature_moments(ctx.train.X)
    return {"count": np.asarray(count, dtype=np.int64), "sum": total, "sumsq": squares}


# Under secure aggregation (federation.secure_aggregation): each client sends its term of the ensemble (its logits or
# probabilities times its row of the teacher weights, which the server knows from the plan and sends), its gradient
# term, its input moments over the pooled count; only their sums are unmasked (rayfuse.updates.secure, ArraySum)


@client_step("distill.secure_predict")
def secure_predict(
    ctx: ClientContext,
    X: np.ndarray,
    weights: Mapping[int, np.ndarray],
    *,
    combine: str,
    chunk_size: int = 256,
    refined: tuple[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """This client's term of the ensemble on the server's inputs ``X``, ``(N, C)``: its :func:`predict` logits through
    :func:`~rayfuse.fusion.distill.teachers.ensemble_term` with its row of the teacher weights ``weights[client]``."""
    from rayfuse.fusion.distill.teachers import ensemble_term

    w = weights[int(ctx.client_id)]
    return {"ensemble": ensemble_term(predict(ctx, X, chunk_size=chunk_size, refined=refined)["logits"], w, combine)}


@client_step("distill.secure_signal")
def secure_signal(
    ctx: ClientContext,
    X: np.ndarray,
    labels: np.ndarray,
    weights: Mapping[int, np.ndarray],
    *,
    num_teachers: int,
    settings: dict[str, Any],
    combine: str,
) -> dict[str, np.ndarray]:
    """This client's :func:`signal` with its row of the teacher weights ``weights[client]``: its term of the ensemble on
    the generated batches ``(G, B, C)`` and its gradient term ``(G, B, ...)`` (the server needs only their sums)."""
    from rayfuse.fusion.distill.teachers import ensemble_term

    w = np.array(weights[int(ctx.client_id)], dtype=np.float32)  # a copy: a broadcast array is read-only
    reply = signal(ctx, X, labels, w, num_teachers=num_teachers, settings=settings)
    return {"ensemble": ensemble_term(reply["logits"], w, combine), "grad": reply["grad"]}


@client_step("distill.secure_input_moments")
def secure_input_moments(ctx: ClientContext, total: float) -> dict[str, np.ndarray]:
    """This client's :func:`input_moments` with the sums divided by ``total`` (at least the clients' pooled count, so
    each summed entry is within the inputs' range: a fixed-point range fits any dataset's size)."""
    reply = input_moments(ctx)
    return {"count": np.asarray([reply["count"]], np.float64), "sum": reply["sum"] / total, "sumsq": reply["sumsq"] / total}


#: each secure sum's fixed-point ``(step, limit)`` per key (ArraySum): every reply is a float32 quantity, summed exactly
#: as integers, so the decoded sum is off by at most half a step per client per entry
SECURE_STEPS: dict[str, tuple[float, float]] = {
    # w_kc z_kc: a trained model's logits are tens at most (beyond 4096 clipped and counted); 2^-24 is float32's
    # resolution at 1, finer than its at the logits' scale
    "logits": (2.0**-24, 2.0**12),
    # w_kc log softmax(z_k)_c: at most 0, as far below as a confident member's logit gaps (tens; beyond -4096 clipped
    # and counted: such a class's probability is 0 to any precision); the logits' step
    "geometric": (2.0**-24, 2.0**12),
    "energy": (2.0**-24, 2.0**12),  # the same plus a standardised energy (a few units)
    # w_kc softmax(z_k)_c in [0, 1]: absolute error, 2^-40 ~ 1e-12 (the floor of the ensemble's log), so the ensemble
    # holds the probabilities its temperature-scaled log makes matter
    "probabilities": (2.0**-40, 2.0),
    # d/dx of a member's generator term (a mean over the batch of w CE' plus lambda_bn / K BN'): measured on digits
    # (mlp, cnn) at most 1.4e-2 an entry, median 1e-4..3e-4; 2^-40 ~ 9e-13 is finer than float32 at the median, and
    # the range 256 leaves room for far steeper teachers (the ring: 2^48 levels, + log2 K bits)
    "grad": (2.0**-40, 2.0**8),
    # an input's mean and mean square pooled (each client's sums over the pooled count): within the inputs' range and
    # its square, 2^16 (pixel values up to 255, standardised features); 2^-32 so that a nearly constant element's
    # variance, a difference of two such sums, keeps its digits
    "moments": (2.0**-32, 2.0**16),
}


class _ClientTeachers:
    """The clients as teachers: one federation call per pass; each reply checked (shapes, finite values) before use."""

    def __init__(self, server: ServerContext, clients: Sequence[int], num_classes: int, refined: tuple[str, int] | None = None) -> None:
        self.server, self.clients, self.num_classes = server, list(clients), num_classes
        self.num_teachers = len(self.clients)
        self.refined = refined  # rounds > 1: (label, round) of the students the clients refined

    def _gather(
        self, step: Any, what: str, expect: dict[str, tuple[int, ...]], *args: Any, per_client: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[dict[str, np.ndarray]]:
        fed = self.server.federation
        refs = [fed.put(a) for a in args]
        if per_client is None:
            gathered = fed.run(step, *refs, clients=self.clients, **kwargs)
        else:
            gathered = fed.gather(
                [call for c, extra in zip(self.clients, per_client) for call in fed.map(step, *refs, extra, clients=[c], **kwargs)]
            )

        def read(client: int, reply: Any) -> dict[str, np.ndarray]:
            if not isinstance(reply, dict) or set(reply) != set(expect):
                raise Rejected(
                    f"{what}: a dict of {sorted(expect)}, got {sorted(reply) if isinstance(reply, dict) else type(reply).__name__}"
                )
            for key, shape in expect.items():
                value = np.asarray(reply[key])
                if value.shape != shape:
                    raise Rejected(f"{what}: {key} of shape {shape}, got {value.shape}")
                if not np.isfinite(value).all():
                    raise Rejected(f"{what}: non-finite values in {key}")
            return reply

        kept = self.server.updates.accept_replies(gathered, read, need=len(self.clients), what=what)
        return [kept[c] for c in self.clients]

    def predict(self, X: Any) -> Any:
        import torch

        X_np = X.detach().cpu().numpy() if hasattr(X, "detach") else np.asarray(X)
        extra = {} if self.refined is None else {"refined": self.refined}
        replies = self._gather(predict, "teacher predictions", {"logits": (len(X_np), self.num_classes)}, X_np, **extra)
        return torch.as_tensor(np.stack([r["logits"] for r in replies]))

    def signal(self, X: Any, labels: Any, weights: Any, settings: Any) -> tuple[Any, Any]:
        import dataclasses

        import torch

        X_np, y_np, W = X.detach().cpu().numpy(), labels.detach().cpu().numpy(), weights.detach().cpu().numpy()
        G, B = y_np.shape
        replies = self._gather(
            signal,
            "generator signals",
            {"logits": (G, B, self.num_classes), "grad": X_np.shape},
            X_np,
            y_np,
            per_client=[W[k] for k in range(self.num_teachers)],
            num_teachers=self.num_teachers,
            settings=dataclasses.asdict(settings),
        )
        return (torch.as_tensor(np.stack([r["logits"] for r in replies])), torch.as_tensor(np.sum([r["grad"] for r in replies], axis=0)))


class _ClientGradientTeachers(_ClientTeachers):
    """The clients as teachers whose generator steps are exact (``generator_calls: step``): their logits, then their
    input gradients for the server's cotangents (:func:`vjp`), two calls a step."""

    def vjp(self, X: Any, cotangents: Any, settings: Any) -> tuple[Any, float]:
        """The clients' input gradients for the server's cotangents ``(K, B, C)`` on their logits, summed, and their
        BatchNorm terms summed (:func:`vjp`; one call, each client its own cotangent)."""
        import dataclasses

        import torch

        X_np, C_np = X.detach().cpu().numpy(), cotangents.detach().cpu().numpy().astype(np.float32)
        replies = self._gather(
            vjp,
            "generator gradients",
            {"grad": X_np.shape, "bn": (1,)},
            X_np,
            per_client=[C_np[k] for k in range(self.num_teachers)],
            num_teachers=self.num_teachers,
            settings=dataclasses.asdict(settings),
        )
        return torch.as_tensor(np.sum([r["grad"] for r in replies], axis=0)), float(sum(float(r["bn"][0]) for r in replies))


class _SecureTeachers:
    """The clients as teachers under secure aggregation: the server learns only the ensemble, each pass's sum of the
    clients' :func:`~rayfuse.fusion.distill.teachers.ensemble_term` (``server.updates.secure_sum``), and for the
    generator the sum of their gradient terms, which is what the plain path combines from their replies.

    To the loops it is one teacher, the ensemble: its logits are the combined ones, so the loops take per-class
    weights of ones ``(1, C)`` and ``combine: logits`` (:attr:`loop_weights`), under which
    :func:`~rayfuse.fusion.distill.teachers.combine_teachers` returns the ensemble's logits as they are. The teacher
    weights the clients use are ``weights`` as the plain loops use them: as given for the public transfer, renormalised
    per class for the generator (``scaled_weights`` with unit scales, as :func:`distill_synthetic` weighs its members).

    A client that drops out of a sum (``on_client_failure: drop``) leaves the others' sum with its weight missing: the
    pass is summed again among the clients in it, with their weights renormalised per class and ``K`` their number, so
    that it is exactly the plain ensemble (and generator objective) of those teachers; the next pass asks every client
    again. Entries beyond a key's range are clipped by the clients, counted, and reported (an event and
    :attr:`record`)."""

    def __init__(
        self, server: ServerContext, clients: Sequence[int], weights: np.ndarray, combine: str, refined: tuple[str, int] | None = None
    ) -> None:
        self.server, self.clients, self.combine = server, list(clients), combine
        self.refined = refined  # rounds > 1: (label, round) of the students the clients refined
        self.weights = np.asarray(weights, dtype=np.float32)
        self.num_teachers = 1  # the ensemble
        self.num_classes = self.weights.shape[1]
        self.loop_weights = np.ones((1, self.num_classes), dtype=np.float32)
        # each summed key's step, range and error bound (K half steps an entry of the sum), the clipped entries, the
        # sums done again after a dropout: info()["secure_sums"]
        self.record: dict[str, Any] = {"steps": {}, "limits": {}, "error_bounds": {}, "clipped_entries": 0, "summed_again": 0}

    def _rows(self, clients: list[int], renormalise: bool) -> dict[int, np.ndarray]:
        import torch

        from rayfuse.fusion.distill.student import scaled_weights

        index = [self.clients.index(c) for c in clients]
        W = torch.as_tensor(self.weights[index])
        if renormalise or len(clients) < len(self.clients):
            W = scaled_weights(W, torch.ones(len(index)))
        return {c: row for c, row in zip(clients, W.numpy())}

    def _decode(self, encoding: Any, done: Any, what: str) -> dict[str, np.ndarray]:
        """The decoded sums; each key's step and bound, and the entries the clients clipped (also an event), recorded
        in :attr:`record`."""
        sums, clipped = encoding.decode(done.levels)
        bounds = encoding.error_bounds(len(done.contributors))
        for key, _, step, limit in encoding.keys:
            name = self.combine if key == "ensemble" else key
            self.record["steps"][name], self.record["limits"][name] = step, limit
            self.record["error_bounds"][name] = max(self.record["error_bounds"].get(name, 0.0), bounds[key])
        if clipped:
            self.record["clipped_entries"] += clipped
            limits = {key: limit for key, _, _, limit in encoding.keys}
            self.server.events.emit(
                "secure_aggregation",
                f"{what}: {clipped} entries of the clients' replies were beyond their fixed-point ranges {limits} and clipped",
                method=self.server.label,
                clipped_entries=clipped,
            )
        return sums

    def _sum(
        self, step: Any, what: str, keys: dict[str, tuple[int, ...]], args: tuple, kwargs: dict[str, Any], *, generator: bool = False
    ) -> dict[str, np.ndarray]:
        """``step``'s replies summed securely over the teachers (each key at its :data:`SECURE_STEPS`; ``ensemble`` at
        the combine's), summed again among the clients left where one dropped (the class docstring)."""
        from rayfuse.updates.secure import ArraySum

        server = self.server
        encoding = ArraySum(tuple((k, shape, *SECURE_STEPS[self.combine if k == "ensemble" else k]) for k, shape in keys.items()))
        clients = list(self.clients)
        while True:
            extra = {"num_teachers": len(clients)} if generator else {}
            rows = self._rows(clients, renormalise=generator)
            done = server.updates.secure_sum(step, (*args, rows), encoding, clients=clients, step_kwargs={**kwargs, **extra}, what=what)
            sums = self._decode(encoding, done, what)
            if len(done.contributors) == len(clients):
                return sums
            left = sorted(done.contributors)
            server.events.emit(
                "secure_aggregation",
                f"{what}: clients {sorted(set(clients) - set(left))} dropped out of the sum; summed again among {left} "
                "with their weights renormalised",
                method=server.label,
            )
            self.record["summed_again"] += 1
            clients = left

    def predict(self, X: Any) -> Any:
        import torch

        from rayfuse.fusion.distill.teachers import ensemble_of_sum

        X_np = X.detach().cpu().numpy() if hasattr(X, "detach") else np.asarray(X)
        extra = {} if self.refined is None else {"refined": self.refined}
        sums = self._sum(
            secure_predict, "teacher predictions", {"ensemble": (len(X_np), self.num_classes)}, (X_np,), {"combine": self.combine, **extra}
        )
        return torch.as_tensor(ensemble_of_sum(sums["ensemble"], self.combine))[None]

    def signal(self, X: Any, labels: Any, weights: Any, settings: Any) -> tuple[Any, Any]:
        """The ensemble's logits ``(1, G, B, C)`` and the summed gradient terms; ``weights`` (the loops' ones) unused:
        the clients' weights are the teachers' own (the class docstring)."""
        import torch

        from rayfuse.fusion.distill.teachers import ensemble_of_sum

        X_np, y_np = X.detach().cpu().numpy(), labels.detach().cpu().numpy()
        G, B = y_np.shape
        sums = self._sum(
            secure_signal,
            "generator signals",
            {"ensemble": (G, B, self.num_classes), "grad": X_np.shape},
            (X_np, y_np),
            {"settings": dataclasses.asdict(settings), "combine": self.combine},
            generator=True,
        )
        ensemble = torch.as_tensor(ensemble_of_sum(sums["ensemble"], self.combine))[None]
        return ensemble, torch.as_tensor(sums["grad"].astype(np.float32))

    def moments(self, input_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The clients' pooled input mean and standard deviation per element, from the secure sum of their counts and
        their sums and sums of squares over ``total`` (the plan's count of their samples, train and held-out: at least
        theirs); a client that drops is left out of the pool, as its count is."""
        from rayfuse.fusion.distill.transfer import pooled_moments
        from rayfuse.updates.secure import ArraySum

        server = self.server
        total = float(np.asarray(server.data.class_counts, dtype=np.float64)[self.clients].sum())
        shape = tuple(int(d) for d in input_shape)
        step, limit = SECURE_STEPS["moments"]
        encoding = ArraySum((("count", (1,), 1.0, total), ("sum", shape, step, limit), ("sumsq", shape, step, limit)))
        done = server.updates.secure_sum(secure_input_moments, (total,), encoding, clients=self.clients, what="input moments")
        sums = self._decode(encoding, done, "input moments")
        count = int(round(float(sums["count"][0])))
        return pooled_moments([(count, sums["sum"] * total, sums["sumsq"] * total)])


# ---------------------------------------------------------------------------------------------------------------
# The server


def checked_target(
    params: DistillParams, teachers: Any, X: Any, weights: np.ndarray, counts: np.ndarray, settings: Any, *, device: str = "cpu"
) -> tuple[Any, np.ndarray, dict[str, Any] | None]:
    """``combine: auto``'s check of the target on the public inputs ``X`` against the clients' class ``counts``
    (:func:`~rayfuse.fusion.distill.student.check_target`): the settings and weights to distil with and the check's
    record (``info.target``); with another ``combine`` or data-free, ``settings`` and ``weights`` as they are and no
    record. Teachers that give each member's logits are asked once more (one call per client where the clients are
    the teachers); under secure aggregation (:class:`_SecureTeachers`) each candidate is one secure sum, and the chosen
    one's combine and weights are then the clients'."""
    from rayfuse.fusion.distill.student import auto_target, check_target

    if params.transfer != "public" or params.combine != "auto":
        return settings, weights, None
    if not isinstance(teachers, _SecureTeachers):
        return auto_target(teachers, X, weights, counts, settings, params.temperature, device=device)
    secure = teachers

    def ensemble_of(how: str, w: np.ndarray) -> Any:
        secure.combine, secure.weights = how, np.asarray(w, dtype=np.float32)
        return secure.predict(X)[0]

    settings, weights, record = check_target(ensemble_of, weights, counts, settings, params.temperature)
    secure.combine, secure.weights = settings.combine, np.asarray(weights, dtype=np.float32)
    return settings, weights, record


class _StudentModels:
    """``server.models`` with the student's architecture as the run's model (the rest is the run's)."""

    def __init__(self, server: ServerContext, model_cfg: ModelConfig) -> None:
        self._server = server
        self.model_cfg = model_cfg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server.models, name)

    def build_model(self, seed: int | None = None) -> Any:
        from rayfuse.models import build_model

        return build_model(self.model_cfg, self._server.data.input_shape, self._server.data.num_classes, seed=seed)

    def initial_params(self) -> dict[str, np.ndarray]:
        from rayfuse.models import get_params

        return get_params(self.build_model(seed=self._server.step_seed("init")))


class _StudentServer:
    """The run's server seen with the student's architecture as the run's model (``init: aligned`` of a student whose
    architecture is not the run's ``model``): its ``models`` service is the student's (:class:`_StudentModels`)."""

    def __init__(self, server: ServerContext, model_cfg: ModelConfig) -> None:
        self._server = server
        self.models = _StudentModels(server, model_cfg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


@dataclass
class DistillRoundsState:
    """``rounds > 1``: the student after each round (the round checkpoint's parameters)."""

    params: dict[str, np.ndarray]
    info: dict[str, Any]  # what the last round's distillation reports (its final pass, its secure sums...)


@register_method
class Distill(Method[DistillParams, DistillRoundsState]):
    name = "distill"
    Params = DistillParams
    summary = "one-shot ensemble distillation into one student: public unlabeled data or data-free, parameters or predictions only"
    reference = references.FEDDF
    tags = MethodTags(
        fuses="predictions",
        public_sample=True,  # transfer: public (tags_for); data-free reads none
        uses_local_models=True,
        local_model_only=True,  # train.dp covers the predictions (post-processing); input moments are refused with it
        heterogeneous_clients=True,
    )
    test_case = MethodCase({"steps": 20, "epochs": 1}, {"data": {"public_size": 0.1}}, step="aligned.correlations")

    @classmethod
    def tags_for(cls, params: DistillParams | None = None) -> MethodTags:
        """It reads the server's public sample (its inputs only) with ``transfer: public``, data-free none; the coordinator
        holds no local model with ``teachers: clients`` (predictions only), two copies with ``teachers: parameters`` (the
        uploads and the teachers built from them); its server needs only sums (``sums``: secure aggregation applies)
        with ``teachers: clients``, unless the data-free ``reweight`` re-weighs each member by its own predictions."""
        if params is None:
            return cls.tags
        copies = {"clients": 0, "parameters": 2}.get(params.teachers, 1)  # clients: predictions only; parameters: uploads + teachers
        # predictions only: the ensemble (and the generator's signal, the input moments) is a weighted sum of what the
        # clients send, so secure aggregation sums it; reweight reads each member's predictions, parameters each model;
        # the energy ensemble standardises each member's energy over the inputs combined at once, a pass's bank (a
        # client can, over the bank it is sent) but, data-free, each batch the server draws from its bank
        # generator_calls: step sends each client its own cotangent for its logits, which a sum alone cannot give
        sums = params.teachers == "clients" and not (
            params.transfer == "synthetic" and (params.reweight or params.combine == "energy" or params.generator_calls == "step")
        )
        # rounds > 1: the clients' refinement reads their data again (beyond the local models: not covered by train.dp)
        # and each round is checkpointed
        few = params.rounds > 1
        return replace(
            cls.tags,
            public_sample=params.transfer == "public",
            local_model_copies=copies,
            sums=sums,
            multi_round=few,
            local_model_only=not few,
        )

    @classmethod
    def check(cls, params: DistillParams, setup: RunSetup) -> None:
        check_distill_memory(params, setup)
        if params.transfer == "public" and setup.public_size <= 0:
            raise InputError(
                "data.public_size",
                "a public sample for transfer: public (data.public_size > 0; data.public with "
                "data.silos): its inputs are the transfer data, its labels are never read",
                setup.public_size,
                "or set transfer: synthetic (data-free)",
            )
        if params.rounds > 1 and params.transfer == "synthetic":
            raise InputError(
                "rounds",
                "1 with transfer: synthetic (the clients' refinement is anchored to the student on the public inputs)",
                params.rounds,
                "or set transfer: public",
            )
        if params.generator_calls is not None and (params.teachers, params.transfer) != ("clients", "synthetic"):
            raise InputError(
                "generator_calls",
                "unset unless teachers: clients and transfer: synthetic (how the clients give the generator its gradient)",
                params.generator_calls,
            )
        if params.holdout > 0 and params.transfer == "synthetic":
            raise InputError("holdout", "0 with transfer: synthetic (a held-out share of the public sample's inputs)", params.holdout)
        from rayfuse.fusion.distill.student import held_out

        if params.holdout > 0 and params.transfer == "public" and setup.public_size - held_out(setup.public_size, params.holdout) < 2:
            raise InputError(
                "holdout", f"a share that leaves at least 2 of the {setup.public_size} public inputs to train on", params.holdout
            )
        if params.teachers == "clients" and params.init != "random":
            raise InputError(
                "init",
                "random with teachers: clients (predictions only: no client's parameters reach the server to start from)",
                params.init,
            )
        if params.transfer == "synthetic" and params.input_moments and setup.train.dp is not None:
            raise InputError(
                "input_moments",
                "false with train.dp (local DP-SGD covers the clients' models and what they predict, not the moments of their inputs)",
                True,
            )
        if params.repair and params.teachers == "clients":
            raise InputError(
                "repair",
                "false with teachers: clients (predictions only: the clients return predictions on the server's "
                "inputs, not statistics of their data)",
                True,
            )
        if params.aligned.rounds != 1:
            raise InputError("aligned.rounds", "1 (the student's start is the one-shot aligned merge)", params.aligned.rounds)
        if params.aligned.dp is not None:
            raise InputError("aligned.dp", "none (the aligned start uploads the local models as they are)", "a dp setting")
        if params.student is not None and setup.input_shape and setup.num_classes:
            from rayfuse.models.registry import check_model_fits

            try:
                check_model_fits(params.student, setup.input_shape, setup.num_classes)
            except InputError as exc:
                raise exc.at("student." + exc.path.split(".", 1)[-1]) from None
        if params.init == "aligned" and params.teachers == "parameters":
            check_nested_aligned(params, setup)

    def run(self, server: ServerContext) -> MethodResult:
        from rayfuse.fusion.distill.teachers import teacher_weights

        p = self.params
        student_cfg = p.student or server.models.model_cfg
        clients = list(server.federation.client_ids)
        updates: dict[int, Update] = {}
        if p.teachers == "parameters":
            updates = server.updates.accept(server.updates.local_updates())
            clients = sorted(updates)
        counts = np.asarray(server.data.class_counts, dtype=np.float64)[clients]
        models = server.models
        one_architecture = all(models.client_model(c) == models.client_model(clients[0]) for c in clients)
        info: dict[str, Any] = {
            "transfer": p.transfer,
            "teachers": p.teachers,
            "clients": clients,
            "weighting": p.weighting,
            "combine": p.settings(0, one_architecture=one_architecture, transfer=p.transfer).combine,
            "student": student_cfg.name,
            "batched": "vmap" if self._batched(server.models.device) else "loop",
        }
        if p.rounds == 1:
            student, info["init"], resized = self._start(server, student_cfg, updates, clients)
            teachers = self._teachers(server, clients, updates, lambda c: models.client_model(c))
            settings = p.settings(server.step_seed("distill"), one_architecture=one_architecture, transfer=p.transfer)
            history = self._transfer(
                server, student, teachers, teacher_weights(p.weighting, counts), settings, counts, clients, info, log_rows=True
            )
            params = self._finish(server, student, student_cfg, clients, info, history)
            metrics = server.scoring.evaluate(params, resized=resized, model=student_cfg)
            server.log(p.epochs, metrics)
            return MethodResult(metrics, params, info=info)
        return self._rounds(server, student_cfg, clients, updates, counts, one_architecture, info)

    def _rounds(
        self,
        server: ServerContext,
        student_cfg: ModelConfig,
        clients: list[int],
        updates: dict[int, Update],
        counts: np.ndarray,
        one_architecture: bool,
        info: dict[str, Any],
    ) -> MethodResult:
        """``rounds > 1``: round 1 is the one-shot distillation; each later round every client refines the student
        (:func:`refine`) and the server distils the refined students into it, from where it was. Each round is
        checkpointed (``--resume`` continues from the last one finished)."""
        from rayfuse.fusion.distill.teachers import teacher_weights
        from rayfuse.models import build_model

        p = self.params
        shapes = {
            k: tuple(v.shape)
            for k, v in build_model(student_cfg, server.data.input_shape, server.data.num_classes, seed=0).state_dict().items()
        }

        def evaluate(rnd: int) -> Mapping[str, float]:
            params = rounds.state.params
            resized = any(tuple(np.shape(params[k])) != shape for k, shape in shapes.items() if k in params)
            return server.scoring.evaluate(params, resized=resized, model=student_cfg)

        rounds = server.rounds(DistillRoundsState({}, {}), last=p.rounds, evaluate=evaluate)
        info["init"] = self._start_reason(server, student_cfg, updates, clients)
        train = server.models.train_cfg
        for rnd in rounds:
            row: dict[str, float] = {}
            got: dict[str, Any] = {}
            if rnd == 1:
                student, _, _ = self._start(server, student_cfg, updates, clients)
                teachers = self._teachers(server, clients, updates, lambda c: server.models.client_model(c))
                settings = p.settings(server.step_seed("distill"), one_architecture=one_architecture, transfer=p.transfer)
                weights = teacher_weights(p.weighting, counts)
                history = self._transfer(server, student, teachers, weights, settings, counts, clients, got)
            else:
                fed = server.federation
                start = rounds.state.params
                upload = p.teachers == "parameters"
                gathered = fed.run(
                    refine,
                    fed.put(start),
                    fed.put(server.data.public.X),
                    label=server.label,
                    round=rnd,
                    student=student_cfg,
                    epochs=p.refine_epochs,
                    lr=p.refine_lr,
                    batch_size=p.refine_batch_size or train.batch_size,
                    anchor=p.anchor,
                    upload=upload,
                    clients=clients,
                )
                if upload:
                    refined = server.updates.accept(gathered, start)
                else:

                    def read(client: int, reply: Any) -> Update:
                        if not isinstance(reply, Update) or reply.params:
                            raise Rejected("refinement: an update without parameters (predictions only)")
                        return reply

                    refined = server.updates.accept_replies(gathered, read, need=1, what="refinement")
                kept = sorted(refined)
                losses = np.array([refined[c].metrics.get("train_loss", np.nan) for c in kept])
                sizes = np.array([refined[c].num_examples for c in kept], dtype=float)
                row = {"refine_loss": float(np.sum(losses * sizes) / sizes.sum()), "clients": float(len(kept))}
                student = self._teacher(server, student_cfg, start)
                student.train()
                teachers = self._teachers(server, kept, refined, lambda c: student_cfg, refined=(server.label, rnd))
                round_counts = np.asarray(server.data.class_counts, dtype=np.float64)[kept]
                settings = p.settings(server.step_seed("distill", rnd), one_architecture=True, transfer=p.transfer)
                weights = teacher_weights(p.weighting, round_counts)
                history = self._transfer(server, student, teachers, weights, settings, round_counts, kept, got)
            rounds.state.params = self._finish(server, student, student_cfg, clients, got, history)
            rounds.state.info = got
            final = history[-1] if history else {}
            rounds.log({"distill_loss": final.get("loss", float("nan")), "agreement": final.get("agreement", float("nan")), **row})
        info.update(rounds.state.info, rounds=p.rounds)
        return MethodResult(rounds.metrics, rounds.state.params, info=info)

    def _teachers(
        self,
        server: ServerContext,
        clients: list[int],
        updates: dict[int, Update],
        model_of: Any,
        refined: tuple[str, int] | None = None,
    ) -> Any:
        """The loops' teacher source: the uploaded models (``teachers: parameters``; ``model_of(client)`` their
        architecture), else the clients themselves, as a secure sum where the federation has one. ``refined``: the
        clients answer with the student they refined in that round."""
        from rayfuse.fusion.distill.teachers import Teachers, teacher_weights

        p = self.params
        if p.teachers == "parameters":
            return Teachers(
                [self._teacher(server, model_of(c), updates[c].params) for c in clients],
                batched=self._batched(server.models.device),
                device=server.models.device,
            )
        if server.updates.secure is not None:  # the ensemble alone: one teacher to the loops (_SecureTeachers)
            counts = np.asarray(server.data.class_counts, dtype=np.float64)[clients]
            one = all(server.models.client_model(c) == server.models.client_model(clients[0]) for c in clients) or refined is not None
            combine = p.settings(0, one_architecture=one, transfer=p.transfer).combine
            return _SecureTeachers(server, clients, teacher_weights(p.weighting, counts), combine, refined=refined)
        if p.generator_calls == "round":
            return _ClientTeachers(server, clients, server.data.num_classes, refined=refined)
        return _ClientGradientTeachers(server, clients, server.data.num_classes, refined=refined)

    def _transfer(
        self,
        server: ServerContext,
        student: Any,
        teachers: Any,
        weights: np.ndarray,
        settings: Any,
        counts: np.ndarray,
        clients: list[int],
        info: dict[str, Any],
        *,
        log_rows: bool = False,
    ) -> list[dict[str, float]]:
        """The student trained on the teachers' ensemble (public or synthetic transfer); the pass rows. ``log_rows``:
        each pass is a history row (one shot; with rounds the round is the row)."""
        from rayfuse.fusion.distill.student import distill_public, distill_synthetic

        p = self.params
        secure = teachers if isinstance(teachers, _SecureTeachers) else None
        X = server.data.public.X if p.transfer == "public" else None
        settings, weights, target = checked_target(p, teachers, X, weights, counts, settings, device=server.models.device)
        if target is not None:
            info["target"] = target
        if secure is not None:  # the loops see one teacher, the ensemble, combined by the clients' sum
            weights, settings = secure.loop_weights, replace(settings, combine="logits")
        epochs = p.epochs

        def log(epoch: int, row: dict[str, float]) -> None:
            if log_rows:
                server.log(epoch, {"distill_loss": row["loss"], "agreement": row["agreement"]})
            server.progress(
                f"epoch {epoch}/{epochs}: loss {row['loss']:.4f}, agreement with the ensemble {row['agreement']:.3f}", epoch=epoch
            )

        try:
            if p.transfer == "public":
                X = server.data.public.X
                history = distill_public(student, teachers, X, weights, settings, device=server.models.device, log=log)
                info["transfer_samples"] = int(len(X))
            else:
                moments = None
                if p.input_moments:
                    moments = secure.moments(server.data.input_shape) if secure is not None else self._moments(server, clients)
                history, scales = distill_synthetic(
                    student,
                    teachers,
                    server.data.input_shape,
                    weights,
                    settings,
                    label_prior=counts.sum(0),
                    moments=moments,
                    device=server.models.device,
                    log=log,
                )
                if p.reweight:
                    info["member_scales"] = {str(c): round(float(s), 4) for c, s in zip(clients, scales)}
        except FloatingPointError as exc:
            raise RunFailure(f"{server.label}: {exc}") from None
        if secure is not None:
            info["secure_sums"] = secure.record
        info["transfer_note"] = transfer_note(p, info.get("transfer_samples"))
        info["final"] = {k: round(v, 4) for k, v in history[-1].items()} if history else {}
        chosen = [row for row in history if row.get("chosen")]
        if chosen:  # holdout: the pass whose student is returned, and its fidelity on the held-out inputs
            info["holdout"] = {k: round(v, 4) for k, v in chosen[0].items() if k in ("epoch", "holdout_agreement", "holdout_kl")}
        return history

    def _finish(
        self, server: ServerContext, student: Any, student_cfg: ModelConfig, clients: list[int], info: dict[str, Any], history: Any
    ) -> dict[str, np.ndarray]:
        """The distilled student's parameters, repaired (``repair``) and checked finite."""
        from rayfuse.models import get_params

        params = get_params(student.cpu())
        if self.params.repair and any(k.endswith("running_mean") for k in params):
            params = self._repair(server, params, student_cfg, clients)
            info["repaired"] = True
        bad = [k for k, v in params.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
        if bad:
            raise RunFailure(f"{server.label}: the distilled student has non-finite values in {bad[0]}")
        return params

    # -- the student's start and the teachers ---------------------------------------------------------------------

    def _batched(self, device: str) -> bool:
        if self.params.batched == "auto":
            return str(device).startswith("cuda")
        return self.params.batched == "vmap"

    @staticmethod
    def _teacher(server: ServerContext, model_cfg: ModelConfig, params: dict[str, np.ndarray]) -> Any:
        from rayfuse.evaluation import model_for_params

        return model_for_params(params, model_cfg, server.data.input_shape, server.data.num_classes)

    def _start(
        self, server: ServerContext, student_cfg: ModelConfig, updates: dict[int, Update], clients: list[int]
    ) -> tuple[Any, str, bool]:
        """The student model, how it started, and whether its widths differ from its configuration's."""
        from rayfuse.evaluation import model_for_params
        from rayfuse.models import build_model
        from rayfuse.updates.aggregate import weighted_average

        p = self.params
        same = [c for c in clients if c in updates and server.models.client_model(c) == student_cfg]
        reason = self._start_reason(server, student_cfg, updates, clients)
        if p.init == "random" or not same:
            model = build_model(student_cfg, server.data.input_shape, server.data.num_classes, seed=server.step_seed("student"))
            return model, reason, False
        weights = [float(updates[c].num_examples) for c in same]
        if p.init == "average":
            start = weighted_average([updates[c].params for c in same], weights)
        else:
            from rayfuse.fusion.aligned.algorithm import Aligned

            view = server if student_cfg == server.models.model_cfg else _StudentServer(server, student_cfg)
            start, _ = Aligned(p.aligned, server.label).merge_local_models(view, {c: updates[c] for c in same})
        reference = build_model(student_cfg, server.data.input_shape, server.data.num_classes, seed=0).state_dict()
        resized = any(tuple(np.shape(start[k])) != tuple(v.shape) for k, v in reference.items() if k in start)
        model = model_for_params(start, student_cfg, server.data.input_shape, server.data.num_classes)
        server.progress(f"the student starts from the {reason}" + (" (widened)" if resized else ""))
        return model, reason, resized

    def _start_reason(self, server: ServerContext, student_cfg: ModelConfig, updates: dict[int, Update], clients: list[int]) -> str:
        """How :meth:`_start` starts the student (the result's ``init``), known before it does."""
        p = self.params
        same = [c for c in clients if c in updates and server.models.client_model(c) == student_cfg]
        if p.init == "random":
            return "random"
        if not same:
            return f"random (no client has the student's architecture for init: {p.init})"
        return f"average of clients {same}" if p.init == "average" else f"aligned merge of clients {same}"

    def _repair(
        self, server: ServerContext, params: dict[str, np.ndarray], student_cfg: ModelConfig, clients: list[int]
    ) -> dict[str, np.ndarray]:
        """The student's BatchNorm running statistics replaced by the clients' pooled statistics of its inputs."""
        from rayfuse.alignment import apply_batchnorm, combine_batchnorm
        from rayfuse.fusion.aligned.algorithm import batchnorm, read_batchnorm_reply

        fed = server.federation
        gathered = fed.run(
            batchnorm,
            fed.put(params),
            label=server.label,
            samples=self.params.aligned.samples,
            batch_size=256,
            model_cfg=student_cfg,
            clients=clients,
        )
        stats = server.updates.accept_replies(gathered, lambda c, r: read_batchnorm_reply(r), need=1, what="BatchNorm statistics")
        return apply_batchnorm(params, combine_batchnorm([stats[c] for c in sorted(stats)]))

    @staticmethod
    def _moments(server: ServerContext, clients: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The clients' pooled input mean and standard deviation per element (each client's count, sum, sum of squares)."""
        from rayfuse.fusion.distill.transfer import pooled_moments

        shape = tuple(server.data.input_shape)

        def read(client: int, reply: Any) -> tuple[int, np.ndarray, np.ndarray]:
            if not isinstance(reply, dict) or set(reply) != {"count", "sum", "sumsq"}:
                raise Rejected("input moments: a dict of count, sum, sumsq")
            total, squares = np.asarray(reply["sum"], np.float64), np.asarray(reply["sumsq"], np.float64)
            if total.shape != shape or squares.shape != shape or not (np.isfinite(total).all() and np.isfinite(squares).all()):
                raise Rejected(f"input moments: finite sums shaped like one input {shape}")
            return int(reply["count"]), total, squares

        replies = server.updates.accept_replies(server.federation.run(input_moments, clients=clients), read, need=1, what="input moments")
        return pooled_moments([replies[c] for c in sorted(replies)])
