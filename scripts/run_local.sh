#!/usr/bin/env bash
# Start a local Ray with the prefill_node / decode_node resources, deploy the emulated 2P2D app,
# and send it a few requests. The app keeps running afterwards; `make stop` shuts it down.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keep every Ray socket on this machine
URL=http://127.0.0.1:8000
MODEL=deepseek-v2-lite

if ! ray status --address auto >/dev/null 2>&1; then
    echo "run: starting a local Ray with 2 prefill and 2 decode node slots"
    ray start --head --node-ip-address=127.0.0.1 --include-dashboard=false --disable-usage-stats \
        --resources='{"prefill_node": 2, "decode_node": 2}' >/dev/null
fi
echo "run: deploying serve_configs/2p2d-emulated.yaml"
serve run --non-blocking --address auto serve_configs/2p2d-emulated.yaml >/tmp/kairos-serve-run.log 2>&1 \
    || { tail -20 /tmp/kairos-serve-run.log; exit 1; }

for _ in $(seq 1 120); do  # until every engine has reported to the router
    if curl -sf -o /dev/null -D /tmp/kairos-run-headers "$URL/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\": \"$MODEL\", \"prompt\": \"warm up\", \"max_tokens\": 1}" \
        && grep -qi '^x-kairos-fallback: 0' /tmp/kairos-run-headers; then
        break
    fi
    sleep 1
done

echo
echo "run: one request, with the route Kairos chose in the x-kairos-* headers:"
curl -s -D - "$URL/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"$(printf 'word %.0s' $(seq 1 3000))\", \"max_tokens\": 8}" \
    | grep -Ei '^x-kairos|^\{' | sed 's/"kairos".*//'
echo
echo "run: a burst of 30 requests (kairos bench), deflecting where decode nodes are faster:"
kairos bench --url "$URL" --workload bursty --rps 10 --requests 30 --seed 1 --out bench-out | tail -2
echo
echo "run: the app is serving OpenAI requests on $URL (model $MODEL); stop it with: make stop"
