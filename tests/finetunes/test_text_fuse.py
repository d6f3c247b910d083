"""``rayfuse fuse`` on Hugging Face classifiers with text data: fisher, regmean, adamerging and distill, from full
fine-tunes and LoRA adapters, and the one-line refusals of bad text inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import rayfuse
from rayfuse.data.text import encode_texts, text_tokenizer
from rayfuse.errors import InputError
from tests.data.test_text_silos import tiny_text_bert

SPORT = ["i like football and tennis", "the match ended in a draw", "she runs every morning", "a goal in the last minute"]
CODE = ["the program crashed again", "python code with a bug", "my computer will not boot", "install the new driver"]
PUBLIC = [*SPORT, *CODE, "what a game", "the code runs fast", "hello there"]


def _train(model: torch.nn.Module, tokenizer, texts: list[str], labels: list[int], steps: int = 8) -> None:
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    y = torch.tensor(labels)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(steps):
        out = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"])
        loss = torch.nn.functional.cross_entropy(out.logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BERT base, two full fine-tunes on label-skewed text (a sports site, a computing site) and one LoRA
    adapter, each a few steps."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertForSequenceClassification

    root = tmp_path_factory.mktemp("text_fuse")
    base = root / "base"
    tokenizer = text_tokenizer(tiny_text_bert(base, positions=24, texts=PUBLIC * 2, vocab_size=80, layers=2))
    sites = {"sport": (SPORT * 2 + CODE[:1], [0] * 8 + [1]), "code": (CODE * 2 + SPORT[:1], [1] * 8 + [0])}
    out = {"base": base}
    for seed, (name, (texts, labels)) in enumerate(sites.items(), 1):
        torch.manual_seed(seed)
        model = BertForSequenceClassification.from_pretrained(base)
        _train(model, tokenizer, texts, labels)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out[name] = root / name
    torch.manual_seed(3)
    lora = get_peft_model(
        BertForSequenceClassification.from_pretrained(base),
        LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], task_type="SEQ_CLS"),
    )  # the classifier head trained in full (modules_to_save), as PEFT does for a sequence classifier
    _train(lora, tokenizer, SPORT + CODE, [0] * 4 + [1] * 4, steps=6)
    lora.save_pretrained(root / "lora")
    out["lora"] = root / "lora"
    (root / "public.jsonl").write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(PUBLIC)))
    (root / "public.txt").write_text("\n".join(PUBLIC) + "\n")
    out["jsonl"], out["txt"] = root / "public.jsonl", root / "public.txt"
    return out


def _config(folders: dict[str, Path], method: str, tmp_path: Path, **extra) -> dict:
    config = {
        "merge_method": method,
        "base_model": str(folders["base"]),
        "models": [{"model": str(folders["sport"])}, {"model": str(folders["code"])}],
        "data": {"path": str(folders["jsonl"]), "text": "text", "max_length": 12},
        "output": str(tmp_path / "merged"),
    }
    config.update(extra)
    return config


def _load(folder: Path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer(PUBLIC, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits
    assert torch.isfinite(logits).all() and logits.shape == (len(PUBLIC), 2)
    return model


def _entropy(folder: Path, X: np.ndarray) -> float:
    from rayfuse.finetunes.text_fuse import _load as load_token_model
    from rayfuse.finetunes.text_fuse import prediction_entropy

    return prediction_entropy(load_token_model(folder), X)


def _task_arithmetic(folders: dict[str, Path], tmp_path: Path, lam: float) -> Path:
    out = tmp_path / "ta"
    rayfuse.fuse(
        {
            "merge_method": "task_arithmetic",
            "base_model": str(folders["base"]),
            "models": [
                {"model": str(folders["sport"]), "parameters": {"weight": 1.0}},
                {"model": str(folders["code"]), "parameters": {"weight": 1.0}},
            ],
            "parameters": {"lambda": lam},
            "output": str(out),
        }
    )
    return out


@pytest.mark.parametrize(("method", "kind"), [("fisher", "jsonl"), ("regmean", "csv"), ("regmean", "parquet")])
def test_statistics_merges_from_text_load_with_their_tokenizer(folders, tmp_path, method, kind):
    config = _config(folders, method, tmp_path)
    if kind != "jsonl":
        import pyarrow as pa
        import pyarrow.csv
        import pyarrow.parquet

        table = pa.table({"body": PUBLIC, "id": list(range(len(PUBLIC)))})
        file = tmp_path / f"public.{kind}"
        pyarrow.csv.write_csv(table, file) if kind == "csv" else pyarrow.parquet.write_table(table, file)
        config["data"] = {"path": str(file), "text": "body"}
    out = rayfuse.fuse(config)
    _load(out)
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the statistics' work folder is gone
    assert (out / "vocab.txt").is_file() or (out / "tokenizer.json").is_file()


def test_regmean_from_text_equals_regmean_from_its_statistics_files(folders, tmp_path):
    from rayfuse.alignment import masked_grams
    from rayfuse.finetunes.statistics import write_statistics
    from rayfuse.finetunes.text_fuse import _load as load_token_model
    from rayfuse.io import read_checkpoint

    X = encode_texts(text_tokenizer(folders["base"]), PUBLIC, 12)
    files = []
    for name in ("sport", "code"):
        files.append(write_statistics(tmp_path / f"{name}.safetensors", masked_grams(load_token_model(folders[name]), X), "gram", len(X)))
    from_text = rayfuse.fuse(_config(folders, "regmean", tmp_path))
    config = _config(folders, "regmean", tmp_path, output=str(tmp_path / "from_files"))
    del config["data"]
    config["models"] = [{"model": str(folders[n]), "statistics": str(f)} for n, f in zip(("sport", "code"), files)]
    from_files = rayfuse.fuse(config)
    a, _ = read_checkpoint(from_text / "model.safetensors")
    b, _ = read_checkpoint(from_files / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_grams_leave_out_the_padded_positions(folders):
    from rayfuse.alignment import masked_grams
    from rayfuse.finetunes.text_fuse import _load as load_token_model

    model = load_token_model(folders["sport"])
    tokenizer = text_tokenizer(folders["base"])
    short = encode_texts(tokenizer, ["what a game"], 5)  # class token, what a game, separator: no padding
    padded = encode_texts(tokenizer, ["what a game"], 12)
    a, b = masked_grams(model, short), masked_grams(model, padded)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-8)


def test_an_embedding_tables_gram_is_the_count_of_its_rows_at_the_texts_tokens(folders):
    from rayfuse.alignment import masked_grams
    from rayfuse.finetunes.text_fuse import _load as load_token_model

    model = load_token_model(folders["sport"])
    X = encode_texts(text_tokenizer(folders["base"]), PUBLIC, 12)
    grams = masked_grams(model, X, batch_size=4)
    ids = X[X >= 0].astype(np.int64)
    words = grams["bert.embeddings.word_embeddings.weight"]
    assert words.shape == (model.config.vocab_size,)
    np.testing.assert_array_equal(words, np.bincount(ids, minlength=model.config.vocab_size))
    lengths = (X >= 0).sum(1)  # position j is used once by each text longer than j
    positions = grams["bert.embeddings.position_embeddings.weight"]
    np.testing.assert_array_equal(positions, [(lengths > j).sum() for j in range(model.config.max_position_embeddings)])
    np.testing.assert_array_equal(grams["bert.embeddings.token_type_embeddings.weight"], [len(ids), 0])


def test_regmean_from_each_sites_texts_takes_a_words_row_from_the_sites_that_used_it(folders, tmp_path):
    """Each site's statistics on its own texts: a word only the sport site's texts hold keeps the sport model's row
    exactly (its task vector, not half of it); one both hold is their count-weighted row; one neither holds is the
    average (the base's row plus the mean of the two task vectors)."""
    from rayfuse.alignment import masked_grams
    from rayfuse.finetunes.statistics import write_statistics
    from rayfuse.finetunes.text_fuse import _load as load_token_model
    from rayfuse.io import read_checkpoint

    tokenizer = text_tokenizer(folders["base"])
    texts = {"sport": SPORT, "code": CODE}
    models, files, counts = [], [], {}
    for name, own in texts.items():
        X = encode_texts(tokenizer, own, 12)
        grams = masked_grams(load_token_model(folders[name]), X)
        counts[name] = grams["bert.embeddings.word_embeddings.weight"]
        files.append(write_statistics(tmp_path / f"{name}.safetensors", grams, "gram", len(X)))
        models.append({"model": str(folders[name]), "statistics": str(files[-1])})
    config = _config(folders, "regmean", tmp_path, models=models)
    del config["data"]
    merged, _ = read_checkpoint(rayfuse.fuse(config) / "model.safetensors")
    key = "bert.embeddings.word_embeddings.weight"
    table = {n: read_checkpoint(folders[n] / "model.safetensors")[0][key].astype(np.float64) for n in (*texts, "base")}
    vocab = tokenizer.get_vocab()
    football, both, nothing = vocab["football"], vocab["the"], vocab["hello"]
    assert counts["sport"][football] > 0 == counts["code"][football]
    np.testing.assert_allclose(merged[key][football], table["sport"][football], rtol=1e-5, atol=1e-6)
    c = (counts["sport"][both], counts["code"][both])
    assert min(c) > 0
    np.testing.assert_allclose(merged[key][both], (c[0] * table["sport"][both] + c[1] * table["code"][both]) / sum(c), rtol=1e-5, atol=1e-6)
    assert counts["sport"][nothing] == 0 == counts["code"][nothing]
    np.testing.assert_allclose(merged[key][nothing], (table["sport"][nothing] + table["code"][nothing]) / 2, rtol=1e-5, atol=1e-6)


def test_fisher_is_the_expectation_over_the_models_own_softmax(folders):
    from rayfuse.finetunes.text_fuse import _load as load_token_model
    from rayfuse.finetunes.text_fuse import expected_fisher

    model = load_token_model(folders["sport"])
    X = encode_texts(text_tokenizer(folders["base"]), PUBLIC[:3], 12)
    with torch.no_grad():
        p = torch.softmax(model(torch.as_tensor(X)), -1).numpy()
    per_class = [expected_fisher(model, X, np.full(3, c)) for c in (0, 1)]
    # with one class per call the mean over texts mixes them; per text the expectation weighs class c by p(c | x)
    expected = {}
    for n in range(3):
        singles = [expected_fisher(model, X[n : n + 1], np.array([c])) for c in (0, 1)]
        for key in singles[0]:
            expected[key] = expected.get(key, 0) + (p[n, 0] * singles[0][key] + p[n, 1] * singles[1][key]) / 3
    got = expected_fisher(model, X)
    assert per_class[0].keys() == got.keys()
    for key in got:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-12)


