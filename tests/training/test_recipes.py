"""The recipe end to end on tiny corpora written here, and the trivial baselines against hand-computed values."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import random
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sacrebleu
import torch

from model.checkpoint import load_checkpoint
from model.lora_io import load_adapter
from tests.training.mo_writer import write_locale_tree
from training import baselines
from training.arch import ModelSizes
from training.baselines import lm_targets, majority_class, map_langdetect, unigram_perplexity
from training.data import LabeledText, Pair
from training.errors import UserError
from training.recipe_run import run_recipe
from training.recipe_stages import Paths, plan
from training.recipes import FamilyRecipe, Tier
from training.runs import LORA_LOOP, AdapterSpec, Data, Loop, SplitFractions, TrainRun
from training.train_run import train

HAS_LANGDETECT = importlib.util.find_spec("langdetect") is not None
WORDS = {
    "es": ["archivo", "abrir", "guardar", "cerrar", "rama", "nuevo", "borrar", "todo"],
    "fr": ["fichier", "ouvrir", "enregistrer", "fermer", "branche", "nouveau", "effacer", "tout"],
    "de": ["Datei", "öffnen", "speichern", "schließen", "Zweig", "neu", "löschen", "alles"],
}
ENGLISH = ["file", "open", "save", "close", "branch", "new", "delete", "all"]
TINY = ModelSizes(layers=1, d_model=16, heads=2, ffn=32, max_len=32)
LOOP = {"max_steps": 3, "eval_every": 3, "save_every": 3, "batch_tokens": 256, "warmup": 2}


def _catalog(rng: random.Random, lang: str, n: int) -> dict[str, str]:
    messages = {}
    for _ in range(n):
        idx = [rng.randrange(len(ENGLISH)) for _ in range(rng.randint(2, 5))]
        messages[" ".join(ENGLISH[i] for i in idx)] = " ".join(WORDS[lang][i] for i in idx)
    return messages


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A locale tree (es/fr/de; packages alpha, beta, git, iso_3166) and a stdlib of 24 files."""
    root = tmp_path_factory.mktemp("sources")
    rng = random.Random(0)
    packages = ("alpha", "beta", "git", "iso_3166")
    tree = {lang: {pkg: _catalog(rng, lang, 80) for pkg in packages} for lang in WORDS}
    locale = write_locale_tree(root / "locale", tree)
    stdlib = root / "stdlib"
    for i in range(12):
        for rel in (f"mod{i}.py", f"test/test_mod{i}.py"):
            path = stdlib / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            body = "".join(f"    x{j} = {i} + {j}\n" for j in range(rng.randint(3, 9)))
            path.write_text(f"def f{i}():\n{body}    return x0\n", encoding="utf-8")
    return locale, stdlib


def tiny_tier() -> Tier:
    def family(model: str, family: str, adapter: str, arch: str) -> FamilyRecipe:
        return FamilyRecipe(
            model=model,
            family=family,
            adapter=adapter,
            sizes=replace(TINY, arch=arch),
            vocab_size=300,
            train_loop=Loop(**LOOP),
            train_minutes=1.0,
            lora=AdapterSpec(rank=2, alpha=4),
            lora_loop=replace(LORA_LOOP, **LOOP),
            lora_minutes=1.0,
            eval_minutes=0.1,
        )

    return Tier(
        name="tiny",
        translation=family("translation", "seq2seq", "git", "paper"),
        langid=family("langid", "classifier", "iso", "bert"),
        code=family("code", "causal_lm", "tests", "gpt2"),
        translation_package="git",
        langdetect=HAS_LANGDETECT,
        fractions=SplitFractions(valid_fraction=0.2, test_fraction=0.2),
    )


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
    assert len(summary["checks"]) == 3 + (5 if HAS_LANGDETECT else 3) + 3
    assert all({"what", "value", "other", "passed"} <= set(c) for c in summary["checks"])
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
