"""Text as a data kind of a run config (issue 43, item 1): ``data.text`` / a silo's ``text`` column, ``data.tokenizer``
(default: the model's ``hf:<folder>``), ``data.max_length`` (default: min(128, the model's positions)); text silos
(jsonl, csv / parquet with ``text`` named) tokenised on the client, the server's public texts (``labels: false``, txt or
a text column), the single file a simulation partitions (``dataset: text``). Bad text inputs are one line each, exit 2,
before any site trains, nothing written."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rayfuse.config import validate_config
from rayfuse.data.silos import check_schemas, dtype_kind, load_silo, silo_schema
from rayfuse.data.text import PAD, TEXT_DTYPE, TextEncoding, build_word_tokenizer
from rayfuse.errors import InputError
from rayfuse.models.hf import quiet_transformers
from rayfuse.runner import prepare_run
from tests.config.test_bad_inputs import Files, _snapshot, isolated, refused_line  # noqa: F401  (isolated: the harness's fixture)

TOPICS = {
    "tech": "python code bug compile error java function class method install driver update windows",
    "mood": "i feel happy today sad lonely angry upset love joy fear hope",
}


def texts(n: int, seed: int = 0, labels: tuple[str, ...] = ("tech", "mood")) -> list[dict[str, str]]:
    """``n`` rows ``{"q": text, "cat": label}``: a few words of the label's topic, labels in turn."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = labels[i % len(labels)]
        words = TOPICS[label].split()
        rows.append({"q": " ".join(rng.choice(words, size=int(rng.integers(2, 7)))), "cat": label})
    return rows