def test_adamerging_lowers_the_entropy_below_task_arithmetics_at_its_start(folders, tmp_path):
    from rayfuse.api import fuse_checkpoints

    summary = fuse_checkpoints(
        _config(folders, "adamerging", tmp_path, parameters={"lambda_init": 0.3, "steps": 12, "lr": 0.05, "batch_size": 8})
    )
    out = Path(summary["output"])
    _load(out)
    X = encode_texts(text_tokenizer(folders["base"]), PUBLIC, 12)
    ta = _task_arithmetic(folders, tmp_path, 0.3)
    start, end = summary["entropy"]
    assert start == pytest.approx(_entropy(ta, X), rel=1e-4)
    assert _entropy(out, X) == pytest.approx(end, rel=1e-4)
    assert end < start


def test_adamerging_fit_to_the_ensemble_lowers_its_kl_from_the_models_mean_probabilities(folders, tmp_path):
    """``objective: ensemble``: the reported KL at the start and the end is the written model's KL from the two sites'
    mean probabilities (recomputed here from their folders), and it falls."""
    from rayfuse.api import fuse_checkpoints
    from rayfuse.finetunes.text_fuse import _load as load_token_model

    params = {"lambda_init": 0.6, "steps": 12, "lr": 0.02, "batch_size": len(PUBLIC), "objective": "ensemble"}
    summary = fuse_checkpoints(_config(folders, "adamerging", tmp_path, parameters=params))
    out = Path(summary["output"])
    _load(out)
    X = torch.as_tensor(encode_texts(text_tokenizer(folders["base"]), PUBLIC, 12))

    def kl(folder: Path) -> float:
        with torch.no_grad():
            target = sum(torch.softmax(load_token_model(folders[s]).eval()(X).double(), -1) for s in ("sport", "code")) / 2
            logp = torch.log_softmax(load_token_model(folder).eval()(X).double(), -1)
        return float((target * (target.log() - logp)).sum(-1).mean())

    start, end = summary["kl_from_ensemble"]
    assert "entropy" not in summary
    assert start == pytest.approx(kl(_task_arithmetic(folders, tmp_path, 0.6)), rel=1e-3, abs=1e-6)
    assert kl(out) == pytest.approx(end, rel=1e-3, abs=1e-6)
    assert end < start


