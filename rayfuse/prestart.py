"""The pre-start rules: one ordered table of small rule functions, run before any actor starts or any client trains.

Each rule reads the run's facts (:class:`StartFacts`: the config, the resolved method entries with their tags, the
run's setup, the model's size) and refuses, with one :class:`~rayfuse.errors.InputError`, what the run cannot do. A
simulation runs the table once (:func:`rayfuse.runner.prepare_run`); a silo run runs the same table twice: before its
survey, with what only the silos know (their shapes, label counts, sizes, the model's size) ``None`` (every rule skips
what is ``None``), and again once the clients reported (:func:`rayfuse.runner.finish_silo_run`). So the two paths
cannot drift apart: ``tests/test_prestart_table.py`` checks that both run every rule of :data:`PRE_START_RULES`, in
its order.

The order decides which refusal a config with several faults gets: what the data and the clients' models make
impossible first (a method that needs the whole dataset, one layout, public labels), then each method's own check
(it names what to give: ``data.test`` for EP-GAN...), then the evaluation and DP rules, the update pipeline's, and the
memory and local DP-SGD ones, which build or size models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rayfuse.config import ExperimentConfig
from rayfuse.errors import InputError
from rayfuse.method import (
    MethodSpec,
    RunSetup,
    check_methods,
    refuse_dataset_readers_with_silos,
    refuse_dp_the_tags_exclude,
    refuse_federated_evaluation_without_scores,
    refuse_local_dp_for_other_readers,
    refuse_one_layout_methods_with_mixed_clients,
    refuse_public_labels_without_labels,
)
from rayfuse.updates.pipeline import check_aggregation, check_round_memory, check_update_pipeline

__all__ = ["PRE_START_RULES", "StartFacts", "check_before_start", "check_local_dp"]


@dataclass(frozen=True)
class StartFacts:
    """What the pre-start rules read. ``num_params`` (the run's model's parameter count) and ``client_params`` (each
    client's own model's) are ``None`` before a silo run's survey, as are the setup's shapes and sizes."""

    cfg: ExperimentConfig
    specs: Sequence[MethodSpec]
    setup: RunSetup
    num_params: int | None
    client_params: tuple[int, ...] | None


def _tags(rule: Callable[[Sequence[MethodSpec], RunSetup, ExperimentConfig], None]) -> Callable[[StartFacts], None]:
    def run(facts: StartFacts) -> None:
        rule(facts.specs, facts.setup, facts.cfg)

    run.__name__ = rule.__name__
    run.__doc__ = rule.__doc__
    return run


def methods_own_checks(facts: StartFacts) -> None:
    """Each method's own :meth:`~rayfuse.method.Method.check` on the setup (:func:`rayfuse.method.check_methods`). In a
    silo run, a refusal of the server's sample size is said at ``data.public`` (a silo config gives the server's sample
    as ``data.public``, not ``data.public_size``)."""
    try:
        check_methods(facts.specs, facts.setup)
    except InputError as exc:
        if facts.cfg.data.is_silos and exc.path.startswith("data.public") and not exc.path.startswith("data.public."):
            raise InputError(
                "data.public",
                f"the server's public / target sample ({exc.expected})",
                "none given",
                "give data.public: {dataset: npz, path: ...}",
            ) from None
        raise


def update_pipeline(facts: StartFacts) -> None:
    """What the update pipeline cannot do for an entry (:func:`rayfuse.updates.pipeline.check_update_pipeline`)."""
    check_update_pipeline(facts.specs, facts.setup, facts.cfg.federation.attacks)


def aggregation_mode(facts: StartFacts) -> None:
    """An explicit ``federation.aggregation`` no round can use (:func:`rayfuse.updates.pipeline.check_aggregation`)."""
    check_aggregation(facts.specs, facts.cfg.federation)


def coordinator_memory(facts: StartFacts) -> None:
    """The coordinator's memory for each entry's aggregation or gathered models
    (:func:`rayfuse.updates.pipeline.check_round_memory`); needs the model's size."""
    if facts.num_params is None:
        return
    check_round_memory(
        facts.specs, facts.cfg.federation, facts.setup.num_clients, facts.num_params, client_params=facts.client_params or ()
    )


