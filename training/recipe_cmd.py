"""`python -m training recipe {quick,quality}`: the command line (work in training.recipe_run)."""

from __future__ import annotations

import argparse

from training.options import positive_int
from training.runs import RecipeRun, command, default_stdlib_dir

TIER_HELP = {
    "quick": "small models, about 13 minutes on 2 quiet CPU cores (what `make run` trains)",
    "quality": "bigger models trained for longer, about 50 minutes on 2 quiet CPU cores (docs/training.md)",
}


def _run(run: RecipeRun) -> None:
    import torch

    from training.recipe_run import run_recipe
    from training.recipe_stages import Paths
    from training.recipes import TIERS

    torch.set_num_threads(run.threads)
    paths = Paths(run.out, run.data, run.locale_dir, run.stdlib_dir)
    run_recipe(TIERS[run.tier], paths, force=run.force, jobs=run.jobs)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `recipe`."""
    p = subparsers.add_parser(
        "recipe",
        help="build the corpora, train the default models and adapters, measure them",
        description="Prepare the three corpora and their domain subsets, train one model and one LoRA adapter "
        "per family, evaluate them and the trivial baselines on the test splits, and write OUT/summary.json. "
        "Every training phase runs the tier's fixed number of steps with fixed seeds, so a busy machine takes "
        "longer and trains the same models. Serve the result with `python -m service --models OUT/models "
        "--adapters OUT/adapters`. A stage whose output exists is skipped, so running the command again finishes "
        "an interrupted run. The output ends with every check against the trivial baselines and whether it passed "
        "(also in OUT/summary.json); the exit status is 0 even when one failed, since the models are usable.",
        epilog=" ".join(f"{name}: {text}." for name, text in TIER_HELP.items()),
    )
    p.add_argument("tier", choices=tuple(TIER_HELP), help="which recipe")
    p.add_argument(
        "--out", default=str(RecipeRun.out), metavar="DIR", help="models, adapters, summary (default %(default)s)"
    )
    p.add_argument("--data", default=str(RecipeRun.data), metavar="DIR", help="corpora (default %(default)s)")
    p.add_argument("--force", action="store_true", help="redo every stage, even those whose output exists")
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=RecipeRun.jobs,
        metavar="N",
        help="families trained at the same time, one process each (default %(default)s; the tiers' times assume 2)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=RecipeRun.threads,
        metavar="N",
        help="torch intra-op threads per process (default %(default)s: models this small gain little from more, and "
        "on a busy machine extra threads wait on each other)",
    )
    p.add_argument("--locale-dir", default=str(RecipeRun.locale_dir), help="gettext root (default %(default)s)")
    p.add_argument("--stdlib-dir", default=str(default_stdlib_dir()), help="stdlib root (default %(default)s)")
    p.set_defaults(func=command(RecipeRun, _run))
