# Two entry points for a fresh machine (see README):
#   make demo   set up .venv and run the 4-worker demo job
#   make test   set up .venv (if needed) and run the whole test suite
#
# TORCH_SPEC pins the torch build.  On CPU-only machines torch==2.13.0 comes
# from a local CPU wheel; a bare "torch" would download a multi-GB CUDA build.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
STAMP       := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	# --no-build-isolation: the build must see the torch above, never fetch another
	$(PIP) install -q --no-build-isolation -e ".[dev,demo,bench]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/gtopk-demo

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) -m benchmarks.bytes_per_step

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