def test_distill_of_full_fine_tunes_through_the_cli(folders, tmp_path, capsys):
    import yaml

    from rayfuse.cli import main

    config = _config(folders, "distill", tmp_path, parameters={"steps": 12, "epochs": 2, "batch_size": 4, "lr": 1e-3})
    config["data"] = {"path": str(folders["txt"]), "text": "line"}
    file = tmp_path / "fuse.yaml"
    file.write_text(yaml.safe_dump(config))
    assert main(["fuse", str(file)]) == 0
    assert "distill of 3 models" in capsys.readouterr().out
    _load(tmp_path / "merged")
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_distill_moves_the_student_from_the_average_toward_the_ensemble(folders, tmp_path):
    from rayfuse.finetunes.text_fuse import _load as load_token_model

    config = _config(
        folders,
        "distill",
        tmp_path,
        parameters={"steps": 30, "epochs": 3, "batch_size": 8, "lr": 3e-3, "temperature": 1.0, "combine": "probabilities"},
    )
    out = rayfuse.fuse(config)
    average = tmp_path / "average"
    rayfuse.fuse({"merge_method": "average", "models": [{"model": str(folders[n])} for n in ("sport", "code")], "output": str(average)})
    X = torch.as_tensor(encode_texts(text_tokenizer(folders["base"]), PUBLIC, 12))
    with torch.no_grad():
        ensemble = torch.stack([torch.softmax(load_token_model(folders[n])(X), -1) for n in ("sport", "code")]).mean(0)

        def kl(folder: Path) -> float:
            logq = torch.log_softmax(load_token_model(folder)(X), -1)
            return float((ensemble * (ensemble.log() - logq)).sum(-1).mean())

        assert kl(out) < kl(average)


