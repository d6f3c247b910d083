"""The cost of a secure sum (SecAgg+, :mod:`rayfuse.updates.secagg`) against a plain ``np.sum`` of the same vectors.

N = 20 clients x 100,000 float64 entries, the complete graph (k = 19, plain SecAgg) and a sparse one (k = 6); each
stage driven in this process. Times: the clients' side (keys, shares, masking: the sum over the clients, as if run one
after another), the server's side (routing, the sum of the masked vectors, rebuilding the secrets, unmasking,
decoding), and their total as a multiple of ``np.sum`` over the stacked plain vectors; median of ``--repeats``::

    PYTHONPATH=$PWD nice -n 10 .venv/bin/python benchmarks/secagg_cost.py            # ~30 s
    PYTHONPATH=$PWD .venv/bin/python benchmarks/secagg_cost.py --quick --out /tmp/x  # 10,000 entries, 1 repeat

Writes ``secagg_cost.json`` (``machine``, ``rows``) under ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import add_quick_arguments, machine_info, median, out_dir, print_table, write_results  # noqa: E402

from rayfuse.updates.secagg import SecAggClient, SecAggParams, SecAggServer  # noqa: E402


def one_sum(vectors: dict[int, np.ndarray], params: SecAggParams, seed: int) -> dict[str, float]:
    """Client and server seconds of one secure sum; checks it against the plain sum."""
    ids = sorted(vectors)
    seconds = {"client": 0.0, "server": 0.0}

    def timed(side, fn):
        start = time.perf_counter()
        out = fn()
        seconds[side] += time.perf_counter() - start
        return out

    def on_clients(fn):
        return timed("client", fn)

    def on_server(fn):
        return timed("server", fn)

    server = on_server(lambda: SecAggServer(params, ids, seed))
    clients = on_server(lambda: {cid: SecAggClient(cid, params) for cid in ids})  # as before: the setup's time
    setup = on_server(server.setup_message)

    keys = on_clients(lambda: {cid: c.stage_setup(*setup) for cid, c in clients.items()})
    key_msgs = on_server(lambda: server.receive_public_keys(keys))
    shares = on_clients(lambda: {cid: clients[cid].stage_share_keys(m) for cid, m in key_msgs.items()})
    routed = on_server(lambda: server.receive_shares(shares))
    masked = on_clients(lambda: {cid: clients[cid].stage_collect_masked(m, vectors[cid]) for cid, m in routed.items()})
    survivors, dropped = on_server(lambda: server.receive_masked(masked))
    responses = on_clients(lambda: {cid: clients[cid].stage_unmask(survivors, dropped) for cid in survivors})
    result = on_server(lambda: server.receive_unmask(responses))
    plain = np.sum(np.stack(list(vectors.values())), axis=0)
    gap = float(np.max(np.abs(np.asarray(result.total) - plain)))
    assert gap <= result.error_bound, (gap, result.error_bound)
    return {"client_s": seconds["client"], "server_s": seconds["server"], "gap": gap, "error_bound": result.error_bound}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--neighbours", type=int, nargs="+", default=None, help="k values (default: N-1 and 6)")
    parser.add_argument("--repeats", type=int, default=3)
    add_quick_arguments(parser, "20 clients x 10,000 entries, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeats = 10_000, 1
    out = out_dir(args.out, args.quick)
    n = args.clients
    rng = np.random.default_rng(0)
    vectors = {i: rng.uniform(-1.0, 1.0, size=args.size) for i in range(n)}
    stacked = np.stack(list(vectors.values()))
    rows: list[dict[str, Any]] = []
    for k in args.neighbours or [n - 1, min(6, n - 1)]:
        params = SecAggParams(n, k, (k + 1) // 2 + 1, clipping_range=1.0)
        runs = [one_sum(vectors, params, seed) for seed in range(args.repeats)]
        plain = []
        for _ in range(max(args.repeats, 3)):
            start = time.perf_counter()
            np.sum(stacked, axis=0)
            plain.append(time.perf_counter() - start)
        client_s, server_s = median([r["client_s"] for r in runs]), median([r["server_s"] for r in runs])
        rows.append(
            {
                "clients": n,
                "size": args.size,
                "num_neighbours": k,
                "reconstruction_threshold": params.reconstruction_threshold,
                "client_s": client_s,
                "client_per_client_s": client_s / n,
                "server_s": server_s,
                "plain_sum_s": median(plain),
                "ratio": (client_s + server_s) / median(plain),
                "max_gap": max(r["gap"] for r in runs),
                "error_bound": runs[0]["error_bound"],
            }
        )
    print_table(
        rows,
        [
            ("num_neighbours", "k"),
            ("client_per_client_s", "client s (each)"),
            ("server_s", "server s"),
            ("plain_sum_s", "np.sum s"),
            ("ratio", "(clients+server)/np.sum"),
            ("max_gap", "max gap"),
            ("error_bound", "bound"),
        ],
        title=f"secure sum of {n} clients x {args.size} entries",
    )
    path = write_results("secagg_cost", {"machine": machine_info(), "rows": rows}, out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
