"""`python -m training {train,lora,evaluate}` as subprocesses: --help, bad flags and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "training", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["train", "--help"], ["seq2seq", "classifier", "causal_lm"]),
        (["train", "seq2seq", "--help"], ["--encoder-layers", "--label-smoothing", "--arch", "--tokenizer"]),
        (["train", "classifier", "--help"], ["--pretrain-mlm", "--pretrain-steps", "--skip-malformed"]),
        (["train", "causal_lm", "--help"], ["--max-minutes", "--batch-tokens", "--accum-steps", "--device"]),
        (["lora", "--help"], ["--base", "--rank", "--alpha", "--targets", "--dropout"]),
        (
            ["evaluate", "--help"],
            ["--model", "--adapter", "--test", "--beams", "--max-examples", "--quantize", "--metrics-key"],
        ),
    ],
)
def test_help(argv, flags):
    result = _run(*argv)
    assert result.returncode == 0, result.stderr
    for flag in flags:
        assert flag in result.stdout


def test_bad_flag_is_a_usage_error(tmp_path):
    result = _run("train", "seq2seq", "--train", "a.tsv", "--valid", "b.tsv", "--out", str(tmp_path), "--lr", "-1")
    assert result.returncode == 2
    assert "--lr: expected a positive number" in result.stderr
    result = _run("lora", "--base", "x", "--train", "a", "--valid", "b", "--out", "c", "--targets", "q_proj,nope")
    assert result.returncode == 2 and "--targets" in result.stderr


def test_missing_and_malformed_files_are_one_line_errors(tmp_path):
    result = _run("train", "seq2seq", "--train", str(tmp_path / "nope.tsv"), "--valid", "v.tsv", "--out", "o")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'nope.tsv'}: data file not found"
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"text": "ok", "label": "a"}\n{"text": "no label"}\n')
    result = _run("train", "classifier", "--train", str(bad), "--valid", str(bad), "--out", str(tmp_path / "o"))
    assert result.returncode == 1
    assert f"error: {bad}:2: field 'label'" in result.stderr
    assert "Traceback" not in result.stderr
    result = _run("evaluate", "--model", str(tmp_path / "missing"), "--test", str(bad))
    assert result.returncode == 1 and "checkpoint directory not found" in result.stderr
