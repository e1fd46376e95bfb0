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
	$(PIP) install $(PIP_FLAGS) -e '.[compile,test]'
	touch $@

venv: $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(PY) -m kimi_iree.frontend.demo

test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info demo-out
