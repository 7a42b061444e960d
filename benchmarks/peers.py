"""The engines benchmarks/compare.py measures, all on the same weights.

:func:`build` trains an 8000-token byte-level BPE on generated words, makes three random models of the
issue's shape (d_model 512, 6 layers, 8 heads, ffn 2048, vocab 8000) in the configurations the
Hugging Face export expresses exactly (seq2seq ``paper`` -> MarianMTModel, causal_lm ``gpt2`` ->
GPT2LMHeadModel, classifier ``bert`` -> BertForSequenceClassification), saves them as checkpoints,
exports them with training.export and converts the Marian export with CTranslate2's
TransformersConverter. A random model decodes exactly as fast as a trained one once
min_new_tokens = max_new_tokens fixes the lengths.

Each runner returns the number of tokens generated per input (or the rows classified), so the
caller can check that no engine stopped early.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model.causal_lm import CausalLM
from model.checkpoint import save_checkpoint
from model.classifier import TransformerClassifier
from model.config import CausalLMConfig, ClassifierConfig, Seq2SeqConfig
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.layout import use_input_major_weights
from model.quantize import quantize_int8
from model.seq2seq import Seq2SeqTransformer
from model.tokenizer import Tokenizer

logger = logging.getLogger("benchmarks.peers")

SHAPE = dict(vocab_size=8000, d_model=512, n_heads=8, d_ff=2048, dropout=0.0, max_len=512)
LAYERS = 6
PAPER = dict(positions="sinusoidal", norm="post", activation="relu", scale_embeddings=True, tie_embeddings=True)
GPT2 = dict(positions="learned", norm="pre", activation="gelu_tanh", scale_embeddings=False)
BERT = dict(positions="learned", norm="post", activation="gelu", scale_embeddings=False, embedding_norm=True)
LABELS = ["negative", "neutral", "positive"]

Runner = Callable[[], list[int]]


@dataclass
class Models:
    """Our models (fp32 and int8), their HF exports, and the CTranslate2 conversion of the seq2seq one."""

    tokenizer: Tokenizer
    causal: CausalLM
    seq2seq: Seq2SeqTransformer
    classifier: TransformerClassifier
    causal_int8: CausalLM
    seq2seq_int8: Seq2SeqTransformer
    classifier_int8: TransformerClassifier
    hf_causal: nn.Module
    hf_seq2seq: nn.Module
    hf_classifier: nn.Module
    ct2_dir: Path | None  # None when ctranslate2 is not installed
    checkpoints: dict[str, Path]


def synthetic_tokenizer(vocab_size: int = SHAPE["vocab_size"], seed: int = 0) -> Tokenizer:
    """A BPE of exactly ``vocab_size`` tokens, trained on random lowercase words (about 1 s)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(30000)]
    texts = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(20000)]
    tokenizer = Tokenizer.train(texts, vocab_size=vocab_size, min_frequency=1, keep_placeholders=False)
    if tokenizer.vocab_size != vocab_size:
        raise RuntimeError(f"synthetic tokenizer has {tokenizer.vocab_size} tokens, wanted {vocab_size}")
    return tokenizer


def random_models(seed: int = 0) -> tuple[CausalLM, Seq2SeqTransformer, TransformerClassifier]:
    """The three models of the issue's shape, random weights, in eval mode."""
    torch.manual_seed(seed)
    causal = CausalLM(CausalLMConfig(**SHAPE, n_layers=LAYERS, **GPT2)).eval()
    seq2seq = Seq2SeqTransformer(
        Seq2SeqConfig(**SHAPE, n_encoder_layers=LAYERS, n_decoder_layers=LAYERS, max_src_len=256, **PAPER)
    ).eval()
    classifier = TransformerClassifier(
        ClassifierConfig(**SHAPE, n_layers=LAYERS, num_labels=len(LABELS), layer_norm_eps=1e-12, **BERT)
    ).eval()
    return causal, seq2seq, classifier


