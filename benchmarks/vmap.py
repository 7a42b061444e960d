"""Vocabulary maps on the opus-mt shape: `python -m benchmarks.vmap [--threads 1 2] [--repeats 5] [--per-token 24]
[--always 1000] [--quick] [--tiny]`.

The lever of issue 19 that CTranslate2 offers as ``use_vmap``: a translation scores only its source's candidate
target tokens (model.vocab_map, model.restricted_vocab) instead of OPUS-MT's 58,101. The shape is
benchmarks/shapes.py's opus-mt (random weights, HF layout); the map is synthetic, of a real one's size: the
``--always`` tokens every source may use (specials included) plus ``--per-token`` candidates per source token
(random ids, seeded by the token), CTranslate2's format for both engines (written next to a link of its converted
model, as its converter's ``--vocab_mapping`` would). Random weights make a map's quality meaningless here; the
default model's BLEU with its own map is `python -m training evaluate --vmap`. Cells: greedy and beam 4 at batch
1 and 16, 32-token sources, exactly 64 new tokens; ours fp32 with and without the map, CTranslate2 fp32 with and
without it (its best thread count), timed alternately (benchmarks/cells.py). Each of ours' outputs with the map
is checked to hold only its source's candidates.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks import peers, shapes
from benchmarks.cells import Cell, alternate, load, rate, ratio_text
from benchmarks.common import machine_line, markdown_table
from benchmarks.shape_engines import ct2_pieces, generation_config, random_ids
from model.checkpoint import Checkpoint, load_checkpoint
from model.generation import generate_seq2seq
from model.quantize import prepare_for_inference
from model.vocab_map import VMAP_FILE, VocabularyMap

logger = logging.getLogger("benchmarks.vmap")

GRID = [(1, 1), (1, 16), (4, 1), (4, 16)]  # (beams, batch)
QUICK = [(1, 1), (4, 1)]
SOURCE_TOKENS, NEW_TOKENS = 32, 64
TINY_SOURCE_TOKENS, TINY_NEW_TOKENS = 8, 4


def synthetic_map(vocab: int, specials: set[int], sources: list[list[int]], per_token: int, always: int
                  ) -> VocabularyMap:
    """``always`` random ids (with ``specials``) for every source, ``per_token`` random ids per source token."""
    everyone = set(random.Random(0).sample(range(vocab), always)) | specials
    entries = {(token,): tuple(sorted(random.Random(token).sample(range(vocab), per_token)))
               for token in {t for source in sources for t in source}}
    return VocabularyMap(frozenset(everyone), entries, copy_source=False)


def ct2_with_map(ct2: Path, vmap_text: str, into: Path) -> Path:
    """A directory with the converted model's files (links) and ``vmap_text`` as its vocabulary map."""
    into.mkdir(parents=True, exist_ok=True)
    for item in ct2.iterdir():
        (into / item.name).symlink_to(item)
    (into / VMAP_FILE).write_text(vmap_text, encoding="utf-8")
    return into


def ours_runner(ours: Checkpoint, inputs: torch.Tensor, beams: int, new_tokens: int, vmap: VocabularyMap | None):
    sources, config = inputs.tolist(), generation_config(ours, beams, new_tokens)

    def run() -> list[int]:
        best = [h[0].tokens for h in generate_seq2seq(ours.model, sources, config, vocab_map=vmap)]
        if vmap is not None and any(not set(t) <= set(vmap.candidates(s)) for t, s in zip(best, sources, strict=True)):
            raise RuntimeError("a translation with the map used a token outside its source's candidates")
        return [len(t) for t in best]

    return run


def ct2_runner(translator: peers.CT2Process, pieces: list[str], inputs: torch.Tensor, beams: int, new_tokens: int,
               use_vmap: bool):
    strings = [[pieces[i] for i in row] for row in inputs.tolist()]
    return lambda: translator.translate(strings, beams, new_tokens, use_vmap)


