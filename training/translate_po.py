"""`translate-po`: fill a gettext catalog's empty translations with a translation model, never breaking a placeholder.

Each untranslated entry (plural ones too: form 0 from ``msgid``, the others from ``msgid_plural``) gets a machine
translation and the ``fuzzy`` flag (a translator reviews it; msgfmt skips fuzzy entries unless told otherwise);
entries that have a translation, the header and obsolete entries are kept as they are. A message is translated
line by line (the models are trained on single lines), keeping its line breaks and the spaces around each line.
Placeholders are protected as the service protects them (model.placeholders): restored in the source's order
and repaired where the model lost one; a repaired entry says so in a translator comment. An entry whose output
still lacks its source's placeholders (a model without sentinels) or whose line is longer than the model takes
stays untranslated, so the catalog never holds a message that would break the program formatting it.

A multilingual model (NLLB-200, M2M100, mBART-50: model.hf.languages) translates into the catalog's language: the
``Language:`` header's code where the model has it (M2M100's ``fr``), else the one code that is it with a region or
script (mBART-50's ``fr_XX`` for ``fr`` or ``fr_CA``), else ``--target-lang`` must name it (NLLB's ``fra_Latn``); its
token is each translation's forced first token, as transformers' forced_bos_token_id.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.checkpoint import Checkpoint
from model.hf.languages import Languages
from model.placeholders import Restored, check, protect, sentinels_for
from training.tasks.base import TaskOptions, TokenIds
from training.tasks.seq2seq import Seq2SeqTask

logger = logging.getLogger(__name__)

REPAIRED_NOTE = "machine translation (tserve): placeholders repaired, review them"
_NPLURALS = re.compile(r"nplurals\s*=\s*(\d+)")
_EDGES = re.compile(r"^(\s*)(.*?)(\s*)$", re.DOTALL)


@dataclass
class PoReport:
    """What translate-po did to a catalog."""

    translated: int = 0  # entries filled (plural entries count once)
    plural: int = 0  # of which plural entries
    kept: int = 0  # entries that already had a translation
    repaired: int = 0  # filled entries whose placeholders the model did not keep by itself
    skipped: list[str] = field(default_factory=list)  # msgids left untranslated, with why

    def as_dict(self) -> dict[str, object]:
        return {"translated": self.translated, "plural": self.plural, "kept": self.kept, "repaired": self.repaired,
                "untranslated": len(self.skipped), "untranslated_why": self.skipped[:20]}


class LineTranslator:
    """Single lines through a seq2seq checkpoint (greedy or beams), placeholders protected, in batches."""

    def __init__(self, checkpoint: Checkpoint, adapters: str | None, beams: int, max_new_tokens: int,
                 target_lang: str | None = None) -> None:
        if checkpoint.family != "seq2seq":
            raise ValueError(f"translate-po needs a translation (seq2seq) model, not {checkpoint.family}")
        if target_lang is not None and checkpoint.languages is None:
            raise ValueError("--target-lang is for multilingual models (NLLB-200, M2M100, mBART-50); this model "
                             "has no language codes")
        self.checkpoint, self.adapters = checkpoint, adapters
        self.task = Seq2SeqTask(TaskOptions(beams=beams, max_new_tokens=max_new_tokens,
                                            ids=TokenIds.of(checkpoint.config)))
        self.sentinels = sentinels_for(checkpoint.tokenizer, checkpoint.prompt_tokenizer)
        self.target_lang = target_lang
        self.forced: int | None = None  # the target language's token (set by :meth:`choose_language`)

    def choose_language(self, header: str) -> str | None:
        """A multilingual model's target language: ``--target-lang``, else the one the catalog's ``Language:``
        ``header`` names (:func:`target_language`); None for a model without languages."""
        languages = self.checkpoint.languages
        if languages is None:
            return None
        code = self.target_lang if self.target_lang is not None else target_language(languages, header)
        self.forced = languages.token_id(code, "--target-lang")
        return code

    def translate(self, lines: list[str]) -> list[Restored | None]:
        """Each line's restored translation, or None where it is too long for the model."""
        protected = [protect(line, self.sentinels) for line in lines]
        sources = self.checkpoint.encode_prompts([p.text for p in protected])
        fits = [i for i, ids in enumerate(sources) if len(ids) < self.checkpoint.config.max_src_len]
        generation = self.checkpoint.generation
        forced = self.forced if self.forced is not None or generation is None else generation.forced_bos
        with torch.no_grad():
            outputs = self.task.translate(self.checkpoint.model, [sources[i] for i in fits], self.checkpoint.tokenizer,
                                          self.adapters, forced, generation.imposed() if generation else None)
        results: list[Restored | None] = [None] * len(lines)
        for i, output in zip(fits, outputs, strict=True):
            results[i] = protected[i].restore(output)
        return results


