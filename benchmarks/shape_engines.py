"""The engines of benchmarks/shape_compare.py on one shape's files: loading, runners, and the output checks.

Ours: ``load_checkpoint`` of the HF directory, ``prepare_for_inference`` as the service loads it (fp32, and each
mode of :data:`OURS_QUANTIZED`, int8 and bf16, on a copy of its own), its generation rules (OPUS-MT's banned pad
id). HF: ``from_pretrained`` of the same directory, ``generate()`` with the directory's generation config.
CTranslate2: ``peers.CT2Process`` over the converted directory (token strings of vocab.json). ONNX Runtime: an
``InferenceSession`` per model and thread count, ``ORT_ENABLE_ALL``, one inter-op thread. Every runner does one
whole cell and returns what it produced per input (tokens per input, or rows per forward) so the caller checks that
no engine stopped early.

The checks run before any timing: greedy tokens against HF's (a divergence only where HF's two candidates are
within :data:`TIE` of each other is a tie), classifier logits against HF's (:data:`LOGITS_RTOL` of their scale).
A fp32 engine that fails goes into ``Engines.excluded`` and is not timed; int8 and bf16 agreement is reported only
(:func:`quantized`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from benchmarks import floor, peers, seq2seq_shapes, shapes
from model.checkpoint import Checkpoint, load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.quantize import QUANTIZED_LAYERS, prepare_for_inference

logger = logging.getLogger("benchmarks.shape_engines")

Runner = Callable[[], list[int]]
TIE = 1e-4  # HF logits closer than this (relative to the step's largest) are a tie, either token is right
LOGITS_RTOL = 1e-3
# Our engines beside fp32 "ours", one per model.quantize mode: "ours int8", "ours bf16" -> the mode of its copy
OURS_QUANTIZED = {f"ours {mode}": mode for mode in QUANTIZED_LAYERS}


def quantized(engine: str) -> bool:
    """Whether ``engine`` (ours or a peer's) computes in a lower precision than fp32: its outputs are reported
    against fp32 HF's, not required to equal them."""
    return engine in OURS_QUANTIZED or "int8" in engine or "Q8" in engine


def floor_seconds(engine: str, floors: Mapping[int, float]) -> float | None:
    """The floor (seconds) ``engine``'s rate is held against, of a cell's floors by weight bytes
    (benchmarks.floor.by_precision): bf16's for bf16 weights, int8's for int8 ones (``Q8_0`` too), fp32's for fp32
    ones; None where that floor was not measured."""
    if "bf16" in engine:
        return floors.get(floor.BF16)
    return floors[floor.INT8 if quantized(engine) else floor.FP32]


@dataclass
class Engines:
    """Every engine of one shape, loaded, and the engines left out (name -> why)."""

    files: shapes.ShapeFiles
    ours: Checkpoint
    ours_quantized: dict[str, Checkpoint]  # OURS_QUANTIZED's engines
    hf: torch.nn.Module
    translators: dict[tuple[str, int], peers.CT2Process] = field(default_factory=dict)
    ort: dict[tuple[str, int], object] = field(default_factory=dict)  # (kind, threads) -> InferenceSession
    excluded: dict[str, str] = field(default_factory=dict)
    forced: int | None = None  # the id of the shape's forced first token (a target language), None without one

    @property
    def family(self) -> str:
        return self.files.shape.family

    @property
    def ours_int8(self) -> Checkpoint:
        return self.ours_quantized["ours int8"]

    @property
    def ours_engines(self) -> dict[str, Checkpoint]:
        """Every engine of ours by name: "ours" (fp32) and each of :data:`OURS_QUANTIZED`."""
        return {"ours": self.ours, **self.ours_quantized}

    @property
    def prefix(self) -> str | None:
        """The forced first token as CTranslate2's ``target_prefix`` spells it."""
        return self.files.shape.forced_first or None

    def close(self) -> None:
        for translator in self.translators.values():
            translator.close()


def random_ids(shape: shapes.Shape, batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids without the special ones: Marian's </s>, <unk> and pad; NLLB's and T5's specials, language codes and
    sentinels; BERT's five specials (then [CLS] and [SEP] around each row); GPT-2's <|endoftext|>."""
    low, high = {"seq2seq": (2, shape.vocab - 1), "classifier": (5, shape.vocab),
                 "causal_lm": (0, shape.vocab - 1)}[shape.family]
    if shape.family == "seq2seq" and shape.architecture != "MarianMTModel":
        low, high = seq2seq_shapes.special_ids(shape.architecture, shape.vocab)
    ids = torch.randint(low, high, (batch, length), generator=torch.Generator().manual_seed(seed))
    if shape.family == "classifier":
        ids[:, 0], ids[:, -1] = shapes.BERT_SPECIALS.index("[CLS]"), shapes.BERT_SPECIALS.index("[SEP]")
    return ids


# ---- loading ------------------------------------------------------------------------------------------------


def load_engines(files: shapes.ShapeFiles, threads: list[int]) -> Engines:
    import transformers

    ours = {engine: load_checkpoint(files.hf, device="cpu") for engine in ("ours", *OURS_QUANTIZED)}
    for engine, checkpoint in ours.items():  # as the service loads a model
        prepare_for_inference(checkpoint.model, OURS_QUANTIZED.get(engine, "none"))
    hf = getattr(transformers, files.shape.architecture).from_pretrained(files.hf).eval()
    engines = Engines(files, ours.pop("ours"), ours, hf, forced=forced_first_id(files))
    if files.shape.family == "seq2seq":
        ct2 = shapes.ct2_directory(files)
        if ct2 is None:
            logger.warning("ctranslate2 is not installed: its engines are skipped")
        else:
            engines.translators = {(kind, n): peers.CT2Process(ct2, kind.replace("fp32", "float32"), n)
                                   for kind in ("fp32", "int8") for n in threads}
    if files.shape.family == "classifier":
        models = shapes.onnx_models(files)
        if models is None:
            logger.warning("onnxruntime (or onnx) is not installed: its engines are skipped")
        else:
            engines.ort = {(kind, n): ort_session(path, n) for kind, path in zip(("fp32", "int8"), models, strict=True)
                           for n in threads}
    return engines


def forced_first_id(files: shapes.ShapeFiles) -> int | None:
    """The id of the shape's forced first token in its tokenizer.json (an added token: a language code)."""
    if not files.shape.forced_first:
        return None
    added = json.loads((files.hf / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    return next(t["id"] for t in added if t["content"] == files.shape.forced_first)


def ort_session(path, threads: int):
    """An ONNX Runtime CPU session: ``threads`` intra-op threads, one inter-op, every graph optimization; its
    pool spins during a run but stops at the end (``session.force_spinning_stop``: the same 19-20 ms BERT
    forward alone, where a pool left spinning held the next engine's core for tens of milliseconds)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# ---- runners: each does one whole cell and returns what it produced per input --------------------------------


def generation_config(checkpoint: Checkpoint, beams: int, new_tokens: int) -> GenerationConfig:
    rules = checkpoint.generation.imposed() if checkpoint.generation else {}
    return GenerationConfig(strategy="beam" if beams > 1 else "greedy", num_beams=max(beams, 1),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            eos_token_id=checkpoint.config.eos_id, **rules)


def ours_tokens(checkpoint: Checkpoint, inputs: torch.Tensor, beams: int, new_tokens: int,
                forced: int | None = None) -> list[list[int]]:
    """Ours' best hypothesis per input (``forced``: every translation's first token, counted among the new ones)."""
    config = generation_config(checkpoint, beams, new_tokens)
    if checkpoint.family != "seq2seq":
        return [h[0].tokens for h in generate_causal(checkpoint.model, inputs.tolist(), config)]
    first = None if forced is None else [forced] * len(inputs)
    return [h[0].tokens for h in generate_seq2seq(checkpoint.model, inputs.tolist(), config, forced_first=first)]


def ours_decode(checkpoint: Checkpoint, inputs: torch.Tensor, beams: int, new_tokens: int,
                forced: int | None = None) -> Runner:
    return lambda: [len(t) for t in ours_tokens(checkpoint, inputs, beams, new_tokens, forced)]


def hf_generate(model: torch.nn.Module, inputs: torch.Tensor, beams: int, new_tokens: int, **extra):
    """HF ``generate()``, no sampling, exactly ``new_tokens`` new tokens; the directory's generation rules."""
    pad = model.generation_config.pad_token_id
    with torch.inference_mode():
        return model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                              num_beams=max(beams, 1), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=model.generation_config.eos_token_id if pad is None else pad, **extra)


def hf_decode(model: torch.nn.Module, inputs: torch.Tensor, beams: int, new_tokens: int,
              forced: int | None = None) -> Runner:
    """HF ``generate()``; ``forced``: its forced_bos_token_id (the first new token)."""
    start = 1 if model.config.is_encoder_decoder else inputs.shape[1]  # the decoder start token, or the prompt
    extra = {} if forced is None else {"forced_bos_token_id": forced}

    def run() -> list[int]:
        out = hf_generate(model, inputs, beams, new_tokens, **extra)
        return [out.shape[1] - start] * out.shape[0]

    return run


def ct2_pieces(files: shapes.ShapeFiles) -> list[str]:
    """The token strings by id that CTranslate2's converter took as its vocabulary: OPUS-MT's vocab.json, else the
    converted model's own list (NLLB's and T5's tokenizers plus the names it gave the rows they leave unnamed)."""
    if (files.hf / "vocab.json").is_file():
        vocab = json.loads((files.hf / "vocab.json").read_text())
        return [piece for piece, _ in sorted(vocab.items(), key=lambda item: item[1])]
    return json.loads((files.ct2 / "shared_vocabulary.json").read_text(encoding="utf-8"))


def ct2_decode(translator: peers.CT2Process, pieces: list[str], inputs: torch.Tensor, beams: int,
               new_tokens: int, prefix: str | None = None) -> Runner:
    sources = [[pieces[i] for i in row] for row in inputs.tolist()]
    return lambda: translator.translate(sources, beams, new_tokens, prefix=prefix)


def rows_of(logits: Callable[..., torch.Tensor], engine: object, ids: torch.Tensor) -> Callable[[], int]:
    """A forward of ``engine`` over ``ids`` that returns the rows classified."""
    return lambda: logits(engine, ids).shape[0]


def repeated(forward: Callable[[], int], times: int) -> Runner:
    return lambda: [forward() for _ in range(times)]


def ours_classify(checkpoint: Checkpoint, ids: torch.Tensor) -> Callable[[], int]:
    def forward() -> int:
        with torch.inference_mode():
            return checkpoint.model(ids).shape[0]

    return forward


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids)).logits


