"""A model's input texts checked and encoded: the one rule of every request that encodes text.

An input is first held to the bytes its token limit allows (``Tokenizer.max_token_bytes``), so no text costs more
to encode than one that fits; encoding runs on the model's tokenizer pool, never on the event loop; the ids are
then held to the token limit. How each family encodes its input (:func:`input_ids`):

- causal_lm prompt: ``<s>`` + text (so an empty prompt is valid); seq2seq source: text + ``</s>``
  (``Checkpoint.encode_prompts``, shared with the Hugging Face export);
- classifier: ``[CLS] a [SEP] (b [SEP])`` with segment ids (``Tokenizer.encode_pair``);
- a chat prompt, laid out by the model's chat template: by its PromptEncoder (model.hf.chat_prompt), the template's
  control tokens as their ids, the same text written by a user as text, nothing added (:meth:`InputChecks.encode`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from model.checkpoint import Checkpoint
from model.hf.chat_prompt import PromptEncoder
from model.hf.chat_template import ChatTemplateError
from model.tokenizer import Tokenizer
from service.engine.errors import InvalidRequest, NotReady

TOKENIZER_THREADS = 2  # per model: encoding is bounded per input, so two threads keep requests from queueing
T = TypeVar("T")


def input_ids(checkpoint: Checkpoint, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of ``texts``: as the model reads them as inputs (its special tokens included), or the texts' own
    tokens alone."""
    if not add_special_tokens:
        return checkpoint.prompt_tokenizer.encode_batch(list(texts))
    if checkpoint.family == "classifier":
        return [checkpoint.tokenizer.encode_pair(text)[0] for text in texts]
    return checkpoint.encode_prompts(texts)


class InputChecks:
    """Checks and encodes one model's input texts (``max_input_tokens`` tokens at most), on its tokenizer pool
    (``chat``: the model's chat prompt encoder, where it has a chat template)."""

    def __init__(self, name: str, checkpoint: Checkpoint, max_input_tokens: int, max_inputs: int,
                 chat: PromptEncoder | None = None) -> None:
        self.name = name
        self.checkpoint = checkpoint
        self.chat = chat
        self.max_input_tokens = max_input_tokens
        self.max_inputs = max_inputs
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix=f"tokenize-{name}")

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (encoding) on the tokenizer pool: no input stalls the event loop while it is encoded."""
        try:
            encoding = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except RuntimeError:  # the pool is shut down: the engine has stopped
            raise NotReady(f"model {self.name!r} is not accepting requests (shut down)") from None
        return await encoding

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def input_ids(self, texts: Sequence[str], add_special_tokens: bool = True, field: str = "inputs",
                        chat: bool = False) -> list[list[int]]:
        """The ids of ``texts`` as the model reads them (:meth:`encode`), each text held to the bytes its token
        limit allows before it is encoded and to max_input_tokens after."""
        tokenizer = self.checkpoint.prompt_tokenizer
        texts = [self.size(f"{field}[{i}]", self.text(i, text), tokenizer, self.max_input_tokens)
                 for i, text in enumerate(texts)]
        ids = await self.run(lambda: self.encode(texts, add_special_tokens, chat, field))
        return [self.length(i, one, field) for i, one in enumerate(ids)]

    def encode(self, texts: Sequence[str], add_special_tokens: bool = True, chat: bool = False,
               field: str = "inputs") -> list[list[int]]:
        """The ids of ``texts`` (:func:`input_ids`), or (``chat``) of prompts this model's PromptEncoder rendered:
        the control tokens its template wrote as their ids, those inside what a user wrote as text (blocking: run
        it on the pool)."""
        if not chat:
            return input_ids(self.checkpoint, texts, add_special_tokens)
        if self.chat is None:
            raise InvalidRequest("model", f"model {self.name!r} has no chat template")
        try:
            return self.chat.encode_texts(texts)
        except ChatTemplateError as exc:  # user text that cannot be kept apart from a control token
            raise InvalidRequest(field, str(exc)) from None

    def count(self, inputs: Any) -> None:
        """``inputs`` is a non-empty list of at most max_inputs."""
        if not isinstance(inputs, list | tuple) or not inputs:
            raise InvalidRequest("inputs", "expected a non-empty list")
        if len(inputs) > self.max_inputs:
            raise InvalidRequest("inputs", f"{len(inputs)} inputs exceeds max_inputs={self.max_inputs}")

    @staticmethod
    def text(i: int, text: Any) -> str:
        if not isinstance(text, str):
            raise InvalidRequest(f"inputs[{i}]", f"expected a string, got {type(text).__name__}")
        return text

    @staticmethod
    def size(field: str, text: str, tokenizer: Tokenizer, max_tokens: int, limit: str = "max_input_tokens") -> str:
        """``text`` if its bytes could fit ``max_tokens`` tokens (the setting or field ``limit``), checked before
        it is encoded."""
        size, allowed = len(text.encode("utf-8", "surrogatepass")), max_tokens * tokenizer.max_token_bytes
        if size > allowed:
            raise InvalidRequest(field, f"{size} bytes, over the {allowed} that {max_tokens} tokens ({limit}) "
                                 f"allow: one token of this model covers at most {tokenizer.max_token_bytes} bytes")
        return text

    def length(self, i: int, encoded: Any, field: str = "inputs") -> Any:
        """``encoded`` (ids, or (ids, segments)) if it holds at most max_input_tokens tokens."""
        ids = encoded[0] if isinstance(encoded, tuple) else encoded
        if len(ids) > self.max_input_tokens:
            raise InvalidRequest(f"{field}[{i}]", f"{len(ids)} tokens exceeds max_input_tokens={self.max_input_tokens}")
        return encoded
