# Fresh machine: `make demo` or `make test` creates .venv and installs everything.
# Another torch: `make test VENV=.venv-215 TORCH=2.15.0` (CI does this for 2.15.0 and 2.11.0).
VENV ?= .venv
TORCH ?= 2.13.0
# The Triton kernels (accelerators; tested on CPU in Triton's interpreter). torch's CUDA
# wheels bring their own triton; the CPU wheel gets the release that pairs with 2.13.
TRITON ?= 3.8.0
PY := $(VENV)/bin/python
PYTHON ?= python3
# pytest-xdist workers: whole test files per worker, so a module's shared compiles stay
# shared. Most of the suite is single-threaded compile work: 2 workers on a 2-core machine
# run the default suite in ~0.55x the time. WORKERS=1 runs in this process (debugging).
WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS) --dist loadfile,)
# what `make test` selects (CI's torch 2.15 run adds "and not torch_independent"), and
# where from (TESTS: test files or ids, all of tests/ when empty)
MARKS ?= not slow
TESTS ?=

.PHONY: setup demo parity lint test test-slow test-all test-releases test-gpu gpu-check aot-gpu bench load clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, at the tested release: 2.13.0 resolves to a CPU wheel where one is on
	# local disk (these machines); elsewhere, and for 2.15.0, the registry's build comes
	# with several GB of CUDA packages (it runs on CPU too). compile_rng's own install
	# then leaves that torch as it is (it accepts torch>=2.11,<2.16); the check says so.
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==$(TRITON)
	$(PY) -c "import torch; v = torch.__version__.split('+')[0]; assert v == '$(TORCH)', v"
	# compile_rng's C++ random-op kernels for this torch, built now rather than at the
	# first step (~20-40 s; without a C++ compiler this warns and the Python kernels serve)
	$(PY) -c "from compile_rng.eager import native_kernels; native_kernels.load()"
	touch $@

# the demo compiles only what it shows (~1.5 min after set-up on 2 cores); `make parity`
# then trains the loss-curve comparison (several minutes: every configuration compiles)
demo: setup
	$(PY) examples/demo.py
	$(PY) examples/llama_init.py
	@echo "next: make parity - the same loss curve on one process, DDP=2 and TP=2+SP (~5 min on 2 cores)"

parity: setup
	$(PY) examples/train_parity.py --steps 3 --only DDP=2 TP=2+SP

lint: setup
	$(VENV)/bin/ruff check compile_rng passes tests examples benchmarks

# --durations: the slowest tests, printed on every run, so a slow one is seen when it lands
test: setup
	$(VENV)/bin/pytest -q -m "$(MARKS)" $(XDIST) --durations=15 $(TESTS)

# CI's second run; the sweeps (marker `sweep`) and the runs CI leaves out for its budget
# (marker `beyond_ci`) only in test-all
test-slow: setup
	$(VENV)/bin/pytest -q -m "slow and not sweep and not beyond_ci" $(XDIST) --durations=15

test-all: setup
	$(VENV)/bin/pytest -q $(XDIST)

# The releases CI does not run (it runs 2.13, 2.15 and 2.11): the default suite less the
# torch-independent tests on torch 2.12.1 and 2.14.1, each in its own venv (the registry's
# CUDA builds, ~5.4 GB each; they run on CPU)
test-releases:
	$(MAKE) test VENV=.venv-212 TORCH=2.12.1 MARKS="not slow and not torch_independent"
	$(MAKE) test VENV=.venv-214 TORCH=2.14.1 MARKS="not slow and not torch_independent"

# On a CUDA machine: the GPU suite, then the kernel tests (they run on the GPU there).
test-gpu: setup
	$(VENV)/bin/pytest -q tests/gpu tests/test_triton_kernels.py tests/test_stream_conformance.py

# On one NVIDIA GPU whose Python already has torch (2.11-2.15) and triton, no network and
# no venv: installs this checkout into that Python, runs the GPU suite, bench_gpu.py and an
# Nsight Compute count, and writes gpu-check-out/gpu-check.md (under 8 minutes on an H100).
# The first thing to run whenever a GPU is lent.
gpu-check:
	bash benchmarks/gpu_check.sh

# No GPU needed: every Triton kernel variant compiled ahead of time for sm_80/90/100
# (registers, spills, compile time), then sm_90 instructions per element and the H100
# prediction of docs/gpus.md.
aot-gpu: setup
	$(PY) benchmarks/aot_gpu.py
	$(PY) benchmarks/aot_gpu.py --per-element

bench: setup
	$(PY) benchmarks/bench_import.py
	$(PY) benchmarks/bench_random.py
	$(PY) benchmarks/bench_init.py
	$(PY) benchmarks/bench_init_first.py
	$(PY) benchmarks/bench_init_ranks.py
	$(PY) benchmarks/bench_train_step.py --layers 12
	$(PY) benchmarks/bench_random_ops.py
	$(PY) benchmarks/bench_samplers.py
	$(PY) benchmarks/bench_gpu.py

load: setup
	$(PY) benchmarks/load_init.py

clean:
	rm -rf $(VENV) build *.egg-info
