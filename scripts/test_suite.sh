#!/usr/bin/env bash
# The whole test suite (`make test`): the unit layer runs beside the Ray and vLLM layers, at the lowest CPU priority.
#
# The Ray and vLLM layers spend much of their time waiting on clusters and engines to start, stop and answer, and
# run one cluster at a time (tests/shared_ray.py); the unit layer (no Ray, no vLLM) fills those gaps in a second
# pytest, niced so that it never slows what the live layers wait on. Its output follows theirs. Arguments go to
# both runs (after the defaults, so `--durations=0` lists every test's time); the status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."

export PYTHONFAULTHANDLER=1  # a native crash in either run prints every thread's stack
unit_log=$(mktemp)
unit=""
# interrupted or failed to start, the unit run goes too (a background job of a script ignores the terminal's ^C)
trap '[[ -n $unit ]] && kill "$unit" 2>/dev/null; rm -f "$unit_log"' EXIT
trap 'exit 130' INT TERM
# no cache plugin: the two runs would overwrite each other's record of failed tests
nice -n 19 .venv/bin/python -m pytest -m unit -q -p no:cacheprovider --durations=10 "$@" >"$unit_log" 2>&1 &
unit=$!
.venv/bin/python -m pytest -m "not unit" --durations=30 "$@"
live=$?
wait "$unit"
unit_status=$?
unit=""
echo
echo "=============================== the unit layer ==============================="
cat "$unit_log"
if ((live != 0)); then
    exit "$live"
fi
exit "$unit_status"
