"""`recipe`: run a tier's stages in order, skipping those whose output exists, then write summary.json.

Layout under ``out`` (serve it with ``python -m service --models OUT/models --adapters OUT/adapters``)::

    models/<model>/               finished checkpoints: a training run is moved here when it ends
    adapters/<model>/<adapter>/   finished adapters (PEFT layout), moved here likewise
    runs/                         work in progress (training runs with their .state/ for --resume),
                                  and one JSON record per finished stage (runs/stages/)
    summary.json                  corpora, sizes, times and test metrics against the baselines

A stage is skipped when its output exists (a corpus's manifest.json, a model or adapter directory,
an evaluation's record), so an interrupted run picks up where it stopped; an interrupted training
run resumes from its last saved state. A stage whose inputs changed after it ran (a retrained base
under an adapter, a retrained model under its evaluations) is redone. ``force`` redoes every stage.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import multiprocessing
import os
import platform
import shutil
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model import checkpoint, lora
from training import corpora
from training.errors import UserError
from training.recipe_summary import build_summary
from training.recipes import SPLIT_SUFFIX, FamilyRecipe, Tier
from training.state import state_dir_for, write_json

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


def evaluation_stages(f: FamilyRecipe, tier: Tier, paths: Paths) -> list[Stage]:
    """Base and adapter on the domain's test split, then the base on its own (general) test split,
    last so that the model's metrics.json ends with its general test metrics; then the baselines."""
    from training.baselines import baselines_for

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
            return baselines_for(model, train, test, langdetect=tier.langdetect)

        return run

    weights, adapter_weights = model / checkpoint.WEIGHTS_FILE, adapter / lora.WEIGHTS_FILE
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


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def machine() -> dict[str, Any]:
    """The date, CPU, cores and library versions the numbers were measured with."""
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def _remove(*paths: Path) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def is_stale(stage: Stage, record: Path) -> bool:
    """Whether an input of ``stage`` changed after its record was written (e.g. a retrained base)."""
    return record.exists() and any(p.exists() and p.stat().st_mtime > record.stat().st_mtime for p in stage.inputs)


def run_stage(stage: Stage, paths: Paths, force: bool) -> bool:
    """Run ``stage`` unless its output exists and is up to date; True if it ran.

    With ``force``, or when an input is newer than the stage's record, its output is removed first.
    """
    record = paths.record(stage.name)
    if force or is_stale(stage, record):
        _remove(stage.output, record, *stage.removes)
    record.parent.mkdir(parents=True, exist_ok=True)
    if stage.output.exists():
        if not record.exists() and stage.describe is not None:  # e.g. corpora kept from another run
            write_json(record, {"stage": stage.name, "seconds": None, "result": stage.describe()})
        return False
    start = time.perf_counter()
    result = stage.run()
    write_json(record, {"stage": stage.name, "seconds": round(time.perf_counter() - start, 1), "result": result})
    return True


def run_pipeline(name: str, stages: list[Stage], paths: Paths, force: bool) -> None:
    """Run ``stages`` in order, logging each with the time this pipeline has left by its budgets."""
    start = time.perf_counter()
    for i, stage in enumerate(stages, 1):
        where = f"[{name} {i}/{len(stages)}] {stage.name}"
        left = sum(s.budget_s for s in stages[i - 1 :])
        logger.info(
            "%s: budget %s; %s elapsed, about %s to go",
            where,
            _clock(stage.budget_s),
            _clock(time.perf_counter() - start),
            _clock(left),
        )
        stage_start = time.perf_counter()
        if run_stage(stage, paths, force):
            logger.info("%s done in %s", where, _clock(time.perf_counter() - stage_start))
        else:
            logger.info("%s: %s exists, skipped", where, stage.output)


def _worker_init(level: int, threads: int) -> None:
    logging.basicConfig(level=level, format="%(levelname)s %(processName)s %(name)s: %(message)s")
    torch.set_num_threads(threads)


def _run_family(tier: Tier, paths: Paths, name: str, force: bool) -> None:
    """One family's pipeline in a worker process (stages hold closures, so each process plans anew)."""
    run_pipeline(name, pipelines(tier, paths)[name], paths, force)


def run_families(tier: Tier, paths: Paths, force: bool, jobs: int) -> None:
    """The three families' pipelines, ``jobs`` at a time in worker processes, longest budget first."""
    order = sorted(tier.families, key=lambda f: -(f.train_minutes + f.lora_minutes + f.eval_minutes))
    if jobs == 1:
        for f in order:
            run_pipeline(f.model, pipelines(tier, paths)[f.model], paths, force)
        return
    # One thread per process: small matrices gain little from intra-op threads, processes scale.
    context = multiprocessing.get_context("spawn")
    init = (logging.getLogger().getEffectiveLevel(), torch.get_num_threads())
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init, initargs=init) as pool:
        futures = [pool.submit(_run_family, tier, paths, f.model, force) for f in order]
        for future in futures:
            future.result()


def run_recipe(tier: Tier, paths: Paths, force: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Run (or finish) ``tier`` into ``paths``, the families ``jobs`` at a time; writes and returns summary.json."""
    stages = pipelines(tier, paths)
    budgets = {name: sum(s.budget_s for s in group) for name, group in stages.items()}
    logger.info(
        "recipe %s: %d stages, %d at a time; budgets (min:s): %s -> %s",
        tier.name,
        sum(len(group) for group in stages.values()),
        jobs,
        ", ".join(f"{name} {_clock(seconds)}" for name, seconds in budgets.items()),
        paths.out,
    )
    start = time.perf_counter()
    run_pipeline("corpora", stages["corpora"], paths, force)
    run_families(tier, paths, force, jobs)
    wall = time.perf_counter() - start
    records = {
        s.name: json.loads(paths.record(s.name).read_text(encoding="utf-8")) for group in stages.values() for s in group
    }
    summary = build_summary(tier, records, {**machine(), "jobs": jobs}, wall)
    write_json(paths.out / "summary.json", summary)
    for check in summary["checks"]:
        log = logger.info if check["passed"] else logger.warning
        log("%s: %s", "beats" if check["passed"] else "DOES NOT BEAT", check["what"])
    logger.info("recipe %s finished in %s -> %s", tier.name, _clock(wall), paths.out / "summary.json")
    return summary
