#!/usr/bin/env bash
# The whole test suite (`make test`): its layers side by side, in three pytest processes.
#
# - the vLLM app layer (`-m "(ray and vllm) or in_vllm_layer"`): real vLLM engines in Serve apps and Ray actors,
#   and the live tests marked `in_vllm_layer`, which even out the two live layers' times;
# - the other live tests: emulated apps on Ray, vLLM engines in process; at Ray's workers' niceness (15), so that
#   the engines it runs in process never starve the vLLM app layer's engines of CPU (a starved engine core looks hung);
# - the unit layer (no Ray, no vLLM), niced so that it never slows what the live layers wait on.
# The live layers spend much of their time waiting on clusters and engines to start, stop and answer; side by side,
# each fills the other's waits. Each process starts Rays of its own (tests/shared_ray.py), on ports of its own.
# The vLLM app layer's output shows as it runs, the others' follow it. Arguments go to every run (after the
# defaults, so `--durations=0` lists every test's time); a run that the arguments leave without tests passes, and
# the status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."

export PYTHONFAULTHANDLER=1  # a native crash in any run prints every thread's stack
logs=$(mktemp -d)
jobs_started=()
# interrupted or failed to start, the background runs go too (a background job of a script ignores the terminal's ^C)
trap 'for pid in "${jobs_started[@]}"; do kill "$pid" 2>/dev/null; done; rm -rf "$logs"' EXIT
trap 'exit 130' INT TERM
# no cache plugin: the runs would overwrite each other's record of failed tests
pytest=(.venv/bin/python -m pytest -p no:cacheprovider)
nice -n 19 "${pytest[@]}" -m unit -q --durations=10 "$@" >"$logs/unit" 2>&1 &
unit=$!
nice -n 15 "${pytest[@]}" -m "(ray or vllm) and not (ray and vllm) and not in_vllm_layer" --durations=20 "$@" \
    >"$logs/live" 2>&1 &
live=$!
jobs_started=("$unit" "$live")
"${pytest[@]}" -m "(ray and vllm) or in_vllm_layer" --durations=20 "$@"
statuses=($?)
for pid in "$live" "$unit"; do
    wait "$pid"
    statuses+=($?)
done
jobs_started=()
for name in "other live tests:live" "unit layer:unit"; do
    echo
    echo "=============================== the ${name%:*} ==============================="
    cat "$logs/${name#*:}"
done
for status in "${statuses[@]}"; do
    if ((status != 0 && status != 5)); then  # 5: pytest collected no test
        exit "$status"
    fi
done
