# Two commands for a fresh machine (see README): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: install demo test lint bench

$(BIN)/gpuguard: setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/gpuguard

install: $(BIN)/gpuguard

demo: install
	bash scripts/demo.sh

test: install
	GPUGUARD_SLURM=1 $(BIN)/pytest -q

lint: install
	$(BIN)/ruff check .

bench: install
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done
