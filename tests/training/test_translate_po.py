"""`python -m training translate-po`: a catalog written here, filled by a tiny translator trained on protected pairs,
passes gettext's own checker (msgfmt --check, fuzzy entries included): placeholders, plural forms, line breaks
and the existing translations come through."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from model.placeholders import check
from tests.hf_seq2seq_tokenizers import m2m100, mbart50, nllb
from tests.service.conftest import placeholder_translator  # noqa: F401 (the session's fixture)
from tests.service.test_seq2seq_languages import translator
from training.cli import main

transformers = pytest.importorskip("transformers")

HEADER = '''msgid ""
msgstr ""
"Project-Id-Version: demo 1.0\\n"
"Language: es\\n"
"MIME-Version: 1.0\\n"
"Content-Type: text/plain; charset=UTF-8\\n"
"Content-Transfer-Encoding: 8bit\\n"
"Plural-Forms: nplurals=2; plural=(n != 1);\\n"
'''
ENTRIES = '''
#, c-format
msgid "delete file %s in %d seconds"
msgstr ""

#, python-format
msgid "open folder %(path)s"
msgstr ""

#, python-brace-format
msgid "copy image {name} to {0}"
msgstr ""

#, c-format
msgid "move window %s"
msgid_plural "move windows %s"
msgstr[0] ""
msgstr[1] ""

msgid ""
"save table $HOME\\n"
"print list --force\\n"
msgstr ""

msgctxt "menu"
msgid "close window"
msgstr ""

#, c-format
msgid "rename file %s"
msgstr "renombrar archivo %s"

#~ msgid "old message"
#~ msgstr ""
'''


def po_entries(path: Path):
    import polib

    return {(e.msgctxt, e.msgid): e for e in polib.pofile(str(path))}


@pytest.mark.skipif(shutil.which("msgfmt") is None, reason="gettext's msgfmt is not installed (Debian: gettext)")
def test_a_filled_catalog_passes_msgfmt_check(tmp_path, placeholder_translator, capsys):  # noqa: F811
    source, out = tmp_path / "in.po", tmp_path / "out.po"
    source.write_text(HEADER + ENTRIES, encoding="utf-8")
    subprocess.run(["msgfmt", "--check", "-o", "/dev/null", str(source)], check=True)  # the test's own catalog is valid

    assert main(["translate-po", str(source), "--model", str(placeholder_translator), "--out", str(out),
                 "--beams", "2", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept"] == 1 and report["translated"] + report["untranslated"] == 6 and report["plural"] <= 1
    assert report["translated"] >= 5, report  # every line fits the model, every output keeps its placeholders

    for flags in ([], ["--use-fuzzy"]):
        checked = subprocess.run(["msgfmt", "--check", *flags, "-o", str(tmp_path / "out.mo"), str(out)],
                                 capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr

    entries = po_entries(out)
    kept = entries[None, "rename file %s"]
    assert kept.msgstr == "renombrar archivo %s" and "fuzzy" not in kept.flags
    for (_, msgid), entry in entries.items():
        if msgid == "rename file %s" or entry.obsolete or not (entry.msgstr or entry.msgstr_plural):
            continue
        assert "fuzzy" in entry.flags, entry
        if entry.msgid_plural:
            assert check(msgid, entry.msgstr_plural[0]) and check(entry.msgid_plural, entry.msgstr_plural[1])
        else:
            assert check(msgid, entry.msgstr), entry
    lines = entries[None, "save table $HOME\nprint list --force\n"].msgstr
    assert lines.count("\n") == 2 and lines.endswith("\n") and "$HOME" in lines and "--force" in lines
    assert entries["menu", "close window"].msgstr  # context kept apart, translated
    old = entries[None, "old message"]
    assert old.obsolete and old.msgstr == ""  # obsolete entries are left alone


def test_a_causal_lm_or_a_missing_catalog_is_a_clear_error(tmp_path, placeholder_translator, capsys):  # noqa: F811
    assert main(["translate-po", str(tmp_path / "missing.po"), "--model", str(placeholder_translator),
                 "--out", str(tmp_path / "out.po")]) == 1
    assert "no such catalog" in capsys.readouterr().err


MULTILINGUAL = {  # name -> (tokenizer directory builder, tests/model/hf_bart.py variant)
    "m2m100": (lambda d: m2m100(d, "wmt21"), "m2m100"),
    "mbart50": (lambda d: mbart50(d, "json"), "mbart"),
    "nllb": (lambda d: nllb(d, "json"), "nllb"),
}
MESSAGES = ["hello world", "good morning to you", "the quick brown fox"]


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    """Random NLLB-200, M2M100 and mBART-50 models with their tokenizers (tests/service/test_seq2seq_languages.py)."""
    root = tmp_path_factory.mktemp("multilingual")
    return {name: translator(root, name, variant, build(root / f"{name}-tok"))
            for name, (build, variant) in MULTILINGUAL.items()}


def catalog(path: Path, language: str) -> Path:
    entries = "".join(f'\nmsgid "{m}"\nmsgstr ""\n' for m in MESSAGES)
    path.write_text(HEADER.replace("Language: es", f"Language: {language}") + entries, encoding="utf-8")
    return path


@pytest.mark.parametrize(("name", "header", "flag", "code"), [
    ("m2m100", "de", None, "de"),  # the header's code itself
    ("mbart50", "fr", None, "fr_XX"),  # the one code that is it with a region
    ("mbart50", "de_CH", None, "de_DE"),  # its language part
    ("nllb", "fr", "fra_Latn", "fra_Latn"),  # NLLB's codes need --target-lang
])
def test_a_multilingual_model_translates_into_the_catalogs_language(tmp_path, multilingual, capsys, name, header,
                                                                    flag, code):
    """Each message what generate() gives with forced_bos_token_id = the language's token, without that token."""
    directory = multilingual[name]
    out = tmp_path / "out.po"
    argv = ["translate-po", str(catalog(tmp_path / "in.po", header)), "--model", str(directory), "--out", str(out),
            "--beams", "1", "--max-new-tokens", "8", "--device", "cpu"]
    assert main(argv + (["--target-lang", flag] if flag else [])) == 0, capsys.readouterr().err
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    entries = po_entries(out)
    for message in MESSAGES:
        with torch.no_grad():
            tokens = model.generate(**tokenizer(message, return_tensors="pt"), max_new_tokens=8, num_beams=1,
                                    do_sample=False, forced_bos_token_id=tokenizer.convert_tokens_to_ids(
                                        tokenizer.lang_code_to_token[code] if name == "m2m100" else code))
        assert entries[None, message].msgstr == tokenizer.decode(tokens[0], skip_special_tokens=True).strip(), message


@pytest.mark.parametrize(("name", "header", "flag", "says"), [
    ("nllb", "fr", None, "the catalog's Language: 'fr' is none of the model's language codes: give --target-lang "
     "(codes: eng_Latn, fra_Latn"),
    ("m2m100", "de", "xx", "--target-lang='xx' is not a language code of this model (codes: en, ha,"),
], ids=["nllb-needs-the-flag", "unknown-code"])
def test_a_language_the_model_lacks_asks_for_target_lang(tmp_path, multilingual, capsys, name, header, flag, says):
    argv = ["translate-po", str(catalog(tmp_path / "in.po", header)), "--model", str(multilingual[name]), "--out",
            str(tmp_path / "out.po"), "--device", "cpu"]
    assert main(argv + (["--target-lang", flag] if flag else [])) == 1
    assert says in capsys.readouterr().err
