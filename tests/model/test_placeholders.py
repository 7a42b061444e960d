"""model.placeholders: every kind the issue names is found and protected, restored in the source's order, repaired
when a model drops or repeats one; training pairs are protected only when both sides agree."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from model.placeholders import check, find, positional, protect, sentinel

KINDS = [
    "%s", "%d", "%5.2f", "%-8lu", "%(name)s", "%(count)d", "%1$s", "%2$d", "%%", "%<PRIu64>", "%H", "%Y",
    "{0}", "{name}", "{}", "{name!r:>10}", "{0,-8:N2}", "{user.name}", "{:>4}",
    "$HOME", "${VAR}", "<b>", "</b>", '<a href="http://x.org/?a=1">', "<br/>", "&amp;", "&#160;",
    "https://example.org/docs/page.html?x=1&y=2#top", "ftp://ftp.example.org/pub", "john.doe+tag@mail.example.com",
    "--force", "--output=FILE", "--pages=FIRST[:LAST]", "-n", "-rf",
]  # fmt: skip
PROSE = ["100% done", "5 % off", "{not a placeholder}", "a {{literal}} brace", "re-enter the e-mail", "costs $5",
         "x < y > z", "see http:// nothing", "non-empty"]


@pytest.mark.parametrize("placeholder", KINDS)
def test_each_kind_is_one_placeholder_and_comes_back_from_its_sentinel(placeholder):
    text = f"Before {placeholder} after."
    assert find(text) == [placeholder]
    protected = protect(text)
    assert protected.text == f"Before {sentinel(0)} after." and protected.originals == (placeholder,)
    assert protected.restore(f"Antes {sentinel(0)} después.").text == f"Antes {placeholder} después."


@pytest.mark.parametrize("text", PROSE)
def test_prose_is_left_alone(text):
    assert find(text) == [] and protect(text).text == text


def test_an_option_value_leaves_the_sentences_punctuation_outside():
    assert find("Set --unset=NAME, or --pages=FIRST[:LAST]'. Then --out=a.txt.") == [
        "--unset=NAME", "--pages=FIRST[:LAST]", "--out=a.txt"]


def test_a_url_keeps_its_sentence_punctuation_outside():
    assert find("See https://example.org/a.html. Or (http://x.org/b), then stop.") == [
        "https://example.org/a.html", "http://x.org/b"]


def test_the_issue_example_survives_a_model_that_reorders_and_copies_its_sentinels():
    source = "Invalid date string “%(datestr)s” given format “%(format)s”"
    protected = protect(source)
    assert find(protected.text) == [sentinel(0), sentinel(1)]
    out = protected.restore(f"Cadena de fecha no válida «{sentinel(0)}» con el formato «{sentinel(1)}»")
    assert out.ok and out.text == "Cadena de fecha no válida «%(datestr)s» con el formato «%(format)s»"
    # Named placeholders may move: the output is still right.
    swapped = protected.restore(f"Con el formato «{sentinel(1)}», la fecha «{sentinel(0)}» no es válida")
    assert swapped.ok and swapped.text == "Con el formato «%(format)s», la fecha «%(datestr)s» no es válida"


def test_positional_placeholders_are_restored_in_the_source_order():
    protected = protect("Copy %s to %d files")
    assert [positional(p) for p in protected.originals] == [True, True]
    out = protected.restore(f"Copiar {sentinel(1)} archivos a {sentinel(0)}")
    assert out.text == "Copiar %s archivos a %d" and not out.ok  # the program's arguments stay in order
    assert check("Copy %s to %d files", out.text)
    assert not positional("%1$s") and not positional("%(name)s") and not positional("{0}") and positional("{:>4}")
    assert positional("%<PRIu64>") and not positional("%H") and not positional("%%")  # a date's fields may move


def test_repair_appends_what_is_missing_and_drops_extra_or_unknown_copies():
    protected = protect("Move %s to %s, keep {name}")
    assert protected.counts == (2, 1)
    dropped = protected.restore(f"Mover {sentinel(0)}")
    assert not dropped.ok and Counter(find(dropped.text)) == Counter(["%s", "%s", "{name}"])
    repeated = protected.restore(f"Mover {sentinel(0)} {sentinel(0)} {sentinel(0)} a {sentinel(1)} {sentinel(7)}")
    assert not repeated.ok and repeated.text == "Mover %s %s a {name}"
    assert protected.restore("").text == "%s %s {name}"
    assert protected.restore(f"Mover {sentinel(0)} {sentinel(0)} {sentinel(0)}", repair=False).text == "Mover %s %s"
    partial = protected.restore(f"Mover {sentinel(0)}", repair=False)  # a growing stream: nothing appended
    assert partial.text == "Mover %s"


def test_a_target_prefix_leaves_its_continuation_the_placeholders_it_does_not_hold():
    protected = protect("Move %s to %s, keep {name}")
    rest = protected.after("Mover %s a")  # the prefix holds the first positional %s
    assert rest.counts == (1, 1) and rest.order == ("%s",) and rest.text == protected.text
    kept = rest.restore(f" {sentinel(0)}, mantener {sentinel(1)}")
    assert kept.ok and kept.text == " %s, mantener {name}"
    again = rest.restore(f" {sentinel(0)} {sentinel(0)} {sentinel(1)}")  # a copy beyond the rest: dropped, flagged
    assert not again.ok and Counter(find("Mover %s a" + again.text)) == Counter(find(protected.source))
    assert Counter(find("Mover %s a" + rest.restore("").text)) == Counter(find(protected.source))  # repaired once
    assert protected.after("{name} {name} {other} --force").counts == (2, 0)  # only the source's, at most its count
    assert protected.after("no placeholders") == protected


def test_a_text_without_placeholders_is_checked_for_invented_ones():
    protected = protect("Nothing to see")
    assert protected.text == "Nothing to see" and protected.restore("Nada que ver").ok
    assert not protected.restore("Nada que ver %s").ok


def test_sentinels_beyond_the_limit_leave_the_rest_as_it_is_and_literal_sentinels_are_protected():
    text = " ".join(f"{{v{i}}}" for i in range(5)) + f" {sentinel(3)}"
    protected = protect(text, sentinels=3)
    assert protected.text == f"{sentinel(0)} {sentinel(1)} {sentinel(2)} {{v3}} {{v4}} {sentinel(3)}"
    assert protected.originals == ("{v0}", "{v1}", "{v2}")
    assert protect(f"a literal {sentinel(0)}").originals == (sentinel(0),)


def test_training_pairs_share_sentinels_only_when_the_target_agrees():
    assert protect("Delete %s from {0}?").pair("¿Borrar %s de {0}?") == (
        f"Delete {sentinel(0)} from {sentinel(1)}?", f"¿Borrar {sentinel(0)} de {sentinel(1)}?")
    assert protect("Delete %1$s from %2$s?").pair("¿De %2$s borrar %1$s?") == (
        f"Delete {sentinel(0)} from {sentinel(1)}?", f"¿De {sentinel(1)} borrar {sentinel(0)}?")
    assert protect("Delete %s?").pair("¿Borrar?") == ("Delete %s?", "¿Borrar?")
    assert protect("plain").pair("llano") == ("plain", "llano")


def test_restore_gives_back_any_mix_of_kinds_for_a_model_that_copies_in_order():
    rng = random.Random(0)
    for _ in range(200):
        chosen = rng.sample(KINDS, rng.randint(1, 6))
        source = " word ".join(chosen) + " end"
        protected = protect(source)
        output = protected.text.replace("word", "palabra").replace("end", "fin")
        restored = protected.restore(output)
        assert restored.ok and check(source, restored.text), (source, restored)
        assert restored.text == source.replace(" word ", " palabra ").replace(" end", " fin")


def test_placeholders_the_model_invents_are_dropped_and_touching_words_kept_apart():
    protected = protect("Usage: %s [-T] SOURCE - does it exist? Use $HOME")
    out = protected.restore(f"Uso: {sentinel(0)} [{sentinel(1)}UENA] FUENTE -a existe? %d Usa {sentinel(2)}ahora")
    assert out.text == "Uso: %s [-T UENA] FUENTE existe? Usa $HOME ahora" and not out.ok
    assert check(protected.source, out.text)
    assert protect("Copy %s files").restore(f"Copiar {sentinel(0)}archivos").text == "Copiar %sarchivos"


def test_a_streams_text_up_to_any_space_is_a_prefix_of_the_repaired_whole():
    """Outputs made of sentinels (valid or not), words, invented placeholders and punctuation, glued or spaced."""
    rng = random.Random(1)
    words = ["palabra", "-a", "%d", "<i>", "x", "--no", "$V", "{k}", "ok.", "(", ")", ".", "a.b"]
    for _ in range(2000):
        chosen = rng.sample(KINDS, rng.randint(0, 4))
        protected = protect(" word ".join(["start", *chosen, "end"]))
        pieces = [sentinel(rng.randrange(len(protected.originals) + 1)) if rng.random() < 0.3 else rng.choice(words)
                  for _ in range(rng.randint(0, 12))]
        output = "".join(p + (" " if rng.random() < 0.7 else "") for p in pieces)
        whole = protected.restore(output).text
        for cut in [i + 1 for i, c in enumerate(output) if c == " "]:
            assert whole.startswith(protected.restore(output[:cut], repair=False).text.rstrip(" ")), (output, cut)
        assert check(protected.source, whole), (protected.source, output, whole)