def tiny_text_bert(
    folder: Path,
    *,
    positions: int = 16,
    num_labels: int = 2,
    tokenizer: bool = True,
    texts: Sequence[str] | None = None,
    vocab_size: int = 64,
    layers: int = 1,
) -> Path:
    """A tiny BERT classifier saved in ``folder`` (with the word tokenizer of ``texts``, default :data:`TOPICS`, unless
    ``tokenizer`` is false): ``layers`` layers, 16 wide."""
    from transformers import BertConfig, BertForSequenceClassification

    words = list(TOPICS.values()) if texts is None else list(texts)
    vocab = build_word_tokenizer(words, folder, vocab_size=vocab_size) if tokenizer else None
    if not tokenizer:
        folder.mkdir(parents=True, exist_ok=True)
    config = BertConfig(
        vocab_size=len(vocab) if vocab is not None else vocab_size,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=positions,
        num_labels=num_labels,
        pad_token_id=0,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(0)
    with quiet_transformers():
        BertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_text_bert(tmp_path_factory.mktemp("text_bert"))


def jsonl(f: Files, name: str, rows: list[dict[str, Any]]) -> str:
    return f.text(name, "".join(json.dumps(row) + "\n" for row in rows))


def jsonl_silo(f: Files, name: str, rows: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    jsonl(f, name, texts(24, seed=len(name)) if rows is None else rows)
    return {"dataset": "jsonl", "path": name, "text": "q", "label": "cat", "val_size": 0.25, **spec}


def text_job(
    f: Files, bert: Path, silos: list[dict[str, Any]], methods: dict[str, Any] | None = None, model: str | None = None, **data: Any
) -> str:
    return f.yaml(
        "job.yaml",
        {
            "run": {"name": "text", "seed": 0, "storage": "runs"},
            "data": {"silos": silos, **data},
            "model": {"name": model or f"hf:{bert}"},
            "train": {"epochs": 1, "batch_size": 8, "shared_init": True},
            "federation": {"backend": "local"},
            "methods": methods or {"local": {}},
        },
    )


def public_txt(f: Files, name: str = "public.txt", lines: list[str] | None = None) -> dict[str, Any]:
    f.text(name, "\n".join(lines if lines is not None else [r["q"] for r in texts(12, seed=9)]) + "\n")
    return {"dataset": "txt", "path": name, "labels": False}


def two_silos(f: Files, **spec: Any) -> list[dict[str, Any]]:
    return [jsonl_silo(f, "site0.jsonl", **spec), jsonl_silo(f, "site1.jsonl", **spec)]


# ---------------------------------------------------------------------------------------------------------------
# Refused: one line (exact), exit 2, nothing written


CASES: list[tuple[str, Callable[[Files, Path], list[str]], str]] = [
    (
        "empty-text-in-a-silo",
        lambda f, b: [
            "run",
            text_job(f, b, [jsonl_silo(f, "site0.jsonl", [*texts(10), {"q": "  ", "cat": "tech"}]), jsonl_silo(f, "site1.jsonl")]),
        ],
        "data.silos.0.text: expected a non-empty text in every row of column 'q', got 'an empty text at row 10 of site0.jsonl'",
    ),
    (
        "non-utf8-silo",
        lambda f, b: [
            "run",
            text_job(
                f,
                b,
                [
                    {**jsonl_silo(f, "site0.jsonl"), "path": f.raw("bad.jsonl", b'{"q": "caf\xe9", "cat": "tech"}\n')},
                    jsonl_silo(f, "s1.jsonl"),
                ],
            ),
        ],
        "data.silos.0.path: expected a UTF-8 text file, got 'byte 0xe9 at line 1 of bad.jsonl'; save it as UTF-8",
    ),
    (
        "missing-text-column",
        lambda f, b: ["run", text_job(f, b, two_silos(f, text="question"))],
        "data.silos.0.text: expected a column of site0.jsonl (cat, q), got 'question'",
    ),
    (
        "missing-label-column",
        lambda f, b: ["run", text_job(f, b, two_silos(f, label="category"))],
        "data.silos.0.label: expected a column of site0.jsonl (cat, q), got 'category'",
    ),
    (
        "missing-label-in-a-row",
        lambda f, b: ["run", text_job(f, b, [jsonl_silo(f, "site0.jsonl", [*texts(10), {"q": "hello"}]), jsonl_silo(f, "site1.jsonl")])],
        "data.silos.0.label: expected a label in every row of column 'cat', got 'None at row 10 of site0.jsonl'",
    ),
    (
        "a-tokenizer-the-folder-lacks",
        lambda f, b: ["run", text_job(f, b, two_silos(f), model=f"hf:{tiny_text_bert(f.root / 'bare', tokenizer=False)}")],
        "data.tokenizer: expected a folder with a tokenizer (tokenizer.json, vocab.txt, ...), got 'none in {root}/bare'",
    ),
    (
        "no-such-tokenizer-folder",
        lambda f, b: ["run", text_job(f, b, two_silos(f), tokenizer="missing")],
        "data.tokenizer: expected an existing Hugging Face folder with a tokenizer, got '{root}/missing'",
    ),
    (
        "max-length-beyond-the-model-positions",
        lambda f, b: ["run", text_job(f, b, two_silos(f), max_length=64)],
        "data.max_length: expected at most the model's max_position_embeddings (16) in {bert}, got 64",
    ),
    (
        "model-not-hf",
        lambda f, b: ["run", text_job(f, b, two_silos(f), model="mlp")],
        "model.name: expected a Hugging Face classifier hf:<folder> for text data (token-id rows), got 'mlp'",
    ),
    (
        "txt-silo",
        lambda f, b: ["run", text_job(f, b, [{**public_txt(f, "s.txt"), "labels": True, "val_size": 0.25}, jsonl_silo(f, "s1.jsonl")])],
        "data.silos.0.dataset: expected jsonl, csv or parquet with a text column for a client's silo (a txt file holds no labels: "
        "data.public only), got 'txt'",
    ),
    (
        "txt-public-with-labels",
        lambda f, b: ["run", text_job(f, b, two_silos(f), public={**public_txt(f), "labels": True})],
        "data.public.labels: expected false for a txt file (one unlabeled text a line: data.public only), got True",
    ),
    (
        "txt-public-with-a-label-column",
        lambda f, b: ["run", text_job(f, b, two_silos(f), public={**public_txt(f), "label": "cat"})],
        "data.public.label: expected no label for a txt file (one unlabeled text a line; use jsonl, csv or parquet), got 'cat'",
    ),
    (
        "empty-line-in-public-txt",
        lambda f, b: ["run", text_job(f, b, two_silos(f), public=public_txt(f, lines=["hello there", "", "what is ai"]))],
        "data.public.path: expected one non-empty text a line (.txt), got 'an empty line 2 in public.txt'",
    ),
    (
        "public-text-column-missing",
        lambda f, b: [
            "run",
            text_job(
                f, b, two_silos(f), public={"dataset": "jsonl", "path": jsonl(f, "pub.jsonl", texts(6)), "text": "body", "labels": False}
            ),
        ],
        "data.public.text: expected a column of pub.jsonl (cat, q), got 'body'",
    ),
    (
        "jsonl-without-text",
        lambda f, b: [
            "run",
            text_job(f, b, [{k: v for k, v in jsonl_silo(f, "s0.jsonl").items() if k != "text"}, jsonl_silo(f, "s1.jsonl")]),
        ],
        "data.silos.0.text: expected the text column of the jsonl file (dataset is 'jsonl')",
    ),
    (
        "text-with-features",
        lambda f, b: ["run", text_job(f, b, [jsonl_silo(f, "s0.jsonl", features=["q"]), jsonl_silo(f, "s1.jsonl")])],
        "data.silos.0.features: expected no features for a text file (its inputs are the texts of column text), got ['q']",
    ),
    (
        "text-silo-beside-an-npz-silo",
        lambda f, b: [
            "run",
            text_job(f, b, [jsonl_silo(f, "site0.jsonl"), {"dataset": "npz", "path": f.npz("s1.npz"), "val_size": 0.25}]),
        ],
        "data.silos.1.dataset: expected a text source (jsonl, txt, or csv / parquet with text named) as data.silos.0 is (a run's "
        "data are texts or not), got 'npz'",
    ),
    (
        "standardized-token-ids",
        lambda f, b: ["run", text_job(f, b, two_silos(f), standardize=True)],
        "data.standardize: expected false or unset for text data (token ids are never scaled), got True",
    ),
    (
        "tokenizer-without-text-data",
        lambda f, b: ["validate", f.job(data={"dataset": "digits", "tokenizer": str(b)})],
        "data.tokenizer: expected no tokenizer without text data (dataset: text, or text silos), got '{bert}'",
    ),
    (
        "dataset-text-from-a-txt-file",
        lambda f, b: [
            "validate",
            f.job(data={"dataset": "text", "path": public_txt(f)["path"], "text": "q"}, model={"name": f"hf:{b}"}),
        ],
        "data.path: expected a .jsonl, .csv or .parquet file of labeled texts for dataset 'text' (a .txt file holds no labels), "
        "got 'public.txt'",
    ),
    (
        "dataset-text-empty-text",
        lambda f, b: [
            "validate",
            f.job(
                data={
                    "dataset": "text",
                    "path": jsonl(f, "all.jsonl", [*texts(20), {"q": "", "cat": "mood"}]),
                    "text": "q",
                    "label": "cat",
                },
                model={"name": f"hf:{b}"},
            ),
        ],
        "data.text: expected a non-empty text in every row of column 'q', got 'an empty text at row 20 of all.jsonl'",
    ),
]


@pytest.mark.parametrize(("make", "line"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_text_input_is_one_line_exit_2_and_nothing_written(make, line, bert, isolated: Path, capsys) -> None:  # noqa: F811
    files = Files(isolated)
    command = make(files, bert)
    capsys.readouterr()
    before = _snapshot(isolated)
    got = refused_line(command, capsys)
    assert got == "rayfuse: error: " + line.format(root=isolated, bert=bert)
    assert _snapshot(isolated) == before and not (isolated / "runs").exists()


def test_silos_tokenised_differently_are_refused_by_the_survey(bert, tmp_path) -> None:
    f = Files(tmp_path)
    spec = jsonl_silo(f, "site0.jsonl")
    spec["path"] = str(tmp_path / spec["path"])
    reports = [silo_schema(*load_silo(spec, client=0, text=TextEncoding(str(bert), n))) for n in (12, 16)]
    assert reports[0]["text"]["max_length"] == 12 and reports[0]["dtype"] == TEXT_DTYPE
    with pytest.raises(InputError) as info:
        check_schemas(reports)
    fingerprint = reports[0]["text"]["tokenizer"]
    assert str(info.value).startswith(
        f"data.silos.1: expected texts tokenised as data.silos.0's {{'tokenizer': '{fingerprint}', 'max_length': 12}}, got "
    )
    assert "\n" not in str(info.value)
    assert dtype_kind(TEXT_DTYPE) == "token ids of texts" != dtype_kind("float32")


# ---------------------------------------------------------------------------------------------------------------
# Accepted: read as they mean


def test_a_text_silo_is_tokenised_on_the_client_with_minus_one_padding(bert, tmp_path) -> None:
    f = Files(tmp_path)
    spec = jsonl_silo(f, "site0.jsonl")
    spec["path"] = str(tmp_path / spec["path"])
    train, held_out = load_silo(spec, client=0, text=TextEncoding(str(bert), 10))
    assert train.X.shape == (18, 10) and held_out.X.shape == (6, 10) and train.X.dtype == np.float32
    assert train.class_names == ("mood", "tech") and (train.X[:, 0] == 2).all()  # the class token first
    assert (train.X == PAD).any() and set(np.unique(train.X[train.X >= 0]).astype(int)) <= set(range(64))


def test_defaults_come_from_the_model_folder_and_the_driver_never_opens_a_silo(bert, tmp_path) -> None:
    f = Files(tmp_path)
    silos = [{"dataset": "jsonl", "path": str(tmp_path / f"nowhere{i}.jsonl"), "text": "q", "label": "cat"} for i in range(2)]
    cfg = validate_config(
        {
            "data": {"silos": silos, "public": {**public_txt(f), "path": str(tmp_path / "public.txt")}},
            "model": {"name": f"hf:{bert}"},
            "methods": {"distill": {"transfer": "public", "init": "average"}},
        }
    )
    assert cfg.data.tokenizer is None and cfg.data.max_length is None  # as written; resolved for the run
    prepared = prepare_run(cfg)  # the silos' files do not exist: the driver reads only the server's public texts
    assert prepared.cfg.data.tokenizer == str(bert) and prepared.cfg.data.max_length == 16
    assert prepared.setup.public_size == 12


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_csv_and_parquet_silos_with_a_text_column(fmt, bert, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rows = texts(20)
    table = pa.table({"q": [r["q"] for r in rows], "cat": [r["cat"] for r in rows], "id": list(range(20))})
    path = tmp_path / f"site.{fmt}"
    pq.write_table(table, path) if fmt == "parquet" else pacsv.write_csv(table, path)
    train, _ = load_silo(
        {"dataset": fmt, "path": str(path), "text": "q", "label": "cat", "val_size": 0.25}, client=0, text=TextEncoding(str(bert), 8)
    )
    assert train.X.shape == (15, 8) and train.stored_dtype == TEXT_DTYPE and train.class_names == ("mood", "tech")


def test_the_single_file_mode_partitions_one_text_file(bert, tmp_path) -> None:
    f = Files(tmp_path)
    path = tmp_path / jsonl(f, "all.jsonl", texts(60))
    cfg = validate_config(
        {
            "data": {"dataset": "text", "path": str(path), "text": "q", "label": "cat", "max_length": 12},
            "partition": {"method": "iid", "num_clients": 3},
            "model": {"name": f"hf:{bert}"},
            "methods": {"local": {}},
        }
    )
    prepared = prepare_run(cfg)
    assert prepared.setup.input_shape == (12,) and prepared.setup.num_classes == 2
    assert prepared.cfg.data.standardize in (None, False)  # token ids are never standardised


def test_a_local_model_key_covers_the_text_column_the_tokenizer_files_and_max_length(bert, tmp_path) -> None:
    import shutil

    from rayfuse.store import local_model_key

    f = Files(tmp_path)
    path = tmp_path / jsonl(f, "all.jsonl", [{**r, "body": r["q"] + " today"} for r in texts(30)])
    copied = shutil.copytree(bert, tmp_path / "copy")

    def key(**data: Any) -> str:
        job = {
            "data": {"dataset": "text", "path": str(path), "text": "q", "label": "cat", **data},
            "partition": {"method": "iid", "num_clients": 2},
            "model": {"name": f"hf:{bert}"},
            "methods": {"local": {}},
        }
        prepared = prepare_run(validate_config(job))
        return local_model_key(prepared.resolved(), prepared.plan.for_client(0))[0]

    base = key()
    assert key(tokenizer=str(copied)) == base  # a copy of the same tokenizer files: the same key
    assert len({base, key(text="body"), key(max_length=12)}) == 3
    (copied / "tokenizer_config.json").write_text((copied / "tokenizer_config.json").read_text() + " ")
    assert key(tokenizer=str(copied)) != base  # changed in place: another key


def linear() -> torch.nn.Module:
    return torch.nn.Linear(16, 2)


def test_a_model_given_from_python_must_be_a_hugging_face_one(bert, tmp_path) -> None:
    import rayfuse
    from rayfuse.models.hf import hf_model

    f = Files(tmp_path)
    silos = [{**s, "path": str(tmp_path / s["path"])} for s in two_silos(f)]
    job = {"data": {"silos": silos}, "methods": {"local": {}}, "train": {"epochs": 1}, "federation": {"backend": "local"}}
    for model, line in (
        (
            linear,
            "model.name: expected a Hugging Face classifier for text data (hf:<folder>, or rayfuse.models.hf.hf_model(folder) "
            f"from Python), got '{__name__}.linear'",
        ),
        (
            None,
            "model.name: expected a Hugging Face classifier for text data (hf:<folder>, or rayfuse.models.hf.hf_model(folder) from Python), got 'mlp'",
        ),
    ):
        with pytest.raises(InputError) as info:
            rayfuse.run(job, model=model, run_dir=tmp_path / "refused", quiet=True)
        assert str(info.value) == line
    assert not (tmp_path / "refused").exists()
    run = rayfuse.run(job, model=hf_model(bert), run_dir=tmp_path / "r", quiet=True)  # its folder's tokenizer, by default
    assert run.results["status"] == "succeeded" and f"tokenizer: {bert}" in (tmp_path / "r" / "config.yaml").read_text()
