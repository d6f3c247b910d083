"""The final results table."""

from __future__ import annotations

from rayfuse.report import format_table


def test_table_shows_extras_of_fusion_methods():
    table = format_table(
        {
            "average": {"accuracy": 0.5, "seconds": 0.1},
            "gems": {"accuracy": 0.3, "tuned_accuracy": 0.88, "hidden_units": 50.0, "seconds": 1.0, "info": {"intersection_found": False}},
            "local": {"accuracy": 0.2, "accuracy_std": 0.01, "seconds": 0.0},
            "kl": {"hausdorff": 0.51, "num_components": 12.0, "size_error": 0.2, "seconds": 2.0},
        }
    )
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["method", "accuracy"]
    gems = next(line for line in lines if line.startswith("gems"))
    assert "tuned acc 0.8800" in gems and "50 hidden units" in gems and "no intersection" in gems
    assert "0.2000 ± 0.010" in next(line for line in lines if line.startswith("local"))
    assert "hausdorff 0.510, 12 components (size error 0.20)" in next(line for line in lines if line.startswith("kl"))
    assert "tuned" not in next(line for line in lines if line.startswith("average"))
