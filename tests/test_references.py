"""Every citation in the repository resolves inside it: tags in docs/references.md, papers on the method classes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rayfuse.fusion import references
from rayfuse.method import METHODS, Reference

ROOT = Path(__file__).resolve().parents[1]
REFERENCES_MD = ROOT / "docs" / "references.md"
SCANNED = ["rayfuse", "actors", "benchmarks", "tests", "docs", "jobs", "tune_spaces", "README.md"]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".txt", ".toml", ".cfg", ".csv"}

# A citation tag: ``[KLF]``, ``[KLF : src/fusion.py]``, ``[GEMS: utils/dnn3.py]``, ``[FEDREF @ 737c333 : ...]``,
# ``[FEDREF HEAD : main.py]``. Not preceded by a word character, so ``list[BNN]`` and ``TINY[TINY != 1]`` are code.
TAG = re.compile(r"(?<![\w\]])\[([A-Z][A-Z0-9_]+)(?=\s*:|\s+@|\s+HEAD\b|\])")
# Command-line usage placeholders (``rayfuse run [CONFIG]``, ``rayfuse fuse CONFIG [OUT]``), not citations.
PLACEHOLDERS = {"CONFIG", "OUT"}


def list_text_files() -> list[Path]:
    """The repository's text files under the scanned paths."""
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            # hidden folders are virtualenvs of peer tools and caches (benchmarks/.venv-rebasin), not the repository's text
            files += [
                p
                for p in sorted(path.rglob("*"))
                if p.is_file()
                and p.suffix in TEXT_SUFFIXES
                and "__pycache__" not in p.parts
                and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
            ]
    return files


def read_reference_keys() -> set[str]:
    """The keys docs/references.md resolves: one ``### KEY`` section each."""
    return set(re.findall(r"^### ([A-Z][A-Z0-9_]+)\s*$", REFERENCES_MD.read_text(encoding="utf-8"), flags=re.M))


def test_the_tag_pattern_finds_citations_and_skips_code() -> None:
    text = (
        "[KLF : src/fusion.py] [GEMS: utils/dnn3.py] [FEDREF @ 737c333] [FEDREF HEAD : main.py] ``[KLF]`` "
        "list[BNN] TINY[TINY != 1] [A-Za-z0-9_] [None] [C s]"
    )
    assert TAG.findall(text) == ["KLF", "GEMS", "FEDREF", "FEDREF", "KLF"]


def test_every_tag_used_in_the_repository_resolves_in_docs_references() -> None:
    keys = read_reference_keys()
    assert {"KLF", "GEMS", "KAMAL", "SPAHM", "FEDREF", "PFNM"} <= keys
    unresolved = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: [{match.group(1)}]"
        for path in list_text_files()
        for text in [path.read_text(encoding="utf-8", errors="replace")]
        for match in TAG.finditer(text)
        if match.group(1) not in keys | PLACEHOLDERS
    ]
    assert not unresolved, "tags missing from docs/references.md:\n" + "\n".join(unresolved)


def test_every_section_of_docs_references_names_a_repository_commit_or_says_there_is_no_code() -> None:
    sections = re.split(r"^### ", REFERENCES_MD.read_text(encoding="utf-8"), flags=re.M)[1:]
    assert sections
    for section in sections:
        key = section.split("\n", 1)[0].strip()
        assert re.search(r"https?://", section), key
        has_commit = bool(re.search(r"https://github\.com/\S+", section) and re.search(r"`[0-9a-f]{40}`", section))
        says_none = re.search(r"Code: (none|in KamalEngine)", section) is not None
        assert has_commit or says_none, f"{key}: neither a repository with a full commit nor 'Code: none'"


@pytest.mark.parametrize("name", [name for name in METHODS.names() if METHODS.get(name).reference is not None])
def test_every_registered_method_with_a_paper_names_it_with_a_title_and_an_http_url(name: str) -> None:
    reference = METHODS.get(name).reference
    assert isinstance(reference, Reference)
    assert reference.title.strip()
    assert re.match(r"https?://\S+$", reference.url)
    assert reference.key in read_reference_keys()


def test_the_papers_the_methods_implement_carry_their_reference() -> None:
    expected = {
        "kl": "KLF",
        "gems": "GEMS",
        "epgan": "EPGAN",
        "fedref": "FEDREF",
        "fedsa": "FEDSA",
        "fedavg": "FEDAVG",
        "fedprox": "FEDPROX",
        "fedadam": "FEDOPT",
        "fedyogi": "FEDOPT",
        "fedadagrad": "FEDOPT",
        "spahm": "SPAHM",
    }
    assert {name: METHODS.get(name).reference.key for name in expected} == expected
    assert all(METHODS.get(name).reference is None for name in ("local", "average", "ensemble", "global"))


def test_the_reference_constants_match_docs_references() -> None:
    text = REFERENCES_MD.read_text(encoding="utf-8")
    constants = [value for value in vars(references).values() if isinstance(value, Reference)]
    assert len(constants) == len(references.__all__)
    for reference in constants:
        assert reference.key in read_reference_keys()
        assert reference.url in text, f"{reference.key}: {reference.url} is not the URL docs/references.md gives"


def test_nothing_points_at_files_outside_the_repository() -> None:
    forbidden = ("../shared", "ALGORITHMS.md")
    this_file = Path(__file__).resolve()
    hits = [
        f"{path.relative_to(ROOT)}: {word}"
        for path in list_text_files()
        if path.resolve() != this_file
        for word in forbidden
        if word in path.read_text(encoding="utf-8", errors="replace")
    ]
    assert not hits, "\n".join(hits)
