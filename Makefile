# rayfuse: `make run` (set up, then run the quickstart job on a local Ray) and `make test` (set up, then the tests).
# `make docs` builds the documentation site (mkdocs.yml) into site/ with --strict: a broken link fails it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rayfuse-installed
ARGS   ?=
PYTEST_ARGS ?=
# The tested versions: `make run`, `make test` and CI install exactly these (a pip constraints file, every platform and
# Python >= 3.10 in one file), so a fresh machine gets what the suite passed on. pyproject.toml keeps the open ranges
# for users who install rayfuse elsewhere. `make lock` refreshes it from pyproject.toml; `make test LOCK=
# VENV=.venv-latest` tests the newest versions the ranges allow instead, in a virtualenv of their own.
LOCK   ?= requirements-lock.txt
# torch and torchvision as tested (their builds must match each other; the lock holds them to these)
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
CONSTRAINT := $(if $(LOCK),-c $(LOCK),)

.PHONY: setup run test test-unit test-ray lint typecheck format docs docs-config bench clean lock

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	# torch and torchvision together from PyPI so their builds match (a CPU-only torch from elsewhere breaks
	# torchvision's compiled ops); the standard build runs on CPU too.
	$(BIN)/python -m pip install $(CONSTRAINT) "torch>=2.4" "torchvision>=0.19"
	$(BIN)/python -m pip install $(CONSTRAINT) -e ".[dev]"
	$(BIN)/python -c "import torch, torchvision, torchvision.ops; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	touch $(STAMP)

# Rewrite the lock from pyproject.toml with uv's resolver (every platform, Python >= 3.10), torch as TORCH_PINS says.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv>=0.9"
	printf '%s\n' $(TORCH_PINS) > $(VENV)/torch-pins.txt
	$(BIN)/uv pip compile pyproject.toml --all-extras --universal --python-version 3.10 --constraint $(VENV)/torch-pins.txt \
		--custom-compile-command "make lock" --quiet -o $(LOCK)

setup: $(STAMP)

run: setup
	$(BIN)/rayfuse run $(ARGS)

# `make test`: the tests that start no Ray on TEST_WORKERS pytest-xdist workers (0: in this process), then the tests that
# start Ray (the `ray` marker; tests/conftest.py adds it to every such test) in one process with one session Ray: two
# Rays never share the cores, and the Ray tests' actors have both. Both parts always run; either failing fails the
# target (pytest's 5, nothing selected, is no failure: PYTEST_ARGS may name one file).
TEST_WORKERS ?= 2
test: setup
	@$(BIN)/python -m pytest -q -m "not ray" -n $(TEST_WORKERS) $(PYTEST_ARGS); rest=$$?; \
	$(BIN)/python -m pytest -q -m ray $(PYTEST_ARGS); ray=$$?; \
	for code in $$rest $$ray; do [ $$code -eq 0 ] || [ $$code -eq 5 ] || exit $$code; done

test-unit: setup
	$(BIN)/python -m pytest -q -m "not ray" -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-ray: setup
	$(BIN)/python -m pytest -q -m ray $(PYTEST_ARGS)

# ruff's rules (pyproject [tool.ruff]), the formatter's check (the tree is formatted: `make format`), then mypy over the
# package (pyproject [tool.mypy])
lint: setup
	$(BIN)/ruff check rayfuse actors tests benchmarks docs/hooks.py
	$(BIN)/ruff format --check rayfuse actors tests benchmarks docs/hooks.py
	$(BIN)/mypy

# mypy alone (also part of `lint`)
typecheck: setup
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format rayfuse actors tests benchmarks docs/hooks.py

# the site: docs/ with the generated configuration reference and the API reference from the docstrings
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

# rewrite docs/configuration.md from the schema's field descriptions (tests/test_docs_site.py checks it is current)
docs-config: setup
	$(BIN)/python -m rayfuse.docs_gen

bench: setup
	bash benchmarks/run_all.sh

clean:
	rm -rf $(VENV) runs .pytest_cache site