def check_local_dp(cfg: ExperimentConfig, setup: RunSetup) -> None:
    """Refuse ``train.dp`` (local DP-SGD) where it cannot hold, before any client trains: a model Opacus cannot train
    privately (BatchNorm, stock attention: Opacus' ``ModuleValidator``) or a delta not below one over the smallest
    client's number of training examples (the privacy unit is one example). Every client's model is checked
    (``federation.client_overrides.<i>.model``, else ``model``). A method that reads the clients' data other than
    through their local models is refused from its tags (:func:`rayfuse.method.check_tags`)."""
    dp = cfg.train.dp
    if dp is None:
        return
    from rayfuse.models import build_model
    from rayfuse.models.privacy import find_dp_unsupported

    sizes = setup.train_sizes or ()  # (None: not known yet, a silo run before its survey; checked after it)
    smallest = min((n for n in sizes if n > 0), default=0)
    if smallest and dp.delta >= 1.0 / smallest:
        raise InputError(
            "train.dp.delta",
            f"less than 1 / {smallest} (the smallest client's training examples: the privacy unit is one example)",
            dp.delta,
            f"e.g. delta: {10 ** -(len(str(smallest)) + 1):g}",
        )
    if dp.target_epsilon is not None and cfg.train.epochs > 0:  # each client's noise search, bounded, before any trains
        from rayfuse.models.privacy import dp_sgd_noise_multiplier
        from rayfuse.updates.accountant import UnreachableEpsilon

        for batches in sorted({-(-n // cfg.train.batch_size) for n in sizes if n > 0}):
            try:
                dp_sgd_noise_multiplier(dp.target_epsilon, dp.delta, batches, cfg.train.epochs, dp.accountant)
            except UnreachableEpsilon as exc:
                raise InputError(
                    "train.dp.target_epsilon",
                    f"an epsilon DP-SGD reaches in {cfg.train.epochs} epochs of {batches} batches: {exc}",
                    dp.target_epsilon,
                    "or give noise_multiplier",
                ) from None
    checked: list[Any] = []
    for client, model in enumerate(cfg.client_models()):
        if any(model == m for m in checked):
            continue
        checked.append(model)
        if setup.input_shape is None or setup.num_classes is None:
            break  # not known yet (a silo run before its survey): checked after it
        found = find_dp_unsupported(build_model(model, setup.input_shape, setup.num_classes, seed=0))
        if found is not None:
            module, kind = found
            whose = (
                f"model {model.name!r}"
                if model == cfg.model
                else f"client {client}'s model {model.name!r} (federation.client_overrides.{client}.model)"
            )
            raise InputError(
                "train.dp",
                f"a model Opacus can train with DP-SGD (logreg, mlp, cnn, or a custom model without BatchNorm "
                f"or stock MultiheadAttention), but {whose} has {module}: {kind}",
                InputError._MISSING,
                "rayfuse's models have no norm option: use model.name mlp or cnn, or drop train.dp",
            )


def local_dp_sgd(facts: StartFacts) -> None:
    """Local DP-SGD (``train.dp``) where it cannot hold (:func:`check_local_dp`)."""
    check_local_dp(facts.cfg, facts.setup)


#: The pre-start table, in order (see the module's docstring): every run's checks, once for a simulation, twice for a
#: silo run.
PRE_START_RULES: tuple[Callable[[StartFacts], None], ...] = (
    _tags(refuse_dataset_readers_with_silos),
    _tags(refuse_one_layout_methods_with_mixed_clients),
    _tags(refuse_public_labels_without_labels),
    methods_own_checks,
    _tags(refuse_federated_evaluation_without_scores),
    _tags(refuse_dp_the_tags_exclude),
    _tags(refuse_local_dp_for_other_readers),
    update_pipeline,
    aggregation_mode,
    coordinator_memory,
    local_dp_sgd,
)


def check_before_start(facts: StartFacts, rules: Sequence[Callable[[StartFacts], None]] | None = None) -> None:
    """Run the pre-start table (:data:`PRE_START_RULES`, or ``rules``) on ``facts``: the first refusal is raised."""
    try:
        for rule in PRE_START_RULES if rules is None else rules:
            rule(facts)
    except InputError as exc:
        raise _where_given(exc, facts.specs) from None


def _where_given(exc: InputError, specs: Sequence[MethodSpec]) -> InputError:
    """``exc`` at ``methods.<label>.updates.<key>...`` when that entry gave ``<key>`` in its ``updates:`` block."""
    for spec in specs:
        prefix = f"methods.{spec.label}."
        key = exc.path.removeprefix(prefix).split(".", 1)[0] if exc.path.startswith(prefix) else None
        if key in spec.grouped:
            return exc.at(f"{prefix}updates.{exc.path.removeprefix(prefix)}")
    return exc
