# One command sets up and runs the demo (`make demo`), one runs the tests (`make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
# 2.13.0 is a CPU build pip finds locally on the reference CPU boxes; an unpinned torch pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
# SGLang's own code for the contract tests (pure Python; its CUDA kernels and torch pin are left out).
SGLANG_CONTRACT_SPEC ?= sglang==0.5.23
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export DO_NOT_TRACK = 1
export RAY_AUTH_MODE = disabled
export RAY_USAGE_STATS_ENABLED = 0
# Bytecode caching on, whatever the shell says: every test process, Ray actor and CLI run imports the checkout, and
# compiling it from source each time costs ~1.5 CPU-s per process.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo lint fmt test test-fast gpu-check bench clean-runs server-stop

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,sglang-contract]"
	$(PY) -m pip install -q --no-deps "$(SGLANG_CONTRACT_SPEC)"
	touch $@

demo: setup
	$(VENV)/bin/rollflow demo

# Whole files per worker (module fixtures such as a Prefect worker or a 2-rank megatron run are built once);
# 4 workers on 2 cores: the end-to-end tests partly wait on Prefect, Ray, subprocesses and their own time windows.
# Measured on a 2-core box (same tree, back to back): 3 workers kept the CPUs 91% busy and took 23.7 min, 4 kept
# them 96% busy and took 20.9 min, every test passing. Files go out in the order tests/conftest.py sorts them
# (longest first): --no-loadscope-reorder stops xdist re-sorting them by test count.
TEST_WORKERS ?= 4

# Style gate (pyproject.toml [tool.ruff]): a lint or formatting violation fails `make test` before pytest runs.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Apply the formatter and ruff's safe fixes; what remains is listed by `make lint`.
fmt: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# Two stages, both always run (scripts/test_stages.sh; the exit status is a failure if either failed): the suite
# without the cluster tests on the xdist workers, and the cluster tests (tests/test_cluster.py: PostgreSQL, S3, a
# Prefect server, a work pool and three Ray nodes in network namespaces). Where the script may make a CPU cgroup
# (root) the cluster stage runs beside the suite with 4x its CPU weight; otherwise, or with TEST_STAGES=serial,
# after it, alone. Beside 3 workers on 2 cores with no weight the cluster module took 32 min instead of 7.5 alone.
test: lint
	@PY=$(PY) TEST_WORKERS=$(TEST_WORKERS) bash scripts/test_stages.sh

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

bench: setup
	$(PY) -m benchmarks

server-stop:
	$(VENV)/bin/rollflow server stop

clean-runs:
	rm -rf runs

# GPU checks (Megatron parity, step-1 exactness, throughput): run on any CUDA machine from the checkout
# (docs/megatron.md: which wheels; scripts/use_checkout.sh maps the checkout to rollflow.* without installing).
gpu-check:
	bash scripts/gpu_checks.sh
