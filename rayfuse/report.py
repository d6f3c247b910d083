"""Run reporting: the progress display, the final table, ``metrics.parquet`` and the comparison plot."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from rayfuse.io import atomic_write_bytes

__all__ = [
    "Printer",
    "format_table",
    "format_client_summary",
    "format_partition",
    "write_metrics_parquet",
    "plot_comparison",
    "TABLE_METRICS",
]

TABLE_METRICS = ("accuracy", "nll", "entropy", "ece")
# shown in progress lines; the generative methods (epgan) report D-MSE / modes (toy set) or FD / IS (images)
_PROGRESS_METRICS = ("accuracy", "nll", "train_loss", "d_mse", "modes", "fd", "is", "dp_epsilon")


class Printer:
    """Prints run events as one line each (works the same in a terminal and in Ray job logs)."""

    _QUIET_KINDS = {"stage_start", "method_start", "client_trained"}

    def __init__(self, stream: TextIO | None = None, *, verbose: bool = False, enabled: bool = True) -> None:
        self.stream = stream or sys.stdout
        self.verbose = verbose
        self.enabled = enabled

    def __call__(self, event: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        kind = event.get("kind", "")
        if kind in self._QUIET_KINDS and not self.verbose:
            return
        line = self.format(event)
        if line:
            print(line, file=self.stream, flush=True)

    @staticmethod
    def format(event: Mapping[str, Any]) -> str:
        t = f"[{event.get('t', 0):7.1f}s]"
        kind = event.get("kind", "")
        message = event.get("message", "")
        who = event.get("method") or event.get("stage") or ""
        if kind == "stage_end":
            return f"{t} {event.get('stage')}: done in {event.get('seconds', 0):.1f} s"
        if kind == "stage_start":
            return f"{t} {event.get('stage')}: started"
        if kind == "progress":
            metrics = event.get("metrics") or {}
            shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k in _PROGRESS_METRICS)
            clients = f"  clients {event['clients']}" if "clients" in event else ""
            return f"{t} {who}: {message}{clients}  {shown}".rstrip()
        if kind == "method_done":
            metrics = event.get("metrics") or {}
            acc = f"  accuracy {metrics['accuracy']:.4f}" if "accuracy" in metrics else ""
            return f"{t} {who}: finished in {event.get('seconds', 0):.1f} s{acc}"
        if kind == "method_start":
            return f"{t} {who}: started"
        if kind == "client_trained":
            return f"{t} client {event.get('client')}: local model trained, {message}"
        if kind in ("client_failed", "client_retry", "client_dropped", "client_restarted", "client_dead", "update_rejected"):
            return f"{t} ! {kind.replace('_', ' ')}: client {event.get('client')}{' in ' + event['step'] if event.get('step') else ''}: {message}"
        if kind in ("resumed", "local_models_restored", "warning", "info"):
            return f"{t} {who + ': ' if who else ''}{message}"
        return ""


def _fmt(value: float | None, std: float | None = None) -> str:
    if value is None or not np.isfinite(value):
        return "-"
    text = f"{value:.4f}"
    if std is not None and np.isfinite(std):
        text += f" ± {std:.3f}"
    return text


def _has(key: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda entry: key in entry


# The "extra" column: (shown for this entry?, how it reads), in order.
_EXTRAS: list[tuple[Callable[[Mapping[str, Any]], bool], Callable[[Mapping[str, Any]], str]]] = [
    (_has("vote_accuracy"), lambda e: f"vote acc {e['vote_accuracy']:.4f}"),
    (_has("dp_sgd_epsilon"), lambda e: f"DP-SGD epsilon {e['dp_sgd_epsilon']:.3g} (max over clients)"),  # train.dp
    (_has("upload_epsilon"), lambda e: f"upload epsilon {e['upload_epsilon']:.3g}"),  # a one-shot method's dp upload
    (lambda e: bool(e.get("rounds")), lambda e: f"{e['rounds']} round{'s' if e['rounds'] != 1 else ''}"),
    (lambda e: "transfer_note" in e.get("info", {}), lambda e: e["info"]["transfer_note"]),  # distill: the transfer data
    (
        _has("epsilon"),
        lambda e: (
            f"({e['epsilon']:.3g}, {e['delta']:.0e})-DP"
            + (" (stopped at the epsilon budget)" if "stopped" in e.get("info", {}).get("dp", {}) else "")
        ),
    ),  # central DP-FedAvg
    (_has("tuned_accuracy"), lambda e: f"tuned acc {e['tuned_accuracy']:.4f}"),  # fine-tuned on the public sample (gems)
    (_has("hidden_units"), lambda e: f"{int(e['hidden_units'])} hidden units"),
    (lambda e: e.get("info", {}).get("intersection_found") is False, lambda e: "no intersection"),
    (_has("hausdorff"), lambda e: f"hausdorff {e['hausdorff']:.3f}"),  # kl gmm and its baselines: distance to the true means
    (_has("completion_ll"), lambda e: f"completion ll {e['completion_ll']:.3f}"),  # kl topics: held-out document completion
    (
        _has("num_components"),
        lambda e: f"{int(e['num_components'])} components" + (f" (size error {e['size_error']:.2f})" if "size_error" in e else ""),
    ),
    # epgan on the toy set: critic-map D-MSE and modes covered by the generator; on images: Frechet distance, IS
    (_has("d_mse"), lambda e: f"d_mse {e['d_mse']:.3f}, modes {int(e.get('modes', 0))}, high quality {e.get('high_quality', 0):.2f}"),
    (_has("fd"), lambda e: f"fd {e['fd']:.2f}, is {e['is']:.2f}, classes {int(e.get('classes', 0))}"),
]


def format_table(methods: Mapping[str, Mapping[str, Any]]) -> str:
    """Methods x metrics as an aligned text table (local shows mean ± std over clients)."""
    header = ["method", *TABLE_METRICS, "extra", "time (s)"]
    rows = []
    for label, entry in methods.items():
        name = label + (" (oracle)" if entry.get("oracle") else "")
        cells = [name]
        for metric in TABLE_METRICS:
            cells.append(_fmt(entry.get(metric), entry.get(f"{metric}_std")))
        extra = [fmt(entry) for shown, fmt in _EXTRAS if shown(entry)]
        cells.append(", ".join(extra) or "")
        cells.append(f"{entry.get('seconds', 0):.1f}")
        rows.append(cells)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def format_client_summary(methods: Mapping[str, Mapping[str, Any]], evaluation: str) -> str:
    """One line per method scored by federated evaluation: its aggregate accuracy over the clients' held-out splits
    and the lowest and highest client's (the whole table is ``client_metrics`` in ``results.json``)."""
    key = "federated_accuracy" if evaluation == "both" else "accuracy"
    lines = []
    for label, entry in methods.items():
        rows = [r for r in entry.get("client_metrics") or [] if "accuracy" in r]
        if not rows:
            continue
        low = min(rows, key=lambda r: r["accuracy"])
        high = max(rows, key=lambda r: r["accuracy"])
        lines.append(
            f"  {label}: {_fmt(entry.get(key))} over {len(rows)} clients ({sum(int(r['count']) for r in rows)} samples); "
            f"lowest client {low['client']} {low['accuracy']:.4f}, highest client {high['client']} {high['accuracy']:.4f}"
        )
    if not lines:
        return ""
    return "federated evaluation (accuracy on the clients' held-out splits, count-weighted):\n" + "\n".join(lines)


