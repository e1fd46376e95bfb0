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

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(PIP) install $(PIP_FLAGS) -e '.[compile,serve,test]'
	touch $@

venv: $(VENV)/.installed-base

# The main job on a built-in default: the synthetic K3.1 checkpoint -> IREE cpu module -> text.
demo: $(VENV)/.installed-base
	$(VENV)/bin/kimi-compile --demo --target cpu -o demo-out
	$(VENV)/bin/kimi-run demo-out/model.vmfb --prompt "The Kimi delta attention" -n 24
	$(VENV)/bin/kimi-run demo-out/model.vmfb --bench --prompt-tokens 64 --gen-tokens 32 --json

test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info demo-out
