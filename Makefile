# `make run` and `make test` are the two commands of the README; both set up .venv first.
.PHONY: setup run run-emulated stop demo test test-fast bench lint

setup:
	@bash scripts/setup.sh

run: setup
	bash scripts/run_local.sh cpu

run-emulated: setup
	bash scripts/run_local.sh emulated

stop:
	-[ -f /tmp/kairos-prometheus/pid ] && kill $$(cat /tmp/kairos-prometheus/pid) && rm /tmp/kairos-prometheus/pid
	-RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled .venv/bin/ray stop

demo: setup
	.venv/bin/kairos demo

test: setup  # the unit layer beside the Ray and vLLM layers (scripts/test_suite.sh)
	bash scripts/test_suite.sh

test-fast: setup  # the unit layer: no Ray cluster, no vLLM engine (tests/conftest.py), on two processes
	.venv/bin/python -m pytest -m unit -q -n 2

bench: setup
	for n in 2 64 256 1024; do .venv/bin/python -m kairos_ray.bench.decision --decode-nodes $$n --json; done
	.venv/bin/python -m kairos_ray.bench.sim_speed

lint: setup
	.venv/bin/ruff check kairos_ray tests
	.venv/bin/ruff format --check kairos_ray tests
	.venv/bin/mypy kairos_ray
