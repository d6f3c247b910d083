"""Text as a data kind: files holding one text a row (``.jsonl``, ``.csv``, ``.parquet``; ``.txt``: one text a line,
without labels), tokenised where the file is, with a Hugging Face folder's own tokenizer.

A text becomes a row of token ids the way every rayfuse dataset stores its inputs: float32, ``(N, max_length)``, exact
for ids below 2^24. A padded position holds :data:`PAD` (-1): the row carries its attention mask in its sign
(``row >= 0``), so partitions, silos, the object store and every method see the same ``(N, L)`` arrays as for the
``tokens`` dataset, and a Hugging Face model (:mod:`rayfuse.models.hf`) attends only to the text's own tokens.

Refused in one line each, before anything trains: a file that is not UTF-8, an empty file, a column the file lacks, a
row whose text is missing or empty (after stripping white space), a label that is missing, a folder without tokenizer
files, a ``max_length`` the model's positions do not cover.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayfuse.data.datasets import Dataset, _existing_file, _labels_to_int, csv_dialect, register_dataset
from rayfuse.errors import InputError

__all__ = [
    "PAD",
    "TEXT_DTYPE",
    "TEXT_FORMATS",
    "TOKENIZER_FILES",
    "TextEncoding",
    "attention_mask",
    "build_word_tokenizer",
    "encode_texts",
    "has_tokenizer",
    "model_positions",
    "read_text_dataset",
    "read_text_inputs",
    "read_texts",
    "tokenizer_fingerprint",
    "text_format",
    "text_tokenizer",
]

#: A padded position of a token-id row: the attention mask is ``row >= 0``.
PAD = -1.0
#: File formats a text column is read from (``txt``: one text a line, no labels).
TEXT_FORMATS = ("jsonl", "csv", "parquet", "txt")
#: Files of which at least one makes a folder's tokenizer (a fast tokenizer's json, a vocabulary, a sentencepiece model).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
#: Token ids are stored in float32 inputs, exact for integers up to 2^24.
_MAX_ID = 2**24
#: The stored dtype of a text source's inputs (what the silo survey compares: rayfuse.data.silos.dtype_kind).
TEXT_DTYPE = "int64 token ids"
#: The default ``data.max_length`` where the model's positions allow it.
DEFAULT_MAX_LENGTH = 128


def text_format(path: str | Path, kind: str | None = None, *, key: str = "data.path") -> str:
    """The text format of ``path``: ``kind`` when given, else its suffix; one line for any other."""
    found = kind or Path(path).suffix.lstrip(".").lower()
    if found not in TEXT_FORMATS:
        raise InputError(key, f"a text file ({', '.join('.' + k for k in TEXT_FORMATS)})", str(path))
    return found


def _utf8(file: Path, key: str) -> str:
    """The file's text (a UTF-8 byte-order mark skipped); one line naming the first byte that is not UTF-8."""
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(
            key, "a UTF-8 text file", f"byte 0x{raw[exc.start]:02x} at line {line} of {file.name}", "save it as UTF-8"
        ) from None
    if not text.strip():
        raise InputError(key, "a text file with at least one row", f"an empty file {file.name}")
    return text


def _jsonl_rows(text: str, file: Path, key: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(key, "one JSON object a line (.jsonl)", f"line {number} of {file.name}: {exc.msg}") from None
        if not isinstance(row, dict):
            raise InputError(key, "one JSON object a line (.jsonl)", f"a {type(row).__name__} at line {number} of {file.name}")
        rows.append(row)
    return rows


def _table_columns(file: Path, kind: str, key: str) -> tuple[list[str], dict[str, list[Any]]]:
    """A csv or parquet file's column names and values (Python lists)."""
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(file)
        else:
            import pyarrow.csv as pacsv

            dialect = csv_dialect(file)
            # every column as text: a label column of numbers is read as its numbers below
            table = pacsv.read_csv(file, read_options=dialect.read_options(), parse_options=pacsv.ParseOptions(delimiter=dialect.delimiter))
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0][:100] if str(exc).strip() else type(exc).__name__
        raise InputError(key, f"a readable {kind} file", first) from None
    return list(table.column_names), {name: table.column(name).to_pylist() for name in table.column_names}


