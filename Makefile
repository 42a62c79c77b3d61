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
# Both spread the tests over pytest-xdist workers; the tests that time signals, grace periods
# and hangs share one worker (`xdist_group("timing")`), so they run one at a time. `make test`
# takes a worker more than the 2 cores CI has: its tests spend much of their time waiting on
# the processes they start, and a third worker fills that time (measured from a fresh clone on
# 2 idle cores: 9:37 against 10:20 with 2 workers; green at a load of 7). `make test-fast`
# keeps busy on 2, where a third only adds a third collection.
TEST_WORKERS ?= 3
FAST_TEST_WORKERS ?= 2

# Every command here writes Python's bytecode caches, even where PYTHONDONTWRITEBYTECODE asks
# not to: a module is compiled the first time it is imported, and never again by the hundreds
# of interpreters the tests start (pytest's rewritten test modules included). So the packages
# are installed without compiling them (pip would compile every module of every package, most
# never imported, for half the install's time).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install test test-fast demo lint clean gpu-check

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile "$(TORCH_SPEC)" -e ".[dev]"
	@# The install works, and what every process imports is compiled once, before the
	@# test workers would each compile it side by side.
	$(BIN)/python -c "import gpukit, gpukit.cli.__main__, torch.distributed.fsdp"
	@# The browser the report's test opens the page in (tests/watch/test_report_browser.py,
	@# skipped without it); installed where this runs as root on Debian or Ubuntu.
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && { apt-get install -y -qq \
		--no-install-recommends chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null && \
		apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; }; } || \
		echo "chromium not installed (not root, or no apt-get): the report's browser test skips"
	touch $@

install: $(STAMP)

# `make test` runs ruff and the formatter's check first (a second), so a change that breaks
# the style fails before the suite starts; mypy (about 25 s of one core from a fresh clone,
# seconds once its cache is warm) runs beside the suite, on the CPU time the suite's tests
# leave idle while they wait on the processes they start, and its verdict is printed after
# the suite's. Either failing fails `make test`.
test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	@$(BIN)/mypy > $(VENV)/mypy.out 2>&1 & types=$$!; \
	echo "$(BIN)/mypy (beside the tests)"; \
	echo "$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup"; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup; suite=$$?; \
	wait $$types; typed=$$?; echo "$(BIN)/mypy:"; cat $(VENV)/mypy.out; \
	test $$suite -eq 0 && test $$typed -eq 0

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(FAST_TEST_WORKERS) -m "not processes"

# About a minute on 2 CPU cores: 150 steps of the gpt workload into runs/demo/, started afresh.
DEMO_OUT ?= runs/demo
DEMO_STEPS ?= 150

demo: $(STAMP)
	@if [ -e $(DEMO_OUT) ]; then echo "make demo: removing the previous demo's $(DEMO_OUT)/"; rm -rf $(DEMO_OUT); fi
	$(BIN)/gpukit devices
	$(BIN)/gpukit train --workload gpt --max-steps $(DEMO_STEPS) --out $(DEMO_OUT)
	@$(BIN)/python -c "import json, gpukit as gk; m = json.load(open('$(DEMO_OUT)/metrics.json')); \
	d = gk.device(m['devices'][0]); \
	print(f\"speed: {m['samples_per_s']:.0f} samples/s on {d.name or d} ({d}), {m['precision']} precision\")"
	@echo "files: $(DEMO_OUT)/metrics.json  $(DEMO_OUT)/metrics.csv  $(DEMO_OUT)/loss.png  $(DEMO_OUT)/config.toml  $(DEMO_OUT)/checkpoints/"
	@echo "next:  $(BIN)/gpukit train --workload gpt --max-steps 300 --out $(DEMO_OUT) --resume   # continue this run"
	@echo "       $(BIN)/gpukit plan --workload gpt --devices 1,2   # memory and speed per strategy, before running"
	@echo "       README.md, then docs/ (docs/training-runtime.md: your own model and loop)"

gpu-check:
	PYTHONPATH=src $(GPU_PYTHON) -m gpukit.bench.gpu_check $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