def test_distill_with_class_counts_weights_each_class_by_the_models_that_held_it(folders, tmp_path, monkeypatch):
    """With each model's class counts the teachers are weighted per class (``teacher_weights("classes")``, the
    federated distill's default): the class a model never held takes its logit from the others."""
    import rayfuse.fusion.distill.student as student_module
    from rayfuse.fusion.distill.teachers import teacher_weights

    seen = []
    original = student_module.distill_public

    def spy(student, teachers, X, weights, settings, **kw):
        seen.append(np.asarray(weights))
        return original(student, teachers, X, weights, settings, **kw)

    monkeypatch.setattr(student_module, "distill_public", spy)
    counts = [[9.0, 0.0], [1.0, 8.0]]
    models = [{"model": str(folders[n]), "parameters": {"class_counts": c}} for n, c in zip(("sport", "code"), counts)]
    parameters = {"steps": 6, "epochs": 2, "batch_size": 4, "lr": 1e-3}
    out = rayfuse.fuse(_config(folders, "distill", tmp_path, models=models, parameters=parameters))
    _load(out)
    expected = teacher_weights("classes", np.array(counts))
    np.testing.assert_allclose(seen[0], expected, rtol=0, atol=1e-7)
    assert seen[0][0, 1] < 0.001 and seen[0][1, 1] > 0.999  # class 1: only code held it
    np.testing.assert_allclose(seen[0][:, 0], [0.9, 0.1], atol=1e-3)  # class 0: sport held 9 of its 10 samples
    rayfuse.fuse(_config(folders, "distill", tmp_path, output=str(tmp_path / "uniform"), parameters=parameters))
    np.testing.assert_allclose(seen[1], np.full((2, 2), 0.5), rtol=0, atol=1e-7)  # no counts: uniform, as before


