"""`python -m training translate-po`: a catalog written here, filled by a tiny translator trained on protected pairs,
passes gettext's own checker (msgfmt --check, fuzzy entries included): placeholders, plural forms, line breaks
and the existing translations come through."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from model.placeholders import check
from tests.service.conftest import placeholder_translator  # noqa: F401 (the session's fixture)
from training.cli import main

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