def target_language(languages: Languages, header: str) -> str:
    """The model's code for a catalog's ``Language:`` header: the code itself, else the one code that is it (or its
    language part, ``pt`` of ``pt_BR``) with a region or script after ``_``; ValueError asking for --target-lang."""
    header = header.strip().replace("-", "_")
    for name in dict.fromkeys([header, header.split("_")[0]]):
        if not name:
            continue
        if name in languages.ids:
            return name
        matches = [code for code in languages.ids if code.startswith(name + "_")]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise ValueError(f"the catalog's Language: {header!r} could be any of {', '.join(matches)}: give "
                             "--target-lang")
    raise ValueError(f"the catalog's Language: {header!r} is none of the model's language codes: give --target-lang "
                     f"(codes: {', '.join(languages.ids)})")


def translate_catalog(source: Path, out: Path, translator: LineTranslator) -> PoReport:
    """Fill ``source``'s empty translations into ``out`` (see the module's docstring)."""
    import polib

    catalog = polib.pofile(str(source), wrapwidth=0)
    translator.choose_language(catalog.metadata.get("Language", ""))
    nplurals = _nplurals(catalog.metadata.get("Plural-Forms", ""))
    report = PoReport()
    wanted: list[tuple[polib.POEntry, list[str]]] = []
    for entry in catalog:
        if entry.obsolete or not entry.msgid:
            continue
        if entry.msgstr or any(entry.msgstr_plural.values()):
            report.kept += 1
            continue
        texts = [entry.msgid] if not entry.msgid_plural else [entry.msgid] + [entry.msgid_plural] * (nplurals - 1)
        wanted.append((entry, texts))
    messages = sorted({text for _, texts in wanted for text in texts})
    translated = _translate_messages(messages, translator)
    for entry, texts in wanted:
        results = [translated[text] for text in texts]
        if any(r is None for r in results):
            report.skipped.append(f"{entry.msgid[:60]!r}: a line is longer than the model takes")
            continue
        if not all(check(text, r.text) for text, r in zip(texts, results, strict=True)):
            report.skipped.append(f"{entry.msgid[:60]!r}: the translation lost a placeholder")
            continue
        if entry.msgid_plural:
            entry.msgstr_plural = {k: r.text for k, r in enumerate(results)}
            report.plural += 1
        else:
            entry.msgstr = results[0].text
        if "fuzzy" not in entry.flags:
            entry.flags.append("fuzzy")
        if not all(r.ok for r in results):
            report.repaired += 1
            entry.tcomment = f"{entry.tcomment}\n{REPAIRED_NOTE}" if entry.tcomment else REPAIRED_NOTE
        report.translated += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    catalog.save(str(out))
    return report


def _translate_messages(messages: list[str], translator: LineTranslator) -> dict[str, Restored | None]:
    """Each message translated line by line: its line breaks and the spaces around every line kept."""
    parts = {m: [_EDGES.match(line).groups() for line in m.split("\n")] for m in messages}
    lines = sorted({core for split in parts.values() for _, core, _ in split if core})
    by_line = dict(zip(lines, translator.translate(lines), strict=True))
    out: dict[str, Restored | None] = {}
    for message, split in parts.items():
        pieces, ok = [], True
        for lead, core, trail in split:
            result = by_line[core] if core else Restored("", True)
            if result is None:
                out[message] = None
                break
            pieces.append(f"{lead}{result.text}{trail}")
            ok = ok and result.ok
        else:
            out[message] = Restored("\n".join(pieces), ok)
    return out


def _nplurals(plural_forms: str) -> int:
    found = _NPLURALS.search(plural_forms)
    return int(found.group(1)) if found else 2


__all__ = ["LineTranslator", "PoReport", "target_language", "translate_catalog"]