def test_word_dropout_keeps_each_rows_ends_and_order_and_pads_again():
    from rayfuse.fusion.distill.transfer import drop_tokens

    X = torch.tensor([[2.0, 10, 11, 12, 13, 3, -1, -1], [2.0, 20, 3, -1, -1, -1, -1, -1], [2.0, 30, 31, 32, 33, 34, 35, 36]])
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(drop_tokens(X, 0.0, generator), X)
    for _ in range(20):
        out = drop_tokens(X, 0.5, generator)
        for row, new in zip(X.tolist(), out.tolist()):
            kept = [v for v in new if v >= 0]
            real = [v for v in row if v >= 0]
            assert new[: len(kept)] == kept  # kept tokens first, padding after
            assert kept[0] == real[0] and kept[-1] == real[-1]
            assert all(v in real[1:-1] for v in kept[1:-1]) and kept[1:-1] == sorted(kept[1:-1])  # a subsequence
    assert (drop_tokens(X, 0.999, generator) >= 0).sum(1).tolist() == [2, 2, 2]


def test_text_mixup_pairs_a_share_of_rows_and_leaves_the_rest_as_they_are():
    from rayfuse.fusion.distill.transfer import mix_texts

    X = torch.tensor([[2.0, 10, 11, 3, -1], [2.0, 20, 3, -1, -1], [2.0, 30, 31, 32, 3]])
    pool = torch.tensor([[2.0, 40, 3, -1, -1], [2.0, 50, 51, 3, -1]])
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(mix_texts(X, pool, 0.0, generator), X)
    out = mix_texts(X.repeat(20, 1), pool, 0.5, generator)
    assert out.shape == (60, 3, 5) and torch.equal(out[:, 0], X.repeat(20, 1))
    lam = out[:, 2]
    assert torch.equal(lam, lam[:, :1].expand_as(lam)) and bool(((lam >= 0) & (lam <= 1)).all())
    plain = lam[:, 0] == 1
    assert torch.equal(out[plain, 1], out[plain, 0])  # a row not mixed: its text twice, ratio 1
    assert 10 < int((~plain).sum()) < 50 and all(row in pool.tolist() for row in out[~plain, 1].tolist())


