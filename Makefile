# Two commands for a new user (see README.md): `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# The test processes, and the worker processes they start by the hundred, import mptier
# from this tree. Where the environment says PYTHONDONTWRITEBYTECODE (some CI images
# do), no bytecode is ever cached and every worker start compiles every module again:
# 0.31 s of CPU per start against 0.18 with the caches, ~900 starts a `make test`.
# Bytecode caches are ignored by git (.gitignore).
unexport PYTHONDONTWRITEBYTECODE
SOURCES := pyproject.toml setup.py mptier/native/build_ffi.py $(wildcard mptier/native/*.c mptier/native/*.h)

.PHONY: run test test-slow lint bench vllm-env vllm-test vllm-cpu-env vllm-cpu-test engine-test test-deps dfs-test clean

$(STAMP): $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q -e '.[test,bench]'
	$(VENV)/bin/python -c "import mptier.native as n; assert n.HAS_NATIVE, n.NATIVE_IMPORT_ERROR"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/mptier run

# Test processes (pytest-xdist). The tests mostly wait on worker processes, pipes and
# disks rather than compute, so more processes than this machine's 2 cores keep them
# busy; tests whose timing matters are given room (or an xdist group) to stand the load.
TEST_JOBS ?= 4
# The slow tests are storms and long fault runs that time workers (heartbeats, I/O
# timeouts of a second): fewer of them at once on two cores.
SLOW_TEST_JOBS ?= 2
# More pytest arguments, e.g. PYTEST_ARGS=--durations=30 or PYTEST_ARGS=tests/test_jobs.py
PYTEST_ARGS ?=
PYTEST := $(VENV)/bin/python -m pytest -q --dist loadgroup $(PYTEST_ARGS)

# Everything but the storms and long fault runs (marker `slow`); `make test-slow` runs
# those, and .ci/run runs both.
test: $(STAMP)
	$(PYTEST) -n $(TEST_JOBS) -m "not slow"

test-slow: $(STAMP)
	$(PYTEST) -n $(SLOW_TEST_JOBS) -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check mptier tests bench

bench: $(STAMP)
	$(VENV)/bin/mptier bench --quick

# System FUSE packages and the JuiceFS binary, so the FUSE and JuiceFS tests run instead
# of skipping (root, or sudo, for apt-get).
test-deps: $(STAMP)
	bash scripts/ci-deps.sh
	bash scripts/juicefs-env.sh

dfs-test: test-deps
	$(VENV)/bin/python -m pytest -q -m "dfs or fuse"

vllm-env:
	bash scripts/vllm-env.sh

# The vLLM suites in test processes too: most of their time is spent importing vLLM
# and torch in subprocesses and waiting on tiers' workers. Each test's shared-memory
# names, engine ids, roots and run directory are its own (pid or uuid in the name).
VLLM_TEST_JOBS ?= 3

vllm-test: vllm-env
	.venv-vllm/bin/python -m pytest -q -n $(VLLM_TEST_JOBS) --dist loadgroup -m vllm $(PYTEST_ARGS)

# vLLM built for CPUs (vllm-cpu 0.32): the plug-in's own vLLM tests on that release too
# (not the anchor and bench ones: they hold vllm-env.sh's 0.33 build, with the C
# extension it builds, to account), and the tests that run real engines with mptier.
PLUGIN_TESTS = tests/test_vllm_integration.py tests/test_vllm_logging.py tests/test_vllm_parity.py

vllm-cpu-env:
	bash scripts/vllm-cpu-env.sh

vllm-cpu-test: vllm-cpu-env
	.venv-vllm-cpu/bin/python -m pytest -q -n $(VLLM_TEST_JOBS) --dist loadgroup -m vllm $(PLUGIN_TESTS) $(PYTEST_ARGS)

engine-test: vllm-cpu-env
	.venv-vllm-cpu/bin/python -m pytest -q -m engine $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info mptier/native/_mptier_cffi*
