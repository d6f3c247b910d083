"""``benchmarks/finetunes/accuracy.py`` runs end to end in its quick mode: every row of its table is there, finite and
a fraction, and the files it writes agree with what it returns (the accuracies themselves are the full run's business,
not a test's)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "finetunes" / "accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("finetunes_accuracy_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the fedlora run's model factory is this module's class
    import torch

    threads = torch.get_num_threads()  # main() sets torch's threads for the process: given back after this module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        torch.set_num_threads(threads)


def expected_rows(bench) -> list[str]:
    setting = bench.QUICK
    sites = len(bench.GROUPS)
    rows = ["base", *(f"site {i}" for i in range(sites)), "pooled fine-tune", "average"]
    for lam in setting.lambdas:
        rows += [
            f"{m} lambda={lam}" for m in ("task_arithmetic", "ties", "dare_linear", "dare_ties", *bench.SPECTRAL, "breadcrumbs", "della")
        ]
    rows += ["model_stock", "sce", "karcher", "multislerp"]
    rows += ["fisher", "regmean", bench.SELECTED, *(f"LoRA site {i}" for i in range(sites)), "LoRA pooled"]
    rows += [f"LoRA one shot {c}" for c in ("average_factors", "stack", "svd")] + [bench.SHRUNK]
    for combine in bench.FED_COMBINES:
        rows += [f"fedlora one shot {combine}", f"fedlora {setting.fed_rounds} rounds {combine}"]
    return rows


def test_tokens_are_a_cls_and_sixteen_patch_ids(bench):
    images = np.random.default_rng(0).integers(0, 17, size=(5, 8, 8))
    ids = bench.tokens(images)
    assert ids.shape == (5, bench.SEQ) and (ids[:, 0] == bench.CLS).all()
    assert ids[:, 1:].min() >= 0 and ids[:, 1:].max() < bench.CLS
    # the first patch token is the top-left 2x2 block, 3 levels per pixel, row-major
    q = np.digitize(images[0, :2, :2], [4, 12]).ravel()
    assert ids[0, 1] == int(q @ np.array([27, 9, 3, 1]))


def test_sites_see_only_their_label_groups(bench):
    data = bench.split(0, bench.QUICK)
    y_pool = data["pool"][1]
    for group, part in zip(bench.GROUPS, data["parts"]):
        assert len(part) > 0 and set(np.unique(y_pool[part]).tolist()) <= set(group)
    assert set(np.unique(data["test"][1]).tolist()) == set(range(10))  # the union of the tasks
    # the parts index the training pool site by site; each site's validation share is held out of it
    assert np.array_equal(np.concatenate(data["parts"]), np.arange(len(y_pool)))
    y_val = data["validation"][1]
    assert set(np.unique(y_val).tolist()) == set(range(10))
    assert len(y_val) == pytest.approx(bench.VALIDATION * (len(y_val) + len(y_pool)), abs=len(bench.GROUPS))


def test_quick_run_writes_a_complete_finite_table(bench, tmp_path):
    report = bench.main(["--quick", "--seeds", "0", "--out-dir", str(tmp_path)])
    rows = expected_rows(bench)
    assert list(report["summary"]) == rows
    for key, (mean, std) in report["summary"].items():
        assert math.isfinite(mean) and 0.0 <= mean <= 1.0 and std == 0.0, key
    [run] = report["runs"]
    assert list(run["accuracy"]) == rows and len(run["site_samples"]) == len(bench.GROUPS)
    goal = report["targets"]
    assert goal["best_merge"] in rows and goal["best_site"].startswith("site ")
    assert isinstance(goal["best_merge_above_every_site"], bool) and len(goal["best_merge_above_every_site_per_seed"]) == 1
    # one exact-against-average_factors cell per exact combine (stack, svd) and per kind (LoRA one shot, fedlora x2)
    assert [c["cell"] for c in goal["exact_lora_cells"]] == [
        f"{kind} {exact}"
        for kind in ("LoRA one shot", "fedlora one shot", f"fedlora {bench.QUICK.fed_rounds} rounds")
        for exact in ("stack", "svd")
    ]
    merges = [k for k in rows if k.split(" ")[0] in bench.MERGES]
    assert list(run["validation_accuracy"]) == merges and run["chosen_merge"] in merges
    assert run["accuracy"][bench.SELECTED] == run["accuracy"][run["chosen_merge"]]
    assert run["validation_accuracy"][run["chosen_merge"]] == max(run["validation_accuracy"].values())
    assert goal["chosen_merges"] == [run["chosen_merge"]] and len(goal["chosen_merge_above_every_site_per_seed"]) == 1
    norms = run["update_norm"]
    assert set(norms) == {k for k in rows if k.startswith(("LoRA one shot", "fedlora"))}
    assert all(math.isfinite(v) and v >= 0 for v in norms.values())
    assert norms[bench.SHRUNK] == pytest.approx(norms["LoRA one shot average_factors"])
    errors = run["lora_relative_error"]
    assert set(errors) == {f"LoRA one shot {c}" for c in ("average_factors", "stack", "svd")} and errors["LoRA one shot stack"] < 1e-5
    saved = json.loads((tmp_path / "finetunes_accuracy.json").read_text(encoding="utf-8"))
    assert saved["summary"] == {k: list(v) for k, v in report["summary"].items()} and saved["meta"]["quick"] is True
    table = (tmp_path / "accuracy.md").read_text(encoding="utf-8")
    for key in rows:
        assert f"| {key} | {report['summary'][key][0]:.3f} |" in table, key
    # the page is rendered again from the JSON alone (no training): the same text
    again = tmp_path / "again"
    again.mkdir()
    bench.main(["--render", str(tmp_path / "finetunes_accuracy.json"), "--out-dir", str(again)])
    assert (again / "accuracy.md").read_text(encoding="utf-8") == table
