"""MkDocs hook (``mkdocs.yml``: ``hooks``): links from the docs to repository files outside ``docs/``.

The pages are written to be read on a forge as well as on the site, so they link repository files by relative path
(``[benchmarks/README.md](../benchmarks/README.md)``, ``[robust.py](../rayfuse/updates/robust.py)``). The site holds
only ``docs/``, so such a link would be a dead link there and ``mkdocs build --strict`` would fail on it. This hook
turns a link whose target is a file or folder of the repository outside ``docs/`` into a code span naming the path;
a link to a path that does not exist is left alone, so ``--strict`` still fails on it. A link to a folder of
``docs/results/`` (which have no index page) goes to that folder's list on the results page.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")
# an inline code span (left as it is) or a link, whichever comes first
CODE_OR_LINK = re.compile(r"(?P<code>(?P<ticks>`+)(?!`).+?(?<!`)(?P=ticks)(?!`))|" + LINK.pattern)
FENCE = re.compile(r"^(```|~~~)", re.M)


def _slug(text: str) -> str:
    """Python-Markdown's default heading id (``toc``'s slugify): word characters, spaces as ``-``, lower case."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _rewrite(match: re.Match[str], page_dir: Path, docs: Path, repo: Path) -> str:
    text, target = match.group("text"), match.group("target")
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return match.group(0)  # a URL, an anchor on this page, a site-absolute path: mkdocs judges those
    path_part = target.split("#", 1)[0]
    resolved = Path(posixpath.normpath((page_dir / path_part).as_posix()))
    if resolved.is_relative_to(docs):
        if resolved.is_dir() and not (resolved / "index.md").exists() and not (resolved / "README.md").exists():
            results = docs / "results"
            if resolved.is_relative_to(results) and resolved != results:
                page = posixpath.relpath((results / "index.md").as_posix(), page_dir.as_posix())
                return f"[{text}]({page}#{_slug(resolved.relative_to(docs).as_posix())})"
        elif resolved.is_dir():
            index = "index.md" if (resolved / "index.md").exists() else "README.md"
            return f"[{text}]({path_part.rstrip('/')}/{index})"
        return match.group(0)
    if not resolved.is_relative_to(repo) or not resolved.exists():
        return match.group(0)  # not a repository file: left for --strict to report
    name = resolved.relative_to(repo).as_posix() + ("/" if resolved.is_dir() else "")
    plain = text.strip("`")
    if name.rstrip("/") in plain:
        return f"`{plain}`"  # the text names the path already
    return f"{text} (`{name}`)"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **_: Any) -> str:
    """Rewrite the page's links outside fenced code blocks (see the module docstring)."""
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    page_dir = (docs / page.file.src_uri).parent
    parts = FENCE.split(markdown)
    # FENCE.split keeps each fence marker: text, marker, code, marker, text... A part after an odd number of
    # markers is inside a fence.
    out, inside = [], False
    for part in parts:
        if part in ("```", "~~~"):
            inside = not inside
            out.append(part)
        elif inside:
            out.append(part)
        else:
            out.append(CODE_OR_LINK.sub(lambda m: m.group(0) if m.group("code") else _rewrite(m, page_dir, docs, repo), part))
    return "".join(out)
