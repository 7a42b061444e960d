"""Typed runs: what each `python -m training <command>` does, as a dataclass with named fields.

The command line is parsed once into one of these (:func:`from_namespace`, by field name: a field
named like a flag's ``dest`` takes its value, a nested dataclass is filled the same way); the
commands' work functions and the recipes take them. Their defaults are the flags' defaults. No torch
import here, so that ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sysconfig
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from training.arch import ModelSizes
from training.corpora import DEFAULT_LOCALE_DIR, LANGID_CANDIDATES

R = TypeVar("R")

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "up")  # Linear names an adapter may wrap
DEVICE = "auto"  # the default --device: CUDA when there is one, else the CPU


def default_stdlib_dir() -> Path:
    """This Python's standard library (the code corpus's source)."""
    return Path(sysconfig.get_paths()["stdlib"])


# ---- train, lora, evaluate ---------------------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    """The training loop of `train` and `lora`: optimisation, schedule, validation and saving."""

    max_steps: int = 2000  # optimizer steps in all, counted over resumes
    max_minutes: float | None = None  # stop this invocation after this long
    batch_tokens: int = 4096  # padded tokens per batch and process
    accum_steps: int = 1  # batches per optimizer step
    lr: float = 7e-4  # peak learning rate
    warmup: int = 400  # linear warm-up steps
    label_smoothing: float | None = None  # None: 0.1 for seq2seq, 0 otherwise
    clip_norm: float = 1.0  # max gradient norm; 0 disables
    seed: int = 1
    eval_every: int = 200
    save_every: int = 200
    valid_examples: int = 200  # examples decoded for BLEU during seq2seq training
    quiet: bool = False  # no progress bar (progress is logged instead)


LORA_LOOP = Loop(lr=1e-3, warmup=100)  # an adapter learns faster and needs less warm-up


@dataclass(frozen=True)
class Data:
    """A run's training and validation files."""

    train: Path  # a file, or a directory for causal_lm
    valid: Path
    skip_malformed: bool = False  # skip malformed lines (and report the count) instead of failing


@dataclass(frozen=True)
class TrainRun:
    """`train`: a new model of ``family`` (or ``init_from`` a checkpoint) trained on ``data`` into ``out``."""

    family: str  # seq2seq | classifier | causal_lm
    data: Data
    out: Path  # the best checkpoint; the resume state goes to <out>.state/
    sizes: ModelSizes = ModelSizes()
    vocab_size: int = 8000  # BPE vocabulary trained on the data (unless ``tokenizer``)
    tokenizer: Path | None = None  # reuse this tokenizer.json
    init_from: Path | None = None  # fine-tune this checkpoint: its config and tokenizer are kept
    pretrain_mlm: Path | None = None  # classifier: first MLM + sentence order on this text file's lines
    pretrain_steps: int = 1000
    loop: Loop = Loop()
    resume: bool = False  # continue from the state in <out>.state/
    device: str = DEVICE  # auto, cpu, cuda or cuda:N


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter's shape."""

    rank: int = 8
    alpha: float = 16.0  # scaling = alpha / rank
    dropout: float = 0.0  # on the adapter's input
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")  # from LORA_TARGETS


@dataclass(frozen=True)
class LoRARun:
    """`lora`: an adapter on the frozen checkpoint ``base``, trained on ``data`` into ``out`` (PEFT layout)."""

    base: Path  # ours, or a Hugging Face model directory
    data: Data
    out: Path  # the best adapter; the resume state goes to <out>.state/
    adapter: AdapterSpec = AdapterSpec()
    loop: Loop = LORA_LOOP
    resume: bool = False
    device: str = DEVICE


@dataclass(frozen=True)
class EvalRun:
    """`evaluate`: ``model`` (with ``adapter``) on ``test``; the metrics merge into the metrics.json of the
    adapter if given, else of the model."""

    model: Path
    test: Path  # a file, or a directory for causal_lm
    adapter: Path | None = None  # a LoRA adapter directory (PEFT layout)
    beams: int = 4  # seq2seq beam size; 1 = greedy
    max_examples: int | None = None  # score only the first N examples
    max_new_tokens: int = 128  # seq2seq output cap, also <= 2 x source + 10
    batch_tokens: int = 4096
    device: str = DEVICE
    quantize: str = "none"  # model.quantize mode (int8, bf16: CPU only), its metrics merged under its name
    vmap: bool = False  # seq2seq: decode with the model's vocabulary map (vmap.txt), merged under "vmap"
    skip_malformed: bool = False


# ---- prepare -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitFractions:
    """The shares of a corpus's records that go to valid and test (the rest is train)."""

    valid_fraction: float = 0.05
    test_fraction: float = 0.05


@dataclass(frozen=True, kw_only=True)
class CorpusRun:
    """`prepare`: a corpus's train/valid/test files and manifest.json written to ``out``."""

    out: Path
    fractions: SplitFractions = SplitFractions()


@dataclass(frozen=True, kw_only=True)
class CatalogCorpus(CorpusRun):
    """A corpus read from gettext catalogs."""

    locale_dir: Path = DEFAULT_LOCALE_DIR
    packages: tuple[str, ...] = ()  # keep only these packages (none: all)
    exclude_packages: tuple[str, ...] = ()
    max_chars: int = 300  # skip longer texts


