#!/usr/bin/env bash
# Reproduce the paper's Tables 3-4 and Figures 4-6 in simulation (2P2D, the shipped A100 profile).
# Usage: scripts/reproduce_paper.sh [OUT_DIR]   (default docs/reproduction; a few minutes on 2 cores)
# KAIROS_PYTHON=/path/to/python runs with that interpreter (e.g. another checkout's .venv) instead of setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/kairos_python.sh
out=${1:-docs/reproduction}
for workload in lpld lphd hpld hphd bursty; do
    "$python" -m kairos_ray.cli sim --workload "$workload" --rps 1,2,4,6,8,10,12,16 \
        --policies pd,sq:1,sq:4,sl:512,sl:1024,sl:2048,kairos,oracle --requests 2000 --seed 1 \
        --out "$out/$workload" > "$out-$workload.log" 2>&1 || { cat "$out-$workload.log"; exit 1; }
    rm -f "$out-$workload.log"
    rm -f "$out/$workload/requests.csv"  # per-request rows: large; rerun kairos sim to get them
    echo "reproduce: $workload done"
done
"$python" -m kairos_ray.sim.report "$out" --rps 6 | tee "$out/tables.md"
