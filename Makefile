# Two commands on a fresh machine with Python >= 3.10 and pip:  make demo  |  make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SUM    := $(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
# the demo installs what it runs (the core, plots, and the HF extra for its live part); the tests
# install everything (llama-cpp-python builds llama.cpp from source: minutes)
DEMO_STAMP := $(VENV)/.demo-installed-$(SUM)
TEST_STAMP := $(VENV)/.installed-$(SUM)
PIP        := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: demo test bench gpu-check clean

$(DEMO_STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[plot,hf]'
	@rm -f $(VENV)/.demo-installed-*
	@touch $@

$(TEST_STAMP): $(DEMO_STAMP)
	$(PIP) -e '.[plot,test,hf,grid,ray,llama,serve]'
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: $(DEMO_STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/expertcache demo --out demo-out

# compileall: the bytecode a wheel's install writes, which an editable install leaves to the first
# import (and never writes where PYTHONDONTWRITEBYTECODE is set: every command then compiles the
# package again, 0.3-0.5 s a run); it writes only what changed.
# two workers, a file each at a time (module fixtures shared), the README's chapters one by one, the
# longest file first (tests/conftest.py); --no-loadscope-reorder keeps that order (xdist would sort
# the groups by their number of tests, which put the README's chapters, the longest tests, last)
test: $(TEST_STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/bench_replay.py

# on a GPU machine, with its own python3 (installs nothing): every GPU figure, PASS/FAIL lines
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) demo-out .pytest_cache .hypothesis
