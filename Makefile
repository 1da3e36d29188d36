# draftsman: the commands a new user needs.
#
#   make demo    install, then run the bundled demo (models in zoo/)
#   make test    install, then run the test suite (CPU is enough)
#   make zoo     install, then retrain the bundled demo models (~1.5 h on CPU)
#
# torch is installed first, pinned by TORCH_SPEC (default torch==2.13.0: on this machine pip finds
# that as a CPU wheel on local disk), so the package install below finds torch satisfied and pulls
# no other build. On a GPU machine where you want CUDA torch:  make install TORCH_SPEC=torch

PYTHON     ?= python
PIP        := $(PYTHON) -m pip
PIP_FLAGS  ?= --quiet
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= test,plots
TEST_WORKERS ?= auto

.PHONY: install test demo zoo lint help

help:
	@sed -n '3,9p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

# Idempotent: pip leaves satisfied requirements alone; a rerun only refreshes the editable link.
install:
	$(PIP) install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(PIP) install $(PIP_FLAGS) -e ".[$(EXTRAS)]"
	@$(PYTHON) -c "import torch, draftsman; print(f'draftsman {draftsman.__version__} with torch {torch.__version__}')"

# pytest-xdist: one worker per core (the tests run torch on one thread each, tests/conftest.py), so
# a 2-core machine runs the suite in about 0.6x the time of one process. TEST_WORKERS=0: one process.
test: install
	$(PYTHON) -m pytest tests -n $(TEST_WORKERS)  # -q comes from pyproject addopts; a second -q hides the summary

# `python -m draftsman` is the `draftsman` command, without relying on PATH having its script.
demo: install
	$(PYTHON) -m draftsman demo

# Trains zoo/python-target and zoo/python-draft from the Python stdlib: ~1.5 h on CPU. Resumable:
# rerunning continues from the last checkpoint; finished stages are skipped. Then counts the
# target's most frequent picks for the draft model's draft_vocab (seconds).
zoo: install
	$(PYTHON) -m draftsman.training.pretrain --config training/configs/pretrain.yaml
	$(PYTHON) -m draftsman vocab --target zoo/python-target --out zoo/python-draft

# Optional: needs ruff (pip install ruff); not part of `make test`.
lint:
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || { echo "lint needs ruff: $(PIP) install ruff"; exit 1; }
	$(PYTHON) -m ruff check draftsman drafters verifier heads training tests