def ort_logits(session, ids: torch.Tensor) -> torch.Tensor:
    feed = {"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy(),
            "token_type_ids": torch.zeros_like(ids).numpy()}
    return torch.from_numpy(session.run(["logits"], feed)[0])


# ---- outputs: the same across engines where they should be ------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def hf_greedy_reference(model: torch.nn.Module, inputs: torch.Tensor, new_tokens: int, forced: int | None = None
                        ) -> tuple[list[list[int]], torch.Tensor]:
    """HF's greedy tokens of each input and the processed logits it chose them from (inputs, steps, vocab)."""
    extra = {} if forced is None else {"forced_bos_token_id": forced}
    out = hf_generate(model, inputs, 1, new_tokens, return_dict_in_generate=True, output_scores=True, **extra)
    start = 1 if model.config.is_encoder_decoder else inputs.shape[1]
    return out.sequences[:, start:].tolist(), torch.stack(out.scores, 1).float()


def divergence(mine: list[int], theirs: list[int], scores: torch.Tensor, tie: float) -> tuple[int, float, bool] | None:
    """Where ``mine`` first parts from HF's ``theirs`` (scores: HF's logits per step), HF's logit for its token over
    this one's there, and whether that gap is a tie (within ``tie`` of the step's largest |logit|); None if equal."""
    t = first_difference(mine, theirs)
    if t is None:
        return None
    gap = (scores[t, theirs[t]] - scores[t, mine[t]]).item() if t < min(len(mine), len(theirs)) else float("inf")
    step = scores[t][scores[t].isfinite()]  # banned tokens are -inf
    return t, gap, gap <= tie * max(1.0, step.abs().max().item())