def read_texts(
    path: str | Path, *, text: str | None, label: str | None = None, kind: str | None = None, key: str = "data.path"
) -> tuple[list[str], list[Any] | None]:
    """The texts of column ``text`` of the file at ``path`` (``txt``: its lines; ``text`` not used) and, when
    ``label`` is named, its labels (as stored: numbers or text). One line, at ``key`` or the column's key
    (``data.text``, ``data.label``), for a file that is missing, not UTF-8 or empty, a column it lacks, and a row whose
    text or label is missing or whose text is empty."""
    file = Path(path)
    kind = text_format(file, kind, key=key)
    if not file.is_file():
        raise InputError(key, f"an existing .{kind} file", str(path))
    if kind == "txt":
        if label is not None:
            raise InputError(
                "data.label",
                "no label for a .txt file (one unlabeled text a line)",
                label,
                "use .jsonl, .csv or .parquet for labeled texts",
            )
        lines = _utf8(file, key).splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                raise InputError(key, "one non-empty text a line (.txt)", f"an empty line {number} in {file.name}")
        return lines, None
    if not text:
        raise InputError("data.text", f"the name of the text column of {file.name}", text)
    if kind == "jsonl":
        rows = _jsonl_rows(_utf8(file, key), file, key)
        columns = sorted({name for row in rows for name in row})
        values = {name: [row.get(name) for row in rows] for name in columns}
    else:
        if kind == "csv":
            _utf8(file, key)
        columns, values = _table_columns(file, kind, key)
        if not values or not next(iter(values.values()), []):
            raise InputError(key, f"a {kind} file with at least one row", f"no rows in {file.name}")
    for name, field in ((text, "data.text"), (label, "data.label")):
        if name is not None and name not in values:
            raise InputError(field, f"a column of {file.name} ({', '.join(columns)})", name)
    texts = values[text]
    for i, value in enumerate(texts):
        if not isinstance(value, str):
            raise InputError("data.text", f"a text in every row of column {text!r}", f"{value!r} at row {i} of {file.name}")
        if not value.strip():
            raise InputError("data.text", f"a non-empty text in every row of column {text!r}", f"an empty text at row {i} of {file.name}")
    if label is None:
        return [str(t) for t in texts], None
    labels = values[label]
    for i, value in enumerate(labels):
        if value is None or isinstance(value, (dict, list)) or (isinstance(value, float) and not np.isfinite(value)):
            raise InputError("data.label", f"a label in every row of column {label!r}", f"{value!r} at row {i} of {file.name}")
    return [str(t) for t in texts], list(labels)


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a tokenizer's files (:data:`TOKENIZER_FILES`)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def text_tokenizer(folder: str | Path, *, key: str = "data.tokenizer") -> Any:
    """The tokenizer of a Hugging Face folder, read with ``AutoTokenizer.from_pretrained(folder, local_files_only=True)``
    (nothing downloaded); one line for a folder without tokenizer files or one transformers cannot read. A tokenizer
    without a padding token pads with its end-of-text token (as GPT-2's users do): padded positions are masked anyway."""
    from rayfuse.models.hf import check_hf_folder, quiet_transformers

    path = Path(folder)
    if not path.is_dir():
        raise InputError(key, "an existing Hugging Face folder with a tokenizer", str(folder))
    if not has_tokenizer(path):
        raise InputError(key, f"a folder with a tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...)", f"none in {path}")
    check_hf_folder(path, where=key)
    import transformers

    try:
        with quiet_transformers():
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers' many errors for an unreadable tokenizer: one line
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        raise InputError(
            key, f"a tokenizer transformers {transformers.__version__} reads in {path}", f"{type(exc).__name__}: {first}"
        ) from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise InputError(key, "a tokenizer with a padding or end-of-text token", f"neither in {path}")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_texts(tokenizer: Any, texts: Sequence[str], max_length: int, *, key: str = "data.max_length") -> np.ndarray:
    """``texts`` as token-id rows ``(N, max_length)`` (float32): truncated to ``max_length``, padded with :data:`PAD`
    where the tokenizer's attention mask is 0."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise InputError(key, "an integer >= 2", max_length)
    if not texts:
        return np.zeros((0, max_length), dtype=np.float32)
    encoded = tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_length, return_attention_mask=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    mask = np.asarray(encoded["attention_mask"], dtype=bool)
    if ids.shape != (len(texts), max_length):
        raise InputError(key, f"rows of {max_length} tokens", f"the tokenizer's rows of shape {ids.shape}")
    if ids.size and int(ids.max()) >= _MAX_ID:
        raise InputError(key, "token ids below 2^24 (stored exactly in float32)", int(ids.max()))
    return np.where(mask, ids, PAD).astype(np.float32)


def attention_mask(X: np.ndarray) -> np.ndarray:
    """The attention mask of token-id rows: 1 at a text's tokens, 0 at padding (:data:`PAD`)."""
    return (np.asarray(X) >= 0).astype(np.int64)


