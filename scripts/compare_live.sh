#!/usr/bin/env bash
# Replay one workload against a live app under several policies, one deployment after another, and print
# each run's summary: the live counterpart of `kairos sim --policies`.
#   scripts/compare_live.sh [CONFIG] [POLICIES] [-- kairos bench options]
#   scripts/compare_live.sh serve_configs/2p2d-cpu.yaml pd,kairos -- --workload lpld --rps 6 --requests 80
# Needs a local Ray with the prefill_node / decode_node resources (make run starts one). Summaries go
# to compare-out/<policy>/summary.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
CONFIG=${1:-serve_configs/2p2d-cpu.yaml}
POLICIES=${2:-pd,kairos}
shift $(( $# < 2 ? $# : 2 ))
[[ ${1:-} == -- ]] && shift
BENCH=("$@")
(( ${#BENCH[@]} )) || BENCH=(--workload lpld --rps 6 --requests 80 --context 2048)
URL=http://127.0.0.1:8000
ray status --address auto >/dev/null 2>&1 || { echo "compare: no local Ray; run 'make run' first" >&2; exit 1; }
shutdown() {  # the serve CLI's shutdown needs the dashboard; a driver does not
    python -c 'import ray; from ray import serve; ray.init(address="auto", logging_level="ERROR"); serve.shutdown()' \
        >/dev/null 2>&1
}

for policy in ${POLICIES//,/ }; do
    config=$(mktemp --suffix=.yaml)
    python - "$CONFIG" "$policy" "$config" <<'PY'
import sys, yaml
src, policy, dst = sys.argv[1:]
data = yaml.safe_load(open(src))
for app in data["applications"]:
    app["args"].setdefault("kairos", {}).setdefault("policy", {})["name"] = policy
yaml.safe_dump(data, open(dst, "w"))
PY
    shutdown  # every policy starts on fresh engines
    echo "compare: deploying $CONFIG with policy $policy"
    serve run --non-blocking --address auto "$config" >/tmp/kairos-compare.log 2>&1 || { tail -20 /tmp/kairos-compare.log; exit 1; }
    model=$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']['decode_config']['model_loading_config']['model_id'])" "$config")
    start=$(date +%s)
    until curl -sf -o /dev/null -D /tmp/kairos-compare-headers "$URL/v1/completions" -H 'content-type: application/json' \
            -d "{\"model\": \"$model\", \"prompt\": \"warm up\", \"max_tokens\": 1}" \
            && grep -qi '^x-kairos-fallback: 0' /tmp/kairos-compare-headers; do
        (( $(date +%s) - start < 900 )) || { echo "compare: the app did not come up within 900 s" >&2; exit 1; }
        sleep 2
    done
    kairos bench --url "$URL" "${BENCH[@]}" --label "$policy" --seed 1 --out "compare-out/$policy" | tail -2 | head -1
    rm -f "$config"
done
shutdown
