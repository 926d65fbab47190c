# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs; nothing relies on a hand install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: demo test unit lint bench clean system labextension compat

# What the demo needs: nbdist and its runtime dependencies (a user's install).
$(RUNTIME): pyproject.toml
	@echo "make: installing nbdist and its runtime dependencies into $(VENV) (about a minute the first time)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch first, pinned, so pip never pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e .
	touch $(RUNTIME)

# What the tests add: pytest, Playwright, JupyterHub, the interop libraries (the dev extras).
$(STAMP): $(RUNTIME)
	@echo "make: adding the test dependencies (the dev extras) to $(VENV)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(RUNTIME)
	@OMP_NUM_THREADS=1 $(BIN)/python -m nbdist.demo

# System packages the tests use (Chromium, Slurm, munge, Open MPI, sudo, acl, configurable-http-proxy):
# installed as root with apt-get and npm when missing; elsewhere the tests that need them skip and say so.
system:
	@sh tests/system-packages.sh

# The fast tier first (lint, types, the unit tests: about a minute, before any system package is installed),
# stopping at its first failure; then the system packages and the rest. TEST_WORKERS=2 runs the rest on two
# pytest-xdist workers (each module, and the tests that share one set of nodes, on one worker: tests/conftest.py),
# then the tests marked `alone`, which time the machine, by themselves: 27-28 minutes against 44 serially here,
# but not yet the default: each of three fresh-clone runs failed one or two tests the load provoked (all fixed but
# one: Ray Client's proxier failing to start a second client's server, docs/faults.md row 97).
TEST_WORKERS ?= 1
test: $(STAMP)
	$(BIN)/ruff check nbdist tests benchmarks notebooks deploy
	$(BIN)/mypy
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -x tests/unit
	@sh tests/system-packages.sh
ifeq ($(TEST_WORKERS),1)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests --ignore=tests/unit
else
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 -n $(TEST_WORKERS) \
	  -m "not alone" tests --ignore=tests/unit
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 -m alone tests --ignore=tests/unit
endif

# The tests that need no cluster, no browser and no system package: under a minute, for the edit-test loop.
unit: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

# The compatibility tier: the unit tests, the core integration tests (start and its three methods, cells, failure,
# recovery, DDP and FSDP against one process, %dist_why and %dist_equiv, which reach into torch's privates, the
# tutorials' programs) and one notebook, on another torch in a venv of its own. COMPAT_TORCH=2.14.1 is a CUDA build
# on this machine's disk (5.5 GB; it runs on the CPU). A release newer than pip's cap here (/etc/xdg/pip): `make compat COMPAT_TORCH=2.15.0 PIP_CONFIG_FILE=/dev/null`.
COMPAT_TORCH ?= 2.14.1
COMPAT := .venv-torch-$(COMPAT_TORCH)
COMPAT_TESTS := tests/unit tests/integration/test_lifecycle.py tests/integration/test_cells.py \
	tests/integration/test_recovery.py tests/integration/test_peer_recovery.py tests/dist/test_ddp.py \
	tests/dist/test_sharded.py tests/integration/test_why.py tests/integration/test_equiv.py \
	tests/integration/test_start_methods.py tests/integration/test_tutorial_shapes.py

$(COMPAT)/.installed: pyproject.toml
	@echo "make: installing torch $(COMPAT_TORCH), nbdist and the dev extras into $(COMPAT)"
	$(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install --quiet --upgrade pip
	$(COMPAT)/bin/pip install --quiet "torch==$(COMPAT_TORCH)"
	$(COMPAT)/bin/pip install --quiet -e ".[dev]"
	$(COMPAT)/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$(COMPAT_TORCH)', torch.__version__"
	touch $@

compat: $(COMPAT)/.installed
	OMP_NUM_THREADS=1 $(COMPAT)/bin/python -m pytest -q -p no:cacheprovider --durations=10 $(COMPAT_TESTS) \
	  "tests/notebooks/test_notebooks.py::test_notebook_runs_top_to_bottom[01_data_parallel.ipynb]"

# The prebuilt lab extension (nbdist/labextension, committed): rebuild after editing js/src. Needs Node and npm;
# `make demo` and `make test` do not (they use the committed build).
labextension: $(STAMP)
	cd js && npm install --no-audit --no-fund && npx tsc && \
	  node node_modules/@jupyterlab/builder/lib/build-labextension.js \
	    --core-path $$(../$(BIN)/python -c 'import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), "staging"))') .
	$(BIN)/pip install --quiet --no-deps -e .

lint: $(STAMP)
	$(BIN)/ruff check nbdist tests benchmarks notebooks deploy
	$(BIN)/mypy

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/startup.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/cell_latency.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/ddp_throughput.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/compression.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/compression_gpu.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/instrumentation.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/faults.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/recovery.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/preemption.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/checkpoint.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/multinode.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/tutorial_shapes.py

clean:
	rm -rf $(VENV) benchmarks/results
