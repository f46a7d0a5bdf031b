# The two set-up commands of README.md live here: `make run` and `make test`. Both create the venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU install path: pin torch to the CPU build (any other torch request downloads several GB of CUDA wheels).
CONSTRAINTS ?= constraints/cpu.txt
PROMPT ?= a small red circle at the top left on a blue background
PORT ?= 8000
# pytest-xdist workers for `make test`: 2 on CI's 2 cores (each with one torch thread); 0 runs it in one process.
# 3 measured no faster here (pytest 1640 s against 1584 s) and failed a test that counts streams waiting under load.
TEST_WORKERS ?= 2

.PHONY: setup run generate test bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $@

run: setup
	$(VENV)/bin/diffusiond serve --port $(PORT)

generate: setup
	$(VENV)/bin/diffusiond generate "$(PROMPT)" --out out.png --previews previews

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: setup
	$(VENV)/bin/diffusiond bench compare