def check_decoding(engines: Engines, length: int, new_tokens: int) -> list[list[str]]:
    """Greedy tokens of each engine against HF's on three inputs: rows of the outputs table; a fp32 engine that
    disagrees beyond a tie goes into ``engines.excluded``."""
    inputs = random_ids(engines.files.shape, 3, length, seed=1234)
    reference, scores = hf_greedy_reference(engines.hf, inputs, new_tokens, engines.forced)
    candidates = {engine: ours_tokens(checkpoint, inputs, 1, new_tokens, engines.forced)
                  for engine, checkpoint in engines.ours_engines.items()}
    if engines.translators:
        pieces = ct2_pieces(engines.files)
        index = {piece: i for i, piece in enumerate(pieces)}
        sources = [[pieces[i] for i in row] for row in inputs.tolist()]
        some = min(engines.translators)[1]
        for kind in ("fp32", "int8"):
            strings = engines.translators[kind, some].tokens(sources, 1, new_tokens, prefix=engines.prefix)
            candidates[f"CT2 {kind}"] = [[index[s] for s in row] for row in strings]
    rows = []
    for engine, tokens in candidates.items():
        verdicts = []
        for i, (mine, theirs) in enumerate(zip(tokens, reference, strict=True)):
            found = divergence(mine, theirs, scores[i], TIE)
            if found is None:
                continue
            verdicts.append((i, *found))
            if quantized(engine):
                break  # a lower precision is expected to part somewhere: report the first input only
        text, ok = verdict(verdicts, len(reference), new_tokens, quantized(engine))
        if not ok:
            engines.excluded[engine] = text
            logger.error("%s %s: %s", engines.files.shape.name, engine, text)
        rows.append([engine, "greedy tokens vs HF", text])
    return rows


