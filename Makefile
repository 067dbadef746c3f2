# Two entry points for a fresh machine (see README):
#   make demo   set up .venv and run the 4-worker demo job
#   make test   set up .venv (if needed), build or reuse Horovod, run the whole test suite
#
# HOROVOD=0 skips the Horovod install (its tests then skip, loudly).  The
# first install builds horovod==0.28.1 against the venv's torch (~9 min on 2
# cores); the wheel is cached in ~/.cache/gtopk_plugin/horovod/, so later
# runs (and fresh venvs on the same machine) install it in seconds.
# TF=1 (the default) first installs tensorflow-cpu==2.15.1 (the newest TF
# that Horovod 0.28.1 builds against; see docs/horovod.md) and builds Horovod
# with TensorFlow too, so the Horovod-TF tests run; TF=0 builds without it.
#
# TORCH_SPEC pins the torch build.  On CPU-only machines torch==2.13.0 comes
# from a local CPU wheel; a bare "torch" would download a multi-GB CUDA build.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
STAMP       := $(VENV)/.installed
HOROVOD     ?= 1
TF          ?= 1

.PHONY: setup horovod demo test bench bench-horovod results clean

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

# Idempotent and quick once installed (checks the install matches this torch).
horovod: setup
ifeq ($(HOROVOD),1)
	GTOPK_HOROVOD_TF=$(TF) bash scripts/install_horovod.sh $(VENV)
else
	@echo "HOROVOD=0: not installing Horovod; its tests will be skipped"
endif

test: setup horovod
	$(PY) -m pytest

# gtopk-bench (gtopk_plugin/bench): the measurements a user runs; results
# in gtopk-bench-results/.  The lab's studies: lab/README.md.
bench: setup
	$(VENV)/bin/gtopk-bench bytes-per-step

bench-horovod: horovod
	$(VENV)/bin/gtopk-bench horovod-overhead

# docs/results.md from the JSON in docs/results/
results: setup
	$(PY) -m lab render-results

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
