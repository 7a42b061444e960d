"""Placeholders kept intact through translation: found, swapped for sentinel tokens, restored, checked.

A placeholder is text a program or a markup gives meaning to, which a translation must carry over as it is:
printf conversions (``%s``, ``%5.2f``, ``%(name)s``, ``%1$s``, ``%%``, ``%<PRIu64>``), Python/.NET/ICU braces
(``{0}``, ``{name}``, ``{name!r:>10}``, ``{0,-8:N2}``), shell and environment variables (``$HOME``,
``${VAR}``), HTML/XML tags and entities, URLs, e-mail addresses and command-line options (``--force``,
``-n``). :data:`PATTERN` is the one definition.

:func:`protect` replaces each distinct placeholder of a source by a sentinel, ``｟0｠``, ``｟1｠``, ... (the
"white parentheses" OpenNMT uses for protected spans), which a model trained on protected pairs
(training/tasks/seq2seq.py) copies as single tokens; :meth:`Protected.restore` puts the originals back into
the output. A *positional* placeholder (printf without ``n$`` or ``(name)``, and ``{}``) means "the next
argument", so those are restored in the source's order whatever order the sentinels came in. With
``repair``, an output that dropped a sentinel gets it appended, one that repeated it loses the extra copy, a
placeholder the model wrote itself is dropped and a restored one a word touches is spaced from it, so the
restored text holds the source's placeholders (a catalog filled with it cannot crash the program
that formats it); ``ok`` says whether the model's own output already did. :func:`check` compares the
placeholders of two texts, for models whose tokenizer has no sentinels (nothing to restore: reported only).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

MAX_SENTINELS = 16  # distinct placeholders protected per text; any further ones stay as they are
SENTINEL_OPEN, SENTINEL_CLOSE = "\uff5f", "\uff60"  # ｟ ｠

# printf: %%, %s, %-5d, %.2f, %lu, %1$s, %(name)s, %<PRIu64>, and the other letters' directives of strftime
# (%H:%M, %Y) and stat-like formats (%n, %T); no space flag, so "100% done" is prose.
_PRINTF = (r"%%|%<\w+>|%(?:\d+\$)?(?:\([A-Za-z_]\w*\))?[-+#0']*(?:\*|\d+)?(?:\.(?:\*|\d+))?"
           r"(?:hh|h|ll|l|L|q|j|z|t)?[A-Za-z]")
PRINTF_CONVERSIONS = frozenset("diouxXeEfFgGaAcsp")  # the ones that take printf's next argument
# {}, {0}, {name}, {0.attr}, {name[key]}, {name!r:>10}, .NET {0,-8:N2}; not {{ }} escapes
_BRACES = r"(?<!\{)\{(?:[A-Za-z_]\w*|\d+)?(?:\.[A-Za-z_]\w*|\[\w+\])*(?:,-?\d+)?(?:![rsa])?(?::[^{}\s]*)?\}(?!\})"
_SENTINEL = SENTINEL_OPEN + r"\d+" + SENTINEL_CLOSE
PATTERN = re.compile(
    "|".join(
        [
            r"(?:https?|ftp|file)://[^\s<>\"']*[^\s<>\"'.,;:!?)\]]",  # URL (not its sentence's punctuation)
            r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+",  # e-mail address
            r"</?[A-Za-z][\w:-]*(?:\s+[^<>]*?)?/?>|&(?:[A-Za-z]+|#\d+|#x[0-9A-Fa-f]+);",  # tag, entity
            _PRINTF,
            _BRACES,
            r"\$\{[A-Za-z_]\w*\}|\$[A-Za-z_]\w*",  # ${VAR}, $HOME
            # --force, --out=FILE, --pages=FIRST[:LAST] (a value ends in a word character or a bracket, so the
            # sentence's punctuation stays outside), -n
            r"(?<![\w-])--[A-Za-z][\w-]*(?:=[\w/{}|\[\]:.,+-]*[\w}\]])?|(?<![\w/-])-[A-Za-z]{1,2}(?![\w-])",
            _SENTINEL,  # a literal sentinel in the text is protected like any placeholder
        ]
    )
)
# What a tokenizer keeps as single tokens when frequent (model.tokenizer): format specifiers and sentinels.
TOKEN_PATTERN = re.compile("|".join([_PRINTF, _BRACES, _SENTINEL]))
_EMPTY_FIELD = re.compile(r"\{[!:,}]")
# A sentinel in an output, or any placeholder, with the space before it (a dropped one takes its space along).
_SENTINEL_RE = re.compile(f"(?P<space> ?){SENTINEL_OPEN}(?P<index>\\d+){SENTINEL_CLOSE}")
_SPACED = re.compile(f"(?P<space> ?)(?P<found>{PATTERN.pattern})")


def sentinel(index: int) -> str:
    return f"{SENTINEL_OPEN}{index}{SENTINEL_CLOSE}"


def find(text: str) -> list[str]:
    """The placeholders of ``text``, in order (repeats kept)."""
    return PATTERN.findall(text)


def positional(placeholder: str) -> bool:
    """Whether ``placeholder`` takes the next argument (``%s``, ``%5.2f``, ``{}``, ``{:>4}``): its order matters."""
    if placeholder.startswith("%"):
        if placeholder == "%%" or "$" in placeholder or placeholder.startswith("%("):
            return False  # a literal percent, a numbered or a named argument
        return placeholder.startswith("%<") or placeholder[-1] in PRINTF_CONVERSIONS  # %H may move, %s may not
    return _EMPTY_FIELD.match(placeholder) is not None


@dataclass(frozen=True)
class Restored:
    text: str
    ok: bool  # the output held exactly the source's placeholders (positional ones in the source's order)


@dataclass(frozen=True)
class Protected:
    """A source with its placeholders swapped for sentinels, and what each sentinel stands for."""

    source: str  # the text as given
    text: str  # the text the model reads: ``source`` with sentinels
    originals: tuple[str, ...] = ()  # sentinel i stands for originals[i]
    counts: tuple[int, ...] = ()  # how often sentinel i occurs in the source
    order: tuple[str, ...] = ()  # the source's positional placeholders, in order

    def pair(self, target: str) -> tuple[str, str]:
        """A training pair of this source and its ``target`` with the same sentinels on both sides, when the target
        holds exactly the source's placeholders (else the pair as it is: a translator who changed them teaches
        nothing to copy)."""
        if not self.originals or Counter(find(target)) != Counter(find(self.source)):
            return self.source, target
        index = {p: i for i, p in enumerate(self.originals)}
        return self.text, PATTERN.sub(lambda m: sentinel(index[m.group(0)]) if m.group(0) in index else m.group(0),
                                      target)

    def after(self, prefix: str) -> Protected:
        """What a continuation of ``prefix`` (the start of the output, given as text: a target prefix) must hold: the
        source's placeholders less the ones ``prefix`` already has (positional ones from the front), so restoring
        the continuation neither flags nor appends what the prefix holds."""
        source, counts, order = self.source, list(self.counts), list(self.order)
        index = {p: i for i, p in enumerate(self.originals)}
        for placeholder in find(prefix):
            match = next((m for m in PATTERN.finditer(source) if m.group(0) == placeholder), None)
            if match is None:
                continue  # not the source's, or the prefix repeats it more often than the source has it
            source = source[:match.start()] + source[match.end():]
            if placeholder in index:
                counts[index[placeholder]] -= 1
            if placeholder in order:
                order.remove(placeholder)
        return Protected(source, self.text, self.originals, tuple(counts), tuple(order))

    def restore(self, output: str, repair: bool = True) -> Restored:
        """``output`` with each sentinel replaced by its original (positional ones in the source's order).

        Copies beyond the source's count, sentinels the source never had and placeholders the model wrote itself
        (``-a``, ``%d`` where the source had none) are dropped, with the space before them; a restored option,
        variable, URL or address that a word touches gets a space between (``-T`` + ``UENA`` would be another
        option). With ``repair`` (a finished output), sentinels the output lacks are appended; without it (a
        stream: its text up to a space) the result is a prefix of the repaired text of any longer output.
        """
        seen: Counter[int] = Counter()
        ok = True

        def keep(match: re.Match[str]) -> str:
            nonlocal ok
            index = int(match["index"])
            if index >= len(self.originals) or seen[index] >= self.counts[index]:
                ok = False
                return _left_by(match)
            seen[index] += 1
            return match.group(0)

        kept = _SENTINEL_RE.sub(keep, output)
        unprotected = Counter(p for p in find(self.source) if p not in self.originals)  # beyond the sentinels

        def invented(match: re.Match[str]) -> str:
            nonlocal ok
            found = match["found"]
            if found.startswith(SENTINEL_OPEN):
                return match.group(0)
            if unprotected[found] > 0:
                unprotected[found] -= 1
                return match.group(0)
            ok = False
            return _left_by(match)

        while (fewer := _SPACED.sub(invented, kept)) != kept:  # a removal can leave another one standing alone
            kept = fewer
        if repair:
            missing = [sentinel(i) for i, n in enumerate(self.counts) for _ in range(n - seen[i])]
            if missing:
                ok = False
                kept = " ".join([kept.rstrip(), *missing]) if kept.strip() else " ".join(missing)
        positions = iter(self.order)
        in_order = []

        def original(match: re.Match[str]) -> str:
            text = self.originals[int(match["index"])]
            if positional(text):
                in_order.append(text)
                text = next(positions, text)
            before = match["space"] or match.string[match.start() - 1: match.start()]
            lead, trail = _spaced(text, before, match.string[match.end(): match.end() + 2])
            return match["space"] + lead + text + trail

        restored = _SENTINEL_RE.sub(original, kept)
        ok = ok and tuple(in_order) == self.order[: len(in_order)]
        return Restored(restored, ok and (not repair or check(self.source, restored)))


def _left_by(match: re.Match[str]) -> str:
    """What stays of a dropped placeholder: nothing, or the space before it where text follows it at once (which
    would otherwise join the text before)."""
    follows = match.string[match.end(): match.end() + 1]
    return match["space"] if follows and not follows.isspace() else ""


# Characters that never join an option, a variable, a URL or an address touching them (on its left / right).
_SEPARATE_LEFT = frozenset(" \t\n'\"«»“”‘’([{<)]}>,;:!?¡¿")
_SEPARATE_RIGHT = frozenset(" \t\n'\"«»“”‘’<>")
_CLOSERS = frozenset(".,;:!?)]}")  # separate on the right where a space, a quote or another closer follows


def _spaced(text: str, before: str, after: str) -> tuple[str, str]:
    """The spaces a restored ``text`` needs around it so that its neighbours (``before``: a character or "";
    ``after``: the next two) do not join it: an option, a variable, a URL or an address next to a word or another
    placeholder would read as another one (``-T`` + ``UENA``, ``ok.`` + ``john@x.org``); printf directives and
    bracketed forms end where they end."""
    if not (text[0] in "-$" or text[0].isalnum()):
        return "", ""
    closes = after[:1] in _CLOSERS and (len(after) == 1 or after[1] in _SEPARATE_RIGHT or after[1] in _CLOSERS)
    return (" " if before and before not in _SEPARATE_LEFT else "",
            " " if after and after[0] not in _SEPARATE_RIGHT and not closes else "")


def protect(text: str, sentinels: int = MAX_SENTINELS) -> Protected:
    """``text`` with each of its first ``sentinels`` distinct placeholders replaced by a sentinel."""
    index: dict[str, int] = {}
    counts: Counter[int] = Counter()

    def swap(match: re.Match[str]) -> str:
        found = match.group(0)
        if found not in index:
            if len(index) >= sentinels:
                return found
            index[found] = len(index)
        counts[index[found]] += 1
        return sentinel(index[found])

    swapped = PATTERN.sub(swap, text)
    originals = tuple(index)
    order = tuple(p for p in find(text) if p in index and positional(p))
    return Protected(text, swapped, originals, tuple(counts[i] for i in range(len(originals))), order)


def sentinels_for(*tokenizers: Any) -> int:
    """How many placeholders a model reading and writing with ``tokenizers`` gets protected per text: all
    (:data:`MAX_SENTINELS`) when each was trained on protected pairs (has ``｟0｠`` as a token; the rarer sentinels
    may be several tokens, which a repair still catches), else none (its outputs are checked only)."""
    return MAX_SENTINELS if all(t.sentinels > 0 for t in tokenizers) else 0


def check(source: str, output: str) -> bool:
    """Whether ``output`` holds exactly the placeholders of ``source`` (positional ones in the same order)."""
    got, want = find(output), find(source)
    return Counter(got) == Counter(want) and [p for p in got if positional(p)] == [p for p in want if positional(p)]


__all__ = ["MAX_SENTINELS", "PATTERN", "Protected", "Restored", "TOKEN_PATTERN", "check", "find", "positional",
           "protect", "sentinel", "sentinels_for"]
