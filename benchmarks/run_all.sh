#!/usr/bin/env bash
# Run every benchmark in sequence; results go to benchmarks/results/*.json.
#   benchmarks/run_all.sh            # full runs (about 20-30 minutes on 2 cores)
#   benchmarks/run_all.sh --quick    # a smoke run: small aggregation cases, rayfuse target cells only, 3 rounds
# PYTHON selects the interpreter (default: .venv/bin/python); Flower runs only if benchmarks/.flwr-venv exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

if [[ "${1:-}" == "--quick" ]]; then
    "$PYTHON" benchmarks/bench_aggregate.py --quick --repeats 3
    "$PYTHON" benchmarks/bench_round.py --cells targets --rounds 3 --warmup 1 --quiet-timeout 0
    "$PYTHON" benchmarks/compare_flower.py --rounds 3
else
    "$PYTHON" benchmarks/bench_aggregate.py
    "$PYTHON" benchmarks/bench_round.py
    "$PYTHON" benchmarks/compare_flower.py
fi
