# The two entry points: `make demo` and `make test`. Both build .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-gpu clean

# The top-level folder `operator/` would shadow the standard library's `operator` module for any
# `python -m ...` started here (the current directory goes first on sys.path), so every tool runs
# through its script in .venv/bin, and the venv is created from another directory.
$(STAMP): pyproject.toml
	cd / && $(PYTHON) -m venv $(CURDIR)/$(VENV)
	# The CPU build of torch that lies on disk, first, so that nothing pulls a CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/demo.py

test: install
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m "not gpu and not slow" tests

test-gpu: install
	$(VENV)/bin/pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .pytest_cache
