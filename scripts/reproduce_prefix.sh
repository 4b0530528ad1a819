#!/usr/bin/env bash
# Prefix-aware Kairos in simulation: the multi-turn workload on 2P2D with the shipped A100 profile.
# Usage: scripts/reproduce_prefix.sh [OUT_DIR]   (default docs/prefix; a few minutes on 2 cores)
# KAIROS_PYTHON=/path/to/python runs with that interpreter (e.g. another checkout's .venv) instead of setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/kairos_python.sh
out=${1:-docs/prefix}
"$python" -m kairos_ray.cli sim --workload multiturn --rps 2,4,6,8,10,12,14,16 \
    --policies pd+blind,pd+prefix,sl:1024+prefix,kairos+blind,kairos+prefix,oracle+prefix --requests 2000 --seed 1 \
    --out "$out/multiturn" > "$out-multiturn.log" 2>&1 || { cat "$out-multiturn.log"; exit 1; }
rm -f "$out-multiturn.log" "$out/multiturn/requests.csv"  # per-request rows: large; rerun kairos sim to get them
"$python" -m kairos_ray.sim.report "$out" | tee "$out/table.md"
