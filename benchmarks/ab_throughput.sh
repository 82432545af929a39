#!/bin/bash
# Whole-process throughput of two checkouts, alternating (A B A B ...), on the shared workload:
#   bash benchmarks/ab_throughput.sh TREE_A TREE_B THREADS PAIRS
# Each run is a fresh process of TREE/benchmarks/bench_throughput.py with PYTHONPATH=TREE/src
# (SmolLM2 fp32, 16 prompts x 64 tokens, default graphs); each line says the time and the load.
# Run it again with the trees swapped: the order of a pair matters on a machine whose rate drifts.
set -euo pipefail
A=$1; B=$2; THREADS=$3; PAIRS=$4
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
export HF_HUB_OFFLINE=1 TRITON_INTERPRET=1
for _ in $(seq 1 "$PAIRS"); do
  for T in "$A" "$B"; do
    echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) tree $T threads $THREADS"
    PYTHONPATH=$T/src "$PY" "$T/benchmarks/bench_throughput.py" --peers warmcap --threads "$THREADS" --rounds 1 \
      2>&1 | grep -E "tokens/s" | tail -1
  done
done
