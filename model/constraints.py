"""Constrained decoding: outputs that match a JSON schema, a regular expression or one of a list of choices.

The grammar library is llguidance (pinned in requirements.txt; docs/benchmarks.md says why): it compiles a
schema, regex or Lark grammar against a tokenizer's vocabulary and, at every step, gives the set of tokens that
keep the output inside the grammar (EOS only once the output is complete). A search's rows each own a matcher;
before a step picks, the logits of every token outside its row's set become -inf, and after it the matcher
consumes the picked token. Beams and samples fork their parent's matcher, so each keeps its own state.

Byte-level BPE tokenizers only (ours and GPT-2's): the library reads their tokenizer.json.

Regular expressions (``regex``, and a schema's ``pattern``) are in the library's dialect, Rust's ``regex``
crate: classes such as ``\\d``, ``\\w`` and ``\\s`` are Unicode-aware (``\\d`` matches every decimal digit,
Arabic-Indic ones included: write ``[0-9]`` for ASCII digits), and a pattern matches the whole output.
Everything the library would only find out while decoding is checked when a constraint is compiled: counted
repetitions that unroll past ``MAX_UNROLLED`` atoms (model.regex_size), and grammars that admit no output at all
(a schema that only refers to itself).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from model.regex_size import unrolled_size
from model.tokenizer import Tokenizer

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or choice list longer than this (as JSON) is refused
MAX_CHOICES = 256
# Counted repetitions unrolled (a{10000} is 10,000): the library expands them while decoding, a{100000} at ~10 ms
# a token and a{1000000} not at all.
MAX_UNROLLED = 10_000
KINDS = ("json_schema", "regex", "choice")


class ConstraintError(ValueError):
    """A constraint that cannot be used: malformed, too large, impossible, or a tokenizer without byte-level BPE."""


@dataclass(frozen=True)
class Constraint:
    """What the output must match: ``kind`` one of KINDS, ``value`` a JSON schema (dict or bool), a regular
    expression, or a list of strings."""

    kind: str
    value: Any

    def grammar(self) -> str:
        """The llguidance grammar (checked for size; validity is checked against a tokenizer by :func:`compile`)."""
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint {self.kind!r}; expected one of {list(KINDS)}")
        size = len(json.dumps(self.value))
        if size > MAX_GRAMMAR_CHARS:
            raise ConstraintError(f"the {self.kind} is {size:,} characters as JSON, over the {MAX_GRAMMAR_CHARS:,} "
                                  "allowed")
        for pattern in self._patterns():
            size = unrolled_size(pattern)
            if size > MAX_UNROLLED:
                raise ConstraintError(f"the regular expression {pattern[:64]!r} unrolls its counted "
                                      f"repetitions ({{n}}, {{n,m}}) to {size:,} characters, over the "
                                      f"{MAX_UNROLLED:,} allowed")
        if self.kind == "json_schema":
            try:  # compact JSON: no free whitespace, so an output ends as soon as its value does
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.value, overrides={"whitespace_flexible": False})
            except ValueError as exc:
                raise ConstraintError(f"json_schema: {exc}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if not self.value or len(self.value) > MAX_CHOICES:
            raise ConstraintError(f"choice needs 1 to {MAX_CHOICES} strings, got {len(self.value)}")
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in self.value))

    def _patterns(self) -> list[str]:
        """The regular expressions of the constraint: a regex, or every ``pattern`` (and ``patternProperties``
        key) in a schema."""
        if self.kind == "regex":
            return [self.value] if isinstance(self.value, str) else []
        found, todo = [], [self.value] if self.kind == "json_schema" else []
        while todo:
            node = todo.pop()
            if isinstance(node, list):
                todo.extend(node)
            elif isinstance(node, dict):
                found += [v for k, v in node.items() if k == "pattern" and isinstance(v, str)]
                patterned = node.get("patternProperties")
                found += list(patterned) if isinstance(patterned, dict) else []
                todo.extend(node.values())
        return found


_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The library's view of ``tokenizer`` (built once per tokenizer)."""
    found = _TOKENIZERS.get(tokenizer)
    if found is None:
        if not getattr(tokenizer, "byte_level", False):  # SentencePiece tokenizers have no such property
            raise ConstraintError("constrained decoding needs a byte-level BPE tokenizer (this model's is not)")
        found = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=tokenizer.vocab_size,
                                       eos_token=tokenizer.eos_id)
        _TOKENIZERS[tokenizer] = found
    return found


