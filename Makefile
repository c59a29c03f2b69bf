PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One pytest worker a core (at most 4): the suite is CPU-bound (compiling), and on 2 cores a
# third worker, meant to compute while others wait on the processes they start, made it slower
# (2026-11-28, idle: 2 workers 9.8 and 9.5 min, 15.7-16.3 CPU-min; 3 workers 9.9 and 10.3 min,
# 17.7-18.4 CPU-min).
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')

.PHONY: demo test bench lint setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,notebooks,eval]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/mmnnx train --output-dir runs/demo

# The package's and the tests' bytecode written first: the processes tests start (about 140 in
# the launch and CLI files) import them, and where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines) each would compile the sources again (0.75 s a process measured).
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q mmnnx multimesh_compat tests > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/dispatch.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/pipeline.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/memory.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/lora_memory.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/scan_layers.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/init.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/first_call.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/first_call_phases.py
	$(PY) benchmarks/packed_reads.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/precision.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/moe.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) benchmarks/partition.py
	$(PY) benchmarks/multiprocess.py
	$(PY) benchmarks/pretrained_load.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
