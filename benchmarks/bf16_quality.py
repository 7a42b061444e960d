"""fp32 against int8 and bf16 weights on the default models (issue 40's bar: the metric moves < 0.5%).

`python -m benchmarks.bf16_quality --checkpoints DIR --data DIR [--modes none int8 bf16] [--max-examples N]
[--no-adapters]`

The default models are what `make run` trains (`python -m training recipe quick --out DIR --data DIR`): DIR/models/
translation (BLEU, chrF), langid (accuracy, macro-F1) and code (perplexity), each scored on its corpus's test split
(DIR/<corpus>/test.*) by `python -m training evaluate`'s own function (training.evaluate_run.evaluate, greedy as the
recipe scores them), once per quantize mode (model.quantize), and with the recipe's LoRA adapter on that base
(DIR/adapters/<model>/<adapter>, scored on the adapter's corpus: LoRA's float deltas over the quantised base). The
models and adapters are copied to a temporary folder first: evaluate merges its metrics into metrics.json, and the
checkpoints stay as they were. Prints one markdown table: each metric per mode and its relative change against fp32.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import machine_line, markdown_table
from model.quantize import QUANTIZE_MODES
from training.evaluate_run import evaluate
from training.runs import EvalRun

# Model -> (its test corpus, the metrics reported, the recipe's adapter and its corpus); perplexity: lower is better
DEFAULTS = {
    "translation": ("translation", ("bleu", "chrf"), ("postgres", "translation-postgres")),
    "langid": ("langid", ("accuracy", "macro_f1"), ("iso", "langid-iso")),
    "code": ("code", ("perplexity",), ("tests", "code-tests")),
}
BAR = 0.005  # issue 40: a metric may move less than 0.5% of its fp32 value


@dataclass(frozen=True)
class Subject:
    """One evaluation: a default model (and adapter) on a test split."""

    label: str
    model: Path
    test: Path
    metrics: tuple[str, ...]
    adapter: Path | None = None


def subjects(checkpoints: Path, data: Path, adapters: bool) -> list[Subject]:
    """The default models found under ``checkpoints`` (and their adapters), each with its test split in ``data``."""
    found = []
    for name, (corpus, metrics, (adapter, adapter_corpus)) in DEFAULTS.items():
        model = checkpoints / "models" / name
        if not model.is_dir():
            continue
        found.append(Subject(name, model, _test_split(data / corpus), metrics))
        adapter_dir = checkpoints / "adapters" / name / adapter
        if adapters and adapter_dir.is_dir():
            found.append(Subject(f"{name} + {adapter} adapter", model, _test_split(data / adapter_corpus), metrics,
                                 adapter_dir))
    if not found:
        raise SystemExit(f"no default model under {checkpoints}/models: python -m training recipe quick --out "
                         f"{checkpoints} trains them")
    return found


def _test_split(corpus: Path) -> Path:
    """The test file of a corpus folder (test.tsv or test.txt)."""
    for name in ("test.tsv", "test.txt"):
        if (corpus / name).is_file():
            return corpus / name
    raise SystemExit(f"{corpus}: no test.tsv or test.txt (python -m training prepare writes them)")


def score(subject: Subject, mode: str, max_examples: int | None, scratch: Path) -> dict[str, float]:
    """``subject``'s metrics under quantize ``mode``, evaluated on copies in ``scratch`` (metrics.json is merged)."""
    model = scratch / f"{subject.model.name}-{mode}"
    if not model.exists():
        shutil.copytree(subject.model, model)
    adapter = None
    if subject.adapter is not None:
        adapter = scratch / f"{subject.model.name}-{subject.adapter.name}-{mode}"
        if not adapter.exists():
            shutil.copytree(subject.adapter, adapter)
    run = EvalRun(model=model, test=subject.test, adapter=adapter, beams=1, max_examples=max_examples, device="cpu",
                  quantize=mode)
    return evaluate(run)


def relative(value: float, reference: float) -> float:
    return (value - reference) / reference if reference else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"), help="the recipe's --out")
    parser.add_argument("--data", type=Path, default=Path("data"), help="the recipe's --data (corpora)")
    parser.add_argument("--modes", nargs="+", choices=QUANTIZE_MODES, default=list(QUANTIZE_MODES))
    parser.add_argument("--max-examples", type=int, default=None, help="score only the first N examples of each")
    parser.add_argument("--no-adapters", action="store_true", help="the base models only")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("training.evaluate_run").setLevel(logging.ERROR)  # "adapter trained on <original>": the copies
    torch.set_num_threads(args.threads)
    modes = ["none", *(m for m in args.modes if m != "none")]  # fp32 is the reference
    rows = []
    worst = {m: 0.0 for m in modes[1:]}
    with tempfile.TemporaryDirectory() as folder:
        for subject in subjects(args.checkpoints, args.data, not args.no_adapters):
            results = {}
            for mode in modes:
                start = time.perf_counter()
                results[mode] = score(subject, mode, args.max_examples, Path(folder))
                results[mode]["seconds"] = time.perf_counter() - start
            for metric in subject.metrics:
                ref = results["none"][metric]
                cells = [subject.label, metric, results["none"]["test_examples"], f"{ref:.4g}"]
                for mode in modes[1:]:
                    change = relative(results[mode][metric], ref)
                    worst[mode] = max(worst[mode], abs(change))
                    cells.append(f"{results[mode][metric]:.4g} ({change:+.2%})")
                rows.append(cells)
            rows.append([subject.label, "seconds", "", *(f"{results[m]['seconds']:.1f}" for m in modes)])
    print(machine_line())
    print(markdown_table(["model", "metric", "examples", "fp32", *modes[1:]], rows))
    for mode, change in worst.items():
        print(f"{mode}: largest change {change:.2%} of fp32 ({'within' if change < BAR else 'beyond'} the "
              f"{BAR:.1%} bar)")


if __name__ == "__main__":
    main()
