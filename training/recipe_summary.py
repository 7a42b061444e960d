"""summary.json of a recipe: corpora, model sizes, training times, test metrics against the baselines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.recipes import FamilyRecipe, Tier


@dataclass(frozen=True)
class Scoring:
    """A family's test metrics in summary.json and its checks: each ``checked`` metric of the model against each
    of its ``baselines`` (whose records hold the same metric keys) and of its adapter against the base."""

    reported: tuple[str, ...]
    checked: tuple[str, ...]
    higher_is_better: bool
    baselines: tuple[str, ...]


SCORING = {
    "seq2seq": Scoring(("bleu", "chrf"), ("bleu", "chrf"), True, ("copy_source",)),
    "classifier": Scoring(("accuracy", "macro_f1"), ("accuracy",), True, ("majority", "langdetect")),
    "causal_lm": Scoring(("perplexity", "nll", "tokens"), ("perplexity",), False, ("unigram",)),
}
# summary.json's name of each test split and how a check names it.
SPLIT_NAMES = {"general": "general", "heldout": "package-held-out", "domain": "domain"}
CORPUS_KEYS = ("kind", "counts", "chars", "labels", "lang", "subset", "heldout", "out_of_label")
TRAIN_KEYS = ("steps_trained", "total_train_tokens", "total_wall_time_s", "best_step")


def _pick(metrics: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: metrics[k] for k in keys if k in metrics}


def _training(metrics: dict[str, Any], steps: int) -> dict[str, Any]:
    """What a run trained, with ``steps``: the tier's fixed number of steps, which steps_trained should equal."""
    train = _pick(metrics, TRAIN_KEYS)
    wall, tokens = metrics.get("total_wall_time_s"), metrics.get("total_train_tokens")
    if wall and tokens:
        train["tokens_per_s"] = round(tokens / wall, 1)
    return {**train, "fixed_steps": steps}


def _baselines(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if isinstance(v, dict)}


def _check(what: str, against: str, value: float, other: float, higher: bool) -> dict[str, Any]:
    """``value`` against ``other``, the score of ``against`` (a baseline's name, or "base")."""
    passed = value > other if higher else value < other
    return {"what": what, "against": against, "value": value, "other": other, "passed": passed}


def _tests(f: FamilyRecipe, result: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The test entries: the base on its general (and held-out packages') test split, base and adapter on the
    domain's, each with its baselines."""
    keys = SCORING[f.family].reported

    def split(evaluation: str, baselines: str, **systems: str) -> dict[str, Any]:
        return {
            "examples": result[evaluation].get("test_examples"),
            **{name: _pick(result[stage], keys) for name, stage in systems.items()},
            "baselines": _baselines(result[baselines]),
        }

    base, domain = f"eval-{f.model}-base", f"eval-{f.model}-base-on-{f.adapter}"
    tests = {"general": split(base, f"baselines-{f.model}", model=base)}
    if f.heldout:
        heldout = f"eval-{f.model}-base-on-heldout"
        tests["heldout"] = split(heldout, f"baselines-{f.model}-heldout", model=heldout)
    tests["domain"] = split(
        domain, f"baselines-{f.model}-{f.adapter}", base=domain, adapter=f"eval-{f.model}-{f.adapter}-on-{f.adapter}"
    )
    return tests


def _checks(f: FamilyRecipe, tests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The model (the adapter on the domain) against each baseline on each test split, and the adapter against
    the base on the domain."""
    scoring, checks = SCORING[f.family], []
    for split, test in tests.items():
        label, metrics = (f"{f.model}+{f.adapter}", test["adapter"]) if split == "domain" else (f.model, test["model"])
        for name in scoring.baselines:
            for key in scoring.checked if name in test["baselines"] else ():
                what = f"{label} {key} vs {name} on the {SPLIT_NAMES[split]} test split"
                other = test["baselines"][name][key]
                checks.append(_check(what, name, metrics[key], other, scoring.higher_is_better))
    domain = tests["domain"]
    for key in scoring.checked:
        what = f"{f.model}+{f.adapter} {key} vs the base on the {f.adapter} test split"
        checks.append(_check(what, "base", domain["adapter"][key], domain["base"][key], scoring.higher_is_better))
    return checks


def family_summary(f: FamilyRecipe, result: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One model's entry of summary.json and its checks against the baselines and its base."""
    trained, adapted = result[f"train-{f.model}"], result[f"lora-{f.model}-{f.adapter}"]
    tests = _tests(f, result)
    entry = {
        "family": f.family,
        "arch": f.sizes.arch,
        "parameters": trained.get("parameters"),
        "sizes": trained.get("sizes"),
        "train": _training(trained, f.train_loop.max_steps),
        "adapter": {
            "name": f.adapter,
            "rank": adapted.get("rank"),
            "targets": adapted.get("targets"),
            "trainable_parameters": adapted.get("trainable_parameters"),
            "train": _training(adapted, f.lora_loop.max_steps),
        },
        "test": tests,
    }
    if f"out-of-label-{f.model}" in result:
        entry["out_of_label"] = result[f"out-of-label-{f.model}"]
    return entry, _checks(f, tests)


def build_summary(
    tier: Tier, records: dict[str, dict[str, Any]], machine: dict[str, Any], wall_s: float
) -> dict[str, Any]:
    """summary.json from the stage records (``{stage: {"seconds", "result"}}``)."""
    result = {name: record["result"] for name, record in records.items()}
    corpora = {
        r["corpus"]: {k: r[k] for k in CORPUS_KEYS if k in r}
        for name, r in result.items()
        if name.startswith("prepare-")
    }
    models, checks = {}, []
    for f in tier.families:
        models[f.model], family_checks = family_summary(f, result)
        checks += family_checks
    stage_seconds = {name: record["seconds"] for name, record in records.items()}
    return {
        "tier": tier.name,
        "machine": machine,
        "wall_s_this_run": round(wall_s, 1),
        "stage_seconds": stage_seconds,
        "stage_seconds_total": round(sum(s for s in stage_seconds.values() if s is not None), 1),
        "corpora": corpora,
        "models": models,
        "checks": checks,
        "all_checks_passed": all(check["passed"] for check in checks),
    }
