"""The stages of a recipe: where they read and write, and what each runs (see training.recipe_run).

A stage's output tells whether it is done: a corpus's manifest.json, a model or adapter directory
(moved into place only when its training ends), or the stage's record under runs/stages/.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from model import checkpoint, lora_io
from model.calibration import CALIBRATION_FILE
from training import corpora
from training.baselines import LANGDETECT_PIN, baselines_for
from training.calibration import calibrate_checkpoint
from training.errors import UserError
from training.evaluate_run import evaluate
from training.generation_tuning import tune, write_defaults
from training.lora_run import lora
from training.out_of_label import rejections
from training.prepare import is_current, prepare
from training.recipes import SPLIT_SUFFIX, FamilyRecipe, Tier
from training.runs import (
    CodeCorpus,
    CorpusRun,
    Data,
    EvalRun,
    LangidCorpus,
    Loop,
    LoRARun,
    TrainRun,
    TranslationCorpus,
    default_stdlib_dir,
)
from training.state import state_dir_for
from training.train_run import train

logger = logging.getLogger(__name__)

PREPARE_SECONDS = 15  # the ETA's guess for one `prepare`
TUNE_PROMPTS = 100  # valid windows per generation setting the recipe tries (training.generation_tuning)
CALIBRATION_REJECTED = 0.05  # share of valid texts a classifier's default threshold answers "unknown" for


@dataclass(frozen=True)
class Paths:
    """Where a run reads and writes."""

    out: Path
    data: Path
    locale_dir: Path = corpora.DEFAULT_LOCALE_DIR
    stdlib_dir: Path = field(default_factory=default_stdlib_dir)

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
    expected_s: float  # about how long it takes on a quiet machine: the ETA's guess, never a limit
    run: Callable[[], dict[str, Any]]
    removes: tuple[Path, ...] = ()  # what --force deletes besides output and the record
    describe: Callable[[], dict[str, Any]] | None = None  # the record of an output found without one
    inputs: tuple[Path, ...] = ()  # files made by earlier stages: when one is newer, the stage is redone
    outdated: Callable[[], bool] | None = None  # whether an existing output lacks what the stage now makes


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
    stages = []

    def add(name: str, kind: str, corpus: Callable[[Path], CorpusRun]) -> None:
        out = paths.corpus(name)

        def run() -> dict[str, Any]:
            prepare(corpus(out))
            return describe()

        def describe() -> dict[str, Any]:
            return {**manifest(out), "corpus": name, "kind": kind}

        def outdated() -> bool:
            return not is_current(corpus(out), manifest(out))

        stages.append(
            Stage(f"prepare-{name}", out / "manifest.json", PREPARE_SECONDS, run, (out,), describe, outdated=outdated)
        )

    catalogs = {"locale_dir": paths.locale_dir, "fractions": tier.fractions}
    package = (tier.translation_package,)
    t_base, t_domain = domain_corpora(tier.translation)
    add(
        t_base,
        "translation",
        lambda out: TranslationCorpus(out=out, lang=tier.lang, exclude_packages=package, **catalogs),
    )
    add(t_domain, "translation", lambda out: TranslationCorpus(out=out, lang=tier.lang, packages=package, **catalogs))

    def iso() -> tuple[str, ...]:
        return tuple(langid_domain_packages(paths.locale_dir, tier.langid_domain_prefix))

    def domain_langid(out: Path) -> LangidCorpus:  # the domain corpus must use the base model's labels
        labels = tuple(label for label in manifest(paths.corpus(l_base))["labels"] if label != corpora.ENGLISH)
        return LangidCorpus(out=out, packages=iso(), languages=labels, num_languages=len(labels), **catalogs)

    l_base, l_domain = domain_corpora(tier.langid)
    add(l_base, "langid", lambda out: LangidCorpus(out=out, exclude_packages=iso(), **catalogs))
    add(l_domain, "langid", domain_langid)

    c_base, c_domain = domain_corpora(tier.code)
    code = {"stdlib_dir": paths.stdlib_dir, "max_files": tier.code_max_files, "fractions": tier.fractions}
    add(c_base, "code", lambda out: CodeCorpus(out=out, subset="nontests", **code))
    add(c_domain, "code", lambda out: CodeCorpus(out=out, subset="tests", **code))
    return stages


def _metrics(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "metrics.json").read_text(encoding="utf-8"))


def _train_then_move(final: Path, paths: Paths, command: str, run: Callable[[Path, bool], Any]) -> dict[str, Any]:
    """``run(out, resume)`` (`train` or `lora`) into runs/, resuming a saved state, then move the result to
    ``final``.

    The resume state is removed once the result is in place: it only serves an interrupted run.
    """
    work = paths.run_dir(final)
    work.parent.mkdir(parents=True, exist_ok=True)
    run(work, state_dir_for(work).exists())
    if not work.is_dir():
        raise UserError(f"{command} wrote no checkpoint to {work}")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(work, final)
    shutil.rmtree(state_dir_for(work))  # the log and plot were copied into the checkpoint
    return _metrics(final)


def trained_steps(directory: Path) -> int | None:
    """How many steps the model or adapter in ``directory`` was trained for (its metrics.json)."""
    return _metrics(directory).get("steps_trained") if (directory / "metrics.json").is_file() else None


def fixed_steps(loop: Loop) -> Loop:
    """``loop`` as a recipe runs it: its max_steps and nothing else end it (no time limit), logged as lines."""
    return replace(loop, max_minutes=None, quiet=True)


def training_stages(f: FamilyRecipe, paths: Paths) -> list[Stage]:
    """Train the base model, then its adapter on the domain corpus, each for its fixed number of steps.

    A model or adapter trained for another number of steps (by an older, time-budgeted recipe or another
    tier) is trained again.
    """
    base, domain = domain_corpora(f)
    model, adapter = paths.model(f), paths.adapter(f)

    def data(corpus: str) -> Data:
        return Data(paths.split(corpus, f.kind, "train"), paths.split(corpus, f.kind, "valid"))

    def train_base(out: Path, resume: bool) -> None:
        loop = fixed_steps(f.train_loop)
        run = TrainRun(
            family=f.family, data=data(base), out=out, sizes=f.sizes, vocab_size=f.vocab_size, loop=loop, resume=resume
        )
        train(run)

    def train_adapter(out: Path, resume: bool) -> None:
        loop = fixed_steps(f.lora_loop)
        lora(LoRARun(base=model, data=data(domain), out=out, adapter=f.lora, loop=loop, resume=resume))

    overhead = 20  # loading, tokenizing and the last validation
    return [
        Stage(
            f"train-{f.model}",
            model,
            f.train_minutes * 60 + overhead,
            lambda: _train_then_move(model, paths, "train", train_base),
            _with_state(paths.run_dir(model)),
            lambda: _metrics(model),
            inputs=(paths.corpus(base) / "manifest.json",),
            outdated=lambda: trained_steps(model) != f.train_loop.max_steps,
        ),
        Stage(
            f"lora-{f.model}-{f.adapter}",
            adapter,
            f.lora_minutes * 60 + overhead,
            lambda: _train_then_move(adapter, paths, "lora", train_adapter),
            _with_state(paths.run_dir(adapter)),
            lambda: _metrics(adapter),
            inputs=(paths.corpus(domain) / "manifest.json", model / checkpoint.WEIGHTS_FILE),
            outdated=lambda: trained_steps(adapter) != f.lora_loop.max_steps,
        ),
    ]


def _with_state(work: Path) -> tuple[Path, ...]:
    return (work, state_dir_for(work))


def has_langdetect(f: FamilyRecipe) -> bool:
    """Whether the langdetect baseline can run; `make run` should not fail for a docs-only package."""
    if f.family != "classifier" or importlib.util.find_spec("langdetect") is not None:
        return True
    logger.warning("langdetect is not installed: no langdetect baseline (pip install %s)", LANGDETECT_PIN)
    return False


def evaluation_stages(f: FamilyRecipe, tier: Tier, paths: Paths) -> list[Stage]:
    """Base and adapter on the domain's test split, the base on its held-out packages' test split (merged into
    its metrics.json as the entry test-heldout), then on its own (general) test split, last so that the model's
    metrics.json ends with its general test metrics; then the baselines on each of those test splits."""
    base, domain = domain_corpora(f)
    model, adapter = paths.model(f), paths.adapter(f)

    def scored(corpus: str, with_adapter: bool, split: str = "test") -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            test = paths.split(corpus, f.kind, split)
            evaluation = EvalRun(model=model, test=test, adapter=adapter if with_adapter else None, beams=f.beams)
            return evaluate(evaluation, metrics_key=None if split == "test" else split)

        return run

    def baselines(corpus: str, split: str = "test") -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            train, test = paths.split(corpus, f.kind, "train"), paths.split(corpus, f.kind, split)
            return baselines_for(model, train, test, langdetect=tier.langdetect and has_langdetect(f))

        return run

    weights, adapter_weights = model / checkpoint.WEIGHTS_FILE, adapter / lora_io.WEIGHTS_FILE
    tokenizer = model / checkpoint.TOKENIZER_FILE
    evaluations = [
        (f"eval-{f.model}-base-on-{f.adapter}", scored(domain, False), (weights,)),
        (f"eval-{f.model}-{f.adapter}-on-{f.adapter}", scored(domain, True), (weights, adapter_weights)),
    ]
    scored_baselines = [(f"baselines-{f.model}-{f.adapter}", baselines(domain), (tokenizer,))]
    if f.heldout:
        evaluations.append((f"eval-{f.model}-base-on-heldout", scored(base, False, corpora.HELDOUT_TEST), (weights,)))
        scored_baselines.append((f"baselines-{f.model}-heldout", baselines(base, corpora.HELDOUT_TEST), (tokenizer,)))
    evaluations.append((f"eval-{f.model}-base", scored(base, False), (weights,)))
    scored_baselines.append((f"baselines-{f.model}", baselines(base), (tokenizer,)))
    runs = evaluations + scored_baselines
    expected = f.eval_minutes * 60 / len(runs)
    return [Stage(name, paths.record(name), expected, run, inputs=inputs) for name, run, inputs in runs]


def tuning_stages(f: FamilyRecipe, paths: Paths) -> list[Stage]:
    """Serving defaults chosen on the valid split: a causal LM's anti-loop generation settings (its
    generation_config.json, training.generation_tuning), a classifier's calibration (its calibration.json,
    training.calibration) and what its "unknown" answer rejects (training.out_of_label); nothing for seq2seq."""
    if f.family == "classifier":
        return [_calibration_stage(f, paths), _out_of_label_stage(f, paths)]
    if f.family != "causal_lm":
        return []
    model, name = paths.model(f), f"tune-generation-{f.model}"

    def run() -> dict[str, Any]:
        valid = paths.split(domain_corpora(f)[0], f.kind, "valid").read_text(encoding="utf-8")
        scores, chosen = tune(checkpoint.load_checkpoint(model, device="cpu"), valid, TUNE_PROMPTS, 32, 48)
        write_defaults(model, chosen)
        return {"chosen": dataclasses.asdict(chosen), "prompts": TUNE_PROMPTS,
                "scores": [{**dataclasses.asdict(s.setting), "loop_rate": s.loop_rate, "chrf": s.chrf} for s in scores]}

    return [Stage(name, paths.record(name), 90, run, inputs=(model / checkpoint.WEIGHTS_FILE,))]


def _calibration_stage(f: FamilyRecipe, paths: Paths) -> Stage:
    model, name = paths.model(f), f"calibrate-{f.model}"

    def run() -> dict[str, Any]:
        valid = paths.split(domain_corpora(f)[0], f.kind, "valid")
        calibration = calibrate_checkpoint(model, valid, CALIBRATION_REJECTED)
        calibration.save(model)
        return {"temperature": calibration.temperature, "min_confidence": calibration.min_confidence,
                **calibration.report}

    return Stage(name, paths.record(name), 30, run, inputs=(model / checkpoint.WEIGHTS_FILE,))


def _out_of_label_stage(f: FamilyRecipe, paths: Paths) -> Stage:
    model, name, base = paths.model(f), f"out-of-label-{f.model}", domain_corpora(f)[0]

    def run() -> dict[str, Any]:
        splits = ("test", corpora.HELDOUT_TEST) if f.heldout else ("test",)
        outside = paths.split(base, f.kind, corpora.OUT_OF_LABEL)
        return rejections(model, outside, {split: paths.split(base, f.kind, split) for split in splits})

    return Stage(name, paths.record(name), 30, run, inputs=(model / checkpoint.WEIGHTS_FILE, model / CALIBRATION_FILE))


def pipelines(tier: Tier, paths: Paths) -> dict[str, list[Stage]]:
    """The corpora, then per family: train, adapter, evaluations and baselines, a causal LM's generation defaults
    (in running order)."""
    result = {"corpora": prepare_stages(tier, paths)}
    for f in tier.families:
        result[f.model] = training_stages(f, paths) + evaluation_stages(f, tier, paths) + tuning_stages(f, paths)
    return result


def plan(tier: Tier, paths: Paths) -> list[Stage]:
    """Every stage of ``tier``."""
    return [stage for stages in pipelines(tier, paths).values() for stage in stages]