def format_partition(counts: np.ndarray, class_names: Sequence[str], num_val: Sequence[int]) -> str:
    """Class counts per client (train + val), one row per client."""
    names = [str(c)[:6] for c in class_names]
    header = ["client", *names, "total", "val"]
    rows = [[str(i), *(str(int(v)) for v in row), str(int(row.sum())), str(int(num_val[i]))] for i, row in enumerate(counts)]
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def write_metrics_parquet(path: Any, summaries: Sequence[Mapping[str, Any]]) -> None:
    """One row per method x round x metric (x client): columns method, method_name, round, metric, value, client."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        (s["label"], s["method"], int(r["round"]), r["metric"], float(r["value"]), r.get("client"))
        for s in summaries
        for r in s.get("history", [])
    ]
    table = pa.table(
        {
            "method": pa.array([r[0] for r in rows], pa.string()),
            "method_name": pa.array([r[1] for r in rows], pa.string()),
            "round": pa.array([r[2] for r in rows], pa.int32()),
            "metric": pa.array([r[3] for r in rows], pa.string()),
            "value": pa.array([r[4] for r in rows], pa.float64()),
            "client": pa.array([r[5] for r in rows], pa.int32()),
        }
    )
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    atomic_write_bytes(path, buffer.getvalue().to_pybytes())


def plot_comparison(
    path: Any,
    methods: Mapping[str, Mapping[str, Any]],
    summaries: Sequence[Mapping[str, Any]],
    title: str = "",
    evaluation: str = "central",
) -> None:
    """Final test accuracy per method (local with its spread over clients); with multi-round methods, their test
    accuracy and test loss (NLL) per round. With ``evaluation: federated`` the accuracies are the aggregate over the
    clients' held-out splits, and each client's own accuracy is a dot on its method's bar (``both``: the bars are
    central, the dots federated)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def series(summary: Mapping[str, Any], metric: str) -> list[tuple[int, float]]:
        return sorted((r["round"], r["value"]) for r in summary.get("history", []) if r["metric"] == metric and r.get("client") is None)

    curves: dict[str, list[tuple[int, float]]] = {}
    losses: dict[str, list[tuple[int, float]]] = {}
    for s in summaries:
        for target, metric in ((curves, "accuracy"), (losses, "nll")):
            points = series(s, metric)
            if len(points) > 1:
                target[s["label"]] = points
    panels = 1 + bool(curves) + bool(losses)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = axes[0, 0]
    labels = list(methods)
    values = [methods[m].get("accuracy", np.nan) for m in labels]
    errors = [methods[m].get("accuracy_std", 0.0) for m in labels]
    colors = ["#bbbbbb" if methods[m].get("oracle") else "#4C72B0" for m in labels]
    bars = ax.bar(range(len(labels)), values, color=colors)
    for i, (bar, value, err) in enumerate(zip(bars, values, errors)):
        if err:
            ax.errorbar(i, value, yerr=err, color="black", capsize=4, linewidth=1)
        ax.text(
            bar.get_x() + bar.get_width() / 2, min(value + (err or 0), 0.97) + 0.01, f"{value:.3f}", ha="center", va="bottom", fontsize=8
        )
        dots = [r["accuracy"] for r in methods[labels[i]].get("client_metrics") or [] if "accuracy" in r]
        if dots:
            ax.scatter([i] * len(dots), dots, s=8, color="black", zorder=3)
    ax.set_xticks(
        range(len(labels)),
        [m + ("\n(oracle)" if methods[m].get("oracle") else "") for m in labels],
        fontsize=8,
        rotation=30 if len(labels) > 6 else 0,
    )
    ax.set_ylim(0, 1.05)
    what = {"federated": "held-out accuracy (federated)", "both": "test accuracy (dots: clients' held-out)"}.get(
        evaluation, "test accuracy"
    )
    ax.set_ylabel(what)
    ax.set_title(f"final {what}" + (f" ({title})" if title else ""), fontsize=10)
    panels_of = (
        [(curves, "accuracy", "test accuracy"), (losses, "nll", "test loss (NLL)")]
        if evaluation != "federated"
        else [(curves, "accuracy", "held-out accuracy (federated)"), (losses, "nll", "held-out loss (NLL, federated)")]
    )
    for col, (data, metric, name) in enumerate(panels_of, start=1):
        if not data:
            continue
        ax = axes[0, col if curves else col - 1]
        for label, points in data.items():
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o" if len(points) <= 30 else None,
                markersize=3,
                linewidth=1.2,
                label=label,
            )
        for m in labels:
            value = methods[m].get(metric, np.nan)
            if m not in data and np.isfinite(value):
                ax.axhline(value, linestyle="--", linewidth=0.8, color="gray")
                ax.text(ax.get_xlim()[1] if ax.lines else 1, value, f" {m}", fontsize=7, va="center", color="gray")
        if metric == "nll":
            ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.set_title(f"multi-round methods: {name} (dashed: one-shot)", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
