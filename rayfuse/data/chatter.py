"""``chatter``: the English chatterbot corpus (PyPI ``chatterbot-corpus``, BSD, installed data, nothing downloaded) as a
labeled text task: each conversation line (a question or an answer) is a text, the topic of its file the label.

The corpus has 21 English files (``chatterbot_corpus/data/english/*.yml``), about 4400 lines, but most repeat:
``tech_support``'s 2100 lines hold 20 distinct texts. After deduplication (a text is kept once; one found in two
topics is dropped, its label being ambiguous) the files hold 8 to 537 texts: too few for a class each. Six classes of
related files, of 119 to 879 texts, keep every file (:data:`CLASSES`, 1898 texts):

* ``ai``: ``ai``, ``botprofile`` (questions about the bot itself),
* ``computing``: ``coding``, ``computers``, ``tech_support``,
* ``emotion``: ``emotion``,
* ``knowledge``: ``trivia`` and the small topic files (science, history, literature, sports, movies, politics, money,
  food, health: quiz-like questions and facts),
* ``psychology``: ``psychology`` (banter about the speaker),
* ``smalltalk``: ``conversations``, ``greetings``, ``gossip``, ``humor``.

Class ids are the names' alphabetical order (what rayfuse's readers give text labels), texts in sorted order.

``python -m rayfuse.data.chatter prepare <folder> --sites 4 --seed 0`` writes a federated text task from it
(:func:`prepare`; at most 300 texts a class by default, so that ``knowledge``, 46 % of the corpus, does not
dominate the accuracy): label-skewed sites, a held-out test set, an unlabeled public sample and a small base model with a
tokenizer learnt from the training texts only.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.data.datasets import Dataset, register_dataset
from rayfuse.errors import InputError

__all__ = ["CLASSES", "chatter_lines", "chatter_texts", "label_groups", "prepare", "split_chatter"]

#: The task's classes: a name and the corpus files (their stems) it holds.
CLASSES: dict[str, tuple[str, ...]] = {
    "ai": ("ai", "botprofile"),
    "computing": ("coding", "computers", "tech_support"),
    "emotion": ("emotion",),
    "knowledge": ("trivia", "science", "history", "literature", "sports", "movies", "politics", "money", "food", "health"),
    "psychology": ("psychology",),
    "smalltalk": ("conversations", "greetings", "gossip", "humor"),
}


def _english() -> Path:
    try:
        import chatterbot_corpus
    except ImportError:
        raise InputError("chatter", "the chatterbot-corpus package installed", "none", "pip install chatterbot-corpus") from None
    return Path(chatterbot_corpus.__file__).parent / "data" / "english"


def chatter_lines() -> list[tuple[str, str]]:
    """Every conversation line of the English corpus as ``(text, file stem)``, stripped, in file then line order."""
    return list(_lines())


@functools.cache
def _lines() -> tuple[tuple[str, str], ...]:
    import yaml

    lines: list[tuple[str, str]] = []
    for file in sorted(_english().glob("*.yml")):
        content = yaml.safe_load(file.read_text(encoding="utf-8"))
        for conversation in content.get("conversations") or []:
            for line in conversation:
                text = " ".join(str(line).split())  # one line a text: newlines inside a YAML string folded
                if text:
                    lines.append((text, file.stem))
    return tuple(lines)


def chatter_texts(
    classes: Mapping[str, Sequence[str]] | None = None,
    *,
    max_per_class: int | None = None,
    key: str = "--max-per-class",
    surplus: bool = False,
) -> tuple[list[str], np.ndarray, tuple[str, ...]]:
    """``(texts, labels, class_names)``: the distinct lines of the files ``classes`` names (default :data:`CLASSES`),
    a text found in two classes dropped, sorted by text; ``labels`` (int64) index ``class_names`` (alphabetical).
    ``max_per_class`` keeps at most that many texts a class (the first by SHA-256 of the text: the same for every
    seed), so that no class dominates the accuracy (``knowledge`` alone is 46 % of the corpus). ``surplus``: the texts
    the cap leaves out instead (sorted, no labels: ``labels`` is empty), disjoint from the kept ones."""
    import hashlib

    classes = CLASSES if classes is None else classes
    if max_per_class is not None and (isinstance(max_per_class, bool) or not isinstance(max_per_class, int) or max_per_class < 10):
        raise InputError(key, "an integer >= 10", max_per_class)
    names = tuple(sorted(classes))
    of_file: dict[str, str] = {}
    for name in names:
        for stem in classes[name]:
            if stem in of_file:
                raise InputError(f"classes.{name}", "each corpus file in one class", f"{stem} also in {of_file[stem]}")
            of_file[stem] = name
    stems = {stem for _, stem in chatter_lines()}
    for stem, name in of_file.items():
        if stem not in stems:
            raise InputError(f"classes.{name}", f"corpus files among {', '.join(sorted(stems))}", stem)
    found: dict[str, set[str]] = {}
    for text, stem in chatter_lines():
        if stem in of_file:
            found.setdefault(text, set()).add(of_file[stem])
    texts = sorted(t for t, c in found.items() if len(c) == 1)
    if max_per_class is not None:
        by_class: dict[str, list[str]] = {}
        for text in sorted(texts, key=lambda t: hashlib.sha256(t.encode("utf-8")).hexdigest()):
            by_class.setdefault(next(iter(found[text])), []).append(text)
        texts = sorted(t for kept in by_class.values() for t in kept[:max_per_class])
        if surplus:
            return sorted(t for kept in by_class.values() for t in kept[max_per_class:]), np.zeros(0, np.int64), names
    elif surplus:
        return [], np.zeros(0, np.int64), names
    labels = np.array([names.index(next(iter(found[t]))) for t in texts], dtype=np.int64)
    return texts, labels, names


@register_dataset(
    "chatter",
    source="bundled",
    description="the English chatterbot corpus (chatterbot-corpus), 6 topic classes of conversation lines as token-id "
    "rows; data.options: tokenizer (a folder, required), max_length, max_per_class",
)
def _load_chatter(*, tokenizer: str | None = None, max_length: int = 32, max_per_class: int | None = 300, **_: Any) -> Dataset:
    """The corpus (:func:`chatter_texts`) tokenised with the tokenizer of the folder ``tokenizer`` (a model folder's,
    e.g. ``prepare``'s ``base/``), ``-1``-padded rows of ``max_length`` ids (:mod:`rayfuse.data.text`)."""
    from rayfuse.data.text import encode_texts, text_tokenizer

    if not isinstance(tokenizer, str) or not tokenizer.strip():
        raise InputError(
            "data.options.tokenizer",
            "the folder of the tokenizer that turns the texts into the model's token ids",
            tokenizer,
            "e.g. the model's own folder, or base/ of python -m rayfuse.data.chatter prepare",
        )
    encoder = text_tokenizer(tokenizer, key="data.options.tokenizer")
    texts, labels, names = chatter_texts(max_per_class=max_per_class, key="data.options.max_per_class")
    X = encode_texts(encoder, texts, max_length, key="data.options.max_length")
    return Dataset("chatter", X, labels, len(names), names)


def label_groups(n_classes: int, sites: int, per_site: int | None = None) -> list[list[int]]:
    """Each site's classes: windows of ``per_site`` consecutive classes (wrapping; default ``ceil(n_classes / sites)
    + 1``, so that most classes are held by two sites), starting at ``floor(k n_classes / sites)``: every class is
    held by at least one site (6 classes, 4 sites: ``[0, 1, 2], [1, 2, 3], [3, 4, 5], [4, 5, 0]``; ``per_site`` 2:
    ``[0, 1], [1, 2], [3, 4], [4, 5]``)."""
    if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
        raise InputError("--sites", "an integer >= 1", sites)
    least = math.ceil(n_classes / sites)
    if per_site is None:
        per_site = min(n_classes, least + 1)
    if isinstance(per_site, bool) or not isinstance(per_site, int) or not least <= per_site <= n_classes:
        raise InputError("--classes-per-site", f"an integer in {least}..{n_classes} (every class at a site)", per_site)
    size = per_site
    return [sorted({(k * n_classes // sites + j) % n_classes for j in range(size)}) for k in range(sites)]


def split_chatter(
    *,
    sites: int = 4,
    seed: int = 0,
    test: float = 0.2,
    public: float = 0.15,
    pretrain: float = 0.1,
    max_per_class: int | None = None,
    classes_per_site: int | None = None,
) -> dict[str, Any]:
    """The task's parts, deterministic for ``seed``: stratified ``test``, ``public`` (its labels kept here, not
    written) and ``pretrain`` fractions of the corpus, and the rest split among ``sites`` by :func:`label_groups`
    (``rayfuse.data.partition``'s ``labels`` partitioner: a class two sites hold is split evenly between them).
    Each part is ``(texts, labels)``; ``sites`` is a list of them; ``classes`` the class names; ``groups`` the sites'
    classes."""
    from sklearn.model_selection import train_test_split

    from rayfuse.data.partition import partition

    for key, value in (("--test", test), ("--public", public), ("--pretrain", pretrain)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise InputError(key, "a fraction in (0, 1)", value)
    if test + public + pretrain >= 0.9:
        raise InputError("--test", "test + public + pretrain below 0.9 (the rest is the sites')", round(test + public + pretrain, 6))
    texts, labels, names = chatter_texts(max_per_class=max_per_class)
    groups = label_groups(len(names), sites, classes_per_site)
    index = np.arange(len(texts))
    rest, test_idx = train_test_split(index, test_size=test, stratify=labels, random_state=seed)
    rest, public_idx = train_test_split(rest, test_size=public / (1 - test), stratify=labels[rest], random_state=seed)
    pool, pre_idx = train_test_split(rest, test_size=pretrain / (1 - test - public), stratify=labels[rest], random_state=seed)

    def part(idx: np.ndarray) -> tuple[list[str], np.ndarray]:
        idx = np.sort(idx)
        return [texts[i] for i in idx], labels[idx]

    pool = np.sort(pool)
    parts = partition(labels[pool], sites, "labels", seed=seed, groups=groups)
    return {
        "classes": names,
        "groups": groups,
        "test": part(test_idx),
        "public": part(public_idx),
        "pretrain": part(pre_idx),
        "sites": [part(pool[p]) for p in parts],
    }


def _write_jsonl(path: Path, texts: Sequence[str], labels: np.ndarray, names: Sequence[str]) -> None:
    rows = (json.dumps({"text": t, "label": names[int(y)]}, ensure_ascii=False) for t, y in zip(texts, labels))
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")


def prepare(
    out: str | Path,
    *,
    sites: int = 4,
    seed: int = 0,
    test: float = 0.2,
    public: float = 0.15,
    pretrain: float = 0.1,
    max_per_class: int | None = 300,
    classes_per_site: int | None = None,
    public_surplus: bool = False,
    vocab_size: int = 2000,
    min_frequency: int = 1,
    max_length: int = 32,
    hidden: int = 64,
    layers: int = 2,
    pretrain_epochs: int = 30,
    lr: float = 1e-3,
) -> dict[str, Any]:
    """Write the federated chatter task to ``out`` (a new or empty folder), deterministic for ``seed``:

    * ``site{k}.jsonl`` (``text``, ``label``: the class name), label-skewed (:func:`split_chatter`; at most
      ``max_per_class`` texts a class, :func:`chatter_texts`),
    * ``test.jsonl``, the held-out test set, and ``pretrain.jsonl``, the base's training slice,
    * ``public.txt``: an unlabeled sample, one text a line (distillation's transfer set); ``public_surplus``: with the
      texts beyond ``max_per_class`` after it (:func:`chatter_texts`' ``surplus``: in no other part, the test set's
      included; the cap balances the labeled task, unlabeled text need not be balanced),
    * ``base/``: a ``BertForSequenceClassification`` (``hidden`` wide, ``layers`` layers, 64 positions, one logit a
      class, ``id2label`` the class names) with a word-level tokenizer (:func:`rayfuse.data.text.build_word_tokenizer`)
      learnt from the training texts only (the sites' and the pretraining slice), trained for ``pretrain_epochs``
      (Adam, ``lr``) on the pretraining slice (``pretrain_epochs: 0``: random weights), so that it is a weak
      "pretrained" model that knows every class a little,
    * ``task.json``: the classes, each site's classes and sizes, the settings, and the base's test accuracy.

    Returns ``task.json``'s content."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from rayfuse.data.text import build_word_tokenizer, encode_texts
    from rayfuse.models import train_model

    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise InputError("out", "a new or empty folder", str(folder), "choose another folder or remove it")
    for key, value, low in (("--max-length", max_length, 2), ("--pretrain-epochs", pretrain_epochs, 0), ("--layers", layers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(key, f"an integer >= {low}", value)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 5:
        raise InputError("--vocab-size", "an integer > 5 (the 5 special tokens)", vocab_size)
    if max_length > 64:
        raise InputError("--max-length", "at most 64 (the base's positions)", max_length)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 4 or hidden % 4:
        raise InputError("--hidden", "a multiple of 4 (4 attention heads), >= 4", hidden)
    parts = split_chatter(
        sites=sites, seed=seed, test=test, public=public, pretrain=pretrain, max_per_class=max_per_class, classes_per_site=classes_per_site
    )
    names = parts["classes"]
    training = [t for texts, _ in parts["sites"] for t in texts] + parts["pretrain"][0]
    folder.mkdir(parents=True, exist_ok=True)
    for k, (texts, labels) in enumerate(parts["sites"]):
        _write_jsonl(folder / f"site{k}.jsonl", texts, labels, names)
    for name in ("test", "pretrain"):
        texts, labels = parts[name]
        _write_jsonl(folder / f"{name}.jsonl", texts, labels, names)
    public_texts = list(parts["public"][0])
    if public_surplus:
        public_texts += chatter_texts(max_per_class=max_per_class, surplus=True)[0]
    (folder / "public.txt").write_text("".join(t + "\n" for t in public_texts), encoding="utf-8")

    base = folder / "base"
    tokenizer = build_word_tokenizer(training, base, vocab_size=vocab_size, min_frequency=min_frequency)
    config = BertConfig(  # type: ignore[call-arg]  # num_labels, id2label...: PretrainedConfig's keyword arguments
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        type_vocab_size=1,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
        pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.0,  # deterministic training and merging (dropout only adds noise at this size)
        attention_probs_dropout_prob=0.0,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    accuracy = None
    if pretrain_epochs:
        from rayfuse.models.hf import hf_model

        # trained through the token-id forward rayfuse's clients use (padding -1, masked), then saved as the plain class
        net = hf_model(_save(model, base))((max_length,), len(names))
        net.load_state_dict(model.state_dict())
        X_pre = encode_texts(tokenizer, parts["pretrain"][0], max_length)
        train_model(net, X_pre, parts["pretrain"][1], epochs=pretrain_epochs, batch_size=32, lr=lr, optimizer="adam", seed=seed)
        model.load_state_dict(net.state_dict())
        X_test = encode_texts(tokenizer, parts["test"][0], max_length)
        net.eval()
        with torch.no_grad():
            accuracy = float((net(torch.as_tensor(X_test)).argmax(1).numpy() == parts["test"][1]).mean())
    _save(model, base)
    task = {
        "corpus": "chatterbot-corpus (english)",
        "classes": list(names),
        "groups": parts["groups"],
        "sizes": {
            **{f"site{k}": len(texts) for k, (texts, _) in enumerate(parts["sites"])},
            **{name: len(parts[name][0]) for name in ("test", "pretrain")},
            "public": len(public_texts),
        },
        "settings": {
            "sites": sites,
            "seed": seed,
            "test": test,
            "public": public,
            "pretrain": pretrain,
            "max_per_class": max_per_class,
            "classes_per_site": classes_per_site,
            "public_surplus": public_surplus,
            "vocab_size": vocab_size,
            "min_frequency": min_frequency,
            "max_length": max_length,
            "hidden": hidden,
            "layers": layers,
            "pretrain_epochs": pretrain_epochs,
            "lr": lr,
        },
        "base_test_accuracy": accuracy,
    }
    (folder / "task.json").write_text(json.dumps(task, indent=1) + "\n", encoding="utf-8")
    return task


def _save(model: Any, folder: Path) -> Path:
    from rayfuse.models.hf import quiet_transformers

    with quiet_transformers():
        model.save_pretrained(str(folder))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayfuse.data.chatter", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write label-skewed sites, test, public texts and a base model folder")
    p.add_argument("out", type=Path)
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test", type=float, default=0.2)
    p.add_argument("--public", type=float, default=0.15)
    p.add_argument("--pretrain", type=float, default=0.1)
    p.add_argument("--max-per-class", type=int, default=300, help="at most this many texts a class (0: all)")
    p.add_argument("--classes-per-site", type=int, default=None, help="classes a site holds (default: ceil(classes / sites) + 1)")
    p.add_argument("--public-surplus", action="store_true", help="the texts beyond --max-per-class added to public.txt (unlabeled)")
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--min-frequency", type=int, default=1, help="a word seen fewer times in the training texts is unknown")
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pretrain-epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    args = vars(parser.parse_args(argv))
    args["max_per_class"] = args["max_per_class"] or None
    args.pop("command")
    out = args.pop("out")
    try:
        task = prepare(out, **args)
    except InputError as exc:
        import sys

        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: task[k] for k in ("classes", "groups", "sizes", "base_test_accuracy")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
