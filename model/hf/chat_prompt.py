"""A chat's prompt ids, as transformers' ``apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)``
gives them: the control tokens a chat template writes (``<|im_start|>``, ``<|eot_id|>``, ``[INST]``) are their ids,
and the same text inside what a caller wrote (message content, tool schemas, chat_template_kwargs) stays text, so no
user can forge a turn or a system message. Without such strings the ids equal plain ``apply_chat_template(...,
tokenize=True)``'s (and vLLM's default). One difference from transformers: a control token in a dict key (a tool
schema's property name) stays text here too; transformers reads it as the token.

How: the caller's strings have each control token wrapped in transformers' private-use marks (MARK_START ...
MARK_END, any marks already in them dropped) before the template renders them; encoding reads the marked tokens as
text and the rest of the rendered text with the tokenizer's added tokens matched.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import tokenizers

from model.hf.chat_template import ChatTemplate, ChatTemplateError
from model.tokenizer import Tokenizer

MARK_START, MARK_END = "\U000f0000", "\U000f0001"  # transformers' private-use marks around user-written tokens


class PromptEncoder:
    """The prompt ids of a chat, as transformers' ``apply_chat_template(..., tokenize=True,
    sanitize_control_tokens=True)`` gives them: the control tokens the template writes (``<|im_start|>``,
    ``<|eot_id|>``, ``[INST]``) become their ids; the same tokens inside the caller's strings (message content, tool
    schemas, chat_template_kwargs) stay text, so a user cannot forge a turn. Without such strings the ids equal
    plain ``apply_chat_template(..., tokenize=True)``'s. ``encode`` does it in one step; ``render`` then
    ``encode_texts`` in two, for a pipeline that carries the prompt as text (the marks travel in it).

    model.tokenizer.Tokenizer encodes special-token text as text, so this holds a copy of its backend that matches
    added tokens (built once per model; about the tokenizer's size in memory).
    """

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.template = template
        self._backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        self._backend.encode_special_tokens = False  # runtime state, not serialized: the copy matches them already
        added = self._backend.get_added_tokens_decoder().values()
        any_added = _token_pattern(tuple(t.content for t in added)).pattern
        self._markers = re.compile(f"{MARK_START}({any_added}){MARK_END}|[{MARK_START}{MARK_END}]")
        self._newline = self._encode("\n")
        self._control = {}  # per variant of the template: the pattern of its control tokens
        for variant in template.variants():
            listed = set(variant.control_tokens or ())
            self._control[variant.origin] = _token_pattern(tuple(
                t.content for t in added if t.special or (
                    t.content in listed if variant.control_tokens is not None
                    else variant.writes(t.content) and not t.content.isspace())))

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The ids of the template's end_of_turn_tokens that are single tokens of this tokenizer (the ones to stop
        at, beside generation_config.json's eos ids)."""
        ids = (self._backend.token_to_id(t) for t in self.template.end_of_turn_tokens)
        return tuple(i for i in ids if i is not None)

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               extra: dict | None = None) -> str:
        """ChatTemplate.render's text (same arguments, same ChatTemplateError) with each control token inside the
        caller's strings between MARK_START and MARK_END (private-use characters), which encode_texts reads."""
        variant = self.template.variant(tools)
        control = self._control[variant.origin]
        return variant.render(messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, extra=extra,
                              mark=lambda value: _mark(value, control))

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of rendered texts: control tokens as their ids, marked ones as text (the marks dropped). A text
        without marks is encoded whole, as ``apply_chat_template(..., tokenize=True)`` encodes it."""
        return [self._encode_marked(text) for text in texts]

    def encode(self, messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               extra: dict | None = None) -> list[int]:
        """The ids of the chat: ``encode_texts([render(...)])[0]``."""
        return self._encode_marked(self.render(messages, tools=tools, documents=documents,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, extra=extra))

    def _encode_marked(self, text: str) -> list[int]:
        # [text, marked token, text, ...]: None in place of the token for a lone mark (a template split a token)
        pieces = self._markers.split(text)
        ids = self._encode(pieces[0])
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._encode_piece(piece, as_text=i % 2 == 1)
        return ids

    def _encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def _encode_text(self, text: str) -> list[int]:
        """``text`` by the pipeline without added tokens (transformers' _encode_without_added_tokens)."""
        if self._backend.normalizer is not None:
            text = self._backend.normalizer.normalize_str(text)
        splits = [text] if self._backend.pre_tokenizer is None else \
            [split for split, _ in self._backend.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in self._backend.model.tokenize(split)]

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        """A piece from inside the chat, encoded after a newline that is then dropped (so SentencePiece adds no
        prefix space), as transformers' _encode_chat_piece does."""
        encode = self._encode_text if as_text else self._encode
        ids = encode("\n" + piece)
        ids = ids[len(self._newline):] if ids[:len(self._newline)] == self._newline else encode(piece)
        if as_text and self._backend.token_to_id(piece) in ids:
            raise ChatTemplateError(f"the text {piece!r} cannot be kept apart from the control token it spells")
        return ids


def _token_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """Any of ``tokens``, the longest first (a token wins over those it contains); never matches for none."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or "(?!)")


def _mark(value: Any, control: re.Pattern) -> Any:
    """``value`` (JSON data) with each control token in its strings wrapped in MARK_START ... MARK_END (markers
    already there dropped first, so none can be forged). Dict keys too: a tool schema's property names reach the
    prompt through ``tojson`` (transformers leaves keys unmarked, so there a key can forge a turn; the names templates
    look up hold no control token, so they are unchanged)."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return control.sub(f"{MARK_START}\\g<0>{MARK_END}", value)
    if isinstance(value, dict):
        return {_mark(k, control): _mark(v, control) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark(v, control) for v in value]
    return value