def build(root: Path, seed: int = 0) -> Models:
    """Make, save, export and convert the three models under ``root``."""
    import transformers

    from training.export import export_hf

    tokenizer = synthetic_tokenizer()
    causal, seq2seq, classifier = random_models(seed)
    checkpoints, exports = {}, {}
    for name, model in (("causal_lm", causal), ("seq2seq", seq2seq), ("classifier", classifier)):
        labels = LABELS if name == "classifier" else None
        checkpoints[name] = save_checkpoint(root / "models" / name, model, tokenizer, labels=labels)
        exports[name] = export_hf(checkpoints[name], root / "hf" / name)
    ct2_dir = None
    try:
        from ctranslate2.converters import TransformersConverter

        ct2_dir = Path(TransformersConverter(str(exports["seq2seq"])).convert(str(root / "ct2" / "seq2seq")))
    except ImportError:
        logger.warning("ctranslate2 is not installed: its cells are skipped")
    causal_int8, seq2seq_int8, classifier_int8 = (_int8(m) for m in (causal, seq2seq, classifier))
    for model in (causal, seq2seq, classifier, causal_int8, seq2seq_int8, classifier_int8):
        use_input_major_weights(model)  # as the service does at load
    return Models(
        tokenizer=tokenizer,
        causal=causal,
        seq2seq=seq2seq,
        classifier=classifier,
        causal_int8=causal_int8,
        seq2seq_int8=seq2seq_int8,
        classifier_int8=classifier_int8,
        hf_causal=transformers.GPT2LMHeadModel.from_pretrained(exports["causal_lm"]).eval(),
        hf_seq2seq=transformers.MarianMTModel.from_pretrained(exports["seq2seq"]).eval(),
        hf_classifier=transformers.BertForSequenceClassification.from_pretrained(exports["classifier"]).eval(),
        ct2_dir=ct2_dir,
        checkpoints=checkpoints,
    )


def _int8(model: nn.Module) -> nn.Module:
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    return quantized


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids avoiding the special ids 0..6."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(7, SHAPE["vocab_size"], (batch, length), generator=g)


def decoding_config(beams: int, new_tokens: int) -> GenerationConfig:
    return GenerationConfig(
        strategy="beam" if beams > 1 else "greedy",
        num_beams=max(beams, 1),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )


# ---- runners: each does one whole cell (prefill/encoding included) ----------------------------------


def ours_causal(model: CausalLM, prompts: torch.Tensor, beams: int, new_tokens: int) -> Runner:
    config, inputs = decoding_config(beams, new_tokens), prompts.tolist()
    return lambda: [len(h[0].tokens) for h in generate_causal(model, inputs, config)]


def ours_seq2seq(model: Seq2SeqTransformer, sources: torch.Tensor, beams: int, new_tokens: int) -> Runner:
    config, inputs = decoding_config(beams, new_tokens), sources.tolist()
    return lambda: [len(h[0].tokens) for h in generate_seq2seq(model, inputs, config)]


