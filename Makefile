# kvlab: `make book` executes the notebooks and builds the book into _build/html;
# `make test` runs the tests, builds the book with CPU-sized notebooks and checks the site
# in a headless browser. `make book FULL=1` runs every notebook with `-p small False`.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.ONESHELL:
.DEFAULT_GOAL := book

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.installed
FULL_FLAG := $(if $(filter 1 yes true True,$(FULL)),--full)

.PHONY: book test setup clean

setup:
	@test -x $(PY) || { echo "make: creating $(VENV)"; python3 -m venv $(VENV); }
	if ! cat requirements.txt requirements-nodeps.txt | cmp -s - $(STAMP); then
		echo "make: installing requirements.txt and requirements-nodeps.txt into $(VENV)"
		$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
		$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-nodeps.txt
		cat requirements.txt requirements-nodeps.txt > $(STAMP)
	fi
	$(PY) scripts/fetch_mathjax.py

book: setup
	@$(PY) scripts/run_notebooks.py $(FULL_FLAG)

test: setup
	@if [ -z "$${TRITON_INTERPRET+x}" ] && [ "$$($(PY) -c 'import torch; print(int(torch.cuda.is_available()))')" != 1 ]; then
		export TRITON_INTERPRET=1
	fi
	echo "make: pytest -q tests (TRITON_INTERPRET=$${TRITON_INTERPRET:-unset})"
	$(PY) -m pytest -q tests
	$(PY) scripts/run_notebooks.py $(FULL_FLAG)
	$(PY) scripts/check_site.py

clean:
	rm -rf _build book/executed
