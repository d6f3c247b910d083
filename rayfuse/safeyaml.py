"""Reading YAML that a user wrote: bounded, strict about duplicated keys, one-line errors.

Every YAML document rayfuse reads from a user (an experiment config, a sweep space, a fuse config, a ``--set`` value)
goes through :func:`parse_yaml`. PyYAML's ``safe_load`` builds no Python objects beyond plain data, but it still
expands aliases: a few lines of nested ``*alias`` references ("billion laughs") expand to billions of nodes and
exhaust memory. Here the document is first composed into PyYAML's node graph, where an alias is one shared node, and
the size of its expansion is counted (shared nodes counted once per reference, in linear time) before anything is
built; a document above :data:`MAX_NODES` nodes, a recursive alias or a mapping that repeats a key is refused with an
:class:`~rayfuse.errors.InputError` naming the file and the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rayfuse.errors import InputError

__all__ = ["MAX_NODES", "parse_yaml", "read_yaml_file"]

# Nodes of the fully expanded document. The largest shipped config has a few hundred; a sweep space or a fuse config
# with a hundred models stays far below.
MAX_NODES = 100_000


def read_yaml_file(path: str | Path, expected: str = "a YAML file") -> Any:
    """The data of the YAML file at ``path`` (see :func:`parse_yaml`); :class:`InputError` naming ``path`` when it is
    missing, unreadable, not UTF-8 text, invalid YAML, too large once expanded or has a duplicated key."""
    file = Path(path)
    if not file.is_file():
        raise InputError(str(file), f"an existing {expected}", "no such file" if not file.exists() else "not a regular file")
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise InputError(str(file), f"a readable {expected}", exc.strerror or type(exc).__name__) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(str(file), "UTF-8 text", f"byte 0x{raw[exc.start]:02x} at line {line}", "save the file as UTF-8") from None
    return parse_yaml(text, str(file))


def parse_yaml(text: str, where: str) -> Any:
    """Parse one YAML document of plain data (``yaml.safe_load``'s types), refusing, with an :class:`InputError` at
    ``where``: a syntax error, a document of more than :data:`MAX_NODES` nodes once its aliases are expanded, a
    recursive alias, and a mapping that gives one key twice (YAML says keys are unique; PyYAML keeps the last)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _count_nodes(node, where)
        _check_unique_keys(node, where, [], set())
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InputError(where, "valid YAML", f"a syntax error{at}", getattr(exc, "problem", None) or "") from None
    except RecursionError:
        raise InputError(where, "YAML nested a few hundred levels at most", "deeper nesting") from None
    finally:
        loader.dispose()


def _count_nodes(root: yaml.Node, where: str) -> int:
    """The number of nodes of ``root`` with every alias expanded, computed on the shared graph (each node once)."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()
    # Iterative post-order walk: deep documents must not hit Python's recursion limit here.
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if not expanded:
            if key in visiting:
                raise InputError(
                    where, "YAML without recursive aliases", f"an alias inside its own anchor at line {node.start_mark.line + 1}"
                )
            visiting.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        for child in children:
            if id(child) not in sizes:  # a child still being visited: the alias points back up its own branch
                raise InputError(
                    where, "YAML without recursive aliases", f"an alias inside its own anchor at line {child.start_mark.line + 1}"
                )
        total = 1 + sum(sizes[id(child)] for child in children)
        if total > MAX_NODES:
            raise InputError(
                where,
                f"a YAML document of at most {MAX_NODES:,} nodes once its aliases are expanded",
                f"more (the node at line {node.start_mark.line + 1} alone expands to {total:,})",
                "an alias bomb? write the values out",
            )
        sizes[key] = total
        visiting.discard(key)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def _check_unique_keys(node: yaml.Node, where: str, path: list[str], seen: set[int]) -> None:
    """Refuse a mapping that gives a key twice, naming its key path and line (each shared node checked once)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, child in enumerate(node.value):
            _check_unique_keys(child, where, [*path, str(i)], seen)
    elif isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                ident = (key_node.tag, key_node.value)
                name = ".".join([*path, key_node.value])
                if ident in first:
                    raise InputError(
                        f"{where}: {name}",
                        "each key once in a mapping",
                        f"it again at line {key_node.start_mark.line + 1} (first at line {first[ident]})",
                        "YAML keeps only the last; remove one",
                    )
                first[ident] = key_node.start_mark.line + 1
                _check_unique_keys(value_node, where, [*path, key_node.value], seen)
            else:
                _check_unique_keys(value_node, where, path, seen)
