# Meshpact: `make app` opens the dashboard, `make test` runs the tests.
# Both create .venv and install the project first (idempotent).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.meshpact-installed
PORT   ?= 8501

.PHONY: install app test test-fast lint bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[test,torchtitan]'
	touch $(STAMP)

app: install
	$(VENV)/bin/streamlit run app/main.py --server.address 127.0.0.1 --server.port $(PORT) \
	    --server.headless true --browser.gatherUsageStats false

# Two workers, a test file per worker at a time (module fixtures such as the dashboard server and
# Chromium are set up once per file): the live tests wait on timeouts and processes as much as
# they compute, so two cores run two files at once. The longest files go first
# (tests/conftest.py), so neither worker is left alone with one at the end.
# The project's modules are compiled first: the suite starts some 300 interpreters (ranks, agents,
# fork servers), and where PYTHONDONTWRITEBYTECODE is set none writes the bytecode it compiled, so
# each compiled every module it imports again (0.15 s of CPU apiece on 2 cores).
test: install
	$(PY) -m compileall -q -j 0 core live app simulator meshpact
	$(VENV)/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder

# pyflakes and pycodestyle over the whole tree (pyproject.toml's [tool.ruff]), the formatter's check
# (`ruff format .` writes what it wants), then mypy over the whole tree ([tool.mypy]; its cache in
# .mypy_cache); .ci/run runs it first
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test-fast: install
	$(VENV)/bin/pytest -m "not slow"

bench: install
	@set -e; for b in bench/*.py; do echo "== $$b"; $(PY) $$b; done

# The docs site: docs/results.md rendered from bench/results/*.json, then mkdocs-material with
# --strict (a broken link or a missing page fails) into site/. Installs the docs extra first.
DOCS_STAMP := $(VENV)/.meshpact-docs-installed

$(DOCS_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) scripts/render_results.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache build *.egg-info
