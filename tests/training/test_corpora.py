"""Corpora built from tiny gettext catalogs and a fake stdlib written by the tests themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import product
from pathlib import Path
from string import ascii_lowercase

import pytest

from tests.training.heldout import package_in
from tests.training.mo_writer import write_locale_tree
from training import corpora
from training.cli import main
from training.corpora import HELDOUT_SPLITS, SPLITS, PackageFilter, PackageHoldout, split_of, split_records
from training.data import Pair
from training.errors import UserError
from training.prepare import is_current, write_atomic
from training.runs import LangidCorpus

REPO = Path(__file__).resolve().parents[2]

ALPHA_ES = {
    "Hello": "Hola",
    "Open %s file": "Abrir archivo %s",
    "%(count)d items in {name}": "%(count)d elementos en {name}",
    "%1$s of %2$s": "%1$s de %2$s",
    "{0} saved": "{0} guardado",
    ("one file", "%d files"): ["un archivo", "%d archivos"],
    "OK": "OK",
    "Untranslated": "",
    "menu\x04Quit": "Salir",
    "Line one\n  line two\tend\n": "Línea uno\n  línea dos\tfin\n",
    "A very long message " * 10: "Un mensaje muy largo " * 10,
}
EXPECTED_ALPHA = {
    ("Hello", "Hola"),
    ("Open %s file", "Abrir archivo %s"),
    ("%(count)d items in {name}", "%(count)d elementos en {name}"),
    ("%1$s of %2$s", "%1$s de %2$s"),
    ("{0} saved", "{0} guardado"),
    ("Quit", "Salir"),
    ("Line one line two end", "Línea uno línea dos fin"),
    (("A very long message " * 10).strip(), ("Un mensaje muy largo " * 10).strip()),
}


@pytest.fixture
def locale_dir(tmp_path: Path) -> Path:
    return write_locale_tree(
        tmp_path / "locale",
        {
            "es": {"alpha": ALPHA_ES, "beta": {"Hello": "Hola beta", "Goodbye": "Adiós", "Save": "Guardar"}},
            "fr": {"alpha": {"Hello": "Bonjour", "Goodbye": "Au revoir", "%d%%": "%d %%", "Yes": "Oui", "No": "Non"}},
            "de": {"alpha": {"Goodbye": "Auf Wiedersehen", "Close": "Hola"}, "beta": {"Save": "Speichern"}},
        },
    )


def test_read_catalog_pairs_skips_header_plural_identical_empty(locale_dir: Path) -> None:
    pairs = corpora.read_catalog_pairs(locale_dir / "es" / "LC_MESSAGES" / "alpha.mo")
    assert {(p.source, p.target) for p in pairs} == EXPECTED_ALPHA
    assert {p.package for p in pairs} == {"alpha"}


def test_translation_dedups_filters_and_caps_length(locale_dir: Path) -> None:
    pairs = corpora.build_translation(locale_dir, "es", max_chars=100)
    sources = [p.source for p in pairs]
    assert len(sources) == len(set(sources))
    assert Pair("Hello", "Hola", package="alpha") in pairs  # the first package in name order wins
    assert not any(len(p.source) > 100 for p in pairs)
    assert len(pairs) == len(EXPECTED_ALPHA) - 1 + 2  # minus the long one, plus Goodbye and Save

    only_beta = corpora.build_translation(locale_dir, "es", PackageFilter(include=frozenset({"beta"})))
    assert {(p.source, p.target, p.package) for p in only_beta} == {
        ("Hello", "Hola beta", "beta"),
        ("Goodbye", "Adiós", "beta"),
        ("Save", "Guardar", "beta"),
    }
    no_alpha = corpora.build_translation(locale_dir, "es", PackageFilter(exclude=frozenset({"alpha"})))
    assert set(no_alpha) == set(only_beta)
    with pytest.raises(UserError, match="nosuch"):
        corpora.build_translation(locale_dir, "es", PackageFilter(include=frozenset({"nosuch"})))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("%s: %s", False), ("%1$s, %2$s", False), ("%-5lu {0} {name:>4} %(x)s %%", False), ("%d files", True)],
)
def test_has_words_ignores_placeholders(text: str, expected: bool) -> None:
    assert corpora.has_words(text) is expected


def test_split_of_is_deterministic_and_follows_fractions() -> None:
    texts = [f"message number {i}" for i in range(4000)]
    splits = split_records(texts, key=lambda t: t, valid_fraction=0.1, test_fraction=0.2)
    assert splits == split_records(texts, key=lambda t: t, valid_fraction=0.1, test_fraction=0.2)
    assert 0.17 < len(splits["test"]) / 4000 < 0.23 and 0.08 < len(splits["valid"]) / 4000 < 0.12
    assert sum(map(len, splits.values())) == 4000
    assert not set(splits["train"]) & set(splits["test"])
    assert all(split_of(t, 0.0, 0.0) == "train" for t in texts[:50])
    with pytest.raises(ValueError):
        split_of("x", 0.5, 0.5)


def test_langid_labels_balance_and_ambiguity(locale_dir: Path) -> None:
    texts = corpora.build_langid(locale_dir, languages=("es", "fr", "de", "ja"), num_languages=2)
    by_text = {t.text: t.label for t in texts}
    assert {t.label for t in texts} == {"es", "fr", "en"}  # es and fr have the most texts; ja has none
    assert by_text["Bonjour"] == "fr" and by_text["Adiós"] == "es" and by_text["Goodbye"] == "en"
    assert "%d %%" not in by_text and "%d%%" not in by_text  # placeholders only
    assert by_text["%(count)d items in {name}"] == "en"
    assert "Auf Wiedersehen" not in by_text  # de not chosen

    texts = corpora.build_langid(locale_dir, languages=("es", "de"), max_per_language=3)
    by_text = {t.text: t.label for t in texts}
    assert "Hola" not in by_text  # es for Hello, de for Close: ambiguous
    counts = {label: sum(t.label == label for t in texts) for label in ("es", "de", "en")}
    assert counts == {"es": 3, "de": 2, "en": 3}

    only_beta = corpora.build_langid(locale_dir, languages=("es", "de"), packages=PackageFilter(frozenset({"beta"})))
    assert {t.package for t in only_beta} == {"beta"}
    with pytest.raises(UserError, match="no gettext catalogs"):
        corpora.build_langid(locale_dir, languages=("ja", "ko"))


@pytest.fixture
def stdlib_dir(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    files = {
        "os2.py": "import sys\n",
        "json2/__init__.py": "",
        "json2/decoder.py": "def decode(s):\n    return s\n",
        "json2/copy.py": "def decode(s):\n    return s\n",  # duplicate content
        "test/support.py": "HELPER = 1\n",
        "idlelib/idle_test/helper.py": "X = 2\n",
        "unittest/test_case.py": "def test_it():\n    assert True\n",
        "site-packages/third.py": "THIRD = 3\n",
        "__pycache__/cached.py": "C = 4\n",
        "huge.py": "# " + "x" * 5000 + "\n",
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "latin.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    return root


def test_code_subsets_and_skips(stdlib_dir: Path) -> None:
    paths = {f.path for f in corpora.build_code(stdlib_dir, max_file_bytes=1000)}
    duplicates = paths & {"json2/decoder.py", "json2/copy.py"}
    assert len(duplicates) == 1  # same content: kept once
    assert paths - duplicates == {"os2.py", "test/support.py", "idlelib/idle_test/helper.py", "unittest/test_case.py"}
    tests = {f.path for f in corpora.build_code(stdlib_dir, "tests", max_file_bytes=1000)}
    assert tests == {"test/support.py", "idlelib/idle_test/helper.py", "unittest/test_case.py"}
    nontests = {f.path for f in corpora.build_code(stdlib_dir, "nontests", max_file_bytes=1000)}
    assert not tests & nontests and "os2.py" in nontests
    assert len(corpora.build_code(stdlib_dir, max_files=2)) == 2
    with pytest.raises(UserError, match="libpython3.11-stdlib"):
        corpora.build_code(stdlib_dir / "missing")


def test_prepare_code_writes_whole_files(stdlib_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "code"
    args = ["prepare", "code", "--stdlib-dir", str(stdlib_dir), "--out", str(out), "--subset", "tests"]
    assert main([*args, "--valid-fraction", "0", "--test-fraction", "0"]) == 0
    text = (out / "train.txt").read_text(encoding="utf-8")
    assert text.count("# file: ") == 3 and "# file: unittest/test_case.py\ndef test_it():\n" in text
    assert "\n\n# file: " in text
    assert (out / "valid.txt").read_text() == "" and (out / "test.txt").read_text() == ""
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "training", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_cli_translation_end_to_end(locale_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "translation"
    args = ["prepare", "translation", "--locale-dir", str(locale_dir), "--out", str(out), "--test-fraction", "0.3"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "translation:" in result.stderr and "top packages: alpha" in result.stderr
    rows = {}
    for split in ("train", "valid", "test"):
        lines = (out / f"{split}.tsv").read_text(encoding="utf-8").splitlines()
        packages = (out / f"{split}.packages.txt").read_text(encoding="utf-8").splitlines()
        assert len(lines) == len(packages) and all(line.count("\t") == 1 for line in lines)
        rows[split] = {line.split("\t")[0] for line in lines}
    assert not rows["train"] & rows["test"] and not rows["train"] & rows["valid"]
    assert sum(map(len, rows.values())) == 10

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(args) == 0
    assert before == {p.name: p.read_bytes() for p in out.iterdir()}


def test_cli_errors(tmp_path: Path) -> None:
    missing = run_cli("prepare", "langid", "--locale-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: no gettext catalogs") and missing.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()
    bad_flag = run_cli("prepare", "code", "--out", str(tmp_path), "--bogus")
    assert bad_flag.returncode == 2 and "unrecognized arguments: --bogus" in bad_flag.stderr
    assert run_cli("prepare", "translation", "--help").returncode == 0


def test_write_atomic_replaces_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    write_atomic(path, "one\n")
    write_atomic(path, "two\n")
    assert path.read_text() == "two\n" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_package_holdout_sends_whole_groups_to_one_split_by_name_alone() -> None:
    names = ["".join(letters) for letters in product(ascii_lowercase, repeat=2)]  # 676 groups
    splits = [PackageHoldout().split_of(name) for name in names]
    for name, split in zip(names, splits, strict=True):  # versions, -properties and _tools share their group's split
        related = (f"{name}20", f"{name}30-properties", f"{name.upper()}_x-15")
        assert {PackageHoldout().split_of(package) for package in related} == {split}
    shares = {split: splits.count(split) / len(names) for split in HELDOUT_SPLITS}
    assert 0.03 < shares["test-heldout"] < 0.07 and 0.03 < shares["valid-heldout"] < 0.07
    assert not any(PackageHoldout(0.0, 0.0).split_of(name) for name in names)


def _packages(out: Path, split: str) -> set[str]:
    return set((out / f"{split}.packages.txt").read_text(encoding="utf-8").split())


def test_prepare_holds_whole_packages_out_of_train_valid_and_test(tmp_path: Path) -> None:
    test_pkg, valid_pkg, sibling = package_in("test-heldout"), package_in("valid-heldout"), "alpha30-properties"
    held = f"{test_pkg}20-properties"  # test_pkg's group: held out with it
    names = ("alpha", "beta", sibling, test_pkg, held, valid_pkg)
    catalogs = {pkg: {f"{pkg} message {i}": f"{pkg} mensaje {i}" for i in range(40)} for pkg in names}
    locale = write_locale_tree(tmp_path / "locale", {"es": catalogs})
    out = tmp_path / "translation"
    assert main(["prepare", "translation", "--locale-dir", str(locale), "--out", str(out)]) == 0
    assert _packages(out, "test-heldout") == {test_pkg, held} and _packages(out, "valid-heldout") == {valid_pkg}
    assert set().union(*(_packages(out, split) for split in SPLITS)) == {"alpha", "beta", sibling}
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["counts"]["test-heldout"] == 80 and manifest["counts"]["valid-heldout"] == 40
    assert sum(manifest["counts"][split] for split in SPLITS) == 120
    assert manifest["heldout"]["packages"] == {"valid-heldout": [valid_pkg], "test-heldout": sorted([test_pkg, held])}
    assert len((out / "test-heldout.tsv").read_text(encoding="utf-8").splitlines()) == 80

    # A corpus of named packages (a domain corpus) holds none of them out.
    domain = tmp_path / "domain"
    assert main(["prepare", "translation", "--locale-dir", str(locale), "--out", str(domain), "--packages", held]) == 0
    assert not (domain / "test-heldout.tsv").exists()
    assert "heldout" not in json.loads((domain / "manifest.json").read_text(encoding="utf-8"))
    assert sum(len((domain / f"{split}.tsv").read_text().splitlines()) for split in SPLITS) == 40


def test_langid_out_of_label_texts_are_other_languages_in_no_label(tmp_path: Path) -> None:
    shared = ("Open file", "Close", "Save", "Print", "Help")
    spanish = ("Abrir archivo", "Cerrar", "Guardar", "Imprimir", "Ayuda")
    french = ("Ouvrir le fichier", "Fermer", "Enregistrer", "Imprimer", "Aide")
    tree = {
        "es": {"alpha": dict(zip(shared, spanish, strict=True))},
        "fr": {"alpha": dict(zip(shared, french, strict=True))},
        # nl: a candidate langid does not choose (fewer texts); ko: one of OUT_OF_LABEL_LANGUAGES.
        "nl": {
            "alpha": {"Open file": "Bestand openen", "Save": "Guardar", "Quit": "Close"},
            "beta": {"Print": "Afdrukken"},
        },
        "ko": {"alpha": {"Open file": "파일 열기", "Save": "저장", "Quit": "Bestand openen"}},
    }
    locale = write_locale_tree(tmp_path / "locale", tree)
    out = tmp_path / "langid"
    args = ["prepare", "langid", "--locale-dir", str(locale), "--languages", "es,fr,nl", "--num-languages", "2"]
    assert main([*args, "--out", str(out)]) == 0
    rows = [line.split("\t") for line in (out / "out-of-label.tsv").read_text(encoding="utf-8").splitlines()]
    # "Guardar" is Spanish too, "Close" an English msgid, "Bestand openen" in two outside languages: all dropped.
    assert sorted(map(tuple, rows)) == [("Afdrukken", "nl"), ("저장", "ko"), ("파일 열기", "ko")]
    assert _packages(out, "out-of-label") == {"alpha", "beta"}
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert set(manifest["labels"]) == {"es", "fr", "en"} and manifest["out_of_label"] == {"ko": 2, "nl": 1}
    assert is_current(LangidCorpus(out=out), manifest)
    assert not is_current(LangidCorpus(out=out), {k: v for k, v in manifest.items() if k != "out_of_label"})

    # The same packages as the corpus: without beta, no Afdrukken.
    assert main([*args, "--out", str(tmp_path / "no-beta"), "--exclude-packages", "beta"]) == 0
    assert "Afdrukken" not in (tmp_path / "no-beta" / "out-of-label.tsv").read_text(encoding="utf-8")
