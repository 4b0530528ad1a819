#!/usr/bin/env bash
# Prefix-aware Kairos in simulation: the multi-turn workload with the shipped A100 profile, on 2P2D (where the
# decode pool saturates first) and on 1P3D (where the prefill pool does, the paper's case).
# Usage: scripts/reproduce_prefix.sh [OUT_DIR]   (default docs/prefix; about 5 minutes on 2 cores)
# KAIROS_PYTHON=/path/to/python runs with that interpreter (e.g. another checkout's .venv) instead of setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/kairos_python.sh
out=${1:-docs/prefix}
policies=pd+blind,pd+prefix,sl:1024+prefix,kairos+blind,kairos+prefix,oracle+prefix
# name, prefill nodes, decode nodes, rates
for cell in "multiturn 2 2 2,4,6,8,10,12,14,16" "multiturn-1p3d 1 3 4,8,12,14,16,18,20"; do
    read -r name prefill decode rates <<< "$cell"
    "$python" -m kairos_ray.cli sim --workload multiturn --prefill "$prefill" --decode "$decode" --rps "$rates" \
        --policies "$policies" --requests 2000 --seed 1 --out "$out/$name" > "$out-$name.log" 2>&1 \
        || { cat "$out-$name.log"; exit 1; }
    rm -f "$out-$name.log" "$out/$name/requests.csv"  # per-request rows: large; rerun kairos sim to get them
done
"$python" -m kairos_ray.sim.report "$out" | tee "$out/table.md"
