"""Settings: defaults < TSERVE_* environment < flags; validation names the variable; --help and the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.__main__ import parse_settings, server_config
from service.api.connections import ConnectionLimits, GuardedH11Protocol
from service.settings import Settings, SettingsError, settings_table

ROOT = Path(__file__).resolve().parents[2]
ENV_VARS = [
    "TSERVE_MODELS",
    "TSERVE_ADAPTERS",
    "TSERVE_HOST",
    "TSERVE_PORT",
    "TSERVE_DEVICE",
    "TSERVE_DTYPE",
    "TSERVE_MAX_BATCH_SIZE",
    "TSERVE_MAX_WAIT_MS",
    "TSERVE_MAX_QUEUE",
    "TSERVE_MAX_QUEUE_PER_KEY",
    "TSERVE_MAX_NEW_TOKENS",
    "TSERVE_MAX_BEAMS",
    "TSERVE_MAX_INPUTS",
    "TSERVE_MAX_INPUT_TOKENS",
    "TSERVE_REQUEST_TIMEOUT_S",
    "TSERVE_MAX_RESIDENT_ADAPTERS",
    "TSERVE_MAX_BODY_BYTES",
    "TSERVE_MAX_ADAPTER_UPLOAD_BYTES",
    "TSERVE_API_KEYS",
    "TSERVE_ADMIN_KEYS",
    "TSERVE_THREADS",
    "TSERVE_DRAIN_TIMEOUT_S",
    "TSERVE_HEADER_TIMEOUT_S",
    "TSERVE_BODY_TIMEOUT_S",
    "TSERVE_MAX_CONNECTIONS",
    "TSERVE_PREFIX_CACHE_MB",
    "TSERVE_SPECULATIVE",
    "TSERVE_LOG_LEVEL",
]


def test_precedence_default_env_flag():
    env = {"TSERVE_MODELS": "/m", "TSERVE_PORT": "9000", "TSERVE_MAX_BEAMS": "5", "TSERVE_API_KEYS": "a, b,,c"}
    s = parse_settings(["--port", "9001", "--max-wait-ms", "2.5"], env)
    assert (s.port, s.max_beams, s.max_wait_ms, s.models) == (9001, 5, 2.5, "/m")
    assert s.api_keys == ("a", "b", "c") and s.admin_keys == () and s.auth_enabled
    assert s.max_queue == Settings().max_queue and s.max_input_tokens is None and s.threads is None
    engine = s.engine_settings()
    assert (engine.max_beams, engine.max_wait_ms, engine.max_inputs) == (5, 2.5, s.max_inputs)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TSERVE_PORT": "http"}, "TSERVE_PORT"),
        ({"TSERVE_PORT": "70000"}, "TSERVE_PORT"),
        ({"TSERVE_MAX_QUEUE": "0"}, "TSERVE_MAX_QUEUE"),
        ({"TSERVE_MAX_QUEUE_PER_KEY": "0"}, "TSERVE_MAX_QUEUE_PER_KEY"),
        ({"TSERVE_PREFIX_CACHE_MB": "-1"}, "TSERVE_PREFIX_CACHE_MB"),
        ({"TSERVE_PREFIX_CACHE_MB": "nan"}, "TSERVE_PREFIX_CACHE_MB"),
        ({"TSERVE_SPECULATIVE": "ngram:99"}, "TSERVE_SPECULATIVE"),
        ({"TSERVE_SPECULATIVE": "code=draft"}, "TSERVE_SPECULATIVE"),
        ({"TSERVE_REQUEST_TIMEOUT_S": "nan"}, "TSERVE_REQUEST_TIMEOUT_S"),
        ({"TSERVE_HEADER_TIMEOUT_S": "0"}, "TSERVE_HEADER_TIMEOUT_S"),
        ({"TSERVE_BODY_TIMEOUT_S": "inf"}, "TSERVE_BODY_TIMEOUT_S"),
        ({"TSERVE_MAX_CONNECTIONS": "0"}, "TSERVE_MAX_CONNECTIONS"),
        ({"TSERVE_DRAIN_TIMEOUT_S": "-1"}, "TSERVE_DRAIN_TIMEOUT_S"),
        ({"TSERVE_LOG_LEVEL": "loud"}, "TSERVE_LOG_LEVEL"),
        ({"TSERVE_WARMUP": "maybe"}, "TSERVE_WARMUP"),
        ({"TSERVE_API_KEYS": "has space"}, "printable ASCII"),
        ({"TSERVE_QUANTIZE": "none,mt=int4"}, "TSERVE_QUANTIZE"),
    ],
)
def test_invalid_settings_name_the_variable(env, says):
    with pytest.raises(SettingsError, match=says):
        Settings.from_env(env)


def test_table_and_help_list_every_setting():
    table = settings_table()
    assert table.startswith("| Flag | Environment variable | Default | Meaning |")
    out = subprocess.run(
        [sys.executable, "-m", "service", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for var in ENV_VARS:
        assert f"`{var}`" in table and var in out, var
    assert "| `--max-body-bytes` | `TSERVE_MAX_BODY_BYTES` | `1048576` |" in table


def test_server_config_carries_the_connection_limits():
    env = {"TSERVE_HEADER_TIMEOUT_S": "2.5", "TSERVE_BODY_TIMEOUT_S": "7", "TSERVE_MAX_CONNECTIONS": "9"}
    s = parse_settings([], env)
    config = server_config(object(), s)
    assert issubclass(config.http, GuardedH11Protocol)
    assert config.http.limits == ConnectionLimits(header_timeout_s=2.5, body_timeout_s=7.0, max_connections=9)
    assert (config.host, config.port, config.timeout_graceful_shutdown) == (s.host, s.port, 35)
