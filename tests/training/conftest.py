"""Tiny data sets written by the tests themselves, and the tiny-model flags every training test uses."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from training.cli import build_parser, main
from training.runs import from_namespace

R = TypeVar("R")

WORDS = {
    "the": "el", "cat": "gato", "dog": "perro", "house": "casa", "red": "rojo", "blue": "azul", "green": "verde",
    "small": "chico", "big": "grande", "runs": "corre", "sees": "ve", "eats": "come", "one": "uno", "two": "dos",
}  # fmt: skip
TINY = [
    "--d-model", "32", "--heads", "4", "--ffn", "64", "--layers", "2", "--vocab-size", "300", "--max-len", "32",
    "--batch-tokens", "256", "--warmup", "10", "--lr", "3e-3", "--eval-every", "10", "--save-every", "10", "--quiet",
]  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models: extra threads only add contention on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sentence(rng: random.Random) -> list[str]:
    return [rng.choice(list(WORDS)) for _ in range(rng.randint(2, 6))]


def write_translation(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = _sentence(rng)
        lines.append(" ".join(words) + "\t" + " ".join(WORDS[w] for w in words) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def write_labels(path: Path, n: int, seed: int) -> Path:
    """Label "animal" when the text mentions a cat or a dog, else "thing"."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = _sentence(rng)
        label = "animal" if {"cat", "dog"} & set(words) else "thing"
        lines.append(json.dumps({"text": " ".join(words), "label": label}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def write_text(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(" ".join(_sentence(rng)) + ".\n" for _ in range(n)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    return {
        "s2s_train": write_translation(d / "train.tsv", 300, 1),
        "s2s_valid": write_translation(d / "valid.tsv", 20, 2),
        "cls_train": write_labels(d / "train.jsonl", 300, 3),
        "cls_valid": write_labels(d / "valid.jsonl", 30, 4),
        "lm_train": write_text(d / "train.txt", 300, 5),
        "lm_valid": write_text(d / "valid.txt", 30, 6),
    }


def run_cli(*argv: str) -> None:
    """Run `python -m training ...` in-process; fail on a non-zero status."""
    assert main(["--log-level", "WARNING", *argv]) == 0


def call_command(*argv: str) -> None:
    """Parse ``argv`` and call the command directly, so a UserError propagates to the test."""
    args = build_parser().parse_args(argv)
    args.func(args)


def parse_run(run_type: type[R], *argv: str) -> R:
    """The typed run (training.runs) that the command line ``argv`` describes."""
    return from_namespace(run_type, build_parser().parse_args(argv))


def train_args(family: str, data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    prefix = {"seq2seq": "s2s", "classifier": "cls", "causal_lm": "lm"}[family]
    return ["train", family, "--train", str(data[f"{prefix}_train"]), "--valid", str(data[f"{prefix}_valid"]),
            "--out", str(out), *TINY, *extra]  # fmt: skip


def log_rows(state_dir: Path) -> list[dict[str, str]]:
    with open(state_dir / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))
