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

import json
import logging
import multiprocessing
import os
import platform
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from model.cpu import this_cpu
from training.recipe_report import report_lines
from training.recipe_stages import Paths, Stage, pipelines
from training.recipe_summary import build_summary
from training.recipes import Tier
from training.state import write_json

logger = logging.getLogger(__name__)


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def machine() -> dict[str, Any]:
    """The date, CPU, cores and library versions the numbers were measured with."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": this_cpu().model_name,
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
    """Whether an input of ``stage`` changed after its record was written (e.g. a retrained base), or its output
    was made by an older version of the stage (e.g. a corpus without its held-out packages)."""
    changed = record.exists() and any(p.exists() and p.stat().st_mtime > record.stat().st_mtime for p in stage.inputs)
    return changed or (stage.outdated is not None and stage.output.exists() and stage.outdated())


def run_stage(stage: Stage, paths: Paths, force: bool) -> bool:
    """Run ``stage`` unless its output exists and is up to date; True if it ran.

    With ``force``, or when the output is stale (:func:`is_stale`), its output is removed first.
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
    """Run ``stages`` in order, logging each with the time this pipeline is expected to take still (the
    training stages then log their own ETA from their fixed steps and measured pace)."""
    start = time.perf_counter()
    for i, stage in enumerate(stages, 1):
        where = f"[{name} {i}/{len(stages)}] {stage.name}"
        left = sum(s.expected_s for s in stages[i - 1 :])
        logger.info(
            "%s: expected %s on a quiet machine; %s elapsed, about %s to go",
            where,
            _clock(stage.expected_s),
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
    """The three families' pipelines, ``jobs`` at a time in worker processes, the longest expected first."""
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
    expected = {name: sum(s.expected_s for s in group) for name, group in stages.items()}
    logger.info(
        "recipe %s: %d stages, %d at a time; expected on a quiet machine (min:s): %s -> %s",
        tier.name,
        sum(len(group) for group in stages.values()),
        jobs,
        ", ".join(f"{name} {_clock(seconds)}" for name, seconds in expected.items()),
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
    logger.info("recipe %s finished in %s -> %s", tier.name, _clock(wall), paths.out / "summary.json")
    log = logger.info if summary["all_checks_passed"] else logger.warning
    for line in report_lines(summary, str(paths.out)):  # the last thing it says: `make run` serves next
        log("%s", line)
    return summary
