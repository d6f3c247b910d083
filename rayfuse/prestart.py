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

from rayfuse.config import ExperimentConfig, other_model_clients
from rayfuse.errors import InputError
from rayfuse.method import METHODS, MethodSpec, RunSetup, check_methods, dp_options_text, dp_refusal, update_setting, where_given
from rayfuse.updates.pipeline import check_aggregation, check_round_memory, check_secure_aggregation, check_update_pipeline

__all__ = ["PRE_START_RULES", "TAG_RULES", "StartFacts", "check_before_start", "check_local_dp", "check_tags"]


# ---------------------------------------------------------------------------------------------------------------
# The tags' rules: what the methods' tags (MethodTags) say they cannot do


#: what a method combines of its clients (:data:`Fuses`), in the words of the refusal of clients of several models
_FUSES_ONE_LAYOUT = {
    "parameters": "combines the clients' weights, in one layout",
    "adapter factors": "combines the clients' low-rank factors, in one layout",
    "task vectors": "combines the clients' task vectors, in one layout",
    "posteriors": "fuses posteriors over the clients' weights, in one layout",
    "statistics": "fuses statistics of the clients' models, in one layout",
    "predictions": "fuses the clients' predictions, every client's model built in one architecture",
    "nothing": "builds every model it trains or scores in the run's one architecture",
}


def refuse_dataset_readers_with_silos(specs: Sequence[MethodSpec], setup: RunSetup, cfg: ExperimentConfig) -> None:
    """``needs_dataset`` with ``data.silos`` (no process reads every silo), at ``methods.<label>``."""
    if cfg.data.is_silos:
        for spec in specs:
            if spec.tags.needs_dataset:
                raise InputError(
                    f"methods.{spec.label}",
                    "methods that run without a dataset of their own with data.silos (no process reads every silo)",
                    spec.method,
                    "it reads the whole dataset (data.dataset): run it on a simulation config",
                )


def refuse_one_layout_methods_with_mixed_clients(specs: Sequence[MethodSpec], setup: RunSetup, cfg: ExperimentConfig) -> None:
    """Clients of different models (``federation.client_overrides.<i>.model``) for a method without
    ``heterogeneous_clients`` (it fuses what it fuses, ``MethodTags.fuses``, in one layout), naming the clients whose
    model differs from client 0's (or, when every client has one other model, that it is not ``model``)."""
    if setup.heterogeneous_clients:
        models = [setup.client_model(i) for i in range(setup.num_clients)]
        others = other_model_clients(models)
        for spec in specs:
            if spec.tags.heterogeneous_clients:
                continue
            what = _FUSES_ONE_LAYOUT.get(spec.tags.fuses, _FUSES_ONE_LAYOUT["parameters"])
            if others:
                expected = f"clients of one architecture for method {spec.method!r} (methods.{spec.label} {what})"
                got = f"client{'s' if len(others) > 1 else ''} {_client_list(others)} with models other than client 0's"
            else:
                expected = (
                    f"clients of the run's architecture (model: {setup.model.name}) for method {spec.method!r} "
                    f"(methods.{spec.label} {what} and scores in the server's model)"
                )
                got = f"every client with model {models[0].name}"
            accepted = ", ".join(name for name, cls in METHODS.items() if cls.tags.heterogeneous_clients)
            raise InputError(
                "federation.client_overrides", f"{expected}, got {got}", hint=f"methods that take clients of different models: {accepted}"
            )


def refuse_public_labels_without_labels(specs: Sequence[MethodSpec], setup: RunSetup, cfg: ExperimentConfig) -> None:
    """A public sample without labels (``data.public.labels: false``) for a method with ``public_labels``."""
    if not setup.public_labeled:
        for spec in specs:
            if spec.tags.public_labels:
                raise InputError(
                    "data.public.labels",
                    f"true (a labelled public sample) for method {spec.method!r} (methods.{spec.label} "
                    "reads the labels of the server's public sample)",
                    False,
                    "give data.public a labelled file, or drop the method (distill with transfer: public reads inputs only)",
                )


