"""Issue 39's bad inputs on the fine-tune surfaces (``fedlora`` / ``fedmerge``, ``rayfuse fuse`` of fine-tunes and
adapters): each is refused before start in one line (exit 2 on the command line) and nothing is written where the
case ran (the harness of tests/config/test_bad_inputs.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.config.test_bad_inputs import Files, _snapshot, refused_line
from tests.config.test_bad_inputs import isolated as isolated  # noqa: F401  (the harness's fixture: the case's folder as cwd)

Make = Callable[[Files], Any]


def _run(method: str, **params: Any) -> Make:
    """``rayfuse run`` of the harness's tiny job with one method."""
    return lambda f: ["run", f.job(methods={method: params})]


def _in_a_file(make: Callable[[Files, str], Make], below: str = "") -> Make:
    """A case whose output is the harness's file (``below``: a path under it)."""
    return lambda f: make(f, f.a_file() + below)(f)


def _in_a_folder(make: Callable[[Files, str], Make], name: str = "taken") -> Make:
    """A case whose output is an existing folder (with a file in it: an earlier output)."""

    def build(f: Files) -> Any:
        (f.root / name).mkdir()
        f.text(f"{name}/base.safetensors", "an earlier export\n")
        return make(f, name)(f)

    return build


def _export(f: Files, where: str) -> Make:
    return _run("fedmerge", export=where)


def _fuse_output(kind: str) -> Callable[[Files, str], Make]:
    """``rayfuse fuse`` of two models with ``output:`` given: a fine-tune merge (``ties`` on a base) or ``average``."""

    def make(f: Files, where: str) -> Make:
        def build(f: Files) -> list[str]:
            models = f.models()
            if kind == "ties":
                return ["fuse", f.fuse(models=models[1:], merge_method="ties", base_model=models[0], output=where)]
            return ["fuse", f.fuse(models=models, output=where)]

        return build

    return make


# id -> (the command, what the one line starts with / holds)
CASES: dict[str, tuple[Make, str]] = {
    # target_modules: [] matches nothing: refused where the patterns are read (was fedlora's ValueError from min())
    "fedlora-target-modules-empty": (
        _run("fedlora", target_modules=[]),
        "methods.fedlora.target_modules: expected at least one module name or pattern (an empty list matches nothing), got []",
    ),
    "fedmerge-target-modules-empty": (_run("fedmerge", target_modules=[]), "methods.fedmerge.target_modules: expected at least one"),
    "fedmerge-lora-target-modules-empty": (
        _run("fedmerge", finetune="lora", target_modules=[]),
        "methods.fedmerge.target_modules: expected at least one",
    ),
    # export: / output: name a path nothing is at yet (was a FileExistsError at run time for an existing file)
    "fedmerge-export-is-a-file": (_in_a_file(_export), "methods.fedmerge.export: expected a folder that does not exist yet"),
    "fedmerge-export-is-an-earlier-export": (_in_a_folder(_export), "methods.fedmerge.export: expected a folder that does not exist yet"),
    "fedmerge-export-under-a-file": (_in_a_file(_export, "/export"), "methods.fedmerge.export: expected a folder rayfuse can create"),
    "fuse-ties-output-is-a-file": (_in_a_file(_fuse_output("ties")), "fuse.yaml: output: expected a path that does not exist yet"),
    "fuse-ties-output-is-a-folder": (_in_a_folder(_fuse_output("ties")), "fuse.yaml: output: expected a path that does not exist yet"),
    "fuse-ties-output-under-a-file": (_in_a_file(_fuse_output("ties"), "/merged"), "fuse.yaml: output: expected a folder rayfuse can"),
    "fuse-average-output-is-a-file": (
        lambda f: _fuse_output("average")(f, f.text("fused.safetensors", "x"))(f),
        "fuse.yaml: output: expected a file that does not exist yet",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_in_one_line_before_start_and_leaves_nothing_behind(name: str, isolated: Path, capsys) -> None:
    make, expected = CASES[name]
    command = make(Files(isolated))
    capsys.readouterr()
    before = _snapshot(isolated)
    line = refused_line(command, capsys)
    assert expected in line, line
    assert _snapshot(isolated) == before
