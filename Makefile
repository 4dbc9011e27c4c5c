# Two entry points, each self-sufficient on a fresh machine:
#   make demo  - pipeline training with an injected failure and its recovery (embedded defaults)
#   make test  - the test suite, every test (the full tier: what CI runs)
# Both create .venv if missing and install the project with every extra (server, demo, dev).
# A training rank needs none of them: `pip install swiftlog` is logstore, trainer_client and replay.
# make test-fast runs the fast tier, what a developer runs on every change: every test not marked slow.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.swiftlog-installed

.PHONY: demo test test-fast lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 first: this pin resolves to the CPU wheel kept on disk on this kind of machine
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[server,demo,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/swiftlog demo

test: $(STAMP) lint
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test-fast: $(STAMP) lint
	$(PY) -m pytest -q -ra -m "not slow"

bench: $(STAMP)
	$(PY) bench/store_bench.py
	$(PY) bench/client_overhead.py
	$(PY) bench/replay_bench.py
	$(PY) bench/recovery_bench.py
	$(PY) bench/hybrid_bench.py
	$(PY) bench/fsdp_bench.py
	$(PY) bench/multihost_bench.py
	$(PY) bench/groups_bench.py
	$(PY) bench/api_bench.py
	$(PY) bench/sim_bench.py
	$(PY) bench/table.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
