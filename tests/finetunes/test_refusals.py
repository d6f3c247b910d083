"""Issue 39's bad inputs on the fine-tune surfaces (``fedlora`` / ``fedmerge``, ``rayfuse fuse`` of fine-tunes and
adapters): each is refused before start in one line (exit 2 on the command line) and nothing is written where the
case ran (the harness of tests/config/test_bad_inputs.py)."""

from __future__ import annotations

import json
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
        "fuse.yaml: output: expected a path that does not exist yet",
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# A Hugging Face folder whose config.json does not describe its weights: the output would copy it (rayfuse fuse) or
# from_pretrained would fail or reinitialise (fedlora's base); refused naming the config, before anything is written


def _llama(f: Files, name: str, seed: int = 0) -> str:
    """A tiny Llama (2 layers of width 32) saved as a Hugging Face folder ``name``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(f.root / name)
    return name


def _bert(f: Files, name: str, hidden: int = 32) -> str:
    """A tiny BERT sequence classifier for the tokens dataset's defaults (vocab 32, rows of 16, 2 classes)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from make_tiny_hf import make_tiny_hf

    make_tiny_hf(f.root / name, hidden=hidden, heads=2)
    return name


def _config(f: Files, folder: str, **changes: Any) -> None:
    file = f.root / folder / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def _ties(config: dict[str, Any], method: str = "ties") -> Make:
    """``rayfuse fuse`` of fine-tunes of a tiny Llama, its base's config.json changed by ``config`` first."""

    def build(f: Files) -> list[str]:
        folders = [_llama(f, "base"), _llama(f, "ft0", 1), _llama(f, "ft1", 2)]
        _config(f, "base", **config)  # the base_model's, or the first model's (the folder the output copies)
        entries = [{"model": m} for m in (folders[1:] if method == "ties" else folders)]
        fields = {"base_model": "base"} if method == "ties" else {}
        return ["fuse", f.yaml("merge.yaml", {"merge_method": method, **fields, "models": entries, "output": "merged"})]

    return build


def _tokens_job(f: Files, model: str, **params: Any) -> str:
    return f.job(
        data={"dataset": "tokens", "options": {"n_samples": 200}},
        model={"name": f"hf:{model}"},
        methods={"fedlora": {"rounds": 1, "r": 2, "target_modules": ["classifier"], **params}},
    )


def _fedlora_base(config: dict[str, Any] | None = None, hidden: int = 32) -> Make:
    """``rayfuse run`` of fedlora on a tiny BERT, its base another folder (of width ``hidden``, config changed)."""

    def build(f: Files) -> list[str]:
        _bert(f, "bert")
        _bert(f, "other", hidden)
        if config:
            _config(f, "other", **config)
        return ["run", _tokens_job(f, "bert", base="other")]

    return build


WHAT = "expected a config.json describing the weights beside it (from_pretrained would fail, or reinitialise what they lack)"
CASES.update(
    {
        "fuse-ties-base-config-wider": (_ties({"hidden_size": 64}), f"base/config.json: {WHAT}, got 'LlamaForCausalLM with lm_head."),
        "fuse-ties-base-config-more-layers": (
            _ties({"num_hidden_layers": 3}),
            f"base/config.json: {WHAT}, got 'LlamaForCausalLM with model.layers.2.",  # from_pretrained: reinitialised
        ),
        "fuse-ties-base-config-fewer-layers": (
            _ties({"num_hidden_layers": 1}),
            f"base/config.json: {WHAT}, got 'LlamaForCausalLM without model.layers.1.",
        ),
        "fuse-ties-base-config-vocab": (_ties({"vocab_size": 65}), "base/config.json: expected a config.json describing the weights"),
        "fuse-average-first-config-layers": (_ties({"num_hidden_layers": 3}, "average"), "base/config.json: expected a config.json"),
        "fedlora-base-config-layers": (_fedlora_base({"num_hidden_layers": 3}), f"methods.fedlora.base: {WHAT}"),
        # the base loads (transformers' "Loading weights" bars) and is then refused: the line alone is printed
        "fedlora-base-another-model": (
            _fedlora_base(hidden=16),
            "methods.fedlora.base: expected tensor bert.embeddings.word_embeddings.weight",
        ),
    }
)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_in_one_line_before_start_and_leaves_nothing_behind(name: str, isolated: Path, capsys) -> None:
    make, expected = CASES[name]
    command = make(Files(isolated))
    capsys.readouterr()
    before = _snapshot(isolated)
    line = refused_line(command, capsys)  # exit 2, exactly one line on stderr
    assert expected in line, line
    assert capsys.readouterr() == ("", "")  # and nothing else: no progress bar, no load report, no warning
    assert _snapshot(isolated) == before


def test_transformers_is_quiet_only_inside_rayfuses_loads_and_as_the_user_asks(monkeypatch) -> None:
    from transformers.utils import logging as hf_logging

    from rayfuse.models.hf import quiet_transformers

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    monkeypatch.setattr(hf_logging, "_tqdm_active", True)  # bars on, whatever an earlier test left (restored after)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    with quiet_transformers():
        assert hf_logging.get_verbosity() == hf_logging.ERROR and not hf_logging.is_progress_bar_enabled()
    assert hf_logging.get_verbosity() == hf_logging.WARNING and hf_logging.is_progress_bar_enabled()  # restored
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's choice (rayfuse run --verbose: warning)
    with quiet_transformers():
        assert hf_logging.get_verbosity() == hf_logging.WARNING and hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity(level)