def test_a_mixed_row_is_the_ratios_mix_of_word_embeddings(folders):
    from transformers import BertConfig, BertForSequenceClassification

    from rayfuse.models.hf import _token_ids_forward

    torch.manual_seed(0)  # freshly initialised with large weights: its logits differ from text to text
    config = BertConfig.from_pretrained(folders["base"])
    config.initializer_range = 0.5
    model = _token_ids_forward(BertForSequenceClassification(config)).eval()
    a = torch.tensor([[2.0, 10, 11, 12, 3, -1]])
    b = torch.tensor([[2.0, 20, 21, 22, 3, -1]])  # the same length: one attention mask for both
    with torch.no_grad():
        same = model(torch.stack([a, a, torch.ones_like(a)], dim=1))
        second = model(torch.stack([a, b, torch.zeros_like(a)], dim=1))
        half = model(torch.stack([a, b, torch.full_like(a, 0.5)], dim=1))
        torch.testing.assert_close(same, model(a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second, model(b), rtol=1e-5, atol=1e-5)
        table = model.get_input_embeddings()
        embeds = 0.5 * table(a.clamp(min=0).long()) + 0.5 * table(b.clamp(min=0).long())
        embeds[:, -1] = table(torch.tensor([model.config.pad_token_id]))  # a padded position embeds the pad token
        expected = type(model).__mro__[1].forward(model, inputs_embeds=embeds, attention_mask=(a >= 0).long()).logits
        torch.testing.assert_close(half, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(half, model(a), rtol=0, atol=0.05) and not torch.allclose(half, model(b), rtol=0, atol=0.05)


@pytest.mark.parametrize("option", [{"word_dropout": 0.2}, {"mixup": 1.0}])
def test_distill_with_word_dropout_or_mixup_writes_a_model_that_loads(folders, tmp_path, option):
    parameters = {"steps": 6, "epochs": 2, "batch_size": 4, "lr": 1e-3, **option}
    out = rayfuse.fuse(_config(folders, "distill", tmp_path, parameters=parameters))
    _load(out)
    assert (out / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("method", ["regmean", "fisher", "adamerging"])
def test_lora_adapters_are_folded_into_the_base_and_merged(folders, tmp_path, method):
    config = _config(folders, method, tmp_path, models=[{"model": str(folders["lora"])}, {"model": str(folders["code"])}])
    if method == "adamerging":
        config["parameters"] = {"steps": 3}
    _load(rayfuse.fuse(config))


def test_a_folded_adapter_is_pefts_merge_and_unload_with_its_trained_head(folders, tmp_path):
    from peft import PeftModel
    from transformers import BertForSequenceClassification

    from rayfuse.finetunes.text_fuse import _load as load_token_model
    from rayfuse.finetunes.text_fuse import _weights
    from rayfuse.merging import load_fuse_config

    models = [{"model": str(folders["lora"])}, {"model": str(folders["code"])}]
    spec = load_fuse_config(_config(folders, "regmean", tmp_path, models=models))
    base_state = load_token_model(folders["base"]).state_dict()
    folded = _weights(spec, 0, base_state)
    peft = PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained(folders["base"]), folders["lora"])
    expected = peft.merge_and_unload().state_dict()
    assert not torch.equal(folded["classifier.weight"], base_state["classifier.weight"])
    for key, value in folded.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)


def test_fisher_with_labels_is_the_empirical_fisher(folders, tmp_path):
    config = _config(folders, "fisher", tmp_path)
    config["data"]["label"] = "label"
    _load(rayfuse.fuse(config))


# -- refusals: one line, exit 2 from the CLI, nothing written ------------------------------------------------------------

BAD = [
    (
        "missing column",
        {"data": {"path": "{jsonl}", "text": "body"}},
        "{cfg}: data.text: expected a column of public.jsonl (label, text), got 'body'",
    ),
    ("not utf-8", {"data": {"path": "{latin}", "text": "text"}}, "{cfg}: data.path: expected"),
    (
        "empty text",
        {"data": {"path": "{empty}", "text": "text"}},
        "{cfg}: data.text: expected a non-empty text in every row of column 'text', got 'an empty text at row 1 of empty.jsonl'",
    ),
    ("no tokenizer", {"base_model": "{bare}"}, "{cfg}: base_model: expected a folder with a tokenizer"),
    (
        "max_length beyond the positions",
        {"data": {"path": "{jsonl}", "text": "text", "max_length": 64}},
        "{cfg}: data.max_length: expected at most the model's 24 positions",
    ),
    (
        "label for an unlabeled merge",
        {"merge_method": "regmean", "data": {"path": "{jsonl}", "text": "text", "label": "label"}},
        "{cfg}: data.label: expected no label with merge_method regmean (it reads unlabeled text), got 'label'",
    ),
    (
        "labels out of range",
        {"merge_method": "fisher", "data": {"path": "{bad_labels}", "text": "text", "label": "label"}},
        "{cfg}: data.label: expected class ids in [0, 2) (the model's num_labels), got 7",
    ),
    (
        "aligned on BERT",
        {"merge_method": "activation_matching"},
        "{cfg}: merge_method: expected a merge that reads text data (fisher, regmean, adamerging, distill), got "
        "'activation_matching'; activation matching, REPAIR and the nonparametric merge permute",
    ),
    ("data-free merge", {"merge_method": "ties"}, "{cfg}: merge_method: expected a merge that reads text data"),
    ("adamerging without base", {"base_model": None}, "{cfg}: base_model: expected the model the others are fine-tunes of, for adamerging"),
    ("adamerging without data", {"data": None}, "{cfg}: data: expected unlabeled text for adamerging"),
    (
        "statistics and text",
        {"merge_method": "regmean", "models": [{"model": "{sport}", "statistics": "x.safetensors"}, {"model": "{code}"}]},
        "{cfg}: models.0.statistics: expected no statistics file with text data",
    ),
    (
        "seed of a merge that seeds itself",
        {"seed": 3},
        "{cfg}: seed: expected no seed with merge_method adamerging on text (it runs the models in memory), got 3; parameters.seed seeds it",
    ),
    ("a model file, not a folder", {"models": [{"model": "{file}"}]}, "{cfg}: models.0.model: expected a Hugging Face folder"),
    (
        "class counts on one model only",
        {"merge_method": "distill", "models": [{"model": "{sport}", "parameters": {"class_counts": [8, 1]}}, {"model": "{code}"}]},
        "{cfg}: models.1.parameters.class_counts: expected class counts on every model or on none (models.0 has them)",
    ),
    (
        "class counts of another length",
        {"merge_method": "distill", "models": [{"model": "{sport}", "parameters": {"class_counts": c}} for c in ([8, 1, 0], [1, 8, 0])]},
        "{cfg}: models.0.parameters.class_counts: expected 2 counts (the models' num_labels), got [8.0, 1.0, 0.0]",
    ),
    (
        "class counts of no sample",
        {"merge_method": "distill", "models": [{"model": "{sport}", "parameters": {"class_counts": c}} for c in ([8, 1], [0, 0])]},
        "{cfg}: models.1.parameters.class_counts: expected at least one sample",
    ),
    (
        "negative class counts",
        {"merge_method": "distill", "models": [{"model": "{sport}", "parameters": {"class_counts": c}} for c in ([8, -1], [1, 8])]},
        "{cfg}: models.0.parameters.class_counts.1: expected",
    ),
    (
        "weighting classes without class counts",
        {"merge_method": "distill", "parameters": {"weighting": "classes"}},
        "{cfg}: parameters.weighting: expected uniform or weights (classes needs each model's class_counts), got 'classes'",
    ),
    (
        "class counts that another weighting leaves unread",
        {
            "merge_method": "distill",
            "parameters": {"weighting": "uniform"},
            "models": [{"model": "{sport}", "parameters": {"class_counts": c}} for c in ([8, 1], [1, 8])],
        },
        "{cfg}: models.0.parameters.class_counts: expected no class counts with weighting: uniform (they would go unread)",
    ),
    (
        "class counts for a merge that reads none",
        {"merge_method": "regmean", "models": [{"model": "{sport}", "parameters": {"class_counts": c}} for c in ([8, 1], [1, 8])]},
        "{cfg}: models.0.parameters",
    ),
    (
        "distill holding out all but one text",
        {"merge_method": "distill", "parameters": {"holdout": 0.9}},
        "{cfg}: parameters.holdout: expected a share that leaves at least 2 of the",
    ),
]


@pytest.fixture(scope="module")
def bad_files(folders, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_text")
    (root / "latin.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (root / "empty.jsonl").write_text('{"text": "ok"}\n{"text": "  "}\n')
    (root / "bad_labels.jsonl").write_text('{"text": "ok", "label": 7}\n')
    bare = root / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folders["base"] / name, bare / name)
    (root / "model.safetensors").write_bytes((folders["base"] / "model.safetensors").read_bytes())
    return {
        "jsonl": str(folders["jsonl"]),
        "latin": str(root / "latin.jsonl"),
        "empty": str(root / "empty.jsonl"),
        "bad_labels": str(root / "bad_labels.jsonl"),
        "bare": str(bare),
        "sport": str(folders["sport"]),
        "code": str(folders["code"]),
        "file": str(root / "model.safetensors"),
    }


def _fill(value, files):
    if isinstance(value, str):
        return value.format(**files)
    if isinstance(value, dict):
        return {k: _fill(v, files) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, files) for v in value]
    return value


@pytest.mark.parametrize(("case", "change", "message"), BAD, ids=[row[0] for row in BAD])
def test_bad_text_inputs_are_one_line_exit_2_and_nothing_written(folders, bad_files, tmp_path, capsys, case, change, message):
    import yaml

    from rayfuse.cli import main

    config = _config(folders, "adamerging", tmp_path)
    for key, value in _fill(change, bad_files).items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    file = tmp_path / "fuse.yaml"
    file.write_text(yaml.safe_dump(config))
    assert main(["fuse", str(file)]) == 2
    err = capsys.readouterr().err.strip()
    expected = message.format(cfg=file)
    assert err.startswith(f"rayfuse: error: {expected}"), err
    assert "\n" not in err
    assert not (tmp_path / "merged").exists()
    with pytest.raises(InputError) as info:
        rayfuse.fuse(file)
    assert str(info.value).startswith(expected)