def run(args: argparse.Namespace) -> str:
    files = shapes.build("opus-mt", tiny=args.tiny)
    ours = load_checkpoint(files.hf, device="cpu")
    prepare_for_inference(ours.model, "none")
    length, new_tokens = (TINY_SOURCE_TOKENS, TINY_NEW_TOKENS) if args.tiny else (SOURCE_TOKENS, NEW_TOKENS)
    grid = QUICK if args.quick or args.tiny else GRID
    config = ours.config
    specials = {i for i in (config.eos_id, config.pad_id, config.bos_id, ours.tokenizer.unk_id) if i is not None}
    inputs = {batch: random_ids(files.shape, batch, length, seed=batch) for _, batch in grid}
    every_source = [s for batch in inputs.values() for s in batch.tolist()]
    vmap = synthetic_map(config.vocab_size, specials, every_source, args.per_token, min(args.always,
                                                                                       config.vocab_size // 2))
    ct2 = shapes.ct2_directory(files)
    pieces = ct2_pieces(files) if ct2 is not None else []
    work = Path(tempfile.mkdtemp(prefix="bench-vmap-"))
    translators: dict[tuple[bool, int], peers.CT2Process] = {}
    cells, candidates = [], []
    try:
        if ct2 is not None:
            mapped = ct2_with_map(ct2, vmap.dump(pieces.__getitem__, pieces.__getitem__), work / "ct2")
            translators = {(True, n): peers.CT2Process(mapped, "float32", n) for n in args.threads}
        for beams, batch in grid:
            label = "greedy" if beams == 1 else f"beam {beams}"
            logger.info("vmap: %s batch %d (%s)", label, batch, load())
            sources = inputs[batch]
            counts = [len(vmap.candidates(s)) for s in sources.tolist()]
            union = len(set().union(*(vmap.candidates(s) for s in sources.tolist())))
            candidates.append((label, batch, sum(counts) / len(counts), union))
            variants = {}
            for n in args.threads:
                variants[f"ours@{n}"] = (n, ours_runner(ours, sources, beams, new_tokens, None))
                variants[f"ours vmap@{n}"] = (n, ours_runner(ours, sources, beams, new_tokens, vmap))
                if (True, n) in translators:
                    for use_vmap in (False, True):
                        variants[f"CT2 fp32{' vmap' if use_vmap else ''}@{n}"] = (
                            1, ct2_runner(translators[True, n], pieces, sources, beams, new_tokens, use_vmap))
            cell = Cell("seq2seq", label, batch, beams, batch * new_tokens, length=length)
            cells.append(alternate(cell, variants, new_tokens, args.repeats, args.prune))
    finally:
        for translator in translators.values():
            translator.close()
        shutil.rmtree(work, ignore_errors=True)
    return report(args, cells, candidates, ct2 is not None, config.vocab_size)


def report(args: argparse.Namespace, cells: list[Cell], candidates: list, with_ct2: bool, vocab: int) -> str:
    engines = ["ours", "ours vmap"] + (["CT2 fp32", "CT2 fp32 vmap"] if with_ct2 else [])
    rows = []
    for cell, (_, _, mean, union) in zip(cells, candidates, strict=True):
        row = [f"{cell.label} b{cell.batch}", f"{mean:,.0f} / {union:,}", *[rate(cell, e) for e in engines],
               ratio_text(cell.ratio("ours vmap", "ours"))]
        if with_ct2:
            pairs = (("CT2 fp32 vmap", "CT2 fp32"), ("ours vmap", "CT2 fp32 vmap"), ("ours vmap", "CT2 fp32"))
            row += [ratio_text(cell.ratio(a, b)) for a, b in pairs]
        rows.append(row)
    headers = ["cell", "candidates per row / batch union", *[f"{e} tok/s" for e in engines], "ours: vmap / plain"]
    if with_ct2:
        headers += ["CT2: vmap / plain", "ours vmap / CT2 vmap", "ours vmap / CT2 plain"]
    return "\n".join([
        f"Machine: {machine_line()}",
        f"Shape: opus-mt (random weights, vocabulary {vocab:,}); map: {args.always} tokens always + {args.per_token} "
        f"per source token (synthetic); threads {', '.join(map(str, args.threads))}, medians of {args.repeats}",
        "",
        markdown_table(headers, rows),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts tried per engine")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    parser.add_argument("--per-token", type=int, default=24, help="map candidates per source token")
    parser.add_argument("--always", type=int, default=1000, help="map tokens every source may use")
    parser.add_argument("--prune", type=float, default=3.0, help="stop timing a thread count this much slower")
    parser.add_argument("--quick", action="store_true", help="batch-1 cells only")
    parser.add_argument("--tiny", action="store_true", help="the toy shape (the test suite's smoke run)")
    args = parser.parse_args(argv)
    if min(args.threads) < 1 or args.repeats < 1 or args.per_token < 1 or args.always < 1:
        parser.error("--threads, --repeats, --per-token and --always must be >= 1")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    text = run(args)
    print(text)
    return text


if __name__ == "__main__":
    main()
