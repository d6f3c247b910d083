"""The front page and the documentation site: README.md short and linked into docs/, the configuration reference
generated from the schema and current, the site building with ``mkdocs build --strict``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from rayfuse import docs_gen
from rayfuse.config import ExperimentConfig
from rayfuse.method import METHODS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------
# README.md: the front page


def test_the_readme_is_a_front_page_of_at_most_200_lines_that_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    first_block = text[text.index("```bash\n") + len("```bash\n") :]
    first_block = first_block[: first_block.index("```")]
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "run"], ["make", "test"]]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make docs" in ci


def test_the_readme_links_writing_a_method_and_every_link_resolves():
    text = README.read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]
    assert "docs/writing-a-method.md" in targets
    assert {"docs/configuration.md", "docs/api.md", "docs/manual.md"} <= set(targets)
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == []


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch):
    """The README's ten-line Python API block, run in-process as printed (its run folder goes under ``runs/`` of the
    working directory, here a temporary one)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```\n")]
    assert len(block.strip().splitlines()) <= 10 and 'backend="local"' in block
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    result = namespace["result"]
    assert list(result.metrics.index) == ["average", "aligned", "fedavg"]
    assert ((result.metrics["accuracy"] > 0) & (result.metrics["accuracy"] <= 1)).all()
    assert result.run_dir.resolve().is_relative_to((tmp_path / "runs").resolve())
    assert sum(p.numel() for p in namespace["fused"].parameters()) > 0


# ---------------------------------------------------------------------------------------------------------------
# The configuration reference, generated


def test_the_committed_configuration_reference_is_the_generated_one():
    committed = docs_gen.PAGE.read_text(encoding="utf-8")
    assert committed == docs_gen.render(), f"docs/configuration.md is stale: run `{docs_gen.REGENERATE}` (or `make docs-config`)"


def test_the_committed_merges_table_is_the_generated_one_and_lists_every_registered_merge():
    committed = docs_gen.MERGES_PAGE.read_text(encoding="utf-8")
    assert committed == docs_gen.render_merges(), f"docs/methods/merges.md is stale: run `{docs_gen.REGENERATE}`"
    from rayfuse.merging import MERGES

    for name in MERGES:
        assert f"| `{name}`" in committed, name


def test_the_reference_lists_every_section_key_and_shipped_method_with_its_description():
    page = docs_gen.render()
    for section in ExperimentConfig.model_fields:
        assert f"## `{section}`" in page
    # one nested key of each kind: a section's key, a list item's key, a dict value's key, a method's parameter
    seed = ExperimentConfig.model_fields["run"].annotation.model_fields["seed"]
    assert f"| `run.seed` | int, &gt;= 0, &lt;= {2**32 - 1} | `0` | {seed.description} |" in page
    assert "| `data.silos.<i>.path` |" in page and "| `federation.client_overrides.<i>.model.name` |" in page
    for name in docs_gen.shipped_methods():
        assert f"### `{name}`" in page
        for field in METHODS.get(name).Params.model_fields:
            assert f"| `methods.<label>.{field}` |" in page, (name, field)
    assert {"fedavg", "aligned", "kl", "gems"} <= set(docs_gen.shipped_methods())


def test_the_reference_shows_a_required_key_and_escapes_markup_in_descriptions():
    rows = {row.path: row for rows in docs_gen.config_rows().values() for row in rows}
    assert rows["data.target.dataset"].default == "required"
    assert rows["partition.alpha"].type == "float, > 0" and rows["partition.alpha"].default == "0.5"
    assert docs_gen._cell("a | b <name> *x*") == "a \\| b &lt;name&gt; \\*x\\*"
    missing = docs_gen.missing_descriptions()
    assert "run.seed" not in missing and all(isinstance(path, str) and path for path in missing)


def test_the_generator_check_mode_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "configuration.md"
    monkeypatch.setattr(docs_gen, "PAGE", page)
    assert docs_gen.main(["--check"]) == 1 and "run `python -m rayfuse.docs_gen`" in capsys.readouterr().err
    assert docs_gen.main([]) == 0 and page.read_text(encoding="utf-8") == docs_gen.render()
    assert docs_gen.main(["--check"]) == 0


# ---------------------------------------------------------------------------------------------------------------
# The site


def test_the_hook_turns_repository_links_into_code_spans_and_leaves_broken_ones_to_strict():
    hooks = load_hooks()
    docs = ROOT / "docs"
    page = SimpleNamespace(file=SimpleNamespace(src_uri="methods/page.md"))
    config = {"docs_dir": str(docs)}
    text = (
        "[benchmarks/README.md](../../benchmarks/README.md#x) [the rule](../../rayfuse/updates/robust.py) "
        "[gone](../../no/such/file.py) [fedavg](fedavg.md) [plots](../results/gems/) [site](https://example.org)\n"
        "`[inline](../../rayfuse/updates/robust.py)`\n```\n[in code](../../rayfuse/updates/robust.py)\n```\n"
    )
    out = hooks.on_page_markdown(text, page, config, None)
    assert "`benchmarks/README.md`" in out and "the rule (`rayfuse/updates/robust.py`)" in out
    assert "[gone](../../no/such/file.py)" in out and "[fedavg](fedavg.md)" in out
    assert "[plots](../results/index.md#resultsgems)" in out and "[site](https://example.org)" in out
    assert "[in code](../../rayfuse/updates/robust.py)" in out  # fenced code is not touched, nor inline code
    assert "`[inline](../../rayfuse/updates/robust.py)`" in out


def test_the_results_page_lists_every_result_file():
    """docs/results/index.md lists the tables and plots the benchmark scripts write, folder by folder (a new file
    needs its line there, and a new page its line in mkdocs.yml's nav: the strict build refuses pages left out)."""
    results = ROOT / "docs" / "results"
    listed = set(LINK.findall((results / "index.md").read_text(encoding="utf-8")))
    files = {
        p.relative_to(results).as_posix()
        for p in results.rglob("*")
        if p.is_file() and p.suffix in (".md", ".png", ".csv") and p.parent != results
    }
    assert files and files - listed == set()
    assert all((results / target).exists() for target in listed if not target.startswith(("#", "..")))


def test_the_site_builds_with_mkdocs_strict(tmp_path):
    """``mkdocs build --strict``: every page in the nav, every link between pages and every anchor resolves, the
    API reference renders from the docstrings."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "rayfuse.api.run" in api and "rayfuse.method.Method" in api and "rayfuse.errors.InputError" in api
    assert "rayfuse.testing.check_method" in api and "rayfuse.method.MethodCase" in api
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
