"""Incremental detokenization: the text of a growing token sequence, piece by piece, at O(window) per token.

vLLM's scheme (its prefix_offset / read_offset): the tokens before ``read`` are in the text already; each new
token decodes the window ``tokens[start:]`` and ``tokens[start:read]`` (``start``: where the last text emitted
began) and the difference is the new text, emitted once it is complete. A decoder may treat a window's first token
differently from the same token mid-sequence (Metaspace's and Strip's leading space, WordPiece's "##"): that comes
out of both decodes alike, never out of the new text. The context's window starts where its text is not empty (a
special token alone would let the decoder strip the first new token's space).

Held back: text ending in an incomplete UTF-8 character ("\ufffd"), and every token of ``held`` (with a
ByteFallback decoder: the <0xXX> byte pieces, and the special tokens decode skips, across which a run of byte
pieces joins): a run of byte pieces decodes as a whole, one character, or one "\ufffd" per byte if any byte is
wrong, so its text is known only when the run ends; where decoded text is cleaned up (model.hf.cleanup), the tokens
after which it may end in what a later token's clean-up changes (" n" of " n't"). The pieces joined equal
``decode(context + tokens)`` after ``decode(context)``; the caller decodes the finished sequence once to flush what is
still held.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

Decode = Callable[[Sequence[int]], str]
INCOMPLETE = "\ufffd"  # what decoders give for bytes that are not (yet) a whole UTF-8 character


class IncrementalDecoder:
    """The new text of each token pushed, after ``context`` (tokens whose text the caller has already)."""

    def __init__(self, decode: Decode, context: Sequence[int] = (), held: Collection[int] = ()) -> None:
        self._decode = decode
        self._held = held
        self._tokens = [int(t) for t in context]
        self._read = len(self._tokens)
        self._start, self._before = self._window_start()

    def push(self, token: int) -> str:
        """The text ``token`` completes ("" while it is held back)."""
        token = int(token)
        self._tokens.append(token)
        if token in self._held:
            return ""
        text, before = self._decode(self._tokens[self._start:]), self._before
        if len(text) <= len(before) or text.endswith(INCOMPLETE) or not text.startswith(before):
            return ""
        self._start, self._before = self._read, self._decode(self._tokens[self._read:])  # the next window
        self._read = len(self._tokens)
        return text[len(before):]

    def _window_start(self) -> tuple[int, str]:
        """The last start at or before ``read`` whose text up to ``read`` is not empty, and that text."""
        for start in range(self._read - 1, -1, -1):
            if start and self._tokens[start - 1] in self._held:
                continue  # never split a run of byte pieces
            text = self._decode(self._tokens[start:self._read])
            if text:
                return start, text
        return 0, ""
