# Two commands on a fresh machine with Python >= 3.10 and pip:  make demo  |  make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: demo test bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[plot,test,hf,grid,ray,llama,serve]'
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: $(STAMP)
	$(BIN)/expertcache demo --out demo-out

# two workers, a file each at a time (module fixtures shared, the longest file first: tests/conftest.py)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_replay.py

# on a GPU machine, with its own python3 (installs nothing): every GPU figure, PASS/FAIL lines
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) demo-out .pytest_cache .hypothesis
