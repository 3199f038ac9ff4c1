# Fresh machine: `make demo` or `make test` creates .venv and installs everything.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: setup demo test test-slow test-all bench load clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch's CPU wheel for the tested release; installing it first keeps pip from
	# resolving "torch" to a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) examples/demo.py
	$(PY) examples/llama_init.py

test: setup
	$(VENV)/bin/pytest -q -m "not slow"

test-slow: setup
	$(VENV)/bin/pytest -q -m slow

test-all: setup
	$(VENV)/bin/pytest -q

bench: setup
	$(PY) benchmarks/bench_random.py
	$(PY) benchmarks/bench_init.py
	$(PY) benchmarks/bench_init_ranks.py

load: setup
	$(PY) benchmarks/load_init.py

clean:
	rm -rf $(VENV) build *.egg-info
