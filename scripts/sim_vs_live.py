"""The same workload and seed through `kairos sim` and through the live app, side by side.

    .venv/bin/python scripts/sim_vs_live.py --config serve_configs/2p2d-emulated.yaml --rates 1,2,4

Starts a local Ray and Serve in this process with the config's application
(emulated engines replay the simulator's timing, so the two should agree),
replays a synthetic workload at each rate with the load generator, runs the
simulator on the very same requests, and prints both summaries with the
ratio of each figure, the rate the load generator achieved, and the CPU the
serving path spent per streamed token (every Serve process of the app: proxy,
ingress, router, engine replicas). Everything it started is shut down at the
end.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from pathlib import Path

import httpx
import ray
import yaml
from ray import serve

from kairos_ray.bench.loadgen import replay
from kairos_ray.bench.serving_cost import cpu_s, own_cpu_s, serving_processes
from kairos_ray.config import load_config
from kairos_ray.metrics import summarize
from kairos_ray.serve import build_app
from kairos_ray.sim.run import SimSetup, compare_rows
from kairos_ray.workloads.synthetic import synthetic


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="serve_configs/2p2d-emulated.yaml", help="a Serve config of the app")
    parser.add_argument("--rates", default="1,2,4", help="request rates, comma-separated")
    parser.add_argument("--workload", default="bursty")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    (application,) = yaml.safe_load(Path(args.config).read_text())["applications"]
    app_args = application["args"]
    kairos = load_config(args.config)
    model = app_args["decode_config"]["model_loading_config"]["model_id"]
    port = free_port()
    ray.init(num_cpus=2, resources={"prefill_node": 2, "decode_node": 2}, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name="kairos", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # until every engine has reported
            try:
                body = {"model": model, "prompt": "warm up", "max_tokens": 1}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                if r.status_code == 200 and r.headers["x-kairos-fallback"] == "0":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        processes = serving_processes("kairos")
        setup = SimSetup.from_config(kairos, None, 2, 2, args.seed)
        for rps in (float(r) for r in args.rates.split(",")):
            workload = synthetic(args.workload, rps, args.requests, args.seed)
            before = {p: cpu_s(p.pid) for p in processes}
            own = own_cpu_s()
            result = asyncio.run(replay(url, model, workload))
            spent = sum(cpu_s(p.pid) - before[p] for p in processes)
            own = own_cpu_s() - own
            tokens = sum(r.output_tokens for r in result.records)
            live = summarize(result.records, kairos.slo, "live", rps, failed=len(result.failures))
            simulated = setup.simulate(kairos.policy.name, workload)
            sim = summarize(simulated.records, kairos.slo, "sim", rps)
            print(f"\n{args.workload}, {args.requests} requests, seed {args.seed}, {rps:g} req/s "
                  f"({len(result.failures)} failed; sent at {result.achieved_rps:.2f} req/s, "
                  f"P50 send lag {1e3 * result.p50_send_lag_s:.1f} ms)")  # fmt: skip
            print(compare_rows(sim, live))
            print(f"serving path CPU {1e3 * spent / max(1, tokens):.3f} ms per streamed token ({tokens} tokens); "
                  f"load generator {1e3 * own / max(1, tokens):.3f} ms", flush=True)  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
