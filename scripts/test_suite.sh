#!/usr/bin/env bash
# The whole test suite (`make test`): the unit layer runs beside the Ray and vLLM layers, at the lowest CPU priority.
#
# The Ray and vLLM layers spend much of their time waiting on clusters and engines to start, stop and answer, and
# run one cluster at a time (tests/shared_ray.py); the unit layer (no Ray, no vLLM) fills those gaps in a second
# pytest, niced so that it never slows what the live layers wait on. Its output follows theirs. Arguments go to
# both runs (after the defaults, so `--durations=0` lists every test's time); the status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."

unit_log=$(mktemp)
trap 'rm -f "$unit_log"' EXIT
# no cache plugin: the two runs would overwrite each other's record of failed tests
nice -n 19 .venv/bin/python -m pytest -m unit -q -p no:cacheprovider --durations=10 "$@" >"$unit_log" 2>&1 &
unit=$!
PYTHONFAULTHANDLER=1 .venv/bin/python -m pytest -m "not unit" --durations=30 "$@"
live=$?
wait "$unit"
unit_status=$?
echo
echo "=============================== the unit layer ==============================="
cat "$unit_log"
if ((live != 0)); then
    exit "$live"
fi
exit "$unit_status"
