# The two entry points: `make demo` and `make test`. Both build .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-gpu bench-gpu bench-dry clean

# The top-level folder `operator/` would shadow the standard library's `operator` module for any
# `python -m ...` started here (the current directory goes first on sys.path), so every tool runs
# through its script in .venv/bin, and the venv is created from another directory.
$(STAMP): pyproject.toml
	cd / && $(PYTHON) -m venv $(CURDIR)/$(VENV)
	# torch first, so that nothing pulls another build: a torch already in .venv (e.g. a CUDA build
	# installed by hand, README "Install without make") is kept, else the CPU build that lies on disk.
	$(VENV)/bin/python -I -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/demo.py

test: install
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m "not gpu and not slow" tests

test-gpu: install
	$(VENV)/bin/pytest -q -m gpu tests

# Every figure of BENCHMARKS.md's current-results table (`kvpilot bench all`), in one process on one
# GPU. On the project's device image run `source benchmarks/device_setup.sh` first: it installs
# kvpilot into the image's python and puts `kvpilot` on PATH (no .venv there). About 6 minutes on an
# H200, most of it the two offline runs; BENCH_ARGS='--quick' takes about 3, e.g.
#   make bench-gpu BENCH_OUT=$OUT/bench.json BENCH_ARGS='--figures decode-b1,offline'
BENCH_OUT ?= bench-results.json
BENCH_ARGS ?=
bench-gpu:
	kvpilot bench all --out $(BENCH_OUT) $(BENCH_ARGS)

# The same figures on a tiny random Llama on the CPU, in seconds: checks the benchmark code, not speed.
bench-dry: install
	$(VENV)/bin/kvpilot bench all --dry-run --out $(BENCH_OUT) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
