"""summary.json of a recipe: corpora, model sizes, training times, test metrics against the baselines."""

from __future__ import annotations

from typing import Any

from training.recipes import FamilyRecipe, Tier

# Per family: the test metrics reported, the one the checks compare, whether higher is better, and
# the baselines that metric is compared with (name in the baselines record -> its metric key).
METRICS = {
    "seq2seq": (("bleu", "chrf"), "bleu", True, {"copy_source": "bleu"}),
    "classifier": (("accuracy", "macro_f1"), "accuracy", True, {"majority": "accuracy", "langdetect": "accuracy"}),
    "causal_lm": (("perplexity", "nll", "tokens"), "perplexity", False, {"unigram": "perplexity"}),
}
TRAIN_KEYS = ("steps_trained", "total_train_tokens", "total_wall_time_s", "best_step")


def _pick(metrics: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: metrics[k] for k in keys if k in metrics}


def _training(metrics: dict[str, Any], minutes: float) -> dict[str, Any]:
    train = _pick(metrics, TRAIN_KEYS)
    wall, tokens = metrics.get("total_wall_time_s"), metrics.get("total_train_tokens")
    if wall and tokens:
        train["tokens_per_s"] = round(tokens / wall, 1)
    return {**train, "max_minutes": minutes}


def _baselines(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if isinstance(v, dict)}


def _check(what: str, value: float, other: float, higher: bool) -> dict[str, Any]:
    passed = value > other if higher else value < other
    return {"what": what, "value": value, "other": other, "passed": passed}


def family_summary(f: FamilyRecipe, result: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One model's entry of summary.json and its checks against the baselines and its base."""
    keys, main, higher, compared = METRICS[f.family]
    trained, adapted = result[f"train-{f.model}"], result[f"lora-{f.model}-{f.adapter}"]
    general = _pick(result[f"eval-{f.model}-base"], keys)
    base_domain = _pick(result[f"eval-{f.model}-base-on-{f.adapter}"], keys)
    adapter_domain = _pick(result[f"eval-{f.model}-{f.adapter}-on-{f.adapter}"], keys)
    general_baselines = _baselines(result[f"baselines-{f.model}"])
    domain_baselines = _baselines(result[f"baselines-{f.model}-{f.adapter}"])
    entry = {
        "family": f.family,
        "arch": f.sizes.arch,
        "parameters": trained.get("parameters"),
        "sizes": trained.get("sizes"),
        "train": _training(trained, f.train_minutes),
        "adapter": {
            "name": f.adapter,
            "rank": adapted.get("rank"),
            "targets": adapted.get("targets"),
            "trainable_parameters": adapted.get("trainable_parameters"),
            "train": _training(adapted, f.lora_minutes),
        },
        "test": {
            "general": {
                "examples": result[f"eval-{f.model}-base"].get("test_examples"),
                "model": general,
                "baselines": general_baselines,
            },
            "domain": {
                "examples": result[f"eval-{f.model}-base-on-{f.adapter}"].get("test_examples"),
                "base": base_domain,
                "adapter": adapter_domain,
                "baselines": domain_baselines,
            },
        },
    }
    checks = []
    for split, label, metrics, baselines in (
        ("general", f"{f.model}", general, general_baselines),
        ("domain", f"{f.model}+{f.adapter}", adapter_domain, domain_baselines),
    ):
        for name, key in compared.items():
            if name in baselines:
                what = f"{label} {main} vs {name} on the {split} test split"
                checks.append(_check(what, metrics[main], baselines[name][key], higher))
    what = f"{f.model}+{f.adapter} {main} vs the base on the {f.adapter} test split"
    checks.append(_check(what, adapter_domain[main], base_domain[main], higher))
    return entry, checks


def build_summary(
    tier: Tier, records: dict[str, dict[str, Any]], machine: dict[str, Any], wall_s: float
) -> dict[str, Any]:
    """summary.json from the stage records (``{stage: {"seconds", "result"}}``)."""
    result = {name: record["result"] for name, record in records.items()}
    corpora = {
        r["corpus"]: {k: r[k] for k in ("kind", "counts", "chars", "labels", "lang", "subset") if k in r}
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
    }
