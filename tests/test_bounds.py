"""Settings whose cost is implied, not given, are bounded before anything is allocated or drawn (issue: hardening,
round 4): the memory a batch, a bank or a generated dataset implies is estimated against what the machine has; the
``tokens`` generator ends for every option it accepts and keeps its ids exact; ``rayfuse symmetry``'s flags are
refused by their own names. Each case: exit 2 (or one ``InputError``), one line naming the key, no traceback."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from rayfuse.data.tokens import MAX_VOCAB, token_sequences
from rayfuse.errors import InputError
from tests.config.test_bad_inputs import refused_line

ROOT = Path(__file__).resolve().parents[1]
HUGE = 10**12


def job(tmp_path: Path, **sections: Any) -> str:
    """A job file under ``tmp_path`` whose runs would go to ``tmp_path / "runs"`` (which a refusal leaves absent)."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"run": {"storage": str(tmp_path / "runs")}, **sections}))
    return str(path)


def _quickstart_with(tmp_path: Path, **distill: Any) -> list[str]:
    return ["validate", str(ROOT / "jobs" / "quickstart.yaml"), *(f"--set=methods.distill.{k}={v}" for k, v in distill.items())]


CASES = [
    # 1. memory implied by a parameter
    ("distill-batch-size", lambda t: _quickstart_with(t, batch_size=HUGE), "methods.distill.batch_size", "GiB available"),
    (
        "distill-synthetic-batch",
        lambda t: _quickstart_with(t, transfer="synthetic", synthetic_batch=HUGE),
        "methods.distill.synthetic_batch",
        "GiB",
    ),
    ("distill-bank-samples", lambda t: _quickstart_with(t, transfer="synthetic", bank_samples=HUGE), "methods.distill.bank_samples", "GiB"),
    (
        "tokens-n-samples",
        lambda t: ["validate", job(t, data={"dataset": "tokens", "options": {"n_samples": HUGE}}, methods={"fedavg": {}})],
        "data.options.n_samples",
        "GiB available",
    ),
    (
        "tokens-n-samples-times-length",
        lambda t: [
            "validate",
            job(t, data={"dataset": "tokens", "options": {"n_samples": 10**6, "length": 10**7}}, methods={"fedavg": {}}),
        ],
        "data.options.n_samples",
        "GiB available",
    ),
    # 2. the tokens generator: bounded, exact ids
    (
        "tokens-marker-rate-tiny",
        lambda t: ["validate", job(t, data={"dataset": "tokens", "options": {"marker_rate": 1e-9}}, methods={"fedavg": {}})],
        "data.options.marker_rate",
        "at least 1% of the rows",
    ),
    (
        "tokens-vocab-beyond-float32",
        lambda t: ["validate", job(t, data={"dataset": "tokens", "options": {"vocab": MAX_VOCAB + 1}}, methods={"fedavg": {}})],
        "data.options.vocab",
        "2^24",
    ),
    # 12. and the leftovers: symmetry's flags by their names
    ("symmetry-dataset-unknown", lambda t: ["symmetry", "mlp", "--dataset", "nope"], "--dataset", "got 'nope'"),
    (
        "symmetry-vit-image-not-a-multiple-of-the-patch",
        lambda t: ["symmetry", "torchvision:vit_b_16", "--input-shape", "3,230,230", "--args", '{"image_size": 230}'],
        "--args",
        "multiple of its patch size 16",
    ),
]


def refused_before_start(tmp_path: Path, capsys: Any, argv: list[str], key: str, words: str) -> None:
    """``argv`` exits 2 with one line at ``key`` holding ``words``, and no run folder was made."""
    line = refused_line(argv, capsys)
    assert line.startswith(f"rayfuse: error: {key}: expected") and words in line, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("make", "key", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_setting_beyond_its_bound_is_one_line_before_anything_starts(tmp_path, capsys, make, key, words):
    refused_before_start(tmp_path, capsys, make(tmp_path), key, words)


@pytest.mark.parametrize("rate", [1e-9, 1e-4])
def test_the_tokens_generator_refuses_at_once_a_rate_it_could_not_fill_rows_at(rate):
    start = time.monotonic()
    with pytest.raises(InputError, match=r"^data\.options\.marker_rate"):
        token_sequences(marker_rate=rate)
    assert time.monotonic() - start < 5  # a bound on a loop, not a performance check: the old generator never returned


def test_many_tied_markers_end_in_a_refusal_or_rows_not_a_loop():
    X, y = token_sequences(n_samples=50, length=200, vocab=40, n_classes=30, marker_rate=1.0)
    assert X.shape == (50, 200) and X.dtype == np.int64 and set(np.unique(y)) <= set(range(30))


def test_the_largest_vocab_keeps_every_id_exact_in_the_dataset():
    from rayfuse.data.datasets import load_dataset

    data = load_dataset("tokens", options={"vocab": MAX_VOCAB, "n_samples": 50, "length": 64})
    ids = data.X.astype(np.int64)
    assert (ids.astype(np.float32) == data.X).all() and ids.max() < MAX_VOCAB and ids.max() > MAX_VOCAB - 2**20


def test_symmetry_takes_the_token_shape_from_the_tokens_dataset(capsys):
    from rayfuse.cli import main

    # the registry's transformer takes floats: the refusal is about the model, not a missing --input-shape
    assert main(["symmetry", "transformer", "--dataset", "tokens", "--vocab", "30"]) == 2
    err = capsys.readouterr().err
    assert "--input-shape" not in err and "token ids in [0, 30)" in err, err
