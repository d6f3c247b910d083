#!/usr/bin/env bash
# The GPU path, measured in one table (benchmarks/gpu/check.py): the quickstart with GPU clients (num_gpus 0.25),
# aligned fusion of 8 resnet18s with the cost matrices on the GPU against the CPU path, a distillation run and a
# FedAvg round of a 1 GB model. On a machine with a CUDA GPU: under 8 minutes. --cpu: the same table on the CPU with
# small sizes (one to two minutes on 2 cores), as CI runs it.
#
#   benchmarks/gpu/check.sh [--cpu] [--only quickstart aligned distill fedavg] [--timeout 300]
#
# PYTHON overrides the interpreter (default: the repository's .venv, else python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" benchmarks/gpu/check.py "$@"
