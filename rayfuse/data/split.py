"""Rehearsal: a simulation config's data written out as silos (``rayfuse split CONFIG --out DIR``).

:func:`split_simulation` runs the simulation's data plan (:func:`rayfuse.data.roles.make_plan`: the same test set,
public sample, partition and validation splits as ``rayfuse run``) and writes, under ``DIR``:

* ``client-<i>/train.npz`` and ``client-<i>/held_out.npz``: client ``i``'s private training split and its held-out
  (validation) split, exactly the arrays its client would hold in the simulation (arrays ``X`` float32 and ``y``
  int64, in the simulation's order);
* ``server/test.npz`` (the test set) and ``server/public.npz`` (the server's public sample, when the simulation has
  one);
* ``silos.yaml``: the silo config that runs on these files (``data.silos`` with each client's ``path`` and
  ``test_path``, ``data.test``, ``data.public``; every other section copied, resolved).

What keeps the numbers identical:

* **Standardisation** is applied before writing, with the simulation's statistics (those of its training pool,
  computed on the driver), and the silo config says ``data.standardize: false``. Federated standardisation would
  compute the statistics of the clients' training splits only, which differ from the pool's (the pool also holds the
  validation splits, the public sample and any unassigned samples).
* **Corruption** (``partition.corrupt``) is applied before writing, as the client applies it when it loads its
  shard: the written files are the corrupted data, and the silo config has no ``partition.corrupt``.
* **Held-out splits** are written files (``test_path``), not ``val_size`` of the silo: a silo's own ``val_size``
  split is drawn with another generator than the simulation's.
* **Labels**: the files hold the simulation's label numbers (0..C-1) and the silo config declares them all,
  ``data.classes: [0, ..., C-1]``, so a client whose shard lacks some labels (a Dirichlet or label-disjoint
  partition) numbers its labels as the simulation does, and every silo reports the same C label values.
* Seeds, ``train`` (``shared_init`` included), ``model``, ``federation``, ``methods`` and ``evaluation`` are copied,
  except the methods that read the whole dataset (``MethodTags.needs_dataset``: the oracles ``global``, training on
  every client's data pooled, ``gmm_oracle`` and ``epgan-oracle``), which a silo run refuses (no process reads every
  silo): they are left out, and the config's header says so. An oracle that runs on silos (``transfer``: the
  teachers' weights leave their clients, but no process reads their data) is kept.

Paths in ``silos.yaml`` are absolute, so the config runs from any working directory. Only what a silo file can say
is written: a split with no sample (a client's shard or validation split, a silo file holds at least one) is refused,
as are datasets whose evaluation needs more than their arrays (generators recording their true parameters: ``gmm``,
``lda``) and configs given arrays from Python.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfuse.data.roles import DataPlan, Split, client_splits, load_dataset_from_config, load_target_from_config, make_plan, server_splits
from rayfuse.errors import InputError

if TYPE_CHECKING:
    from rayfuse.config import ExperimentConfig

__all__ = ["SILO_CONFIG_NAME", "silo_config_for", "silo_config_text", "split_simulation"]

SILO_CONFIG_NAME = "silos.yaml"
# data keys of a simulation that a silo config refuses (rayfuse.config: each client reads its own silo instead)
# (text, tokenizer, max_length: the files hold a text dataset's token ids, tokenised already)
_SIMULATION_ONLY = (
    "dataset",
    "root",
    "path",
    "label",
    "features",
    "options",
    "target",
    "test_size",
    "public_size",
    "text",
    "tokenizer",
    "max_length",
)


def split_simulation(cfg: ExperimentConfig, out: str | Path, *, key: str = "--out") -> Path:
    """Write the simulation ``cfg``'s data as one file per client split and server set, and a silo config that
    reproduces the run's numbers; return the path of that config (``<out>/silos.yaml``).

    Parameters
    ----------
    cfg : ExperimentConfig
        A simulation config (``data.dataset`` + ``partition``).
    out : str or Path
        A new or empty folder (created); ``key`` names it in errors.

    Raises
    ------
    InputError
        A silo config, a folder that exists with entries or cannot be written, or a split that silo files cannot
        reproduce (see the module's docstring). Nothing is left in ``out`` then.
    """
    from rayfuse.io import check_writable_folder

    if cfg.data.is_silos:
        raise InputError(
            "data.silos",
            "a simulation config (data.dataset + partition) to split into silos",
            f"a silo config ({len(cfg.data.silos or [])} silos)",
            "its data is already one file per client",
        )
    if cfg.data.dataset == "arrays":
        raise InputError("data.dataset", "a dataset a config file names (rayfuse split reads the config's own data)", "arrays")
    folder = Path(out)
    absolute = str(folder.resolve())
    # silos.yaml holds absolute paths, read back by the silo config's rules: its reader expands ${NAME} in them, and a
    # line break is no path there
    if "${" in absolute or any(c in absolute for c in "\n\r"):
        raise InputError(
            key,
            "a folder whose absolute path holds no '${' and no line break (the silo config's paths expand ${NAME} on "
            "each node, and hold no line break)",
            absolute,
            "pick a folder elsewhere",
        )
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise InputError(key, "a new or empty folder", str(folder), "pick another folder")
    check_writable_folder(folder, key=key)

    dataset = load_dataset_from_config(cfg.data)
    if dataset.meta:
        raise InputError(
            "data.dataset",
            "a dataset whose evaluation needs only its arrays (silo files carry no generator facts)",
            cfg.data.dataset,
            f"its runs also read {sorted(dataset.meta)[0]!r} and the like, which no silo holds",
        )
    if dataset.X.ndim == 3:  # (N, L, F): an npz reader takes (N, H, W) for grey images and adds a channel
        raise InputError(
            "data.dataset",
            "inputs of shape (N, features) or (N, C, H, W) (what an npz silo reads back as it is)",
            f"{cfg.data.dataset} with inputs {dataset.input_shape}",
        )
    target = load_target_from_config(cfg.data)
    plan = make_plan(dataset, cfg.data, cfg.partition, cfg.run.seed, target=target)
    clients = [client_splits(dataset, plan.for_client(i)) for i in range(plan.num_clients)]
    test, public = server_splits(dataset if target is None else target, plan)
    _check_silo_sizes(clients, test)

    folder = folder.resolve()
    files = [
        {"path": str(folder / f"client-{i}" / "train.npz"), "test_path": str(folder / f"client-{i}" / "held_out.npz")}
        for i in range(plan.num_clients)
    ]
    test_file, public_file = folder / "server" / "test.npz", (folder / "server" / "public.npz") if len(public) else None
    text = silo_config_text(cfg, files, test_file, public_file, plan)  # checked before anything is written
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for (train, held_out), paths in zip(clients, files, strict=True):
            _write_npz(Path(paths["path"]), train)
            _write_npz(Path(paths["test_path"]), held_out)
        _write_npz(test_file, test)
        if public_file is not None:
            _write_npz(public_file, public)
        config_file = folder / SILO_CONFIG_NAME
        config_file.write_text(text, encoding="utf-8")
    except BaseException:
        _remove_written(folder, created)
        raise
    return config_file


def silo_config_for(
    cfg: ExperimentConfig, files: list[dict[str, str]], test_file: Path, public_file: Path | None, num_classes: int
) -> dict[str, Any]:
    """The silo config (plain data, validated) that runs ``cfg`` on the written files: ``files`` holds each client's
    ``path`` and ``test_path``; the server's sets are ``test_file`` and ``public_file``; the labels are
    ``0..num_classes-1`` (``data.classes``)."""
    from rayfuse.config import validate_config
    from rayfuse.method import resolve_methods, resolved_config

    specs = resolve_methods(cfg.methods)
    kept = [spec for spec in specs if not spec.tags.needs_dataset]
    if not kept:
        raise InputError(
            "methods",
            "at least one method a federation can run on silos (methods that read the whole "
            "dataset, as oracles pooling every client's data do, cannot)",
            [spec.label for spec in specs],
        )
    resolved = resolved_config(cfg, kept)
    # the default layout is no setting of a silo config (a silo's npz is read as a simulation's with layout auto);
    # another layout is kept, and the silo config refuses it as before
    data = {k: v for k, v in resolved["data"].items() if k not in _SIMULATION_ONLY and (k, v) != ("layout", "auto")}
    data["standardize"] = False  # the files hold the simulation's standardised values already
    data["classes"] = list(range(num_classes))  # the files' label numbers, every one declared: a shard may lack some
    data["silos"] = [{"dataset": "npz", **f} for f in files]
    data["test"] = {"dataset": "npz", "path": str(test_file)}
    if public_file is not None:
        data["public"] = {"dataset": "npz", "path": str(public_file)}
    config = {**resolved, "data": data, "partition": {"num_clients": len(files)}, "evaluation": cfg.evaluation}
    validate_config(config)  # the config rayfuse run will read
    return config


def silo_config_text(cfg: ExperimentConfig, files: list[dict[str, str]], test_file: Path, public_file: Path | None, plan: DataPlan) -> str:
    """:func:`silo_config_for` as YAML, after a comment saying where it comes from."""
    import yaml

    from rayfuse.method import resolve_methods

    config = silo_config_for(cfg, files, test_file, public_file, plan.num_classes)
    left_out = [spec.label for spec in resolve_methods(cfg.methods) if spec.tags.needs_dataset]
    notes = [
        f"# written by rayfuse split: the simulation of {cfg.data.dataset!r} (partition {plan.partition['method']}, "
        f"{plan.num_clients} clients, seed {cfg.run.seed}, partition hash {plan.digest()[:12]}) as silo files.",
        "# The files hold the simulation's standardised"
        + (" and corrupted" if plan.corruptions else "")
        + " values: standardize is off, and the held-out",
        "# splits are the simulation's validation splits (test_path). Run it with: rayfuse run <this file>",
    ]
    if left_out:
        notes.append(f"# Left out: the method(s) {', '.join(left_out)} (they read the whole dataset; no silo run can).")
    return "\n".join(notes) + "\n" + yaml.safe_dump(config, sort_keys=False)


def _check_silo_sizes(clients: list[tuple[Split, Split]], test: Split) -> None:
    """Refuse a split that no silo file can hold: an empty client shard, validation split or test set (a file holds
    at least one sample; the labels a shard lacks are declared in ``data.classes``)."""
    for i, (train, held_out) in enumerate(clients):
        if not len(train):
            raise InputError("partition", "a training shard of at least one sample on every client (a silo file)", f"client {i} with none")
        if not len(held_out):
            raise InputError(
                "data.val_size",
                "a validation split of at least one sample on every client (a silo's held-out file)",
                f"client {i} with none of its {len(train)} samples",
                "raise data.val_size for rayfuse split",
            )
    if not len(test):
        raise InputError("data.test_size", "a test set of at least one sample (a silo test file)", "none")


def _write_npz(path: Path, split: Split) -> Path:
    """``split`` as an npz archive of ``X`` and ``y`` (dtypes and shapes as they are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        np.savez(handle, X=split.X, y=split.y)
    return path


def _remove_written(folder: Path, created: bool) -> None:
    """Undo a split that failed part way: the folder's entries (the folder too when this split created it)."""
    if not folder.is_dir():
        return
    if created:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
