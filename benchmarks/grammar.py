"""Grammar libraries for constrained decoding, side by side: `python -m benchmarks.grammar [--vocab 8000 32000]
[--repeats 3]`.

For each vocabulary (a byte-level BPE trained here on Python's standard library source, as ours are) and each
grammar (a JSON schema and a regular expression), every installed library compiles the grammar against the
vocabulary, then walks the same valid output token by token: at each step it computes the set of allowed tokens
(what a decoding step waits for) and consumes the next token of the output. Reported: the compile time and the
mean / p99 time per step's token mask, per library. llguidance is what model/constraints.py uses; outlines-core
is a dev dependency; xgrammar joins when installed by hand (`pip install --no-deps xgrammar==0.2.8
apache-tvm-ffi==0.1.15.post2`: its declared dependencies pull triton).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable

from benchmarks.common import machine_line, markdown_table
from benchmarks.serve_setup import stdlib_texts
from model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "id": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["name", "id", "tags", "active"],
    "additionalProperties": False,
}
SCHEMA_OUTPUT = ('{"name":"tokenizer for the standard library","id":4096,"email":"dev@example.org",'
                 '"tags":["json","regex","bpe","mask"],"active":true}')
REGEX = r"(\d{4}-\d{2}-\d{2}) ([A-Z][a-z]+ ){1,6}#[0-9a-f]{6}"
REGEX_OUTPUT = "2026-11-24 Grammar Libraries Compared Here #0a1b2c"


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each id's bytes (special tokens: their text)."""
    decoder, backend = byte_decoder(), tokenizer._backend
    specials = {t.content for t in backend.get_added_tokens_decoder().values()}
    out = []
    for i in range(tokenizer.vocab_size):
        piece = backend.id_to_token(i)
        out.append(piece.encode() if piece in specials else bytes(decoder[c] for c in piece))
    return out


def walk(compile_fn: Callable[[], object], step_fn: Callable[[object, int], None],
         path: list[int]) -> tuple[float, list[float]]:
    """Compile, then time each step of ``path``: (compile seconds, step seconds)."""
    start = time.perf_counter()
    state = compile_fn()
    compiled = time.perf_counter() - start
    steps = []
    for token in path:
        start = time.perf_counter()
        step_fn(state, token)
        steps.append(time.perf_counter() - start)
    return compiled, steps


def llguidance_walk(tokenizer: Tokenizer, kind: str, path: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import torch

    vocab = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)
    mask = torch.empty((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    def compile_fn():
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})
                   if kind == "json_schema" else llguidance.LLMatcher.grammar_from_regex(REGEX))
        return llguidance.LLMatcher(vocab, grammar, log_level=0)

    def step(matcher, token):
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        matcher.consume_token(token)

    return walk(compile_fn, step, path)


def outlines_walk(tokenizer: Tokenizer, kind: str, path: list[int]) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tokens: dict[bytes, list[int]] = {}
    for i, piece in enumerate(token_bytes(tokenizer)):
        if i != tokenizer.eos_id and piece:
            tokens.setdefault(piece, []).append(i)
    vocabulary = Vocabulary(tokenizer.eos_id, tokens)

    def compile_fn():
        regex = build_regex_from_schema(json.dumps(SCHEMA), r"") if kind == "json_schema" else REGEX
        return Guide(Index(regex, vocabulary))

    def step(guide, token):
        guide.get_tokens()
        guide.advance(token)

    return walk(compile_fn, step, path)


def xgrammar_walk(tokenizer: Tokenizer, kind: str, path: list[int]) -> tuple[float, list[float]]:
    import xgrammar

    info = xgrammar.TokenizerInfo(token_bytes(tokenizer), vocab_type=xgrammar.VocabType.RAW,
                                  stop_token_ids=[tokenizer.eos_id])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile_fn():
        compiled = (compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False) if kind == "json_schema"
                    else compiler.compile_regex(REGEX))
        return xgrammar.GrammarMatcher(compiled)

    def step(matcher, token):
        matcher.fill_next_token_bitmask(bitmask)
        matcher.accept_token(token)

    return walk(compile_fn, step, path)


LIBRARIES = {"llguidance": ("llguidance", llguidance_walk), "outlines-core": ("outlines_core", outlines_walk),
             "xgrammar": ("xgrammar", xgrammar_walk)}


def run(args: argparse.Namespace) -> str:
    rows = []
    texts = stdlib_texts(args.corpus_chars)
    for size in args.vocab:
        tokenizer = Tokenizer.train(texts, vocab_size=size)
        for kind, output in (("json_schema", SCHEMA_OUTPUT), ("regex", REGEX_OUTPUT)):
            path = tokenizer.encode(output)
            for name, (module, fn) in LIBRARIES.items():
                if importlib.util.find_spec(module) is None:
                    rows.append([tokenizer.vocab_size, kind, name, "not installed", "", "", ""])
                    continue
                results = [fn(tokenizer, kind, path) for _ in range(args.repeats)]
                steps = [s for _, run_steps in results for s in run_steps]
                compile_ms = statistics.median(c for c, _ in results) * 1000
                p99 = sorted(steps)[int(0.99 * (len(steps) - 1))]
                rows.append([tokenizer.vocab_size, kind, name, f"{compile_ms:,.1f}", len(path),
                             f"{statistics.mean(steps) * 1e6:,.0f}", f"{p99 * 1e6:,.0f}"])
    table = markdown_table(["vocabulary", "grammar", "library", "compile ms", "steps", "mask + advance us (mean)",
                            "p99 us"], rows)
    return "\n".join([f"Machine: {machine_line()}",
                      f"Byte-level BPE trained on {args.corpus_chars:,} characters of stdlib source; each walk "
                      f"compiles the grammar and masks every step of one valid output; {args.repeats} walks each",
                      "", table])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8000, 32000], help="BPE vocabulary sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--corpus-chars", type=int, default=2_000_000)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    text = run(parse_args(argv))
    print(text)
    return text


if __name__ == "__main__":
    main()
