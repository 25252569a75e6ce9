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
	# The ray extra too: tests/test_ray_serve.py runs two replicas under a local Ray Serve.
	$(BIN)/pip install -q -e '.[test,ray]'
	# The compiled CPU kernels (models/cpu_kernels.cpp), built once now rather than at first use.
	$(BIN)/python -c "from specdec.models import cpu_kernels; print('specdec CPU kernels:', 'ready' if cpu_kernels.load() else 'unavailable, PyTorch paths in use')"
	touch $(STAMP)

install: $(STAMP)

# Plain against speculative decoding (prompt lookup) on one question, int8 on the CPU: both speeds,
# their ratio and whether the two texts are identical.
demo: install
	$(BIN)/specdec generate --prompt "$$(printf 'Question: Explain what a hash table is and how it handles collisions.\nAnswer:')" \
		--max-tokens 128 --quantize int8 --drafter ngram --compare

test: install
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
