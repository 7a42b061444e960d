# Every target does its own set-up: a fresh clone needs only python3 (3.11+) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check --quiet
STAMP := $(VENV)/.installed

.PHONY: test lint bench-decode

$(STAMP): requirements.txt requirements-dev.txt constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements-dev.txt -c constraints.txt
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check model training service benchmarks tests
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

bench-decode: $(STAMP)
	$(PY) -m benchmarks.decode
