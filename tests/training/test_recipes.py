"""The recipe end to end on tiny corpora written here, and the trivial baselines against hand-computed values."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sacrebleu
import torch

from model.calibration import Calibration
from model.checkpoint import load_checkpoint
from model.lora_io import load_adapter
from tests.training.tiny_recipe import HAS_LANGDETECT, HELD_OUT, tiny_tier, write_sources
from training import baselines
from training.baselines import lm_targets, majority_class, map_langdetect, unigram_perplexity
from training.corpora import OUT_OF_LABEL
from training.data import LabeledText, Pair, read_pairs
from training.errors import UserError
from training.out_of_label import rejections
from training.recipe_report import report_lines
from training.recipe_run import run_recipe, run_stage
from training.recipe_stages import Paths, plan, prepare_stages
from training.runs import Data, TrainRun
from training.train_run import train


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_sources(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="module")
def finished(sources: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Paths, dict]:
    root = tmp_path_factory.mktemp("recipe")
    paths = Paths(root / "checkpoints", root / "data", *sources)
    return paths, run_recipe(tiny_tier(), paths, jobs=2)  # the families in two worker processes


def test_recipe_writes_models_adapters_and_summary_in_the_service_layout(finished: tuple[Paths, dict]) -> None:
    paths, summary = finished
    assert sorted(p.name for p in (paths.out / "models").iterdir()) == ["code", "langid", "translation"]
    adapters = sorted(p.relative_to(paths.out / "adapters").as_posix() for p in (paths.out / "adapters").glob("*/*"))
    assert adapters == ["code/tests", "langid/iso", "translation/git"]  # nothing else, no .state dirs
    for model, adapter in (p.split("/") for p in adapters):
        ckpt = load_checkpoint(paths.out / "models" / model, dtype=torch.float32)
        config = load_adapter(ckpt.model, paths.out / "adapters" / model / adapter, adapter)
        assert Path(config.base_model_name_or_path) == (paths.out / "models" / model).resolve()

    assert json.loads((paths.out / "summary.json").read_text()) == summary
    assert summary["tier"] == "tiny" and set(summary["stage_seconds"]) == {s.name for s in plan(tiny_tier(), paths)}
    assert set(summary["corpora"]) == {"translation", "translation-git", "langid", "langid-iso", "code", "code-tests"}
    for name, model in summary["models"].items():
        assert model["parameters"] > 0 and model["train"]["steps_trained"] == 3, name
        assert model["adapter"]["trainable_parameters"] > 0
        assert model["test"]["general"]["examples"] > 0 and model["test"]["domain"]["examples"] > 0
    translation = summary["models"]["translation"]["test"]
    assert {"bleu", "chrf"} <= set(translation["domain"]["adapter"])
    assert set(translation["general"]["baselines"]) == {"copy_source"}
    langid = summary["models"]["langid"]["test"]["domain"]["baselines"]
    assert set(langid) == ({"majority", "langdetect"} if HAS_LANGDETECT else {"majority"})
    code = summary["models"]["code"]["test"]
    for split in ("general", "domain"):  # the unigram is scored on exactly the model's tokens
        model = code[split]["model" if split == "general" else "base"]
        assert model["tokens"] == code[split]["baselines"]["unigram"]["tokens"]
    # translation: BLEU and chrF vs copy-source on 3 splits, and vs the base; langid: accuracy vs 2 (or 1) baselines
    # on 3 splits, and vs the base; code: perplexity vs the unigram on 2 splits, and vs the base.
    assert len(summary["checks"]) == 8 + (7 if HAS_LANGDETECT else 4) + 3
    assert all({"what", "against", "value", "other", "passed"} <= set(c) for c in summary["checks"])
    assert summary["all_checks_passed"] == all(c["passed"] for c in summary["checks"])
    for name, model in summary["models"].items():  # every phase trained the tier's fixed steps
        assert model["train"]["steps_trained"] == model["train"]["fixed_steps"] == 3, name
        assert model["adapter"]["train"]["steps_trained"] == model["adapter"]["train"]["fixed_steps"] == 3, name
    # The code model's generation defaults, chosen on its valid split, are in its generation_config.json.
    tuned = json.loads(paths.record("tune-generation-code").read_text())["result"]
    assert len(tuned["scores"]) == 10 and all(0 <= s["loop_rate"] <= 1 and s["chrf"] >= 0 for s in tuned["scores"])
    written = json.loads((paths.out / "models" / "code" / "generation_config.json").read_text())
    assert written == {"repetition_penalty": tuned["chosen"]["repetition_penalty"],
                       "no_repeat_ngram_size": tuned["chosen"]["no_repeat_ngram_size"]}
    assert load_checkpoint(paths.out / "models" / "code").generation.repetition_penalty == written["repetition_penalty"]
    calibrated = json.loads(paths.record("calibrate-langid").read_text())["result"]
    served = load_checkpoint(paths.out / "models" / "langid").calibration
    assert (served.temperature, served.min_confidence) == (calibrated["temperature"], calibrated["min_confidence"])
    assert {"ece_before", "ece_after", "rejected"} <= set(calibrated)


def test_recipe_measures_the_held_out_packages_against_the_baselines(finished: tuple[Paths, dict]) -> None:
    paths, summary = finished
    for f in (tiny_tier().translation, tiny_tier().langid):
        manifest = json.loads((paths.corpus(f.model) / "manifest.json").read_text())
        assert manifest["heldout"]["packages"] == {split: [package] for split, package in HELD_OUT.items()}
        assert summary["corpora"][f.model]["heldout"] == manifest["heldout"]
        heldout = summary["models"][f.model]["test"]["heldout"]
        assert heldout["examples"] == manifest["counts"]["test-heldout"] > 0
        # The held-out metrics are merged as their own entry; the general split's stay at the top level.
        metrics = json.loads((paths.model(f) / "metrics.json").read_text())
        assert metrics["test_file"] == str(paths.split(f.model, f.kind, "test"))
        assert metrics["test-heldout"]["test_file"] == str(paths.split(f.model, f.kind, "test-heldout"))
        assert heldout["model"].items() <= metrics["test-heldout"].items()
    pairs = read_pairs(paths.split("translation", "translation", "test-heldout")).records
    copied = summary["models"]["translation"]["test"]["heldout"]["baselines"]["copy_source"]
    assert copied == pytest.approx(baselines.copy_source(pairs))
    checked = {c["what"] for c in summary["checks"]}
    for key in ("bleu", "chrf"):
        assert f"translation {key} vs copy_source on the package-held-out test split" in checked
    assert "langid accuracy vs majority on the package-held-out test split" in checked
    assert ("langid accuracy vs langdetect on the package-held-out test split" in checked) == HAS_LANGDETECT


def test_recipe_counts_what_calibrated_langid_rejects_in_and_out_of_its_labels(finished: tuple[Paths, dict]) -> None:
    paths, summary = finished
    result = summary["models"]["langid"]["out_of_label"]
    outside = paths.split("langid", "langid", OUT_OF_LABEL).read_text(encoding="utf-8").splitlines()
    assert result["out_of_label"]["texts"] == len(outside) > 0
    assert set(result["out_of_label"]["rejected_by_language"]) == {"tr"}  # the only language outside es, fr, de, en
    counts = json.loads((paths.corpus("langid") / "manifest.json").read_text())["counts"]
    assert {name: entry["texts"] for name, entry in result["in_label"].items()} == {
        "test": counts["test"], "test-heldout": counts["test-heldout"]}  # fmt: skip
    served = load_checkpoint(paths.model(tiny_tier().langid)).calibration
    assert (result["temperature"], result["min_confidence"]) == (served.temperature, served.min_confidence)


def test_out_of_label_rejections_count_each_text_as_the_service_decides(
    finished: tuple[Paths, dict], tmp_path: Path
) -> None:
    paths, _ = finished
    model = shutil.copytree(paths.model(tiny_tier().langid), tmp_path / "langid")
    ckpt = load_checkpoint(model, device="cpu", dtype=torch.float32)
    files = {name: paths.split("langid", "langid", name) for name in (OUT_OF_LABEL, "test")}

    def logits(text: str) -> torch.Tensor:  # one text at a time, unpadded: not the batched path under test
        ids, segments = ckpt.tokenizer.encode_pair(text)
        with torch.no_grad():
            return ckpt.model(torch.tensor([ids[:32]]), torch.tensor([segments[:32]]))[0].double()

    texts = {name: [line.split("\t")[0] for line in path.read_text(encoding="utf-8").splitlines()]
             for name, path in files.items()}  # fmt: skip
    scores = {name: torch.stack([logits(text) for text in group]) for name, group in texts.items()}
    # The 3-step model's logits barely depend on the text (top-2 margins of ~2e-3 that differ by ~1e-5, batched
    # and unbatched logits by ~1e-9): a temperature of the median margin keeps the confidences apart.
    top2 = scores[OUT_OF_LABEL].topk(2, dim=-1).values
    temperature = float((top2[:, 0] - top2[:, 1]).median())
    confidences = {name: torch.softmax(s / temperature, -1).max(-1).values.tolist() for name, s in scores.items()}
    ordered = sorted(confidences[OUT_OF_LABEL])
    # The threshold in the widest gap between the middle half's confidences, far from both.
    i = max(range(len(ordered) // 4, 3 * len(ordered) // 4), key=lambda i: ordered[i + 1] - ordered[i])
    threshold = (ordered[i] + ordered[i + 1]) / 2
    Calibration(temperature, threshold).save(model)
    result = rejections(model, files[OUT_OF_LABEL], {"test": files["test"]})
    expected = {name: sum(c < threshold for c in values) / len(values) for name, values in confidences.items()}
    assert result["out_of_label"]["rejected"] == pytest.approx(expected[OUT_OF_LABEL]) and expected[OUT_OF_LABEL] > 0
    assert result["in_label"]["test"]["rejected"] == pytest.approx(expected["test"])


def test_a_corpus_prepared_before_the_held_out_packages_is_prepared_again(
    sources: tuple[Path, Path], tmp_path: Path
) -> None:
    paths = Paths(tmp_path / "checkpoints", tmp_path / "data", *sources)
    stage = next(s for s in prepare_stages(tiny_tier(), paths) if s.name == "prepare-translation")
    assert run_stage(stage, paths, force=False) and not run_stage(stage, paths, force=False)
    path = paths.corpus("translation") / "manifest.json"
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "heldout"}
    path.write_text(json.dumps(old))
    (paths.corpus("translation") / "test-heldout.tsv").unlink()
    assert run_stage(stage, paths, force=False)
    assert "heldout" in json.loads(path.read_text())
    assert paths.split("translation", "translation", "test-heldout").is_file()


def test_recipe_skips_finished_stages_and_redoes_a_missing_or_stale_one(
    finished: tuple[Paths, dict], caplog: pytest.LogCaptureFixture
) -> None:
    paths, summary = finished
    stages = plan(tiny_tier(), paths)
    shutil.rmtree(paths.adapter(tiny_tier().langid))
    with caplog.at_level(logging.INFO, logger="training.recipe_run"):
        again = run_recipe(tiny_tier(), paths)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().endswith("skipped")]
    ran = [r.getMessage().split("] ")[1].split(" done")[0] for r in caplog.records if " done in " in r.getMessage()]
    # The adapter, then its evaluation: its record is older than the new adapter's weights.
    assert ran == ["lora-langid-iso", "eval-langid-iso-on-iso"]
    assert len(skipped) == len(stages) - 2
    assert (paths.adapter(tiny_tier().langid) / "adapter_config.json").is_file()
    assert again["models"]["translation"] == summary["models"]["translation"]
    # The output ends with the report: every check, then the verdict (training.recipe_report).
    ended = [r.getMessage() for r in caplog.records if r.name == "training.recipe_run"]
    assert ended[-len(report_lines(again, str(paths.out))) :] == report_lines(again, str(paths.out))


def test_recipe_resumes_an_interrupted_training_run(
    finished: tuple[Paths, dict], caplog: pytest.LogCaptureFixture
) -> None:
    paths, _ = finished
    f = tiny_tier().code
    shutil.rmtree(paths.model(f))
    # An interrupted run: its state (saved at step 2 of 3) is left under runs/, the model never moved.
    data = Data(paths.split("code", "code", "train"), paths.split("code", "code", "valid"))
    out, loop = paths.run_dir(paths.model(f)), replace(f.train_loop, max_steps=2)
    train(TrainRun(family=f.family, data=data, out=out, sizes=f.sizes, vocab_size=f.vocab_size, loop=loop))
    with caplog.at_level(logging.INFO):
        summary = run_recipe(tiny_tier(), paths)
    assert any("resumed from" in r.getMessage() and "at step 2" in r.getMessage() for r in caplog.records)
    assert summary["models"]["code"]["train"]["steps_trained"] == 3
    assert (paths.model(f) / "config.json").is_file() and not paths.run_dir(paths.model(f)).exists()


def test_majority_class_by_hand() -> None:
    train = [LabeledText(t, label, 0) for t, label in (("x", "b"), ("y", "a"), ("z", "a"), ("w", "b"))]
    test = [LabeledText("q", label, 0) for label in ("a", "b", "b")]
    result = majority_class(train, test)  # a tie: the first label in sorted order
    assert result["label"] == "a"
    assert result["accuracy"] == pytest.approx(1 / 3)
    assert result["macro_f1"] == pytest.approx((2 * 1 / (1 + 3) + 0) / 2)


def test_unigram_perplexity_by_hand() -> None:
    result = unigram_perplexity([1, 1, 2], [1, 3], vocab_size=5)  # p(1) = 3/8, p(3) = 1/8
    assert result["perplexity"] == pytest.approx(math.exp(-(math.log(3 / 8) + math.log(1 / 8)) / 2))
    assert result["perplexity"] == pytest.approx(math.sqrt(64 / 3))


def test_lm_targets_are_the_stream_less_its_first_token(finished: tuple[Paths, dict]) -> None:
    tokenizer = baselines.load_tokenizer(finished[0].model(tiny_tier().code))
    a, b = tokenizer.encode("x = 1"), tokenizer.encode("y")
    assert lm_targets(["x = 1", "y"], tokenizer) == [*a, 2, 1, *b, 2]


def test_copy_source_bleu_is_sacrebleus() -> None:
    pairs = [
        Pair("Open the file", "Abrir el archivo", 1),
        Pair("use git commit --amend --no-edit", "usa git commit --amend --no-edit", 2),
    ]
    expected = sacrebleu.corpus_bleu([p.source for p in pairs], [[p.target for p in pairs]]).score
    assert baselines.copy_source(pairs)["bleu"] == pytest.approx(expected)
    assert baselines.copy_source(pairs)["bleu"] > 0


def test_langdetect_codes_map_onto_labels() -> None:
    labels = ["de", "en", "pt_BR", "zh_CN"]
    assert map_langdetect("zh-cn", labels) == "zh_CN"
    assert map_langdetect("zh-tw", labels) == "zh_CN"  # generous: same language, other region
    assert map_langdetect("pt", labels) == "pt_BR"
    assert map_langdetect("de", labels) == "de"
    assert map_langdetect("ca", labels) == "ca"  # no such label: a miss


def test_langdetect_macro_f1_leaves_out_labels_the_model_cannot_predict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(baselines, "langdetect_predict", lambda texts, labels: ["de", "ca", "fr", "fr"])
    test = [LabeledText("t", label, 0) for label in ("de", "fr", "fr", "de")]
    result = baselines.langdetect_baseline(test, ["de", "fr"])
    assert result["accuracy"] == 0.5 and result["outside_labels"] == 1
    # F1(de) = 2*1/(2+1), F1(fr) = 2*1/(2+2); "ca" (never gold, not a label) is left out of the mean.
    assert result["macro_f1"] == pytest.approx((2 / 3 + 1 / 2) / 2)


@pytest.mark.skipif(not HAS_LANGDETECT, reason="langdetect is a docs/benchmark-only dependency")
def test_langdetect_is_seeded_and_detects_plain_sentences() -> None:
    texts = ["Dies ist ein ganz normaler deutscher Satz über das Wetter.", "这是一个关于天气的普通中文句子。"]
    first = baselines.langdetect_predict(texts, ["de", "zh_CN"])
    assert first == ["de", "zh_CN"] == baselines.langdetect_predict(texts, ["de", "zh_CN"])


def test_langdetect_missing_is_a_clear_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langdetect", None)  # makes `import langdetect` raise ImportError
    with pytest.raises(UserError, match=r"pip install langdetect==1\.0\.9"):
        baselines.langdetect_predict(["Hallo Welt"], ["de"])
