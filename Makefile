# fedhive developer commands. `make test` is the README's test command; `.ci/run` runs it in CI.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup bytecode proto lint test bench soak infra gpu-check demo wheel wheel-demo

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The checkout's modules compiled ahead (Python reads __pycache__ even where it may not write it):
# with PYTHONDONTWRITEBYTECODE set (this project's machines set it), every service, client job
# and `fedhive` process compiled ~150 of fedhive's modules as it started, ~0.4 s of CPU each (a
# client job 0.94 -> 0.53 s, the job-store 1.36 -> 0.78 s); the suite starts ~700 of them.
# Up-to-date files are skipped; a file edited later is compiled in memory, as without this.
bytecode: setup
	$(PY) -m compileall -q -j 0 libs services tests

# Regenerate libs/fedhive/proto from proto/ (the result is committed; a test fails if it is stale).
proto: setup
	$(PY) proto/generate.py

lint: setup
	$(VENV)/bin/ruff check libs services tests bench proto deploy
	$(VENV)/bin/mypy libs services deploy

# Real RabbitMQ, Redis and S3: starts local RabbitMQ/Redis if they are down; the tests start
# their own SeaweedFS S3 server. pytest's "no tests collected" (exit 5) counts as a failure.
# TEST_WORKERS pytest processes share the tests a file at a time (every test has its own
# namespace, ports and private brokers): about half the suite's time waits on the services, so
# two on 2 cores take ~40 % less time than one; three take longer than two (17.4 -> 20.4 min,
# 2026-11-28) and starve timing-bound fault tests (TEST_WORKERS=0: one process, no xdist). The
# 25 slowest tests are listed at the end (CI's log shows where the suite's time goes).
TEST_WORKERS ?= 2
test: setup bytecode infra
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

infra:
	bash deploy/local/ensure-infra.sh

# The README's first command: `fedhive demo` starts the whole system (docker compose where a
# Docker engine answers; otherwise a POC on this machine: local RabbitMQ and Redis started, or
# installed with apt as root, when missing; an embedded SeaweedFS S3), runs examples/hello-numpy
# then examples/hello-pt with live progress, prints a summary and stops everything it started.
# DEMO_ARGS="--record bench/results/demo.json" writes the wall time; DEMO_ARGS=--local skips
# docker compose.
demo: setup bytecode
	$(VENV)/bin/fedhive demo $(DEMO_ARGS)

# The wheel `pip install fedhive` gets (dist/fedhive-VERSION-py3-none-any.whl): the CLI, SDK and
# services, the generated protobuf and the example jobs (setup.py bundles them); torch, SeaweedFS
# and matplotlib are the extras torch, poc and plot. build/lib is cleared first: a file deleted
# from the tree would otherwise stay in the next wheel.
wheel:
	rm -rf build/lib build/bdist.* dist/fedhive-*.whl
	python3 -m pip wheel -q --no-deps --wheel-dir dist .

# CI's demo: the wheel in a fresh venv (build/wheel-venv), bare then with [torch,poc], and
# `fedhive demo --local` run from outside the repository (deploy/local/wheel-demo.sh).
wheel-demo: wheel infra
	bash deploy/local/wheel-demo.sh

# Each script prints JSON and writes bench/results/<name>.json; bench/RESULTS.md says how to read them.
bench: setup bytecode infra
	for name in blobs jobs heartbeats scheduling rounds large_model hierarchy faults simulate scale task_manager liveness; do $(PY) bench/$$name.py || exit 1; done

# A longer randomised fault run (not part of `make test`): SOAK_TRIALS random scenarios at random
# moments (tests/faults/scenarios.py), every invariant checked after each; writes
# bench/results/faults_soak.json. SOAK_SEED=N replays a run.
SOAK_TRIALS ?= 200
soak: setup infra
	$(PY) bench/faults.py --soak --trials $(SOAK_TRIALS) $(if $(SOAK_SEED),--seed $(SOAK_SEED))

# Proves the NVML path on a machine with a GPU (detection, distinct device ids, CUDA_VISIBLE_DEVICES
# seen by a child); exits 2 with one line where there is no GPU. Tests never need a GPU.
gpu-check: setup
	$(PY) deploy/gpu_check.py
