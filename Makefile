# The two commands of the README: `make demo` and `make test`. Both build .venv
# from the pinned lock when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_OUT ?= results/leaderboard
export TF_CPP_MIN_LOG_LEVEL := 3

.PHONY: venv venv-torch demo test test-slow test-all docs bazel-test benchmark clean

# uv installs the lock in a third of pip's time (41 s against 126 s here,
# bytecode compiled as pip does; make venv 49 s in all); --system-certs: the
# machine's own CA store, as pip reads it. uv reads no pip configuration: a
# mirror is UV_INDEX_URL (or UV_DEFAULT_INDEX) in the environment
UV := uv==0.13.8

$(STAMP): requirements.lock setup.py tools/install_privacy_tests.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(UV)
	$(BIN)/uv pip install --python $(BIN)/python --system-certs --compile-bytecode \
	  --no-deps -r requirements.lock
	$(BIN)/python -m pip install --no-deps --no-build-isolation -e .
	$(BIN)/python tools/install_privacy_tests.py
	touch $(STAMP)

venv: $(STAMP)

# The HyperFL authors' PyTorch stack, for benchmarks/hyperfl_authors_fedavg.py's
# baseline only (4.6 GB: PyPI's torch brings its CUDA libraries); PYTHON
# must be 3.8 to 3.11, which torch 2.0.1 has wheels for
TORCH_VENV := .venv-torch
venv-torch:
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q -r benchmarks/authors-torch-requirements.txt

# The compact leaderboard: every method and defence on the bundled digits,
# attacked alike; a rerun reuses the finished rows.
demo: $(STAMP)
	$(BIN)/tff-privacy leaderboard --out $(DEMO_OUT)

# The fast suite; `test-slow` runs the tests marked slow (end-to-end
# trainings, attacks run to convergence, worker processes: those of 8 s or
# more in a full run on 2 cores, 4.5 s or more in a fast one), `test-all` both; CI runs `test` then `test-slow`. Tests run in
# TEST_WORKERS pytest-xdist processes: most of a test's time is one Python
# thread tracing TFF computations, so two processes use both cores. The
# slowest tests are listed at the end, to keep the fast suite fast.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal \
	--durations=25

test: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-slow: $(STAMP)
	$(PYTEST) -m slow tests

test-all: $(STAMP)
	$(PYTEST) tests

# The documentation site (mkdocs.yml): docs/ and the docstrings (mkdocstrings),
# built offline into site/; --strict fails on any warning (a broken link, a
# docstring naming a parameter the signature lacks). Open site/index.html.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Every BUILD target, offline, with Debian's Bazel 4.2 and the .venv
# interpreter (tools/bazel); installs bazel-bootstrap with apt when missing.
bazel-test: $(STAMP)
	command -v bazel >/dev/null || { apt-get update -q && \
	  apt-get install -y -q bazel-bootstrap bazel-rules-java; }
	bazel test //...

benchmark: $(STAMP)
	$(BIN)/python benchmarks/round_overhead.py
	$(BIN)/python benchmarks/fedem_round_time.py

clean:
	-command -v bazel >/dev/null && bazel clean --expunge
	rm -rf $(VENV) $(TORCH_VENV) results site .pytest_cache
