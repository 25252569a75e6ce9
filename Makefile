# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: it takes the CPU build from this machine's disk instead of a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The compiled CPU kernels (models/cpu_kernels.cpp), built once now rather than at first use.
	$(BIN)/python -c "from specdec.models import cpu_kernels; print('specdec CPU kernels:', 'ready' if cpu_kernels.load() else 'unavailable, PyTorch paths in use')"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/specdec generate --prompt "The history of the printing press" --max-tokens 48 --compare --drafter ngram

test: install
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
