# kvlab: `make book` executes the notebooks and builds the book into _build/html;
# `make test` runs the tests, builds the book with CPU-sized notebooks and checks the site
# in a headless browser. `make book FULL=1` runs every notebook with `-p small False`.
# `make test` runs pytest in the background (its output goes to _build/pytest.log and is printed
# when it ends) while the notebooks execute, JOBS at a time (default 2).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.ONESHELL:
.DEFAULT_GOAL := book

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.installed
FULL_FLAG := $(if $(filter 1 yes true True,$(FULL)),--full)
JOBS ?= 2

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
	start=$$SECONDS
	# the cores are shared by pytest and the notebooks' kernels: idle OpenMP threads sleep, never spin
	export OMP_WAIT_POLICY=PASSIVE
	mkdir -p _build
	# the converted models, once, before the tests and the notebooks load them side by side
	$(PY) -c 'import kvlab; kvlab.load_model(); kvlab.load_model("gemma3-270m")'
	echo "make: pytest -q tests in the background, output in _build/pytest.log (TRITON_INTERPRET=$${TRITON_INTERPRET:-unset})"
	$(PY) -m pytest -q --durations=15 tests > _build/pytest.log 2>&1 &
	pytest_pid=$$!
	trap 'kill $$pytest_pid 2>/dev/null || true' EXIT
	notebooks=0
	$(PY) scripts/run_notebooks.py --jobs $(JOBS) $(FULL_FLAG) || notebooks=$$?
	echo "make: notebooks and book done after $$((SECONDS - start))s (exit code $$notebooks)"
	if [ $$notebooks != 0 ]; then
		kill $$pytest_pid 2>/dev/null || true
		wait $$pytest_pid || true
		exit $$notebooks
	fi
	# the browser check of the built site while pytest finishes
	site=0
	$(PY) scripts/check_site.py || site=$$?
	tests=0
	wait $$pytest_pid || tests=$$?
	trap - EXIT
	cat _build/pytest.log
	echo "make: pytest done after $$((SECONDS - start))s (exit code $$tests)"
	if [ $$tests != 0 ]; then exit $$tests; fi
	if [ $$site != 0 ]; then exit $$site; fi
	echo "make: test passed in $$((SECONDS - start))s"

clean:
	rm -rf _build book/executed