def verdict(verdicts: list[tuple[int, int, float, bool]], inputs: int, steps: int, lower: bool) -> tuple[str, bool]:
    """The outputs table's text for an engine's divergences from HF, and whether it may be timed (``lower``: a
    quantized engine, reported only)."""
    if not verdicts:
        return f"same ({inputs} inputs x {steps} tokens)", True
    i, t, gap, tie = verdicts[0]
    where = f"input {i} step {t} (HF's logit for its token {gap:+.2e} over this one's)"
    if lower:
        return f"parts from fp32 HF at {where} (quantized: reported, not required)", True
    if all(v[3] for v in verdicts):
        return f"same up to a tie at {where}", True
    return f"MISMATCH at {where}: not timed", False


def check_classifier(engines: Engines, threads: int) -> list[list[str]]:
    """Logits of each engine against HF's on four 64-token rows (relative to HF's largest |logit|)."""
    ids = random_ids(engines.files.shape, 4, 64 if engines.files.shape.dims.d_model > 64 else 16, seed=1234)
    reference = hf_logits(engines.hf, ids)
    scale = reference.abs().max().item()
    with torch.inference_mode():
        candidates = {engine: checkpoint.model(ids) for engine, checkpoint in engines.ours_engines.items()}
    for kind in ("fp32", "int8"):
        if (kind, threads) in engines.ort:
            candidates[f"ORT {kind}"] = ort_logits(engines.ort[kind, threads], ids)
    rows = []
    for engine, got in candidates.items():
        error = (got - reference).abs().max().item() / scale
        same_labels = int((got.argmax(-1) == reference.argmax(-1)).sum())
        text = f"max abs difference {error:.1e} of the logits' scale, argmax equal on {same_labels}/{len(ids)}"
        if not quantized(engine) and error > LOGITS_RTOL:
            engines.excluded[engine] = text
            logger.error("%s %s: logits differ from HF's: %s", engines.files.shape.name, engine, text)
            text = f"MISMATCH: {text}: not timed"
        rows.append([engine, "logits vs HF", text + (" (quantized: reported, not required)" * quantized(engine))])
    return rows
