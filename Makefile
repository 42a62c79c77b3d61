# `make test`, `make test-fast` and `make demo` each build .venv on first use, then run.
# Without an NVIDIA GPU the CPU build of torch is installed (the default wheel pulls several GB
# of CUDA libraries); override with `make TORCH_SPEC=... test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= $(if $(HAS_NVIDIA_GPU),torch,torch==2.13.0)
STAMP := $(VENV)/.installed

# `make gpu-check` verifies everything that needs an NVIDIA GPU and writes the evidence under
# benchmarks/results/<date>-<gpu>/. It needs no .venv: it runs from the source tree with the
# first of .venv's python or $(PYTHON) (torch, numpy, rich, matplotlib, nvidia-ml-py, pytest).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

# `make test-fast` runs every test that starts no process: those marked `processes` are left
# out, and tests/conftest.py fails an unmarked test that starts one. `make test` runs them all.
# Both spread the tests over TEST_WORKERS pytest-xdist workers; the tests that time signals,
# grace periods and hangs share one worker (`xdist_group("timing")`), so they run one at a time.
TEST_WORKERS ?= 2

.PHONY: install test test-fast demo lint clean gpu-check

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not processes"

demo: $(STAMP)
	$(BIN)/gpukit doctor
	$(BIN)/gpukit train

gpu-check:
	PYTHONPATH=src $(GPU_PYTHON) -m gpukit.bench.gpu_check $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