def refuse_federated_evaluation_without_scores(specs: Sequence[MethodSpec], setup: RunSetup, cfg: ExperimentConfig) -> None:
    """``evaluation: federated`` / ``both`` where the clients cannot score: a new task on the server
    (``data.target``), no held-out data on any client (``data.val_size: 0``), or a method without
    ``federated_evaluation``. A silo run's setup before its survey holds stand-in sizes (every client holding held-out
    data)."""
    if setup.evaluation != "central":
        if setup.target is not None:
            raise InputError(
                "evaluation",
                "central with data.target (the clients hold held-out data of their own task, not the server's target task)",
                setup.evaluation,
            )
        if setup.val_sizes is not None and sum(setup.val_sizes) == 0:
            raise InputError(
                "evaluation",
                "central when no client holds a held-out split (data.val_size is 0)",
                setup.evaluation,
                "set data.val_size, e.g. 0.1",
            )
        for spec in specs:
            if not spec.tags.federated_evaluation:
                raise InputError(
                    "evaluation",
                    f"central for method {spec.method!r} (methods.{spec.label}: it scores on the server's "
                    "data in its own way, not through federated evaluation)",
                    setup.evaluation,
                )


def refuse_dp_the_tags_exclude(specs: Sequence[MethodSpec], setup: RunSetup, cfg: ExperimentConfig) -> None:
    """``dp`` on a method whose ``no_dp`` says why it does not apply, at ``methods.<label>.dp``."""
    for spec in specs:
        if spec.tags.no_dp and update_setting(spec, "dp") is not None:
            raise dp_refusal(spec.method_cls, spec.method, f"methods.{spec.label}.dp", params=spec.params)


def refuse_local_dp_for_other_readers(specs: Sequence[MethodSpec], setup: RunSetup, cfg: ExperimentConfig) -> None:
    """Local DP-SGD (``train.dp``) for a method that is neither ``local_model_only`` nor an ``oracle``: it reads the
    clients' data other than through their DP-trained local models (oracles, non-private references, pass)."""
    if cfg.train.dp is not None:
        for spec in specs:
            tags = spec.tags
            if not tags.local_model_only and not tags.oracle:
                released = ", ".join(name for name, cls in METHODS.items() if cls.tags.local_model_only)
                raise InputError(
                    "train.dp",
                    f"methods whose clients release only their DP-trained local models ({released}; "
                    f"oracles pass as non-private references), not method {spec.method!r}",
                    f"methods.{spec.label}",
                    f"drop train.dp or that method (methods.<label>.dp is {dp_options_text()})",
                )


#: The tags' pre-start rules, in the order the pre-start table runs them (:data:`PRE_START_RULES`, with
#: the methods' own checks between the data rules and the evaluation's): each reads the entries' tags and the setup,
#: and raises one :class:`InputError`.
TAG_RULES = (
    refuse_dataset_readers_with_silos,
    refuse_one_layout_methods_with_mixed_clients,
    refuse_public_labels_without_labels,
    refuse_federated_evaluation_without_scores,
    refuse_dp_the_tags_exclude,
    refuse_local_dp_for_other_readers,
)


def check_tags(specs: Sequence[MethodSpec], setup: RunSetup, cfg: ExperimentConfig) -> None:
    """Refuse, before anything starts, every run the methods' tags (:class:`MethodTags`) say they cannot do: the
    rules of :data:`TAG_RULES` in order, one line, the first refusal (a run's checks are the pre-start table,
    :data:`PRE_START_RULES`, which runs these among the others)."""
    for rule in TAG_RULES:
        rule(specs, setup, cfg)


def _client_list(clients: Sequence[int], most: int = 8) -> str:
    """``1, 2, 5`` (and how many more past ``most``)."""
    shown = ", ".join(str(c) for c in clients[:most])
    return shown if len(clients) <= most else f"{shown} and {len(clients) - most} more"


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


def secure_aggregation(facts: StartFacts) -> None:
    """``federation.secure_aggregation`` with what cannot be summed securely
    (:func:`rayfuse.updates.pipeline.check_secure_aggregation`)."""
    check_secure_aggregation(facts.specs, facts.setup, facts.cfg.federation)


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
    through their local models is refused from its tags (:func:`rayfuse.prestart.check_tags`)."""
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
    secure_aggregation,
    coordinator_memory,
    local_dp_sgd,
)


def check_before_start(facts: StartFacts, rules: Sequence[Callable[[StartFacts], None]] | None = None) -> None:
    """Run the pre-start table (:data:`PRE_START_RULES`, or ``rules``) on ``facts``: the first refusal is raised."""
    try:
        for rule in PRE_START_RULES if rules is None else rules:
            rule(facts)
    except InputError as exc:
        for spec in facts.specs:  # named where the entry gave it (methods.<label>.updates.<key>...)
            exc = where_given(exc, spec.label, spec.grouped)
        raise exc from None
