#!/usr/bin/env bash
# Start a local Ray with the prefill_node / decode_node resources and its dashboard, deploy a Kairos 2P2D app,
# and send it requests. The app keeps running afterwards; `make stop` shuts it down.
#   scripts/run_local.sh            the app on four real vLLM CPU engines (serve_configs/2p2d-cpu.yaml)
#   scripts/run_local.sh emulated   the app on emulated A100 engines (serve_configs/2p2d-emulated.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keep every Ray socket on this machine
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}   # one local cluster on loopback: no token, for every client alike
export RAY_SERVE_PROXY_USE_GRPC=${RAY_SERVE_PROXY_USE_GRPC:-1}   # kairos_ray.serve.CLUSTER_ENV: set where Ray starts
export RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=${RAY_SERVE_METRICS_EXPORT_INTERVAL_MS:-1000}   # kairos_ray.serve.CLUSTER_ENV
export RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=${RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD:-0}   # kairos_ray.serve.CLUSTER_ENV
export RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=${RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP:-0}   # kairos_ray.serve.CLUSTER_ENV
URL=http://127.0.0.1:8000
DASHBOARD=http://127.0.0.1:8265   # Ray's dashboard: its Serve page, and where `serve status` and `ray list` ask
METRICS=http://127.0.0.1:8080/metrics   # this node's Prometheus metrics (ray_kairos_*, ray_vllm_*)
PROMETHEUS=http://127.0.0.1:9090   # a local Prometheus scraping them, where the prometheus package is installed
PROM_DIR=/tmp/kairos-prometheus
case "${1:-cpu}" in
    cpu) CONFIG=serve_configs/2p2d-cpu.yaml MODEL=tiny-llama WORDS=600 BENCH=(--workload lpld --rps 4 --requests 40 --context 2048)
         READY_S=900 ;;
    emulated) CONFIG=serve_configs/2p2d-emulated.yaml MODEL=deepseek-v2-lite WORDS=3000
              BENCH=(--workload bursty --rps 10 --requests 30) READY_S=120 ;;
    *) echo "usage: $0 [cpu|emulated]" >&2; exit 2 ;;
esac

if ! ray status --address auto >/dev/null 2>&1; then
    echo "run: starting a local Ray with 2 prefill and 2 decode node slots"
    ray start --head --node-ip-address=127.0.0.1 --disable-usage-stats \
        --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=8265 --metrics-export-port=8080 \
        --resources='{"prefill_node": 2, "decode_node": 2}' >/dev/null
fi
echo "run: Ray's dashboard: $DASHBOARD (Serve page: $DASHBOARD/#/serve)"
if command -v prometheus >/dev/null && ! curl -sf -o /dev/null "$PROMETHEUS/-/ready"; then
    mkdir -p "$PROM_DIR"
    printf '%s\n' 'global: {scrape_interval: 5s}' 'scrape_configs:' \
        '  - {job_name: ray, static_configs: [{targets: ["127.0.0.1:8080"]}]}' >"$PROM_DIR/prometheus.yml"
    prometheus --config.file="$PROM_DIR/prometheus.yml" --web.listen-address=127.0.0.1:9090 \
        --storage.tsdb.path="$PROM_DIR/data" >"$PROM_DIR/log" 2>&1 &
    echo $! >"$PROM_DIR/pid"
fi
if command -v prometheus >/dev/null; then
    echo "run: Prometheus: $PROMETHEUS (query e.g. sum by (route) (rate(ray_kairos_decisions_total[1m])))"
fi
echo "run: deploying $CONFIG (vLLM engines take a minute or two to start on 2 cores)"
serve run --non-blocking --address auto "$CONFIG" >/tmp/kairos-serve-run.log 2>&1 \
    || { tail -20 /tmp/kairos-serve-run.log; exit 1; }

start=$(date +%s)
until curl -sf -o /dev/null -D /tmp/kairos-run-headers "$URL/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\": \"$MODEL\", \"prompt\": \"warm up\", \"max_tokens\": 1}" \
        && grep -qi '^x-kairos-fallback: 0' /tmp/kairos-run-headers; do  # until every engine has reported
    if (( $(date +%s) - start > READY_S )); then
        echo "run: the app did not come up within $READY_S s; see /tmp/kairos-serve-run.log and /tmp/ray/session_latest/logs/serve" >&2
        exit 1
    fi
    sleep 2
done
echo "run: the app answered after $(( $(date +%s) - start )) s"

echo
echo "run: one request, with the route Kairos chose in the x-kairos-* headers:"
curl -s -D - "$URL/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"$(printf 'word %.0s' $(seq 1 "$WORDS"))\", \"max_tokens\": 8}" \
    | grep -Ei '^x-kairos|^\{' | sed 's/"kairos".*//'
echo
echo "run: a burst of requests (kairos bench ${BENCH[*]}), deflecting where decode nodes are faster:"
kairos bench --url "$URL" "${BENCH[@]}" --seed 1 --out bench-out | tail -2
echo
echo "run: the app is serving OpenAI requests on $URL (model $MODEL); stop it with: make stop"
echo "run: watch it live:  .venv/bin/kairos top --url $URL"
echo "run: Ray's tools:    serve status, ray list actors, the dashboard at $DASHBOARD, metrics at $METRICS"
echo "run: inject faults:  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/kairos chaos --url $URL   (Ray here is on loopback)"
