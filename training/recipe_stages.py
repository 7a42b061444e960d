"""The stages of a recipe: where they read and write, and what each runs (see training.recipe_run).

A stage's output tells whether it is done: a corpus's manifest.json, a model or adapter directory
(moved into place only when its training ends), or the stage's record under runs/stages/.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import shutil
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model import checkpoint, lora_io
from training import corpora
from training.baselines import LANGDETECT_PIN, baselines_for
from training.errors import UserError
from training.recipes import SPLIT_SUFFIX, FamilyRecipe, Tier
from training.state import state_dir_for

logger = logging.getLogger(__name__)

PREPARE_SECONDS = 15  # the ETA's guess for one `prepare`


@dataclass(frozen=True)
class Paths:
    """Where a run reads and writes."""

    out: Path
    data: Path
    locale_dir: Path = corpora.DEFAULT_LOCALE_DIR
    stdlib_dir: Path = field(default_factory=lambda: Path(sysconfig.get_paths()["stdlib"]))

    def model(self, f: FamilyRecipe) -> Path:
        return self.out / "models" / f.model

    def adapter(self, f: FamilyRecipe) -> Path:
        return self.out / "adapters" / f.model / f.adapter

    def run_dir(self, final: Path) -> Path:
        """Where the training run of ``final`` writes until it is moved there."""
        return self.out / "runs" / final.relative_to(self.out)

    def record(self, stage: str) -> Path:
        return self.out / "runs" / "stages" / f"{stage}.json"

    def corpus(self, name: str) -> Path:
        return self.data / name

    def split(self, corpus: str, kind: str, split: str) -> Path:
        return self.data / corpus / f"{split}{SPLIT_SUFFIX[kind]}"


@dataclass
class Stage:
    """One step of a recipe: skipped when ``output`` exists; ``run`` returns its record."""

    name: str
    output: Path
    budget_s: float  # for the ETA
    run: Callable[[], dict[str, Any]]
    removes: tuple[Path, ...] = ()  # what --force deletes besides output and the record
    describe: Callable[[], dict[str, Any]] | None = None  # the record of an output found without one
    inputs: tuple[Path, ...] = ()  # files made by earlier stages: when one is newer, the stage is redone


def run_command(argv: list[str]) -> None:
    """Parse ``argv`` as `python -m training ...` and call the command in this process."""
    from training.cli import build_parser  # cli imports the recipe command, so not at module level

    args = build_parser().parse_args(argv)
    args.func(args)


def domain_corpora(f: FamilyRecipe) -> tuple[str, str]:
    """The names of the base's corpus and the adapter's corpus under --data."""
    return f.model, f"{f.model}-{f.adapter}"


def langid_domain_packages(locale_dir: Path, prefix: str) -> list[str]:
    """The packages under ``locale_dir`` whose name starts with ``prefix``, in any language."""
    found = sorted({p.stem for p in Path(locale_dir).glob(f"*/LC_MESSAGES/{prefix}*.mo")})
    if not found:
        raise UserError(f"no gettext catalogs named {prefix}* under {locale_dir}: the langid adapter's domain")
    return found


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text(encoding="utf-8"))


def prepare_stages(tier: Tier, paths: Paths) -> list[Stage]:
    """The six corpora: each family's base corpus (without the domain) and its domain corpus."""
    locale = ("--locale-dir", str(paths.locale_dir))
    stages = []

    def add(name: str, kind: str, flags: Callable[[], list[str]]) -> None:
        out = paths.corpus(name)

        def run() -> dict[str, Any]:
            extra = list(tier.prepare_flags.get(kind, ()))
            run_command(["prepare", kind, "--out", str(out), *flags(), *extra])
            return describe()

        def describe() -> dict[str, Any]:
            return {**manifest(out), "corpus": name, "kind": kind}

        stages.append(Stage(f"prepare-{name}", out / "manifest.json", PREPARE_SECONDS, run, (out,), describe))

    t_base, t_domain = domain_corpora(tier.translation)
    lang = ("--lang", tier.lang)
    add(t_base, "translation", lambda: [*locale, *lang, "--exclude-packages", tier.translation_package])
    add(t_domain, "translation", lambda: [*locale, *lang, "--packages", tier.translation_package])

    def iso() -> str:
        return ",".join(langid_domain_packages(paths.locale_dir, tier.langid_domain_prefix))

    def base_languages() -> list[str]:  # the domain corpus must use the base model's labels
        labels = [label for label in manifest(paths.corpus(l_base))["labels"] if label != corpora.ENGLISH]
        return ["--languages", ",".join(labels), "--num-languages", str(len(labels))]

    l_base, l_domain = domain_corpora(tier.langid)
    add(l_base, "langid", lambda: [*locale, "--exclude-packages", iso()])
    add(l_domain, "langid", lambda: [*locale, "--packages", iso(), *base_languages()])

    c_base, c_domain = domain_corpora(tier.code)
    cap = ["--max-files", str(tier.code_max_files)] if tier.code_max_files else []
    stdlib = ["--stdlib-dir", str(paths.stdlib_dir)]
    add(c_base, "code", lambda: [*stdlib, "--subset", "nontests", *cap])
    add(c_domain, "code", lambda: [*stdlib, "--subset", "tests", *cap])
    return stages


def _metrics(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "metrics.json").read_text(encoding="utf-8"))