def hf_generate(model: nn.Module, inputs: torch.Tensor, beams: int, new_tokens: int, decoder_only: bool) -> Runner:
    """HF ``generate()``: greedy or beam, no sampling, exactly ``new_tokens`` new tokens."""
    kwargs = dict(
        input_ids=inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=False,
        num_beams=max(beams, 1),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    start = inputs.shape[1] if decoder_only else 1  # the prompt, or the decoder start token

    def run() -> list[int]:
        with torch.inference_mode():
            out = model.generate(**kwargs)
        return [out.shape[1] - start] * out.shape[0]

    return run


def ct2_translate(translator: CT2Process, tokenizer: Tokenizer, sources: torch.Tensor, beams: int,
                  new_tokens: int) -> Runner:
    """CTranslate2 ``translate_batch`` on the sources' token strings, exactly ``new_tokens`` tokens."""
    pieces = [[tokenizer.backend.id_to_token(i) for i in row] for row in sources.tolist()]
    return lambda: translator.translate(pieces, beams, new_tokens)


def ours_classify(model: TransformerClassifier, ids: torch.Tensor) -> Runner:
    def run() -> list[int]:
        with torch.inference_mode():
            return [model(ids).shape[0]]

    return run


def hf_classify(model: nn.Module, ids: torch.Tensor) -> Runner:
    mask, segments = torch.ones_like(ids), torch.zeros_like(ids)

    def run() -> list[int]:
        with torch.inference_mode():
            return [model(input_ids=ids, attention_mask=mask, token_type_ids=segments).logits.shape[0]]

    return run


class CT2Process:
    """A CTranslate2 ``Translator`` (or, ``generator``, a decoder-only ``Generator``: the prompt forwarded at once,
    only new tokens returned) in a process of its own, driven over a pipe.

    In the benchmark's process, one ``translate_batch`` of a translator with ``intra_threads=2`` halved
    every PyTorch engine's 2-thread speed for as long as the translator lived (measured: our seq2seq
    greedy b1 at 2 threads 250 -> 125 tokens/s, HF likewise; the two OpenMP runtimes in one process
    contend). In its own process it disturbs no one. The pipe costs well under 1 ms per call.
    """

    def __init__(self, ct2_dir: Path, compute_type: str, threads: int, generator: bool = False) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve_translator, args=(child, str(ct2_dir), compute_type, threads, generator), daemon=True
        )
        self._process.start()
        child.close()
        self._reply()  # "ready", or the child's error

    def _reply(self):
        try:
            reply = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                "CTranslate2 worker exited without answering (its error is on stderr above; a script that "
                "starts one needs an `if __name__ == '__main__':` guard, since the worker is spawned)"
            ) from None
        if isinstance(reply, str) and reply != "ready":
            raise RuntimeError(f"CTranslate2 worker: {reply}")
        return reply

    def translate(self, pieces: list[list[str]], beams: int, new_tokens: int, use_vmap: bool = False,
                  prefix: str | None = None) -> list[int]:
        """Tokens generated per source (``use_vmap``: restricted by the model directory's vmap.txt; ``prefix``: every
        translation's first token, a target language's, as ``target_prefix``: counted among the ``new_tokens``)."""
        self._conn.send((pieces, beams, new_tokens, False, use_vmap, prefix))
        return self._reply()

    def tokens(self, pieces: list[list[str]], beams: int, new_tokens: int, use_vmap: bool = False,
               prefix: str | None = None) -> list[list[str]]:
        """The best hypothesis of each source, as token strings (the prefix included)."""
        self._conn.send((pieces, beams, new_tokens, True, use_vmap, prefix))
        return self._reply()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(10)
        self._conn.close()


def _serve_translator(conn, ct2_dir: str, compute_type: str, threads: int, generator: bool) -> None:
    try:
        import ctranslate2

        translator = (ctranslate2.Generator if generator else ctranslate2.Translator)(
            ct2_dir, device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1
        )
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    while (request := conn.recv()) is not None:
        pieces, beams, new_tokens, want_tokens, use_vmap, prefix = request
        try:
            if generator:
                results = translator.generate_batch(pieces, beam_size=max(beams, 1), max_length=new_tokens,
                                                    min_length=new_tokens, include_prompt_in_result=False)
                best = [r.sequences[0] for r in results]
            else:
                results = translator.translate_batch(
                    pieces, beam_size=max(beams, 1), max_decoding_length=new_tokens, min_decoding_length=new_tokens,
                    use_vmap=use_vmap, target_prefix=[[prefix]] * len(pieces) if prefix else None,
                )
                best = [r.hypotheses[0] for r in results]
            conn.send([b if want_tokens else len(b) for b in best])
        except Exception as exc:
            conn.send(f"{type(exc).__name__}: {exc}")
