"""The engine: loaded models, their workers, schedulers and batching, adapters, metrics. Torch, no HTTP: nothing
here imports service.api (tests/test_import_rules.py checks it)."""