def _train_then_move(final: Path, paths: Paths, argv: list[str]) -> dict[str, Any]:
    """Run `train`/`lora` into runs/ (resuming a saved state), then move the result to ``final``.

    The resume state is removed once the result is in place: it only serves an interrupted run.
    """
    work = paths.run_dir(final)
    work.parent.mkdir(parents=True, exist_ok=True)
    resume = ["--resume"] if state_dir_for(work).exists() else []
    run_command([*argv, "--out", str(work), "--quiet", *resume])
    if not work.is_dir():
        raise UserError(f"{argv[0]} wrote no checkpoint to {work}")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(work, final)
    shutil.rmtree(state_dir_for(work))  # the log and plot were copied into the checkpoint
    return _metrics(final)


def training_stages(f: FamilyRecipe, paths: Paths) -> list[Stage]:
    """Train the base model, then its adapter on the domain corpus."""
    base, domain = domain_corpora(f)
    model, adapter = paths.model(f), paths.adapter(f)

    def data(corpus: str) -> list[str]:
        return [
            "--train",
            str(paths.split(corpus, f.kind, "train")),
            "--valid",
            str(paths.split(corpus, f.kind, "valid")),
        ]

    def train() -> dict[str, Any]:
        argv = ["train", f.family, *data(base), *f.train_flags, "--max-minutes", str(f.train_minutes)]
        return _train_then_move(model, paths, argv)

    def train_adapter() -> dict[str, Any]:
        argv = ["lora", "--base", str(model), *data(domain), *f.lora_flags, "--max-minutes", str(f.lora_minutes)]
        return _train_then_move(adapter, paths, argv)

    overhead = 20  # loading, tokenizing and the last validation, beyond --max-minutes
    return [
        Stage(
            f"train-{f.model}",
            model,
            f.train_minutes * 60 + overhead,
            train,
            _with_state(paths.run_dir(model)),
            lambda: _metrics(model),
            inputs=(paths.corpus(base) / "manifest.json",),
        ),
        Stage(
            f"lora-{f.model}-{f.adapter}",
            adapter,
            f.lora_minutes * 60 + overhead,
            train_adapter,
            _with_state(paths.run_dir(adapter)),
            lambda: _metrics(adapter),
            inputs=(paths.corpus(domain) / "manifest.json", model / checkpoint.WEIGHTS_FILE),
        ),
    ]


def _with_state(work: Path) -> tuple[Path, ...]:
    return (work, state_dir_for(work))


def evaluate_quietly(argv: list[str]) -> dict[str, Any]:
    """`evaluate` in this process, its JSON captured rather than printed."""
    from training.cli import build_parser
    from training.evaluate_run import evaluate

    args = build_parser().parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        return evaluate(args)


def has_langdetect(f: FamilyRecipe) -> bool:
    """Whether the langdetect baseline can run; `make run` should not fail for a docs-only package."""
    if f.family != "classifier" or importlib.util.find_spec("langdetect") is not None:
        return True
    logger.warning("langdetect is not installed: no langdetect baseline (pip install %s)", LANGDETECT_PIN)
    return False


def evaluation_stages(f: FamilyRecipe, tier: Tier, paths: Paths) -> list[Stage]:
    """Base and adapter on the domain's test split, then the base on its own (general) test split,
    last so that the model's metrics.json ends with its general test metrics; then the baselines."""
    base, domain = domain_corpora(f)
    model, adapter = paths.model(f), paths.adapter(f)
    budget = f.eval_minutes * 60 / 5

    def evaluate(corpus: str, with_adapter: bool) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            argv = ["evaluate", "--model", str(model), "--test", str(paths.split(corpus, f.kind, "test"))]
            argv += ["--adapter", str(adapter)] if with_adapter else []
            return evaluate_quietly([*argv, *f.eval_flags])

        return run

    def baselines(corpus: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            train, test = paths.split(corpus, f.kind, "train"), paths.split(corpus, f.kind, "test")
            return baselines_for(model, train, test, langdetect=tier.langdetect and has_langdetect(f))

        return run

    weights, adapter_weights = model / checkpoint.WEIGHTS_FILE, adapter / lora_io.WEIGHTS_FILE
    tokenizer = model / checkpoint.TOKENIZER_FILE
    runs = [
        (f"eval-{f.model}-base-on-{f.adapter}", evaluate(domain, False), (weights,)),
        (f"eval-{f.model}-{f.adapter}-on-{f.adapter}", evaluate(domain, True), (weights, adapter_weights)),
        (f"eval-{f.model}-base", evaluate(base, False), (weights,)),
        (f"baselines-{f.model}-{f.adapter}", baselines(domain), (tokenizer,)),
        (f"baselines-{f.model}", baselines(base), (tokenizer,)),
    ]
    return [Stage(name, paths.record(name), budget, run, inputs=inputs) for name, run, inputs in runs]


def pipelines(tier: Tier, paths: Paths) -> dict[str, list[Stage]]:
    """The corpora, then per family: train, adapter, evaluations and baselines (in running order)."""
    result = {"corpora": prepare_stages(tier, paths)}
    for f in tier.families:
        result[f.model] = training_stages(f, paths) + evaluation_stages(f, tier, paths)
    return result


def plan(tier: Tier, paths: Paths) -> list[Stage]:
    """Every stage of ``tier``."""
    return [stage for stages in pipelines(tier, paths).values() for stage in stages]
