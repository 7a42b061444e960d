"""A tiny recipe for the tests: a locale tree and a stdlib written by the test, and a tier of 3-step models."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace
from pathlib import Path

from tests.training.heldout import package_in
from tests.training.mo_writer import write_locale_tree
from training.arch import ModelSizes
from training.corpora import HELDOUT_SPLITS
from training.recipes import FamilyRecipe, Tier
from training.runs import LORA_LOOP, AdapterSpec, Loop, SplitFractions

HAS_LANGDETECT = importlib.util.find_spec("langdetect") is not None
WORDS = {
    "es": ["archivo", "abrir", "guardar", "cerrar", "rama", "nuevo", "borrar", "todo"],
    "fr": ["fichier", "ouvrir", "enregistrer", "fermer", "branche", "nouveau", "effacer", "tout"],
    "de": ["Datei", "öffnen", "speichern", "schließen", "Zweig", "neu", "löschen", "alles"],
    "tr": ["dosya", "aç", "kaydet", "kapat", "dal", "yeni", "sil", "hepsi"],  # outside langid's candidates
}
HELD_OUT = {split: package_in(split) for split in HELDOUT_SPLITS}
ENGLISH = ["file", "open", "save", "close", "branch", "new", "delete", "all"]
TINY = ModelSizes(layers=1, d_model=16, heads=2, ffn=32, max_len=32)
STEPS = 3  # every phase of the tiny tier
LOOP = {"max_steps": STEPS, "eval_every": 3, "save_every": 3, "batch_tokens": 256, "warmup": 2}


def _catalog(rng: random.Random, lang: str, n: int) -> dict[str, str]:
    messages = {}
    for _ in range(n):
        idx = [rng.randrange(len(ENGLISH)) for _ in range(rng.randint(2, 5))]
        messages[" ".join(ENGLISH[i] for i in idx)] = " ".join(WORDS[lang][i] for i in idx)
    return messages


def write_sources(root: Path) -> tuple[Path, Path]:
    """A locale tree (es/fr/de/tr; packages alpha, beta, git, iso_3166 and two held out) and a stdlib of 24 files."""
    rng = random.Random(0)
    packages = ("alpha", "beta", "git", "iso_3166", *HELD_OUT.values())
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
    """Three families of 1-layer models; every base and adapter trains for STEPS steps."""

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