@dataclass(frozen=True, kw_only=True)
class TranslationCorpus(CatalogCorpus):
    """English -> ``lang`` pairs."""

    lang: str = "es"  # the target language's locale folder


@dataclass(frozen=True, kw_only=True)
class LangidCorpus(CatalogCorpus):
    """Texts labelled with their language: the ``num_languages`` of ``languages`` with most data, and English."""

    languages: tuple[str, ...] = LANGID_CANDIDATES
    num_languages: int = 10
    max_per_language: int = 4000


@dataclass(frozen=True, kw_only=True)
class CodeCorpus(CorpusRun):
    """Whole Python files of the standard library."""

    stdlib_dir: Path = field(default_factory=default_stdlib_dir)
    subset: str = "all"  # all | tests | nontests
    max_files: int | None = None  # a stable sample of at most this many files
    max_file_bytes: int = 200_000  # skip bigger files


# ---- import, export, baselines, recipe ---------------------------------------------------------


@dataclass(frozen=True)
class ImportRun:
    """`import`: the model directory ``source`` (in ``source_format``) as our checkpoint ``out``."""

    source: Path
    out: Path
    source_format: str = "hf"
    overwrite: bool = False  # replace an existing output directory


@dataclass(frozen=True)
class ExportRun:
    """`export`: checkpoint ``model`` as a model directory of format ``to`` in ``out``."""

    model: Path
    out: Path
    to: str = "hf"
    overwrite: bool = False


@dataclass(frozen=True)
class BaselinesRun:
    """`baselines`: the trivial baselines of ``model``'s family on ``test`` (fitted on ``train``)."""

    model: Path
    train: Path
    test: Path
    langdetect: bool = True  # score the langdetect baseline (classifier)
    out: Path | None = None  # also write the JSON here


@dataclass(frozen=True)
class TuneGenerationRun:
    """`tune-generation`: a causal LM's anti-loop generation defaults, chosen on ``valid``."""

    model: Path
    valid: Path
    prompts: int = 200  # valid windows completed per setting
    prompt_tokens: int = 32
    new_tokens: int = 48
    write: bool = False  # write the chosen setting into the checkpoint's generation_config.json


@dataclass(frozen=True)
class CalibrateRun:
    """`calibrate`: a classifier's temperature and "unknown" threshold, fitted on ``valid``."""

    model: Path
    valid: Path
    max_rejected: float = 0.05  # share of valid (in-label) texts the threshold may answer "unknown" for
    write: bool = False  # write calibration.json into the checkpoint


@dataclass(frozen=True)
class TranslatePoRun:
    """`translate-po`: a gettext catalog's empty translations filled by a translation model."""

    catalog: Path  # the .po file read
    model: Path
    out: Path  # the .po file written (may be the catalog itself)
    adapter: Path | None = None
    beams: int = 4
    max_new_tokens: int = 128
    device: str = DEVICE
    target_lang: str | None = None  # a multilingual model's target code (None: the catalog's Language: header's)


@dataclass(frozen=True)
class BuildVmapRun:
    """`build-vmap`: a translation model's vocabulary map (vmap.txt) from its training pairs."""

    model: Path
    train: Path  # the parallel file the map counts co-occurrences in
    per_token: int = 24  # candidate target tokens per source token
    always: int = 1000  # target tokens (the most frequent) every source may use
    target_lang: str | None = None  # a multilingual model's target language: its map goes to vmaps/<code>.txt
    skip_malformed: bool = False


@dataclass(frozen=True)
class RecipeRun:
    """`recipe`: a tier's corpora, models, adapters and measurements."""

    tier: str  # quick | quality (training.recipes.TIERS)
    out: Path = Path("checkpoints")  # models, adapters, summary
    data: Path = Path("data")  # corpora
    force: bool = False  # redo every stage, even those whose output exists
    jobs: int = 2  # families trained at the same time, one process each
    threads: int = 1  # torch intra-op threads per process
    locale_dir: Path = DEFAULT_LOCALE_DIR
    stdlib_dir: Path = field(default_factory=default_stdlib_dir)


# ---- from the command line ---------------------------------------------------------------------


def _coerce(hint: Any, value: Any) -> Any:
    """A flag's parsed value as the field holds it: paths as Path, lists as tuples."""
    if isinstance(value, str) and (hint is Path or Path in typing.get_args(hint)):
        return Path(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def from_namespace(cls: type[R], args: argparse.Namespace) -> R:
    """``cls`` with each field from the parsed flag of the same name (fields with no flag keep their default);
    a field holding a dataclass is built from the same flags."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = from_namespace(hint, args)
        elif hasattr(args, f.name):
            values[f.name] = _coerce(hint, getattr(args, f.name))
    return cls(**values)


def command(run_type: type[R], func: Callable[[R], Any]) -> Callable[[argparse.Namespace], None]:
    """The ``func`` of a parser's defaults: builds ``run_type`` from the parsed flags and calls ``func`` with it."""

    def run(args: argparse.Namespace) -> None:
        func(from_namespace(run_type, args))

    return run
