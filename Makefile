# The two commands a newcomer needs: `make demo` and `make test` (both create .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_FLAGS := --disable-pip-version-check -q

.PHONY: demo test venv clean

$(VENV)/.installed-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) --upgrade pip setuptools
	$(PIP) install $(PIP_FLAGS) -e '.[compile]'
	touch $@

$(VENV)/.installed-serve: $(VENV)/.installed-base
	$(PIP) install $(PIP_FLAGS) -e '.[compile,serve]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(PIP) install $(PIP_FLAGS) -e '.[compile,serve,test]'
	touch $@

venv: $(VENV)/.installed-base

# The main job on a model that has learned something: the shipped demo K3.1 (demo/README.md, trained
# on Python's help() topics) -> IREE cpu module -> text, its held-out perplexity next to the random
# synthetic K3.1's, and the server command.
demo: $(VENV)/.installed-serve
	$(VENV)/bin/kimi-compile demo/kimi-k3.1-pydoc --target cpu --max-context 1024 -o demo-out --quiet
	@echo "--- a continuation (sampled, seed 1):"
	$(VENV)/bin/kimi-run demo-out/model.vmfb --prompt "The for statement" -n 120 --temperature 0.7 --top-k 40 --seed 1
	$(VENV)/bin/kimi-compile --demo --target cpu --max-context 1024 -o demo-out/random --quiet
	@echo "--- held-out perplexity (demo/heldout.txt, first 1024 tokens): trained, then random weights"
	@$(VENV)/bin/kimi-run demo-out/model.vmfb --perplexity demo/heldout.txt --ctx 1024 | grep perplexity
	@$(VENV)/bin/kimi-run demo-out/random/model.vmfb --perplexity demo/heldout.txt --ctx 1024 | grep perplexity
	@echo "--- serve it (OpenAI API on http://127.0.0.1:8000/v1):  $(VENV)/bin/kimi-serve demo-out --slots 4"

test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info demo-out
