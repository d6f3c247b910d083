#!/usr/bin/env bash
# Run the benchmarks in sequence.
#   benchmarks/run_all.sh            # the round benchmarks' full runs, results to benchmarks/results/*.json (about
#                                    # 20-30 minutes on 2 cores); the other benchmarks: benchmarks/README.md
#   benchmarks/run_all.sh --quick    # every benchmark's quick mode, as listed in benchmarks/quick.txt (the list
#                                    # tests/test_benchmarks_quick.py runs), each into its own folder under a new
#                                    # temporary directory (QUICK_OUT overrides it); never over the full runs' results
# PYTHON selects the interpreter (default: .venv/bin/python); Flower runs only if benchmarks/.flwr-venv exists.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON="${PYTHON:-.venv/bin/python}"  # exported: a .sh benchmark (gpu/check.sh) runs its Python with it too
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ "${1:-}" == "--quick" ]]; then
    root="${QUICK_OUT:-$(mktemp -d -t rayfuse-bench-quick-XXXXXX)}"
    failed=()
    while read -r script args <&3; do  # fd 3: the scripts keep their own stdin
        [[ -z "$script" || "$script" == \#* ]] && continue
        out="$root/$(echo "${script#benchmarks/}" | tr '/' '_' | sed 's/\.[a-z]*$//')"
        mkdir -p "$out"
        read -r -a argv <<< "${args//\{out\}/$out}"
        echo "== $script ${argv[*]}"
        started=$SECONDS
        if [[ "$script" == *.sh ]]; then runner=(bash); else runner=("$PYTHON"); fi
        if "${runner[@]}" "$script" "${argv[@]}"; then
            echo "== $script: ok in $((SECONDS - started)) s"
        else
            echo "== $script: FAILED (exit $?) after $((SECONDS - started)) s"
            failed+=("$script")
        fi
    done 3< benchmarks/quick.txt
    echo "results under $root"
    if (( ${#failed[@]} )); then
        echo "failed: ${failed[*]}"
        exit 1
    fi
else
    "$PYTHON" benchmarks/bench_aggregate.py
    "$PYTHON" benchmarks/bench_round.py
    "$PYTHON" benchmarks/compare_flower.py
fi
