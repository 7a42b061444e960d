"""The end of a recipe's output (what `make run` prints before it serves): what each model trained, every check
against the trivial baselines with its verdict, and, when one fails, what that means and what to do."""

from __future__ import annotations

from typing import Any

from training.progress import clock_text

RULE = "=" * 100
# What a failed check says about the model, by what it was compared with (summary.json's checks' "against").
MEANING = {
    "copy_source": "its translations score no better than the English source left untranslated",
    "majority": "it is no more accurate than always answering the most frequent language",
    "langdetect": "it is no more accurate than the off-the-shelf langdetect package",
    "unigram": "it predicts the code no better than token frequencies alone",
    "base": "the adapter does no better on its own domain than the base model without it",
}

QUALITY_ADVICE = (
    "  - for better models, train the quality tier: `make train-quality` (python -m training recipe quality, about "
    "50 minutes on 2 cores), then `make serve CHECKPOINTS=checkpoints-quality`;"
)


def _number(value: float) -> str:
    return f"{value:.4g}"


def _trained(name: str, train: dict[str, Any]) -> str:
    wall = train.get("total_wall_time_s")
    took = f" in {clock_text(wall)}" if wall is not None else ""
    return f"{name} {train.get('steps_trained')}/{train['fixed_steps']} steps{took}"


def training_lines(summary: dict[str, Any]) -> list[str]:
    """One line per model: the steps its base and adapter trained (of their fixed steps) and how long they took."""
    lines = [f"recipe {summary['tier']}: fixed steps and seeds, so the same models on every machine (only the time "
             "differs):"]  # fmt: skip
    for name, model in summary["models"].items():
        adapter = model["adapter"]
        lines.append(f"  {_trained(name, model['train'])}; adapter {_trained(adapter['name'], adapter['train'])}")
    return lines


def check_lines(checks: list[dict[str, Any]]) -> list[str]:
    """Every check, passed or FAILED, with both scores."""
    return [
        f"  {'passed' if c['passed'] else 'FAILED'}  {c['what']}: {_number(c['value'])} vs {_number(c['other'])}"
        for c in checks
    ]


def verdict_lines(summary: dict[str, Any], out: str) -> list[str]:
    """The verdict: one line when every check passed, else a banner saying what failed, what it means, what to do.

    ``out`` is where the recipe wrote (its summary.json is named in the advice).
    """
    checks = summary["checks"]
    failed = [c for c in checks if not c["passed"]]
    if not failed:
        return [f"recipe {summary['tier']}: all {len(checks)} checks passed: every model beats its trivial "
                "baselines on every test split, and every adapter its base"]  # fmt: skip
    meanings = {c["against"]: MEANING[c["against"]] for c in failed}
    return [
        RULE,
        f"THE DEFAULT MODELS DID NOT BEAT THEIR TRIVIAL BASELINES: {len(failed)} of {len(checks)} checks FAILED "
        f"(recipe {summary['tier']})",
        *(f"  FAILED  {c['what']}" for c in failed),
        "What it means: the models are saved (and `make run` serves them anyway), but where a check failed:",
        *(f"  - vs {against}: {meaning}" for against, meaning in meanings.items()),
        "What to do: the recipe trains a fixed number of steps with fixed seeds, so running it again (on a quieter "
        "machine or not) trains the same models.",
        f"  - compare the corpora in {out}/summary.json with docs/training.md's: other gettext catalogs or another "
        "Python standard library make other data, hence other models;",
        *([] if summary["tier"] == "quality" else [QUALITY_ADVICE]),
        f"  - report it with {out}/summary.json: the {summary['tier']} tier is meant to pass every check on every "
        "machine.",
        RULE,
    ]


def report_lines(summary: dict[str, Any], out: str) -> list[str]:
    """All of it: the training lines, the checks, the verdict last."""
    header = f"recipe {summary['tier']}: the checks against the trivial baselines (summary.json's \"checks\"):"
    return [*training_lines(summary), header, *check_lines(summary["checks"]), *verdict_lines(summary, out)]
