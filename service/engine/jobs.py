"""Jobs: what the event loop hands a model's worker thread, and how results travel back.

A job is created on the event loop (it owns an ``asyncio.Future`` there); the worker thread resolves
it with ``loop.call_soon_threadsafe``. Cancellation goes the other way through a plain flag that the
worker reads before every step. Streaming jobs also own an ``asyncio.Queue`` of StreamEvents.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from model.constraints import CompiledConstraint, RowMatchers
from model.decoding import GenerationConfig
from model.detokenize import IncrementalDecoder
from model.generation import trim_stop
from model.placeholders import Protected
from model.search import Hypothesis
from model.speculative import Drafter, SpeculativeConfig
from service.engine.adapters import AdapterVersion
from service.engine.errors import RequestTimeout
from service.engine.types import (
    DEFAULT_QUEUE,
    Alternative,
    GeneratedSequence,
    GenerationOutput,
    StreamEvent,
    TokenLogprob,
)

# The worker enforces deadlines; the awaiting coroutine gives up this much later if the worker is stuck.
DEADLINE_GRACE_S = 5.0


class Job:
    """One request's unit of work for a worker thread."""

    endpoint = "job"

    def __init__(self, request_id: str, timeout_s: float, adapter: AdapterVersion | None = None) -> None:
        self.id = request_id
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future = self.loop.create_future()
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout_s
        self.timeout_s = timeout_s
        self.adapter = adapter  # pinned version (released by the worker when the job leaves)
        self.admitted_at: float | None = None
        self.finished_at: float | None = None  # when the worker resolved or failed it (tracing.py reads these)
        self.cancelled = False  # written by the event loop, read by the worker
        self.done = False  # written by the worker once the job is resolved or failed
        self.queue = DEFAULT_QUEUE  # its priority and client (set by the worker before it is submitted)

    @property
    def rows(self) -> int:
        """Batch rows (generation) or inputs (classify/embed) this job needs at most."""
        return 1

    @property
    def adapter_name(self) -> str | None:
        return self.adapter.public if self.adapter is not None else None

    def expired(self, now: float) -> bool:
        return now > self.deadline

    def timeout_error(self) -> RequestTimeout:
        return RequestTimeout(f"request {self.id!r} exceeded its deadline of {self.timeout_s:g} s "
                              f"(request_timeout_s); its rows were freed")

    # ---- worker thread -> event loop ----------------------------------------------------------

    def resolve(self, value: Any) -> None:
        self.done = True
        self._post(self._set_result, value)

    def fail(self, exc: BaseException) -> None:
        self.done = True
        self._post(self._set_exception, exc)

    def _post(self, fn: Callable[[Any], None], arg: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting any more
            self.loop.call_soon_threadsafe(fn, arg)

    def _set_result(self, value: Any) -> None:
        if not self.future.done():
            self.future.set_result(value)

    def _set_exception(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    # ---- event loop ---------------------------------------------------------------------------

    async def wait(self) -> Any:
        """The result; cancelling the awaiting coroutine cancels the job (its rows go at the next step)."""
        remaining = self.deadline - time.monotonic() + DEADLINE_GRACE_S
        try:
            return await asyncio.wait_for(asyncio.shield(self.future), max(remaining, 0.0))
        except TimeoutError:
            self.cancel()
            raise self.timeout_error() from None
        except asyncio.CancelledError:
            self.cancel()
            raise

    def cancel(self) -> None:
        self.cancelled = True
        self.future.cancel()


class CallJob(Job):
    """A one-off function run alone on the worker thread (attention maps)."""

    def __init__(self, request_id: str, timeout_s: float, fn: Callable[[], Any], endpoint: str) -> None:
        super().__init__(request_id, timeout_s)
        self.fn = fn
        self.endpoint = endpoint

    @property
    def rows(self) -> int:
        return 0


class PoolingJob(Job):
    """Classification or embedding of several inputs, batched with other jobs' inputs."""

    def __init__(self, request_id: str, timeout_s: float, endpoint: str, inputs: list[tuple[list[int], list[int]]],
                 adapter: AdapterVersion | None = None, pooling: str = "mean", top_k: int | None = None,
                 normalize: bool = False, min_confidence: float = 0.0) -> None:
        super().__init__(request_id, timeout_s, adapter)
        self.endpoint = endpoint  # "classify" | "logits" (the head's, raw) | "tokens" (per token, raw) | "embed"
        self.inputs = inputs  # (ids, segment ids) per input
        self.pooling = pooling
        self.normalize = normalize  # embed: unit-length vectors
        self.top_k = top_k
        self.min_confidence = min_confidence  # classify: a lower top probability answers "unknown"

    @property
    def rows(self) -> int:
        return len(self.inputs)


class GenerationJob(Job):
    """A generation request: one Search over its inputs, owning some rows of the running batch."""

    def __init__(self, request_id: str, timeout_s: float, prompts: list[list[int]], config: GenerationConfig,
                 stops: list[str], adapter: AdapterVersion | None = None, stream: StreamText | None = None,
                 targets: list[list[int]] | None = None, speculative: SpeculativeConfig | None = None,
                 constraint: CompiledConstraint | None = None, protected: list[Protected] | None = None,
                 use_vmap: bool = False, forced: list[int | None] | None = None) -> None:
        super().__init__(request_id, timeout_s, adapter)
        self.endpoint = "stream" if stream is not None else "generate"
        self.prompts = prompts
        self.targets = targets if targets is not None else [[] for _ in prompts]  # seq2seq target prefixes
        self.speculative = speculative  # drafting (one input, one sequence)
        self.drafter: Drafter | None = None  # made with the search, fed every token the search picks
        self.constraint = constraint  # the grammar every output matches
        self.protected = protected  # per input, its placeholders swapped for sentinels (seq2seq): restored in texts
        self.use_vmap = use_vmap  # outputs keep to the model's vocabulary map (seq2seq, model.vocab_map)
        # per input, the token its output is forced to start with (a target language's; service/engine/languages.py)
        self.forced = forced if forced is not None else [None] * len(prompts)
        self.matchers: RowMatchers | None = None  # one per row of the search, made with it
        self.config = config
        self.stops = stops
        self.search = None  # model.decoding.Search, made at admission
        self.stream = stream
        self.events: asyncio.Queue | None = asyncio.Queue() if stream is not None else None
        self.last_token_at: float | None = None
        self.first_token_at: float | None = None
        self.generated_tokens = 0  # over all rows

    @property
    def rows(self) -> int:
        """Most rows the search will ever hold (beams expand after the first step)."""
        return len(self.prompts) * self.config.rows_per_input

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def emit(self, event: StreamEvent | BaseException) -> None:
        """Queue a stream event (or the exception that ends the stream)."""
        if self.events is not None:
            self._post(self.events.put_nowait, event)

    def fail(self, exc: BaseException) -> None:
        if self.events is None:
            super().fail(exc)
        else:  # a stream reports through its queue only (nobody awaits the future)
            self.done = True
            self.emit(exc)


class StreamText:
    """Incremental text of one streamed sequence: never emits what a later token could still change.

    Its tokens' text comes from model.detokenize: each token decodes a short window of recent tokens, never the
    whole sequence, and incomplete characters and byte-fallback runs wait. Held back besides: any suffix that
    could be the start of a stop string; with protected placeholders, the last word and the space before it (a
    placeholder the model invented there is dropped with its space). Everything emitted is a prefix of the final,
    stop-trimmed (and placeholder-restored) text. Cost per token: the window's decode plus the longest stop
    string; with protected placeholders (seq2seq outputs, a sentence long) the text so far, which restore reads
    whole. ``prefix``: the tokens the sequence continues (a target prefix), whose text is not the stream's.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: list[str], protected: Protected | None = None,
                 prefix: Sequence[int] = (), held: Collection[int] = ()) -> None:
        self.decode = continuation(decode, prefix)  # a finished sequence's text (and its tokens', for logprobs)
        self.stops = [s for s in stops if s]
        self.protected = protected  # the input's placeholders: restored as they come, repaired at the end
        self.tokens: list[int] = []
        self._pieces = IncrementalDecoder(decode, prefix, held)
        self._keep = max(map(len, self.stops), default=1) - 1  # emitted characters a stop string may start in
        self._text: list[str] = []  # the whole text, for placeholders only
        self._tail = ""  # the last ``_keep`` characters emitted
        self._pending = ""  # the text after them, not emitted yet
        self._emitted: list[str] = []

    @classmethod
    def of(cls, tokenizer: Any, stops: list[str], protected: Protected | None = None,
           prefix: Sequence[int] = ()) -> StreamText:
        """The stream of ``tokenizer``'s text (a Tokenizer says which tokens wait: OPUS-MT's target side has none)."""
        return cls(tokenizer.decode, stops, protected, prefix, getattr(tokenizer, "held_ids", ()))

    def feed(self, token: int, logprobs: list[TokenLogprob] | None = None) -> StreamEvent:
        self.tokens.append(token)
        piece = self._pieces.push(token)
        return StreamEvent(text=self._advance(piece) if piece else "", token=token, logprobs=logprobs)

    def _advance(self, piece: str) -> str:
        """What can be emitted once ``piece`` joins the text."""
        if self.protected is not None:  # restored up to its last space (a placeholder ends there), which waits too
            self._text.append(piece)
            text = trim_stop("".join(self._text), self.stops)
            safe = text[: _safe_length(text, self.stops)]
            safe = self.protected.restore(safe[: safe.rfind(" ") + 1], repair=False).text.rstrip(" ")
            emitted = "".join(self._emitted)
            delta = safe[len(emitted):] if safe.startswith(emitted) else ""
        else:  # a stop string starts after what was emitted, or in its last _keep characters
            self._pending += piece
            visible = trim_stop(self._tail + self._pending, self.stops)
            delta = visible[len(self._tail): _safe_length(visible, self.stops)]
            self._pending = self._pending[len(delta):]
            self._tail = (self._tail + delta)[-self._keep:] if self._keep else ""
        self._emitted.append(delta)
        return delta

    def finish(self, hyp: Hypothesis) -> StreamEvent:
        text, placeholders_ok = self.final_text(hyp.tokens)
        emitted = "".join(self._emitted)
        delta = text[len(emitted):] if text.startswith(emitted) else ""
        self._emitted.append(delta)
        # A sequence ended by length or stop_fn keeps its last token, which no event carried yet.
        token = hyp.tokens[-1] if len(hyp.tokens) > len(self.tokens) else None
        logprobs = token_logprobs(hyp, self.decode)
        if logprobs is not None:
            logprobs = logprobs[-1:] if token is not None else []
        return StreamEvent(text=delta, token=token, finish_reason=hyp.finish_reason, logprobs=logprobs,
                           placeholders_ok=placeholders_ok)

    def final_text(self, tokens: Sequence[int]) -> tuple[str, bool | None]:
        """The finished sequence's text (placeholders restored and repaired) and whether they needed no repair."""
        return finished_text(self.decode(tokens), self.stops, self.protected)


def finished_text(text: str, stops: list[str], protected: Protected | None) -> tuple[str, bool | None]:
    """A finished sequence's text: cut at its stop string, then its input's placeholders restored and repaired
    (model.placeholders), with whether the model's own text held them all (None where nothing is protected)."""
    text = trim_stop(text, stops)
    if protected is None:
        return text, None
    restored = protected.restore(text)
    return restored.text, restored.ok


def _safe_length(text: str, stops: list[str]) -> int:
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold


def logprob_entries(tokens: Sequence[int], token_lp: Sequence[float], tops: Sequence[list] | None,
                    decode: Callable[[Sequence[int]], str]) -> list[TokenLogprob]:
    """The API's entry per token: its log-prob, and the top (id, log-prob) alternatives when recorded (a token that
    could not be produced, log-prob -inf under a vocabulary map or a constraint, is no alternative)."""
    tops = tops if tops is not None else [None] * len(tokens)
    return [
        TokenLogprob(token=token, text=decode([token]), logprob=logprob,
                     top_logprobs=None if top is None else [Alternative(token=t, text=decode([t]), logprob=lp)
                                                            for t, lp in top if lp > -math.inf])
        for token, logprob, top in zip(tokens, token_lp, tops, strict=True)
    ]


def token_logprobs(hyp: Hypothesis, decode: Callable[[Sequence[int]], str]) -> list[TokenLogprob] | None:
    """The entries of every token of ``hyp`` (None when the search recorded no log-probs)."""
    if hyp.token_logprobs is None:
        return None
    return logprob_entries(hyp.tokens, hyp.token_logprobs, hyp.top_logprobs, decode)


def continuation(decode: Callable[[Sequence[int]], str], prefix: Sequence[int]) -> Callable[[Sequence[int]], str]:
    """``decode`` of tokens that follow ``prefix``: their text after the prefix's (a subword tokenizer's decode of
    them alone could lose the space or bytes they share with it)."""
    if not prefix:
        return decode
    head = decode(prefix)

    def after(tokens: Sequence[int]) -> str:
        text = decode([*prefix, *tokens])
        return text[len(head):] if text.startswith(head) else decode(tokens)

    return after


def generate_outputs(results: list[list[Hypothesis]], decode: Callable[[Sequence[int]], str],
                     stops: list[str], many: bool, targets: list[list[int]] | None = None,
                     protected: list[Protected] | None = None, constraint: CompiledConstraint | None = None,
                     forced: list[int | None] | None = None) -> list[GenerationOutput]:
    """One GenerationOutput per input from a finished search's hypotheses (best first); with ``many`` (several
    sequences asked for) every candidate too, else None (as logprobs and placeholders_ok are unless asked for).
    ``targets``: per input, the target prefix its tokens follow (the text is decoded after it); ``protected``: per
    input, its placeholders (restored in each text); ``constraint``: the grammar, to say whether each output completed
    it; ``forced``: per input, the token its output was forced to start with (not text: the grammar starts after it)."""
    outputs = []
    for i, hyps in enumerate(results):
        text_of = continuation(decode, targets[i]) if targets is not None else decode
        candidates = []
        for h in hyps:
            text, placeholders_ok = finished_text(text_of(h.tokens), stops, protected[i] if protected else None)
            candidates.append(GeneratedSequence(text=text, tokens=list(h.tokens), score=float(h.score),
                                                finish_reason=h.finish_reason, logprobs=token_logprobs(h, decode),
                                                placeholders_ok=placeholders_ok,
                                                constraint_satisfied=satisfied(constraint, h.tokens,
                                                                               forced[i] if forced else None)))
        best = {f.name: getattr(candidates[0], f.name) for f in dataclasses.fields(GeneratedSequence)}
        outputs.append(GenerationOutput(**best, candidates=candidates if many else None))
    return outputs


def satisfied(constraint: CompiledConstraint | None, tokens: Sequence[int], forced: int | None = None) -> bool | None:
    """Whether ``tokens`` complete ``constraint``'s grammar (None without one): false for an output a length limit
    cut, so a client never parses half a JSON by surprise. A ``forced`` first token (a target language's) is not
    text: the grammar reads what follows it."""
    if constraint is None:
        return None
    return constraint.accepts(list(tokens[1:] if forced is not None else tokens))


def final_stream_event(results: list[list[Hypothesis]], stream: StreamText, beam: bool,
                       constraint: CompiledConstraint | None = None, forced: int | None = None) -> StreamEvent:
    """The last event: beam search streams its best sequence whole, as one event at the end."""
    best = results[0][0]
    if beam:
        text, placeholders_ok = stream.final_text(best.tokens)
        event = StreamEvent(text=text, token=None, finish_reason=best.finish_reason,
                            logprobs=token_logprobs(best, stream.decode), placeholders_ok=placeholders_ok)
    else:
        event = stream.finish(best)
    event.constraint_satisfied = satisfied(constraint, best.tokens, forced)
    return event