def compile(constraint: Constraint, tokenizer: Tokenizer) -> CompiledConstraint:  # noqa: A001 (as re.compile)
    """Check ``constraint`` against ``tokenizer``'s vocabulary; raises ConstraintError with the library's reason."""
    vocabulary = grammar_tokenizer(tokenizer)
    grammar = constraint.grammar()
    error = llguidance.LLMatcher.validate_grammar(grammar, vocabulary)
    if error:
        raise ConstraintError(f"{constraint.kind}: {error.strip().splitlines()[0]}")
    compiled = CompiledConstraint(vocabulary, grammar)
    first = compiled._matcher()
    first.compute_bitmask()  # the first step's mask: a grammar with no finite output fails here, not after a 200
    if first.is_error():
        reason = first.get_error().strip().splitlines()[0]
        raise ConstraintError(f"admits no output ({reason}): e.g. a schema that refers only to itself has no "
                              "finite value")
    return compiled


@dataclass(frozen=True)
class CompiledConstraint:
    """A grammar checked against one tokenizer: makes the matchers of a search's rows."""

    vocabulary: llguidance.LLTokenizer
    grammar: str

    def accepts(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` are a complete output of the grammar (an output cut by a length limit may not be)."""
        matcher = self._matcher()
        return matcher.consume_tokens(list(tokens)) and not matcher.is_error() and matcher.is_accepting()

    def rows(self, count: int) -> RowMatchers:
        return RowMatchers(self, [self._matcher() for _ in range(count)])

    def _matcher(self) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.vocabulary, self.grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(matcher.get_error())
        return matcher


class RowMatchers:
    """One matcher per row of a search, in the search's row order."""

    def __init__(self, compiled: CompiledConstraint, matchers: list[llguidance.LLMatcher]) -> None:
        self.compiled = compiled
        self.matchers = matchers
        self._words = (compiled.vocabulary.vocab_size + 31) // 32  # the library's mask: one bit per token
        self._bits = torch.arange(32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor, held: Sequence[bool] | None = None) -> torch.Tensor:
        """``logits`` (rows, V) with -inf for every token that would leave its row's grammar (a new tensor). Rows
        ``held`` (a translation's forced first token: a target language's, BART's ``<s>``, outside the text the
        grammar reads) keep their logits."""
        bitmask = torch.empty(len(self.matchers), self._words, dtype=torch.int32)
        for row, matcher in enumerate(self.matchers):
            matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), self._words * 4)
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).reshape(len(self.matchers), -1).bool()
        if held is not None:
            allowed[torch.tensor(held, dtype=torch.bool)] = True
        vocab = min(logits.shape[1], allowed.shape[1])
        masked = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
        keep = allowed[:, :vocab].to(logits.device)
        masked[:, :vocab] = logits[:, :vocab].float().masked_fill(~keep, float("-inf"))
        return masked

    def advance(self, tokens: torch.Tensor, parents: torch.Tensor, held: Sequence[bool] | None = None) -> None:
        """Rows continue rows ``parents`` with ``tokens``: each takes its parent's matcher (a copy when a parent
        has several children) and consumes its token, but for children of rows ``held`` (see :meth:`mask`), whose
        token is not text. A row whose token was outside its grammar (beam search's filler of an empty beam, scored
        -inf) keeps a matcher in error, which allows no token: the row stays dead."""
        parents_list = parents.tolist()
        seen: set[int] = set()
        matchers = []
        for parent in parents_list:  # copies before any consumption: siblings start from their parent's state
            matchers.append(self.matchers[parent] if parent not in seen else self.matchers[parent].deep_copy())
            seen.add(parent)
        for matcher, token, parent in zip(matchers, tokens.tolist(), parents_list, strict=True):
            if held is None or not held[parent]:
                matcher.consume_token(token)  # an empty beam's filler leaves its matcher in error: no token allowed
        if matchers and all(m.is_error() for m in matchers):
            reason = matchers[0].get_error().strip().splitlines()[0]
            raise ConstraintError(f"no output can continue within the grammar: {reason}")
        self.matchers = matchers
