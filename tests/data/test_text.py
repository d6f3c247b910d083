"""Text as token-id rows: read, tokenised with a folder's tokenizer, padded with -1, masked by the model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rayfuse.data.text import PAD, build_word_tokenizer, encode_texts, read_texts, text_tokenizer
from rayfuse.errors import InputError

TEXTS = ["what is ai", "the science of mixing chemicals", "hello there, how are you?", "i like football and tennis"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    from tests.data.test_text_silos import tiny_text_bert

    return tiny_text_bert(tmp_path_factory.mktemp("tiny_text_bert"), positions=24, texts=TEXTS * 3, vocab_size=40)


def test_the_word_tokenizer_is_the_same_for_the_same_texts(tmp_path):
    a = build_word_tokenizer(TEXTS, tmp_path / "a", vocab_size=30)
    b = build_word_tokenizer(list(reversed(TEXTS)), tmp_path / "b", vocab_size=30)
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").is_file()


def test_min_frequency_leaves_rare_words_unknown_and_bad_values_are_refused(tmp_path):
    texts = ["the cat sat", "the dog sat", "a bird"]
    kept = build_word_tokenizer(texts, tmp_path / "two", vocab_size=30, min_frequency=2)
    words = set(kept.get_vocab()) - set(kept.all_special_tokens)
    assert words == {"the", "sat"}  # the only words seen twice
    ids = encode_texts(kept, ["the bird sat"], 6)[0]
    assert ids[2] == kept.unk_token_id and ids[1] == kept.get_vocab()["the"]
    every = build_word_tokenizer(texts, tmp_path / "one", vocab_size=30)  # the default keeps every word
    assert {"cat", "dog", "a", "bird"} <= set(every.get_vocab())
    with pytest.raises(InputError, match="min_frequency: expected an integer >= 1"):
        build_word_tokenizer(texts, tmp_path / "zero", min_frequency=0)


def test_texts_are_padded_with_minus_one_and_the_model_masks_the_padding(folder):
    from rayfuse.models.hf import hf_model

    X = encode_texts(text_tokenizer(folder), ["what is ai", "the science of mixing chemicals"], 10)
    assert X.dtype == np.float32 and X.shape == (2, 10)
    assert X[0, 0] == 2 and (X[0, 5:] == PAD).all() and (X[1, :7] >= 0).all()  # class token, what is ai, separator, then padding
    net = hf_model(folder)((10,), 2).eval()
    from transformers import BertForSequenceClassification

    net.load_state_dict(BertForSequenceClassification.from_pretrained(folder).state_dict())
    with torch.no_grad():
        padded = net(torch.as_tensor(X))
        alone = net(torch.as_tensor(X[:1, :5]))  # the first text without its padding
    torch.testing.assert_close(padded[:1], alone, rtol=1e-5, atol=1e-6)


def test_fisher_of_padded_texts_loops_where_vmap_cannot_trace_the_mask(folder):
    from rayfuse.alignment.merge import diagonal_fisher
    from rayfuse.models.hf import hf_model

    X = encode_texts(text_tokenizer(folder), TEXTS, 12)
    net = hf_model(folder)((12,), 2)
    fisher = diagonal_fisher(net, X, np.array([0, 1, 0, 1]))
    # the per-sample loop gives the mean of the single-sample Fishers
    single = [diagonal_fisher(net, X[i : i + 1], np.array([i % 2])) for i in range(4)]
    for key, value in fisher.items():
        assert np.isfinite(value).all()
        np.testing.assert_allclose(value, np.mean([s[key] for s in single], axis=0), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "content", "text", "label", "message"),
    [
        (
            "a.jsonl",
            b'{"t": "hi", "y": 1}\n{"t": "", "y": 0}\n',
            "t",
            "y",
            "data.text: expected a non-empty text in every row of column 't', got 'an empty text at row 1 of a.jsonl'",
        ),
        ("a.jsonl", b'{"t": "hi", "y": 1}\n', "text", "y", "data.text: expected a column of a.jsonl (t, y), got 'text'"),
        (
            "a.jsonl",
            b'{"t": "hi", "y": 1}\n{"t": "yo"}\n',
            "t",
            "y",
            "data.label: expected a label in every row of column 'y', got 'None at row 1 of a.jsonl'",
        ),
        (
            "a.jsonl",
            b'{"t": "hi"}\n[1]\n',
            "t",
            None,
            "data.path: expected one JSON object a line (.jsonl), got 'a list at line 2 of a.jsonl'",
        ),
        (
            "a.csv",
            b"t,y\nhi,1\n\xff\xfe,0\n",
            "t",
            "y",
            "data.path: expected a UTF-8 text file, got 'byte 0xff at line 3 of a.csv'; save it as UTF-8",
        ),
        ("a.txt", b"", None, None, "data.path: expected a text file with at least one row, got 'an empty file a.txt'"),
        ("a.txt", b"one\n\nthree\n", None, None, "data.path: expected one non-empty text a line (.txt), got 'an empty line 2 in a.txt'"),
        (
            "a.txt",
            b"one\n",
            None,
            "y",
            "data.label: expected no label for a .txt file (one unlabeled text a line), got 'y'; use .jsonl, .csv or .parquet for labeled texts",
        ),
        ("a.tsv", b"t\n", "t", None, "data.path: expected a text file (.jsonl, .csv, .parquet, .txt), got '"),
    ],
)
def test_bad_text_files_are_one_line(tmp_path, name, content, text, label, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError) as err:
        read_texts(tmp_path / name, text=text, label=label)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_texts_and_labels_are_read_from_each_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": t, "label": ["a", "b"][i % 2]} for i, t in enumerate(TEXTS)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    (tmp_path / "d.csv").write_text("text,label\n" + "".join(f'"{r["text"]}",{r["label"]}\n' for r in rows), encoding="utf-8")
    pq.write_table(pa.table({"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]}), tmp_path / "d.parquet")
    for suffix in ("jsonl", "csv", "parquet"):
        assert read_texts(tmp_path / f"d.{suffix}", text="text", label="label") == (TEXTS, ["a", "b", "a", "b"])
    (tmp_path / "d.txt").write_text("\n".join(TEXTS) + "\n\n", encoding="utf-8")
    assert read_texts(tmp_path / "d.txt", text=None) == (TEXTS, None)


def test_a_folder_without_a_tokenizer_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        InputError, match=r"^data.tokenizer: expected a folder with a tokenizer \(tokenizer.json, vocab.txt, ...\), got 'none in"
    ):
        text_tokenizer(tmp_path)


def test_teachers_of_padded_texts_run_in_the_loop_and_match_each_model(folder):
    from rayfuse.fusion.distill.teachers import Teachers
    from rayfuse.models.hf import hf_model

    X = torch.as_tensor(encode_texts(text_tokenizer(folder), TEXTS, 12))
    torch.manual_seed(1)
    models = [hf_model(folder)((12,), 2).eval() for _ in range(2)]
    teachers = Teachers(models, batched=True)
    assert not any(group.batched for group in teachers.groups)
    with torch.no_grad():
        expected = torch.stack([m(X) for m in models])
        out = teachers.groups[0].forward(X, with_bn=False)[0]
    torch.testing.assert_close(out, expected)
