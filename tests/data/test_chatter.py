"""``chatter``: the chatterbot corpus as a labeled text task, and the federated task ``prepare`` writes from it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rayfuse.data.chatter import CLASSES, chatter_lines, chatter_texts, label_groups, main, prepare
from rayfuse.errors import InputError

TINY = {"hidden": 8, "layers": 1, "pretrain_epochs": 1, "vocab_size": 300, "max_length": 16}


def test_the_texts_are_distinct_sorted_and_each_in_one_class():
    texts, labels, names = chatter_texts()
    assert names == tuple(sorted(CLASSES)) and len(texts) == len(set(texts)) == len(labels)
    assert texts == sorted(texts)
    counts = np.bincount(labels, minlength=len(names))
    assert counts.min() >= 100, dict(zip(names, counts))
    # a line found in two classes' files is dropped
    classes_of: dict[str, set[str]] = {}
    of_file = {stem: name for name, stems in CLASSES.items() for stem in stems}
    for text, stem in chatter_lines():
        classes_of.setdefault(text, set()).add(of_file[stem])
    ambiguous = {t for t, c in classes_of.items() if len(c) > 1}
    assert ambiguous and not ambiguous & set(texts)


def test_every_corpus_file_is_in_one_class():
    stems = {stem for _, stem in chatter_lines()}
    listed = [stem for stems_ in CLASSES.values() for stem in stems_]
    assert sorted(listed) == sorted(stems)


@pytest.mark.parametrize(
    ("n_classes", "sites", "groups"),
    [
        (6, 4, [[0, 1, 2], [1, 2, 3], [3, 4, 5], [0, 4, 5]]),
        ((6, 2), 4, [[0, 1], [1, 2], [3, 4], [4, 5]]),
        (6, 2, [[0, 1, 2, 3], [0, 3, 4, 5]]),
        (6, 1, [[0, 1, 2, 3, 4, 5]]),
        (4, 8, [[0, 1], [0, 1], [1, 2], [1, 2], [2, 3], [2, 3], [0, 3], [0, 3]]),
    ],
)
def test_label_groups_cover_every_class(n_classes, sites, groups):
    n_classes, per_site = n_classes if isinstance(n_classes, tuple) else (n_classes, None)
    assert label_groups(n_classes, sites, per_site) == groups
    assert set().union(*map(set, groups)) == set(range(n_classes))


def test_prepare_writes_the_same_task_for_the_same_seed(tmp_path):
    from rayfuse.data.text import read_texts, text_tokenizer

    a = prepare(tmp_path / "a", seed=3, **TINY)
    prepare(tmp_path / "b", seed=3, **TINY)
    names = ["site0.jsonl", "site1.jsonl", "site2.jsonl", "site3.jsonl", "test.jsonl", "pretrain.jsonl", "public.txt"]
    for name in [*names, "base/tokenizer.json", "base/config.json", "base/model.safetensors", "task.json"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    classes = a["classes"]
    for k, group in enumerate(a["groups"]):
        texts, labels = read_texts(tmp_path / "a" / f"site{k}.jsonl", text="text", label="label")
        assert labels is not None and {classes.index(y) for y in labels} == set(group)
        assert len(texts) == a["sizes"][f"site{k}"]
    test, _ = read_texts(tmp_path / "a" / "test.jsonl", text="text", label="label")
    public, _ = read_texts(tmp_path / "a" / "public.txt", text=None)
    sites = {t for k in range(4) for t in read_texts(tmp_path / "a" / f"site{k}.jsonl", text="text")[0]}
    assert not set(test) & sites and not set(public) & sites and not set(test) & set(public)
    config = json.loads((tmp_path / "a" / "base" / "config.json").read_text())
    assert len(config["id2label"]) == len(classes) and config["id2label"]["0"] == classes[0]
    tokenizer = text_tokenizer(tmp_path / "a" / "base")
    vocab = set(tokenizer.get_vocab())
    # the tokenizer is learnt from the training texts only: a word only the test set holds is unknown to it
    from tokenizers.pre_tokenizers import BertPreTokenizer

    def words(texts):
        return {w for t in texts for w, _ in BertPreTokenizer().pre_tokenize_str(t.lower())}

    test_words = words(test)
    train_words = words([*sites, *read_texts(tmp_path / "a" / "pretrain.jsonl", text="text")[0]])
    assert test_words - train_words and not (test_words - train_words) & vocab


def test_a_different_seed_gives_different_sites(tmp_path):
    prepare(tmp_path / "a", seed=0, **{**TINY, "pretrain_epochs": 0})
    prepare(tmp_path / "b", seed=1, **{**TINY, "pretrain_epochs": 0})
    assert (tmp_path / "a" / "site0.jsonl").read_bytes() != (tmp_path / "b" / "site0.jsonl").read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sites", "0"], "--sites: expected an integer >= 1, got 0"),
        (["--test", "1.5"], "--test: expected a fraction in (0, 1), got 1.5"),
        (["--test", "0.5", "--public", "0.3"], "--test: expected test + public + pretrain below 0.9 (the rest is the sites'), got 0.9"),
        (["--max-length", "100"], "--max-length: expected at most 64 (the base's positions), got 100"),
        (["--hidden", "10"], "--hidden: expected a multiple of 4 (4 attention heads), >= 4, got 10"),
        (["--vocab-size", "3"], "--vocab-size: expected an integer > 5 (the 5 special tokens), got 3"),
        (["--max-per-class", "5"], "--max-per-class: expected an integer >= 10, got 5"),
        (["--classes-per-site", "1"], "--classes-per-site: expected an integer in 2..6 (every class at a site), got 1"),
    ],
)
def test_bad_prepare_options_are_one_line_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "task"
    assert main(["prepare", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"
    assert not out.exists()


def test_prepare_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="^out: expected a new or empty folder"):
        prepare(tmp_path, **TINY)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_max_per_class_keeps_the_same_texts_of_each_class():
    texts, labels, names = chatter_texts()
    capped, capped_labels, _ = chatter_texts(max_per_class=150)
    counts = np.bincount(capped_labels, minlength=len(names))
    assert counts.max() == 150 and (counts == np.minimum(np.bincount(labels), 150)).all()
    assert set(capped) < set(texts) and capped == sorted(capped)
    assert chatter_texts(max_per_class=150)[0] == capped


def test_the_surplus_is_the_texts_the_cap_leaves_out_and_public_surplus_appends_it(tmp_path):
    from rayfuse.data.text import read_texts

    texts, _, _ = chatter_texts()
    capped, _, _ = chatter_texts(max_per_class=150)
    surplus, labels, _ = chatter_texts(max_per_class=150, surplus=True)
    assert sorted(capped + surplus) == texts and not set(capped) & set(surplus) and len(labels) == 0
    assert chatter_texts(surplus=True)[0] == []
    info = prepare(tmp_path / "a", seed=0, public_surplus=True, **{**TINY, "pretrain_epochs": 0})
    prepare(tmp_path / "b", seed=0, **{**TINY, "pretrain_epochs": 0})
    public, _ = read_texts(tmp_path / "a" / "public.txt", text=None)
    plain, _ = read_texts(tmp_path / "b" / "public.txt", text=None)
    extra = chatter_texts(max_per_class=300, surplus=True)[0]  # prepare's default cap
    assert public == plain + extra and info["sizes"]["public"] == len(public) and info["settings"]["public_surplus"]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("chatter") / "task"
    prepare(folder, seed=0, **{**TINY, "pretrain_epochs": 0})
    return folder


def test_the_bundled_dataset_is_the_corpus_as_token_rows_of_a_folders_tokenizer(task):
    from rayfuse.data.datasets import load_dataset

    data = load_dataset("chatter", options={"tokenizer": str(task / "base"), "max_length": 16, "max_per_class": 100})
    texts, labels, names = chatter_texts(max_per_class=100)
    assert data.X.shape == (len(texts), 16) and data.X.dtype == np.float32 and data.class_names == names
    assert (data.y == labels).all() and (data.X[:, 0] == 2).all()  # the class token first
    assert ((data.X == -1) | (data.X >= 0)).all() and (data.X == -1).any()


def _job(tmp_path, task, **options):
    import yaml

    path = tmp_path / "job.yaml"
    given = {"tokenizer": str(task / "base"), "max_length": 16, **options}
    data = {"dataset": "chatter", "options": {k: v for k, v in given.items() if v is not None}}  # None: left out
    path.write_text(
        yaml.safe_dump(
            {
                "run": {"storage": str(tmp_path / "runs")},
                "data": data,
                "model": {"name": f"hf:{task / 'base'}"},
                "methods": {"fedavg": {}},
            }
        )
    )
    return str(path)


def test_a_federated_config_on_the_bundled_dataset_validates(tmp_path, task, capsys):
    from rayfuse.cli import main as cli

    assert cli(["validate", _job(tmp_path, task)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tokenizer": None},
            "data.options.tokenizer: expected the folder of the tokenizer that turns the texts into the model's token ids, got None",
        ),
        (
            {"tokenizer": "/nonexistent/folder"},
            "data.options.tokenizer: expected an existing Hugging Face folder with a tokenizer, got '/nonexistent/folder'",
        ),
        ({"max_length": 1}, "data.options.max_length: expected an integer >= 2, got 1"),
        ({"max_per_class": 3}, "data.options.max_per_class: expected an integer >= 10, got 3"),
    ],
)
def test_bad_options_of_the_bundled_dataset_are_one_line_before_anything_starts(tmp_path, task, capsys, options, message):
    from rayfuse.cli import main as cli

    assert cli(["validate", _job(tmp_path, task, **options)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rayfuse: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()
