"""Vocabulary maps on the opus-mt shape: `python -m benchmarks.vmap [--threads 1 2] [--repeats 5] [--per-token 24]
[--always 1000] [--quick] [--tiny]`; on a multilingual shape with a map per target language: `python -m
benchmarks.vmap --shape nllb-200-distilled-600m [--always 2500] ...` (see :func:`run_language_shape`).

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

from benchmarks import floor, peers, shapes
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
    if args.shape != "opus-mt":
        return run_language_shape(args)
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


def run_language_shape(args: argparse.Namespace) -> str:
    """A multilingual shape (nllb-200-distilled-600m: 256,206 tokens) translating into its target language with a
    map for that language alone, as a directory's ``vmaps/<code>.txt`` (written into a copy of links, loaded by
    load_checkpoint + checkpoint_vocabulary_map as the service does). The map is synthetic and of a real one's size:
    ``--always`` random ids (specials added) plus ``--per-token`` per source token, a few thousand candidates per
    source (a map built from a corpus keeps a few thousand of a language's tokens). Cells greedy and beam 4 at batch
    1 (batch 16 without ``--quick``), 32-token sources, exactly 64 new tokens, the language token forced first; ours
    fp32 and int8 (``--precision``: one alone holds less memory) with and without the map, timed alternately, each
    with the floor of the cell without a map (benchmarks/shape_compare.py's, at the bandwidth read during the cell).
    No HF or CTranslate2 in this process (NLLB's engines hold 13-17 GB together). Random weights: the map changes
    the outputs, so their overlap with the unrestricted ones is reported, not their quality; each output is checked
    to keep to its candidates."""
    from benchmarks import floor, shape_compare
    from benchmarks.shape_engines import forced_first_id
    from model.checkpoint import checkpoint_vocabulary_map
    from model.vocab_map import language_map_path

    spec = shapes.shape(args.shape, args.tiny)
    files = shapes.build(args.shape, tiny=args.tiny)
    forced, code = forced_first_id(files), spec.forced_first
    length, new_tokens = (TINY_SOURCE_TOKENS, TINY_NEW_TOKENS) if args.tiny else (SOURCE_TOKENS, NEW_TOKENS)
    grid = QUICK if args.quick or args.tiny else GRID
    inputs = {batch: random_ids(spec, batch, length, seed=batch) for _, batch in grid}
    every_source = [s for batch in inputs.values() for s in batch.tolist()]
    work = Path(tempfile.mkdtemp(prefix="bench-vmap-"))
    try:
        for item in files.hf.iterdir():
            (work / item.name).symlink_to(item)
        ours = {kind: load_checkpoint(work, device="cpu") for kind in args.precision}
        for kind, checkpoint in ours.items():
            prepare_for_inference(checkpoint.model, "none" if kind == "fp32" else kind)
        maps_of = next(iter(ours.values()))  # the map is read as the service reads it, from the model's directory
        config, tokenizer = maps_of.config, maps_of.tokenizer
        specials = {i for i in (config.eos_id, config.pad_id, config.bos_id) if i is not None}
        vmap = synthetic_map(spec.vocab, specials, every_source, args.per_token, min(args.always, spec.vocab // 2))
        path = language_map_path(work, code)
        path.parent.mkdir()
        path.write_text(vmap.dump(tokenizer.backend.id_to_token, tokenizer.backend.id_to_token), encoding="utf-8")
        maps = checkpoint_vocabulary_map(maps_of)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rates = shape_compare.measure_rates(spec, args.threads)
    probe = floor.BandwidthProbe(shape_compare.weight_bytes(spec), args.threads)
    cells, rows = [], []
    for beams, batch in grid:
        label = "greedy" if beams == 1 else f"beam {beams}"
        logger.info("vmap %s: %s batch %d (%s)", spec.name, label, batch, load())
        sources = inputs[batch].tolist()
        config, first = generation_config(maps_of, beams, new_tokens), [forced] * batch
        allowed = [maps.candidates_in(s, forced) for s in sources]
        outputs: dict[str, list[list[int]]] = {}

        def runner(engine: str, vocab_map, checkpoint, config=config, first=first, sources=sources,
                   allowed=allowed, outputs=outputs):
            def go() -> list[int]:
                best = [h[0].tokens for h in generate_seq2seq(checkpoint.model, sources, config, vocab_map=vocab_map,
                                                              forced_first=first)]
                if vocab_map is not None and any(not set(t) <= set(a) for t, a in zip(best, allowed, strict=True)):
                    raise RuntimeError("a translation with the map used a token outside its candidates")
                outputs[engine] = best
                return [len(t) for t in best]
            return go

        variants = {}
        for n in args.threads:
            for kind, checkpoint in ours.items():
                name = "ours" if kind == "fp32" else "ours int8"
                variants[f"{name}@{n}"] = (n, runner(name, None, checkpoint))
                variants[f"{name} vmap@{n}"] = (n, runner(f"{name} vmap", maps, checkpoint))
        cell = alternate(Cell(spec.name, label, batch, beams, batch * new_tokens, length=length), variants,
                         new_tokens, args.repeats, args.prune, probe)
        cells.append(cell)
        rows.append((sum(map(len, allowed)) / batch, len(set().union(*allowed)),
                     {kind: overlap(outputs[f"{kind} vmap"], outputs[kind]) for kind in ("ours", "ours int8")
                      if kind in outputs}))
    rates = rates.best_with(shape_compare.measure_rates(spec, args.threads))
    slicing = {kind: head_slicing_ms(checkpoint, allowed) for kind, checkpoint in ours.items()}
    report = language_report(args, spec, cells, rows, shape_compare.floors(cells, spec, rates, new_tokens), code)
    return report + "\n\nSlicing the head to a restriction's rows (its first step, once per restriction: each new " \
        "batch): " + ", ".join(f"{kind} {ms:,.0f} ms" for kind, ms in slicing.items())


def head_slicing_ms(checkpoint: Checkpoint, allowed: list[list[int]]) -> float:
    """Milliseconds a new restriction's first head call takes beyond a later one's: slicing the head's rows (the
    median of 3 restrictions)."""
    import statistics
    import time

    from model.restricted_vocab import VocabularyRestriction

    head, hidden = checkpoint.model.lm_head, torch.randn(len(allowed), checkpoint.config.d_model)
    extra = []
    with torch.inference_mode():
        for _ in range(3):
            restriction = VocabularyRestriction.of_rows(allowed, checkpoint.config.vocab_size, "cpu")
            times = []
            for _ in range(2):
                start = time.perf_counter()
                restriction.logits(head, hidden)
                times.append(time.perf_counter() - start)
            extra.append(times[0] - times[1])
    return 1e3 * statistics.median(extra)


def overlap(mapped: list[list[int]], full: list[list[int]]) -> tuple[float, float]:
    """(share of positions where the two outputs hold the same token, share of the full outputs' distinct tokens
    that the mapped ones hold too), over the rows."""
    same = sum(a == b for m, f in zip(mapped, full, strict=True) for a, b in zip(m, f, strict=False))
    kept = sum(len(set(m) & set(f)) for m, f in zip(mapped, full, strict=True))
    return same / sum(map(len, full)), kept / sum(len(set(f)) for f in full)


def language_report(args: argparse.Namespace, spec: shapes.Shape, cells: list[Cell], rows: list, limits: dict,
                    code: str) -> str:
    from benchmarks import shape_compare

    fp32_bytes = shape_compare.weight_bytes(spec)[0]
    engines = ["ours", "ours vmap", "ours int8", "ours int8 vmap"]
    table = []
    for cell, (mean, union, overlaps) in zip(cells, rows, strict=True):
        fp32, int8 = (limits[cell.family, cell.batch, cell.label][b] for b in (floor.FP32, floor.INT8))
        shares = []
        for engine in engines:
            best = cell.best(engine)
            shares.append(f"{best[0] * (int8 if 'int8' in engine else fp32) / cell.items:.0%}" if best else "-")
        read = cell.read_bandwidth().get(fp32_bytes)
        table.append([f"{cell.label} b{cell.batch}", f"{mean:,.0f} / {union:,}", *[rate(cell, e) for e in engines],
                      *[ratio_text(cell.ratio(f"{e} vmap", e)) for e in ("ours", "ours int8")],
                      *shares, f"{read / 1e9:.1f}" if read else "-",
                      *[f"{overlaps[e][0]:.0%} / {overlaps[e][1]:.0%}" if e in overlaps else "-"
                        for e in ("ours", "ours int8")]])
    headers = ["cell", "candidates per row / batch union", *[f"{e} tok/s" for e in engines], "fp32: vmap / plain",
               "int8: vmap / plain", *[f"{e} % of the no-map floor" for e in engines], "read GB/s",
               "fp32 overlap (positions / tokens)", "int8 overlap"]
    return "\n".join([
        f"Machine: {machine_line()}",
        f"Shape: {spec.name}{' (tiny)' if args.tiny else ''} (random weights, vocabulary {spec.vocab:,}), target "
        f"{code} forced first; map vmaps/{code}.txt: {args.always} tokens always + {args.per_token} per source token "
        f"(synthetic); threads {', '.join(map(str, args.threads))}, medians of {args.repeats}",
        "",
        markdown_table(headers, table),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["opus-mt", "nllb-200-distilled-600m"], default="opus-mt",
                        help="opus-mt (one map, CTranslate2 beside ours) or a multilingual shape (a map per target "
                        "language, ours fp32 and int8 only)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts tried per engine")
    parser.add_argument("--precision", nargs="+", choices=["fp32", "int8"], default=["fp32", "int8"],
                        help="a multilingual shape's engines (one alone holds less memory: NLLB fp32 ~7 GB)")
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