def build_word_tokenizer(texts: Sequence[str], folder: str | Path, *, vocab_size: int = 2000, min_frequency: int = 1) -> Any:
    """A small word-level tokenizer learnt from ``texts`` and saved in ``folder`` (``tokenizer.json`` and its config,
    read back by :func:`text_tokenizer`): lower-cased words and punctuation marks, the ``vocab_size - 5`` most frequent
    (ties in alphabetical order, so the same texts give the same ids) among those found at least ``min_frequency``
    times, after five special tokens: padding (id 0), unknown, class (prepended), separator (appended) and mask, written
    as BERT writes them. With ``min_frequency`` 2 a word seen once is unknown, so that the unknown token is trained on
    the rare words of the training texts, as a model meets new words later (with 1 it never occurs in training). For
    corpora and tests built offline; a user's model folder brings its own."""
    from collections import Counter

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # BERT's special tokens, by role: padding (id 0), unknown, class, separator, mask
    token = {role: "[" + role.upper() + "]" for role in ("pad", "unk", "cls", "sep", "mask")}
    specials = list(token.values())
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(specials):
        raise InputError("vocab_size", f"an integer > {len(specials)}", vocab_size)
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise InputError("min_frequency", "an integer >= 1", min_frequency)
    normalizer = normalizers.BertNormalizer(lowercase=True)
    splitter = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
    kept = (w for w in counts if counts[w] >= min_frequency)
    words = sorted(kept, key=lambda w: (-counts[w], w))[: vocab_size - len(specials)]
    vocab = {word: i for i, word in enumerate([*specials, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=token["unk"]))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = splitter
    cls, sep = token["cls"], token["sep"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{f"{role}_token": value for role, value in token.items()})
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return fast


# ---------------------------------------------------------------------------------------------------------------
# Text sources of a run: a file read and tokenised where it is (a client's silo, the server's public sample, the
# single file a simulation partitions)


@dataclass(frozen=True)
class TextEncoding:
    """How a run turns texts into token-id rows: the tokenizer's folder (``data.tokenizer``, absolute) and
    ``data.max_length``; every process that reads a text source holds it (the silo plans, the data section)."""

    tokenizer: str
    max_length: int


def model_positions(folder: str | Path) -> int | None:
    """The ``max_position_embeddings`` of a Hugging Face folder's ``config.json`` (read as JSON: nothing built);
    ``None`` where the folder, its config or the field is missing (the model's own checks name those)."""
    try:
        value = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def tokenizer_fingerprint(folder: str | Path) -> str:
    """A SHA-256 of a tokenizer folder's own files (its vocabulary, ``tokenizer.json``, its configs): two nodes whose
    folders at the same path hold different tokenizers tokenise differently, and the silo survey refuses them."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted({*TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json", "merges.txt", "added_tokens.json"}):
        file = Path(folder) / name
        if file.is_file():
            digest.update(f"{name}|".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _encoded(texts: Sequence[str], encoding: TextEncoding) -> tuple[np.ndarray, dict[str, Any]]:
    """``texts`` as token-id rows with the run's tokenizer, and the facts the silo survey compares (``meta["text"]``)."""
    tokenizer = text_tokenizer(encoding.tokenizer)
    X = encode_texts(tokenizer, texts, encoding.max_length)
    return X, {"text": {"tokenizer": tokenizer_fingerprint(encoding.tokenizer), "max_length": int(encoding.max_length)}}


def read_text_dataset(
    path: str | Path,
    *,
    text: str | None,
    label: str,
    encoding: TextEncoding,
    kind: str | None = None,
    key: str = "data.path",
    min_labels: int = 2,
    name: str | None = None,
) -> Dataset:
    """A labelled text file (``.jsonl``, ``.csv``, ``.parquet``) as a :class:`rayfuse.data.datasets.Dataset`: its texts
    tokenised (:func:`encode_texts`), its labels numbered as a table's are (0-based integers kept, anything else in
    sorted order, the values as class names); stored dtype :data:`TEXT_DTYPE`, ``meta["text"]`` the tokenizer's
    fingerprint and ``max_length``. A ``.txt`` file holds no labels (one line at ``data.label``)."""
    texts, labels = read_texts(path, text=text, label=label, kind=kind, key=key)
    assert labels is not None  # read_texts: a label column named, or one line
    kinds = {type(v) for v in labels}
    # one kind of label as numpy stores it (text, or numbers); mixed kinds stay objects, which check_labels refuses
    values = np.asarray(labels, dtype=object) if len(kinds) > 1 and str in kinds else np.asarray(labels)
    y, classes = _labels_to_int(values, "data.label", min_labels)
    X, meta = _encoded(texts, encoding)
    return Dataset(name or Path(path).stem, X, y, len(classes), classes, meta=meta, stored_dtype=TEXT_DTYPE)


def read_text_inputs(
    path: str | Path, *, text: str | None, encoding: TextEncoding, kind: str | None = None, key: str = "data.path"
) -> tuple[np.ndarray, str]:
    """The texts of an unlabeled file (``.txt``: its lines; ``.jsonl`` / ``.csv`` / ``.parquet``: column ``text``) as
    token-id rows, with the stored dtype (:data:`TEXT_DTYPE`)."""
    texts, _ = read_texts(path, text=text, kind=kind, key=key)
    return _encoded(texts, encoding)[0], TEXT_DTYPE


@register_dataset(
    "text",
    description="a .jsonl, .csv or .parquet file at data.path: texts in column data.text (tokenised with data.tokenizer "
    "to data.max_length tokens), labels in data.label",
    source="user file",
)
def _load_text_dataset(
    *,
    path: str | None = None,
    label: str = "y",
    text: str | None = None,
    tokenizer: str | None = None,
    max_length: int | None = None,
    **_: Any,
) -> Dataset:
    if tokenizer is None or max_length is None:  # the config resolves both (ExperimentConfig: data.tokenizer, data.max_length)
        raise InputError("data.tokenizer", "a tokenizer folder and data.max_length for dataset 'text'", tokenizer)
    return read_text_dataset(
        _existing_file(path, Path(str(path)).suffix), text=text, label=label, encoding=TextEncoding(tokenizer, max_length)
    )
