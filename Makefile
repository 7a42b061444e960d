# Every target does its own set-up: a fresh clone needs only python3 (3.11+) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check --quiet
STAMP := $(VENV)/.installed
CHECKPOINTS ?= checkpoints
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run serve train-quick train-quality test lint kernels bench-decode bench-adapters bench-serve soak

$(STAMP): requirements.txt requirements-dev.txt constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements-dev.txt -c constraints.txt
	$(PIP) install --no-deps -e .  # model, training and service importable from any directory
	touch $(STAMP)

## Our C++ CPU kernels (model/native.py): built once per machine (under a minute), then only imported.
kernels: $(STAMP)
	$(PY) -m model.native

## The main job: build the corpora and train the default models if $(CHECKPOINTS)/ has none, then serve them.
run: train-quick serve

## A fixed number of steps per model with fixed seeds: the same models on every machine, only slower on a busy one.
## The output ends with every check against the trivial baselines and a verdict (exit status 0 either way).
train-quick: kernels
	$(PY) -m training recipe quick --out $(CHECKPOINTS)

train-quality: kernels
	$(PY) -m training recipe quality --out $(CHECKPOINTS)-quality

serve: kernels
	@echo "Playground: http://$(HOST):$(PORT)/   API docs: http://$(HOST):$(PORT)/docs   Metrics: http://$(HOST):$(PORT)/metrics"
	$(PY) -m service --models $(CHECKPOINTS)/models --adapters $(CHECKPOINTS)/adapters --host $(HOST) --port $(PORT)

## The tests (what CI runs).
test: kernels
	$(PY) -m ruff check model training service benchmarks tests
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

bench-decode: $(STAMP)
	$(PY) -m benchmarks.decode

bench-adapters: kernels
	$(PY) -m benchmarks.adapters

bench-serve: kernels
	$(PY) -m benchmarks.serve

soak: $(STAMP)
	$(PY) -m benchmarks.soak
